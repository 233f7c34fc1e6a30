#pragma once
// CUDA kernels for exact softmax attention (DESIGN §3.1): the baseline, with
// the causal mask and FlashAttention's sliding window, and its KV-cache decode.
//
// One warp per query row, online softmax over groups of 32 keys: lane j scores
// key s0 + j (q in shared memory), the warp takes the group's maximum, rescales
// its running sums by exp(m_old - m_new) and accumulates p_j v_{s0+j} with the
// output row spread over the lanes (Dv <= 256). Simple and exact; no tensor
// cores (the fast softmax peer is PyTorch SDPA, run by scripts/gpu-check.sh).
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "latte/backends/cuda/device.cuh"
#include "latte/backends/cuda/launch_plan.hpp"
#include "latte/core/shape_check.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/policies/window.hpp"

namespace latte::cuda {

/// A KV cache in device memory, in KVCache<T>'s layout: keys [B, H, capacity, Dk],
/// values [B, H, capacity, Dv], token at absolute position p in slot p % capacity.
template <class T>
struct KVDeviceCache {
  T* keys = nullptr;
  T* values = nullptr;
  index_t capacity = 0;
};

namespace kernels {

/// The running (maximum, sum, output) of one warp's online softmax.
template <int Slots>
struct OnlineRow {
  float m = kNegInf;
  float total = 0.f;
  float acc[Slots] = {};

  /// Absorbs one group of up to 32 keys: lane j holds score_j (-inf when absent);
  /// value_of(j) is the value row of key j of the group.
  template <class T, class ValueOf>
  __device__ void absorb(float score, int count, int Dv, const ValueOf& value_of) {
    const int lane = threadIdx.x % 32;
    const float m_new = fmaxf(m, warp_max(score));
    if (m_new == kNegInf) return;  // warp-uniform
    const float p = score == kNegInf ? 0.f : expf(score - m_new);
    const float rescale = expf(m - m_new);  // m = -inf: 0
    total = total * rescale + warp_sum(p);
#pragma unroll
    for (int j = 0; j < Slots; ++j) acc[j] *= rescale;
    for (int jj = 0; jj < count; ++jj) {
      const float pj = __shfl_sync(0xffffffffu, p, jj);
      const T* value = value_of(jj);
#pragma unroll
      for (int j = 0; j < Slots; ++j) {
        const int d = lane + 32 * j;
        if (d < Dv) acc[j] = fmaf(pj, to_float(value[d]), acc[j]);
      }
    }
    m = m_new;
  }
};

/// Query row blockIdx.x * 8 + warp of head (blockIdx.z, blockIdx.y) attends keys
/// [t - left, t + right] (a negative side is unbounded), capped at t when causal.
template <class T, int Slots>
__global__ void __launch_bounds__(256)
    softmax_forward_kernel(View4<const T> q, View4<const T> k, View4<const T> v, View4<T> out,
                           long long Tn, int Dk, int Dv, float scale, bool causal,
                           long long left, long long right) {
  float* const smem = dynamic_shared_floats();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long long t = static_cast<long long>(blockIdx.x) * 8 + warp;
  const long long h = blockIdx.y, b = blockIdx.z;
  if (t >= Tn) return;  // whole warps only; no block barrier below
  float* qs = smem + warp * Dk;
  const T* q_row = q.row(b, t, h);
  for (int d = lane; d < Dk; d += 32) qs[d] = to_float(q_row[d]);
  __syncwarp();
  const long long lo = left < 0 ? 0 : (t - left > 0 ? t - left : 0);
  // right compared with the distance to the end, never added to t: right may be near INT64_MAX
  long long hi = right < 0 || right >= Tn - 1 - t ? Tn - 1 : t + right;
  if (causal && hi > t) hi = t;
  OnlineRow<Slots> row;
  for (long long s0 = lo; s0 <= hi; s0 += 32) {
    const long long s = s0 + lane;
    float score = kNegInf;
    if (s <= hi) {
      const T* key = k.row(b, s, h);
      float dot = 0.f;
      for (int d = 0; d < Dk; ++d) dot = fmaf(qs[d], to_float(key[d]), dot);
      score = scale * dot;
    }
    const int count = static_cast<int>(hi - s0 + 1 < 32 ? hi - s0 + 1 : 32);
    row.template absorb<T>(score, count, Dv, [&](int j) { return v.row(b, s0 + j, h); });
  }
  T* o = out.row(b, t, h);
  const float inverse = row.total > 0.f ? 1.f / row.total : 0.f;
#pragma unroll
  for (int j = 0; j < Slots; ++j) {
    const int d = lane + 32 * j;
    if (d < Dv) o[d] = from_float<T>(row.acc[j] * inverse);
  }
}

/// One decode step for head (blockIdx.y, blockIdx.x): stores (k, v) at slot
/// position % capacity, then attends over the `visible` most recent tokens,
/// split over the 8 warps (each an online softmax over its groups of 32) and
/// merged at the end.
template <class T, int Slots>
__global__ void __launch_bounds__(256)
    softmax_step_kernel(View4<const T> q, View4<const T> k, View4<const T> v, View4<T> out,
                        KVDeviceCache<T> cache, int Dk, int Dv, float scale, long long position,
                        long long visible) {
  float* const smem = dynamic_shared_floats();
  float* qs = smem;                 // [Dk]
  float* partial = qs + Dk;         // [8][Dv]
  float* partial_m = partial + 8 * Dv;
  float* partial_total = partial_m + 8;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long long h = blockIdx.x, b = blockIdx.y, H = gridDim.x, head = b * H + h;
  const long long capacity = cache.capacity;
  T* keys = cache.keys + head * capacity * Dk;
  T* values = cache.values + head * capacity * Dv;
  const long long slot = position % capacity;
  const T* k_row = k.row(b, 0, h);
  const T* v_row = v.row(b, 0, h);
  const T* q_row = q.row(b, 0, h);
  for (int d = threadIdx.x; d < Dk; d += blockDim.x) {
    keys[slot * Dk + d] = k_row[d];
    qs[d] = to_float(q_row[d]);
  }
  for (int d = threadIdx.x; d < Dv; d += blockDim.x) values[slot * Dv + d] = v_row[d];
  __syncthreads();  // the new token is read back below by other threads of this block
  const long long oldest = position + 1 - visible;
  OnlineRow<Slots> row;
  for (long long j0 = static_cast<long long>(warp) * 32; j0 < visible; j0 += 8 * 32) {
    const long long j = j0 + lane;
    float score = kNegInf;
    if (j < visible) {
      const T* key = keys + ((oldest + j) % capacity) * Dk;
      float dot = 0.f;
      for (int d = 0; d < Dk; ++d) dot = fmaf(qs[d], to_float(key[d]), dot);
      score = scale * dot;
    }
    const int count = static_cast<int>(visible - j0 < 32 ? visible - j0 : 32);
    row.template absorb<T>(score, count, Dv,
                           [&](int jj) { return values + ((oldest + j0 + jj) % capacity) * Dv; });
  }
#pragma unroll
  for (int s = 0; s < Slots; ++s) {
    const int d = lane + 32 * s;
    if (d < Dv) partial[warp * Dv + d] = row.acc[s];
  }
  if (lane == 0) {
    partial_m[warp] = row.m;
    partial_total[warp] = row.total;
  }
  __syncthreads();
  float top = kNegInf;
  for (int w = 0; w < 8; ++w) top = fmaxf(top, partial_m[w]);
  float total = 0.f;
  for (int w = 0; w < 8; ++w)
    if (partial_m[w] != kNegInf) total += partial_total[w] * expf(partial_m[w] - top);
  T* o = out.row(b, 0, h);
  for (int d = threadIdx.x; d < Dv; d += blockDim.x) {
    float acc = 0.f;
    for (int w = 0; w < 8; ++w)
      if (partial_m[w] != kNegInf) acc += partial[w * Dv + d] * expf(partial_m[w] - top);
    o[d] = from_float<T>(total > 0.f ? acc / total : 0.f);
  }
}

}  // namespace kernels

/// The window's sides for the kernels: -1 = unbounded.
template <Window Win>
[[nodiscard]] std::pair<long long, long long> window_sides(const Win& window) {
  if constexpr (std::is_same_v<Win, SlidingWindow>) return {window.left, window.right};
  else {
    static_assert(std::is_same_v<Win, NoWindow>,
                  "exec::cuda softmax takes NoWindow or SlidingWindow (a user-defined window "
                  "runs on exec::cpu / exec::reference)");
    return {-1, -1};
  }
}

template <int Slots, class Call>
void with_value_slots(int slots, Call&& call) {
  if constexpr (Slots > 8) {
    (void)slots;
  } else {
    if (slots == Slots) call(std::integral_constant<int, Slots>{});
    else with_value_slots<Slots * 2>(slots, call);
  }
}

/// Whole-sequence softmax attention on `stream` over validated device views.
template <bool Causal, Window Win, DeviceElement T>
void softmax_forward(cudaStream_t stream, TensorView<const T, 4> q, TensorView<const T, 4> k,
                     TensorView<const T, 4> v, TensorView<T, 4> out, float scale,
                     const Win& window) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), Dk = q.extent(3);
  const index_t Dv = v.extent(3);
  const std::pair<long long, long long> sides = window_sides(window);
  const long long left = sides.first, right = sides.second;  // (a lambda below uses them)
  if (B == 0 || Tn == 0) return;
  const SoftmaxPlan plan = plan_softmax(B, Tn, H, Dk, Dv, shared_memory_limit());
  with_value_slots<1>(plan.value_slots, [&](auto slots) {
    auto kernel = kernels::softmax_forward_kernel<T, decltype(slots)::value>;
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(plan.smem)),
          "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
    launch(kernel, dim3(plan.grid.x, plan.grid.y, plan.grid.z), 256, plan.smem, stream,
        device_view(q), device_view(k), device_view(v), device_view(out), Tn,
        static_cast<int>(Dk), static_cast<int>(Dv), scale, Causal, left, right);
  });
  check_launch("softmax_forward_kernel");
}

/// One KV-cache decode step at absolute `position` over [B, H, *] device views:
/// the token is stored in `cache` and the query attends over the `visible` most
/// recent tokens (position + 1, or the window's left + 1).
template <DeviceElement T>
void softmax_step(cudaStream_t stream, TensorView<const T, 3> q, TensorView<const T, 3> k,
                  TensorView<const T, 3> v, TensorView<T, 3> out, KVDeviceCache<T> cache,
                  float scale, long long position, long long visible) {
  const index_t B = q.extent(0), H = q.extent(1), Dk = q.extent(2), Dv = v.extent(2);
  detail::check_shape(q, "queries", {B, H, Dk}, "[B, H, Dk]");
  detail::check_shape(k, "keys", {B, H, Dk}, "[B, H, Dk]");
  detail::check_shape(v, "values", {B, H, Dv}, "[B, H, Dv]");
  detail::check_shape(out, "out", {B, H, Dv}, "[B, H, Dv]");
  detail::require(cache.keys && cache.values && cache.capacity >= 1, "state",
                  "a device KV cache needs keys, values and capacity >= 1");
  detail::require(position >= 0 && visible >= 1 && visible <= position + 1 &&
                      visible <= cache.capacity,
                  "state",
                  detail::expected_given("visible tokens", "1 ..= min(position + 1, capacity)",
                                         visible));
  if (B == 0) return;
  const Dim3 grid = plan_step(B, H);
  const int slots = softmax_value_slots(Dv);
  const std::size_t smem = softmax_step_floats(Dk, Dv) * sizeof(float);
  with_value_slots<1>(slots, [&](auto value_slots) {
    auto kernel = kernels::softmax_step_kernel<T, decltype(value_slots)::value>;
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem)),
          "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
    launch(kernel, dim3(grid.x, grid.y, grid.z), 256, smem, stream,
        device_view(q), device_view(k), device_view(v), device_view(out), cache,
        static_cast<int>(Dk), static_cast<int>(Dv), scale, position, visible);
  });
  check_launch("softmax_step_kernel");
}

}  // namespace latte::cuda
