// LAVO (paper 002): local softmax over the w most recent tokens plus an
// orthogonal memory of all complete earlier windows. Runs the causal forward,
// the same tokens through step() and checks they agree; prints the state size
// (constant in the context: O(w*d + r) per head).
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
  return gap < 1e-4 ? 0 : 1;
}
