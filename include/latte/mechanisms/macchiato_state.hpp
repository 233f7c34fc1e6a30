#pragma once
// MacchiatoState<T>: the decode state of causal Latte Macchiato.
//
// Per (batch, head): Latte's carry — the running maximum m [L], the normaliser
// alpha [L] and the latent memory vtilde [L x Dv], scaled by exp(-m) (paper 000
// App. B.2), alpha and vtilde as compensated sums (low parts normaliser_low,
// memory_low: latte_state.hpp) — and a ring of the window's last w + 1 keys [Dk] and values [Dv],
// token s in slot s % (w + 1), stored as the window reads them (R^s k_s under
// RoPE; R^{-s} v_s when VAPOR acts on the window too). One count for the whole
// state, `window_fill` (0..min(w + 1, position)), says how many ring slots hold
// tokens, so a state that starts at position p > 0 does not read slots it never wrote.
// Size O(L * Dv + w * (Dk + Dv)) per head, constant in the context.
// One state belongs to one batch of sequences and one attention type; step it
// from one thread at a time. Saved bytes are StateStorage's format.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "latte/backends/reference/latte.hpp"
#include "latte/backends/reference/macchiato.hpp"
#include "latte/backends/reference/softmax.hpp"
#include "latte/core/error.hpp"
#include "latte/core/checked_size.hpp"
#include "latte/core/state_storage.hpp"
#include "latte/core/types.hpp"

namespace latte {

template <Real T>
class MacchiatoState final : public StateStorage<T> {
 public:
  MacchiatoState() = default;

  /// Prefer LatteMacchiato::make_state, which sets `kind` and the sizes.
  MacchiatoState(std::string kind, index_t batch, index_t heads, index_t latents, index_t key_dim,
                 index_t value_dim, index_t window, std::int64_t first_position)
      : StateStorage<T>(std::move(kind), sizes_for(batch, heads, latents, key_dim, value_dim, window),
                        fields_for(batch, heads, latents, key_dim, value_dim, window),
                        first_position),
        scratch_(static_cast<std::size_t>(
            reference::MacchiatoScratch<T>::size(key_dim, value_dim))) {}

  static std::vector<StateSize> sizes_for(index_t batch, index_t heads, index_t latents,
                                          index_t key_dim, index_t value_dim, index_t window) {
    return {{"batch", batch},         {"heads", heads},         {"latents", latents},
            {"key_dim", key_dim},     {"value_dim", value_dim}, {"window", window}};
  }
  static std::vector<StateField> fields_for(index_t batch, index_t heads, index_t latents,
                                            index_t key_dim, index_t value_dim, index_t window) {
    const index_t slots_per_head = detail::checked_sum("window", {window, 1});
    detail::checked_count<T>("batch", {batch, heads, latents, value_dim});
    detail::checked_count<T>("batch", {batch, heads, slots_per_head,
                                       detail::checked_sum("key_dim", {key_dim, value_dim})});
    const auto per_latent = static_cast<std::size_t>(batch * heads * latents);
    const auto slots = static_cast<std::size_t>(batch * heads * slots_per_head);
    return {{"running_max", per_latent},
            {"normaliser", per_latent},
            {"memory", per_latent * static_cast<std::size_t>(value_dim)},
            {"normaliser_low", per_latent},
            {"memory_low", per_latent * static_cast<std::size_t>(value_dim)},
            {"window_keys", slots * static_cast<std::size_t>(key_dim)},
            {"window_values", slots * static_cast<std::size_t>(value_dim)},
            {"window_fill", 1}};
  }

  [[nodiscard]] index_t heads() const noexcept { return this->size_of("heads"); }
  [[nodiscard]] index_t latents() const noexcept { return this->size_of("latents"); }
  [[nodiscard]] index_t key_dim() const noexcept { return this->size_of("key_dim"); }
  [[nodiscard]] index_t value_dim() const noexcept { return this->size_of("value_dim"); }
  [[nodiscard]] index_t window() const noexcept { return this->size_of("window"); }
  /// Ring slots per (batch, head): w + 1.
  [[nodiscard]] index_t capacity() const noexcept { return window() + 1; }

  /// Latte's carry of one (batch, head), for the backends.
  [[nodiscard]] reference::LatteCarry<T> carry(index_t b, index_t h) noexcept {
    return reference::latte_head_carry([this](std::size_t i) { return this->field(i); },
                                       b * heads() + h, latents(), value_dim());
  }
  /// The same, read only (a backward's initial state).
  [[nodiscard]] reference::LatteCarry<const T> carry(index_t b, index_t h) const noexcept {
    return reference::latte_head_carry([this](std::size_t i) { return this->field(i); },
                                       b * heads() + h, latents(), value_dim());
  }
  /// The window ring of one (batch, head): keys [w + 1, Dk], values [w + 1, Dv].
  [[nodiscard]] reference::KVSlots<T> ring(index_t b, index_t h) noexcept {
    const index_t head = b * heads() + h;
    return {this->field(5) + head * capacity() * key_dim(),
            this->field(6) + head * capacity() * value_dim()};
  }
  [[nodiscard]] reference::RingRows<const T> ring(index_t b, index_t h) const noexcept {
    const index_t head = b * heads() + h;
    return {this->field(5) + head * capacity() * key_dim(),
            this->field(6) + head * capacity() * value_dim()};
  }

  /// Ring slots holding tokens (0..w + 1, at most the position), or -1 when
  /// the stored count is not such an integer (a state corrupted through
  /// field(); the attention rejects it).
  [[nodiscard]] index_t window_fill() const noexcept {
    return fill_count(*this->field(7), this->position());
  }
  /// The most ring slots that can hold tokens now: min(w + 1, position).
  [[nodiscard]] index_t window_fill_limit() const noexcept { return fill_limit(this->position()); }
  void set_window_fill(index_t fill) noexcept { *this->field(7) = static_cast<T>(fill); }

  /// This state becomes the state of its tokens followed by `later`'s:
  /// `later` started fresh (make_state) at this state's position and absorbed
  /// the tokens after it. The latent carry merges as Latte's
  /// (reference::latte_append_carry); the ring keeps its slots and takes
  /// later's filled ones (a token's slot is its position modulo w + 1, so
  /// later's tokens land where a scan would have put them), and the fill adds
  /// up to w + 1. Associative; latte/distributed/ combines slices' states with it,
  /// the ring carrying each slice's last w + 1 tokens to the next (its halo).
  void append_state(const MacchiatoState& later) {
    const std::int64_t end = later.position();
    const index_t later_fill = later.window_fill(), fill = window_fill();
    this->append_position(later);
    const index_t Dk = key_dim(), Dv = value_dim(), slots = capacity();
    for (index_t b = 0; b < this->batch(); ++b)
      for (index_t h = 0; h < heads(); ++h) {
        reference::latte_append_carry(carry(b, h), later.carry(b, h), latents(), Dv);
        const reference::KVSlots<T> to = ring(b, h);
        const reference::RingRows<const T> from = later.ring(b, h);
        for (std::int64_t p = end - later_fill; p < end; ++p) {
          const index_t slot = static_cast<index_t>(p % slots);
          std::copy_n(from.keys + slot * Dk, Dk, to.keys + slot * Dk);
          std::copy_n(from.values + slot * Dv, Dv, to.values + slot * Dv);
        }
      }
    set_window_fill(std::min(slots, fill + later_fill));
  }

  /// Scratch for a step, 2 Dk + 2 Dv values (not part of the saved state).
  [[nodiscard]] reference::MacchiatoScratch<T> scratch() noexcept {
    return reference::MacchiatoScratch<T>::carve(scratch_.data(), key_dim(), value_dim());
  }

 protected:
  /// A saved window_fill must be a fill this state can have had at the saved
  /// position: the ring is read from position - fill on.
  void check_saved(std::int64_t position,
                   const std::vector<AlignedVector<T>>& fields) const override {
    if (fill_count(fields[7][0], position) < 0)
      throw Error("bytes", detail::expected_given(
                               "saved window_fill",
                               "an integer in [0, " + std::to_string(fill_limit(position)) +
                                   "] (min(w + 1, saved position))",
                               fields[7][0]));
  }

 private:
  [[nodiscard]] index_t fill_limit(std::int64_t position) const noexcept {
    return static_cast<index_t>(std::min<std::int64_t>(capacity(), position));
  }
  /// `fill` as a slot count in [0, min(capacity, position)], or -1 when it is not one.
  [[nodiscard]] index_t fill_count(T fill, std::int64_t position) const noexcept {
    const index_t limit = fill_limit(position);
    if (!(fill >= T(0) && fill <= static_cast<T>(limit) && std::floor(fill) == fill)) return -1;
    return static_cast<index_t>(fill);
  }

  AlignedVector<T> scratch_;
};

}  // namespace latte
