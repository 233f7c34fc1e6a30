#pragma once
// Reference backend for the linear-attention family: scalar loops that read
// like the papers.
//
// Symbols follow paper 001 §3.1 and paper 004: phi (feature map), S (memory,
// sum_s e(k_s) v_s^T), z (normaliser, sum_s e'(k_s)), P (proportion),
// R^p (RoPE rotation by absolute position p). A token becomes expanded
// features e = [w_1 R^p phi(x), ..., w_streams R^p phi(x)] with stream weights
// w = (1) without re-weighting or w = (sin(pi P/2), cos(pi P/2)) with the
// cosine re-weighting (paper 004 eqs. 6-9), so that
//   e(q_t) . e(k_s) = phi(q_t) . R^{p_s - p_t} phi(k_s) * cos(pi/2 (P_q,t - P_k,s)).
// The denominator features e' are the same without the rotation (RoFormer
// eq. 19, the default under RoPE) or equal to e (rotated denominator).
// Kernels receive validated views and never allocate more than O(E * Dv).
#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/policies/feature_map.hpp"
#include "latte/policies/normaliser.hpp"
#include "latte/policies/positional.hpp"
#include "latte/policies/reweight.hpp"

namespace latte::reference {

/// The recurrent carry of one (batch, head): S [E x Dv] and z [E] (paper 001 eq. 4).
template <Real T>
struct LinearCarry {
  T* memory;
  T* normaliser;
};

/// Sizes and runtime parameters of one call, validated by the mechanism.
struct LinearSpec {
  index_t key_dim;      ///< Dk: features of a query/key row
  index_t feature_dim;  ///< F: features of phi(x)
  index_t streams;      ///< 1, or 2 with the cosine re-weighting
  index_t value_dim;    ///< Dv
  const std::vector<double>* angles;  ///< RoPE angles [H * (F/2)], empty otherwise
  bool rotated_denominator;
  Normaliser normaliser;

  [[nodiscard]] index_t expanded_dim() const noexcept { return streams * feature_dim; }
  [[nodiscard]] const double* theta(index_t head) const noexcept {
    return angles->empty() ? nullptr : angles->data() + head * (feature_dim / 2);
  }
  /// Workspace of one token: phi [F], e [E], e' [E].
  [[nodiscard]] index_t scratch_size() const noexcept { return feature_dim + 2 * expanded_dim(); }
};

/// Which side of the attention a token is on (its proportion module differs).
enum class Side { query, key };

/// Workspace of one token, carved out of spec.scratch_size() values.
template <Real T>
struct TokenFeatures {
  T* phi;          ///< phi(x), then R^p phi(x)
  T* numerator;    ///< e  [E]
  T* denominator;  ///< e' [E]
  TokenFeatures(T* scratch, const LinearSpec& spec) noexcept
      : phi(scratch), numerator(scratch + spec.feature_dim),
        denominator(scratch + spec.feature_dim + spec.expanded_dim()) {}
};

template <Real T>
void linear_reset(LinearCarry<T> carry, index_t E, index_t Dv) noexcept {
  std::fill(carry.memory, carry.memory + E * Dv, T(0));
  std::fill(carry.normaliser, carry.normaliser + E, T(0));
}

/// Expanded features of one row x at absolute position `position`
/// (paper 004 eqs. 6-10 and 13). `proportion_of(phi)` gives P from phi(x).
template <FeatureMap Map, Reweight Rw, Positional Pos, Real T, class ProportionOf>
void linear_features(const T* x, std::int64_t position, const double* theta, const LinearSpec& spec,
                     ProportionOf&& proportion_of, TokenFeatures<T> token) {
  const index_t F = spec.feature_dim;
  Map::apply(std::span<const T>(x, static_cast<std::size_t>(spec.key_dim)),
             std::span<T>(token.phi, static_cast<std::size_t>(F)));
  T weight[2] = {T(1), T(1)};
  if constexpr (Rw::streams == 2) cos_reweight_streams(proportion_of(token.phi), weight);  // eq. 9
  for (index_t stream = 0; stream < Rw::streams; ++stream)
    for (index_t f = 0; f < F; ++f) token.denominator[stream * F + f] = weight[stream] * token.phi[f];
  if constexpr (Pos::rotates_queries_keys)
    Pos::rotate(token.phi, F, theta, position);  // R^p phi(x), eq. 13
  for (index_t stream = 0; stream < Rw::streams; ++stream)
    for (index_t f = 0; f < F; ++f) token.numerator[stream * F + f] = weight[stream] * token.phi[f];
  if (spec.rotated_denominator)
    std::copy(token.numerator, token.numerator + Rw::streams * F, token.denominator);
}

/// S += e(k) v^T, z += e'(k)   (paper 001 eq. 4: S_t = S_{t-1} + v_t phi(k_t)^T).
template <Real T>
void linear_absorb(const TokenFeatures<T>& key, const T* v, LinearCarry<T> carry, index_t E,
                   index_t Dv) noexcept {
  for (index_t e = 0; e < E; ++e) {
    const T weight = key.numerator[e];
    T* row = carry.memory + e * Dv;
    for (index_t d = 0; d < Dv; ++d) row[d] += weight * v[d];
    carry.normaliser[e] += key.denominator[e];
  }
}

/// out = S^T e(q) / N(e'(q) . z)   (paper 001 eq. 4, normaliser N).
template <Real T>
void linear_read(const TokenFeatures<T>& query, LinearCarry<T> carry, index_t E, index_t Dv,
                 const Normaliser& normaliser, T* out) noexcept {
  std::fill(out, out + Dv, T(0));
  T denominator = 0;
  for (index_t e = 0; e < E; ++e) {
    const T weight = query.numerator[e];
    const T* row = carry.memory + e * Dv;
    for (index_t d = 0; d < Dv; ++d) out[d] += weight * row[d];
    denominator += query.denominator[e] * carry.normaliser[e];
  }
  const T normalised = normaliser.apply(denominator);
  for (index_t d = 0; d < Dv; ++d) out[d] /= normalised;
}

/// One causal token at absolute position `position`: absorb (k, v), then read q.
/// `proportion_of(side, phi)` gives the proportions; `scratch` holds
/// spec.scratch_size() values.
template <FeatureMap Map, Reweight Rw, Positional Pos, Real T, class ProportionOf>
void linear_causal_token(const T* q, const T* k, const T* v, T* out, LinearCarry<T> carry,
                         const LinearSpec& spec, const double* theta, std::int64_t position,
                         ProportionOf&& proportion_of, T* scratch) {
  const TokenFeatures<T> token(scratch, spec);
  const index_t E = spec.expanded_dim(), Dv = spec.value_dim;
  linear_features<Map, Rw, Pos>(k, position, theta, spec,
                                [&](const T* phi) { return proportion_of(Side::key, phi); }, token);
  linear_absorb(token, v, carry, E, Dv);
  linear_features<Map, Rw, Pos>(q, position, theta, spec,
                                [&](const T* phi) { return proportion_of(Side::query, phi); },
                                token);
  linear_read(token, carry, E, Dv, spec.normaliser, out);
}

/// Causal linear attention over a [B, T, H, *] sequence, continuing from
/// `carry_of(b, h)` at absolute position `first_position`.
/// `proportion_of(side, b, t, h, position, phi)` gives the proportions.
template <FeatureMap Map, Reweight Rw, Positional Pos, Real T, class ProportionOf, class CarryOf>
void linear_causal_forward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                           TensorView<const T, 4> v, TensorView<T, 4> out, const LinearSpec& spec,
                           std::int64_t first_position, ProportionOf&& proportion_of,
                           CarryOf&& carry_of) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2);
  std::vector<T> scratch(static_cast<std::size_t>(spec.scratch_size()));
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h) {
      const LinearCarry<T> carry = carry_of(b, h);
      for (index_t t = 0; t < Tn; ++t) {
        const std::int64_t position = first_position + t;
        linear_causal_token<Map, Rw, Pos>(
            q.row(b, t, h), k.row(b, t, h), v.row(b, t, h), out.row(b, t, h), carry, spec,
            spec.theta(h), position,
            [&](Side side, const T* phi) { return proportion_of(side, b, t, h, position, phi); },
            scratch.data());
      }
    }
}

/// Bidirectional linear attention of queries [B, T, H, Dk] over keys
/// [B, S, H, Dk] and values [B, S, H, Dv] (S = T for self-attention, any S for
/// cross-attention): S and z over the whole source, then one read per query.
/// Query t sits at position t, key s at position s.
template <FeatureMap Map, Reweight Rw, Positional Pos, Real T, class ProportionOf>
void linear_bidirectional_forward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                                  TensorView<const T, 4> v, TensorView<T, 4> out,
                                  const LinearSpec& spec, ProportionOf&& proportion_of) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), Sn = k.extent(1);
  const index_t E = spec.expanded_dim(), Dv = spec.value_dim;
  std::vector<T> scratch(static_cast<std::size_t>(spec.scratch_size()));
  std::vector<T> carry_storage(static_cast<std::size_t>(E * Dv + E));
  const LinearCarry<T> carry{carry_storage.data(), carry_storage.data() + E * Dv};
  const TokenFeatures<T> token(scratch.data(), spec);
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h) {
      linear_reset(carry, E, Dv);
      for (index_t s = 0; s < Sn; ++s) {
        linear_features<Map, Rw, Pos>(
            k.row(b, s, h), s, spec.theta(h), spec,
            [&](const T* phi) { return proportion_of(Side::key, b, s, h, s, phi); }, token);
        linear_absorb(token, v.row(b, s, h), carry, E, Dv);
      }
      for (index_t t = 0; t < Tn; ++t) {
        linear_features<Map, Rw, Pos>(
            q.row(b, t, h), t, spec.theta(h), spec,
            [&](const T* phi) { return proportion_of(Side::query, b, t, h, t, phi); }, token);
        linear_read(token, carry, E, Dv, spec.normaliser, out.row(b, t, h));
      }
    }
}

}  // namespace latte::reference
