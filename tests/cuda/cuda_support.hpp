#pragma once
// Helpers of the CUDA tests: the no-GPU skip, device buffers filled from host
// tensors (converted to fp16 / bf16 when asked) and read back as float.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <type_traits>
#include <vector>

#include "latte/backends/cuda/error.hpp"
#include "support.hpp"

namespace latte::test {

/// Exit code CTest maps to SKIPPED (SKIP_RETURN_CODE in tests/cuda/CMakeLists.txt).
inline constexpr int kSkipReturnCode = 77;

/// True where these tests run on tests/cuda_host's emulation of CUDA (one host
/// thread per CUDA thread, on CI's two cores) rather than on a GPU.
#if defined(LATTE_CUDA_HOST_EMULATION)
inline constexpr bool kEmulated = true;
#else
inline constexpr bool kEmulated = false;
#endif

/// The cost budget T^2 B H (Dk + Dv) of a random case: the GPU run's, or a small
/// one on the emulation (T up to ~40 at a few heads), where every barrier wakes
/// 256 host threads.
inline constexpr double kCaseBudget = kEmulated ? 3e5 : 6e7;

/// `gpu` on a GPU, `emulated` on the emulation: a fixed case's size.
inline constexpr index_t gpu_or_emulated(index_t gpu, index_t emulated) {
  return kEmulated ? emulated : gpu;
}

/// True when a CUDA device can run kernels; otherwise prints why the test skips.
inline bool cuda_device_present(const char* test_name) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status == cudaSuccess && count > 0) return true;
  std::printf("SKIPPED %s: no CUDA device (%s). The CUDA kernels were compiled; "
              "scripts/gpu-check.sh runs them on a GPU machine.\n",
              test_name,
              status == cudaSuccess ? "cudaGetDeviceCount returned 0" : cudaGetErrorString(status));
  return false;
}

template <class T>
inline T to_element(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else if constexpr (std::is_same_v<T, __half>) return __float2half_rn(x);
  else return __float2bfloat16_rn(x);
}
template <class T>
inline float from_element(T x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else if constexpr (std::is_same_v<T, __half>) return __half2float(x);
  else return __bfloat162float(x);
}

/// `x` rounded to T and back: the values a T-input kernel actually sees, from
/// which its oracle is computed.
template <class T, std::size_t N>
Tensor<float, N> rounded_to(const Tensor<float, N>& x) {
  Tensor<float, N> y(x.extents());
  for (index_t i = 0; i < x.size(); ++i) y.data()[i] = from_element(to_element<T>(x.data()[i]));
  return y;
}

/// An owning device array of T.
template <class T>
class DeviceArray {
 public:
  explicit DeviceArray(std::size_t count) : count_(count) {
    if (count) cuda::check(cudaMalloc(reinterpret_cast<void**>(&data_), count * sizeof(T)), "cudaMalloc");
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() { cudaFree(data_); }
  [[nodiscard]] T* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return count_; }

  void upload(const std::vector<T>& host) {
    cuda::check(cudaMemcpy(data_, host.data(), count_ * sizeof(T), cudaMemcpyHostToDevice),
                "cudaMemcpy H2D");
  }
  [[nodiscard]] std::vector<T> download() const {
    std::vector<T> host(count_);
    cuda::check(cudaMemcpy(host.data(), data_, count_ * sizeof(T), cudaMemcpyDeviceToHost),
                "cudaMemcpy D2H");
    return host;
  }
  void fill_bytes(int byte) { cuda::check(cudaMemset(data_, byte, count_ * sizeof(T)), "cudaMemset"); }

 private:
  T* data_ = nullptr;
  std::size_t count_ = 0;
};

/// A host float tensor copied to the device as T, with its view.
template <class T, std::size_t N>
struct DeviceTensor {
  std::array<index_t, N> extents;
  DeviceArray<T> array;

  explicit DeviceTensor(const Tensor<float, N>& host)
      : extents(host.extents()), array(static_cast<std::size_t>(host.size())) {
    std::vector<T> converted(array.size());
    for (index_t i = 0; i < host.size(); ++i) converted[i] = to_element<T>(host.data()[i]);
    array.upload(converted);
  }
  explicit DeviceTensor(const std::array<index_t, N>& shape)
      : extents(shape), array(static_cast<std::size_t>(Tensor<float, N>(shape).size())) {
    array.fill_bytes(0xff);  // NaN pattern: an element the kernel forgets shows up
  }
  [[nodiscard]] TensorView<T, N> view() { return {array.data(), extents}; }
  [[nodiscard]] TensorView<const T, N> cview() const { return {array.data(), extents}; }
  [[nodiscard]] Tensor<float, N> to_host() const {
    Tensor<float, N> host(extents);
    const std::vector<T> values = array.download();
    for (index_t i = 0; i < host.size(); ++i) host.data()[i] = from_element(values[i]);
    return host;
  }
};

inline void synchronize() { cuda::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }

}  // namespace latte::test
