#pragma once
// Seeded orthonormal bases: `heads` matrices B_h in R^{r x d} whose rows are
// orthonormal (B_h B_h^T = I_r, so r <= d), as LAVO's orthogonal memory needs
// (paper 002 §3.1: "we initialize a set of orthogonal bases as introduced in
// Saxe et al. (2013)", i.e. orthogonal initialisation).
//
// Construction, per head: a d x r matrix G of independent standard normal
// numbers, its Householder QR G = Q R (Eigen), the columns of Q made unique by
// the sign of R's diagonal (Q := Q diag(sign R_jj), the Haar-distributed
// orthogonal factor that torch.nn.init.orthogonal_ also returns), B_h = Q^T.
// The QR runs in long double and is rounded to double once: rows orthonormal
// to ~1e-16. (Eigen has no SIMD packets for long double, which also keeps
// GCC 12's false-positive -Wmaybe-uninitialized warnings from Eigen's AVX-512
// GEMM kernels under -march=native out of every file that includes this.)
//
// Reproducible: the normal numbers come from std::mt19937_64 (whose output the
// C++ standard fixes) through a Box-Muller transform written here, not through
// std::normal_distribution (whose algorithm differs between standard
// libraries). The same seed gives bit-identical bases with the same libm; on
// another platform they agree to the last bits of cos/log/sqrt.
#include <cmath>
#include <cstdint>
#include <numbers>
#include <random>
#include <string>

#include <Eigen/Core>
#include <Eigen/QR>

#include "latte/core/error.hpp"
#include "latte/core/shape_check.hpp"
#include "latte/core/tensor.hpp"
#include "latte/core/types.hpp"

namespace latte {

namespace detail {

/// Standard normal numbers from a seed, the same on every standard library.
class SeededGaussian {
 public:
  explicit SeededGaussian(std::uint64_t seed) : engine_(seed) {}

  double next() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    // Box-Muller on two uniforms in (0, 1): 53 random bits, shifted off zero.
    const double u1 = uniform(), u2 = uniform();
    const double radius = std::sqrt(-2.0 * std::log(u1));
    const double angle = 2.0 * std::numbers::pi * u2;
    spare_ = radius * std::sin(angle);
    has_spare_ = true;
    return radius * std::cos(angle);
  }

 private:
  double uniform() {
    return (static_cast<double>(engine_() >> 11) + 0.5) * 0x1.0p-53;
  }
  std::mt19937_64 engine_;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

}  // namespace detail

/// `heads` orthonormal bases of `bases` rows in R^`dim`, as a [heads, bases, dim]
/// tensor (row i of head h is b_i of paper 002 eq. 3). Requires 1 <= bases <= dim.
[[nodiscard]] inline Tensor<double, 3> orthonormal_bases(index_t heads, index_t bases, index_t dim,
                                                         std::uint64_t seed) {
  detail::check_positive(heads, "heads");
  detail::check_positive(bases, "bases");
  detail::check_positive(dim, "dim");
  detail::require(bases <= dim, "bases",
                  detail::expected_given("number of orthonormal rows in R^" + std::to_string(dim),
                                         "<= " + std::to_string(dim), bases));
  Tensor<double, 3> result({heads, bases, dim});
  detail::SeededGaussian gaussian(seed);
  using Matrix = Eigen::Matrix<long double, Eigen::Dynamic, Eigen::Dynamic>;
  Matrix gaussian_matrix(dim, bases);
  for (index_t h = 0; h < heads; ++h) {
    for (index_t j = 0; j < bases; ++j)  // column by column: G(:, j)
      for (index_t i = 0; i < dim; ++i) gaussian_matrix(i, j) = gaussian.next();
    const Eigen::HouseholderQR<Matrix> qr(gaussian_matrix);
    const Matrix q = qr.householderQ() * Matrix::Identity(dim, bases);
    for (index_t j = 0; j < bases; ++j) {
      const long double sign = qr.matrixQR()(j, j) < 0 ? -1.0L : 1.0L;
      for (index_t i = 0; i < dim; ++i) result(h, j, i) = static_cast<double>(sign * q(i, j));
    }
  }
  return result;
}

}  // namespace latte
