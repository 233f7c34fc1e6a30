#pragma once
// Shape and aliasing checks shared by every entry point. Each failure is a
// latte::Error naming the argument, the layout and expected vs given extents.
#include <array>
#include <string>
#include <string_view>

#include "latte/core/error.hpp"
#include "latte/core/tensor_view.hpp"

namespace latte::detail {

/// `view` must be structurally valid and have exactly `expected` extents
/// (`layout` names the dimensions, e.g. "[B, T, H, L]").
template <class T, std::size_t N>
void check_shape(const TensorView<T, N>& view, std::string_view argument,
                 const std::array<index_t, N>& expected, std::string_view layout) {
  check_view(view, argument);
  if (view.extents() == expected) return;
  throw Error(argument, expected_given(std::string("shape ") + std::string(layout),
                                       format_extents(expected), format_extents(view.extents())));
}

/// An output must not share memory with an input.
template <class O, std::size_t N, class I, std::size_t M>
void check_no_overlap(const TensorView<O, N>& output, std::string_view output_name,
                      const TensorView<I, M>& input, std::string_view input_name) {
  if (!may_overlap(output, input)) return;
  throw Error(output_name, std::string("aliases input '") + std::string(input_name) +
                               "'; outputs must not share memory with inputs");
}

/// A size parameter must be at least one.
inline void check_positive(index_t value, std::string_view argument) {
  require(value >= 1, argument, expected_given("value", ">= 1", value));
}

}  // namespace latte::detail
