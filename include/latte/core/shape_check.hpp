#pragma once
// Shape and aliasing checks shared by every entry point. Each failure is a
// latte::Error naming the argument, the layout and expected vs given extents.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

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

/// An output's elements must be distinct: ordered by stride, every dimension
/// of extent > 1 must step past the whole span of the smaller ones (so no
/// zero strides and no interleaving that would write one element twice).
template <class T, std::size_t N>
void check_distinct_elements(const TensorView<T, N>& view, std::string_view argument) {
  if (view.empty()) return;
  std::array<std::array<index_t, 2>, N> by_stride{};  // {stride, extent}
  std::size_t count = 0;
  for (std::size_t d = 0; d < N; ++d)
    if (view.extent(d) > 1) by_stride[count++] = {view.stride(d), view.extent(d)};
  for (std::size_t i = 1; i < count; ++i)  // insertion sort: N is at most 4
    for (std::size_t j = i; j > 0 && by_stride[j][0] < by_stride[j - 1][0]; --j)
      std::swap(by_stride[j], by_stride[j - 1]);
  index_t span = 1;
  for (std::size_t i = 0; i < count; ++i) {
    const auto [stride, extent] = by_stride[i];
    if (stride < span)
      throw Error(argument, "strides " + format_extents(view.strides()) + " for extents " +
                                format_extents(view.extents()) +
                                " address some elements twice; an output needs distinct elements");
    span += (extent - 1) * stride;
  }
}

/// True when a byte of some element of `output` is a byte of some element of
/// `input`. `output` must address distinct elements (check_distinct_elements):
/// its dimensions, ordered by stride, then nest (each stride passes the whole
/// span of the smaller ones), so the largest element at or below an offset is
/// found greedily, one division per dimension. The input is walked row by row
/// (its feature dimension is contiguous), only when the two byte ranges meet:
/// an output interleaved with an input (even and odd rows of one buffer) shares
/// no element and is accepted.
template <class O, std::size_t N, class I, std::size_t M>
[[nodiscard]] bool shares_element(const TensorView<O, N>& output, const TensorView<I, M>& input) {
  if (!may_overlap(output, input)) return false;
  std::array<std::array<index_t, 2>, N> by_stride{};  // {stride, extent}, largest stride first
  std::size_t dims = 0;
  for (std::size_t d = 0; d < N; ++d)
    if (output.extent(d) > 1) {
      if (output.stride(d) == 0) return true;  // not distinct: refused anyway
      by_stride[dims++] = {output.stride(d), output.extent(d)};
    }
  for (std::size_t i = 1; i < dims; ++i)  // insertion sort, largest first: N is at most 4
    for (std::size_t j = i; j > 0 && by_stride[j][0] > by_stride[j - 1][0]; --j)
      std::swap(by_stride[j], by_stride[j - 1]);
  constexpr auto out_size = static_cast<std::intptr_t>(sizeof(O));
  const auto out_first = reinterpret_cast<std::intptr_t>(output.data());
  // Whether an output element has a byte in [first, last] (addresses).
  auto meets = [&](std::intptr_t first, std::intptr_t last) {
    if (last < out_first) return false;
    index_t below = static_cast<index_t>((last - out_first) / out_size), offset = 0;
    for (std::size_t i = 0; i < dims; ++i) {
      const auto [stride, extent] = by_stride[i];
      const index_t step = std::min(below / stride, extent - 1);
      offset += step * stride;
      below -= step * stride;
    }
    return out_first + offset * out_size + out_size > first;  // that element ends past `first`
  };
  constexpr auto in_size = static_cast<std::intptr_t>(sizeof(I));
  const auto in_first = reinterpret_cast<std::intptr_t>(input.data());
  const std::intptr_t row_bytes = input.extent(M - 1) * in_size;
  std::array<index_t, M> at{};  // the row's index in the input's leading dimensions
  for (;;) {
    index_t row = 0;
    for (std::size_t d = 0; d + 1 < M; ++d) row += at[d] * input.stride(d);
    const std::intptr_t first = in_first + row * in_size;
    if (meets(first, first + row_bytes - 1)) return true;
    std::size_t d = M - 1;
    while (d > 0 && ++at[d - 1] == input.extent(d - 1)) at[--d] = 0;
    if (d == 0) return false;
  }
}

/// An output must not share an element with an input.
template <class O, std::size_t N, class I, std::size_t M>
void check_no_overlap(const TensorView<O, N>& output, std::string_view output_name,
                      const TensorView<I, M>& input, std::string_view input_name) {
  if (!shares_element(output, input)) return;
  throw Error(output_name, std::string("aliases input '") + std::string(input_name) +
                               "'; outputs must not share memory with inputs");
}

/// An input view paired with the argument name errors should use.
template <class V>
struct NamedInput {
  const V& view;
  std::string_view name;
};
template <class V>
[[nodiscard]] NamedInput<V> named(const V& view, std::string_view name) noexcept {
  return {view, name};
}

/// `out` must address distinct elements and share no memory with any input.
template <class O, std::size_t N, class... Inputs>
void check_output(const TensorView<O, N>& out, std::string_view out_name,
                  const NamedInput<Inputs>&... inputs) {
  check_distinct_elements(out, out_name);
  (check_no_overlap(out, out_name, inputs.view, inputs.name), ...);
}

/// A size parameter must be at least one.
inline void check_positive(index_t value, std::string_view argument) {
  require(value >= 1, argument, expected_given("value", ">= 1", value));
}

}  // namespace latte::detail
