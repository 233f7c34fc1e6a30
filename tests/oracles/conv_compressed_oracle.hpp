#pragma once
// Convolutional-compression attention (paper 003 §4, DESIGN §3.5) from its
// definition, in long double, with every attention an explicit matrix and every
// mask a plain predicate. Nothing is shared with the library's kernels: no ring
// buffers, no running sums, no online softmax; each level is computed whole,
// from scratch, for every (batch, head).
//
//   level 0:  A0[t][s] = softmax_s(scale q_t . k_s) over window(t, s);   y0 = A0 V
//   level l:  c_l[j] = b_l + sum_{i<M} W_l[i] y_{l-1}[jM + i]   for every group j whose
//             M positions jM .. jM+M-1 all exist in y_{l-1} (complete groups)
//             y_l = softmax-window attention over (Wq_l c_l, Wk_l c_l, Wv_l c_l)  (l < L)
//   cross:    C[t][j] = softmax_j(scale (Wq_x y0_t) . (Wk_x c_L[j])) over visible(t, j)
//             global_t = sum_j C[t][j] Wv_x c_L[j]
//   out       = y0 + global
// window(t, s)  = t - left <= s <= t + right (and s <= t when causal)
// visible(t, j) = bidirectional, or: the last input position that c_L[j] covers,
//                 (j + 1) M^L - 1, lies strictly before t.
// A query with no allowed key reads zero.
#include <cmath>
#include <vector>

#include "latte/mechanisms/conv_compressed_attention.hpp"
#include "oracles/tensor_ld.hpp"

namespace latte::test {

struct ConvCompressedSpec {
  bool causal = true;
  index_t group_size = 1;
  index_t levels = 1;
  index_t window_left = 0;
  index_t window_right = 0;
  long double scale = 1;

  [[nodiscard]] bool in_window(index_t t, index_t s) const {
    return s >= t - window_left && s <= t + window_right && (!causal || s <= t);
  }
  /// Whether query t may read top-level token j.
  [[nodiscard]] bool visible(index_t t, index_t j) const {
    if (!causal) return true;
    long double span = 1;  // M^L, exact in long double for the sizes tests use
    for (index_t l = 0; l < levels; ++l) span *= (long double)group_size;
    const long double last_covered = (long double)(j + 1) * span - 1;
    return last_covered < (long double)t;
  }
};

/// A sequence of n rows of D long doubles.
struct RowsLD {
  index_t n = 0, D = 0;
  std::vector<long double> data;
  RowsLD(index_t rows, index_t dim) : n(rows), D(dim), data(static_cast<std::size_t>(rows * dim)) {}
  long double& operator()(index_t i, index_t d) { return data[static_cast<std::size_t>(i * D + d)]; }
  long double operator()(index_t i, index_t d) const {
    return data[static_cast<std::size_t>(i * D + d)];
  }
};

/// out_j = W x_j for W [out, in] (head h of a [H, out, in] tensor).
template <class Weights3>
RowsLD project(const Weights3& W, index_t h, const RowsLD& x) {
  const index_t out_dim = W.extent(1), in_dim = W.extent(2);
  RowsLD y(x.n, out_dim);
  for (index_t j = 0; j < x.n; ++j)
    for (index_t o = 0; o < out_dim; ++o) {
      long double total = 0;
      for (index_t d = 0; d < in_dim; ++d) total += (long double)W(h, o, d) * x(j, d);
      y(j, o) = total;
    }
  return y;
}

/// The explicit n_q x n_k attention matrix softmax_s(scale q_t . k_s) over allowed(t, s),
/// applied to the values.
template <class Allowed>
RowsLD attend(const RowsLD& q, const RowsLD& k, const RowsLD& v, long double scale,
              Allowed&& allowed) {
  std::vector<long double> A(static_cast<std::size_t>(q.n * k.n), 0.0L);
  for (index_t t = 0; t < q.n; ++t) {
    std::vector<long double> score(static_cast<std::size_t>(k.n), 0.0L);
    long double row_max = -INFINITY;
    for (index_t s = 0; s < k.n; ++s) {
      if (!allowed(t, s)) continue;
      long double dot = 0;
      for (index_t d = 0; d < q.D; ++d) dot += q(t, d) * k(s, d);
      score[s] = scale * dot;
      row_max = std::fmax(row_max, score[s]);
    }
    long double total = 0;
    for (index_t s = 0; s < k.n; ++s)
      if (allowed(t, s)) total += std::exp(score[s] - row_max);
    for (index_t s = 0; s < k.n; ++s)
      if (allowed(t, s)) A[t * k.n + s] = std::exp(score[s] - row_max) / total;
  }
  RowsLD out(q.n, v.D);
  for (index_t t = 0; t < q.n; ++t)
    for (index_t s = 0; s < k.n; ++s) {
      const long double a = A[t * k.n + s];
      if (a == 0) continue;
      for (index_t d = 0; d < v.D; ++d) out(t, d) += a * v(s, d);
    }
  return out;
}

/// c[j] = b + sum_i W[i] y[jM + i] over the complete groups of y (level `level`, 1-based).
/// `Params` is ConvCompressedParams or the same fields in long double (gradient tests).
template <class Params>
RowsLD compress(const Params& params, index_t level, index_t h, index_t M, const RowsLD& y) {
  const auto& W = params.conv_weight[level - 1];
  const auto& bias = params.conv_bias[level - 1];
  index_t groups = 0;
  while ((groups + 1) * M <= y.n) ++groups;  // group j needs positions jM .. jM+M-1 < n
  RowsLD c(groups, y.D);
  for (index_t j = 0; j < groups; ++j)
    for (index_t o = 0; o < y.D; ++o) {
      long double total = bias(h, o);
      for (index_t i = 0; i < M; ++i)
        for (index_t d = 0; d < y.D; ++d) total += (long double)W(h, i, o, d) * y(j * M + i, d);
      c(j, o) = total;
    }
  return c;
}

/// ConvCompressedParams' fields in long double: what the loss perturbs.
struct ParamsLD {
  std::vector<TensorLD<4>> conv_weight;
  std::vector<TensorLD<2>> conv_bias;
  std::vector<TensorLD<3>> level_query, level_key, level_value;
  TensorLD<3> cross_query, cross_key, cross_value;
};

/// Every weight tensor of `p`, in one fixed order (`visit(tensor)`).
template <class Params, class Visit>
void for_each_weight(Params& p, Visit&& visit) {
  for (auto& w : p.conv_weight) visit(w);
  for (auto& w : p.conv_bias) visit(w);
  for (auto& w : p.level_query) visit(w);
  for (auto& w : p.level_key) visit(w);
  for (auto& w : p.level_value) visit(w);
  visit(p.cross_query);
  visit(p.cross_key);
  visit(p.cross_value);
}

/// The output and its two parts (local = y0, global = cross) for every (batch, head).
struct ConvCompressedOracle {
  TensorLD<4> out, local, global;
};

template <class T, class Params = ConvCompressedParams>
ConvCompressedOracle conv_compressed_oracle(const ConvCompressedSpec& spec, const Params& params,
                                            const Tensor<T, 4>& q, const Tensor<T, 4>& k,
                                            const Tensor<T, 4>& v) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), Dk = q.extent(3);
  const index_t Dv = v.extent(3);
  ConvCompressedOracle result{TensorLD<4>(v.extents()), TensorLD<4>(v.extents()),
                              TensorLD<4>(v.extents())};
  auto window = [&](index_t t, index_t s) { return spec.in_window(t, s); };
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h) {
      RowsLD q0(Tn, Dk), k0(Tn, Dk), v0(Tn, Dv);
      for (index_t t = 0; t < Tn; ++t) {
        for (index_t d = 0; d < Dk; ++d) q0(t, d) = q(b, t, h, d), k0(t, d) = k(b, t, h, d);
        for (index_t d = 0; d < Dv; ++d) v0(t, d) = v(b, t, h, d);
      }
      const RowsLD y0 = attend(q0, k0, v0, spec.scale, window);
      RowsLD y = y0, c(0, Dv);
      for (index_t level = 1; level <= spec.levels; ++level) {
        c = compress(params, level, h, spec.group_size, y);
        if (level == spec.levels) break;
        y = attend(project(params.level_query[level - 1], h, c),
                   project(params.level_key[level - 1], h, c),
                   project(params.level_value[level - 1], h, c), spec.scale, window);
      }
      const RowsLD global = attend(project(params.cross_query, h, y0),
                                   project(params.cross_key, h, c),
                                   project(params.cross_value, h, c), spec.scale,
                                   [&](index_t t, index_t j) { return spec.visible(t, j); });
      for (index_t t = 0; t < Tn; ++t)
        for (index_t d = 0; d < Dv; ++d) {
          result.local(b, t, h, d) = y0(t, d);
          result.global(b, t, h, d) = global(t, d);
          result.out(b, t, h, d) = y0(t, d) + global(t, d);
        }
    }
  return result;
}

}  // namespace latte::test
