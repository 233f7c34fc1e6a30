// The linear-attention family: elu+1 linear attention, cosFormer (M = the
// length) and LeaPformer with given proportions, each run whole and then step
// by step from a fresh state; prints the largest forward/step difference.
//   linear_family [--tokens N]
#include "example_support.hpp"

template <class Attention, class... Extra>
double forward_vs_steps(const Attention& attn, latte::Tensor<float, 4>& q, latte::Tensor<float, 4>& k,
                        latte::Tensor<float, 4>& v) {
  const latte::index_t B = q.extent(0), T = q.extent(1), H = q.extent(2), D = v.extent(3);
  latte::Tensor<float, 4> whole({B, T, H, D}), stepped({B, T, H, D});
  attn.forward(latte::exec::reference, q, k, v, whole.view());
  auto state = attn.template make_state<float>(B);
  for (latte::index_t t = 0; t < T; ++t)
    attn.step(latte::exec::reference, state, example::at_time<const float>(q, t),
              example::at_time<const float>(k, t), example::at_time<const float>(v, t),
              example::at_time<float>(stepped, t));
  return example::max_difference(whole, stepped);
}

int main(int argc, char** argv) {
  const latte::index_t T = example::tokens_flag(argc, argv, 2048), B = 1, H = 4, D = 32;
  std::mt19937 rng(4);
  auto q = example::random_tensor<4>(rng, {B, T, H, D}, 0.5f);
  auto k = example::random_tensor<4>(rng, {B, T, H, D}, 0.5f);
  auto v = example::random_tensor<4>(rng, {B, T, H, D});
  const latte::LinearAttention<latte::Causal, latte::EluPlusOne> linear({H, D, D});
  const latte::CosFormer<latte::Causal> cosformer({H, D, D}, {.reweight = {.length = T}});
  const double linear_gap = forward_vs_steps(linear, q, k, v);
  const double cosformer_gap = forward_vs_steps(cosformer, q, k, v);
  std::printf("LinearAttention<Causal, EluPlusOne>: forward vs step max |diff| %.2e\n", linear_gap);
  std::printf("CosFormer<Causal> (M = %td):           forward vs step max |diff| %.2e\n", T,
              cosformer_gap);
  return std::max(linear_gap, cosformer_gap) < 1e-4 ? 0 : 1;
}
