#pragma once
// Eigen interop: view Eigen storage as latte tensors and latte heads as Eigen matrices.
#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

#include "latte/core/tensor_view.hpp"

namespace latte {

/// A [B, T, H, D] view of a row-major Eigen::TensorMap (no copy).
template <class T, int Options>
  requires((Options & Eigen::RowMajor) != 0)
[[nodiscard]] TensorView<T, 4> view(const Eigen::TensorMap<Eigen::Tensor<T, 4, Options>>& map) {
  return TensorView<T, 4>(map.data(), {map.dimension(0), map.dimension(1), map.dimension(2),
                                       map.dimension(3)});
}

/// A [B, T, H, D] view of a row-major Eigen::Tensor (no copy).
template <class T, int Options>
  requires((Options & Eigen::RowMajor) != 0)
[[nodiscard]] TensorView<T, 4> view(Eigen::Tensor<T, 4, Options>& tensor) {
  return TensorView<T, 4>(tensor.data(), {tensor.dimension(0), tensor.dimension(1),
                                          tensor.dimension(2), tensor.dimension(3)});
}

template <class T>
using HeadMatrix =
    Eigen::Map<Eigen::Matrix<std::remove_const_t<T>, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>,
               Eigen::Unaligned, Eigen::OuterStride<>>;
template <class T>
using ConstHeadMatrix =
    Eigen::Map<const Eigen::Matrix<std::remove_const_t<T>, Eigen::Dynamic, Eigen::Dynamic,
                                   Eigen::RowMajor>,
               Eigen::Unaligned, Eigen::OuterStride<>>;

/// The T x D matrix of one (batch, head) of a [B, T, H, D] view, as an Eigen::Map
/// (rows are time steps; the outer stride is the view's time stride).
template <class T>
[[nodiscard]] auto head_matrix(const TensorView<T, 4>& tensor, index_t batch, index_t head) {
  using Map = std::conditional_t<std::is_const_v<T>, ConstHeadMatrix<T>, HeadMatrix<T>>;
  return Map(tensor.data() + batch * tensor.stride(0) + head * tensor.stride(2), tensor.extent(1),
             tensor.extent(3), Eigen::OuterStride<>(tensor.stride(1)));
}

}  // namespace latte
