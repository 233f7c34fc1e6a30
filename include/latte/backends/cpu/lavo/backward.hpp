#pragma once
// CPU backward of LAVO (paper 002), the gradients of reference/lavo.hpp's
// backward section with blocked GEMMs (docs/backward.md "LAVO").
//
// One task per (batch, head) (OpenMP), blocks of 64 query rows:
//  1. forward again: F_local by local_block (lavo/forward.hpp) into a [T x d]
//     workspace with each row's maximum m and normaliser l, P_F = F B^T (GEMM), the windows'
//     sums and the mean H each window's tokens read (compensated, as the forward);
//  2. the read's backward: Q B^T and G B^T (GEMMs), per row the r-way softmax's
//     backward, dQ = (scale ds (.) H) B, d_basis += (scale ds (.) H)^T Q +
//     (c p (.) H)^T G (GEMMs), each window's dM = sum of its readers' dH / n;
//  3. a reverse scan over windows, E_j = sum_{j' > j} dM_j' (plus the gradient of
//     the state left), then dF = c G + E B and d_basis += E^T F (GEMMs);
//  4. the local part's backward over the band (FlashAttention-2's): P = exp(S - m) / l
//     (m and l kept apart, not as lse = m + log l: docs/backward.md "Softmax"),
//     dP = dF V^T, dS = P (.) (dP - rowdot(dF, F)), dQ += scale dS K,
//     dK += scale dS^T Q, dV += P^T dF (P and dP as GEMMs over the tile, the three
//     products over the band only: band_products.hpp), dP_bias[(s - t) + w - 1] += dS.
// Workspace per worker: F and dF [T x d], m and l [T], 2 r values per window,
// the forward's block scratch and seven 64 x r / 64 x 128 panels; parameter
// gradients per (batch, head) in double, summed over the batch at the end.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <Eigen/Core>

#include "latte/backends/cpu/lavo/forward.hpp"
#include "latte/backends/cpu/parallel.hpp"
#include "latte/backends/cpu/simd.hpp"
#include "latte/backends/cpu/softmax.hpp"
#include "latte/backends/reference/lavo.hpp"
#include "latte/core/checked_size.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"

namespace latte::cpu {

namespace lavo_detail {

/// Per-worker scratch of the backward.
template <Real T>
struct BackwardScratch {
  BackwardScratch(index_t d, index_t r)
      : forward(d, r), probabilities(block_rows, block_keys), score_gradients(block_rows, block_keys),
        query_bases(block_rows, r), gradient_bases(block_rows, r), scaled_ds(block_rows, r),
        read_weights(block_rows, r), memory_gradients(block_rows, r), basis_block(r, d),
        row_dots(block_rows) {}
  Scratch<T> forward;
  Matrix<T> probabilities, score_gradients;  // P and dS of one key block
  Matrix<T> query_bases, gradient_bases;     // b_i . q_t, b_i . g_t
  Matrix<T> scaled_ds, read_weights;         // scale ds_i H_i, c p_i H_i
  Matrix<T> memory_gradients;                // E of each row's window
  Matrix<T> basis_block;                     // one block's part of d_basis
  AlignedVector<T> row_dots;                 // dF_t . F_t
  AlignedVector<T> features, feature_gradients, row_max, row_sum, means, window_gradients_t;
  std::vector<double> window_gradients, later;
  AlignedVector<T> history_key_gradients, history_value_gradients;
};

/// Where the keys' and values' gradients go: key j >= 0 to the row j of dk / dv,
/// key j in [-pre, 0) to the history's row pre + j.
template <Real T>
struct KeyGradientRows {
  T* keys;
  T* values;
  index_t key_stride, value_stride;
  T* history_keys = nullptr;
  T* history_values = nullptr;
  index_t pre = 0;
};

/// d_basis += block (r x d, computed in T for one block), in double.
template <Real T>
void add_to_double(const Matrix<T>& block, double* d_basis) {
  if (!d_basis) return;
  const index_t count = block.rows() * block.cols();
  for (index_t i = 0; i < count; ++i) d_basis[i] += static_cast<double>(block.data()[i]);
}

/// The local part's backward for query rows [i0, i0 + nq): rows t see keys as
/// in local_block; `features` / `feature_gradients` are F and dF of these rows
/// (row stride d), `row_max` and `row_sum` their softmax's m and l. Adds to dq rows, the keys' and
/// values' gradients and d_bias (double; null: not wanted).
template <Real T>
void local_backward_block(const T* queries, index_t query_stride, T* dq, index_t dq_stride,
                          index_t i0, index_t nq, const KeyRows<T>& rows,
                          const KeyGradientRows<T>& grads, index_t Tn, bool causal,
                          const reference::LavoHead<T>& head, const T* features,
                          const T* feature_gradients, const T* row_max, const T* row_sum,
                          double* d_bias,
                          BackwardScratch<T>& s) {
  const index_t d = head.dim, w = head.window;
  const T scale = head.scale;
  const ConstMap<T> Q(queries, nq, d, Eigen::OuterStride<>(query_stride));
  const ConstMap<T> F(features, nq, d, Eigen::OuterStride<>(d));
  const ConstMap<T> dF(feature_gradients, nq, d, Eigen::OuterStride<>(d));
  for (index_t row = 0; row < nq; ++row) s.row_dots[row] = dF.row(row).dot(F.row(row));
  auto lowest = [&](index_t t) { return std::max<index_t>(t - (w - 1), -rows.pre); };
  auto highest = [&](index_t t) { return causal ? t : std::min<index_t>(t + (w - 1), Tn - 1); };

  auto visit = [&](index_t j_first, index_t nk, const T* key_rows, index_t key_stride,
                   const T* value_rows, index_t value_stride, T* dkey_rows, index_t dkey_stride,
                   T* dvalue_rows, index_t dvalue_stride) {
    const ConstMap<T> K(key_rows, nk, d, Eigen::OuterStride<>(key_stride));
    const ConstMap<T> V(value_rows, nk, d, Eigen::OuterStride<>(value_stride));
    auto P = s.probabilities.topLeftCorner(nq, nk);
    auto dS = s.score_gradients.topLeftCorner(nq, nk);
    P.noalias() = (Q * K.transpose()) * scale;
    dS.noalias() = dF * V.transpose();  // dP
    for (index_t row = 0; row < nq; ++row) {
      const index_t t = i0 + row;
      const index_t c_lo = std::max<index_t>(lowest(t) - j_first, 0);
      const index_t c_hi = std::min<index_t>(highest(t) - j_first, nk - 1);
      T* p = s.probabilities.row(row).data();
      T* ds = s.score_gradients.row(row).data();
      if (c_lo > c_hi || !(row_sum[row] > T(0))) {
        std::fill(p, p + nk, T(0));
        std::fill(ds, ds + nk, T(0));
        continue;
      }
      const T* bias = head.relative_bias + (j_first + c_lo - t + w - 1);
      const index_t n = c_hi - c_lo + 1;
      T* band = p + c_lo;
      for (index_t c = 0; c < n; ++c) band[c] += bias[c];
      (void)simd::exp_shifted_sum(band, n, row_max[row], band);
      const T inverse = T(1) / row_sum[row];
      for (index_t c = 0; c < n; ++c) band[c] *= inverse;  // P = exp(S - m) / l
      std::fill(p, band, T(0));
      std::fill(band + n, p + nk, T(0));
      const T row_dot = s.row_dots[row];
      for (index_t c = 0; c < nk; ++c) ds[c] = p[c] * (ds[c] - row_dot);
      if (d_bias) {
        double* into = d_bias + (j_first + c_lo - t + w - 1);
        for (index_t c = 0; c < n; ++c) into[c] += static_cast<double>(ds[c_lo + c]);
      }
    }
    // dQ += dS K, dK += dS^T Q, dV += P^T dF over the band only
    // (band_products.hpp): a block's tile is a window's parallelogram, about
    // half of it outside every row's band, and a GEMM would multiply those
    // zeros too (and by a NaN in a row no query of the tile may see).
    dS *= scale;
    const auto band = tile_band(i0, j_first, nq, nk, lowest, highest);
    const index_t ld = s.probabilities.cols();  // P and dS: rows ld apart
    band_product(nq, BandTile<T>{dS.data(), ld, 1}, StridedRows<const T>{key_rows, key_stride}, d,
                 StridedRows<T>{dq, dq_stride}, band.keys_first(), band.keys_last());
    band_product(nk, BandTile<T>{dS.data(), 1, ld}, StridedRows<const T>{queries, query_stride}, d,
                 StridedRows<T>{dkey_rows, dkey_stride}, band.rows_first(), band.rows_last());
    band_product(nk, BandTile<T>{P.data(), 1, ld}, StridedRows<const T>{feature_gradients, d}, d,
                 StridedRows<T>{dvalue_rows, dvalue_stride}, band.rows_first(), band.rows_last());
  };

  const index_t key_lo = lowest(i0), key_hi = highest(i0 + nq - 1);
  const index_t history_hi = std::min<index_t>(key_hi, -1);
  for (index_t j0 = key_lo; j0 <= history_hi; j0 += block_keys) {
    const index_t nk = std::min(block_keys, history_hi - j0 + 1);
    const index_t at = (rows.pre + j0) * d;
    visit(j0, nk, rows.history_keys + at, d, rows.history_values + at, d,
          grads.history_keys + at, d, grads.history_values + at, d);
  }
  for (index_t j0 = std::max<index_t>(key_lo, 0); j0 <= key_hi; j0 += block_keys) {
    const index_t nk = std::min(block_keys, key_hi - j0 + 1);
    visit(j0, nk, rows.keys + j0 * rows.key_stride, rows.key_stride,
          rows.values + j0 * rows.value_stride, rows.value_stride,
          grads.keys + j0 * grads.key_stride, grads.key_stride,
          grads.values + j0 * grads.value_stride, grads.value_stride);
  }
}

/// The read's backward for query rows [c0, c0 + nq) of one (batch, head):
/// row `row` read the mean `mean_of(row)` (null: an empty memory, no read)
/// with output share `share` (1/2 in self-attention, 1 in cross-attention) and
/// its window's dM gets dH / n at `window_gradient_of(row)` (double, r values)
/// with `weight_of(row)` = 1 / n. Writes the block's dq (overwritten) and adds
/// the read's part of d_basis.
template <Real T, class MeanOf, class WindowGradientOf, class WeightOf>
void read_backward_block(const T* queries, index_t query_stride, const T* d_out,
                         index_t d_out_stride, T* dq, index_t dq_stride, index_t nq,
                         const reference::LavoHead<T>& head, T share, MeanOf&& mean_of,
                         WindowGradientOf&& window_gradient_of, WeightOf&& weight_of,
                         double* d_basis, BackwardScratch<T>& s) {
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  const index_t d = head.dim, r = head.bases;
  const T scale = head.scale;
  const ConstMap<T> Q(queries, nq, d, Eigen::OuterStride<>(query_stride));
  const ConstMap<T> G(d_out, nq, d, Eigen::OuterStride<>(d_out_stride));
  const ConstMap<T> Bm(head.basis, r, d, Eigen::OuterStride<>(d));
  auto QB = s.query_bases.topRows(nq);
  auto GB = s.gradient_bases.topRows(nq);
  QB.noalias() = Q * Bm.transpose();
  GB.noalias() = G * Bm.transpose();
  for (index_t row = 0; row < nq; ++row) {
    T* A = s.scaled_ds.row(row).data();
    T* W = s.read_weights.row(row).data();
    const T* mean = mean_of(row);
    const T* bq = s.query_bases.row(row).data();
    const T* bg = s.gradient_bases.row(row).data();
    T score_max = neg_inf;
    if (mean)
      for (index_t i = 0; i < r; ++i) {
        W[i] = scale * (mean[i] * bq[i]);
        score_max = std::isnan(W[i]) ? W[i] : std::max(score_max, W[i]);
      }
    if (score_max == neg_inf) {  // an empty memory (or no finite score): g = 0 whatever q
      std::fill(A, A + r, T(0));
      std::fill(W, W + r, T(0));
      continue;
    }
    const T total = simd::exp_shifted_sum(W, r, score_max, W);  // W = unnormalised p
    T mean_dp = 0;
    for (index_t i = 0; i < r; ++i) {
      W[i] /= total;
      mean_dp += W[i] * mean[i] * (share * bg[i]);
    }
    double* dM = window_gradient_of(row);
    const double weight = weight_of(row);
    for (index_t i = 0; i < r; ++i) {
      const T p = W[i], bgi = share * bg[i];
      const T ds = p * (mean[i] * bgi - mean_dp);
      dM[i] += weight * (static_cast<double>(p) * bgi + static_cast<double>(scale) * ds * bq[i]);
      A[i] = scale * ds * mean[i];
      W[i] = share * p * mean[i];
    }
  }
  auto A = s.scaled_ds.topRows(nq);
  auto W = s.read_weights.topRows(nq);
  Map<T>(dq, nq, d, Eigen::OuterStride<>(dq_stride)).noalias() = A * Bm;
  if (d_basis) {
    s.basis_block.noalias() = A.transpose() * Q;
    s.basis_block.noalias() += W.transpose() * G;
    add_to_double(s.basis_block, d_basis);
  }
}

/// The forward's state and the state gradients of one (batch, head) of a causal backward.
template <Real T>
struct CausalEnds {
  reference::LavoSavedCarry<T> initial;  // null keys: fresh
  reference::LavoSavedCarry<T> d_final;  // null keys: zero
  reference::LavoCarry<T> d_initial;     // null keys: not wanted
  std::int64_t first_position = 0;
};

/// The whole backward of one (batch, head) (causal or bidirectional).
template <Real T>
void head_backward(bool causal, const T* q, const T* k, const T* v, const T* g, index_t stride,
                   T* dq, T* dk, T* dv, index_t grad_stride, index_t Tn,
                   const reference::LavoHead<T>& head, const CausalEnds<T>& ends,
                   double* d_basis, double* d_bias, BackwardScratch<T>& s) {
  const index_t d = head.dim, r = head.bases, w = head.window;
  const ConstMap<T> Bm(head.basis, r, d, Eigen::OuterStride<>(d));
  const std::int64_t P0 = causal ? ends.first_position : 0, end = P0 + Tn;
  const std::int64_t j0 = causal ? P0 / w : 0;
  const index_t windows = causal ? static_cast<index_t>((end - 1) / w - j0 + 1) : 1;
  auto window_of = [&](index_t t) { return causal ? static_cast<index_t>((P0 + t) / w - j0) : 0; };
  auto memory_tokens = [&](index_t t) -> std::int64_t { return causal ? ((P0 + t) / w) * w : Tn; };

  const auto area = static_cast<std::size_t>(Tn * d);
  s.features.resize(area);
  s.feature_gradients.resize(area);
  s.row_max.resize(static_cast<std::size_t>(Tn));
  s.row_sum.resize(static_cast<std::size_t>(Tn));
  s.means.assign(static_cast<std::size_t>(windows * r), T(0));
  s.window_gradients_t.resize(static_cast<std::size_t>(windows * r));
  s.window_gradients.assign(static_cast<std::size_t>(windows * r), 0.0);
  s.later.assign(static_cast<std::size_t>(r), 0.0);

  // History: the ring's keys and values of positions P0 - pre .. P0 - 1.
  KeyRows<T> rows{k, v, stride, stride};
  KeyGradientRows<T> grads{dk, dv, grad_stride, grad_stride};
  const index_t pre = causal && ends.initial.keys
                          ? static_cast<index_t>(std::min<std::int64_t>(w - 1, P0)) : 0;
  if (pre > 0) {
    Scratch<T>& f = s.forward;
    f.history_keys.resize(static_cast<std::size_t>(pre * d));
    f.history_values.resize(static_cast<std::size_t>(pre * d));
    s.history_key_gradients.assign(static_cast<std::size_t>(pre * d), T(0));
    s.history_value_gradients.assign(static_cast<std::size_t>(pre * d), T(0));
    for (index_t j = 0; j < pre; ++j) {
      const auto slot = static_cast<index_t>((P0 - pre + j) % w);
      std::copy_n(ends.initial.keys + slot * d, d, f.history_keys.data() + j * d);
      std::copy_n(ends.initial.values + slot * d, d, f.history_values.data() + j * d);
    }
    rows.history_keys = f.history_keys.data();
    rows.history_values = f.history_values.data();
    rows.pre = pre;
    grads.history_keys = s.history_key_gradients.data();
    grads.history_values = s.history_value_gradients.data();
    grads.pre = pre;
  }

  // 1. Forward again: F_local, m and l, and the mean each window's tokens read.
  AlignedVector<T>& window_sum = s.forward.window_sum;
  AlignedVector<T>& sum = s.forward.memory_sum;
  AlignedVector<T>& comp = s.forward.memory_compensation;
  for (index_t i = 0; i < r; ++i) {
    const bool saved = causal && ends.initial.keys;
    window_sum[i] = saved ? ends.initial.window_sum[i] : T(0);
    sum[i] = saved ? ends.initial.memory_sum[i] : T(0);
    comp[i] = saved ? ends.initial.memory_compensation[i] : T(0);
  }
  for (index_t c0 = 0; c0 < Tn; c0 += block_rows) {
    const index_t nq = std::min(block_rows, Tn - c0);
    T* F = s.features.data() + c0 * d;
    local_block(q + c0 * stride, stride, c0, nq, rows, Tn, causal, head, F, d, s.forward);
    std::copy_n(s.forward.row_max.data(), nq, s.row_max.data() + c0);
    std::copy_n(s.forward.row_sum.data(), nq, s.row_sum.data() + c0);
    auto projected = s.forward.projected.topRows(nq);
    projected.noalias() = ConstMap<T>(F, nq, d, Eigen::OuterStride<>(d)) * Bm.transpose();
    for (index_t row = 0; row < nq; ++row) {
      const index_t t = c0 + row;
      const std::int64_t position = P0 + t;
      if (causal && (t == 0 || position % w == 0) && memory_tokens(t) > 0) {  // eq. 3: H = M / n
        T* mean = s.means.data() + window_of(t) * r;
        const T n = static_cast<T>(memory_tokens(t));
        for (index_t i = 0; i < r; ++i) mean[i] = (sum[i] + comp[i]) / n;
      }
      const T* p = s.forward.projected.row(row).data();
      if (!causal) {
        for (index_t i = 0; i < r; ++i) reference::compensated_add(sum[i], comp[i], p[i]);
        continue;
      }
      for (index_t i = 0; i < r; ++i) window_sum[i] += p[i];
      if ((position + 1) % w == 0)
        for (index_t i = 0; i < r; ++i) {
          reference::compensated_add(sum[i], comp[i], window_sum[i]);
          window_sum[i] = T(0);
        }
    }
  }
  if (!causal)
    for (index_t i = 0; i < r; ++i) s.means[i] = (sum[i] + comp[i]) / static_cast<T>(Tn);

  // 2. The read's backward: dq, and each window's dM.
  for (index_t c0 = 0; c0 < Tn; c0 += block_rows) {
    const index_t nq = std::min(block_rows, Tn - c0);
    read_backward_block(
        q + c0 * stride, stride, g + c0 * stride, stride, dq + c0 * grad_stride, grad_stride, nq,
        head, T(0.5),
        [&](index_t row) -> const T* {
          return memory_tokens(c0 + row) > 0 ? s.means.data() + window_of(c0 + row) * r : nullptr;
        },
        [&](index_t row) { return s.window_gradients.data() + window_of(c0 + row) * r; },
        [&](index_t row) { return 1.0 / static_cast<double>(memory_tokens(c0 + row)); }, d_basis,
        s);
  }

  // 3. Reverse over windows: the tokens of window j reach the reads of later
  // windows and the state left (its memory when j completes here, else its window_sum).
  for (index_t jj = windows - 1; jj >= 0; --jj) {
    T* e = s.window_gradients_t.data() + jj * r;
    const std::int64_t j = j0 + jj;
    const T* final_term = nullptr;
    if (causal && ends.d_final.keys)
      final_term = (j + 1) * w <= end ? ends.d_final.memory_sum : ends.d_final.window_sum;
    for (index_t i = 0; i < r; ++i) {
      const double total = s.later[static_cast<std::size_t>(i)] +
                           (final_term ? static_cast<double>(final_term[i]) : 0.0);
      e[i] = static_cast<T>(total);
      if (jj == 0 && causal && ends.d_initial.keys) ends.d_initial.window_sum[i] = e[i];
    }
    for (index_t i = 0; i < r; ++i)
      s.later[static_cast<std::size_t>(i)] += s.window_gradients[static_cast<std::size_t>(jj * r + i)];
  }
  if (!causal)  // one window, read by every token: E = dM
    for (index_t i = 0; i < r; ++i) s.window_gradients_t[static_cast<std::size_t>(i)] = static_cast<T>(s.later[static_cast<std::size_t>(i)]);
  if (causal && ends.d_initial.keys)
    for (index_t i = 0; i < r; ++i) {
      const double total = s.later[static_cast<std::size_t>(i)] +
                           (ends.d_final.keys ? static_cast<double>(ends.d_final.memory_sum[i]) : 0.0);
      ends.d_initial.memory_sum[i] = ends.d_initial.memory_compensation[i] = static_cast<T>(total);
    }
  for (index_t c0 = 0; c0 < Tn; c0 += block_rows) {
    const index_t nq = std::min(block_rows, Tn - c0);
    auto E = s.memory_gradients.topRows(nq);
    for (index_t row = 0; row < nq; ++row)
      std::copy_n(s.window_gradients_t.data() + window_of(c0 + row) * r, r,
                  s.memory_gradients.row(row).data());
    const ConstMap<T> G(g + c0 * stride, nq, d, Eigen::OuterStride<>(stride));
    const ConstMap<T> F(s.features.data() + c0 * d, nq, d, Eigen::OuterStride<>(d));
    Map<T> dF(s.feature_gradients.data() + c0 * d, nq, d, Eigen::OuterStride<>(d));
    dF.noalias() = E * Bm;
    for (index_t row = 0; row < nq; ++row) {
      const bool whole = causal && memory_tokens(c0 + row) == 0 && head.local_only_without_memory;
      dF.row(row) += G.row(row) * (whole ? T(1) : T(0.5));
    }
    if (d_basis) {
      s.basis_block.noalias() = E.transpose() * F;
      add_to_double(s.basis_block, d_basis);
    }
  }

  // 4. The local part's backward.
  for (index_t t = 0; t < Tn; ++t) {
    std::fill_n(dk + t * grad_stride, d, T(0));
    std::fill_n(dv + t * grad_stride, d, T(0));
  }
  for (index_t c0 = 0; c0 < Tn; c0 += block_rows) {
    const index_t nq = std::min(block_rows, Tn - c0);
    local_backward_block(q + c0 * stride, stride, dq + c0 * grad_stride, grad_stride, c0, nq, rows,
                         grads, Tn, causal, head, s.features.data() + c0 * d,
                         s.feature_gradients.data() + c0 * d, s.row_max.data() + c0,
                         s.row_sum.data() + c0, d_bias, s);
  }
  if (!causal) return;

  // The ring: the w most recent tokens' keys and values sit in the state left;
  // slots the chunk does not overwrite pass d_final's gradient to d_initial.
  if (ends.d_final.keys)
    for (std::int64_t position = std::max(end - w, P0); position < end; ++position) {
      const index_t t = static_cast<index_t>(position - P0), slot = static_cast<index_t>(position % w);
      for (index_t e = 0; e < d; ++e) {
        dk[t * grad_stride + e] += ends.d_final.keys[slot * d + e];
        dv[t * grad_stride + e] += ends.d_final.values[slot * d + e];
      }
    }
  if (!ends.d_initial.keys) return;
  reference::lavo_start_ring_gradient(ends.d_initial, ends.d_final, w, d, P0, Tn);
  for (index_t j = 0; j < pre; ++j) {
    const auto slot = static_cast<index_t>((P0 - pre + j) % w);
    for (index_t e = 0; e < d; ++e) {
      ends.d_initial.keys[slot * d + e] += s.history_key_gradients[static_cast<std::size_t>(j * d + e)];
      ends.d_initial.values[slot * d + e] += s.history_value_gradients[static_cast<std::size_t>(j * d + e)];
    }
  }
}

/// Per-(batch, head) parameter gradients in double, summed over the batch into `parameters`.
struct ParameterPartials {
  std::vector<double> basis, bias;
  index_t basis_size, bias_size;
  ParameterPartials(const reference::LavoParameterGradients& parameters, index_t tasks,
                    index_t basis_per_head, index_t bias_per_head)
      : basis(parameters.d_basis ? static_cast<std::size_t>(tasks * basis_per_head) : 0, 0.0),
        bias(parameters.d_bias ? static_cast<std::size_t>(tasks * bias_per_head) : 0, 0.0),
        basis_size(basis_per_head), bias_size(bias_per_head) {}
  double* basis_of(index_t task) { return basis.empty() ? nullptr : basis.data() + task * basis_size; }
  double* bias_of(index_t task) { return bias.empty() ? nullptr : bias.data() + task * bias_size; }
  /// Task bh = b * H + h adds to head h.
  void add_to(const reference::LavoParameterGradients& parameters, index_t tasks, index_t H) const {
    for (index_t bh = 0; bh < tasks; ++bh) {
      const index_t h = bh % H;
      for (index_t i = 0; i < basis_size && !basis.empty(); ++i)
        parameters.d_basis[h * basis_size + i] += basis[static_cast<std::size_t>(bh * basis_size + i)];
      for (index_t i = 0; i < bias_size && !bias.empty(); ++i)
        parameters.d_bias[h * bias_size + i] += bias[static_cast<std::size_t>(bh * bias_size + i)];
    }
  }
};

template <Real T>
std::vector<BackwardScratch<T>> backward_scratch(int workers, index_t d, index_t r) {
  std::vector<BackwardScratch<T>> scratch;
  scratch.reserve(static_cast<std::size_t>(workers));
  for (int i = 0; i < workers; ++i) scratch.emplace_back(d, r);
  return scratch;
}

/// head_backward for every (batch, head) in parallel; `ends_of(b, h)` gives
/// the causal state's ends (CausalEnds{} when bidirectional).
template <Real T, class HeadOf, class EndsOf>
void self_backward(bool causal, TensorView<const T, 4> q, TensorView<const T, 4> k,
                   TensorView<const T, 4> v, TensorView<const T, 4> d_out, TensorView<T, 4> dq,
                   TensorView<T, 4> dk, TensorView<T, 4> dv, HeadOf&& head_of, EndsOf&& ends_of,
                   const reference::LavoParameterGradients& parameters) {
  const index_t Bn = q.extent(0), Tn = q.extent(1), H = q.extent(2);
  if (Bn == 0 || Tn == 0) return;
  const reference::LavoHead<T> first = head_of(0);
  const index_t d = first.dim, r = first.bases, w = first.window;
  const int workers = thread_count();
  auto scratch = backward_scratch<T>(workers, d, r);
  ParameterPartials partials(parameters, Bn * H, r * d, 2 * w - 1);
  parallel_for(Bn * H, workers, [&](index_t bh, int worker) {
    const index_t b = bh / H, h = bh % H;
    head_backward(causal, q.row(b, 0, h), k.row(b, 0, h), v.row(b, 0, h), d_out.row(b, 0, h),
                  q.stride(1), dq.row(b, 0, h), dk.row(b, 0, h), dv.row(b, 0, h), dq.stride(1), Tn,
                  head_of(h), ends_of(b, h), partials.basis_of(bh), partials.bias_of(bh),
                  scratch[static_cast<std::size_t>(worker)]);
  });
  partials.add_to(parameters, Bn * H, H);
}

}  // namespace lavo_detail

/// Causal LAVO backward (the contract of reference::lavo_causal_backward).
template <Real T, class HeadOf, class InitialOf, class FinalGradientOf, class InitialGradientOf>
void lavo_causal_backward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                          TensorView<const T, 4> v, TensorView<const T, 4> d_out,
                          TensorView<T, 4> dq, TensorView<T, 4> dk, TensorView<T, 4> dv,
                          std::int64_t first_position, HeadOf&& head_of, InitialOf&& initial_of,
                          FinalGradientOf&& final_gradient_of,
                          InitialGradientOf&& initial_gradient_of,
                          const reference::LavoParameterGradients& parameters) {
  lavo_detail::self_backward(
      true, q, k, v, d_out, dq, dk, dv, head_of,
      [&](index_t b, index_t h) {
        return lavo_detail::CausalEnds<T>{initial_of(b, h), final_gradient_of(b, h),
                                          initial_gradient_of(b, h), first_position};
      },
      parameters);
}

/// Bidirectional LAVO backward (the contract of reference::lavo_bidirectional_backward).
template <Real T, class HeadOf>
void lavo_bidirectional_backward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                                 TensorView<const T, 4> v, TensorView<const T, 4> d_out,
                                 TensorView<T, 4> dq, TensorView<T, 4> dk, TensorView<T, 4> dv,
                                 HeadOf&& head_of,
                                 const reference::LavoParameterGradients& parameters) {
  lavo_detail::self_backward(
      false, q, k, v, d_out, dq, dk, dv, head_of,
      [](index_t, index_t) { return lavo_detail::CausalEnds<T>{}; }, parameters);
}

/// Cross-attention LAVO backward (the contract of reference::lavo_cross_backward).
template <Real T, class HeadOf>
void lavo_cross_backward(TensorView<const T, 4> q, TensorView<const T, 4> source,
                         TensorView<const T, 4> d_out, TensorView<T, 4> dq,
                         TensorView<T, 4> d_source, HeadOf&& head_of,
                         const reference::LavoParameterGradients& parameters) {
  using namespace lavo_detail;
  const index_t Bn = q.extent(0), Tq = q.extent(1), H = q.extent(2), Ts = source.extent(1);
  if (Bn == 0) return;
  const reference::LavoHead<T> first = head_of(0);
  const index_t d = first.dim, r = first.bases;
  const int workers = thread_count();
  auto scratch = backward_scratch<T>(workers, d, r);
  ParameterPartials partials(parameters, Bn * H, r * d, 0);
  parallel_for(Bn * H, workers, [&](index_t bh, int worker) {
    BackwardScratch<T>& s = scratch[static_cast<std::size_t>(worker)];
    const index_t b = bh / H, h = bh % H;
    const reference::LavoHead<T> head = head_of(h);
    const ConstMap<T> Bm(head.basis, r, d, Eigen::OuterStride<>(d));
    double* d_basis = partials.basis_of(bh);
    if (Ts == 0) {  // an empty memory reads zero whatever q
      for (index_t t = 0; t < Tq; ++t) std::fill_n(dq.row(b, t, h), d, T(0));
      return;
    }
    T* sum = s.forward.memory_sum.data();
    T* comp = s.forward.memory_compensation.data();
    std::fill_n(sum, r, T(0));
    std::fill_n(comp, r, T(0));
    s.features.assign(static_cast<std::size_t>(d), T(0));  // sum_s source_s, for d_basis
    for (index_t c0 = 0; c0 < Ts; c0 += block_rows) {
      const index_t n = std::min(block_rows, Ts - c0);
      const ConstMap<T> X(source.row(b, c0, h), n, d, Eigen::OuterStride<>(source.stride(1)));
      auto P = s.forward.projected.topRows(n);
      P.noalias() = X * Bm.transpose();  // eq. 3: B f_s
      add_column_sums(P, sum, comp, r);
      Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>>(s.features.data(), d) += X.colwise().sum();
    }
    s.means.resize(static_cast<std::size_t>(r));
    for (index_t i = 0; i < r; ++i) s.means[static_cast<std::size_t>(i)] = (sum[i] + comp[i]) / static_cast<T>(Ts);
    s.window_gradients.assign(static_cast<std::size_t>(r), 0.0);
    const double weight = 1.0 / static_cast<double>(Ts);
    for (index_t c0 = 0; c0 < Tq; c0 += block_rows) {
      const index_t nq = std::min(block_rows, Tq - c0);
      read_backward_block(
          q.row(b, c0, h), q.stride(1), d_out.row(b, c0, h), d_out.stride(1), dq.row(b, c0, h),
          dq.stride(1), nq, head, T(1), [&](index_t) -> const T* { return s.means.data(); },
          [&](index_t) { return s.window_gradients.data(); }, [&](index_t) { return weight; },
          d_basis, s);
    }
    // d_source_s = B^T dM for every s; d_basis_i += dM_i sum_s source_s.
    s.feature_gradients.assign(static_cast<std::size_t>(d), T(0));
    for (index_t i = 0; i < r; ++i) {
      const double e = s.window_gradients[static_cast<std::size_t>(i)];
      for (index_t j = 0; j < d; ++j) {
        s.feature_gradients[static_cast<std::size_t>(j)] += static_cast<T>(e) * head.basis[i * d + j];
        if (d_basis) d_basis[i * d + j] += e * static_cast<double>(s.features[static_cast<std::size_t>(j)]);
      }
    }
    for (index_t t = 0; t < Ts; ++t) std::copy_n(s.feature_gradients.data(), d, d_source.row(b, t, h));
  });
  partials.add_to(parameters, Bn * H, H);
}

}  // namespace latte::cpu
