// Google Benchmark suite for Lavo (paper 002), fp32, B = 1, H = 8, d = 64, r = 64 bases,
// window w = 64 (the paper's LM setting: num_bases 64; w = 64 extrapolated best in
// its Fig. 4), on the reference backend and (rows prefixed cpu_) on exec::cpu:
//
//   lavo_forward/{causal,bidirectional}/T:{256,1K,4K,16K}       reference
//   cpu_lavo_forward/{causal,bidirectional}/T:{1K,4K,16K}       exec::cpu (DESIGN §6 shapes)
//   lavo_cross_forward/Tq=Ts:{256,1024}, cpu_lavo_cross_forward/Tq=Ts:{1K,4K,16K}   §3.4
//   lavo_step/causal/context:{1K,64K,1M}, cpu_lavo_step/causal/context:{1K,64K,1M}
//
// The reference rows at 4K and 16K take ~1-4 s each (one iteration); they are
// there so that the cpu / reference ratio is read off the same run.
// T = 256 and 1024 are those of softmax_forward/causal in bench_reference.cpp (same
// binary), so the ratio to exact softmax attention is read off the same run.
// items_per_second is tokens/s (queries for cross). The counter "flops" is a rate
// (FLOP/s) from this model, a multiply and an add counting 2, exp and max ignored,
// per token and head:
//   local part (§3.2): 4 * |W(t)| * d, |W(t)| the keys it sees: min(t + 1, w) causal,
//       min(T - 1, t + w - 1) - max(0, t - w + 1) + 1 bidirectional (a dot product
//       and a weighted accumulation of d each per key)
//   compression (eq. 3): 2 * r * d (B f_t)
//   memory read (eq. 6): 4 * r * d (B q_t, then sum_i p_i H_i b_i)
//   cross: 2 * r * d per source token, 4 * r * d per query.
// The decode state is O(w * d + r) per head (state_bytes), whatever the context:
// lavo_step fills a fresh state with random numbers and moves its position to
// `context` instead of absorbing `context` tokens (the step's cost does not depend
// on the values), so a 1M-token context costs nothing to set up.
// Each benchmark runs for at least 0.1 s (MinTime), keeping the suite at ~2 s of CPU.
#include <benchmark/benchmark.h>

#include <latte/attention.hpp>
#include <latte/mechanisms/lavo.hpp>

#include "flop_models.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <random>

namespace {

using latte::index_t;
constexpr index_t kBatch = 1, kHeads = 8, kDim = 64, kBases = 64, kWindow = 64;

template <std::size_t N>
latte::Tensor<float, N> random_tensor(const std::array<index_t, N>& extents, unsigned seed) {
  latte::Tensor<float, N> tensor(extents);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (index_t i = 0; i < tensor.size(); ++i) tensor.data()[i] = normal(rng);
  return tensor;
}

template <class Dir>
latte::Lavo<Dir> make_lavo() {
  return latte::Lavo<Dir>({.heads = kHeads, .dim = kDim, .bases = kBases, .window = kWindow},
                          {.basis_seed = 1});
}

void report(benchmark::State& state, index_t tokens, double flops) {
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(tokens));
  state.counters["flops"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}

template <class Dir, class E = latte::exec::reference_t>
void lavo_forward(benchmark::State& state) {
  const index_t T = state.range(0);
  const auto attention = make_lavo<Dir>();
  const auto q = random_tensor<4>({kBatch, T, kHeads, kDim}, 1);
  const auto k = random_tensor<4>({kBatch, T, kHeads, kDim}, 2);
  const auto v = random_tensor<4>({kBatch, T, kHeads, kDim}, 3);
  latte::Tensor<float, 4> out({kBatch, T, kHeads, kDim});
  for (auto _ : state) {
    attention.forward(E{}, q, k, v, out.view());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  report(state, kBatch * T,
         latte::bench::lavo_forward_flops(T, kDim, kBases, kWindow, Dir::is_causal) * kBatch *
             kHeads);
}

template <class E = latte::exec::reference_t>
void lavo_cross_forward(benchmark::State& state) {
  const index_t T = state.range(0);
  const auto attention = make_lavo<latte::Bidirectional>();
  const auto q = random_tensor<4>({kBatch, T, kHeads, kDim}, 4);
  const auto source = random_tensor<4>({kBatch, T, kHeads, kDim}, 5);
  latte::Tensor<float, 4> out({kBatch, T, kHeads, kDim});
  for (auto _ : state) {
    attention.cross_forward(E{}, q, source, out.view());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  report(state, kBatch * T, 6.0 * double(T) * kBases * kDim * kBatch * kHeads);
}

template <class E = latte::exec::reference_t>
void lavo_step(benchmark::State& state) {
  const index_t context = state.range(0);
  const auto attention = make_lavo<latte::Causal>();
  auto decode_state = attention.make_state<float>(kBatch);
  {
    std::mt19937 rng(6);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (std::size_t field = 0; field < 4; ++field) {  // ring keys, values, window and memory sums
      const std::size_t count = field < 2 ? std::size_t(kBatch * kHeads * kWindow * kDim)
                                          : std::size_t(kBatch * kHeads * kBases);
      float* data = decode_state.field(field);
      for (std::size_t i = 0; i < count; ++i)
        data[i] = field == 3 ? float(context) * normal(rng) : normal(rng);
    }
    decode_state.advance(context);
  }
  const auto q = random_tensor<3>({kBatch, kHeads, kDim}, 7);
  const auto k = random_tensor<3>({kBatch, kHeads, kDim}, 8);
  const auto v = random_tensor<3>({kBatch, kHeads, kDim}, 9);
  latte::Tensor<float, 3> out({kBatch, kHeads, kDim});
  for (auto _ : state) {
    attention.step(E{}, decode_state, q, k, v, out.view());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.counters["state_bytes"] = static_cast<double>(decode_state.bytes());
  report(state, kBatch, (4.0 * kWindow * kDim + 6.0 * kBases * kDim) * kBatch * kHeads);
}

}  // namespace

BENCHMARK_TEMPLATE(lavo_forward, latte::Causal)
    ->Name("lavo_forward/causal")
    ->ArgName("T")
    ->Arg(256)->Arg(1024)->Arg(4096)->Arg(16384)
    ->MinTime(0.1)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(lavo_forward, latte::Bidirectional)
    ->Name("lavo_forward/bidirectional")
    ->ArgName("T")
    ->Arg(256)->Arg(1024)->Arg(4096)->Arg(16384)
    ->MinTime(0.1)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(lavo_cross_forward)
    ->Name("lavo_cross_forward")
    ->ArgName("Tq=Ts")
    ->Arg(256)->Arg(1024)->Arg(4096)->Arg(16384)
    ->MinTime(0.1)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(lavo_step)
    ->Name("lavo_step/causal")
    ->ArgName("context")
    ->Arg(1 << 10)->Arg(64 << 10)->Arg(1 << 20)
    ->MinTime(0.1)
    ->Unit(benchmark::kMicrosecond);

BENCHMARK_TEMPLATE(lavo_forward, latte::Causal, latte::exec::cpu_t)
    ->Name("cpu_lavo_forward/causal")
    ->ArgName("T")
    ->Arg(1024)->Arg(4096)->Arg(16384)
    ->MinTime(0.1)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(lavo_forward, latte::Bidirectional, latte::exec::cpu_t)
    ->Name("cpu_lavo_forward/bidirectional")
    ->ArgName("T")
    ->Arg(1024)->Arg(4096)->Arg(16384)
    ->MinTime(0.1)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(lavo_cross_forward, latte::exec::cpu_t)
    ->Name("cpu_lavo_cross_forward")
    ->ArgName("Tq=Ts")
    ->Arg(1024)->Arg(4096)->Arg(16384)
    ->MinTime(0.1)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(lavo_step, latte::exec::cpu_t)
    ->Name("cpu_lavo_step/causal")
    ->ArgName("context")
    ->Arg(1 << 10)->Arg(64 << 10)->Arg(1 << 20)
    ->MinTime(0.1)
    ->Unit(benchmark::kMicrosecond);
