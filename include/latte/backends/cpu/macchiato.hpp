#pragma once
// CPU backend for Latte Macchiato (paper 000 §2.3, paper 001 §4.1): the mixture
// of eq. 13 splits exactly into its two reads,
//
//   o_t = p(0|t) w_t + sum_{l>=1} p(l|t) vtilde_{t,l} / alpha_{t,l}
//       = p(0|t) w_t + (1 - p(0|t)) latte_t,
//
// where latte_t is causal / bidirectional Latte over the logits q_{t,1..L} alone
// (its softmax over L latents times 1 - p(0|t) is the mixture's p(l|t)), and w_t
// the sliding-window softmax read of state 0 (eq. 16). So the latent part runs on
// the cpu Latte kernels (register-blocked scan with two-pass time segments, or
// blocked GEMMs), and a second pass forms w_t and mixes, with the shares
// p(0|t), 1 - p(0|t) from reference::macchiato_shares (each from its own sum of
// exponentials, no 1 - p cancellation).
//
// Causal window pass: per (batch, head) and time segment, a sliding buffer of
// the last w RoPE-rotated keys and values (R^{-s} v_s when VAPOR acts on the
// window) plus one block of queries, attended block by block with the flash
// step of softmax.hpp; segments prefill their buffer from the w tokens before
// them, so B * H = 1 still uses every core. Workspace per worker: the buffer,
// independent of T. Bidirectional window: the blocked online-softmax
// kernel with a {w, w} window over RoPE-rotated copies of q / k (and rotated
// values under VAPOR on the window), O(T * H * (2 Dk + Dv)) extra.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "latte/backends/cpu/latte.hpp"
#include "latte/backends/cpu/parallel.hpp"
#include "latte/backends/cpu/rotation.hpp"
#include "latte/backends/cpu/softmax.hpp"
#include "latte/backends/reference/macchiato.hpp"
#include "latte/core/checked_size.hpp"
#include "latte/core/huge_page_allocator.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/policies/positional.hpp"
#include "latte/policies/window.hpp"

namespace latte::cpu {

/// What the window pass needs besides the tensors.
struct MacchiatoWindowSpec {
  index_t window;                  ///< w
  double scale;                    ///< of q . k
  const std::vector<double>* key_angles;    ///< RoPE [H * Dk/2] (empty: none)
  const std::vector<double>* value_angles;  ///< VAPOR [H * Dv/2] (empty: none)
  bool rotate_window_values;       ///< VAPOR acts on the window part too
};

/// Causal window pass and mixture over [B, T, H, *], `out` holding the latent
/// reads (already rotated by R^t under VAPOR). `ring_of(b, h)` gives the state's
/// ring (`capacity` = w + 1 slots, `fill` tokens before `first_position`), or
/// nullptr-keyed rings for a fresh sequence (fill = 0; capacity min(w + 1, T)
/// suffices then, slot = position % capacity either way). Token t sees the
/// w' = capacity - 1 tokens before it and itself.
///
/// Per (batch, head) and time segment the window keys / values live in a
/// sliding buffer of w' + 8 block_q rows as the window stores them (R^s k_s
/// under RoPE, R^{-s} v_s under VAPOR on the window); each block of block_q
/// queries appends its tokens, attends to rows [t0 - w', t0 + block_q) with the
/// flash step of softmax.hpp (GEMMs where every query of the block sees a whole
/// key block, row by row on the band's edges); when the buffer is full, the
/// w' rows later queries still see move to its front. The state's ring is read
/// once at the start and written once at the end. Workspace per worker: the
/// buffer and one score tile, independent of T.
template <Positional LatentPos, Positional WindowPos, Real T, class RingOf>
void macchiato_causal_window(TensorView<const T, 4> q, TensorView<const T, 4> wq,
                             TensorView<const T, 4> wk, TensorView<const T, 4> v,
                             TensorView<T, 4> out, const MacchiatoWindowSpec& spec,
                             std::int64_t first_position, index_t fill, index_t capacity,
                             RingOf&& ring_of) {
  constexpr index_t block_q = 32, block_k = 32;
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), L = q.extent(3) - 1;
  const index_t Dk = wq.extent(3), Dv = v.extent(3);
  const index_t heads = B * H, reach = capacity - 1;  // w'
  if (Tn == 0 || heads == 0) return;
  const double work = double(heads) * double(Tn) * double(std::min(capacity, Tn)) * double(Dk + Dv);
  const int workers = work >= 1 << 18 ? thread_count() : 1;
  // Time segments when there are fewer heads than workers; each must be long
  // enough that its buffer prefill (w' tokens) is a small part of its work.
  const index_t segments =
      heads >= workers ? 1 : std::clamp<index_t>(Tn / std::max<index_t>(4 * capacity, 256), 1, workers);
  const bool rope = WindowPos::rotates_queries_keys;
  const bool vapor_window = LatentPos::rotates_values && spec.rotate_window_values;
  // The buffer keeps `slack` tokens beyond what a block needs, so the w' rows
  // later blocks still see move to its front once per slack / block_q blocks.
  constexpr index_t slack = 8 * block_q;
  const index_t rows = reach + slack;
  struct Scratch {
    AlignedVector<T> keys, values, queries, read;
    OnlineSoftmaxScratch<T> attend;
    RotationStepper<T> key_rotation, value_rotation, read_rotation;
  };
  std::vector<Scratch> scratch(static_cast<std::size_t>(workers));
  for (Scratch& s : scratch) {
    s.keys.resize(static_cast<std::size_t>(rows * Dk));
    s.values.resize(static_cast<std::size_t>(rows * Dv));
    s.queries.resize(static_cast<std::size_t>(block_q * Dk));
    s.read.resize(static_cast<std::size_t>(block_q * Dv));
    s.attend = OnlineSoftmaxScratch<T>(block_q, block_k, Dv);
    s.key_rotation = RotationStepper<T>(Dk / 2);
    s.value_rotation = RotationStepper<T>(Dv / 2);
    s.read_rotation = RotationStepper<T>(Dv / 2);
  }
  auto segment_begin = [&](index_t p) { return p * Tn / segments; };
  // With segments, the last one rewrites the state's ring while the first reads
  // what it held before the call: the first reads a copy.
  AlignedVector<T> rings_before;
  if (segments > 1) {
    rings_before.resize(static_cast<std::size_t>(
        latte::detail::checked_count<T>("query_logits", {heads, capacity, Dk + Dv})));
    for (index_t i = 0; i < heads; ++i) {
      const reference::KVSlots<T> ring = ring_of(i / H, i % H);
      if (ring.keys == nullptr) continue;
      T* copy = rings_before.data() + i * capacity * (Dk + Dv);
      std::copy(ring.keys, ring.keys + capacity * Dk, copy);
      std::copy(ring.values, ring.values + capacity * Dv, copy + capacity * Dk);
    }
  }
  parallel_for(heads * segments, workers, [&](index_t task, int worker) {
    Scratch& s = scratch[static_cast<std::size_t>(worker)];
    const index_t p = task % segments, i = task / segments, b = i / H, h = i % H;
    const index_t begin = segment_begin(p), end = segment_begin(p + 1);
    const reference::KVSlots<T> ring = ring_of(b, h);
    reference::KVSlots<T> ring_read = ring;
    if (segments > 1 && ring.keys != nullptr) {
      T* copy = rings_before.data() + i * capacity * (Dk + Dv);
      ring_read = {copy, copy + capacity * Dk};
    }
    const double* key_theta = rope ? spec.key_angles->data() + h * (Dk / 2) : nullptr;
    const double* value_theta =
        LatentPos::rotates_values ? spec.value_angles->data() + h * (Dv / 2) : nullptr;
    // The buffer holds tokens [first, first + count) (relative to the call; the
    // state's ring tokens are negative), token t in row t - first.
    index_t first = begin, count = 0;
    T* const keys = s.keys.data();
    T* const values = s.values.data();
    auto slot_of = [&](index_t t) { return static_cast<index_t>((first_position + t) % capacity); };
    // Appends token t as the window stores it; the steppers stand at t.
    auto append = [&](index_t t) {
      T* key = keys + (t - first) * Dk;
      T* value = values + (t - first) * Dv;
      std::copy(wk.row(b, t, h), wk.row(b, t, h) + Dk, key);
      std::copy(v.row(b, t, h), v.row(b, t, h) + Dv, value);
      if (rope) s.key_rotation.rotate(key, true);
      if (vapor_window) s.value_rotation.rotate(value, false);
      ++count;
    };
    auto advance = [&] {
      if (rope) s.key_rotation.next();
      if (vapor_window) s.value_rotation.next();
    };
    // History: the w' tokens before `begin` (segments p > 0 start past 4 (w' + 1)
    // tokens), or for the first segment the state's ring (as it was before the call).
    index_t oldest = begin;
    if (begin > 0) {
      first = oldest = begin - reach;
      if (rope) s.key_rotation.seek(key_theta, first_position + first);
      if (vapor_window) s.value_rotation.seek(value_theta, first_position + first);
      for (index_t t = first; t < begin; ++t, advance()) append(t);
    } else {
      const index_t history = ring.keys == nullptr ? 0 : std::min(fill, reach);
      first = oldest = -history;
      for (index_t t = first; t < 0; ++t, ++count) {
        const index_t slot = slot_of(t);
        std::copy(ring_read.keys + slot * Dk, ring_read.keys + (slot + 1) * Dk,
                  keys + (t - first) * Dk);
        std::copy(ring_read.values + slot * Dv, ring_read.values + (slot + 1) * Dv,
                  values + (t - first) * Dv);
      }
      if (rope) s.key_rotation.seek(key_theta, first_position + begin);
      if (vapor_window) s.value_rotation.seek(value_theta, first_position + begin);
    }
    if (vapor_window) s.read_rotation.seek(value_theta, first_position + begin);
    auto lowest = [&](index_t t) { return std::max(t - reach, oldest); };
    for (index_t t0 = begin; t0 < end; t0 += block_q) {
      const index_t n = std::min(block_q, end - t0);
      // When the block does not fit, drop the tokens no query from t0 on sees.
      const index_t drop = count + n > rows ? (t0 - reach) - first : 0;
      if (drop > 0) {
        std::copy(keys + drop * Dk, keys + count * Dk, keys);
        std::copy(values + drop * Dv, values + count * Dv, values);
        first += drop;
        count -= drop;
      }
      for (index_t r = 0; r < n; ++r, advance()) {
        const index_t t = t0 + r;
        append(t);
        T* query = s.queries.data() + r * Dk;
        std::copy(wq.row(b, t, h), wq.row(b, t, h) + Dk, query);
        if (rope) s.key_rotation.rotate(query, true);
      }
      // In buffer rows: token t is row t - first.
      auto lowest_row = [&](index_t row) { return lowest(row + first) - first; };
      auto highest_row = [](index_t row) { return row; };
      attend_query_block(s.queries.data(), Dk, t0 - first, n, Dk, Dv,
                         KeyValueRows<T>{keys, Dk, values, Dv}, lowest_row(t0 - first), block_k,
                         static_cast<T>(spec.scale), lowest_row, highest_row, s.attend,
                         s.read.data(), Dv);
      for (index_t r = 0; r < n; ++r) {
        T* read = s.read.data() + r * Dv;
        if (vapor_window) {  // R^t sum p0 R^{-s} v_s
          s.read_rotation.rotate(read, true);
          s.read_rotation.next();
        }
        reference::macchiato_mix(reference::macchiato_shares(q.row(b, t0 + r, h), L), read,
                                 out.row(b, t0 + r, h), Dv);
      }
    }
    // The last segment leaves the newest min(capacity, tokens seen) tokens in the state's ring.
    if (ring.keys != nullptr && p + 1 == segments) {
      for (index_t t = std::max(first, first + count - capacity); t < first + count; ++t) {
        std::copy(keys + (t - first) * Dk, keys + (t - first + 1) * Dk,
                  ring.keys + slot_of(t) * Dk);
        std::copy(values + (t - first) * Dv, values + (t - first + 1) * Dv,
                  ring.values + slot_of(t) * Dv);
      }
    }
  });
}

/// Causal Macchiato forward, continuing from carry_of / ring_of at `first_position`
/// with `fill` tokens in rings of `capacity` slots.
template <Stabilizer Stab, Positional LatentPos, Positional WindowPos, Real T, class CarryOf,
          class RingOf>
void macchiato_causal_forward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                              TensorView<const T, 4> wq, TensorView<const T, 4> wk,
                              TensorView<const T, 4> v, TensorView<T, 4> out,
                              const MacchiatoWindowSpec& spec, std::int64_t first_position,
                              index_t fill, index_t capacity, CarryOf&& carry_of,
                              RingOf&& ring_of) {
  latte_causal_forward<Stab, LatentPos>(reference::latent_logits(q), k, v, out, *spec.value_angles,
                                        first_position, carry_of);
  macchiato_causal_window<LatentPos, WindowPos>(q, wq, wk, v, out, spec, first_position, fill,
                                                capacity, ring_of);
}

/// Bidirectional Macchiato: bidirectional Latte for the latent part, the blocked
/// online-softmax kernel with a {w, w} window for state 0.
template <Stabilizer Stab, Positional LatentPos, Positional WindowPos, Real T>
void macchiato_bidirectional_forward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                                     TensorView<const T, 4> wq, TensorView<const T, 4> wk,
                                     TensorView<const T, 4> v, TensorView<T, 4> out,
                                     const MacchiatoWindowSpec& spec) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), L = q.extent(3) - 1;
  const index_t Dv = v.extent(3);
  if (Tn == 0 || B * H == 0) return;
  latte_bidirectional_forward<Stab, LatentPos>(reference::latent_logits(q), k, v, out, *spec.value_angles);
  const bool rope = WindowPos::rotates_queries_keys;
  const bool vapor_window = LatentPos::rotates_values && spec.rotate_window_values;
  // Rotated copies where a policy acts (R^t q_t, R^s k_s; R^{-s} v_s), else the inputs.
  Tensor<T, 4> rotated_q, rotated_k, rotated_v, read({B, Tn, H, Dv});
  TensorView<const T, 4> window_q = wq, window_k = wk, window_v = v;
  auto rotate_copy = [&](const TensorView<const T, 4>& x, Tensor<T, 4>& copy,
                         const std::vector<double>& angles, bool forward) {
    const index_t D = x.extent(3);
    copy = Tensor<T, 4>({B, Tn, H, D});
    parallel_for(B * H, thread_count(), [&](index_t i, int) {
      const index_t b = i / H, h = i % H;
      RotationStepper<T> rotation(D / 2);
      rotation.seek(angles.data() + h * (D / 2), 0);
      for (index_t t = 0; t < Tn; ++t, rotation.next()) {
        std::copy(x.row(b, t, h), x.row(b, t, h) + D, copy.view().row(b, t, h));
        rotation.rotate(copy.view().row(b, t, h), forward);
      }
    });
    return copy.cview();
  };
  if (rope) {
    window_q = rotate_copy(wq, rotated_q, *spec.key_angles, true);
    window_k = rotate_copy(wk, rotated_k, *spec.key_angles, true);
  }
  if (vapor_window) window_v = rotate_copy(v, rotated_v, *spec.value_angles, false);
  softmax_forward<false>(window_q, window_k, window_v, read.view(), static_cast<T>(spec.scale),
                         SlidingWindow{.left = spec.window, .right = spec.window});
  parallel_for(B * H, thread_count(), [&](index_t i, int) {
    const index_t b = i / H, h = i % H;
    RotationStepper<T> rotation(vapor_window ? Dv / 2 : 0);
    if (vapor_window) rotation.seek(spec.value_angles->data() + h * (Dv / 2), 0);
    for (index_t t = 0; t < Tn; ++t) {
      T* window_read = read.view().row(b, t, h);
      if (vapor_window) {
        rotation.rotate(window_read, true);
        rotation.next();
      }
      reference::macchiato_mix(reference::macchiato_shares(q.row(b, t, h), L), window_read,
                               out.row(b, t, h), Dv);
    }
  });
}

/// A token's mixture (paper 000 eq. 9 over the states 0..L), from its query
/// logits q_0..q_L: the shares, and the latent logits' exponentials
/// e_l = exp(q_l - latent_max) (into `exps`, L of them) with their sum.
template <Real T>
struct TokenMixture {
  reference::MixtureShares<T> shares{T(0), T(0)};
  T latent_max = -std::numeric_limits<T>::infinity();
  T latent_sum = 0;
  bool reads = false;  ///< false: every logit is -inf, the token reads zero
};

/// reference::macchiato_shares, vectorised: the latent exponentials in one
/// pass, shifted by the latent maximum (so p(l | latent) underflows no sooner
/// than in the reference), their sum scaled by exp(latent max - overall max).
template <Real T>
[[nodiscard]] TokenMixture<T> token_mixture(const T* q, index_t L, T* exps) noexcept {
  constexpr T minus_inf = -std::numeric_limits<T>::infinity();
  TokenMixture<T> mixture;
  mixture.latent_max = simd::max_of(q + 1, L);
  const T all_max = std::max(q[0], mixture.latent_max);
  if (all_max == minus_inf) return mixture;
  mixture.reads = true;
  const T local = std::exp(q[0] - all_max);
  T latent = 0;
  if (mixture.latent_max != minus_inf) {
    mixture.latent_sum = simd::exp_shifted_sum(q + 1, L, mixture.latent_max, exps);
    latent = mixture.latent_sum * std::exp(mixture.latent_max - all_max);
  }
  const T beta = local + latent;
  mixture.shares = {local / beta, latent / beta};
  return mixture;
}

/// reference::macchiato_query_gradient, vectorised on token_mixture's
/// exponentials: dq_0 = Y - p(0|t) (X + Y) and, for l >= 1,
/// dq_l += p(l | latent) X - p(l|t) (X + Y) = e_l (X - share_latent (X + Y)) / latent_sum.
template <Real T>
void macchiato_query_gradient(const T* q, index_t L, T X, T Y, T* dq, T* exps) noexcept {
  const TokenMixture<T> mixture = token_mixture(q, L, exps);
  if (!mixture.reads) {  // no gradient
    std::fill(dq, dq + L + 1, T(0));
    return;
  }
  const T total = X + Y;  // <g, o>
  dq[0] = Y - mixture.shares.local * total;
  if (mixture.latent_max == -std::numeric_limits<T>::infinity()) return;  // Latte wrote zeros, p(l|t) = 0
  const simd::batch<T> factor((X - mixture.shares.latent * total) / mixture.latent_sum);
  simd::for_each_vector<T>(L, [&](index_t i, index_t count, auto tail) {
    T* row = dq + 1 + i;
    simd::store_lanes<tail.value>(
        row, simd::fma(simd::load_lanes<tail.value>(exps + i, count), factor, simd::load_lanes<tail.value>(row, count)),
        count);
  });
}

/// The cpu kernels as reference::macchiato_backward's parts: Latte's and
/// softmax attention's cpu backwards, the per-token work parallel over heads.
struct MacchiatoParts {
  /// The mixture's shares of a token, and its query logits' gradient (above).
  template <Real T>
  static reference::MixtureShares<T> shares(const T* q, index_t L, T* exps) noexcept {
    return token_mixture(q, L, exps).shares;
  }
  template <Real T>
  static void query_gradient(const T* q, index_t L, T X, T Y, T* dq, T* exps) noexcept {
    cpu::macchiato_query_gradient(q, L, X, Y, dq, exps);
  }
  template <class Body>
  static void for_heads(index_t count, Body&& body) {
    parallel_for(count, thread_count(), [&](index_t i, int) { body(i); });
  }
  /// Row t (`stride` apart, t < count) turned by R^{first + t} (`forward`) or
  /// R^{-(first + t)}, the angles stepped from `first` (rotation.hpp).
  template <Positional, Real T>
  static void rotate_rows(T* row, index_t stride, index_t count, index_t D, const double* theta,
                          bool forward, std::int64_t first) {
    RotationStepper<T> rotation(D / 2);
    rotation.seek(theta, first);
    for (index_t t = 0; t < count; ++t, rotation.next()) rotation.rotate(row + t * stride, forward);
  }
  template <Stabilizer Stab, Positional Pos, class... Args>
  static void latte_causal_backward(Args&&... args) {
    cpu::latte_causal_backward<Stab, Pos>(std::forward<Args>(args)...);
  }
  template <Stabilizer Stab, Positional Pos, class... Args>
  static void latte_bidirectional_backward(Args&&... args) {
    cpu::latte_bidirectional_backward<Stab, Pos>(std::forward<Args>(args)...);
  }
  template <bool Causal, class... Args>
  static void softmax_backward(Args&&... args) {
    cpu::softmax_backward<Causal>(std::forward<Args>(args)...);
  }
  template <bool Causal, class... Args>
  static void softmax_forward(Args&&... args) {
    cpu::softmax_forward<Causal>(std::forward<Args>(args)...);
  }
};

}  // namespace latte::cpu
