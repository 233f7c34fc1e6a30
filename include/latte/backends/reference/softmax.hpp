#pragma once
// Reference backend for exact softmax attention (DESIGN §3.1), its backward
// (§3.6) and its KV-cache decode.
//
// One query row is computed with the online-softmax recurrence
// (running maximum m, normaliser l, accumulator o): the same exact result as
// a two-pass softmax, without a T-sized score buffer.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "latte/core/compensated_sum.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/policies/window.hpp"

namespace latte::reference {

/// out = sum_j softmax_j(scale * q . key(j)) value(j) over j in [0, count).
/// With `out_low` (Dv values of scratch) the running sums l and out are
/// compensated (core/compensated_sum.hpp: TwoSum per key and element), so that
/// their error does not grow with count (a read over a whole past, such as
/// conv-compression's over its compressed tokens).
template <Real T, class KeyAt, class ValueAt>
void softmax_row(const T* q, index_t Dk, index_t Dv, T scale, index_t count, KeyAt&& key_at,
                 ValueAt&& value_at, T* out, T* out_low = nullptr) noexcept {
  std::fill(out, out + Dv, T(0));
  if (out_low) std::fill(out_low, out_low + Dv, T(0));
  T m = -std::numeric_limits<T>::infinity();
  T l = 0, l_low = 0;
  for (index_t j = 0; j < count; ++j) {
    const T* key = key_at(j);
    T dot = 0;
    for (index_t d = 0; d < Dk; ++d) dot += q[d] * key[d];
    const T score = scale * dot;
    // std::max(m, NaN) is m, which would skip a NaN score like a masked one:
    // carry it instead, so NaN stays in the rows that depend on it.
    const T m_new = std::isnan(score) ? score : std::max(m, score);
    if (m_new == -std::numeric_limits<T>::infinity()) continue;
    const T carry_scale = std::exp(m - m_new), weight = std::exp(score - m_new);
    const T* value = value_at(j);
    m = m_new;
    if (out_low) {
      if (carry_scale != T(1)) {
        detail::compensated_scale(l, l_low, carry_scale);
        for (index_t d = 0; d < Dv; ++d) detail::compensated_scale(out[d], out_low[d], carry_scale);
      }
      detail::compensated_add(l, l_low, weight);
      for (index_t d = 0; d < Dv; ++d)
        detail::compensated_add(out[d], out_low[d], detail::rounded_product(weight, value[d]));
      continue;
    }
    l = l * carry_scale + weight;
    for (index_t d = 0; d < Dv; ++d) out[d] = out[d] * carry_scale + weight * value[d];
  }
  if (l > T(0))
    for (index_t d = 0; d < Dv; ++d) out[d] /= l;
}

/// Whole-sequence softmax attention: query t sees keys
/// [window.lowest_key(t), window.highest_key(t)], capped at t when causal.
template <bool Causal, Window Win, Real T>
void softmax_forward(TensorView<const T, 4> q, TensorView<const T, 4> k, TensorView<const T, 4> v,
                     TensorView<T, 4> out, T scale, const Win& window) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), Dk = q.extent(3);
  const index_t Dv = v.extent(3);
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h)
      for (index_t t = 0; t < Tn; ++t) {
        const index_t lo = window.lowest_key(t);
        index_t hi = window.highest_key(t, Tn);
        if constexpr (Causal) hi = std::min(hi, t);
        softmax_row(
            q.row(b, t, h), Dk, Dv, scale, hi - lo + 1,
            [&](index_t j) { return k.row(b, lo + j, h); },
            [&](index_t j) { return v.row(b, lo + j, h); }, out.row(b, t, h));
      }
}

/// The gradients of softmax attention (FlashAttention-2's backward, DESIGN §3.6)
/// for g = d_out: per query row t, with P_ts = softmax_s(scale q_t . k_s) over
/// the allowed s and D_t = <g_t, o_t>,
///   dv_s += P_ts g_t,  dS_ts = P_ts (<g_t, v_s> - D_t),
///   dq_t += scale dS_ts k_s,  dk_s += scale dS_ts q_t.
/// The row's softmax and o_t are recomputed: nothing is kept from the forward.
/// `row_dots` [B, T, H], when not empty, receives each D_t.
template <bool Causal, Window Win, Real T>
void softmax_backward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                      TensorView<const T, 4> v, TensorView<const T, 4> d_out,
                      TensorView<T, 4> d_q, TensorView<T, 4> d_k, TensorView<T, 4> d_v, T scale,
                      const Win& window, TensorView<T, 3> row_dots = {}) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), Dk = q.extent(3);
  const index_t Dv = v.extent(3);
  std::vector<T> o(static_cast<std::size_t>(Dv));
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h) {
      for (index_t t = 0; t < Tn; ++t) {
        std::fill(d_q.row(b, t, h), d_q.row(b, t, h) + Dk, T(0));
        std::fill(d_k.row(b, t, h), d_k.row(b, t, h) + Dk, T(0));
        std::fill(d_v.row(b, t, h), d_v.row(b, t, h) + Dv, T(0));
      }
      for (index_t t = 0; t < Tn; ++t) {
        const index_t lo = window.lowest_key(t);
        index_t hi = window.highest_key(t, Tn);
        if constexpr (Causal) hi = std::min(hi, t);
        const T* q_t = q.row(b, t, h);
        const T* g_t = d_out.row(b, t, h);
        auto score = [&](index_t s) {
          T dot = 0;
          for (index_t d = 0; d < Dk; ++d) dot += q_t[d] * k.row(b, s, h)[d];
          return scale * dot;
        };
        // The row's softmax: max m and normaliser l = sum exp(score - m), kept
        // apart (m + log l rounded to T would lose log l's digits when |m| is large).
        T m = -std::numeric_limits<T>::infinity();
        for (index_t s = lo; s <= hi; ++s) {
          const T x = score(s);
          m = std::isnan(x) ? x : std::max(m, x);
        }
        T l = 0;
        for (index_t s = lo; s <= hi; ++s) l += std::exp(score(s) - m);
        auto probability = [&](index_t s) { return std::exp(score(s) - m) / l; };
        // o_t = sum_s P_ts v_s, D_t = <g_t, o_t>.
        std::fill(o.begin(), o.end(), T(0));
        for (index_t s = lo; s <= hi; ++s) {
          const T p = probability(s);
          for (index_t d = 0; d < Dv; ++d) o[d] += p * v.row(b, s, h)[d];
        }
        T D = 0;
        for (index_t d = 0; d < Dv; ++d) D += g_t[d] * o[d];
        if (!row_dots.empty()) row_dots(b, t, h) = D;
        for (index_t s = lo; s <= hi; ++s) {
          const T p = probability(s);
          const T* v_s = v.row(b, s, h);
          T* dv_s = d_v.row(b, s, h);
          T dp = 0;  // <g_t, v_s>
          for (index_t d = 0; d < Dv; ++d) {
            dv_s[d] += p * g_t[d];
            dp += g_t[d] * v_s[d];
          }
          const T ds = p * (dp - D);
          const T* k_s = k.row(b, s, h);
          T* dk_s = d_k.row(b, s, h);
          T* dq_t = d_q.row(b, t, h);
          for (index_t d = 0; d < Dk; ++d) {
            dq_t[d] += scale * ds * k_s[d];
            dk_s[d] += scale * ds * q_t[d];
          }
        }
      }
    }
}

/// The KV cache of one (batch, head): `capacity` slots used as a ring.
template <Real T>
struct KVSlots {
  T* keys;    // [capacity x Dk]
  T* values;  // [capacity x Dv]
};

/// One decode step: stores (k, v) for absolute position `position` in the ring,
/// then attends over the `visible` most recent tokens (oldest first, the order
/// the whole-sequence forward uses).
template <Real T>
void softmax_decode_step(const T* q, const T* k, const T* v, T* out, KVSlots<T> slots,
                         index_t capacity, index_t Dk, index_t Dv, T scale, std::int64_t position,
                         index_t visible) noexcept {
  const index_t slot = static_cast<index_t>(position % capacity);
  std::copy(k, k + Dk, slots.keys + slot * Dk);
  std::copy(v, v + Dv, slots.values + slot * Dv);
  const std::int64_t oldest = position + 1 - visible;
  auto slot_of = [&](index_t j) { return static_cast<index_t>((oldest + j) % capacity); };
  softmax_row(
      q, Dk, Dv, scale, visible, [&](index_t j) { return slots.keys + slot_of(j) * Dk; },
      [&](index_t j) { return slots.values + slot_of(j) * Dv; }, out);
}

}  // namespace latte::reference
