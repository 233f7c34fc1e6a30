#pragma once
// Layers from their definitions, in long double: the token mixers written out
// (ShortConv as the explicit sum over taps, RG-LRU as the Griffin equations of
// DESIGN §3.2 with nothing precomputed), the projections as explicit dot
// products, and the output projection. The attention in between is one of the
// explicit T x T oracles of this folder. Nothing is shared with the library.
#include <cmath>
#include <vector>

#include "latte/core/tensor.hpp"
#include "oracles/tensor_ld.hpp"

namespace latte::test {

/// y_{t,c} = b_c + sum_{i<K} w_{i,c} x_{t-i,c} with x_{s<0} = 0.  x [B, T, C].
template <class T>
TensorLD<3> short_conv_oracle(const Tensor<T, 2>& kernel, const Tensor<T, 1>& bias,
                              const TensorLD<3>& x) {
  const index_t B = x.extent(0), Tn = x.extent(1), C = x.extent(2), K = kernel.extent(0);
  TensorLD<3> y(x.extents());
  for (index_t b = 0; b < B; ++b)
    for (index_t t = 0; t < Tn; ++t)
      for (index_t c = 0; c < C; ++c) {
        long double sum = bias(c);
        for (index_t i = 0; i < K && i <= t; ++i) sum += (long double)kernel(i, c) * x(b, t - i, c);
        y(b, t, c) = sum;
      }
  return y;
}

struct RglruOracleWeights {
  // Row vector times matrix: gate_c = sum_j x_j W(j, c) + bias_c.
  std::vector<long double> recurrence_gate, recurrence_bias, input_gate, input_bias, lambda;
  long double c = 8;
};

/// h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t), y_t = h_t, h_{-1} = 0, with
/// r_t = sigmoid(x_t W_a + b_a), i_t = sigmoid(x_t W_x + b_x),
/// a_t = exp(-c r_t softplus(Lambda)).
inline TensorLD<3> rglru_oracle(const RglruOracleWeights& w, const TensorLD<3>& x) {
  const index_t B = x.extent(0), Tn = x.extent(1), C = x.extent(2);
  TensorLD<3> y(x.extents());
  for (index_t b = 0; b < B; ++b) {
    std::vector<long double> h(static_cast<std::size_t>(C), 0.0L);
    for (index_t t = 0; t < Tn; ++t)
      for (index_t c = 0; c < C; ++c) {
        long double zr = w.recurrence_bias[c], zi = w.input_bias[c];
        for (index_t j = 0; j < C; ++j) {
          zr += x(b, t, j) * w.recurrence_gate[j * C + c];
          zi += x(b, t, j) * w.input_gate[j * C + c];
        }
        const long double r = 1.0L / (1.0L + std::exp(-zr));
        const long double i = 1.0L / (1.0L + std::exp(-zi));
        // log1p / expm1: with Lambda << 0, a is within 1e-13 of 1, and 1 + e^Lambda,
        // 1 - a^2 formed directly would lose most digits even in long double.
        const long double log_a = -w.c * r * std::log1p(std::exp(w.lambda[c]));
        const long double a = std::exp(log_a);
        h[c] = a * h[c] + std::sqrt(-std::expm1(2.0L * log_a)) * (i * x(b, t, c));
        y(b, t, c) = h[c];
      }
  }
  return y;
}

/// a[b, t, h, d] = sum_j x[b, t, j] W(j, h * width + d), rounded to double so it
/// can feed the attention oracles (which take double inputs and work in long double).
template <class Matrix>
Tensor<double, 4> project_oracle(const TensorLD<3>& x, const Matrix& W, index_t heads,
                                 index_t width) {
  const index_t B = x.extent(0), Tn = x.extent(1), C = x.extent(2);
  Tensor<double, 4> a({B, Tn, heads, width});
  for (index_t b = 0; b < B; ++b)
    for (index_t t = 0; t < Tn; ++t)
      for (index_t h = 0; h < heads; ++h)
        for (index_t d = 0; d < width; ++d) {
          long double sum = 0;
          for (index_t j = 0; j < C; ++j) sum += x(b, t, j) * (long double)W(j, h * width + d);
          a(b, t, h, d) = static_cast<double>(sum);
        }
  return a;
}

/// out[b, t, m] = sum_{h, d} o[b, t, h, d] W_o(h * Dv + d, m).
template <class Matrix>
TensorLD<3> output_oracle(const TensorLD<4>& o, const Matrix& W) {
  const index_t B = o.extent(0), Tn = o.extent(1), H = o.extent(2), Dv = o.extent(3);
  const index_t M = W.cols();
  TensorLD<3> out({B, Tn, M});
  for (index_t b = 0; b < B; ++b)
    for (index_t t = 0; t < Tn; ++t)
      for (index_t m = 0; m < M; ++m) {
        long double sum = 0;
        for (index_t h = 0; h < H; ++h)
          for (index_t d = 0; d < Dv; ++d) sum += o(b, t, h, d) * (long double)W(h * Dv + d, m);
        out(b, t, m) = sum;
      }
  return out;
}

template <class T>
TensorLD<3> to_long_double(const Tensor<T, 3>& x) {
  TensorLD<3> y(x.extents());
  for (index_t i = 0; i < x.size(); ++i) y.data()[i] = x.data()[i];
  return y;
}

}  // namespace latte::test
