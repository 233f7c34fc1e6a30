#pragma once
// latte::HugePageAllocator<T> — a standard allocator for long-sequence buffers.
//
// Why: the time scans read [B, T, H, *] rows H * width elements apart (2 KiB
// for H = 8, width 64, fp32), so with 4 KiB pages every other token of every
// input is on a new page. Once the inputs outgrow the caches the page-table
// walks, not the arithmetic, set the pace: causal Latte B1 H8 L64 D64 on one
// core ran at 30-35 GFLOP/s at T = 64K on 4 KiB pages and 58-63 GFLOP/s on
// 2 MiB pages (bench_cpu, side by side). A prefetch further ahead recovered
// only part of it (42-44 GFLOP/s).
//
// What: an allocation of at least 2 MiB is aligned to 2 MiB and, on Linux,
// marked MADV_HUGEPAGE, so transparent huge pages back it when the system
// allows them (/sys/kernel/mm/transparent_hugepage/enabled set to "madvise"
// or "always"); elsewhere, or when the kernel declines, it is an ordinary
// aligned allocation. Smaller allocations are 64-byte aligned (a cache line,
// a full AVX-512 vector). latte::Tensor allocates through it; callers who own
// their memory can use it for theirs:
//   std::vector<float, latte::HugePageAllocator<float>> keys(T * H * L);
#include <cstddef>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace latte {

template <class T>
struct HugePageAllocator {
  using value_type = T;

  /// Allocations of this many bytes or more are aligned to it and advised as huge pages.
  static constexpr std::size_t huge_page_bytes = std::size_t{2} << 20;
  static constexpr std::size_t small_alignment = 64;

  HugePageAllocator() noexcept = default;
  template <class U>
  HugePageAllocator(const HugePageAllocator<U>&) noexcept {}  // NOLINT: rebinding is implicit

  [[nodiscard]] T* allocate(std::size_t count) {
    if (count > std::size_t(-1) / sizeof(T)) throw std::bad_array_new_length();
    const std::size_t bytes = count * sizeof(T);
    void* block = ::operator new(bytes, std::align_val_t{alignment_for(bytes)});
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    // A hint: where it fails (THP off, an old kernel) the pages stay 4 KiB.
    if (bytes >= huge_page_bytes) (void)::madvise(block, bytes, MADV_HUGEPAGE);
#endif
    return static_cast<T*>(block);
  }

  void deallocate(T* block, std::size_t count) noexcept {
    ::operator delete(block, std::align_val_t{alignment_for(count * sizeof(T))});
  }

  template <class U>
  bool operator==(const HugePageAllocator<U>&) const noexcept {
    return true;
  }

 private:
  static constexpr std::size_t alignment_for(std::size_t bytes) noexcept {
    constexpr std::size_t small = alignof(T) > small_alignment ? alignof(T) : small_alignment;
    return bytes >= huge_page_bytes ? huge_page_bytes : small;
  }
};

/// A std::vector on HugePageAllocator: 64-byte aligned, so no vector load of
/// it straddles two cache lines (std::vector's 16-byte alignment lets three
/// zmm loads in four do so), and on 2 MiB pages when large. Decode states and
/// the CPU kernels' workspaces live in these: the same Latte decode step
/// measured 2.0 to 2.7 us depending on where std::vector put its state, and
/// 2.0 us for every state once aligned.
template <class T>
using AlignedVector = std::vector<T, HugePageAllocator<T>>;

/// `count` elements on HugePageAllocator, left uninitialised: a workspace whose
/// every element is written before it is read, where AlignedVector's zeroing
/// would be a pass over memory that nothing needs (tens of MB per call for the
/// [B, T, H, D] workspaces of a backward).
template <class T>
class UninitializedBuffer {
  static_assert(std::is_trivially_default_constructible_v<T> && std::is_trivially_destructible_v<T>);

 public:
  explicit UninitializedBuffer(std::size_t count)
      : data_(count > 0 ? HugePageAllocator<T>().allocate(count) : nullptr), count_(count) {}
  UninitializedBuffer(const UninitializedBuffer&) = delete;
  UninitializedBuffer& operator=(const UninitializedBuffer&) = delete;
  UninitializedBuffer(UninitializedBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), count_(std::exchange(other.count_, 0)) {}
  UninitializedBuffer& operator=(UninitializedBuffer&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      count_ = std::exchange(other.count_, 0);
    }
    return *this;
  }
  ~UninitializedBuffer() { release(); }
  [[nodiscard]] T* data() noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return count_; }

 private:
  void release() noexcept {
    if (data_ != nullptr) HugePageAllocator<T>().deallocate(data_, count_);
  }

  T* data_;
  std::size_t count_;
};

}  // namespace latte
