#pragma once
// Reference backend for Latte Macchiato (paper 000 §2.3 Definition 3, eqs. 13-16;
// paper 001 §4.1 eqs. 15-17): scalar loops that read like the paper.
//
// One softmax over the L + 1 query logits q_{t,0..L} gives p(l|t); state 0 is
// local softmax attention p0(s|t) over the window W(t), states 1..L are Latte's
// latent states:
//   o_t = p(0|t) sum_{s in W(t)} p0(s|t) v_s + sum_{l=1..L} p(l|t) sum_s p(s|l,t) v_s.
// W(t) = {t - w <= s <= t} (causal, eq. 16) or {|t - s| <= w} (bidirectional).
// The window part reuses the online softmax of backends/reference/softmax.hpp
// and the latent part the carry / read of backends/reference/latte.hpp.
//
// Positions: RoPE rotates window queries and keys by R^t and R^s (pairs (2i, 2i+1),
// angles [H, Dk/2]); VAPOR (paper 000 eq. 22) stores R^{-s} v_s in the latent
// memory and rotates the read-out by R^t. `rotate_window_values` says whether the
// window part reads R^{t-s} v_s too (eq. 22 applied to the whole mixture) or the
// plain v_s (VAPOR on the latent states only).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "latte/backends/reference/latte.hpp"
#include "latte/backends/reference/softmax.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/policies/positional.hpp"
#include "latte/policies/stabilizer.hpp"

namespace latte::reference {

/// p(0|t) and sum_{l=1..L} p(l|t): the local and latent shares of one
/// softmax over the L + 1 query logits (paper 000 §2.3, "normalisation over
/// all L + 1 states").
template <Real T>
struct MixtureShares {
  T local;
  T latent;
};

/// The shares from q_{t,0..L}, shifted by their maximum; a query whose logits
/// are all -inf gets {0, 0} and reads zero (the Latte convention).
template <Real T>
[[nodiscard]] MixtureShares<T> macchiato_shares(const T* q, index_t L) noexcept {
  T q_max = -std::numeric_limits<T>::infinity();
  for (index_t l = 0; l <= L; ++l) q_max = std::max(q_max, q[l]);
  if (q_max == -std::numeric_limits<T>::infinity()) return {T(0), T(0)};
  const T local = std::exp(q[0] - q_max);
  T latent = 0;
  for (index_t l = 1; l <= L; ++l) latent += std::exp(q[l] - q_max);
  const T beta = local + latent;  // eq. 9 over l = 0..L
  return {local / beta, latent / beta};
}

/// out = shares.latent * latent_read + shares.local * window_read (eq. 13).
template <Real T>
void macchiato_mix(MixtureShares<T> shares, const T* window_read, T* latent_read_and_out,
                   index_t Dv) noexcept {
  for (index_t d = 0; d < Dv; ++d)
    latent_read_and_out[d] = shares.latent * latent_read_and_out[d] + shares.local * window_read[d];
}

/// Sizes of one head.
struct MacchiatoSizes {
  index_t latents;    ///< L (the query logits have L + 1 entries)
  index_t key_dim;    ///< Dk of the window queries / keys
  index_t value_dim;  ///< Dv
};

/// Per-head angle tables (null when the policy does not rotate).
struct MacchiatoAngles {
  const double* value_theta;  ///< VAPOR, Dv/2 angles
  const double* key_theta;    ///< RoPE, Dk/2 angles
  bool rotate_window_values;  ///< VAPOR also acts on the window part
};

/// Scratch for one step: 2 Dk + 2 Dv values.
template <Real T>
struct MacchiatoScratch {
  T* query;         // [Dk] R^t q_t (RoPE)
  T* key;           // [Dk] R^t k_t (RoPE)
  T* memory_value;  // [Dv] R^{-t} v_t (VAPOR)
  T* window_read;   // [Dv] sum_{s in W(t)} p0(s|t) v_s
  static MacchiatoScratch carve(T* base, index_t Dk, index_t Dv) noexcept {
    return {base, base + Dk, base + 2 * Dk, base + 2 * Dk + Dv};
  }
  static index_t size(index_t Dk, index_t Dv) noexcept { return 2 * Dk + 2 * Dv; }
};

/// One causal step of one (batch, head) at absolute position `position`.
/// The ring holds the window's last `capacity` (= w + 1) keys and values, as
/// the window reads them (RoPE-rotated keys; values R^{-s} v_s when VAPOR acts
/// on the window); `visible` = min(tokens so far including this one, w + 1).
/// q: [L + 1] query logits, k: [L] key logits, wq / wk: [Dk], v: [Dv].
template <Stabilizer Stab, Positional LatentPos, Positional WindowPos, Real T>
void macchiato_causal_step(const T* q, const T* k, const T* wq, const T* wk, const T* v, T* out,
                           LatteCarry<T> carry, KVSlots<T> ring, index_t capacity,
                           index_t visible, MacchiatoSizes sizes, T scale,
                           MacchiatoAngles angles, std::int64_t position,
                           MacchiatoScratch<T> scratch) noexcept {
  const index_t L = sizes.latents, Dk = sizes.key_dim, Dv = sizes.value_dim;
  // Latent states 1..L: absorb (eq. 12 / 21), the memory storing R^{-t} v_t under VAPOR (eq. 22).
  const T* memory_value = v;
  if constexpr (LatentPos::rotates_values) {
    std::copy(v, v + Dv, scratch.memory_value);
    LatentPos::rotate(scratch.memory_value, Dv, angles.value_theta, -position);
    memory_value = scratch.memory_value;
  }
  latte_absorb<Stab>(k, memory_value, carry, L, Dv);
  // State 0: sliding-window softmax over t - w <= s <= t (eq. 16), RoPE on q_t and k_t.
  const T* query = wq;
  const T* key = wk;
  if constexpr (WindowPos::rotates_queries_keys) {
    std::copy(wq, wq + Dk, scratch.query);
    std::copy(wk, wk + Dk, scratch.key);
    WindowPos::rotate(scratch.query, Dk, angles.key_theta, position);
    WindowPos::rotate(scratch.key, Dk, angles.key_theta, position);
    query = scratch.query;
    key = scratch.key;
  }
  const T* window_value = angles.rotate_window_values ? memory_value : v;
  softmax_decode_step(query, key, window_value, scratch.window_read, ring, capacity, Dk, Dv, scale,
                      position, visible);
  // The mixture (eq. 13): p(l|t) over l = 0..L; the latent read sum_l p(l|t, l >= 1) vtilde / alpha.
  latte_read(q + 1, carry.normaliser, carry.memory, L, Dv, out);
  const MixtureShares<T> shares = macchiato_shares(q, L);
  if constexpr (LatentPos::rotates_values) {
    if (angles.rotate_window_values) {  // R^t (p(0|t) w_t + latent), window stored R^{-s} v_s
      macchiato_mix(shares, scratch.window_read, out, Dv);
      LatentPos::rotate(out, Dv, angles.value_theta, position);
      return;
    }
    LatentPos::rotate(out, Dv, angles.value_theta, position);  // R^t on the latent part only
  }
  macchiato_mix(shares, scratch.window_read, out, Dv);
}

/// Bidirectional Latte Macchiato over a whole [B, T, H, *] sequence: the latent
/// part is bidirectional Latte (paper 000 eqs. 5-7, VAPOR eq. 22), state 0 the
/// two-sided window |t - s| <= w. Workspace O(L * Dv + w * (Dk + Dv)) per call.
/// `latent_angles` [H * Dv/2] (VAPOR) and `key_angles` [H * Dk/2] (RoPE) may be empty.
template <Stabilizer Stab, Positional LatentPos, Positional WindowPos, Real T>
void macchiato_bidirectional_forward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                                     TensorView<const T, 4> wq, TensorView<const T, 4> wk,
                                     TensorView<const T, 4> v, TensorView<T, 4> out, T scale,
                                     index_t window, const std::vector<double>& latent_angles,
                                     const std::vector<double>& key_angles,
                                     bool rotate_window_values) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), L = k.extent(3);
  const index_t Dk = wq.extent(3), Dv = v.extent(3);
  if (B == 0 || Tn == 0) return;
  // Latent states 1..L: bidirectional Latte on the query logits 1..L, written into out.
  const TensorView<const T, 4> latent_logits(q.data() + 1, {B, Tn, H, L},
                                             {q.stride(0), q.stride(1), q.stride(2), 1});
  latte_bidirectional_forward<Stab, LatentPos>(latent_logits, k, v, out, latent_angles);
  // State 0: the window keys / values of tokens [t - w, t + w], prepared once per token
  // (R^s k_s under RoPE; R^{-s} v_s when VAPOR acts on the window) in a ring of
  // min(2w + 1, T) slots, token s in slot s % capacity.
  const index_t capacity = window >= Tn / 2 ? Tn : 2 * window + 1;  // min(2w + 1, T), no overflow
  std::vector<T> ring_keys(static_cast<std::size_t>(capacity * Dk));
  std::vector<T> ring_values(static_cast<std::size_t>(capacity * Dv));
  std::vector<T> query(static_cast<std::size_t>(Dk)), window_read(static_cast<std::size_t>(Dv));
  const bool rotate_values = LatentPos::rotates_values && rotate_window_values;
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h) {
      const double* value_theta =
          latent_angles.empty() ? nullptr : latent_angles.data() + h * (Dv / 2);
      const double* key_theta = key_angles.empty() ? nullptr : key_angles.data() + h * (Dk / 2);
      auto prepare = [&](index_t s) {  // token s into its ring slot
        T* key = ring_keys.data() + (s % capacity) * Dk;
        T* value = ring_values.data() + (s % capacity) * Dv;
        std::copy(wk.row(b, s, h), wk.row(b, s, h) + Dk, key);
        std::copy(v.row(b, s, h), v.row(b, s, h) + Dv, value);
        if constexpr (WindowPos::rotates_queries_keys)
          WindowPos::rotate(key, Dk, key_theta, static_cast<std::int64_t>(s));
        if constexpr (LatentPos::rotates_values)
          if (rotate_values) LatentPos::rotate(value, Dv, value_theta, -static_cast<std::int64_t>(s));
      };
      for (index_t s = 0; s < std::min(window, Tn); ++s) prepare(s);
      for (index_t t = 0; t < Tn; ++t) {
        // window may be as large as index_t allows: compare before adding.
        if (window < Tn - t) prepare(t + window);
        const index_t lo = window >= t ? 0 : t - window;
        const index_t hi = window >= Tn - 1 - t ? Tn - 1 : t + window;
        const T* query_row = wq.row(b, t, h);
        if constexpr (WindowPos::rotates_queries_keys) {
          std::copy(query_row, query_row + Dk, query.data());
          WindowPos::rotate(query.data(), Dk, key_theta, static_cast<std::int64_t>(t));
          query_row = query.data();
        }
        softmax_row(
            query_row, Dk, Dv, scale, hi - lo + 1,
            [&](index_t j) { return ring_keys.data() + ((lo + j) % capacity) * Dk; },
            [&](index_t j) { return ring_values.data() + ((lo + j) % capacity) * Dv; },
            window_read.data());
        if constexpr (LatentPos::rotates_values)
          if (rotate_values)  // R^t sum_s p0(s|t) R^{-s} v_s
            LatentPos::rotate(window_read.data(), Dv, value_theta, static_cast<std::int64_t>(t));
        macchiato_mix(macchiato_shares(q.row(b, t, h), L), window_read.data(), out.row(b, t, h),
                      Dv);
      }
    }
}

}  // namespace latte::reference
