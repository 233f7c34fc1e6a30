// Global operator new / delete of fuzz_attention: allocations above the memory
// cap throw std::bad_alloc (see memory_cap.hpp); the rest go to ASan's malloc.
// Every form is replaced, so no block crosses between this allocator and ASan's
// operator delete (replacing new costs ASan its new/delete mismatch report).
#include <cstdlib>
#include <new>

#include "memory_cap.hpp"

namespace {
void* allocate(std::size_t bytes, std::size_t alignment) {
  if (bytes > static_cast<std::size_t>(latte_fuzz::kMemoryCapBytes)) throw std::bad_alloc();
  if (bytes == 0) bytes = 1;
  void* block = nullptr;
  if (alignment <= alignof(std::max_align_t)) block = std::malloc(bytes);
  else if (posix_memalign(&block, alignment, bytes) != 0) block = nullptr;
  if (block == nullptr) throw std::bad_alloc();
  return block;
}
void* allocate_or_null(std::size_t bytes, std::size_t alignment) noexcept {
  try {
    return allocate(bytes, alignment);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
}  // namespace

void* operator new(std::size_t n) { return allocate(n, 0); }
void* operator new[](std::size_t n) { return allocate(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) { return allocate(n, std::size_t(a)); }
void* operator new[](std::size_t n, std::align_val_t a) { return allocate(n, std::size_t(a)); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return allocate_or_null(n, 0); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return allocate_or_null(n, 0); }
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return allocate_or_null(n, std::size_t(a));
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return allocate_or_null(n, std::size_t(a));
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
