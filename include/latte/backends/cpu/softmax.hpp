#pragma once
// CPU backend for exact softmax attention: blocked online softmax (the flash
// algorithm) with Eigen GEMMs for the score and value products, OpenMP over
// (batch, head, query block), and a vectorised KV-cache decode step.
//
// For a query block Q_i and each key block K_j inside its allowed band:
//   S = scale Q_i K_j^T (masked), m' = max(m, rowmax S), P = exp(S - m'),
//   l = l exp(m - m') + rowsum P, O = O exp(m - m') + P V_j;  finally O / l.
// Only blocks that intersect the causal / sliding-window band are visited,
// so a window costs O(T * w). Workspace is per worker and independent of T.
// The decode step is softmax_row_blocked over the ring (softmax_row.hpp).
// The backward (FlashAttention-2's) is below the forward.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "latte/backends/cpu/band_products.hpp"
#include "latte/backends/cpu/parallel.hpp"
#include "latte/backends/cpu/simd.hpp"
#include "latte/backends/cpu/softmax_row.hpp"
#include "latte/backends/reference/softmax.hpp"
#include "latte/core/huge_page_allocator.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/policies/window.hpp"

namespace latte::cpu {

/// One worker's workspace for attend_query_block: a block_q x block_k score
/// tile, the block_q x Dv accumulator and three per-row vectors. Independent of T.
template <Real T>
struct OnlineSoftmaxScratch {
  using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Matrix scores, acc;
  AlignedVector<T> row_max, row_sum, correction;

  OnlineSoftmaxScratch() = default;
  OnlineSoftmaxScratch(index_t block_q, index_t block_k, index_t Dv)
      : scores(block_q, block_k), acc(block_q, Dv), row_max(static_cast<std::size_t>(block_q)),
        row_sum(static_cast<std::size_t>(block_q)), correction(static_cast<std::size_t>(block_q)) {}
};

/// Where the keys and values a query block attends to live: key j's row is
/// keys + j * key_stride (values alike), for every j the block may see.
template <Real T>
struct KeyValueRows {
  const T* keys;
  index_t key_stride;
  const T* values;
  index_t value_stride;
};

/// The smallest t in [0, Tn) with pred(t) (pred monotone: false, then true); Tn if none.
template <class Pred>
index_t first_where(index_t Tn, Pred&& pred) {
  index_t lo = 0, hi = Tn;
  while (lo < hi) {
    const index_t mid = lo + (hi - lo) / 2;
    if (pred(mid))
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo;
}

/// The band of the tile of query rows i0 .. i0 + nq - 1 and keys j0 .. j0 + nk - 1
/// (row t sees keys lowest(t) .. highest(t), both non-decreasing in t) in tile
/// coordinates, as cpu::band_product takes it: row r sees key columns
/// keys_first(r) .. keys_last(r); key column c is seen by rows rows_first(c) ..
/// rows_last(c). All four are non-decreasing; a range is empty when first > last.
template <class Lowest, class Highest>
struct TileBand {
  index_t i0, j0, nq, nk;
  const Lowest& lowest;
  const Highest& highest;
  [[nodiscard]] auto keys_first() const {
    return [this](index_t r) { return std::max<index_t>(lowest(i0 + r) - j0, 0); };
  }
  [[nodiscard]] auto keys_last() const {
    return [this](index_t r) { return std::min<index_t>(highest(i0 + r) - j0, nk - 1); };
  }
  [[nodiscard]] auto rows_first() const {
    return [this](index_t c) { return first_where(nq, [&](index_t r) { return highest(i0 + r) >= j0 + c; }); };
  }
  [[nodiscard]] auto rows_last() const {
    return [this](index_t c) { return first_where(nq, [&](index_t r) { return lowest(i0 + r) > j0 + c; }) - 1; };
  }
};
template <class Lowest, class Highest>
TileBand<Lowest, Highest> tile_band(index_t i0, index_t j0, index_t nq, index_t nk, const Lowest& lowest,
                                    const Highest& highest) {
  return {i0, j0, nq, nk, lowest, highest};
}

/// The flash step for query rows i0 .. i0 + nq - 1 (q rows `q_stride` apart,
/// nq <= the scratch's block_q): row t sees keys lowest(t) .. highest(t), both
/// monotone in t. Keys are visited in blocks of `block_k` from `first_block`
/// (<= lowest(i0)) up to highest(i0 + nq - 1); for each, S = scale Q K^T
/// masked to each row's band, then the online-softmax update above. A block
/// every row sees whole goes through one GEMM with V; a block on the band's
/// edge multiplies each row's visible keys only, so a NaN or inf in a value
/// no row may see never reaches it (0 * NaN in a GEMM would). Which path a
/// block takes depends on the band only, never on the values, so a row's
/// result is the same bits whatever the rows it cannot see hold.
/// Writes the normalised rows to out (rows `out_stride` apart).
template <Real T, class Lowest, class Highest>
void attend_query_block(const T* q, index_t q_stride, index_t i0, index_t nq, index_t Dk,
                        index_t Dv, const KeyValueRows<T>& kv, index_t first_block,
                        index_t block_k, T scale, Lowest&& lowest, Highest&& highest,
                        OnlineSoftmaxScratch<T>& s, T* out, index_t out_stride) {
  using Matrix = typename OnlineSoftmaxScratch<T>::Matrix;
  using ConstMap = Eigen::Map<const Matrix, Eigen::Unaligned, Eigen::OuterStride<>>;
  using Map = Eigen::Map<Matrix, Eigen::Unaligned, Eigen::OuterStride<>>;
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  const ConstMap Q(q, nq, Dk, Eigen::OuterStride<>(q_stride));
  auto acc = s.acc.topRows(nq);
  acc.setZero();
  std::fill(s.row_max.begin(), s.row_max.begin() + nq, neg_inf);
  std::fill(s.row_sum.begin(), s.row_sum.begin() + nq, T(0));
  // Key range any row of the block may see (lowest/highest are monotone in t).
  const index_t key_lo = lowest(i0), key_hi = highest(i0 + nq - 1);
  for (index_t j0 = first_block; j0 <= key_hi; j0 += block_k) {
    const index_t j_first = std::max(j0, key_lo);
    const index_t nk = std::min(j0 + block_k, key_hi + 1) - j_first;
    if (nk <= 0) continue;
    const ConstMap K(kv.keys + j_first * kv.key_stride, nk, Dk,
                     Eigen::OuterStride<>(kv.key_stride));
    const ConstMap V(kv.values + j_first * kv.value_stride, nk, Dv,
                     Eigen::OuterStride<>(kv.value_stride));
    auto S = s.scores.topLeftCorner(nq, nk);
    S.noalias() = (Q * K.transpose()) * scale;
    for (index_t r = 0; r < nq; ++r) {
      const index_t t = i0 + r, lo = lowest(t), hi = highest(t);
      T* row = S.row(r).data();
      T block_max = neg_inf;
      for (index_t c = 0; c < nk; ++c) {
        const index_t key = j_first + c;
        if (key < lo || key > hi) row[c] = neg_inf;
        // std::max drops a NaN argument: keep it, so NaN stays in the rows that see it.
        block_max = std::isnan(row[c]) ? row[c] : std::max(block_max, row[c]);
      }
      const T m_new = std::isnan(block_max) ? block_max : std::max(s.row_max[r], block_max);
      if (m_new == neg_inf) {  // nothing allowed yet in this row
        s.correction[r] = T(1);
        std::fill(row, row + nk, T(0));
        continue;
      }
      const T total = simd::exp_shifted_sum(row, nk, m_new, row);
      s.correction[r] = std::exp(s.row_max[r] - m_new);
      s.row_sum[r] = s.row_sum[r] * s.correction[r] + total;
      s.row_max[r] = m_new;
    }
    for (index_t r = 0; r < nq; ++r) acc.row(r) *= s.correction[r];
    if (lowest(i0 + nq - 1) <= j_first && highest(i0) >= j_first + nk - 1) {
      acc.noalias() += S * V;
    } else {  // the band's edge: each row's visible keys only (band_products.hpp)
      const auto band = tile_band(i0, j_first, nq, nk, lowest, highest);
      band_product(nq, BandTile<T>{S.data(), s.scores.cols(), 1},
                   StridedRows<const T>{V.data(), kv.value_stride}, Dv,
                   StridedRows<T>{acc.data(), s.acc.cols()}, band.keys_first(), band.keys_last());
    }
  }
  Map O(out, nq, Dv, Eigen::OuterStride<>(out_stride));
  for (index_t r = 0; r < nq; ++r)
    O.row(r) = s.row_sum[r] > T(0) ? (acc.row(r) / s.row_sum[r]).eval() : acc.row(r).eval();
}

/// Each row t's softmax statistics, at (b H + h) T + t: m_t and 1 / l_t from
/// the flash step, and D_t = <g_t, o_t> for the backward. A softmax_forward
/// given one keeps m_t and 1 / l_t, so that a softmax_backward given it and the
/// forward's output skips its pass 1 (the flash step again).
template <Real T>
struct SoftmaxRowStatistics {
  AlignedVector<T> row_max, inverse_sum, row_dot;  // m_t, 1 / l_t, D_t
  explicit SoftmaxRowStatistics(index_t rows)
      : row_max(static_cast<std::size_t>(rows)), inverse_sum(static_cast<std::size_t>(rows)),
        row_dot(static_cast<std::size_t>(rows)) {}
};

template <bool Causal, Window Win, Real T>
void softmax_forward(TensorView<const T, 4> q, TensorView<const T, 4> k, TensorView<const T, 4> v,
                     TensorView<T, 4> out, T scale, const Win& window,
                     SoftmaxRowStatistics<T>* keep = nullptr) {
  constexpr index_t block_q = 64, block_k = 64;
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), Dk = q.extent(3);
  const index_t Dv = v.extent(3);
  if (Tn == 0 || B * H == 0) return;
  const index_t query_blocks = (Tn + block_q - 1) / block_q;
  const int workers = thread_count();
  std::vector<OnlineSoftmaxScratch<T>> scratch(static_cast<std::size_t>(workers),
                                               OnlineSoftmaxScratch<T>(block_q, block_k, Dv));
  auto lowest = [&](index_t t) { return window.lowest_key(t); };
  auto highest = [&](index_t t) {
    const index_t hi = window.highest_key(t, Tn);
    return Causal ? std::min(hi, t) : hi;
  };
  parallel_for(B * H * query_blocks, workers, [&](index_t task, int worker) {
    const index_t qb = task % query_blocks, bh = task / query_blocks;
    const index_t b = bh / H, h = bh % H;
    const index_t i0 = qb * block_q, nq = std::min(block_q, Tn - i0);
    const index_t key_lo = lowest(i0);
    attend_query_block(q.row(b, i0, h), q.stride(1), i0, nq, Dk, Dv,
                       KeyValueRows<T>{k.row(b, 0, h), k.stride(1), v.row(b, 0, h), v.stride(1)},
                       key_lo - key_lo % block_k, block_k, scale, lowest, highest,
                       scratch[static_cast<std::size_t>(worker)], out.row(b, i0, h),
                       out.stride(1));
    if (keep != nullptr) {
      const OnlineSoftmaxScratch<T>& s = scratch[static_cast<std::size_t>(worker)];
      for (index_t r = 0; r < nq; ++r) {
        const auto at = static_cast<std::size_t>(bh * Tn + i0 + r);
        keep->row_max[at] = s.row_max[static_cast<std::size_t>(r)];
        keep->inverse_sum[at] = T(1) / s.row_sum[static_cast<std::size_t>(r)];
      }
    }
  });
}

// ------------------------------------------------------------- backward --
// FlashAttention-2's backward (DESIGN §3.6), in three passes that need no
// atomics, each parallel over (batch, head, block) (with heads enough, passes
// 2 and 3 are one, parallel over heads: see softmax_backward_by_head):
//   1. query blocks: the forward's flash step again (attend_query_block), kept
//      as each row's max m_t, 1 / l_t and D_t = <g_t, o_t> (g = d_out), O(B H T);
//   2. key blocks: dV_j = sum_i P_ij^T G_i and dK_j = scale sum_i dS_ij^T Q_i;
//   3. query blocks: dQ_i = scale sum_j dS_ij K_j;
// with P = exp(scale Q K^T - m) / l and dS = P o (G V^T - D) recomputed per tile.
// m and l stay apart: FlashAttention's single lse = m + log l, rounded to fp32
// near a score of 1e3, would lose log l's digits (ulp(1e3) = 6e-5).
// Workspace: the row statistics and per worker a few block-sized tiles.

/// One worker's tiles for the backward: P and dS of a block_q x block_k tile,
/// the rows of dK and dV (or dQ) a block accumulates, a band-edge tile's dQ
/// rows before they are scaled into d_queries (query_rows), and the flash
/// step's workspace and output rows (pass 1).
template <Real T>
struct SoftmaxBackwardScratch {
  using Matrix = typename OnlineSoftmaxScratch<T>::Matrix;
  Matrix probabilities, d_scores, d_keys, d_values, out_rows, query_rows;
  OnlineSoftmaxScratch<T> flash;

  SoftmaxBackwardScratch(index_t block_q, index_t block_k, index_t Dk, index_t Dv)
      : probabilities(block_q, block_k), d_scores(block_q, block_k),
        d_keys(std::max(block_q, block_k), Dk), d_values(block_k, Dv), out_rows(block_q, Dv),
        query_rows(block_q, Dk), flash(block_q, block_k, Dv) {}
};

/// `count` rows of D elements from `first`, `stride` apart, as a row-major matrix.
template <class T>
auto row_block(T* first, index_t count, index_t D, index_t stride) {
  using Matrix = typename OnlineSoftmaxScratch<std::remove_const_t<T>>::Matrix;
  using Mapped = std::conditional_t<std::is_const_v<T>, const Matrix, Matrix>;
  return Eigen::Map<Mapped, Eigen::Unaligned, Eigen::OuterStride<>>(first, count, D,
                                                                    Eigen::OuterStride<>(stride));
}

/// The keys of tile column 0 .. nk - 1 (key j0 + c) that query row t sees:
/// columns [first, last], empty when first > last.
struct VisibleColumns {
  index_t first, last;
  [[nodiscard]] index_t count() const noexcept { return std::max<index_t>(last - first + 1, 0); }
};
template <class Lowest, class Highest>
VisibleColumns visible_columns(index_t t, index_t j0, index_t nk, Lowest&& lowest,
                               Highest&& highest) {
  return {std::max<index_t>(lowest(t) - j0, 0), std::min<index_t>(highest(t) - j0, nk - 1)};
}

/// P and dS of the tile of query rows i0 .. i0 + nq - 1 and keys j0 .. j0 + nk - 1:
///   P_rc = exp(scale q_r . k_c - m_r) / l_r,  dS_rc = P_rc (<g_r, v_c> - D_r)
/// where row i0 + r sees key j0 + c, and exactly 0 elsewhere (a NaN in a key or
/// value a row cannot see never reaches that row).
template <Real T, class QRows, class KRows, class VRows, class GRows, class Lowest, class Highest>
void backward_tile(const QRows& Q, const KRows& K, const VRows& V, const GRows& G, index_t i0,
                   index_t j0, const SoftmaxRowStatistics<T>& statistics, std::size_t first_row,
                   T scale, Lowest&& lowest, Highest&& highest, SoftmaxBackwardScratch<T>& s) {
  const index_t nq = Q.rows(), nk = K.rows();
  auto P = s.probabilities.topLeftCorner(nq, nk);
  auto dS = s.d_scores.topLeftCorner(nq, nk);
  P.noalias() = (Q * K.transpose()) * scale;
  dS.noalias() = G * V.transpose();  // dP = G V^T
  for (index_t r = 0; r < nq; ++r) {
    const VisibleColumns seen = visible_columns(i0 + r, j0, nk, lowest, highest);
    T* p = P.row(r).data();
    T* ds = dS.row(r).data();
    const index_t n = seen.count();
    if (n == 0) {
      std::fill(p, p + nk, T(0));
      std::fill(ds, ds + nk, T(0));
      continue;
    }
    std::fill(p, p + seen.first, T(0));
    std::fill(p + seen.last + 1, p + nk, T(0));
    std::fill(ds, ds + seen.first, T(0));
    std::fill(ds + seen.last + 1, ds + nk, T(0));
    const std::size_t at = first_row + static_cast<std::size_t>(r);
    (void)simd::exp_shifted_sum(p + seen.first, n, statistics.row_max[at], p + seen.first);
    const T inverse_sum = statistics.inverse_sum[at], row_dot = statistics.row_dot[at];
    for (index_t c = seen.first; c <= seen.last; ++c) {
      p[c] *= inverse_sum;
      ds[c] = p[c] * (ds[c] - row_dot);
    }
  }
}

/// The backward's schedule: one head per task when there are heads enough to
/// keep every worker busy (d_queries then accumulates in place, and each tile's
/// dS is computed once), else three passes over blocks (B H = 1 uses all cores).
[[nodiscard]] inline bool softmax_backward_by_head(index_t heads, int workers) noexcept {
  return heads >= 2 * index_t{workers};
}

/// The gradients of softmax attention; the arguments are reference::softmax_backward's.
template <bool Causal, Window Win, Real T>
void softmax_backward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                      TensorView<const T, 4> v, TensorView<const T, 4> d_out,
                      TensorView<T, 4> d_q, TensorView<T, 4> d_k, TensorView<T, 4> d_v, T scale,
                      const Win& window, TensorView<T, 3> row_dots = {},
                      SoftmaxRowStatistics<T>* kept = nullptr,
                      TensorView<const T, 4> kept_out = {}) {
  constexpr index_t block_q = 64, block_k = 64;
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), Dk = q.extent(3);
  const index_t Dv = v.extent(3);
  if (Tn == 0 || B * H == 0) return;
  const index_t query_blocks = (Tn + block_q - 1) / block_q;
  const index_t key_blocks = (Tn + block_k - 1) / block_k;
  const int workers = thread_count();
  std::vector<SoftmaxBackwardScratch<T>> scratch(
      static_cast<std::size_t>(workers), SoftmaxBackwardScratch<T>(block_q, block_k, Dk, Dv));
  // With `kept` (softmax_forward's statistics of these inputs) and its output
  // `kept_out`, pass 1 only forms D_t: the flash step would give the same
  // statistics. kept_out may be d_q itself: a head's pass 1 ends before
  // anything writes its d_q rows (by head: pass 1, then d_q; else pass 1 is
  // done for every head before passes 2 and 3).
  SoftmaxRowStatistics<T> own_statistics(kept != nullptr ? 0 : B * H * Tn);
  SoftmaxRowStatistics<T>& statistics = kept != nullptr ? *kept : own_statistics;
  auto lowest = [&](index_t t) { return window.lowest_key(t); };
  auto highest = [&](index_t t) {
    const index_t hi = window.highest_key(t, Tn);
    return Causal ? std::min(hi, t) : hi;
  };
  auto rows = [](auto view, index_t b, index_t first, index_t h, index_t count) {
    return row_block(view.row(b, first, h), count, view.extent(3), view.stride(1));
  };

  // 1. Row statistics of query block qb, from the forward's flash step (the
  //    same blocks, so the same o).
  auto row_statistics = [&](index_t bh, index_t qb, SoftmaxBackwardScratch<T>& s) {
    const index_t b = bh / H, h = bh % H;
    const index_t i0 = qb * block_q, nq = std::min(block_q, Tn - i0);
    if (kept != nullptr) {
      const auto G = rows(d_out, b, i0, h, nq);
      const auto O = rows(kept_out, b, i0, h, nq);
      for (index_t r = 0; r < nq; ++r) {
        const std::size_t at = static_cast<std::size_t>(bh * Tn + i0 + r);
        statistics.row_dot[at] = G.row(r).dot(O.row(r));
        if (!row_dots.empty()) row_dots(b, i0 + r, h) = statistics.row_dot[at];
      }
      return;
    }
    const index_t key_lo = lowest(i0);
    attend_query_block(q.row(b, i0, h), q.stride(1), i0, nq, Dk, Dv,
                       KeyValueRows<T>{k.row(b, 0, h), k.stride(1), v.row(b, 0, h), v.stride(1)},
                       key_lo - key_lo % block_k, block_k, scale, lowest, highest, s.flash,
                       s.out_rows.data(), Dv);
    const auto G = rows(d_out, b, i0, h, nq);
    for (index_t r = 0; r < nq; ++r) {
      const std::size_t at = static_cast<std::size_t>(bh * Tn + i0 + r);
      statistics.row_max[at] = s.flash.row_max[r];
      statistics.inverse_sum[at] = T(1) / s.flash.row_sum[r];
      statistics.row_dot[at] = G.row(r).dot(s.out_rows.row(r));
      if (!row_dots.empty()) row_dots(b, i0 + r, h) = statistics.row_dot[at];
    }
  };

  // 2. dK and dV of key block kb, over the query rows that see it; with
  //    `add_d_queries`, also d_queries += scale dS K over those rows.
  auto key_block = [&](index_t bh, index_t kb, SoftmaxBackwardScratch<T>& s, bool add_d_queries) {
    const index_t b = bh / H, h = bh % H;
    const index_t j0 = kb * block_k, nk = std::min(block_k, Tn - j0);
    const auto K = rows(k, b, j0, h, nk);
    const auto V = rows(v, b, j0, h, nk);
    auto dK = s.d_keys.topRows(nk);
    auto dV = s.d_values.topRows(nk);
    dK.setZero();
    dV.setZero();
    // Rows that see a key of the block: highest(t) >= j0 and lowest(t) <= j0 + nk - 1.
    const index_t t_first = first_where(Tn, [&](index_t t) { return highest(t) >= j0; });
    const index_t t_end = first_where(Tn, [&](index_t t) { return lowest(t) > j0 + nk - 1; });
    for (index_t i0 = t_first; i0 < t_end; i0 += block_q) {
      const index_t nq = std::min(block_q, t_end - i0);
      const auto Q = rows(q, b, i0, h, nq);
      const auto G = rows(d_out, b, i0, h, nq);
      const std::size_t at = static_cast<std::size_t>(bh * Tn + i0);
      backward_tile(Q, K, V, G, i0, j0, statistics, at, scale, lowest, highest, s);
      const auto P = s.probabilities.topLeftCorner(nq, nk);
      const auto dS = s.d_scores.topLeftCorner(nq, nk);
      auto dQ = rows(d_q, b, i0, h, nq);
      if (lowest(i0 + nq - 1) <= j0 && highest(i0) >= j0 + nk - 1) {  // every row sees every key
        dV.noalias() += P.transpose() * G;
        dK.noalias() += dS.transpose() * Q;
        if (add_d_queries) dQ.noalias() += scale * (dS * K);
      } else {  // only the keys each row sees, so a row's NaN reaches no other key
        const auto band = tile_band(i0, j0, nq, nk, lowest, highest);
        const index_t ld = s.probabilities.cols();  // P and dS: rows ld apart
        band_product(nk, BandTile<T>{P.data(), 1, ld}, StridedRows<const T>{G.data(), d_out.stride(1)}, Dv,
                     StridedRows<T>{dV.data(), s.d_values.cols()}, band.rows_first(), band.rows_last());
        band_product(nk, BandTile<T>{dS.data(), 1, ld}, StridedRows<const T>{Q.data(), q.stride(1)}, Dk,
                     StridedRows<T>{dK.data(), s.d_keys.cols()}, band.rows_first(), band.rows_last());
        if (add_d_queries) {
          auto dQ_tile = s.query_rows.topRows(nq);
          dQ_tile.setZero();
          band_product(nq, BandTile<T>{dS.data(), ld, 1}, StridedRows<const T>{K.data(), k.stride(1)}, Dk,
                       StridedRows<T>{dQ_tile.data(), s.query_rows.cols()}, band.keys_first(),
                       band.keys_last());
          dQ.noalias() += scale * dQ_tile;
        }
      }
    }
    rows(d_k, b, j0, h, nk) = dK * scale;
    rows(d_v, b, j0, h, nk) = dV;
  };

  // 3. dQ of query block qb, over the key blocks it sees (the forward's blocks).
  auto query_block = [&](index_t bh, index_t qb, SoftmaxBackwardScratch<T>& s) {
    const index_t b = bh / H, h = bh % H;
    const index_t i0 = qb * block_q, nq = std::min(block_q, Tn - i0);
    const auto Q = rows(q, b, i0, h, nq);
    const auto G = rows(d_out, b, i0, h, nq);
    auto dQ = s.d_keys.topRows(nq);
    dQ.setZero();
    const std::size_t at = static_cast<std::size_t>(bh * Tn + i0);
    const index_t key_lo = lowest(i0), key_hi = highest(i0 + nq - 1);
    for (index_t j0 = key_lo - key_lo % block_k; j0 <= key_hi; j0 += block_k) {
      const index_t j_first = std::max(j0, key_lo);
      const index_t nk = std::min(j0 + block_k, key_hi + 1) - j_first;
      if (nk <= 0) continue;
      const auto K = rows(k, b, j_first, h, nk);
      const auto V = rows(v, b, j_first, h, nk);
      backward_tile(Q, K, V, G, i0, j_first, statistics, at, scale, lowest, highest, s);
      const auto dS = s.d_scores.topLeftCorner(nq, nk);
      if (lowest(i0 + nq - 1) <= j_first && highest(i0) >= j_first + nk - 1) {
        dQ.noalias() += dS * K;
      } else {
        const auto band = tile_band(i0, j_first, nq, nk, lowest, highest);
        band_product(nq, BandTile<T>{dS.data(), s.d_scores.cols(), 1},
                     StridedRows<const T>{K.data(), k.stride(1)}, Dk,
                     StridedRows<T>{dQ.data(), s.d_keys.cols()}, band.keys_first(), band.keys_last());
      }
    }
    rows(d_q, b, i0, h, nq) = dQ * scale;
  };

  auto scratch_of = [&](int worker) -> SoftmaxBackwardScratch<T>& {
    return scratch[static_cast<std::size_t>(worker)];
  };
  if (softmax_backward_by_head(B * H, workers)) {
    // One head per task: its key blocks add to its d_queries rows in place,
    // so dS is computed once (no pass 3).
    parallel_for(B * H, workers, [&](index_t bh, int worker) {
      const index_t b = bh / H, h = bh % H;
      for (index_t qb = 0; qb < query_blocks; ++qb) row_statistics(bh, qb, scratch_of(worker));
      rows(d_q, b, 0, h, Tn).setZero();
      for (index_t kb = 0; kb < key_blocks; ++kb) key_block(bh, kb, scratch_of(worker), true);
    });
  } else {
    parallel_for(B * H * query_blocks, workers, [&](index_t task, int worker) {
      row_statistics(task / query_blocks, task % query_blocks, scratch_of(worker));
    });
    parallel_for(B * H * key_blocks, workers, [&](index_t task, int worker) {
      key_block(task / key_blocks, task % key_blocks, scratch_of(worker), false);
    });
    parallel_for(B * H * query_blocks, workers, [&](index_t task, int worker) {
      query_block(task / query_blocks, task % query_blocks, scratch_of(worker));
    });
  }
}

/// One KV-cache decode step for one (b, h): stores (k, v) at `position`, then
/// softmax over the `visible` most recent tokens, oldest first, taken 64 keys at
/// a time (softmax_row_blocked): the scores and the value sums of a block are
/// matrix-vector products over the ring's contiguous runs (a block wraps at
/// most once), its exponentials one vectorised pass. No allocation.
template <Real T>
void softmax_decode_step(const T* q, const T* k, const T* v, T* out, reference::KVSlots<T> slots,
                         index_t capacity, index_t Dk, index_t Dv, T scale,
                         std::int64_t position, index_t visible) noexcept {
  using Vector = Eigen::Matrix<T, Eigen::Dynamic, 1>;
  using Rows = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using ConstRows = Eigen::Map<const Rows>;
  const index_t slot = static_cast<index_t>(position % capacity);
  std::copy(k, k + Dk, slots.keys + slot * Dk);
  std::copy(v, v + Dv, slots.values + slot * Dv);
  const std::int64_t oldest = position + 1 - visible;
  auto slot_of = [&](index_t j) { return static_cast<index_t>((oldest + j) % capacity); };
  const Eigen::Map<const Vector> query(q, Dk);
  softmax_row_blocked(
      Dv, visible,
      [&](index_t j0, index_t n, T* p) {
        for (index_t done = 0; done < n;) {
          const index_t at = slot_of(j0 + done), run = std::min(n - done, capacity - at);
          const ConstRows K(slots.keys + at * Dk, run, Dk);
          Eigen::Map<Vector>(p + done, run).noalias() = scale * (K * query);
          done += run;
        }
      },
      [&](index_t j0, index_t n, const T* p, T* acc) {
        for (index_t done = 0; done < n;) {
          const index_t at = slot_of(j0 + done), run = std::min(n - done, capacity - at);
          const ConstRows V(slots.values + at * Dv, run, Dv);
          Eigen::Map<Vector>(acc, Dv).noalias() +=
              V.transpose() * Eigen::Map<const Vector>(p + done, run);
          done += run;
        }
      },
      out);
}

/// Causal sliding-window attention (window `window_left`) of the tokens at
/// first_position, first_position + 1, ... whose windows reach into the tokens
/// before them, held in a ring (`ring_of(b, h)`: KVSlots of `ring` >= the
/// window's left + 1 slots, slot = position mod ring, as a KV cache or a decode
/// state keeps them): the blocked windowed softmax over the tokens given, then
/// their first window_left rows again by decode steps over the ring. The ring
/// is left as T decode steps leave it. (A windowed KV cache's continuation,
/// and level 0 of convolutional compression's.)
template <Real T, class RingOf>
void window_outputs_after_ring(TensorView<const T, 4> q, TensorView<const T, 4> k,
                               TensorView<const T, 4> v, TensorView<T, 4> out, T scale,
                               index_t window_left, index_t ring, std::int64_t first_position,
                               RingOf&& ring_of) {
  const index_t Bn = q.extent(0), Tn = q.extent(1), H = q.extent(2);
  if (Bn == 0 || Tn == 0) return;
  const index_t Dk = q.extent(3), Dv = v.extent(3);
  softmax_forward<true>(q, k, v, out, scale, SlidingWindow{.left = window_left, .right = 0});
  const index_t halo_rows = std::min<index_t>(Tn, window_left);
  parallel_for(Bn * H, thread_count(), [&](index_t bh, int) {
    const index_t b = bh / H, h = bh % H;
    const reference::KVSlots<T> slots = ring_of(b, h);
    for (index_t t = 0; t < halo_rows; ++t) {
      const std::int64_t position = first_position + t;
      cpu::softmax_decode_step(q.row(b, t, h), k.row(b, t, h), v.row(b, t, h), out.row(b, t, h),
                               slots, ring, Dk, Dv, scale, position,
                               static_cast<index_t>(window_left >= position ? position + 1
                                                                            : window_left + 1));
    }
    for (index_t t = std::max(halo_rows, Tn - ring); t < Tn; ++t) {  // the rest of the ring
      const auto slot = static_cast<index_t>((first_position + t) % ring);
      std::copy_n(k.row(b, t, h), Dk, slots.keys + slot * Dk);
      std::copy_n(v.row(b, t, h), Dv, slots.values + slot * Dv);
    }
  });
}

}  // namespace latte::cpu
