#pragma once
// The two contractions of a block of n tokens with an L x Dv memory, register
// blocked for the bidirectional Latte pass (paper 000 eq. 7):
//
//   accumulate_outer_products:  M[l][d] += sum_s e[s][l] v[s][d]   (M += E^T V)
//   read_memory_rows:           o[s][d]  = c_s sum_l g[s][l] M[l][d]   (O = diag(c) G M)
//
// Both keep a tile of 4 x tile_vectors SIMD vectors of accumulators in
// registers and stream the other operand through it (one core, fma_tile): for
// each step, tile_vectors vector loads and 4 broadcasts feed 4 tile_vectors
// FMAs. The tile fits the register file: 4 x 4 with 32 vector registers
// (AVX-512), 4 x 2 with 16 (AVX2), where a 4 x 4 tile and its 4 loaded
// vectors (20 registers) spill: 28.6 GFMA/s against 50.0 for 4 x 2, one core
// of this machine's AVX2 EPYC (peak ~51), L = Dv = 64, 64 tokens; the
// bidirectional Latte forward (B1 H8 L64 D64, T = 16K / 64K, 2 threads) went
// from 66 to 78-79 GFLOP/s (latte-compare, best of two alternating runs). E, V and G are contiguous n x L / n x Dv blocks the
// caller has just written (so they sit in L1); the outputs of read_memory_rows
// go straight to their strided rows. Eigen's GEMM on these shapes (n = 256,
// L = Dv = 64; profiled in the bidirectional pass) spent about a sixth of its
// time packing operands, and an assignment to a strided destination first
// clears it; these need neither.
// Accumulation runs over s (resp. l) in order, one FMA per term. A caller's
// `after_tile()` runs after each full register tile (the bidirectional pass
// requests the next block's rows there, a few per tile).
#include <cstddef>
#include <type_traits>

#include "latte/backends/cpu/simd.hpp"
#include "latte/core/types.hpp"

namespace latte::cpu {

/// Vectors per row of a contraction's register tile (see above).
inline constexpr int tile_vectors = simd::vector_registers >= 32 ? 4 : 2;

namespace detail {

/// The tile core of both contractions: acc[i][c] += sum_{s < steps}
/// a[i * a_row + s * a_step] b[s * b_step + c W ..], i < R, c < CV. Each step
/// loads CV vectors of b once (held in registers) and broadcasts R scalars of a.
/// With Tail the last vector of b holds `last` columns (the rest read as 0):
/// a row of Dv = 65 ends in a masked vector, not a scalar loop.
template <Real T, int R, int CV, bool Tail = false>
inline void fma_tile(simd::batch<T> (&acc)[R][CV], const T* a, index_t a_row, index_t a_step,
                     const T* b, index_t b_step, index_t steps, index_t last) noexcept {
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  // Constant indices (simd::unrolled): GCC unrolls loops of R and CV at -O3
  // but not at -O2, where the tile then lives on the stack.
  for (index_t s = 0; s < steps; ++s) {
    B vector[CV];
    simd::unrolled<CV>([&](auto c) {
      constexpr bool part = Tail && decltype(c)::value == CV - 1;
      vector[c] = simd::load_lanes<part>(b + s * b_step + c * W, last);
      simd::hold_in_register(vector[c]);
    });
    simd::unrolled<R>([&](auto i) {
      const B scalar(a[i * a_row + s * a_step]);
      simd::unrolled<CV>([&](auto c) { acc[i][c] = simd::fma(scalar, vector[c], acc[i][c]); });
    });
  }
}

/// M[l0 + i][d0 + c W ..] += sum_s e[s][l0 + i] v[s][d0 + c W ..], i < RL, c < CV.
template <Real T, int RL, int CV, bool Tail>
LATTE_FLATTEN void outer_products_tile(const T* e, index_t n, index_t L, const T* v,
                                       index_t Dv, T* memory, index_t l0, index_t d0,
                                       index_t last) noexcept {
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  B acc[RL][CV];
  T* tile = memory + l0 * Dv + d0;
  simd::unrolled<RL * CV>([&](auto k) {
    constexpr bool part = Tail && decltype(k)::value % CV == CV - 1;
    acc[k / CV][k % CV] = simd::load_lanes<part>(tile + (k / CV) * Dv + (k % CV) * W, last);
  });
  fma_tile<T, RL, CV, Tail>(acc, e + l0, /*a_row=*/1, /*a_step=*/L, v + d0, /*b_step=*/Dv, n, last);
  simd::unrolled<RL * CV>([&](auto k) {
    constexpr bool part = Tail && decltype(k)::value % CV == CV - 1;
    simd::store_lanes<part>(tile + (k / CV) * Dv + (k % CV) * W, acc[k / CV][k % CV], last);
  });
}

template <Real T, int CV, bool Tail, class Hook>
inline void outer_products_columns(const T* e, index_t n, index_t L, const T* v, index_t Dv,
                                   T* memory, index_t d0, index_t last, Hook& after_tile) noexcept {
  index_t l0 = 0;
  for (; l0 + 4 <= L; l0 += 4) {
    outer_products_tile<T, 4, CV, Tail>(e, n, L, v, Dv, memory, l0, d0, last);
    after_tile();
  }
  switch (L - l0) {
    case 3: outer_products_tile<T, 3, CV, Tail>(e, n, L, v, Dv, memory, l0, d0, last); break;
    case 2: outer_products_tile<T, 2, CV, Tail>(e, n, L, v, Dv, memory, l0, d0, last); break;
    case 1: outer_products_tile<T, 1, CV, Tail>(e, n, L, v, Dv, memory, l0, d0, last); break;
    default: break;
  }
}

/// o[s0 + r][d0 + c W ..] = scale[s0 + r] sum_l g[s0 + r][l] M[l][d0 + c W ..],
/// r < R, c < CV (unscaled where scale is null).
template <Real T, int R, int CV, bool Tail>
LATTE_FLATTEN void read_tile(const T* g, index_t L, const T* memory, index_t Dv, const T* scale,
                             T* out, index_t out_stride, index_t s0, index_t d0,
                             index_t last) noexcept {
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  B acc[R][CV];
  simd::unrolled<R * CV>([&](auto k) { acc[k / CV][k % CV] = B(T(0)); });
  fma_tile<T, R, CV, Tail>(acc, g + s0 * L, /*a_row=*/L, /*a_step=*/1, memory + d0, /*b_step=*/Dv,
                           L, last);
  T* tile = out + s0 * out_stride + d0;
  simd::unrolled<R * CV>([&](auto k) {
    constexpr bool part = Tail && decltype(k)::value % CV == CV - 1;
    simd::store_lanes<part>(tile + (k / CV) * out_stride + (k % CV) * W,
                            scale ? acc[k / CV][k % CV] * B(scale[s0 + k / CV]) : acc[k / CV][k % CV],
                            last);
  });
}

template <Real T, int CV, bool Tail, class Hook>
inline void read_columns(const T* g, index_t n, index_t L, const T* memory, index_t Dv,
                         const T* scale, T* out, index_t out_stride, index_t d0, index_t last,
                         Hook& after_tile) noexcept {
  index_t s0 = 0;
  for (; s0 + 4 <= n; s0 += 4) {
    read_tile<T, 4, CV, Tail>(g, L, memory, Dv, scale, out, out_stride, s0, d0, last);
    after_tile();
  }
  auto rows = [&]<int R>() {
    read_tile<T, R, CV, Tail>(g, L, memory, Dv, scale, out, out_stride, s0, d0, last);
  };
  switch (n - s0) {
    case 3: rows.template operator()<3>(); break;
    case 2: rows.template operator()<2>(); break;
    case 1: rows.template operator()<1>(); break;
    default: break;
  }
}

/// The default hook between tiles: nothing.
struct NoTileHook {
  void operator()() const noexcept {}
};

}  // namespace detail

/// to = from^T for a rows x cols row-major `from` (the backward's transposed
/// carries, read by read_memory_rows as the other side's memory).
template <Real T>
void transpose_into(const T* from, index_t rows, index_t cols, T* to) noexcept {
  for (index_t r = 0; r < rows; ++r)
    for (index_t c = 0; c < cols; ++c) to[c * rows + r] = from[r * cols + c];
}

/// memory[l][d] += sum_{s < n} e[s][l] v[s][d]: e is n x L and v n x Dv, both
/// contiguous; memory is L x Dv, contiguous.
template <Real T, class Hook = detail::NoTileHook>
void accumulate_outer_products(const T* e, index_t n, index_t L, const T* v, T* memory,
                               index_t Dv, Hook&& after_tile = {}) noexcept {
  simd::for_each_vector_group<T, tile_vectors>(
      Dv, [&](index_t d0, index_t last, auto vectors, auto tail) {
        detail::outer_products_columns<T, vectors.value, tail.value>(e, n, L, v, Dv, memory, d0,
                                                                     last, after_tile);
      });
}

/// out[s][d] = scale[s] sum_{l < L} g[s][l] memory[l][d] for s < n: g is
/// n x L, contiguous; memory L x Dv, contiguous; output row s at
/// out + s * out_stride. A null `scale` leaves the rows unscaled.
template <Real T, class Hook = detail::NoTileHook>
void read_memory_rows(const T* g, index_t n, index_t L, const T* memory, index_t Dv, T* out,
                      index_t out_stride, std::type_identity_t<const T*> scale,
                      Hook&& after_tile = {}) noexcept {
  simd::for_each_vector_group<T, tile_vectors>(
      Dv, [&](index_t d0, index_t last, auto vectors, auto tail) {
        detail::read_columns<T, vectors.value, tail.value>(g, n, L, memory, Dv, scale, out,
                                                           out_stride, d0, last, after_tile);
      });
}

}  // namespace latte::cpu
