#pragma once
// Software prefetch of [B, T, H, *] rows for the time scans of the CPU backend.
//
// A scan over one (b, h) reads rows H * width elements apart: for the shapes of
// DESIGN §6 (H = 8, width 64, fp32) that is 2 KiB, so every other token starts
// a new 4 KiB page, where the hardware prefetchers stop. Once the inputs no
// longer fit in L2 (T >= ~4K) each token then waits on memory; asking for the
// rows a few tokens ahead hides that latency. Prefetches are hints: they never
// fault and change no result.
#include <cstddef>
#include <cstdint>

#include "latte/core/types.hpp"

namespace latte::cpu {

inline constexpr std::size_t cache_line_bytes = 64;

/// Where a prefetch puts the line: L1 (prefetcht0, for rows used within a few
/// tokens) or L2 only (prefetcht1, for rows used thousands of cycles later,
/// which L1 would evict first).
enum class CacheLevel { l1, l2 };

/// Asks for the cache line holding `p`. x86 uses inline asm: GCC 12 deletes
/// __builtin_prefetch when it sits alone in a loop or in a chain of three or
/// more conditionals (measured: no prefetch left in the scan's machine code).
template <CacheLevel Level = CacheLevel::l1>
inline void prefetch_line(const char* p) noexcept {
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
  if constexpr (Level == CacheLevel::l1) asm volatile("prefetcht0 %0" : : "m"(*p));
  else asm volatile("prefetcht1 %0" : : "m"(*p));
#elif defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 0, Level == CacheLevel::l1 ? 3 : 2);
#else
  (void)p;
#endif
}

/// Hints that the `bytes` bytes from `row` will be used soon (read or written):
/// every cache line they touch, from the first byte's to the last byte's. A row
/// that does not start on a line (NumPy's and malloc's large arrays start 16
/// bytes past one) touches one line more than bytes / 64; left unrequested, that
/// line was a demand miss per row and token: causal Latte and linear attention
/// ran 1.2-1.3x slower on such arrays (T = 16K, fp32).
template <CacheLevel Level = CacheLevel::l1>
inline void prefetch_row(const void* row, std::size_t bytes) noexcept {
  if (bytes == 0) return;
  const auto first = reinterpret_cast<std::uintptr_t>(row) & ~std::uintptr_t{cache_line_bytes - 1};
  const auto last = reinterpret_cast<std::uintptr_t>(row) + (bytes - 1);
  for (std::uintptr_t line = first; line <= last; line += cache_line_bytes)
    prefetch_line<Level>(reinterpret_cast<const char*>(line));
}

/// Hints the row of token t of (b, h) in each [B, T, H, *] view.
template <CacheLevel Level = CacheLevel::l1, class... Views>
inline void prefetch_token_rows(index_t b, index_t t, index_t h, const Views&... views) noexcept {
  (prefetch_row<Level>(views.row(b, t, h),
                       sizeof(*views.data()) * static_cast<std::size_t>(views.extent(3))),
   ...);
}

/// The rows of tokens [c0 + block, c0 + 2 block) (those before `end`) of (b, h)
/// into L2: what a blocked pass reads next while it runs the block at c0. A
/// head's rows are H * width elements apart, where the hardware prefetchers
/// stop (the bidirectional passes at B1 H8 L64 D64, T = 16K, 2 threads: Latte's
/// backward 54.2 -> 47.7 ms, the linear family's forward 24.1 -> 19.9 ms).
template <class... Views>
inline void prefetch_next_block(index_t b, index_t h, index_t c0, index_t block, index_t end,
                                const Views&... views) noexcept {
  for (index_t t = c0 + block; t < end && t < c0 + 2 * block; ++t)
    prefetch_token_rows<CacheLevel::l2>(b, t, h, views...);
}

}  // namespace latte::cpu
