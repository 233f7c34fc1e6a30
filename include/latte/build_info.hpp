#pragma once
// What this build of latte runs on: threads, SIMD instruction set, CUDA.
// latte is header-only, so the answer belongs to the translation unit that
// asks (its compiler flags and include paths; core/config.hpp decides).
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>

#include "latte/backends/cpu/parallel.hpp"
#include "latte/backends/cpu/simd.hpp"
#include "latte/core/config.hpp"
#include "latte/version.hpp"

namespace latte {

struct BuildInfo {
  int threads = 1;                  ///< workers exec::cpu starts here (omp_get_max_threads(); 1 without OpenMP)
  bool openmp = false;              ///< exec::cpu on OpenMP threads (LATTE_WITH_OPENMP)
  bool xsimd = false;               ///< exec::cpu vectorised with xsimd (LATTE_WITH_XSIMD)
  std::string_view simd = "scalar"; ///< xsimd's instruction set, e.g. "avx512bw", "fma3+avx2"
  int float_lanes = 1;              ///< floats per SIMD vector (16 for AVX-512)
  bool cuda_backend = false;        ///< latte configured with CUDA (LATTE_WITH_CUDA)
  bool cuda_kernels = false;        ///< exec::cuda runs in this translation unit (nvcc)

  /// One line, e.g. "latte 0.1.0: exec::cpu on 2 threads (OpenMP on), SIMD avx512bw
  /// (16 floats, xsimd on), CUDA off".
  [[nodiscard]] std::string to_string() const {
    std::ostringstream line;
    line << "latte " << LATTE_VERSION_STRING << ": exec::cpu on " << threads
         << (threads == 1 ? " thread" : " threads") << " (OpenMP " << (openmp ? "on" : "off")
         << "), SIMD " << simd << " (" << float_lanes << (float_lanes == 1 ? " float" : " floats")
         << ", xsimd " << (xsimd ? "on" : "off") << "), CUDA "
         << (cuda_kernels   ? "on"
             : cuda_backend ? "built (exec::cuda runs in files nvcc compiles)"
                            : "off");
    return line.str();
  }
};

inline std::ostream& operator<<(std::ostream& out, const BuildInfo& info) {
  return out << info.to_string();
}

/// What exec::cpu and exec::cuda are built with where this is called.
[[nodiscard]] inline BuildInfo build_info() {
  BuildInfo info;
  info.threads = cpu::thread_count();
  info.openmp = LATTE_WITH_OPENMP == 1;
  info.xsimd = LATTE_WITH_XSIMD == 1;
#if LATTE_WITH_XSIMD
  info.simd = xsimd::default_arch::name();
#endif
  info.float_lanes = static_cast<int>(cpu::simd::width<float>);
#if defined(LATTE_WITH_CUDA)
  info.cuda_backend = true;
#endif
  info.cuda_kernels = LATTE_CUDA_KERNELS == 1;
  return info;
}

}  // namespace latte
