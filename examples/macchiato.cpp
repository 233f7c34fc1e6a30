// Latte Macchiato: one softmax over L+1 states mixes sliding-window softmax
// attention (state 0, with RoPE on its own queries/keys) and Latte's L latent
// states. Runs a whole-sequence forward, then decodes the same tokens one at
// a time from a fresh state and checks both give the same outputs. Then the
// backward: the gradients of the loss <d_out, out> with respect to the five
// inputs, checked along a random direction of the values against a central
// difference of the forward.
//   macchiato [--tokens N]
#include "example_support.hpp"

int main(int argc, char** argv) {
  const latte::index_t T = example::tokens_flag(argc, argv, 2048), B = 1, H = 4, L = 32, D = 32;
  std::mt19937 rng(1);
  latte::LatteMacchiato<latte::Causal, latte::RunningMax, latte::NoPositional, latte::RoPE> attn(
      {.heads = H, .latents = L, .key_dim = D, .value_dim = D, .window = 64});
  auto q = example::random_tensor<4>(rng, {B, T, H, L + 1});  // column 0: the local state
  auto k = example::random_tensor<4>(rng, {B, T, H, L});
  auto wq = example::random_tensor<4>(rng, {B, T, H, D});
  auto wk = example::random_tensor<4>(rng, {B, T, H, D});
  auto v = example::random_tensor<4>(rng, {B, T, H, D});
  latte::Tensor<float, 4> whole({B, T, H, D}), stepped({B, T, H, D});
  attn.forward(latte::exec::reference, q, k, wq, wk, v, whole.view());

  auto state = attn.make_state<float>(B);  // Latte carry + a ring of window + 1 keys/values
  for (latte::index_t t = 0; t < T; ++t)
    attn.step(latte::exec::reference, state, example::at_time<const float>(q, t),
              example::at_time<const float>(k, t), example::at_time<const float>(wq, t),
              example::at_time<const float>(wk, t), example::at_time<const float>(v, t),
              example::at_time<float>(stepped, t));
  const double gap = example::max_difference(whole, stepped);
  std::printf("LatteMacchiato: %td tokens, state %zu bytes, forward vs step-by-step max |diff| %.2e\n",
              T, state.bytes(), gap);

  // Backward (exec::cpu): d_out = dL/d out for L = <d_out, out>.
  const auto d_out = example::random_tensor<4>(rng, {B, T, H, D});
  latte::Tensor<float, 4> dq({B, T, H, L + 1}), dk({B, T, H, L}), dwq({B, T, H, D}),
      dwk({B, T, H, D}), dv({B, T, H, D});
  attn.backward(latte::exec::cpu, q, k, wq, wk, v, d_out,
                latte::MacchiatoGradients<float>{dq.view(), dk.view(), dwq.view(), dwk.view(), dv.view()});
  // <dv, u> against (L(v + h u) - L(v - h u)) / 2h for a random direction u.
  const auto u = example::random_tensor<4>(rng, {B, T, H, D});
  auto loss_at = [&](float h) {
    latte::Tensor<float, 4> moved = v, out({B, T, H, D});
    for (latte::index_t i = 0; i < moved.size(); ++i) moved.data()[i] += h * u.data()[i];
    attn.forward(latte::exec::cpu, q, k, wq, wk, moved, out.view());
    double total = 0;
    for (latte::index_t i = 0; i < out.size(); ++i) total += double(d_out.data()[i]) * out.data()[i];
    return total;
  };
  const float h = 1e-2f;  // the loss is linear in v: the difference is exact up to rounding
  const double finite = (loss_at(h) - loss_at(-h)) / (2.0 * h);
  double analytic = 0;
  for (latte::index_t i = 0; i < dv.size(); ++i) analytic += double(dv.data()[i]) * u.data()[i];
  const double mismatch = std::fabs(finite - analytic) / std::fmax(std::fabs(analytic), 1.0);
  std::printf("LatteMacchiato backward: <d_values, u> = %.6f, central difference %.6f (rel %.1e)\n",
              analytic, finite, mismatch);
  return gap < 1e-4 && mismatch < 1e-3 ? 0 : 1;
}
