// What the README's C++ snippets use without defining it: small inputs (T = 40
// tokens, a 24-token source) with the README's shapes, H = 8 heads of 64
// features. cmake/latte_readme_snippets.cmake puts every ```cpp block of
// README.md after this, each in a function of its own, and runs them all.
#pragma once
#include <latte/attention.hpp>

#include <array>
#include <cstddef>
#include <random>

namespace readme {

inline std::mt19937 rng(7);

/// A tensor of the given shape with standard-normal entries.
template <std::size_t N>
latte::Tensor<float, N> random(const std::array<latte::index_t, N>& extents) {
  latte::Tensor<float, N> tensor(extents);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (latte::index_t i = 0; i < tensor.size(); ++i) tensor.data()[i] = normal(rng);
  return tensor;
}

inline latte::LeaPModule leap_module() {  // Dk = 64, leap_factor 4: hidden 16
  latte::LeaPModule module;
  module.w1 = latte::Tensor<double, 2>({16, 64}, 0.01);
  module.b1 = latte::Tensor<double, 1>({16}, 0.0);
  module.w2 = latte::Tensor<double, 1>({16}, 0.1);
  return module;
}

}  // namespace readme

constexpr latte::index_t T = 40, S = 24, model_dim = 512;

// [B, T, H, 64]: latent logits (q, k), queries / keys, window queries / keys, values.
auto q = readme::random<4>({1, T, 8, 64}), k = readme::random<4>({1, T, 8, 64}),
     v = readme::random<4>({1, T, 8, 64});
auto queries = readme::random<4>({1, T, 8, 64}), keys = readme::random<4>({1, T, 8, 64}),
     values = readme::random<4>({1, T, 8, 64});
auto window_q = readme::random<4>({1, T, 8, 64}), window_k = readme::random<4>({1, T, 8, 64});
auto query_logits = readme::random<4>({1, T, 8, 65});  // Macchiato: column 0 = the local state
auto key_logits = readme::random<4>({1, T, 8, 64});
auto source_keys = readme::random<4>({1, S, 8, 64}), source_values = readme::random<4>({1, S, 8, 64});
latte::Tensor<float, 4> out({1, T, 8, 64});
// One token: [B, H, 64].
auto q1 = readme::random<3>({1, 8, 64}), k1 = readme::random<3>({1, 8, 64}),
     v1 = readme::random<3>({1, 8, 64});
latte::Tensor<float, 3> out1({1, 8, 64});
latte::LeaPModule query_module = readme::leap_module(), key_module = readme::leap_module();
// Layers: x [B, T, model_dim], a prompt, one token x_t [B, model_dim].
auto x = readme::random<3>({1, T, model_dim}), prompt = readme::random<3>({1, T, model_dim});
latte::Tensor<float, 3> x_out({1, T, model_dim}), prompt_out({1, T, model_dim});
auto x_t = readme::random<2>({1, model_dim});
latte::Tensor<float, 2> out_t({1, model_dim});
