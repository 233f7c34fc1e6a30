#pragma once
// RunRotations: VAPOR's rotations R^p (paper 000 eq. 22) for a run of
// consecutive positions p0, p0 + 1, ..., p0 + n - 1, written as the
// interleaved cos / sin rows that rotate_pairs applies. The causal Latte scan
// asks for one run of up to `run_length` positions at a time.
//
// Pair i of position p0 + j is the complex product of the run's base rotation
// (p0 theta_i) and an offset rotation (j theta_i):
//   cos = cos_b cos_j - sin_b sin_j,  sin = sin_b cos_j + cos_b sin_j.
// With both factors stored interleaved (cos rows (c, c), sin rows (-s, s)) a
// row is two multiplies and two fmas per vector and no lane shuffles:
//   cos_row = B_cos O_cos - B_sin O_sin,  sin_row = B_sin O_cos + B_cos O_sin
// (the first with -B_sin kept as a row of its own).
// The offsets depend on theta only and are kept while the next seek brings
// the same angles (every head of the default schedule), as is the base of the
// seek's position. The base moves in double by the rotation of one whole
// run and is recomputed exactly (core/angles.hpp) every `anchor_every` runs.
// Base and offsets are rounded to T and multiplied in T. An entry is within
// one epsilon of T of the exact cos / sin in fp32 and ~16 in fp64 (offsets
// are up to run_length - 1 double products), tested in test_numerics.cpp.
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "latte/backends/cpu/rotation.hpp"
#include "latte/backends/cpu/simd.hpp"
#include "latte/core/huge_page_allocator.hpp"
#include "latte/core/types.hpp"

namespace latte::cpu {

template <Real T>
class RunRotations {
 public:
  /// Runs between exact recomputations of the base: 1024 positions for fp32
  /// and 64 for fp64 at 16-position runs (a double complex product adds ~1e-16).
  static constexpr int anchor_every = std::is_same_v<T, float> ? 64 : 4;

  RunRotations() = default;
  RunRotations(index_t pairs, index_t run_length)
      : pairs_(pairs), run_length_(run_length), theta_(pairs), base_cos_(pairs), base_sin_(pairs),
        seek_cos_(pairs), seek_sin_(pairs), run_cos_(pairs), run_sin_(pairs), step_cos_(pairs),
        step_sin_(pairs), cos_j_(pairs), sin_j_(pairs), base_cos_row_(2 * pairs),
        base_sin_row_(2 * pairs), minus_base_sin_row_(2 * pairs),
        offset_cos_(run_length * 2 * pairs), offset_sin_(run_length * 2 * pairs) {}

  /// Points at one head's angles (`pairs` of them) and an absolute position.
  void seek(const double* theta, std::int64_t position) noexcept {
    const bool same_angles = has_angles_ && std::equal(theta, theta + pairs_, theta_.begin());
    if (!same_angles) {
      std::copy(theta, theta + pairs_, theta_.begin());
      has_angles_ = true;
      make_offsets();
    }
    if (!same_angles || position != seek_position_) {
      seek_position_ = position;
      anchor(position);
      std::copy(base_cos_.begin(), base_cos_.end(), seek_cos_.begin());
      std::copy(base_sin_.begin(), base_sin_.end(), seek_sin_.begin());
    } else {
      std::copy(seek_cos_.begin(), seek_cos_.end(), base_cos_.begin());
      std::copy(seek_sin_.begin(), seek_sin_.end(), base_sin_.begin());
    }
    position_ = position;
    runs_since_anchor_ = 0;
  }

  /// Writes the rows of positions position() + j, j < n <= run_length, to
  /// cos_rows + j * stride and sin_rows + j * stride (2 * pairs values each),
  /// then moves n positions on.
  void fill(index_t n, T* cos_rows, T* sin_rows, index_t stride) noexcept {
    write_base_rows();
    const index_t width = 2 * pairs_;
    const T* bc = base_cos_row_.data();
    const T* bs = base_sin_row_.data();
    const T* minus_bs = minus_base_sin_row_.data();
    for (index_t j = 0; j < n; ++j) {
      const T* oc = offset_cos_.data() + j * width;
      const T* os = offset_sin_.data() + j * width;
      T* cos_row = cos_rows + j * stride;
      T* sin_row = sin_rows + j * stride;
      index_t i = 0;
      constexpr auto W = static_cast<index_t>(simd::width<T>);
      for (; i + W <= width; i += W) {
        const auto c = simd::load(bc + i);
        const auto o_cos = simd::load(oc + i), o_sin = simd::load(os + i);
        simd::store(cos_row + i, simd::fma(simd::load(minus_bs + i), o_sin, c * o_cos));
        simd::store(sin_row + i, simd::fma(simd::load(bs + i), o_cos, c * o_sin));
      }
      for (; i < width; ++i) {
        cos_row[i] = bc[i] * oc[i] - bs[i] * os[i];
        sin_row[i] = bs[i] * oc[i] + bc[i] * os[i];
      }
    }
    advance(n);
  }

  [[nodiscard]] std::int64_t position() const noexcept { return position_; }

 private:
  /// Offsets j theta for j < run_length (interleaved, in T) as products of the
  /// one-position rotation, and the rotation of a whole run (exact, in double).
  void make_offsets() noexcept {
    const auto pairs = static_cast<std::size_t>(pairs_);
    rotations_at(theta_.data(), 1, step_cos_.data(), step_sin_.data(), pairs);
    std::fill(cos_j_.begin(), cos_j_.end(), 1.0);
    std::fill(sin_j_.begin(), sin_j_.end(), 0.0);
    const index_t width = 2 * pairs_;
    for (index_t j = 0; j < run_length_; ++j) {
      interleave_rotations(cos_j_.data(), sin_j_.data(), offset_cos_.data() + j * width,
                           offset_sin_.data() + j * width, pairs);
      compose_rotations(cos_j_.data(), sin_j_.data(), step_cos_.data(), step_sin_.data(), pairs);
    }
    // exact, not the run_length-th product
    rotations_at(theta_.data(), run_length_, run_cos_.data(), run_sin_.data(), pairs);
  }

  void advance(index_t n) noexcept {
    position_ += n;
    if (n == run_length_ && ++runs_since_anchor_ < anchor_every) {
      compose_rotations(base_cos_.data(), base_sin_.data(), run_cos_.data(), run_sin_.data(),
                        base_cos_.size());
      return;
    }
    anchor(position_);  // due, or after a short run (a scan's last): start exactly
    runs_since_anchor_ = 0;
  }

  void anchor(std::int64_t position) noexcept {
    rotations_at(theta_.data(), position, base_cos_.data(), base_sin_.data(), base_cos_.size());
  }

  void write_base_rows() noexcept {
    interleave_rotations(base_cos_.data(), base_sin_.data(), base_cos_row_.data(),
                         base_sin_row_.data(), base_cos_.size());
    for (index_t i = 0; i < 2 * pairs_; ++i) minus_base_sin_row_[i] = -base_sin_row_[i];
  }

  index_t pairs_ = 0, run_length_ = 0;
  std::vector<double> theta_;
  bool has_angles_ = false;
  std::int64_t seek_position_ = 0, position_ = 0;
  int runs_since_anchor_ = 0;
  std::vector<double> base_cos_, base_sin_, seek_cos_, seek_sin_, run_cos_, run_sin_;
  std::vector<double> step_cos_, step_sin_, cos_j_, sin_j_;  // for make_offsets
  AlignedVector<T> base_cos_row_, base_sin_row_, minus_base_sin_row_, offset_cos_, offset_sin_;
};

}  // namespace latte::cpu
