#pragma once
// Rotation angles for position-dependent rotations (VAPOR, RoPE).
//
// An angle position * theta is formed and reduced modulo 2*pi in extended
// precision before cos/sin are taken, so that a rotation at position 10^7 or
// 2^31 is as accurate as one at position 1, in float32 and float64.
#include <cmath>
#include <cstdint>
#include <numbers>

namespace latte {

struct CosSin {
  double cos;
  double sin;
};

/// cos and sin of (position * theta), with the angle reduced modulo 2*pi to
/// ~1e-18 rad for |position * theta| up to ~2^40 (degrading slowly beyond).
///
/// Two rounding errors would otherwise grow with the position: the product
/// (a 64-bit position times a 53-bit theta has up to 117 bits) and the
/// reduction (k * 2pi with k ~ position * theta / 2pi needs 2pi to more bits
/// than any float type has). So the product is split exactly into a long
/// double and its rounding error (an fma), and k * 2pi is subtracted in four
/// chunks of <= 32 bits each (fdlibm's pi/2 chunks times 4, summing to 2pi
/// within 2^-157), each k * chunk exact inside an fma (Cody and Waite). With an
/// 80-bit long double (x86) this keeps VAPOR / RoPE at position 2^31 within
/// the fp64 tolerance; a plain double product would be off by ~1e-7 rad there.
[[nodiscard]] inline CosSin rotation_cos_sin(std::int64_t position, double theta) noexcept {
  constexpr long double chunk1 = 0x1.921fb544p+2L, chunk2 = 0x1.0b4611a6p-32L,
                        chunk3 = 0x1.3198a2ep-67L, chunk4 = 0x1.b839a252049c1p-102L;
  const auto n = static_cast<long double>(position);
  const auto th = static_cast<long double>(theta);
  const long double product = n * th;
  const long double product_error = std::fma(n, th, -product);  // n * th = product + error
  const long double k = std::nearbyint(product / (chunk1 + chunk2));
  long double reduced = std::fma(-k, chunk1, product);
  reduced = std::fma(-k, chunk2, reduced);
  reduced = std::fma(-k, chunk3, reduced);
  reduced = std::fma(-k, chunk4, reduced) + product_error;
  const auto angle = static_cast<double>(reduced);
  return {std::cos(angle), std::sin(angle)};
}

/// The default RoPE schedule: theta_i = base^(-2i / dim) for pair i < dim / 2.
[[nodiscard]] inline double rope_theta(std::int64_t pair, std::int64_t dim, double base) noexcept {
  return std::pow(base, -2.0 * static_cast<double>(pair) / static_cast<double>(dim));
}

}  // namespace latte
