#pragma once
// Rows of 16-bit activations to fp32 and back on the CPU: widening is exact,
// narrowing rounds to nearest, ties to even, bit for bit what the scalar
// conversions of core/half_float.hpp give (NaN, inf, subnormals included).
// bfloat16 uses AVX-512 or AVX2 integer lanes (a widen is a 16-bit shift; a
// narrow adds 0x7fff plus the kept lowest bit); float16 uses F16C's vcvtph2ps / vcvtps2ph.
// Without them, the scalar conversions. (AVX-512 BF16's vcvtneps2bf16 is not
// used: it flushes subnormal inputs to zero, which the scalar path does not.)
//
// widen / narrow move whole [.., rows, width] views between a strided 16-bit
// view and a contiguous fp32 buffer, rows split over the threads.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>

#include "latte/backends/cpu/parallel.hpp"
#include "latte/core/half_float.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"

#if defined(__AVX2__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace latte::cpu {

/// dst[i] = float(src[i]) for i < n (exact).
template <HalfFloat H>
void widen_row(const H* src, float* dst, index_t n) noexcept {
  using Plain = std::remove_const_t<H>;
  index_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<Plain, bfloat16>)
    for (; i + 16 <= n; i += 16) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
      _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
    }
#endif
#if defined(__AVX2__)
  if constexpr (std::is_same_v<Plain, bfloat16>)
    for (; i + 8 <= n; i += 8) {
      const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16);
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(wide));
    }
#endif
#if defined(__F16C__)
  if constexpr (std::is_same_v<Plain, float16>)
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

/// dst[i] = H(src[i]) for i < n, rounded to nearest even.
template <HalfFloat H>
void narrow_row(const float* src, H* dst, index_t n) noexcept {
  index_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<H, bfloat16>) {  // as the AVX2 lanes below, 16 at a time
    const __m512i rounding = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1),
                  quiet = _mm512_set1_epi32(0x00400000);
    for (; i + 16 <= n; i += 16) {
      const __m512 value = _mm512_loadu_ps(src + i);
      const __m512i x = _mm512_castps_si512(value);
      const __m512i kept_lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), one);
      const __m512i rounded = _mm512_add_epi32(x, _mm512_add_epi32(rounding, kept_lsb));
      const __mmask16 nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
      const __m512i bits = _mm512_srli_epi32(_mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(x, quiet)), 16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(bits));
    }
  }
#endif
#if defined(__AVX2__)
  if constexpr (std::is_same_v<H, bfloat16>) {
    const __m256i rounding = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1),
                  quiet = _mm256_set1_epi32(0x00400000);
    for (; i + 8 <= n; i += 8) {
      const __m256 value = _mm256_loadu_ps(src + i);
      const __m256i x = _mm256_castps_si256(value);
      const __m256i kept_lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), one);
      const __m256i rounded = _mm256_add_epi32(x, _mm256_add_epi32(rounding, kept_lsb));
      const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(value, value, _CMP_UNORD_Q));
      const __m256i bits = _mm256_srli_epi32(
          _mm256_blendv_epi8(rounded, _mm256_or_si256(x, quiet), nan), 16);
      // 32 -> 16 bits: packus works per 128-bit lane; the permute joins the lanes' halves.
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0b1000);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_castsi256_si128(packed));
    }
  }
#endif
#if defined(__F16C__)
  if constexpr (std::is_same_v<H, float16>)
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < n; ++i) dst[i] = H(src[i]);
}

namespace detail {

/// Calls body(row_offset_in_view, row_index) for every row of a view's
/// leading N - 1 dimensions (rows numbered in row-major order).
template <class T, std::size_t N, class Body>
void for_each_row(const TensorView<T, N>& view, index_t rows, int workers, Body&& body) {
  parallel_for(rows, workers, [&](index_t r, int) {
    index_t rest = r, offset = 0;
    for (std::size_t d = N - 1; d-- > 0;) {
      const index_t extent = view.extent(d);
      offset += (rest % extent) * view.stride(d);
      rest /= extent;
    }
    body(offset, r);
  });
}

template <class T, std::size_t N>
index_t row_count(const TensorView<T, N>& view) {
  index_t rows = 1;
  for (std::size_t d = 0; d + 1 < N; ++d) rows *= view.extent(d);
  return rows;
}

/// Threads pay off past ~2^16 elements.
inline int conversion_workers(index_t elements) noexcept {
  return elements >= (index_t{1} << 16) ? thread_count() : 1;
}

}  // namespace detail

/// Widens every element of `src` (any strides, last dimension contiguous)
/// into the row-major buffer `dst` of src.size() floats.
template <HalfFloat H, std::size_t N>
void widen(const TensorView<const H, N>& src, float* dst) {
  if (src.empty()) return;
  const index_t width = src.extent(N - 1), rows = detail::row_count(src);
  detail::for_each_row(src, rows, detail::conversion_workers(rows * width),
                       [&](index_t offset, index_t r) { widen_row(src.data() + offset, dst + r * width, width); });
}

/// Rounds the row-major buffer `src` of dst.size() floats into `dst`.
template <HalfFloat H, std::size_t N>
void narrow(const float* src, const TensorView<H, N>& dst) {
  if (dst.empty()) return;
  const index_t width = dst.extent(N - 1), rows = detail::row_count(dst);
  detail::for_each_row(dst, rows, detail::conversion_workers(rows * width),
                       [&](index_t offset, index_t r) { narrow_row(src + r * width, dst.data() + offset, width); });
}

}  // namespace latte::cpu
