#pragma once
// Rotation angles for position-dependent rotations (VAPOR, RoPE).
//
// An angle position * theta is formed and reduced modulo 2*pi in double
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

/// cos and sin of (position * theta), reduced in double precision.
[[nodiscard]] inline CosSin rotation_cos_sin(std::int64_t position, double theta) noexcept {
  constexpr double two_pi = 2.0 * std::numbers::pi;
  const double angle = std::fmod(static_cast<double>(position) * theta, two_pi);
  return {std::cos(angle), std::sin(angle)};
}

/// The default RoPE schedule: theta_i = base^(-2i / dim) for pair i < dim / 2.
[[nodiscard]] inline double rope_theta(std::int64_t pair, std::int64_t dim, double base) noexcept {
  return std::pow(base, -2.0 * static_cast<double>(pair) / static_cast<double>(dim));
}

}  // namespace latte
