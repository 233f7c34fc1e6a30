#pragma once
// Proportion: a value P in [0, 1] (paper 004 eq. 8) together with its
// complement 1 - P, each to full relative precision.
//
// The cosine re-weighting needs cos(pi P / 2) = sin(pi (1 - P) / 2). Computing
// 1 - P by subtraction loses the relative precision of a complement near 0
// (P = sigmoid(20) = 1 - 2e-9 keeps only 7 significant digits of 1 - P in
// double), so every source of proportions forms the complement directly:
// (M - i - 1) / M for positions, sigmoid(-z) for a LeaP logit z.
#include <cmath>

namespace latte {

struct Proportion {
  double value = 0.0;       ///< P
  double complement = 1.0;  ///< 1 - P

  /// A proportion given as a number (its complement by subtraction, exact for P >= 0.5).
  [[nodiscard]] static Proportion of(double value) noexcept { return {value, 1.0 - value}; }

  /// sigmoid(z) and sigmoid(-z).
  [[nodiscard]] static Proportion from_logit(double logit) noexcept {
    return {1.0 / (1.0 + std::exp(-logit)), 1.0 / (1.0 + std::exp(logit))};
  }

  /// (position + 1) / M and (M - position - 1) / M.
  [[nodiscard]] static Proportion at_position(double position, double length) noexcept {
    return {(position + 1.0) / length, (length - position - 1.0) / length};
  }
};

}  // namespace latte
