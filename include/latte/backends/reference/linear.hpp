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
// Kernels receive validated views and never allocate more than O(E * Dv)
// (the backward: O(E * Dv + T) per call).
//
// Backward (DESIGN §3.6): with g_t = dL/do_t, n_t = N(D_t), g~_t = g_t / n_t and
// dD_t = -N'(D_t) <g_t, o_t> / n_t,
//   dL/de(q_t) = S_t g~_t,  dL/de'(q_t) = dD_t z_t                 (forward scan)
//   U_s = sum_{t >= s} e(q_t) g~_t^T,  u_s = sum_{t >= s} dD_t e'(q_t)  (reverse scan)
//   dL/de(k_s) = U_s v_s,  dL/dv_s = U_s^T e(k_s),  dL/de'(k_s) = u_s,
// then each token's feature gradients go back through the streams, the
// rotation (R^T = R^{-p}), the proportion and the feature map.
#include <algorithm>
#include <cstdint>
#include <numbers>
#include <span>
#include <vector>

#include "latte/core/compensated_sum.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/policies/feature_map.hpp"
#include "latte/policies/normaliser.hpp"
#include "latte/policies/positional.hpp"
#include "latte/policies/reweight.hpp"
#include "latte/policies/summation.hpp"

namespace latte::reference {

/// The recurrent carry of one (batch, head): S [E x Dv] and z [E] (paper 001 eq. 4).
/// With `memory_low` and `normaliser_low` (a decode state's), S and z are
/// compensated sums (core/compensated_sum.hpp: the value is S + memory_low);
/// null: plain sums (scratch carries of a backward, bidirectional sums).
template <Real T>
struct LinearCarry {
  T* memory;
  T* normaliser;
  T* memory_low = nullptr;
  T* normaliser_low = nullptr;
  [[nodiscard]] bool compensated() const noexcept { return memory_low != nullptr; }
};

/// Values in one compensated carry: S, z, then their low parts (S_low [E x
/// Dv], z_low [E]), checked against index_t overflow by the caller.
inline index_t linear_carry_size(index_t E, index_t Dv) noexcept { return 2 * (E * Dv + E); }

/// The compensated carry laid out in linear_carry_size(E, Dv) values at `base`.
template <Real T>
LinearCarry<T> linear_carry_at(T* base, index_t E, index_t Dv) noexcept {
  return {base, base + E * Dv, base + E * Dv + E, base + 2 * E * Dv + E};
}

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
  if (carry.compensated()) {
    std::fill(carry.memory_low, carry.memory_low + E * Dv, T(0));
    std::fill(carry.normaliser_low, carry.normaliser_low + E, T(0));
  }
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
    if (carry.compensated()) {
      T* row_low = carry.memory_low + e * Dv;
      for (index_t d = 0; d < Dv; ++d)
        detail::compensated_add(row[d], row_low[d], detail::rounded_product(weight, v[d]));
      detail::compensated_add(carry.normaliser[e], carry.normaliser_low[e], key.denominator[e]);
      continue;
    }
    for (index_t d = 0; d < Dv; ++d) row[d] += weight * v[d];
    carry.normaliser[e] += key.denominator[e];
  }
}

/// carry <- the carry of carry's tokens followed by `later`'s (each summed
/// from zero where its tokens begin): S and z added, compensated pairs by
/// TwoSum. The associative merge of a sequence cut into slices (cpu
/// linear_causal_absorb, latte/distributed/).
template <Real T>
void linear_append_carry(LinearCarry<T> carry, LinearCarry<const T> later, index_t E,
                         index_t Dv) noexcept {
  auto add = [&](T* hi, T* lo, const T* later_hi, const T* later_lo, index_t n) {
    for (index_t x = 0; x < n; ++x) {
      if (!carry.compensated()) {
        hi[x] += later_hi[x];
        continue;
      }
      detail::compensated_add(hi[x], lo[x], later_hi[x]);
      detail::compensated_add(hi[x], lo[x], later_lo[x]);
    }
  };
  add(carry.memory, carry.memory_low, later.memory, later.memory_low, E * Dv);
  add(carry.normaliser, carry.normaliser_low, later.normaliser, later.normaliser_low, E);
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

/// Absorbs keys [B, T, H, Dk] and values [B, T, H, Dv] into carry_of(b, h)
/// from absolute position `first_position` without reading: the carry
/// linear_causal_forward would leave. proportion_of as there (key side only).
template <FeatureMap Map, Reweight Rw, Positional Pos, Real T, class ProportionOf, class CarryOf>
void linear_causal_absorb(TensorView<const T, 4> k, TensorView<const T, 4> v,
                          const LinearSpec& spec, std::int64_t first_position,
                          ProportionOf&& proportion_of, CarryOf&& carry_of) {
  const index_t B = k.extent(0), Tn = k.extent(1), H = k.extent(2);
  std::vector<T> scratch(static_cast<std::size_t>(spec.scratch_size()));
  const TokenFeatures<T> token(scratch.data(), spec);
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h) {
      const LinearCarry<T> carry = carry_of(b, h);
      for (index_t t = 0; t < Tn; ++t) {
        const std::int64_t position = first_position + t;
        linear_features<Map, Rw, Pos>(
            k.row(b, t, h), position, spec.theta(h), spec,
            [&](const T* phi) { return proportion_of(Side::key, b, t, h, position, phi); }, token);
        linear_absorb(token, v.row(b, t, h), carry, spec.expanded_dim(), spec.value_dim);
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

// ------------------------------------------------------------ backward --

/// Gradient of linear_features for the row x: given dL/de (`d_numerator`) and
/// dL/de' (`d_denominator`), writes dL/dx into d_x. With re-weighting, dL/dP =
/// pi/2 (dL/dw_sin cos(pi P/2) - dL/dw_cos sin(pi P/2)) goes to
/// `proportion_backward(P, dP, phi, d_phi)`, which adds the proportion's own
/// path into d_phi (LeaP modules) and keeps dP where the caller wants it.
/// `scratch` holds 3 F values.
template <FeatureMap Map, Reweight Rw, Positional Pos, Real T, class ProportionOf,
          class ProportionBackward>
void linear_features_backward(const T* x, std::int64_t position, const double* theta,
                              const LinearSpec& spec, ProportionOf&& proportion_of,
                              ProportionBackward&& proportion_backward, const T* d_numerator,
                              const T* d_denominator, T* scratch, T* d_x) {
  static_assert(DifferentiableFeatureMap<Map>,
                "backward needs the feature map's derivative: give it a static "
                "backward(x, d_phi, d_x) (policies/feature_map.hpp)");
  const index_t F = spec.feature_dim;
  T* phi = scratch;
  T* rotated = scratch + F;  // R^p phi(x)
  T* d_phi = scratch + 2 * F;
  Map::apply(std::span<const T>(x, static_cast<std::size_t>(spec.key_dim)),
             std::span<T>(phi, static_cast<std::size_t>(F)));
  Proportion proportion{};
  T weight[2] = {T(1), T(1)};
  if constexpr (Rw::streams == 2) {
    proportion = proportion_of(static_cast<const T*>(phi));
    cos_reweight_streams(proportion, weight);
  }
  std::copy(phi, phi + F, rotated);
  if constexpr (Pos::rotates_queries_keys) Pos::rotate(rotated, F, theta, position);
  // e' = e unless RoPE leaves the denominator un-rotated: its gradient joins e's.
  const bool separate = Pos::rotates_queries_keys && !spec.rotated_denominator;
  double d_weight[2] = {0.0, 0.0};
  std::fill(d_phi, d_phi + F, T(0));
  for (index_t stream = 0; stream < Rw::streams; ++stream)
    for (index_t f = 0; f < F; ++f) {
      const index_t e = stream * F + f;
      const T d_e = separate ? d_numerator[e] : d_numerator[e] + d_denominator[e];
      d_weight[stream] += static_cast<double>(d_e) * static_cast<double>(rotated[f]);
      d_phi[f] += weight[stream] * d_e;  // dL/d(R^p phi)
    }
  if constexpr (Pos::rotates_queries_keys) Pos::rotate(d_phi, F, theta, -position);  // R^T
  if (separate)
    for (index_t stream = 0; stream < Rw::streams; ++stream)
      for (index_t f = 0; f < F; ++f) {
        const T d_e = d_denominator[stream * F + f];
        d_weight[stream] += static_cast<double>(d_e) * static_cast<double>(phi[f]);
        d_phi[f] += weight[stream] * d_e;
      }
  if constexpr (Rw::streams == 2) {
    const double d_proportion =
        std::numbers::pi / 2.0 * (d_weight[0] * static_cast<double>(weight[1]) -
                                  d_weight[1] * static_cast<double>(weight[0]));
    proportion_backward(proportion, d_proportion, static_cast<const T*>(phi), d_phi);
  } else {
    (void)proportion_backward;
  }
  Map::backward(std::span<const T>(x, static_cast<std::size_t>(spec.key_dim)),
                std::span<const T>(d_phi, static_cast<std::size_t>(F)),
                std::span<T>(d_x, static_cast<std::size_t>(spec.key_dim)));
}

/// What a query's read passes to the reverse scan: 1 / n and dD.
template <Real T>
struct ReadGradient {
  T inverse_normaliser;  ///< 1 / N(D)
  T d_denominator;       ///< dL/dD = -N'(D) <g, o> / N(D)
};

/// The backward of linear_read for a query with output gradient g: writes
/// dL/de(q) = S g / n into d_numerator and dL/de'(q) = dD z into d_denominator.
/// `scratch` holds Dv values.
template <Real T>
ReadGradient<T> linear_read_backward(const TokenFeatures<T>& query, LinearCarry<const T> carry,
                                     index_t E, index_t Dv, const Normaliser& normaliser,
                                     const T* g, T* scratch, T* d_numerator,
                                     T* d_denominator) noexcept {
  T* numerator = scratch;
  std::fill(numerator, numerator + Dv, T(0));
  T denominator = 0;
  for (index_t e = 0; e < E; ++e) {
    const T* row = carry.memory + e * Dv;
    T d_e = 0;
    for (index_t d = 0; d < Dv; ++d) {
      numerator[d] += query.numerator[e] * row[d];
      d_e += row[d] * g[d];
    }
    d_numerator[e] = d_e;
    denominator += query.denominator[e] * carry.normaliser[e];
  }
  const T inverse = T(1) / normaliser.apply(denominator);
  T g_dot_o = 0;  // <g, o> with o = numerator / n
  for (index_t d = 0; d < Dv; ++d) g_dot_o += g[d] * numerator[d] * inverse;
  const T d_sum = -normaliser.derivative(denominator) * g_dot_o * inverse;  // dL/dD
  for (index_t e = 0; e < E; ++e) {
    d_numerator[e] *= inverse;
    d_denominator[e] = d_sum * carry.normaliser[e];
  }
  return {inverse, d_sum};
}

/// Reverse carry update for one query: U += e(q) (g / n)^T, u += dD e'(q)
/// (compensated sums when the adjoint has its low parts).
template <Real T>
void linear_adjoint_absorb(const TokenFeatures<T>& query, const T* g, ReadGradient<T> read,
                           LinearCarry<T> adjoint, index_t E, index_t Dv) noexcept {
  for (index_t e = 0; e < E; ++e) {
    const T weight = query.numerator[e] * read.inverse_normaliser;
    T* row = adjoint.memory + e * Dv;
    if (adjoint.compensated()) {
      T* row_low = adjoint.memory_low + e * Dv;
      for (index_t d = 0; d < Dv; ++d)
        detail::compensated_add(row[d], row_low[d], detail::rounded_product(weight, g[d]));
      detail::compensated_add(adjoint.normaliser[e], adjoint.normaliser_low[e],
                              detail::rounded_product(read.d_denominator, query.denominator[e]));
      continue;
    }
    for (index_t d = 0; d < Dv; ++d) row[d] += weight * g[d];
    adjoint.normaliser[e] += read.d_denominator * query.denominator[e];
  }
}

/// A key's gradients from the reverse carry: dL/de(k) = U v, dL/de'(k) = u and
/// dL/dv = U^T e(k) (written).
template <Real T>
void linear_key_backward(const TokenFeatures<T>& key, const T* v, LinearCarry<const T> adjoint,
                         index_t E, index_t Dv, T* d_numerator, T* d_denominator,
                         T* d_v) noexcept {
  std::fill(d_v, d_v + Dv, T(0));
  for (index_t e = 0; e < E; ++e) {
    const T* row = adjoint.memory + e * Dv;
    T d_e = 0;
    for (index_t d = 0; d < Dv; ++d) {
      d_e += row[d] * v[d];
      d_v[d] += row[d] * key.numerator[e];
    }
    d_numerator[e] = d_e;
    d_denominator[e] = adjoint.normaliser[e];
  }
}

/// Per-call workspace of the reference backward.
template <Real T>
struct LinearBackwardScratch {
  explicit LinearBackwardScratch(const LinearSpec& spec)
      : features(static_cast<std::size_t>(spec.scratch_size())),
        carry(static_cast<std::size_t>(spec.expanded_dim() * (spec.value_dim + 1))),
        adjoint(carry.size()),
        d_features(static_cast<std::size_t>(2 * spec.expanded_dim() + 3 * spec.feature_dim +
                                             spec.value_dim)) {}
  std::vector<T> features, carry, adjoint, d_features;
  /// S, z (or U, u) laid out in `storage` of E * (Dv + 1) values.
  [[nodiscard]] static LinearCarry<T> carry_in(std::vector<T>& storage, index_t E,
                                               index_t Dv) noexcept {
    return {storage.data(), storage.data() + E * Dv};
  }
};

/// Gradient of linear_causal_forward (continuing from carry_of(b, h) at
/// `first_position`): writes d_q, d_k, d_v. `initial_of(b, h, carry)` fills the
/// carry the forward started from; `final_gradient_of(b, h)` gives dL/d(S, z)
/// of the carry it left (a null memory: zero); `initial_gradient_of(b, h)`
/// gives where dL/d(initial S, z) goes (a null memory: nowhere).
/// `proportion_backward(worker, side, b, t, h, P, dP, phi, d_phi)` as in
/// linear_features_backward (worker: the thread's index, always 0 here). Per (b, h): a forward scan (query gradients),
/// then a reverse scan (key and value gradients). With Sum = CompensatedSums
/// S, z and their adjoints U, u are compensated sums (TwoSum per term and
/// element), so that their error does not grow with T; PlainSums: plain sums.
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
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2);
  const index_t E = spec.expanded_dim(), Dv = spec.value_dim, F = spec.feature_dim;
  LinearBackwardScratch<T> scratch(spec);
  LinearCarry<T> carry = scratch.carry_in(scratch.carry, E, Dv);
  LinearCarry<T> adjoint = scratch.carry_in(scratch.adjoint, E, Dv);
  // The low parts of S, z, U, u (compensated sums), zeroed per (b, h).
  std::vector<T> low(Sum::compensated ? scratch.carry.size() + scratch.adjoint.size() : 0);
  const TokenFeatures<T> token(scratch.features.data(), spec);
  T* d_numerator = scratch.d_features.data();
  T* d_denominator = d_numerator + E;
  T* feature_scratch = d_denominator + E;  // 3F
  T* read_scratch = feature_scratch + 3 * F;  // Dv
  std::vector<ReadGradient<T>> reads(static_cast<std::size_t>(Tn));
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h) {
      const double* theta = spec.theta(h);
      auto features_of = [&](Side side, const T* x, index_t t, std::int64_t position) {
        linear_features<Map, Rw, Pos>(
            x, position, theta, spec,
            [&](const T* phi) { return proportion_of(side, b, t, h, position, phi); }, token);
      };
      auto backward_of = [&](Side side, const T* x, index_t t, std::int64_t position, T* d_x) {
        linear_features_backward<Map, Rw, Pos>(
            x, position, theta, spec,
            [&](const T* phi) { return proportion_of(side, b, t, h, position, phi); },
            [&](const Proportion& p, double dp, const T* phi, T* d_phi) {
              proportion_backward(0, side, b, t, h, p, dp, phi, d_phi);
            },
            d_numerator, d_denominator, feature_scratch, d_x);
      };
      initial_of(b, h, LinearCarry<T>{carry.memory, carry.normaliser});
      if constexpr (Sum::compensated) {
        std::fill(low.begin(), low.end(), T(0));
        carry.memory_low = low.data();
        carry.normaliser_low = carry.memory_low + E * Dv;
        adjoint.memory_low = carry.normaliser_low + E;
        adjoint.normaliser_low = adjoint.memory_low + E * Dv;
      }
      for (index_t t = 0; t < Tn; ++t) {  // forward scan: S_t, z_t and the query gradients
        const std::int64_t position = first_position + t;
        features_of(Side::key, k.row(b, t, h), t, position);
        linear_absorb(token, v.row(b, t, h), carry, E, Dv);
        features_of(Side::query, q.row(b, t, h), t, position);
        reads[static_cast<std::size_t>(t)] =
            linear_read_backward<T>(token, {carry.memory, carry.normaliser}, E, Dv,
                                    spec.normaliser, d_out.row(b, t, h), read_scratch,
                                    d_numerator, d_denominator);
        backward_of(Side::query, q.row(b, t, h), t, position, d_q.row(b, t, h));
      }
      const LinearCarry<const T> d_final = final_gradient_of(b, h);
      if (d_final.memory) {
        std::copy(d_final.memory, d_final.memory + E * Dv, adjoint.memory);
        std::copy(d_final.normaliser, d_final.normaliser + E, adjoint.normaliser);
      } else {
        linear_reset(LinearCarry<T>{adjoint.memory, adjoint.normaliser}, E, Dv);
      }
      for (index_t t = Tn; t-- > 0;) {  // reverse scan: U_t, u_t and the key/value gradients
        const std::int64_t position = first_position + t;
        features_of(Side::query, q.row(b, t, h), t, position);
        linear_adjoint_absorb(token, d_out.row(b, t, h), reads[static_cast<std::size_t>(t)],
                              adjoint, E, Dv);
        features_of(Side::key, k.row(b, t, h), t, position);
        linear_key_backward<T>(token, v.row(b, t, h), {adjoint.memory, adjoint.normaliser}, E,
                               Dv, d_numerator, d_denominator, d_v.row(b, t, h));
        backward_of(Side::key, k.row(b, t, h), t, position, d_k.row(b, t, h));
      }
      const LinearCarry<T> d_initial = initial_gradient_of(b, h);
      if (d_initial.memory) {
        std::copy(adjoint.memory, adjoint.memory + E * Dv, d_initial.memory);
        std::copy(adjoint.normaliser, adjoint.normaliser + E, d_initial.normaliser);
      }
    }
}

/// Gradient of linear_bidirectional_forward (self- or cross-attention):
/// S, z over the source; the query gradients and U, u over the queries; then
/// the key and value gradients.
template <FeatureMap Map, Reweight Rw, Positional Pos, Real T, class ProportionOf,
          class ProportionBackward>
void linear_bidirectional_backward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                                   TensorView<const T, 4> v, TensorView<const T, 4> d_out,
                                   TensorView<T, 4> d_q, TensorView<T, 4> d_k,
                                   TensorView<T, 4> d_v, const LinearSpec& spec,
                                   ProportionOf&& proportion_of,
                                   ProportionBackward&& proportion_backward) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), Sn = k.extent(1);
  const index_t E = spec.expanded_dim(), Dv = spec.value_dim, F = spec.feature_dim;
  LinearBackwardScratch<T> scratch(spec);
  const LinearCarry<T> carry = scratch.carry_in(scratch.carry, E, Dv);
  const LinearCarry<T> adjoint = scratch.carry_in(scratch.adjoint, E, Dv);
  const TokenFeatures<T> token(scratch.features.data(), spec);
  T* d_numerator = scratch.d_features.data();
  T* d_denominator = d_numerator + E;
  T* feature_scratch = d_denominator + E;
  T* read_scratch = feature_scratch + 3 * F;
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h) {
      const double* theta = spec.theta(h);
      auto features_of = [&](Side side, const T* x, index_t t) {
        linear_features<Map, Rw, Pos>(
            x, t, theta, spec, [&](const T* phi) { return proportion_of(side, b, t, h, t, phi); },
            token);
      };
      auto backward_of = [&](Side side, const T* x, index_t t, T* d_x) {
        linear_features_backward<Map, Rw, Pos>(
            x, t, theta, spec, [&](const T* phi) { return proportion_of(side, b, t, h, t, phi); },
            [&](const Proportion& p, double dp, const T* phi, T* d_phi) {
              proportion_backward(0, side, b, t, h, p, dp, phi, d_phi);
            },
            d_numerator, d_denominator, feature_scratch, d_x);
      };
      linear_reset(carry, E, Dv);
      for (index_t s = 0; s < Sn; ++s) {
        features_of(Side::key, k.row(b, s, h), s);
        linear_absorb(token, v.row(b, s, h), carry, E, Dv);
      }
      linear_reset(adjoint, E, Dv);
      for (index_t t = 0; t < Tn; ++t) {
        features_of(Side::query, q.row(b, t, h), t);
        const ReadGradient<T> read = linear_read_backward<T>(
            token, {carry.memory, carry.normaliser}, E, Dv, spec.normaliser, d_out.row(b, t, h),
            read_scratch, d_numerator, d_denominator);
        linear_adjoint_absorb(token, d_out.row(b, t, h), read, adjoint, E, Dv);
        backward_of(Side::query, q.row(b, t, h), t, d_q.row(b, t, h));
      }
      for (index_t s = 0; s < Sn; ++s) {
        features_of(Side::key, k.row(b, s, h), s);
        linear_key_backward<T>(token, v.row(b, s, h), {adjoint.memory, adjoint.normaliser}, E, Dv,
                               d_numerator, d_denominator, d_v.row(b, s, h));
        backward_of(Side::key, k.row(b, s, h), s, d_k.row(b, s, h));
      }
    }
}

}  // namespace latte::reference
