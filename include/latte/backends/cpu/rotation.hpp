#pragma once
// RotationStepper: cos/sin of (position * theta_i) for consecutive positions
// without a sincos per pair per token. Each step multiplies by the rotation
// of one position in double precision; every `anchor_every` steps the values
// are recomputed exactly (reduced modulo 2*pi in double, core/angles.hpp), so
// the drift stays ~1e-15, far below fp32 and fp64 output tolerances.
#include <cstdint>
#include <vector>

#include "latte/core/angles.hpp"
#include "latte/core/types.hpp"

namespace latte::cpu {

template <Real T>
class RotationStepper {
 public:
  static constexpr int anchor_every = 64;

  RotationStepper() = default;
  explicit RotationStepper(index_t pairs)
      : cos_(pairs), sin_(pairs), step_cos_(pairs), step_sin_(pairs), cos_t_(pairs), sin_t_(pairs) {}

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

  /// Moves to the next position.
  void next() noexcept {
    if (++since_anchor_ == anchor_every) {
      anchor(position_ + 1);
      return;
    }
    ++position_;
    for (std::size_t i = 0; i < cos_.size(); ++i) {
      const double c = cos_[i] * step_cos_[i] - sin_[i] * step_sin_[i];
      const double s = sin_[i] * step_cos_[i] + cos_[i] * step_sin_[i];
      cos_[i] = c;
      sin_[i] = s;
      cos_t_[i] = static_cast<T>(c);
      sin_t_[i] = static_cast<T>(s);
    }
  }

  /// Rotates the pairs (2i, 2i+1) of `row` by R^{+position} (forward) or R^{-position}.
  void rotate(T* row, bool forward) const noexcept {
    const T sign = forward ? T(1) : T(-1);
    for (std::size_t i = 0; i < cos_t_.size(); ++i) {
      const T c = cos_t_[i], s = sign * sin_t_[i];
      const T x = row[2 * i], y = row[2 * i + 1];
      row[2 * i] = c * x - s * y;
      row[2 * i + 1] = s * x + c * y;
    }
  }

  [[nodiscard]] std::int64_t position() const noexcept { return position_; }

 private:
  void anchor(std::int64_t position) noexcept {
    position_ = position;
    since_anchor_ = 0;
    for (std::size_t i = 0; i < cos_.size(); ++i) {
      const CosSin at = rotation_cos_sin(position, theta_[i]);
      cos_[i] = at.cos;
      sin_[i] = at.sin;
      cos_t_[i] = static_cast<T>(at.cos);
      sin_t_[i] = static_cast<T>(at.sin);
    }
  }

  const double* theta_ = nullptr;
  std::int64_t position_ = 0;
  int since_anchor_ = 0;
  std::vector<double> cos_, sin_, step_cos_, step_sin_;
  std::vector<T> cos_t_, sin_t_;
};

}  // namespace latte::cpu
