#pragma once
// Arrays between Python and latte's views: any object nanobind's ndarray takes
// (NumPy, DLPack: PyTorch, JAX, ...) on the CPU, read in place (strides
// included, no copy), with latte::Error for what latte would refuse and for
// what only Python can get wrong (dtype, rank, a read-only out).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "array_memory.hpp"
#include "latte/core/error.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"

namespace latte::python {

namespace nb = nanobind;

/// Any CPU array, read-only, any dtype and rank: checked by hand below, so that
/// a wrong one gets latte's message naming the argument, not nanobind's
/// overload listing.
using AnyArray = nb::ndarray<nb::ro, nb::device::cpu>;
/// The same, writable (an `out` argument).
using WritableArray = nb::ndarray<nb::device::cpu>;
/// What latte returns: NumPy arrays owning their memory.
template <Real T>
using NumpyArray = nb::ndarray<nb::numpy, T>;

enum class Dtype { float32, float64 };

[[nodiscard]] inline std::string dtype_name(const nb::dlpack::dtype& dtype) {
  using Code = nb::dlpack::dtype_code;
  const char* kind = dtype.code == static_cast<std::uint8_t>(Code::Float)   ? "float"
                     : dtype.code == static_cast<std::uint8_t>(Code::Int)   ? "int"
                     : dtype.code == static_cast<std::uint8_t>(Code::UInt)  ? "uint"
                     : dtype.code == static_cast<std::uint8_t>(Code::Bfloat) ? "bfloat"
                     : dtype.code == static_cast<std::uint8_t>(Code::Bool)  ? "bool"
                                                                             : "complex";
  return std::string(kind) + std::to_string(dtype.bits);
}

[[nodiscard]] inline const char* dtype_name(Dtype dtype) {
  return dtype == Dtype::float32 ? "float32" : "float64";
}

/// float32 or float64, else latte::Error naming `argument`.
[[nodiscard]] inline Dtype dtype_of(const AnyArray& array, const char* argument) {
  if (array.dtype() == nb::dtype<float>()) return Dtype::float32;
  if (array.dtype() == nb::dtype<double>()) return Dtype::float64;
  throw Error(argument, detail::expected_given("dtype", "float32 or float64", dtype_name(array.dtype())));
}

/// A view of `array` as [extents] of T, in place. `layout` names the axes for
/// the message ("[B, T, H, L]"); the shapes themselves are latte's to check.
template <Real T, std::size_t N>
[[nodiscard]] TensorView<const T, N> view_of(const AnyArray& array, const char* argument,
                                             const char* layout, Dtype expected) {
  if (dtype_of(array, argument) != expected)
    throw Error(argument, detail::expected_given("dtype (that of the first input)", dtype_name(expected),
                                                 dtype_name(array.dtype())));
  if (array.ndim() != N)
    throw Error(argument, detail::expected_given(std::string("rank of ") + layout, N, array.ndim()));
  std::array<index_t, N> extents{}, strides{};
  for (std::size_t d = 0; d < N; ++d) {
    extents[d] = static_cast<index_t>(array.shape(d));
    strides[d] = static_cast<index_t>(array.stride(d));
  }
  // A size-1 axis may come with any stride (NumPy and PyTorch choose freely):
  // latte wants the last one to be 1.
  if (N > 0 && extents[N - 1] == 1) strides[N - 1] = 1;
  // An empty array addresses no element, and NumPy gives it strides of 0:
  // any strides will do, C order's are what latte expects.
  if (std::find(extents.begin(), extents.end(), index_t{0}) != extents.end()) {
    index_t stride = 1;
    for (std::size_t d = N; d-- > 0;) {
      strides[d] = stride;
      stride *= std::max<index_t>(extents[d], 1);
    }
  }
  return TensorView<const T, N>(static_cast<const T*>(array.data()), extents, strides);
}

/// `out` as a writable view: refused when read-only.
template <Real T, std::size_t N>
[[nodiscard]] TensorView<T, N> writable_view_of(nb::handle out, const char* argument,
                                                const char* layout, Dtype expected) {
  WritableArray writable;
  if (!nb::try_cast(out, writable)) {
    AnyArray readable;
    if (nb::try_cast(out, readable))
      throw Error(argument, "expected a writable array, given a read-only one");
    throw Error(argument, "expected a float32 or float64 array on the CPU, given " +
                              nb::cast<std::string>(nb::str(out.type())));
  }
  const auto view = view_of<T, N>(AnyArray(writable), argument, layout, expected);
  return TensorView<T, N>(const_cast<T*>(view.data()), view.extents(), view.strides());
}

/// A NumPy array of `shape` (any rank), uninitialised, owning its memory
/// (array_memory.hpp's: given back to its cache when the array is freed).
template <Real T>
[[nodiscard]] NumpyArray<T> new_array(std::span<const std::size_t> shape) {
  std::size_t count = 1;
  for (const std::size_t extent : shape) count *= extent;
  auto block = std::make_unique<ArrayBlock>();
  *block = ArrayMemory::instance().allocate(count * sizeof(T));
  T* data = static_cast<T*>(block->data);
  nb::capsule owner(block.get(), [](void* p) noexcept {
    const std::unique_ptr<ArrayBlock> freed(static_cast<ArrayBlock*>(p));
    ArrayMemory::instance().release(*freed);
  });
  block.release();  // the capsule owns it now
  return NumpyArray<T>(data, shape.size(), shape.data(), owner);
}

/// A NumPy array of `extents`, uninitialised, owning its memory (freed with the array).
template <Real T, std::size_t N>
[[nodiscard]] NumpyArray<T> new_array(const std::array<index_t, N>& extents) {
  std::array<std::size_t, N> shape{};
  for (std::size_t d = 0; d < N; ++d) shape[d] = static_cast<std::size_t>(extents[d]);
  return new_array<T>(std::span<const std::size_t>(shape));
}

/// Copies `array` (of T, any rank and strides) into `into`, in C order.
template <Real T>
void copy_elements(const AnyArray& array, T* into) {
  const auto* data = static_cast<const T*>(array.data());
  std::vector<std::size_t> index(array.ndim(), 0);
  for (std::size_t i = 0; i < array.size(); ++i) {
    std::int64_t offset = 0;
    for (std::size_t d = 0; d < index.size(); ++d) offset += static_cast<std::int64_t>(index[d]) * array.stride(d);
    into[i] = data[offset];
    for (std::size_t d = index.size(); d-- > 0;) {
      if (++index[d] < array.shape(d)) break;
      index[d] = 0;
    }
  }
}

/// A writable view of a NumPy array new_array made.
template <Real T, std::size_t N>
[[nodiscard]] TensorView<T, N> view_of_new(NumpyArray<T>& array) {
  std::array<index_t, N> extents{};
  for (std::size_t d = 0; d < N; ++d) extents[d] = static_cast<index_t>(array.shape(d));
  return TensorView<T, N>(array.data(), extents);
}

/// The Dtype of float / double.
template <Real T>
inline constexpr Dtype dtype_v = std::is_same_v<T, float> ? Dtype::float32 : Dtype::float64;

/// A call's output: `out` as given (checked writable, of T and `layout`), or a
/// new array of `extents`; the object to hand back and a view to write.
template <Real T, std::size_t R>
[[nodiscard]] std::pair<nb::object, TensorView<T, R>> output_array(std::optional<nb::handle> out,
                                                                   const std::array<index_t, R>& extents,
                                                                   const char* layout) {
  if (out) return {nb::borrow(*out), writable_view_of<T, R>(*out, "out", layout, dtype_v<T>)};
  auto array = new_array<T, R>(extents);
  const auto view = view_of_new<T, R>(array);
  return {nb::cast(std::move(array)), view};
}

}  // namespace latte::python
