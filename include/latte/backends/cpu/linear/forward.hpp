#pragma once
// CPU backend for the linear-attention family (paper 001 §3.1 eq. 4; paper 004):
// xsimd vectorisation, Eigen GEMMs and OpenMP threads.
//
// Features. A block of tokens of one (b, h) becomes rows of expanded features
// e = [w_1 R^p phi(x), ..., w_streams R^p phi(x)] (E = streams * F per row) and,
// where they differ (RoPE with the un-rotated denominator), rows of the
// denominator features e' = [w_1 phi(x), ...] — the definitions of
// backends/reference/linear.hpp. The built-in maps (Relu, EluPlusOne,
// Identity) are vectorised here; a user's map goes through its own apply().
// RoPE's cos/sin come from a RotationStepper (angles reduced in double).
//
// Causal: the recurrence S_t = S_{t-1} + e(k_t) v_t^T, z_t = z_{t-1} + e'(k_t),
// o_t = S_t^T e(q_t) / N(e'(q_t) . z_t) (paper 001 eq. 4) as a register-blocked
// scan: the E x Dv memory stays in L1, each pass over it absorbs and reads four
// tokens (memory_pass.hpp, shared with cpu/latte.hpp), with the value and
// output blocks in registers.
// The chunked GEMM form of DESIGN §5 (intra-chunk masked (E_Q E_K^T) V plus
// E_Q S) was measured against it and loses at the DESIGN §6 shapes (see
// bench/bench_linear.cpp); it is kept as `chunked_scan` for that comparison.
// Work is split over (batch, head); when there are fewer heads than threads,
// time is split into one segment per thread and run in two passes (the
// segment sums E_K^T V in parallel as GEMMs -> a prefix sum of states ->
// outputs in parallel), so B*H = 1 still uses every core.
//
// Bidirectional and cross: S = E_K^T V and z = 1^T E'_K over the source (Eigen
// GEMM in row blocks), then O = E_Q S / N(E'_Q z) per query block.
//
// Workspace: O(threads * (block * E + E * Dv)), independent of T.
#include <algorithm>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "latte/backends/cpu/block_contractions.hpp"
#include "latte/backends/cpu/compensated_sums.hpp"
#include "latte/backends/cpu/memory_pass.hpp"
#include "latte/backends/cpu/parallel.hpp"
#include "latte/backends/cpu/prefetch.hpp"
#include "latte/backends/cpu/rotation.hpp"
#include "latte/backends/cpu/simd.hpp"
#include "latte/backends/reference/linear.hpp"
#include "latte/core/angles.hpp"
#include "latte/core/huge_page_allocator.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/policies/feature_map.hpp"
#include "latte/policies/normaliser.hpp"
#include "latte/policies/positional.hpp"
#include "latte/policies/reweight.hpp"

namespace latte::cpu {

using reference::LinearCarry;
using reference::LinearSpec;
using reference::Side;

/// Tokens whose features are formed together (rows of the scratch blocks).
inline constexpr index_t linear_block = 64;

// ------------------------------------------------------------- features --

/// y = s x over n values, in batches (a plain -O2 build does not vectorise the loop).
template <Real T>
inline void scaled_copy(const T* x, T s, T* y, index_t n) noexcept {
  index_t i = 0;
#if LATTE_WITH_XSIMD
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  for (; i + W <= n; i += W) simd::store(y + i, B(s) * simd::load(x + i));
#endif
  for (; i < n; ++i) y[i] = s * x[i];
}

/// phi(x) for one row: the built-in maps vectorised, any other map through its apply().
/// Flattened: a plain -O2 build otherwise calls xsimd's exp out of line, with
/// its batches through memory (EluPlusOne ran 2.5x slower than at -O3).
template <FeatureMap Map, Real T>
LATTE_FLATTEN void feature_map_row(const T* x, index_t key_dim, T* phi,
                                   index_t feature_dim) noexcept {
  constexpr bool builtin = std::is_same_v<Map, Relu> || std::is_same_v<Map, EluPlusOne> ||
                           std::is_same_v<Map, Identity>;
#if LATTE_WITH_XSIMD
  if constexpr (builtin) {
    using B = simd::batch<T>;
    // Whole vectors, then a masked last one (Dk = 63).
    simd::for_each_vector<T>(key_dim, [&](index_t i, index_t count, auto tail) {
      const B value = simd::load_lanes<tail.value>(x + i, count);
      B phi_i = value;
      if constexpr (std::is_same_v<Map, Relu>)
        phi_i = simd::max(value, B(T(0)));
      else if constexpr (std::is_same_v<Map, EluPlusOne>)  // x + 1 for x > 0, exp(x) otherwise
        phi_i = xsimd::select(value > B(T(0)), value + B(T(1)), simd::exp(value));
      simd::store_lanes<tail.value>(phi + i, phi_i, count);
    });
    return;
  }
#endif
  (void)builtin;
  Map::apply(std::span<const T>(x, static_cast<std::size_t>(key_dim)),
             std::span<T>(phi, static_cast<std::size_t>(feature_dim)));
}

/// Expanded features of one row x (paper 004 eqs. 6-10 and 13), as
/// reference::linear_features: `numerator` gets e, `denominator` (when not
/// null) the un-rotated e'. `proportion_of(phi)` gives P; `rotation` (RoPE)
/// sits at the token's position.
template <FeatureMap Map, Reweight Rw, Positional Pos, Real T, class ProportionOf>
void token_features(const T* x, const LinearSpec& spec, ProportionOf&& proportion_of,
                    const RotationStepper<T>* rotation, T* phi, T* numerator,
                    T* denominator) noexcept {
  const index_t F = spec.feature_dim;
  feature_map_row<Map>(x, spec.key_dim, phi, F);
  T weight[2] = {T(1), T(1)};
  if constexpr (Rw::streams == 2) cos_reweight_streams(proportion_of(phi), weight);  // eq. 9
  if constexpr (Pos::rotates_queries_keys) {
    if (denominator)
      for (index_t stream = 0; stream < Rw::streams; ++stream)
        scaled_copy(phi, weight[stream], denominator + stream * F, F);
    rotation->rotate(phi, /*forward=*/true);  // R^p phi(x), eq. 13
  } else {
    (void)rotation, (void)denominator;
  }
  for (index_t stream = 0; stream < Rw::streams; ++stream)
    scaled_copy(phi, weight[stream], numerator + stream * F, F);
}

/// Whether the denominator features differ from the numerator ones.
template <Positional Pos>
[[nodiscard]] bool separate_denominator(const LinearSpec& spec) noexcept {
  return Pos::rotates_queries_keys && !spec.rotated_denominator;
}

/// Per-worker scratch: feature rows of one block of tokens for both sides.
template <Real T>
struct LinearScratch {
  LinearScratch(const LinearSpec& spec, index_t block)
      : phi(static_cast<std::size_t>(spec.feature_dim)),
        key_numerator(static_cast<std::size_t>(block * spec.expanded_dim())),
        key_denominator(key_numerator.size()),
        query_numerator(key_numerator.size()),
        query_denominator(key_numerator.size()),
        denominator(static_cast<std::size_t>(block)),
        folded(static_cast<std::size_t>(spec.expanded_dim() * (spec.value_dim + 1))),
        pending(folded.size()), block_values(static_cast<std::size_t>(block * spec.value_dim)),
        rotation(spec.feature_dim / 2) {}
  AlignedVector<T> phi, key_numerator, key_denominator, query_numerator, query_denominator;
  AlignedVector<T> denominator;  // e'(q_t) . z_t per token of the block
  // Compensated carries (compensated_sums.hpp): S, z at the last fold, a
  // block's E_K^T V, 1^T E'_K summed apart ([E x Dv] then [E] each), and the
  // block's value rows, contiguous for the register-tiled contraction.
  AlignedVector<T> folded, pending, block_values;
  RotationStepper<T> rotation;
  Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> scores;  // chunked form
};

/// Features of tokens [t0, t0 + n) of (b, h) for the sides asked for
/// (`keys` / `queries` null: that side is skipped), rows of E in the scratch
/// blocks. `position` is token t0's; under RoPE the rotation must sit there
/// (seek_rotation) and is left at the position after the block: a seek costs
/// F sincos with long-double reductions, so it happens once per scanned range.
template <FeatureMap Map, Reweight Rw, Positional Pos, Real T, class ProportionOf>
void block_features(const TensorView<const T, 4>* queries, const TensorView<const T, 4>* keys,
                    index_t b, index_t h, index_t t0, index_t n, std::int64_t position,
                    const LinearSpec& spec, ProportionOf& proportion_of,
                    LinearScratch<T>& scratch) noexcept {
  const index_t E = spec.expanded_dim();
  const bool separate = separate_denominator<Pos>(spec);
  for (index_t r = 0; r < n; ++r) {
    const index_t t = t0 + r;
    const std::int64_t p = position + r;
    if (keys) {
      T* numerator = scratch.key_numerator.data() + r * E;
      token_features<Map, Rw, Pos>(
          keys->row(b, t, h), spec,
          [&](const T* phi) { return proportion_of(Side::key, b, t, h, p, phi); },
          &scratch.rotation, scratch.phi.data(), numerator,
          separate ? scratch.key_denominator.data() + r * E : nullptr);
    }
    if (queries) {
      T* numerator = scratch.query_numerator.data() + r * E;
      token_features<Map, Rw, Pos>(
          queries->row(b, t, h), spec,
          [&](const T* phi) { return proportion_of(Side::query, b, t, h, p, phi); },
          &scratch.rotation, scratch.phi.data(), numerator,
          separate ? scratch.query_denominator.data() + r * E : nullptr);
    }
    if constexpr (Pos::rotates_queries_keys) scratch.rotation.next();
  }
}

/// Points the RoPE rotation of `scratch` at head h, absolute position `position`.
template <Positional Pos, Real T>
void seek_rotation(LinearScratch<T>& scratch, const LinearSpec& spec, index_t h,
                   std::int64_t position) noexcept {
  if constexpr (Pos::rotates_queries_keys) scratch.rotation.seek(spec.theta(h), position);
  else (void)scratch, (void)spec, (void)h, (void)position;
}

// ------------------------------------------------------------ the scan --

/// One register block of R vectors of the Dv pass for two consecutive tokens:
/// S_e += e(k_1)_e v_1; o_1 += e(q_1)_e S_e; S_e += e(k_2)_e v_2; o_2 += e(q_2)_e S_e
/// (eq. 4), each memory row loaded and stored once for both tokens.
template <Real T, int R>
inline void absorb_read_pair_block(T* memory, index_t Dv, index_t d0, const T* k1, const T* k2,
                                   const T* q1, const T* q2, const T* v1, const T* v2, T* o1,
                                   T* o2, index_t E) noexcept {
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  B value1[R], value2[R], acc1[R], acc2[R];
  for (int r = 0; r < R; ++r) {
    value1[r] = simd::load(v1 + d0 + r * W);
    value2[r] = simd::load(v2 + d0 + r * W);
    acc1[r] = B(T(0));
    acc2[r] = B(T(0));
  }
  for (index_t e = 0; e < E; ++e) {
    T* row = memory + e * Dv + d0;
    const B key1(k1[e]), key2(k2[e]), query1(q1[e]), query2(q2[e]);
    for (int r = 0; r < R; ++r) {
      B m = simd::fma(key1, value1[r], simd::load(row + r * W));
      acc1[r] = simd::fma(query1, m, acc1[r]);
      m = simd::fma(key2, value2[r], m);
      acc2[r] = simd::fma(query2, m, acc2[r]);
      simd::store(row + r * W, m);
    }
  }
  for (int r = 0; r < R; ++r) {
    simd::store(o1 + d0 + r * W, acc1[r]);
    simd::store(o2 + d0 + r * W, acc2[r]);
  }
}

/// The single-token block: S_e += e(k)_e v; o += e(q)_e S_e.
template <Real T, int R>
inline void absorb_read_block(T* memory, index_t Dv, index_t d0, const T* k, const T* q,
                              const T* v, T* o, index_t E) noexcept {
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  B value[R], acc[R];
  for (int r = 0; r < R; ++r) {
    value[r] = simd::load(v + d0 + r * W);
    acc[r] = B(T(0));
  }
  for (index_t e = 0; e < E; ++e) {
    T* row = memory + e * Dv + d0;
    const B key(k[e]), query(q[e]);
    for (int r = 0; r < R; ++r) {
      const B m = simd::fma(key, value[r], simd::load(row + r * W));
      acc[r] = simd::fma(query, m, acc[r]);
      simd::store(row + r * W, m);
    }
  }
  for (int r = 0; r < R; ++r) simd::store(o + d0 + r * W, acc[r]);
}

/// The Dv pass of two tokens (k2/q2/v2/o2 null: one token).
template <Real T>
void absorb_read(T* memory, const T* k1, const T* k2, const T* q1, const T* q2, const T* v1,
                 const T* v2, T* o1, T* o2, index_t E, index_t Dv) noexcept {
  constexpr index_t W = simd::width<T>;
  index_t d = 0;
  if (k2) {
    for (; d + 4 * W <= Dv; d += 4 * W)
      absorb_read_pair_block<T, 4>(memory, Dv, d, k1, k2, q1, q2, v1, v2, o1, o2, E);
    for (; d + W <= Dv; d += W)
      absorb_read_pair_block<T, 1>(memory, Dv, d, k1, k2, q1, q2, v1, v2, o1, o2, E);
  } else {
    for (; d + 4 * W <= Dv; d += 4 * W) absorb_read_block<T, 4>(memory, Dv, d, k1, q1, v1, o1, E);
    for (; d + W <= Dv; d += W) absorb_read_block<T, 1>(memory, Dv, d, k1, q1, v1, o1, E);
  }
  for (; d < Dv; ++d) {
    T acc1 = 0, acc2 = 0;
    for (index_t e = 0; e < E; ++e) {
      T& m = memory[e * Dv + d];
      m += k1[e] * v1[d];
      acc1 += q1[e] * m;
      if (k2) {
        m += k2[e] * v2[d];
        acc2 += q2[e] * m;
      }
    }
    o1[d] = acc1;
    if (k2) o2[d] = acc2;
  }
}

/// z += e'(k); returns e'(q) . z (the denominator of eq. 4 before N).
template <Real T>
[[nodiscard]] T absorb_read_normaliser(T* z, const T* key, const T* query, index_t E) noexcept {
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  B total(T(0));
  index_t e = 0;
  for (; e + W <= E; e += W) {
    const B sum = simd::load(z + e) + simd::load(key + e);
    simd::store(z + e, sum);
    total = simd::fma(simd::load(query + e), sum, total);
  }
  T tail = 0;
  for (; e < E; ++e) {
    z[e] += key[e];
    tail += query[e] * z[e];
  }
  return simd::reduce_add(total) + tail;
}

/// <x, y> over n values.
template <Real T>
[[nodiscard]] T dot(const T* x, const T* y, index_t n) noexcept {
  index_t i = 0;
  T tail = 0;
#if LATTE_WITH_XSIMD
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  B total(T(0));
  for (; i + W <= n; i += W) total = simd::fma(simd::load(x + i), simd::load(y + i), total);
  tail = simd::reduce_add(total);
#endif
  for (; i < n; ++i) tail += x[i] * y[i];
  return tail;
}

/// out /= N(denominator), Dv values.
template <Real T>
void normalise(T* out, index_t Dv, T denominator, const Normaliser& normaliser) noexcept {
  const T inverse = T(1) / normaliser.apply(denominator);
  using B = simd::batch<T>;
  constexpr index_t W = simd::width<T>;
  index_t d = 0;
  for (; d + W <= Dv; d += W) simd::store(out + d, simd::load(out + d) * B(inverse));
  for (; d < Dv; ++d) out[d] *= inverse;
}

template <Real T>
using RowMatrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <Real T>
using ConstRows = Eigen::Map<const RowMatrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <Real T>
using Rows = Eigen::Map<RowMatrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;

/// Rows [t0, t0 + n) of (b, h) of a [B, T, H, D] view as an n x D Eigen map.
template <Real T>
[[nodiscard]] ConstRows<T> rows_of(const TensorView<const T, 4>& x, index_t b, index_t h,
                                   index_t t0, index_t n) noexcept {
  return ConstRows<T>(x.row(b, t0, h), n, x.extent(3), Eigen::OuterStride<>(x.stride(1)));
}

/// S += E_K^T V, z += 1^T E'_K over the `n` key rows in the scratch (the
/// register-tiled contraction).
template <Real T>
void absorb_block(LinearScratch<T>& scratch, bool separate, const ConstRows<T>& values,
                  index_t n, LinearCarry<T> carry, index_t E, index_t Dv) noexcept {
  // The value rows copied contiguous, then the register-tiled contraction
  // (block_contractions.hpp): on these small blocks Eigen's GEMM spends much
  // of its time packing (linear elu+1 H8 E64 Dv64, T = 16K: 1.9x the plain
  // forward through Eigen, latte-compare --only sums; the bidirectional
  // forward 29.0 -> 24.6 ms with its read, docs/backward.md).
  T* rows = scratch.block_values.data();
  for (index_t r = 0; r < n; ++r)
    std::copy(values.row(r).data(), values.row(r).data() + Dv, rows + r * Dv);
  accumulate_outer_products(scratch.key_numerator.data(), n, E, rows, carry.memory, Dv);
  const T* denominators = separate ? scratch.key_denominator.data() : scratch.key_numerator.data();
  for (index_t r = 0; r < n; ++r)
    for (index_t e = 0; e < E; ++e) carry.normaliser[e] += denominators[r * E + e];
}

/// Compensated carries (compensated_sums.hpp): the block's E_K^T V and 1^T E'_K
/// summed apart (absorb_block into the scratch's pending sums), then added to
/// the pairs by TwoSum; carry.memory / normaliser restart from the new sums.
/// `folded` holds the sums at the last fold (scratch.folded, or the carry's
/// own sums when nothing read them in between).
template <Real T>
void absorb_block_compensated(LinearScratch<T>& scratch, bool separate, const ConstRows<T>& values,
                              index_t n, LinearCarry<T> carry, T* folded_memory,
                              T* folded_normaliser, index_t E, index_t Dv) noexcept {
  T* pending = scratch.pending.data();  // zero: fold_pending leaves it so
  absorb_block(scratch, separate, values, n, LinearCarry<T>{pending, pending + E * Dv}, E, Dv);
  fold_pending(carry.memory, folded_memory, carry.memory_low, pending, E * Dv);
  fold_pending(carry.normaliser, folded_normaliser, carry.normaliser_low, pending + E * Dv, E);
}

/// Starts a scan over a compensated carry: the pairs renormalised (a decode
/// step may have left terms in the low parts) and their sums kept in
/// scratch.folded. Returns whether the carry is compensated.
template <Real T>
bool begin_compensated(LinearCarry<T> carry, LinearScratch<T>& scratch, index_t E,
                       index_t Dv) noexcept {
  if (!carry.compensated()) return false;
  renormalise_pairs(carry.memory, carry.memory_low, E * Dv);
  renormalise_pairs(carry.normaliser, carry.normaliser_low, E);
  std::copy(carry.memory, carry.memory + E * Dv, scratch.folded.data());
  std::copy(carry.normaliser, carry.normaliser + E, scratch.folded.data() + E * Dv);
  return true;
}

/// Scans tokens [t0, t1) of (b, h) from `carry` (absolute position `position`
/// for token t0), writing outputs.
template <FeatureMap Map, Reweight Rw, Positional Pos, Real T, class ProportionOf>
void scan(const TensorView<const T, 4>& q, const TensorView<const T, 4>& k,
          const TensorView<const T, 4>& v, const TensorView<T, 4>& out, index_t b, index_t h,
          index_t t0, index_t t1, LinearCarry<T> carry, std::int64_t position,
          const LinearSpec& spec, ProportionOf& proportion_of, LinearScratch<T>& scratch) noexcept {
  const index_t E = spec.expanded_dim(), Dv = spec.value_dim;
  const bool separate = separate_denominator<Pos>(spec);
  const bool compensated = begin_compensated(carry, scratch, E, Dv);
  seek_rotation<Pos>(scratch, spec, h, position);
  // Rows 2 KiB apart defeat the hardware prefetchers (prefetch.hpp): the
  // first block's rows are requested up front, each later block's while the
  // passes of the one before it run.
  auto prefetch_token = [&]<CacheLevel Level>(index_t t) {
    if (t < t1) prefetch_token_rows<Level>(b, t, h, q, k, v, out);
  };
  for (index_t t = t0; t < std::min(t1, t0 + linear_block); ++t)
    prefetch_token.template operator()<CacheLevel::l1>(t);
  for (index_t c0 = t0; c0 < t1; c0 += linear_block) {
    const index_t n = std::min(linear_block, t1 - c0);
    block_features<Map, Rw, Pos>(&q, &k, b, h, c0, n, position + (c0 - t0), spec, proportion_of,
                                 scratch);
    auto prefetch_next_block = [&](index_t r, index_t count) {
      for (index_t j = r; j < r + count; ++j)
        prefetch_token.template operator()<CacheLevel::l2>(c0 + linear_block + j);
    };
    const T* kn = scratch.key_numerator.data();
    const T* qn = scratch.query_numerator.data();
    const T* kd = separate ? scratch.key_denominator.data() : kn;
    const T* qd = separate ? scratch.query_denominator.data() : qn;
    index_t r = 0;
    for (; r + 3 < n; r += 4) {  // four tokens per pass over the memory (memory_pass.hpp)
      const index_t t = c0 + r;
      prefetch_next_block(r, 4);
      const T* values[4] = {v.row(b, t, h), v.row(b, t + 1, h), v.row(b, t + 2, h),
                            v.row(b, t + 3, h)};
      T* outs[4] = {out.row(b, t, h), out.row(b, t + 1, h), out.row(b, t + 2, h),
                    out.row(b, t + 3, h)};
      update_and_read_quad(carry.memory, kn + r * E, qn + r * E, values, outs, E, Dv);
      for (index_t j = r; j < r + 4; ++j)
        scratch.denominator[j] =
            absorb_read_normaliser(carry.normaliser, kd + j * E, qd + j * E, E);
    }
    for (; r + 1 < n; r += 2) {  // two tokens per pass over the memory
      const index_t t = c0 + r;
      prefetch_next_block(r, 2);
      absorb_read(carry.memory, kn + r * E, kn + (r + 1) * E, qn + r * E, qn + (r + 1) * E,
                  v.row(b, t, h), v.row(b, t + 1, h), out.row(b, t, h), out.row(b, t + 1, h), E,
                  Dv);
      scratch.denominator[r] = absorb_read_normaliser(carry.normaliser, kd + r * E, qd + r * E, E);
      scratch.denominator[r + 1] =
          absorb_read_normaliser(carry.normaliser, kd + (r + 1) * E, qd + (r + 1) * E, E);
    }
    if (r < n) {
      const index_t t = c0 + r;
      absorb_read<T>(carry.memory, kn + r * E, nullptr, qn + r * E, nullptr, v.row(b, t, h),
                     nullptr, out.row(b, t, h), nullptr, E, Dv);
      scratch.denominator[r] = absorb_read_normaliser(carry.normaliser, kd + r * E, qd + r * E, E);
    }
    for (r = 0; r < n; ++r)
      normalise(out.row(b, c0 + r, h), Dv, scratch.denominator[r], spec.normaliser);
    if (compensated)  // the running sums restart from the compensated ones
      absorb_block_compensated(scratch, separate, rows_of(v, b, h, c0, n), n, carry,
                               scratch.folded.data(), scratch.folded.data() + E * Dv, E, Dv);
  }
}

/// The chunked GEMM form of DESIGN §5 for tokens [t0, t1) of (b, h): per chunk
/// of C tokens, O = tril(E_Q E_K^T) V + E_Q S, D = rowsum(tril(E'_Q E'_K^T)) + E'_Q z,
/// then S += E_K^T V, z += 1^T E'_K. Kept for the measured comparison with scan().
template <FeatureMap Map, Reweight Rw, Positional Pos, Real T, class ProportionOf>
void chunked_scan(const TensorView<const T, 4>& q, const TensorView<const T, 4>& k,
                  const TensorView<const T, 4>& v, const TensorView<T, 4>& out, index_t b,
                  index_t h, index_t t0, index_t t1, LinearCarry<T> carry, std::int64_t position,
                  const LinearSpec& spec, ProportionOf& proportion_of,
                  LinearScratch<T>& scratch) {
  const index_t E = spec.expanded_dim(), Dv = spec.value_dim;
  const bool separate = separate_denominator<Pos>(spec);
  const ConstRows<T> memory(carry.memory, E, Dv, Eigen::OuterStride<>(Dv));
  const Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, 1>> z(carry.normaliser, E);
  const bool compensated = begin_compensated(carry, scratch, E, Dv);
  seek_rotation<Pos>(scratch, spec, h, position);
  for (index_t c0 = t0; c0 < t1; c0 += linear_block) {
    const index_t n = std::min(linear_block, t1 - c0);
    block_features<Map, Rw, Pos>(&q, &k, b, h, c0, n, position + (c0 - t0), spec, proportion_of,
                                 scratch);
    const ConstRows<T> kn(scratch.key_numerator.data(), n, E, Eigen::OuterStride<>(E));
    const ConstRows<T> qn(scratch.query_numerator.data(), n, E, Eigen::OuterStride<>(E));
    const ConstRows<T> values = rows_of(v, b, h, c0, n);
    Rows<T> o(out.row(b, c0, h), n, Dv, Eigen::OuterStride<>(out.stride(1)));
    auto scores = scratch.scores.topLeftCorner(n, n);
    scores.noalias() = qn * kn.transpose();
    o.noalias() = scores.template triangularView<Eigen::Lower>() * values;
    o.noalias() += qn * memory;
    Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, 1>> denominator(scratch.denominator.data(), n);
    if (separate) {
      const ConstRows<T> kd(scratch.key_denominator.data(), n, E, Eigen::OuterStride<>(E));
      const ConstRows<T> qd(scratch.query_denominator.data(), n, E, Eigen::OuterStride<>(E));
      scores.noalias() = qd * kd.transpose();
      denominator.noalias() = qd * z;
    } else {
      denominator.noalias() = qn * z;
    }
    for (index_t r = 0; r < n; ++r) denominator[r] += scores.row(r).head(r + 1).sum();
    if (compensated)  // the carry's sums are read only here: they are their own fold point
      absorb_block_compensated(scratch, separate, values, n, carry, carry.memory,
                               carry.normaliser, E, Dv);
    else
      absorb_block(scratch, separate, values, n, carry, E, Dv);
    for (index_t r = 0; r < n; ++r)
      normalise(out.row(b, c0 + r, h), Dv, scratch.denominator[r], spec.normaliser);
  }
}

/// S, z of tokens [t0, t1) of (b, h) added into `carry` (no outputs): register-tiled
/// contractions per block.
template <FeatureMap Map, Reweight Rw, Positional Pos, Real T, class ProportionOf>
void absorb_segment(const TensorView<const T, 4>& k, const TensorView<const T, 4>& v, index_t b,
                    index_t h, index_t t0, index_t t1, LinearCarry<T> carry,
                    std::int64_t position, const LinearSpec& spec, ProportionOf& proportion_of,
                    LinearScratch<T>& scratch) noexcept {
  const index_t E = spec.expanded_dim(), Dv = spec.value_dim;
  const bool separate = separate_denominator<Pos>(spec);
  const bool compensated = begin_compensated(carry, scratch, E, Dv);
  seek_rotation<Pos>(scratch, spec, h, position);
  for (index_t c0 = t0; c0 < t1; c0 += linear_block) {
    const index_t n = std::min(linear_block, t1 - c0);
    prefetch_next_block(b, h, c0, linear_block, t1, k, v);
    block_features<Map, Rw, Pos>(static_cast<const TensorView<const T, 4>*>(nullptr), &k, b, h, c0, n, position + (c0 - t0), spec,
                                 proportion_of, scratch);
    if (compensated)
      absorb_block_compensated(scratch, separate, rows_of(v, b, h, c0, n), n, carry, carry.memory,
                               carry.normaliser, E, Dv);
    else
      absorb_block(scratch, separate, rows_of(v, b, h, c0, n), n, carry, E, Dv);
  }
}

/// Which causal algorithm linear_causal_forward runs.
enum class CausalAlgorithm { scan, chunked };

/// Causal linear attention over [B, T, H, *], continuing from carry_of(b, h)
/// at absolute position `first_position` (the reference's signature:
/// proportion_of(side, b, t, h, position, phi) gives the proportions).
template <FeatureMap Map, Reweight Rw, Positional Pos, Real T, class ProportionOf,
          class CarryOf>
void linear_causal_forward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                           TensorView<const T, 4> v, TensorView<T, 4> out, const LinearSpec& spec,
                           std::int64_t first_position, ProportionOf&& proportion_of,
                           CarryOf&& carry_of,
                           CausalAlgorithm algorithm = CausalAlgorithm::scan) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), heads = B * H;
  const index_t E = spec.expanded_dim(), Dv = spec.value_dim;
  if (Tn == 0 || heads == 0) return;
  // Threads only pay off past ~2^18 multiply-adds; smaller calls stay on this thread.
  const double work = double(heads) * double(Tn) * double(E) * double(Dv);
  const int workers = work >= 1 << 18 ? thread_count() : 1;
  constexpr index_t min_segment = 256;
  const index_t segments =
      heads >= workers ? 1 : std::clamp<index_t>(Tn / min_segment, 1, workers);
  std::vector<LinearScratch<T>> scratch(static_cast<std::size_t>(workers),
                                        LinearScratch<T>(spec, linear_block));
  if (algorithm == CausalAlgorithm::chunked)
    for (LinearScratch<T>& s : scratch) s.scores.resize(linear_block, linear_block);
  auto run = [&](index_t b, index_t h, index_t t0, index_t t1, LinearCarry<T> carry,
                 LinearScratch<T>& s) {
    if (algorithm == CausalAlgorithm::chunked)
      chunked_scan<Map, Rw, Pos>(q, k, v, out, b, h, t0, t1, carry, first_position + t0, spec,
                                 proportion_of, s);
    else
      scan<Map, Rw, Pos>(q, k, v, out, b, h, t0, t1, carry, first_position + t0, spec,
                         proportion_of, s);
  };

  if (segments == 1) {
    interleave_heads(
        heads, Tn, workers, [&](index_t i) { return carry_of(i / H, i % H); },
        [&](index_t i, LinearCarry<T> carry, index_t t0, index_t t1, int worker) {
          run(i / H, i % H, t0, t1, carry, scratch[worker]);
        });
    return;
  }
  // Two passes over `segments` time segments, one (b, h) at a time. Pass 1
  // sums E_K^T V over `pieces` sub-ranges of each segment but the last (so
  // every worker has work even with two segments); the state entering
  // segment p is then the incoming state plus the sums of segments < p.
  const index_t pieces = (workers + segments - 2) / (segments - 1);
  const index_t carry_size = reference::linear_carry_size(E, Dv);
  const index_t partial_slots = (segments - 1) * pieces;
  AlignedVector<T> storage(static_cast<std::size_t>((partial_slots + segments) * carry_size));
  bool compensated = false;  // as the incoming carry (the summation policy's choice)
  auto carry_at = [&](index_t slot) {
    // S, z, then (compensated) their low parts: [sums | low parts of the sums].
    const LinearCarry<T> carry =
        reference::linear_carry_at(storage.data() + slot * carry_size, E, Dv);
    return compensated ? carry : LinearCarry<T>{carry.memory, carry.normaliser};
  };
  auto segment_begin = [&](index_t p) { return p * Tn / segments; };
  for (index_t i = 0; i < heads; ++i) {
    const index_t b = i / H, h = i % H;
    const LinearCarry<T> incoming = carry_of(b, h);
    compensated = incoming.compensated();
    parallel_for(partial_slots, workers, [&](index_t slot, int worker) {
      const index_t p = slot / pieces, j = slot % pieces;
      const index_t begin = segment_begin(p), length = segment_begin(p + 1) - begin;
      const index_t t0 = begin + j * length / pieces, t1 = begin + (j + 1) * length / pieces;
      const LinearCarry<T> local = carry_at(slot);
      reference::linear_reset(local, E, Dv);
      absorb_segment<Map, Rw, Pos>(k, v, b, h, t0, t1, local, first_position + t0, spec,
                                   proportion_of, scratch[worker]);
    });
    auto copy_carry = [&](LinearCarry<T> to, LinearCarry<const T> from) {
      std::copy(from.memory, from.memory + E * Dv, to.memory);
      std::copy(from.normaliser, from.normaliser + E, to.normaliser);
      if (!compensated) return;
      std::copy(from.memory_low, from.memory_low + E * Dv, to.memory_low);
      std::copy(from.normaliser_low, from.normaliser_low + E, to.normaliser_low);
    };
    copy_carry(carry_at(partial_slots), {incoming.memory, incoming.normaliser, incoming.memory_low,
                                         incoming.normaliser_low});
    for (index_t p = 1; p < segments; ++p) {
      T* into = carry_at(partial_slots + p).memory;
      std::copy(into - carry_size, into, into);
      for (index_t j = 0; j < pieces; ++j) {
        const LinearCarry<T> part = carry_at((p - 1) * pieces + j);
        reference::linear_append_carry<T>(
            carry_at(partial_slots + p),
            {part.memory, part.normaliser, part.memory_low, part.normaliser_low}, E, Dv);
      }
    }
    parallel_for(segments, workers, [&](index_t p, int worker) {
      run(b, h, segment_begin(p), segment_begin(p + 1), carry_at(partial_slots + p),
          scratch[worker]);
    });
    const LinearCarry<T> last = carry_at(partial_slots + segments - 1);
    copy_carry(incoming, {last.memory, last.normaliser, last.memory_low, last.normaliser_low});
  }
}

/// Absorbs keys and values [B, T, H, *] into carry_of(b, h) from
/// `first_position` without reading (absorb_segment's GEMMs alone): the carry
/// linear_causal_forward would leave. With fewer heads than threads, each
/// head's tokens are cut into pieces summed from zero, then appended in order.
template <FeatureMap Map, Reweight Rw, Positional Pos, Real T, class ProportionOf, class CarryOf>
void linear_causal_absorb(TensorView<const T, 4> k, TensorView<const T, 4> v,
                          const LinearSpec& spec, std::int64_t first_position,
                          ProportionOf&& proportion_of, CarryOf&& carry_of) {
  const index_t B = k.extent(0), Tn = k.extent(1), H = k.extent(2), heads = B * H;
  const index_t E = spec.expanded_dim(), Dv = spec.value_dim;
  if (Tn == 0 || heads == 0) return;
  const double work = double(heads) * double(Tn) * double(E) * double(Dv);
  const int workers = work >= 1 << 18 ? thread_count() : 1;
  const index_t pieces = heads >= workers ? 1 : std::clamp<index_t>(Tn / 256, 1, workers);
  std::vector<LinearScratch<T>> scratch(static_cast<std::size_t>(workers),
                                        LinearScratch<T>(spec, linear_block));
  if (pieces == 1) {
    parallel_for(heads, workers, [&](index_t i, int worker) {
      absorb_segment<Map, Rw, Pos>(k, v, i / H, i % H, 0, Tn, carry_of(i / H, i % H),
                                   first_position, spec, proportion_of, scratch[worker]);
    });
    return;
  }
  const index_t carry_size = reference::linear_carry_size(E, Dv);
  AlignedVector<T> storage(static_cast<std::size_t>(pieces * carry_size));
  auto piece_begin = [&](index_t p) { return p * Tn / pieces; };
  for (index_t i = 0; i < heads; ++i) {
    const index_t b = i / H, h = i % H;
    const LinearCarry<T> carry = carry_of(b, h);
    auto slot = [&](index_t p) {  // compensated as the carry is (the summation policy's choice)
      const LinearCarry<T> at = reference::linear_carry_at(storage.data() + p * carry_size, E, Dv);
      return carry.compensated() ? at : LinearCarry<T>{at.memory, at.normaliser};
    };
    parallel_for(pieces, workers, [&](index_t p, int worker) {
      const LinearCarry<T> local = p == 0 ? carry : slot(p);
      if (p > 0) reference::linear_reset(local, E, Dv);
      absorb_segment<Map, Rw, Pos>(k, v, b, h, piece_begin(p), piece_begin(p + 1), local,
                                   first_position + piece_begin(p), spec, proportion_of,
                                   scratch[worker]);
    });
    for (index_t p = 1; p < pieces; ++p) {
      const LinearCarry<T> local = slot(p);
      reference::linear_append_carry<T>(
          carry, {local.memory, local.normaliser, local.memory_low, local.normaliser_low}, E, Dv);
    }
  }
}

/// One decode step for every (b, h) at absolute position `position` (eq. 4);
/// allocation-free. proportion_of(side, b, h, phi) gives the proportions;
/// `scratch` holds step_scratch_size(spec) values.
[[nodiscard]] inline index_t step_scratch_size(const LinearSpec& spec) noexcept {
  return 2 * spec.feature_dim + 4 * spec.expanded_dim();
}

template <FeatureMap Map, Reweight Rw, Positional Pos, Real T, class ProportionOf, class CarryOf>
void linear_causal_step(TensorView<const T, 3> q, TensorView<const T, 3> k,
                        TensorView<const T, 3> v, TensorView<T, 3> out, const LinearSpec& spec,
                        std::int64_t position, ProportionOf&& proportion_of, CarryOf&& carry_of,
                        T* scratch) noexcept {
  const index_t B = q.extent(0), H = q.extent(1), F = spec.feature_dim;
  const index_t E = spec.expanded_dim(), Dv = spec.value_dim, pairs = F / 2;
  const bool separate = separate_denominator<Pos>(spec);
  T* phi = scratch;
  T* cos_sin = scratch + F;  // [pairs][cos, sin]
  T *kn = scratch + 2 * F, *kd = kn + E, *qn = kd + E, *qd = qn + E;
  // R^p phi(x) with the cos/sin of this position, formed once per head.
  struct Rotate {
    const T* table;
    index_t pairs;
    void rotate(T* row, bool) const noexcept {
      for (index_t i = 0; i < pairs; ++i) {
        const T c = table[2 * i], s = table[2 * i + 1];
        const T x = row[2 * i], y = row[2 * i + 1];
        row[2 * i] = c * x - s * y;
        row[2 * i + 1] = s * x + c * y;
      }
    }
  };
  for (index_t h = 0; h < H; ++h) {
    if constexpr (Pos::rotates_queries_keys) {
      const double* theta = spec.theta(h);
      for (index_t i = 0; i < pairs; ++i) {
        const CosSin cs = rotation_cos_sin(position, theta[i]);
        cos_sin[2 * i] = static_cast<T>(cs.cos);
        cos_sin[2 * i + 1] = static_cast<T>(cs.sin);
      }
    }
    const Rotate rotation{cos_sin, pairs};
    for (index_t b = 0; b < B; ++b) {
      const LinearCarry<T> carry = carry_of(b, h);
      auto features = [&](const T* x, Side side, T* numerator, T* denominator) {
        feature_map_row<Map>(x, spec.key_dim, phi, F);
        T weight[2] = {T(1), T(1)};
        if constexpr (Rw::streams == 2)
          cos_reweight_streams(proportion_of(side, b, h, static_cast<const T*>(phi)), weight);
        if constexpr (Pos::rotates_queries_keys) {
          if (denominator)
            for (index_t s = 0; s < Rw::streams; ++s)
              for (index_t f = 0; f < F; ++f) denominator[s * F + f] = weight[s] * phi[f];
          rotation.rotate(phi, true);
        }
        for (index_t s = 0; s < Rw::streams; ++s)
          for (index_t f = 0; f < F; ++f) numerator[s * F + f] = weight[s] * phi[f];
      };
      features(k.row(b, h), Side::key, kn, separate ? kd : nullptr);
      features(q.row(b, h), Side::query, qn, separate ? qd : nullptr);
      T* o = out.row(b, h);
      if (!carry.compensated()) {
        absorb_read<T>(carry.memory, kn, nullptr, qn, nullptr, v.row(b, h), nullptr, o, nullptr,
                       E, Dv);
        const T denominator =
            absorb_read_normaliser(carry.normaliser, separate ? kd : kn, separate ? qd : qn, E);
        normalise(o, Dv, denominator, spec.normaliser);
        continue;
      }
      // Compensated (compensated_sums.hpp): the term goes to the low parts,
      // reads take fl(hi + lo), the pairs renormalised every fold_tokens positions.
      pairs_update_and_read(carry.memory, carry.memory_low, static_cast<const T*>(nullptr), kn, qn,
                            v.row(b, h), o, E, Dv, false);
      const T *key_d = separate ? kd : kn, *query_d = separate ? qd : qn;
      T denominator = 0;
      for (index_t e = 0; e < E; ++e) {
        carry.normaliser_low[e] += key_d[e];
        denominator += query_d[e] * (carry.normaliser[e] + carry.normaliser_low[e]);
      }
      normalise(o, Dv, denominator, spec.normaliser);
      if ((position + 1) % fold_tokens == 0) {
        renormalise_pairs(carry.memory, carry.memory_low, E * Dv);
        renormalise_pairs(carry.normaliser, carry.normaliser_low, E);
      }
    }
  }
}

// ------------------------------------------------------- bidirectional --

/// Bidirectional linear attention of queries [B, T, H, Dk] over keys
/// [B, S, H, Dk] and values [B, S, H, Dv] (S = T for self-attention):
/// S = E_K^T V, z = 1^T E'_K, then O = E_Q S / N(E'_Q z). Query t sits at
/// position t, key s at position s (as reference::linear_bidirectional_forward).
template <FeatureMap Map, Reweight Rw, Positional Pos, Real T, class ProportionOf>
void linear_bidirectional_forward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                                  TensorView<const T, 4> v, TensorView<T, 4> out,
                                  const LinearSpec& spec, ProportionOf&& proportion_of) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), Sn = k.extent(1);
  const index_t E = spec.expanded_dim(), Dv = spec.value_dim, heads = B * H;
  if (Tn == 0 || heads == 0) return;
  const bool separate = separate_denominator<Pos>(spec);
  const double work = double(heads) * double(Tn + Sn) * double(E) * double(Dv);
  const int workers = work >= 1 << 18 ? thread_count() : 1;
  // With fewer heads than workers, the source and the queries are split in
  // `parts` ranges each, one per worker (partial sums of S, z reduced in between).
  const index_t parts = heads >= workers ? 1 : workers;
  const index_t carry_size = E * Dv + E;
  std::vector<LinearScratch<T>> scratch(static_cast<std::size_t>(workers),
                                        LinearScratch<T>(spec, linear_block));
  AlignedVector<T> storage(static_cast<std::size_t>((parts == 1 ? workers : parts) * carry_size));
  auto carry_at = [&](index_t slot) {
    T* base = storage.data() + slot * carry_size;
    return LinearCarry<T>{base, base + E * Dv};
  };
  auto absorb = [&](index_t b, index_t h, index_t s0, index_t s1, LinearCarry<T> carry,
                    LinearScratch<T>& s) {
    reference::linear_reset(carry, E, Dv);
    absorb_segment<Map, Rw, Pos>(k, v, b, h, s0, s1, carry, s0, spec, proportion_of, s);
  };
  auto read = [&](index_t b, index_t h, index_t t0, index_t t1, LinearCarry<T> carry,
                  LinearScratch<T>& s) {
    seek_rotation<Pos>(s, spec, h, t0);
    for (index_t c0 = t0; c0 < t1; c0 += linear_block) {
      const index_t n = std::min(linear_block, t1 - c0);
      prefetch_next_block(b, h, c0, linear_block, t1, q, out);
      block_features<Map, Rw, Pos>(&q, static_cast<const TensorView<const T, 4>*>(nullptr), b, h, c0, n, c0, spec, proportion_of, s);
      const T* qd = separate ? s.query_denominator.data() : s.query_numerator.data();
      // Each row's 1 / n_t (normalise's factor), then o = diag(1 / n) E_Q S through
      // the register-tiled read (block_contractions.hpp; an Eigen GEMM into the
      // strided rows packed its operands and cleared the rows first: with the
      // Eigen absorb below, the forward went 29.0 -> 24.6 ms at B1 H8 E64 D64,
      // T = 16K, 2 threads).
      for (index_t r = 0; r < n; ++r)
        s.denominator[r] = T(1) / spec.normaliser.apply(dot(qd + r * E, carry.normaliser, E));
      read_memory_rows(s.query_numerator.data(), n, E, carry.memory, Dv, out.row(b, c0, h),
                       out.stride(1), s.denominator.data());  // scaled by 1 / n_t
    }
  };
  if (parts == 1) {
    parallel_for(heads, workers, [&](index_t i, int worker) {
      const index_t b = i / H, h = i % H;
      const LinearCarry<T> carry = carry_at(worker);
      absorb(b, h, 0, Sn, carry, scratch[worker]);
      read(b, h, 0, Tn, carry, scratch[worker]);
    });
    return;
  }
  for (index_t i = 0; i < heads; ++i) {
    const index_t b = i / H, h = i % H;
    parallel_for(parts, workers, [&](index_t p, int worker) {
      absorb(b, h, p * Sn / parts, (p + 1) * Sn / parts, carry_at(p), scratch[worker]);
    });
    T* total = carry_at(0).memory;
    for (index_t p = 1; p < parts; ++p) {
      const T* part = carry_at(p).memory;
      for (index_t x = 0; x < carry_size; ++x) total[x] += part[x];
    }
    parallel_for(parts, workers, [&](index_t p, int worker) {
      read(b, h, p * Tn / parts, (p + 1) * Tn / parts, carry_at(0), scratch[worker]);
    });
  }
}

}  // namespace latte::cpu
