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

#include "latte/backends/cpu/linear/forward.hpp"
#include "latte/backends/cpu/parallel.hpp"
#include "latte/backends/cpu/simd.hpp"
#include "latte/backends/reference/linear.hpp"
#include "latte/core/huge_page_allocator.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/policies/feature_map.hpp"
#include "latte/policies/positional.hpp"
#include "latte/policies/reweight.hpp"

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
  LinearBackwardWorkspace(const LinearSpec& spec, index_t tokens)
      : features(spec, linear_backward_block),
        carry(static_cast<std::size_t>(spec.expanded_dim() * (spec.value_dim + 1))),
        adjoint(carry.size()),
        feature_scratch(static_cast<std::size_t>(3 * spec.feature_dim)),
        reads(static_cast<std::size_t>(tokens)),
        scores(linear_backward_block, linear_backward_block), d_scores(linear_backward_block, linear_backward_block),
        numerators(linear_backward_block, spec.value_dim), scaled(linear_backward_block, spec.value_dim),
        d_query_numerator(linear_backward_block, spec.expanded_dim()),
        d_query_denominator(linear_backward_block, spec.expanded_dim()),
        d_key_numerator(linear_backward_block, spec.expanded_dim()),
        d_key_denominator(linear_backward_block, spec.expanded_dim()) {}
  LinearScratch<T> features;
  AlignedVector<T> carry, adjoint, feature_scratch;
  std::vector<reference::ReadGradient<T>> reads;  // per token of the head (causal)
  RowMatrix<T> scores, d_scores, numerators, scaled;
  RowMatrix<T> d_query_numerator, d_query_denominator, d_key_numerator, d_key_denominator;
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
/// worker's index first.
template <FeatureMap Map, Reweight Rw, Positional Pos, Real T, class ProportionOf,
          class ProportionBackward, class InitialOf, class FinalGradientOf,
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
                                                     LinearBackwardWorkspace<T>(spec, Tn));
  parallel_for(heads, workers, [&](index_t i, int worker) {
    const index_t b = i / H, h = i % H;
    LinearBackwardWorkspace<T>& ws = workspaces[static_cast<std::size_t>(worker)];
    LinearScratch<T>& fs = ws.features;
    const double* theta = spec.theta(h);
    const LinearCarry<T> carry = carry_in(ws.carry, E, Dv);
    const LinearCarry<T> adjoint = carry_in(ws.adjoint, E, Dv);
    Rows<T> S(carry.memory, E, Dv, Eigen::OuterStride<>(Dv));
    Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>> z(carry.normaliser, E);
    Rows<T> U(adjoint.memory, E, Dv, Eigen::OuterStride<>(Dv));
    Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>> u(adjoint.normaliser, E);
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
          [&](const T* phi) { return proportion_of(side, b, t, h, position, phi); },
          [&](const Proportion& p, double dp, const T* phi, T* d_phi) {
            proportion_backward(worker, side, b, t, h, p, dp, phi, d_phi);
          },
          d_numerator, d_denominator, ws.feature_scratch.data(), d_x);
    };
    initial_of(b, h, carry);
    for (index_t c0 = 0; c0 < Tn; c0 += linear_backward_block) {  // forward sweep: query gradients
      const index_t n = std::min(linear_backward_block, Tn - c0);
      features(c0, n);
      const ConstRows<T> kn(fs.key_numerator.data(), n, E, Eigen::OuterStride<>(E));
      const ConstRows<T> qn(fs.query_numerator.data(), n, E, Eigen::OuterStride<>(E));
      const ConstRows<T> kd(separate ? fs.key_denominator.data() : fs.key_numerator.data(), n, E,
                            Eigen::OuterStride<>(E));
      const ConstRows<T> qd(separate ? fs.query_denominator.data() : fs.query_numerator.data(), n,
                            E, Eigen::OuterStride<>(E));
      const ConstRows<T> values = rows_of(v, b, h, c0, n);
      const ConstRows<T> gradient = rows_of(d_out, b, h, c0, n);
      auto scores = ws.scores.topLeftCorner(n, n);
      auto numerators = ws.numerators.topRows(n);
      auto G = ws.scaled.topRows(n);
      scores.noalias() = qd * kd.transpose();  // the denominators' scores first
      Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, 1>> denominator(fs.denominator.data(), n);
      denominator.noalias() = qd * z.transpose();
      for (index_t r = 0; r < n; ++r) denominator[r] += scores.row(r).head(r + 1).sum();
      if (separate) scores.noalias() = qn * kn.transpose();
      numerators.noalias() = scores.template triangularView<Eigen::Lower>() * values;
      numerators.noalias() += qn * S;
      block_read_gradients<T>(gradient, n, spec.normaliser, ws, ws.reads.data() + c0);
      auto d_scores = ws.d_scores.topLeftCorner(n, n);
      d_scores.noalias() = G * values.transpose();
      auto d_qn = ws.d_query_numerator.topRows(n);
      auto d_qd = ws.d_query_denominator.topRows(n);
      d_qn.noalias() = d_scores.template triangularView<Eigen::Lower>() * kn;
      d_qn.noalias() += G * S.transpose();
      Eigen::Matrix<T, 1, Eigen::Dynamic> prefix = z;  // z + sum of E'_K rows up to r
      for (index_t r = 0; r < n; ++r) {
        prefix += kd.row(r);
        d_qd.row(r) = ws.reads[static_cast<std::size_t>(c0 + r)].d_denominator * prefix;
      }
      for (index_t r = 0; r < n; ++r)
        backward_row(Side::query, q.row(b, c0 + r, h), qn.row(r).data(), c0 + r,
                     d_qn.row(r).data(),
                     d_qd.row(r).data(), d_q.row(b, c0 + r, h));
      S.noalias() += kn.transpose() * values;
      z += kd.colwise().sum();
    }
    const LinearCarry<const T> d_final = final_gradient_of(b, h);
    if (d_final.memory) {
      std::copy(d_final.memory, d_final.memory + E * Dv, adjoint.memory);
      std::copy(d_final.normaliser, d_final.normaliser + E, adjoint.normaliser);
    } else {
      reference::linear_reset(adjoint, E, Dv);
    }
    const index_t last = (Tn - 1) / linear_backward_block * linear_backward_block;
    for (index_t c0 = last;; c0 -= linear_backward_block) {  // reverse sweep: key and value gradients
      const index_t n = std::min(linear_backward_block, Tn - c0);
      features(c0, n);
      const ConstRows<T> kn(fs.key_numerator.data(), n, E, Eigen::OuterStride<>(E));
      const ConstRows<T> qn(fs.query_numerator.data(), n, E, Eigen::OuterStride<>(E));
      const ConstRows<T> kd(separate ? fs.key_denominator.data() : fs.key_numerator.data(), n, E,
                            Eigen::OuterStride<>(E));
      const ConstRows<T> qd(separate ? fs.query_denominator.data() : fs.query_numerator.data(), n,
                            E, Eigen::OuterStride<>(E));
      const ConstRows<T> values = rows_of(v, b, h, c0, n);
      const ConstRows<T> gradient = rows_of(d_out, b, h, c0, n);
      auto G = ws.scaled.topRows(n);
      for (index_t r = 0; r < n; ++r)
        G.row(r) = gradient.row(r) * ws.reads[static_cast<std::size_t>(c0 + r)].inverse_normaliser;
      auto scores = ws.scores.topLeftCorner(n, n);
      scores.noalias() = qn * kn.transpose();
      auto d_scores = ws.d_scores.topLeftCorner(n, n);
      d_scores.noalias() = G * values.transpose();
      auto d_kn = ws.d_key_numerator.topRows(n);
      auto d_kd = ws.d_key_denominator.topRows(n);
      d_kn.noalias() = d_scores.template triangularView<Eigen::Lower>().transpose() * qn;
      d_kn.noalias() += values * U.transpose();
      Rows<T> dv(d_v.row(b, c0, h), n, Dv, Eigen::OuterStride<>(d_v.stride(1)));
      dv.noalias() = scores.template triangularView<Eigen::Lower>().transpose() * G;
      dv.noalias() += kn * U;
      Eigen::Matrix<T, 1, Eigen::Dynamic> suffix = u;  // u + sum of dD E'_Q rows from r on
      for (index_t r = n; r-- > 0;) {
        suffix += ws.reads[static_cast<std::size_t>(c0 + r)].d_denominator * qd.row(r);
        d_kd.row(r) = suffix;
      }
      u = suffix;
      U.noalias() += qn.transpose() * G;
      for (index_t r = 0; r < n; ++r)
        backward_row(Side::key, k.row(b, c0 + r, h), kn.row(r).data(), c0 + r,
                     d_kn.row(r).data(),
                     d_kd.row(r).data(), d_k.row(b, c0 + r, h));
      if (c0 == 0) break;
    }
    const LinearCarry<T> d_initial = initial_gradient_of(b, h);
    if (d_initial.memory) {
      std::copy(adjoint.memory, adjoint.memory + E * Dv, d_initial.memory);
      std::copy(adjoint.normaliser, adjoint.normaliser + E, d_initial.normaliser);
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
                                                     LinearBackwardWorkspace<T>(spec, 0));
  const TensorView<const T, 4>* no_view = nullptr;
  parallel_for(heads, workers, [&](index_t i, int worker) {
    const index_t b = i / H, h = i % H;
    LinearBackwardWorkspace<T>& ws = workspaces[static_cast<std::size_t>(worker)];
    LinearScratch<T>& fs = ws.features;
    const double* theta = spec.theta(h);
    const LinearCarry<T> carry = carry_in(ws.carry, E, Dv);
    const LinearCarry<T> adjoint = carry_in(ws.adjoint, E, Dv);
    const ConstRows<T> S(carry.memory, E, Dv, Eigen::OuterStride<>(Dv));
    const Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>> z(carry.normaliser, E);
    Rows<T> U(adjoint.memory, E, Dv, Eigen::OuterStride<>(Dv));
    Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>> u(adjoint.normaliser, E);
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
      block_features<Map, Rw, Pos>(no_view, &k, b, h, c0, n, c0, spec, proportion_of, fs);
      absorb_block(fs, separate, rows_of(v, b, h, c0, n), n, carry, E, Dv);
    }
    reference::linear_reset(adjoint, E, Dv);
    reference::ReadGradient<T> reads[linear_backward_block];
    seek_rotation<Pos>(fs, spec, h, 0);
    for (index_t c0 = 0; c0 < Tn; c0 += linear_backward_block) {  // queries: their gradients, U and u
      const index_t n = std::min(linear_backward_block, Tn - c0);
      block_features<Map, Rw, Pos>(&q, no_view, b, h, c0, n, c0, spec, proportion_of, fs);
      const ConstRows<T> qn(fs.query_numerator.data(), n, E, Eigen::OuterStride<>(E));
      const ConstRows<T> qd(separate ? fs.query_denominator.data() : fs.query_numerator.data(), n,
                            E, Eigen::OuterStride<>(E));
      auto numerators = ws.numerators.topRows(n);
      numerators.noalias() = qn * S;
      Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, 1>>(fs.denominator.data(), n).noalias() =
          qd * z.transpose();
      block_read_gradients<T>(rows_of(d_out, b, h, c0, n), n, spec.normaliser, ws, reads);
      auto G = ws.scaled.topRows(n);
      auto d_qn = ws.d_query_numerator.topRows(n);
      auto d_qd = ws.d_query_denominator.topRows(n);
      d_qn.noalias() = G * S.transpose();
      for (index_t r = 0; r < n; ++r) {
        d_qd.row(r) = reads[r].d_denominator * z;
        u += reads[r].d_denominator * qd.row(r);
      }
      U.noalias() += qn.transpose() * G;
      for (index_t r = 0; r < n; ++r)
        backward_row(Side::query, q.row(b, c0 + r, h), qn.row(r).data(), c0 + r,
                     d_qn.row(r).data(),
                     d_qd.row(r).data(), d_q.row(b, c0 + r, h));
    }
    seek_rotation<Pos>(fs, spec, h, 0);
    for (index_t c0 = 0; c0 < Sn; c0 += linear_backward_block) {  // keys and values
      const index_t n = std::min(linear_backward_block, Sn - c0);
      block_features<Map, Rw, Pos>(no_view, &k, b, h, c0, n, c0, spec, proportion_of, fs);
      const ConstRows<T> kn(fs.key_numerator.data(), n, E, Eigen::OuterStride<>(E));
      const ConstRows<T> values = rows_of(v, b, h, c0, n);
      auto d_kn = ws.d_key_numerator.topRows(n);
      auto d_kd = ws.d_key_denominator.topRows(n);
      d_kn.noalias() = values * U.transpose();
      d_kd = u.replicate(n, 1);
      Rows<T>(d_v.row(b, c0, h), n, Dv, Eigen::OuterStride<>(d_v.stride(1))).noalias() = kn * U;
      for (index_t r = 0; r < n; ++r)
        backward_row(Side::key, k.row(b, c0 + r, h), kn.row(r).data(), c0 + r,
                     d_kn.row(r).data(),
                     d_kd.row(r).data(), d_k.row(b, c0 + r, h));
    }
  });
}

}  // namespace latte::cpu
