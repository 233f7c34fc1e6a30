#pragma once
// The explicit T x S attention matrix of the linear-attention family, straight
// from the definitions (paper 001 eq. 4; paper 004 eqs. 6-10 and 13), in long
// double, then applied to V. Nothing here is shared with the library's
// kernels: no memory S, no normaliser z, no sin/cos streams, no absolute
// rotations — each score is formed directly from its definition:
//
//   w_ts  = phi(q_t) . R^{s-t} phi(k_s) * sigma_ts,   sigma_ts = cos(pi/2 (P_q,t - P_k,s)) or 1
//   w'_ts = w_ts (no RoPE, or rotated denominator), phi(q_t) . phi(k_s) * sigma_ts otherwise
//   D_t   = sum_{s allowed} w'_ts,  allowed = (s <= t) causal, all s otherwise
//   N(D)  = max(D, 0) + eps (additive) or max(D, c) (clamp_min)
//   o_t   = sum_{s allowed} w_ts / N(D_t) v_s
//
// sigma is evaluated as sin(pi/2 (1 - |P_q - P_k|)) with 1 - |P_q - P_k| formed
// from the proportions and their complements (Q = 1 - P, kept separately), so
// that proportions within 1e-9 of 0 or 1 keep their relative precision.
// R^n rotates feature pairs (2i, 2i+1) by n * theta_i (the last feature of an
// odd F is not rotated). Only the relative distance s - t enters, so the
// oracle is independent of the absolute positions the library rotates by.
#include <cmath>
#include <cstdint>
#include <functional>
#include <numbers>
#include <vector>

#include "latte/policies/leap_module.hpp"
#include "oracles/tensor_ld.hpp"

namespace latte::test {

/// phi on one row, in long double.
using OracleFeatureMap = std::function<std::vector<long double>(const std::vector<long double>&)>;

inline std::vector<long double> oracle_relu(const std::vector<long double>& x) {
  std::vector<long double> phi(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) phi[i] = x[i] > 0 ? x[i] : 0.0L;
  return phi;
}
/// elu(x) + 1 with alpha = 1: x + 1 for x > 0, (exp(x) - 1) + 1 otherwise.
inline std::vector<long double> oracle_elu_plus_one(const std::vector<long double>& x) {
  std::vector<long double> phi(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) phi[i] = x[i] > 0 ? x[i] + 1.0L : std::exp(x[i]);
  return phi;
}
inline std::vector<long double> oracle_identity(const std::vector<long double>& x) { return x; }

/// A proportion P and its complement Q = 1 - P, each to full precision.
struct OracleProportion {
  long double value = 0, complement = 1;
};

struct LinearOracleSpec {
  bool causal = false;
  OracleFeatureMap feature = oracle_relu;
  /// Proportions P_q [B * T * H] and P_k [B * S * H] (row-major); empty: sigma = 1.
  std::vector<OracleProportion> query_proportions = {}, key_proportions = {};
  /// RoPE angles [H * (F/2)]; empty: no rotation.
  std::vector<long double> angles = {};
  bool rotated_denominator = false;
  bool clamp = false;          ///< clamp_min instead of additive
  long double value = 1e-6L;   ///< epsilon or the clamp minimum
};

template <class T>
std::vector<long double> oracle_row(const Tensor<T, 4>& x, index_t b, index_t t, index_t h) {
  std::vector<long double> row(static_cast<std::size_t>(x.extent(3)));
  for (index_t d = 0; d < x.extent(3); ++d) row[d] = x(b, t, h, d);
  return row;
}

/// cosFormer's proportions (i + 1) / M at absolute positions first + t, as a [B * T * H] table.
inline std::vector<OracleProportion> oracle_position_proportions(index_t B, index_t Tn, index_t H,
                                                                 long double length,
                                                                 std::int64_t first = 0) {
  std::vector<OracleProportion> p(static_cast<std::size_t>(B * Tn * H));
  for (index_t b = 0; b < B; ++b)
    for (index_t t = 0; t < Tn; ++t)
      for (index_t h = 0; h < H; ++h) {
        const long double i = (long double)(first + t);
        p[(b * Tn + t) * H + h] = {(i + 1) / length, (length - i - 1) / length};
      }
  return p;
}

/// LeaP proportions sigmoid(W2 relu(W1 phi(x) + b1) + b2) of every row of x, in long double.
template <class T>
std::vector<OracleProportion> oracle_leap_proportions(const Tensor<T, 4>& x,
                                                      const LeaPModule& module,
                                                      const OracleFeatureMap& feature) {
  const index_t B = x.extent(0), Tn = x.extent(1), H = x.extent(2);
  std::vector<OracleProportion> p(static_cast<std::size_t>(B * Tn * H));
  for (index_t b = 0; b < B; ++b)
    for (index_t t = 0; t < Tn; ++t)
      for (index_t h = 0; h < H; ++h) {
        const auto phi = feature(oracle_row(x, b, t, h));
        long double logit = module.b2;
        for (index_t j = 0; j < module.w1.extent(0); ++j) {
          long double pre = module.b1(j);
          for (index_t f = 0; f < module.w1.extent(1); ++f)
            pre += (long double)module.w1(j, f) * phi[f];
          logit += (long double)module.w2(j) * std::fmax(pre, 0.0L);
        }
        p[(b * Tn + t) * H + h] = {1.0L / (1.0L + std::exp(-logit)),
                                   1.0L / (1.0L + std::exp(logit))};
      }
  return p;
}

/// Given proportions [B, T, H] as a table.
template <class T>
std::vector<OracleProportion> oracle_given_proportions(const Tensor<T, 3>& p) {
  std::vector<OracleProportion> table(static_cast<std::size_t>(p.size()));
  for (index_t i = 0; i < p.size(); ++i)
    table[i] = {(long double)p.data()[i], 1.0L - (long double)p.data()[i]};
  return table;
}

/// The attention matrix A[t][s] = w_ts / N(D_t) of one (batch, head), row-major T x S.
template <class T>
std::vector<long double> linear_attention_matrix(const LinearOracleSpec& spec, const Tensor<T, 4>& q,
                                                 const Tensor<T, 4>& k, index_t b, index_t h) {
  const index_t Tn = q.extent(1), Sn = k.extent(1), H = q.extent(2);
  std::vector<std::vector<long double>> phi_q(Tn), phi_k(Sn);
  for (index_t t = 0; t < Tn; ++t) phi_q[t] = spec.feature(oracle_row(q, b, t, h));
  for (index_t s = 0; s < Sn; ++s) phi_k[s] = spec.feature(oracle_row(k, b, s, h));
  const index_t F = Tn ? (index_t)phi_q[0].size() : 0;
  const index_t pairs = spec.angles.empty() ? 0 : F / 2;
  // cos / sin of n * theta_i for every relative distance n = s - t.
  const index_t offset = Tn - 1;
  std::vector<long double> cos_table, sin_table;
  if (pairs) {
    cos_table.resize(static_cast<std::size_t>((Tn + Sn) * pairs));
    sin_table.resize(cos_table.size());
    for (index_t n = -(Tn - 1); n <= Sn - 1; ++n)
      for (index_t i = 0; i < pairs; ++i) {
        const long double angle = (long double)n * spec.angles[h * pairs + i];
        cos_table[(n + offset) * pairs + i] = std::cos(angle);
        sin_table[(n + offset) * pairs + i] = std::sin(angle);
      }
  }
  auto sigma = [&](index_t t, index_t s) -> long double {
    if (spec.query_proportions.empty()) return 1.0L;
    const OracleProportion pq = spec.query_proportions[(b * Tn + t) * H + h];
    const OracleProportion pk = spec.key_proportions[(b * Sn + s) * H + h];
    // cos(pi/2 d) = sin(pi/2 (1 - |d|)), d = P_q - P_k; 1 - d = Q_q + P_k, 1 + d = P_q + Q_k.
    const long double rest = pq.value >= pk.value ? pq.complement + pk.value
                                                  : pq.value + pk.complement;
    return std::sin(std::numbers::pi_v<long double> / 2 * rest);
  };
  std::vector<long double> score(static_cast<std::size_t>(Tn * Sn), 0.0L);
  std::vector<long double> attention(score.size(), 0.0L);
  for (index_t t = 0; t < Tn; ++t) {
    const index_t last = spec.causal ? t : Sn - 1;
    long double denominator = 0;
    for (index_t s = 0; s <= last; ++s) {
      const auto& x = phi_q[t];
      const auto& y = phi_k[s];
      long double plain = 0, rotated = 0;
      for (index_t f = 0; f < F; ++f) plain += x[f] * y[f];
      rotated = plain;
      if (pairs) {  // x . R^{s-t} y
        rotated = 0;
        for (index_t i = 0; i < pairs; ++i) {
          const long double c = cos_table[(s - t + offset) * pairs + i];
          const long double sn = sin_table[(s - t + offset) * pairs + i];
          const long double y0 = c * y[2 * i] - sn * y[2 * i + 1];
          const long double y1 = sn * y[2 * i] + c * y[2 * i + 1];
          rotated += x[2 * i] * y0 + x[2 * i + 1] * y1;
        }
        for (index_t f = 2 * pairs; f < F; ++f) rotated += x[f] * y[f];
      }
      const long double weight = sigma(t, s);
      score[t * Sn + s] = rotated * weight;
      denominator += (spec.rotated_denominator ? rotated : plain) * weight;
    }
    const long double normalised = spec.clamp ? std::fmax(denominator, spec.value)
                                              : std::fmax(denominator, 0.0L) + spec.value;
    for (index_t s = 0; s <= last; ++s) attention[t * Sn + s] = score[t * Sn + s] / normalised;
  }
  return attention;
}

/// The linear-attention output for every (batch, head): queries [B, T, H, Dk],
/// keys [B, S, H, Dk], values [B, S, H, Dv] (S = T for self-attention).
template <class T>
TensorLD<4> linear_oracle(const LinearOracleSpec& spec, const Tensor<T, 4>& q,
                          const Tensor<T, 4>& k, const Tensor<T, 4>& v) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), Sn = k.extent(1);
  const index_t Dv = v.extent(3);
  TensorLD<4> out({B, Tn, H, Dv});
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h) {
      const auto attention = linear_attention_matrix(spec, q, k, b, h);
      for (index_t t = 0; t < Tn; ++t)
        for (index_t s = 0; s < Sn; ++s) {
          const long double a = attention[t * Sn + s];
          if (a == 0) continue;
          for (index_t d = 0; d < Dv; ++d) out(b, t, h, d) += a * (long double)v(b, s, h, d);
        }
    }
  return out;
}

}  // namespace latte::test
