#pragma once
// What the CPU and CUDA backends are built with, decided once for every header.
//
//   LATTE_WITH_OPENMP  1: exec::cpu runs on OpenMP threads; 0: serially.
//                      Left undefined: 1 when the compiler's OpenMP is on
//                      (_OPENMP, e.g. g++ -fopenmp), as Eigen decides.
//   LATTE_WITH_XSIMD   1: exec::cpu is vectorised with xsimd; 0: one-lane scalar.
//                      Left undefined: 1 when <xsimd/xsimd.hpp> is on the include path.
//
// Define either to 0 to opt out (CMake's -DLATTE_WITH_OPENMP=OFF / -DLATTE_WITH_XSIMD=OFF
// put =0 on latte::latte). After this header both are 0 or 1: test them with #if, never
// with #ifdef. latte::build_info() (latte/build_info.hpp) reports what was decided.
//
//   LATTE_CUDA_KERNELS 1 in a translation unit that nvcc compiles with LATTE_WITH_CUDA
//                      (CMake defines it on latte::latte when a CUDA toolkit is found):
//                      only there do the .cuh kernels exist and exec::cuda run.
//                      (LATTE_CUDA_HOST_EMULATION: latte's own CUDA tests compiled as
//                      host C++ against tests/cuda_host/, never a user's build.)

#if !defined(LATTE_WITH_OPENMP)
#if defined(_OPENMP)
#define LATTE_WITH_OPENMP 1
#else
#define LATTE_WITH_OPENMP 0
#endif
#endif
#if LATTE_WITH_OPENMP && !defined(_OPENMP) && !defined(__CUDACC__)
#error "LATTE_WITH_OPENMP=1 needs the compiler's OpenMP (g++/clang++ -fopenmp); define LATTE_WITH_OPENMP=0 to build without threads"
#endif

#if !defined(LATTE_WITH_XSIMD)
#if defined(__has_include)
#if __has_include(<xsimd/xsimd.hpp>)
#define LATTE_WITH_XSIMD 1
#endif
#endif
#if !defined(LATTE_WITH_XSIMD)
#define LATTE_WITH_XSIMD 0
#endif
#endif

#if (defined(__CUDACC__) && defined(LATTE_WITH_CUDA)) || defined(LATTE_CUDA_HOST_EMULATION)
#define LATTE_CUDA_KERNELS 1
#else
#define LATTE_CUDA_KERNELS 0
#endif
