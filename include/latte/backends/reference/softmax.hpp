#pragma once
// Reference backend for exact softmax attention (DESIGN §3.1) and its KV-cache decode.
//
// One query row is computed with the online-softmax recurrence
// (running maximum m, normaliser l, accumulator o): the same exact result as
// a two-pass softmax, without a T-sized score buffer.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/policies/window.hpp"

namespace latte::reference {

/// out = sum_j softmax_j(scale * q . key(j)) value(j) over j in [0, count).
template <Real T, class KeyAt, class ValueAt>
void softmax_row(const T* q, index_t Dk, index_t Dv, T scale, index_t count, KeyAt&& key_at,
                 ValueAt&& value_at, T* out) noexcept {
  std::fill(out, out + Dv, T(0));
  T m = -std::numeric_limits<T>::infinity();
  T l = 0;
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
    l = l * carry_scale + weight;
    const T* value = value_at(j);
    for (index_t d = 0; d < Dv; ++d) out[d] = out[d] * carry_scale + weight * value[d];
    m = m_new;
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
