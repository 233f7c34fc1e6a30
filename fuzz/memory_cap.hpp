// The fuzz harness's memory cap, in place of a cap on sizes.
//
// fuzz_attention replaces the global operator new (memory_cap.cpp): one
// allocation of more than kMemoryCapBytes throws std::bad_alloc instead of
// allocating (ASan's own operator new cannot throw: with allocator_may_return_null
// it still aborts), smaller ones go to malloc, which ASan still instruments.
// So the harness can hand latte any size, up to 2^62 and past it, and a call
// ends in one of three ways that `demand` tells apart from the harness's own
// overflow-checked product of the sizes of a buffer the call cannot avoid
// allocating (a lower bound: the library may allocate more, never less):
//   overflows  the byte count does not fit in int64: only a latte::Error is right;
//   over_cap   it fits but exceeds the cap: a latte::Error or std::bad_alloc;
//   fits       a latte::Error or a return; std::bad_alloc here means a size
//              computed wrong (a wrapped product), and stops the run.
#pragma once
#include <cstddef>
#include <cstdint>
#include <initializer_list>

namespace latte_fuzz {

/// The largest single allocation the harness's operator new makes.
inline constexpr std::int64_t kMemoryCapBytes = std::int64_t{64} << 20;

enum class Demand { fits, over_cap, overflows };

/// What a buffer of `element_bytes` times the product of `extents` asks of the
/// allocator. A non-positive extent makes the call invalid (validation must
/// refuse it) or the buffer empty: fits.
inline Demand demand(std::initializer_list<std::int64_t> extents, std::int64_t element_bytes) {
  for (std::int64_t e : extents)
    if (e <= 0) return Demand::fits;
  std::int64_t bytes = element_bytes;
  for (std::int64_t e : extents)
    if (__builtin_mul_overflow(bytes, e, &bytes)) return Demand::overflows;
  return bytes > kMemoryCapBytes ? Demand::over_cap : Demand::fits;
}
/// The stronger of two demands (a call that allocates both buffers).
inline Demand operator|(Demand a, Demand b) { return a > b ? a : b; }

}  // namespace latte_fuzz
