#pragma once
// Replaces the global operator new/delete of the test executable that includes
// this header (include it from exactly one .cpp) with a counting pair over
// malloc/free (aligned_alloc/free for the over-aligned forms), so a test can
// assert that a call allocates nothing:
//   const long before = latte::test::allocations.load(); ...; allocations.load() - before
#include <atomic>
#include <cstdlib>
#include <new>

namespace latte::test {
inline std::atomic<long> allocations{0};
}  // namespace latte::test

// GCC 12 cannot see that the malloc/free pair below matches.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

void* operator new(std::size_t bytes) {
  latte::test::allocations.fetch_add(1);
  if (void* p = std::malloc(bytes ? bytes : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

// The over-aligned forms too (latte::HugePageAllocator, hence latte::Tensor, uses them).
void* operator new(std::size_t bytes, std::align_val_t alignment) {
  latte::test::allocations.fetch_add(1);
  const auto align = static_cast<std::size_t>(alignment);
  const std::size_t rounded = (bytes + align - 1) / align * align;  // aligned_alloc wants a multiple
  if (void* p = std::aligned_alloc(align, rounded ? rounded : align)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

// The nothrow forms too (std::stable_sort's temporary buffer uses them): left to the
// runtime, a nothrow new would be freed by the delete above, which ASan reports as
// an alloc-dealloc mismatch.
void* operator new(std::size_t bytes, const std::nothrow_t&) noexcept {
  latte::test::allocations.fetch_add(1);
  return std::malloc(bytes ? bytes : 1);
}
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void* operator new(std::size_t bytes, std::align_val_t alignment, const std::nothrow_t&) noexcept {
  latte::test::allocations.fetch_add(1);
  const auto align = static_cast<std::size_t>(alignment);
  const std::size_t rounded = (bytes + align - 1) / align * align;
  return std::aligned_alloc(align, rounded ? rounded : align);
}
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
