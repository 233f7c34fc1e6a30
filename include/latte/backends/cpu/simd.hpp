#pragma once
// SIMD for the CPU backend: xsimd batches of the widest instruction set the
// translation unit is compiled for (build with -march=native, or -mavx512f /
// -mavx2 -mfma, to get wide kernels), and a one-lane scalar stand-in when
// latte is built without xsimd (LATTE_WITH_XSIMD off).
//
// Debian's xsimd is 8.1, which has no reduce_add / reduce_max (they arrived in
// 9.0): both are written here (trees in registers for 512-bit batches).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>

#include "latte/core/types.hpp"

#if defined(LATTE_WITH_XSIMD)
#include <xsimd/xsimd.hpp>
#if defined(__AVX512F__)
#include <immintrin.h>

#include <bit>
#include <cstdint>
#endif
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
#if defined(__AVX512F__)
namespace detail {
/// exp of 16 floats with xsimd's own range reduction and polynomial (k =
/// rint(x / ln 2), r = x - k ln 2 with ln 2 in two parts, e^r = 1 + r + r^2
/// P(r) of degree 4): wherever xsimd's result is a normal float this one is
/// the same bits (checked over every float in [-110, 110]). Only the last step
/// differs: e^r 2^k is one vscalefps, where xsimd adds k to the exponent field
/// with integer instructions and then patches the ends of the range with two
/// compares and two blends (14 vector instructions here, 19 there). The ends
/// come out right: e^x is finite up to 88.72 (xsimd 8 says inf from 88.38) and
/// subnormal below 2^-126 (xsimd flushes to 0). Clamping x to [-104, 89]
/// first sends -inf to 0, +inf to inf and keeps NaN (max/min return their
/// second operand when one is NaN).
[[nodiscard]] inline __m512 exp_avx512(__m512 x) noexcept {
  auto constant = [](std::uint32_t bits) { return _mm512_set1_ps(std::bit_cast<float>(bits)); };
  // The masked forms with every lane selected: GCC 12's unmasked min, max,
  // roundscale and scalef pass an uninitialised source that -Wuninitialized
  // reports in the caller's code.
  constexpr __mmask16 all = 0xffff;
  x = _mm512_mask_max_ps(x, all, _mm512_set1_ps(-104.0f), x);
  x = _mm512_mask_min_ps(x, all, _mm512_set1_ps(89.0f), x);
  const __m512 k =
      _mm512_mask_roundscale_ps(x, all, _mm512_mul_ps(x, _mm512_set1_ps(1.442695040888963407f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, constant(0x3f318000u), x);  // ln 2, high part
  r = _mm512_fnmadd_ps(k, constant(0xb95e8083u), r);         // ln 2, low part
  __m512 p = _mm512_fmadd_ps(r, constant(0x3ab778cfu), constant(0x3c098d8bu));
  p = _mm512_fmadd_ps(r, p, constant(0x3d2aa957u));
  p = _mm512_fmadd_ps(r, p, constant(0x3e2aa9a5u));
  p = _mm512_fmadd_ps(r, p, constant(0x3f000000u));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return _mm512_mask_scalef_ps(p, all, p, k);
}

/// exp of 8 doubles the same way: xsimd's reduction and rational form
/// (r = hi - lo, c = r - r^2 P(r^2), e^r = 1 - ((lo - r c / (2 - c)) - hi)),
/// scaled by 2^k with one vscalefpd. x is clamped to [-746, 710], past which
/// e^x is 0 and inf; the clamp also spares xsimd 8's lane-by-lane conversion
/// of NaN and inf to int64, which is undefined behaviour.
[[nodiscard]] inline __m512d exp_avx512(__m512d x) noexcept {
  auto constant = [](std::uint64_t bits) { return _mm512_set1_pd(std::bit_cast<double>(bits)); };
  constexpr __mmask8 all = 0xff;
  x = _mm512_mask_max_pd(x, all, _mm512_set1_pd(-746.0), x);
  x = _mm512_mask_min_pd(x, all, _mm512_set1_pd(710.0), x);
  const __m512d k =
      _mm512_mask_roundscale_pd(x, all, _mm512_mul_pd(x, _mm512_set1_pd(1.442695040888963407359924681)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512d hi = _mm512_fnmadd_pd(k, constant(0x3fe62e42fee00000u), x);  // ln 2, high part
  const __m512d lo = _mm512_mul_pd(k, constant(0x3dea39ef35793c76u));        // ln 2, low part
  const __m512d r = _mm512_sub_pd(hi, lo), t = _mm512_mul_pd(r, r);
  __m512d p = _mm512_fmadd_pd(t, constant(0x3e66376972bea4d0u), constant(0xbebbbd41c5d26bf1u));
  p = _mm512_fmadd_pd(t, p, constant(0x3f11566aaf25de2cu));
  p = _mm512_fmadd_pd(t, p, constant(0xbf66c16c16bebd93u));
  p = _mm512_fmadd_pd(t, p, constant(0x3fc555555555553eu));
  const __m512d c = _mm512_fnmadd_pd(t, p, r);
  const __m512d ratio = _mm512_div_pd(_mm512_mul_pd(r, c), _mm512_sub_pd(_mm512_set1_pd(2.0), c));
  const __m512d e =
      _mm512_sub_pd(_mm512_set1_pd(1.0), _mm512_sub_pd(_mm512_sub_pd(lo, ratio), hi));
  return _mm512_mask_scalef_pd(e, all, e, k);
}
}  // namespace detail
#endif

template <Real T>
[[nodiscard]] inline batch<T> exp(const batch<T>& x) noexcept {
#if defined(__AVX512F__)
  if constexpr (width<T> * sizeof(T) == 64) return batch<T>(detail::exp_avx512(x.data));
#endif
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

/// Keeps `x` in a register: with enough registers free, GCC still folds a
/// vector loaded once for several FMAs into each of them as a memory operand
/// (one load per FMA instead of one in all), which makes the register tiles of
/// block_contractions.hpp wait on loads. An empty asm that takes and returns
/// the register stops that and emits nothing.
template <Real T>
inline void hold_in_register(batch<T>& x) noexcept {
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
  asm("" : "+v"(x.data));
#else
  (void)x;
#endif
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

// Horizontal reductions as halving trees (log2(width) dependent steps, no
// branches): they sit on the per-token chain of the scans' softmax stages.
// xsimd 8 has no reduce_add / reduce_max, and its hadd trips GCC 12's
// -Wmaybe-uninitialized inside its AVX-512 shuffles, so 512-bit batches use
// the register trees below and other widths a tree over the stored lanes.
namespace detail {
template <Real T, class Op>
[[nodiscard]] inline T reduce_lanes(const batch<T>& x, Op op) noexcept {
  alignas(64) T lanes[width<T>];
  x.store_unaligned(lanes);
  for (std::size_t half = width<T> / 2; half > 0; half /= 2)
    for (std::size_t i = 0; i < half; ++i) lanes[i] = op(lanes[i], lanes[i + half]);
  return lanes[0];
}
}  // namespace detail

#if defined(__AVX512F__) && defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define LATTE_ZMM_REDUCTIONS 1
#endif
#endif

#if defined(LATTE_ZMM_REDUCTIONS)
namespace detail {
// Reductions of a 512-bit batch in registers: log2(width) steps, each
// combining the vector with a permutation of itself (GCC / Clang vector
// extensions: GCC 12's AVX-512 shuffle intrinsics trip -Wuninitialized in
// user code). Measured on the Latte read weights (L = 64, AVX-512, one
// token at a time): about 180 -> 130 cycles per token against a store and a
// scalar loop over the lanes.
using Float16 = float __attribute__((vector_size(64)));
using Double8 = double __attribute__((vector_size(64)));

template <class Op>
[[nodiscard]] inline float reduce_zmm(Float16 v, Op op) noexcept {
  v = op(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = op(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = op(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}
template <class Op>
[[nodiscard]] inline double reduce_zmm(Double8 v, Op op) noexcept {
  v = op(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
  v = op(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
  v = op(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
  return v[0];
}
template <Real T>
using Zmm = std::conditional_t<std::is_same_v<T, float>, Float16, Double8>;
template <Real T>
[[nodiscard]] inline Zmm<T> to_zmm(const batch<T>& x) noexcept {
  Zmm<T> v;
  x.store_unaligned(reinterpret_cast<T*>(&v));  // a register move once compiled
  return v;
}
}  // namespace detail
#endif

/// Sum of the lanes.
template <Real T>
[[nodiscard]] inline T reduce_add(const batch<T>& x) noexcept {
#if defined(LATTE_ZMM_REDUCTIONS)
  if constexpr (width<T> * sizeof(T) == 64)
    return detail::reduce_zmm(detail::to_zmm(x), [](auto a, auto b) { return a + b; });
#endif
  return detail::reduce_lanes(x, [](T a, T b) { return a + b; });
}

/// Largest lane. Which lane wins when one is NaN is unspecified: callers that
/// must propagate NaN do so through the values they shift, not this maximum.
template <Real T>
[[nodiscard]] inline T reduce_max(const batch<T>& x) noexcept {
#if defined(LATTE_ZMM_REDUCTIONS)
  if constexpr (width<T> * sizeof(T) == 64)
    return detail::reduce_zmm(detail::to_zmm(x), [](auto a, auto b) { return a > b ? a : b; });
#endif
  return detail::reduce_lanes(x, [](T a, T b) { return std::max(a, b); });
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
inline void hold_in_register(batch<T>&) noexcept {}
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

/// max_i x[i] for i < n (-inf when n = 0): one vectorised pass and a scalar tail.
template <Real T>
[[nodiscard]] inline T max_of(const T* x, index_t n) noexcept {
  constexpr auto W = static_cast<index_t>(width<T>);
  T result = -std::numeric_limits<T>::infinity();
  index_t i = 0;
  if (n >= W) {
    batch<T> running = simd::load(x);
    for (i = W; i + W <= n; i += W) running = simd::max(running, simd::load(x + i));
    result = simd::reduce_max(running);
  }
  for (; i < n; ++i) result = std::max(result, x[i]);
  return result;
}

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
