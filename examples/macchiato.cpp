// Latte Macchiato: one softmax over L+1 states mixes sliding-window softmax
// attention (state 0, with RoPE on its own queries/keys) and Latte's L latent
// states. Runs a whole-sequence forward, then decodes the same tokens one at
// a time from a fresh state and checks both give the same outputs.
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
  return gap < 1e-4 ? 0 : 1;
}
