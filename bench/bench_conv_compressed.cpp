// Google Benchmark suite for ConvCompressedAttention (paper 003), fp32, B = 1, H = 8,
// Dk = Dv = 64, group size (= window) M = 64, on the reference backend and (rows
// prefixed cpu_) on exec::cpu:
//
//   conv_compressed_forward/{causal,bidirectional}_levels{1,2}/T:{256,1024}
//   conv_compressed_forward/causal_levels1/T:{4K,16K}          (ratio rows; 16K takes seconds)
//   cpu_conv_compressed_forward/{causal,bidirectional}_levels{1,2}/T:{1K,4K,16K}
//   conv_compressed_step/causal_levels{1,2}/context:{1K,16K,64K}   one decode token
//   cpu_conv_compressed_step/causal_levels{1,2}/context:{1K,16K,64K}
//
// The T values match softmax_forward/causal in bench_reference.cpp (same binary), so
// the ratio to exact softmax attention is read off the same run.
// items_per_second is tokens/s. The counter "flops" is a rate (FLOP/s) from this
// model, a multiply and an add counting 2, exp and max ignored, per head:
//   window (every level l, n_l tokens): 2 * |W(j)| * (Dk + Dv) per token j, |W(j)| the
//       keys in its window (min(j, left) + 1 causal; + min(n_l - 1 - j, right) bidirectional)
//   convolution (level l): 2 * Dv^2 per token of level l - 1 (each passes through one tap)
//   level projections (1 <= l < L): 2 * Dv * (2 Dk + Dv) per token of level l
//   cross: 2 * Dk * Dv per query (Wq_x), 2 * Dv * (Dk + Dv) per top-level token (Wk_x, Wv_x),
//       2 * |V(t)| * (Dk + Dv) per query, |V(t)| = floor(t / M^L) causal, n_L bidirectional
//   decode step at context C: the same terms for the one new token, with |W| = min(C, left) + 1
//       and |V| = floor(C / M^L); the window/projection work of higher levels (at most
//       once per M tokens) is left out.
// The state_bytes counter is the decode state (window rings, group sums and the
// compressed store, allocated for the context).
#include <benchmark/benchmark.h>

#include <latte/attention.hpp>
#include <latte/mechanisms/conv_compressed_attention.hpp>

#include "conv_compressed_weights.hpp"
#include "flop_models.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <random>

namespace {

using latte::index_t;
constexpr index_t kBatch = 1, kHeads = 8, kDim = 64, kGroup = 64;

template <std::size_t N>
latte::Tensor<float, N> random_tensor(const std::array<index_t, N>& extents, unsigned seed,
                                      float stddev = 1.0f) {
  latte::Tensor<float, N> tensor(extents);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, stddev);
  for (index_t i = 0; i < tensor.size(); ++i) tensor.data()[i] = normal(rng);
  return tensor;
}

latte::ConvCompressedDims dims_for(index_t levels) {
  return {.heads = kHeads, .key_dim = kDim, .value_dim = kDim, .group_size = kGroup,
          .levels = levels};
}

/// One attention per (direction, levels), built once: its random weights take
/// longer to draw than a benchmark iteration.
template <class Dir, index_t Levels>
const latte::ConvCompressedAttention<Dir>& attention() {
  static const latte::ConvCompressedAttention<Dir> attn(dims_for(Levels),
                                                        latte::bench::random_conv_compressed_params(dims_for(Levels)));
  return attn;
}

void report(benchmark::State& state, index_t tokens, double flops) {
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(tokens));
  state.counters["flops"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}

template <class Dir, index_t Levels, class E = latte::exec::reference_t>
void conv_compressed_forward(benchmark::State& state) {
  const index_t T = state.range(0);
  const auto& attn = attention<Dir, Levels>();
  const auto q = random_tensor<4>({kBatch, T, kHeads, kDim}, 1);
  const auto k = random_tensor<4>({kBatch, T, kHeads, kDim}, 2);
  const auto v = random_tensor<4>({kBatch, T, kHeads, kDim}, 3);
  latte::Tensor<float, 4> out({kBatch, T, kHeads, kDim});
  for (auto _ : state) {
    attn.forward(E{}, q, k, v, out.view());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  report(state, kBatch * T, kBatch * kHeads * latte::bench::conv_compressed_forward_flops(
                                         T, Levels, kGroup, kDim, kDim, Dir::is_causal));
}

/// One decode step after `context` tokens. Absorbing a long context by stepping
/// costs O(context^2 / M^L); instead the state's rings, group sums and compressed
/// store are filled with random numbers and its position set to `context` (the step
/// reads them exactly as it would read absorbed tokens). `slack` extra tokens of
/// capacity let the timed loop step on; when they run out the state is reset
/// outside the timing.
template <index_t Levels, class E = latte::exec::reference_t>
void conv_compressed_step(benchmark::State& state) {
  const index_t context = state.range(0);
  const auto& attn = attention<latte::Causal, Levels>();
  const index_t slack = std::max<index_t>(context / 16, 1);
  auto filled = attn.template make_state<float>(kBatch, context + slack);
  {
    std::mt19937 rng(10);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const auto& shape = filled.shape();
    const index_t ring = shape.levels * shape.ring(), stored = shape.compressed_capacity();
    for (index_t b = 0; b < kBatch; ++b)
      for (index_t h = 0; h < kHeads; ++h) {
        const auto carry = filled.carry(b, h);
        for (index_t i = 0; i < ring * kDim; ++i) {
          carry.window_keys[i] = normal(rng);
          carry.window_values[i] = normal(rng);
        }
        for (index_t i = 0; i < shape.levels * kDim; ++i) carry.group_sums[i] = normal(rng);
        for (index_t i = 0; i < stored * kDim; ++i) {
          carry.compressed_keys[i] = normal(rng);
          carry.compressed_values[i] = normal(rng);
        }
      }
    filled.advance(context);
  }
  auto decode_state = filled;
  const auto q = random_tensor<3>({kBatch, kHeads, kDim}, 11);
  const auto k = random_tensor<3>({kBatch, kHeads, kDim}, 12);
  const auto v = random_tensor<3>({kBatch, kHeads, kDim}, 13);
  latte::Tensor<float, 3> out({kBatch, kHeads, kDim});
  for (auto _ : state) {
    if (decode_state.position() == decode_state.context_capacity()) {
      state.PauseTiming();
      decode_state = filled;
      state.ResumeTiming();
    }
    attn.step(E{}, decode_state, q, k, v, out.view());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  std::int64_t span = 1;
  for (index_t level = 0; level < Levels; ++level) span *= kGroup;
  const double Dk = kDim, Dv = kDim;
  const double per_head = 2.0 * double(std::min<index_t>(context, kGroup - 1) + 1) * (Dk + Dv) +
                          2.0 * Dv * Dv + 2.0 * Dk * Dv +
                          2.0 * double(context / span) * (Dk + Dv);
  state.counters["state_bytes"] = static_cast<double>(decode_state.bytes());
  report(state, kBatch, kBatch * kHeads * per_head);
}

}  // namespace

BENCHMARK_TEMPLATE(conv_compressed_forward, latte::Causal, 1)
    ->Name("conv_compressed_forward/causal_levels1")
    ->ArgName("T")->Arg(256)->Arg(1024)->Arg(4096)->Arg(16384)
    ->MinTime(0.1)->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(conv_compressed_forward, latte::Causal, 2)
    ->Name("conv_compressed_forward/causal_levels2")
    ->ArgName("T")->Arg(256)->Arg(1024)
    ->MinTime(0.1)->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(conv_compressed_forward, latte::Bidirectional, 1)
    ->Name("conv_compressed_forward/bidirectional_levels1")
    ->ArgName("T")->Arg(256)->Arg(1024)
    ->MinTime(0.1)->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(conv_compressed_forward, latte::Bidirectional, 2)
    ->Name("conv_compressed_forward/bidirectional_levels2")
    ->ArgName("T")->Arg(256)->Arg(1024)
    ->MinTime(0.1)->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(conv_compressed_step, 1)
    ->Name("conv_compressed_step/causal_levels1")
    ->ArgName("context")->Arg(1 << 10)->Arg(16 << 10)->Arg(64 << 10)
    ->MinTime(0.1)->Unit(benchmark::kMicrosecond);
BENCHMARK_TEMPLATE(conv_compressed_step, 2)
    ->Name("conv_compressed_step/causal_levels2")
    ->ArgName("context")->Arg(1 << 10)->Arg(16 << 10)->Arg(64 << 10)
    ->MinTime(0.1)->Unit(benchmark::kMicrosecond);

using cpu_t = latte::exec::cpu_t;
BENCHMARK_TEMPLATE(conv_compressed_forward, latte::Causal, 1, cpu_t)
    ->Name("cpu_conv_compressed_forward/causal_levels1")
    ->ArgName("T")->Arg(1024)->Arg(4096)->Arg(16384)
    ->MinTime(0.1)->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(conv_compressed_forward, latte::Causal, 2, cpu_t)
    ->Name("cpu_conv_compressed_forward/causal_levels2")
    ->ArgName("T")->Arg(1024)->Arg(4096)->Arg(16384)
    ->MinTime(0.1)->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(conv_compressed_forward, latte::Bidirectional, 1, cpu_t)
    ->Name("cpu_conv_compressed_forward/bidirectional_levels1")
    ->ArgName("T")->Arg(1024)->Arg(4096)->Arg(16384)
    ->MinTime(0.1)->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(conv_compressed_forward, latte::Bidirectional, 2, cpu_t)
    ->Name("cpu_conv_compressed_forward/bidirectional_levels2")
    ->ArgName("T")->Arg(1024)->Arg(4096)->Arg(16384)
    ->MinTime(0.1)->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(conv_compressed_step, 1, cpu_t)
    ->Name("cpu_conv_compressed_step/causal_levels1")
    ->ArgName("context")->Arg(1 << 10)->Arg(16 << 10)->Arg(64 << 10)
    ->MinTime(0.1)->Unit(benchmark::kMicrosecond);
BENCHMARK_TEMPLATE(conv_compressed_step, 2, cpu_t)
    ->Name("cpu_conv_compressed_step/causal_levels2")
    ->ArgName("context")->Arg(1 << 10)->Arg(16 << 10)->Arg(64 << 10)
    ->MinTime(0.1)->Unit(benchmark::kMicrosecond);
