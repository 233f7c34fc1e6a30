#pragma once
// latte::SoftmaxGradients<T> — where SoftmaxAttention::backward writes the
// gradients of a loss with respect to the forward's inputs: d_queries and
// d_keys [B, T, H, Dk], d_values [B, T, H, Dv]. All three are overwritten
// (not accumulated into); each is named after the input it differentiates.
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"

namespace latte {

template <Real T>
struct SoftmaxGradients {
  TensorView<T, 4> d_queries;
  TensorView<T, 4> d_keys;
  TensorView<T, 4> d_values;
};

}  // namespace latte
