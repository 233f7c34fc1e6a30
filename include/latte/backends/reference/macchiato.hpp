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
#include <utility>
#include <vector>

#include "latte/backends/reference/latte.hpp"
#include "latte/backends/reference/softmax.hpp"
#include "latte/core/checked_size.hpp"
#include "latte/core/huge_page_allocator.hpp"
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
  index_t window_slots;                      ///< w + 1: a state's ring slots
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

/// One (batch, head)'s window ring in a backward: keys [w + 1, Dk], values
/// [w + 1, Dv], token s in slot s % (w + 1), as the window reads them.
template <class T>
struct RingRows {
  T* keys;
  T* values;
};

/// What a causal Macchiato backward continues from and gives back of the
/// states. This one is a fresh start at position 0 with nothing asked for;
/// LatteMacchiato::backward passes its own for MacchiatoStateGradients. The
/// carry hooks are latte_causal_backward's; `fill` ring slots before
/// `first_position` hold tokens (ring_of), `final_ring_gradient_of` gives the
/// gradient of the final state's ring (null: zero) and
/// `initial_ring_gradient_of` where the initial ring's goes (null: not asked;
/// the caller zeroed it).
template <Stabilizer Stab, Real T>
struct FreshMacchiatoStates {
  index_t latents, value_dim, capacity;
  std::int64_t first_position = 0;
  index_t fill = 0;
  void initial_of(index_t, index_t, LatteCarry<T> carry) const {
    latte_reset<Stab>(carry, latents, value_dim);
  }
  LatteCarryGradient<const T> final_gradient_of(index_t, index_t, const T*) const {
    return {nullptr, nullptr};
  }
  LatteCarryGradient<T> initial_gradient_of(index_t, index_t) const { return {nullptr, nullptr}; }
  RingRows<const T> ring_of(index_t, index_t) const { return {nullptr, nullptr}; }
  RingRows<const T> final_ring_gradient_of(index_t, index_t) const { return {nullptr, nullptr}; }
  RingRows<T> initial_ring_gradient_of(index_t, index_t) const { return {nullptr, nullptr}; }
};

/// Latte Macchiato's backward over a [B, T, H, *] sequence (see above); the
/// causal one continues from `states` (the window part then runs over the
/// ring's last min(fill, w) tokens and the sequence, the ring's rows taking
/// no query). `d_angles` [H * (Dv/2)] doubles, accumulated, or null.
template <bool Causal, Stabilizer Stab, Positional LatentPos, Positional WindowPos, class Parts,
          Real T, class States>
void macchiato_backward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                        TensorView<const T, 4> wq, TensorView<const T, 4> wk,
                        TensorView<const T, 4> v, TensorView<const T, 4> g,
                        const MacchiatoGradientViews<T>& gradients,
                        const MacchiatoBackwardSpec& spec, double* d_angles, States& states) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), L = k.extent(3);
  const index_t Dk = wq.extent(3), Dv = v.extent(3), heads = B * H;
  if (B == 0 || Tn == 0 || H == 0) return;
  constexpr bool rope = WindowPos::rotates_queries_keys;
  const bool vapor_window = LatentPos::rotates_values && spec.rotate_window_values;
  const std::int64_t P = Causal ? states.first_position : 0;
  // The ring tokens the sequence's windows reach: positions P - pre .. P - 1.
  const index_t pre = Causal ? std::min(states.fill, spec.window) : 0;
  const index_t Tx = detail::checked_sum("query_logits", {pre, Tn});  // the window part's rows
  const auto size = [](index_t count) { return static_cast<std::size_t>(count); };
  const index_t tokens = detail::checked_count<T>("query_logits", {B, Tn, H});
  const index_t rows = detail::checked_count<T>("query_logits", {B, Tx, H});
  const index_t value_rows = detail::checked_count<T>("values", {rows, Dv});
  // Per token a_t, s_t, X_t, Y_t (Y over the window part's rows); the parts' d_out.
  std::vector<T> shares(size(2 * tokens)), dots(size(tokens + rows));
  // The [B, T, H, *] buffers in 2 MiB pages (huge_page_allocator.hpp): fewer faults on first touch.
  AlignedVector<T> upstream(size(value_rows)), window_d_values(size(value_rows));
  auto dense = [&](T* data, index_t count, index_t D) {
    return TensorView<T, 4>(data, {B, count, H, D});
  };
  const TensorView<T, 3> latent_dots(dots.data(), {B, Tn, H});
  const TensorView<T, 3> window_dots(dots.data() + tokens, {B, Tx, H});
  auto theta_of = [&](const std::vector<double>* angles, index_t h, index_t D) {
    return angles->empty() ? nullptr : angles->data() + h * (D / 2);
  };

  // The latent part: Latte on the logits 1..L with d_out s_t g_t.
  const TensorView<T, 4> latent_upstream = dense(upstream.data(), Tn, Dv);
  Parts::for_heads(heads, [&](index_t i) {
    const index_t b = i / H, h = i % H;
    std::vector<T> exps(size(L));  // the parts' scratch for one token's latent exponentials
    for (index_t t = 0; t < Tn; ++t) {
      const MixtureShares<T> share = Parts::shares(q.row(b, t, h), L, exps.data());
      const index_t at = (b * Tn + t) * H + h;
      shares[size(2 * at)] = share.local;
      shares[size(2 * at + 1)] = share.latent;
      const T* gt = g.row(b, t, h);
      T* out = latent_upstream.row(b, t, h);
      for (index_t d = 0; d < Dv; ++d) out[d] = share.latent * gt[d];
    }
  });
  auto share_of = [&](index_t b, index_t t, index_t h) { return shares[size(2 * ((b * Tn + t) * H + h))]; };
  if constexpr (Causal)
    Parts::template latte_causal_backward<Stab, LatentPos>(
        latent_logits(q), k, v, TensorView<const T, 4>(latent_upstream),
        latent_logits(gradients.d_query_logits), gradients.d_key_logits, gradients.d_values,
        *spec.latent_angles, states.first_position,
        [&](index_t b, index_t h, LatteCarry<T> carry) { states.initial_of(b, h, carry); },
        [&](index_t b, index_t h, const T* m_T) { return states.final_gradient_of(b, h, m_T); },
        [&](index_t b, index_t h) { return states.initial_gradient_of(b, h); }, d_angles,
        latent_dots);
  else
    Parts::template latte_bidirectional_backward<Stab, LatentPos>(
        latent_logits(q), k, v, TensorView<const T, 4>(latent_upstream),
        latent_logits(gradients.d_query_logits), gradients.d_key_logits, gradients.d_values,
        *spec.latent_angles, d_angles, latent_dots);

  // The window part: softmax over W(t) with d_out a_t g_t, over Tx rows (the
  // ring's last `pre` tokens, which take no query, then the sequence), on
  // copies where the window rotates (R^t q'_t, R^s k'_s; R^{-s} v_s and R^{-t} g_t)
  // or a ring comes first; else on the inputs. The key gradients go into the
  // gradients themselves (rotated back there under RoPE) unless a ring's rows
  // come first.
  const bool copy_keys = rope || pre > 0, copy_values = vapor_window || pre > 0;
  const bool key_gradient_rows = pre > 0;
  const index_t key_rows = detail::checked_count<T>("window_keys", {rows, Dk});
  AlignedVector<T> key_buffers(size(((copy_keys ? 2 : 0) + (key_gradient_rows ? 2 : 0)) * key_rows));
  AlignedVector<T> value_buffer(copy_values ? size(value_rows) : 0);
  const TensorView<T, 4> Xq = copy_keys ? dense(key_buffers.data(), Tx, Dk) : TensorView<T, 4>{};
  const TensorView<T, 4> Xk = copy_keys ? dense(key_buffers.data() + key_rows, Tx, Dk) : TensorView<T, 4>{};
  const TensorView<T, 4> dXq = key_gradient_rows ? dense(key_buffers.data() + 2 * key_rows, Tx, Dk)
                                                 : gradients.d_window_queries;
  const TensorView<T, 4> dXk = key_gradient_rows ? dense(key_buffers.data() + 3 * key_rows, Tx, Dk)
                                                 : gradients.d_window_keys;
  const TensorView<T, 4> Xv = copy_values ? dense(value_buffer.data(), Tx, Dv) : TensorView<T, 4>{};
  const TensorView<T, 4> Xg = dense(upstream.data(), Tx, Dv);
  const TensorView<T, 4> dXv = dense(window_d_values.data(), Tx, Dv);
  Parts::for_heads(heads, [&](index_t i) {
    const index_t b = i / H, h = i % H;
    const RingRows<const T> ring = pre > 0 ? states.ring_of(b, h) : RingRows<const T>{nullptr, nullptr};
    for (index_t j = 0; j < pre; ++j) {  // ring token P - pre + j, as stored; no query, no d_out
      const index_t slot = static_cast<index_t>((P - pre + j) % spec.window_slots);
      std::copy_n(ring.keys + slot * Dk, Dk, Xk.row(b, j, h));
      std::copy_n(ring.values + slot * Dv, Dv, Xv.row(b, j, h));
      std::fill_n(Xq.row(b, j, h), Dk, T(0));
      std::fill_n(Xg.row(b, j, h), Dv, T(0));
    }
    for (index_t t = 0; t < Tn; ++t) {  // Xg reuses latent_upstream's buffer: Latte is done
      const T* gt = g.row(b, t, h);
      T* out = Xg.row(b, pre + t, h);
      const T local = share_of(b, t, h);
      for (index_t d = 0; d < Dv; ++d) out[d] = local * gt[d];
      if (copy_keys) {
        std::copy_n(wq.row(b, t, h), Dk, Xq.row(b, pre + t, h));
        std::copy_n(wk.row(b, t, h), Dk, Xk.row(b, pre + t, h));
      }
      if (copy_values) std::copy_n(v.row(b, t, h), Dv, Xv.row(b, pre + t, h));
    }
    if constexpr (rope) {  // R^t q'_t, R^s k'_s at absolute positions
      const double* key_theta = theta_of(spec.key_angles, h, Dk);
      const TensorView<T, 4> rotated[] = {Xq, Xk};
      for (const TensorView<T, 4>& x : rotated)
        Parts::template rotate_rows<WindowPos>(x.row(b, pre, h), x.stride(1), Tn, Dk, key_theta,
                                               true, P);
    }
    if constexpr (LatentPos::rotates_values) {
      if (vapor_window) {  // R^{-t} (a_t g_t), R^{-s} v_s
        const double* value_theta = theta_of(spec.latent_angles, h, Dv);
        const TensorView<T, 4> rotated[] = {Xg, Xv};
        for (const TensorView<T, 4>& x : rotated)
          Parts::template rotate_rows<LatentPos>(x.row(b, pre, h), x.stride(1), Tn, Dv,
                                                 value_theta, false, P);
      }
    }
  });
  const TensorView<const T, 4> window_queries = copy_keys ? TensorView<const T, 4>(Xq) : wq;
  const TensorView<const T, 4> window_keys = copy_keys ? TensorView<const T, 4>(Xk) : wk;
  const TensorView<const T, 4> window_values = copy_values ? TensorView<const T, 4>(Xv) : v;
  const SlidingWindow band{spec.window, Causal ? 0 : spec.window};
  const T scale = static_cast<T>(spec.scale);
  Parts::template softmax_backward<Causal>(window_queries, window_keys, window_values,
                                           TensorView<const T, 4>(Xg), dXq, dXk, dXv, scale, band,
                                           window_dots);
  const index_t final_count = std::min(Tx, spec.window_slots);  // the final ring's tokens
  if constexpr (LatentPos::rotates_values) {
    if (vapor_window && d_angles) {
      // The window part's angle terms (DESIGN §3.6, VAPOR), positions counted
      // from the first token as in Latte's backward (fp32 at 1e7 keeps its
      // digits): with w~_t the unrotated window read, sum_t t <a_t g~_t, J w~_t>
      // - sum_s s <dv~_s, J v~_s> over the sequence; moving the origin to P adds
      // P <dv~_j, J v~_j> for the ring's rows (their own terms were the previous
      // call's), and the final ring's gradient adds -(P + s) <dv~_s, J v~_s> for
      // the sequence's tokens it holds (docs/backward.md).
      AlignedVector<T> reads(size(value_rows));
      const TensorView<T, 4> read = dense(reads.data(), Tx, Dv);
      Parts::template softmax_forward<Causal>(window_queries, window_keys, window_values, read,
                                              scale, band);
      for (index_t b = 0; b < B; ++b)
        for (index_t h = 0; h < H; ++h) {
          double* d_theta = d_angles + h * (Dv / 2);
          for (index_t t = 0; t < Tn; ++t) {
            accumulate_angle_gradient(d_theta, Dv, Xg.row(b, pre + t, h), read.row(b, pre + t, h), t);
            accumulate_angle_gradient(d_theta, Dv, dXv.row(b, pre + t, h),
                                      window_values.row(b, pre + t, h), -t);
          }
          if constexpr (Causal) {
            for (index_t j = 0; j < pre; ++j)
              accumulate_angle_gradient(d_theta, Dv, dXv.row(b, j, h), window_values.row(b, j, h), P);
            const RingRows<const T> d_ring = states.final_ring_gradient_of(b, h);
            if (d_ring.values != nullptr)
              for (index_t j = std::max(pre, Tx - final_count); j < Tx; ++j) {
                const index_t slot = static_cast<index_t>((P - pre + j) % spec.window_slots);
                accumulate_angle_gradient(d_theta, Dv, d_ring.values + slot * Dv,
                                          window_values.row(b, j, h), -(P + j - pre));
              }
          }
        }
    }
  }
  // The final ring's gradient: its min(fill + T, w + 1) tokens, in the window's frame.
  if constexpr (Causal) {
    Parts::for_heads(heads, [&](index_t i) {
      const index_t b = i / H, h = i % H;
      const RingRows<const T> d_ring = states.final_ring_gradient_of(b, h);
      if (d_ring.keys == nullptr) return;
      for (index_t j = Tx - final_count; j < Tx; ++j) {
        const index_t slot = static_cast<index_t>((P - pre + j) % spec.window_slots);
        T* dk = dXk.row(b, j, h);
        T* dv = dXv.row(b, j, h);
        for (index_t d = 0; d < Dk; ++d) dk[d] += d_ring.keys[slot * Dk + d];
        for (index_t d = 0; d < Dv; ++d) dv[d] += d_ring.values[slot * Dv + d];
      }
    });
  }
  // Everything back to the inputs' frames, the ring's rows to the initial
  // state's gradient, and the query logits' gradient.
  Parts::for_heads(heads, [&](index_t i) {
    const index_t b = i / H, h = i % H;
    std::vector<T> exps(size(L));
    if constexpr (Causal) {
      const RingRows<T> d_ring = states.initial_ring_gradient_of(b, h);
      if (d_ring.keys != nullptr)
        for (index_t j = 0; j < pre; ++j) {
          const index_t slot = static_cast<index_t>((P - pre + j) % spec.window_slots);
          std::copy_n(dXk.row(b, j, h), Dk, d_ring.keys + slot * Dk);
          std::copy_n(dXv.row(b, j, h), Dv, d_ring.values + slot * Dv);
        }
    }
    if (key_gradient_rows)
      for (index_t t = 0; t < Tn; ++t) {
        std::copy_n(dXq.row(b, pre + t, h), Dk, gradients.d_window_queries.row(b, t, h));
        std::copy_n(dXk.row(b, pre + t, h), Dk, gradients.d_window_keys.row(b, t, h));
      }
    if constexpr (rope) {  // dq' = R^{-t} d(R^t q'), dk' likewise
      const double* key_theta = theta_of(spec.key_angles, h, Dk);
      // A named array, not a braced list in the range-for: nvcc's front end rejects the latter
      // here (CI, session 17).
      const TensorView<T, 4> rotated[] = {gradients.d_window_queries, gradients.d_window_keys};
      for (const TensorView<T, 4>& d : rotated)
        Parts::template rotate_rows<WindowPos>(d.row(b, 0, h), d.stride(1), Tn, Dk, key_theta,
                                               false, P);
    }
    if constexpr (LatentPos::rotates_values)
      if (vapor_window)  // R^s dv~
        Parts::template rotate_rows<LatentPos>(dXv.row(b, pre, h), dXv.stride(1), Tn, Dv,
                                               theta_of(spec.latent_angles, h, Dv), true, P);
    for (index_t t = 0; t < Tn; ++t) {
      const T* window_dv = dXv.row(b, pre + t, h);
      T* dv = gradients.d_values.row(b, t, h);
      for (index_t d = 0; d < Dv; ++d) dv[d] += window_dv[d];
      Parts::query_gradient(q.row(b, t, h), L, latent_dots(b, t, h), window_dots(b, pre + t, h),
                            gradients.d_query_logits.row(b, t, h), exps.data());
    }
  });
}

/// The reference backend's parts for macchiato_backward.
struct ReferenceMacchiatoParts {
  /// A token's mixture shares and its query logits' gradient (the definitions
  /// above; `exps` is the cpu parts' scratch).
  template <Real T>
  static MixtureShares<T> shares(const T* q, index_t L, T*) noexcept {
    return macchiato_shares(q, L);
  }
  template <Real T>
  static void query_gradient(const T* q, index_t L, T X, T Y, T* dq, T*) noexcept {
    macchiato_query_gradient(q, L, X, Y, dq);
  }
  template <class Body>
  static void for_heads(index_t count, Body&& body) {
    for (index_t i = 0; i < count; ++i) body(i);
  }
  /// Row t (`stride` apart, t < count) turned by R^{first + t} (`forward`) or
  /// R^{-(first + t)}.
  template <Positional Pos, Real T>
  static void rotate_rows(T* row, index_t stride, index_t count, index_t D, const double* theta,
                          bool forward, std::int64_t first) {
    for (index_t t = 0; t < count; ++t)
      Pos::rotate(row + t * stride, D, theta, forward ? first + t : -(first + t));
  }
  template <Stabilizer Stab, Positional Pos, class... Args>
  static void latte_causal_backward(Args&&... args) {
    reference::latte_causal_backward<Stab, Pos>(std::forward<Args>(args)...);
  }
  template <Stabilizer Stab, Positional Pos, class... Args>
  static void latte_bidirectional_backward(Args&&... args) {
    reference::latte_bidirectional_backward<Stab, Pos>(std::forward<Args>(args)...);
  }
  template <bool Causal, class... Args>
  static void softmax_backward(Args&&... args) {
    reference::softmax_backward<Causal>(std::forward<Args>(args)...);
  }
  template <bool Causal, class... Args>
  static void softmax_forward(Args&&... args) {
    reference::softmax_forward<Causal>(std::forward<Args>(args)...);
  }
};

}  // namespace latte::reference
