#pragma once
// Reference backend for convolutional-compression attention (paper 003 §4,
// DESIGN §3.5): scalar loops that read like the paper.
//
// Symbols (per batch and head; paper 003 has no numbered equations, so the
// comments cite its §4 and DESIGN §3.5's steps (1)-(4)):
//   M         group size: one compressed token per M consecutive tokens
//   L         levels: how many times the sequence is compressed (approach 1: L = 1)
//   y^(0)     sliding-window attention over the projected inputs q, k, v     (step 1)
//   c^(l)_j   = b^(l) + sum_{i<M} W^(l)_i y^(l-1)_{jM+i}, the learned convolution
//             (kernel M, stride M, Dv -> Dv, bias) over the complete groups   (step 2)
//   y^(l)     sliding-window attention over c^(l) with the level's own
//             projections Wq^(l), Wk^(l), Wv^(l), for 1 <= l < L       (approach 2)
//   o_t       = y^(0)_t + sum_{j in V(t)} softmax_j(scale (Wq_x y^(0)_t).(Wk_x c^(L)_j))
//                                       Wv_x c^(L)_j                   (steps 3, 4)
//   V(t)      = { j < floor(t / M^L) } (Causal: block-causal at level L's
//             granularity; the first M^L tokens see no compressed token),
//             every j (Bidirectional).
// Weight matrices are [out, in] (torch.nn.Linear / Conv1d order): W^(l)_i is
// the Dv x Dv matrix of tap i. Sliding windows use FlashAttention's
// convention (SlidingWindow{left, right}) at every level.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "latte/backends/reference/softmax.hpp"
#include "latte/core/huge_page_allocator.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/policies/window.hpp"

namespace latte::reference {

/// M^levels: the input tokens one top-level compressed token covers,
/// saturating at INT64_MAX (then no compressed token is ever complete).
[[nodiscard]] inline std::int64_t tokens_per_compressed_token(index_t group_size,
                                                              index_t levels) noexcept {
  std::int64_t span = 1;
  for (index_t level = 0; level < levels; ++level) {
    if (span > std::numeric_limits<std::int64_t>::max() / group_size)
      return std::numeric_limits<std::int64_t>::max();
    span *= group_size;
  }
  return span;
}

/// The op's weights in the compute type, flat and per head.
template <Real T>
struct ConvCompressedWeights {
  index_t heads = 0, key_dim = 0, value_dim = 0, group_size = 0, levels = 0;
  std::vector<T> conv_weight;   // [levels][H][M][Dv][Dv]: W^(l)_i, [out, in]
  std::vector<T> conv_bias;     // [levels][H][Dv]: b^(l)
  std::vector<T> level_query;   // [levels-1][H][Dk][Dv]: Wq^(l), l = 1..L-1
  std::vector<T> level_key;     // [levels-1][H][Dk][Dv]: Wk^(l)
  std::vector<T> level_value;   // [levels-1][H][Dv][Dv]: Wv^(l)
  std::vector<T> cross_query;   // [H][Dk][Dv]: Wq_x
  std::vector<T> cross_key;     // [H][Dk][Dv]: Wk_x
  std::vector<T> cross_value;   // [H][Dv][Dv]: Wv_x

  // Levels are 1-based, as in the paper's c^(1), ..., c^(L).
  [[nodiscard]] const T* conv(index_t level, index_t h) const noexcept {
    return conv_weight.data() + ((level - 1) * heads + h) * group_size * value_dim * value_dim;
  }
  [[nodiscard]] const T* bias(index_t level, index_t h) const noexcept {
    return conv_bias.data() + ((level - 1) * heads + h) * value_dim;
  }
  [[nodiscard]] const T* query_projection(index_t level, index_t h) const noexcept {
    return level_query.data() + ((level - 1) * heads + h) * key_dim * value_dim;
  }
  [[nodiscard]] const T* key_projection(index_t level, index_t h) const noexcept {
    return level_key.data() + ((level - 1) * heads + h) * key_dim * value_dim;
  }
  [[nodiscard]] const T* value_projection(index_t level, index_t h) const noexcept {
    return level_value.data() + ((level - 1) * heads + h) * value_dim * value_dim;
  }
  [[nodiscard]] const T* cross_query_projection(index_t h) const noexcept {
    return cross_query.data() + h * key_dim * value_dim;
  }
  [[nodiscard]] const T* cross_key_projection(index_t h) const noexcept {
    return cross_key.data() + h * key_dim * value_dim;
  }
  [[nodiscard]] const T* cross_value_projection(index_t h) const noexcept {
    return cross_value.data() + h * value_dim * value_dim;
  }
};

/// y = W x for a row-major [rows, cols] matrix W.
template <Real T>
void matvec(const T* W, const T* x, T* y, index_t rows, index_t cols) noexcept {
  for (index_t r = 0; r < rows; ++r) {
    T total = 0;
    for (index_t c = 0; c < cols; ++c) total += W[r * cols + c] * x[c];
    y[r] = total;
  }
}

/// Adds tap i of the convolution, W^(l)_i z, to the open group's partial sum
/// (which `first` starts afresh): sum_{i' <= i} W^(l)_{i'} y^(l-1)_{jM+i'}.
template <Real T>
void conv_tap(const T* tap_weight, const T* z, T* group_sum, index_t Dv, bool first) noexcept {
  for (index_t o = 0; o < Dv; ++o) {
    T total = 0;
    for (index_t d = 0; d < Dv; ++d) total += tap_weight[o * Dv + d] * z[d];
    group_sum[o] = (first ? T(0) : group_sum[o]) + total;
  }
}

/// c^(l)_j = (sum of the M taps) + b^(l)   (paper 003 §4: "a convolution over the
/// entire size M resulting in an output size of 1, with the embedding dimension unchanged").
template <Real T>
void close_group(const T* group_sum, const T* bias, T* compressed, index_t Dv) noexcept {
  for (index_t o = 0; o < Dv; ++o) compressed[o] = group_sum[o] + bias[o];
}

/// Whole-sequence forward over validated [B, T, H, *] views. Workspace: the
/// compressed sequences, O(T / M * (Dk + Dv)) per head.
template <bool Causal, Real T>
void conv_compressed_forward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                             TensorView<const T, 4> v, TensorView<T, 4> out,
                             const ConvCompressedWeights<T>& w, T scale,
                             const SlidingWindow& window) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2);
  const index_t Dk = w.key_dim, Dv = w.value_dim, M = w.group_size, L = w.levels;
  if (B == 0 || Tn == 0) return;
  // Step 1: y^(0) = sliding-window attention, written into out (the residual branch).
  softmax_forward<Causal>(q, k, v, out, scale, window);

  const std::int64_t span = tokens_per_compressed_token(M, L);
  std::vector<T> previous, compressed, level_q, level_k, level_v, level_y, cross_k, cross_v;
  std::vector<T> query(static_cast<std::size_t>(Dk)), cross(static_cast<std::size_t>(Dv)),
      cross_low(cross.size());
  auto as_sequence = [](std::vector<T>& data, index_t n, index_t D) {
    return TensorView<T, 4>(data.data(), {1, n, 1, D});
  };
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h) {
      // Step 2 and approach 2: compress, then (below the top) window-attend, per level.
      index_t n = Tn;  // length of y^(l-1)
      for (index_t level = 1; level <= L; ++level) {
        const index_t groups = n / M;  // complete groups only: c^(l) has floor(n / M) tokens
        compressed.assign(static_cast<std::size_t>(groups * Dv), T(0));
        auto source_row = [&](index_t s) -> const T* {  // y^(l-1)_s
          return level == 1 ? out.row(b, s, h) : previous.data() + s * Dv;
        };
        for (index_t j = 0; j < groups; ++j) {
          T* c = compressed.data() + j * Dv;
          for (index_t i = 0; i < M; ++i)
            conv_tap(w.conv(level, h) + i * Dv * Dv, source_row(j * M + i), c, Dv, i == 0);
          close_group(c, w.bias(level, h), c, Dv);
        }
        n = groups;
        if (level == L) break;
        level_q.resize(static_cast<std::size_t>(n * Dk));
        level_k.resize(static_cast<std::size_t>(n * Dk));
        level_v.resize(static_cast<std::size_t>(n * Dv));
        level_y.resize(static_cast<std::size_t>(n * Dv));
        for (index_t j = 0; j < n; ++j) {
          const T* c = compressed.data() + j * Dv;
          matvec(w.query_projection(level, h), c, level_q.data() + j * Dk, Dk, Dv);
          matvec(w.key_projection(level, h), c, level_k.data() + j * Dk, Dk, Dv);
          matvec(w.value_projection(level, h), c, level_v.data() + j * Dv, Dv, Dv);
        }
        // y^(l): the same sliding window over the compressed sequence.
        softmax_forward<Causal>(TensorView<const T, 4>(as_sequence(level_q, n, Dk)),
                                TensorView<const T, 4>(as_sequence(level_k, n, Dk)),
                                TensorView<const T, 4>(as_sequence(level_v, n, Dv)),
                                as_sequence(level_y, n, Dv), scale, window);
        previous.swap(level_y);
      }
      // Step 3: keys and values of the top level, Wk_x c^(L)_j and Wv_x c^(L)_j.
      cross_k.resize(static_cast<std::size_t>(n * Dk));
      cross_v.resize(static_cast<std::size_t>(n * Dv));
      for (index_t j = 0; j < n; ++j) {
        matvec(w.cross_key_projection(h), compressed.data() + j * Dv, cross_k.data() + j * Dk, Dk,
               Dv);
        matvec(w.cross_value_projection(h), compressed.data() + j * Dv, cross_v.data() + j * Dv,
               Dv, Dv);
      }
      // Steps 3-4: every query t reads the visible compressed tokens; out = y + cross.
      for (index_t t = 0; t < Tn; ++t) {
        T* y = out.row(b, t, h);
        matvec(w.cross_query_projection(h), y, query.data(), Dk, Dv);
        const index_t visible =
            Causal ? static_cast<index_t>(std::min<std::int64_t>(t / span, n)) : n;
        softmax_row(
            query.data(), Dk, Dv, scale, visible,
            [&](index_t j) { return cross_k.data() + j * Dk; },
            [&](index_t j) { return cross_v.data() + j * Dv; }, cross.data(),
            cross_low.data());  // compensated: the read spans the whole past
        for (index_t d = 0; d < Dv; ++d) y[d] += cross[d];
      }
    }
}

/// The decode carry of one (batch, head); ConvCompressedCarry<const T> reads one.
template <class T>
struct ConvCompressedCarry {
  T* window_keys;        // [L][R][Dk]: ring of level l's keys (l = 0: the inputs), R slots
  T* window_values;      // [L][R][Dv]
  T* group_sums;         // [L][Dv]: partial sum of the open group feeding c^(l+1)
  T* compressed_keys;    // [capacity][Dk]: Wk_x c^(L)_j
  T* compressed_values;  // [capacity][Dv]: Wv_x c^(L)_j
};

/// Step workspace (4 Dv + 2 Dk values), not part of the saved state.
template <Real T>
struct ConvCompressedScratch {
  T* level_output;  // [Dv]: y^(l) of the token climbing the hierarchy
  T* compressed;    // [Dv]: c^(l)_j
  T* query;         // [Dk]
  T* key;           // [Dk]
  T* value;         // [Dv]
  T* cross;         // [Dv]
  T* cross_compensation;  // [2 Dv]: the cross read's low parts, and a block's sum (cpu)
};

/// One causal decode step at absolute position `position`: the token's window
/// attention, its cross read of the floor(position / M^L) visible compressed
/// tokens, then the token climbs the hierarchy: it is added to the open group
/// of each level, and a group it completes becomes a compressed token c^(l)_j
/// that is window-attended (l < L) and climbs on, or is stored (l = L).
/// `ring` is the slot count R of each level's window ring (>= window.left + 1
/// or the whole context); visible window at level l: min(index + 1, left + 1).
template <Real T>
void conv_compressed_step(const T* q, const T* k, const T* v, T* out, ConvCompressedCarry<T> carry,
                          const ConvCompressedWeights<T>& w, index_t h, T scale,
                          index_t window_left, index_t ring, std::int64_t position,
                          ConvCompressedScratch<T> scratch) noexcept {
  const index_t Dk = w.key_dim, Dv = w.value_dim, M = w.group_size, L = w.levels;
  auto window_visible = [&](std::int64_t index) {
    return static_cast<index_t>(window_left >= index ? index + 1 : window_left + 1);  // no overflow
  };
  auto ring_of = [&](index_t level) {  // level 0 holds the inputs, level l >= 1 c^(l)'s projections
    return KVSlots<T>{carry.window_keys + level * ring * Dk, carry.window_values + level * ring * Dv};
  };
  // Step 1: y^(0)_t over the window ring of the inputs.
  softmax_decode_step(q, k, v, scratch.level_output, ring_of(0), ring, Dk, Dv, scale, position,
                      window_visible(position));
  // Steps 3-4: o_t = y^(0)_t + cross read of c^(L)_j, j < floor(t / M^L).
  const index_t visible =
      static_cast<index_t>(position / tokens_per_compressed_token(M, L));
  matvec(w.cross_query_projection(h), scratch.level_output, scratch.query, Dk, Dv);
  softmax_row(
      scratch.query, Dk, Dv, scale, visible,
      [&](index_t j) { return carry.compressed_keys + j * Dk; },
      [&](index_t j) { return carry.compressed_values + j * Dv; }, scratch.cross,
      scratch.cross_compensation);  // compensated: the read spans the whole past
  for (index_t d = 0; d < Dv; ++d) out[d] = scratch.level_output[d] + scratch.cross[d];

  // Step 2 / approach 2: the token climbs while it closes groups.
  std::int64_t index = position;  // index of scratch.level_output in y^(level-1)
  for (index_t level = 1; level <= L; ++level) {
    const index_t tap = static_cast<index_t>(index % M);
    T* group_sum = carry.group_sums + (level - 1) * Dv;
    conv_tap(w.conv(level, h) + tap * Dv * Dv, scratch.level_output, group_sum, Dv, tap == 0);
    if (tap != M - 1) return;  // the group stays open
    index /= M;                // j: this group's compressed token c^(level)_j
    close_group(group_sum, w.bias(level, h), scratch.compressed, Dv);
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
    softmax_decode_step(scratch.query, scratch.key, scratch.value, scratch.level_output,
                        ring_of(level), ring, Dk, Dv, scale, index, window_visible(index));
  }
}


// ---------------------------------------------------------------------------
// Backward (docs/backward.md "Convolutional compression"). With G_t = dL/do_t,
// reverse through steps (4)-(1): the cross read is a softmax attention backward
// (queries Wq_x y^(0)_t, keys and values Wk_x c^(L)_j, Wv_x c^(L)_j); each
// projection z = W x gives dW += dz x^T and dx += W^T dz; each convolution
// c_j = b + sum_i W_i y_{jM+i} gives dW_i += dc_j y_{jM+i}^T, db += dc_j and
// dy_{jM+i} += W_i^T dc_j; each level's window attention is softmax_backward.
// y^(0) collects G_t (the residual), Wq_x^T dq_x and W^(1)^T dc^(1) before
// its own window backward gives dq, dk, dv. Weight gradients are summed in
// double, in the flat layout of ConvCompressedWeights. Continuing a state
// (ConvCompressedHeadStates), every level's window runs over its ring's rows
// ahead of the new tokens, the first new group starts from the open group's
// partial sum, the cross read sees the stored compressed tokens first, and the
// final state's gradient enters where its rows come from.
// ---------------------------------------------------------------------------

/// dW += dz x^T (double) and dx += W^T dz, for z = W x with W [rows, cols].
template <Real T>
void matvec_backward(const T* W, const T* x, const T* dz, index_t rows, index_t cols, T* dx,
                     double* dW) noexcept {
  for (index_t r = 0; r < rows; ++r) {
    if (dW)
      for (index_t c = 0; c < cols; ++c) dW[r * cols + c] += static_cast<double>(dz[r]) * x[c];
    for (index_t c = 0; c < cols; ++c) dx[c] += W[r * cols + c] * dz[r];
  }
}

/// The softmax read's backward for one query q over `count` keys (the
/// forward's softmax_row), given g = dL/d(read): adds to dq, dkey_at(j),
/// dvalue_at(j). `p` is count values of scratch.
template <Real T, class KeyAt, class ValueAt, class KeyGradientAt, class ValueGradientAt>
void softmax_row_backward(const T* q, const T* g, index_t Dk, index_t Dv, T scale, index_t count,
                          KeyAt&& key_at, ValueAt&& value_at, T* dq,
                          KeyGradientAt&& dkey_at, ValueGradientAt&& dvalue_at, T* p) noexcept {
  if (count == 0) return;  // the read is zero whatever q
  T m = -std::numeric_limits<T>::infinity();
  for (index_t j = 0; j < count; ++j) {
    T dot = 0;
    for (index_t d = 0; d < Dk; ++d) dot += q[d] * key_at(j)[d];
    p[j] = scale * dot;
    m = std::isnan(p[j]) ? p[j] : std::max(m, p[j]);
  }
  T l = 0;
  for (index_t j = 0; j < count; ++j) l += (p[j] = std::exp(p[j] - m));
  T row_dot = 0;  // <g, read> = sum_j p_j <g, v_j>
  for (index_t j = 0; j < count; ++j) {
    p[j] /= l;
    T gv = 0;
    for (index_t d = 0; d < Dv; ++d) gv += g[d] * value_at(j)[d];
    row_dot += p[j] * gv;
  }
  for (index_t j = 0; j < count; ++j) {
    const T* value = value_at(j);
    T gv = 0;
    for (index_t d = 0; d < Dv; ++d) gv += g[d] * value[d];
    const T ds = p[j] * (gv - row_dot);
    const T* key = key_at(j);
    T* dkey = dkey_at(j);
    T* dvalue = dvalue_at(j);
    for (index_t d = 0; d < Dk; ++d) {
      dq[d] += scale * ds * key[d];
      dkey[d] += scale * ds * q[d];
    }
    for (index_t d = 0; d < Dv; ++d) dvalue[d] += p[j] * g[d];
  }
}

/// Where a causal sequence of `tokens` tokens after `position` sits at each
/// level: before[l] = floor(P / M^l) tokens of level l precede it (level 0:
/// the inputs, l >= 1: c^(l)), lengths[l] = floor((P + T) / M^l) - before[l]
/// of them are new. A whole sequence (P = 0): before = 0, lengths[l] =
/// floor(T / M^l). Repeated division: no M^l is formed, nothing overflows.
struct ConvLevelGeometry {
  std::vector<std::int64_t> before;  // [L + 1]
  std::vector<index_t> lengths;      // [L + 1]

  ConvLevelGeometry(std::int64_t position, index_t tokens, index_t group_size, index_t levels) {
    std::int64_t start = position, end = position + tokens;
    for (index_t level = 0; level <= levels; ++level) {
      before.push_back(start);
      lengths.push_back(static_cast<index_t>(end - start));
      start /= group_size;
      end /= group_size;
    }
  }
  /// Taps of level l's first new group that the open group's partial sum
  /// (ConvCompressedCarry::group_sums) already holds: before[l - 1] mod M.
  [[nodiscard]] index_t taps_before(index_t level, index_t group_size) const noexcept {
    return static_cast<index_t>(before[static_cast<std::size_t>(level - 1)] % group_size);
  }
  /// Taps in level l's open group once the sequence is absorbed (0: no open group).
  [[nodiscard]] index_t taps_after(index_t level, index_t group_size) const noexcept {
    const auto at = static_cast<std::size_t>(level - 1);
    return static_cast<index_t>((before[at] + lengths[at]) % group_size);
  }
};

/// What a causal backward continues from and gives back of one (batch,
/// head)'s state (docs/backward.md "Convolutional compression"): the tokens
/// the initial state absorbed (P), its ring slot count R (token j of a level
/// in slot j mod R), the initial carry (read: rings, open groups' sums,
/// compressed store), the final state's gradient (null pointers: zero) and
/// the initial state's gradient (added into; the caller zeroed it; null
/// pointers: not asked). Default: a whole sequence from position 0.
template <Real T>
struct ConvCompressedHeadStates {
  std::int64_t position = 0;
  index_t ring = 1;
  ConvCompressedCarry<const T> initial{};
  ConvCompressedCarry<const T> d_final{};
  ConvCompressedCarry<T> d_initial{};
};

/// Rows of a level's window attention when a ring comes first: `pre` ring
/// tokens (before - pre .. before - 1, each in slot j mod R of `keys` /
/// `values`) take rows 0..pre-1, with a zero query (they take no query and no
/// d_out; only their keys and values matter).
template <Real T, class QRow, class KRow, class VRow>
void ring_rows_first(const T* keys, const T* values, index_t R, std::int64_t before, index_t pre,
                     index_t Dk, index_t Dv, QRow&& q_row, KRow&& k_row, VRow&& v_row) {
  for (index_t j = 0; j < pre; ++j) {
    const auto slot = static_cast<index_t>((before - pre + j) % R);
    std::fill_n(q_row(j), Dk, T(0));
    std::copy_n(keys + slot * Dk, Dk, k_row(j));
    std::copy_n(values + slot * Dv, Dv, v_row(j));
  }
}

/// A level's ring in the backward: the final ring's gradient (its last
/// min(R, before + new) tokens) added to their keys' and values' gradient rows
/// (row = token - (before - pre)), then the `pre` ring rows' gradients added
/// into the initial ring's gradient. Null pointers: not given / not asked.
template <class T, class DKRow, class DVRow>
void ring_gradients(const T* d_final_keys, const T* d_final_values, T* d_initial_keys,
                    T* d_initial_values, index_t R, std::int64_t before, index_t pre,
                    index_t fresh, index_t Dk, index_t Dv, DKRow&& dk_row, DVRow&& dv_row) {
  const std::int64_t first = before - pre, end = before + fresh;
  if (d_final_keys != nullptr)
    for (std::int64_t token = end - std::min<std::int64_t>(R, end); token < end; ++token) {
      const auto slot = static_cast<index_t>(token % R), row = static_cast<index_t>(token - first);
      T* dk = dk_row(row);
      T* dv = dv_row(row);
      for (index_t d = 0; d < Dk; ++d) dk[d] += d_final_keys[slot * Dk + d];
      for (index_t d = 0; d < Dv; ++d) dv[d] += d_final_values[slot * Dv + d];
    }
  if (d_initial_keys != nullptr)
    for (index_t j = 0; j < pre; ++j) {
      const auto slot = static_cast<index_t>((first + j) % R);
      const T* dk = dk_row(j);
      const T* dv = dv_row(j);
      for (index_t d = 0; d < Dk; ++d) d_initial_keys[slot * Dk + d] += dk[d];
      for (index_t d = 0; d < Dv; ++d) d_initial_values[slot * Dv + d] += dv[d];
    }
}

/// The forward's activations of one (batch, head) above level 0, kept for its
/// backward (O(T / M (Dk + Dv)) values): the new c^(l) for l = 1..L and, for
/// l < L, the level's window attention over its ring rows then its new tokens
/// (queries, keys, values, outputs: prefix[l - 1] + lengths[l] rows).
template <Real T>
struct ConvCompressedLevels {
  std::vector<std::vector<T>> compressed;                      // [L]: new c^(l), lengths[l] x Dv
  std::vector<std::vector<T>> queries, keys, values, outputs;  // [L - 1]
  std::vector<index_t> prefix;                                 // [L - 1]: ring rows first
  std::vector<index_t> lengths;                                // [L + 1]: new tokens per level
};

/// Recomputes the levels above y^(0) (rows `y0_row(s)` of the sequence's T
/// tokens) for head h, continuing `states` (a whole sequence by default).
template <bool Causal, Real T, class Y0Row>
void conv_compressed_levels(Y0Row&& y0_row, index_t Tn, index_t h,
                            const ConvCompressedWeights<T>& w, T scale,
                            const SlidingWindow& window, ConvCompressedLevels<T>& levels,
                            const ConvCompressedHeadStates<T>& states = {}) {
  const index_t Dk = w.key_dim, Dv = w.value_dim, M = w.group_size, L = w.levels;
  const ConvLevelGeometry geometry(states.position, Tn, M, L);
  levels.compressed.resize(static_cast<std::size_t>(L));
  levels.queries.resize(static_cast<std::size_t>(L - 1));
  levels.keys.resize(static_cast<std::size_t>(L - 1));
  levels.values.resize(static_cast<std::size_t>(L - 1));
  levels.outputs.resize(static_cast<std::size_t>(L - 1));
  levels.prefix.assign(static_cast<std::size_t>(L - 1), 0);
  levels.lengths = geometry.lengths;
  auto as_sequence = [](std::vector<T>& data, index_t n, index_t D) {
    return TensorView<T, 4>(data.data(), {1, n, 1, D});
  };
  for (index_t level = 1; level <= L; ++level) {
    const index_t n = levels.lengths[static_cast<std::size_t>(level)];
    const index_t r = geometry.taps_before(level, M);  // taps summed before the sequence
    std::vector<T>& c = levels.compressed[static_cast<std::size_t>(level - 1)];
    c.assign(static_cast<std::size_t>(n * Dv), T(0));
    auto source_row = [&](index_t s) -> const T* {  // new row s of y^(level - 1)
      if (level == 1) return y0_row(s);
      const auto below = static_cast<std::size_t>(level - 2);
      return levels.outputs[below].data() + (levels.prefix[below] + s) * Dv;
    };
    for (index_t j = 0; j < n; ++j) {
      T* cj = c.data() + j * Dv;
      if (j == 0 && r > 0) std::copy_n(states.initial.group_sums + (level - 1) * Dv, Dv, cj);
      for (index_t i = 0; i < M; ++i)
        if (j * M + i >= r)  // tap i of group j is new row jM + i - r
          conv_tap(w.conv(level, h) + i * Dv * Dv, source_row(j * M + i - r), cj, Dv, false);
      close_group(cj, w.bias(level, h), cj, Dv);
    }
    if (level == L) break;
    const auto at = static_cast<std::size_t>(level - 1);
    const std::int64_t before = geometry.before[static_cast<std::size_t>(level)];
    const index_t pre = static_cast<index_t>(std::min<std::int64_t>(states.ring, before));
    const index_t rows = pre + n;
    levels.prefix[at] = pre;
    levels.queries[at].resize(static_cast<std::size_t>(rows * Dk));
    levels.keys[at].resize(static_cast<std::size_t>(rows * Dk));
    levels.values[at].resize(static_cast<std::size_t>(rows * Dv));
    levels.outputs[at].resize(static_cast<std::size_t>(rows * Dv));
    if (pre > 0)
      ring_rows_first(states.initial.window_keys + level * states.ring * Dk,
                      states.initial.window_values + level * states.ring * Dv, states.ring,
                      before, pre, Dk, Dv, [&](index_t j) { return levels.queries[at].data() + j * Dk; },
                      [&](index_t j) { return levels.keys[at].data() + j * Dk; },
                      [&](index_t j) { return levels.values[at].data() + j * Dv; });
    for (index_t j = 0; j < n; ++j) {
      const T* cj = c.data() + j * Dv;
      matvec(w.query_projection(level, h), cj, levels.queries[at].data() + (pre + j) * Dk, Dk, Dv);
      matvec(w.key_projection(level, h), cj, levels.keys[at].data() + (pre + j) * Dk, Dk, Dv);
      matvec(w.value_projection(level, h), cj, levels.values[at].data() + (pre + j) * Dv, Dv, Dv);
    }
    if (rows > 0)
      softmax_forward<Causal>(TensorView<const T, 4>(as_sequence(levels.queries[at], rows, Dk)),
                              TensorView<const T, 4>(as_sequence(levels.keys[at], rows, Dk)),
                              TensorView<const T, 4>(as_sequence(levels.values[at], rows, Dv)),
                              as_sequence(levels.outputs[at], rows, Dv), scale, window);
  }
}

/// Offsets of one head's weights in the flat layout of ConvCompressedWeights,
/// for the gradients (double, same layout).
struct ConvCompressedGradientLayout {
  index_t heads, key_dim, value_dim, group_size, levels;
  [[nodiscard]] index_t conv(index_t level, index_t h) const noexcept {
    return ((level - 1) * heads + h) * group_size * value_dim * value_dim;
  }
  [[nodiscard]] index_t bias(index_t level, index_t h) const noexcept {
    return ((level - 1) * heads + h) * value_dim;
  }
  [[nodiscard]] index_t query(index_t level, index_t h) const noexcept {
    return ((level - 1) * heads + h) * key_dim * value_dim;
  }
  [[nodiscard]] index_t value(index_t level, index_t h) const noexcept {
    return ((level - 1) * heads + h) * value_dim * value_dim;
  }
};

/// ConvCompressedWeights' layout in double: the weights' gradients.
using ConvCompressedWeightGradients = ConvCompressedWeights<double>;

/// The gradient `dg` of level l's open group sum once the sequence is
/// absorbed (the final state's group_sums row): its `taps` newest taps are
/// rows n_below - taps + i of y^(l-1) when those are new, else (a group begun
/// before the sequence) the initial group sum's, which gets dg whole.
/// `tap_backward(i, s, dg)` runs tap i's backward on new row s.
template <class T, class TapBackward>
void open_group_backward(const T* dg, index_t taps, index_t n_below, index_t Dv, T* d_initial_sum,
                         TapBackward&& tap_backward) {
  for (index_t i = 0; i < taps; ++i)
    if (n_below - taps + i >= 0) tap_backward(i, n_below - taps + i, dg);
  if (n_below - taps < 0 && d_initial_sum != nullptr)
    for (index_t d = 0; d < Dv; ++d) d_initial_sum[d] += dg[d];
}

/// The backward above level 0 for one (batch, head): given the recomputed
/// `levels`, y^(0) rows and G rows, adds the cross read's and the levels'
/// contributions to dy0 rows (which must hold G_t on entry: the residual) and
/// to `dw` (null: weights' gradients not wanted); with `states`, also the
/// final state's gradient (rings above level 0, open groups, compressed
/// store) and the initial state's (the same fields) as ConvCompressedHeadStates says.
template <bool Causal, Real T, class Y0Row, class GRow, class DY0Row>
void conv_compressed_levels_backward(Y0Row&& y0_row, GRow&& g_row, DY0Row&& dy0_row, index_t Tn,
                                     index_t h, const ConvCompressedWeights<T>& w, T scale,
                                     const SlidingWindow& window,
                                     const ConvCompressedLevels<T>& levels,
                                     ConvCompressedWeightGradients* dw,
                                     const ConvCompressedHeadStates<T>& states = {}) {
  const index_t Dk = w.key_dim, Dv = w.value_dim, M = w.group_size, L = w.levels;
  const ConvLevelGeometry geometry(states.position, Tn, M, L);
  const index_t n_top = levels.lengths[static_cast<std::size_t>(L)];
  const auto stored = static_cast<index_t>(geometry.before[static_cast<std::size_t>(L)]);
  const index_t total = stored + n_top;  // compressed tokens once the sequence is absorbed
  const std::vector<T>& top = levels.compressed[static_cast<std::size_t>(L - 1)];
  using Field = std::vector<double> ConvCompressedWeightGradients::*;
  auto flat = [&](Field field, index_t offset) -> double* {
    return dw ? (dw->*field).data() + offset : nullptr;
  };
  // Steps 3-4: the cross read over the stored then the new top-level tokens.
  std::vector<T> cross_k(static_cast<std::size_t>(total * Dk)), cross_v(static_cast<std::size_t>(total * Dv));
  std::vector<T> d_cross_k(cross_k.size(), T(0)), d_cross_v(cross_v.size(), T(0));
  if (stored > 0) {
    std::copy_n(states.initial.compressed_keys, stored * Dk, cross_k.data());
    std::copy_n(states.initial.compressed_values, stored * Dv, cross_v.data());
  }
  for (index_t j = 0; j < n_top; ++j) {
    matvec(w.cross_key_projection(h), top.data() + j * Dv, cross_k.data() + (stored + j) * Dk, Dk, Dv);
    matvec(w.cross_value_projection(h), top.data() + j * Dv, cross_v.data() + (stored + j) * Dv, Dv, Dv);
  }
  const std::int64_t span = tokens_per_compressed_token(M, L);
  std::vector<T> query(static_cast<std::size_t>(Dk)), d_query(query.size()),
      p(static_cast<std::size_t>(std::max<index_t>(total, 1)));
  const index_t projection_offset = h * Dk * Dv, value_offset = h * Dv * Dv;
  for (index_t t = 0; t < Tn; ++t) {
    const index_t visible =
        Causal ? static_cast<index_t>(std::min<std::int64_t>((states.position + t) / span, total))
               : total;
    if (visible == 0) continue;
    const T* y = y0_row(t);
    matvec(w.cross_query_projection(h), y, query.data(), Dk, Dv);
    std::fill(d_query.begin(), d_query.end(), T(0));
    softmax_row_backward(
        query.data(), g_row(t), Dk, Dv, scale, visible,
        [&](index_t j) { return cross_k.data() + j * Dk; },
        [&](index_t j) { return cross_v.data() + j * Dv; }, d_query.data(),
        [&](index_t j) { return d_cross_k.data() + j * Dk; },
        [&](index_t j) { return d_cross_v.data() + j * Dv; }, p.data());
    matvec_backward(w.cross_query_projection(h), y, d_query.data(), Dk, Dv, dy0_row(t),
                    flat(&ConvCompressedWeightGradients::cross_query, projection_offset));
  }
  // The compressed store: the final state's gradient, the stored tokens' to the initial state's.
  if (states.d_final.compressed_keys != nullptr)
    for (index_t i = 0; i < total * Dk; ++i) d_cross_k[static_cast<std::size_t>(i)] += states.d_final.compressed_keys[i];
  if (states.d_final.compressed_values != nullptr)
    for (index_t i = 0; i < total * Dv; ++i) d_cross_v[static_cast<std::size_t>(i)] += states.d_final.compressed_values[i];
  if (states.d_initial.compressed_keys != nullptr) {
    for (index_t i = 0; i < stored * Dk; ++i) states.d_initial.compressed_keys[i] += d_cross_k[static_cast<std::size_t>(i)];
    for (index_t i = 0; i < stored * Dv; ++i) states.d_initial.compressed_values[i] += d_cross_v[static_cast<std::size_t>(i)];
  }
  // The new top-level compressed tokens, through the cross keys and values.
  std::vector<T> dc(static_cast<std::size_t>(n_top * Dv), T(0));
  for (index_t j = 0; j < n_top; ++j) {
    matvec_backward(w.cross_key_projection(h), top.data() + j * Dv, d_cross_k.data() + (stored + j) * Dk, Dk,
                    Dv, dc.data() + j * Dv, flat(&ConvCompressedWeightGradients::cross_key, projection_offset));
    matvec_backward(w.cross_value_projection(h), top.data() + j * Dv, d_cross_v.data() + (stored + j) * Dv,
                    Dv, Dv, dc.data() + j * Dv, flat(&ConvCompressedWeightGradients::cross_value, value_offset));
  }
  const ConvCompressedGradientLayout layout{w.heads, Dk, Dv, M, L};
  auto as_sequence = [](auto& data, index_t n, index_t D) {
    return TensorView<std::remove_reference_t<decltype(*data.data())>, 4>(data.data(), {1, n, 1, D});
  };
  // Down the levels: dc^(level) -> d y^(level - 1) (-> dc^(level - 1) through level - 1's window).
  std::vector<T> dy, dq_l, dk_l, dv_l;
  for (index_t level = L; level >= 1; --level) {
    const index_t n = levels.lengths[static_cast<std::size_t>(level)];
    const index_t n_below = levels.lengths[static_cast<std::size_t>(level - 1)];
    const index_t r = geometry.taps_before(level, M);
    const auto below = static_cast<std::size_t>(level - 2);  // level - 1's activations (level > 1)
    const index_t pre = level > 1 ? levels.prefix[below] : 0;
    if (level > 1) dy.assign(static_cast<std::size_t>((pre + n_below) * Dv), T(0));
    auto source_row = [&](index_t s) -> const T* {
      return level == 1 ? y0_row(s) : levels.outputs[below].data() + (pre + s) * Dv;
    };
    auto d_source_row = [&](index_t s) -> T* { return level == 1 ? dy0_row(s) : dy.data() + (pre + s) * Dv; };
    auto tap_backward = [&](index_t i, index_t s, const T* dcj) {
      matvec_backward(w.conv(level, h) + i * Dv * Dv, source_row(s), dcj, Dv, Dv, d_source_row(s),
                      flat(&ConvCompressedWeightGradients::conv_weight, layout.conv(level, h) + i * Dv * Dv));
    };
    T* d_initial_sum =
        states.d_initial.group_sums != nullptr ? states.d_initial.group_sums + (level - 1) * Dv : nullptr;
    for (index_t j = 0; j < n; ++j) {
      const T* dcj = dc.data() + j * Dv;
      if (dw)
        for (index_t o = 0; o < Dv; ++o) dw->conv_bias[static_cast<std::size_t>(layout.bias(level, h) + o)] += dcj[o];
      for (index_t i = 0; i < M; ++i)
        if (j * M + i >= r) tap_backward(i, j * M + i - r, dcj);
      if (j == 0 && r > 0 && d_initial_sum != nullptr)  // the initial open group closed here
        for (index_t o = 0; o < Dv; ++o) d_initial_sum[o] += dcj[o];
    }
    if (states.d_final.group_sums != nullptr)
      open_group_backward(states.d_final.group_sums + (level - 1) * Dv, geometry.taps_after(level, M),
                          n_below, Dv, d_initial_sum, tap_backward);
    if (level == 1) break;
    // y^(level - 1) = window attention over level - 1's ring rows then its new tokens.
    const index_t rows = pre + n_below;
    dq_l.assign(static_cast<std::size_t>(rows * Dk), T(0));
    dk_l.assign(dq_l.size(), T(0));
    dv_l.assign(static_cast<std::size_t>(rows * Dv), T(0));
    if (rows > 0)
      softmax_backward<Causal>(
          TensorView<const T, 4>(as_sequence(levels.queries[below], rows, Dk)),
          TensorView<const T, 4>(as_sequence(levels.keys[below], rows, Dk)),
          TensorView<const T, 4>(as_sequence(levels.values[below], rows, Dv)),
          TensorView<const T, 4>(as_sequence(dy, rows, Dv)), as_sequence(dq_l, rows, Dk),
          as_sequence(dk_l, rows, Dk), as_sequence(dv_l, rows, Dv), scale, window);
    const index_t R = states.ring, ring_level = level - 1;
    auto ring_of = [&](auto* keys, auto* values) {
      return std::pair(keys ? keys + ring_level * R * Dk : nullptr, values ? values + ring_level * R * Dv : nullptr);
    };
    const auto [final_keys, final_values] = ring_of(states.d_final.window_keys, states.d_final.window_values);
    const auto [initial_keys, initial_values] = ring_of(states.d_initial.window_keys, states.d_initial.window_values);
    ring_gradients(final_keys, final_values, initial_keys, initial_values, R,
                   geometry.before[static_cast<std::size_t>(level - 1)], pre, n_below, Dk, Dv,
                   [&](index_t row) { return dk_l.data() + row * Dk; },
                   [&](index_t row) { return dv_l.data() + row * Dv; });
    const std::vector<T>& c = levels.compressed[below];
    dc.assign(static_cast<std::size_t>(n_below * Dv), T(0));
    for (index_t j = 0; j < n_below; ++j) {
      const T* cj = c.data() + j * Dv;
      matvec_backward(w.query_projection(level - 1, h), cj, dq_l.data() + (pre + j) * Dk, Dk, Dv,
                      dc.data() + j * Dv, flat(&ConvCompressedWeightGradients::level_query, layout.query(level - 1, h)));
      matvec_backward(w.key_projection(level - 1, h), cj, dk_l.data() + (pre + j) * Dk, Dk, Dv,
                      dc.data() + j * Dv, flat(&ConvCompressedWeightGradients::level_key, layout.query(level - 1, h)));
      matvec_backward(w.value_projection(level - 1, h), cj, dv_l.data() + (pre + j) * Dv, Dv, Dv,
                      dc.data() + j * Dv, flat(&ConvCompressedWeightGradients::level_value, layout.value(level - 1, h)));
    }
  }
}

/// The reference backend's parts of the backward: the level-0 window
/// attention's forward and backward, a loop over heads, and each head's levels
/// above y^(0) with their backward. window_forward returns what it keeps for
/// window_backward (which is also given the forward's output): here nothing,
/// the definition's backward recomputes what it needs. window_backward may be
/// given that output in its own dq (conv_compressed_backward does so): it must
/// have read it before it writes dq.
struct ReferenceConvCompressedParts {
  struct NothingKept {};
  template <bool Causal, Real T>
  static NothingKept window_forward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                                    TensorView<const T, 4> v, TensorView<T, 4> out, T scale,
                                    const SlidingWindow& window) {
    softmax_forward<Causal>(q, k, v, out, scale, window);
    return {};
  }
  template <bool Causal, Real T>
  static void window_backward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                              TensorView<const T, 4> v, TensorView<const T, 4> d_out,
                              TensorView<T, 4> dq, TensorView<T, 4> dk, TensorView<T, 4> dv,
                              T scale, const SlidingWindow& window, NothingKept,
                              TensorView<const T, 4> /*forward's output*/) {
    softmax_backward<Causal>(q, k, v, d_out, dq, dk, dv, scale, window);
  }
  template <class Body>
  static void for_heads(index_t heads, Body&& body) {
    for (index_t h = 0; h < heads; ++h) body(h);
  }
  /// One (batch, head)'s levels above y^(0) and their backward (rows with strides).
  template <bool Causal, Real T>
  static void head_backward(const T* y0, index_t y0_stride, const T* g, index_t g_stride, T* dy0,
                            index_t dy0_stride, index_t Tn, index_t h,
                            const ConvCompressedWeights<T>& w, T scale, const SlidingWindow& window,
                            ConvCompressedLevels<T>& levels, ConvCompressedWeightGradients* dw,
                            const ConvCompressedHeadStates<T>& states) {
    auto y0_row = [&](index_t t) -> const T* { return y0 + t * y0_stride; };
    conv_compressed_levels<Causal>(y0_row, Tn, h, w, scale, window, levels, states);
    conv_compressed_levels_backward<Causal>(
        y0_row, [&](index_t t) { return g + t * g_stride; },
        [&](index_t t) { return dy0 + t * dy0_stride; }, Tn, h, w, scale, window, levels, dw,
        states);
  }
};

/// A whole sequence from position 0: no state read or given back.
struct FreshConvCompressedStates {
  static constexpr std::int64_t position = 0;
  static constexpr index_t ring = 1;
  template <Real T>
  [[nodiscard]] ConvCompressedHeadStates<T> of(index_t, index_t) const noexcept { return {}; }
};

/// The backward: writes dq, dk, dv and accumulates the weights' gradients into
/// `dw` (null: not wanted). `Parts` runs level 0's window attention (the
/// T-sized part) and the loop over heads; the levels above and the cross read
/// run in Parts::head_backward. `states` (causal only) gives P, R and each
/// head's ConvCompressedHeadStates (`states.template of<T>(b, h)`): level 0's
/// window then runs over the initial ring's last min(R, P) tokens and the
/// sequence (those rows take no query), its ring's gradients are added here,
/// the rest in head_backward. `Parts::window_forward` returns what its
/// backward may reuse (the cpu's row statistics; the reference's nothing).
/// Workspace: y^(0) (in dq when Dk = Dv and no ring comes first) and its
/// gradient, B T H Dv each, head-major (the cpu keeps 3 B T H row statistics more)
/// (with a ring: copies of q, k, v, their gradients, over min(R, P) + T rows)
/// and, per head in flight, the levels above, O(T / M (Dk + Dv)).
template <bool Causal, class Parts, Real T, class States = FreshConvCompressedStates>
void conv_compressed_backward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                              TensorView<const T, 4> v, TensorView<const T, 4> d_out,
                              TensorView<T, 4> dq, TensorView<T, 4> dk, TensorView<T, 4> dv,
                              const ConvCompressedWeights<T>& w, T scale,
                              const SlidingWindow& window, ConvCompressedWeightGradients* dw,
                              const States& states = {}) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), Dk = w.key_dim, Dv = w.value_dim;
  if (B == 0 || Tn == 0) return;
  const std::int64_t P = states.position;
  const index_t R = states.ring, pre = static_cast<index_t>(std::min<std::int64_t>(R, P));
  const index_t rows = pre + Tn;  // level 0's window: the ring's tokens, then the sequence
  auto size = [](index_t n) { return static_cast<std::size_t>(n); };
  // Written whole before they are read (y^(0) by the window's forward, its
  // gradient head by head below): not zeroed. Head-major ([B, H, rows, Dv]):
  // a head's rows are contiguous, so the levels' GEMMs over them (the
  // convolution's taps, M rows apart) read dense blocks rather than rows
  // H * Dv apart. y^(0) lives in dq when it fits there (no ring rows ahead,
  // Dk = Dv): the heads read it before the window's backward, and that reads
  // it before it writes dq (Parts::window_backward's contract). Fresh memory
  // is what a call pays for most on a machine whose pages fault slowly.
  const bool y0_in_dq = pre == 0 && Dk == Dv;
  UninitializedBuffer<T> y0_data(y0_in_dq ? 0 : size(B * rows * H * Dv)), dy0_data(size(B * rows * H * Dv));
  const std::array<index_t, 4> head_major{H * rows * Dv, Dv, rows * Dv, 1};
  const TensorView<T, 4> y0 = y0_in_dq ? dq : TensorView<T, 4>(y0_data.data(), {B, rows, H, Dv}, head_major);
  const TensorView<T, 4> dy0(dy0_data.data(), {B, rows, H, Dv}, head_major);
  // With a ring ahead: copies of q, k, v and their gradients over `rows` rows.
  std::vector<T> copies(pre > 0 ? size(4 * B * rows * H * Dk + 2 * B * rows * H * Dv) : 0);
  auto dense = [&](std::size_t offset, index_t D) { return TensorView<T, 4>(copies.data() + offset, {B, rows, H, D}); };
  const std::size_t key_rows = size(B * rows * H * Dk), value_rows = size(B * rows * H * Dv);
  const TensorView<T, 4> Xq = pre > 0 ? dense(0, Dk) : TensorView<T, 4>{};
  const TensorView<T, 4> Xk = pre > 0 ? dense(key_rows, Dk) : TensorView<T, 4>{};
  const TensorView<T, 4> Xv = pre > 0 ? dense(2 * key_rows, Dv) : TensorView<T, 4>{};
  const TensorView<T, 4> dXq = pre > 0 ? dense(2 * key_rows + value_rows, Dk) : dq;
  const TensorView<T, 4> dXk = pre > 0 ? dense(3 * key_rows + value_rows, Dk) : dk;
  const TensorView<T, 4> dXv = pre > 0 ? dense(4 * key_rows + value_rows, Dv) : dv;
  if (pre > 0)
    for (index_t b = 0; b < B; ++b)
      for (index_t h = 0; h < H; ++h) {
        const ConvCompressedHeadStates<T> head = states.template of<T>(b, h);
        ring_rows_first(head.initial.window_keys, head.initial.window_values, R, P, pre, Dk, Dv,
                        [&](index_t j) { return Xq.row(b, j, h); }, [&](index_t j) { return Xk.row(b, j, h); },
                        [&](index_t j) { return Xv.row(b, j, h); });
        for (index_t t = 0; t < Tn; ++t) {
          std::copy_n(q.row(b, t, h), Dk, Xq.row(b, pre + t, h));
          std::copy_n(k.row(b, t, h), Dk, Xk.row(b, pre + t, h));
          std::copy_n(v.row(b, t, h), Dv, Xv.row(b, pre + t, h));
        }
      }
  const TensorView<const T, 4> window_q = pre > 0 ? TensorView<const T, 4>(Xq) : q;
  const TensorView<const T, 4> window_k = pre > 0 ? TensorView<const T, 4>(Xk) : k;
  const TensorView<const T, 4> window_v = pre > 0 ? TensorView<const T, 4>(Xv) : v;
  auto kept = Parts::template window_forward<Causal>(window_q, window_k, window_v, y0, scale, window);
  // One task per head (each writes only its head's weight and state gradients).
  Parts::for_heads(H, [&](index_t h) {
    ConvCompressedLevels<T> levels;
    for (index_t b = 0; b < B; ++b) {
      for (index_t j = 0; j < pre; ++j) std::fill_n(dy0.row(b, j, h), Dv, T(0));
      for (index_t t = 0; t < Tn; ++t) std::copy_n(d_out.row(b, t, h), Dv, dy0.row(b, pre + t, h));
      Parts::template head_backward<Causal>(y0.row(b, pre, h), y0.stride(1), d_out.row(b, 0, h),
                                            d_out.stride(1), dy0.row(b, pre, h), dy0.stride(1), Tn,
                                            h, w, scale, window, levels, dw,
                                            states.template of<T>(b, h));
    }
  });
  Parts::template window_backward<Causal>(window_q, window_k, window_v,
                                          TensorView<const T, 4>(dy0), dXq, dXk, dXv, scale,
                                          window, std::move(kept), TensorView<const T, 4>(y0));
  if constexpr (Causal) {  // level 0's ring: the final one's gradient in, the initial one's out
    for (index_t b = 0; b < B; ++b)
      for (index_t h = 0; h < H; ++h) {
        const ConvCompressedHeadStates<T> head = states.template of<T>(b, h);
        ring_gradients(head.d_final.window_keys, head.d_final.window_values,
                       head.d_initial.window_keys, head.d_initial.window_values, R, P, pre, Tn, Dk,
                       Dv, [&](index_t row) { return dXk.row(b, row, h); },
                       [&](index_t row) { return dXv.row(b, row, h); });
      }
  }
  if (pre > 0)
    for (index_t b = 0; b < B; ++b)
      for (index_t t = 0; t < Tn; ++t)
        for (index_t h = 0; h < H; ++h) {
          std::copy_n(dXq.row(b, pre + t, h), Dk, dq.row(b, t, h));
          std::copy_n(dXk.row(b, pre + t, h), Dk, dk.row(b, t, h));
          std::copy_n(dXv.row(b, pre + t, h), Dv, dv.row(b, t, h));
        }
}

}  // namespace latte::reference
