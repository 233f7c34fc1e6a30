#pragma once
// Tolerances of the CUDA tests, per input type (normwise relative error against
// the long-double oracle, as in tests/tolerances.hpp). fp32 inputs use the
// library-wide Tolerance<float>. For fp16 / bf16 the oracle is computed from the
// inputs as rounded to that type, so what remains is the rounding of the output
// to it (half an ulp at 1: 2^-11 for fp16, 2^-8 for bf16) plus fp32 sums; each
// bound is twice that rounding. Never loosen one to make a test pass.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tolerances.hpp"

namespace latte::test {

template <class T>
struct CudaTolerance {
  static constexpr double relative = Tolerance<T>::relative;
};
template <>
struct CudaTolerance<__half> {
  static constexpr double relative = 1e-3;  // 2 x 2^-11
};
template <>
struct CudaTolerance<__nv_bfloat16> {
  static constexpr double relative = 8e-3;  // 2 x 2^-8
};

}  // namespace latte::test
