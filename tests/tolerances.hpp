#pragma once
// The one place tolerances live. Errors are normwise relative errors against
// the long-double oracle: max |out - oracle| / max |oracle| over a whole output.
// Never loosen one of these to make a test pass; fix the kernel.
namespace latte::test {

template <class T>
struct Tolerance;

template <>
struct Tolerance<float> {
  static constexpr double relative = 2e-5;  // ~170 ulp(1): sums of up to 1000 terms in fp32
  // Gradients against central differences of the oracle's loss: a backward
  // sums T terms twice (a forward recompute, then a reverse sum) and subtracts
  // nearly equal terms (dq = p (dp - <g, o>)), so ~5x the forward's bound.
  static constexpr double gradient = 1e-4;
};
template <>
struct Tolerance<double> {
  static constexpr double relative = 1e-12;  // ~4500 ulp(1): same sums in fp64
  // The reference gradients (tests/gradient_check.hpp) are good to ~1e-13 of
  // the gradient's norm: central differences with one Richardson step.
  static constexpr double gradient = 1e-10;
};

}  // namespace latte::test
