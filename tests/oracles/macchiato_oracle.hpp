#pragma once
// The explicit T x T attention matrices of Latte Macchiato, straight from the
// definition (paper 000 §2.3 eqs. 13-16, paper 001 §4.1 eqs. 15-17; RoPE on the
// window's queries and keys; VAPOR eq. 22), in long double, then applied to V.
// Nothing here is shared with the library's kernels: no running maximum, no
// online softmax, no ring buffer, no latent memory — each entry is formed directly.
//
//   p(l|t)     = exp(q_{t,l}) / sum_{j=0..L} exp(q_{t,j})                    l = 0..L
//   p0(s|t)    = exp(c q'_t . R^{s-t} k'_s) / sum_{s' in W(t)} (same)        s in W(t)
//   p(s|l,t)   = exp(k_{s,l}) / sum_{s' in S(t)} exp(k_{s',l})               l = 1..L
//   Local[t][s]  = p(0|t) p0(s|t) [s in W(t)]
//   Latent[t][s] = sum_{l=1..L} p(l|t) p(s|l,t)
//   o_t = sum_s Local[t][s] V0(t, s) + Latent[t][s] R^{t-s} v_s
// W(t) = {t - w <= s <= t} (causal) or {|t - s| <= w}; S(t) = {s <= t} (causal) or
// all s; c the score scale; R^n the pair rotation by n * theta (RoPE's R^{s-t}
// between the rotated query R^t q'_t and key R^s k'_s); V0 = R^{t-s} v_s when VAPOR
// acts on the whole mixture, v_s otherwise.
// Conventions (as LatteAttention's): a latent whose keys in S(t) are all -inf
// contributes nothing; a query whose L + 1 logits are all -inf reads zero.
#include <cmath>
#include <stdexcept>
#include <vector>

#include "oracles/tensor_ld.hpp"

namespace latte::test {

struct MacchiatoSpec {
  bool causal = true;
  index_t window = 1;           ///< w
  long double scale = 1;        ///< c
  bool vapor_on_window = false; ///< VaporScope::all_states
  [[nodiscard]] bool in_window(index_t t, index_t s) const {
    if (causal && s > t) return false;
    return t - s <= window && s - t <= window;
  }
  [[nodiscard]] bool in_latent_range(index_t t, index_t s) const { return !causal || s <= t; }
};

/// Local[t][s] and Latent[t][s] of one (batch, head), row-major T x T each.
struct MacchiatoMatrices {
  std::vector<long double> local, latent;
};

/// cos / sin of n * theta_i in long double for n in [-(T-1), T-1] and pair i
/// (empty: no rotation, R^n = identity).
struct RotationTable {
  index_t length = 0, pairs = 0;
  std::vector<long double> cos, sin;
  RotationTable(const long double* theta, index_t Tn, index_t dim) {
    if (!theta) return;
    length = Tn;
    pairs = dim / 2;
    cos.resize(static_cast<std::size_t>((2 * Tn - 1) * pairs));
    sin.resize(cos.size());
    for (index_t n = -(Tn - 1); n <= Tn - 1; ++n)
      for (index_t i = 0; i < pairs; ++i) {
        const long double angle = (long double)n * theta[i];
        cos[(n + Tn - 1) * pairs + i] = std::cos(angle);
        sin[(n + Tn - 1) * pairs + i] = std::sin(angle);
      }
  }
  [[nodiscard]] bool rotates() const { return pairs > 0; }
  [[nodiscard]] long double c(index_t n, index_t i) const { return cos[(n + length - 1) * pairs + i]; }
  [[nodiscard]] long double s(index_t n, index_t i) const { return sin[(n + length - 1) * pairs + i]; }
};

/// `key_theta`: Dk/2 RoPE angles of this head, or null.
template <class T>
MacchiatoMatrices macchiato_attention_matrices(const MacchiatoSpec& spec, const Tensor<T, 4>& q,
                                               const Tensor<T, 4>& k, const Tensor<T, 4>& wq,
                                               const Tensor<T, 4>& wk, index_t b, index_t h,
                                               const long double* key_theta) {
  const index_t Tn = q.extent(1), L = k.extent(3), Dk = wq.extent(3), pairs = Dk / 2;
  constexpr long double neg_inf = -INFINITY;
  MacchiatoMatrices m;
  m.local.assign(static_cast<std::size_t>(Tn * Tn), 0.0L);
  m.latent.assign(static_cast<std::size_t>(Tn * Tn), 0.0L);

  // p(l|t), l = 0..L: one softmax over the L + 1 query logits.
  std::vector<long double> p_state(static_cast<std::size_t>(Tn * (L + 1)), 0.0L);
  for (index_t t = 0; t < Tn; ++t) {
    long double q_max = neg_inf;
    for (index_t l = 0; l <= L; ++l) q_max = std::fmax(q_max, (long double)q(b, t, h, l));
    if (q_max == neg_inf) continue;
    long double total = 0;
    for (index_t l = 0; l <= L; ++l) total += std::exp((long double)q(b, t, h, l) - q_max);
    for (index_t l = 0; l <= L; ++l)
      p_state[t * (L + 1) + l] = std::exp((long double)q(b, t, h, l) - q_max) / total;
  }

  // State 0: softmax of the window scores c q'_t . R^{s-t} k'_s over W(t).
  const RotationTable rope(key_theta, Tn, Dk);
  std::vector<long double> score(static_cast<std::size_t>(Tn));
  for (index_t t = 0; t < Tn; ++t) {
    long double row_max = neg_inf;
    for (index_t s = 0; s < Tn; ++s) {
      if (!spec.in_window(t, s)) continue;
      long double dot = 0;
      for (index_t d = 2 * pairs; d < Dk; ++d) dot += (long double)wq(b, t, h, d) * wk(b, s, h, d);
      for (index_t i = 0; i < pairs; ++i) {
        const long double qx = wq(b, t, h, 2 * i), qy = wq(b, t, h, 2 * i + 1);
        const long double kx = wk(b, s, h, 2 * i), ky = wk(b, s, h, 2 * i + 1);
        const long double c = rope.rotates() ? rope.c(s - t, i) : 1.0L;
        const long double sn = rope.rotates() ? rope.s(s - t, i) : 0.0L;
        dot += qx * (c * kx - sn * ky) + qy * (sn * kx + c * ky);
      }
      score[s] = spec.scale * dot;
      row_max = std::fmax(row_max, score[s]);
    }
    if (row_max == neg_inf) continue;
    long double total = 0;
    for (index_t s = 0; s < Tn; ++s)
      if (spec.in_window(t, s)) total += std::exp(score[s] - row_max);
    for (index_t s = 0; s < Tn; ++s)
      if (spec.in_window(t, s))
        m.local[t * Tn + s] = p_state[t * (L + 1)] * std::exp(score[s] - row_max) / total;
  }

  // States 1..L: exp(k_{s,l}) shifted by the column maximum (an identity inside
  // each ratio; long double's range holds every term of a spread up to 11000).
  std::vector<long double> weight(static_cast<std::size_t>(Tn * L), 0.0L);
  for (index_t l = 0; l < L; ++l) {
    long double column_max = neg_inf;
    for (index_t s = 0; s < Tn; ++s) column_max = std::fmax(column_max, (long double)k(b, s, h, l));
    if (column_max == neg_inf) continue;
    for (index_t s = 0; s < Tn; ++s) {
      const long double logit = k(b, s, h, l);
      if (logit != neg_inf && column_max - logit > 11000.0L)
        throw std::domain_error("macchiato oracle: key logit spread beyond long double range");
      weight[s * L + l] = std::exp(logit - column_max);
    }
  }
  std::vector<long double> denominator(static_cast<std::size_t>(L));
  for (index_t t = 0; t < Tn; ++t) {
    for (index_t l = 0; l < L; ++l) {
      long double total = 0;
      for (index_t s = 0; s < Tn; ++s)
        if (spec.in_latent_range(t, s)) total += weight[s * L + l];
      denominator[l] = total;
    }
    for (index_t s = 0; s < Tn; ++s) {
      if (!spec.in_latent_range(t, s)) continue;
      long double a = 0;
      for (index_t l = 0; l < L; ++l)
        if (denominator[l] > 0)
          a += p_state[t * (L + 1) + 1 + l] * weight[s * L + l] / denominator[l];
      m.latent[t * Tn + s] = a;
    }
  }
  return m;
}

/// R^n v_s, feature d (pair i = d / 2; an odd last feature is not rotated).
template <class T>
long double rotated_value(const Tensor<T, 4>& v, index_t b, index_t s, index_t h, index_t d,
                          index_t n, const RotationTable& rotation) {
  if (!rotation.rotates() || d >= 2 * rotation.pairs) return v(b, s, h, d);
  const index_t i = d / 2;
  const long double c = rotation.c(n, i), sn = rotation.s(n, i);
  const long double x = v(b, s, h, 2 * i), y = v(b, s, h, 2 * i + 1);
  return d % 2 == 0 ? c * x - sn * y : sn * x + c * y;
}

/// The Latte Macchiato output for every (batch, head). `value_angles` is
/// [H * (Dv/2)] for VAPOR or empty; `key_angles` [H * (Dk/2)] for RoPE or empty.
template <class T>
TensorLD<4> macchiato_oracle(const MacchiatoSpec& spec, const Tensor<T, 4>& q,
                             const Tensor<T, 4>& k, const Tensor<T, 4>& wq,
                             const Tensor<T, 4>& wk, const Tensor<T, 4>& v,
                             const std::vector<long double>& value_angles = {},
                             const std::vector<long double>& key_angles = {}) {
  const index_t Tn = v.extent(1), Dv = v.extent(3), Dk = wq.extent(3);
  TensorLD<4> out(v.extents());
  for (index_t b = 0; b < v.extent(0); ++b)
    for (index_t h = 0; h < v.extent(2); ++h) {
      const long double* value_theta =
          value_angles.empty() ? nullptr : value_angles.data() + h * (Dv / 2);
      const long double* key_theta = key_angles.empty() ? nullptr : key_angles.data() + h * (Dk / 2);
      const auto m = macchiato_attention_matrices(spec, q, k, wq, wk, b, h, key_theta);
      const RotationTable vapor(value_theta, Tn, Dv);
      const RotationTable none(nullptr, Tn, Dv);
      const RotationTable& local_rotation = spec.vapor_on_window ? vapor : none;
      for (index_t t = 0; t < Tn; ++t)
        for (index_t s = 0; s < Tn; ++s) {
          const long double local = m.local[t * Tn + s], latent = m.latent[t * Tn + s];
          if (local == 0 && latent == 0) continue;
          for (index_t d = 0; d < Dv; ++d) {
            long double sum = latent * rotated_value(v, b, s, h, d, t - s, vapor);
            if (local != 0) sum += local * rotated_value(v, b, s, h, d, t - s, local_rotation);
            out(b, t, h, d) += sum;
          }
        }
    }
  return out;
}

}  // namespace latte::test
