// LAVO (paper 002): local softmax over the w most recent tokens plus an
// orthogonal memory of all complete earlier windows. Runs the causal forward,
// the same tokens through step() and checks they agree; prints the state size
// (constant in the context: O(w*d + r) per head). Then the backward in fp64:
// the gradients of L = <d_out, out> along a random direction of the values and
// of the relative bias P, against central differences of the forward.
//   lavo [--tokens N]
#include "example_support.hpp"

int main(int argc, char** argv) {
  const latte::index_t T = example::tokens_flag(argc, argv, 2048), B = 1, H = 4, d = 32;
  std::mt19937 rng(2);
  latte::Lavo<latte::Causal> lavo({.heads = H, .dim = d, .bases = 16, .window = 32},
                                  {.basis_seed = 1});  // seeded orthonormal bases (Eigen QR)
  auto q = example::random_tensor<4>(rng, {B, T, H, d});
  auto k = example::random_tensor<4>(rng, {B, T, H, d});
  auto v = example::random_tensor<4>(rng, {B, T, H, d});
  latte::Tensor<float, 4> whole({B, T, H, d}), stepped({B, T, H, d});
  lavo.forward(latte::exec::reference, q, k, v, whole.view());
  auto state = lavo.make_state<float>(B);
  for (latte::index_t t = 0; t < T; ++t)
    lavo.step(latte::exec::reference, state, example::at_time<const float>(q, t),
              example::at_time<const float>(k, t), example::at_time<const float>(v, t),
              example::at_time<float>(stepped, t));
  const double gap = example::max_difference(whole, stepped);
  std::printf("Lavo<Causal>: %td tokens, state %zu bytes, forward vs step-by-step max |diff| %.2e\n",
              T, state.bytes(), gap);

  // Backward (exec::cpu, fp64; P random, so its gradient is not trivially zero).
  auto widen = [](const latte::Tensor<float, 4>& x) {
    latte::Tensor<double, 4> y(x.extents());
    for (latte::index_t i = 0; i < x.size(); ++i) y.data()[i] = x.data()[i];
    return y;
  };
  const auto q64 = widen(q), k64 = widen(k), v64 = widen(v);
  const auto d_out = widen(example::random_tensor<4>(rng, {B, T, H, d}));
  const auto u = widen(example::random_tensor<4>(rng, {B, T, H, d}));
  latte::Tensor<double, 2> bias({H, 2 * 32 - 1}), bias_direction({H, 2 * 32 - 1});
  std::normal_distribution<double> normal;
  for (latte::index_t i = 0; i < bias.size(); ++i) {
    bias.data()[i] = normal(rng);
    bias_direction.data()[i] = normal(rng);
  }
  auto attention_with = [&](const latte::Tensor<double, 2>& p) {
    return latte::Lavo<latte::Causal>({.heads = H, .dim = d, .bases = 16, .window = 32},
                                      {.basis_seed = 1, .relative_bias = p});
  };
  const auto trained = attention_with(bias);
  latte::Tensor<double, 4> dq({B, T, H, d}), dk({B, T, H, d}), dv({B, T, H, d});
  latte::Tensor<double, 2> d_bias({H, 2 * 32 - 1});
  trained.backward(latte::exec::cpu, q64, k64, v64, d_out,
                   latte::LavoGradients<double>{dq.view(), dk.view(), dv.view(), d_bias.view()});
  // L(v + h u, P + h p): its central difference against <dv, u> + <dP, p>.
  auto loss_at = [&](double h) {
    latte::Tensor<double, 4> moved = v64, out({B, T, H, d});
    for (latte::index_t i = 0; i < moved.size(); ++i) moved.data()[i] += h * u.data()[i];
    latte::Tensor<double, 2> p = bias;
    for (latte::index_t i = 0; i < p.size(); ++i) p.data()[i] += h * bias_direction.data()[i];
    attention_with(p).forward(latte::exec::cpu, q64, k64, moved, out.view());
    double total = 0;
    for (latte::index_t i = 0; i < out.size(); ++i) total += d_out.data()[i] * out.data()[i];
    return total;
  };
  const double h = 1e-4, finite = (loss_at(h) - loss_at(-h)) / (2 * h);
  double analytic = 0;
  for (latte::index_t i = 0; i < dv.size(); ++i) analytic += dv.data()[i] * u.data()[i];
  for (latte::index_t i = 0; i < d_bias.size(); ++i)
    analytic += d_bias.data()[i] * bias_direction.data()[i];
  const double mismatch = std::fabs(finite - analytic) / std::fmax(std::fabs(analytic), 1.0);
  std::printf("Lavo backward: <d_values, u> + <d_relative_bias, p> = %.8f, central difference "
              "%.8f (rel %.1e)\n",
              analytic, finite, mismatch);
  return gap < 1e-4 && mismatch < 1e-6 ? 0 : 1;
}
