#pragma once
// LavoState<T>: the decode state of causal LAVO, O(w * d + r) per head and
// constant in the context length.
//
// Per (batch, head): the last w keys and values (a ring, slot s % w), the sum
// of B f_s over the current, still incomplete window [r], and the sum of B f_s
// over all complete windows [r] with its Neumaier compensation [r] (paper 002
// eq. 3 keeps the mean H; the count it divides by is floor(t / w) w, derived
// from the position). DESIGN §3.4 lists the current window's outputs; their
// projections' sum is all the memory needs, so r values replace w x d.
// One state belongs to one batch of sequences and one attention type; step it
// from one thread at a time. Saved bytes are StateStorage's format.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "latte/backends/reference/lavo.hpp"
#include "latte/core/checked_size.hpp"
#include "latte/core/state_storage.hpp"
#include "latte/core/types.hpp"

namespace latte {

template <Real T>
class LavoState final : public StateStorage<T> {
 public:
  LavoState() = default;

  /// Prefer Lavo::make_state, which sets `kind` and the sizes.
  LavoState(std::string kind, index_t batch, index_t heads, index_t dim, index_t bases,
            index_t window)
      : StateStorage<T>(std::move(kind), sizes_for(batch, heads, dim, bases, window),
                        fields_for(batch, heads, dim, bases, window), 0),
        scratch_(static_cast<std::size_t>(reference::lavo_step_scratch(dim, bases))) {}

  static std::vector<StateSize> sizes_for(index_t batch, index_t heads, index_t dim,
                                          index_t bases, index_t window) {
    return {{"batch", batch}, {"heads", heads}, {"dim", dim}, {"bases", bases}, {"window", window}};
  }
  static std::vector<StateField> fields_for(index_t batch, index_t heads, index_t dim,
                                            index_t bases, index_t window) {
    detail::checked_count<T>("batch", {batch, heads, window, dim});
    detail::checked_count<T>("batch", {batch, heads, bases});
    const auto per_head = static_cast<std::size_t>(batch * heads);
    const auto ring = per_head * static_cast<std::size_t>(window) * static_cast<std::size_t>(dim);
    const auto memory = per_head * static_cast<std::size_t>(bases);
    return {{"keys", ring},
            {"values", ring},
            {"window_sum", memory},
            {"memory_sum", memory},
            {"memory_compensation", memory}};
  }

  [[nodiscard]] index_t heads() const noexcept { return this->size_of("heads"); }
  [[nodiscard]] index_t dim() const noexcept { return this->size_of("dim"); }
  [[nodiscard]] index_t bases() const noexcept { return this->size_of("bases"); }
  [[nodiscard]] index_t window() const noexcept { return this->size_of("window"); }

  /// The carry of one (batch, head), for the backends.
  [[nodiscard]] reference::LavoCarry<T> carry(index_t b, index_t h) noexcept {
    const index_t head = b * heads() + h, w = window(), d = dim(), r = bases();
    return {this->field(0) + head * w * d, this->field(1) + head * w * d, w,
            this->field(2) + head * r,     this->field(3) + head * r,     this->field(4) + head * r};
  }
  /// The carry of one (batch, head) as saved, read-only (a backward's initial
  /// state and the gradient of the state a forward left).
  [[nodiscard]] reference::LavoSavedCarry<T> saved_carry(index_t b, index_t h) const noexcept {
    const index_t head = b * heads() + h, w = window(), d = dim(), r = bases();
    return {this->field(0) + head * w * d, this->field(1) + head * w * d, this->field(2) + head * r,
            this->field(3) + head * r, this->field(4) + head * r};
  }
  /// Scratch for a step (d + 2r values; not part of the saved state).
  [[nodiscard]] T* scratch() noexcept { return scratch_.data(); }

 private:
  AlignedVector<T> scratch_;
};

}  // namespace latte
