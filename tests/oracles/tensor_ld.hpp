#pragma once
#include "latte/core/tensor.hpp"

namespace latte::test {
/// Oracle outputs are computed and stored in long double.
template <std::size_t N>
using TensorLD = Tensor<long double, N>;
}  // namespace latte::test
