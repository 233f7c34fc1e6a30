#pragma once
// The product of a banded tile with a block of rows, reading only the band:
//
//   band_product:  C[i][d] += sum_{j = first(i)}^{last(i)} A(i, j) X[j][d]
//
// for the tiles of blocked softmax attention that straddle the causal diagonal
// or a sliding window's edge (cpu/softmax.hpp): the forward's P V, the
// backward's dS K (rows i are queries, j keys) and P^T G, dS^T Q (rows i are
// keys, j the queries that see them). A GEMM over the whole tile would multiply
// the zeros outside the band by the operand rows there, and 0 * NaN is NaN: a
// NaN or inf in a key, value or gradient row would reach rows that cannot see
// it. Row by row (Eigen's rank-1 updates and vector-matrix products) keeps the
// band but runs at a fraction of a GEMM's rate: those tiles were two thirds of
// a window-128 backward's tiles and most of its time.
//
// Here rows go four at a time through cpu::detail::fma_tile (block_contractions.hpp):
// the columns all four rows see, [first(i0 + 3), last(i0)], in one register
// tile, then each row's own ragged ends (a few columns where the band's edge
// crosses the tile) one row at a time. first and last must be non-decreasing in
// i (a band). Which terms are summed, and in which order, depends on the band
// alone, so a row's result is the same bits whatever the rows outside its band
// hold.
#include <algorithm>

#include "latte/backends/cpu/block_contractions.hpp"
#include "latte/backends/cpu/simd.hpp"
#include "latte/core/types.hpp"

namespace latte::cpu {

/// A banded tile A(i, j) = a[i * row_step + j * column_step] (a row-major tile,
/// or its transpose with the steps swapped).
template <Real T>
struct BandTile {
  const T* a;
  index_t row_step, column_step;
};

/// Rows of D elements: row j at data + j * stride.
template <class T>
struct StridedRows {
  T* data;
  index_t stride;
};

namespace detail {

/// acc[0][..] += sum_{j = lo}^{hi} A(i, j) X[j][d0 ..] for one row i.
template <Real T, int CV, bool Tail>
inline void band_row_terms(simd::batch<T> (&acc)[1][CV], const BandTile<T>& A, index_t i, index_t lo,
                           index_t hi, StridedRows<const T> X, index_t d0, index_t last) noexcept {
  if (lo > hi) return;
  fma_tile<T, 1, CV, Tail>(acc, A.a + i * A.row_step + lo * A.column_step, A.row_step, A.column_step,
                           X.data + lo * X.stride + d0, X.stride, hi - lo + 1, last);
}

template <Real T, int CV, bool Tail, class First, class Last>
LATTE_FLATTEN void band_product_columns(index_t n, const BandTile<T>& A, StridedRows<const T> X,
                                        StridedRows<T> C, index_t d0, index_t last, First& first,
                                        Last& last_of) noexcept {
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  auto load_row = [&](B (&acc)[1][CV], index_t i) {
    simd::unrolled<CV>([&](auto c) {
      constexpr bool part = Tail && decltype(c)::value == CV - 1;
      acc[0][c] = simd::load_lanes<part>(C.data + i * C.stride + d0 + c * W, last);
    });
  };
  auto store_row = [&](const B (&acc)[1][CV], index_t i) {
    simd::unrolled<CV>([&](auto c) {
      constexpr bool part = Tail && decltype(c)::value == CV - 1;
      simd::store_lanes<part>(C.data + i * C.stride + d0 + c * W, acc[0][c], last);
    });
  };
  // Row i alone over columns [lo1, hi1], then [lo2, hi2] (either may be empty).
  auto row_terms = [&](index_t i, index_t lo1, index_t hi1, index_t lo2, index_t hi2) {
    B row[1][CV];
    load_row(row, i);
    band_row_terms<T, CV, Tail>(row, A, i, lo1, hi1, X, d0, last);
    band_row_terms<T, CV, Tail>(row, A, i, lo2, hi2, X, d0, last);
    store_row(row, i);
  };
  auto whole_row = [&](index_t i) { row_terms(i, first(i), last_of(i), 1, 0); };
  index_t i0 = 0;
  for (; i0 + 4 <= n; i0 += 4) {
    const index_t common_lo = first(i0 + 3), common_hi = last_of(i0);
    if (common_lo <= common_hi) {
      B acc[4][CV];
      simd::unrolled<4 * CV>([&](auto k) {
        constexpr bool part = Tail && decltype(k)::value % CV == CV - 1;
        acc[k / CV][k % CV] = simd::load_lanes<part>(C.data + (i0 + k / CV) * C.stride + d0 + (k % CV) * W, last);
      });
      fma_tile<T, 4, CV, Tail>(acc, A.a + i0 * A.row_step + common_lo * A.column_step, A.row_step,
                               A.column_step, X.data + common_lo * X.stride + d0, X.stride,
                               common_hi - common_lo + 1, last);
      simd::unrolled<4 * CV>([&](auto k) {
        constexpr bool part = Tail && decltype(k)::value % CV == CV - 1;
        simd::store_lanes<part>(C.data + (i0 + k / CV) * C.stride + d0 + (k % CV) * W, acc[k / CV][k % CV], last);
      });
      for (index_t i = i0; i < i0 + 4; ++i) {  // the ragged ends: [first(i), common_lo), (common_hi, last(i)]
        const index_t lo = first(i), hi = last_of(i);
        if (lo >= common_lo && hi <= common_hi) continue;
        row_terms(i, lo, std::min(hi, common_lo - 1), std::max(lo, common_hi + 1), hi);
      }
    } else {
      for (index_t i = i0; i < i0 + 4; ++i) whole_row(i);
    }
  }
  for (index_t i = i0; i < n; ++i) whole_row(i);
}

}  // namespace detail

/// C[i][d] += sum_{j = first(i)}^{last(i)} A(i, j) X[j][d] for i < n, d < D
/// (see above; an empty band row when first(i) > last(i)). Reads A and X
/// inside the band only.
template <Real T, class First, class Last>
void band_product(index_t n, const BandTile<T>& A, StridedRows<const T> X, index_t D, StridedRows<T> C,
                  First&& first, Last&& last) noexcept {
  simd::for_each_vector_group<T, tile_vectors>(D, [&](index_t d0, index_t lanes, auto vectors, auto tail) {
    detail::band_product_columns<T, vectors.value, tail.value>(n, A, X, C, d0, lanes, first, last);
  });
}

}  // namespace latte::cpu
