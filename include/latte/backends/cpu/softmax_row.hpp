#pragma once
// One query's softmax attention over `count` keys for the CPU decode steps of
// LAVO and convolutional-compression attention: the online softmax taken 64
// keys at a time, so that the exponentials of a block are one vectorised pass
// (one exp per key and one per block, instead of two per key in the per-key
// recurrence), the running output is rescaled once per block, and every
// value row is added with SIMD. No allocation: the block's scores live on the stack.
//
//   out = sum_j softmax_j(score(j)) value(j),  j in [0, count)
// where score_block(j0, n, p) writes score(j0 .. j0 + n - 1) to p (n <= 64), e.g.
// scale q . k_j + bias(j) with one matrix-vector product over contiguous keys, and
// accumulate_block(j0, n, p, out) adds sum_j p[j] value(j0 + j) to out (the
// transposed matrix-vector product over the same rows).
// A row whose scores are all -inf reads zero; a NaN score makes the row NaN
// (as the reference's per-key recurrence does).
// With `compensation` (2 Dv values of scratch) the running sums across blocks,
// l and out, are compensated (core/compensated_sum.hpp): each block's sum is
// formed apart and added by TwoSum, so that the error does not grow with
// count (conv-compression's read over its compressed tokens spans the whole past).
#include <algorithm>
#include <cmath>
#include <limits>

#include "latte/backends/cpu/compensated_sums.hpp"
#include "latte/backends/cpu/simd.hpp"
#include "latte/core/compensated_sum.hpp"
#include "latte/core/types.hpp"

namespace latte::cpu {

inline constexpr index_t softmax_row_block = 64;

template <Real T, class ScoreBlock, class AccumulateBlock>
void softmax_row_blocked(index_t Dv, index_t count, ScoreBlock&& score_block,
                         AccumulateBlock&& accumulate_block, T* out,
                         T* compensation = nullptr) noexcept {
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  constexpr index_t block = softmax_row_block;
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  alignas(64) T p[block];
  std::fill(out, out + Dv, T(0));
  T* const out_low = compensation;
  T* const block_sum = compensation ? compensation + Dv : nullptr;
  if (compensation) std::fill(out_low, out_low + Dv, T(0));
  T m = neg_inf, l = 0, l_low = 0;
  for (index_t j0 = 0; j0 < count; j0 += block) {
    const index_t n = std::min(block, count - j0);
    T block_max = neg_inf;
    bool nan = false;
    score_block(j0, n, p);
    for (index_t j = 0; j < n; ++j) {
      nan = nan || std::isnan(p[j]);
      block_max = std::max(block_max, p[j]);
    }
    const T m_new = nan ? std::numeric_limits<T>::quiet_NaN() : std::max(m, block_max);
    if (m_new == neg_inf) continue;  // every score so far is -inf
    const T total = simd::exp_shifted_sum(p, n, m_new, p);
    const T carry_scale = std::exp(m - m_new);
    if (compensation) {
      if (carry_scale != T(1)) {
        latte::detail::compensated_scale(l, l_low, carry_scale);
        scale_pairs(out, out_low, carry_scale, Dv);
      }
      latte::detail::compensated_add(l, l_low, total);
      std::fill(block_sum, block_sum + Dv, T(0));
      accumulate_block(j0, n, static_cast<const T*>(p), block_sum);
      add_to_pairs(out, out_low, block_sum, Dv);
      m = m_new;
      continue;
    }
    l = l * carry_scale + total;
    index_t d = 0;
    if (carry_scale != T(1)) {
      for (; d + W <= Dv; d += W) simd::store(out + d, simd::load(out + d) * B(carry_scale));
      for (; d < Dv; ++d) out[d] *= carry_scale;
    }
    accumulate_block(j0, n, static_cast<const T*>(p), out);
    m = m_new;
  }
  if (l > T(0))
    for (index_t d = 0; d < Dv; ++d) out[d] /= l;
}

}  // namespace latte::cpu
