#pragma once
// SIMD for the CPU backend: xsimd batches of the widest instruction set the
// translation unit is compiled for (build with -march=native, or -mavx512f /
// -mavx2 -mfma, to get wide kernels), and a one-lane scalar stand-in when
// latte is built without xsimd (LATTE_WITH_XSIMD 0, core/config.hpp).
//
// Debian's xsimd is 8.1, which has no reduce_add / reduce_max (they arrived in
// 9.0): both are written here (trees in registers for 512-bit batches).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>
#include <utility>

#include "latte/core/config.hpp"
#include "latte/core/types.hpp"

#if LATTE_WITH_XSIMD
#include <xsimd/xsimd.hpp>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#include <bit>
#include <cstdint>
#endif
#endif

/// On a register tile's function: every call inside it is inlined, the
/// lambdas of its unrolled loops included (GCC's inliner otherwise stops at
/// some of them, and what they reference is kept in memory).
#if defined(__GNUC__) || defined(__clang__)
#define LATTE_FLATTEN inline __attribute__((flatten))
#else
#define LATTE_FLATTEN inline
#endif

namespace latte::cpu::simd {

/// Calls f(std::integral_constant<int, K>{}) for K = 0 .. N-1. Register tiles
/// (block_contractions.hpp, the causal Latte passes) set up and store their
/// accumulators through it, indexed by constants: indexed by loop variables,
/// a tile reaches GCC's scalar replacement of aggregates before its loops are
/// unrolled, stays an array on the stack, and is stored and reloaded around
/// every tile (about a tenth of the tiles' time in the bidirectional pass).
/// The tile's function is LATTE_FLATTEN so that these lambdas are inlined.
template <int N, class F>
inline void unrolled(F&& f) {
  [&]<int... K>(std::integer_sequence<int, K...>) {
    (f(std::integral_constant<int, K>{}), ...);
  }(std::make_integer_sequence<int, N>{});
}

#if LATTE_WITH_XSIMD

template <Real T>
using batch = xsimd::batch<T>;

/// Vector registers of the instruction set compiled for (register tiles size themselves by it).
#if defined(__AVX512F__)
inline constexpr int vector_registers = 32;
#else
inline constexpr int vector_registers = 16;
#endif

template <Real T>
inline constexpr std::size_t width = batch<T>::size;

template <Real T>
[[nodiscard]] inline batch<T> load(const T* p) noexcept { return batch<T>::load_unaligned(p); }
template <Real T>
inline void store(T* p, const batch<T>& x) noexcept { x.store_unaligned(p); }
template <Real T>
[[nodiscard]] inline batch<T> broadcast(T x) noexcept { return batch<T>(x); }
/// a b + c with one rounding. xsimd 8 has no AVX-512 fma: its generic one
/// multiplies, then adds, which GCC contracts back into an FMA (its default
/// -ffp-contract=fast) and clang does not (two instructions and two roundings:
/// clang's causal Latte forward ran at 0.85x of GCC's, VAPOR at 0.78x).
template <Real T>
[[nodiscard]] inline batch<T> fma(const batch<T>& a, const batch<T>& b, const batch<T>& c) noexcept {
#if defined(__AVX512F__)
  if constexpr (sizeof(batch<T>) == 64) {
    if constexpr (std::is_same_v<T, float>)
      return batch<T>(_mm512_fmadd_ps(a, b, c));
    else
      return batch<T>(_mm512_fmadd_pd(a, b, c));
  }
#endif
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

namespace detail {
// Without AVX-512, xsimd's exp loses the ends: inf just below the overflow
// threshold and 0 or wrong digits where the result is subnormal (test_numerics on
// an AVX2-only machine). Lanes of x in those two narrow bands get std::exp; the
// others (+-inf and NaN included) keep xsimd's result e.
template <Real T>
[[nodiscard]] inline batch<T> exp_edges(const batch<T>& x, const batch<T>& e) noexcept {
  const T normal = std::log(std::numeric_limits<T>::min()) + T(1);
  const T overflow = std::log(std::numeric_limits<T>::max()) - T(1);
  const T underflow = std::log(std::numeric_limits<T>::denorm_min()) - T(1);
  const auto edge = (x < batch<T>(normal) && x > batch<T>(underflow)) ||
                    (x > batch<T>(overflow) && x < batch<T>(overflow + T(2)));
  if (!xsimd::any(edge)) return e;
  alignas(64) T in[width<T>], out[width<T>];
  x.store_aligned(in);
  e.store_aligned(out);
  for (std::size_t i = 0; i < width<T>; ++i)
    if ((in[i] < normal && in[i] > underflow) || (in[i] > overflow && in[i] < overflow + T(2)))
      out[i] = std::exp(in[i]);
  return batch<T>::load_aligned(out);
}
}  // namespace detail

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
    return detail::exp_edges(x, xsimd::select(is_number, xsimd::exp(bounded), x));
  } else {
    return detail::exp_edges(x, xsimd::exp(x));
  }
}

/// Lane-wise maximum (vmaxps: where a lane of either is NaN, b's lane).
template <Real T>
[[nodiscard]] inline batch<T> max(const batch<T>& a, const batch<T>& b) noexcept {
#if defined(__AVX512F__)
  // The merge-masked form with every lane set: the same instruction, without
  // the undefined pass-through operand of _mm512_max_ps, on which GCC 12's
  // -Wmaybe-uninitialized fires once a loop's first max starts from a constant.
  if constexpr (sizeof(batch<T>) == 64) {
    if constexpr (std::is_same_v<T, float>)
      return batch<T>(_mm512_mask_max_ps(a, static_cast<__mmask16>(0xFFFF), a, b));
    else
      return batch<T>(_mm512_mask_max_pd(a, static_cast<__mmask8>(0xFF), a, b));
  }
#endif
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
  auto held = static_cast<typename batch<T>::register_type>(x);
  asm("" : "+v"(held));
  x = batch<T>(held);
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
/// Per lane: if_finite where key is finite, otherwise `otherwise`.
template <Real T>
[[nodiscard]] inline batch<T> select_finite(const batch<T>& key, const batch<T>& if_finite,
                                            const batch<T>& otherwise) noexcept {
  return xsimd::select(xsimd::isfinite(key), if_finite, otherwise);
}
/// Whether any lane of a is greater than the same lane of b.
template <Real T>
[[nodiscard]] inline bool any_greater(const batch<T>& a, const batch<T>& b) noexcept {
  return xsimd::any(a > b);
}
/// Lane by lane: if_greater where a > b, otherwise `otherwise` (NaN: otherwise).
template <Real T>
[[nodiscard]] inline batch<T> select_greater(const batch<T>& a, const batch<T>& b,
                                             const batch<T>& if_greater,
                                             const batch<T>& otherwise) noexcept {
  return xsimd::select(a > b, if_greater, otherwise);
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
template <Real T>
[[nodiscard]] inline batch<T> from_zmm(const Zmm<T>& v) noexcept {
  return batch<T>::load_unaligned(reinterpret_cast<const T*>(&v));
}

// reduce_zmm of 16 (8) vectors at once, lane j of the result from x[j]: the
// same pairs of lanes combined in the same order (lane i with i^8, i^4, i^2,
// i^1; fp64 from i^4), so each lane has the bits reduce_zmm(x[j]) returns.
// Each level folds two vectors into one, so the whole is 15 (7) shuffle pairs
// and ops instead of 4 (3) dependent steps and an extract per vector.
template <class Op>
[[nodiscard]] inline Float16 reduce_zmm_each(const Float16* x, Op op) noexcept {
  Float16 r[8], z[4], w[2];
  for (int j = 0; j < 8; ++j)  // lanes 0-7: x[j], 8-15: x[j + 8]
    r[j] = op(__builtin_shufflevector(x[j], x[j + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20,
                                      21, 22, 23),
              __builtin_shufflevector(x[j], x[j + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26,
                                      27, 28, 29, 30, 31));
  for (int j = 0; j < 4; ++j)  // 128-bit chunk c: x[j + 4c]
    z[j] = op(__builtin_shufflevector(r[j], r[j + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11,
                                      24, 25, 26, 27),
              __builtin_shufflevector(r[j], r[j + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15,
                                      28, 29, 30, 31));
  for (int j = 0; j < 2; ++j)  // chunk c: lanes 0-1 x[j + 4c], 2-3 x[j + 2 + 4c]
    w[j] = op(__builtin_shufflevector(z[j], z[j + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25,
                                      12, 13, 28, 29),
              __builtin_shufflevector(z[j], z[j + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27,
                                      14, 15, 30, 31));
  return op(__builtin_shufflevector(w[0], w[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28,
                                    14, 30),
            __builtin_shufflevector(w[0], w[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29,
                                    15, 31));
}
template <class Op>
[[nodiscard]] inline Double8 reduce_zmm_each(const Double8* x, Op op) noexcept {
  Double8 r[4], z[2];
  for (int j = 0; j < 4; ++j)  // lanes 0-3: x[j], 4-7: x[j + 4]
    r[j] = op(__builtin_shufflevector(x[j], x[j + 4], 0, 1, 2, 3, 8, 9, 10, 11),
              __builtin_shufflevector(x[j], x[j + 4], 4, 5, 6, 7, 12, 13, 14, 15));
  for (int j = 0; j < 2; ++j)  // lane pair c: x[j + 2c]
    z[j] = op(__builtin_shufflevector(r[j], r[j + 2], 0, 1, 8, 9, 4, 5, 12, 13),
              __builtin_shufflevector(r[j], r[j + 2], 2, 3, 10, 11, 6, 7, 14, 15));
  return op(__builtin_shufflevector(z[0], z[1], 0, 8, 2, 10, 4, 12, 6, 14),
            __builtin_shufflevector(z[0], z[1], 1, 9, 3, 11, 5, 13, 7, 15));
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

/// Lane j of the result is reduce_add(x[j]), bit for bit, for j < width:
/// `width` horizontal sums at once (a transposing tree on 512-bit batches).
template <Real T>
[[nodiscard]] inline batch<T> reduce_add_each(const batch<T>* x) noexcept {
#if defined(LATTE_ZMM_REDUCTIONS)
  if constexpr (width<T> * sizeof(T) == 64) {
    detail::Zmm<T> v[width<T>];
    for (std::size_t j = 0; j < width<T>; ++j) v[j] = detail::to_zmm(x[j]);
    return detail::from_zmm<T>(detail::reduce_zmm_each(v, [](auto a, auto b) { return a + b; }));
  }
#endif
  alignas(64) T lanes[width<T>];
  for (std::size_t j = 0; j < width<T>; ++j) lanes[j] = reduce_add(x[j]);
  return simd::load(static_cast<const T*>(lanes));
}

/// Lane j of the result is reduce_max(x[j]) for j < width.
template <Real T>
[[nodiscard]] inline batch<T> reduce_max_each(const batch<T>* x) noexcept {
#if defined(LATTE_ZMM_REDUCTIONS)
  if constexpr (width<T> * sizeof(T) == 64) {
    detail::Zmm<T> v[width<T>];
    for (std::size_t j = 0; j < width<T>; ++j) v[j] = detail::to_zmm(x[j]);
    return detail::from_zmm<T>(
        detail::reduce_zmm_each(v, [](auto a, auto b) { return a > b ? a : b; }));
  }
#endif
  alignas(64) T lanes[width<T>];
  for (std::size_t j = 0; j < width<T>; ++j) lanes[j] = reduce_max(x[j]);
  return simd::load(static_cast<const T*>(lanes));
}

/// (x1, x0, x3, x2, ...): the two lanes of every pair exchanged (the partner
/// coordinate of each 2-D rotation, rotation.hpp). One in-lane permute on
/// 512-bit batches; other widths go through the stored lanes.
template <Real T>
[[nodiscard]] inline batch<T> swap_pairs(const batch<T>& x) noexcept {
#if defined(LATTE_ZMM_REDUCTIONS)
  if constexpr (std::is_same_v<T, float> && width<T> == 16) {
    const detail::Float16 v = detail::to_zmm(x);
    return detail::from_zmm<T>(
        __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  } else if constexpr (std::is_same_v<T, double> && width<T> == 8) {
    const detail::Double8 v = detail::to_zmm(x);
    return detail::from_zmm<T>(__builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
  }
#endif
  alignas(64) T lanes[width<T>];
  x.store_unaligned(lanes);
  for (std::size_t i = 0; i + 1 < width<T>; i += 2) std::swap(lanes[i], lanes[i + 1]);
  return simd::load(static_cast<const T*>(lanes));
}

/// The first n lanes (0 <= n <= width) of the vector at p, the others `fill`;
/// reads nothing at or past p + n. The kernels' vector tails: a row whose
/// length is not a multiple of the width (L = 63, Dv = 65) takes its last
/// vector through these instead of a scalar loop (one masked instruction on
/// AVX-512 and on AVX2, masked lanes never touch memory, so no fault).
template <Real T>
[[nodiscard]] inline batch<T> load_first(const T* p, index_t n, T fill) noexcept {
#if defined(__AVX512F__)
  if constexpr (sizeof(batch<T>) == 64) {
    if constexpr (std::is_same_v<T, float>)
      return batch<T>(_mm512_mask_loadu_ps(_mm512_set1_ps(fill),
                                           static_cast<__mmask16>((1u << n) - 1u), p));
    else
      return batch<T>(_mm512_mask_loadu_pd(_mm512_set1_pd(fill),
                                           static_cast<__mmask8>((1u << n) - 1u), p));
  }
#endif
#if defined(__AVX2__)
  if constexpr (sizeof(batch<T>) == 32) {
    if constexpr (std::is_same_v<T, float>) {
      const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      return batch<T>(_mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, mask),
                                       _mm256_castsi256_ps(mask)));
    } else {
      const __m256i mask =
          _mm256_cmpgt_epi64(_mm256_set1_epi64x(n), _mm256_setr_epi64x(0, 1, 2, 3));
      return batch<T>(_mm256_blendv_pd(_mm256_set1_pd(fill), _mm256_maskload_pd(p, mask),
                                       _mm256_castsi256_pd(mask)));
    }
  }
#endif
  alignas(64) T lanes[width<T>];
  for (index_t i = 0; i < static_cast<index_t>(width<T>); ++i) lanes[i] = i < n ? p[i] : fill;
  return batch<T>::load_aligned(lanes);
}

/// Stores the first n lanes (0 <= n <= width) of x at p; writes nothing at or past p + n.
template <Real T>
inline void store_first(T* p, const batch<T>& x, index_t n) noexcept {
#if defined(__AVX512F__)
  if constexpr (sizeof(batch<T>) == 64) {
    if constexpr (std::is_same_v<T, float>)
      _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1u), x);
    else
      _mm512_mask_storeu_pd(p, static_cast<__mmask8>((1u << n) - 1u), x);
    return;
  }
#endif
#if defined(__AVX2__)
  if constexpr (sizeof(batch<T>) == 32) {
    if constexpr (std::is_same_v<T, float>)
      _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                          x);
    else
      _mm256_maskstore_pd(
          p, _mm256_cmpgt_epi64(_mm256_set1_epi64x(n), _mm256_setr_epi64x(0, 1, 2, 3)), x);
    return;
  }
#endif
  alignas(64) T lanes[width<T>];
  x.store_aligned(lanes);
  for (index_t i = 0; i < n; ++i) p[i] = lanes[i];
}

#else  // one-lane scalar stand-in

inline constexpr int vector_registers = 16;

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
[[nodiscard]] inline batch<T> select_finite(const batch<T>& key, const batch<T>& if_finite,
                                            const batch<T>& otherwise) noexcept {
  return std::isfinite(key.value) ? if_finite : otherwise;
}
template <Real T>
[[nodiscard]] inline bool any_greater(const batch<T>& a, const batch<T>& b) noexcept {
  return a.value > b.value;
}
template <Real T>
[[nodiscard]] inline batch<T> select_greater(const batch<T>& a, const batch<T>& b,
                                             const batch<T>& if_greater,
                                             const batch<T>& otherwise) noexcept {
  return a.value > b.value ? if_greater : otherwise;
}
template <Real T>
[[nodiscard]] inline T reduce_add(const batch<T>& x) noexcept { return x.value; }
template <Real T>
[[nodiscard]] inline T reduce_max(const batch<T>& x) noexcept { return x.value; }
template <Real T>
[[nodiscard]] inline batch<T> reduce_add_each(const batch<T>* x) noexcept { return x[0]; }
template <Real T>
[[nodiscard]] inline batch<T> reduce_max_each(const batch<T>* x) noexcept { return x[0]; }
template <Real T>
[[nodiscard]] inline batch<T> load_first(const T* p, index_t n, T fill) noexcept {
  return batch<T>(n > 0 ? *p : fill);
}
template <Real T>
inline void store_first(T* p, const batch<T>& x, index_t n) noexcept {
  if (n > 0) *p = x.value;
}
/// One lane holds no pair: callers take a scalar path when width < 2.
template <Real T>
[[nodiscard]] inline batch<T> swap_pairs(const batch<T>&) noexcept {
  static_assert(sizeof(T) == 0, "swap_pairs needs batches of two lanes or more");
  return {};
}

#endif

/// A whole vector at p (Tail false) or its first `count` lanes, the others
/// `fill` (Tail true, load_first): the last vector of a row whose length is
/// not a multiple of the width, with the tail chosen at compile time so that
/// whole vectors keep plain loads.
template <bool Tail, Real T>
[[nodiscard]] inline batch<T> load_lanes(const T* p, index_t count, T fill = T(0)) noexcept {
  if constexpr (Tail)
    return load_first(p, count, fill);
  else
    return simd::load(p);
}
template <bool Tail, Real T>
inline void store_lanes(T* p, const batch<T>& x, index_t count) noexcept {
  if constexpr (Tail)
    store_first(p, x, count);
  else
    simd::store(p, x);
}

/// Calls f(i, count, std::bool_constant<Tail>) for the vectors of [0, n): the
/// whole ones (count = width, Tail false), then the partial last one if any
/// (count = n - i < width, Tail true). f loads and stores with
/// load_lanes<Tail> / store_lanes<Tail>.
template <Real T, class F>
inline void for_each_vector(index_t n, F&& f) {
  constexpr auto W = static_cast<index_t>(width<T>);
  index_t i = 0;
  for (; i + W <= n; i += W) f(i, W, std::false_type{});
  if (i < n) f(i, n - i, std::true_type{});
}

/// Calls f(i, last, std::integral_constant<int, V>, std::bool_constant<Tail>) over
/// [0, n) in groups of G vectors (register tiles of G vectors across a row): the
/// whole groups (V = G, Tail false, last = width), then one group of V =
/// ceil(rest / width) vectors whose last holds `last` lanes (Tail true). A row
/// of 32 floats on AVX-512 is one group of 2 vectors, not two of 1; 65 floats
/// end in a group of one vector of one lane.
template <Real T, int G, class F>
inline void for_each_vector_group(index_t n, F&& f) {
  constexpr auto W = static_cast<index_t>(width<T>);
  index_t i = 0;
  for (; i + G * W <= n; i += G * W) f(i, W, std::integral_constant<int, G>{}, std::false_type{});
  const index_t rest = n - i;
  if (rest == 0) return;
  const index_t last = rest - (rest - 1) / W * W;  // 1 .. W
  [&]<int... V>(std::integer_sequence<int, V...>) {
    ((rest > V * W && rest <= (V + 1) * W
          ? f(i, last, std::integral_constant<int, V + 1>{}, std::true_type{})
          : void()),
     ...);
  }(std::make_integer_sequence<int, G>{});
}

/// The vectorised part of max_of: lane-wise maxima of x[0, n) (lanes past a
/// partial last vector count as -inf), n >= 1.
template <Real T>
[[nodiscard]] inline batch<T> max_lanes(const T* x, index_t n) noexcept {
  batch<T> running(-std::numeric_limits<T>::infinity());
  for_each_vector<T>(n, [&](index_t i, index_t count, auto tail) {
    running = simd::max(running,
                        load_lanes<tail.value>(x + i, count, -std::numeric_limits<T>::infinity()));
  });
  return running;
}

/// max_i x[i] for i < n (-inf when n = 0).
template <Real T>
[[nodiscard]] inline T max_of(const T* x, index_t n) noexcept {
  if (n == 0) return -std::numeric_limits<T>::infinity();
  return simd::reduce_max(max_lanes(x, n));
}

/// The vectorised part of exp_shifted_sum: out[i] = exp(x[i] - shift) over
/// [0, n) (out may be x); returns their lane-wise sums (lanes past a partial
/// last vector add 0).
template <Real T>
[[nodiscard]] inline batch<T> exp_shifted_lanes(const T* x, index_t n, T shift, T* out) noexcept {
  batch<T> lanes(T(0));
  for_each_vector<T>(n, [&](index_t i, index_t count, auto tail) {
    // Lanes past the row are exp(-inf) = 0.
    constexpr T lowest = -std::numeric_limits<T>::infinity();
    const batch<T> e = simd::exp(load_lanes<tail.value>(x + i, count, lowest) - batch<T>(shift));
    store_lanes<tail.value>(out + i, e, count);
    lanes = lanes + e;
  });
  return lanes;
}

/// out[i] = exp(x[i] - shift) for i < n (out may be x); returns the sum of the
/// out[i], the lanes' sums reduced. The softmax kernels' shared inner step:
/// every caller sums in this order.
template <Real T>
[[nodiscard]] inline T exp_shifted_sum(const T* x, index_t n, T shift, T* out) noexcept {
  return simd::reduce_add(exp_shifted_lanes(x, n, shift, out));
}

/// to[i] = from[i] for i < n: whole vectors, then a partial one (std::copy
/// with a length known only at run time is a call to memmove).
template <Real T>
inline void copy(const T* from, index_t n, T* to) noexcept {
  for_each_vector<T>(n, [&](index_t i, index_t count, auto tail) {
    store_lanes<tail.value>(to + i, load_lanes<tail.value>(from + i, count), count);
  });
}

}  // namespace latte::cpu::simd
