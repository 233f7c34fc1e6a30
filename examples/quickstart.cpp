// quickstart — the first latte program to run.
//
// It compares causal Latte (linear-time attention through L latent states, with
// VAPOR positional rotations) against exact causal softmax attention on the same
// workload: prefill a random sequence, then decode a few tokens one at a time.
//
//   Latte keeps a fixed-size state per head (O(L * Dv)), so each decoded token
//   costs the same no matter how long the context is.
//   Softmax keeps a KV cache that grows with the context, so each decoded token
//   costs O(context * D) and the cache grows by one key and one value per token.
//
// Usage: quickstart [--tokens N] [--steps S]   (defaults: 4096 tokens, 100 steps)
#include <latte/attention.hpp>

#include <array>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
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

  constexpr latte::index_t B = 1, H = 8, L = 64, D = 64;  // batch, heads, latents, features
  std::mt19937 rng(42);
  std::printf("latte %s quickstart: B=%td H=%td L=%td Dv=%td, %td-token prefill + %td decode steps "
              "(fp32, reference backend)\n\n",
              LATTE_VERSION_STRING, B, H, L, D, tokens, steps);
  bool finite = true;

  // ---- Causal Latte with VAPOR --------------------------------------------
  // Inputs are already projected: query and key *latent logits* [B, T, H, L]
  // and values [B, T, H, Dv]. The output has the shape of the values.
  latte::LatteAttention<latte::Causal, latte::RunningMax, latte::VAPOR> latte_attn(
      {.heads = H, .latents = L, .value_dim = D});
  double latte_per_token = 0;
  {
    auto q = random_tensor<4>(rng, {B, tokens, H, L});
    auto k = random_tensor<4>(rng, {B, tokens, H, L});
    auto v = random_tensor<4>(rng, {B, tokens, H, D});
    latte::Tensor<float, 4> out({B, tokens, H, D});

    // Prefill: one forward over the prompt that leaves `state` at its end.
    auto state = latte_attn.make_state<float>(B);
    auto start = Clock::now();
    latte_attn.forward(latte::exec::reference, q, k, v, out.view(), state);
    const double prefill = seconds_since(start);
    finite = finite && all_finite(out);

    // Decode: one token at a time; per-token inputs are [B, H, L] / [B, H, Dv].
    auto q1 = random_tensor<3>(rng, {B, H, L});
    auto k1 = random_tensor<3>(rng, {B, H, L});
    auto v1 = random_tensor<3>(rng, {B, H, D});
    latte::Tensor<float, 3> out1({B, H, D});
    start = Clock::now();
    for (latte::index_t s = 0; s < steps; ++s) {
      latte_attn.step(latte::exec::reference, state, q1, k1, v1, out1.view());
      finite = finite && all_finite(out1);  // in a real model out1 feeds the next token
    }
    latte_per_token = seconds_since(start) / static_cast<double>(steps);

    std::printf("Latte<causal, running_max, vapor>\n");
    std::printf("  prefill (%td tokens):  %10.3f ms\n", tokens, prefill * 1e3);
    std::printf("  decode, per token:      %10.3f us\n", latte_per_token * 1e6);
    std::printf("  state size:             %10zu bytes (constant in the context length)\n\n",
                state.bytes());
  }

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
    auto cache = softmax_attn.make_state<float>(B, tokens + steps);
    auto start = Clock::now();
    softmax_attn.forward(latte::exec::reference, q, k, v, out.view(), cache);
    const double prefill = seconds_since(start);
    finite = finite && all_finite(out);

    auto q1 = random_tensor<3>(rng, {B, H, D});
    auto k1 = random_tensor<3>(rng, {B, H, D});
    auto v1 = random_tensor<3>(rng, {B, H, D});
    latte::Tensor<float, 3> out1({B, H, D});
    start = Clock::now();
    for (latte::index_t s = 0; s < steps; ++s) {
      softmax_attn.step(latte::exec::reference, cache, q1, k1, v1, out1.view());
      finite = finite && all_finite(out1);
    }
    softmax_per_token = seconds_since(start) / static_cast<double>(steps);

    std::printf("Softmax<causal> + KV cache\n");
    std::printf("  prefill (%td tokens):  %10.3f ms\n", tokens, prefill * 1e3);
    std::printf("  decode, per token:      %10.3f us\n", softmax_per_token * 1e6);
    std::printf("  KV cache size:          %10zu bytes (grows with the context)\n\n",
                cache.bytes());
  }

  std::printf("decode speed-up at %td tokens of context: %.1fx (softmax time / Latte time)\n",
              tokens, softmax_per_token / latte_per_token);
  std::printf("sanity check: all outputs finite: %s\n", finite ? "yes" : "NO");
  return finite ? 0 : 1;
}
