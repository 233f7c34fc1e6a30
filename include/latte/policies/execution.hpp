#pragma once
// Execution tags: the first argument of every entry point, like std::execution.
#include <concepts>
#include <string>

namespace latte::exec {

/// Scalar loops: the readable definition of every mechanism.
struct reference_t {
  static constexpr const char* name = "reference";
};
/// xsimd + OpenMP kernels (the default). Compile with -march=native (or the
/// target's -m flags) for wide SIMD.
struct cpu_t {
  static constexpr const char* name = "cpu";
};
/// CUDA kernels over device pointers. Reserved: the CUDA backend is not built yet.
struct cuda_t {
  static constexpr const char* name = "cuda";
};

inline constexpr reference_t reference{};
/// The execution policy used when none is named.
using default_t = cpu_t;
inline constexpr cpu_t cpu{};
inline constexpr cuda_t cuda{};

template <class E>
concept Policy = std::same_as<E, reference_t> || std::same_as<E, cpu_t> || std::same_as<E, cuda_t>;

/// Whether a backend is available in this build.
template <Policy E>
inline constexpr bool implemented = std::same_as<E, reference_t> || std::same_as<E, cpu_t>;

}  // namespace latte::exec

namespace latte {

/// The answer of supports(): ok, or a sentence saying why not.
struct Support {
  bool ok = true;
  std::string reason;
  explicit operator bool() const noexcept { return ok; }
};

/// Whether `exec` can run in this build.
template <exec::Policy E>
[[nodiscard]] Support supports(E) {
  if constexpr (exec::implemented<E>) {
    return {};
  } else {
    return {false, std::string("the '") + E::name +
                       "' backend is not implemented in this version of latte; use "
                       "latte::exec::cpu or latte::exec::reference"};
  }
}

}  // namespace latte
