#pragma once
// Rotation angles for position-dependent rotations (VAPOR, RoPE).
//
// An angle position * theta is formed and reduced modulo 2*pi in extended
// precision before cos/sin are taken, so that position 10^7 in a float32
// computation rotates by the same angle an fp64 computation would.
#include <cmath>
#include <cstdint>
#include <numbers>

namespace latte {

struct CosSin {
  double cos;
  double sin;
};

/// cos and sin of (position * theta). The product and its reduction modulo
/// 2*pi are formed in long double (64-bit mantissa on x86), so the reduced
/// angle is accurate to ~1e-12 rad even at position 10^7 with theta ~ 1,
/// where a double product alone would already be off by ~1e-9.
[[nodiscard]] inline CosSin rotation_cos_sin(std::int64_t position, double theta) noexcept {
  constexpr long double two_pi = 2.0L * std::numbers::pi_v<long double>;
  const auto angle = static_cast<double>(
      std::fmod(static_cast<long double>(position) * static_cast<long double>(theta), two_pi));
  return {std::cos(angle), std::sin(angle)};
}

/// The default RoPE schedule: theta_i = base^(-2i / dim) for pair i < dim / 2.
[[nodiscard]] inline double rope_theta(std::int64_t pair, std::int64_t dim, double base) noexcept {
  return std::pow(base, -2.0 * static_cast<double>(pair) / static_cast<double>(dim));
}

}  // namespace latte
