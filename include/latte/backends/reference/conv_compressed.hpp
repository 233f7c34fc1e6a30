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
#include <cstdint>
#include <limits>
#include <vector>

#include "latte/backends/reference/softmax.hpp"
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
  std::vector<T> query(static_cast<std::size_t>(Dk)), cross(static_cast<std::size_t>(Dv));
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
            [&](index_t j) { return cross_v.data() + j * Dv; }, cross.data());
        for (index_t d = 0; d < Dv; ++d) y[d] += cross[d];
      }
    }
}

/// The decode carry of one (batch, head).
template <Real T>
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
      [&](index_t j) { return carry.compressed_values + j * Dv; }, scratch.cross);
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

}  // namespace latte::reference
