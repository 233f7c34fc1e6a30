#pragma once
// Every linear-attention oracle case runs on both backends: exec::reference
// (the readable recurrences) and exec::cpu (the SIMD/threaded kernels), each
// checked against the same long-double oracle (not against each other).
#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>

#include "linear_support.hpp"

namespace latte::test {

/// One case's outputs on both backends and its oracle.
template <class T>
struct BackendOutputs {
  Tensor<T, 4> reference, cpu;
  TensorLD<4> oracle;
};

/// Runs call(exec, out_view) on exec::reference and on exec::cpu, each into a
/// fresh output of `extents`; returns {reference, cpu}.
template <class T, class Call>
std::pair<Tensor<T, 4>, Tensor<T, 4>> on_both_backends(const std::array<index_t, 4>& extents,
                                                       Call&& call) {
  Tensor<T, 4> reference(extents), cpu(extents);
  call(exec::reference, reference.view());
  call(exec::cpu, cpu.view());
  return {std::move(reference), std::move(cpu)};
}

/// run_oracle_cases for both backends: make_case(rng, c, about) returns
/// BackendOutputs; the reference output goes through run_oracle_cases (its
/// [oracle] line), the cpu output is checked here against the same oracle
/// and tolerance and gets its own [oracle] line.
template <class T, class MakeCase>
void run_backend_cases(const std::string& label, const char* direction, std::uint64_t seed,
                       int cases, MakeCase&& make_case) {
  double worst_cpu = 0;
  run_oracle_cases<T>(label, direction, seed, cases, [&](Rng& rng, int c, std::string& about) {
    BackendOutputs<T> outputs = make_case(rng, c, about);
    const double error = relative_error(outputs.cpu, outputs.oracle);
    CHECK_MESSAGE(error <= Tolerance<T>::relative,
                  label << " " << std::string(direction) << " exec::cpu case " << c << " "
                        << about << " error=" << error);
    worst_cpu = std::max(worst_cpu, error);
    return std::pair{std::move(outputs.reference), std::move(outputs.oracle)};
  });
  std::printf("[oracle] %-58s %-13s %s exec::cpu       max_rel_error=%.3e (tol %.0e)\n",
              label.c_str(), direction, dtype_name<T>(), worst_cpu, Tolerance<T>::relative);
}

}  // namespace latte::test
