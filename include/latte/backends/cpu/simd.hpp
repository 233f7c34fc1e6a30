#pragma once
// SIMD for the CPU backend: xsimd batches of the widest instruction set the
// translation unit is compiled for (build with -march=native, or -mavx512f /
// -mavx2 -mfma, to get wide kernels), and a one-lane scalar stand-in when
// latte is built without xsimd (LATTE_WITH_XSIMD off).
//
// Debian's xsimd is 8.1, which has no reduce_add / reduce_max (they arrived in
// 9.0): the shim below provides both, keyed on XSIMD_VERSION_MAJOR.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>

#include "latte/core/types.hpp"

#if defined(LATTE_WITH_XSIMD)
#include <xsimd/xsimd.hpp>
#endif

namespace latte::cpu::simd {

#if defined(LATTE_WITH_XSIMD)

template <Real T>
using batch = xsimd::batch<T>;

template <Real T>
inline constexpr std::size_t width = batch<T>::size;

template <Real T>
[[nodiscard]] inline batch<T> load(const T* p) noexcept { return batch<T>::load_unaligned(p); }
template <Real T>
inline void store(T* p, const batch<T>& x) noexcept { x.store_unaligned(p); }
template <Real T>
[[nodiscard]] inline batch<T> broadcast(T x) noexcept { return batch<T>(x); }
template <Real T>
[[nodiscard]] inline batch<T> fma(const batch<T>& a, const batch<T>& b, const batch<T>& c) noexcept {
  return xsimd::fma(a, b, c);
}
template <Real T>
[[nodiscard]] inline batch<T> exp(const batch<T>& x) noexcept {
  if constexpr (std::is_same_v<T, double> && XSIMD_VERSION_MAJOR < 9) {
    // xsimd 8 has no AVX2 / AVX-512F double -> int64 conversion and converts
    // lane by lane in its range reduction, which is undefined behaviour for
    // NaN, +-inf and |x| >= 2^63 (we pass -inf for masked latents). exp is
    // exactly 0 below -746 and inf above 710, so bounding x to +-1000 changes
    // no result; NaN lanes are computed on 0 and put back afterwards.
    const auto is_number = x == x;
    const batch<T> bounded =
        xsimd::select(is_number, xsimd::min(xsimd::max(x, batch<T>(-1000.0)), batch<T>(1000.0)),
                      batch<T>(0.0));
    return xsimd::select(is_number, xsimd::exp(bounded), x);
  } else {
    return xsimd::exp(x);
  }
}
template <Real T>
[[nodiscard]] inline batch<T> max(const batch<T>& a, const batch<T>& b) noexcept {
  return xsimd::max(a, b);
}

/// Lanes of `x` where `key` equals `value` take `if_equal`, the others keep `x`.
template <Real T>
[[nodiscard]] inline batch<T> replace_where_equal(const batch<T>& key, T value,
                                                  const batch<T>& if_equal,
                                                  const batch<T>& x) noexcept {
  return xsimd::select(key == batch<T>(value), if_equal, x);
}
/// Whether any lane of a is greater than the same lane of b.
template <Real T>
[[nodiscard]] inline bool any_greater(const batch<T>& a, const batch<T>& b) noexcept {
  return xsimd::any(a > b);
}

template <Real T>
[[nodiscard]] inline T reduce_add(const batch<T>& x) noexcept {
#if XSIMD_VERSION_MAJOR >= 9
  return xsimd::reduce_add(x);
#else
  // xsimd 8's hadd trips GCC 12's -Wmaybe-uninitialized inside its AVX-512
  // shuffles; a store and a short loop is as fast here and warning-free.
  alignas(64) T lanes[width<T>];
  x.store_unaligned(lanes);
  T total = 0;
  for (std::size_t i = 0; i < width<T>; ++i) total += lanes[i];
  return total;
#endif
}

template <Real T>
[[nodiscard]] inline T reduce_max(const batch<T>& x) noexcept {
#if XSIMD_VERSION_MAJOR >= 9
  return xsimd::reduce_max(x);
#else
  alignas(64) T lanes[width<T>];
  x.store_unaligned(lanes);
  return *std::max_element(lanes, lanes + width<T>);
#endif
}

#else  // one-lane scalar stand-in

template <Real T>
struct batch {
  T value;
  batch() = default;
  explicit batch(T x) : value(x) {}
  friend batch operator+(batch a, batch b) { return batch(a.value + b.value); }
  friend batch operator-(batch a, batch b) { return batch(a.value - b.value); }
  friend batch operator*(batch a, batch b) { return batch(a.value * b.value); }
  friend batch operator/(batch a, batch b) { return batch(a.value / b.value); }
};
template <Real T>
inline constexpr std::size_t width = 1;
template <Real T>
[[nodiscard]] inline batch<T> load(const T* p) noexcept { return batch<T>(*p); }
template <Real T>
inline void store(T* p, const batch<T>& x) noexcept { *p = x.value; }
template <Real T>
[[nodiscard]] inline batch<T> broadcast(T x) noexcept { return batch<T>(x); }
template <Real T>
[[nodiscard]] inline batch<T> fma(const batch<T>& a, const batch<T>& b, const batch<T>& c) noexcept {
  return batch<T>(a.value * b.value + c.value);
}
template <Real T>
[[nodiscard]] inline batch<T> exp(const batch<T>& x) noexcept { return batch<T>(std::exp(x.value)); }
template <Real T>
[[nodiscard]] inline batch<T> max(const batch<T>& a, const batch<T>& b) noexcept {
  return batch<T>(std::max(a.value, b.value));
}
template <Real T>
[[nodiscard]] inline batch<T> replace_where_equal(const batch<T>& key, T value,
                                                  const batch<T>& if_equal,
                                                  const batch<T>& x) noexcept {
  return key.value == value ? if_equal : x;
}
template <Real T>
[[nodiscard]] inline bool any_greater(const batch<T>& a, const batch<T>& b) noexcept {
  return a.value > b.value;
}
template <Real T>
[[nodiscard]] inline T reduce_add(const batch<T>& x) noexcept { return x.value; }
template <Real T>
[[nodiscard]] inline T reduce_max(const batch<T>& x) noexcept { return x.value; }

#endif

/// out[i] = exp(x[i] - shift) for i < n (out may be x), one vectorised pass and
/// a scalar tail; returns the sum of the out[i] (the tail's sum plus the lanes').
/// The softmax kernels' shared inner step: every caller sums in this order.
template <Real T>
[[nodiscard]] inline T exp_shifted_sum(const T* x, index_t n, T shift, T* out) noexcept {
  constexpr auto W = static_cast<index_t>(width<T>);
  batch<T> lanes(T(0));
  index_t i = 0;
  for (; i + W <= n; i += W) {
    const batch<T> e = simd::exp(simd::load(x + i) - batch<T>(shift));
    simd::store(out + i, e);
    lanes = lanes + e;
  }
  T total = 0;
  for (; i < n; ++i) {
    out[i] = std::exp(x[i] - shift);
    total += out[i];
  }
  return total + simd::reduce_add(lanes);
}

}  // namespace latte::cpu::simd
