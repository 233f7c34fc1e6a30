// Google Benchmark suite for the reference backend (latte::exec::reference), fp32, B = 1.
//
//   latte_forward/{causal,bidirectional,causal_vapor}/T:{256,1024,4096}   H=8, L=64, Dv=64
//   softmax_forward/causal/T:{256,1024}  (4096: see below)               H=8, Dk=Dv=64
//   latte_step/{causal,causal_vapor}/context:{1K,16K,64K}   one decode token after `context`
//   softmax_step/causal/context:{1K,16K}                   one KV-cache decode token
//
// items_per_second is tokens/s. The counter "flops" is a rate (FLOP/s) from
// this model, counting a multiply and an add as 2 flops and ignoring exp, max
// and the VAPOR rotations (O(Dv) per token, small next to O(L * Dv)):
//   Latte forward (causal or bidirectional): 4 * T * H * L * Dv
//       per token and head, absorbing v_t into the L x Dv latent memory is one
//       multiply-add per memory element (2 * L * Dv) and reading the memory out
//       with p(l|t) is another (2 * L * Dv).
//   Latte decode step: 4 * H * L * Dv per token (the same two passes).
//   Softmax causal forward: 2 * T^2 * H * (Dk + Dv) / 2
//       T^2 / 2 (query, key) pairs, each a Dk dot product (2 * Dk) and a
//       Dv weighted accumulation (2 * Dv).
//   Softmax decode step at context C: 2 * C * H * (Dk + Dv).
// The reference backend is scalar loops; these numbers are the baseline the
// CPU and CUDA backends will be measured against, not a peak.
#include <benchmark/benchmark.h>

#include <latte/attention.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <random>
#include <utility>

namespace {

using latte::index_t;
constexpr index_t kBatch = 1, kHeads = 8, kLatents = 64, kDim = 64;  // B, H, L, Dv (= Dk)

using LatteCausal = latte::LatteAttention<latte::Causal>;
using LatteBidirectional = latte::LatteAttention<latte::Bidirectional>;
using LatteCausalVapor = latte::LatteAttention<latte::Causal, latte::RunningMax, latte::VAPOR>;
using SoftmaxCausal = latte::SoftmaxAttention<latte::Causal>;

template <std::size_t N>
latte::Tensor<float, N> random_tensor(const std::array<index_t, N>& extents, unsigned seed) {
  latte::Tensor<float, N> tensor(extents);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (index_t i = 0; i < tensor.size(); ++i) tensor.data()[i] = normal(rng);
  return tensor;
}

template <class Attn>
Attn make_latte() {
  return Attn({.heads = kHeads, .latents = kLatents, .value_dim = kDim});
}

SoftmaxCausal make_softmax() {
  return SoftmaxCausal({.heads = kHeads, .key_dim = kDim, .value_dim = kDim});
}

// Reports tokens/s and FLOP/s given the tokens and flops of one iteration.
void report(benchmark::State& state, index_t tokens, double flops) {
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(tokens));
  state.counters["flops"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}

// ---- Whole-sequence forward ------------------------------------------------

template <class Attn>
void latte_forward(benchmark::State& state) {
  const index_t T = state.range(0);
  const Attn attn = make_latte<Attn>();
  const auto q = random_tensor<4>({kBatch, T, kHeads, kLatents}, 1);
  const auto k = random_tensor<4>({kBatch, T, kHeads, kLatents}, 2);
  const auto v = random_tensor<4>({kBatch, T, kHeads, kDim}, 3);
  latte::Tensor<float, 4> out({kBatch, T, kHeads, kDim});
  for (auto _ : state) {
    attn.forward(latte::exec::reference, q, k, v, out.view());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  report(state, kBatch * T, 4.0 * double(kBatch * T) * kHeads * kLatents * kDim);
}

void softmax_forward(benchmark::State& state) {
  const index_t T = state.range(0);
  const SoftmaxCausal attn = make_softmax();
  const auto q = random_tensor<4>({kBatch, T, kHeads, kDim}, 1);
  const auto k = random_tensor<4>({kBatch, T, kHeads, kDim}, 2);
  const auto v = random_tensor<4>({kBatch, T, kHeads, kDim}, 3);
  latte::Tensor<float, 4> out({kBatch, T, kHeads, kDim});
  for (auto _ : state) {
    attn.forward(latte::exec::reference, q, k, v, out.view());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  report(state, kBatch * T,
         2.0 * double(T) * double(T) * kBatch * kHeads * (kDim + kDim) / 2.0);
}

// ---- Decode steps after a long context ---------------------------------------

// A Latte state that has absorbed `context` random tokens, built once per
// (type, context) with chunked forwards (linear in the context) and cached,
// so Google Benchmark's repeated calls do not rebuild it.
template <class Attn>
const typename Attn::template State<float>& latte_context(index_t context) {
  static std::map<index_t, typename Attn::template State<float>> cache;
  if (auto found = cache.find(context); found != cache.end()) return found->second;
  const Attn attn = make_latte<Attn>();
  auto state = attn.template make_state<float>(kBatch);
  constexpr index_t kChunk = 4096;
  const auto q = random_tensor<4>({kBatch, kChunk, kHeads, kLatents}, 4);
  const auto k = random_tensor<4>({kBatch, kChunk, kHeads, kLatents}, 5);
  const auto v = random_tensor<4>({kBatch, kChunk, kHeads, kDim}, 6);
  latte::Tensor<float, 4> out({kBatch, kChunk, kHeads, kDim});
  for (index_t done = 0; done < context;) {
    const index_t n = std::min(kChunk, context - done);
    auto first = [n](const auto& t) {  // the first n tokens of a chunk
      return latte::TensorView<const float, 4>(t.data(), {kBatch, n, kHeads, t.extent(3)});
    };
    attn.forward(latte::exec::reference, first(q), first(k), first(v),
                 latte::TensorView<float, 4>(out.data(), {kBatch, n, kHeads, kDim}), state);
    done += n;
  }
  return cache.emplace(context, std::move(state)).first->second;
}

template <class Attn>
void latte_step(benchmark::State& state) {
  const index_t context = state.range(0);
  const Attn attn = make_latte<Attn>();
  auto decode_state = latte_context<Attn>(context);  // a copy: O(H * L * Dv) floats
  const auto q = random_tensor<3>({kBatch, kHeads, kLatents}, 7);
  const auto k = random_tensor<3>({kBatch, kHeads, kLatents}, 8);
  const auto v = random_tensor<3>({kBatch, kHeads, kDim}, 9);
  latte::Tensor<float, 3> out({kBatch, kHeads, kDim});
  // The state has a fixed size, so stepping on does not change the cost.
  for (auto _ : state) {
    attn.step(latte::exec::reference, decode_state, q, k, v, out.view());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.counters["state_bytes"] = static_cast<double>(decode_state.bytes());
  report(state, kBatch, 4.0 * kBatch * kHeads * kLatents * kDim);
}

void softmax_step(benchmark::State& state) {
  const index_t context = state.range(0);
  const SoftmaxCausal attn = make_softmax();
  // Filling a KV cache by stepping costs O(context^2); instead write `context`
  // random keys and values straight into the cache slots and advance it.
  // `slack` extra slots let the timed loop append tokens; when they run out the
  // cache is reset (outside the timing), so the context stays within 1/16 of `context`.
  const index_t slack = std::max<index_t>(context / 16, 1);
  auto filled = attn.make_state<float>(kBatch, context + slack);
  {
    std::mt19937 rng(10);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (index_t b = 0; b < kBatch; ++b)
      for (index_t h = 0; h < kHeads; ++h) {
        const auto slots = filled.slots(b, h);
        for (index_t i = 0; i < context * kDim; ++i) {
          slots.keys[i] = normal(rng);
          slots.values[i] = normal(rng);
        }
      }
    filled.advance(context);
  }
  auto cache = filled;
  const auto q = random_tensor<3>({kBatch, kHeads, kDim}, 11);
  const auto k = random_tensor<3>({kBatch, kHeads, kDim}, 12);
  const auto v = random_tensor<3>({kBatch, kHeads, kDim}, 13);
  latte::Tensor<float, 3> out({kBatch, kHeads, kDim});
  for (auto _ : state) {
    if (cache.position() == cache.capacity()) {
      state.PauseTiming();
      cache = filled;
      state.ResumeTiming();
    }
    attn.step(latte::exec::reference, cache, q, k, v, out.view());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.counters["state_bytes"] = static_cast<double>(cache.bytes());
  report(state, kBatch, 2.0 * double(context) * kBatch * kHeads * (kDim + kDim));
}

}  // namespace

// ---- Registration --------------------------------------------------------------

BENCHMARK_TEMPLATE(latte_forward, LatteCausal)
    ->Name("latte_forward/causal")
    ->ArgName("T")
    ->Arg(256)->Arg(1024)->Arg(4096)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(latte_forward, LatteBidirectional)
    ->Name("latte_forward/bidirectional")
    ->ArgName("T")
    ->Arg(256)->Arg(1024)->Arg(4096)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(latte_forward, LatteCausalVapor)
    ->Name("latte_forward/causal_vapor")
    ->ArgName("T")
    ->Arg(256)->Arg(1024)->Arg(4096)
    ->Unit(benchmark::kMillisecond);
// Softmax forward stops at T = 1024: the reference kernel takes ~6 s per
// iteration at T = 4096 (16x the T = 1024 time). Add ->Arg(4096) to measure it.
BENCHMARK(softmax_forward)
    ->Name("softmax_forward/causal")
    ->ArgName("T")
    ->Arg(256)->Arg(1024)
    ->Unit(benchmark::kMillisecond);

BENCHMARK_TEMPLATE(latte_step, LatteCausal)
    ->Name("latte_step/causal")
    ->ArgName("context")
    ->Arg(1 << 10)->Arg(16 << 10)->Arg(64 << 10)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_TEMPLATE(latte_step, LatteCausalVapor)
    ->Name("latte_step/causal_vapor")
    ->ArgName("context")
    ->Arg(1 << 10)->Arg(16 << 10)->Arg(64 << 10)
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(softmax_step)
    ->Name("softmax_step/causal")
    ->ArgName("context")
    ->Arg(1 << 10)->Arg(16 << 10)
    ->Unit(benchmark::kMicrosecond);

