#pragma once
// Host-side launch planning for the CUDA kernels: chunk size, grid sizes,
// shared memory and workspace. Plain C++ (no CUDA headers) so that the planning
// is unit-tested on machines without a GPU; the .cuh launchers only read a plan.
//
// Latte causal (DESIGN §5, two passes + scan):
//   1. latte_chunk_states   grid (chunks, H, B): each chunk's local (m, alpha, vtilde)
//   2. latte_scan           grid (ceil(L (Dv + 1) / 256), H, B): incoming state of every chunk
//   3. latte_chunk_outputs  grid (chunks, H, B): outputs of every chunk from its incoming state
// Bidirectional replaces 3 with latte_read (grid (chunks, H, B)) over the final state.
#include <algorithm>
#include <cstddef>
#include <string>

#include "latte/core/error.hpp"
#include "latte/core/types.hpp"

namespace latte::cuda {

/// Threads per block of every latte kernel (8 warps).
inline constexpr int kBlockThreads = 256;
/// CUDA's limit on grid.y and grid.z (heads and batch).
inline constexpr index_t kMaxGridYZ = 65535;
/// Softmax kernels keep a query row's output in registers, 32 lanes x up to 8 values.
inline constexpr index_t kMaxSoftmaxValueDim = 256;

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

/// How a Latte forward is cut and launched.
struct LattePlan {
  index_t chunk = 0;                ///< C: tokens per chunk
  index_t chunks = 0;               ///< ceil(T / C)
  std::size_t states_smem = 0;      ///< bytes of dynamic shared memory, latte_chunk_states
  std::size_t outputs_smem = 0;     ///< latte_chunk_outputs
  std::size_t read_smem = 0;        ///< latte_read (bidirectional)
  std::size_t workspace_floats = 0; ///< per-chunk states: B H chunks L (3 + Dv)
  Dim3 chunk_grid;                  ///< (chunks, H, B)
  Dim3 scan_grid;                   ///< (ceil(L (Dv + 1) / 256), H, B)
};

/// Shared-memory floats of the chunk-output kernel for chunk C: k/E, p(l|t)/den
/// and reference max / carry weight (3 C (L + 1): rows padded by one float so
/// that threads reading one latent of consecutive rows hit distinct banks),
/// rotated values C Dv, A (C x C), the incoming memory L Dv and four L-vectors.
[[nodiscard]] constexpr std::size_t latte_outputs_floats(index_t C, index_t L, index_t Dv) {
  return static_cast<std::size_t>(3 * C * (L + 1) + C * Dv + C * C + L * Dv + 4 * L);
}
/// Chunk-state kernel: k/E (C L), rotated values (C Dv).
[[nodiscard]] constexpr std::size_t latte_states_floats(index_t C, index_t L, index_t Dv) {
  return static_cast<std::size_t>(C * L + C * Dv);
}
/// Read kernel: p(l|t) for C rows (C L), memory / alpha (L Dv).
[[nodiscard]] constexpr std::size_t latte_read_floats(index_t C, index_t L, index_t Dv) {
  return static_cast<std::size_t>(C * L + L * Dv);
}

/// Requires grid.y / grid.z to fit heads and batch.
inline void check_grid_yz(index_t batch, index_t heads) {
  detail::require(heads <= kMaxGridYZ, "dims.heads",
                  detail::expected_given("heads for exec::cuda", "<= 65535", heads));
  detail::require(batch <= kMaxGridYZ, "batch",
                  detail::expected_given("batch for exec::cuda", "<= 65535", batch));
}

/// The largest chunk in {64, 32, 16, 8} whose kernels fit `smem_limit` bytes of
/// shared memory per block (the device's opt-in limit: 227 KiB on H100).
/// Throws latte::Error when even C = 8 does not fit (L x Dv too large).
[[nodiscard]] inline LattePlan plan_latte(index_t B, index_t T, index_t H, index_t L, index_t Dv,
                                          std::size_t smem_limit) {
  check_grid_yz(B, H);
  for (index_t C : {64, 32, 16, 8}) {
    const std::size_t outputs = latte_outputs_floats(C, L, Dv) * sizeof(float);
    const std::size_t states = latte_states_floats(C, L, Dv) * sizeof(float);
    const std::size_t read = latte_read_floats(C, L, Dv) * sizeof(float);
    if (std::max({outputs, states, read}) > smem_limit) continue;
    LattePlan plan;
    plan.chunk = C;
    plan.chunks = (T + C - 1) / C;
    plan.states_smem = states;
    plan.outputs_smem = outputs;
    plan.read_smem = read;
    plan.workspace_floats = static_cast<std::size_t>(B * H * plan.chunks * L * (3 + Dv));
    plan.chunk_grid = {static_cast<unsigned>(plan.chunks), static_cast<unsigned>(H),
                       static_cast<unsigned>(B)};
    const index_t scan_threads = L * (Dv + 1);
    plan.scan_grid = {static_cast<unsigned>((scan_threads + kBlockThreads - 1) / kBlockThreads),
                      static_cast<unsigned>(H), static_cast<unsigned>(B)};
    return plan;
  }
  throw Error("dims", detail::expected_given(
                          "shared memory of the CUDA Latte kernels at chunk 8 (L = " +
                              std::to_string(L) + ", Dv = " + std::to_string(Dv) + "), bytes",
                          "<= " + std::to_string(smem_limit),
                          latte_outputs_floats(8, L, Dv) * sizeof(float)));
}

/// Softmax forward: one warp per query row, 8 rows per block.
struct SoftmaxPlan {
  int value_slots = 0;   ///< values per lane: ceil(Dv / 32) rounded up to 1, 2, 4 or 8
  std::size_t smem = 0;  ///< bytes: 8 query rows of Dk floats
  Dim3 grid;             ///< (ceil(T / 8), H, B)
};

[[nodiscard]] inline int softmax_value_slots(index_t Dv) {
  detail::require(Dv <= kMaxSoftmaxValueDim, "dims.value_dim",
                  detail::expected_given("value features for exec::cuda softmax", "<= 256", Dv));
  const index_t per_lane = (Dv + 31) / 32;
  return per_lane <= 1 ? 1 : per_lane <= 2 ? 2 : per_lane <= 4 ? 4 : 8;
}

[[nodiscard]] inline SoftmaxPlan plan_softmax(index_t B, index_t T, index_t H, index_t Dk,
                                              index_t Dv, std::size_t smem_limit) {
  check_grid_yz(B, H);
  SoftmaxPlan plan;
  plan.value_slots = softmax_value_slots(Dv);
  plan.smem = static_cast<std::size_t>(8 * Dk) * sizeof(float);
  detail::require(plan.smem <= smem_limit, "dims.key_dim",
                  detail::expected_given("key features for exec::cuda softmax",
                                         "<= " + std::to_string(smem_limit / 32), Dk));
  plan.grid = {static_cast<unsigned>((T + 7) / 8), static_cast<unsigned>(H),
               static_cast<unsigned>(B)};
  return plan;
}

/// Decode steps: one block of 256 threads per (batch, head).
[[nodiscard]] inline Dim3 plan_step(index_t B, index_t H) {
  check_grid_yz(B, H);
  return {static_cast<unsigned>(H), static_cast<unsigned>(B), 1};
}

/// Shared-memory floats of the Latte decode step: q, carry scale, weight and
/// gamma (4 L), the query's max and sum (2) and two value rows (2 Dv).
[[nodiscard]] constexpr std::size_t latte_step_floats(index_t L, index_t Dv) {
  return static_cast<std::size_t>(4 * L + 2 + 2 * Dv);
}
/// Softmax decode: the query (Dk) and per-warp partial outputs (8 Dv) and maxima/sums (16).
[[nodiscard]] constexpr std::size_t softmax_step_floats(index_t Dk, index_t Dv) {
  return static_cast<std::size_t>(Dk + 8 * Dv + 16);
}

}  // namespace latte::cuda
