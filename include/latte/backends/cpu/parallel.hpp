#pragma once
// Threads for the CPU backend: OpenMP when latte is built with it
// (LATTE_WITH_OPENMP, core/config.hpp), a serial loop otherwise. Kernels split work into
// independent tasks (heads, time segments) and run them through
// parallel_for, which also tells each task which worker runs it so that
// per-worker scratch can be allocated up front. Called from inside a caller's
// own parallel region, everything runs serially on the calling thread.
#include <algorithm>
#include <cstddef>
#include <exception>
#include <vector>

#include "latte/core/config.hpp"
#include "latte/core/types.hpp"

#if LATTE_WITH_OPENMP
#include <omp.h>
#endif

namespace latte::cpu {

/// Workers a parallel_for started here will use.
[[nodiscard]] inline int thread_count() noexcept {
#if LATTE_WITH_OPENMP
  return omp_in_parallel() ? 1 : omp_get_max_threads();
#else
  return 1;
#endif
}

/// Calls body(i, worker) for i in [0, count), worker in [0, workers), where
/// `workers` is the value thread_count() had when the caller sized its scratch.
/// A task may throw (a hook that checks what only its task computes, such as
/// the Latte backward's d_final against the recomputed running maximum): an
/// exception must not leave an OpenMP region (std::terminate), so the first one
/// is kept and rethrown here once every task has finished.
template <class Body>
void parallel_for(index_t count, int workers, Body&& body) {
#if LATTE_WITH_OPENMP
  if (count > 1 && workers > 1) {
    std::exception_ptr failure;
#pragma omp parallel for schedule(static) num_threads(workers)
    for (index_t i = 0; i < count; ++i) {
      try {
        body(i, omp_get_thread_num());
      } catch (...) {
#pragma omp critical(latte_parallel_for_failure)
        if (!failure) failure = std::current_exception();
      }
    }
    if (failure) std::rethrow_exception(failure);
    return;
  }
#else
  (void)workers;  // one worker without OpenMP
#endif
  for (index_t i = 0; i < count; ++i) body(i, 0);
}

/// Tokens each head advances before its worker moves to the next head (see below).
inline constexpr index_t interleave_tokens = 256;

/// Runs `heads` independent causal scans over [0, Tn): each worker owns a
/// contiguous range of heads and advances all of them `interleave_tokens` at
/// a time, calling body(i, carry, t0, t1, worker) with carry = begin(i),
/// which is called once per head. In [B, T, H, *] the rows of one token for
/// every head share a page; one head at a time over all of T touches a new
/// page every few tokens and, once the inputs outgrow the caches (T >= ~4K),
/// waits on TLB misses (Latte B1 H8 L64 D64 at 16K: 47.6 -> 24-26 ms).
template <class Begin, class Body>
void interleave_heads(index_t heads, index_t Tn, int workers, Begin&& begin, Body&& body) {
  const index_t groups = std::min<index_t>(heads, workers);
  parallel_for(groups, workers, [&](index_t g, int worker) {
    const index_t first = g * heads / groups, last = (g + 1) * heads / groups;
    std::vector<decltype(begin(index_t{0}))> carries;
    carries.reserve(static_cast<std::size_t>(last - first));
    for (index_t i = first; i < last; ++i) carries.push_back(begin(i));
    for (index_t t0 = 0; t0 < Tn; t0 += interleave_tokens)
      for (index_t i = first; i < last; ++i)
        body(i, carries[static_cast<std::size_t>(i - first)], t0,
             std::min(Tn, t0 + interleave_tokens), worker);
  });
}

}  // namespace latte::cpu
