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
    for (std::size_t i = 0; i < cos_.size(); ++i) {
      const CosSin step = rotation_cos_sin(1, theta[i]);
      step_cos_[i] = step.cos;
      step_sin_[i] = step.sin;
    }
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
    double* __restrict cos_d = cos_.data();
    double* __restrict sin_d = sin_.data();
    const double* __restrict step_cos = step_cos_.data();
    const double* __restrict step_sin = step_sin_.data();
    for (std::size_t i = 0; i < cos_.size(); ++i) {
      const double c = cos_d[i] * step_cos[i] - sin_d[i] * step_sin[i];
      const double s = sin_d[i] * step_cos[i] + cos_d[i] * step_sin[i];
      cos_d[i] = c;
      sin_d[i] = s;
    }
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
    const double* __restrict cos_d = cos_.data();
    const double* __restrict sin_d = sin_.data();
    T* __restrict cos_t = cos_t_.data();
    T* __restrict sin_t = sin_t_.data();
    for (std::size_t i = 0; i < cos_.size(); ++i) {
      const T c = static_cast<T>(cos_d[i]), s = static_cast<T>(sin_d[i]);
      cos_t[2 * i] = c;
      cos_t[2 * i + 1] = c;
      sin_t[2 * i] = -s;
      sin_t[2 * i + 1] = s;
    }
  }

  void anchor(std::int64_t position) noexcept {
    position_ = position;
    since_anchor_ = 0;
    for (std::size_t i = 0; i < cos_.size(); ++i) {
      const CosSin at = rotation_cos_sin(position, theta_[i]);
      cos_[i] = at.cos;
      sin_[i] = at.sin;
    }
    write_interleaved();
  }

  const double* theta_ = nullptr;
  std::int64_t position_ = 0;
  int since_anchor_ = 0;
  std::vector<double> cos_, sin_, step_cos_, step_sin_;  // one per pair
  std::vector<T> cos_t_, sin_t_;                         // interleaved rows, 2 * pairs
};

}  // namespace latte::cpu
