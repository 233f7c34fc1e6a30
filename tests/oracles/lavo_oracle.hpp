#pragma once
// LAVO (paper 002) straight from its definition, per query, in long double.
// The output is not one T x T matrix times V, so each query's output is formed
// directly; nothing is shared with the library's recurrences (no ring, no
// running sums, no window bookkeeping):
//
//   local part (§3.2, §3.3), an explicit masked softmax row per query t:
//     allowed(t, s) = t - w < s <= t          (causal: the w most recent tokens)
//                   | |s - t| < w             (bidirectional)
//     A[t][s] = exp(scale q_t . k_s + P[s - t + w - 1]) / sum_{allowed s'} (same)
//     F_local(t) = sum_s A[t][s] v_s
//   global part, from scratch for every t (eq. 3 and the read of eq. 6), from the
//   per-token projections y_s = B F_local(s) (the summands of eq. 3):
//     M(t) = { s : s < floor(t / w) w }        (causal: the complete earlier windows)
//          = every s                           (bidirectional)
//     H = (1 / |M(t)|) sum_{s in M(t)} y_s     (H = 0 when M(t) is empty)
//     X~[i][j] = H_i B[i][j]
//     F_global(t) = sum_i softmax_i(scale sum_j X~[i][j] q_t[j]) X~[i]
//   o_t = (F_local(t) + F_global(t)) / 2, or F_local(t) when M(t) is empty and
//   the empty-memory rule is "local only".
//   Cross-attention (§3.4): M = every source token, f_s = source_s, o_t = F_global(t).
#include <cmath>
#include <vector>

#include "oracles/tensor_ld.hpp"

namespace latte::test {

struct LavoOracleSpec {
  bool causal = true;
  index_t window = 1;                    ///< w
  index_t bases = 1;                     ///< r
  long double scale = 1;                 ///< multiplies q . k and X~ q
  bool local_only_without_memory = false;
  std::vector<long double> basis{};      ///< [H, r, d]
  std::vector<long double> relative_bias{};  ///< [H, 2w - 1]
};

/// The explicit local attention matrix A[t][s] (row-major T x T) of one (batch, head).
template <class T>
std::vector<long double> lavo_local_matrix(const LavoOracleSpec& spec, const Tensor<T, 4>& q,
                                           const Tensor<T, 4>& k, index_t b, index_t h) {
  const index_t Tn = q.extent(1), d = q.extent(3), w = spec.window;
  auto allowed = [&](index_t t, index_t s) {
    return spec.causal ? (s <= t && s > t - w) : (s - t < w && t - s < w);
  };
  const long double* bias = spec.relative_bias.data() + h * (2 * w - 1);
  std::vector<long double> attention(static_cast<std::size_t>(Tn * Tn), 0.0L);
  std::vector<long double> score(static_cast<std::size_t>(Tn));
  for (index_t t = 0; t < Tn; ++t) {
    long double row_max = -INFINITY;
    for (index_t s = 0; s < Tn; ++s) {
      if (!allowed(t, s)) continue;
      long double dot = 0;
      for (index_t j = 0; j < d; ++j) dot += (long double)q(b, t, h, j) * k(b, s, h, j);
      score[s] = spec.scale * dot + bias[s - t + w - 1];
      row_max = std::fmax(row_max, score[s]);
    }
    long double total = 0;
    for (index_t s = 0; s < Tn; ++s)
      if (allowed(t, s)) total += std::exp(score[s] - row_max);
    for (index_t s = 0; s < Tn; ++s)
      if (allowed(t, s)) attention[t * Tn + s] = std::exp(score[s] - row_max) / total;
  }
  return attention;
}

/// y_s = B f_s for every row f_s of `features` (n x d): each token's projection
/// onto the r bases of head h, the summand of eq. 3.
inline std::vector<long double> lavo_projections(const LavoOracleSpec& spec, index_t h,
                                                 const std::vector<long double>& features,
                                                 index_t d) {
  const index_t r = spec.bases, n = static_cast<index_t>(features.size()) / d;
  const long double* basis = spec.basis.data() + h * r * d;
  std::vector<long double> projections(static_cast<std::size_t>(n * r), 0.0L);
  for (index_t s = 0; s < n; ++s)
    for (index_t i = 0; i < r; ++i) {
      long double projection = 0;
      for (index_t j = 0; j < d; ++j) projection += basis[i * d + j] * features[s * d + j];
      projections[s * r + i] = projection;
    }
  return projections;
}

/// F_global for one query given H [r] (eq. 6): X~ = B (.) H formed explicitly,
/// then softmax(scale X~ q)^T X~.
inline std::vector<long double> lavo_read(const LavoOracleSpec& spec, index_t h,
                                          const std::vector<long double>& mean,
                                          const std::vector<long double>& query, index_t d) {
  const index_t r = spec.bases;
  const long double* basis = spec.basis.data() + h * r * d;
  std::vector<long double> memory_matrix(static_cast<std::size_t>(r * d));  // X~ = B (.) H
  for (index_t i = 0; i < r; ++i)
    for (index_t j = 0; j < d; ++j) memory_matrix[i * d + j] = mean[i] * basis[i * d + j];
  std::vector<long double> logits(static_cast<std::size_t>(r));
  long double logit_max = -INFINITY;
  for (index_t i = 0; i < r; ++i) {
    long double dot = 0;
    for (index_t j = 0; j < d; ++j) dot += memory_matrix[i * d + j] * query[j];
    logits[i] = spec.scale * dot;
    logit_max = std::fmax(logit_max, logits[i]);
  }
  long double total = 0;
  for (index_t i = 0; i < r; ++i) total += std::exp(logits[i] - logit_max);
  std::vector<long double> global(static_cast<std::size_t>(d), 0.0L);
  for (index_t i = 0; i < r; ++i) {
    const long double p = std::exp(logits[i] - logit_max) / total;
    for (index_t j = 0; j < d; ++j) global[j] += p * memory_matrix[i * d + j];
  }
  return global;
}

/// F_global for one query from the tokens `in_memory(s)` selects, from scratch:
/// H = mean of their projections (eq. 3; H = 0 when none), then lavo_read.
template <class InMemory>
std::vector<long double> lavo_read_from_scratch(const LavoOracleSpec& spec, index_t h,
                                                const std::vector<long double>& projections,
                                                InMemory&& in_memory,
                                                const std::vector<long double>& query, index_t d,
                                                index_t* memory_tokens) {
  const index_t r = spec.bases, n = static_cast<index_t>(projections.size()) / r;
  std::vector<long double> mean(static_cast<std::size_t>(r), 0.0L);
  index_t count = 0;
  for (index_t s = 0; s < n; ++s) {
    if (!in_memory(s)) continue;
    ++count;
    for (index_t i = 0; i < r; ++i) mean[i] += projections[s * r + i];
  }
  for (index_t i = 0; i < r; ++i) mean[i] = count == 0 ? 0.0L : mean[i] / (long double)count;
  *memory_tokens = count;
  return lavo_read(spec, h, mean, query, d);
}

/// Self-attention LAVO (causal or bidirectional) for every (batch, head).
template <class T>
TensorLD<4> lavo_oracle(const LavoOracleSpec& spec, const Tensor<T, 4>& q, const Tensor<T, 4>& k,
                        const Tensor<T, 4>& v) {
  const index_t Tn = q.extent(1), d = q.extent(3), w = spec.window;
  TensorLD<4> out(v.extents());
  for (index_t b = 0; b < q.extent(0); ++b)
    for (index_t h = 0; h < q.extent(2); ++h) {
      const auto attention = lavo_local_matrix(spec, q, k, b, h);
      std::vector<long double> local(static_cast<std::size_t>(Tn * d), 0.0L);
      for (index_t t = 0; t < Tn; ++t)
        for (index_t s = 0; s < Tn; ++s) {
          const long double a = attention[t * Tn + s];
          if (a == 0) continue;
          for (index_t j = 0; j < d; ++j) local[t * d + j] += a * v(b, s, h, j);
        }
      const auto projections = lavo_projections(spec, h, local, d);
      for (index_t t = 0; t < Tn; ++t) {
        auto in_memory = [&](index_t s) { return spec.causal ? s < (t / w) * w : true; };
        std::vector<long double> query(static_cast<std::size_t>(d));
        for (index_t j = 0; j < d; ++j) query[j] = q(b, t, h, j);
        index_t memory_tokens = 0;
        const auto global =
            lavo_read_from_scratch(spec, h, projections, in_memory, query, d, &memory_tokens);
        for (index_t j = 0; j < d; ++j) {
          const long double f_local = local[t * d + j];
          out(b, t, h, j) = memory_tokens == 0 && spec.local_only_without_memory
                                ? f_local
                                : (f_local + global[j]) / 2;
        }
      }
    }
  return out;
}

/// Cross-attention LAVO: queries [B, Tq, H, d] read CODE(source [B, Ts, H, d]).
template <class T>
TensorLD<4> lavo_cross_oracle(const LavoOracleSpec& spec, const Tensor<T, 4>& q,
                              const Tensor<T, 4>& source) {
  const index_t Tq = q.extent(1), Ts = source.extent(1), d = q.extent(3);
  TensorLD<4> out(q.extents());
  for (index_t b = 0; b < q.extent(0); ++b)
    for (index_t h = 0; h < q.extent(2); ++h) {
      std::vector<long double> features(static_cast<std::size_t>(Ts * d));
      for (index_t s = 0; s < Ts; ++s)
        for (index_t j = 0; j < d; ++j) features[s * d + j] = source(b, s, h, j);
      const auto projections = lavo_projections(spec, h, features, d);
      for (index_t t = 0; t < Tq; ++t) {
        std::vector<long double> query(static_cast<std::size_t>(d));
        for (index_t j = 0; j < d; ++j) query[j] = q(b, t, h, j);
        index_t memory_tokens = 0;
        const auto global = lavo_read_from_scratch(
            spec, h, projections, [](index_t) { return true; }, query, d, &memory_tokens);
        for (index_t j = 0; j < d; ++j) out(b, t, h, j) = global[j];
      }
    }
  return out;
}

}  // namespace latte::test
