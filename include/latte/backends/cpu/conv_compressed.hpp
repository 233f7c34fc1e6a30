#pragma once
// CPU backend for convolutional-compression attention (paper 003 §4, DESIGN
// §3.5; symbols of reference/conv_compressed.hpp).
//
//   (1) y^(0): cpu::softmax_forward's blocked sliding window, written into `out`;
//   (2) c^(l) = b^(l) + sum_i Y_i W^(l)_i^T, where Y_i (groups x Dv) holds tap i of
//       every complete group: a stride-M convolution of kernel M is M GEMMs over
//       strided views of the sequence, no copy; approach 2's levels project c^(l)
//       with GEMMs and window-attend it with cpu::softmax_forward;
//   (3) the top level's keys and values Wk_x c^(L), Wv_x c^(L) (GEMMs); per block of
//       64 queries, Q_x = Y^(0) Wq_x^T (GEMM) and a blocked online softmax over the
//       compressed tokens each row may see (block-causal: j < floor(t / M^L));
//   (4) the cross part is added to `out` (Residual).
// Work is split over (batch, head) when there are at least as many heads as
// threads (each head runs whole on one thread), otherwise heads run one after
// the other with their query blocks (and Eigen's GEMMs) spread over the threads.
// Workspace: per running head, the compressed sequences, O(T / M * (Dk + Dv)),
// the reference's per-head workspace (one copy per thread in the first mode);
// per worker a 64-row block of queries, scores and accumulators.
//
// Decode: the reference's step with Eigen matrix-vector products and the cross
// read as softmax_row_blocked over the compressed store (64 tokens per block). A forward into a fresh state (position 0) is the blocked
// forward above, which then leaves the rings, open group sums and compressed
// store as T steps would; a forward that continues a state at position > 0 runs
// the step token by token, in parallel over (batch, head).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include <Eigen/Core>

#include "latte/backends/cpu/compensated_sums.hpp"
#include "latte/backends/cpu/parallel.hpp"
#include "latte/backends/cpu/simd.hpp"
#include "latte/backends/cpu/softmax.hpp"
#include "latte/backends/cpu/softmax_row.hpp"
#include "latte/backends/reference/conv_compressed.hpp"
#include "latte/core/compensated_sum.hpp"
#include "latte/core/huge_page_allocator.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/policies/window.hpp"

namespace latte::cpu {

namespace conv_compressed_detail {

template <Real T>
using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <Real T>
using ConstMap = Eigen::Map<const Matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <Real T>
using Map = Eigen::Map<Matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;

inline constexpr index_t block_rows = 64;   // queries per cross block
inline constexpr index_t block_keys = 128;  // compressed tokens per score block

/// Per-worker scratch of the cross read.
template <Real T>
struct BlockScratch {
  BlockScratch(index_t Dk, index_t Dv)
      : query(block_rows, std::max(Dk, Dv)), scores(block_rows, block_keys), acc(block_rows, Dv),
        acc_low(block_rows, Dv), block_acc(block_rows, Dv), row_max(block_rows),
        row_sum(block_rows), row_sum_low(block_rows), correction(block_rows) {}
  // acc / row_sum with their low parts: compensated sums across key blocks.
  Matrix<T> query, scores, acc, acc_low, block_acc;
  AlignedVector<T> row_max, row_sum, row_sum_low, correction;
};

/// The compressed sequences of one head (reused from head to head).
template <Real T>
struct HeadWorkspace {
  Matrix<T> compressed, previous, level_q, level_k, level_v, level_y, cross_k, cross_v,
      cross_kw;  // K_x Wq_x (scores_through_keys)
};

/// C = b + sum_i Y_i W_i^T over the `groups` complete groups of a sequence whose
/// row s is source + s * stride (step 2; W_i is [out, in], row-major Dv x Dv).
template <Real T>
void convolve(const T* source, index_t stride, index_t groups, const T* weight, const T* bias,
              index_t M, index_t Dv, Matrix<T>& compressed) {
  compressed.resize(groups, Dv);
  if (groups == 0) return;
  const Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>> b(bias, Dv);
  compressed = b.replicate(groups, 1);
  for (index_t i = 0; i < M; ++i) {
    const ConstMap<T> Y(source + i * stride, groups, Dv, Eigen::OuterStride<>(M * stride));
    const ConstMap<T> W(weight + i * Dv * Dv, Dv, Dv, Eigen::OuterStride<>(Dv));
    compressed.noalias() += Y * W.transpose();
  }
}

/// X W^T for a row-major [out, in] matrix W.
template <Real T>
void project(const Matrix<T>& X, const T* weight, index_t rows_out, Matrix<T>& result) {
  const ConstMap<T> W(weight, rows_out, X.cols(), Eigen::OuterStride<>(X.cols()));
  result.resize(X.rows(), rows_out);
  if (X.rows() > 0) result.noalias() = X * W.transpose();
}

/// Window attention over a contiguous compressed sequence (approach 2's y^(l)).
template <bool Causal, Real T>
void window_attend(const Matrix<T>& q, const Matrix<T>& k, const Matrix<T>& v, Matrix<T>& y,
                   T scale, const SlidingWindow& window) {
  const index_t n = q.rows();
  y.resize(n, v.cols());
  if (n == 0) return;
  auto as_view = [n](const Matrix<T>& x) {
    return TensorView<const T, 4>(x.data(), {1, n, 1, x.cols()});
  };
  softmax_forward<Causal>(as_view(q), as_view(k), as_view(v),
                          TensorView<T, 4>(y.data(), {1, n, 1, y.cols()}), scale, window);
}

/// Whether the cross read's scores are cheaper as y^(0)_t . (K_x Wq_x)_j than
/// as (Wq_x y^(0)_t) . k_j: per query row, n Dv multiplications against
/// Dk Dv + n Dk for n compressed tokens (always, when Dk = Dv). The product
/// K_x Wq_x (n x Dv) is formed once per head; the backward then needs no
/// query projection either (its gradient goes through the same product).
[[nodiscard]] inline bool scores_through_keys(index_t n, index_t Dk, index_t Dv) noexcept {
  return n * (Dv - Dk) <= Dk * Dv;
}

/// Steps 3-4 for the query rows [i0, i0 + nq) of one head: out += softmax(scale
/// Q_x K_x^T) V_x over the compressed tokens each row sees (`visible(t)`, a
/// count non-decreasing in t). `out` rows hold y^(0) on entry. With a null
/// `query_weight`, `keys` are K_x Wq_x (n x Dv, scores_through_keys) and the
/// rows of y^(0) are the queries. A row's read
/// spans the whole past (T / M^L tokens): its sums across key blocks (the
/// softmax normaliser and the weighted values) are compensated, each block's
/// GEMM result added by TwoSum (core/compensated_sum.hpp).
template <Real T, class Keys, class Values, class Visible>
void cross_block(T* out_rows, index_t out_stride, index_t i0, index_t nq, const T* query_weight,
                 const Keys& keys, const Values& values, T scale, Visible&& visible,
                 BlockScratch<T>& s) {
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  const index_t Dk = keys.cols(), Dv = values.cols();
  const index_t reach = visible(i0 + nq - 1);
  if (reach == 0) return;  // no row of the block sees a compressed token
  Map<T> Y(out_rows, nq, Dv, Eigen::OuterStride<>(out_stride));
  if (query_weight != nullptr) {
    const ConstMap<T> Wq(query_weight, Dk, Dv, Eigen::OuterStride<>(Dv));
    s.query.topLeftCorner(nq, Dk).noalias() = Y * Wq.transpose();  // Wq_x y^(0)_t
  } else {
    s.query.topLeftCorner(nq, Dv) = Y;  // y^(0)_t against K_x Wq_x (Y is updated below)
  }
  const auto Q = s.query.topLeftCorner(nq, Dk);
  auto acc = s.acc.topRows(nq);
  auto acc_low = s.acc_low.topRows(nq);
  auto block_acc = s.block_acc.topRows(nq);
  acc.setZero();
  acc_low.setZero();
  std::fill(s.row_max.begin(), s.row_max.end(), neg_inf);
  std::fill(s.row_sum.begin(), s.row_sum.end(), T(0));
  std::fill(s.row_sum_low.begin(), s.row_sum_low.end(), T(0));
  for (index_t j0 = 0; j0 < reach; j0 += block_keys) {
    const index_t nk = std::min(block_keys, reach - j0);
    auto S = s.scores.topLeftCorner(nq, nk);
    S.noalias() = (Q * keys.middleRows(j0, nk).transpose()) * scale;
    for (index_t r = 0; r < nq; ++r) {
      const index_t count = std::min<index_t>(visible(i0 + r) - j0, nk);
      T* row = s.scores.row(r).data();
      if (count <= 0) {
        s.correction[r] = T(1);
        std::fill(row, row + nk, T(0));
        continue;
      }
      std::fill(row + count, row + nk, T(0));
      T block_max = neg_inf;
      for (index_t c = 0; c < count; ++c) block_max = std::max(block_max, row[c]);
      const T m_new = std::max(s.row_max[r], block_max);
      if (m_new == neg_inf) {
        s.correction[r] = T(1);
        std::fill(row, row + count, T(0));
        continue;
      }
      const T total = simd::exp_shifted_sum(row, count, m_new, row);
      s.correction[r] = std::exp(s.row_max[r] - m_new);
      if (s.correction[r] != T(1))
        latte::detail::compensated_scale(s.row_sum[r], s.row_sum_low[r], s.correction[r]);
      latte::detail::compensated_add(s.row_sum[r], s.row_sum_low[r], total);
      s.row_max[r] = m_new;
    }
    block_acc.noalias() = S * values.middleRows(j0, nk);
    for (index_t r = 0; r < nq; ++r) {  // rows are contiguous (row-major)
      if (s.correction[r] != T(1)) scale_pairs(&acc(r, 0), &acc_low(r, 0), s.correction[r], Dv);
      add_to_pairs(&acc(r, 0), &acc_low(r, 0), &block_acc(r, 0), Dv);
    }
  }
  for (index_t r = 0; r < nq; ++r)
    if (s.row_sum[r] > T(0)) Y.row(r) += acc.row(r) / s.row_sum[r];  // step 4: y + cross
}

/// The last min(ring, n) rows of keys / values (n x Dk, n x Dv) into a ring
/// (slot j % ring), as n decode steps would have left it.
template <Real T>
void fill_ring(const T* keys, index_t key_stride, const T* values, index_t value_stride,
               index_t n, T* ring_keys, T* ring_values, index_t ring, index_t Dk, index_t Dv) {
  for (index_t j = std::max<index_t>(0, n - ring); j < n; ++j) {
    std::copy(keys + j * key_stride, keys + j * key_stride + Dk, ring_keys + (j % ring) * Dk);
    std::copy(values + j * value_stride, values + j * value_stride + Dv,
              ring_values + (j % ring) * Dv);
  }
}

/// Steps 2-4 for one (b, h), once `out` holds y^(0). The cross blocks run on
/// `inner_workers` threads with scratch[worker]. With a `carry` (a fresh decode
/// state, ring slots `ring`), the state is left as T decode steps leave it:
/// level rings, open groups' partial sums and the compressed store.
template <bool Causal, Real T>
void compress_and_read(TensorView<T, 4> out, index_t b, index_t h,
                       const reference::ConvCompressedWeights<T>& w, T scale,
                       const SlidingWindow& window, HeadWorkspace<T>& ws,
                       BlockScratch<T>* scratch, int inner_workers,
                       const reference::ConvCompressedCarry<T>* carry = nullptr, index_t ring = 0) {
  const index_t Tn = out.extent(1), Dk = w.key_dim, Dv = w.value_dim, M = w.group_size;
  const index_t L = w.levels;
  index_t n = Tn;  // length of y^(l-1)
  for (index_t level = 1; level <= L; ++level) {
    const index_t groups = n / M;
    const T* source = level == 1 ? out.row(b, 0, h) : ws.previous.data();
    const index_t stride = level == 1 ? out.stride(1) : Dv;
    convolve(source, stride, groups, w.conv(level, h), w.bias(level, h), M, Dv, ws.compressed);
    if (carry != nullptr && n > groups * M) {  // the open group's taps so far
      Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>> open(carry->group_sums + (level - 1) * Dv,
                                                            Dv);
      open.setZero();
      for (index_t i = 0; i < n - groups * M; ++i) {
        const Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>> y(
            source + (groups * M + i) * stride, Dv);
        const ConstMap<T> W(w.conv(level, h) + i * Dv * Dv, Dv, Dv, Eigen::OuterStride<>(Dv));
        open.noalias() += y * W.transpose();
      }
    }
    n = groups;
    if (level == L || n == 0) {
      if (level < L) ws.compressed.resize(0, Dv);  // nothing reaches the top level
      break;
    }
    project(ws.compressed, w.query_projection(level, h), Dk, ws.level_q);
    project(ws.compressed, w.key_projection(level, h), Dk, ws.level_k);
    project(ws.compressed, w.value_projection(level, h), Dv, ws.level_v);
    if (carry != nullptr)
      fill_ring(ws.level_k.data(), Dk, ws.level_v.data(), Dv, n,
                carry->window_keys + level * ring * Dk, carry->window_values + level * ring * Dv,
                ring, Dk, Dv);
    window_attend<Causal>(ws.level_q, ws.level_k, ws.level_v, ws.level_y, scale, window);
    ws.previous.swap(ws.level_y);
  }
  n = ws.compressed.rows();
  if (n == 0) return;  // no compressed token: o = y^(0)
  project(ws.compressed, w.cross_key_projection(h), Dk, ws.cross_k);
  project(ws.compressed, w.cross_value_projection(h), Dv, ws.cross_v);
  if (carry != nullptr) {  // the compressed store: Wk_x c^(L)_j, Wv_x c^(L)_j
    std::copy(ws.cross_k.data(), ws.cross_k.data() + n * Dk, carry->compressed_keys);
    std::copy(ws.cross_v.data(), ws.cross_v.data() + n * Dv, carry->compressed_values);
  }
  const std::int64_t span = reference::tokens_per_compressed_token(M, L);
  auto visible = [&](index_t t) -> index_t {
    if constexpr (Causal) return static_cast<index_t>(std::min<std::int64_t>(t / span, n));
    else return n;
  };
  const bool through_keys = scores_through_keys(n, Dk, Dv);
  if (through_keys)
    ws.cross_kw.noalias() =
        ws.cross_k * ConstMap<T>(w.cross_query_projection(h), Dk, Dv, Eigen::OuterStride<>(Dv));
  const index_t blocks = (Tn + block_rows - 1) / block_rows;
  parallel_for(blocks, inner_workers, [&](index_t block, int worker) {
    const index_t i0 = block * block_rows, nq = std::min(block_rows, Tn - i0);
    cross_block(out.row(b, i0, h), out.stride(1), i0, nq,
                through_keys ? nullptr : w.cross_query_projection(h),
                through_keys ? ws.cross_kw : ws.cross_k, ws.cross_v, scale, visible, scratch[worker]);
  });
}

/// y = W x for a row-major [rows, cols] matrix W (Eigen's GEMV; no allocation).
template <Real T>
inline void matvec(const T* W, const T* x, T* y, index_t rows, index_t cols) noexcept {
  using Vector = Eigen::Matrix<T, Eigen::Dynamic, 1>;
  Eigen::Map<Vector>(y, rows).noalias() =
      ConstMap<T>(W, rows, cols, Eigen::OuterStride<>(cols)) * Eigen::Map<const Vector>(x, cols);
}

}  // namespace conv_compressed_detail

/// Whole-sequence forward over validated [B, T, H, *] views (see the header
/// comment). With `carry_of` (causal only), the sequence starts a fresh decode
/// state (position 0, ring slots `ring`) and leaves it as T steps would.
template <bool Causal, Real T, class CarryOf = std::nullptr_t>
void conv_compressed_forward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                             TensorView<const T, 4> v, TensorView<T, 4> out,
                             const reference::ConvCompressedWeights<T>& w, T scale,
                             const SlidingWindow& window, CarryOf&& carry_of = nullptr,
                             index_t ring = 0) {
  using namespace conv_compressed_detail;
  constexpr bool with_state = !std::is_same_v<std::remove_cvref_t<CarryOf>, std::nullptr_t>;
  const index_t Bn = q.extent(0), Tn = q.extent(1), H = q.extent(2);
  if (Bn == 0 || Tn == 0) return;
  softmax_forward<Causal>(q, k, v, out, scale, window);  // step 1: y^(0) into out
  const int workers = thread_count();
  const index_t heads_total = Bn * H;
  std::vector<BlockScratch<T>> scratch;
  scratch.reserve(static_cast<std::size_t>(workers));
  for (int i = 0; i < workers; ++i) scratch.emplace_back(w.key_dim, w.value_dim);
  auto carry_at = [&](index_t bh) {
    if constexpr (with_state) {
      const index_t b = bh / H, h = bh % H;
      const reference::ConvCompressedCarry<T> carry = carry_of(b, h);
      fill_ring(k.row(b, 0, h), k.stride(1), v.row(b, 0, h), v.stride(1), Tn, carry.window_keys,
                carry.window_values, ring, w.key_dim, w.value_dim);  // level 0: the inputs
      return carry;
    } else {
      return reference::ConvCompressedCarry<T>{};
    }
  };
  if (heads_total >= workers) {
    std::vector<HeadWorkspace<T>> workspace(static_cast<std::size_t>(workers));
    parallel_for(heads_total, workers, [&](index_t bh, int worker) {
      const auto carry = carry_at(bh);
      compress_and_read<Causal>(out, bh / H, bh % H, w, scale, window, workspace[worker],
                                &scratch[worker], 1, with_state ? &carry : nullptr, ring);
    });
  } else {
    HeadWorkspace<T> workspace;
    for (index_t bh = 0; bh < heads_total; ++bh) {
      const auto carry = carry_at(bh);
      compress_and_read<Causal>(out, bh / H, bh % H, w, scale, window, workspace, scratch.data(),
                                workers, with_state ? &carry : nullptr, ring);
    }
  }
}

/// Step 2 / approach 2 for the token at `position`, whose y^(0) is in
/// scratch.level_output: it joins the open group of each level, and a group it
/// completes becomes c^(l) (window-attended, l < L, and climbing on; or stored
/// in the compressed store, l = L). The decode step's second half.
template <Real T>
void conv_compressed_climb(reference::ConvCompressedCarry<T> carry,
                           const reference::ConvCompressedWeights<T>& w, index_t h, T scale,
                           index_t window_left, index_t ring, std::int64_t position,
                           reference::ConvCompressedScratch<T> scratch) noexcept {
  using namespace conv_compressed_detail;
  constexpr index_t W = simd::width<T>;
  const index_t Dk = w.key_dim, Dv = w.value_dim, M = w.group_size, L = w.levels;
  auto window_visible = [&](std::int64_t index) {
    return static_cast<index_t>(window_left >= index ? index + 1 : window_left + 1);  // no overflow
  };
  auto ring_of = [&](index_t level) {
    return reference::KVSlots<T>{carry.window_keys + level * ring * Dk,
                                 carry.window_values + level * ring * Dv};
  };
  index_t d = 0;
  std::int64_t index = position;
  for (index_t level = 1; level <= L; ++level) {
    const auto tap = static_cast<index_t>(index % M);
    T* group_sum = carry.group_sums + (level - 1) * Dv;
    const T* tap_weight = w.conv(level, h) + tap * Dv * Dv;
    if (tap == 0) std::fill(group_sum, group_sum + Dv, T(0));
    {
      using Vector = Eigen::Matrix<T, Eigen::Dynamic, 1>;
      Eigen::Map<Vector>(group_sum, Dv).noalias() +=
          ConstMap<T>(tap_weight, Dv, Dv, Eigen::OuterStride<>(Dv)) *
          Eigen::Map<const Vector>(scratch.level_output, Dv);
    }
    if (tap != M - 1) return;  // the group stays open
    index /= M;
    const T* bias = w.bias(level, h);
    for (d = 0; d + W <= Dv; d += W)
      simd::store(scratch.compressed + d, simd::load(group_sum + d) + simd::load(bias + d));
    for (; d < Dv; ++d) scratch.compressed[d] = group_sum[d] + bias[d];
    if (level == L) {
      matvec(w.cross_key_projection(h), scratch.compressed, carry.compressed_keys + index * Dk,
             Dk, Dv);
      matvec(w.cross_value_projection(h), scratch.compressed,
             carry.compressed_values + index * Dv, Dv, Dv);
      return;
    }
    matvec(w.query_projection(level, h), scratch.compressed, scratch.query, Dk, Dv);
    matvec(w.key_projection(level, h), scratch.compressed, scratch.key, Dk, Dv);
    matvec(w.value_projection(level, h), scratch.compressed, scratch.value, Dv, Dv);
    cpu::softmax_decode_step(scratch.query, scratch.key, scratch.value, scratch.level_output,
                        ring_of(level), ring, Dk, Dv, scale, index, window_visible(index));
  }
}

/// One causal decode step: reference::conv_compressed_step with vectorised
/// products (same arguments, same state layout); no allocation.
template <Real T>
void conv_compressed_step(const T* q, const T* k, const T* v, T* out,
                          reference::ConvCompressedCarry<T> carry,
                          const reference::ConvCompressedWeights<T>& w, index_t h, T scale,
                          index_t window_left, index_t ring, std::int64_t position,
                          reference::ConvCompressedScratch<T> scratch) noexcept {
  using namespace conv_compressed_detail;
  constexpr index_t W = simd::width<T>;
  const index_t Dk = w.key_dim, Dv = w.value_dim, M = w.group_size, L = w.levels;
  // Step 1: y^(0)_t over the ring of the inputs (level 0's).
  cpu::softmax_decode_step(
      q, k, v, scratch.level_output, reference::KVSlots<T>{carry.window_keys, carry.window_values},
      ring, Dk, Dv, scale, position,
      static_cast<index_t>(window_left >= position ? position + 1 : window_left + 1));
  // Steps 3-4: o_t = y^(0)_t + the read of c^(L)_j, j < floor(t / M^L).
  const auto visible =
      static_cast<index_t>(position / reference::tokens_per_compressed_token(M, L));
  matvec(w.cross_query_projection(h), scratch.level_output, scratch.query, Dk, Dv);
  const Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>> query(scratch.query, Dk);
  softmax_row_blocked(
      Dv, visible,
      [&](index_t j0, index_t n, T* p) {
        const ConstMap<T> K(carry.compressed_keys + j0 * Dk, n, Dk, Eigen::OuterStride<>(Dk));
        Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, 1>>(p, n).noalias() = scale * (K * query);
      },
      [&](index_t j0, index_t n, const T* p, T* acc) {
        const ConstMap<T> V(carry.compressed_values + j0 * Dv, n, Dv, Eigen::OuterStride<>(Dv));
        Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, 1>>(acc, Dv).noalias() +=
            V.transpose() * Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>>(p, n);
      },
      scratch.cross, scratch.cross_compensation);  // compensated: the read spans the whole past
  index_t d = 0;
  for (; d + W <= Dv; d += W)
    simd::store(out + d, simd::load(scratch.level_output + d) + simd::load(scratch.cross + d));
  for (; d < Dv; ++d) out[d] = scratch.level_output[d] + scratch.cross[d];

  conv_compressed_climb(carry, w, h, scale, window_left, ring, position, scratch);
}

/// A forward that continues decode states at `first_position` > 0, blocked as
/// the whole-sequence forward is: (1) y^(0) (window_outputs_after_ring, over
/// and into the state's ring of the inputs);
/// (2) each token climbs the levels as a decode step's second half does
/// (conv_compressed_climb: the groups, the levels' rings and the compressed
/// store, in place in the state); (3) the cross read of the compressed store in
/// blocks of 64 queries (cross_block, GEMMs) over the tokens each query sees.
/// `carry_of(b, h)` gives each head's carry; the state ends as T steps leave it.
template <Real T, class CarryOf>
void conv_compressed_forward_with_state(TensorView<const T, 4> q, TensorView<const T, 4> k,
                                        TensorView<const T, 4> v, TensorView<T, 4> out,
                                        const reference::ConvCompressedWeights<T>& w, T scale,
                                        index_t window_left, index_t ring,
                                        std::int64_t first_position, CarryOf&& carry_of) {
  using namespace conv_compressed_detail;
  const index_t Bn = q.extent(0), Tn = q.extent(1), H = q.extent(2);
  if (Bn == 0 || Tn == 0) return;
  const index_t Dk = w.key_dim, Dv = w.value_dim, per_worker = 6 * Dv + 2 * Dk;
  window_outputs_after_ring(q, k, v, out, scale, window_left, ring, first_position,
                            [&](index_t b, index_t h) {
                              const reference::ConvCompressedCarry<T> carry = carry_of(b, h);
                              return reference::KVSlots<T>{carry.window_keys, carry.window_values};
                            });
  const int workers = thread_count();
  const index_t heads_total = Bn * H;
  const std::int64_t span = reference::tokens_per_compressed_token(w.group_size, w.levels);
  AlignedVector<T> buffer(static_cast<std::size_t>(workers * per_worker));
  std::vector<BlockScratch<T>> blocks;
  blocks.reserve(static_cast<std::size_t>(workers));
  for (int i = 0; i < workers; ++i) blocks.emplace_back(Dk, Dv);
  // Step 2 for one head.
  auto climb = [&](index_t b, index_t h, int worker) {
    T* p = buffer.data() + worker * per_worker;
    const reference::ConvCompressedScratch<T> scratch{
        p,          p + Dv,     p + 2 * Dv, p + 2 * Dv + Dk, p + 2 * Dv + 2 * Dk,
        p + 3 * Dv + 2 * Dk, p + 4 * Dv + 2 * Dk};
    const reference::ConvCompressedCarry<T> carry = carry_of(b, h);
    for (index_t t = 0; t < Tn; ++t) {
      std::copy_n(out.row(b, t, h), Dv, scratch.level_output);
      conv_compressed_climb(carry, w, h, scale, window_left, ring, first_position + t, scratch);
    }
  };
  // Step 3 for one head's query rows [i0, i0 + nq).
  auto cross = [&](index_t b, index_t h, index_t i0, index_t nq, int worker) {
    const reference::ConvCompressedCarry<T> carry = carry_of(b, h);
    const auto stored = static_cast<index_t>((first_position + Tn - 1) / span);
    const ConstMap<T> keys(carry.compressed_keys, stored, Dk, Eigen::OuterStride<>(Dk));
    const ConstMap<T> values(carry.compressed_values, stored, Dv, Eigen::OuterStride<>(Dv));
    auto visible = [&](index_t t) {
      return static_cast<index_t>((first_position + t) / span);
    };
    cross_block(out.row(b, i0, h), out.stride(1), i0, nq, w.cross_query_projection(h), keys,
                values, scale, visible, blocks[static_cast<std::size_t>(worker)]);
  };
  const index_t row_blocks = (Tn + block_rows - 1) / block_rows;
  if (heads_total >= workers) {
    parallel_for(heads_total, workers, [&](index_t bh, int worker) {
      climb(bh / H, bh % H, worker);
      for (index_t block = 0; block < row_blocks; ++block)
        cross(bh / H, bh % H, block * block_rows, std::min(block_rows, Tn - block * block_rows),
              worker);
    });
  } else {
    for (index_t bh = 0; bh < heads_total; ++bh) {
      climb(bh / H, bh % H, 0);
      parallel_for(row_blocks, workers, [&](index_t block, int worker) {
        cross(bh / H, bh % H, block * block_rows, std::min(block_rows, Tn - block * block_rows),
              worker);
      });
    }
  }
}

namespace conv_backward_detail {

template <Real T>
using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <Real T>
using Rows = Eigen::Map<const Matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <Real T>
using MutableRows = Eigen::Map<Matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;

/// `rows` x `cols` rows from `data`, consecutive rows `stride` apart.
template <Real T>
Rows<T> rows_of(const T* data, index_t rows, index_t cols, index_t stride) {
  return Rows<T>(data, rows, cols, Eigen::OuterStride<>(stride));
}
template <Real T>
MutableRows<T> rows_of(T* data, index_t rows, index_t cols, index_t stride) {
  return MutableRows<T>(data, rows, cols, Eigen::OuterStride<>(stride));
}

/// into[i] += block(i) in double (a weight's gradient, flat; null: not wanted).
template <class Block>
void add_to_double(const Block& block, double* into) {
  if (!into) return;
  for (index_t r = 0; r < block.rows(); ++r)
    for (index_t c = 0; c < block.cols(); ++c) into[r * block.cols() + c] += static_cast<double>(block(r, c));
}

/// C = b + sum_i Y_i W_i^T over the n new groups of a level whose first `r`
/// taps were summed before the sequence (`initial_sum`, added to group 0):
/// tap i of group j is new row jM + i - r of `source` (rows `stride` apart),
/// so the convolution is M GEMMs over strided rows (group 0 joins tap i's
/// GEMM when i >= r).
template <Real T>
void convolve(const T* source, index_t stride, index_t n, index_t r, const T* initial_sum,
              const T* weights, const T* bias, index_t M, index_t Dv, Matrix<T>& C) {
  C.resize(n, Dv);
  if (n == 0) return;
  C.rowwise() = Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(bias, Dv);
  for (index_t i = 0; i < M; ++i) {
    const index_t skip = i < r ? 1 : 0, count = n - skip;  // group 0 has no new tap i < r
    if (count > 0)
      C.bottomRows(count).noalias() +=
          rows_of(source + (skip * M + i - r) * stride, count, Dv, M * stride) *
          rows_of(weights + i * Dv * Dv, Dv, Dv, Dv).transpose();
  }
  if (r > 0) C.row(0) += Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(initial_sum, Dv);
}

}  // namespace conv_backward_detail

/// The cpu backend's parts of reference::conv_compressed_backward: level 0's
/// window attention on the blocked softmax kernels (FlashAttention-2's
/// backward), heads in parallel over OpenMP threads, and each head's levels
/// and cross read as GEMMs (the convolution as M GEMMs, projections, the
/// block-causal cross read's backward per 64-query block, from the first query
/// that sees a compressed token); the levels' own window attentions (T / M
/// tokens and fewer) on the same blocked kernels, one head per thread, each
/// backward reusing its forward's row statistics. A
/// state continued (reference::ConvCompressedHeadStates) puts each level's
/// ring rows ahead of its new tokens and the stored compressed tokens ahead
/// of the new ones, as the reference does.
struct ConvCompressedParts {
  /// Level 0's window forward keeps each row's softmax statistics, so that its
  /// backward skips the flash step it would otherwise run again (pass 1).
  template <bool Causal, Real T>
  static SoftmaxRowStatistics<T> window_forward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                                                TensorView<const T, 4> v, TensorView<T, 4> out,
                                                T scale, const SlidingWindow& window) {
    SoftmaxRowStatistics<T> kept(q.extent(0) * q.extent(1) * q.extent(2));
    softmax_forward<Causal>(q, k, v, out, scale, window, &kept);
    return kept;
  }
  template <bool Causal, Real T>
  static void window_backward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                              TensorView<const T, 4> v, TensorView<const T, 4> d_out,
                              TensorView<T, 4> dq, TensorView<T, 4> dk, TensorView<T, 4> dv,
                              T scale, const SlidingWindow& window, SoftmaxRowStatistics<T> kept,
                              TensorView<const T, 4> out) {
    softmax_backward<Causal>(q, k, v, d_out, dq, dk, dv, scale, window, {}, &kept, out);
  }
  template <class Body>
  static void for_heads(index_t heads, Body&& body) {
    parallel_for(heads, thread_count(), [&](index_t h, int) { body(h); });
  }

  template <bool Causal, Real T>
  static void head_backward(const T* y0, index_t y0_stride, const T* g, index_t g_stride, T* dy0,
                            index_t dy0_stride, index_t Tn, index_t h,
                            const reference::ConvCompressedWeights<T>& w, T scale,
                            const SlidingWindow& window, reference::ConvCompressedLevels<T>& levels,
                            reference::ConvCompressedWeightGradients* dw,
                            const reference::ConvCompressedHeadStates<T>& states) {
    using namespace conv_backward_detail;
    using Mat = Matrix<T>;
    using Row = Eigen::Matrix<T, 1, Eigen::Dynamic>;
    using RowMap = Eigen::Map<Row>;
    using ConstRowMap = Eigen::Map<const Row>;
    const index_t Dk = w.key_dim, Dv = w.value_dim, M = w.group_size, L = w.levels, R = states.ring;
    const reference::ConvCompressedGradientLayout layout{w.heads, Dk, Dv, M, L};
    const reference::ConvLevelGeometry geometry(states.position, Tn, M, L);
    const std::vector<index_t>& length = geometry.lengths;
    auto flat = [&](std::vector<double> reference::ConvCompressedWeightGradients::*field,
                    index_t offset) -> double* { return dw ? (dw->*field).data() + offset : nullptr; };
    auto sequence = [](T* data, index_t n, index_t D) { return TensorView<T, 4>(data, {1, n, 1, D}); };
    // Forward of the levels: c^(l) = conv(y^(l-1)), y^(l) = window(projections
    // of c^(l)) over the level's ring rows (pre[l]) then its new tokens.
    std::vector<Mat> C(static_cast<std::size_t>(L)), Ql(static_cast<std::size_t>(L)),
        Kl(static_cast<std::size_t>(L)), Vl(static_cast<std::size_t>(L)), Yl(static_cast<std::size_t>(L));
    std::vector<index_t> pre(static_cast<std::size_t>(L), 0);
    std::vector<SoftmaxRowStatistics<T>> kept;  // levels 1 .. L - 1's window forwards, for their backward
    kept.reserve(static_cast<std::size_t>(L));
    auto source_of = [&](index_t level) -> std::pair<const T*, index_t> {  // new rows of y^(level - 1)
      if (level == 1) return {y0, y0_stride};
      const auto below = static_cast<std::size_t>(level - 2);
      return {Yl[below].data() + pre[below] * Dv, Dv};
    };
    for (index_t level = 1; level <= L; ++level) {
      const index_t n = length[static_cast<std::size_t>(level)];
      const auto [source, stride] = source_of(level);
      Mat& c = C[static_cast<std::size_t>(level - 1)];
      convolve(source, stride, n, geometry.taps_before(level, M),
               states.initial.group_sums ? states.initial.group_sums + (level - 1) * Dv : nullptr,
               w.conv(level, h), w.bias(level, h), M, Dv, c);
      if (level == L) break;
      const auto at = static_cast<std::size_t>(level - 1);
      const std::int64_t before = geometry.before[static_cast<std::size_t>(level)];
      const index_t p = pre[at] = static_cast<index_t>(std::min<std::int64_t>(R, before)), rows = p + n;
      Ql[at].resize(rows, Dk);
      Kl[at].resize(rows, Dk);
      Vl[at].resize(rows, Dv);
      if (p > 0)
        reference::ring_rows_first(states.initial.window_keys + level * R * Dk,
                                   states.initial.window_values + level * R * Dv, R, before, p, Dk, Dv,
                                   [&](index_t j) { return Ql[at].row(j).data(); },
                                   [&](index_t j) { return Kl[at].row(j).data(); },
                                   [&](index_t j) { return Vl[at].row(j).data(); });
      Ql[at].bottomRows(n).noalias() = c * rows_of(w.query_projection(level, h), Dk, Dv, Dv).transpose();
      Kl[at].bottomRows(n).noalias() = c * rows_of(w.key_projection(level, h), Dk, Dv, Dv).transpose();
      Vl[at].bottomRows(n).noalias() = c * rows_of(w.value_projection(level, h), Dv, Dv, Dv).transpose();
      Yl[at].resize(rows, Dv);
      kept.emplace_back(rows);
      if (rows > 0)  // serial when heads run in parallel (parallel.hpp)
        softmax_forward<Causal>(TensorView<const T, 4>(sequence(Ql[at].data(), rows, Dk)),
                                TensorView<const T, 4>(sequence(Kl[at].data(), rows, Dk)),
                                TensorView<const T, 4>(sequence(Vl[at].data(), rows, Dv)),
                                sequence(Yl[at].data(), rows, Dv), scale, window, &kept.back());
    }
    (void)levels;  // the reference's per-head workspace; these GEMMs keep their own
    // The cross read's backward over the stored then the new top-level tokens,
    // 64 queries at a time (each block sees a prefix of the keys).
    const Mat& top = C[static_cast<std::size_t>(L - 1)];
    const index_t n_top = length[static_cast<std::size_t>(L)];
    const auto stored = static_cast<index_t>(geometry.before[static_cast<std::size_t>(L)]);
    const index_t total = stored + n_top;
    const auto Y0 = rows_of(y0, Tn, Dv, y0_stride);
    const auto G = rows_of(g, Tn, Dv, g_stride);
    auto dY0 = rows_of(dy0, Tn, Dv, dy0_stride);
    const auto Wq = rows_of(w.cross_query_projection(h), Dk, Dv, Dv);
    const auto Wk = rows_of(w.cross_key_projection(h), Dk, Dv, Dv);
    const auto Wv = rows_of(w.cross_value_projection(h), Dv, Dv, Dv);
    Mat dC = Mat::Zero(n_top, Dv);
    if (total > 0) {
      Mat K(total, Dk), V(total, Dv);
      if (stored > 0) {
        K.topRows(stored) = rows_of(states.initial.compressed_keys, stored, Dk, Dk);
        V.topRows(stored) = rows_of(states.initial.compressed_values, stored, Dv, Dv);
      }
      K.bottomRows(n_top).noalias() = top * Wk.transpose();
      V.bottomRows(n_top).noalias() = top * Wv.transpose();
      const std::int64_t span = reference::tokens_per_compressed_token(M, L);
      auto visible = [&](index_t t) {
        return Causal ? static_cast<index_t>(std::min<std::int64_t>((states.position + t) / span, total))
                      : total;
      };
      // Rows before `first` see no compressed token (block-causal): they have
      // no cross query and give no gradient through it (at T <= M^L, none does).
      const index_t first = first_where(Tn, [&](index_t t) { return visible(t) > 0; });
      const index_t reading = Tn - first;
      const auto Y0_reading = Y0.middleRows(first, reading);
      // The scores as the forward formed them (scores_through_keys): either
      // Q_x = Y0 Wq^T against K_x = K, or Q_x = Y0 against K_x = K Wq. The
      // loop below is the softmax read's backward for (Q_x, K_x, V); the
      // gradients of Q_x and K_x go back through Wq after it.
      const bool through_keys = conv_compressed_detail::scores_through_keys(total, Dk, Dv);
      const index_t Dx = through_keys ? Dv : Dk;
      Mat Q, Kx;
      if (through_keys) Kx.noalias() = K * Wq;
      else Q.noalias() = Y0_reading * Wq.transpose();  // row t - first: Wq_x y^(0)_t
      // Qualified: latte::cpu::Rows (linear/forward.hpp) is visible too when
      // that header comes first.
      using ReadRows = conv_backward_detail::Rows<T>;
      const ReadRows Qx = through_keys ? rows_of(Y0_reading.data(), reading, Dv, Y0.outerStride())
                                       : rows_of(std::as_const(Q).data(), reading, Dk, Dk);
      const ReadRows Keys = through_keys ? rows_of(std::as_const(Kx).data(), total, Dv, Dv)
                                         : rows_of(std::as_const(K).data(), total, Dk, Dk);
      Mat dQ(through_keys ? 0 : reading, Dk), P, dS;
      // dK and dV sum over every later query block (T / 64 of them), dQ over a
      // row's keys: in double, as the rows' softmax sums, so that their error
      // does not grow with T.
      using Wide = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
      Wide dK_sum = Wide::Zero(total, Dx), dV_sum = Wide::Zero(total, Dv), dQ_sum;
      constexpr index_t rows = 64;
      for (index_t t0 = first; t0 < Tn; t0 += rows) {
        const index_t nq = std::min(rows, Tn - t0), seen = visible(t0 + nq - 1);
        const auto Q_block = Qx.middleRows(t0 - first, nq);
        P.noalias() = (Q_block * Keys.topRows(seen).transpose()) * scale;
        dS.noalias() = G.middleRows(t0, nq) * V.topRows(seen).transpose();  // dP
        for (index_t r = 0; r < nq; ++r) {
          const index_t count = visible(t0 + r);
          auto p = P.row(r);
          if (count == 0) {
            p.setZero();
            dS.row(r).setZero();
            continue;
          }
          const T m = p.head(count).maxCoeff();
          p.head(count) = (p.head(count).array() - m).exp().matrix();
          p.head(count) /= static_cast<T>(p.head(count).template cast<double>().sum());
          p.tail(seen - count).setZero();
          const T row_dot =
              static_cast<T>(p.template cast<double>().dot(dS.row(r).template cast<double>()));
          dS.row(r) = (p.array() * (dS.row(r).array() - row_dot)).matrix();
        }
        // dQ sums over the row's keys (the compressed past): per block of
        // block_keys keys, in double, as the forward's read is compensated.
        dQ_sum.setZero(nq, Dx);
        using conv_compressed_detail::block_keys;
        for (index_t j0 = 0; j0 < seen; j0 += block_keys) {
          const index_t nk = std::min(block_keys, seen - j0);
          dQ_sum += Mat(dS.middleCols(j0, nk) * Keys.middleRows(j0, nk)).template cast<double>();
        }
        if (through_keys)  // Q_x = y^(0): its gradient is y^(0)'s
          dY0.middleRows(t0, nq) += (dQ_sum * double(scale)).template cast<T>();
        else
          dQ.middleRows(t0 - first, nq) = (dQ_sum * double(scale)).template cast<T>();
        dK_sum.topRows(seen) += (Mat(dS.transpose() * Q_block) * scale).template cast<double>();
        dV_sum.topRows(seen) += Mat(P.transpose() * G.middleRows(t0, nq)).template cast<double>();
      }
      // K_x = K Wq: dK = dK_x Wq^T and dWq += K^T dK_x (in double, as the sums).
      Mat dK = through_keys ? Mat((dK_sum * Wq.transpose().template cast<double>()).template cast<T>())
                            : Mat(dK_sum.template cast<T>());
      Mat dV = dV_sum.template cast<T>();
      // The compressed store: the final state's gradient in, the stored tokens' out.
      if (states.d_final.compressed_keys != nullptr) {
        dK += rows_of(states.d_final.compressed_keys, total, Dk, Dk);
        dV += rows_of(states.d_final.compressed_values, total, Dv, Dv);
      }
      if (states.d_initial.compressed_keys != nullptr && stored > 0) {
        rows_of(states.d_initial.compressed_keys, stored, Dk, Dk) += dK.topRows(stored);
        rows_of(states.d_initial.compressed_values, stored, Dv, Dv) += dV.topRows(stored);
      }
      if (through_keys) {
        add_to_double(Wide(K.template cast<double>().transpose() * dK_sum),
                      flat(&reference::ConvCompressedWeightGradients::cross_query, h * Dk * Dv));
      } else {
        dY0.middleRows(first, reading).noalias() += dQ * Wq;
        add_to_double(Mat(dQ.transpose() * Y0_reading),
                      flat(&reference::ConvCompressedWeightGradients::cross_query, h * Dk * Dv));
      }
      if (n_top > 0) {
        add_to_double(Mat(dK.bottomRows(n_top).transpose() * top),
                      flat(&reference::ConvCompressedWeightGradients::cross_key, h * Dk * Dv));
        add_to_double(Mat(dV.bottomRows(n_top).transpose() * top),
                      flat(&reference::ConvCompressedWeightGradients::cross_value, h * Dv * Dv));
        dC.noalias() = dK.bottomRows(n_top) * Wk;
        dC.noalias() += dV.bottomRows(n_top) * Wv;
      }
    }
    // Down the levels: dc^(level) -> d y^(level - 1) (-> dc^(level - 1) through level - 1's window).
    Mat dY;
    for (index_t level = L; level >= 1; --level) {
      const index_t n = length[static_cast<std::size_t>(level)];
      const index_t n_below = length[static_cast<std::size_t>(level - 1)];
      const index_t r = geometry.taps_before(level, M);
      const auto below = static_cast<std::size_t>(level - 2);  // level - 1's activations (level > 1)
      const index_t p = level > 1 ? pre[below] : 0;
      const std::pair<const T*, index_t> source_rows = source_of(level);  // no structured
      const T* source = source_rows.first;  // binding: clang 14 cannot capture those
      const index_t stride = source_rows.second;
      if (level > 1) dY = Mat::Zero(p + n_below, Dv);
      T* d_source = level == 1 ? dy0 : dY.data() + p * Dv;
      const index_t d_stride = level == 1 ? dy0_stride : Dv;
      T* d_initial_sum = states.d_initial.group_sums ? states.d_initial.group_sums + (level - 1) * Dv : nullptr;
      if (n > 0) {
        if (dw) {
          const Row column_sums = dC.colwise().sum();
          add_to_double(column_sums, flat(&reference::ConvCompressedWeightGradients::conv_bias, layout.bias(level, h)));
        }
        for (index_t i = 0; i < M; ++i) {
          const index_t skip = i < r ? 1 : 0, count = n - skip, first = skip * M + i - r;
          if (count == 0) continue;
          const auto Wi = rows_of(w.conv(level, h) + i * Dv * Dv, Dv, Dv, Dv);
          rows_of(d_source + first * d_stride, count, Dv, M * d_stride).noalias() += dC.bottomRows(count) * Wi;
          if (dw)
            add_to_double(Mat(dC.bottomRows(count).transpose() * rows_of(source + first * stride, count, Dv, M * stride)),
                          flat(&reference::ConvCompressedWeightGradients::conv_weight,
                               layout.conv(level, h) + i * Dv * Dv));
        }
        if (r > 0 && d_initial_sum != nullptr) RowMap(d_initial_sum, Dv) += dC.row(0);  // the initial open group closed
      }
      if (states.d_final.group_sums != nullptr)  // the open group left behind
        reference::open_group_backward(
            states.d_final.group_sums + (level - 1) * Dv, geometry.taps_after(level, M), n_below, Dv,
            d_initial_sum, [&](index_t i, index_t s, const T* dg) {
              const auto Wi = rows_of(w.conv(level, h) + i * Dv * Dv, Dv, Dv, Dv);
              const ConstRowMap d_sum(dg, Dv);
              RowMap(d_source + s * d_stride, Dv).noalias() += d_sum * Wi;
              if (dw)
                add_to_double(Mat(d_sum.transpose() * ConstRowMap(source + s * stride, Dv)),
                              flat(&reference::ConvCompressedWeightGradients::conv_weight,
                                   layout.conv(level, h) + i * Dv * Dv));
            });
      if (level == 1) break;
      const index_t rows = p + n_below;
      Mat dq_l = Mat::Zero(rows, Dk), dk_l = Mat::Zero(rows, Dk), dv_l = Mat::Zero(rows, Dv);
      if (rows > 0)
        softmax_backward<Causal>(
            TensorView<const T, 4>(sequence(Ql[below].data(), rows, Dk)),
            TensorView<const T, 4>(sequence(Kl[below].data(), rows, Dk)),
            TensorView<const T, 4>(sequence(Vl[below].data(), rows, Dv)),
            TensorView<const T, 4>(sequence(dY.data(), rows, Dv)), sequence(dq_l.data(), rows, Dk),
            sequence(dk_l.data(), rows, Dk), sequence(dv_l.data(), rows, Dv), scale, window, {},
            &kept[below], TensorView<const T, 4>(sequence(Yl[below].data(), rows, Dv)));
      const index_t ring_level = level - 1;
      auto in_ring = [&](auto* field, index_t D) { return field ? field + ring_level * R * D : nullptr; };
      reference::ring_gradients(in_ring(states.d_final.window_keys, Dk), in_ring(states.d_final.window_values, Dv),
                                in_ring(states.d_initial.window_keys, Dk),
                                in_ring(states.d_initial.window_values, Dv), R,
                                geometry.before[static_cast<std::size_t>(level - 1)], p, n_below, Dk, Dv,
                                [&](index_t row) { return dk_l.row(row).data(); },
                                [&](index_t row) { return dv_l.row(row).data(); });
      const Mat& c = C[below];
      const auto Wql = rows_of(w.query_projection(level - 1, h), Dk, Dv, Dv);
      const auto Wkl = rows_of(w.key_projection(level - 1, h), Dk, Dv, Dv);
      const auto Wvl = rows_of(w.value_projection(level - 1, h), Dv, Dv, Dv);
      dC.noalias() = dq_l.bottomRows(n_below) * Wql;
      dC.noalias() += dk_l.bottomRows(n_below) * Wkl;
      dC.noalias() += dv_l.bottomRows(n_below) * Wvl;
      if (dw) {
        add_to_double(Mat(dq_l.bottomRows(n_below).transpose() * c), flat(&reference::ConvCompressedWeightGradients::level_query, layout.query(level - 1, h)));
        add_to_double(Mat(dk_l.bottomRows(n_below).transpose() * c), flat(&reference::ConvCompressedWeightGradients::level_key, layout.query(level - 1, h)));
        add_to_double(Mat(dv_l.bottomRows(n_below).transpose() * c), flat(&reference::ConvCompressedWeightGradients::level_value, layout.value(level - 1, h)));
      }
    }
  }
};

}  // namespace latte::cpu
