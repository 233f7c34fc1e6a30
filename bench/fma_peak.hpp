#pragma once
// This machine's FMA throughput with every thread, the peak the benchmark tools
// report kernels' GFLOP/s against: 12 independent chains of simd::fma per
// thread (enough to cover the FMA latency on two pipes), on latte's own SIMD
// layer so the measured instruction is the one the kernels issue.
#include <latte/backends/cpu/simd.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>

namespace latte::bench {

/// One sample of the FMA throughput in T with every thread (GFLOP/s), ~15 ms.
template <class T>
double fma_sample_gflops() {
  namespace simd = latte::cpu::simd;
  using Batch = simd::batch<T>;
  constexpr int chains = 12;
  const long iterations = 4'000'000;
  double total_flops = 0;
  T sink = 0;
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel reduction(+ : total_flops, sink)
  {
    Batch acc[chains];
    for (int i = 0; i < chains; ++i) acc[i] = simd::broadcast(T(1e-3) * T(i));
    const Batch a = simd::broadcast(T(0.999999)), b = simd::broadcast(T(1e-7));
    for (long it = 0; it < iterations; ++it)
      for (int i = 0; i < chains; ++i) acc[i] = simd::fma(acc[i], a, b);
    for (int i = 0; i < chains; ++i) sink += simd::reduce_add(acc[i]);
    total_flops += 2.0 * double(iterations) * chains * double(simd::width<T>);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (sink == T(12345)) std::fprintf(stderr, " ");  // keeps the chains alive
  return total_flops / seconds / 1e9;
}

/// The best of `samples` samples. The best, as for the kernels' times: on a
/// shared machine one sample can land while a neighbour holds a core, and a
/// peak measured low would overstate every kernel's fraction of it.
template <class T>
double fma_peak_gflops(int samples) {
  double best = 0;
  for (int i = 0; i < samples; ++i) best = std::max(best, fma_sample_gflops<T>());
  return best;
}

}  // namespace latte::bench
