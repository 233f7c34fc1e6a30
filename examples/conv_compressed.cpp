// Convolutional-compression attention (paper 003), hierarchical (levels = 2):
// sliding-window attention, groups of M tokens compressed by a learned
// convolution, and block-causal cross-attention to the compressed tokens,
// added residually. The weights here are small random numbers standing in for
// trained ones. Checks forward against step-by-step decode.
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
  return gap < 1e-4 ? 0 : 1;
}
