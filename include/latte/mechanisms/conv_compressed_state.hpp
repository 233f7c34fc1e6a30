#pragma once
// ConvCompressedState<T>: the decode state of causal convolutional-compression
// attention (paper 003 §4, DESIGN §3.5).
//
// Per (batch, head):
//   window_keys / window_values  one ring of R = min(window_left + 1, context_capacity)
//                                keys and values per level (level 0: the inputs;
//                                level l >= 1: the projections of c^(l))
//   group_sums                   the partial convolution sum of the open group of
//                                each level (L x Dv)
//   compressed_keys / _values    Wk_x c^(L)_j and Wv_x c^(L)_j of every complete
//                                top-level group: floor(context_capacity / M^L) slots
// plus the absolute position of the next token, from which every level's
// token count follows (level l has floor(position / M^l) complete tokens).
// The compressed store grows with the context as T / M^L; it is allocated for
// `context_capacity` tokens up front, so step never allocates, and a step past
// the capacity is an error. Saved bytes are StateStorage's format.
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "latte/backends/reference/conv_compressed.hpp"
#include "latte/core/checked_size.hpp"
#include "latte/core/error.hpp"
#include "latte/core/state_storage.hpp"
#include "latte/core/types.hpp"

namespace latte {

/// The sizes that fix a state's layout.
struct ConvCompressedStateShape {
  index_t batch = 0, heads = 0, key_dim = 0, value_dim = 0;
  index_t group_size = 0, levels = 0, window_left = 0;
  index_t context_capacity = 0;  ///< tokens the state can absorb

  /// Slots of each window ring.
  [[nodiscard]] index_t ring() const noexcept {
    return window_left < context_capacity ? window_left + 1 : context_capacity;  // no overflow
  }
  /// Top-level compressed tokens the state can hold.
  [[nodiscard]] index_t compressed_capacity() const noexcept {
    return static_cast<index_t>(
        context_capacity / reference::tokens_per_compressed_token(group_size, levels));
  }
};

template <Real T>
class ConvCompressedState final : public StateStorage<T> {
 public:
  ConvCompressedState() = default;

  /// Prefer ConvCompressedAttention::make_state, which sets `kind` and the sizes.
  ConvCompressedState(std::string kind, const ConvCompressedStateShape& shape)
      : StateStorage<T>(std::move(kind), sizes_for(shape), fields_for(shape), 0),
        shape_(shape),
        scratch_(static_cast<std::size_t>(detail::checked_sum(
            "value_dim", {detail::checked_product("value_dim", {6, shape.value_dim}),
                          detail::checked_product("key_dim", {2, shape.key_dim})}))) {}

  static std::vector<StateSize> sizes_for(const ConvCompressedStateShape& s) {
    return {{"batch", s.batch},
            {"heads", s.heads},
            {"key_dim", s.key_dim},
            {"value_dim", s.value_dim},
            {"group_size", s.group_size},
            {"levels", s.levels},
            {"window_left", s.window_left},
            {"context_capacity", s.context_capacity}};
  }
  static std::vector<StateField> fields_for(const ConvCompressedStateShape& s) {
    const index_t widest = detail::checked_sum("key_dim", {s.key_dim, s.value_dim});
    detail::checked_count<T>("batch", {s.batch, s.heads, s.levels, s.ring(), widest});
    detail::checked_count<T>("batch", {s.batch, s.heads, s.compressed_capacity(), widest});
    detail::checked_count<T>("batch", {s.batch, s.heads, s.levels, s.value_dim});
    const auto heads = static_cast<std::size_t>(s.batch * s.heads);
    const auto ring = static_cast<std::size_t>(s.levels * s.ring());
    const auto stored = static_cast<std::size_t>(s.compressed_capacity());
    const auto Dk = static_cast<std::size_t>(s.key_dim), Dv = static_cast<std::size_t>(s.value_dim);
    return {{"window_keys", heads * ring * Dk},
            {"window_values", heads * ring * Dv},
            {"group_sums", heads * static_cast<std::size_t>(s.levels) * Dv},
            {"compressed_keys", heads * stored * Dk},
            {"compressed_values", heads * stored * Dv}};
  }

  [[nodiscard]] const ConvCompressedStateShape& shape() const noexcept { return shape_; }
  [[nodiscard]] index_t heads() const noexcept { return shape_.heads; }
  [[nodiscard]] index_t context_capacity() const noexcept { return shape_.context_capacity; }
  /// Top-level compressed tokens held now: floor(position / M^L).
  [[nodiscard]] index_t compressed_tokens() const noexcept {
    return static_cast<index_t>(this->position() / reference::tokens_per_compressed_token(
                                                       shape_.group_size, shape_.levels));
  }

  /// The carry of one (batch, head), for the backends.
  [[nodiscard]] reference::ConvCompressedCarry<T> carry(index_t b, index_t h) noexcept {
    const index_t head = b * shape_.heads + h, Dk = shape_.key_dim, Dv = shape_.value_dim;
    const index_t ring = shape_.levels * shape_.ring(), stored = shape_.compressed_capacity();
    return {this->field(0) + head * ring * Dk, this->field(1) + head * ring * Dv,
            this->field(2) + head * shape_.levels * Dv, this->field(3) + head * stored * Dk,
            this->field(4) + head * stored * Dv};
  }
  /// The same, read only (a backward's initial state and final gradient).
  [[nodiscard]] reference::ConvCompressedCarry<const T> carry(index_t b, index_t h) const noexcept {
    const index_t head = b * shape_.heads + h, Dk = shape_.key_dim, Dv = shape_.value_dim;
    const index_t ring = shape_.levels * shape_.ring(), stored = shape_.compressed_capacity();
    return {this->field(0) + head * ring * Dk, this->field(1) + head * ring * Dv,
            this->field(2) + head * shape_.levels * Dv, this->field(3) + head * stored * Dk,
            this->field(4) + head * stored * Dv};
  }
  /// Step workspace (not part of the saved state).
  [[nodiscard]] reference::ConvCompressedScratch<T> scratch() noexcept {
    T* p = scratch_.data();
    const index_t Dk = shape_.key_dim, Dv = shape_.value_dim;
    return {p,          p + Dv,     p + 2 * Dv, p + 2 * Dv + Dk, p + 2 * Dv + 2 * Dk,
            p + 3 * Dv + 2 * Dk, p + 4 * Dv + 2 * Dk};
  }

 protected:
  /// A state never holds more than context_capacity tokens.
  void check_saved(std::int64_t position, const std::vector<AlignedVector<T>>&) const override {
    detail::require(position <= shape_.context_capacity, "bytes",
                    detail::expected_given("saved position",
                                           "<= context_capacity " +
                                               std::to_string(shape_.context_capacity),
                                           position));
  }

 private:
  ConvCompressedStateShape shape_{};
  AlignedVector<T> scratch_;
};

}  // namespace latte
