// FLOP models shared by the Google Benchmark suites and latte-compare, for the
// mechanisms whose count is more than one product. A multiply and an add count
// 2; exp, max and rotations are left out. Each returns the FLOPs of one head
// (multiply by B * H).
#pragma once

#include <latte/core/types.hpp>

#include <algorithm>
#include <cstdint>

namespace latte::bench {

/// Latte Macchiato, one token: the L latent states absorb v_t into an L x Dv
/// memory (2 L Dv) and read it with p(l|t) (2 L Dv); the window part scores
/// w + 1 keys (2 (w + 1) Dk) and sums w + 1 values (2 (w + 1) Dv). The first w
/// tokens of a sequence see fewer keys; the model ignores that.
inline double macchiato_token_flops(index_t latents, index_t key_dim, index_t value_dim,
                                    index_t window) {
  return 4.0 * double(latents) * double(value_dim) +
         2.0 * double(window + 1) * double(key_dim + value_dim);
}

/// Keys the LAVO local part of token t sees in a sequence of `length` tokens
/// (paper 002 §3.2): the last w causal, w - 1 either side bidirectional.
inline index_t lavo_local_keys(bool causal, index_t t, index_t length, index_t window) {
  if (causal) return std::min(t + 1, window);
  return std::min(length - 1, t + window - 1) - std::max<index_t>(0, t - window + 1) + 1;
}

/// LAVO forward over T tokens: per token 4 |W(t)| d for the local part (a dot
/// product and a weighted sum per key), 2 r d for the compression (eq. 3) and
/// 4 r d for the memory read (eq. 6).
inline double lavo_forward_flops(index_t T, index_t dim, index_t bases, index_t window,
                                 bool causal) {
  double flops = 0;
  for (index_t t = 0; t < T; ++t)
    flops += 4.0 * double(lavo_local_keys(causal, t, T, window)) * double(dim) +
             6.0 * double(bases) * double(dim);
  return flops;
}

/// Convolutional-compression attention (paper 003) forward over T tokens with
/// group size (= window) M and `levels` levels:
///   window (every level l, n_l tokens): 2 |W(j)| (Dk + Dv) per token j;
///   convolution (level l): 2 Dv^2 per token of level l - 1;
///   level projections (1 <= l < levels): 2 Dv (2 Dk + Dv) per token of level l;
///   cross: 2 Dk Dv per query, 2 Dv (Dk + Dv) per top-level token, and
///   2 |V(t)| (Dk + Dv) per query, |V(t)| = floor(t / M^levels) causal, n_levels
///   bidirectional.
inline double conv_compressed_forward_flops(index_t T, index_t levels, index_t group,
                                            index_t key_dim, index_t value_dim, bool causal) {
  const double Dk = double(key_dim), Dv = double(value_dim);
  const index_t left = group - 1, right = causal ? 0 : group - 1;
  auto window = [&](index_t n) {
    double keys = 0;
    for (index_t j = 0; j < n; ++j)
      keys += double(std::min(j, left) + 1 + std::min(n - 1 - j, right));
    return 2.0 * keys * (Dk + Dv);
  };
  double flops = window(T);
  index_t n = T;
  for (index_t level = 1; level <= levels; ++level) {
    flops += 2.0 * double(n) * Dv * Dv;  // convolution over level - 1
    n /= group;
    if (level < levels) flops += double(n) * 2.0 * Dv * (2 * Dk + Dv) + window(n);
  }
  std::int64_t span = 1;
  for (index_t level = 0; level < levels; ++level) span *= group;
  double reads = 0;
  for (index_t t = 0; t < T; ++t) reads += causal ? double(t / span) : double(n);
  return flops + double(T) * 2.0 * Dk * Dv + double(n) * 2.0 * Dv * (Dk + Dv) +
         2.0 * reads * (Dk + Dv);
}

}  // namespace latte::bench
