#pragma once
// CPU backend for Latte's backward (DESIGN §3.6; the recurrences and symbols
// of reference::latte_causal_backward, backends/reference/latte.hpp), one
// task per (batch, head) over OpenMP threads.
//
// Causal, in chunks of backward_chunk_tokens (16) tokens whose rows are
// prefetched into L2 a chunk ahead, a token's with each token (a head's rows
// are H * width elements apart, where the hardware prefetchers stop): pass 1
// runs the forward's key stage (absorb_keys: c_t, w_t, with the forward's
// headroom references) per token and the query softmax of the chunk's rows together, then the memory
// passes, backward_tokens (4) tokens at a time and one call over all rows in
// groups of 4 latent rows, M^ = c M^ + w v~ and <g~, M^> for each of the 4
// tokens with each row loaded and stored once, then each token's L-wide read
// backward. Pass 2 walks the chunks backwards with the adjoint passes, 4
// tokens and groups of 4 adjoint rows at a time: per token (last first) Mbar
// += (p / alpha^) g~, dv~ += w Mbar, <v~, Mbar>, Mbar *= c; rows and dv~
// loaded and stored once per 4 tokens. Where no running maximum moved in the
// 4 tokens (c = 1, nearly always once the maxima settle) both passes leave
// the rescale out: one FMA for M^'s update, three for the adjoint's, as the
// forward's passes. The 16 dots of a group stay in registers and are
// reduced together (simd::reduce_add_each). VAPOR rotates rows with the
// forward's RunRotations (one exact rotation per chunk, products after it),
// and learned angles run pass 1 a token at a time. The sums
// over the whole past (pass 1) and future (pass 2) are compensated
// (compensated_sums.hpp's ScaledTermWindow; latte_causal_backward_head).
//
// Bidirectional (DESIGN §3.6): five products per (batch, head), M^ = W^T V~,
// dp = G~ M^^T / alpha^, Mbar = (P / alpha^)^T G~, dv~ = W Mbar and
// dk = W o (V~ Mbar^T + Abar), in blocks of 64 tokens through the forward's
// register-tiled block contractions (W = exp(K - shift) taken again for the
// last two rather than kept: no T-long workspace).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "latte/backends/cpu/block_contractions.hpp"
#include "latte/backends/cpu/column_exps.hpp"
#include "latte/backends/cpu/compensated_sums.hpp"
#include "latte/backends/cpu/latte/forward.hpp"
#include "latte/backends/cpu/parallel.hpp"
#include "latte/backends/cpu/prefetch.hpp"
#include "latte/backends/cpu/rotation.hpp"
#include "latte/backends/cpu/run_rotations.hpp"
#include "latte/backends/cpu/simd.hpp"
#include "latte/backends/reference/latte.hpp"
#include "latte/core/checked_size.hpp"
#include "latte/core/eigen.hpp"
#include "latte/core/huge_page_allocator.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/policies/positional.hpp"
#include "latte/policies/stabilizer.hpp"
#include "latte/policies/summation.hpp"

namespace latte::cpu {

namespace detail {

/// The [1, T, 1, D] view of one (batch, head) of a [B, T, H, D] view.
template <class T>
TensorView<T, 4> head_view(const TensorView<T, 4>& x, index_t b, index_t h) {
  return TensorView<T, 4>(x.data() + b * x.stride(0) + h * x.stride(2),
                          {1, x.extent(1), 1, x.extent(3)},
                          {x.stride(0), x.stride(1), x.stride(2), x.stride(3)});
}

/// Token 0 of (batch b, head h) in a [B, T, H] view, or null when it is empty.
template <class T>
T* head_row(const TensorView<T, 3>& x, index_t b, index_t h) noexcept {
  return x.empty() ? nullptr : x.data() + b * x.stride(0) + h * x.stride(2);
}

/// Runs `backward(b, h, the head's angles (or null), d_angles of the task, worker)`
/// for every (batch, head) in parallel; per-task angle gradients are summed
/// into `d_angles` [H * (Dv/2)] afterwards, in a fixed order.
template <Real T, class Backward>
void for_each_head(const TensorView<const T, 4>& q, index_t Dv, const std::vector<double>& angles,
                   double* d_angles, Backward&& backward) {
  const index_t B = q.extent(0), H = q.extent(2), pairs = Dv / 2, heads = B * H;
  std::vector<double> task_d_angles(d_angles ? static_cast<std::size_t>(
                                                   latte::detail::checked_count<double>(
                                                       "d_angles", {heads, pairs}))
                                             : 0);
  parallel_for(heads, thread_count(), [&](index_t i, int worker) {
    const index_t b = i / H, h = i % H;
    const double* theta = angles.empty() ? nullptr : angles.data() + h * pairs;
    backward(b, h, theta, d_angles ? task_d_angles.data() + i * pairs : nullptr, worker);
  });
  if (d_angles)
    for (index_t i = 0; i < heads; ++i)
      for (index_t j = 0; j < pairs; ++j) d_angles[(i % H) * pairs + j] += task_d_angles[i * pairs + j];
}

}  // namespace detail

/// Tokens whose memory passes share one load and store of each row.
inline constexpr int backward_tokens = 4;
/// Latent rows per memory pass (R * G dot accumulators stay in registers).
inline constexpr int backward_latents = 4;

/// Sums of `count` batches' lanes into out[0 .. count): `width` at a time
/// through simd::reduce_add_each, the rest one by one.
template <Real T>
inline void reduce_each(const simd::batch<T>* lanes, int count, T* out) noexcept {
  constexpr int W = static_cast<int>(simd::width<T>);
  int i = 0;
  for (; i + W <= count; i += W) simd::store(out + i, simd::reduce_add_each(lanes + i));
  for (; i < count; ++i) out[i] = simd::reduce_add(lanes[i]);
}

/// One token's step of the compensated adjoint normaliser over its L latents
/// (reference::latte_causal_backward's Abar recurrence), `width` latents at a
/// time with the scalar steps lane by lane: the pair (hi, lo) of Abar_l gains
/// -rdp_l; dk_l = w_l (dot_l + Abar_l), 0 where w_l = 0; then the pair is
/// rescaled by c_l where c_l != 1 (latte::detail::compensated_scale).
template <Real T>
inline void compensated_normaliser_bar_step(T* hi, T* lo, const T* rdp, const T* c, const T* w, const T* dot,
                                            T* dk, index_t L) noexcept {
  index_t l = 0;
#if LATTE_WITH_XSIMD
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  const B zero(T(0)), one(T(1));
  for (; l + W <= L; l += W) {
    B high = simd::load(hi + l), low = simd::load(lo + l);
    cpu::detail::compensated_add(high, low, -simd::load(rdp + l));
    const B wl = simd::load(w + l);
    simd::store(dk + l, xsimd::select(wl == zero, zero, wl * (simd::load(dot + l) + high)));
    const B cl = simd::load(c + l);
    B scaled_high = high, scaled_low = low;
    cpu::detail::compensated_scale(scaled_high, scaled_low, cl);
    const auto rescale = cl != one;
    simd::store(hi + l, xsimd::select(rescale, scaled_high, high));
    simd::store(lo + l, xsimd::select(rescale, scaled_low, low));
  }
#endif
  for (; l < L; ++l) {
    latte::detail::compensated_add(hi[l], lo[l], -rdp[l]);
    dk[l] = w[l] == T(0) ? T(0) : w[l] * (dot[l] + hi[l]);  // hi: fl(hi + lo), the pair is renormalised
    if (c[l] != T(1)) latte::detail::compensated_scale(hi[l], lo[l], c[l]);
  }
}

/// Runs group(std::integral_constant<int, G>, l) over all L latent rows: groups
/// of G = backward_latents rows, then the last L mod G one at a time.
template <class Group>
[[gnu::always_inline]] inline void over_latent_groups(index_t L, Group&& group) {
  constexpr int G = backward_latents;
  index_t l = 0;
  for (; l + G <= L; l += G) group(std::integral_constant<int, G>{}, l);
  for (; l < L; ++l) group(std::integral_constant<int, 1>{}, l);
}

/// Pass 1's memory pass over one group of G latent rows for R tokens: for
/// r = 0 .. R-1, M^ = c_r M^ + w_r v~_r, then dots[r][j] = <g~_r, M^> (the
/// memory after token r). Each row is loaded and stored once for the R
/// tokens. c, w and dots: [R][L] (row stride L) from the block's first token
/// and latent l0; rows: memory + l0 Dv. Rescale false: every c_r is 1 (no
/// running maximum moved in the block, the common case), so the update is one
/// FMA, M^ + w_r v~_r, as in the forward.
template <int R, int G, bool Rescale, Real T>
[[gnu::always_inline]] inline void forward_group(T* rows, index_t Dv, const T* c, const T* w,
                                                 index_t L, const T* const* v, const T* const* g,
                                                 T* dots) noexcept {
  using B = simd::batch<T>;
  B acc[R * G];
  simd::unrolled<R * G>([&](auto i) { acc[i] = B(T(0)); });
  // Whole vectors, then a masked last one (Dv = 65): its lanes past Dv load
  // as 0 and add nothing to the dots.
  simd::for_each_vector<T>(Dv, [&](index_t d, index_t count, auto tail) {
    constexpr bool part = tail.value;
    B value[R], read[R];
    simd::unrolled<R>([&](auto r) {
      value[r] = simd::load_lanes<part>(v[r] + d, count);
      read[r] = simd::load_lanes<part>(g[r] + d, count);
    });
    simd::unrolled<G>([&](auto j) {
      T* row = rows + j * Dv + d;
      B m = simd::load_lanes<part>(row, count);
      simd::unrolled<R>([&](auto r) {
        if constexpr (Rescale) m = simd::fma(m, B(c[r * L + j]), B(w[r * L + j]) * value[r]);
        else m = simd::fma(B(w[r * L + j]), value[r], m);
        acc[r * G + j] = simd::fma(m, read[r], acc[r * G + j]);
      });
      simd::store_lanes<part>(row, m, count);
    });
  });
  T sums[R * G];
  reduce_each(acc, R * G, sums);
  simd::unrolled<R>([&](auto r) {
    simd::unrolled<G>([&](auto j) { dots[r * L + j] = sums[r * G + j]; });
  });
}

/// Pass 1's memory pass for R tokens over all L rows, one call a block (a call
/// per group spilled the row pointers; measured 16 % slower with plain sums).
template <int R, bool Rescale, Real T>
LATTE_FLATTEN void forward_block(T* memory, index_t Dv, const T* c, const T* w, index_t L,
                                 const T* const* v, const T* const* g, T* dots) noexcept {
  const T* value_row[R];  // local copies: the row stores cannot alias them
  const T* read_row[R];
  std::copy_n(v, R, value_row);
  std::copy_n(g, R, read_row);
  over_latent_groups(L, [&](auto group, index_t l) {
    forward_group<R, decltype(group)::value, Rescale>(memory + l * Dv, Dv, c + l, w + l, L,
                                                      value_row, read_row, dots + l);
  });
}

/// Pass 2's adjoint pass over one group of G adjoint rows for R tokens
/// (r = R-1 down to 0): Mbar += rw_r g~_r, dv~_r += w_r Mbar, dots[r][j] =
/// <v~_r, Mbar>, Mbar *= c_r. Rows and dv~ are loaded and stored once per
/// feature block. Rescale false: every c_r is 1 and the product is left out.
template <int R, int G, bool Rescale, Real T>
[[gnu::always_inline]] inline void adjoint_group(T* rows, index_t Dv, const T* rw, const T* w,
                                                 const T* c, index_t L, const T* const* g,
                                                 const T* const* v, T* const* dv,
                                                 T* dots) noexcept {
  using B = simd::batch<T>;
  B acc[R * G];
  simd::unrolled<R * G>([&](auto i) { acc[i] = B(T(0)); });
  // Whole vectors, then a masked last one (lanes past Dv load as 0).
  simd::for_each_vector<T>(Dv, [&](index_t d, index_t count, auto tail) {
    constexpr bool part = tail.value;
    B read[R], value[R], dv_block[R];
    simd::unrolled<R>([&](auto r) {
      read[r] = simd::load_lanes<part>(g[r] + d, count);
      value[r] = simd::load_lanes<part>(v[r] + d, count);
      dv_block[r] = simd::load_lanes<part>(dv[r] + d, count);
    });
    simd::unrolled<G>([&](auto j) {
      T* row = rows + j * Dv + d;
      B bar = simd::load_lanes<part>(row, count);
      simd::unrolled<R>([&](auto step) {
        constexpr int r = R - 1 - decltype(step)::value;
        bar = simd::fma(B(rw[r * L + j]), read[r], bar);
        dv_block[r] = simd::fma(B(w[r * L + j]), bar, dv_block[r]);
        acc[r * G + j] = simd::fma(bar, value[r], acc[r * G + j]);
        if constexpr (Rescale) bar = bar * B(c[r * L + j]);
      });
      simd::store_lanes<part>(row, bar, count);
    });
    simd::unrolled<R>([&](auto r) { simd::store_lanes<part>(dv[r] + d, dv_block[r], count); });
  });
  T sums[R * G];
  reduce_each(acc, R * G, sums);
  simd::unrolled<R>([&](auto r) {
    simd::unrolled<G>([&](auto j) { dots[r * L + j] = sums[r * G + j]; });
  });
}

/// Pass 2's adjoint pass for R tokens over all L rows, one call a block (as
/// forward_block).
template <int R, bool Rescale, Real T>
LATTE_FLATTEN void adjoint_block(T* memory_bar, index_t Dv, const T* rw, const T* w, const T* c,
                                 index_t L, const T* const* g, const T* const* v, T* const* dv,
                                 T* dots) noexcept {
  const T* read_row[R];  // local copies (as forward_block)
  const T* value_row[R];
  T* dv_row[R];
  std::copy_n(g, R, read_row);
  std::copy_n(v, R, value_row);
  std::copy_n(dv, R, dv_row);
  over_latent_groups(L, [&](auto group, index_t l) {
    adjoint_group<R, decltype(group)::value, Rescale>(memory_bar + l * Dv, Dv, rw + l, w + l, c + l,
                                                      L, read_row, value_row, dv_row, dots + l);
  });
}

/// Tokens of a chunk: the backward's L-wide stages run for a chunk at a time
/// (the query softmax of its rows together), its rows are prefetched a chunk
/// ahead, and its row passes go backward_tokens at a time. (Tried: a chunk in
/// which no maximum moved as Eigen matrix products, the chunked form of
/// flash-linear-attention; at 16 to 64 tokens Eigen's packing made the
/// backward 25-50 % slower than the row passes.)
inline constexpr index_t backward_chunk_tokens = 16;

/// Per-worker scratch of the causal backward: per token c, w, p / alpha^,
/// p dp / alpha^ (4 T L), whether each token moved a running maximum, the
/// carry and its adjoints, a chunk's rows and (VAPOR) rotations, and
/// (compensated sums) the window of terms since the last fold, the low parts
/// of the normaliser's adjoint and a token's weights.
template <Real T>
struct LatteBackwardScratch {
  LatteBackwardScratch(index_t Tn, index_t L, index_t Dv)
      : per_token(static_cast<std::size_t>(
            latte::detail::checked_count<T>("query_logits", {4, Tn, L}))),
        carry(static_cast<std::size_t>(2 * L + L * Dv)),
        memory_bar(static_cast<std::size_t>(L * Dv)),
        latent(static_cast<std::size_t>((3 * backward_chunk_tokens + 3) * L + backward_chunk_tokens)),
        rows(static_cast<std::size_t>(4 * backward_chunk_tokens * Dv)),
        token_rescaled(static_cast<std::size_t>(Tn)), window(L, Dv),
        rotation(Dv / 2, backward_chunk_tokens),
        rotation_rows(static_cast<std::size_t>(2 * backward_chunk_tokens * Dv)) {}
  UninitializedBuffer<T> per_token;  // written by pass 1 before pass 2 reads it
  AlignedVector<T> carry, memory_bar, latent, rows;
  std::vector<unsigned char> token_rescaled;  // per token: did a running maximum move (a c != 1)
  ScaledTermWindow<T> window;
  RunRotations<T> rotation;      // VAPOR: a chunk's rotations (run_rotations.hpp),
  AlignedVector<T> rotation_rows;  // as [C][Dv] cos rows, then [C][Dv] sin rows
};

/// One (batch, head) of the causal backward: views of [1, T, 1, *].
///
/// Compensated sums (Sum = CompensatedSums; compensated_sums.hpp): the four
/// sums over the whole past or future, the recomputed memory M^ and
/// normaliser alpha^ of pass 1 and the adjoints Mbar and Abar of pass 2, keep
/// their error independent of T. M^, alpha^ and Mbar keep their plain running
/// sums for the reads and restart them every fold_tokens tokens from pairs
/// fed by a ScaledTermWindow; Abar (L values a token) is a pair updated by
/// TwoSum per token.
template <Stabilizer Stab, Positional Pos, Summation Sum, Real T, class InitialOf,
          class FinalGradientOf, class InitialGradientOf>
void latte_causal_backward_head(TensorView<const T, 4> q, TensorView<const T, 4> k,
                                TensorView<const T, 4> v, TensorView<const T, 4> g,
                                TensorView<T, 4> dq, TensorView<T, 4> dk, TensorView<T, 4> dv,
                                const double* theta, std::int64_t first_position,
                                InitialOf&& initial_of, FinalGradientOf&& final_gradient,
                                InitialGradientOf&& initial_gradient, double* d_theta,
                                LatteBackwardScratch<T>& scratch, T* read_dots,
                                index_t read_dots_stride) {
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  constexpr int R = backward_tokens;
  const index_t Tn = q.extent(1), L = q.extent(3), Dv = v.extent(3);
  T* const carry_scale = scratch.per_token.data();
  T* const weight = carry_scale + Tn * L;
  T* const read_weight = weight + Tn * L;
  T* const read_dp = read_weight + Tn * L;
  T* const memory_bar = scratch.memory_bar.data();
  constexpr index_t C = backward_chunk_tokens;
  T* const p = scratch.latent.data();        // [C][L] e, then p
  T* const alpha = p + C * L;                // [C][L] alpha^ after each token
  T* const dots = alpha + C * L;             // [C][L]
  T* const normaliser_bar = dots + C * L;    // [L]
  T* const normaliser_bar_low = normaliser_bar + L;  // [L] (compensated sums)
  T* const term_weight = normaliser_bar_low + L;     // [L] (compensated sums)
  T* const beta = term_weight + L;                   // [C]
  ScaledTermWindow<T>& window = scratch.window;
  T* const row_buffer = scratch.rows.data(); // [4][C][Dv]: v~, g~, dv~, y
  const LatteCarry<T> carry{scratch.carry.data(), scratch.carry.data() + L,
                            scratch.carry.data() + 2 * L};
  initial_of(carry);
  if constexpr (Sum::compensated) window.start(carry.memory, carry.normaliser);
  // VAPOR (eq. 22): the rotations R^p of the chunk's n positions from token
  // t0, row r for token t0 + r, as the forward's scan makes them
  // (run_rotations.hpp: products of one exact rotation per chunk).
  const T* const rotation_cos = scratch.rotation_rows.data();
  const T* const rotation_sin = rotation_cos + C * Dv;
  auto chunk_rotations = [&](index_t t0, index_t n) {
    if constexpr (Pos::rotates_values) {
      scratch.rotation.seek(theta, first_position + t0);
      scratch.rotation.fill(n, scratch.rotation_rows.data(), scratch.rotation_rows.data() + C * Dv, Dv);
    } else {
      (void)t0, (void)n;
    }
  };
  // v~_t = R^{-t} v_t and g~_t (VAPOR) or the rows themselves; r: the token's
  // row in its chunk.
  auto rows_of = [&](index_t t, int r, const T*& vt, const T*& gt) {
    if constexpr (!Pos::rotates_values) {
      vt = v.row(0, t, 0);
      gt = g.row(0, t, 0);
      (void)r;
    } else {
      T* vr = row_buffer + r * Dv;
      T* gr = row_buffer + (C + r) * Dv;
      rotate_pairs<false>(v.row(0, t, 0), vr, rotation_cos + r * Dv, rotation_sin + r * Dv, Dv);
      rotate_pairs<false>(g.row(0, t, 0), gr, rotation_cos + r * Dv, rotation_sin + r * Dv, Dv);
      vt = vr;
      gt = gr;
    }
  };
  // Whether a running maximum moved at any of tokens [t, t + count) (a c != 1).
  auto any_rescaled = [&](index_t t, index_t count) {
    const auto first = scratch.token_rescaled.begin() + t;
    return std::find(first, first + count, static_cast<unsigned char>(1)) != first + count;
  };
  // Pass 1, forward, C tokens at a time: the key and query stages, the memory
  // pass (M^ updates and <g~, M^>), then each token's read backward.
  // With learned VAPOR angles each token's read y_t = sum_l rw_l M^_{t,l}
  // needs the memory after that token: chunks of one token then.
  const index_t block_tokens = d_theta ? 1 : C;
  T* const y = row_buffer + 3 * C * Dv;
  for (index_t t0 = 0; t0 < Tn; t0 += block_tokens) {
    const int n = static_cast<int>(std::min<index_t>(block_tokens, Tn - t0));
    chunk_rotations(t0, n);
    const T* vt[C];
    const T* gt[C];
    for (int r = 0; r < n; ++r) {
      const index_t t = t0 + r;
      // The next chunk's rows into L2, a token's with each token (spread over
      // the chunk: 6 % faster than all at its start): a head's rows are H *
      // width elements apart, a new page every token or two, where the
      // hardware prefetchers stop (prefetch.hpp).
      if (t + block_tokens < Tn) prefetch_token_rows<CacheLevel::l2>(0, t + block_tokens, 0, k, q, v, g, dq);
      scratch.token_rescaled[static_cast<std::size_t>(t)] =
          absorb_keys<Stab>(k.row(0, t, 0), carry, carry_scale + t * L, weight + t * L, L);
      std::copy(carry.normaliser, carry.normaliser + L, alpha + r * L);
      rows_of(t, r, vt[r], gt[r]);
    }
    latent_softmax_exps(q.row(0, t0, 0), q.stride(1), n, L, p, beta);  // the block's rows together
    const T* c = carry_scale + t0 * L;
    const T* w = weight + t0 * L;
    // The memory pass, R tokens at a time (the last n mod R one at a time);
    // R tokens in which no running maximum moved take the one-FMA update.
    int r = 0;
    for (; r + R <= n; r += R)
      if (any_rescaled(t0 + r, R))
        forward_block<R, true>(carry.memory, Dv, c + r * L, w + r * L, L, vt + r, gt + r, dots + r * L);
      else
        forward_block<R, false>(carry.memory, Dv, c + r * L, w + r * L, L, vt + r, gt + r, dots + r * L);
    for (; r < n; ++r)
      forward_block<1, true>(carry.memory, Dv, c + r * L, w + r * L, L, vt + r, gt + r, dots + r * L);
    if constexpr (Sum::compensated) {
      for (int r = 0; r < n; ++r)
        if (scratch.token_rescaled[static_cast<std::size_t>(t0 + r)])
          window.append(c + r * L, w + r * L, vt[r]);
        else
          window.append(w + r * L, vt[r]);  // c = 1: nothing to rescale
      if (!window.has_room(C) || t0 + n == Tn) window.fold(carry.memory, carry.normaliser);
    }
    for (int r = 0; r < n; ++r) {
      const index_t t = t0 + r;
      T* pr = p + r * L;
      T* dp = dots + r * L;
      const T* a = alpha + r * L;
      T* rw = read_weight + t * L;
      T* rdp = read_dp + t * L;
      const T inverse_beta = beta[r] == T(0) ? T(0) : T(1) / beta[r];
      B mean_lanes(T(0));
      index_t l = 0;
      for (; l + W <= L; l += W) {
        const B al = simd::load(a + l), zero(T(0));
        const B pl = simd::load(pr + l) * B(inverse_beta);
        // One division a latent: 1 / alpha^, 0 for an empty latent (alpha^ = 0).
        const B inverse_alpha = simd::replace_where_equal(
            al, T(0), zero, B(T(1)) / simd::replace_where_equal(al, T(0), B(T(1)), al));
        const B dpl = simd::load(dp + l) * inverse_alpha;
        const B read = pl * inverse_alpha;
        simd::store(pr + l, pl);
        simd::store(dp + l, dpl);
        simd::store(rw + l, read);
        simd::store(rdp + l, read * dpl);
        mean_lanes = simd::fma(pl, dpl, mean_lanes);
      }
      T mean_dp = simd::reduce_add(mean_lanes);
      for (; l < L; ++l) {
        const T pl = pr[l] * inverse_beta;
        pr[l] = pl;
        dp[l] = a[l] == T(0) ? T(0) : dp[l] / a[l];
        rw[l] = a[l] == T(0) ? T(0) : pl / a[l];
        rdp[l] = rw[l] * dp[l];
        mean_dp += pl * dp[l];
      }
      T* dqt = dq.row(0, t, 0);
      for (l = 0; l < L; ++l) dqt[l] = pr[l] * (dp[l] - mean_dp);
      if (read_dots) read_dots[t * read_dots_stride] = mean_dp;  // <g_t, o_t>
      if (d_theta) {  // n == 1: the memory is the one after token t
        std::fill(y, y + Dv, T(0));
        for (l = 0; l < L; ++l)
          for (index_t d = 0; d < Dv; ++d) y[d] += rw[l] * carry.memory[l * Dv + d];
        reference::accumulate_angle_gradient(d_theta, Dv, gt[r], y, t);
      }
    }
  }
  // Pass 2, reverse, R tokens at a time (last block first).
  std::fill(memory_bar, memory_bar + L * Dv, T(0));
  std::fill(normaliser_bar, normaliser_bar + L, T(0));
  std::fill(normaliser_bar_low, normaliser_bar_low + L, T(0));
  const reference::LatteCarryGradient<const T> final_bar = final_gradient(carry.running_max);
  if (final_bar.memory) std::copy(final_bar.memory, final_bar.memory + L * Dv, memory_bar);
  if (final_bar.normaliser) std::copy(final_bar.normaliser, final_bar.normaliser + L, normaliser_bar);
  if constexpr (Sum::compensated) window.start(memory_bar, nullptr);
  if (d_theta && final_bar.memory && first_position != 0)
    for (index_t l = 0; l < L; ++l)
      reference::accumulate_angle_gradient(d_theta, Dv, final_bar.memory + l * Dv,
                                           carry.memory + l * Dv, -first_position);
  const index_t last_block = (Tn - 1) / C * C;
  for (index_t t0 = last_block; t0 >= 0; t0 -= C) {
    const int n = static_cast<int>(std::min<index_t>(C, Tn - t0));
    chunk_rotations(t0, n);
    const T* vt[C];
    const T* gt[C];
    T* dvt[C];
    for (int r = 0; r < n; ++r) {
      // The previous chunk's rows and per-token stages into L2 (as pass 1).
      if (const index_t s = t0 + r - C; s >= 0) {
        prefetch_token_rows<CacheLevel::l2>(0, s, 0, v, g, dk, dv);
        for (const T* stage : {carry_scale, weight, read_weight, read_dp})
          prefetch_row<CacheLevel::l2>(stage + s * L, sizeof(T) * static_cast<std::size_t>(L));
      }
      rows_of(t0 + r, r, vt[r], gt[r]);
      // dv~ in dv's row itself unless VAPOR rotates it after.
      dvt[r] = Pos::rotates_values ? row_buffer + (2 * C + r) * Dv : dv.row(0, t0 + r, 0);
    }
    const T* c = carry_scale + t0 * L;
    const T* w = weight + t0 * L;
    const T* rw = read_weight + t0 * L;
    // The adjoint pass, last tokens first: R a pass, then the first n mod R
    // one at a time. It accumulates dv~.
    for (int r = 0; r < n; ++r) std::fill(dvt[r], dvt[r] + Dv, T(0));
    int r = n;
    for (; r - R >= n % R; r -= R)
      if (any_rescaled(t0 + r - R, R))
        adjoint_block<R, true>(memory_bar, Dv, rw + (r - R) * L, w + (r - R) * L, c + (r - R) * L, L,
                               gt + r - R, vt + r - R, dvt + r - R, dots + (r - R) * L);
      else
        adjoint_block<R, false>(memory_bar, Dv, rw + (r - R) * L, w + (r - R) * L, c + (r - R) * L, L,
                                gt + r - R, vt + r - R, dvt + r - R, dots + (r - R) * L);
    for (--r; r >= 0; --r)
      adjoint_block<1, true>(memory_bar, Dv, rw + r * L, w + r * L, c + r * L, L, gt + r, vt + r,
                             dvt + r, dots + r * L);
    if constexpr (Sum::compensated) {
      // Token t adds rw_t g~_t and then scales by c_t: a term c_t rw_t g~_t
      // after a rescale c_t, latest token first as the pass went.
      for (int r = n - 1; r >= 0; --r) {
        if (!scratch.token_rescaled[static_cast<std::size_t>(t0 + r)]) {
          window.append(rw + r * L, gt[r]);  // c = 1: the term is rw_t g~_t
          continue;
        }
        for (index_t l = 0; l < L; ++l)
          term_weight[l] = latte::detail::rounded_product(c[r * L + l], rw[r * L + l]);
        window.append(c + r * L, term_weight, gt[r]);
      }
      if (!window.has_room(C) || t0 == 0) window.fold(memory_bar, nullptr);
    }
    for (int r = n - 1; r >= 0; --r) {
      const index_t t = t0 + r;
      const T* cr = c + r * L;
      const T* wr = w + r * L;
      const T* rdp = read_dp + t * L;
      const T* dot = dots + r * L;
      T* dkt = dk.row(0, t, 0);
      if constexpr (Sum::compensated) {
        compensated_normaliser_bar_step(normaliser_bar, normaliser_bar_low, rdp, cr, wr, dot, dkt, L);
      } else {
        for (index_t l = 0; l < L; ++l) {
          const T abar = normaliser_bar[l] - rdp[l];
          dkt[l] = wr[l] == T(0) ? T(0) : wr[l] * (dot[l] + abar);
          normaliser_bar[l] = abar * cr[l];
        }
      }
      if (d_theta) reference::accumulate_angle_gradient(d_theta, Dv, dvt[r], vt[r], -t);
      if constexpr (Pos::rotates_values)  // dv = R^t dv~
        rotate_pairs<true>(dvt[r], dv.row(0, t, 0), rotation_cos + r * Dv, rotation_sin + r * Dv, Dv);
    }
  }
  if (d_theta && first_position != 0) {
    initial_of(carry);
    for (index_t l = 0; l < L; ++l)
      reference::accumulate_angle_gradient(d_theta, Dv, memory_bar + l * Dv,
                                           carry.memory + l * Dv, first_position);
  }
  const reference::LatteCarryGradient<T> initial_bar = initial_gradient();
  if (initial_bar.memory) std::copy(memory_bar, memory_bar + L * Dv, initial_bar.memory);
  if (initial_bar.normaliser)
    std::copy(normaliser_bar, normaliser_bar + L, initial_bar.normaliser);
}

/// Causal Latte backward; the arguments are reference::latte_causal_backward's.
template <Stabilizer Stab, Positional Pos, Summation Sum = CompensatedSums, Real T,
          class InitialOf, class FinalGradientOf, class InitialGradientOf>
void latte_causal_backward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                           TensorView<const T, 4> v, TensorView<const T, 4> g,
                           TensorView<T, 4> dq, TensorView<T, 4> dk, TensorView<T, 4> dv,
                           const std::vector<double>& angles, std::int64_t first_position,
                           InitialOf&& initial_of, FinalGradientOf&& final_gradient_of,
                           InitialGradientOf&& initial_gradient_of, double* d_angles,
                           TensorView<T, 3> read_dots = {}) {
  using detail::head_view;
  std::vector<LatteBackwardScratch<T>> scratch;  // one per worker
  for (int worker = 0; worker < thread_count(); ++worker)
    scratch.emplace_back(q.extent(1), q.extent(3), v.extent(3));
  detail::for_each_head<T>(q, v.extent(3), angles, d_angles,
                           [&](index_t b, index_t h, const double* theta,
                               double* head_d_angles, int worker) {
    latte_causal_backward_head<Stab, Pos, Sum>(
        head_view(q, b, h), head_view(k, b, h), head_view(v, b, h), head_view(g, b, h),
        head_view(dq, b, h), head_view(dk, b, h), head_view(dv, b, h),
        theta, first_position,
        [&](LatteCarry<T> carry) { initial_of(b, h, carry); },
        [&](const T* m_T) { return final_gradient_of(b, h, m_T); },
        [&] { return initial_gradient_of(b, h); }, head_d_angles,
        scratch[static_cast<std::size_t>(worker)], detail::head_row(read_dots, b, h),
        read_dots.empty() ? 0 : read_dots.stride(1));
  });
}

/// Tokens per block of the bidirectional backward: a block's key
/// exponentials, latent weights and rows (3 x 16 KiB for L = Dv = 64, fp32)
/// stay in L1 while block_contractions.hpp's tiles stream them, as in the
/// forward's bidirectional pass.
inline constexpr index_t bidirectional_backward_block = 64;

/// Per-worker scratch of the bidirectional backward: one block's exponentials
/// W, weights P / alpha^, dp and rows (V~ or G~, and dV~ or the outputs y), a
/// head's M^ and Mbar with their transposes, and per latent the shift,
/// 1 / alpha^ and Abar. Nothing grows with T.
template <Real T>
struct LatteBidirectionalBackwardScratch {
  LatteBidirectionalBackwardScratch(index_t L, index_t Dv)
      : latent_blocks(static_cast<std::size_t>(3 * bidirectional_backward_block * L)),
        row_blocks(static_cast<std::size_t>(2 * bidirectional_backward_block * Dv)),
        memories(static_cast<std::size_t>(4 * L * Dv)),
        latents(static_cast<std::size_t>(5 * L)),
        beta(static_cast<std::size_t>(bidirectional_backward_block)),
        rotation(Dv / 2), out_rotation(Dv / 2) {}
  AlignedVector<T> latent_blocks, row_blocks, memories, latents, beta;
  RotationStepper<T> rotation, out_rotation;  // VAPOR: R^{-s} of the rows, R^{s} of dV~
};

/// One (batch, head) of the bidirectional backward: views of [1, T, 1, *].
///
/// DESIGN §3.6 in blocks of bidirectional_backward_block tokens, each product
/// a register-tiled contraction of a block with an L x Dv matrix
/// (block_contractions.hpp: E^T V and G M, as the forward's bidirectional pass):
///   keys:    W = exp(K - shift) (the shift each latent's column maximum, the
///            forward's reference), alpha^ = 1^T W, M^ = W^T V~;
///   queries: dp = G~ M^^T / alpha^, D_t = <p_t, dp_t>, dq = p o (dp - D),
///            rw = p / alpha^, Abar = -sum_t rw o dp, Mbar = rw^T G~;
///   keys:    dV~ = W Mbar, dk = W o (V~ Mbar^T + Abar)  (W again, not kept).
/// VAPOR rotates the rows as they are copied into the block (RotationStepper,
/// the forward's), and dV~ back by R^{s}.
template <Stabilizer Stab, Positional Pos, Real T>
void latte_bidirectional_backward_head(TensorView<const T, 4> q, TensorView<const T, 4> k,
                                       TensorView<const T, 4> v, TensorView<const T, 4> g,
                                       TensorView<T, 4> dq, TensorView<T, 4> dk,
                                       TensorView<T, 4> dv, const double* theta,
                                       double* d_theta, T* read_dots, index_t read_dots_stride,
                                       LatteBidirectionalBackwardScratch<T>& scratch) {
  using B = simd::batch<T>;
  constexpr index_t C = bidirectional_backward_block;
  constexpr T lowest = -std::numeric_limits<T>::infinity();
  const index_t Tn = q.extent(1), L = q.extent(3), Dv = v.extent(3);
  if (Tn == 0) return;
  T* const w = scratch.latent_blocks.data();  // [C][L] exp(K - shift)
  T* const p = w + C * L;                     // [C][L] p, then rw = p / alpha^
  T* const dp = p + C * L;                    // [C][L]
  T* const rows = scratch.row_blocks.data();  // [C][Dv] V~ or G~
  T* const out_rows = rows + C * Dv;          // [C][Dv] dV~ or y
  T* const memory = scratch.memories.data();  // M^ [L][Dv]
  T* const memory_t = memory + L * Dv;        // M^^T [Dv][L]
  T* const memory_bar = memory_t + L * Dv;    // Mbar [L][Dv]
  T* const memory_bar_t = memory_bar + L * Dv;
  T* const shift = scratch.latents.data();
  T* const inverse_alpha = shift + L;
  T* const normaliser_bar = inverse_alpha + L;  // Abar
  T* const column_sum = normaliser_bar + L;
  T* const column_max = column_sum + L;
  std::fill(memory, memory + L * Dv, T(0));
  std::fill(memory_bar, memory_bar + L * Dv, T(0));
  std::fill(inverse_alpha, inverse_alpha + L, T(0));  // alpha^ until it is inverted
  std::fill(normaliser_bar, normaliser_bar + L, T(0));
  const index_t ks = k.stride(1), vs = v.stride(1), qs = q.stride(1);

  // The shift: each latent's column maximum over the whole sequence.
  std::fill(shift, shift + L, lowest);
  for (index_t t0 = 0; t0 < Tn; t0 += C) {
    const index_t n = std::min(C, Tn - t0);
    column_max_rows(k.row(0, t0, 0), ks, n, L, column_max);
    for (index_t l = 0; l < L; ++l) shift[l] = std::max(shift[l], column_max[l]);
  }
  for (index_t l = 0; l < L; ++l) shift[l] = Stab::reference_for(shift[l]);
  // W of the block at t0, its value rows R^{-s} v_s into `rows` (copied in the
  // pass over the keys).
  auto key_block = [&](index_t t0, index_t n) {
    const RowCopy<T> values{v.row(0, t0, 0), vs, Dv, rows};
    shifted_column_exps(k.row(0, t0, 0), ks, n, L, shift, w, column_sum, column_max, &values);
    if constexpr (Pos::rotates_values)
      for (index_t r = 0; r < n; ++r) {
        scratch.rotation.rotate(rows + r * Dv, /*forward=*/false);
        scratch.rotation.next();
      }
  };

  // Keys: alpha^ and M^ = W^T V~.
  if constexpr (Pos::rotates_values) scratch.rotation.seek(theta, 0);
  for (index_t t0 = 0; t0 < Tn; t0 += C) {
    const index_t n = std::min(C, Tn - t0);
    prefetch_next_block(0, 0, t0, C, Tn, k, v);
    key_block(t0, n);
    for (index_t l = 0; l < L; ++l) inverse_alpha[l] += column_sum[l];
    accumulate_outer_products(w, n, L, rows, memory, Dv);
  }
  for (index_t l = 0; l < L; ++l)  // 0 for an empty latent (alpha^ = 0)
    inverse_alpha[l] = inverse_alpha[l] == T(0) ? T(0) : T(1) / inverse_alpha[l];
  transpose_into(memory, L, Dv, memory_t);

  // Queries: dp, dq, rw, Abar and Mbar = rw^T G~.
  if constexpr (Pos::rotates_values) scratch.rotation.seek(theta, 0);
  for (index_t t0 = 0; t0 < Tn; t0 += C) {
    const index_t n = std::min(C, Tn - t0);
    prefetch_next_block(0, 0, t0, C, Tn, q, g, dq);
    for (index_t r = 0; r < n; ++r) {
      simd::copy(g.row(0, t0 + r, 0), Dv, rows + r * Dv);
      if constexpr (Pos::rotates_values) {
        scratch.rotation.rotate(rows + r * Dv, /*forward=*/false);  // G~ = R^{-t} g_t
        scratch.rotation.next();
      }
    }
    read_memory_rows(rows, n, Dv, memory_t, L, dp, L, nullptr);  // <g~_t, M^_l>
    latent_softmax_exps(q.row(0, t0, 0), qs, n, L, p, scratch.beta.data());
    for (index_t r = 0; r < n; ++r) {
      T* pr = p + r * L;
      T* dpr = dp + r * L;
      const T beta = scratch.beta[static_cast<std::size_t>(r)];
      const B inverse_beta(beta == T(0) ? T(0) : T(1) / beta);
      B mean_lanes(T(0));
      simd::for_each_vector<T>(L, [&](index_t l, index_t count, auto tail) {
        constexpr bool part = tail.value;  // lanes past L: 0, stored nowhere
        const B pl = simd::load_lanes<part>(pr + l, count) * inverse_beta;
        const B dpl = simd::load_lanes<part>(dpr + l, count) * simd::load_lanes<part>(inverse_alpha + l, count);
        simd::store_lanes<part>(pr + l, pl, count);
        simd::store_lanes<part>(dpr + l, dpl, count);
        mean_lanes = simd::fma(pl, dpl, mean_lanes);
      });
      const T mean_dp = simd::reduce_add(mean_lanes);  // D_t = <g_t, o_t>
      if (read_dots) read_dots[(t0 + r) * read_dots_stride] = mean_dp;
      const B mean(mean_dp);
      T* dqt = dq.row(0, t0 + r, 0);
      simd::for_each_vector<T>(L, [&](index_t l, index_t count, auto tail) {
        constexpr bool part = tail.value;
        const B pl = simd::load_lanes<part>(pr + l, count), dpl = simd::load_lanes<part>(dpr + l, count);
        const B rw = pl * simd::load_lanes<part>(inverse_alpha + l, count);
        simd::store_lanes<part>(dqt + l, pl * (dpl - mean), count);
        simd::store_lanes<part>(pr + l, rw, count);
        simd::store_lanes<part>(normaliser_bar + l,
                                simd::load_lanes<part>(normaliser_bar + l, count) - rw * dpl, count);
      });
    }
    if constexpr (Pos::rotates_values) {
      if (d_theta) {  // y_t = sum_l rw_l M^_l, the unrotated output
        read_memory_rows(p, n, L, memory, Dv, out_rows, Dv, nullptr);
        for (index_t r = 0; r < n; ++r)
          reference::accumulate_angle_gradient(d_theta, Dv, rows + r * Dv, out_rows + r * Dv, t0 + r);
      }
    }
    accumulate_outer_products(p, n, L, rows, memory_bar, Dv);
  }
  transpose_into(memory_bar, L, Dv, memory_bar_t);

  // Keys again: dV~ = W Mbar and dk = W o (V~ Mbar^T + Abar).
  if constexpr (Pos::rotates_values) {
    scratch.rotation.seek(theta, 0);
    scratch.out_rotation.seek(theta, 0);
  }
  for (index_t t0 = 0; t0 < Tn; t0 += C) {
    const index_t n = std::min(C, Tn - t0);
    prefetch_next_block(0, 0, t0, C, Tn, k, v, dk, dv);
    key_block(t0, n);
    if constexpr (Pos::rotates_values) {
      read_memory_rows(w, n, L, memory_bar, Dv, out_rows, Dv, nullptr);
      for (index_t r = 0; r < n; ++r) {
        T* dvt = out_rows + r * Dv;
        if (d_theta) reference::accumulate_angle_gradient(d_theta, Dv, dvt, rows + r * Dv, -(t0 + r));
        scratch.out_rotation.rotate(dvt, /*forward=*/true);  // dv = R^{s} dV~
        scratch.out_rotation.next();
        simd::copy(dvt, Dv, dv.row(0, t0 + r, 0));
      }
    } else {
      read_memory_rows(w, n, L, memory_bar, Dv, dv.row(0, t0, 0), dv.stride(1), nullptr);
    }
    read_memory_rows(rows, n, Dv, memory_bar_t, L, dk.row(0, t0, 0), dk.stride(1), nullptr);
    for (index_t r = 0; r < n; ++r) {
      T* dkt = dk.row(0, t0 + r, 0);
      const T* wr = w + r * L;
      simd::for_each_vector<T>(L, [&](index_t l, index_t count, auto tail) {
        constexpr bool part = tail.value;
        const B wl = simd::load_lanes<part>(wr + l, count);
        const B term = wl * (simd::load_lanes<part>(dkt + l, count) +
                             simd::load_lanes<part>(normaliser_bar + l, count));
        simd::store_lanes<part>(dkt + l, simd::replace_where_equal(wl, T(0), B(T(0)), term), count);
      });
    }
  }
}

/// Bidirectional Latte backward; the arguments are reference::latte_bidirectional_backward's.
template <Stabilizer Stab, Positional Pos, Real T>
void latte_bidirectional_backward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                                  TensorView<const T, 4> v, TensorView<const T, 4> g,
                                  TensorView<T, 4> dq, TensorView<T, 4> dk, TensorView<T, 4> dv,
                                  const std::vector<double>& angles, double* d_angles,
                                  TensorView<T, 3> read_dots = {}) {
  using detail::head_view;
  std::vector<LatteBidirectionalBackwardScratch<T>> scratch;  // one per worker
  for (int worker = 0; worker < thread_count(); ++worker) scratch.emplace_back(q.extent(3), v.extent(3));
  detail::for_each_head<T>(q, v.extent(3), angles, d_angles,
                           [&](index_t b, index_t h, const double* theta,
                               double* head_d_angles, int worker) {
    latte_bidirectional_backward_head<Stab, Pos>(
        head_view(q, b, h), head_view(k, b, h), head_view(v, b, h), head_view(g, b, h),
        head_view(dq, b, h), head_view(dk, b, h), head_view(dv, b, h),
        theta, head_d_angles, detail::head_row(read_dots, b, h),
        read_dots.empty() ? 0 : read_dots.stride(1), scratch[static_cast<std::size_t>(worker)]);
  });
}

/// reference::latte_final_state_backward on the CPU: per (batch, head), runs of
/// 64 tokens: W = exp(K - m) (Eigen's vectorised exp), the run's values
/// rotated R^{-s} (VAPOR, rows from RunRotations), then two GEMMs,
/// dK += W o (1 Dalpha^T + V~ Dvtilde^T) and dV~ = W Dvtilde, and R^{s} dV~
/// into dv; the angle terms per token. Heads in parallel; the angle sums of a
/// head's batch entries added in order afterwards.
template <Positional Pos, Real T, class FinalOf>
void latte_final_state_backward(TensorView<const T, 4> k, TensorView<const T, 4> v,
                                const std::vector<double>& angles, std::int64_t first_position,
                                FinalOf&& final_of, TensorView<T, 4> dk, TensorView<T, 4> dv,
                                double* d_theta) {
  using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Row = Eigen::Matrix<T, 1, Eigen::Dynamic>;
  const index_t B = k.extent(0), Tn = k.extent(1), H = k.extent(2), L = k.extent(3);
  const index_t Dv = v.extent(3), pairs = Dv / 2, heads = B * H;
  if (Tn == 0 || heads == 0) return;
  constexpr index_t run = 64;
  const double work = double(heads) * double(Tn) * double(L) * double(Dv);
  const int workers = work >= 1 << 18 ? thread_count() : 1;
  const bool angles_wanted = Pos::rotates_values && d_theta != nullptr;
  std::vector<double> head_theta(angles_wanted ? static_cast<std::size_t>(heads * pairs) : 0, 0.0);
  parallel_for(heads, workers, [&](index_t i, int) {
    const index_t b = i / H, h = i % H;
    const auto [m, d_normaliser, d_memory] = final_of(b, h);
    // A latent whose reference is -inf saw only -inf keys: its weights are 0.
    Row reference(L);
    for (index_t l = 0; l < L; ++l)
      reference[l] = m[l] == -std::numeric_limits<T>::infinity() ? T(0) : m[l];
    const Eigen::Map<const Matrix> d_memory_rows(d_memory, L, Dv);
    const Eigen::Map<const Row> d_alpha(d_normaliser, L);
    Matrix weights(run, L), rotated(run, Dv), d_rotated(run, Dv), d_keys(run, L);
    Matrix cos_rows, sin_rows;
    RunRotations<T> rotations;
    const double* theta = angles.empty() ? nullptr : angles.data() + h * pairs;
    if constexpr (Pos::rotates_values) {
      rotations = RunRotations<T>(pairs, run);
      rotations.seek(theta, first_position);
      cos_rows.resize(run, Dv);
      sin_rows.resize(run, Dv);
    }
    for (index_t t0 = 0; t0 < Tn; t0 += run) {
      const index_t n = std::min(run, Tn - t0);
      if constexpr (Pos::rotates_values) rotations.fill(n, cos_rows.data(), sin_rows.data(), Dv);
      for (index_t j = 0; j < n; ++j) {
        weights.row(j) = Eigen::Map<const Row>(k.row(b, t0 + j, h), L) - reference;
        if constexpr (Pos::rotates_values)
          rotate_pairs<false>(v.row(b, t0 + j, h), rotated.row(j).data(), cos_rows.row(j).data(),
                              sin_rows.row(j).data(), Dv);  // R^{-s} v_s
        else
          rotated.row(j) = Eigen::Map<const Row>(v.row(b, t0 + j, h), Dv);
      }
      auto w = weights.topRows(n);
      w = w.array().exp().matrix();
      d_keys.topRows(n).noalias() = rotated.topRows(n) * d_memory_rows.transpose();
      d_keys.topRows(n).rowwise() += d_alpha;
      d_rotated.topRows(n).noalias() = w * d_memory_rows;
      for (index_t j = 0; j < n; ++j) {
        Eigen::Map<Row>(dk.row(b, t0 + j, h), L).array() +=
            w.row(j).array() * d_keys.row(j).array();
        T* d_value = dv.row(b, t0 + j, h);
        if constexpr (Pos::rotates_values) {
          if (angles_wanted)
            reference::accumulate_angle_gradient(head_theta.data() + i * pairs, Dv,
                                                 d_rotated.row(j).data(), rotated.row(j).data(),
                                                 -(first_position + t0 + j));
          rotate_pairs<true>(d_rotated.row(j).data(), d_rotated.row(j).data(),
                             cos_rows.row(j).data(), sin_rows.row(j).data(), Dv);  // R^{s}
        }
        Eigen::Map<Row>(d_value, Dv) += d_rotated.row(j);
      }
    }
  });
  for (index_t i = 0; i < heads && angles_wanted; ++i)
    for (index_t p = 0; p < pairs; ++p)
      d_theta[(i % H) * pairs + p] += head_theta[static_cast<std::size_t>(i * pairs + p)];
}

}  // namespace latte::cpu
