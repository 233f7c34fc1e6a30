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


// ---------------------------------------------------------------------------
// Backward (docs/backward.md "LAVO"). With G_t = dL/do_t and the read's
// symbols (bq_i = b_i . q, p_i = softmax_i(scale H_i bq_i), g = sum_i p_i H_i b_i):
//   read:   dp_i = H_i (b_i . dg),  ds_i = p_i (dp_i - sum_j p_j dp_j),
//           dq += scale sum_i ds_i H_i b_i,
//           dH_i += p_i (b_i . dg) + scale ds_i bq_i,
//           db_i += p_i H_i dg + scale ds_i H_i q;
//   mean:   H = M / n with M = sum_s B f_s, so every f_s in M receives B^T dM
//           (dM = sum of the readers' dH / n) and db_i += dM_i f_s;
//   local:  the softmax backward of F_local with dF = (its share of G_t) + B^T dM,
//           dscore_{ts} = p_{ts} (dF_t . v_s - dF_t . F_t), and dP[(s - t) + w - 1]
//           += dscore_{ts} (§3.3's bias is a logit offset).
// Parameter gradients (bases, bias) are summed in double.
// ---------------------------------------------------------------------------

/// One (batch, head)'s causal state as saved, read by a backward: the ring
/// (capacity w, slot s % w) and the sums. A null `keys` is a fresh state.
template <Real T>
struct LavoSavedCarry {
  const T* keys = nullptr;
  const T* values = nullptr;
  const T* window_sum = nullptr;
  const T* memory_sum = nullptr;           ///< the memory's total is memory_sum + memory_compensation
  const T* memory_compensation = nullptr;
};

/// Where a backward accumulates LAVO's parameter gradients (double; null: not wanted).
struct LavoParameterGradients {
  double* d_basis = nullptr;  ///< [H, r, d]
  double* d_bias = nullptr;   ///< [H, 2w - 1]
};

/// The local row's weights p_j = softmax_j(scale q . key(j) + bias(j)) into `p`
/// [count]; all zero when every score is -inf (the row reads nothing).
template <Real T, class KeyAt, class BiasAt>
void lavo_local_weights(const T* q, index_t d, T scale, index_t count, KeyAt&& key_at,
                        BiasAt&& bias_at, T* p) noexcept {
  T m = -std::numeric_limits<T>::infinity();
  for (index_t j = 0; j < count; ++j) {
    p[j] = scale * dot(q, key_at(j), d) + bias_at(j);
    m = std::isnan(p[j]) ? p[j] : std::max(m, p[j]);
  }
  if (m == -std::numeric_limits<T>::infinity()) {
    std::fill(p, p + count, T(0));
    return;
  }
  T total = 0;
  for (index_t j = 0; j < count; ++j) total += (p[j] = std::exp(p[j] - m));
  for (index_t j = 0; j < count; ++j) p[j] /= total;
}

/// Backward of lavo_local_row for one query given F (its output) and dF:
/// adds to dq [d], key_gradient_at(j), value_gradient_at(j) [d] and
/// d_bias[bias_index_at(j)] (double; null: not wanted). `p` is count values of scratch.
template <Real T, class KeyAt, class ValueAt, class BiasAt, class KeyGradientAt,
          class ValueGradientAt, class BiasIndexAt>
void lavo_local_row_backward(const T* q, index_t d, T scale, index_t count, KeyAt&& key_at,
                             ValueAt&& value_at, BiasAt&& bias_at, const T* F, const T* dF, T* dq,
                             KeyGradientAt&& key_gradient_at, ValueGradientAt&& value_gradient_at,
                             BiasIndexAt&& bias_index_at, double* d_bias, T* p) noexcept {
  lavo_local_weights(q, d, scale, count, key_at, bias_at, p);
  const T row_dot = dot(dF, F, d);  // sum_s p_s (dF . v_s)
  for (index_t j = 0; j < count; ++j) {
    if (p[j] == T(0)) continue;  // -inf scores (and underflow) pass no gradient
    const T* value = value_at(j);
    const T dscore = p[j] * (dot(dF, value, d) - row_dot);
    const T* key = key_at(j);
    T* dk = key_gradient_at(j);
    T* dv = value_gradient_at(j);
    for (index_t e = 0; e < d; ++e) {
      dq[e] += scale * dscore * key[e];
      dk[e] += scale * dscore * q[e];
      dv[e] += p[j] * dF[e];
    }
    if (d_bias) d_bias[bias_index_at(j)] += static_cast<double>(dscore);
  }
}

/// Backward of lavo_memory_read for one query given dg: adds to dq [d],
/// weight * dH to d_mean [r] (double; weight = 1 / n folds in H = M / n) and
/// the read's part of d_basis [r x d] (double; null: not wanted). `scratch` is 3 r values.
template <Real T>
void lavo_memory_read_backward(const T* basis, const T* mean, const T* q, const T* dg, index_t r,
                               index_t d, T scale, double weight, T* dq, double* d_mean,
                               double* d_basis, T* scratch) noexcept {
  T* bq = scratch;
  T* bg = scratch + r;
  T* p = scratch + 2 * r;
  T score_max = -std::numeric_limits<T>::infinity();
  for (index_t i = 0; i < r; ++i) {
    bq[i] = dot(basis + i * d, q, d);
    bg[i] = dot(basis + i * d, dg, d);
    p[i] = scale * (mean[i] * bq[i]);
    score_max = std::isnan(p[i]) ? p[i] : std::max(score_max, p[i]);
  }
  if (score_max == -std::numeric_limits<T>::infinity()) return;  // the read was zero
  T total = 0;
  for (index_t i = 0; i < r; ++i) total += (p[i] = std::exp(p[i] - score_max));
  T mean_dp = 0;  // sum_j p_j dp_j, dp_j = H_j (b_j . dg)
  for (index_t i = 0; i < r; ++i) {
    p[i] /= total;
    mean_dp += p[i] * mean[i] * bg[i];
  }
  for (index_t i = 0; i < r; ++i) {
    const T ds = p[i] * (mean[i] * bg[i] - mean_dp);
    const T* b = basis + i * d;
    for (index_t e = 0; e < d; ++e) dq[e] += scale * ds * mean[i] * b[e];
    d_mean[i] += weight * (static_cast<double>(p[i]) * bg[i] + static_cast<double>(scale) * ds * bq[i]);
    if (d_basis)
      for (index_t e = 0; e < d; ++e)
        d_basis[i * d + e] += static_cast<double>(p[i]) * mean[i] * dg[e] +
                              static_cast<double>(scale) * ds * mean[i] * q[e];
  }
}

/// dF += B^T e (e [r], double) and d_basis_i += e_i f (double; null: not wanted):
/// the compression's backward for one token's features f.
template <Real T>
void lavo_compression_backward(const T* basis, const double* e, const T* f, index_t r, index_t d,
                               T* df, double* d_basis) noexcept {
  for (index_t i = 0; i < r; ++i) {
    if (e[i] == 0) continue;
    const T* b = basis + i * d;
    const T ei = static_cast<T>(e[i]);
    for (index_t j = 0; j < d; ++j) df[j] += ei * b[j];
    if (d_basis)
      for (index_t j = 0; j < d; ++j) d_basis[i * d + j] += e[i] * f[j];
  }
}

/// The initial ring's gradient before the local rows add theirs: a slot the
/// chunk of `tokens` tokens from `first_position` does not overwrite still
/// holds, in the state left, what it held before, so it takes d_final's
/// gradient (zero without one); the other slots start at zero.
template <Real T>
void lavo_start_ring_gradient(const LavoCarry<T>& d_initial, const LavoSavedCarry<T>& d_final,
                              index_t w, index_t d, std::int64_t first_position,
                              index_t tokens) noexcept {
  for (index_t slot = 0; slot < w; ++slot) {
    const bool written = tokens >= w || ((slot - first_position % w + w) % w) < tokens;
    T* into_k = d_initial.keys + slot * d;
    T* into_v = d_initial.values + slot * d;
    if (!written && d_final.keys) {
      std::copy_n(d_final.keys + slot * d, d, into_k);
      std::copy_n(d_final.values + slot * d, d, into_v);
    } else {
      std::fill_n(into_k, d, T(0));
      std::fill_n(into_v, d, T(0));
    }
  }
}

/// Causal LAVO backward over [B, T, H, d] at absolute positions
/// first_position + t: writes dq, dk, dv; accumulates `parameters` per head.
/// `initial_of(b, h)` is the saved state the forward continued from
/// (LavoSavedCarry, null keys: fresh), `final_gradient_of(b, h)` the gradient
/// of the state it left (null keys: zero), `initial_gradient_of(b, h)` a
/// LavoCarry to write the initial state's gradient to (null keys: not wanted):
/// ring slots the chunk does not overwrite pass d_final's through, window_sum
/// gets the gradient of its window's total, memory_sum and memory_compensation
/// both the gradient of the memory's total. Workspace O(T (d + r)) per head.
template <Real T, class HeadOf, class InitialOf, class FinalGradientOf, class InitialGradientOf>
void lavo_causal_backward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                          TensorView<const T, 4> v, TensorView<const T, 4> d_out,
                          TensorView<T, 4> dq, TensorView<T, 4> dk, TensorView<T, 4> dv,
                          std::int64_t first_position, HeadOf&& head_of, InitialOf&& initial_of,
                          FinalGradientOf&& final_gradient_of,
                          InitialGradientOf&& initial_gradient_of,
                          const LavoParameterGradients& parameters) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2);
  if (B == 0 || Tn == 0) return;
  const LavoHead<T> first = head_of(0);
  const index_t d = first.dim, r = first.bases, w = first.window;
  const std::int64_t P0 = first_position, end = P0 + Tn;
  const std::int64_t j0 = P0 / w, windows = (end - 1) / w - j0 + 1;
  std::vector<T> F(static_cast<std::size_t>(Tn * d)), means(static_cast<std::size_t>(Tn * r));
  std::vector<T> dF(F.size()), p(static_cast<std::size_t>(w)), scratch(static_cast<std::size_t>(3 * r));
  std::vector<T> window_sum(static_cast<std::size_t>(r)), sum(window_sum.size()),
      compensation(window_sum.size()), discard(static_cast<std::size_t>(d));
  std::vector<double> D(static_cast<std::size_t>(windows * r)), later(static_cast<std::size_t>(r)),
      e(later.size());
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h) {
      const LavoHead<T> head = head_of(h);
      const LavoSavedCarry<T> initial = initial_of(b, h);
      const LavoSavedCarry<T> d_final = final_gradient_of(b, h);
      const LavoCarry<T> d_initial = initial_gradient_of(b, h);
      double* d_basis = parameters.d_basis ? parameters.d_basis + h * r * d : nullptr;
      double* d_bias = parameters.d_bias ? parameters.d_bias + h * (2 * w - 1) : nullptr;
      auto key_of = [&](std::int64_t s) {
        return s >= P0 ? k.row(b, static_cast<index_t>(s - P0), h) : initial.keys + (s % w) * d;
      };
      auto value_of = [&](std::int64_t s) {
        return s >= P0 ? v.row(b, static_cast<index_t>(s - P0), h) : initial.values + (s % w) * d;
      };
      auto memory_tokens = [&](std::int64_t s) { return (s / w) * w; };

      // Forward again: F_local and the mean H each token read.
      for (index_t i = 0; i < r; ++i) {
        window_sum[static_cast<std::size_t>(i)] = initial.keys ? initial.window_sum[i] : T(0);
        sum[static_cast<std::size_t>(i)] = initial.keys ? initial.memory_sum[i] : T(0);
        compensation[static_cast<std::size_t>(i)] = initial.keys ? initial.memory_compensation[i] : T(0);
      }
      for (index_t t = 0; t < Tn; ++t) {
        const std::int64_t s = P0 + t;
        const index_t visible = static_cast<index_t>(std::min<std::int64_t>(s + 1, w));
        const std::int64_t oldest = s + 1 - visible;
        T* f = F.data() + t * d;
        lavo_local_row(
            q.row(b, t, h), d, head.scale, visible, [&](index_t j) { return key_of(oldest + j); },
            [&](index_t j) { return value_of(oldest + j); },
            [&](index_t j) { return head.relative_bias[j + w - visible]; }, f);
        const std::int64_t n = memory_tokens(s);
        for (index_t i = 0; i < r && n > 0; ++i)
          means[static_cast<std::size_t>(t * r + i)] =
              (sum[static_cast<std::size_t>(i)] + compensation[static_cast<std::size_t>(i)]) / static_cast<T>(n);
        for (index_t i = 0; i < r; ++i) window_sum[static_cast<std::size_t>(i)] += dot(head.basis + i * d, f, d);
        if ((s + 1) % w == 0)
          for (index_t i = 0; i < r; ++i) {
            compensated_add(sum[static_cast<std::size_t>(i)], compensation[static_cast<std::size_t>(i)],
                            window_sum[static_cast<std::size_t>(i)]);
            window_sum[static_cast<std::size_t>(i)] = T(0);
          }
      }

      // The read's backward: dq and each window's dM = sum of its readers' dH / n.
      std::fill(D.begin(), D.end(), 0.0);
      for (index_t t = 0; t < Tn; ++t) {
        const std::int64_t s = P0 + t, n = memory_tokens(s);
        const T* g = d_out.row(b, t, h);
        T* dqt = dq.row(b, t, h);
        std::fill(dqt, dqt + d, T(0));
        const T local_share = n == 0 && head.local_only_without_memory ? T(1) : T(0.5);
        for (index_t e2 = 0; e2 < d; ++e2) dF[static_cast<std::size_t>(t * d + e2)] = local_share * g[e2];
        if (n == 0) continue;  // an empty memory: g = 0 whatever q
        for (index_t e2 = 0; e2 < d; ++e2) discard[static_cast<std::size_t>(e2)] = T(0.5) * g[e2];
        lavo_memory_read_backward(head.basis, means.data() + t * r, q.row(b, t, h), discard.data(),
                                  r, d, head.scale, 1.0 / static_cast<double>(n), dqt,
                                  D.data() + (s / w - j0) * r, d_basis, scratch.data());
      }
      // Reverse over windows: tokens of window j reach the reads of windows
      // > j, and the state left: its memory when j completes in the chunk, else its window_sum.
      std::fill(later.begin(), later.end(), 0.0);
      for (std::int64_t jj = windows - 1; jj >= 0; --jj) {
        const std::int64_t j = j0 + jj;
        const bool completes = (j + 1) * w <= end;
        const T* final_term = completes ? d_final.memory_sum : d_final.window_sum;
        for (index_t i = 0; i < r; ++i)
          e[static_cast<std::size_t>(i)] = later[static_cast<std::size_t>(i)] +
                                           (d_final.keys ? static_cast<double>(final_term[i]) : 0.0);
        for (std::int64_t s = std::max(j * w, P0); s < std::min((j + 1) * w, end); ++s) {
          const index_t t = static_cast<index_t>(s - P0);
          lavo_compression_backward(head.basis, e.data(), F.data() + t * d, r, d,
                                    dF.data() + t * d, d_basis);
        }
        if (jj == 0 && d_initial.keys)
          for (index_t i = 0; i < r; ++i) d_initial.window_sum[i] = static_cast<T>(e[static_cast<std::size_t>(i)]);
        for (index_t i = 0; i < r; ++i) later[static_cast<std::size_t>(i)] += D[static_cast<std::size_t>(jj * r + i)];
      }
      if (d_initial.keys)
        for (index_t i = 0; i < r; ++i) {
          const double total = later[static_cast<std::size_t>(i)] +
                               (d_final.keys ? static_cast<double>(d_final.memory_sum[i]) : 0.0);
          d_initial.memory_sum[i] = d_initial.memory_compensation[i] = static_cast<T>(total);
        }

      if (d_initial.keys) lavo_start_ring_gradient(d_initial, d_final, w, d, P0, Tn);
      for (index_t t = 0; t < Tn; ++t) {
        std::fill_n(dk.row(b, t, h), d, T(0));
        std::fill_n(dv.row(b, t, h), d, T(0));
      }
      // The w most recent tokens' keys and values sit in the state left.
      if (d_final.keys)
        for (std::int64_t s = std::max(end - w, P0); s < end; ++s) {
          const index_t t = static_cast<index_t>(s - P0);
          for (index_t e2 = 0; e2 < d; ++e2) {
            dk(b, t, h, e2) += d_final.keys[(s % w) * d + e2];
            dv(b, t, h, e2) += d_final.values[(s % w) * d + e2];
          }
        }
      auto key_gradient_of = [&](std::int64_t s) -> T* {
        if (s >= P0) return dk.row(b, static_cast<index_t>(s - P0), h);
        return d_initial.keys ? d_initial.keys + (s % w) * d : discard.data();
      };
      auto value_gradient_of = [&](std::int64_t s) -> T* {
        if (s >= P0) return dv.row(b, static_cast<index_t>(s - P0), h);
        return d_initial.keys ? d_initial.values + (s % w) * d : discard.data();
      };
      for (index_t t = 0; t < Tn; ++t) {
        const std::int64_t s = P0 + t;
        const index_t visible = static_cast<index_t>(std::min<std::int64_t>(s + 1, w));
        const std::int64_t oldest = s + 1 - visible;
        lavo_local_row_backward(
            q.row(b, t, h), d, head.scale, visible, [&](index_t j) { return key_of(oldest + j); },
            [&](index_t j) { return value_of(oldest + j); },
            [&](index_t j) { return head.relative_bias[j + w - visible]; }, F.data() + t * d,
            dF.data() + t * d, dq.row(b, t, h), [&](index_t j) { return key_gradient_of(oldest + j); },
            [&](index_t j) { return value_gradient_of(oldest + j); },
            [&](index_t j) { return j + w - visible; }, d_bias, p.data());
      }
    }
}

/// Bidirectional LAVO backward (see lavo_bidirectional_forward): writes dq, dk,
/// dv; accumulates `parameters`. Workspace O(T (d + r)).
template <Real T, class HeadOf>
void lavo_bidirectional_backward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                                 TensorView<const T, 4> v, TensorView<const T, 4> d_out,
                                 TensorView<T, 4> dq, TensorView<T, 4> dk, TensorView<T, 4> dv,
                                 HeadOf&& head_of, const LavoParameterGradients& parameters) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2);
  if (B == 0 || Tn == 0) return;
  const LavoHead<T> first = head_of(0);
  const index_t d = first.dim, r = first.bases, w = first.window;
  std::vector<T> F(static_cast<std::size_t>(Tn * d)), dF(F.size()), mean(static_cast<std::size_t>(r)),
      compensation(mean.size()), scratch(static_cast<std::size_t>(3 * r)), dg(static_cast<std::size_t>(d)),
      p(static_cast<std::size_t>(2 * w - 1));
  std::vector<double> D(static_cast<std::size_t>(r));
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h) {
      const LavoHead<T> head = head_of(h);
      double* d_basis = parameters.d_basis ? parameters.d_basis + h * r * d : nullptr;
      double* d_bias = parameters.d_bias ? parameters.d_bias + h * (2 * w - 1) : nullptr;
      // The band |s - t| <= w - 1 (named bounds, not a structured binding: clang 14
      // cannot capture those).
      auto band_lo = [&](index_t t) { return std::max<index_t>(0, t - (w - 1)); };
      auto band_hi = [&](index_t t) { return std::min<index_t>(Tn - 1, t + (w - 1)); };
      std::fill(mean.begin(), mean.end(), T(0));
      std::fill(compensation.begin(), compensation.end(), T(0));
      for (index_t t = 0; t < Tn; ++t) {
        const index_t lo = band_lo(t), hi = band_hi(t);
        T* f = F.data() + t * d;
        lavo_local_row(
            q.row(b, t, h), d, head.scale, hi - lo + 1, [&](index_t j) { return k.row(b, lo + j, h); },
            [&](index_t j) { return v.row(b, lo + j, h); },
            [&](index_t j) { return head.relative_bias[lo + j - t + w - 1]; }, f);
        for (index_t i = 0; i < r; ++i)
          compensated_add(mean[static_cast<std::size_t>(i)], compensation[static_cast<std::size_t>(i)],
                          dot(head.basis + i * d, f, d));
      }
      for (index_t i = 0; i < r; ++i)
        mean[static_cast<std::size_t>(i)] =
            (mean[static_cast<std::size_t>(i)] + compensation[static_cast<std::size_t>(i)]) / static_cast<T>(Tn);
      std::fill(D.begin(), D.end(), 0.0);
      for (index_t t = 0; t < Tn; ++t) {
        const T* g = d_out.row(b, t, h);
        T* dqt = dq.row(b, t, h);
        std::fill(dqt, dqt + d, T(0));
        for (index_t e = 0; e < d; ++e) dF[static_cast<std::size_t>(t * d + e)] = dg[static_cast<std::size_t>(e)] = T(0.5) * g[e];
        lavo_memory_read_backward(head.basis, mean.data(), q.row(b, t, h), dg.data(), r, d,
                                  head.scale, 1.0 / static_cast<double>(Tn), dqt, D.data(), d_basis,
                                  scratch.data());
      }
      for (index_t t = 0; t < Tn; ++t) {  // every token is in the memory
        lavo_compression_backward(head.basis, D.data(), F.data() + t * d, r, d, dF.data() + t * d, d_basis);
        std::fill_n(dk.row(b, t, h), d, T(0));
        std::fill_n(dv.row(b, t, h), d, T(0));
      }
      for (index_t t = 0; t < Tn; ++t) {
        const index_t lo = band_lo(t), hi = band_hi(t);
        lavo_local_row_backward(
            q.row(b, t, h), d, head.scale, hi - lo + 1, [&](index_t j) { return k.row(b, lo + j, h); },
            [&](index_t j) { return v.row(b, lo + j, h); },
            [&](index_t j) { return head.relative_bias[lo + j - t + w - 1]; }, F.data() + t * d,
            dF.data() + t * d, dq.row(b, t, h), [&](index_t j) { return dk.row(b, lo + j, h); },
            [&](index_t j) { return dv.row(b, lo + j, h); },
            [&](index_t j) { return lo + j - t + w - 1; }, d_bias, p.data());
      }
    }
}

/// Cross-attention LAVO backward (see lavo_cross_forward): writes dq and
/// d_source; accumulates the bases' gradient (parameters.d_basis).
template <Real T, class HeadOf>
void lavo_cross_backward(TensorView<const T, 4> q, TensorView<const T, 4> source,
                         TensorView<const T, 4> d_out, TensorView<T, 4> dq,
                         TensorView<T, 4> d_source, HeadOf&& head_of,
                         const LavoParameterGradients& parameters) {
  const index_t B = q.extent(0), Tq = q.extent(1), H = q.extent(2), Ts = source.extent(1);
  if (B == 0) return;
  const LavoHead<T> first = head_of(0);
  const index_t d = first.dim, r = first.bases;
  std::vector<T> mean(static_cast<std::size_t>(r)), compensation(mean.size()),
      scratch(static_cast<std::size_t>(3 * r));
  std::vector<double> D(static_cast<std::size_t>(r));
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h) {
      const LavoHead<T> head = head_of(h);
      double* d_basis = parameters.d_basis ? parameters.d_basis + h * r * d : nullptr;
      for (index_t t = 0; t < Tq; ++t) std::fill_n(dq.row(b, t, h), d, T(0));
      for (index_t s = 0; s < Ts; ++s) std::fill_n(d_source.row(b, s, h), d, T(0));
      if (Ts == 0) continue;  // an empty memory reads zero whatever q
      std::fill(mean.begin(), mean.end(), T(0));
      std::fill(compensation.begin(), compensation.end(), T(0));
      for (index_t s = 0; s < Ts; ++s)
        for (index_t i = 0; i < r; ++i)
          compensated_add(mean[static_cast<std::size_t>(i)], compensation[static_cast<std::size_t>(i)],
                          dot(head.basis + i * d, source.row(b, s, h), d));
      for (index_t i = 0; i < r; ++i)
        mean[static_cast<std::size_t>(i)] =
            (mean[static_cast<std::size_t>(i)] + compensation[static_cast<std::size_t>(i)]) / static_cast<T>(Ts);
      std::fill(D.begin(), D.end(), 0.0);
      for (index_t t = 0; t < Tq; ++t)
        lavo_memory_read_backward(head.basis, mean.data(), q.row(b, t, h), d_out.row(b, t, h), r,
                                  d, head.scale, 1.0 / static_cast<double>(Ts), dq.row(b, t, h),
                                  D.data(), d_basis, scratch.data());
      for (index_t s = 0; s < Ts; ++s)
        lavo_compression_backward(head.basis, D.data(), source.row(b, s, h), r, d,
                                  d_source.row(b, s, h), d_basis);
    }
}

}  // namespace latte::reference
