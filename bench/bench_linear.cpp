// Google Benchmark suite for the linear-attention family, exec::cpu against
// exec::reference in the same run, fp32, B = 1, H = 8, Dk = Dv = 64 (DESIGN §6).
//
//   linear_forward/{causal_elu,causal_relu,bidirectional_relu,causal_cosformer,
//                   causal_leapformer,causal_rope}/{cpu,reference}/T:...
//       cpu at T = 1K .. 64K, reference at T = 1K, 4K (its time is linear in T)
//   linear_forward/causal_elu/{cpu_chunked,cpu_one_head}/T:...
//       the chunked GEMM form of DESIGN §5 (measured against the scan that
//       exec::cpu runs), and B = H = 1 (the time split over threads)
//   linear_step/{causal_relu,causal_cosformer,causal_leapformer,causal_rope}/{cpu,reference}/context:{1K,1M}
//
// Times are wall-clock (UseRealTime: the cpu kernels run on every thread).
// items_per_second is tokens/s. The counter "flops" is a rate (FLOP/s) from this
// model, counting a multiply and an add as 2 flops, per token and head, with
// E = streams * F expanded features (F = Dk = 64; streams = 2 with cosFormer / LeaP):
//   absorb k_t, v_t into S (E x Dv) and z (E):       2 * E * Dv + E
//   read q_t: S^T e(q) and e'(q) . z:                 2 * E * Dv + 2 * E
//   LeaP modules on phi(q_t) and phi(k_t):            2 * 2 * F * (F / 4)
// ignoring the feature map, sin/cos and the RoPE rotations (O(F) per token).
// A decode step costs the same: the state has a fixed size, so the step
// benchmarks fill it with random sums "after `context` tokens" instead of
// running the context through (which would not change the cost).
#include <benchmark/benchmark.h>

#include <latte/attention.hpp>
#include <latte/mechanisms/cosformer.hpp>
#include <latte/mechanisms/leapformer.hpp>
#include <latte/mechanisms/linear_attention.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <random>
#include <vector>

namespace {

using latte::index_t;
constexpr index_t kBatch = 1, kHeads = 8, kDim = 64;  // B, H, Dk = Dv

using CausalElu = latte::LinearAttention<latte::Causal, latte::EluPlusOne>;
using CausalRelu = latte::LinearAttention<latte::Causal, latte::Relu>;
using BidirectionalRelu = latte::LinearAttention<latte::Bidirectional, latte::Relu>;
using CausalCosFormer = latte::CosFormer<latte::Causal>;
using CausalLeaPformer = latte::LeaPformer<latte::Causal>;
using CausalRope = latte::LinearAttention<latte::Causal, latte::EluPlusOne, latte::NoReweight, latte::RoPE>;

constexpr index_t kMaxLength = index_t{1} << 21;  // cosFormer's M: room for every context below

template <std::size_t N>
latte::Tensor<float, N> random_tensor(const std::array<index_t, N>& extents, unsigned seed) {
  latte::Tensor<float, N> tensor(extents);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (index_t i = 0; i < tensor.size(); ++i) tensor.data()[i] = normal(rng);
  return tensor;
}

latte::LeaPModule random_module(unsigned seed) {
  latte::LeaPModule module;
  const index_t hidden = kDim / 4;
  module.w1 = latte::Tensor<double, 2>({hidden, kDim});
  module.b1 = latte::Tensor<double, 1>({hidden}, 0.0);
  module.w2 = latte::Tensor<double, 1>({hidden});
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 0.125);
  for (index_t i = 0; i < module.w1.size(); ++i) module.w1.data()[i] = normal(rng);
  for (index_t j = 0; j < hidden; ++j) module.w2(j) = normal(rng);
  return module;
}

template <class Attn>
Attn make_attention(index_t heads = kHeads) {
  const latte::LinearDims dims{.heads = heads, .key_dim = kDim, .value_dim = kDim};
  typename Attn::Options options;
  if constexpr (Attn::position_proportions) options.reweight.length = kMaxLength;
  if constexpr (Attn::learned_proportions) {
    options.reweight.query_module = random_module(1);
    options.reweight.key_module = random_module(2);
  }
  return Attn(dims, options);
}

/// FLOPs of one token over all heads (the model above).
template <class Attn>
double flops_per_token() {
  const double E = static_cast<double>(Attn::reweight::streams * kDim), Dv = kDim;
  double per_head = 4.0 * E * Dv + 3.0 * E;
  if constexpr (Attn::learned_proportions) per_head += 4.0 * kDim * (kDim / 4);
  return per_head * kHeads;
}

void report(benchmark::State& state, index_t tokens, double flops) {
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(tokens));
  state.counters["flops"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}

template <class Attn, class Exec>
void linear_forward(benchmark::State& state) {
  const index_t T = state.range(0);
  const Attn attn = make_attention<Attn>();
  const auto q = random_tensor<4>({kBatch, T, kHeads, kDim}, 1);
  const auto k = random_tensor<4>({kBatch, T, kHeads, kDim}, 2);
  const auto v = random_tensor<4>({kBatch, T, kHeads, kDim}, 3);
  latte::Tensor<float, 4> out({kBatch, T, kHeads, kDim});
  for (auto _ : state) {
    attn.forward(Exec{}, q, k, v, out.view());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  report(state, kBatch * T, double(kBatch * T) * flops_per_token<Attn>());
}

/// Causal EluPlusOne on the cpu backend called directly: the chunked GEMM form
/// (`chunked`) or the scan with B = H = 1 (`one_head`: time split over threads).
template <bool chunked, bool one_head>
void linear_forward_cpu_variant(benchmark::State& state) {
  const index_t T = state.range(0), H = one_head ? 1 : kHeads;
  const auto q = random_tensor<4>({kBatch, T, H, kDim}, 1);
  const auto k = random_tensor<4>({kBatch, T, H, kDim}, 2);
  const auto v = random_tensor<4>({kBatch, T, H, kDim}, 3);
  latte::Tensor<float, 4> out({kBatch, T, H, kDim});
  const std::vector<double> no_angles;
  const latte::reference::LinearSpec spec{kDim, kDim, 1, kDim, &no_angles, false,
                                          latte::Normaliser::additive(1e-6)};
  std::vector<float> carries(static_cast<std::size_t>(kBatch * H * (kDim * kDim + kDim)));
  for (auto _ : state) {
    std::fill(carries.begin(), carries.end(), 0.0f);
    latte::cpu::linear_causal_forward<latte::EluPlusOne, latte::NoReweight, latte::NoPositional>(
        q.view(), k.view(), v.view(), out.view(), spec, 0,
        [](latte::reference::Side, index_t, index_t, index_t, std::int64_t, const float*) {
          return latte::Proportion{};
        },
        [&](index_t b, index_t h) {
          float* base = carries.data() + (b * H + h) * (kDim * kDim + kDim);
          return latte::reference::LinearCarry<float>{base, base + kDim * kDim};
        },
        chunked ? latte::cpu::CausalAlgorithm::chunked : latte::cpu::CausalAlgorithm::scan);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  report(state, kBatch * T, double(kBatch * T) * flops_per_token<CausalElu>() * H / kHeads);
}

template <class Attn, class Exec>
void linear_step(benchmark::State& state) {
  const index_t context = state.range(0);
  const Attn attn = make_attention<Attn>();
  auto decode_state = attn.template make_state<float>(kBatch);
  {  // the sums of `context` tokens (random, non-negative normaliser)
    std::mt19937 rng(4);
    std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
    const index_t E = attn.expanded_dim();
    for (index_t h = 0; h < kHeads; ++h) {
      const auto carry = decode_state.carry(0, h);
      for (index_t i = 0; i < E * kDim; ++i) carry.memory[i] = uniform(rng) - 0.5f;
      for (index_t i = 0; i < E; ++i) carry.normaliser[i] = static_cast<float>(context) * uniform(rng);
    }
    decode_state.advance(context);
  }
  const auto q = random_tensor<3>({kBatch, kHeads, kDim}, 7);
  const auto k = random_tensor<3>({kBatch, kHeads, kDim}, 8);
  const auto v = random_tensor<3>({kBatch, kHeads, kDim}, 9);
  latte::Tensor<float, 3> out({kBatch, kHeads, kDim});
  const auto start = decode_state;
  for (auto _ : state) {
    if (decode_state.position() >= context + 4096) {  // stay within cosFormer's M
      state.PauseTiming();
      decode_state = start;
      state.ResumeTiming();
    }
    attn.step(Exec{}, decode_state, q, k, v, out.view());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.counters["state_bytes"] = static_cast<double>(decode_state.bytes());
  report(state, kBatch, flops_per_token<Attn>());
}

}  // namespace

using latte::exec::cpu_t;
using latte::exec::reference_t;

#define LATTE_LINEAR_FORWARD(Type, label)                                   \
  BENCHMARK_TEMPLATE(linear_forward, Type, cpu_t)                           \
      ->Name("linear_forward/" label "/cpu")                                \
      ->ArgName("T")                                                        \
      ->RangeMultiplier(4)                                                  \
      ->Range(1 << 10, 1 << 16)                                             \
      ->MinTime(0.1)->UseRealTime()                                         \
      ->Unit(benchmark::kMillisecond);                                      \
  BENCHMARK_TEMPLATE(linear_forward, Type, reference_t)                     \
      ->Name("linear_forward/" label "/reference")                          \
      ->ArgName("T")                                                        \
      ->Arg(1 << 10)                                                        \
      ->Arg(1 << 12)                                                        \
      ->MinTime(0.1)->UseRealTime()                                         \
      ->Unit(benchmark::kMillisecond)
#define LATTE_LINEAR_STEP(Type, label)                                      \
  BENCHMARK_TEMPLATE(linear_step, Type, cpu_t)                              \
      ->Name("linear_step/" label "/cpu")                                   \
      ->ArgName("context")                                                  \
      ->Arg(1 << 10)                                                        \
      ->Arg(1 << 20)                                                        \
      ->MinTime(0.1)->UseRealTime()                                         \
      ->Unit(benchmark::kMicrosecond);                                      \
  BENCHMARK_TEMPLATE(linear_step, Type, reference_t)                        \
      ->Name("linear_step/" label "/reference")                             \
      ->ArgName("context")                                                  \
      ->Arg(1 << 10)                                                        \
      ->Arg(1 << 20)                                                        \
      ->MinTime(0.1)->UseRealTime()                                         \
      ->Unit(benchmark::kMicrosecond)

LATTE_LINEAR_FORWARD(CausalElu, "causal_elu");
LATTE_LINEAR_FORWARD(CausalRelu, "causal_relu");
LATTE_LINEAR_FORWARD(BidirectionalRelu, "bidirectional_relu");
LATTE_LINEAR_FORWARD(CausalCosFormer, "causal_cosformer");
LATTE_LINEAR_FORWARD(CausalLeaPformer, "causal_leapformer");
LATTE_LINEAR_FORWARD(CausalRope, "causal_rope");
BENCHMARK_TEMPLATE(linear_forward_cpu_variant, true, false)
    ->Name("linear_forward/causal_elu/cpu_chunked")
    ->ArgName("T")
    ->RangeMultiplier(4)
    ->Range(1 << 10, 1 << 16)
    ->MinTime(0.1)->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_TEMPLATE(linear_forward_cpu_variant, false, true)
    ->Name("linear_forward/causal_elu/cpu_one_head")
    ->ArgName("T")
    ->RangeMultiplier(4)
    ->Range(1 << 10, 1 << 16)
    ->MinTime(0.1)->UseRealTime()
    ->Unit(benchmark::kMillisecond);
LATTE_LINEAR_STEP(CausalRelu, "causal_relu");
LATTE_LINEAR_STEP(CausalCosFormer, "causal_cosformer");
LATTE_LINEAR_STEP(CausalLeaPformer, "causal_leapformer");
LATTE_LINEAR_STEP(CausalRope, "causal_rope");
