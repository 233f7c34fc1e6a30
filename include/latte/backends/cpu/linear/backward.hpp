#pragma once
// CPU backward of the linear-attention family (DESIGN §3.6; the equations are
// in backends/reference/linear.hpp's backward section), in the chunked GEMM
// form: per block of C = linear_backward_block tokens of one (b, h), with E_Q, E'_Q,
// E_K, E'_K the block's feature rows, G the rows g_t / n_t and dD the
// denominators' gradients,
//
//   forward sweep:  dE_Q  = tril(G V^T) E_K + G S^T
//                   dE'_Q = dD * (z + prefix sums of E'_K)
//                   then S += E_K^T V, z += 1^T E'_K
//   reverse sweep:  dE_K  = tril(G V^T)^T E_Q + V U^T
//                   dV    = tril(E_Q E_K^T)^T G + E_K U
//                   dE'_K = u + suffix sums of dD E'_Q
//                   then U += E_Q^T G, u += E'_Q^T dD
//
// (bidirectional and cross: the same without the triangles, S over the
// whole source). Each token's feature gradients then go back through its
// streams, rotation, proportion and feature map (vectorised for the built-in
// maps without re-weighting or rotation; reference::linear_features_backward
// otherwise). Nothing of size T x E x Dv is made:
// S and U are recomputed by the two sweeps; a worker keeps 1 / n_t and dD_t of
// its head's T tokens between them. (b, h) pairs run in parallel.
#include <algorithm>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "latte/backends/cpu/block_contractions.hpp"
#include "latte/backends/cpu/compensated_sums.hpp"
#include "latte/backends/cpu/linear/forward.hpp"
#include "latte/backends/cpu/memory_pass.hpp"
#include "latte/backends/cpu/parallel.hpp"
#include "latte/backends/cpu/prefetch.hpp"
#include "latte/backends/cpu/simd.hpp"
#include "latte/backends/reference/linear.hpp"
#include "latte/core/huge_page_allocator.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/policies/feature_map.hpp"
#include "latte/policies/positional.hpp"
#include "latte/policies/reweight.hpp"
#include "latte/policies/summation.hpp"

namespace latte::cpu {

/// Tokens per block of the backward's sweeps: the intra-block triangles cost
/// C (E + Dv) per token on top of the 6 E Dv of the carries' GEMMs, so blocks
/// are smaller than the forward's (measured, B1 H8 E64 D64 fp32 at 16K on one
/// thread: 233 ms at 16, 246 ms at 32, 273 ms at 64).
inline constexpr index_t linear_backward_block = 16;

/// One worker's backward workspace: a block's features and their gradients,
/// the carries S, z and U, u, and the C x C score matrices.
template <Real T>
struct LinearBackwardWorkspace {
  /// `cached_tokens` tokens of `cached_sides` feature rows (2, or 4 with separate denominators).
  LinearBackwardWorkspace(const LinearSpec& spec, index_t cached_tokens, index_t cached_sides)
      : features(spec, linear_backward_block),
        carry(static_cast<std::size_t>(spec.expanded_dim() * (spec.value_dim + 1))),
        adjoint(carry.size()),
        feature_scratch(static_cast<std::size_t>(3 * spec.feature_dim)),
        memory_t(carry.size()), adjoint_t(carry.size()),
        normaliser(static_cast<std::size_t>(spec.expanded_dim())), d_normaliser(normaliser.size()),
        pass_weights(static_cast<std::size_t>(4 * std::max(spec.expanded_dim(), spec.value_dim))),
        pass_reads(pass_weights.size()), pass_values(pass_weights.size()),
        zero_row(pass_weights.size() / 4), discard_row(zero_row.size()),
        denominators(static_cast<std::size_t>(linear_backward_block)),
        cached_features(static_cast<std::size_t>(cached_sides * cached_tokens * spec.expanded_dim())),
        reads(static_cast<std::size_t>(cached_tokens)),
        scores(linear_backward_block, linear_backward_block), d_scores(linear_backward_block, linear_backward_block),
        numerators(linear_backward_block, spec.value_dim), scaled(linear_backward_block, spec.value_dim),
        d_query_numerator(linear_backward_block, spec.expanded_dim()),
        d_query_denominator(linear_backward_block, spec.expanded_dim()),
        d_key_numerator(linear_backward_block, spec.expanded_dim()),
        d_key_denominator(linear_backward_block, spec.expanded_dim()),
        memory_window(spec.value_dim, spec.expanded_dim()),
        adjoint_window(spec.expanded_dim(), spec.value_dim),
        normaliser_low(normaliser.size()), d_normaliser_low(normaliser.size()) {}
  LinearScratch<T> features;
  AlignedVector<T> carry, adjoint, feature_scratch;
  // The causal sweeps' carries for the register-blocked passes: S^T and U^T
  // [Dv x E] (U is `adjoint`, S's initial value arrives in `carry`), z and u [E];
  // four tokens' weights and reads, a zero row and a row nothing reads.
  AlignedVector<T> memory_t, adjoint_t, normaliser, d_normaliser;
  AlignedVector<T> pass_weights, pass_reads, pass_values, zero_row, discard_row;
  std::vector<T> denominators;  // D_t of one block
  // The head's feature rows from the forward sweep, read again by the reverse
  // sweep: e(q), e(k) and, where they differ, e'(q), e'(k) [T x E] each.
  AlignedVector<T> cached_features;
  std::vector<reference::ReadGradient<T>> reads;  // per token of the head (causal)
  RowMatrix<T> scores, d_scores, numerators, scaled;
  RowMatrix<T> d_query_numerator, d_query_denominator, d_key_numerator, d_key_denominator;
  // Compensated sums (compensated_sums.hpp): the terms of S^T and U since the
  // last fold, and the low parts of z and u (TwoSum per token).
  ScaledTermWindow<T> memory_window, adjoint_window;
  AlignedVector<T> normaliser_low, d_normaliser_low;
};

/// S (memory, E x Dv) and z (normaliser, E) laid out in `storage`.
template <Real T>
[[nodiscard]] LinearCarry<T> carry_in(AlignedVector<T>& storage, index_t E, index_t Dv) noexcept {
  return {storage.data(), storage.data() + E * Dv};
}

/// The query side of one block of n tokens: given the numerators E_Q S (+ the
/// intra-block part) in ws.numerators and the denominators in
/// ws.features.denominator, forms 1 / n_t, dD_t and G = rows g_t / n_t
/// (ws.scaled), stored into `reads`.
template <Real T>
void block_read_gradients(const ConstRows<T>& d_out, index_t n, const Normaliser& normaliser,
                          LinearBackwardWorkspace<T>& ws, reference::ReadGradient<T>* reads) {
  for (index_t r = 0; r < n; ++r) {
    const T denominator = ws.features.denominator[static_cast<std::size_t>(r)];
    const T inverse = T(1) / normaliser.apply(denominator);
    ws.scaled.row(r) = d_out.row(r) * inverse;
    const T g_dot_o = ws.scaled.row(r).dot(ws.numerators.row(r)) ;  // <g, o> = <G_r, num_r>
    reads[r] = {inverse, -normaliser.derivative(denominator) * g_dot_o * inverse};
  }
}

/// dL/dx of one row from dL/dphi, given x and phi(x): the built-in maps
/// vectorised (elu + 1's derivative is phi itself where x <= 0), any other map
/// through its backward().
template <FeatureMap Map, Real T>
LATTE_FLATTEN void feature_map_backward_row(const T* x, const T* phi, const T* d_phi, T* d_x,
                                            index_t key_dim, index_t feature_dim) noexcept {
  constexpr bool builtin = std::is_same_v<Map, Relu> || std::is_same_v<Map, EluPlusOne> ||
                           std::is_same_v<Map, Identity>;
  if constexpr (builtin) {
    index_t i = 0;
#if LATTE_WITH_XSIMD
    using B = simd::batch<T>;
    constexpr index_t W = simd::width<T>;
    for (; i + W <= key_dim; i += W) {
      const B value = simd::load(x + i), gradient = simd::load(d_phi + i);
      if constexpr (std::is_same_v<Map, Relu>)
        simd::store(d_x + i, xsimd::select(value > B(T(0)), gradient, B(T(0))));
      else if constexpr (std::is_same_v<Map, EluPlusOne>)
        simd::store(d_x + i, xsimd::select(value > B(T(0)), gradient, gradient * simd::load(phi + i)));
      else
        simd::store(d_x + i, gradient);
    }
#endif
    for (; i < key_dim; ++i) {
      if constexpr (std::is_same_v<Map, Relu>) d_x[i] = x[i] > T(0) ? d_phi[i] : T(0);
      else if constexpr (std::is_same_v<Map, EluPlusOne>)
        d_x[i] = x[i] > T(0) ? d_phi[i] : d_phi[i] * phi[i];
      else d_x[i] = d_phi[i];
    }
  } else {
    (void)phi;
    Map::backward(std::span<const T>(x, static_cast<std::size_t>(key_dim)),
                  std::span<const T>(d_phi, static_cast<std::size_t>(feature_dim)),
                  std::span<T>(d_x, static_cast<std::size_t>(key_dim)));
  }
}

/// Token r's feature gradients (rows of dL/de and dL/de') back to its input
/// row x: d_x. Without re-weighting and rotation e = e' = phi(x) (`phi`, from
/// the block's features): dL/dphi = dL/de + dL/de', then the map's derivative.
/// Otherwise through the streams, rotation and proportion
/// (reference::linear_features_backward).
template <FeatureMap Map, Reweight Rw, Positional Pos, Real T, class ProportionOf,
          class ProportionBackward>
void token_backward(const T* x, const T* phi, std::int64_t position, const double* theta,
                    const LinearSpec& spec, ProportionOf&& proportion_of,
                    ProportionBackward&& proportion_backward, const T* d_numerator,
                    const T* d_denominator, T* scratch, T* d_x) {
  if constexpr (Rw::streams == 1 && !Pos::rotates_queries_keys) {
    const index_t F = spec.feature_dim;
    index_t i = 0;
#if LATTE_WITH_XSIMD
    constexpr index_t W = simd::width<T>;
    for (; i + W <= F; i += W)
      simd::store(scratch + i, simd::load(d_numerator + i) + simd::load(d_denominator + i));
#endif
    for (; i < F; ++i) scratch[i] = d_numerator[i] + d_denominator[i];
    feature_map_backward_row<Map>(x, phi, scratch, d_x, spec.key_dim, F);
  } else {
    (void)phi;
    reference::linear_features_backward<Map, Rw, Pos>(x, position, theta, spec, proportion_of,
                                                      proportion_backward, d_numerator,
                                                      d_denominator, scratch, d_x);
  }
}

/// Gradient of linear_causal_forward; the reference's signature
/// (reference::linear_causal_backward), `proportion_backward` receiving the
/// worker's index first. Both sweeps run the forward's register-blocked pass
/// (memory_pass.hpp) four tokens at a time, on carries laid out for it:
///   forward:  S^T [Dv x E] += v_j e(k_j)^T, then dL/de(q_j) = S_j g~_j  (rows d)
///   reverse:  U [E x Dv] += e(q_j) g~_j^T, then dL/dv_j = U_j^T e(k_j)  (rows e)
///             U^T [Dv x E] likewise, then dL/de(k_j) = U_j v_j          (rows d)
/// (g~_j = g_j / n_j), so every contraction accumulates whole rows and none
/// needs a horizontal sum; U is kept twice rather than read across its rows.
/// <g_j, o_j> = e(q_j) . S_j g~_j comes from the query's own gradient.
///
/// Compensated sums (Sum = CompensatedSums): the sums over the whole past (S,
/// z) and future (U, u) keep their error independent of T. S^T and U keep
/// their plain running sums for the reads and restart every fold_tokens
/// tokens from pairs fed by a ScaledTermWindow (U^T restarts as U's
/// transpose); z and u, E values a token, are pairs updated by TwoSum.
template <FeatureMap Map, Reweight Rw, Positional Pos, Summation Sum = CompensatedSums, Real T,
          class ProportionOf, class ProportionBackward, class InitialOf, class FinalGradientOf,
          class InitialGradientOf>
void linear_causal_backward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                            TensorView<const T, 4> v, TensorView<const T, 4> d_out,
                            TensorView<T, 4> d_q, TensorView<T, 4> d_k, TensorView<T, 4> d_v,
                            const LinearSpec& spec, std::int64_t first_position,
                            ProportionOf&& proportion_of, ProportionBackward&& proportion_backward,
                            InitialOf&& initial_of, FinalGradientOf&& final_gradient_of,
                            InitialGradientOf&& initial_gradient_of) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), heads = B * H;
  const index_t E = spec.expanded_dim(), Dv = spec.value_dim;
  if (Tn == 0 || heads == 0) return;
  const bool separate = separate_denominator<Pos>(spec);
  const double work = double(heads) * double(Tn) * double(E) * double(Dv);
  const int workers = work >= 1 << 18 ? thread_count() : 1;
  std::vector<LinearBackwardWorkspace<T>> workspaces(static_cast<std::size_t>(workers),
                                                     LinearBackwardWorkspace<T>(spec, Tn, separate ? 4 : 2));
  parallel_for(heads, workers, [&](index_t i, int worker) {
    const index_t b = i / H, h = i % H;
    LinearBackwardWorkspace<T>& ws = workspaces[static_cast<std::size_t>(worker)];
    LinearScratch<T>& fs = ws.features;
    const double* theta = spec.theta(h);
    T* z = ws.normaliser.data();
    T* u = ws.d_normaliser.data();
    T* z_low = ws.normaliser_low.data();
    T* u_low = ws.d_normaliser_low.data();
    T* zero_row = ws.zero_row.data();
    T* discard = ws.discard_row.data();
    auto cached = [&](int side) { return ws.cached_features.data() + side * Tn * E; };
    auto features = [&](index_t c0, index_t n) {
      seek_rotation<Pos>(fs, spec, h, first_position + c0);
      block_features<Map, Rw, Pos>(&q, &k, b, h, c0, n, first_position + c0, spec, proportion_of,
                                   fs);
    };
    auto backward_row = [&](Side side, const T* x, const T* phi, index_t t,
                            const T* d_numerator, const T* d_denominator, T* d_x) {
      const std::int64_t position = first_position + t;
      token_backward<Map, Rw, Pos>(
          x, phi, position, theta, spec,
          [&](const T* p) { return proportion_of(side, b, t, h, position, p); },
          [&](const Proportion& p, double dp, const T* p_phi, T* d_phi) {
            proportion_backward(worker, side, b, t, h, p, dp, p_phi, d_phi);
          },
          d_numerator, d_denominator, ws.feature_scratch.data(), d_x);
    };
    // Gathers four tokens' rows for a pass: `weights` [4 x N] (zeros past
    // `count`), and row pointers (a zero row / a discarded row past `count`).
    auto gather = [&](T* weights, index_t N, index_t count, auto&& row_of) {
      for (index_t j = 0; j < 4; ++j) {
        if (j < count) std::copy_n(row_of(j), N, weights + j * N);
        else std::fill_n(weights + j * N, N, T(0));
      }
    };
    {  // S^T, z from the initial state
      reference::LinearCarry<T> carry{ws.carry.data(), z};
      initial_of(b, h, carry);
      transpose_into(ws.carry.data(), E, Dv, ws.memory_t.data());
      if constexpr (Sum::compensated) {
        ws.memory_window.start(ws.memory_t.data(), nullptr);
        std::fill_n(z_low, E, T(0));
      }
    }
    for (index_t c0 = 0; c0 < Tn; c0 += linear_backward_block) {  // forward sweep
      const index_t n = std::min(linear_backward_block, Tn - c0);
      features(c0, n);
      const T* kn = fs.key_numerator.data();
      const T* qn = fs.query_numerator.data();
      const T* kd = separate ? fs.key_denominator.data() : kn;
      const T* qd = separate ? fs.query_denominator.data() : qn;
      for (int side = 0; side < (separate ? 4 : 2); ++side) {
        const T* rows[4] = {qn, kn, qd, kd};
        std::copy_n(rows[side], n * E, cached(side) + c0 * E);
      }
      auto d_qn = ws.d_query_numerator.topRows(n);
      auto d_qd = ws.d_query_denominator.topRows(n);
      reference::ReadGradient<T>* reads = ws.reads.data() + c0;
      std::vector<T>& D = ws.denominators;
      for (index_t r = 0; r < n; ++r) {  // z_t (after key t), D_t, 1 / n_t; z_t kept for dE'_Q
        // The next block's rows into L2, a token's with each token: a head's rows
        // are H * width elements apart, where the hardware prefetchers stop.
        if (const index_t s = c0 + r + linear_backward_block; s < Tn)
          prefetch_token_rows<CacheLevel::l2>(b, s, h, q, k, v, d_out, d_q);
        T denominator;
        if constexpr (Sum::compensated) {
          add_to_pairs(z, z_low, kd + r * E, E);
          denominator = dot(z, qd + r * E, E);
        } else {
          denominator = absorb_read_normaliser(z, kd + r * E, qd + r * E, E);
        }
        std::copy_n(z, E, d_qd.row(r).data());
        D[static_cast<std::size_t>(r)] = denominator;
        reads[r].inverse_normaliser = T(1) / spec.normaliser.apply(denominator);
      }
      for (index_t r0 = 0; r0 < n; r0 += 4) {
        const index_t count = std::min<index_t>(4, n - r0);
        // A full quad reads the values' rows in place; a partial one pads with zeros.
        const T* weights = v.row(b, c0 + r0, h);
        index_t weight_stride = v.stride(1);
        if (count < 4) {
          gather(ws.pass_weights.data(), Dv, count, [&](index_t j) { return v.row(b, c0 + r0 + j, h); });
          weights = ws.pass_weights.data();
          weight_stride = Dv;
        }
        for (index_t j = 0; j < 4; ++j) {
          T* g = ws.pass_reads.data() + j * Dv;
          if (j >= count) { std::fill_n(g, Dv, T(0)); continue; }
          scaled_copy(d_out.row(b, c0 + r0 + j, h), reads[r0 + j].inverse_normaliser, g, Dv);
        }
        const T* values[4];
        T* outs[4];
        for (index_t j = 0; j < 4; ++j) {
          values[j] = j < count ? kn + (r0 + j) * E : zero_row;
          outs[j] = j < count ? d_qn.row(r0 + j).data() : discard;
        }
        update_and_read_quad_strided<T>(ws.memory_t.data(), weights, weight_stride,
                                        ws.pass_reads.data(), Dv, values, outs, Dv, E);
      }
      if constexpr (Sum::compensated) {  // S^T += v_t e(k_t)^T
        for (index_t r = 0; r < n; ++r) ws.memory_window.append(v.row(b, c0 + r, h), kn + r * E);
        if (!ws.memory_window.has_room(linear_backward_block))
          ws.memory_window.fold(ws.memory_t.data(), nullptr);
      }
      for (index_t r = 0; r < n; ++r) {
        const T g_dot_o = dot(qn + r * E, d_qn.row(r).data(), E);  // <g, o> = e(q) . S g~
        const T inverse = reads[r].inverse_normaliser;
        reads[r].d_denominator =
            -spec.normaliser.derivative(D[static_cast<std::size_t>(r)]) * g_dot_o * inverse;
        d_qd.row(r) *= reads[r].d_denominator;
        backward_row(Side::query, q.row(b, c0 + r, h), qn + r * E, c0 + r, d_qn.row(r).data(),
                     d_qd.row(r).data(), d_q.row(b, c0 + r, h));
      }
    }
    {  // U, U^T, u from the final state's gradient
      const LinearCarry<const T> d_final = final_gradient_of(b, h);
      if (d_final.memory) {
        std::copy_n(d_final.memory, E * Dv, ws.adjoint.data());
        std::copy_n(d_final.normaliser, E, u);
      } else {
        std::fill_n(ws.adjoint.data(), E * Dv, T(0));
        std::fill_n(u, E, T(0));
      }
      transpose_into(ws.adjoint.data(), E, Dv, ws.adjoint_t.data());
      if constexpr (Sum::compensated) {
        ws.adjoint_window.start(ws.adjoint.data(), nullptr);
        std::fill_n(u_low, E, T(0));
      }
    }
    const index_t last = (Tn - 1) / linear_backward_block * linear_backward_block;
    for (index_t c0 = last;; c0 -= linear_backward_block) {  // reverse sweep
      const index_t n = std::min(linear_backward_block, Tn - c0);
      const T* qn = cached(0) + c0 * E;
      const T* kn = cached(1) + c0 * E;
      const T* qd = separate ? cached(2) + c0 * E : qn;
      auto d_kn = ws.d_key_numerator.topRows(n);
      auto d_kd = ws.d_key_denominator.topRows(n);
      const reference::ReadGradient<T>* reads = ws.reads.data() + c0;
      for (index_t r = n; r-- > 0;) {  // u_t = u_{t+1} + dD_t e'(q_t)
        if (const index_t s = c0 + r - linear_backward_block; s >= 0) {  // the previous block's rows
          prefetch_token_rows<CacheLevel::l2>(b, s, h, q, k, v, d_out, d_k, d_v);
          for (int side = 0; side < (separate ? 4 : 2); ++side)
            prefetch_row<CacheLevel::l2>(cached(side) + s * E, sizeof(T) * static_cast<std::size_t>(E));
        }
        if constexpr (Sum::compensated)
          add_scaled_to_pairs(u, u_low, reads[r].d_denominator, qd + r * E, E);
        else
          for (index_t e = 0; e < E; ++e) u[e] += reads[r].d_denominator * qd[r * E + e];
        std::copy_n(u, E, d_kd.row(r).data());
      }
      for (index_t r1 = n; r1 > 0; r1 -= std::min<index_t>(4, r1)) {  // tokens r1 - 1, r1 - 2, ...
        const index_t count = std::min<index_t>(4, r1);
        auto token = [&](index_t j) { return r1 - 1 - j; };
        for (index_t j = 0; j < 4; ++j) {
          T* g = ws.pass_values.data() + j * Dv;
          if (j >= count) { std::fill_n(g, Dv, T(0)); continue; }
          scaled_copy(d_out.row(b, c0 + token(j), h), reads[token(j)].inverse_normaliser, g, Dv);
        }
        const T* scaled[4];
        const T* query_rows[4];
        T* d_values[4];
        T* d_keys[4];
        for (index_t j = 0; j < 4; ++j) {
          scaled[j] = ws.pass_values.data() + j * Dv;
          query_rows[j] = j < count ? qn + token(j) * E : zero_row;
          d_values[j] = j < count ? d_v.row(b, c0 + token(j), h) : discard;
          d_keys[j] = j < count ? d_kn.row(token(j)).data() : discard;
        }
        // A full quad reads its rows in place, latest token first (negative
        // strides); a partial one gathers them and pads with zeros.
        const bool full = count == 4;
        const T* query_features = qn + token(0) * E;
        const T* key_features = kn + token(0) * E;
        const T* value_rows = v.row(b, c0 + token(0), h);
        index_t feature_stride = -E, value_stride = -v.stride(1);
        if (!full) {
          gather(ws.pass_weights.data(), E, count, [&](index_t j) { return qn + token(j) * E; });
          gather(ws.pass_reads.data(), E, count, [&](index_t j) { return kn + token(j) * E; });
          query_features = ws.pass_weights.data();
          key_features = ws.pass_reads.data();
          feature_stride = E;
        }
        // U += e(q_j) g~_j^T, then dL/dv_j = U^T e(k_j).
        update_and_read_quad_strided<T>(ws.adjoint.data(), query_features, feature_stride,
                                        key_features, feature_stride, scaled, d_values, E, Dv);
        // U^T += g~_j e(q_j)^T, then dL/de(k_j) = U v_j.
        if (!full) {
          gather(ws.pass_reads.data(), Dv, count,
                 [&](index_t j) { return v.row(b, c0 + token(j), h); });
          value_rows = ws.pass_reads.data();
          value_stride = Dv;
        }
        update_and_read_quad_strided<T>(ws.adjoint_t.data(), ws.pass_values.data(), Dv,
                                        value_rows, value_stride, query_rows, d_keys, Dv, E);
        if constexpr (Sum::compensated)  // U += e(q_j) g~_j^T
          for (index_t j = 0; j < count; ++j)
            ws.adjoint_window.append(qn + token(j) * E, ws.pass_values.data() + j * Dv);
      }
      if constexpr (Sum::compensated) {  // U and U^T restart from the compensated U
        if (!ws.adjoint_window.has_room(linear_backward_block) || c0 == 0) {
          ws.adjoint_window.fold(ws.adjoint.data(), nullptr);
          transpose_into(ws.adjoint.data(), E, Dv, ws.adjoint_t.data());
        }
      }
      for (index_t r = 0; r < n; ++r)
        backward_row(Side::key, k.row(b, c0 + r, h), kn + r * E, c0 + r, d_kn.row(r).data(),
                     d_kd.row(r).data(), d_k.row(b, c0 + r, h));
      if (c0 == 0) break;
    }
    const LinearCarry<T> d_initial = initial_gradient_of(b, h);
    if (d_initial.memory) {
      std::copy_n(ws.adjoint.data(), E * Dv, d_initial.memory);
      std::copy_n(u, E, d_initial.normaliser);
    }
  });
}

/// Gradient of linear_bidirectional_forward (self- or cross-attention); the
/// reference's signature, `proportion_backward` receiving the worker first.
template <FeatureMap Map, Reweight Rw, Positional Pos, Real T, class ProportionOf,
          class ProportionBackward>
void linear_bidirectional_backward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                                   TensorView<const T, 4> v, TensorView<const T, 4> d_out,
                                   TensorView<T, 4> d_q, TensorView<T, 4> d_k,
                                   TensorView<T, 4> d_v, const LinearSpec& spec,
                                   ProportionOf&& proportion_of,
                                   ProportionBackward&& proportion_backward) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), Sn = k.extent(1);
  const index_t E = spec.expanded_dim(), Dv = spec.value_dim, heads = B * H;
  if (heads == 0) return;
  const bool separate = separate_denominator<Pos>(spec);
  const double work = double(heads) * double(Tn + Sn) * double(E) * double(Dv);
  const int workers = work >= 1 << 18 ? thread_count() : 1;
  std::vector<LinearBackwardWorkspace<T>> workspaces(static_cast<std::size_t>(workers),
                                                     LinearBackwardWorkspace<T>(spec, 0, 0));
  const TensorView<const T, 4>* no_view = nullptr;
  parallel_for(heads, workers, [&](index_t i, int worker) {
    const index_t b = i / H, h = i % H;
    LinearBackwardWorkspace<T>& ws = workspaces[static_cast<std::size_t>(worker)];
    LinearScratch<T>& fs = ws.features;
    const double* theta = spec.theta(h);
    const LinearCarry<T> carry = carry_in(ws.carry, E, Dv);
    const LinearCarry<T> adjoint = carry_in(ws.adjoint, E, Dv);
    const Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>> z(carry.normaliser, E);
    Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>> u(adjoint.normaliser, E);
    T* const S_t = ws.memory_t.data();  // S^T [Dv x E], then U^T
    auto backward_row = [&](Side side, const T* x, const T* phi, index_t t,
                            const T* d_numerator, const T* d_denominator, T* d_x) {
      token_backward<Map, Rw, Pos>(
          x, phi, t, theta, spec, [&](const T* phi) { return proportion_of(side, b, t, h, t, phi); },
          [&](const Proportion& p, double dp, const T* phi, T* d_phi) {
            proportion_backward(worker, side, b, t, h, p, dp, phi, d_phi);
          },
          d_numerator, d_denominator, ws.feature_scratch.data(), d_x);
    };
    reference::linear_reset(carry, E, Dv);  // S = E_K^T V, z = 1^T E'_K over the source
    seek_rotation<Pos>(fs, spec, h, 0);
    for (index_t c0 = 0; c0 < Sn; c0 += linear_backward_block) {
      const index_t n = std::min(linear_backward_block, Sn - c0);
      prefetch_next_block(b, h, c0, linear_backward_block, Sn, k, v);
      block_features<Map, Rw, Pos>(no_view, &k, b, h, c0, n, c0, spec, proportion_of, fs);
      absorb_block(fs, separate, rows_of(v, b, h, c0, n), n, carry, E, Dv);
    }
    transpose_into(carry.memory, E, Dv, S_t);
    reference::linear_reset(adjoint, E, Dv);
    reference::ReadGradient<T> reads[linear_backward_block];
    seek_rotation<Pos>(fs, spec, h, 0);
    for (index_t c0 = 0; c0 < Tn; c0 += linear_backward_block) {  // queries: their gradients, U and u
      const index_t n = std::min(linear_backward_block, Tn - c0);
      prefetch_next_block(b, h, c0, linear_backward_block, Tn, q, d_out, d_q);
      block_features<Map, Rw, Pos>(&q, no_view, b, h, c0, n, c0, spec, proportion_of, fs);
      // The block's products through the register-tiled contractions
      // (block_contractions.hpp; Eigen's GEMMs on 16-token blocks spent their
      // time packing): E_Q S, G S^T against S^T, U += E_Q^T G.
      const ConstRows<T> qn(fs.query_numerator.data(), n, E, Eigen::OuterStride<>(E));
      const ConstRows<T> qd(separate ? fs.query_denominator.data() : fs.query_numerator.data(), n,
                            E, Eigen::OuterStride<>(E));
      read_memory_rows(fs.query_numerator.data(), n, E, carry.memory, Dv, ws.numerators.data(), Dv,
                       nullptr);
      for (index_t r = 0; r < n; ++r) fs.denominator[r] = dot(qd.row(r).data(), carry.normaliser, E);
      block_read_gradients<T>(rows_of(d_out, b, h, c0, n), n, spec.normaliser, ws, reads);
      auto d_qn = ws.d_query_numerator.topRows(n);
      auto d_qd = ws.d_query_denominator.topRows(n);
      read_memory_rows(ws.scaled.data(), n, Dv, S_t, E, d_qn.data(), E, nullptr);
      for (index_t r = 0; r < n; ++r) {
        d_qd.row(r) = reads[r].d_denominator * z;
        u += reads[r].d_denominator * qd.row(r);
      }
      accumulate_outer_products(fs.query_numerator.data(), n, E, ws.scaled.data(), adjoint.memory, Dv);
      for (index_t r = 0; r < n; ++r)
        backward_row(Side::query, q.row(b, c0 + r, h), qn.row(r).data(), c0 + r,
                     d_qn.row(r).data(),
                     d_qd.row(r).data(), d_q.row(b, c0 + r, h));
    }
    transpose_into(adjoint.memory, E, Dv, S_t);  // U^T
    seek_rotation<Pos>(fs, spec, h, 0);
    for (index_t c0 = 0; c0 < Sn; c0 += linear_backward_block) {  // keys and values
      const index_t n = std::min(linear_backward_block, Sn - c0);
      prefetch_next_block(b, h, c0, linear_backward_block, Sn, k, v, d_k, d_v);
      block_features<Map, Rw, Pos>(no_view, &k, b, h, c0, n, c0, spec, proportion_of, fs);
      const ConstRows<T> kn(fs.key_numerator.data(), n, E, Eigen::OuterStride<>(E));
      T* values = fs.block_values.data();  // the value rows contiguous
      for (index_t r = 0; r < n; ++r) simd::copy(v.row(b, c0 + r, h), Dv, values + r * Dv);
      auto d_kn = ws.d_key_numerator.topRows(n);
      auto d_kd = ws.d_key_denominator.topRows(n);
      read_memory_rows(values, n, Dv, S_t, E, d_kn.data(), E, nullptr);  // V U^T
      d_kd = u.replicate(n, 1);
      read_memory_rows(fs.key_numerator.data(), n, E, adjoint.memory, Dv, d_v.row(b, c0, h),
                       d_v.stride(1), nullptr);  // E_K U
      for (index_t r = 0; r < n; ++r)
        backward_row(Side::key, k.row(b, c0 + r, h), kn.row(r).data(), c0 + r,
                     d_kn.row(r).data(),
                     d_kd.row(r).data(), d_k.row(b, c0 + r, h));
    }
  });
}

}  // namespace latte::cpu
