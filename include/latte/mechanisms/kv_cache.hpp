#pragma once
// KVCache<T>: the decode state of exact softmax attention — the keys and
// values seen so far, in a ring of `capacity` slots per (batch, head).
// With SlidingWindow{left} the ring holds left + 1 tokens and never fills;
// without a window it holds the whole context and a step past `capacity`
// is an error. Memory and step time grow with the context: this is the
// baseline Latte's constant-size state is measured against.
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "latte/backends/reference/softmax.hpp"
#include "latte/core/state_bytes.hpp"
#include "latte/core/types.hpp"

namespace latte {

template <Real T>
class KVCache {
 public:
  KVCache() = default;

  /// Prefer SoftmaxAttention::make_state, which sets `kind` and the sizes.
  KVCache(std::string kind, index_t batch, index_t heads, index_t key_dim, index_t value_dim,
          index_t capacity)
      : kind_(std::move(kind)),
        batch_(batch),
        heads_(heads),
        key_dim_(key_dim),
        value_dim_(value_dim),
        capacity_(capacity),
        keys_(static_cast<std::size_t>(batch * heads * capacity * key_dim)),
        values_(static_cast<std::size_t>(batch * heads * capacity * value_dim)) {}

  [[nodiscard]] index_t batch() const noexcept { return batch_; }
  [[nodiscard]] index_t heads() const noexcept { return heads_; }
  [[nodiscard]] index_t key_dim() const noexcept { return key_dim_; }
  [[nodiscard]] index_t value_dim() const noexcept { return value_dim_; }
  [[nodiscard]] index_t capacity() const noexcept { return capacity_; }
  /// Tokens absorbed so far (the position of the next token).
  [[nodiscard]] std::int64_t position() const noexcept { return position_; }
  [[nodiscard]] const std::string& kind() const noexcept { return kind_; }
  [[nodiscard]] std::size_t bytes() const noexcept {
    return (keys_.size() + values_.size()) * sizeof(T);
  }

  [[nodiscard]] std::vector<std::byte> save() const {
    detail::ByteWriter writer(kind_);
    for (index_t extent : {batch_, heads_, key_dim_, value_dim_, capacity_})
      writer.write<std::int64_t>(extent);
    writer.write<std::int64_t>(position_);
    writer.write_array<T>(keys_);
    writer.write_array<T>(values_);
    return std::move(writer).finish();
  }

  void restore(std::span<const std::byte> bytes) {
    detail::ByteReader reader(bytes, kind_);
    for (auto [extent, name] :
         {std::pair{batch_, "batch"}, std::pair{heads_, "heads"}, std::pair{key_dim_, "key_dim"},
          std::pair{value_dim_, "value_dim"}, std::pair{capacity_, "capacity"}}) {
      const auto saved = reader.read<std::int64_t>();
      detail::require(saved == extent, "bytes",
                      detail::expected_given(std::string("saved ") + name, extent, saved));
    }
    const auto position = reader.read<std::int64_t>();
    detail::require(position >= 0, "bytes", detail::expected_given("saved position", ">= 0", position));
    // Read everything first: a bad buffer leaves this cache untouched.
    std::vector<T> keys, values;
    reader.read_array(keys, keys_.size(), "keys");
    reader.read_array(values, values_.size(), "values");
    reader.finish();
    keys_.swap(keys);
    values_.swap(values);
    position_ = position;
  }

  [[nodiscard]] reference::KVSlots<T> slots(index_t b, index_t h) noexcept {
    const index_t head = b * heads_ + h;
    return {keys_.data() + head * capacity_ * key_dim_,
            values_.data() + head * capacity_ * value_dim_};
  }
  void advance(std::int64_t tokens) noexcept { position_ += tokens; }

 private:
  std::string kind_;
  index_t batch_ = 0, heads_ = 0, key_dim_ = 0, value_dim_ = 0, capacity_ = 0;
  std::int64_t position_ = 0;
  std::vector<T> keys_, values_;
};

}  // namespace latte
