// Google Benchmark suite for the CPU backend (latte::exec::cpu), fp32, B = 1, H = 8,
// D = 64, shapes of DESIGN §6 (latte-compare runs the same side by side with peers):
//
//   cpu_latte_forward/{causal,bidirectional}/T:{1K..64K}/L:{16,64,128,256}
//   cpu_latte_forward/causal_vapor/T:{1K..64K}/L:64   VAPOR (rotations not counted as FLOPs)
//   cpu_softmax_forward/{causal,window128}/T:{1K,4K,16K}
//   cpu_softmax_{backward,forward_backward}/{causal,window128}/T:{1K,4K,16K}  (from d_out)
//   cpu_latte_step/context:{1K,16K,256K}          one decode token after `context`
//   cpu_softmax_step/context:{1K,16K}              one KV-cache decode token
//
// items_per_second is tokens/s; "flops" is a rate (FLOP/s), multiply-add = 2:
//   Latte forward 4*T*H*L*D; Latte step 4*H*L*D; softmax causal T*(T+1)*H*(Dk+Dv);
//   softmax window (w=128) 2*H*(Dk+Dv)*sum_t min(t+1, w+1); softmax step 2*C*H*(Dk+Dv);
//   a softmax backward twice its forward (no credit for recomputation).
#include <benchmark/benchmark.h>

#include <latte/attention.hpp>

#include <algorithm>
#include <array>
#include <random>

namespace {

using latte::index_t;
constexpr index_t kHeads = 8, kDim = 64;

template <std::size_t N>
latte::Tensor<float, N> noise(const std::array<index_t, N>& extents, unsigned seed) {
  latte::Tensor<float, N> tensor(extents);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (index_t i = 0; i < tensor.size(); ++i) tensor.data()[i] = normal(rng);
  return tensor;
}

template <class Direction, class Positional = latte::NoPositional>
void cpu_latte_forward(benchmark::State& bench) {
  const index_t T = bench.range(0), L = bench.range(1);
  const auto q = noise<4>({1, T, kHeads, L}, 1), k = noise<4>({1, T, kHeads, L}, 2);
  const auto v = noise<4>({1, T, kHeads, kDim}, 3);
  latte::Tensor<float, 4> out({1, T, kHeads, kDim});
  const latte::LatteAttention<Direction, latte::RunningMax, Positional> attention({kHeads, L, kDim});
  for (auto _ : bench) attention.forward(latte::exec::cpu, q, k, v, out.view());
  bench.SetItemsProcessed(bench.iterations() * T);
  bench.counters["flops"] = benchmark::Counter(4.0 * double(T) * kHeads * double(L) * kDim *
                                                   double(bench.iterations()),
                                               benchmark::Counter::kIsRate);
}

/// Which softmax pass a row times: the forward, the backward (from d_out), or both.
enum class SoftmaxPass { forward, backward, forward_backward };

template <class Window, SoftmaxPass Pass = SoftmaxPass::forward>
void cpu_softmax(benchmark::State& bench) {
  const index_t T = bench.range(0);
  const auto q = noise<4>({1, T, kHeads, kDim}, 1), k = noise<4>({1, T, kHeads, kDim}, 2);
  const auto v = noise<4>({1, T, kHeads, kDim}, 3), d_out = noise<4>({1, T, kHeads, kDim}, 4);
  latte::Tensor<float, 4> out({1, T, kHeads, kDim});
  latte::Tensor<float, 4> d_q(q.extents()), d_k(k.extents()), d_v(v.extents());
  const latte::SoftmaxGradients<float> gradients{d_q.view(), d_k.view(), d_v.view()};
  Window window{};
  double terms = double(T) * double(T + 1) / 2;
  if constexpr (std::is_same_v<Window, latte::SlidingWindow>) {
    window.left = 128;
    terms = 0;
    for (index_t t = 0; t < T; ++t) terms += double(std::min<index_t>(t + 1, 129));
  }
  const latte::SoftmaxAttention<latte::Causal, Window> attention({kHeads, kDim, kDim}, window);
  for (auto _ : bench) {
    if constexpr (Pass != SoftmaxPass::backward)
      attention.forward(latte::exec::cpu, q, k, v, out.view());
    if constexpr (Pass != SoftmaxPass::forward)
      attention.backward(latte::exec::cpu, q, k, v, d_out, gradients);
  }
  bench.SetItemsProcessed(bench.iterations() * T);
  // The backward counts as twice the forward's FLOPs (no credit for recomputation).
  const double passes = Pass == SoftmaxPass::forward ? 1 : Pass == SoftmaxPass::backward ? 2 : 3;
  bench.counters["flops"] =
      benchmark::Counter(passes * 2.0 * terms * kHeads * 2 * kDim * double(bench.iterations()),
                         benchmark::Counter::kIsRate);
}

void cpu_latte_step(benchmark::State& bench) {
  const index_t context = bench.range(0), L = 64;
  const latte::LatteAttention<latte::Causal> attention({kHeads, L, kDim});
  auto state = attention.make_state<float>(1);
  for (index_t done = 0; done < context;) {  // build the context in 16K-token chunks
    const index_t n = std::min<index_t>(16384, context - done);
    const auto q = noise<4>({1, n, kHeads, L}, 4), v = noise<4>({1, n, kHeads, kDim}, 5);
    latte::Tensor<float, 4> out({1, n, kHeads, kDim});
    attention.forward(latte::exec::cpu, q, q, v, out.view(), state);
    done += n;
  }
  const auto q1 = noise<3>({1, kHeads, L}, 6), v1 = noise<3>({1, kHeads, kDim}, 7);
  latte::Tensor<float, 3> out1({1, kHeads, kDim});
  for (auto _ : bench) attention.step(latte::exec::cpu, state, q1, q1, v1, out1.view());
  bench.counters["flops"] = benchmark::Counter(
      4.0 * kHeads * L * kDim * double(bench.iterations()), benchmark::Counter::kIsRate);
  bench.counters["state_bytes"] = double(state.bytes());
}

void cpu_softmax_step(benchmark::State& bench) {
  const index_t context = bench.range(0);
  const latte::SoftmaxAttention<latte::Causal> attention({kHeads, kDim, kDim});
  const index_t spare = 1 << 16;
  auto cache = attention.make_state<float>(1, context + spare);
  const auto kv = noise<2>({context, kDim}, 8);
  for (index_t h = 0; h < kHeads; ++h) {  // write the context straight into the cache
    auto slots = cache.slots(0, h);
    std::copy(kv.data(), kv.data() + kv.size(), slots.keys);
    std::copy(kv.data(), kv.data() + kv.size(), slots.values);
  }
  cache.advance(context);
  const auto q1 = noise<3>({1, kHeads, kDim}, 9);
  latte::Tensor<float, 3> out1({1, kHeads, kDim});
  index_t steps = 0;
  for (auto _ : bench) {
    if (++steps >= spare) bench.SkipWithError("KV cache spare capacity used up");
    attention.step(latte::exec::cpu, cache, q1, q1, q1, out1.view());
  }
  bench.counters["flops"] = benchmark::Counter(
      2.0 * double(context) * kHeads * 2 * kDim * double(bench.iterations()),
      benchmark::Counter::kIsRate);
}

}  // namespace

BENCHMARK(cpu_latte_forward<latte::Causal>)
    ->Name("cpu_latte_forward/causal")
    ->ArgsProduct({{1024, 4096, 16384, 65536}, {16, 64, 128, 256}})
    ->ArgNames({"T", "L"})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(cpu_latte_forward<latte::Causal, latte::VAPOR>)
    ->Name("cpu_latte_forward/causal_vapor")
    ->ArgsProduct({{1024, 4096, 16384, 65536}, {64}})
    ->ArgNames({"T", "L"})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(cpu_latte_forward<latte::Bidirectional>)
    ->Name("cpu_latte_forward/bidirectional")
    ->ArgsProduct({{1024, 4096, 16384, 65536}, {16, 64, 128, 256}})
    ->ArgNames({"T", "L"})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(cpu_softmax<latte::NoWindow, SoftmaxPass::forward>)
    ->Name("cpu_softmax_forward/causal")
    ->ArgName("T")
    ->Arg(1024)->Arg(4096)->Arg(16384)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(cpu_softmax<latte::SlidingWindow, SoftmaxPass::forward>)
    ->Name("cpu_softmax_forward/window128")
    ->ArgName("T")
    ->Arg(1024)->Arg(4096)->Arg(16384)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(cpu_softmax<latte::NoWindow, SoftmaxPass::backward>)
    ->Name("cpu_softmax_backward/causal")
    ->ArgName("T")
    ->Arg(1024)->Arg(4096)->Arg(16384)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(cpu_softmax<latte::SlidingWindow, SoftmaxPass::backward>)
    ->Name("cpu_softmax_backward/window128")
    ->ArgName("T")
    ->Arg(1024)->Arg(4096)->Arg(16384)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(cpu_softmax<latte::NoWindow, SoftmaxPass::forward_backward>)
    ->Name("cpu_softmax_forward_backward/causal")
    ->ArgName("T")
    ->Arg(1024)->Arg(4096)->Arg(16384)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(cpu_softmax<latte::SlidingWindow, SoftmaxPass::forward_backward>)
    ->Name("cpu_softmax_forward_backward/window128")
    ->ArgName("T")
    ->Arg(1024)->Arg(4096)->Arg(16384)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(cpu_latte_step)
    ->ArgName("context")
    ->Arg(1024)->Arg(16384)->Arg(262144)
    ->Unit(benchmark::kMicrosecond);
// Each step appends a token, so the context grows with the iteration count: a
// fixed count keeps the faster of two builds from being timed at longer contexts
// (the context ends at most 5 % past its start at 1K).
BENCHMARK(cpu_softmax_step)
    ->ArgName("context")
    ->Arg(1024)->Arg(16384)
    ->Iterations(50)
    ->Repetitions(5)
    ->ReportAggregatesOnly(true)
    ->Unit(benchmark::kMicrosecond);
