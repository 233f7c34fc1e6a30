// Google Benchmark suite for the linear-attention family on the reference
// backend (latte::exec::reference), fp32, B = 1, H = 8, Dk = Dv = 64.
//
//   linear_forward/{causal_relu,bidirectional_relu,causal_cosformer,
//                   causal_leapformer,causal_rope}/T:{256,1024}
//   linear_step/{causal_relu,causal_cosformer,causal_leapformer,causal_rope}/context:{1K,1M}
//
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

#include <array>
#include <cstdint>
#include <random>

namespace {

using latte::index_t;
constexpr index_t kBatch = 1, kHeads = 8, kDim = 64;  // B, H, Dk = Dv

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
Attn make_attention() {
  const latte::LinearDims dims{.heads = kHeads, .key_dim = kDim, .value_dim = kDim};
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

template <class Attn>
void linear_forward(benchmark::State& state) {
  const index_t T = state.range(0);
  const Attn attn = make_attention<Attn>();
  const auto q = random_tensor<4>({kBatch, T, kHeads, kDim}, 1);
  const auto k = random_tensor<4>({kBatch, T, kHeads, kDim}, 2);
  const auto v = random_tensor<4>({kBatch, T, kHeads, kDim}, 3);
  latte::Tensor<float, 4> out({kBatch, T, kHeads, kDim});
  for (auto _ : state) {
    attn.forward(latte::exec::reference, q, k, v, out.view());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  report(state, kBatch * T, double(kBatch * T) * flops_per_token<Attn>());
}

template <class Attn>
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
    attn.step(latte::exec::reference, decode_state, q, k, v, out.view());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.counters["state_bytes"] = static_cast<double>(decode_state.bytes());
  report(state, kBatch, flops_per_token<Attn>());
}

}  // namespace

#define LATTE_LINEAR_FORWARD(Type, label)                          \
  BENCHMARK_TEMPLATE(linear_forward, Type)                         \
      ->Name("linear_forward/" label)                              \
      ->ArgName("T")                                               \
      ->Arg(256)                                                   \
      ->Arg(1024)                                                  \
      ->MinTime(0.1)                                               \
      ->Unit(benchmark::kMillisecond)
#define LATTE_LINEAR_STEP(Type, label)                             \
  BENCHMARK_TEMPLATE(linear_step, Type)                            \
      ->Name("linear_step/" label)                                 \
      ->ArgName("context")                                         \
      ->Arg(1 << 10)                                               \
      ->Arg(1 << 20)                                               \
      ->MinTime(0.1)                                               \
      ->Unit(benchmark::kMicrosecond)

LATTE_LINEAR_FORWARD(CausalRelu, "causal_relu");
LATTE_LINEAR_FORWARD(BidirectionalRelu, "bidirectional_relu");
LATTE_LINEAR_FORWARD(CausalCosFormer, "causal_cosformer");
LATTE_LINEAR_FORWARD(CausalLeaPformer, "causal_leapformer");
LATTE_LINEAR_FORWARD(CausalRope, "causal_rope");
LATTE_LINEAR_STEP(CausalRelu, "causal_relu");
LATTE_LINEAR_STEP(CausalCosFormer, "causal_cosformer");
LATTE_LINEAR_STEP(CausalLeaPformer, "causal_leapformer");
LATTE_LINEAR_STEP(CausalRope, "causal_rope");
