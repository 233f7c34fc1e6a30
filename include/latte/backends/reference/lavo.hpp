#pragma once
// Reference backend for LAVO (paper 002): scalar loops that read like the paper.
//
// Symbols follow paper 002: B = [b_1 .. b_r]^T in R^{r x d} (orthonormal bases),
// f_s (a compressed feature), H = (1/n) sum_s B f_s in R^r (eq. 3),
// X~ = B (.) H (row i is H_i b_i, eq. 3), the read softmax(q X~^T) X~ (eqs. 3, 6),
// w (window), P in R^{2w-1} (embedded relative position bias, §3.3).
// With context dissection (§3.2) the features compressed are the local outputs
// F_local of the tokens of the complete earlier windows, and o_t = (F_local +
// F_global) / 2. The kernels receive validated views and allocate at most
// O(w * d + r) workspace per call.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"

namespace latte::reference {

/// One head's LAVO weights in the compute type T.
template <Real T>
struct LavoHead {
  const T* basis;          ///< B [r x d]; row i is b_i
  const T* relative_bias;  ///< P [2w - 1]; P[(s - t) + w - 1] is added to the score of key s for query t
  index_t dim;             ///< d
  index_t bases;           ///< r
  index_t window;          ///< w
  T scale;                 ///< multiplies q . k (local part) and X~ q (memory read)
  bool local_only_without_memory;  ///< o_t = F_local while the memory is empty (else F_local / 2)
};

/// The recurrent carry of causal LAVO for one (batch, head).
template <Real T>
struct LavoCarry {
  T* keys;                 ///< ring [capacity x d]: k_s sits in slot s % capacity
  T* values;               ///< ring [capacity x d]
  index_t capacity;        ///< >= min(w, tokens that will pass through)
  T* window_sum;           ///< [r]: sum of B f_s over the current, incomplete window
  T* memory_sum;           ///< [r]: sum of B f_s over all complete windows (compensated)
  T* memory_compensation;  ///< [r]: Neumaier compensation of memory_sum
};

/// Neumaier's compensated summation: (sum + compensation) carries the exact
/// running total to about twice the working precision, so the mean H of a
/// context of 10^5+ tokens keeps its accuracy in fp32.
template <Real T>
inline void compensated_add(T& sum, T& compensation, T term) noexcept {
  const T total = sum + term;
  if (std::fabs(sum) >= std::fabs(term)) compensation += (sum - total) + term;
  else compensation += (term - total) + sum;
  sum = total;
}

/// sum_j a[j] * b[j].
template <Real T>
[[nodiscard]] inline T dot(const T* a, const T* b, index_t count) noexcept {
  T total = 0;
  for (index_t j = 0; j < count; ++j) total += a[j] * b[j];
  return total;
}

/// The local part F_local (paper 002 §3.2, with the embedded bias of §3.3):
///   out = sum_j softmax_j(scale q . key(j) + bias(j)) value(j),  j in [0, count),
/// by the online-softmax recurrence. A row whose scores are all -inf reads zero.
template <Real T, class KeyAt, class ValueAt, class BiasAt>
void lavo_local_row(const T* q, index_t d, T scale, index_t count, KeyAt&& key_at,
                    ValueAt&& value_at, BiasAt&& bias_at, T* out) noexcept {
  std::fill(out, out + d, T(0));
  T m = -std::numeric_limits<T>::infinity();
  T l = 0;
  for (index_t j = 0; j < count; ++j) {
    const T score = scale * dot(q, key_at(j), d) + bias_at(j);  // A_{t,s} + P_{s-t+w-1}
    // std::max(m, NaN) is m: carry a NaN score instead of skipping it (NaN policy).
    const T m_new = std::isnan(score) ? score : std::max(m, score);
    if (m_new == -std::numeric_limits<T>::infinity()) continue;
    const T carry_scale = std::exp(m - m_new), weight = std::exp(score - m_new);
    l = l * carry_scale + weight;
    const T* value = value_at(j);
    for (index_t e = 0; e < d; ++e) out[e] = out[e] * carry_scale + weight * value[e];
    m = m_new;
  }
  if (l > T(0))
    for (index_t e = 0; e < d; ++e) out[e] /= l;
}

/// Reads the orthogonal memory (paper 002 eqs. 3 and 6):
///   g = softmax(scale X~ q)^T X~,  X~ = B (.) H,  (X~ q)_i = H_i (b_i . q),
/// so g = sum_i p_i H_i b_i with p = softmax_i(scale H_i (b_i . q)).
/// `mean` is H [r]; `scores` is r values of scratch.
template <Real T>
void lavo_memory_read(const T* basis, const T* mean, const T* q, index_t r, index_t d, T scale,
                      T* scores, T* g) noexcept {
  T score_max = -std::numeric_limits<T>::infinity();
  for (index_t i = 0; i < r; ++i) {
    scores[i] = scale * (mean[i] * dot(basis + i * d, q, d));
    score_max = std::isnan(scores[i]) ? scores[i] : std::max(score_max, scores[i]);  // keep NaN
  }
  std::fill(g, g + d, T(0));
  if (score_max == -std::numeric_limits<T>::infinity()) return;
  T total = 0;
  for (index_t i = 0; i < r; ++i) {
    scores[i] = std::exp(scores[i] - score_max);
    total += scores[i];
  }
  for (index_t i = 0; i < r; ++i) {
    const T weight = scores[i] / total * mean[i];  // p_i H_i
    const T* b = basis + i * d;
    for (index_t e = 0; e < d; ++e) g[e] += weight * b[e];
  }
}

/// o_t from F_local and, when the memory holds tokens, F_global (§3.2: the average).
template <Real T>
inline void lavo_combine(const T* local, const T* global, bool memory_empty, bool local_only,
                         T* out, index_t d) noexcept {
  if (!memory_empty) {
    for (index_t e = 0; e < d; ++e) out[e] = T(0.5) * (local[e] + global[e]);
  } else if (local_only) {
    std::copy(local, local + d, out);
  } else {  // an empty memory is H = 0, X~ = 0, and reads F_global = 0
    for (index_t e = 0; e < d; ++e) out[e] = T(0.5) * local[e];
  }
}

/// `scratch` values a causal step needs: F_local [d], H [r], scores [r].
[[nodiscard]] inline index_t lavo_step_scratch(index_t d, index_t r) noexcept { return d + 2 * r; }

/// One causal step for the token at absolute position t = `position` (0-based;
/// window j holds positions [j w, (j + 1) w)).
///  1. k_t, v_t enter the ring, which holds the w most recent tokens.
///  2. F_local: softmax over s = t - w + 1 .. t (crossing the window border),
///     score scale q_t . k_s + P[(s - t) + w - 1] (§3.2, §3.3).
///  3. F_global: read the memory of the floor(t / w) complete windows before
///     t's window, H = (memory sum) / n with n = floor(t / w) w tokens (eq. 3).
///  4. o_t = (F_local + F_global) / 2.
///  5. f_t = F_local(t) is compressed: B f_t joins the current window's sum,
///     which joins the memory when the window is complete.
template <Real T>
void lavo_causal_step(const T* q, const T* k, const T* v, T* out, const LavoCarry<T>& carry,
                      const LavoHead<T>& head, std::int64_t position, T* scratch) noexcept {
  const index_t d = head.dim, r = head.bases, w = head.window, capacity = carry.capacity;
  T* local = scratch;
  T* mean = scratch + d;
  T* scores = scratch + d + r;

  const index_t slot = static_cast<index_t>(position % capacity);
  std::copy(k, k + d, carry.keys + slot * d);
  std::copy(v, v + d, carry.values + slot * d);

  const index_t visible = static_cast<index_t>(std::min<std::int64_t>(position + 1, w));
  const std::int64_t oldest = position + 1 - visible;
  auto slot_of = [&](index_t j) { return static_cast<index_t>((oldest + j) % capacity); };
  lavo_local_row(
      q, d, head.scale, visible, [&](index_t j) { return carry.keys + slot_of(j) * d; },
      [&](index_t j) { return carry.values + slot_of(j) * d; },
      [&](index_t j) { return head.relative_bias[j + w - visible]; },  // (s - t) + w - 1
      local);

  const std::int64_t memory_tokens = (position / w) * w;
  if (memory_tokens > 0) {
    const T n = static_cast<T>(memory_tokens);
    for (index_t i = 0; i < r; ++i)
      mean[i] = (carry.memory_sum[i] + carry.memory_compensation[i]) / n;
    lavo_memory_read(head.basis, mean, q, r, d, head.scale, scores, out);
  }
  lavo_combine(local, out, memory_tokens == 0, head.local_only_without_memory, out, d);

  for (index_t i = 0; i < r; ++i) carry.window_sum[i] += dot(head.basis + i * d, local, d);
  if ((position + 1) % w == 0) {  // t closes its window
    for (index_t i = 0; i < r; ++i) {
      compensated_add(carry.memory_sum[i], carry.memory_compensation[i], carry.window_sum[i]);
      carry.window_sum[i] = T(0);
    }
  }
}

/// Causal LAVO over a whole [B, T, H, d] sequence, continuing from `carry_of(b, h)`
/// at absolute position `first_position`; `head_of(h)` gives the head's weights.
template <Real T, class HeadOf, class CarryOf>
void lavo_causal_forward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                         TensorView<const T, 4> v, TensorView<T, 4> out,
                         std::int64_t first_position, HeadOf&& head_of, CarryOf&& carry_of) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2);
  if (B == 0 || Tn == 0) return;
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h) {
      const LavoHead<T> head = head_of(h);
      const auto [carry, scratch] = carry_of(b, h);
      for (index_t t = 0; t < Tn; ++t)
        lavo_causal_step(q.row(b, t, h), k.row(b, t, h), v.row(b, t, h), out.row(b, t, h), carry,
                         head, first_position + t, scratch);
    }
}

/// Bidirectional LAVO (§3.2 without the causal limit; our reading, see
/// mechanisms/lavo.hpp): F_local over |s - t| <= w - 1 with bias P[(s - t) + w - 1],
/// the memory compresses F_local of every token of the sequence, o_t = (F_local + F_global) / 2.
/// F_local is kept in `out` between the two passes, so no T-sized workspace.
template <Real T, class HeadOf>
void lavo_bidirectional_forward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                                TensorView<const T, 4> v, TensorView<T, 4> out,
                                HeadOf&& head_of) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2);
  if (B == 0 || Tn == 0) return;
  const LavoHead<T> first = head_of(0);
  const index_t d = first.dim, r = first.bases;
  std::vector<T> sum(static_cast<std::size_t>(r)), compensation(sum.size()), mean(sum.size()),
      scores(sum.size()), global(static_cast<std::size_t>(d));
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h) {
      const LavoHead<T> head = head_of(h);
      const index_t w = head.window;
      std::fill(sum.begin(), sum.end(), T(0));
      std::fill(compensation.begin(), compensation.end(), T(0));
      for (index_t t = 0; t < Tn; ++t) {
        const index_t lo = std::max<index_t>(0, t - (w - 1));
        const index_t hi = std::min<index_t>(Tn - 1, t + (w - 1));
        T* local = out.row(b, t, h);
        lavo_local_row(
            q.row(b, t, h), d, head.scale, hi - lo + 1,
            [&](index_t j) { return k.row(b, lo + j, h); },
            [&](index_t j) { return v.row(b, lo + j, h); },
            [&](index_t j) { return head.relative_bias[lo + j - t + w - 1]; }, local);
        for (index_t i = 0; i < r; ++i)  // eq. 3: sum_s B f_s
          compensated_add(sum[i], compensation[i], dot(head.basis + i * d, local, d));
      }
      for (index_t i = 0; i < r; ++i) mean[i] = (sum[i] + compensation[i]) / static_cast<T>(Tn);
      for (index_t t = 0; t < Tn; ++t) {
        T* o = out.row(b, t, h);
        lavo_memory_read(head.basis, mean.data(), q.row(b, t, h), r, d, head.scale,
                         scores.data(), global.data());
        lavo_combine(o, global.data(), false, false, o, d);
      }
    }
}

/// Cross-attention LAVO (paper 002 §3.4, eqs. 5-6): X~ = CODE(source), o_t =
/// softmax(scale q_t X~^T) X~; no local part. An empty source is H = 0 and reads zero.
template <Real T, class HeadOf>
void lavo_cross_forward(TensorView<const T, 4> q, TensorView<const T, 4> source,
                        TensorView<T, 4> out, HeadOf&& head_of) {
  const index_t B = q.extent(0), Tq = q.extent(1), H = q.extent(2), Ts = source.extent(1);
  if (B == 0 || Tq == 0) return;
  const LavoHead<T> first = head_of(0);
  const index_t d = first.dim, r = first.bases;
  std::vector<T> sum(static_cast<std::size_t>(r)), compensation(sum.size()), mean(sum.size()),
      scores(sum.size());
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h) {
      const LavoHead<T> head = head_of(h);
      std::fill(sum.begin(), sum.end(), T(0));
      std::fill(compensation.begin(), compensation.end(), T(0));
      for (index_t s = 0; s < Ts; ++s)
        for (index_t i = 0; i < r; ++i)
          compensated_add(sum[i], compensation[i], dot(head.basis + i * d, source.row(b, s, h), d));
      for (index_t i = 0; i < r; ++i)
        mean[i] = Ts == 0 ? T(0) : (sum[i] + compensation[i]) / static_cast<T>(Ts);
      for (index_t t = 0; t < Tq; ++t)
        lavo_memory_read(head.basis, mean.data(), q.row(b, t, h), r, d, head.scale, scores.data(),
                         out.row(b, t, h));
    }
}

}  // namespace latte::reference
