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
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "latte/backends/reference/lavo.hpp"
#include "latte/core/checked_size.hpp"
#include "latte/core/state_storage.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"

namespace latte {

template <Real T>
class LavoState final : public StateStorage<T> {
 public:
  LavoState() = default;

  /// Prefer Lavo::make_state, which sets `kind` and the sizes.
  LavoState(std::string kind, index_t batch, index_t heads, index_t dim, index_t bases,
            index_t window, std::int64_t first_position = 0)
      : StateStorage<T>(std::move(kind), sizes_for(batch, heads, dim, bases, window),
                        fields_for(batch, heads, dim, bases, window), first_position),
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
  /// Advances over keys and values [B, T, H, d] keeping only the ring's last w
  /// of them, the sums untouched: the halo a later slice's local part reads
  /// (latte/distributed/ passes it ahead of the sums, which need it).
  void absorb_window(TensorView<const T, 4> keys, TensorView<const T, 4> values) {
    const index_t Tn = keys.extent(1), w = window(), d = dim();
    const std::int64_t first = this->position();
    for (index_t b = 0; b < this->batch(); ++b)
      for (index_t h = 0; h < heads(); ++h) {
        const reference::LavoCarry<T> ring = carry(b, h);
        for (index_t t = std::max<index_t>(0, Tn - w); t < Tn; ++t) {
          const index_t slot = static_cast<index_t>((first + t) % w);
          std::copy_n(keys.row(b, t, h), d, ring.keys + slot * d);
          std::copy_n(values.row(b, t, h), d, ring.values + slot * d);
        }
      }
    this->advance(Tn);
  }

  /// This state becomes the state of its tokens followed by `later`'s:
  /// `later` started at this state's position (with any ring: only its own
  /// tokens' slots are taken) and absorbed the tokens after it. LAVO's
  /// associative merge: the ring takes later's last min(w, its tokens) slots;
  /// the window this state's position falls in is closed by later when later
  /// reaches its border (its sum then joins the memory, compensated), else
  /// both windows' partial sums add.
  void append_state(const LavoState& later) {
    const std::int64_t start = this->position(), end = later.position();
    this->append_position(later);
    const index_t w = window(), d = dim(), r = bases();
    const bool closes = end / w > start / w;  // a token t in [start, end) with (t + 1) % w == 0
    for (index_t b = 0; b < this->batch(); ++b)
      for (index_t h = 0; h < heads(); ++h) {
        const reference::LavoCarry<T> into = carry(b, h);
        const reference::LavoSavedCarry<T> from = later.saved_carry(b, h);
        for (std::int64_t p = std::max<std::int64_t>(start, end - w); p < end; ++p) {
          const index_t slot = static_cast<index_t>(p % w);
          std::copy_n(from.keys + slot * d, d, into.keys + slot * d);
          std::copy_n(from.values + slot * d, d, into.values + slot * d);
        }
        for (index_t i = 0; i < r; ++i) {
          if (closes) {
            reference::compensated_add(into.memory_sum[i], into.memory_compensation[i],
                                       into.window_sum[i]);
            into.window_sum[i] = from.window_sum[i];
          } else {
            into.window_sum[i] += from.window_sum[i];
          }
          reference::compensated_add(into.memory_sum[i], into.memory_compensation[i],
                                     from.memory_sum[i]);
          reference::compensated_add(into.memory_sum[i], into.memory_compensation[i],
                                     from.memory_compensation[i]);
        }
      }
  }

  /// Scratch for a step (d + 2r values; not part of the saved state).
  [[nodiscard]] T* scratch() noexcept { return scratch_.data(); }

 private:
  AlignedVector<T> scratch_;
};

}  // namespace latte
