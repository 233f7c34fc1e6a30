#pragma once
// CPU backend for Latte: xsimd vectorisation and OpenMP threads.
//
// Causal: the exact RunningMax recurrence of paper 000 (eqs. 10-12, App. B.2
// eq. 21) as a register-blocked scan. Per token, an L-wide stage absorbs the
// key logits (running max m, rescale c, weight w, normaliser alpha) and forms
// gamma_l = p(l|t) / alpha_{t,l}; a pass over the L x Dv memory (kept in L1)
// then updates vtilde_l = c_l vtilde_l + w_l v_t and reads o_t = sum_l gamma_l
// vtilde_l with the value and output blocks held in registers. Tokens go in
// runs of 16: the stages of the run first, then its passes. One pass serves
// four consecutive tokens while no running max moves, two when one does (each
// memory row loaded and stored once for all of them). Work is split
// over (batch, head); when there are fewer heads than threads, time is split
// into one segment per thread and run in two passes (segment-local states in
// parallel -> a scan that merges them -> outputs in parallel), so B*H = 1
// still uses every core. Workspace is O(threads * L * Dv), independent of T.
//
// Bidirectional: the two contractions of eq. 7 in blocks of 64 tokens. Pass 1
// per block: E = exp(K - shift) in one pass over the key rows, which also
// gives the block's column maxima and copies its value rows; a latent's
// shift is its first block's column maximum and moves only when a later
// maximum passes it by more than 8 (rescaling alpha and M, as eq. 21 does per
// token, and taking the block's E again); then alpha += 1^T E, M += E^T V.
// Pass 2 per block: O = (softmax(Q) / alpha) M. Both contractions are the
// register-blocked kernels of block_contractions.hpp; between their tiles
// the rows of the (head, block) two items on are requested into L2. With
// fewer heads than threads, each head's sequence is split into segments whose
// sums are merged between the two passes; otherwise each worker runs both
// passes over its own heads in one parallel region.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "latte/backends/cpu/bf16_products.hpp"
#include "latte/backends/cpu/block_contractions.hpp"
#include "latte/backends/cpu/column_exps.hpp"
#include "latte/backends/cpu/compensated_sums.hpp"
#include "latte/backends/cpu/half_conversion.hpp"
#include "latte/backends/cpu/memory_pass.hpp"
#include "latte/backends/cpu/parallel.hpp"
#include "latte/backends/cpu/prefetch.hpp"
#include "latte/backends/cpu/rotation.hpp"
#include "latte/backends/cpu/run_rotations.hpp"
#include "latte/backends/cpu/simd.hpp"
#include "latte/backends/reference/latte.hpp"
#include "latte/core/checked_size.hpp"
#include "latte/core/half_float.hpp"
#include "latte/core/huge_page_allocator.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/policies/positional.hpp"
#include "latte/policies/stabilizer.hpp"

namespace latte::cpu {

using reference::LatteCarry;

/// Tokens whose latent stage (absorb_keys, latent_read_weights) the causal
/// scan runs before their passes over the memory.
inline constexpr index_t stage_tokens = 16;

/// How far above a key its latent's shift is set when the key passes it, in
/// the causal scan (RunningMax's running reference) and the bidirectional pass
/// (the column shift). The shift never sits below the maximum, so every
/// exponential is at most 1 (alpha and M stay within the reference backend's
/// bounds: a value near the largest finite number does not overflow where the
/// exact maximum would not), the next move waits until a key passes the
/// maximum by more than 8, and M_l / alpha_l, all the output reads, is unchanged.
inline constexpr int shift_headroom = 8;

/// Per-worker scratch for the causal scan (c, w, gamma of `stage_tokens`
/// tokens; with `rotates_values` (VAPOR), rotated values of up to four and the
/// rotation of each of `stage_tokens` positions as interleaved cos / sin rows;
/// for a compensated carry (compensated_sums.hpp) the sums at the last fold,
/// the weights and values of the tokens since (rows), their sums, and a run's
/// rescale products).
template <Real T>
struct LatteScratch {
  LatteScratch(index_t L, index_t Dv, bool rotates_values, bool stages_rows = false)
      : carry_scale(stage_tokens * L), weight(stage_tokens * L), gamma(stage_tokens * L),
        rotated(rotates_values ? 4 * Dv : 0),
        rotation_cos(rotates_values ? stage_tokens * Dv : 0),
        rotation_sin(rotates_values ? stage_tokens * Dv : 0),
        folded_memory(L * Dv), folded_normaliser(L), pending_memory(L * Dv), pending_normaliser(L),
        chunk_weights(fold_tokens * L), chunk_values(fold_tokens * Dv), run_scale(L),
        staged_queries(stages_rows ? staged_tokens * L : 0), staged_keys(stages_rows ? staged_tokens * L : 0),
        staged_values(stages_rows ? staged_tokens * Dv : 0), staged_out(stages_rows ? staged_tokens * Dv : 0),
        rotation(rotates_values ? Dv / 2 : 0, stage_tokens) {}
  /// Tokens whose 16-bit rows the scan widens into the staged_* rows at a time.
  static constexpr index_t staged_tokens = 64;
  AlignedVector<T> carry_scale, weight, gamma, rotated, rotation_cos, rotation_sin;
  AlignedVector<T> folded_memory, folded_normaliser, pending_memory, pending_normaliser;
  AlignedVector<T> chunk_weights, chunk_values, run_scale;
  AlignedVector<T> staged_queries, staged_keys, staged_values, staged_out;  // 16-bit inputs only
  RunRotations<T> rotation;  // fills rotation_cos / rotation_sin, one row per position
};

/// The L-wide key stage (eq. 21): m <- max(m, k), c = exp(m_old - m),
/// w = exp(k - m), alpha <- c alpha + w. Returns whether any c != 1.
/// With RunningMax the vector lanes keep a reference with headroom instead of
/// the exact maximum: when k > m, m moves to k + shift_headroom, so w <= 1 and
/// the memory is rescaled only on those rare moves (about once per latent in a
/// sequence of centred keys, where the exact maximum moves ~ln T times): the
/// scan stays on its four-token passes.
template <Stabilizer Stab, Real T>
bool absorb_keys(const T* k, LatteCarry<T> carry, T* c, T* w, index_t L) noexcept {
  bool rescaled = false;
  if constexpr (std::is_same_v<Stab, RunningMax>) {
    using B = simd::batch<T>;
    constexpr T neg_inf = -std::numeric_limits<T>::infinity();
    const B headroom(static_cast<T>(shift_headroom));
    // Whole vectors, then the partial last one (L = 63): its lanes past L
    // read as -inf keys and maxima, which give c = 1, w = 0 and no move.
    simd::for_each_vector<T>(L, [&](index_t i, index_t count, auto tail) {
      constexpr bool part = tail.value;
      const B key = simd::load_lanes<part>(k + i, count, neg_inf);
      const B old_max = simd::load_lanes<part>(carry.running_max + i, count, neg_inf);
      const B new_max = simd::select_greater(key, old_max, key + headroom, old_max);
      const bool moved = simd::any_greater(new_max, old_max);  // rare once the max settles
      rescaled = rescaled || moved;
      // Where everything so far is -inf the sums stay empty: c = 1, w = 0.
      const B scale = moved ? simd::replace_where_equal(new_max, neg_inf, B(T(1)),
                                                        simd::exp(old_max - new_max))
                            : B(T(1));
      const B weight = simd::replace_where_equal(new_max, neg_inf, B(T(0)), simd::exp(key - new_max));
      simd::store_lanes<part>(carry.running_max + i, new_max, count);
      simd::store_lanes<part>(c + i, scale, count);
      simd::store_lanes<part>(w + i, weight, count);
      simd::store_lanes<part>(
          carry.normaliser + i,
          simd::fma(simd::load_lanes<part>(carry.normaliser + i, count), scale, weight), count);
    });
    return rescaled;
  }
  for (index_t l = 0; l < L; ++l) {
    const Absorb<T> a = Stab::absorb(carry.running_max[l], k[l]);
    c[l] = a.carry_scale;
    w[l] = a.weight;
    rescaled = rescaled || a.carry_scale != T(1);
    carry.normaliser[l] = carry.normaliser[l] * a.carry_scale + a.weight;
  }
  return rescaled;
}

/// The query half of the latent stage for n rows (row r at q + r * stride):
/// e_{r,l} = exp(q_{r,l} - max_l q_{r,l}) into e + r * L and beta[r] =
/// sum_l e_{r,l}, so that p(l|t) = e_{t,l} / beta_t (eq. 9). A row whose
/// logits are all -inf gets e = 0 and beta = 0. Rows go `width` at a time:
/// their maxima and sums are reduced together (simd::reduce_*_each), the bits
/// max_of and exp_shifted_sum give row by row, which is what one row (a
/// decode step) or a latent count that is not a multiple of the width uses.
template <Real T>
void latent_softmax_exps(const T* q, index_t stride, index_t n, index_t L, T* e,
                         T* beta) noexcept {
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  constexpr T lowest = -std::numeric_limits<T>::infinity();
  auto one_row = [&](index_t r) {
    const T* row = q + r * stride;
    const T q_max = simd::max_of(row, L);
    if (q_max == lowest) {
      std::fill(e + r * L, e + (r + 1) * L, T(0));
      beta[r] = T(0);
    } else {
      beta[r] = simd::exp_shifted_sum(row, L, q_max, e + r * L);
    }
  };
  if (W == 1 || n == 1 || L == 0) {
    for (index_t r = 0; r < n; ++r) one_row(r);
    return;
  }
  for (index_t r0 = 0; r0 < n; r0 += W) {
    const index_t rows = std::min(W, n - r0);
    B lanes[W];
    // Rows past n are zeros, reduced and ignored.
    for (index_t j = 0; j < W; ++j)
      lanes[j] = j < rows ? simd::max_lanes(q + (r0 + j) * stride, L) : B(T(0));
    // A row of -inf is shifted by 0 instead: its exponentials are exp(-inf) =
    // 0 and its sum 0, what one_row gives, with no branch per row (about 7
    // cycles a row of the bidirectional pass's read stage).
    alignas(64) T row_max[W], row_sum[W];
    const B maxima = simd::reduce_max_each(static_cast<const B*>(lanes));
    simd::store(row_max, simd::replace_where_equal(maxima, lowest, B(T(0)), maxima));
    for (index_t j = 0; j < rows; ++j)
      lanes[j] = simd::exp_shifted_lanes(q + (r0 + j) * stride, L, row_max[j], e + (r0 + j) * L);
    simd::store(row_sum, simd::reduce_add_each(static_cast<const B*>(lanes)));
    std::copy(row_sum, row_sum + rows, beta + r0);
  }
}

/// gamma_l = p(l|t) / alpha_l = e_l / (beta alpha_l) (eq. 11) in place over
/// latent_softmax_exps' e and beta; zero for an empty latent (alpha = 0) and
/// for a query whose logits are all -inf (beta = 0).
template <Real T>
void latent_read_finish(T* gamma, T beta, const T* normaliser, index_t L) noexcept {
  using B = simd::batch<T>;
  if (beta == T(0)) {
    std::fill(gamma, gamma + L, T(0));
    return;
  }
  const B beta_lanes(beta);
  simd::for_each_vector<T>(L, [&](index_t l, index_t count, auto tail) {
    constexpr bool part = tail.value;
    const B alpha = simd::load_lanes<part>(normaliser + l, count);  // past L: 0, stored nowhere
    const B g = simd::load_lanes<part>(gamma + l, count) / (beta_lanes * alpha);
    simd::store_lanes<part>(gamma + l, simd::replace_where_equal(alpha, T(0), B(T(0)), g), count);
  });
}

/// gamma_l = p(l|t) / alpha_l (eq. 11) for one query (the decode step).
template <Real T>
void latent_read_weights(const T* q, const T* normaliser, T* gamma, index_t L) noexcept {
  T beta;
  latent_softmax_exps(q, 0, 1, L, gamma, &beta);
  latent_read_finish(gamma, beta, normaliser, L);
}

/// The update half alone (segment-local states of the two-pass scan).
template <Real T, int R>
inline void update_block(T* memory, index_t Dv, index_t d0, const T* c, const T* w, const T* v,
                         index_t L, bool rescale) noexcept {
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  B value[R];
  for (int r = 0; r < R; ++r) value[r] = simd::load(v + d0 + r * W);
  for (index_t l = 0; l < L; ++l) {
    T* row = memory + l * Dv + d0;
    const B weight(w[l]), scale(rescale ? c[l] : T(1));
    for (int r = 0; r < R; ++r)
      simd::store(row + r * W, simd::fma(simd::load(row + r * W), scale, weight * value[r]));
  }
}

/// One register block of R vectors of the Dv pass: memory update and (when
/// `out` is given) read.
template <Real T, int R>
inline void update_read_block(T* memory, index_t Dv, index_t d0, const T* c, const T* w,
                              const T* gamma, const T* v, T* out, index_t L,
                              bool rescale) noexcept {
  if (out == nullptr) {
    update_block<T, R>(memory, Dv, d0, c, w, v, L, rescale);
    return;
  }
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  B value[R], acc[R];
  for (int r = 0; r < R; ++r) {
    value[r] = simd::load(v + d0 + r * W);
    acc[r] = B(T(0));
  }
  for (index_t l = 0; l < L; ++l) {
    T* row = memory + l * Dv + d0;
    const B weight(w[l]), read(gamma[l]);
    if (rescale) {
      const B scale(c[l]);
      for (int r = 0; r < R; ++r) {
        const B m = simd::fma(simd::load(row + r * W), scale, weight * value[r]);
        simd::store(row + r * W, m);
        acc[r] = simd::fma(read, m, acc[r]);
      }
    } else {
      for (int r = 0; r < R; ++r) {
        const B m = simd::fma(weight, value[r], simd::load(row + r * W));
        simd::store(row + r * W, m);
        acc[r] = simd::fma(read, m, acc[r]);
      }
    }
  }
  if (out)
    for (int r = 0; r < R; ++r) simd::store(out + d0 + r * W, acc[r]);
}

/// The Dv pass for one token: vtilde_l = c_l vtilde_l + w_l v, out = sum_l gamma_l vtilde_l.
/// `out` may be null (state update only).
template <Real T>
void update_and_read(T* memory, const T* c, const T* w, const T* gamma, const T* v, T* out,
                     index_t L, index_t Dv, bool rescale) noexcept {
  constexpr index_t W = simd::width<T>;
  index_t d = 0;
  for (; d + 4 * W <= Dv; d += 4 * W)
    update_read_block<T, 4>(memory, Dv, d, c, w, gamma, v, out, L, rescale);
  for (; d + W <= Dv; d += W) update_read_block<T, 1>(memory, Dv, d, c, w, gamma, v, out, L, rescale);
  if (d == Dv) return;
  for (index_t e = d; e < Dv; ++e) {
    T acc = 0;
    for (index_t l = 0; l < L; ++l) {
      T& m = memory[l * Dv + e];
      m = rescale ? m * c[l] + w[l] * v[e] : m + w[l] * v[e];
      acc += gamma[l] * m;
    }
    if (out) out[e] = acc;
  }
}

/// The Dv pass for two consecutive tokens (t, t+1) over one register block:
/// each memory row is loaded and stored once for both tokens, halving the
/// L1 traffic of the scan. c/w/gamma hold the token-t values at [0, L) and
/// the token-(t+1) values at [L, 2L).
template <Real T, int R, bool Rescale1, bool Rescale2>
LATTE_FLATTEN void update_read_pair_block(T* memory, index_t Dv, index_t d0, const T* c,
                                          const T* w, const T* gamma, const T* v1, const T* v2,
                                          T* out1, T* out2, index_t L) noexcept {
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  B value1[R], value2[R], acc1[R], acc2[R];
  simd::unrolled<R>([&](auto r) {  // constant indices (simd::unrolled)
    value1[r] = simd::load(v1 + d0 + r * W);
    value2[r] = simd::load(v2 + d0 + r * W);
    acc1[r] = B(T(0));
    acc2[r] = B(T(0));
  });
  for (index_t l = 0; l < L; ++l) {
    T* row = memory + l * Dv + d0;
    const B w1(w[l]), w2(w[L + l]), g1(gamma[l]), g2(gamma[L + l]);
    const B c1(c[l]), c2(c[L + l]);
    for (int r = 0; r < R; ++r) {
      B m = simd::load(row + r * W);
      m = Rescale1 ? simd::fma(m, c1, w1 * value1[r]) : simd::fma(w1, value1[r], m);
      acc1[r] = simd::fma(g1, m, acc1[r]);
      m = Rescale2 ? simd::fma(m, c2, w2 * value2[r]) : simd::fma(w2, value2[r], m);
      acc2[r] = simd::fma(g2, m, acc2[r]);
      simd::store(row + r * W, m);
    }
  }
  simd::unrolled<R>([&](auto r) {
    simd::store(out1 + d0 + r * W, acc1[r]);
    simd::store(out2 + d0 + r * W, acc2[r]);
  });
}

template <Real T, bool Rescale1, bool Rescale2>
void update_and_read_pair(T* memory, const T* c, const T* w, const T* gamma, const T* v1,
                          const T* v2, T* out1, T* out2, index_t L, index_t Dv) noexcept {
  constexpr index_t W = simd::width<T>;
  index_t d = 0;
  for (; d + 4 * W <= Dv; d += 4 * W)
    update_read_pair_block<T, 4, Rescale1, Rescale2>(memory, Dv, d, c, w, gamma, v1, v2, out1,
                                                     out2, L);
  for (; d + W <= Dv; d += W)
    update_read_pair_block<T, 1, Rescale1, Rescale2>(memory, Dv, d, c, w, gamma, v1, v2, out1,
                                                     out2, L);
  for (index_t e = d; e < Dv; ++e) {
    T acc1 = 0, acc2 = 0;
    for (index_t l = 0; l < L; ++l) {
      T& m = memory[l * Dv + e];
      m = Rescale1 ? m * c[l] + w[l] * v1[e] : m + w[l] * v1[e];
      acc1 += gamma[l] * m;
      m = Rescale2 ? m * c[L + l] + w[L + l] * v2[e] : m + w[L + l] * v2[e];
      acc2 += gamma[L + l] * m;
    }
    out1[e] = acc1;
    out2[e] = acc2;
  }
}

/// Scans tokens [t0, t1) of one (b, h) from `carry` at absolute position
/// `position` (of token t0). With `read` false only the state is advanced.
template <Stabilizer Stab, Positional Pos, Real T>
void scan(const TensorView<const T, 4>& q, const TensorView<const T, 4>& k,
          const TensorView<const T, 4>& v, const TensorView<T, 4>& out, index_t b, index_t h,
          index_t t0, index_t t1, LatteCarry<T> carry, const double* theta,
          std::int64_t position, bool read, LatteScratch<T>& scratch) noexcept {
  const index_t L = q.extent(3), Dv = v.extent(3);
  if constexpr (Pos::rotates_values) scratch.rotation.seek(theta, position);
  T *c = scratch.carry_scale.data(), *w = scratch.weight.data(), *gamma = scratch.gamma.data();
  // VAPOR (eq. 22): the rotations of the next n positions (run_rotations.hpp),
  // row j for token t + j, serve both R^{-s} on the value entering the memory
  // and R^{t} on the output.
  auto fill_rotations = [&](index_t n) {
    if constexpr (Pos::rotates_values)
      scratch.rotation.fill(n, scratch.rotation_cos.data(), scratch.rotation_sin.data(), Dv);
  };
  // Token t's value, the run's row j holding its position; with VAPOR it is
  // rotated into scratch row `slot` (an empty buffer otherwise: no pointer into it).
  auto value_of = [&](index_t t, index_t j, index_t slot) {
    const T* value = v.row(b, t, h);
    if constexpr (Pos::rotates_values) {
      T* rotated = scratch.rotated.data() + slot * Dv;
      rotate_pairs<false>(value, rotated, scratch.rotation_cos.data() + j * Dv,
                          scratch.rotation_sin.data() + j * Dv, Dv);  // R^{-s} v_s
      return static_cast<const T*>(rotated);
    }
    return value;
  };
  auto rotate_out = [&](T* o, index_t j) {
    if constexpr (Pos::rotates_values)  // R^t, at the output token's position
      rotate_pairs<true>(o, o, scratch.rotation_cos.data() + j * Dv,
                         scratch.rotation_sin.data() + j * Dv, Dv);
  };
  // Compensated sums (compensated_sums.hpp): the running sums restart from the
  // compensated ones every fold_tokens tokens; between folds the tokens'
  // weights and values are kept as rows (chunk_*), rescaled as the running sums are.
  const bool compensated = carry.compensated();
  index_t unfolded = 0;
  if (compensated) {  // a decode step may have left terms in the low parts
    renormalise_pairs(carry.memory, carry.memory_low, L * Dv);
    renormalise_pairs(carry.normaliser, carry.normaliser_low, L);
    std::copy(carry.memory, carry.memory + L * Dv, scratch.folded_memory.data());
    std::copy(carry.normaliser, carry.normaliser + L, scratch.folded_normaliser.data());
  }
  // The chunk's terms, summed apart from the running sums: one contraction of
  // its weight and value rows (block_contractions.hpp), then TwoSum into the pairs.
  auto fold = [&] {
    T *weights = scratch.chunk_weights.data(), *pending = scratch.pending_normaliser.data();
    accumulate_outer_products(weights, unfolded, L, scratch.chunk_values.data(),
                              scratch.pending_memory.data(), Dv);
    for (index_t j = 0; j < unfolded; ++j)
      for (index_t l = 0; l < L; ++l) pending[l] += weights[j * L + l];
    fold_pending(carry.memory, scratch.folded_memory.data(), carry.memory_low,
                 scratch.pending_memory.data(), L * Dv);
    fold_pending(carry.normaliser, scratch.folded_normaliser.data(), carry.normaliser_low,
                 pending, L);
    unfolded = 0;
  };
  // Appends the run of n tokens at t (weights and rescales at w, c + j L) to
  // the chunk. A rescale of token j scales every term before it: the run's
  // weights are carried to its end by suffix products of c, and the chunk's
  // earlier weights and the pairs by their product over the run.
  auto absorb_run = [&](index_t t, index_t n, const bool* rescaled) {
    if (!compensated) return;
    T* weights = scratch.chunk_weights.data() + unfolded * L;
    std::copy(w, w + n * L, weights);
    if (std::any_of(rescaled, rescaled + n, [](bool r) { return r; })) {
      T* product = scratch.run_scale.data();
      std::fill(product, product + L, T(1));
      for (index_t j = n - 1; j >= 0; --j)
        for (index_t l = 0; l < L; ++l) {
          weights[j * L + l] *= product[l];
          product[l] *= c[j * L + l];
        }
      for (index_t l = 0; l < L; ++l) {
        if (product[l] == T(1)) continue;
        scale_pairs(scratch.folded_memory.data() + l * Dv, carry.memory_low + l * Dv, product[l], Dv);
        scale_pairs(scratch.folded_normaliser.data() + l, carry.normaliser_low + l, product[l], 1);
        for (index_t j = 0; j < unfolded; ++j) scratch.chunk_weights[j * L + l] *= product[l];
      }
    }
    T* rows = scratch.chunk_values.data() + unfolded * Dv;
    for (index_t j = 0; j < n; ++j) {
      const T* value = v.row(b, t + j, h);
      if constexpr (Pos::rotates_values)
        rotate_pairs<false>(value, rows + j * Dv, scratch.rotation_cos.data() + j * Dv,
                            scratch.rotation_sin.data() + j * Dv, Dv);  // R^{-s} v_s
      else
        std::copy(value, value + Dv, rows + j * Dv);
    }
    unfolded += n;
    if (unfolded + stage_tokens > fold_tokens) fold();
  };
  // Quads without a rescale rotate in registers when Dv is whole vectors.
  const bool quad_rotates =
      Pos::rotates_values && simd::width<T> >= 2 && Dv % simd::width<T> == 0;
  // Rows `ahead` tokens on are requested while this token computes (prefetch.hpp).
  constexpr index_t ahead = 4;
  auto prefetch_token = [&]<CacheLevel Level = CacheLevel::l1>(index_t s) {
    if (s >= t1) return;
    prefetch_token_rows<Level>(b, s, h, k, v);
    if (read) prefetch_token_rows<Level>(b, s, h, q, out);
  };
  for (index_t s = t0; s < std::min(t1, t0 + ahead); ++s) prefetch_token(s);
  index_t t = t0;
  if (read) {
    // Per run of `stage_tokens` tokens: first every token's latent stage
    // (exps and reductions over L that need only the running max and the
    // normaliser, not the memory), so that the core overlaps consecutive
    // tokens' latency chains instead of waiting out each between two passes
    // over the memory; then the passes, four tokens per pass while no running
    // max moves (register blocking in time), a quad where one does as two
    // pairs with each token's rescale compiled in or out. Each token's pass
    // requests the same token of the next run into L2 (spread over the
    // passes: issued all at once from the stage, on 4 KiB pages, they came
    // too late), and the stage requests rows four tokens on into L1.
    auto pair = [&](index_t s, index_t i, bool r1, bool r2, const T* v1, const T* v2) {
      const T *ci = c + i * L, *wi = w + i * L, *gi = gamma + i * L;
      T *o1 = out.row(b, s, h), *o2 = out.row(b, s + 1, h);
      if (r1 && r2) update_and_read_pair<T, true, true>(carry.memory, ci, wi, gi, v1, v2, o1, o2, L, Dv);
      else if (r1) update_and_read_pair<T, true, false>(carry.memory, ci, wi, gi, v1, v2, o1, o2, L, Dv);
      else if (r2) update_and_read_pair<T, false, true>(carry.memory, ci, wi, gi, v1, v2, o1, o2, L, Dv);
      else update_and_read_pair<T, false, false>(carry.memory, ci, wi, gi, v1, v2, o1, o2, L, Dv);
    };
    auto prefetch_next_run = [&](index_t j) {
      prefetch_token.template operator()<CacheLevel::l2>(t + stage_tokens + j);
    };
    while (t < t1) {
      const index_t n = std::min(stage_tokens, t1 - t);
      bool rescaled[stage_tokens];
      T beta[stage_tokens];
      latent_softmax_exps(q.row(b, t, h), q.stride(1), n, L, gamma, beta);
      fill_rotations(n);
      for (index_t j = 0; j < n; ++j) {
        if (j + ahead < n) prefetch_token(t + j + ahead);
        rescaled[j] = absorb_keys<Stab>(k.row(b, t + j, h), carry, c + j * L, w + j * L, L);
        latent_read_finish(gamma + j * L, beta[j], carry.normaliser, L);
      }
      index_t j = 0;
      for (; j + 3 < n; j += 4) {
        const T* values[4];
        T* outs[4];
        for (int i = 0; i < 4; ++i) {
          prefetch_next_run(j + i);
          outs[i] = out.row(b, t + j + i, h);
        }
        const bool rescales = rescaled[j] || rescaled[j + 1] || rescaled[j + 2] || rescaled[j + 3];
        if (!rescales && quad_rotates) {  // the rotations in registers (memory_pass.hpp)
          const T *cos_rows[4], *sin_rows[4];
          for (int i = 0; i < 4; ++i) {
            values[i] = v.row(b, t + j + i, h);
            cos_rows[i] = scratch.rotation_cos.data() + (j + i) * Dv;
            sin_rows[i] = scratch.rotation_sin.data() + (j + i) * Dv;
          }
          if constexpr (simd::width<T> >= 2)
            update_and_read_quad<T, true>(carry.memory, w + j * L, gamma + j * L, values, outs, L,
                                          Dv, {cos_rows, sin_rows});
          continue;
        }
        for (int i = 0; i < 4; ++i)
          values[i] = value_of(t + j + i, j + i, i);
        if (rescales) {
          pair(t + j, j, rescaled[j], rescaled[j + 1], values[0], values[1]);
          pair(t + j + 2, j + 2, rescaled[j + 2], rescaled[j + 3], values[2], values[3]);
        } else {
          update_and_read_quad(carry.memory, w + j * L, gamma + j * L, values, outs, L, Dv);
        }
        for (int i = 0; i < 4; ++i) rotate_out(outs[i], j + i);
      }
      for (; j + 1 < n; j += 2) {
        prefetch_next_run(j);
        prefetch_next_run(j + 1);
        const T* v1 = value_of(t + j, j, 0);
        const T* v2 = value_of(t + j + 1, j + 1, 1);
        pair(t + j, j, rescaled[j], rescaled[j + 1], v1, v2);
        rotate_out(out.row(b, t + j, h), j);
        rotate_out(out.row(b, t + j + 1, h), j + 1);
      }
      if (j < n) {
        prefetch_next_run(j);
        T* o = out.row(b, t + j, h);
        update_and_read(carry.memory, c + j * L, w + j * L, gamma + j * L,
                        value_of(t + j, j, 0), o, L, Dv, rescaled[j]);
        rotate_out(o, j);
      }
      absorb_run(t, n, rescaled);
      t += n;
    }
    if (unfolded > 0) fold();
    return;
  }
  for (; t < t1; t += stage_tokens) {  // state only: one token per pass, in runs
    const index_t n = std::min(stage_tokens, t1 - t);
    bool rescaled[stage_tokens];
    fill_rotations(n);
    for (index_t j = 0; j < n; ++j) {
      prefetch_token(t + j + ahead);
      rescaled[j] = absorb_keys<Stab>(k.row(b, t + j, h), carry, c + j * L, w + j * L, L);
      if (!compensated)  // compensated: nothing reads the running memory, the fold sets it
        update_and_read(carry.memory, c + j * L, w + j * L, gamma, value_of(t + j, j, 0),
                        static_cast<T*>(nullptr), L, Dv, rescaled[j]);
    }
    absorb_run(t, n, rescaled);
  }
  if (unfolded > 0) fold();
}

/// The scan over 16-bit activations: `staged_tokens` tokens at a time, their
/// rows widened (exactly) into fp32 rows of the worker's scratch, scanned as a
/// [1, n, 1, *] sequence by the fp32 scan above, and the outputs rounded back.
template <Stabilizer Stab, Positional Pos, HalfFloat In>
void scan(const TensorView<const In, 4>& q, const TensorView<const In, 4>& k,
          const TensorView<const In, 4>& v, const TensorView<In, 4>& out, index_t b, index_t h,
          index_t t0, index_t t1, LatteCarry<float> carry, const double* theta,
          std::int64_t position, bool read, LatteScratch<float>& scratch) noexcept {
  const index_t L = q.extent(3), Dv = v.extent(3);
  float *queries = scratch.staged_queries.data(), *keys = scratch.staged_keys.data();
  float *values = scratch.staged_values.data(), *outs = scratch.staged_out.data();
  for (index_t t = t0; t < t1; t += LatteScratch<float>::staged_tokens) {
    const index_t n = std::min(LatteScratch<float>::staged_tokens, t1 - t);
    for (index_t r = 0; r < n; ++r) {
      if (t + r + 8 < t1) {  // rows of one head lie H rows apart: 4 KiB pages hold a few
        prefetch_token_rows(b, t + r + 8, h, k, v);
        if (read) prefetch_token_rows(b, t + r + 8, h, q, out);
      }
      if (const index_t next = t + r + LatteScratch<float>::staged_tokens; next < t1) {
        prefetch_token_rows<CacheLevel::l2>(b, next, h, k, v);
        if (read) prefetch_token_rows<CacheLevel::l2>(b, next, h, q, out);
      }
      widen_row(k.row(b, t + r, h), keys + r * L, L);
      widen_row(v.row(b, t + r, h), values + r * Dv, Dv);
      if (read) widen_row(q.row(b, t + r, h), queries + r * L, L);
    }
    scan<Stab, Pos>(TensorView<const float, 4>(queries, {1, n, 1, L}),
                    TensorView<const float, 4>(keys, {1, n, 1, L}),
                    TensorView<const float, 4>(values, {1, n, 1, Dv}),
                    TensorView<float, 4>(outs, {1, n, 1, Dv}), 0, 0, 0, n, carry, theta,
                    position + (t - t0), read, scratch);
    if (read)
      for (index_t r = 0; r < n; ++r) narrow_row(outs + r * Dv, out.row(b, t + r, h), Dv);
  }
}

/// Causal Latte over [B, T, H, *], continuing from carry_of(b, h) at `first_position`.
/// With bf16 / fp16 activations the sums and the carries are fp32.
template <Stabilizer Stab, Positional Pos, Activation In, class CarryOf>
void latte_causal_forward(TensorView<const In, 4> q, TensorView<const In, 4> k,
                          TensorView<const In, 4> v, TensorView<In, 4> out,
                          const std::vector<double>& angles, std::int64_t first_position,
                          CarryOf&& carry_of) {
  using T = compute_type_t<In>;
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), L = q.extent(3);
  const index_t Dv = v.extent(3), pairs = Dv / 2, heads = B * H;
  if (Tn == 0 || heads == 0) return;
  // Threads only pay off past ~2^18 multiply-adds; smaller calls stay on this thread.
  const double work = double(heads) * double(Tn) * double(L) * double(Dv);
  const int workers = work >= 1 << 18 ? thread_count() : 1;
  auto theta_of = [&](index_t h) { return angles.empty() ? nullptr : angles.data() + h * pairs; };
  constexpr index_t min_segment = 256;
  const index_t segments =
      heads >= workers ? 1 : std::clamp<index_t>(Tn / min_segment, 1, workers);
  std::vector<LatteScratch<T>> scratch(static_cast<std::size_t>(workers),
                                       LatteScratch<T>(L, Dv, Pos::rotates_values, HalfFloat<In>));

  if (segments == 1) {
    interleave_heads(
        heads, Tn, workers, [&](index_t i) { return carry_of(i / H, i % H); },
        [&](index_t i, LatteCarry<T> carry, index_t t0, index_t t1, int worker) {
          scan<Stab, Pos>(q, k, v, out, i / H, i % H, t0, t1, carry, theta_of(i % H),
                          first_position + t0, true, scratch[worker]);
        });
    return;
  }
  // Two passes over `segments` time segments, one (b, h) at a time.
  const index_t carry_size = reference::latte_carry_size(L, Dv);
  AlignedVector<T> storage(static_cast<std::size_t>(2 * segments * carry_size));
  bool compensated = false;  // as the incoming carry (the summation policy's choice)
  auto carry_at = [&](index_t slot) {
    LatteCarry<T> carry = reference::latte_carry_at(storage.data() + slot * carry_size, L, Dv);
    return compensated ? carry : LatteCarry<T>{carry.running_max, carry.normaliser, carry.memory};
  };
  auto segment_begin = [&](index_t p) { return p * Tn / segments; };
  for (index_t i = 0; i < heads; ++i) {
    const index_t b = i / H, h = i % H;
    const LatteCarry<T> incoming = carry_of(b, h);
    compensated = incoming.compensated();
    // Pass 1: each segment but the last from an empty state (slots 0 .. segments-2).
    parallel_for(segments - 1, workers, [&](index_t p, int worker) {
      const LatteCarry<T> local = carry_at(p);
      reference::latte_reset<Stab>(local, L, Dv);
      scan<Stab, Pos>(q, k, v, out, b, h, segment_begin(p), segment_begin(p + 1), local,
                      theta_of(h), first_position + segment_begin(p), false, scratch[worker]);
    });
    // Pass 2: the state entering segment p, in slot segments + p.
    auto copy_carry = [&](LatteCarry<T> to, LatteCarry<T> from) {
      std::copy(from.running_max, from.running_max + L, to.running_max);
      std::copy(from.normaliser, from.normaliser + L, to.normaliser);
      std::copy(from.memory, from.memory + L * Dv, to.memory);
      if (!compensated) return;
      std::copy(from.normaliser_low, from.normaliser_low + L, to.normaliser_low);
      std::copy(from.memory_low, from.memory_low + L * Dv, to.memory_low);
    };
    copy_carry(carry_at(segments), incoming);
    for (index_t p = 1; p < segments; ++p) {
      copy_carry(carry_at(segments + p), carry_at(segments + p - 1));
      const LatteCarry<T> local = carry_at(p - 1);
      reference::latte_append_carry<T>(carry_at(segments + p),
                                       {local.running_max, local.normaliser, local.memory,
                                        local.normaliser_low, local.memory_low},
                                       L, Dv);
    }
    // Pass 3: every segment from its incoming state, writing outputs.
    parallel_for(segments, workers, [&](index_t p, int worker) {
      scan<Stab, Pos>(q, k, v, out, b, h, segment_begin(p), segment_begin(p + 1),
                      carry_at(segments + p), theta_of(h), first_position + segment_begin(p), true,
                      scratch[worker]);
    });
    copy_carry(incoming, carry_at(2 * segments - 1));
  }
}

/// Absorbs [B, T, H, *] into carry_of(b, h) from `first_position` without
/// reading it (the scan's memory pass alone): the carry latte_causal_forward
/// would leave. With fewer heads than threads, each head's tokens are cut into
/// pieces absorbed from empty carries, then appended in order.
template <Stabilizer Stab, Positional Pos, Real T, class CarryOf>
void latte_causal_absorb(TensorView<const T, 4> k, TensorView<const T, 4> v,
                         const std::vector<double>& angles, std::int64_t first_position,
                         CarryOf&& carry_of) {
  const index_t B = k.extent(0), Tn = k.extent(1), H = k.extent(2), L = k.extent(3);
  const index_t Dv = v.extent(3), pairs = Dv / 2, heads = B * H;
  if (Tn == 0 || heads == 0) return;
  const double work = double(heads) * double(Tn) * double(L) * double(Dv);
  const int workers = work >= 1 << 18 ? thread_count() : 1;
  auto theta_of = [&](index_t h) { return angles.empty() ? nullptr : angles.data() + h * pairs; };
  const index_t pieces = heads >= workers ? 1 : std::clamp<index_t>(Tn / 256, 1, workers);
  std::vector<LatteScratch<T>> scratch(static_cast<std::size_t>(workers),
                                       LatteScratch<T>(L, Dv, Pos::rotates_values, false));
  const TensorView<T, 4> no_out{};  // read = false: the scan touches no query or output row
  if (pieces == 1) {
    parallel_for(heads, workers, [&](index_t i, int worker) {
      scan<Stab, Pos>(k, k, v, no_out, i / H, i % H, 0, Tn, carry_of(i / H, i % H),
                      theta_of(i % H), first_position, false, scratch[worker]);
    });
    return;
  }
  const index_t carry_size = reference::latte_carry_size(L, Dv);
  AlignedVector<T> storage(static_cast<std::size_t>(pieces * carry_size));
  auto piece_begin = [&](index_t p) { return p * Tn / pieces; };
  for (index_t i = 0; i < heads; ++i) {
    const index_t b = i / H, h = i % H;
    const LatteCarry<T> carry = carry_of(b, h);
    auto slot = [&](index_t p) {  // compensated as the carry is (the summation policy's choice)
      const LatteCarry<T> at = reference::latte_carry_at(storage.data() + p * carry_size, L, Dv);
      return carry.compensated() ? at : LatteCarry<T>{at.running_max, at.normaliser, at.memory};
    };
    parallel_for(pieces, workers, [&](index_t p, int worker) {
      const LatteCarry<T> local = p == 0 ? carry : slot(p);
      if (p > 0) reference::latte_reset<Stab>(local, L, Dv);
      scan<Stab, Pos>(k, k, v, no_out, b, h, piece_begin(p), piece_begin(p + 1), local,
                      theta_of(h), first_position + piece_begin(p), false, scratch[worker]);
    });
    for (index_t p = 1; p < pieces; ++p) {
      const LatteCarry<T> local = slot(p);
      reference::latte_append_carry<T>(carry,
                                       {local.running_max, local.normaliser, local.memory,
                                        local.normaliser_low, local.memory_low},
                                       L, Dv);
    }
  }
}

/// One decode step for every (b, h) (eqs. 12, 21, 22); allocation-free.
template <Stabilizer Stab, Positional Pos, Real T, class CarryOf>
void latte_causal_step(TensorView<const T, 3> q, TensorView<const T, 3> k,
                       TensorView<const T, 3> v, TensorView<T, 3> out,
                       const std::vector<double>& angles, std::int64_t position,
                       CarryOf&& carry_of, T* scratch /* 4L + Dv */) noexcept {
  const index_t B = q.extent(0), H = q.extent(1), L = q.extent(2), Dv = v.extent(2);
  T *c = scratch, *w = scratch + L, *gamma = scratch + 2 * L, *rotated = scratch + 3 * L;
  T* normaliser_read = scratch + 3 * L + Dv;  // fl(alpha + alpha_low), compensated
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h) {
      const LatteCarry<T> carry = carry_of(b, h);
      const T* value = v.row(b, h);
      const double* theta = angles.empty() ? nullptr : angles.data() + h * (Dv / 2);
      if constexpr (Pos::rotates_values) {
        std::copy(value, value + Dv, rotated);
        Pos::rotate(rotated, Dv, theta, -position);
        value = rotated;
      }
      if (!carry.compensated()) {
        const bool rescale = absorb_keys<Stab>(k.row(b, h), carry, c, w, L);
        latent_read_weights(q.row(b, h), carry.normaliser, gamma, L);
        update_and_read(carry.memory, c, w, gamma, value, out.row(b, h), L, Dv, rescale);
      } else {
        // Compensated (compensated_sums.hpp): absorb_keys gives c and w (and
        // moves m), its plain alpha update goes to a copy; alpha's pair is
        // updated from c and w, the term added to the low parts, the pairs
        // renormalised every fold_tokens positions.
        std::copy(carry.normaliser, carry.normaliser + L, normaliser_read);
        const bool rescale =
            absorb_keys<Stab>(k.row(b, h), {carry.running_max, normaliser_read, carry.memory}, c, w, L);
        for (index_t l = 0; l < L; ++l) {
          if (c[l] != T(1))
            latte::detail::compensated_scale(carry.normaliser[l], carry.normaliser_low[l], c[l]);
          carry.normaliser_low[l] += w[l];
          normaliser_read[l] = carry.normaliser[l] + carry.normaliser_low[l];
        }
        latent_read_weights(q.row(b, h), normaliser_read, gamma, L);
        pairs_update_and_read(carry.memory, carry.memory_low, c, w, gamma, value, out.row(b, h),
                              L, Dv, rescale);
        if ((position + 1) % fold_tokens == 0) {
          renormalise_pairs(carry.memory, carry.memory_low, L * Dv);
          renormalise_pairs(carry.normaliser, carry.normaliser_low, L);
        }
      }
      if constexpr (Pos::rotates_values) Pos::rotate(out.row(b, h), Dv, theta, position);
    }
}

/// Bidirectional Latte (eqs. 5-7; VAPOR eq. 22) in blocks of `block` tokens.
/// With bf16 / fp16 activations each block's rows are widened (exactly) into
/// the fp32 blocks the contractions read, the outputs rounded back per block.
/// With RoundedProducts (latte::Bf16Products, bf16 activations) and AVX-512
/// BF16, both contractions round their operands to bf16 and run on bf16 dot
/// products (bf16_products.hpp): E and the rotated values per block (alpha
/// summed from the rounded E, so that M / alpha stays a convex combination of
/// values), G per block and M / alpha once per head.
template <Stabilizer Stab, Positional Pos, Activation In, bool RoundedProducts = false>
void latte_bidirectional_forward(TensorView<const In, 4> q, TensorView<const In, 4> k,
                                 TensorView<const In, 4> v, TensorView<In, 4> out,
                                 const std::vector<double>& angles) {
  using T = compute_type_t<In>;
  constexpr bool staged = HalfFloat<In>;
  static_assert(!RoundedProducts || std::is_same_v<In, bfloat16>, "bf16 products read bf16 activations");
  constexpr bool pair_products = RoundedProducts && bf16_products_available;
  constexpr T lowest = -std::numeric_limits<T>::infinity();
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), L = q.extent(3);
  const index_t Dv = v.extent(3), pairs = Dv / 2, heads = B * H;
  if (Tn == 0 || heads == 0) return;
  // 64 tokens: the block's keys and values (2 x 16 KiB for L = Dv = 64, fp32)
  // stay in L1 while the contraction streams them once per 4 latents.
  constexpr index_t block = 64;
  const int workers = thread_count();
  // Work items: with at least as many heads as workers, each worker owns a
  // range of heads and walks the whole sequence block by block for all of
  // them (as interleave_heads does for the causal scans: the rows of one token
  // for every head share a page). With fewer heads, each head's sequence is
  // cut into `segments` ranges of whole blocks, whose sums are merged before
  // the outputs are read, so B*H = 1 still uses every core.
  const index_t groups = std::min<index_t>(heads, workers);
  const index_t segments =
      std::clamp<index_t>(workers / groups, 1, std::max<index_t>(1, (Tn + block - 1) / block));
  const index_t items = groups * segments;
  auto head_range = [&](index_t item) {
    const index_t g = item / segments;
    return std::pair<index_t, index_t>{g * heads / groups, (g + 1) * heads / groups};
  };
  auto time_range = [&](index_t item) {
    const index_t blocks = (Tn + block - 1) / block, s = item % segments;
    return std::pair<index_t, index_t>{s * blocks / segments * block,
                                       std::min(Tn, (s + 1) * blocks / segments * block)};
  };
  // Per head and segment: the column maximum of its keys, the shift it gives
  // (Stab::reference_for), alpha_l and the memory M_l = sum_s e_{s,l} R^{-s} v_s.
  const index_t states = heads * segments;
  latte::detail::checked_count<T>("query_logits", {states, L, Dv});  // the largest workspace below
  AlignedVector<T> column_max(states * L, lowest), shift(states * L, Stab::reference_for(lowest));
  AlignedVector<T> normaliser(states * L, T(0)), memory(states * L * Dv, T(0));
  // bf16 products: each head's M / alpha as latent pairs (L / 2 rounded up, x Dv).
  const index_t latent_pairs = (L + 1) / 2;
  AlignedVector<std::uint32_t> memory_pairs(pair_products ? heads * latent_pairs * Dv : 0);
  auto state_of = [&](index_t head, index_t segment) { return head * segments + segment; };
  auto theta_of = [&](index_t h) { return angles.empty() ? nullptr : angles.data() + h * pairs; };
  // Prefetch (prefetch.hpp), the same for both passes' two row streams x and y
  // (keys and values, then queries and outputs). A worker walks its heads
  // [first, last) block by block; the rows of the (head, block) item
  // `items_ahead` on are requested into L2 a few at a time between the
  // register tiles of this one's contraction (`tiles` tiles expected), so that
  // the requests trickle out while the arithmetic runs instead of queueing up
  // in a burst. Two items ahead rather than one: 0.6-0.9 % faster (1 and 2
  // threads, T = 16K and 64K), three no better. The range's first
  // `items_ahead` items, which nothing requested, ask for the row `ahead`
  // tokens on into L1 as they go (rows 0 .. ahead - 1 up front).
  constexpr index_t ahead = 4, items_ahead = 2;
  auto unrequested_item = [&](index_t j, index_t t0, index_t begin, index_t first, index_t last) {
    return (t0 - begin) / block * (last - first) + (j - first) < items_ahead;
  };
  auto prefetch_first_rows = [&](const auto& x, const auto& y, index_t b, index_t h, index_t t0,
                                 index_t n) {
    for (index_t r = 0; r < std::min(ahead, n); ++r) prefetch_token_rows(b, t0 + r, h, x, y);
  };
  auto prefetch_ahead = [&](const auto& x, const auto& y, index_t b, index_t h, index_t t0,
                            index_t r, index_t n) {
    if (r + ahead < n) prefetch_token_rows(b, t0 + r + ahead, h, x, y);
  };
  // The hook for the contraction of head j's block at t0 of a worker's range.
  auto prefetch_item_ahead = [&](const auto& x, const auto& y, index_t j, index_t t0, index_t first,
                                 index_t last, index_t end, index_t tiles) {
    index_t next_j = j, next_t0 = t0;
    for (index_t i = 0; i < items_ahead; ++i)
      if (++next_j == last) next_j = first, next_t0 += block;
    const index_t rows = next_t0 < end ? std::min(block, end - next_t0) : 0;
    const index_t per_tile = (rows + tiles - 1) / std::max<index_t>(tiles, 1);
    const index_t b = next_j / H, h = next_j % H;
    return [&x, &y, b, h, next_t0, rows, per_tile, row = index_t{0}]() mutable {
      for (const index_t until = std::min(rows, row + per_tile); row < until; ++row)
        prefetch_token_rows<CacheLevel::l2>(b, next_t0 + row, h, x, y);
    };
  };

  const index_t k_stride = k.stride(1);
  // Records the block's column maxima; moves the shift of each latent whose
  // maximum went past it (or that had no finite maximum yet) to
  // Stab::reference_for(maximum), plus shift_headroom with RunningMax,
  // rescaling alpha_l and M_l summed under the old one. Returns whether any
  // shift moved.
  auto move_shifts = [&](const T* block_max, T* max_j, T* shift_j, T* alpha, T* memory_j) {
    bool moved = false;
    for (index_t l = 0; l < L; ++l) {
      if (!(block_max[l] > max_j[l])) continue;
      const bool empty = max_j[l] == lowest;
      max_j[l] = block_max[l];
      T target = Stab::reference_for(block_max[l]);
      if (!empty && !(target > shift_j[l])) continue;
      if constexpr (std::is_same_v<Stab, RunningMax>) target += T(shift_headroom);
      if (!empty) {
        const T scale = std::exp(shift_j[l] - target);
        alpha[l] *= scale;
        for (index_t d = 0; d < Dv; ++d) memory_j[l * Dv + d] *= scale;
      }
      shift_j[l] = target;
      moved = true;
    }
    return moved;
  };

  // Pass 1: alpha_l = sum_s exp(k_{s,l} - shift_l) and M_l = sum_s exp(k_{s,l} -
  // shift_l) R^{-s} v_s, the shift at most shift_headroom above the column maximum.
  auto sum_keys_and_values = [&](index_t item) {
    // Plain variables, not structured bindings: lambdas below capture them
    // (C++20 allows capturing a binding; clang before 16 rejects it).
    const index_t first = head_range(item).first, last = head_range(item).second;
    const index_t begin = time_range(item).first, end = time_range(item).second;
    const index_t segment = item % segments;
    AlignedVector<T> keys(block * L), values(block * Dv), block_max(L), block_sum(L);
    AlignedVector<T> staged_keys(staged ? block * L : 0);
    AlignedVector<std::uint32_t> key_pairs(pair_products ? block / 2 * L : 0),
        value_pairs(pair_products ? block / 2 * Dv : 0);
    // The bf16 value rows go into pairs as they are (NoPositional): no fp32 copy.
    constexpr bool widens_values = !pair_products || Pos::rotates_values;
    std::vector<RotationStepper<T>> rotation(Pos::rotates_values ? last - first : 0,
                                             RotationStepper<T>(Pos::rotates_values ? pairs : 0));
    for (index_t j = 0; j < static_cast<index_t>(rotation.size()); ++j)
      rotation[j].seek(theta_of((first + j) % H), begin);
    for (index_t t0 = begin; t0 < end; t0 += block) {
      const index_t n = std::min(block, end - t0);
      const bool first_block = t0 == begin;
      for (index_t j = first; j < last; ++j) {
        const index_t b = j / H, h = j % H, state = state_of(j, segment);
        T* alpha = normaliser.data() + state * L;
        T* shift_j = shift.data() + state * L;
        T* max_j = column_max.data() + state * L;
        T* memory_j = memory.data() + state * L * Dv;
        const bool unrequested = unrequested_item(j, t0, begin, first, last);
        if (unrequested) prefetch_first_rows(k, v, b, h, t0, n);
        // The block's values go to a contiguous block (rows of one head lie
        // H * Dv apart: a block of them would share a few L1 sets): copied in
        // the pass over the key rows below, or here, with prefetches ahead, by
        // the range's first `items_ahead` items, which nothing requested.
        // 16-bit rows: keys and values widened into contiguous blocks here.
        const T* key;
        index_t key_stride;
        RowCopy<T> value_rows{nullptr, 0, Dv, values.data()};
        const RowCopy<T>* copies_values = nullptr;  // value rows copied in the key pass
        if constexpr (staged) {
          for (index_t r = 0; r < n; ++r) {
            if (unrequested) prefetch_ahead(k, v, b, h, t0, r, n);
            widen_row(k.row(b, t0 + r, h), staged_keys.data() + r * L, L);
            if (widens_values) widen_row(v.row(b, t0 + r, h), values.data() + r * Dv, Dv);
          }
          key = staged_keys.data();
          key_stride = L;
        } else {
          value_rows.from = v.row(b, t0, h);
          value_rows.stride = v.stride(1);
          if (unrequested)
            for (index_t r = 0; r < n; ++r) {
              prefetch_ahead(k, v, b, h, t0, r, n);
              value_rows.copy_row(r);
            }
          else
            copies_values = &value_rows;
          key = k.row(b, t0, h);
          key_stride = k_stride;
        }
        // e_{s,l} = exp(k_{s,l} - shift_l) into the contiguous block `keys`,
        // their column sums and the block's column maxima, in one pass over
        // the key rows. The shift is set `shift_headroom` above the column
        // maximum (Stab::reference_for) and moves only when the maximum passes
        // it (so e <= 1); then what was summed under the old shift is rescaled
        // (as RunningMax's eq. 21, once per block) and the block's exponentials
        // are taken again. In the first block of a state the maxima come first,
        // from a pass of their own.
        if (first_block) {
          column_max_rows(key, key_stride, n, L, block_max.data());
          move_shifts(block_max.data(), max_j, shift_j, alpha, memory_j);
        }
        shifted_column_exps(key, key_stride, n, L, shift_j, keys.data(), block_sum.data(),
                            block_max.data(), copies_values);
        if (!first_block && move_shifts(block_max.data(), max_j, shift_j, alpha, memory_j))
          shifted_column_exps(key, key_stride, n, L, shift_j, keys.data(), block_sum.data(),
                              block_max.data());
        if constexpr (Pos::rotates_values)  // R^{-s} v_s
          for (index_t r = 0; r < n; ++r) {
            rotation[j - first].rotate(values.data() + r * Dv, /*forward=*/false);
            rotation[j - first].next();
          }
        auto after_tile = prefetch_item_ahead(k, v, j, t0, first, last, end, (L + 3) / 4);
        if constexpr (pair_products) {
          // Tokens 2p and 2p + 1 as pair p; alpha sums the rounded exponentials.
          const index_t token_pairs = (n + 1) / 2;
          std::fill(block_sum.begin(), block_sum.end(), T(0));
          for (index_t p = 0; p < token_pairs; ++p) {
            const bool both = 2 * p + 1 < n;
            pack_row_pairs(keys.data() + 2 * p * L, both ? keys.data() + (2 * p + 1) * L : nullptr, L,
                           key_pairs.data() + p * L, block_sum.data());
            if constexpr (Pos::rotates_values)
              pack_row_pairs(values.data() + 2 * p * Dv, both ? values.data() + (2 * p + 1) * Dv : nullptr,
                             Dv, value_pairs.data() + p * Dv);
            else
              interleave_bf16_rows(v.row(b, t0 + 2 * p, h), both ? v.row(b, t0 + 2 * p + 1, h) : nullptr,
                                   Dv, value_pairs.data() + p * Dv);
          }
          for (index_t l = 0; l < L; ++l) alpha[l] += block_sum[l];
          accumulate_pair_outer_products(key_pairs.data(), token_pairs, L, value_pairs.data(), memory_j,
                                         Dv, after_tile);
        } else {
          for (index_t l = 0; l < L; ++l) alpha[l] += block_sum[l];
          accumulate_outer_products(keys.data(), n, L, values.data(), memory_j, Dv, after_tile);
        }
      }
    }
  };

  // Merge the segments of each head into its first (shifting each to the
  // largest column maximum), then M_l <- M_l / alpha_l = sum_s p(s|l) R^{-s} v_s
  // (zero for an empty latent).
  auto finish_head = [&](index_t j) {
    const index_t into = state_of(j, 0);
    for (index_t segment = 1; segment < segments; ++segment) {
      const index_t from = state_of(j, segment);
      for (index_t l = 0; l < L; ++l) {
        const T from_max = column_max[from * L + l], into_max = column_max[into * L + l];
        if (from_max == lowest) continue;  // nothing summed there
        T* target = memory.data() + (into * L + l) * Dv;
        const T* source = memory.data() + (from * L + l) * Dv;
        if (into_max == lowest || from_max > into_max) {
          // the merged shift is the other segment's: rescale what is here
          const T scale = into_max == lowest ? T(0) : std::exp(shift[into * L + l] - shift[from * L + l]);
          normaliser[into * L + l] *= scale;
          for (index_t d = 0; d < Dv; ++d) target[d] *= scale;
          column_max[into * L + l] = from_max;
          shift[into * L + l] = shift[from * L + l];
        }
        const T scale = std::exp(shift[from * L + l] - shift[into * L + l]);
        normaliser[into * L + l] += scale * normaliser[from * L + l];
        for (index_t d = 0; d < Dv; ++d) target[d] += scale * source[d];
      }
    }
    for (index_t l = 0; l < L; ++l) {
      T* row = memory.data() + (into * L + l) * Dv;
      const T alpha = normaliser[into * L + l];
      if (alpha == T(0)) std::fill(row, row + Dv, T(0));
      else
        for (index_t d = 0; d < Dv; ++d) row[d] /= alpha;
    }
    if constexpr (pair_products) {  // latents 2i and 2i + 1 as pair i
      const T* merged = memory.data() + into * L * Dv;
      std::uint32_t* to = memory_pairs.data() + j * latent_pairs * Dv;
      for (index_t i = 0; i < latent_pairs; ++i)
        pack_row_pairs(merged + 2 * i * Dv, 2 * i + 1 < L ? merged + (2 * i + 1) * Dv : nullptr, Dv,
                       to + i * Dv);
    }
  };

  // Pass 2: o_t = R^t sum_l p(l|t) M_l / alpha_l, p(l|t) = e_{t,l} / sum_l e_{t,l}.
  const index_t q_stride = q.stride(1);
  auto read_outputs = [&](index_t item) {
    // Plain variables, not structured bindings: lambdas below capture them
    // (C++20 allows capturing a binding; clang before 16 rejects it).
    const index_t first = head_range(item).first, last = head_range(item).second;
    const index_t begin = time_range(item).first, end = time_range(item).second;
    AlignedVector<T> gamma(block * L), row_sum(block);
    AlignedVector<T> staged_queries(staged ? block * L : 0), staged_out(staged ? block * Dv : 0);
    AlignedVector<std::uint32_t> read_pairs(pair_products ? block * latent_pairs : 0);
    std::vector<RotationStepper<T>> rotation(Pos::rotates_values ? last - first : 0,
                                             RotationStepper<T>(Pos::rotates_values ? pairs : 0));
    for (index_t j = 0; j < static_cast<index_t>(rotation.size()); ++j)
      rotation[j].seek(theta_of((first + j) % H), begin);
    for (index_t t0 = begin; t0 < end; t0 += block) {
      const index_t n = std::min(block, end - t0);
      for (index_t j = first; j < last; ++j) {
        const index_t b = j / H, h = j % H;
        const bool unrequested = unrequested_item(j, t0, begin, first, last);
        if (unrequested) prefetch_first_rows(q, out, b, h, t0, n);
        // row_sum: each row's sum beta_t (0 for a row of -inf).
        for (index_t r0 = 0; r0 < n; r0 += stage_tokens) {
          const index_t rows = std::min(stage_tokens, n - r0);
          if (unrequested)
            for (index_t r = r0; r < r0 + rows; ++r) prefetch_ahead(q, out, b, h, t0, r, n);
          if constexpr (staged) {
            for (index_t r = r0; r < r0 + rows; ++r)
              widen_row(q.row(b, t0 + r, h), staged_queries.data() + r * L, L);
            latent_softmax_exps(staged_queries.data() + r0 * L, L, rows, L, gamma.data() + r0 * L,
                                row_sum.data() + r0);
          } else {
            latent_softmax_exps(q.row(b, t0 + r0, h), q_stride, rows, L, gamma.data() + r0 * L,
                                row_sum.data() + r0);
          }
        }
        // p(l|t) = e_{t,l} / beta_t before the contraction, not after: the sum
        // of p(l|t) M_l is bounded by max |M_l|, the sum of e_{t,l} M_l only by
        // L times that (a value near the largest finite number overflowed).
        for (index_t r = 0; r < n; ++r) {
          const T inverse = row_sum[r] == T(0) ? T(0) : T(1) / row_sum[r];
          for (index_t l = 0; l < L; ++l) gamma[r * L + l] *= inverse;
        }
        T* out_rows;
        index_t out_stride;
        if constexpr (staged) {
          out_rows = staged_out.data();
          out_stride = Dv;
        } else {
          out_rows = out.row(b, t0, h);
          out_stride = out.stride(1);
        }
        auto after_tile = prefetch_item_ahead(q, out, j, t0, first, last, end, (n + 3) / 4);
        if constexpr (pair_products) {
          for (index_t r = 0; r < n; ++r)
            round_row_to_pairs(gamma.data() + r * L, L, latent_pairs, read_pairs.data() + r * latent_pairs);
          read_pair_memory_rows(read_pairs.data(), n, latent_pairs,
                                memory_pairs.data() + j * latent_pairs * Dv, Dv, out_rows, out_stride,
                                after_tile);
        } else {
          read_memory_rows(gamma.data(), n, L, memory.data() + state_of(j, 0) * L * Dv, Dv, out_rows,
                           out_stride, nullptr, after_tile);
        }
        if constexpr (Pos::rotates_values)
          for (index_t i = 0; i < n; ++i) {
            rotation[j - first].rotate(out_rows + i * out_stride, /*forward=*/true);  // R^t
            rotation[j - first].next();
          }
        if constexpr (staged)
          for (index_t i = 0; i < n; ++i) narrow_row(out_rows + i * Dv, out.row(b, t0 + i, h), Dv);
      }
    }
  };

  // With whole heads per worker, each worker's heads need nothing from
  // another's: one parallel region runs both passes (no second fork and join,
  // no serial merge). Otherwise the segments' sums are merged between them.
  if (segments == 1) {
    parallel_for(items, workers, [&](index_t item, int) {
      sum_keys_and_values(item);
      for (index_t j = head_range(item).first; j < head_range(item).second; ++j) finish_head(j);
      read_outputs(item);
    });
  } else {
    parallel_for(items, workers, [&](index_t item, int) { sum_keys_and_values(item); });
    for (index_t j = 0; j < heads; ++j) finish_head(j);
    parallel_for(items, workers, [&](index_t item, int) { read_outputs(item); });
  }
}

}  // namespace latte::cpu
