#pragma once
// Window policies for softmax attention: which keys near a query are allowed.
#include <algorithm>
#include <concepts>
#include <string>

#include "latte/core/error.hpp"
#include "latte/core/types.hpp"

namespace latte {

/// Every key the direction allows.
struct NoWindow {
  static constexpr const char* name = "full";
  [[nodiscard]] constexpr index_t lowest_key(index_t /*query*/) const noexcept { return 0; }
  [[nodiscard]] constexpr index_t highest_key(index_t /*query*/, index_t length) const noexcept {
    return length - 1;
  }
  void validate(bool /*causal*/) const {}
};

/// FlashAttention's convention: query t attends keys s with
/// t - left <= s <= t + right (then intersected with the direction's rule).
/// Both sides are counts >= 0; under Causal, `right` must be 0.
struct SlidingWindow {
  static constexpr const char* name = "sliding_window";
  index_t left = 0;
  index_t right = 0;

  // left and right may be as large as index_t allows (a window wider than any
  // sequence): compare before subtracting or adding, so nothing overflows.
  [[nodiscard]] constexpr index_t lowest_key(index_t query) const noexcept {
    return left >= query ? 0 : query - left;
  }
  [[nodiscard]] constexpr index_t highest_key(index_t query, index_t length) const noexcept {
    return right >= length - 1 - query ? length - 1 : query + right;
  }
  void validate(bool causal) const {
    detail::require(left >= 0, "window.left",
                    detail::expected_given("window size to the left", ">= 0", left));
    detail::require(right >= 0, "window.right",
                    detail::expected_given("window size to the right", ">= 0", right));
    detail::require(!causal || right == 0, "window.right",
                    detail::expected_given("window size to the right under Causal", 0, right));
  }
};

/// A window policy maps a query index to its inclusive key range and validates itself.
template <class P>
concept Window = requires(const P& window, index_t i, bool causal) {
  { P::name } -> std::convertible_to<const char*>;
  { window.lowest_key(i) } -> std::same_as<index_t>;
  { window.highest_key(i, i) } -> std::same_as<index_t>;
  window.validate(causal);
};

}  // namespace latte
