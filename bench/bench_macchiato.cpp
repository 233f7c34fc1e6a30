// Google Benchmark suite for Latte Macchiato (forward on the reference and cpu backends), fp32, B = 1,
// H = 8, L = 64, Dk = Dv = 64, window w = 128 with RoPE on the window (the paper's
// Latte-*-SWA++ set-up, paper 000 §4.1):
//
//   macchiato_forward/causal_rope/{reference,cpu}/T:{1024,4096}   whole-sequence forward
//   macchiato_step/causal_rope/context:{1K,16K}      one decode token after `context` tokens
//
// items_per_second is tokens/s. The counter "flops" is a rate (FLOP/s) from this
// model, counting a multiply and an add as 2 flops and ignoring exp, max and the
// RoPE rotations (O(Dk) per token):
//   per token and head, latent states: absorb v_t into the L x Dv memory (2 L Dv)
//   and read it with p(l|t) (2 L Dv); window: w + 1 scores (2 (w + 1) Dk) and the
//   weighted sum of w + 1 values (2 (w + 1) Dv):
//       4 L Dv + 2 (w + 1) (Dk + Dv)
//   (the first w tokens of a sequence see fewer keys; the model ignores that).
// A decode step costs the same model per head. The step's state is built by writing
// random contents into a fresh state (Latte carry with positive normalisers, a full
// ring of w + 1 keys / values) and advancing it by `context`: its cost depends only
// on the state's shape, not on how its contents came about (prefilling 16K tokens
// through the reference forward would take seconds).
#include <benchmark/benchmark.h>

#include <latte/attention.hpp>
#include <latte/mechanisms/latte_macchiato.hpp>

#include "flop_models.hpp"

#include <array>
#include <cstdint>
#include <random>

namespace {

using latte::index_t;
constexpr index_t kBatch = 1, kHeads = 8, kLatents = 64, kDim = 64, kWindow = 128;

using MacchiatoRope = latte::LatteMacchiato<latte::Causal, latte::RunningMax,
                                            latte::NoPositional, latte::RoPE>;

MacchiatoRope make_macchiato() {
  return MacchiatoRope({.heads = kHeads, .latents = kLatents, .key_dim = kDim,
                        .value_dim = kDim, .window = kWindow});
}

template <std::size_t N>
latte::Tensor<float, N> random_tensor(const std::array<index_t, N>& extents, unsigned seed) {
  latte::Tensor<float, N> tensor(extents);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (index_t i = 0; i < tensor.size(); ++i) tensor.data()[i] = normal(rng);
  return tensor;
}

double flops_per_token() {
  return double(kHeads) * latte::bench::macchiato_token_flops(kLatents, kDim, kDim, kWindow);
}

void report(benchmark::State& state, index_t tokens) {
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(tokens));
  state.counters["flops"] = benchmark::Counter(flops_per_token() * double(tokens),
                                               benchmark::Counter::kIsIterationInvariantRate);
}

template <class Backend>
void macchiato_forward(benchmark::State& state) {
  const index_t T = state.range(0);
  const MacchiatoRope attn = make_macchiato();
  const auto q = random_tensor<4>({kBatch, T, kHeads, kLatents + 1}, 1);
  const auto k = random_tensor<4>({kBatch, T, kHeads, kLatents}, 2);
  const auto wq = random_tensor<4>({kBatch, T, kHeads, kDim}, 3);
  const auto wk = random_tensor<4>({kBatch, T, kHeads, kDim}, 4);
  const auto v = random_tensor<4>({kBatch, T, kHeads, kDim}, 5);
  latte::Tensor<float, 4> out({kBatch, T, kHeads, kDim});
  for (auto _ : state) {
    attn.forward(Backend{}, q, k, wq, wk, v, out.view());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  report(state, kBatch * T);
}

void macchiato_step(benchmark::State& state) {
  const index_t context = state.range(0);
  const MacchiatoRope attn = make_macchiato();
  auto decode_state = attn.make_state<float>(kBatch);
  {
    std::mt19937 rng(6);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> positive(1.0f, 50.0f);
    for (index_t b = 0; b < kBatch; ++b)
      for (index_t h = 0; h < kHeads; ++h) {
        const auto carry = decode_state.carry(b, h);
        for (index_t l = 0; l < kLatents; ++l) {
          carry.running_max[l] = normal(rng);
          carry.normaliser[l] = positive(rng);
          for (index_t d = 0; d < kDim; ++d) carry.memory[l * kDim + d] = normal(rng);
        }
        const auto ring = decode_state.ring(b, h);
        for (index_t i = 0; i < (kWindow + 1) * kDim; ++i) {
          ring.keys[i] = normal(rng);
          ring.values[i] = normal(rng);
        }
      }
    decode_state.set_window_fill(kWindow + 1);
    decode_state.advance(context);
  }
  const auto q = random_tensor<3>({kBatch, kHeads, kLatents + 1}, 7);
  const auto k = random_tensor<3>({kBatch, kHeads, kLatents}, 8);
  const auto wq = random_tensor<3>({kBatch, kHeads, kDim}, 9);
  const auto wk = random_tensor<3>({kBatch, kHeads, kDim}, 10);
  const auto v = random_tensor<3>({kBatch, kHeads, kDim}, 11);
  latte::Tensor<float, 3> out({kBatch, kHeads, kDim});
  // The state has a fixed size, so stepping on does not change the cost.
  for (auto _ : state) {
    attn.step(latte::exec::reference, decode_state, q, k, wq, wk, v, out.view());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.counters["state_bytes"] = static_cast<double>(decode_state.bytes());
  report(state, kBatch);
}

}  // namespace

BENCHMARK(macchiato_forward<latte::exec::reference_t>)
    ->Name("macchiato_forward/causal_rope/reference")
    ->ArgName("T")
    ->Arg(1024)->Arg(4096)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(macchiato_forward<latte::exec::cpu_t>)
    ->Name("macchiato_forward/causal_rope/cpu")
    ->ArgName("T")
    ->Arg(1024)->Arg(4096)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(macchiato_step)
    ->Name("macchiato_step/causal_rope")
    ->ArgName("context")
    ->Arg(1 << 10)->Arg(16 << 10)
    ->Unit(benchmark::kMicrosecond);
