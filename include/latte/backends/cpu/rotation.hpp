#pragma once
// RotationStepper: cos/sin of (position * theta_i) for consecutive positions
// without a sincos per pair per token. Each step multiplies by the rotation
// of one position in double precision; every `anchor_every` steps the values
// are recomputed exactly (reduced modulo 2*pi in double, core/angles.hpp).
// A step adds ~1e-16 of drift, so 64 steps between anchors for fp64 keep it
// ~1e-14, and 1024 for fp32 ~1e-13, each far below its type's rounding.
//
// The stepper keeps each position's rotation as two interleaved rows (cos_row,
// sin_row), which rotate_pairs applies with vector instructions. (The causal
// Latte scan takes its rows per run of positions from run_rotations.hpp.)
#include <cstdint>
#include <type_traits>
#include <vector>

#include "latte/backends/cpu/simd.hpp"
#include "latte/core/angles.hpp"
#include "latte/core/types.hpp"

namespace latte::cpu {

/// out = R^{+p} in (Forward) or R^{-p} in over n values (n / 2 pairs; an odd
/// last value is copied as it is), from position p's interleaved rows
/// (RotationStepper::cos_row / sin_row): with x the row and swap(x) its pairs
/// exchanged, R^{+p} x = x * cos_row + swap(x) * sin_row and R^{-p} x =
/// x * cos_row - swap(x) * sin_row. `out` may be `in`.
template <bool Forward, Real T>
void rotate_pairs(const T* in, T* out, const T* cos_row, const T* sin_row, index_t n) noexcept {
  index_t i = 0;
  if constexpr (simd::width<T> >= 2) {
    constexpr auto W = static_cast<index_t>(simd::width<T>);
    for (; i + W <= n; i += W) {
      const auto x = simd::load(in + i);
      const auto straight = x * simd::load(cos_row + i);
      const auto crossed = simd::swap_pairs(x) * simd::load(sin_row + i);
      simd::store(out + i, Forward ? straight + crossed : straight - crossed);
    }
  }
  for (; i + 1 < n; i += 2) {
    const T x = in[i], y = in[i + 1];
    const T straight_x = x * cos_row[i], straight_y = y * cos_row[i + 1];
    const T crossed_x = y * sin_row[i], crossed_y = x * sin_row[i + 1];
    out[i] = Forward ? straight_x + crossed_x : straight_x - crossed_x;
    out[i + 1] = Forward ? straight_y + crossed_y : straight_y - crossed_y;
  }
  if (i < n) out[i] = in[i];
}

/// cos[i], sin[i] <- cos and sin of position * theta[i], i < pairs (reduced as
/// in core/angles.hpp).
inline void rotations_at(const double* theta, std::int64_t position, double* cos, double* sin,
                         std::size_t pairs) noexcept {
  for (std::size_t i = 0; i < pairs; ++i) {
    const CosSin at = rotation_cos_sin(position, theta[i]);
    cos[i] = at.cos;
    sin[i] = at.sin;
  }
}

/// (cos[i], sin[i]) <- (cos[i], sin[i]) times the rotation (by_cos[i], by_sin[i]),
/// i < pairs: the angles add (one complex product per pair, in double).
inline void compose_rotations(double* __restrict cos, double* __restrict sin,
                              const double* __restrict by_cos, const double* __restrict by_sin,
                              std::size_t pairs) noexcept {
  for (std::size_t i = 0; i < pairs; ++i) {
    const double c = cos[i] * by_cos[i] - sin[i] * by_sin[i];
    const double s = sin[i] * by_cos[i] + cos[i] * by_sin[i];
    cos[i] = c;
    sin[i] = s;
  }
}

/// The rows rotate_pairs takes, in T, from double cos / sin: pair i becomes
/// (cos, cos) in cos_row and (-sin, sin) in sin_row.
template <Real T>
void interleave_rotations(const double* __restrict cos, const double* __restrict sin,
                          T* __restrict cos_row, T* __restrict sin_row,
                          std::size_t pairs) noexcept {
  for (std::size_t i = 0; i < pairs; ++i) {
    const T c = static_cast<T>(cos[i]), s = static_cast<T>(sin[i]);
    cos_row[2 * i] = c;
    cos_row[2 * i + 1] = c;
    sin_row[2 * i] = -s;
    sin_row[2 * i + 1] = s;
  }
}

template <Real T>
class RotationStepper {
 public:
  static constexpr int anchor_every = std::is_same_v<T, float> ? 1024 : 64;

  RotationStepper() = default;
  explicit RotationStepper(index_t pairs)
      : cos_(pairs), sin_(pairs), step_cos_(pairs), step_sin_(pairs), cos_t_(2 * pairs),
        sin_t_(2 * pairs) {}

  /// Points the stepper at one head's angles and an absolute position.
  void seek(const double* theta, std::int64_t position) noexcept {
    theta_ = theta;
    rotations_at(theta, 1, step_cos_.data(), step_sin_.data(), step_cos_.size());
    anchor(position);
  }

  /// Moves to the next position: (cos, sin) of every pair times the rotation
  /// of one position (in double, one lane per pair), then the rows in T.
  void next() noexcept {
    if (++since_anchor_ == anchor_every) {
      anchor(position_ + 1);
      return;
    }
    ++position_;
    compose_rotations(cos_.data(), sin_.data(), step_cos_.data(), step_sin_.data(), cos_.size());
    write_interleaved();
  }

  /// Rotates the pairs (2i, 2i+1) of `row` by R^{+position} (forward) or R^{-position}.
  void rotate(T* row, bool forward) const noexcept {
    const index_t n = static_cast<index_t>(cos_t_.size());
    if (forward) rotate_pairs<true>(row, row, cos_t_.data(), sin_t_.data(), n);
    else rotate_pairs<false>(row, row, cos_t_.data(), sin_t_.data(), n);
  }

  /// The rotation at the current position as rows of 2 * pairs values:
  /// cos_row[2i] = cos_row[2i+1] = cos_i, sin_row[2i] = -sin_i and
  /// sin_row[2i+1] = sin_i, the form rotate_pairs takes.
  [[nodiscard]] const T* cos_row() const noexcept { return cos_t_.data(); }
  [[nodiscard]] const T* sin_row() const noexcept { return sin_t_.data(); }

  [[nodiscard]] std::int64_t position() const noexcept { return position_; }

 private:
  /// cos_t_ / sin_t_ from the double values: pair i is (cos, cos) and (-sin, sin).
  void write_interleaved() noexcept {
    interleave_rotations(cos_.data(), sin_.data(), cos_t_.data(), sin_t_.data(), cos_.size());
  }

  void anchor(std::int64_t position) noexcept {
    position_ = position;
    since_anchor_ = 0;
    rotations_at(theta_, position, cos_.data(), sin_.data(), cos_.size());
    write_interleaved();
  }

  const double* theta_ = nullptr;
  std::int64_t position_ = 0;
  int since_anchor_ = 0;
  std::vector<double> cos_, sin_, step_cos_, step_sin_;  // one per pair
  std::vector<T> cos_t_, sin_t_;                         // interleaved rows, 2 * pairs
};

}  // namespace latte::cpu
