#pragma once
// The explicit T x T attention matrix of Latte, straight from the definitions
// (paper 000 eqs. 5-8; VAPOR eq. 22), in long double, then applied to V.
// Nothing here is shared with the recurrences of the library: no running
// maximum, no rescaling, no latent memory — each A[t][s] is formed directly.
//
//   p(l|t)   = exp(q_{t,l}) / sum_j exp(q_{t,j})
//   p(s|l,t) = exp(k_{s,l}) / sum_{s' in S(t)} exp(k_{s',l}),  S(t) = {s <= t} (causal) or all s
//   A[t][s]  = sum_l p(l|t) p(s|l,t)
//   o_t      = sum_s A[t][s] R^{t-s} v_s
// Conventions (documented in the README): a latent whose keys in S(t) are all
// -inf contributes nothing; a query whose latent logits are all -inf reads zero.
#include <cmath>
#include <stdexcept>
#include <vector>

#include "oracles/tensor_ld.hpp"

namespace latte::test {

/// A[t][s] for one (batch, head), row-major T x T.
template <class T>
std::vector<long double> latte_attention_matrix(bool causal, const Tensor<T, 4>& q,
                                                const Tensor<T, 4>& k, index_t b, index_t h) {
  const index_t Tn = q.extent(1), L = q.extent(3);
  constexpr long double neg_inf = -INFINITY;
  // p(l|t)
  std::vector<long double> p_latent(static_cast<std::size_t>(Tn * L), 0.0L);
  for (index_t t = 0; t < Tn; ++t) {
    long double q_max = neg_inf;
    for (index_t l = 0; l < L; ++l) q_max = std::fmax(q_max, (long double)q(b, t, h, l));
    if (q_max == neg_inf) continue;
    long double total = 0;
    for (index_t l = 0; l < L; ++l) total += std::exp((long double)q(b, t, h, l) - q_max);
    for (index_t l = 0; l < L; ++l)
      p_latent[t * L + l] = std::exp((long double)q(b, t, h, l) - q_max) / total;
  }
  // exp(k_{s,l}) shifted by the column maximum: an exact identity inside each
  // ratio, and long double's exponent range keeps every term of a spread up to
  // 11000 representable.
  std::vector<long double> weight(static_cast<std::size_t>(Tn * L), 0.0L);
  for (index_t l = 0; l < L; ++l) {
    long double column_max = neg_inf;
    for (index_t s = 0; s < Tn; ++s) column_max = std::fmax(column_max, (long double)k(b, s, h, l));
    if (column_max == neg_inf) continue;
    for (index_t s = 0; s < Tn; ++s) {
      const long double logit = k(b, s, h, l);
      if (logit != neg_inf && column_max - logit > 11000.0L)
        throw std::domain_error("latte oracle: key logit spread beyond long double range");
      weight[s * L + l] = std::exp(logit - column_max);
    }
  }
  std::vector<long double> attention(static_cast<std::size_t>(Tn * Tn), 0.0L);
  std::vector<long double> denominator(static_cast<std::size_t>(L));
  for (index_t t = 0; t < Tn; ++t) {
    const index_t last = causal ? t : Tn - 1;
    for (index_t l = 0; l < L; ++l) {
      long double total = 0;
      for (index_t s = 0; s <= last; ++s) total += weight[s * L + l];
      denominator[l] = total;
    }
    for (index_t s = 0; s <= last; ++s) {
      long double a = 0;
      for (index_t l = 0; l < L; ++l)
        if (denominator[l] > 0) a += p_latent[t * L + l] * weight[s * L + l] / denominator[l];
      attention[t * Tn + s] = a;
    }
  }
  return attention;
}

/// o_t = sum_s A[t][s] R^{t-s} v_s for one (batch, head). `theta` holds Dv/2
/// angles (null: no rotation); pair i is features (2i, 2i+1).
template <class T>
void apply_attention(const std::vector<long double>& attention, const Tensor<T, 4>& v,
                     index_t b, index_t h, const long double* theta, TensorLD<4>& out) {
  const index_t Tn = v.extent(1), Dv = v.extent(3), pairs = Dv / 2;
  // cos/sin of n * theta_i for n = t - s in [-(T-1), T-1].
  std::vector<long double> cos_table, sin_table;
  if (theta) {
    cos_table.resize(static_cast<std::size_t>((2 * Tn - 1) * pairs));
    sin_table.resize(cos_table.size());
    for (index_t n = -(Tn - 1); n <= Tn - 1; ++n)
      for (index_t i = 0; i < pairs; ++i) {
        const long double angle = (long double)n * theta[i];
        cos_table[(n + Tn - 1) * pairs + i] = std::cos(angle);
        sin_table[(n + Tn - 1) * pairs + i] = std::sin(angle);
      }
  }
  for (index_t t = 0; t < Tn; ++t) {
    for (index_t d = 0; d < Dv; ++d) out(b, t, h, d) = 0;
    for (index_t s = 0; s < Tn; ++s) {
      const long double a = attention[t * Tn + s];
      if (a == 0) continue;
      for (index_t d = 0; d < Dv; ++d) {
        long double rotated = v(b, s, h, d);
        if (theta && d < 2 * pairs) {
          const index_t i = d / 2, at = (t - s + Tn - 1) * pairs + i;
          const long double x = v(b, s, h, 2 * i), y = v(b, s, h, 2 * i + 1);
          rotated = (d % 2 == 0) ? cos_table[at] * x - sin_table[at] * y
                                 : sin_table[at] * x + cos_table[at] * y;
        }
        out(b, t, h, d) += a * rotated;
      }
    }
  }
}

/// The Latte output for every (batch, head). `angles` is [H * (Dv/2)] or empty.
template <class T>
TensorLD<4> latte_oracle(bool causal, const Tensor<T, 4>& q, const Tensor<T, 4>& k,
                         const Tensor<T, 4>& v, const std::vector<long double>& angles = {}) {
  TensorLD<4> out(v.extents());
  const index_t pairs = v.extent(3) / 2;
  for (index_t b = 0; b < q.extent(0); ++b)
    for (index_t h = 0; h < q.extent(2); ++h) {
      const auto attention = latte_attention_matrix(causal, q, k, b, h);
      apply_attention(attention, v, b, h, angles.empty() ? nullptr : angles.data() + h * pairs,
                      out);
    }
  return out;
}

}  // namespace latte::test
