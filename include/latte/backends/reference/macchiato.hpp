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
#include "latte/core/checked_size.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/policies/positional.hpp"
#include "latte/policies/stabilizer.hpp"
#include "latte/policies/window.hpp"

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

/// The latent logits q_{.,1..L} of a [B, T, H, L + 1] view, as a [B, T, H, L] view (no copy).
template <class T>
[[nodiscard]] TensorView<T, 4> latent_logits(const TensorView<T, 4>& q) noexcept {
  return TensorView<T, 4>(q.data() + 1, {q.extent(0), q.extent(1), q.extent(2), q.extent(3) - 1},
                          q.strides());
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
  latte_bidirectional_forward<Stab, LatentPos>(latent_logits(q), k, v, out, latent_angles);
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

// ------------------------------------------------------------- backward --
// The mixture splits the gradient as it splits the output (DESIGN §3.6). With
// a_t = p(0|t), s_t = sum_{l>=1} p(l|t), o_t = a_t w_t + s_t y_t (w_t the
// window read, y_t Latte's read over the logits 1..L alone):
//   - the latent part is Latte's backward on the logits 1..L with d_out s_t g_t
//     (its p(l|t) s_t is the mixture's), which also gives X_t = <g_t, s_t y_t>;
//   - the window part is softmax attention's backward (window w, RoPE-rotated
//     copies of q' and k', R^{-s} v_s and R^{-t} g_t when VAPOR acts on it) with
//     d_out a_t g_t, which gives Y_t = <g_t, a_t w_t>;
//   - the query logits: with <g_t, o_t> = X_t + Y_t, dq_{t,0} = Y_t - a_t (X_t + Y_t),
//     and for l >= 1 the true p(l|t) (<g_t, u_l> - <g_t, o_t>) differs from what
//     Latte's backward wrote, p(l|t) <g_t, u_l> - pL(l|t) X_t (pL its softmax over
//     1..L), by pL(l|t) X_t - p(l|t) (X_t + Y_t).
// Each part runs on its backend's kernels (`Parts`: ReferenceMacchiatoParts
// here, cpu::MacchiatoParts). Extra memory O(B T H (Dk + Dv)): the scaled
// d_out, the window part's value gradient, the rotated copies and per token
// a_t, s_t, X_t, Y_t.

/// The gradient buffers of a Macchiato backward (shapes checked by the caller).
template <Real T>
struct MacchiatoGradientViews {
  TensorView<T, 4> d_query_logits;    ///< [B, T, H, L + 1]
  TensorView<T, 4> d_key_logits;      ///< [B, T, H, L]
  TensorView<T, 4> d_window_queries;  ///< [B, T, H, Dk]
  TensorView<T, 4> d_window_keys;     ///< [B, T, H, Dk]
  TensorView<T, 4> d_values;          ///< [B, T, H, Dv]
};

/// What a Macchiato backward needs besides the tensors.
struct MacchiatoBackwardSpec {
  index_t window;                            ///< w
  double scale;                              ///< of q' . k'
  const std::vector<double>* latent_angles;  ///< VAPOR [H * Dv/2] (empty: none)
  const std::vector<double>* key_angles;     ///< RoPE [H * Dk/2] (empty: none)
  bool rotate_window_values;                 ///< VAPOR acts on the window part too
};

/// The query logits' gradient of one token, given Latte's over the logits
/// 1..L in dq[1..L], X = <g, s y> and Y = <g, a w> (see above).
template <Real T>
void macchiato_query_gradient(const T* q, index_t L, T X, T Y, T* dq) noexcept {
  constexpr T minus_inf = -std::numeric_limits<T>::infinity();
  T all_max = minus_inf, latent_max = minus_inf;
  for (index_t l = 1; l <= L; ++l) latent_max = std::max(latent_max, q[l]);
  all_max = std::max(latent_max, q[0]);
  if (all_max == minus_inf) {  // reads nothing: no gradient
    std::fill(dq, dq + L + 1, T(0));
    return;
  }
  T all_sum = std::exp(q[0] - all_max), latent_sum = 0;
  for (index_t l = 1; l <= L; ++l) {
    all_sum += std::exp(q[l] - all_max);
    if (latent_max != minus_inf) latent_sum += std::exp(q[l] - latent_max);
  }
  const T total = X + Y;  // <g, o>
  dq[0] = Y - std::exp(q[0] - all_max) / all_sum * total;
  if (latent_max == minus_inf) return;  // Latte wrote zeros there, and p(l|t) = 0
  for (index_t l = 1; l <= L; ++l)
    dq[l] += std::exp(q[l] - latent_max) / latent_sum * X - std::exp(q[l] - all_max) / all_sum * total;
}

/// Latte Macchiato's backward over a whole [B, T, H, *] sequence from a fresh
/// state (see above). `d_angles` [H * (Dv/2)] doubles, accumulated, or null.
template <bool Causal, Stabilizer Stab, Positional LatentPos, Positional WindowPos, class Parts,
          Real T>
void macchiato_backward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                        TensorView<const T, 4> wq, TensorView<const T, 4> wk,
                        TensorView<const T, 4> v, TensorView<const T, 4> g,
                        const MacchiatoGradientViews<T>& gradients,
                        const MacchiatoBackwardSpec& spec, double* d_angles) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), L = k.extent(3);
  const index_t Dk = wq.extent(3), Dv = v.extent(3), heads = B * H;
  if (B == 0 || Tn == 0 || H == 0) return;
  constexpr bool rope = WindowPos::rotates_queries_keys;
  const bool vapor_window = LatentPos::rotates_values && spec.rotate_window_values;
  const auto size = [](index_t count) { return static_cast<std::size_t>(count); };
  const index_t tokens = detail::checked_count<T>("query_logits", {B, Tn, H});
  const index_t value_rows = detail::checked_count<T>("values", {tokens, Dv});
  // Per token a_t, s_t, X_t, Y_t; the parts' d_out; the window's value gradient.
  std::vector<T> shares(size(2 * tokens)), dots(size(2 * tokens));
  std::vector<T> upstream(size(value_rows)), window_d_values(size(value_rows));
  auto dense = [&](T* data, index_t D) { return TensorView<T, 4>(data, {B, Tn, H, D}); };
  auto token = [&](index_t b, index_t t, index_t h) { return (b * Tn + t) * H + h; };
  const TensorView<T, 3> latent_dots(dots.data(), {B, Tn, H});
  const TensorView<T, 3> window_dots(dots.data() + tokens, {B, Tn, H});
  auto theta_of = [&](const std::vector<double>* angles, index_t h, index_t D) {
    return angles->empty() ? nullptr : angles->data() + h * (D / 2);
  };

  // The latent part: Latte on the logits 1..L with d_out s_t g_t.
  Parts::for_heads(heads, [&](index_t i) {
    const index_t b = i / H, h = i % H;
    for (index_t t = 0; t < Tn; ++t) {
      const MixtureShares<T> share = macchiato_shares(q.row(b, t, h), L);
      shares[size(2 * token(b, t, h))] = share.local;
      shares[size(2 * token(b, t, h) + 1)] = share.latent;
      const T* gt = g.row(b, t, h);
      T* out = upstream.data() + token(b, t, h) * Dv;
      for (index_t d = 0; d < Dv; ++d) out[d] = share.latent * gt[d];
    }
  });
  Parts::template latte_backward<Causal, Stab, LatentPos>(
      latent_logits(q), k, v, TensorView<const T, 4>(dense(upstream.data(), Dv)),
      latent_logits(gradients.d_query_logits), gradients.d_key_logits, gradients.d_values,
      *spec.latent_angles, d_angles, latent_dots);

  // The window part: softmax over W(t) with d_out a_t g_t, on rotated copies
  // where the window rotates (R^t q'_t, R^s k'_s; R^{-s} v_s and R^{-t} g_t).
  std::vector<T> rotated_queries(rope ? size(tokens * Dk) : 0), rotated_keys(rotated_queries.size());
  std::vector<T> rotated_values(vapor_window ? size(value_rows) : 0);
  Parts::for_heads(heads, [&](index_t i) {
    const index_t b = i / H, h = i % H;
    const double* key_theta = theta_of(spec.key_angles, h, Dk);
    const double* value_theta = theta_of(spec.latent_angles, h, Dv);
    for (index_t t = 0; t < Tn; ++t) {
      const index_t at = token(b, t, h);
      const std::int64_t position = t;
      if constexpr (rope) {
        std::copy_n(wq.row(b, t, h), Dk, rotated_queries.data() + at * Dk);
        std::copy_n(wk.row(b, t, h), Dk, rotated_keys.data() + at * Dk);
        WindowPos::rotate(rotated_queries.data() + at * Dk, Dk, key_theta, position);
        WindowPos::rotate(rotated_keys.data() + at * Dk, Dk, key_theta, position);
      }
      T* out = upstream.data() + at * Dv;
      const T* gt = g.row(b, t, h);
      const T local = shares[size(2 * at)];
      for (index_t d = 0; d < Dv; ++d) out[d] = local * gt[d];
      if constexpr (LatentPos::rotates_values) {
        if (vapor_window) {
          LatentPos::rotate(out, Dv, value_theta, -position);
          std::copy_n(v.row(b, t, h), Dv, rotated_values.data() + at * Dv);
          LatentPos::rotate(rotated_values.data() + at * Dv, Dv, value_theta, -position);
        }
      } else {
        (void)value_theta;
      }
    }
  });
  const TensorView<const T, 4> window_queries =
      rope ? TensorView<const T, 4>(dense(rotated_queries.data(), Dk)) : wq;
  const TensorView<const T, 4> window_keys =
      rope ? TensorView<const T, 4>(dense(rotated_keys.data(), Dk)) : wk;
  const TensorView<const T, 4> window_values =
      vapor_window ? TensorView<const T, 4>(dense(rotated_values.data(), Dv)) : v;
  const SlidingWindow band{spec.window, Causal ? 0 : spec.window};
  const T scale = static_cast<T>(spec.scale);
  Parts::template softmax_backward<Causal>(
      window_queries, window_keys, window_values, TensorView<const T, 4>(dense(upstream.data(), Dv)),
      gradients.d_window_queries, gradients.d_window_keys, dense(window_d_values.data(), Dv), scale,
      band, window_dots);
  if constexpr (LatentPos::rotates_values) {
    if (vapor_window && d_angles) {
      // The window part's angle terms (DESIGN §3.6, VAPOR): with w~_t the
      // unrotated window read, sum_t t <a_t g~_t, J w~_t> - sum_s s <dv~_s, J v~_s>.
      std::vector<T> reads(size(value_rows));
      Parts::template softmax_forward<Causal>(window_queries, window_keys, window_values,
                                              dense(reads.data(), Dv), scale, band);
      for (index_t b = 0; b < B; ++b)
        for (index_t h = 0; h < H; ++h)
          for (index_t t = 0; t < Tn; ++t) {
            const index_t at = token(b, t, h);
            double* d_theta = d_angles + h * (Dv / 2);
            accumulate_angle_gradient(d_theta, Dv, upstream.data() + at * Dv,
                                      reads.data() + at * Dv, t);
            accumulate_angle_gradient(d_theta, Dv, window_d_values.data() + at * Dv,
                                      rotated_values.data() + at * Dv, -t);
          }
    }
  }

  // Everything back to the inputs' frames, and the query logits' gradient.
  Parts::for_heads(heads, [&](index_t i) {
    const index_t b = i / H, h = i % H;
    const double* key_theta = theta_of(spec.key_angles, h, Dk);
    const double* value_theta = theta_of(spec.latent_angles, h, Dv);
    for (index_t t = 0; t < Tn; ++t) {
      const index_t at = token(b, t, h);
      const std::int64_t position = t;
      if constexpr (rope) {  // dq' = R^{-t} d(R^t q'), dk' likewise
        WindowPos::rotate(gradients.d_window_queries.row(b, t, h), Dk, key_theta, -position);
        WindowPos::rotate(gradients.d_window_keys.row(b, t, h), Dk, key_theta, -position);
      } else {
        (void)key_theta;
      }
      T* window_dv = window_d_values.data() + at * Dv;
      if constexpr (LatentPos::rotates_values) {
        if (vapor_window) LatentPos::rotate(window_dv, Dv, value_theta, position);  // R^s dv~
      } else {
        (void)value_theta;
      }
      T* dv = gradients.d_values.row(b, t, h);
      for (index_t d = 0; d < Dv; ++d) dv[d] += window_dv[d];
      macchiato_query_gradient(q.row(b, t, h), L, latent_dots(b, t, h), window_dots(b, t, h),
                               gradients.d_query_logits.row(b, t, h));
    }
  });
}

/// The reference backend's parts for macchiato_backward.
struct ReferenceMacchiatoParts {
  template <class Body>
  static void for_heads(index_t count, Body&& body) {
    for (index_t i = 0; i < count; ++i) body(i);
  }
  template <bool Causal, Stabilizer Stab, Positional Pos, Real T>
  static void latte_backward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                             TensorView<const T, 4> v, TensorView<const T, 4> g,
                             TensorView<T, 4> dq, TensorView<T, 4> dk, TensorView<T, 4> dv,
                             const std::vector<double>& angles, double* d_angles,
                             TensorView<T, 3> read_dots) {
    if constexpr (Causal)
      latte_causal_backward<Stab, Pos>(
          q, k, v, g, dq, dk, dv, angles, 0,
          [&](index_t, index_t, LatteCarry<T> carry) { latte_reset<Stab>(carry, k.extent(3), v.extent(3)); },
          [](index_t, index_t, const T*) { return LatteCarryGradient<const T>{nullptr, nullptr}; },
          [](index_t, index_t) { return LatteCarryGradient<T>{nullptr, nullptr}; }, d_angles,
          read_dots);
    else
      latte_bidirectional_backward<Stab, Pos>(q, k, v, g, dq, dk, dv, angles, d_angles, read_dots);
  }
  template <bool Causal, Real T>
  static void softmax_backward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                               TensorView<const T, 4> v, TensorView<const T, 4> g,
                               TensorView<T, 4> dq, TensorView<T, 4> dk, TensorView<T, 4> dv,
                               T scale, const SlidingWindow& window, TensorView<T, 3> row_dots) {
    reference::softmax_backward<Causal>(q, k, v, g, dq, dk, dv, scale, window, row_dots);
  }
  template <bool Causal, Real T>
  static void softmax_forward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                              TensorView<const T, 4> v, TensorView<T, 4> out, T scale,
                              const SlidingWindow& window) {
    reference::softmax_forward<Causal>(q, k, v, out, scale, window);
  }
};

}  // namespace latte::reference
