#pragma once
// Column passes over a block of n strided rows (row r at x + r * stride, L
// wide), the key half of a bidirectional pass (paper 000 eq. 7):
//
//   column_max_rows:      m[l] = max_r x[r][l]
//   shifted_column_exps:  e[r][l] = exp(x[r][l] - shift[l]) into a contiguous
//                         n x L block, sum[l] = sum_r e[r][l] and m[l] as above;
//                         optionally copies the rows of a second strided
//                         input (the block's values) in the same pass
//
// Each reads every row once, in order, straight from the input (a block of
// rows of one head lies H * L apart). Columns go in groups of four vectors
// whose running maxima and sums stay in registers across the rows: no
// intermediate copy of the rows and no per-row loads and stores of the sums.
// The sums run over r in order from zero, one addition per term.
#include <algorithm>
#include <cmath>
#include <limits>

#include "latte/backends/cpu/simd.hpp"
#include "latte/core/types.hpp"

namespace latte::cpu {

/// Rows to copy alongside shifted_column_exps: row r of `from` (at from + r *
/// stride, `width` wide) to to + r * width. The bidirectional pass copies its
/// block of values so: each value row is loaded next to the key row of the
/// same token, while the exponentials run (a separate copy loop waited on
/// every row it loaded: the pass was about 1 % slower, 1 thread, T = 16K).
template <Real T>
struct RowCopy {
  const T* from;
  index_t stride, width;
  T* to;

  void copy_row(index_t r) const noexcept { simd::copy(from + r * stride, width, to + r * width); }
};

namespace detail {

/// The columns [l0, l0 + G W) of column_max_rows.
template <Real T, int G>
inline void column_max_group(const T* x, index_t stride, index_t n, index_t l0,
                             T* column_max) noexcept {
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  B m[G];
  for (int g = 0; g < G; ++g) m[g] = B(-std::numeric_limits<T>::infinity());
  for (index_t r = 0; r < n; ++r)
    for (int g = 0; g < G; ++g) m[g] = simd::max(m[g], simd::load(x + r * stride + l0 + g * W));
  for (int g = 0; g < G; ++g) simd::store(column_max + l0 + g * W, m[g]);
}

/// The columns [l0, l0 + G W) of shifted_column_exps.
template <Real T, int G>
inline void shifted_exps_group(const T* x, index_t stride, index_t n, index_t L, index_t l0,
                               const T* shift, T* e, T* column_sum, T* column_max,
                               const RowCopy<T>* copy) noexcept {
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  B s[G], m[G], sum[G];
  for (int g = 0; g < G; ++g) {
    s[g] = simd::load(shift + l0 + g * W);
    m[g] = B(-std::numeric_limits<T>::infinity());
    sum[g] = B(T(0));
  }
  for (index_t r = 0; r < n; ++r) {
    for (int g = 0; g < G; ++g) {
      const B value = simd::load(x + r * stride + l0 + g * W);
      m[g] = simd::max(m[g], value);
      const B exponential = simd::exp(value - s[g]);
      simd::store(e + r * L + l0 + g * W, exponential);
      sum[g] = sum[g] + exponential;
    }
    if (copy) copy->copy_row(r);
  }
  for (int g = 0; g < G; ++g) {
    simd::store(column_sum + l0 + g * W, sum[g]);
    simd::store(column_max + l0 + g * W, m[g]);
  }
}

}  // namespace detail

/// column_max[l] = max_{r < n} x[r * stride + l] for l < L (-inf when n = 0).
template <Real T>
void column_max_rows(const T* x, index_t stride, index_t n, index_t L, T* column_max) noexcept {
  constexpr index_t W = simd::width<T>;
  index_t l0 = 0;
  for (; l0 + 4 * W <= L; l0 += 4 * W) detail::column_max_group<T, 4>(x, stride, n, l0, column_max);
  for (; l0 + W <= L; l0 += W) detail::column_max_group<T, 1>(x, stride, n, l0, column_max);
  for (; l0 < L; ++l0) {
    T m = -std::numeric_limits<T>::infinity();
    for (index_t r = 0; r < n; ++r) m = std::max(m, x[r * stride + l0]);
    column_max[l0] = m;
  }
}

/// For l < L: e[r * L + l] = exp(x[r * stride + l] - shift[l]) for r < n,
/// column_sum[l] = sum_r e[r * L + l] and column_max[l] = max_r x[r * stride + l];
/// with `copy`, also its n rows (in the pass over the first group of columns).
template <Real T>
void shifted_column_exps(const T* x, index_t stride, index_t n, index_t L, const T* shift, T* e,
                         T* column_sum, T* column_max, const RowCopy<T>* copy = nullptr) noexcept {
  constexpr index_t W = simd::width<T>;
  index_t l0 = 0;
  for (; l0 + 4 * W <= L; l0 += 4 * W, copy = nullptr)
    detail::shifted_exps_group<T, 4>(x, stride, n, L, l0, shift, e, column_sum, column_max, copy);
  for (; l0 + W <= L; l0 += W, copy = nullptr)
    detail::shifted_exps_group<T, 1>(x, stride, n, L, l0, shift, e, column_sum, column_max, copy);
  if (copy)  // no whole vector of columns (L < width)
    for (index_t r = 0; r < n; ++r) copy->copy_row(r);
  for (; l0 < L; ++l0) {
    T sum = 0, m = -std::numeric_limits<T>::infinity();
    for (index_t r = 0; r < n; ++r) {
      const T value = x[r * stride + l0];
      m = std::max(m, value);
      e[r * L + l0] = std::exp(value - shift[l0]);
      sum += e[r * L + l0];
    }
    column_sum[l0] = sum;
    column_max[l0] = m;
  }
}

}  // namespace latte::cpu
