#pragma once
// Index type and the floating-point types latte computes in.
#include <concepts>
#include <cstddef>
#include <type_traits>

namespace latte {

/// Signed index used for every extent and stride (as in Eigen and mdspan's default).
using index_t = std::ptrdiff_t;

/// The element types the kernels accept. State and accumulation use the same
/// type (fp32 or fp64); narrower inputs arrive with the CUDA backend.
template <class T>
concept Real = std::same_as<std::remove_const_t<T>, float> ||
               std::same_as<std::remove_const_t<T>, double>;

/// Human-readable dtype names for error messages and state headers.
template <Real T>
constexpr const char* dtype_name() noexcept {
  if constexpr (std::same_as<std::remove_const_t<T>, float>) return "float32";
  else return "float64";
}

}  // namespace latte
