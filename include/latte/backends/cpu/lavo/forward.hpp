#pragma once
// CPU backend for LAVO (paper 002): blocked online softmax for the local part,
// Eigen GEMMs for the compression and the memory read, OpenMP over (batch,
// head, time segment), and a vectorised decode step.
//
// Per block of 64 query rows (symbols of reference/lavo.hpp):
//   local part (§3.2, §3.3): S = scale Q K^T + P[(s - t) + w - 1] over the keys
//       of the band, online softmax across key blocks (the flash recurrence);
//       F_local is written into `out`, so no T-sized buffer is needed;
//   compression (eq. 3): P_F = F_local B^T (GEMM), summed per window;
//   memory read (eq. 6): Q B^T (GEMM), per row p = softmax_i(scale H_i (b_i . q)),
//       g = (p (.) H) B (GEMM); o_t = (F_local + g) / 2.
// Causal: the memory of token t holds the complete windows before t's window,
// a prefix sum over windows. Time is cut into S segments at window borders
// (S > 1 only when B * H is smaller than the thread count): pass 1 computes the
// segments' F_local and window totals in parallel, a scan of the S totals gives
// each segment its incoming memory, pass 2 reads it in parallel (re-projecting
// F_local from `out`). The memory sum is Neumaier-compensated across windows,
// as in the reference. A sequence that continues a decode state reads the
// state's ring for the w - 1 keys before its first token and leaves the ring
// and sums as a token-by-token run would.
//
// Workspace (independent of T): per worker 64 x 128 scores, 64 x d for the
// accumulator and g, three 64 x r panels, and (when continuing a state) a copy
// of the ring's w - 1 previous keys and values; per (batch, head, segment) 6 r
// values for the scan.
//
// Decode step: the local row is softmax_row_blocked (64 keys per block, scores and
// value sums as matrix-vector products over the ring's contiguous runs), the
// memory read and the compression B f_t are Eigen matrix-vector products; no
// allocation (the state's scratch).
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include <Eigen/Core>

#include "latte/backends/cpu/parallel.hpp"
#include "latte/backends/cpu/simd.hpp"
#include "latte/backends/cpu/softmax_row.hpp"
#include "latte/backends/reference/lavo.hpp"
#include "latte/core/checked_size.hpp"
#include "latte/core/huge_page_allocator.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"

namespace latte::cpu {

namespace lavo_detail {

template <Real T>
using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <Real T>
using ConstMap = Eigen::Map<const Matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <Real T>
using Map = Eigen::Map<Matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;

inline constexpr index_t block_rows = 64;   // query rows per block
// Keys per score block: the causal band of 64 rows at w = 64 (127 keys) is one block.
inline constexpr index_t block_keys = 128;

/// Per-worker scratch of the blocked kernels.
template <Real T>
struct Scratch {
  Scratch(index_t d, index_t r)
      : scores(block_rows, block_keys), acc(block_rows, d), global(block_rows, d),
        projected(block_rows, r), query_bases(block_rows, r), read(block_rows, r),
        row_max(block_rows), row_sum(block_rows), correction(block_rows), mean(r),
        window_sum(r), memory_sum(r), memory_compensation(r) {}
  Matrix<T> scores, acc, global, projected, query_bases, read;
  AlignedVector<T> row_max, row_sum, correction, mean, window_sum, memory_sum, memory_compensation;
  AlignedVector<T> history_keys, history_values;  // [pre x d], oldest first
};

/// Where the keys and values of one (batch, head) come from: key j >= 0 is the
/// input's row j, key j in [-pre, 0) the history's row pre + j (a decode state's ring).
template <Real T>
struct KeyRows {
  const T* keys;
  const T* values;
  index_t key_stride, value_stride;
  const T* history_keys = nullptr;
  const T* history_values = nullptr;
  index_t pre = 0;
};

/// F_local (paper 002 §3.2, bias §3.3) of the query rows [i0, i0 + nq), written to
/// `local` (row stride `local_stride`). Row t sees keys max(t - w + 1, -pre) ..
/// t (causal) or .. min(t + w - 1, Tn - 1) (bidirectional), score
/// scale q_t . k_s + P[(s - t) + w - 1]; blocked online softmax over key blocks.
template <Real T>
void local_block(const T* queries, index_t query_stride, index_t i0, index_t nq,
                 const KeyRows<T>& rows, index_t Tn, bool causal,
                 const reference::LavoHead<T>& head, T* local, index_t local_stride,
                 Scratch<T>& s) {
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  const index_t d = head.dim, w = head.window;
  const ConstMap<T> Q(queries, nq, d, Eigen::OuterStride<>(query_stride));
  auto lowest = [&](index_t t) { return std::max<index_t>(t - (w - 1), -rows.pre); };
  auto highest = [&](index_t t) { return causal ? t : std::min<index_t>(t + (w - 1), Tn - 1); };
  auto acc = s.acc.topRows(nq);
  acc.setZero();
  std::fill(s.row_max.begin(), s.row_max.end(), neg_inf);
  std::fill(s.row_sum.begin(), s.row_sum.end(), T(0));

  auto visit = [&](index_t j_first, index_t nk, const T* key_rows, index_t key_stride,
                   const T* value_rows, index_t value_stride) {
    const ConstMap<T> K(key_rows, nk, d, Eigen::OuterStride<>(key_stride));
    const ConstMap<T> V(value_rows, nk, d, Eigen::OuterStride<>(value_stride));
    auto S = s.scores.topLeftCorner(nq, nk);
    S.noalias() = (Q * K.transpose()) * head.scale;
    for (index_t r = 0; r < nq; ++r) {
      const index_t t = i0 + r;
      const index_t c_lo = std::max<index_t>(lowest(t) - j_first, 0);
      const index_t c_hi = std::min<index_t>(highest(t) - j_first, nk - 1);
      T* row = s.scores.row(r).data();
      if (c_lo > c_hi) {  // no key of this block is in the row's band
        s.correction[r] = T(1);
        std::fill(row, row + nk, T(0));
        continue;
      }
      // P[(s - t) + w - 1] for column c (key s = j_first + c); in range for c in [c_lo, c_hi].
      const T* bias = head.relative_bias + (j_first + c_lo - t + w - 1);
      T* band = row + c_lo;
      const index_t n = c_hi - c_lo + 1;
      T band_max = neg_inf;
      index_t c = 0;
      if (n >= W) {
        B running(neg_inf);
        for (; c + W <= n; c += W) {
          const B x = simd::load(band + c) + simd::load(bias + c);
          simd::store(band + c, x);
          running = simd::max(running, x);
        }
        band_max = simd::reduce_max(running);
      }
      for (; c < n; ++c) {
        band[c] += bias[c];
        band_max = std::max(band_max, band[c]);
      }
      std::fill(row, band, T(0));
      std::fill(band + n, row + nk, T(0));
      const T m_new = std::max(s.row_max[r], band_max);
      if (m_new == neg_inf) {  // every allowed score so far is -inf
        s.correction[r] = T(1);
        std::fill(band, band + n, T(0));
        continue;
      }
      const T total = simd::exp_shifted_sum(band, n, m_new, band);
      s.correction[r] = std::exp(s.row_max[r] - m_new);
      s.row_sum[r] = s.row_sum[r] * s.correction[r] + total;
      s.row_max[r] = m_new;
    }
    for (index_t r = 0; r < nq; ++r) acc.row(r) *= s.correction[r];
    acc.noalias() += S * V;
  };

  const index_t key_lo = lowest(i0), key_hi = highest(i0 + nq - 1);
  const index_t history_hi = std::min<index_t>(key_hi, -1);
  for (index_t j0 = key_lo; j0 <= history_hi; j0 += block_keys) {
    const index_t nk = std::min(block_keys, history_hi - j0 + 1);
    visit(j0, nk, rows.history_keys + (rows.pre + j0) * d, d,
          rows.history_values + (rows.pre + j0) * d, d);
  }
  for (index_t j0 = std::max<index_t>(key_lo, 0); j0 <= key_hi; j0 += block_keys) {
    const index_t nk = std::min(block_keys, key_hi - j0 + 1);
    visit(j0, nk, rows.keys + j0 * rows.key_stride, rows.key_stride,
          rows.values + j0 * rows.value_stride, rows.value_stride);
  }
  Map<T> F(local, nq, d, Eigen::OuterStride<>(local_stride));
  for (index_t r = 0; r < nq; ++r) {
    if (s.row_sum[r] > T(0)) F.row(r) = acc.row(r) / s.row_sum[r];
    else F.row(r).setZero();
  }
}

/// The read weights of the memory (eq. 6) for one query: with bq_i = b_i . q,
/// weights_i = p_i H_i, p = softmax_i(scale H_i bq_i); all zero when every score is -inf.
template <Real T>
void read_weights(const T* bq, const T* mean, index_t r, T scale, T* weights) noexcept {
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  T score_max = neg_inf;
  index_t i = 0;
  if (r >= W) {
    B running(neg_inf);
    for (; i + W <= r; i += W) {
      const B score = B(scale) * (simd::load(mean + i) * simd::load(bq + i));
      simd::store(weights + i, score);
      running = simd::max(running, score);
    }
    score_max = simd::reduce_max(running);
  }
  for (; i < r; ++i) {
    weights[i] = scale * (mean[i] * bq[i]);
    score_max = std::max(score_max, weights[i]);
  }
  if (score_max == neg_inf) {
    std::fill(weights, weights + r, T(0));
    return;
  }
  const T total = simd::exp_shifted_sum(weights, r, score_max, weights);
  for (i = 0; i < r; ++i) weights[i] = weights[i] / total * mean[i];  // p_i H_i
}

/// Rows [c0, c0 + nq) of one (b, h) read a memory of one fixed mean H:
/// g = sum_i p_i H_i b_i, written to `global` rows (row stride `global_stride`).
template <Real T>
void read_fixed_mean(const T* queries, index_t query_stride, index_t nq,
                     const reference::LavoHead<T>& head, const T* mean, Scratch<T>& s) {
  const index_t d = head.dim, r = head.bases;
  const ConstMap<T> Q(queries, nq, d, Eigen::OuterStride<>(query_stride));
  const ConstMap<T> Bm(head.basis, r, d, Eigen::OuterStride<>(d));
  auto QB = s.query_bases.topRows(nq);
  QB.noalias() = Q * Bm.transpose();
  auto R = s.read.topRows(nq);
  for (index_t row = 0; row < nq; ++row)
    read_weights(s.query_bases.row(row).data(), mean, r, head.scale, s.read.row(row).data());
  s.global.topRows(nq).noalias() = R * Bm;
}

/// Adds the column sums of rows `P` (nq x r) to (sum, compensation).
template <Real T, class Panel>
void add_column_sums(const Panel& P, T* sum, T* compensation, index_t r) {
  for (index_t i = 0; i < r; ++i)
    reference::compensated_add(sum[i], compensation[i], P.col(i).sum());
}

/// Number of time segments for a (batch, head) count: enough tasks for every worker.
inline index_t segment_count(index_t heads_total, index_t Tn, index_t min_length, int workers) {
  if (heads_total >= workers) return 1;
  const index_t wanted = (workers + heads_total - 1) / heads_total;
  return std::max<index_t>(1, std::min<index_t>(wanted, Tn / std::max<index_t>(min_length, 1)));
}

}  // namespace lavo_detail

/// Causal LAVO over a whole [B, T, H, d] sequence at absolute positions
/// first_position + t. `carry_of(b, h)` gives the decode carry to continue from
/// and update, or a LavoCarry with null pointers (then first_position must be 0
/// and nothing is written back).
template <Real T, class HeadOf, class CarryOf>
void lavo_causal_forward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                         TensorView<const T, 4> v, TensorView<T, 4> out,
                         std::int64_t first_position, HeadOf&& head_of, CarryOf&& carry_of) {
  using namespace lavo_detail;
  const index_t Bn = q.extent(0), Tn = q.extent(1), H = q.extent(2);
  if (Bn == 0 || Tn == 0) return;
  const reference::LavoHead<T> first = head_of(0);
  const index_t d = first.dim, r = first.bases, w = first.window;
  const std::int64_t p0 = first_position;
  const int workers = thread_count();
  const index_t heads_total = Bn * H;
  const index_t S = segment_count(heads_total, Tn, std::max<index_t>(w, 4 * block_rows), workers);

  // Segment borders (relative), at absolute window borders so that a segment
  // adds whole windows to the memory.
  std::vector<index_t> border(static_cast<std::size_t>(S + 1), 0);
  border[S] = Tn;
  for (index_t seg = 1; seg < S; ++seg) {
    const std::int64_t target = p0 + (static_cast<std::int64_t>(Tn) * seg) / S;
    const std::int64_t aligned = ((target + w - 1) / w) * w;
    border[seg] = static_cast<index_t>(
        std::clamp<std::int64_t>(aligned - p0, border[seg - 1], Tn));
  }

  // History: the ring's keys/values of positions p0 - pre .. p0 - 1.
  const index_t pre = static_cast<index_t>(std::min<std::int64_t>(w - 1, p0));
  std::vector<Scratch<T>> scratch;
  scratch.reserve(static_cast<std::size_t>(workers));
  for (int i = 0; i < workers; ++i) scratch.emplace_back(d, r);
  // Per (b, h, segment): incoming memory (sum, compensation) and window sum, and
  // pass 1's outgoing window totals and open-window sum.
  const auto per_segment =
      static_cast<std::size_t>(latte::detail::checked_count<T>("queries", {heads_total, S, r}));
  AlignedVector<T> start_sum(per_segment, T(0)), start_comp(per_segment, T(0)),
      start_window(per_segment, T(0)), delta_sum(per_segment, T(0)),
      delta_comp(per_segment, T(0)), end_window(per_segment, T(0));
  auto at = [&](AlignedVector<T>& field, index_t bh, index_t seg) {
    return field.data() + (bh * S + seg) * r;
  };
  for (index_t bh = 0; bh < heads_total; ++bh) {
    const reference::LavoCarry<T> carry = carry_of(bh / H, bh % H);
    if (carry.keys == nullptr) continue;
    std::copy(carry.memory_sum, carry.memory_sum + r, at(start_sum, bh, 0));
    std::copy(carry.memory_compensation, carry.memory_compensation + r, at(start_comp, bh, 0));
    std::copy(carry.window_sum, carry.window_sum + r, at(start_window, bh, 0));
  }

  auto rows_of = [&](index_t b, index_t h, Scratch<T>& s, bool with_history) {
    KeyRows<T> rows{k.row(b, 0, h), v.row(b, 0, h), k.stride(1), v.stride(1)};
    if (!with_history || pre == 0) return rows;
    const reference::LavoCarry<T> carry = carry_of(b, h);
    s.history_keys.resize(static_cast<std::size_t>(pre * d));
    s.history_values.resize(static_cast<std::size_t>(pre * d));
    for (index_t j = 0; j < pre; ++j) {
      const auto slot = static_cast<index_t>((p0 - pre + j) % carry.capacity);
      std::copy(carry.keys + slot * d, carry.keys + (slot + 1) * d, s.history_keys.data() + j * d);
      std::copy(carry.values + slot * d, carry.values + (slot + 1) * d,
                s.history_values.data() + j * d);
    }
    rows.history_keys = s.history_keys.data();
    rows.history_values = s.history_values.data();
    rows.pre = pre;
    return rows;
  };

  // Pass 1 (S > 1): F_local of segments 0 .. S-2 and the windows they close.
  if (S > 1) {
    parallel_for(heads_total * (S - 1), workers, [&](index_t task, int worker) {
      Scratch<T>& s = scratch[worker];
      const index_t bh = task / (S - 1), seg = task % (S - 1), b = bh / H, h = bh % H;
      const reference::LavoHead<T> head = head_of(h);
      const KeyRows<T> rows = rows_of(b, h, s, seg == 0);
      const ConstMap<T> Bm(head.basis, r, d, Eigen::OuterStride<>(d));
      T* window_sum = at(end_window, bh, seg);
      std::copy(at(start_window, bh, seg), at(start_window, bh, seg) + r, window_sum);
      T* sum = at(delta_sum, bh, seg);
      T* comp = at(delta_comp, bh, seg);
      for (index_t c0 = border[seg]; c0 < border[seg + 1]; c0 += block_rows) {
        const index_t nq = std::min(block_rows, border[seg + 1] - c0);
        local_block(q.row(b, c0, h), q.stride(1), c0, nq, rows, Tn, true, head,
                    out.row(b, c0, h), out.stride(1), s);
        const ConstMap<T> F(out.row(b, c0, h), nq, d, Eigen::OuterStride<>(out.stride(1)));
        auto P = s.projected.topRows(nq);
        P.noalias() = F * Bm.transpose();  // eq. 3: B f_s
        for (index_t row = 0; row < nq; ++row) {
          const T* p = s.projected.row(row).data();
          for (index_t i = 0; i < r; ++i) window_sum[i] += p[i];
          if ((p0 + c0 + row + 1) % w == 0) {
            for (index_t i = 0; i < r; ++i) {
              reference::compensated_add(sum[i], comp[i], window_sum[i]);
              window_sum[i] = T(0);
            }
          }
        }
      }
    });
    // Scan: segment seg + 1 starts with the memory after segment seg.
    for (index_t bh = 0; bh < heads_total; ++bh)
      for (index_t seg = 0; seg + 1 < S; ++seg) {
        T* sum = at(start_sum, bh, seg + 1);
        T* comp = at(start_comp, bh, seg + 1);
        std::copy(at(start_sum, bh, seg), at(start_sum, bh, seg) + r, sum);
        std::copy(at(start_comp, bh, seg), at(start_comp, bh, seg) + r, comp);
        const T* add_sum = at(delta_sum, bh, seg);
        const T* add_comp = at(delta_comp, bh, seg);
        for (index_t i = 0; i < r; ++i) {
          reference::compensated_add(sum[i], comp[i], add_sum[i]);
          comp[i] += add_comp[i];
        }
        // An empty segment (clamped at T) passes its incoming open window on.
        const T* open = border[seg] == border[seg + 1] ? at(start_window, bh, seg)
                                                       : at(end_window, bh, seg);
        std::copy(open, open + r, at(start_window, bh, seg + 1));
      }
  }

  // Pass 2: every segment reads its memory; the last one also computes its F_local.
  parallel_for(heads_total * S, workers, [&](index_t task, int worker) {
    Scratch<T>& s = scratch[worker];
    const index_t bh = task / S, seg = task % S, b = bh / H, h = bh % H;
    const reference::LavoHead<T> head = head_of(h);
    const bool local_done = seg + 1 < S;
    const KeyRows<T> rows = rows_of(b, h, s, seg == 0 && !local_done);
    const ConstMap<T> Bm(head.basis, r, d, Eigen::OuterStride<>(d));
    T* window_sum = s.window_sum.data();
    T* sum = s.memory_sum.data();
    T* comp = s.memory_compensation.data();
    std::copy(at(start_window, bh, seg), at(start_window, bh, seg) + r, window_sum);
    std::copy(at(start_sum, bh, seg), at(start_sum, bh, seg) + r, sum);
    std::copy(at(start_comp, bh, seg), at(start_comp, bh, seg) + r, comp);
    std::int64_t mean_tokens = -1;
    for (index_t c0 = border[seg]; c0 < border[seg + 1]; c0 += block_rows) {
      const index_t nq = std::min(block_rows, border[seg + 1] - c0);
      if (!local_done)
        local_block(q.row(b, c0, h), q.stride(1), c0, nq, rows, Tn, true, head, out.row(b, c0, h),
                    out.stride(1), s);
      Map<T> F(out.row(b, c0, h), nq, d, Eigen::OuterStride<>(out.stride(1)));
      const ConstMap<T> Q(q.row(b, c0, h), nq, d, Eigen::OuterStride<>(q.stride(1)));
      auto P = s.projected.topRows(nq);
      P.noalias() = F * Bm.transpose();  // eq. 3: B f_s
      auto QB = s.query_bases.topRows(nq);
      QB.noalias() = Q * Bm.transpose();  // b_i . q_t
      for (index_t row = 0; row < nq; ++row) {
        const std::int64_t position = p0 + c0 + row;
        const std::int64_t memory_tokens = (position / w) * w;
        T* weights = s.read.row(row).data();
        if (memory_tokens > 0) {
          if (memory_tokens != mean_tokens) {  // H = (memory sum) / n, eq. 3
            const T n = static_cast<T>(memory_tokens);
            for (index_t i = 0; i < r; ++i) s.mean[i] = (sum[i] + comp[i]) / n;
            mean_tokens = memory_tokens;
          }
          read_weights(s.query_bases.row(row).data(), s.mean.data(), r, head.scale, weights);
        } else {
          std::fill(weights, weights + r, T(0));  // an empty memory reads g = 0
        }
        const T* p = s.projected.row(row).data();
        for (index_t i = 0; i < r; ++i) window_sum[i] += p[i];
        if ((position + 1) % w == 0) {  // the token closes its window
          for (index_t i = 0; i < r; ++i) {
            reference::compensated_add(sum[i], comp[i], window_sum[i]);
            window_sum[i] = T(0);
          }
        }
      }
      auto G = s.global.topRows(nq);
      G.noalias() = s.read.topRows(nq) * Bm;  // g = sum_i p_i H_i b_i
      for (index_t row = 0; row < nq; ++row) {
        const bool empty = p0 + c0 + row < w;
        if (empty && head.local_only_without_memory) continue;  // o_t = F_local
        F.row(row) = (F.row(row) + G.row(row)) * T(0.5);        // §3.2
      }
    }
    if (seg + 1 == S) {
      const reference::LavoCarry<T> carry = carry_of(b, h);
      if (carry.keys != nullptr) {
        std::copy(window_sum, window_sum + r, carry.window_sum);
        std::copy(sum, sum + r, carry.memory_sum);
        std::copy(comp, comp + r, carry.memory_compensation);
      }
    }
  });

  // The ring keeps the last tokens (after every task has read its history).
  for (index_t bh = 0; bh < heads_total; ++bh) {
    const index_t b = bh / H, h = bh % H;
    const reference::LavoCarry<T> carry = carry_of(b, h);
    if (carry.keys == nullptr) continue;
    for (index_t t = std::max<index_t>(0, Tn - carry.capacity); t < Tn; ++t) {
      const auto slot = static_cast<index_t>((p0 + t) % carry.capacity);
      std::copy(k.row(b, t, h), k.row(b, t, h) + d, carry.keys + slot * d);
      std::copy(v.row(b, t, h), v.row(b, t, h) + d, carry.values + slot * d);
    }
  }
}

/// Bidirectional LAVO: F_local over |s - t| <= w - 1 into `out`, the memory mean of
/// B F_local over the whole sequence (per segment, compensated), then the read.
template <Real T, class HeadOf>
void lavo_bidirectional_forward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                                TensorView<const T, 4> v, TensorView<T, 4> out,
                                HeadOf&& head_of) {
  using namespace lavo_detail;
  const index_t Bn = q.extent(0), Tn = q.extent(1), H = q.extent(2);
  if (Bn == 0 || Tn == 0) return;
  const reference::LavoHead<T> first = head_of(0);
  const index_t d = first.dim, r = first.bases;
  const int workers = thread_count();
  const index_t heads_total = Bn * H;
  const index_t S = segment_count(heads_total, Tn, 4 * block_rows, workers);
  auto border = [&](index_t seg) { return (Tn * seg) / S; };
  std::vector<Scratch<T>> scratch;
  scratch.reserve(static_cast<std::size_t>(workers));
  for (int i = 0; i < workers; ++i) scratch.emplace_back(d, r);
  const auto per_segment =
      static_cast<std::size_t>(latte::detail::checked_count<T>("queries", {heads_total, S, r}));
  AlignedVector<T> seg_sum(per_segment, T(0)), seg_comp(per_segment, T(0));
  AlignedVector<T> mean(static_cast<std::size_t>(heads_total * r));

  parallel_for(heads_total * S, workers, [&](index_t task, int worker) {
    Scratch<T>& s = scratch[worker];
    const index_t bh = task / S, seg = task % S, b = bh / H, h = bh % H;
    const reference::LavoHead<T> head = head_of(h);
    const KeyRows<T> rows{k.row(b, 0, h), v.row(b, 0, h), k.stride(1), v.stride(1)};
    const ConstMap<T> Bm(head.basis, r, d, Eigen::OuterStride<>(d));
    T* sum = seg_sum.data() + task * r;
    T* comp = seg_comp.data() + task * r;
    for (index_t c0 = border(seg); c0 < border(seg + 1); c0 += block_rows) {
      const index_t nq = std::min(block_rows, border(seg + 1) - c0);
      local_block(q.row(b, c0, h), q.stride(1), c0, nq, rows, Tn, false, head, out.row(b, c0, h),
                  out.stride(1), s);
      const ConstMap<T> F(out.row(b, c0, h), nq, d, Eigen::OuterStride<>(out.stride(1)));
      auto P = s.projected.topRows(nq);
      P.noalias() = F * Bm.transpose();  // eq. 3: B f_s
      add_column_sums(P, sum, comp, r);
    }
  });
  for (index_t bh = 0; bh < heads_total; ++bh) {
    T* total = seg_sum.data() + bh * S * r;
    T* total_comp = seg_comp.data() + bh * S * r;
    for (index_t seg = 1; seg < S; ++seg)
      for (index_t i = 0; i < r; ++i) {
        reference::compensated_add(total[i], total_comp[i], seg_sum[(bh * S + seg) * r + i]);
        total_comp[i] += seg_comp[(bh * S + seg) * r + i];
      }
    for (index_t i = 0; i < r; ++i)
      mean[bh * r + i] = (total[i] + total_comp[i]) / static_cast<T>(Tn);
  }
  parallel_for(heads_total * S, workers, [&](index_t task, int worker) {
    Scratch<T>& s = scratch[worker];
    const index_t bh = task / S, seg = task % S, b = bh / H, h = bh % H;
    const reference::LavoHead<T> head = head_of(h);
    for (index_t c0 = border(seg); c0 < border(seg + 1); c0 += block_rows) {
      const index_t nq = std::min(block_rows, border(seg + 1) - c0);
      read_fixed_mean(q.row(b, c0, h), q.stride(1), nq, head, mean.data() + bh * r, s);
      Map<T> F(out.row(b, c0, h), nq, d, Eigen::OuterStride<>(out.stride(1)));
      F = (F + s.global.topRows(nq)) * T(0.5);  // §3.2
    }
  });
}

/// Cross-attention LAVO (§3.4, eqs. 5-6): the mean of B s over the source, then
/// every query reads it. An empty source is H = 0 and reads zero.
template <Real T, class HeadOf>
void lavo_cross_forward(TensorView<const T, 4> q, TensorView<const T, 4> source,
                        TensorView<T, 4> out, HeadOf&& head_of) {
  using namespace lavo_detail;
  const index_t Bn = q.extent(0), Tq = q.extent(1), H = q.extent(2), Ts = source.extent(1);
  if (Bn == 0 || Tq == 0) return;
  const reference::LavoHead<T> first = head_of(0);
  const index_t d = first.dim, r = first.bases;
  const int workers = thread_count();
  const index_t heads_total = Bn * H;
  const index_t S_source = segment_count(heads_total, Ts, 4 * block_rows, workers);
  const index_t S_query = segment_count(heads_total, Tq, 4 * block_rows, workers);
  std::vector<Scratch<T>> scratch;
  scratch.reserve(static_cast<std::size_t>(workers));
  for (int i = 0; i < workers; ++i) scratch.emplace_back(d, r);
  const auto per_segment =
      static_cast<std::size_t>(latte::detail::checked_count<T>("source", {heads_total, S_source, r}));
  AlignedVector<T> seg_sum(per_segment, T(0)), seg_comp(per_segment, T(0));
  AlignedVector<T> mean(static_cast<std::size_t>(heads_total * r), T(0));

  if (Ts > 0) {
    parallel_for(heads_total * S_source, workers, [&](index_t task, int worker) {
      Scratch<T>& s = scratch[worker];
      const index_t bh = task / S_source, seg = task % S_source, b = bh / H, h = bh % H;
      const ConstMap<T> Bm(head_of(h).basis, r, d, Eigen::OuterStride<>(d));
      const index_t lo = (Ts * seg) / S_source, hi = (Ts * (seg + 1)) / S_source;
      for (index_t c0 = lo; c0 < hi; c0 += block_rows) {
        const index_t n = std::min(block_rows, hi - c0);
        const ConstMap<T> X(source.row(b, c0, h), n, d, Eigen::OuterStride<>(source.stride(1)));
        auto P = s.projected.topRows(n);
        P.noalias() = X * Bm.transpose();  // eq. 3: B f_s
        add_column_sums(P, seg_sum.data() + task * r, seg_comp.data() + task * r, r);
      }
    });
    for (index_t bh = 0; bh < heads_total; ++bh) {
      T* total = seg_sum.data() + bh * S_source * r;
      T* total_comp = seg_comp.data() + bh * S_source * r;
      for (index_t seg = 1; seg < S_source; ++seg)
        for (index_t i = 0; i < r; ++i) {
          reference::compensated_add(total[i], total_comp[i],
                                     seg_sum[(bh * S_source + seg) * r + i]);
          total_comp[i] += seg_comp[(bh * S_source + seg) * r + i];
        }
      for (index_t i = 0; i < r; ++i)
        mean[bh * r + i] = (total[i] + total_comp[i]) / static_cast<T>(Ts);
    }
  }
  parallel_for(heads_total * S_query, workers, [&](index_t task, int worker) {
    Scratch<T>& s = scratch[worker];
    const index_t bh = task / S_query, seg = task % S_query, b = bh / H, h = bh % H;
    const reference::LavoHead<T> head = head_of(h);
    const index_t lo = (Tq * seg) / S_query, hi = (Tq * (seg + 1)) / S_query;
    for (index_t c0 = lo; c0 < hi; c0 += block_rows) {
      const index_t nq = std::min(block_rows, hi - c0);
      read_fixed_mean(q.row(b, c0, h), q.stride(1), nq, head, mean.data() + bh * r, s);
      Map<T>(out.row(b, c0, h), nq, d, Eigen::OuterStride<>(out.stride(1))) =
          s.global.topRows(nq);
    }
  });
}

/// One causal decode step (the recurrence of reference::lavo_causal_step with
/// matrix-vector products). `scratch` holds reference::lavo_step_scratch(d, r) values.
template <Real T>
void lavo_causal_step(const T* q, const T* k, const T* v, T* out,
                      const reference::LavoCarry<T>& carry, const reference::LavoHead<T>& head,
                      std::int64_t position, T* scratch) noexcept {
  using namespace lavo_detail;
  using Vector = Eigen::Matrix<T, Eigen::Dynamic, 1>;
  const index_t d = head.dim, r = head.bases, w = head.window, capacity = carry.capacity;
  T* local = scratch;
  T* mean = scratch + d;
  T* weights = scratch + d + r;

  const auto slot = static_cast<index_t>(position % capacity);
  std::copy(k, k + d, carry.keys + slot * d);
  std::copy(v, v + d, carry.values + slot * d);

  // F_local: softmax over s = t - visible + 1 .. t with P[(s - t) + w - 1] (§3.2, §3.3).
  const auto visible = static_cast<index_t>(std::min<std::int64_t>(position + 1, w));
  const std::int64_t oldest = position + 1 - visible;
  auto slot_of = [&](index_t j) { return static_cast<index_t>((oldest + j) % capacity); };
  const Eigen::Map<const Vector> query(q, d);
  softmax_row_blocked(
      d, visible,
      [&](index_t j0, index_t n, T* p) {
        // Keys j0 .. j0 + n - 1 are ring slots slot_of(j0) .. , wrapping at most once.
        for (index_t done = 0; done < n;) {
          const index_t slot = slot_of(j0 + done), run = std::min(n - done, capacity - slot);
          const ConstMap<T> K(carry.keys + slot * d, run, d, Eigen::OuterStride<>(d));
          Eigen::Map<Vector>(p + done, run).noalias() = head.scale * (K * query);
          done += run;
        }
        for (index_t j = 0; j < n; ++j) p[j] += head.relative_bias[j0 + j + w - visible];
      },
      [&](index_t j0, index_t n, const T* p, T* acc) {
        for (index_t done = 0; done < n;) {
          const index_t slot = slot_of(j0 + done), run = std::min(n - done, capacity - slot);
          const ConstMap<T> V(carry.values + slot * d, run, d, Eigen::OuterStride<>(d));
          Eigen::Map<Vector>(acc, d).noalias() +=
              V.transpose() * Eigen::Map<const Vector>(p + done, run);
          done += run;
        }
      },
      local);

  // F_global: the memory of the floor(t / w) complete windows (eqs. 3, 6).
  const std::int64_t memory_tokens = (position / w) * w;
  const bool memory_empty = memory_tokens == 0;
  const ConstMap<T> Bm(head.basis, r, d, Eigen::OuterStride<>(d));
  if (!memory_empty) {
    const T n = static_cast<T>(memory_tokens);
    for (index_t i = 0; i < r; ++i)
      mean[i] = (carry.memory_sum[i] + carry.memory_compensation[i]) / n;
    Eigen::Map<Vector> read(weights, r);
    read.noalias() = Bm * query;  // b_i . q
    lavo_detail::read_weights(weights, mean, r, head.scale, weights);
    Eigen::Map<Vector>(out, d).noalias() = Bm.transpose() * read;  // sum_i p_i H_i b_i
  }
  reference::lavo_combine(local, out, memory_empty, head.local_only_without_memory, out, d);

  // f_t = F_local(t) joins the open window's sum (eq. 3), and the memory when it closes.
  Eigen::Map<Vector>(carry.window_sum, r).noalias() += Bm * Eigen::Map<const Vector>(local, d);
  if ((position + 1) % w == 0) {
    for (index_t i = 0; i < r; ++i) {
      reference::compensated_add(carry.memory_sum[i], carry.memory_compensation[i],
                                 carry.window_sum[i]);
      carry.window_sum[i] = T(0);
    }
  }
}

}  // namespace latte::cpu
