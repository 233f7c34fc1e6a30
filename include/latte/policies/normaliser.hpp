#pragma once
// The denominator of linear attention: which sum it is and how it is kept
// away from zero.
//
//   o_t = sum_s w_ts v_s / N(D_t),   D_t = sum_s w'_ts   over the allowed s
//
// Normaliser N (a runtime parameter):
//   additive  (epsilon):  N(D) = max(D, 0) + epsilon   (DESIGN §3.3; default 1e-6)
//   clamp_min (minimum):  N(D) = max(D, minimum)       (cosFormer's and LeaPformer's
//                                                       official code: 1e-6 and 0.1)
// With non-negative features and re-weightings (Relu, EluPlusOne, cosFormer,
// LeaP) D >= 0 and `additive` is exactly D + epsilon. A sign-indefinite D
// (the Identity map on mixed-sign inputs, RoPE with a rotated denominator) is
// clamped: a query whose weights sum to <= 0 is divided by epsilon (additive)
// or by `minimum` (clamp_min), so every output stays finite.
//
// Denominator under RoPE (paper 004 App. A.6, RoFormer eq. 19): w'_ts is the
// un-rotated score phi(q_t) . phi(k_s) (default, as in the RoPE paper and in
// LeaPformer's official code; rows then need not sum to one), or the rotated
// score w_ts itself (rows sum to one; D can be <= 0 and is clamped as above).
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "latte/core/error.hpp"
#include "latte/core/types.hpp"

namespace latte {

struct Normaliser {
  enum class Kind { additive, clamp_min };
  Kind kind = Kind::additive;
  /// epsilon (additive) or the minimum (clamp_min); finite and > 0.
  double value = 1e-6;

  /// N(D) = max(D, 0) + epsilon.
  [[nodiscard]] static constexpr Normaliser additive(double epsilon = 1e-6) noexcept {
    return {Kind::additive, epsilon};
  }
  /// N(D) = max(D, minimum).
  [[nodiscard]] static constexpr Normaliser clamp_min(double minimum) noexcept {
    return {Kind::clamp_min, minimum};
  }

  [[nodiscard]] const char* name() const noexcept {
    return kind == Kind::additive ? "additive" : "clamp_min";
  }

  /// N(D) in T. A value below T's smallest normal number (1e-50 in float)
  /// acts as that number, so N(D) > 0 in every dtype.
  template <Real T>
  [[nodiscard]] T apply(T denominator) const noexcept {
    const T v = std::max(static_cast<T>(value), std::numeric_limits<T>::min());
    if (kind == Kind::additive) return std::max(denominator, T(0)) + v;
    return std::max(denominator, v);
  }

  /// dN/dD at D: 1 where N follows D (D > 0 additive, D > minimum clamp_min), 0
  /// where it is clamped (backward; the kink itself takes the clamped side).
  template <Real T>
  [[nodiscard]] T derivative(T denominator) const noexcept {
    const T v = std::max(static_cast<T>(value), std::numeric_limits<T>::min());
    return denominator > (kind == Kind::additive ? T(0) : v) ? T(1) : T(0);
  }

  void validate() const {
    detail::require(kind == Kind::additive || kind == Kind::clamp_min, "normaliser",
                    "unknown normaliser kind");
    detail::require(std::isfinite(value) && value > 0.0, "normaliser",
                    detail::expected_given(std::string(name()) + " value", "finite and > 0",
                                           value));
  }
};

/// Which scores the denominator sums when RoPE rotates the features.
enum class RopeDenominator {
  unrotated,  ///< sum_s phi(q_t) . phi(k_s) (RoFormer eq. 19; LeaPformer's code)
  rotated,    ///< sum_s (R^t phi(q_t)) . (R^s phi(k_s)): rows sum to one; clamped
};

[[nodiscard]] inline const char* name_of(RopeDenominator denominator) noexcept {
  return denominator == RopeDenominator::rotated ? "rotated" : "unrotated";
}

}  // namespace latte
