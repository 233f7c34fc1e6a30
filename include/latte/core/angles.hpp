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

namespace detail {

/// rotation_cos_sin in 80-bit long double (x86), for products beyond the
/// double fast path's range: the product split exactly with a long double fma
/// and 2pi in four chunks of <= 32 bits (Cody and Waite). Never overflows for
/// a double theta and an int64 position; ~2 us per call (software fmal).
[[nodiscard]] inline CosSin rotation_cos_sin_extended(std::int64_t position,
                                                      double theta) noexcept {
  constexpr long double chunk1 = 0x1.921fb544p+2L, chunk2 = 0x1.0b4611a6p-32L,
                        chunk3 = 0x1.3198a2ep-67L, chunk4 = 0x1.b839a252049c1p-102L;
  const auto n = static_cast<long double>(position);
  const auto th = static_cast<long double>(theta);
  const long double product = n * th;
  const long double product_error = std::fma(n, th, -product);
  const long double k = std::nearbyint(product / (chunk1 + chunk2));
  long double reduced = std::fma(-k, chunk1, product);
  reduced = std::fma(-k, chunk2, reduced);
  reduced = std::fma(-k, chunk3, reduced);
  reduced = std::fma(-k, chunk4, reduced) + product_error;
  const auto angle = static_cast<double>(reduced);
  return {std::cos(angle), std::sin(angle)};
}

}  // namespace detail

/// cos and sin of (position * theta), with the angle reduced modulo 2*pi to
/// ~4e-16 rad (one rounding of the reduced double) for |position * theta| up
/// to ~2^40, degrading slowly beyond; finite for every finite theta.
///
/// Two rounding errors would otherwise grow with the position: the product
/// (a 64-bit position times a 53-bit theta has up to 117 bits) and the
/// reduction (k * 2pi with k ~ position * theta / 2pi needs 2pi to more bits
/// than a double has). So the position is split into two 32-bit halves whose
/// products with theta are each split exactly into a double and its rounding
/// error (hardware fma), and k * 2pi is subtracted with 2pi as three doubles
/// (2pi to ~2^-160), the leading k * 2pi exactly (fma) and the leading
/// difference exact by Sterbenz's lemma. Plain double fma throughout: the
/// previous long double version spent ~2 us per call in software fmal.
[[nodiscard]] inline CosSin rotation_cos_sin(std::int64_t position, double theta) noexcept {
  constexpr double two_pi_1 = 0x1.921fb54442d18p+2, two_pi_2 = 0x1.1a62633145c07p-52,
                   two_pi_3 = -0x1.f1976b7ed8fbcp-108;
  // position = high * 2^32 + low, 0 <= low < 2^32: both halves exact in a double.
  const std::int64_t high_part = position >> 32;
  const auto high = static_cast<double>(high_part) * 0x1p32;
  const auto low = static_cast<double>(position - high_part * (std::int64_t{1} << 32));
  // position * theta = (p1 + e1) + (p2 + e2) exactly.
  const double p1 = high * theta, e1 = std::fma(high, theta, -p1);
  const double p2 = low * theta, e2 = std::fma(low, theta, -p2);
  const double sum = p1 + p2;  // two-sum: sum + sum_error = p1 + p2 exactly
  // Past 2^60 rad (or on overflow: a huge user theta) k no longer fits the
  // exact steps below; the long double path covers every double theta.
  if (!(std::fabs(sum) < 0x1p60) || !std::isfinite(p1))
    return detail::rotation_cos_sin_extended(position, theta);
  const double p1_part = sum - p2;
  const double sum_error = (p1 - p1_part) + (p2 - (sum - p1_part));
  const double k = std::nearbyint(sum / two_pi_1);
  const double q1 = k * two_pi_1, q1_error = std::fma(k, two_pi_1, -q1);  // k * 2pi_1 exactly
  // sum and q1 are within 2pi of each other: sum - q1 is exact (Sterbenz) once
  // |sum| > 4pi, and exact or tiny-error below that.
  const double small = ((sum_error + e1 + e2) - q1_error) - k * two_pi_2 - k * two_pi_3;
  const double angle = (sum - q1) + small;
  return {std::cos(angle), std::sin(angle)};
}

/// The default RoPE schedule: theta_i = base^(-2i / dim) for pair i < dim / 2.
[[nodiscard]] inline double rope_theta(std::int64_t pair, std::int64_t dim, double base) noexcept {
  return std::pow(base, -2.0 * static_cast<double>(pair) / static_cast<double>(dim));
}

}  // namespace latte
