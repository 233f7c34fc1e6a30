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
};
template <>
struct Tolerance<double> {
  static constexpr double relative = 1e-12;  // ~4500 ulp(1): same sums in fp64
};

}  // namespace latte::test
