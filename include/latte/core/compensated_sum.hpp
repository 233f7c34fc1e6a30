#pragma once
// Compensated running sums: a sum kept as an unevaluated pair hi + lo, where
// hi = fl(hi + lo) is the sum rounded to T and lo the part rounding dropped.
//
// A causal state that sums over the whole past (Latte's alpha and vtilde, the
// linear family's S and z) adds each new token's small term to an ever larger
// sum; in plain fp32 the low bits of every term are rounded away, and the
// error grows linearly with the context (docs/numerics.md, "Long contexts").
// A pair keeps what the additions round away in lo (Knuth's TwoSum), so that
// hi + lo stays the sum to within a few roundings however many terms it holds.
// The value of a pair is always hi + lo; lo may also hold terms not yet added
// into hi (a decode step adds its term to lo alone and renormalises every so
// many steps, compensated_sums.hpp), so readers read fl(hi + lo), or
// renormalise first.
//
// Products that feed a TwoSum are formed as fma(a, b, 0), the product rounded
// once: a compiler contracting a * b + c into an fma (GCC's default outside
// ISO mode) would otherwise add the exact product in one place and the
// rounded one in another, and the error term would no longer be the error.
#include <cmath>

#include "latte/core/types.hpp"

namespace latte::detail {

/// a * b rounded once, never contracted into a following addition.
template <Real T>
[[nodiscard]] inline T rounded_product(T a, T b) noexcept {
#if defined(__FMA__) || defined(__aarch64__)
  return std::fma(a, b, T(0));  // an instruction: the product, rounded once
#else
  return a * b;  // no FMA instruction: nothing to contract into (std::fma would be a libm call)
#endif
}

/// s + e = a + b exactly, s = fl(a + b) (Knuth's TwoSum; no condition on |a|, |b|).
template <Real T>
inline void two_sum(T a, T b, T& s, T& e) noexcept {
  s = a + b;
  const T bb = s - a;
  e = (a - (s - bb)) + (b - bb);
}

/// (hi, lo) <- the same sum with hi = fl(hi + lo). A sum that is no longer
/// finite keeps hi = fl(hi + lo) (inf or NaN, as a plain sum would) and lo = 0.
template <Real T>
inline void renormalise(T& hi, T& lo) noexcept {
  T s, e;
  two_sum(hi, lo, s, e);
  hi = s;
  lo = std::isfinite(s) ? e : T(0);
}

/// (hi, lo) <- (hi, lo) + y, renormalised.
template <Real T>
inline void compensated_add(T& hi, T& lo, T y) noexcept {
  T s, e;
  two_sum(hi, y, s, e);
  hi = s;
  lo = std::isfinite(s) ? lo + e : T(0);
  renormalise(hi, lo);
}

/// (hi, lo) <- (hi, lo) * c (a rescale by exp(m_old - m_new) <= 1): hi * c
/// split exactly into its rounded value and its error (fma), lo scaled.
template <Real T>
inline void compensated_scale(T& hi, T& lo, T c) noexcept {
  const T p = rounded_product(hi, c);
  const T error = std::fma(hi, c, -p);
  hi = p;
  lo = std::isfinite(p) ? lo * c + error : T(0);
  renormalise(hi, lo);
}

}  // namespace latte::detail
