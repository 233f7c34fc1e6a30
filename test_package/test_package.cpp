// The package consumer: a tiny causal Latte forward through latte::latte, as
// found by find_package(latte), Conan or add_subdirectory. It checks that the
// headers compile and link with the dependencies the package brings along, and
// that the result makes sense:
//  - every output of a random forward and decode step is finite;
//  - when every value vector is the same vector c, each output is c, because
//    Latte's output is a convex combination of values (paper 000 eq. 10:
//    the weights p(l|t) p(s|l,t) sum to 1 over s for every t).
#include <latte/attention.hpp>

#include <cmath>
#include <cstdio>
#include <random>

int main() {
  constexpr latte::index_t B = 1, T = 16, H = 2, L = 4, Dv = 8;
  latte::LatteAttention<latte::Causal> attn({.heads = H, .latents = L, .value_dim = Dv});

  latte::Tensor<float, 4> q({B, T, H, L}), k({B, T, H, L}), v({B, T, H, Dv});
  latte::Tensor<float, 4> constant({B, T, H, Dv}), out({B, T, H, Dv});
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (auto* tensor : {&q, &k, &v})
    for (latte::index_t i = 0; i < tensor->size(); ++i) tensor->data()[i] = normal(rng);
  for (latte::index_t i = 0; i < constant.size(); ++i)
    constant.data()[i] = 0.5f + static_cast<float>(i % Dv);  // c_d = d + 0.5 at every (t, h)

  int failures = 0;
  attn.forward(latte::exec::reference, q, k, constant, out.view());
  for (latte::index_t i = 0; i < out.size(); ++i)
    if (!(std::abs(out.data()[i] - constant.data()[i]) <= 1e-5f * constant.data()[i])) ++failures;

  auto state = attn.make_state<float>(B);
  attn.forward(latte::exec::reference, q, k, v, out.view(), state);
  latte::Tensor<float, 3> q1({B, H, L}, 1.0f), k1({B, H, L}, -2.0f), v1({B, H, Dv}, 0.25f);
  latte::Tensor<float, 3> out1({B, H, Dv});
  attn.step(latte::exec::reference, state, q1, k1, v1, out1.view());
  for (latte::index_t i = 0; i < out.size(); ++i)
    if (!std::isfinite(out.data()[i])) ++failures;
  for (latte::index_t i = 0; i < out1.size(); ++i)
    if (!std::isfinite(out1.data()[i])) ++failures;

  std::printf("latte %s: causal forward [%td, %td, %td, %td] + 1 decode step: %s\n",
              LATTE_VERSION_STRING, B, T, H, Dv, failures == 0 ? "ok" : "FAILED");
  return failures == 0 ? 0 : 1;
}
