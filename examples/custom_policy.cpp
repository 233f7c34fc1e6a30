// custom_policy — plug your own feature map into latte::LinearAttention without
// touching the library.
//
// A feature map is a struct with a name and a static `apply` on one row
// (see latte/policies/feature_map.hpp). This one, "signed ReLU", keeps the sign
// information ReLU throws away by giving each feature two non-negative halves,
//   phi(x) = [max(x, 0), max(-x, 0)],
// so phi has 2 * Dk features: it says so with `feature_dim`. latte then runs the
// whole family with it: forward, decode (make_state / step) and save/restore.
//
// The program prefills a random sequence, decodes a few tokens one at a time,
// checks that decoding reproduces the whole-sequence forward, and prints the
// decode time per token and the (context-independent) state size.
//
// Usage: custom_policy [--tokens N] [--steps S]   (defaults: 1024 tokens, 16 steps)
#include <latte/attention.hpp>
#include <latte/mechanisms/linear_attention.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <span>
#include <string>

// ---- The user-defined policy --------------------------------------------------
struct SignedRelu {
  static constexpr const char* name = "signed_relu";

  /// phi(x) has twice as many features as x.
  static constexpr latte::index_t feature_dim(latte::index_t key_dim) { return 2 * key_dim; }

  template <class T>
  static void apply(std::span<const T> x, std::span<T> phi) noexcept {
    const std::size_t n = x.size();
    for (std::size_t i = 0; i < n; ++i) {
      phi[i] = x[i] > T(0) ? x[i] : T(0);
      phi[n + i] = x[i] < T(0) ? -x[i] : T(0);
    }
  }
};
static_assert(latte::FeatureMap<SignedRelu>, "SignedRelu satisfies latte's FeatureMap concept");

namespace {

template <std::size_t N>
latte::Tensor<float, N> random_tensor(std::mt19937& rng, const std::array<latte::index_t, N>& extents) {
  latte::Tensor<float, N> tensor(extents);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (latte::index_t i = 0; i < tensor.size(); ++i) tensor.data()[i] = normal(rng);
  return tensor;
}

/// Rows [first, first + count) of the time axis of a [B, T, H, D] tensor, as a view.
latte::TensorView<const float, 4> time_rows(const latte::Tensor<float, 4>& x, latte::index_t first,
                                            latte::index_t count) {
  const auto view = x.view();
  return {view.data() + first * view.stride(1),
          {x.extent(0), count, x.extent(2), x.extent(3)},
          view.strides()};
}

/// Time step t of a [B, T, H, D] tensor as a [B, H, D] view.
latte::TensorView<const float, 3> time_step(const latte::Tensor<float, 4>& x, latte::index_t t) {
  const auto view = x.view();
  return {view.data() + t * view.stride(1),
          {x.extent(0), x.extent(2), x.extent(3)},
          {view.stride(0), view.stride(2), view.stride(3)}};
}

}  // namespace

int main(int argc, char** argv) {
  latte::index_t tokens = 1024, steps = 16;
  bool usage_error = false;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 < argc && flag == "--tokens") tokens = std::atol(argv[i + 1]);
    else if (i + 1 < argc && flag == "--steps") steps = std::atol(argv[i + 1]);
    else usage_error = true;
  }
  if (usage_error || tokens < 1 || steps < 1) {
    std::fprintf(stderr, "usage: custom_policy [--tokens N] [--steps S]  (N, S >= 1)\n");
    return 2;
  }

  constexpr latte::index_t B = 1, H = 4, D = 32;  // batch, heads, key and value features
  const latte::index_t total = tokens + steps;
  std::mt19937 rng(7);
  const auto q = random_tensor<4>(rng, {B, total, H, D});
  const auto k = random_tensor<4>(rng, {B, total, H, D});
  const auto v = random_tensor<4>(rng, {B, total, H, D});

  // ---- The policy plugged in: causal linear attention with phi = SignedRelu ----
  const latte::LinearAttention<latte::Causal, SignedRelu> attention(
      {.heads = H, .key_dim = D, .value_dim = D});
  std::printf("LinearAttention<Causal, %s>: Dk = %td -> phi has %td features per head\n",
              SignedRelu::name, D, attention.feature_dim());

  // Whole sequence at once.
  latte::Tensor<float, 4> whole({B, total, H, D});
  attention.forward(latte::exec::reference, q, k, v, whole.view());

  // Prefill, then decode token by token.
  auto state = attention.make_state<float>(B);
  latte::Tensor<float, 4> prefill_out({B, tokens, H, D});
  attention.forward(latte::exec::reference, time_rows(q, 0, tokens), time_rows(k, 0, tokens),
                    time_rows(v, 0, tokens), prefill_out.view(), state);
  latte::Tensor<float, 3> out({B, H, D});
  double max_difference = 0;
  const auto start = std::chrono::steady_clock::now();
  for (latte::index_t t = tokens; t < total; ++t) {
    attention.step(latte::exec::reference, state, time_step(q, t), time_step(k, t),
                   time_step(v, t), out.view());
    for (latte::index_t h = 0; h < H; ++h)
      for (latte::index_t d = 0; d < D; ++d)
        max_difference = std::max<double>(max_difference, std::fabs(out(0, h, d) - whole(0, t, h, d)));
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  // The state is a checkpoint: save it and continue from the copy.
  auto resumed = attention.load_state<float>(state.save());

  std::printf("prefill %td tokens, then %td decode steps: %.2f us per token, state %zu bytes "
              "(independent of the context)\n",
              tokens, steps, 1e6 * seconds / static_cast<double>(steps), state.bytes());
  std::printf("max |decode - forward| = %.3g; restored state at position %lld\n", max_difference,
              static_cast<long long>(resumed.position()));
  const bool ok = max_difference <= 1e-4 && resumed.position() == total;
  std::printf("%s\n", ok ? "OK" : "MISMATCH");
  return ok ? 0 : 1;
}
