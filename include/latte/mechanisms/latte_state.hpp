#pragma once
// LatteState<T>: the O(L * Dv) per-head decode state of causal Latte.
//
// Per (batch, head): the running maximum m [L], the normaliser alpha [L] and
// the latent memory vtilde [L x Dv], stored scaled by exp(-m) (paper 000
// App. B.2), plus the absolute position of the next token. One state belongs
// to one batch of sequences and one attention type; it is not shared between
// threads while it is being stepped.
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "latte/backends/reference/latte.hpp"
#include "latte/core/state_bytes.hpp"
#include "latte/core/types.hpp"

namespace latte {

template <Real T>
class LatteState {
 public:
  LatteState() = default;

  /// Prefer LatteAttention::make_state, which sets `kind` and the sizes.
  LatteState(std::string kind, index_t batch, index_t heads, index_t latents, index_t value_dim,
             std::int64_t first_position)
      : kind_(std::move(kind)),
        batch_(batch),
        heads_(heads),
        latents_(latents),
        value_dim_(value_dim),
        position_(first_position),
        running_max_(static_cast<std::size_t>(batch * heads * latents)),
        normaliser_(static_cast<std::size_t>(batch * heads * latents)),
        memory_(static_cast<std::size_t>(batch * heads * latents * value_dim)),
        scratch_(static_cast<std::size_t>(value_dim)) {}

  [[nodiscard]] index_t batch() const noexcept { return batch_; }
  [[nodiscard]] index_t heads() const noexcept { return heads_; }
  [[nodiscard]] index_t latents() const noexcept { return latents_; }
  [[nodiscard]] index_t value_dim() const noexcept { return value_dim_; }
  /// Absolute position of the next token (tokens absorbed so far + first position).
  [[nodiscard]] std::int64_t position() const noexcept { return position_; }
  /// The attention type and dtype this state belongs to.
  [[nodiscard]] const std::string& kind() const noexcept { return kind_; }
  /// Bytes the state holds (constant in the number of tokens absorbed).
  [[nodiscard]] std::size_t bytes() const noexcept {
    return (running_max_.size() + normaliser_.size() + memory_.size() + scratch_.size()) *
           sizeof(T);
  }

  /// Serialises the state; `restore` (or LatteAttention::load_state) reads it back.
  [[nodiscard]] std::vector<std::byte> save() const {
    detail::ByteWriter writer(kind_);
    for (index_t extent : {batch_, heads_, latents_, value_dim_})
      writer.write<std::int64_t>(extent);
    writer.write<std::int64_t>(position_);
    writer.write_array<T>(running_max_);
    writer.write_array<T>(normaliser_);
    writer.write_array<T>(memory_);
    return std::move(writer).finish();
  }

  /// Overwrites this state with saved bytes of the same kind and shape.
  void restore(std::span<const std::byte> bytes) {
    detail::ByteReader reader(bytes, kind_);
    for (auto [extent, name] : {std::pair{batch_, "batch"}, std::pair{heads_, "heads"},
                                std::pair{latents_, "latents"}, std::pair{value_dim_, "value_dim"}}) {
      const auto saved = reader.read<std::int64_t>();
      detail::require(saved == extent, "bytes",
                      detail::expected_given(std::string("saved ") + name, extent, saved));
    }
    const auto position = reader.read<std::int64_t>();
    detail::require(position >= 0, "bytes",
                    detail::expected_given("saved position", ">= 0", position));
    // Read everything first: a bad buffer leaves this state untouched.
    std::vector<T> running_max, normaliser, memory;
    reader.read_array(running_max, running_max_.size(), "running_max");
    reader.read_array(normaliser, normaliser_.size(), "normaliser");
    reader.read_array(memory, memory_.size(), "memory");
    reader.finish();
    running_max_.swap(running_max);
    normaliser_.swap(normaliser);
    memory_.swap(memory);
    position_ = position;
  }

  /// The carry of one (batch, head), for the backends.
  [[nodiscard]] reference::LatteCarry<T> carry(index_t b, index_t h) noexcept {
    const index_t head = b * heads_ + h;
    return {running_max_.data() + head * latents_, normaliser_.data() + head * latents_,
            memory_.data() + head * latents_ * value_dim_};
  }
  [[nodiscard]] T* scratch() noexcept { return scratch_.data(); }
  void advance(std::int64_t tokens) noexcept { position_ += tokens; }

 private:
  std::string kind_;
  index_t batch_ = 0, heads_ = 0, latents_ = 0, value_dim_ = 0;
  std::int64_t position_ = 0;
  std::vector<T> running_max_, normaliser_, memory_, scratch_;
};

}  // namespace latte
