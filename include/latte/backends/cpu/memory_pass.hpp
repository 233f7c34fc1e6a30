#pragma once
// The pass of a causal scan over its N x Dv memory for four consecutive
// tokens whose updates add without rescaling, register blocked:
//
//   for j = 0 .. 3:  M[n] += w[j][n] v_j   (n < N),   o_j = sum_n g[j][n] M[n]
//
// with o_j read from the memory just after token j's update. Each memory row
// is loaded and stored once for the four tokens (a quarter of the L1 traffic
// of one token per pass), the values and outputs sit in registers. Latte's
// scan (paper 000 eqs. 10-12: w = exp(k - m), g = p(l|t) / alpha, N = L, used
// while no running max moves) and the linear family's (paper 001 eq. 4: w =
// e(k), g = e(q), N = E) both run it.
//
// With a PairRotations (VAPOR, paper 000 eq. 22) value j enters the memory as
// R^{-p_j} v_j and output j leaves as R^{p_j} o_j, both rotated in registers
// from the rows rotate_pairs takes (rotation.hpp): x cos_row -/+ swap(x) sin_row.
#include "latte/backends/cpu/simd.hpp"
#include "latte/core/types.hpp"

namespace latte::cpu {

/// The rotations of the four tokens of a pass as interleaved rows (token j's
/// at cos_rows[j], sin_rows[j]); read only by update_and_read_quad<T, true>.
template <Real T>
struct PairRotations {
  const T* const* cos_rows = nullptr;
  const T* const* sin_rows = nullptr;
};

/// One register block of R vectors (columns d0 .. d0 + R W) of the pass; w and
/// g hold token j's values at [j w_stride, j w_stride + N) and
/// [j g_stride, j g_stride + N) (strides may be negative).
/// With Tail the block's last vector holds only `last` columns (the end of a
/// row whose Dv is not a multiple of the width): its loads and stores are
/// masked to them, so the row's last columns take the same pass as the others.
template <Real T, int R, bool Rotate, bool Tail = false>
LATTE_FLATTEN void update_read_quad_block(T* memory, index_t Dv, index_t d0, const T* w,
                                          const T* g, const T* const* v, T* const* out,
                                          index_t N, PairRotations<T> rotation,
                                          index_t w_stride, index_t g_stride,
                                          index_t last = simd::width<T>) noexcept {
  static_assert(!(Rotate && Tail), "rotations need whole vectors of pairs");
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  constexpr int K = 4;
  B value[K][R], acc[K][R];
  simd::unrolled<K * R>([&](auto i) {  // constant indices (simd::unrolled)
    const index_t column = d0 + (i % R) * W;
    B x = simd::load_lanes<Tail && decltype(i)::value % R == R - 1>(v[i / R] + column, last);
    if constexpr (Rotate)  // R^{-p} v
      x = x * simd::load(rotation.cos_rows[i / R] + column) -
          simd::swap_pairs(x) * simd::load(rotation.sin_rows[i / R] + column);
    value[i / R][i % R] = x;
    acc[i / R][i % R] = B(T(0));
  });
  for (index_t n = 0; n < N; ++n) {
    T* row = memory + n * Dv + d0;
    B m[R];
    // Constant indices here too: GCC unrolls loops of R and K at -O3 but not
    // at -O2, where value and acc then live on the stack (causal Latte 16K,
    // 2 threads: 118 ms at -O2 against 76 ms at -O3).
    simd::unrolled<R>([&](auto r) {
      m[r] = simd::load_lanes<Tail && decltype(r)::value == R - 1>(row + r * W, last);
    });
    simd::unrolled<K>([&](auto j) {
      const B weight(w[j * w_stride + n]), read(g[j * g_stride + n]);
      simd::unrolled<R>([&](auto r) {
        m[r] = simd::fma(weight, value[j][r], m[r]);
        acc[j][r] = simd::fma(read, m[r], acc[j][r]);
      });
    });
    simd::unrolled<R>([&](auto r) {
      simd::store_lanes<Tail && decltype(r)::value == R - 1>(row + r * W, m[r], last);
    });
  }
  simd::unrolled<K * R>([&](auto i) {
    const index_t column = d0 + (i % R) * W;
    B o = acc[i / R][i % R];
    if constexpr (Rotate)  // R^{p} o
      o = o * simd::load(rotation.cos_rows[i / R] + column) +
          simd::swap_pairs(o) * simd::load(rotation.sin_rows[i / R] + column);
    simd::store_lanes<Tail && decltype(i)::value % R == R - 1>(out[i / R] + column, o, last);
  });
}

/// The whole pass for four tokens: value j at v[j], output j to out[j];
/// token j's weights at w + j w_stride and reads at g + j g_stride (strides
/// may be negative: rows of tokens taken in reverse). With a rotation Dv must
/// be a multiple of the vector width.
template <Real T, bool Rotate = false>
void update_and_read_quad_strided(T* memory, const T* w, index_t w_stride, const T* g,
                                  index_t g_stride, const T* const* v, T* const* out, index_t N,
                                  index_t Dv, PairRotations<T> rotation = {}) noexcept {
  constexpr index_t W = simd::width<T>;
  index_t d = 0;
  for (; d + 2 * W <= Dv; d += 2 * W)
    update_read_quad_block<T, 2, Rotate>(memory, Dv, d, w, g, v, out, N, rotation, w_stride,
                                         g_stride);
  const index_t rest = Dv - d;  // < 2 W columns: one block of one or two vectors, the last masked
  if (rest == 0) return;
  if constexpr (Rotate) {
    update_read_quad_block<T, 1, true>(memory, Dv, d, w, g, v, out, N, rotation, w_stride,
                                       g_stride);
  } else if (rest > W) {
    update_read_quad_block<T, 2, false, true>(memory, Dv, d, w, g, v, out, N, rotation, w_stride,
                                              g_stride, rest - W);
  } else {
    update_read_quad_block<T, 1, false, true>(memory, Dv, d, w, g, v, out, N, rotation, w_stride,
                                              g_stride, rest);
  }
}

/// update_and_read_quad_strided with token j's weights and reads at rows j of
/// [4 x N] arrays w and g.
template <Real T, bool Rotate = false>
void update_and_read_quad(T* memory, const T* w, const T* g, const T* const* v, T* const* out,
                          index_t N, index_t Dv, PairRotations<T> rotation = {}) noexcept {
  update_and_read_quad_strided<T, Rotate>(memory, w, N, g, N, v, out, N, Dv, rotation);
}

}  // namespace latte::cpu
