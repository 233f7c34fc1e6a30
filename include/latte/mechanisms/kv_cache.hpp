#pragma once
// KVCache<T>: the decode state of exact softmax attention — the keys and
// values seen so far, in a ring of `capacity` slots per (batch, head).
// With SlidingWindow{left} the ring holds left + 1 tokens and never fills;
// without a window it holds the whole context and a step past `capacity`
// is an error. Memory and step time grow with the context: this is the
// baseline Latte's constant-size state is measured against.
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "latte/backends/reference/softmax.hpp"
#include "latte/core/checked_size.hpp"
#include "latte/core/state_storage.hpp"
#include "latte/core/types.hpp"

namespace latte {

template <Real T>
class KVCache final : public StateStorage<T> {
 public:
  KVCache() = default;

  /// Prefer SoftmaxAttention::make_state, which sets `kind` and the sizes.
  KVCache(std::string kind, index_t batch, index_t heads, index_t key_dim, index_t value_dim,
          index_t capacity)
      : StateStorage<T>(std::move(kind), sizes_for(batch, heads, key_dim, value_dim, capacity),
                        fields_for(batch, heads, key_dim, value_dim, capacity), 0) {}

  static std::vector<StateSize> sizes_for(index_t batch, index_t heads, index_t key_dim,
                                          index_t value_dim, index_t capacity) {
    return {{"batch", batch},
            {"heads", heads},
            {"key_dim", key_dim},
            {"value_dim", value_dim},
            {"capacity", capacity}};
  }
  static std::vector<StateField> fields_for(index_t batch, index_t heads, index_t key_dim,
                                            index_t value_dim, index_t capacity) {
    detail::checked_count<T>(
        "batch", {batch, heads, capacity, detail::checked_sum("key_dim", {key_dim, value_dim})});
    const auto slots = static_cast<std::size_t>(batch * heads * capacity);
    return {{"keys", slots * static_cast<std::size_t>(key_dim)},
            {"values", slots * static_cast<std::size_t>(value_dim)}};
  }

  [[nodiscard]] index_t heads() const noexcept { return this->size_of("heads"); }
  [[nodiscard]] index_t key_dim() const noexcept { return this->size_of("key_dim"); }
  [[nodiscard]] index_t value_dim() const noexcept { return this->size_of("value_dim"); }
  [[nodiscard]] index_t capacity() const noexcept { return this->size_of("capacity"); }

  [[nodiscard]] reference::KVSlots<T> slots(index_t b, index_t h) noexcept {
    const index_t head = b * heads() + h;
    return {this->field(0) + head * capacity() * key_dim(),
            this->field(1) + head * capacity() * value_dim()};
  }

  /// This cache, then the tokens of `later`, a cache of the same attention and
  /// sizes that started empty at this cache's position (SoftmaxAttention::
  /// make_state, advanced there; then forward or absorb): later's slots of its
  /// own tokens (the last `capacity` of them) are laid over this cache's, as
  /// those tokens' steps would have written them. Associative; with a window
  /// the ring then holds the window before the next token whatever number of
  /// caches it spans (latte/distributed/'s merge).
  void append_state(const KVCache& later) {
    const std::int64_t first = this->position(), end = later.position();
    this->append_position(later);  // checks kind, sizes and order
    const index_t slots_held = capacity(), Dk = key_dim(), Dv = value_dim();
    const T* later_keys = later.field(0);
    const T* later_values = later.field(1);
    for (index_t head = 0; head < this->batch() * heads(); ++head)
      for (std::int64_t p = std::max(first, end - slots_held); p < end; ++p) {
        const auto slot = static_cast<index_t>(p % slots_held);
        const index_t at = head * slots_held + slot;
        std::copy_n(later_keys + at * Dk, Dk, this->field(0) + at * Dk);
        std::copy_n(later_values + at * Dv, Dv, this->field(1) + at * Dv);
      }
  }
};

}  // namespace latte
