// Layers: what a model author drops in place of multi-head attention. A
// Latte-RGLRU-SWA layer (paper 000's best model: an RG-LRU token mixer feeding
// Latte Macchiato's latent logits, RoPE on the sliding window) owns its
// projections W_i and W_o; it runs over a [B, T, model_dim] sequence, then the
// same tokens are decoded one at a time from a prefill of the first half, and
// both must agree. A Latte-Conv layer (ShortConv<3>) is run the same way.
// Then one step of gradient descent on the Latte-RGLRU-SWA layer: backward gives
// the gradient of every weight (projections, output, RG-LRU), and the loss
// 0.5 |layer(x) - target|^2 must fall.
//   layers [--tokens N]
#include "example_support.hpp"

namespace {

/// Forward over all tokens vs prefill of the first half + one step per token.
template <class Layer>
double forward_vs_decode(const Layer& layer, const latte::Tensor<float, 3>& x) {
  const latte::index_t B = x.extent(0), T = x.extent(1), C = x.extent(2), half = T / 2;
  latte::Tensor<float, 3> whole({B, T, C}), decoded({B, T, C});
  layer.forward(x.view(), whole.view());

  auto state = layer.make_state(B);  // mechanism state + mixer state + step scratch
  // Tokens [first, first + count) of every sequence, as strided views (no copy).
  const auto rows = [&](auto* base, latte::index_t first, latte::index_t count) {
    using Element = std::remove_pointer_t<decltype(base)>;
    return latte::TensorView<Element, 3>(base + first * C, {B, count, C}, {T * C, C, 1});
  };
  const auto token = [&](auto* base, latte::index_t t) {
    using Element = std::remove_pointer_t<decltype(base)>;
    return latte::TensorView<Element, 2>(base + t * C, {B, C}, {T * C, 1});
  };
  layer.forward(rows(x.data(), 0, half), rows(decoded.data(), 0, half), state);  // prefill
  for (latte::index_t t = half; t < T; ++t) layer.step(state, token(x.data(), t), token(decoded.data(), t));
  return example::max_difference(whole, decoded);
}

/// 0.5 |layer(x) - target|^2, and its gradient with respect to the output in d_out.
template <class Layer>
double loss_and_gradient(const Layer& layer, const latte::Tensor<float, 3>& x,
                         const latte::Tensor<float, 3>& target, latte::Tensor<float, 3>& d_out) {
  latte::Tensor<float, 3> out(x.extents());
  layer.forward(latte::exec::cpu, x.view(), out.view());
  double loss = 0;
  for (latte::index_t i = 0; i < out.size(); ++i) {
    d_out.data()[i] = out.data()[i] - target.data()[i];
    loss += 0.5 * double(d_out.data()[i]) * d_out.data()[i];
  }
  return loss;
}

/// weights -= rate * gradient, tensor by tensor.
template <class Weights>
void descend(Weights& weights, const Weights& gradient, float rate) {
  for (std::size_t i = 0; i < weights.projections.size(); ++i)
    weights.projections[i] -= rate * gradient.projections[i];
  weights.output -= rate * gradient.output;
  auto& m = weights.mixer;
  const auto& g = gradient.mixer;
  for (auto [w, d] : {std::pair{&m.recurrence_gate, &g.recurrence_gate}, std::pair{&m.input_gate, &g.input_gate}})
    for (latte::index_t i = 0; i < w->size(); ++i) w->data()[i] -= rate * d->data()[i];
  for (auto [w, d] : {std::pair{&m.recurrence_bias, &g.recurrence_bias}, std::pair{&m.input_bias, &g.input_bias},
                      std::pair{&m.lambda, &g.lambda}})
    for (latte::index_t i = 0; i < w->size(); ++i) w->data()[i] -= rate * d->data()[i];
}

}  // namespace

int main(int argc, char** argv) {
  const latte::index_t T = example::tokens_flag(argc, argv, 1024), B = 2, model = 64;
  std::mt19937 rng(3);
  const auto x = example::random_tensor<3>(rng, {B, T, model});

  // Latte-RGLRU-SWA: H = 4 heads, L = 16 latents, window 32 with RoPE.
  const latte::LatteMacchiato<latte::Causal, latte::RunningMax, latte::NoPositional, latte::RoPE>
      macchiato({.heads = 4, .latents = 16, .key_dim = 16, .value_dim = 16, .window = 32});
  using MacchiatoLayer = latte::MacchiatoLayer<latte::Causal, latte::RGLRU>;
  const MacchiatoLayer rglru_swa(
      macchiato, model,
      MacchiatoLayer::random_weights(macchiato, model, /*seed=*/7,
                                     latte::RGLRU::Weights<float>::initial(model, /*seed=*/8)));
  for (const auto& input : rglru_swa.inputs())
    std::printf("  projects %-14s %2td per head, from %s\n", std::string(input.name).c_str(),
                input.width, input.from_mixer ? "RG-LRU(x)" : "x");
  const double gap_macchiato = forward_vs_decode(rglru_swa, x);

  // Latte-Conv: ShortConv<3> on the latent-logit path of plain causal Latte.
  const latte::LatteAttention<latte::Causal> latte({.heads = 4, .latents = 16, .value_dim = 16});
  using ConvLayer = latte::LatteLayer<latte::Causal, latte::ShortConv<3>>;
  const ConvLayer conv(latte, model,
                       ConvLayer::random_weights(latte, model, 9,
                                                 latte::ShortConv<3>::Weights<float>::identity(model)));
  const double gap_conv = forward_vs_decode(conv, x);

  // One gradient-descent step on the Latte-RGLRU-SWA layer.
  const auto target = example::random_tensor<3>(rng, {B, T, model});
  latte::Tensor<float, 3> d_out({B, T, model}), d_x({B, T, model});
  const double before = loss_and_gradient(rglru_swa, x, target, d_out);
  auto d_weights = rglru_swa.zero_weights();  // every weight's gradient accumulates here
  rglru_swa.backward(latte::exec::cpu, x.view(), d_out.view(), d_x.view(), &d_weights);
  auto stepped = rglru_swa.weights();
  descend(stepped, d_weights, 2e-2f / float(B * T));
  const MacchiatoLayer trained(macchiato, model, stepped);
  const double after = loss_and_gradient(trained, x, target, d_out);

  std::printf("Latte-RGLRU-SWA layer: %td tokens x %td sequences, forward vs decode max |diff| %.2e\n",
              T, B, gap_macchiato);
  std::printf("Latte-RGLRU-SWA layer: one gradient step, loss %.6f -> %.6f\n", before / double(B * T),
              after / double(B * T));
  std::printf("Latte-Conv layer:      %td tokens x %td sequences, forward vs decode max |diff| %.2e\n",
              T, B, gap_conv);
  return gap_macchiato < 1e-4 && gap_conv < 1e-4 && after < before ? 0 : 1;
}
