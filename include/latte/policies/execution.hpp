#pragma once
// Execution tags: the first argument of every entry point, like std::execution.
#include <concepts>
#include <string>

// The CUDA kernels are .cuh templates: they exist only in a translation unit
// compiled by nvcc with LATTE_WITH_CUDA (LATTE_CUDA_KERNELS, core/config.hpp).
// Anywhere else exec::cuda is a tag whose use fails to compile with a
// static_assert that says so, never with a link error.
#include "latte/core/config.hpp"

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
/// CUDA kernels over device pointers: every TensorView passed with this tag
/// addresses device memory (the caller promises it). Work is queued on `stream`
/// (a cudaStream_t held opaquely so that host-only code can name the tag;
/// null = the legacy default stream) and the call returns without waiting:
///   attn.forward(latte::exec::cuda.on(stream), q, k, v, out);
/// Errors of the CUDA runtime surface as latte::Error carrying CUDA's message.
struct cuda_t {
  static constexpr const char* name = "cuda";
  void* stream = nullptr;  ///< a cudaStream_t
  /// The same tag queueing on `s` (any cudaStream_t converts to void*).
  [[nodiscard]] constexpr cuda_t on(void* s) const noexcept { return cuda_t{s}; }
};

inline constexpr reference_t reference{};
/// The execution policy used when none is named.
using default_t = cpu_t;
inline constexpr cpu_t cpu{};
inline constexpr cuda_t cuda{};

template <class E>
concept Policy = std::same_as<E, reference_t> || std::same_as<E, cpu_t> || std::same_as<E, cuda_t>;

/// Whether a backend is available in this translation unit: exec::cuda only
/// when it is compiled by nvcc with LATTE_WITH_CUDA.
template <Policy E>
inline constexpr bool implemented =
    std::same_as<E, reference_t> || std::same_as<E, cpu_t> ||
    (std::same_as<E, cuda_t> && LATTE_CUDA_KERNELS == 1);

/// True for exec::cuda in a translation unit that cannot run it; mechanisms
/// static_assert on it with the message below (a string literal, as
/// static_assert requires):
///   "latte::exec::cuda needs this file compiled by nvcc with LATTE_WITH_CUDA ..."
template <Policy E>
inline constexpr bool cuda_unavailable = std::same_as<E, cuda_t> && LATTE_CUDA_KERNELS == 0;

}  // namespace latte::exec

namespace latte {

/// The answer of supports(): ok, or a sentence saying why not.
struct Support {
  bool ok = true;
  std::string reason;
  explicit operator bool() const noexcept { return ok; }
};

/// Whether `exec` can run in this translation unit. For exec::cuda this says
/// whether the kernels were compiled in; whether a device is present is a
/// run-time question (cudaGetDeviceCount), and which mechanisms and shapes the
/// CUDA kernels take is said by latte::cuda::supports_* in backends/cuda/.
template <exec::Policy E>
[[nodiscard]] Support supports(E) {
  if constexpr (exec::implemented<E>) {
    return {};
  } else if constexpr (std::same_as<E, exec::cuda_t>) {
    return {false,
            "the 'cuda' backend is not implemented in this translation unit: compile it with "
            "nvcc and LATTE_WITH_CUDA (CMake sets it when a CUDA toolkit is found), or use "
            "latte::exec::cpu or latte::exec::reference"};
  } else {
    return {false, std::string("the '") + E::name +
                       "' backend is not implemented in this version of latte; use "
                       "latte::exec::cpu or latte::exec::reference"};
  }
}

}  // namespace latte
