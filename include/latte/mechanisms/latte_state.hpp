#pragma once
// LatteState<T>: the O(L * Dv) per-head decode state of causal Latte.
//
// Per (batch, head): the running maximum m [L], the normaliser alpha [L] and
// the latent memory vtilde [L x Dv], stored scaled by exp(-m) (paper 000
// App. B.2), plus the absolute position of the next token. alpha and vtilde
// are compensated sums: normaliser_low [L] and memory_low [L x Dv] hold what
// rounding dropped from them (core/compensated_sum.hpp), so that their error
// stays that of a few roundings however long the context (docs/numerics.md,
// "Long contexts"). One state belongs
// to one batch of sequences and one attention type; step it from one thread
// at a time. Saved bytes are StateStorage's format.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "latte/backends/reference/latte.hpp"
#include "latte/core/checked_size.hpp"
#include "latte/core/state_storage.hpp"
#include "latte/core/types.hpp"

namespace latte {

template <Real T>
class LatteState final : public StateStorage<T> {
 public:
  LatteState() = default;

  /// Prefer LatteAttention::make_state, which sets `kind` and the sizes.
  LatteState(std::string kind, index_t batch, index_t heads, index_t latents, index_t value_dim,
             std::int64_t first_position)
      : StateStorage<T>(std::move(kind), sizes_for(batch, heads, latents, value_dim),
                        fields_for(batch, heads, latents, value_dim), first_position),
        scratch_(static_cast<std::size_t>(
            detail::checked_sum("latents", {detail::checked_product("latents", {4, latents}),
                                            value_dim}))) {}

  static std::vector<StateSize> sizes_for(index_t batch, index_t heads, index_t latents,
                                          index_t value_dim) {
    return {{"batch", batch}, {"heads", heads}, {"latents", latents}, {"value_dim", value_dim}};
  }
  static std::vector<StateField> fields_for(index_t batch, index_t heads, index_t latents,
                                            index_t value_dim) {
    // memory is the largest field: when it fits, so do the others.
    const index_t memory = detail::checked_count<T>("batch", {batch, heads, latents, value_dim});
    const auto per_latent = static_cast<std::size_t>(batch * heads * latents);
    // The low parts double the sums: the memory twice must still fit.
    detail::checked_count<T>("batch", {batch, heads, latents, value_dim, 2});
    return {{"running_max", per_latent},
            {"normaliser", per_latent},
            {"memory", static_cast<std::size_t>(memory)},
            {"normaliser_low", per_latent},
            {"memory_low", static_cast<std::size_t>(memory)}};
  }

  [[nodiscard]] index_t heads() const noexcept { return this->size_of("heads"); }
  [[nodiscard]] index_t latents() const noexcept { return this->size_of("latents"); }
  [[nodiscard]] index_t value_dim() const noexcept { return this->size_of("value_dim"); }

  /// The carry of one (batch, head), for the backends.
  [[nodiscard]] reference::LatteCarry<T> carry(index_t b, index_t h) noexcept {
    return reference::latte_head_carry([this](std::size_t i) { return this->field(i); },
                                       b * heads() + h, latents(), value_dim());
  }
  /// The same, read only (a backward's initial state).
  [[nodiscard]] reference::LatteCarry<const T> carry(index_t b, index_t h) const noexcept {
    return reference::latte_head_carry([this](std::size_t i) { return this->field(i); },
                                       b * heads() + h, latents(), value_dim());
  }
  /// This state becomes the state of its tokens followed by `later`'s:
  /// `later` started fresh (make_state) at this state's position and absorbed
  /// the tokens after it. Latte's associative merge: per latent, both sums
  /// rescaled to the larger running maximum and added (compensated pairs by
  /// TwoSum; reference::latte_append_carry). latte/distributed/ combines the
  /// states of a sequence's slices with it.
  void append_state(const LatteState& later) {
    this->append_position(later);
    for (index_t b = 0; b < this->batch(); ++b)
      for (index_t h = 0; h < heads(); ++h)
        reference::latte_append_carry(carry(b, h), later.carry(b, h), latents(), value_dim());
  }

  /// 4 L + Dv values of scratch for a step (not part of the saved state).
  [[nodiscard]] T* scratch() noexcept { return scratch_.data(); }

 private:
  AlignedVector<T> scratch_;
};

}  // namespace latte
