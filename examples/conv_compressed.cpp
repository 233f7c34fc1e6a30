// Convolutional-compression attention (paper 003), hierarchical (levels = 2):
// sliding-window attention, groups of M tokens compressed by a learned
// convolution, and block-causal cross-attention to the compressed tokens,
// added residually. The weights here are small random numbers standing in for
// trained ones. Checks forward against step-by-step decode, then the backward
// (fp64): the gradient of L = <d_out, out> along a random direction of the
// values and of the first convolution's weights, against a central difference.
//   conv_compressed [--tokens N]
#include "example_support.hpp"

int main(int argc, char** argv) {
  const latte::index_t T = example::tokens_flag(argc, argv, 1024), B = 1, H = 2, D = 16;
  std::mt19937 rng(3);
  const latte::ConvCompressedDims dims{.heads = H, .key_dim = D, .value_dim = D, .group_size = 8,
                                       .levels = 2};
  auto params = latte::ConvCompressedParams::zeros(dims);
  std::normal_distribution<double> small(0.0, 0.05);
  auto fill = [&](auto& tensors) {
    for (auto& tensor : tensors)
      for (latte::index_t i = 0; i < tensor.size(); ++i) tensor.data()[i] = small(rng);
  };
  fill(params.conv_weight);
  fill(params.conv_bias);
  fill(params.level_query);
  fill(params.level_key);
  fill(params.level_value);
  for (auto* tensor : {&params.cross_query, &params.cross_key, &params.cross_value})
    for (latte::index_t i = 0; i < tensor->size(); ++i) tensor->data()[i] = small(rng);
  latte::ConvCompressedAttention<latte::Causal> attn(dims, params);
  auto q = example::random_tensor<4>(rng, {B, T, H, D});
  auto k = example::random_tensor<4>(rng, {B, T, H, D});
  auto v = example::random_tensor<4>(rng, {B, T, H, D});
  latte::Tensor<float, 4> whole({B, T, H, D}), stepped({B, T, H, D});
  attn.forward(latte::exec::reference, q, k, v, whole.view());
  auto state = attn.make_state<float>(B, /*context_capacity=*/T);
  for (latte::index_t t = 0; t < T; ++t)
    attn.step(latte::exec::reference, state, example::at_time<const float>(q, t),
              example::at_time<const float>(k, t), example::at_time<const float>(v, t),
              example::at_time<float>(stepped, t));
  const double gap = example::max_difference(whole, stepped);
  std::printf("ConvCompressedAttention<Causal> levels=2: %td tokens, forward vs step-by-step "
              "max |diff| %.2e\n", T, gap);

  // Backward (exec::cpu, fp64).
  auto widen = [](const latte::Tensor<float, 4>& x) {
    latte::Tensor<double, 4> y(x.extents());
    for (latte::index_t i = 0; i < x.size(); ++i) y.data()[i] = x.data()[i];
    return y;
  };
  const auto q64 = widen(q), k64 = widen(k), v64 = widen(v);
  const auto d_out = widen(example::random_tensor<4>(rng, {B, T, H, D}));
  const auto u = widen(example::random_tensor<4>(rng, {B, T, H, D}));
  latte::Tensor<double, 4> weight_direction(params.conv_weight[0].extents());
  for (latte::index_t i = 0; i < weight_direction.size(); ++i) weight_direction.data()[i] = small(rng);
  latte::Tensor<double, 4> dq({B, T, H, D}), dk({B, T, H, D}), dv({B, T, H, D});
  auto d_params = latte::ConvCompressedParams::zeros(dims);
  attn.backward(latte::exec::cpu, q64, k64, v64, d_out,
                latte::ConvCompressedGradients<double>{dq.view(), dk.view(), dv.view(), &d_params});
  auto loss_at = [&](double h) {
    auto moved_params = params;
    for (latte::index_t i = 0; i < weight_direction.size(); ++i)
      moved_params.conv_weight[0].data()[i] += h * weight_direction.data()[i];
    latte::Tensor<double, 4> moved = v64, out({B, T, H, D});
    for (latte::index_t i = 0; i < moved.size(); ++i) moved.data()[i] += h * u.data()[i];
    latte::ConvCompressedAttention<latte::Causal>(dims, moved_params)
        .forward(latte::exec::cpu, q64, k64, moved, out.view());
    double total = 0;
    for (latte::index_t i = 0; i < out.size(); ++i) total += d_out.data()[i] * out.data()[i];
    return total;
  };
  const double h = 1e-4, finite = (loss_at(h) - loss_at(-h)) / (2 * h);
  double analytic = 0;
  for (latte::index_t i = 0; i < dv.size(); ++i) analytic += dv.data()[i] * u.data()[i];
  for (latte::index_t i = 0; i < weight_direction.size(); ++i)
    analytic += d_params.conv_weight[0].data()[i] * weight_direction.data()[i];
  const double mismatch = std::fabs(finite - analytic) / std::fmax(std::fabs(analytic), 1.0);
  std::printf("ConvCompressedAttention backward: <d_values, u> + <d_conv_weight, w> = %.8f, "
              "central difference %.8f (rel %.1e)\n",
              analytic, finite, mismatch);
  return gap < 1e-4 && mismatch < 1e-6 ? 0 : 1;
}
