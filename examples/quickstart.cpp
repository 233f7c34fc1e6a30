// quickstart — the first latte program to run.
//
// It compares causal Latte (linear-time attention through L latent states; then
// the same with VAPOR positional rotations) against exact causal softmax
// attention on the same workload: prefill a random sequence, then decode a few
// tokens one at a time.
//
//   Latte keeps a fixed-size state per head (O(L * Dv)), so each decoded token
//   costs the same no matter how long the context is.
//   Softmax keeps a KV cache that grows with the context, so each decoded token
//   costs O(context * D) and the cache grows by one key and one value per token.
//
// All run on exec::cpu, the default backend (SIMD + OpenMP threads): calls that
// name no backend use it. It first prints what this build runs on
// (latte::build_info(): threads, SIMD instruction set, CUDA).
//
// Usage: quickstart [--tokens N] [--steps S]   (defaults: 4096 tokens, 5 rounds of 100 steps;
//        the fastest round is reported)
#include <latte/attention.hpp>

#include <array>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <random>
#include <string>

namespace {

using Clock = std::chrono::steady_clock;

constexpr latte::index_t B = 1, H = 8, L = 64, D = 64;  // batch, heads, latents, features

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

/// Rounds of `steps` decode steps timed; a busy machine slows some of them.
constexpr int decode_rounds = 5;

/// Seconds per call of step() in the fastest of decode_rounds rounds of `steps` calls.
template <class Step>
double best_seconds_per_step(latte::index_t steps, Step&& step) {
  double best = 0;
  for (int round = 0; round < decode_rounds; ++round) {
    const auto start = Clock::now();
    for (latte::index_t s = 0; s < steps; ++s) step();
    const double per_step = seconds_since(start) / static_cast<double>(steps);
    if (round == 0 || per_step < best) best = per_step;
  }
  return best;
}

// A tensor of the given shape filled with standard-normal random numbers.
template <std::size_t N>
latte::Tensor<float, N> random_tensor(std::mt19937& rng,
                                      const std::array<latte::index_t, N>& extents) {
  latte::Tensor<float, N> tensor(extents);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (latte::index_t i = 0; i < tensor.size(); ++i) tensor.data()[i] = normal(rng);
  return tensor;
}

template <std::size_t N>
bool all_finite(const latte::Tensor<float, N>& tensor) {
  for (latte::index_t i = 0; i < tensor.size(); ++i)
    if (!std::isfinite(tensor.data()[i])) return false;
  return true;
}

/// Causal Latte with positional policy Pos: a `tokens` prefill, then decode steps.
/// Prints its figures and returns the seconds per decoded token.
template <class Pos>
double run_latte(const char* name, std::mt19937& rng, latte::index_t tokens, latte::index_t steps,
                 bool& finite) {
  // Inputs are already projected: query and key *latent logits* [B, T, H, L]
  // and values [B, T, H, Dv]. The output has the shape of the values.
  latte::LatteAttention<latte::Causal, latte::RunningMax, Pos> latte_attn(
      {.heads = H, .latents = L, .value_dim = D});
  auto q = random_tensor<4>(rng, {B, tokens, H, L});
  auto k = random_tensor<4>(rng, {B, tokens, H, L});
  auto v = random_tensor<4>(rng, {B, tokens, H, D});
  latte::Tensor<float, 4> out({B, tokens, H, D});

  // Prefill: one forward over the prompt that leaves `state` at its end.
  auto state = latte_attn.template make_state<float>(B);
  const auto start = Clock::now();
  latte_attn.forward(q, k, v, out.view(), state);  // = forward(latte::exec::cpu, ...)
  const double prefill = seconds_since(start);
  finite = finite && all_finite(out);

  // Decode: one token at a time; per-token inputs are [B, H, L] / [B, H, Dv].
  auto q1 = random_tensor<3>(rng, {B, H, L});
  auto k1 = random_tensor<3>(rng, {B, H, L});
  auto v1 = random_tensor<3>(rng, {B, H, D});
  latte::Tensor<float, 3> out1({B, H, D});
  const double per_token = best_seconds_per_step(steps, [&] {
    latte_attn.step(state, q1, k1, v1, out1.view());
    finite = finite && all_finite(out1);  // in a real model out1 feeds the next token
  });

  std::printf("%s\n", name);
  std::printf("  prefill (%td tokens):  %10.3f ms\n", tokens, prefill * 1e3);
  std::printf("  decode, per token:      %10.3f us (fastest round)\n", per_token * 1e6);
  std::printf("  state size:             %10zu bytes (constant in the context length)\n\n",
              state.bytes());
  return per_token;
}

}  // namespace

int main(int argc, char** argv) {
  // ---- Command line: --tokens N --steps S --------------------------------
  latte::index_t tokens = 4096, steps = 100;
  bool usage_error = false;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 < argc && flag == "--tokens") tokens = std::atol(argv[i + 1]);
    else if (i + 1 < argc && flag == "--steps") steps = std::atol(argv[i + 1]);
    else usage_error = true;
  }
  if (usage_error || tokens < 1 || steps < 1) {
    std::fprintf(stderr, "usage: quickstart [--tokens N] [--steps S]  (N, S >= 1)\n");
    return 2;
  }

  std::mt19937 rng(42);
  std::cout << latte::build_info() << "\n\n";  // what exec::cpu runs on in this build
  std::printf("quickstart: B=%td H=%td L=%td Dv=%td, %td-token prefill + %d x %td decode steps "
              "(fp32, exec::cpu)\n\n",
              B, H, L, D, tokens, decode_rounds, steps);
  bool finite = true;

  // ---- Causal Latte, without and with VAPOR rotations ----------------------
  const double latte_per_token =
      run_latte<latte::NoPositional>("Latte<causal, running_max>", rng, tokens, steps, finite);
  run_latte<latte::VAPOR>("Latte<causal, running_max, vapor>", rng, tokens, steps, finite);

  // ---- Exact causal softmax attention with a KV cache (the baseline) -------
  // Same shapes, but queries and keys have Dk features instead of L latent logits.
  latte::SoftmaxAttention<latte::Causal> softmax_attn({.heads = H, .key_dim = D, .value_dim = D});
  double softmax_per_token = 0;
  {
    auto q = random_tensor<4>(rng, {B, tokens, H, D});
    auto k = random_tensor<4>(rng, {B, tokens, H, D});
    auto v = random_tensor<4>(rng, {B, tokens, H, D});
    latte::Tensor<float, 4> out({B, tokens, H, D});

    // The KV cache must hold the whole context: prompt + decoded tokens.
    auto cache = softmax_attn.make_state<float>(B, tokens + decode_rounds * steps);
    auto start = Clock::now();
    softmax_attn.forward(q, k, v, out.view(), cache);
    const double prefill = seconds_since(start);
    finite = finite && all_finite(out);

    auto q1 = random_tensor<3>(rng, {B, H, D});
    auto k1 = random_tensor<3>(rng, {B, H, D});
    auto v1 = random_tensor<3>(rng, {B, H, D});
    latte::Tensor<float, 3> out1({B, H, D});
    softmax_per_token = best_seconds_per_step(steps, [&] {
      softmax_attn.step(cache, q1, k1, v1, out1.view());
      finite = finite && all_finite(out1);
    });

    std::printf("Softmax<causal> + KV cache\n");
    std::printf("  prefill (%td tokens):  %10.3f ms\n", tokens, prefill * 1e3);
    std::printf("  decode, per token:      %10.3f us (fastest round)\n", softmax_per_token * 1e6);
    std::printf("  KV cache size:          %10zu bytes (grows with the context)\n\n",
                cache.bytes());
  }

  std::printf("decode speed-up at %td tokens of context: %.1fx (softmax time / Latte time)\n",
              tokens, softmax_per_token / latte_per_token);
  std::printf("sanity check: all outputs finite: %s\n", finite ? "yes" : "NO");
  return finite ? 0 : 1;
}
