#pragma once
// Compensated sums for the CPU kernels (core/compensated_sum.hpp has the
// scalar rules and why). A sum is a pair (hi, lo) whose value is hi + lo.
//
// Prefill (a chunked scan) keeps its plain running sum for the reads and,
// beside it, the terms of the tokens since the last fold as rows; every
// `fold_tokens` tokens one contraction sums them (block_contractions.hpp),
// TwoSum adds that into the pair, and the running sum restarts from the new
// hi. The running sum therefore never drifts further from the exact one than
// the rounding of `fold_tokens` additions, at any length.
//
// A decode step adds its term to lo alone (one FMA, as a plain sum costs) and
// reads fl(hi + lo); every `fold_tokens` positions the pairs are renormalised,
// so lo holds at most that many terms.
#include <algorithm>

#include "latte/backends/cpu/block_contractions.hpp"
#include "latte/backends/cpu/simd.hpp"
#include "latte/core/compensated_sum.hpp"
#include "latte/core/huge_page_allocator.hpp"
#include "latte/core/types.hpp"

namespace latte::cpu {

/// Tokens a scan absorbs into its running sums between two folds, and decode
/// steps between two renormalisations.
inline constexpr index_t fold_tokens = 64;

namespace detail {

/// s + e = a + b exactly, over lanes (TwoSum).
template <Real T>
inline void two_sum(const simd::batch<T>& a, const simd::batch<T>& b, simd::batch<T>& s,
                    simd::batch<T>& e) noexcept {
  s = a + b;
  const simd::batch<T> bb = s - a;
  e = (a - (s - bb)) + (b - bb);
}

}  // namespace detail

/// (high, low) <- (high, low) + pending, renormalised, for n elements; then
/// running = high (the running sums restart from the compensated ones) and
/// pending = 0. A sum that is no longer finite keeps high and low = 0.
template <Real T>
void fold_pending(T* running, T* high, T* low, T* pending, index_t n) noexcept {
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  const B zero(T(0));
  index_t i = 0;
  for (; i + W <= n; i += W) {
    B s, e, r, f;
    detail::two_sum(simd::load(high + i), simd::load(pending + i), s, e);
    detail::two_sum(s, simd::load(low + i) + e, r, f);
    simd::store(high + i, r);
    simd::store(running + i, r);
    simd::store(low + i, simd::select_finite(r, f, zero));
    simd::store(pending + i, zero);
  }
  for (; i < n; ++i) {
    latte::detail::compensated_add(high[i], low[i], pending[i]);
    running[i] = high[i];
    pending[i] = T(0);
  }
}

/// (high, low) <- the same sums with high = fl(high + low), for n elements.
template <Real T>
void renormalise_pairs(T* high, T* low, index_t n) noexcept {
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  index_t i = 0;
  for (; i + W <= n; i += W) {
    B s, e;
    detail::two_sum(simd::load(high + i), simd::load(low + i), s, e);
    simd::store(high + i, s);
    simd::store(low + i, simd::select_finite(s, e, B(T(0))));
  }
  for (; i < n; ++i) latte::detail::renormalise(high[i], low[i]);
}

/// (high, low) <- (high, low) * c for n elements (a rescale: c = exp(m_old - m_new)).
template <Real T>
void scale_pairs(T* high, T* low, T c, index_t n) noexcept {
  for (index_t i = 0; i < n; ++i) latte::detail::compensated_scale(high[i], low[i], c);
}

namespace detail {

/// (high, low) <- (high, low) + y over lanes, renormalised: the steps of
/// latte::detail::compensated_add, lane by lane (the same bits).
template <Real T>
inline void compensated_add(simd::batch<T>& high, simd::batch<T>& low, const simd::batch<T>& y) noexcept {
  const simd::batch<T> zero(T(0));
  simd::batch<T> s, e;
  two_sum(high, y, s, e);
  low = simd::select_finite(s, low + e, zero);
  two_sum(s, low, high, e);
  low = simd::select_finite(high, e, zero);
}

/// (high, low) <- (high, low) * c over lanes (a rescale), renormalised: the
/// steps of latte::detail::compensated_scale, lane by lane.
template <Real T>
inline void compensated_scale(simd::batch<T>& high, simd::batch<T>& low, const simd::batch<T>& c) noexcept {
  const simd::batch<T> zero(T(0));
  const simd::batch<T> product = simd::fma(high, c, zero);  // high c rounded once, and its error
  const simd::batch<T> error = simd::fma(high, c, zero - product);
  two_sum(product, simd::select_finite(product, simd::fma(low, c, error), zero), high, low);
  low = simd::select_finite(high, low, zero);
}

}  // namespace detail

/// (high, low) <- (high, low) + terms, renormalised, for n elements.
template <Real T>
void add_to_pairs(T* high, T* low, const T* terms, index_t n) noexcept {
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  index_t i = 0;
  for (; i + W <= n; i += W) {
    B h = simd::load(high + i), l = simd::load(low + i);
    detail::compensated_add(h, l, simd::load(terms + i));
    simd::store(high + i, h);
    simd::store(low + i, l);
  }
  for (; i < n; ++i) latte::detail::compensated_add(high[i], low[i], terms[i]);
}

/// (high, low) <- (high, low) + c x, renormalised, for n elements; each term
/// c x_i rounded once (never contracted into the sum).
template <Real T>
void add_scaled_to_pairs(T* high, T* low, T c, const T* x, index_t n) noexcept {
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  const B scale(c), zero(T(0));
  index_t i = 0;
  for (; i + W <= n; i += W) {
    B h = simd::load(high + i), l = simd::load(low + i);
    detail::compensated_add(h, l, simd::fma(scale, simd::load(x + i), zero));
    simd::store(high + i, h);
    simd::store(low + i, l);
  }
  for (; i < n; ++i) latte::detail::compensated_add(high[i], low[i], latte::detail::rounded_product(c, x[i]));
}

namespace detail {

/// One register block of R vectors of a decode step's pass over the pairs:
/// low_l += w_l v, out = sum_l gamma_l fl(high_l + low_l).
template <Real T, int R>
inline void pairs_update_read_block(const T* high, T* low, index_t Dv, index_t d0, const T* w,
                                    const T* gamma, const T* v, T* out, index_t L) noexcept {
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  B value[R], acc[R];
  simd::unrolled<R>([&](auto r) {
    value[r] = simd::load(v + d0 + r * W);
    acc[r] = B(T(0));
  });
  for (index_t l = 0; l < L; ++l) {
    const T* hi = high + l * Dv + d0;
    T* lo = low + l * Dv + d0;
    const B weight(w[l]), read(gamma[l]);
    simd::unrolled<R>([&](auto r) {
      const B sum_low = simd::fma(weight, value[r], simd::load(lo + r * W));
      simd::store(lo + r * W, sum_low);
      acc[r] = simd::fma(read, simd::load(hi + r * W) + sum_low, acc[r]);
    });
  }
  if (out != nullptr) simd::unrolled<R>([&](auto r) { simd::store(out + d0 + r * W, acc[r]); });
}

}  // namespace detail

/// A decode step's Dv pass over compensated memory: per latent l,
/// (vtilde_l, low_l) <- (vtilde_l, low_l) c_l (exactly, where c_l != 1), low_l
/// += w_l v, and out = sum_l gamma_l fl(vtilde_l + low_l) (when out is not null).
template <Real T>
void pairs_update_and_read(T* memory, T* memory_low, const T* c, const T* w, const T* gamma,
                           const T* v, T* out, index_t L, index_t Dv, bool rescale) noexcept {
  constexpr index_t W = simd::width<T>;
  if (rescale)
    for (index_t l = 0; l < L; ++l)
      if (c[l] != T(1)) scale_pairs(memory + l * Dv, memory_low + l * Dv, c[l], Dv);
  index_t d = 0;
  for (; d + 4 * W <= Dv; d += 4 * W)
    detail::pairs_update_read_block<T, 4>(memory, memory_low, Dv, d, w, gamma, v, out, L);
  for (; d + W <= Dv; d += W)
    detail::pairs_update_read_block<T, 1>(memory, memory_low, Dv, d, w, gamma, v, out, L);
  for (; d < Dv; ++d) {
    T acc = 0;
    for (index_t l = 0; l < L; ++l) {
      T& lo = memory_low[l * Dv + d];
      lo += w[l] * v[d];
      acc += gamma[l] * (memory[l * Dv + d] + lo);
    }
    if (out) out[d] = acc;
  }
}

/// A scaled running sum M <- c_t M + w_t x_t (M: L x Dv, c_t, w_t: L-vectors,
/// x_t a Dv-row; and, optionally, its normaliser a <- c_t a + w_t) whose scan
/// keeps its plain running sums for the reads, compensated as the prefill
/// above: the terms of the tokens since the last fold are kept as rows
/// (append), rescaled as the running sums are, and every fold_tokens tokens
/// one contraction sums them, TwoSum adds that into the pairs, and the running
/// sums restart from the pairs' high parts. The backward's recomputed memory
/// and its reverse adjoint are such sums.
template <Real T>
class ScaledTermWindow {
 public:
  ScaledTermWindow(index_t L, index_t Dv)
      : L_(L), Dv_(Dv), weights_(static_cast<std::size_t>(fold_tokens * L)),
        rows_(static_cast<std::size_t>(fold_tokens * Dv)),
        pending_(static_cast<std::size_t>(L * Dv + L)), high_(pending_.size()),
        low_(pending_.size()), product_(static_cast<std::size_t>(L)) {}

  /// Starts from the running sums as they are (memory [L x Dv], normaliser
  /// [L] or null), which become the pairs' high parts (low parts 0).
  void start(const T* memory, const T* normaliser) noexcept {
    std::copy(memory, memory + L_ * Dv_, high_.data());
    if (normaliser) std::copy(normaliser, normaliser + L_, high_.data() + L_ * Dv_);
    std::fill(low_.begin(), low_.end(), T(0));
    std::fill(pending_.begin(), pending_.end(), T(0));
    std::fill(product_.begin(), product_.end(), T(1));
    count_ = 0;
  }

  /// Appends one token's term: the rescale c [L] the running sums took
  /// before adding it, its weights w [L] and its row x [Dv]. At most
  /// fold_tokens terms between two folds (has_room).
  void append(const T* c, const T* w, const T* x) noexcept {
    for (index_t l = 0; l < L_; ++l) {  // earlier terms, and the pairs (at the fold), scale by c
      if (c[l] == T(1)) continue;
      for (index_t j = 0; j < count_; ++j) weights_[j * L_ + l] *= c[l];
      product_[l] *= c[l];
    }
    append(w, x);
  }

  /// Appends one token's term without a rescale (an unscaled sum M <- M + w x^T).
  void append(const T* w, const T* x) noexcept {
    std::copy(w, w + L_, weights_.data() + count_ * L_);
    std::copy(x, x + Dv_, rows_.data() + count_ * Dv_);
    ++count_;
  }

  /// Whether n more terms fit before the next fold.
  [[nodiscard]] bool has_room(index_t n) const noexcept { return count_ + n <= fold_tokens; }

  /// Adds the window's terms into the pairs and restarts the running sums
  /// (memory, normaliser or null) from them: afterwards they equal fl(high +
  /// low), the compensated sums.
  void fold(T* memory, T* normaliser) noexcept {
    T* const pending_normaliser = pending_.data() + L_ * Dv_;
    T* const high_normaliser = high_.data() + L_ * Dv_;
    T* const low_normaliser = low_.data() + L_ * Dv_;
    for (index_t l = 0; l < L_; ++l) {
      if (product_[l] == T(1)) continue;
      scale_pairs(high_.data() + l * Dv_, low_.data() + l * Dv_, product_[l], Dv_);
      scale_pairs(high_normaliser + l, low_normaliser + l, product_[l], 1);
      product_[l] = T(1);
    }
    accumulate_outer_products(weights_.data(), count_, L_, rows_.data(), pending_.data(), Dv_);
    fold_pending(memory, high_.data(), low_.data(), pending_.data(), L_ * Dv_);
    if (normaliser) {
      for (index_t j = 0; j < count_; ++j)
        for (index_t l = 0; l < L_; ++l) pending_normaliser[l] += weights_[j * L_ + l];
      fold_pending(normaliser, high_normaliser, low_normaliser, pending_normaliser, L_);
    }
    count_ = 0;
  }

 private:
  index_t L_, Dv_, count_ = 0;
  AlignedVector<T> weights_, rows_;          // [fold_tokens][L], [fold_tokens][Dv]
  AlignedVector<T> pending_, high_, low_;    // [L x Dv | L]: the window's sum, the pairs
  AlignedVector<T> product_;                 // [L]: the window's rescales, for the pairs
};

}  // namespace latte::cpu
