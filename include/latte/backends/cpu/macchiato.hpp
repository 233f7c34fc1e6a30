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
// Causal window pass: per (batch, head) and time segment, a ring of the last
// w + 1 RoPE-rotated keys and values (R^{-s} v_s when VAPOR acts on the window)
// read with the vectorised KV-cache step; segments prefill their ring from the
// w tokens before them, so B * H = 1 still uses every core. Workspace per worker:
// the ring, independent of T. Bidirectional window: the blocked online-softmax
// kernel with a {w, w} window over RoPE-rotated copies of q / k (and rotated
// values under VAPOR on the window), O(T * H * (2 Dk + Dv)) extra.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "latte/backends/cpu/latte.hpp"
#include "latte/backends/cpu/parallel.hpp"
#include "latte/backends/cpu/rotation.hpp"
#include "latte/backends/cpu/softmax.hpp"
#include "latte/backends/reference/macchiato.hpp"
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

/// The latent logits q_{.,1..L} of a [B, T, H, L + 1] view, as a [B, T, H, L] view (no copy).
template <class T>
[[nodiscard]] TensorView<T, 4> latent_logits(const TensorView<T, 4>& q) noexcept {
  return TensorView<T, 4>(q.data() + 1, {q.extent(0), q.extent(1), q.extent(2), q.extent(3) - 1},
                          q.strides());
}

/// Causal window pass and mixture over [B, T, H, *], `out` holding the latent
/// reads (already rotated by R^t under VAPOR). `ring_of(b, h)` gives the state's
/// ring (`capacity` = w + 1 slots, `fill` tokens before `first_position`), or
/// nullptr-keyed rings for a fresh sequence (fill = 0; capacity min(w + 1, T)
/// suffices then, slot = position % capacity either way).
template <Positional LatentPos, Positional WindowPos, Real T, class RingOf>
void macchiato_causal_window(TensorView<const T, 4> q, TensorView<const T, 4> wq,
                             TensorView<const T, 4> wk, TensorView<const T, 4> v,
                             TensorView<T, 4> out, const MacchiatoWindowSpec& spec,
                             std::int64_t first_position, index_t fill, index_t capacity,
                             RingOf&& ring_of) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), L = q.extent(3) - 1;
  const index_t Dk = wq.extent(3), Dv = v.extent(3);
  const index_t heads = B * H;
  if (Tn == 0 || heads == 0) return;
  const double work = double(heads) * double(Tn) * double(std::min(capacity, Tn)) * double(Dk + Dv);
  const int workers = work >= 1 << 18 ? thread_count() : 1;
  // Time segments when there are fewer heads than workers; each must be long
  // enough that its ring prefill (w tokens) is a small part of its work.
  const index_t segments =
      heads >= workers ? 1 : std::clamp<index_t>(Tn / std::max<index_t>(4 * capacity, 256), 1, workers);
  const bool rope = WindowPos::rotates_queries_keys;
  const bool vapor_window = LatentPos::rotates_values && spec.rotate_window_values;
  struct Scratch {
    std::vector<T> keys, values, query, key, value, read;
    RotationStepper<T> key_rotation, value_rotation;
  };
  std::vector<Scratch> scratch(static_cast<std::size_t>(workers));
  for (Scratch& s : scratch) {
    s.keys.resize(static_cast<std::size_t>(capacity * Dk));
    s.values.resize(static_cast<std::size_t>(capacity * Dv));
    s.query.resize(static_cast<std::size_t>(Dk));
    s.key.resize(static_cast<std::size_t>(Dk));
    s.value.resize(static_cast<std::size_t>(Dv));
    s.read.resize(static_cast<std::size_t>(Dv));
    s.key_rotation = RotationStepper<T>(Dk / 2);
    s.value_rotation = RotationStepper<T>(Dv / 2);
  }
  auto segment_begin = [&](index_t p) { return p * Tn / segments; };
  // With segments, the last one rewrites the state's ring while the first reads
  // what it held before the call: copy those rings first.
  std::vector<T> rings_before;
  if (segments > 1) {
    rings_before.resize(static_cast<std::size_t>(heads * capacity * (Dk + Dv)));
    for (index_t i = 0; i < heads; ++i) {
      const reference::KVSlots<T> ring = ring_of(i / H, i % H);
      if (ring.keys == nullptr) continue;
      T* copy = rings_before.data() + i * capacity * (Dk + Dv);
      std::copy(ring.keys, ring.keys + capacity * Dk, copy);
      std::copy(ring.values, ring.values + capacity * Dv, copy + capacity * Dk);
    }
  }
  parallel_for(heads * segments, workers, [&](index_t task, int worker) {
    Scratch& s = scratch[worker];
    const index_t p = task % segments, i = task / segments, b = i / H, h = i % H;
    const index_t begin = segment_begin(p), end = segment_begin(p + 1);
    // The last segment works in the state's ring (which it leaves after the call);
    // earlier ones in a private ring (the first starts from a copy of the state's).
    reference::KVSlots<T> ring = ring_of(b, h);
    const bool own_ring = ring.keys == nullptr || p + 1 < segments;
    if (own_ring) {
      reference::KVSlots<T> mine{s.keys.data(), s.values.data()};
      if (p == 0 && ring.keys != nullptr) {
        const T* before = rings_before.data() + i * capacity * (Dk + Dv);
        std::copy(before, before + capacity * Dk, mine.keys);
        std::copy(before + capacity * Dk, before + capacity * (Dk + Dv), mine.values);
      }
      ring = mine;
    }
    const double* key_theta = rope ? spec.key_angles->data() + h * (Dk / 2) : nullptr;
    const double* value_theta =
        LatentPos::rotates_values ? spec.value_angles->data() + h * (Dv / 2) : nullptr;
    // Token t as the window stores it: R^s k_s (RoPE), R^{-s} v_s (VAPOR on the window).
    auto prepare = [&](index_t t) {
      const T* key = wk.row(b, t, h);
      const T* value = v.row(b, t, h);
      if (rope) {
        std::copy(key, key + Dk, s.key.data());
        s.key_rotation.rotate(s.key.data(), true);
        key = s.key.data();
      }
      if (vapor_window) {
        std::copy(value, value + Dv, s.value.data());
        s.value_rotation.rotate(s.value.data(), false);
        value = s.value.data();
      }
      return std::pair{key, value};
    };
    auto seek = [&](index_t t) {
      if (rope) s.key_rotation.seek(key_theta, first_position + t);
      if (vapor_window) s.value_rotation.seek(value_theta, first_position + t);
    };
    auto advance = [&] {
      if (rope) s.key_rotation.next();
      if (vapor_window) s.value_rotation.next();
    };
    // Prefill: the w tokens before `begin` (segments > 0 start past 4 (w + 1) tokens).
    if (begin > 0) {
      const index_t from = begin - (capacity - 1);
      seek(from);
      for (index_t t = from; t < begin; ++t, advance()) {
        const auto [key, value] = prepare(t);
        const index_t slot = static_cast<index_t>((first_position + t) % capacity);
        std::copy(key, key + Dk, ring.keys + slot * Dk);
        std::copy(value, value + Dv, ring.values + slot * Dv);
      }
    } else {
      seek(begin);
    }
    for (index_t t = begin; t < end; ++t, advance()) {
      const std::int64_t position = first_position + t;
      const T* query = wq.row(b, t, h);
      if (rope) {
        std::copy(query, query + Dk, s.query.data());
        s.key_rotation.rotate(s.query.data(), true);
        query = s.query.data();
      }
      const auto [key, value] = prepare(t);
      const index_t visible = std::min(fill + t + 1, capacity);
      cpu::softmax_decode_step(query, key, value, s.read.data(), ring, capacity, Dk, Dv,
                               static_cast<T>(spec.scale), position, visible);
      if (vapor_window) s.value_rotation.rotate(s.read.data(), true);  // R^t sum p0 R^{-s} v_s
      reference::macchiato_mix(reference::macchiato_shares(q.row(b, t, h), L), s.read.data(),
                               out.row(b, t, h), Dv);
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
  latte_causal_forward<Stab, LatentPos>(latent_logits(q), k, v, out, *spec.value_angles,
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
  latte_bidirectional_forward<Stab, LatentPos>(latent_logits(q), k, v, out, *spec.value_angles);
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

}  // namespace latte::cpu
