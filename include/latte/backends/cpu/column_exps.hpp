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

/// The columns [l0, l0 + G W) of column_max_rows; with Tail the last vector
/// holds `last` columns (masked loads and stores, lanes past them unused).
template <Real T, int G, bool Tail>
inline void column_max_group(const T* x, index_t stride, index_t n, index_t l0, T* column_max,
                             index_t last) noexcept {
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  B m[G];
  simd::unrolled<G>([&](auto g) { m[g] = B(-std::numeric_limits<T>::infinity()); });
  for (index_t r = 0; r < n; ++r)
    simd::unrolled<G>([&](auto g) {
      constexpr bool part = Tail && decltype(g)::value == G - 1;
      m[g] = simd::max(m[g], simd::load_lanes<part>(x + r * stride + l0 + g * W, last));
    });
  simd::unrolled<G>([&](auto g) {
    simd::store_lanes<Tail && decltype(g)::value == G - 1>(column_max + l0 + g * W, m[g], last);
  });
}

/// The columns [l0, l0 + G W) of shifted_column_exps; with Tail the last
/// vector holds `last` columns (masked loads and stores, lanes past them read
/// as 0 and unused).
template <Real T, int G, bool Tail>
inline void shifted_exps_group(const T* x, index_t stride, index_t n, index_t L, index_t l0,
                               const T* shift, T* e, T* column_sum, T* column_max,
                               const RowCopy<T>* copy, index_t last) noexcept {
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  B s[G], m[G], sum[G];
  simd::unrolled<G>([&](auto g) {
    s[g] = simd::load_lanes<Tail && decltype(g)::value == G - 1>(shift + l0 + g * W, last);
    m[g] = B(-std::numeric_limits<T>::infinity());
    sum[g] = B(T(0));
  });
  for (index_t r = 0; r < n; ++r) {
    simd::unrolled<G>([&](auto g) {
      constexpr bool part = Tail && decltype(g)::value == G - 1;
      const B value = simd::load_lanes<part>(x + r * stride + l0 + g * W, last);
      m[g] = simd::max(m[g], value);
      const B exponential = simd::exp(value - s[g]);
      simd::store_lanes<part>(e + r * L + l0 + g * W, exponential, last);
      sum[g] = sum[g] + exponential;
    });
    if (copy) copy->copy_row(r);
  }
  simd::unrolled<G>([&](auto g) {
    constexpr bool part = Tail && decltype(g)::value == G - 1;
    simd::store_lanes<part>(column_sum + l0 + g * W, sum[g], last);
    simd::store_lanes<part>(column_max + l0 + g * W, m[g], last);
  });
}

}  // namespace detail

/// column_max[l] = max_{r < n} x[r * stride + l] for l < L (-inf when n = 0).
template <Real T>
void column_max_rows(const T* x, index_t stride, index_t n, index_t L, T* column_max) noexcept {
  simd::for_each_vector_group<T, 4>(L, [&](index_t l0, index_t last, auto groups, auto tail) {
    detail::column_max_group<T, groups.value, tail.value>(x, stride, n, l0, column_max, last);
  });
}

/// For l < L: e[r * L + l] = exp(x[r * stride + l] - shift[l]) for r < n,
/// column_sum[l] = sum_r e[r * L + l] and column_max[l] = max_r x[r * stride + l];
/// with `copy`, also its n rows (in the pass over the first group of columns).
template <Real T>
void shifted_column_exps(const T* x, index_t stride, index_t n, index_t L, const T* shift, T* e,
                         T* column_sum, T* column_max, const RowCopy<T>* copy = nullptr) noexcept {
  simd::for_each_vector_group<T, 4>(L, [&](index_t l0, index_t last, auto groups, auto tail) {
    detail::shifted_exps_group<T, groups.value, tail.value>(x, stride, n, L, l0, shift, e,
                                                            column_sum, column_max, copy, last);
    copy = nullptr;  // copied in the pass over the first group
  });
  if (copy)  // no columns (L = 0)
    for (index_t r = 0; r < n; ++r) copy->copy_row(r);
}

}  // namespace latte::cpu
