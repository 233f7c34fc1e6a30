#pragma once
// bf16 dot products for the bidirectional Latte pass under latte::Bf16Products
// (policies/bf16_products.hpp): both operands of each contraction of paper 000
// eq. 7 rounded to bf16, every product exact in fp32, every sum in fp32.
//
// AVX-512 BF16's vdpbf16ps adds a pair of bf16 products to each fp32 lane:
// acc[j] += a[2j] b[2j] + a[2j + 1] b[2j + 1]. So both contractions take
// their operands as pairs along the summed index:
//
//   accumulate_pair_outer_products:  M[l][d] += sum_p <e_pairs[p][l], v_pairs[p][d]>
//     (M += E^T V; pair p holds tokens 2p and 2p + 1, built by pack_row_pairs)
//   read_pair_memory_rows:           o[s][d]  = sum_i <g_pairs[s][i], m_pairs[i][d]>
//     (O = G M; pair i holds latents 2i and 2i + 1: a row of G rounded to bf16
//      is already its pairs, round_row_to_pairs)
//
// with the register tile of block_contractions.hpp (4 rows x 4 vectors of
// accumulators, each step 4 vector loads and 4 broadcasts of a pair): one
// instruction does 32 multiply-adds where an fp32 FMA does 16. One core of
// this machine (AMD EPYC, Zen 4): 109 G multiply-adds/s against 44.7 for the
// fp32 tile (L = Dv = 64, 64 tokens).
//
// Rounding is to nearest even (vcvtne2ps2bf16); like vdpbf16ps it reads
// subnormal inputs as zero and flushes subnormal results to zero, whatever
// MXCSR says: an absolute error below 2^-126 per term, in the bound of
// docs/numerics.md ("bf16 products"). An operand past the pairs' end (odd
// token or latent counts) is zero.
//
// Only where the compiler targets AVX-512 BF16, BW and VL (bf16_products_available);
// elsewhere Bf16Products runs the exact kernels, which meet the tighter bound.
#include <bit>
#include <cstdint>

#include "latte/backends/cpu/simd.hpp"
#include "latte/core/half_float.hpp"
#include "latte/core/types.hpp"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define LATTE_BF16_PRODUCTS 1
#else
#define LATTE_BF16_PRODUCTS 0
#endif

namespace latte::cpu {

/// Whether this translation unit runs Bf16Products' kernels (AVX-512 BF16, BW, VL).
inline constexpr bool bf16_products_available = LATTE_BF16_PRODUCTS == 1;

#if LATTE_BF16_PRODUCTS

namespace detail {

/// Lanes [0, n) set, n <= 16.
inline __mmask16 first_lanes(index_t n) noexcept {
  return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
}

/// fp32 lanes of the two bf16 halves of each 32-bit pair.
inline __m512 low_halves(__m512i pairs) noexcept {
  return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
}
inline __m512 high_halves(__m512i pairs) noexcept {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(int(0xffff0000u))));
}

/// acc[i][c] += sum_{s < steps} <a[i * a_row + s * a_step], b[s * b_step + c * 16 ..]>,
/// a a 32-bit pair, b sixteen pairs per vector (b_step counts pairs).
template <int R, int CV>
LATTE_FLATTEN void dp_tile(__m512 (&acc)[R][CV], const std::uint32_t* a, index_t a_row, index_t a_step,
                    const std::uint32_t* b, index_t b_step, index_t steps) noexcept {
  for (index_t s = 0; s < steps; ++s) {
    __m512bh vector[CV];
    simd::unrolled<CV>([&](auto c) {  // constant indices, as fma_tile
      vector[c] = (__m512bh)_mm512_loadu_si512(b + s * b_step + c * 16);
    });
    simd::unrolled<R>([&](auto i) {
      const __m512bh pair = (__m512bh)_mm512_set1_epi32(int(a[i * a_row + s * a_step]));
      simd::unrolled<CV>([&](auto c) { acc[i][c] = _mm512_dpbf16_ps(acc[i][c], pair, vector[c]); });
    });
  }
}

/// The scalar definition, for the columns past the last whole vector.
inline float dp_scalar(float acc, std::uint32_t a, std::uint32_t b) noexcept {
  auto low = [](std::uint32_t x) { return std::bit_cast<float>(x << 16); };
  auto high = [](std::uint32_t x) { return std::bit_cast<float>(x & 0xffff0000u); };
  return low(a) * low(b) + (high(a) * high(b) + acc);
}

/// M[l0 + i][d0 + 16 c ..] += sum_p <e[p][l0 + i], v[p][d0 + 16 c ..]>, i < R, c < CV.
template <int R, int CV>
LATTE_FLATTEN void pair_outer_products_tile(const std::uint32_t* e, index_t pairs, index_t L,
                                     const std::uint32_t* v, index_t Dv, float* memory,
                                     index_t l0, index_t d0) noexcept {
  __m512 acc[R][CV];
  float* tile = memory + l0 * Dv + d0;
  simd::unrolled<R * CV>([&](auto k) {
    acc[k / CV][k % CV] = _mm512_loadu_ps(tile + (k / CV) * Dv + (k % CV) * 16);
  });
  dp_tile<R, CV>(acc, e + l0, /*a_row=*/1, /*a_step=*/L, v + d0, /*b_step=*/Dv, pairs);
  simd::unrolled<R * CV>([&](auto k) {
    _mm512_storeu_ps(tile + (k / CV) * Dv + (k % CV) * 16, acc[k / CV][k % CV]);
  });
}

/// o[s0 + r][d0 + 16 c ..] = sum_i <g[s0 + r][i], m[i][d0 + 16 c ..]>, r < R, c < CV.
template <int R, int CV>
LATTE_FLATTEN void pair_read_tile(const std::uint32_t* g, index_t latent_pairs, const std::uint32_t* m,
                           index_t Dv, float* out, index_t out_stride, index_t s0,
                           index_t d0) noexcept {
  __m512 acc[R][CV];
  simd::unrolled<R * CV>([&](auto k) { acc[k / CV][k % CV] = _mm512_setzero_ps(); });
  dp_tile<R, CV>(acc, g + s0 * latent_pairs, /*a_row=*/latent_pairs, /*a_step=*/1, m + d0,
                 /*b_step=*/Dv, latent_pairs);
  float* tile = out + s0 * out_stride + d0;
  simd::unrolled<R * CV>([&](auto k) {
    _mm512_storeu_ps(tile + (k / CV) * out_stride + (k % CV) * 16, acc[k / CV][k % CV]);
  });
}

/// Runs tile<R, CV>(first, d0) over rows [0, rows) in fours (then the 3, 2 or
/// 1 left), calling after_tile() after each full tile.
template <int CV, class Tile, class Hook>
inline void over_rows(index_t rows, Tile&& tile, Hook& after_tile) noexcept {
  index_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    tile.template operator()<4, CV>(r);
    after_tile();
  }
  switch (rows - r) {
    case 3: tile.template operator()<3, CV>(r); break;
    case 2: tile.template operator()<2, CV>(r); break;
    case 1: tile.template operator()<1, CV>(r); break;
    default: break;
  }
}

struct NoPairTileHook {
  void operator()() const noexcept {}
};

}  // namespace detail

/// pairs[j] = bf16(x[j]) | bf16(y[j]) << 16 for j < n (nearest even; y null:
/// zeros), and sum[j] += the two rounded values (sum may be null).
inline void pack_row_pairs(const float* x, const float* y, index_t n, std::uint32_t* pairs,
                           float* sum = nullptr) noexcept {
  // vcvtne2ps2bf16(y, x) puts x's 16 values in the low half, y's in the high;
  // the permute interleaves them into pairs.
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (index_t j = 0; j < n; j += 16) {
    const __mmask16 lanes = detail::first_lanes(n - j);
    const __m512 first = _mm512_maskz_loadu_ps(lanes, x + j);
    const __m512 second = y ? _mm512_maskz_loadu_ps(lanes, y + j) : _mm512_setzero_ps();
    const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(second, first);
    const __m512i packed = _mm512_permutexvar_epi16(interleave, halves);
    _mm512_mask_storeu_epi32(pairs + j, lanes, packed);
    if (sum) {
      const __m512 rounded = _mm512_add_ps(detail::low_halves(packed), detail::high_halves(packed));
      _mm512_mask_storeu_ps(sum + j, lanes, _mm512_add_ps(_mm512_maskz_loadu_ps(lanes, sum + j), rounded));
    }
  }
}

/// pairs[j] = x[j] | y[j] << 16 for j < n: two rows of bf16 bits interleaved
/// (exact; y null: zeros).
inline void interleave_bf16_rows(const bfloat16* x, const bfloat16* y, index_t n,
                                 std::uint32_t* pairs) noexcept {
  for (index_t j = 0; j < n; j += 16) {
    const __mmask16 lanes = detail::first_lanes(n - j);
    const __m512i first = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, x + j));
    const __m512i second =
        y ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, y + j)), 16)
          : _mm512_setzero_si512();
    _mm512_mask_storeu_epi32(pairs + j, lanes, _mm512_or_si512(first, second));
  }
}

/// pairs[i] = bf16(x[2i]) | bf16(x[2i + 1]) << 16 for i < count (nearest
/// even; x[j] for j >= n is zero): a row of G as its latent pairs.
inline void round_row_to_pairs(const float* x, index_t n, index_t count, std::uint32_t* pairs) noexcept {
  for (index_t i = 0; i < count; i += 8) {
    const index_t j = 2 * i;
    const __m512 value = j < n ? _mm512_maskz_loadu_ps(detail::first_lanes(n - j), x + j) : _mm512_setzero_ps();
    _mm256_mask_storeu_epi32(pairs + i, __mmask8(detail::first_lanes(count - i)),
                             (__m256i)_mm512_cvtneps_pbh(value));
  }
}

/// memory[l][d] += sum_{p < pairs} <e_pairs[p][l], v_pairs[p][d]>: e_pairs is
/// pairs x L, v_pairs pairs x Dv, memory L x Dv, all contiguous.
template <class Hook = detail::NoPairTileHook>
void accumulate_pair_outer_products(const std::uint32_t* e_pairs, index_t pairs, index_t L,
                                    const std::uint32_t* v_pairs, float* memory, index_t Dv,
                                    Hook&& after_tile = {}) noexcept {
  index_t d0 = 0;
  auto columns = [&]<int CV>() {
    auto tile = [&]<int R, int C>(index_t l0) {
      detail::pair_outer_products_tile<R, C>(e_pairs, pairs, L, v_pairs, Dv, memory, l0, d0);
    };
    detail::over_rows<CV>(L, tile, after_tile);
  };
  for (; d0 + 64 <= Dv; d0 += 64) columns.template operator()<4>();
  for (; d0 + 16 <= Dv; d0 += 16) columns.template operator()<1>();
  for (; d0 < Dv; ++d0)
    for (index_t l = 0; l < L; ++l) {
      float sum = memory[l * Dv + d0];
      for (index_t p = 0; p < pairs; ++p) sum = detail::dp_scalar(sum, e_pairs[p * L + l], v_pairs[p * Dv + d0]);
      memory[l * Dv + d0] = sum;
    }
}

/// out[s][d] = sum_{i < latent_pairs} <g_pairs[s][i], m_pairs[i][d]> for s < n:
/// g_pairs n x latent_pairs and m_pairs latent_pairs x Dv, contiguous; output
/// row s at out + s * out_stride.
template <class Hook = detail::NoPairTileHook>
void read_pair_memory_rows(const std::uint32_t* g_pairs, index_t n, index_t latent_pairs,
                           const std::uint32_t* m_pairs, index_t Dv, float* out,
                           index_t out_stride, Hook&& after_tile = {}) noexcept {
  index_t d0 = 0;
  auto columns = [&]<int CV>() {
    auto tile = [&]<int R, int C>(index_t s0) {
      detail::pair_read_tile<R, C>(g_pairs, latent_pairs, m_pairs, Dv, out, out_stride, s0, d0);
    };
    detail::over_rows<CV>(n, tile, after_tile);
  };
  for (; d0 + 64 <= Dv; d0 += 64) columns.template operator()<4>();
  for (; d0 + 16 <= Dv; d0 += 16) columns.template operator()<1>();
  for (; d0 < Dv; ++d0)
    for (index_t s = 0; s < n; ++s) {
      float sum = 0;
      for (index_t i = 0; i < latent_pairs; ++i)
        sum = detail::dp_scalar(sum, g_pairs[s * latent_pairs + i], m_pairs[i * Dv + d0]);
      out[s * out_stride + d0] = sum;
    }
}

#endif  // LATTE_BF16_PRODUCTS

}  // namespace latte::cpu
