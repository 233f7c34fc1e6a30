#pragma once
// Memory for the arrays latte hands back to Python: large blocks in 2 MiB huge
// pages, and freed large blocks kept (up to a limit) for the next output of a
// similar size, so that a call from Python writes memory that is already
// faulted in, as a C++ caller who reuses its output does.
//
// Why: a fresh output is faulted in on its first write, page by page. With
// 4 KiB pages that cost a 64K-token Latte forward (134 MB of output) 1.9x the
// kernel's own time; 2 MiB pages brought it to 1.2x; reusing the block removes
// the faults altogether. PyTorch's CUDA caching allocator makes the same trade
// (memory held after free, `torch.cuda.empty_cache()` to give it back): here
// `latte.empty_array_cache()` and `latte.set_array_cache_limit(bytes)`.
#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <new>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace latte::python {

/// One block of an array's memory: `data`, `capacity` bytes of it usable.
struct ArrayBlock {
  void* data = nullptr;
  std::size_t capacity = 0;
};

/// The process's pool of array memory (thread-safe: an array may be freed on
/// any thread, with or without the GIL).
class ArrayMemory {
 public:
  /// Blocks from this size on are huge-page aligned and cached; smaller ones
  /// are malloc's (which keeps small blocks itself).
  static constexpr std::size_t huge_page = std::size_t{2} << 20;
  static constexpr std::size_t large_block = 2 * huge_page;
  /// The cache's limit until set_limit: freed blocks held, in bytes.
  static constexpr std::size_t default_limit = std::size_t{1} << 30;

  /// The one pool. Never destroyed: NumPy arrays (and the tensors sharing
  /// them) may be freed after static destructors have run.
  [[nodiscard]] static ArrayMemory& instance() {
    static ArrayMemory* memory = new ArrayMemory;
    return *memory;
  }

  /// A block of at least `bytes` (64-byte aligned; large ones 2 MiB aligned
  /// with MADV_HUGEPAGE). Its contents are unspecified: a reused block holds
  /// what the previous array left.
  [[nodiscard]] ArrayBlock allocate(std::size_t bytes) {
    if (bytes < large_block) {
      const std::size_t capacity = (std::max<std::size_t>(bytes, 1) + 63) / 64 * 64;
      void* data = std::aligned_alloc(64, capacity);
      if (data == nullptr) throw std::bad_alloc();
      return {data, capacity};
    }
    const std::size_t capacity = (bytes + huge_page - 1) / huge_page * huge_page;
    {
      // The smallest cached block that fits and wastes at most a quarter:
      // a 1 GiB block is not handed out for a 4 MiB array.
      const std::lock_guard lock(mutex_);
      auto best = cached_.end();
      for (auto it = cached_.begin(); it != cached_.end(); ++it)
        if (it->capacity >= capacity && it->capacity <= capacity + capacity / 4 &&
            (best == cached_.end() || it->capacity < best->capacity))
          best = it;
      if (best != cached_.end()) {
        const ArrayBlock block = *best;
        cached_.erase(best);
        cached_bytes_ -= block.capacity;
        return block;
      }
    }
    void* data = std::aligned_alloc(huge_page, capacity);
    if (data == nullptr) throw std::bad_alloc();
#if defined(__linux__)
    madvise(data, capacity, MADV_HUGEPAGE);  // advice: ignored where huge pages are off
#endif
    return {data, capacity};
  }

  /// Gives `block` back: a large one is kept for reuse (the oldest cached
  /// blocks freed to stay within the limit), a small one freed.
  void release(ArrayBlock block) noexcept {
    if (block.capacity < large_block) {
      std::free(block.data);
      return;
    }
    std::vector<void*> to_free;
    {
      const std::lock_guard lock(mutex_);
      if (block.capacity > limit_) {
        to_free.push_back(block.data);
      } else {
        try {
          cached_.push_back(block);
          cached_bytes_ += block.capacity;
        } catch (...) {  // no memory for the list's entry: free the block instead
          to_free.push_back(block.data);
        }
        trim_locked(limit_, to_free);
      }
    }
    for (void* data : to_free) std::free(data);
  }

  /// Holds at most `bytes` of freed blocks from now on (0: none).
  void set_limit(std::size_t bytes) {
    std::vector<void*> to_free;
    {
      const std::lock_guard lock(mutex_);
      limit_ = bytes;
      trim_locked(limit_, to_free);
    }
    for (void* data : to_free) std::free(data);
  }

  /// Frees every cached block (the limit stays).
  void empty() {
    std::vector<void*> to_free;
    {
      const std::lock_guard lock(mutex_);
      trim_locked(0, to_free);
    }
    for (void* data : to_free) std::free(data);
  }

  [[nodiscard]] std::size_t cached_bytes() const {
    const std::lock_guard lock(mutex_);
    return cached_bytes_;
  }
  [[nodiscard]] std::size_t limit() const {
    const std::lock_guard lock(mutex_);
    return limit_;
  }

 private:
  ArrayMemory() = default;

  /// Moves the oldest cached blocks to `to_free` until at most `bytes` are held.
  void trim_locked(std::size_t bytes, std::vector<void*>& to_free) noexcept {
    while (cached_bytes_ > bytes && !cached_.empty()) {
      try {
        to_free.push_back(cached_.front().data);
      } catch (...) {
        std::free(cached_.front().data);
      }
      cached_bytes_ -= cached_.front().capacity;
      cached_.pop_front();
    }
  }

  mutable std::mutex mutex_;
  std::deque<ArrayBlock> cached_;  // oldest first
  std::size_t cached_bytes_ = 0;
  std::size_t limit_ = default_limit;
};

}  // namespace latte::python
