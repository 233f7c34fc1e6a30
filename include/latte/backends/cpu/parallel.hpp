#pragma once
// Threads for the CPU backend: OpenMP when latte is built with it
// (LATTE_WITH_OPENMP), a serial loop otherwise. Kernels split work into
// independent tasks (heads, time segments) and run them through
// parallel_for, which also tells each task which worker runs it so that
// per-worker scratch can be allocated up front. Called from inside a caller's
// own parallel region, everything runs serially on the calling thread.
#include "latte/core/types.hpp"

#if defined(LATTE_WITH_OPENMP)
#include <omp.h>
#endif

namespace latte::cpu {

/// Workers a parallel_for started here will use.
[[nodiscard]] inline int thread_count() noexcept {
#if defined(LATTE_WITH_OPENMP)
  return omp_in_parallel() ? 1 : omp_get_max_threads();
#else
  return 1;
#endif
}

/// Calls body(i, worker) for i in [0, count), worker in [0, workers), where
/// `workers` is the value thread_count() had when the caller sized its scratch.
template <class Body>
void parallel_for(index_t count, int workers, Body&& body) {
#if defined(LATTE_WITH_OPENMP)
  if (count > 1 && workers > 1) {
#pragma omp parallel for schedule(static) num_threads(workers)
    for (index_t i = 0; i < count; ++i) body(i, omp_get_thread_num());
    return;
  }
#else
  (void)workers;  // one worker without OpenMP
#endif
  for (index_t i = 0; i < count; ++i) body(i, 0);
}

}  // namespace latte::cpu
