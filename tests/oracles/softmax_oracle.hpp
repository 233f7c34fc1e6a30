#pragma once
// The explicit T x T softmax attention matrix (DESIGN §3.1) in long double:
//   A[t][s] = exp(scale q_t . k_s) / sum_{s' allowed} exp(scale q_t . k_s'),
// allowed(t, s) = (!causal || s <= t) && (left < 0 || s >= t - left)
//                 && (right < 0 || s <= t + right),
// then o_t = sum_s A[t][s] v_s. A negative side means unbounded.
#include <cmath>
#include <vector>

#include "oracles/tensor_ld.hpp"

namespace latte::test {

struct MaskSpec {
  bool causal = false;
  index_t left = -1;
  index_t right = -1;
  [[nodiscard]] bool allowed(index_t t, index_t s) const {
    // distances compared with the sides, never a side added to t: sides may be near INT64_MAX
    return (!causal || s <= t) && (left < 0 || t - s <= left) && (right < 0 || s - t <= right);
  }
};

template <class T>
std::vector<long double> softmax_attention_matrix(const MaskSpec& mask, long double scale,
                                                  const Tensor<T, 4>& q, const Tensor<T, 4>& k,
                                                  index_t b, index_t h) {
  const index_t Tn = q.extent(1), Dk = q.extent(3);
  std::vector<long double> attention(static_cast<std::size_t>(Tn * Tn), 0.0L);
  std::vector<long double> score(static_cast<std::size_t>(Tn));
  for (index_t t = 0; t < Tn; ++t) {
    long double row_max = -INFINITY;
    for (index_t s = 0; s < Tn; ++s) {
      if (!mask.allowed(t, s)) continue;
      long double dot = 0;
      for (index_t d = 0; d < Dk; ++d) dot += (long double)q(b, t, h, d) * k(b, s, h, d);
      score[s] = scale * dot;
      row_max = std::fmax(row_max, score[s]);
    }
    long double total = 0;
    for (index_t s = 0; s < Tn; ++s)
      if (mask.allowed(t, s)) total += std::exp(score[s] - row_max);
    for (index_t s = 0; s < Tn; ++s)
      if (mask.allowed(t, s)) attention[t * Tn + s] = std::exp(score[s] - row_max) / total;
  }
  return attention;
}

template <class T>
TensorLD<4> softmax_oracle(const MaskSpec& mask, long double scale, const Tensor<T, 4>& q,
                           const Tensor<T, 4>& k, const Tensor<T, 4>& v) {
  const index_t Tn = q.extent(1), Dv = v.extent(3);
  TensorLD<4> out(v.extents());
  for (index_t b = 0; b < q.extent(0); ++b)
    for (index_t h = 0; h < q.extent(2); ++h) {
      const auto attention = softmax_attention_matrix(mask, scale, q, k, b, h);
      for (index_t t = 0; t < Tn; ++t)
        for (index_t s = 0; s < Tn; ++s) {
          const long double a = attention[t * Tn + s];
          if (a == 0) continue;
          for (index_t d = 0; d < Dv; ++d) out(b, t, h, d) += a * v(b, s, h, d);
        }
    }
  return out;
}

}  // namespace latte::test
