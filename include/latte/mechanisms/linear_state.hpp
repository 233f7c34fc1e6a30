#pragma once
// LinearState<T>: the O(E * Dv) per-head decode state of causal linear attention.
//
// Per (batch, head): the memory S = sum_s e(k_s) v_s^T [E x Dv] and the
// normaliser z = sum_s e'(k_s) [E] (paper 001 eq. 4), as compensated sums
// (their low parts memory_low, normaliser_low: core/compensated_sum.hpp), E = streams * F
// (two streams, sin and cos, with cosFormer / LeaP re-weighting), plus the
// absolute position of the next token. Sizes: batch, heads, feature_dim (F),
// streams, value_dim, and, where the configuration has them, length (cosFormer's
// M) and rotated_denominator (RoPE). One state belongs to one batch of
// sequences and one attention type; step it from one thread at a time.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "latte/backends/reference/linear.hpp"
#include "latte/core/checked_size.hpp"
#include "latte/core/error.hpp"
#include "latte/core/state_storage.hpp"
#include "latte/core/types.hpp"

namespace latte {

template <Real T>
class LinearState final : public StateStorage<T> {
 public:
  LinearState() = default;

  /// Prefer LinearAttention::make_state, which sets `kind` and the sizes.
  LinearState(std::string kind, std::vector<StateSize> sizes, std::int64_t first_position)
      : StateStorage<T>(std::move(kind), sizes, fields_for(sizes), first_position) {
    // The reference step uses F + 2E values, the cpu step 2F + 4E.
    const index_t F = this->size_of("feature_dim");
    scratch_.resize(static_cast<std::size_t>(detail::checked_sum(
        "feature_dim", {detail::checked_product("feature_dim", {2, F}),
                        detail::checked_product("feature_dim", {4, expanded_dim()})})));
  }

  /// The fields of a state with `sizes`: memory [B * H * E * Dv], normaliser [B * H * E].
  static std::vector<StateField> fields_for(const std::vector<StateSize>& sizes) {
    auto size = [&](const char* name) {
      for (const StateSize& s : sizes)
        if (s.name == name) return static_cast<index_t>(s.value);
      return index_t{0};
    };
    const index_t memory = detail::checked_count<T>(
        "batch", {size("batch"), size("heads"), size("streams"), size("feature_dim"),
                  size("value_dim")});  // the largest field: when it fits, so does the other
    const index_t normaliser = size("batch") * size("heads") * size("streams") * size("feature_dim");
    // The low parts double the sums: the memory twice must still fit.
    detail::checked_count<T>("batch", {size("batch"), size("heads"), size("streams"),
                                       size("feature_dim"), size("value_dim"), 2});
    return {{"memory", static_cast<std::size_t>(memory)},
            {"normaliser", static_cast<std::size_t>(normaliser)},
            {"memory_low", static_cast<std::size_t>(memory)},
            {"normaliser_low", static_cast<std::size_t>(normaliser)}};
  }

  [[nodiscard]] index_t heads() const noexcept { return this->size_of("heads"); }
  [[nodiscard]] index_t feature_dim() const noexcept { return this->size_of("feature_dim"); }
  [[nodiscard]] index_t streams() const noexcept { return this->size_of("streams"); }
  [[nodiscard]] index_t value_dim() const noexcept { return this->size_of("value_dim"); }
  /// E = streams * F.
  [[nodiscard]] index_t expanded_dim() const noexcept { return streams() * feature_dim(); }
  /// cosFormer's M (0 when the configuration has none).
  [[nodiscard]] index_t length() const noexcept { return this->size_of("length"); }

  /// The carry of one (batch, head), for the backends.
  [[nodiscard]] reference::LinearCarry<T> carry(index_t b, index_t h) noexcept {
    const index_t head = b * heads() + h, E = expanded_dim();
    return {this->field(0) + head * E * value_dim(), this->field(1) + head * E,
            this->field(2) + head * E * value_dim(), this->field(3) + head * E};
  }
  /// The same, read only (a backward's initial state).
  [[nodiscard]] reference::LinearCarry<const T> carry(index_t b, index_t h) const noexcept {
    const index_t head = b * heads() + h, E = expanded_dim();
    return {this->field(0) + head * E * value_dim(), this->field(1) + head * E,
            this->field(2) + head * E * value_dim(), this->field(3) + head * E};
  }
  /// This state becomes the state of its tokens followed by `later`'s:
  /// `later` started fresh (make_state) at this state's position and absorbed
  /// the tokens after it. The linear family's associative merge: S and z
  /// added (compensated pairs by TwoSum; reference::linear_append_carry).
  /// latte/distributed/ combines the states of a sequence's slices with it.
  void append_state(const LinearState& later) {
    this->append_position(later);
    for (index_t b = 0; b < this->batch(); ++b)
      for (index_t h = 0; h < heads(); ++h)
        reference::linear_append_carry(carry(b, h), later.carry(b, h), expanded_dim(),
                                       value_dim());
  }

  /// 2F + 4E values of scratch for a step (not part of the saved state).
  [[nodiscard]] T* scratch() noexcept { return scratch_.data(); }

 protected:
  /// cosFormer's proportions i / M hold for positions up to M: no state goes past M.
  void check_saved(std::int64_t position, const std::vector<AlignedVector<T>>&) const override {
    if (length() > 0)
      detail::require(position <= length(), "bytes",
                      detail::expected_given("saved position",
                                             "<= cosFormer length M " + std::to_string(length()),
                                             position));
  }

 private:
  AlignedVector<T> scratch_;
};

}  // namespace latte
