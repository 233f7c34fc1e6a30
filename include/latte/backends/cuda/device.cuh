#pragma once
// What every CUDA kernel of latte shares: the element types it reads (fp32, fp16,
// bf16; accumulation is always fp32), a strided view of device memory, the
// VAPOR/RoPE rotation with its angle reduced exactly, a stream-ordered
// workspace and the device's shared-memory limit.
// Compiled by nvcc (see LATTE_CUDA_KERNELS in policies/execution.hpp), or, for
// latte's own tests, as host C++ against tests/cuda_host/'s emulation of CUDA
// (LATTE_CUDA_HOST_EMULATION): every launch goes through launch() and every
// kernel's dynamic shared memory through dynamic_shared_floats(), the two places
// where the emulation steps in.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "latte/backends/cuda/error.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"

namespace latte::cuda {

/// Input/output element types of the CUDA kernels.
template <class T>
concept DeviceElement = std::same_as<std::remove_const_t<T>, float> ||
                        std::same_as<std::remove_const_t<T>, __half> ||
                        std::same_as<std::remove_const_t<T>, __nv_bfloat16>;
/// The half-width ones (no CPU path takes them).
template <class T>
concept HalfElement = DeviceElement<T> && !std::same_as<std::remove_const_t<T>, float>;

template <DeviceElement T>
constexpr const char* element_name() noexcept {
  if constexpr (std::same_as<std::remove_const_t<T>, float>) return "float32";
  else if constexpr (std::same_as<std::remove_const_t<T>, __half>) return "float16";
  else return "bfloat16";
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T>
__device__ __forceinline__ T from_float(float x) {
  if constexpr (std::same_as<T, float>) return x;
  else if constexpr (std::same_as<T, __half>) return __float2half_rn(x);
  else return __float2bfloat16_rn(x);
}

/// A [B, T, H, D] (or [B, H, D] with st = 0) view of device memory, feature dim contiguous.
template <class T>
struct View4 {
  T* data;
  long long sb, st, sh;
  __device__ __forceinline__ T* row(long long b, long long t, long long h) const {
    return data + b * sb + t * st + h * sh;
  }
};

template <class T>
View4<T> device_view(const TensorView<T, 4>& v) {
  return {v.data(), static_cast<long long>(v.stride(0)), static_cast<long long>(v.stride(1)),
          static_cast<long long>(v.stride(2))};
}
/// A [B, H, D] step view as a View4 with one time step.
template <class T>
View4<T> device_view(const TensorView<T, 3>& v) {
  return {v.data(), static_cast<long long>(v.stride(0)), 0, static_cast<long long>(v.stride(1))};
}

/// cos and sin of position * theta, the angle reduced modulo 2 pi in double-double:
/// the product is split exactly with an FMA (hi + lo), and 2 pi into two doubles,
/// so the reduced angle is accurate to ~1e-15 rad even at position 10^7 (the CPU
/// path reaches the same with long double, core/angles.hpp).
__device__ __forceinline__ void rotation_cos_sin(long long position, double theta, float& c,
                                                 float& s) {
  constexpr double two_pi_hi = 6.283185307179586232;     // nearest double to 2 pi
  constexpr double two_pi_lo = 2.4492935982947064e-16;   // 2 pi - two_pi_hi
  constexpr double inv_two_pi = 0.15915494309189533577;
  const double p = static_cast<double>(position);  // exact below 2^53
  const double hi = p * theta;
  const double lo = fma(p, theta, -hi);
  const double n = rint(hi * inv_two_pi);
  double r = fma(-n, two_pi_hi, hi);
  r = fma(-n, two_pi_lo, r) + lo;
  double sd, cd;
  sincos(r, &sd, &cd);
  c = static_cast<float>(cd);
  s = static_cast<float>(sd);
}

/// Rotates the pair (x, y) by position * theta (R^position of VAPOR / RoPE).
__device__ __forceinline__ void rotate_pair(float& x, float& y, long long position, double theta) {
  float c, s;
  rotation_cos_sin(position, theta, c, s);
  const float rx = c * x - s * y, ry = s * x + c * y;
  x = rx;
  y = ry;
}

/// A stream-ordered device buffer (cudaMallocAsync / cudaFreeAsync): freed when
/// the work queued before its end has run, so a forward allocates no memory
/// that outlives it and never synchronises.
template <class T>
class Workspace {
 public:
  Workspace(std::size_t count, cudaStream_t stream) : stream_(stream) {
    if (count == 0) return;
    check(cudaMallocAsync(reinterpret_cast<void**>(&data_), count * sizeof(T), stream),
          "cudaMallocAsync of the workspace");
  }
  /// A device copy of `host` (e.g. VAPOR's angle table).
  Workspace(const std::vector<T>& host, cudaStream_t stream) : Workspace(host.size(), stream) {
    if (host.empty()) return;
    check(cudaMemcpyAsync(data_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice,
                          stream),
          "cudaMemcpyAsync of the angle table");
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  ~Workspace() {
    if (data_) cudaFreeAsync(data_, stream_);  // errors surface at the caller's next sync
  }
  [[nodiscard]] T* data() const noexcept { return data_; }

 private:
  T* data_ = nullptr;
  cudaStream_t stream_;
};

/// The current device's opt-in shared memory per block (bytes).
inline std::size_t shared_memory_limit() {
  int device = 0, bytes = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
        "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
  return static_cast<std::size_t>(bytes);
}

inline cudaStream_t stream_of(void* stream) { return static_cast<cudaStream_t>(stream); }

__device__ __forceinline__ float warp_max(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

inline constexpr float kNegInf = -__builtin_huge_valf();

/// kernel<<<grid, block, shared_bytes, stream>>>(args...): the one launch point of
/// the CUDA backend (under the tests' host emulation, the emulated grid).
template <class... Params, class... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t shared_bytes,
            cudaStream_t stream, Args&&... args) {
#if defined(LATTE_CUDA_HOST_EMULATION)
  latte_cuda_emulation::launch(kernel, grid, block, shared_bytes, stream,
                               std::forward<Args>(args)...);
#else
  kernel<<<grid, block, shared_bytes, stream>>>(std::forward<Args>(args)...);
#endif
}

/// The running block's dynamic shared memory (the launch's shared_bytes), as
/// floats: one accessor instead of an `extern __shared__` in each kernel.
__device__ __forceinline__ float* dynamic_shared_floats() {
#if defined(LATTE_CUDA_HOST_EMULATION)
  return latte_cuda_emulation::dynamic_shared<float>();
#else
  extern __shared__ float latte_dynamic_shared[];
  return latte_dynamic_shared;
#endif
}

}  // namespace latte::cuda
