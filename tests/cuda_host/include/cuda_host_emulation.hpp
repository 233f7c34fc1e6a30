#pragma once
// A host emulation of the part of the CUDA execution model latte's kernels use,
// for tests only (never installed, never on a user's include path): the CUDA
// tests in tests/cuda/ compile against it as plain C++ and run in CI, where no
// GPU is. Its cuda_runtime.h / cuda_fp16.h / cuda_bf16.h stand in for the
// toolkit's; the test targets define LATTE_CUDA_HOST_EMULATION, which makes
// latte's .cuh kernels exist in host C++ (core/config.hpp) and routes their
// launches and dynamic shared memory here (backends/cuda/device.cuh).
//
// What it models (docs/cuda-host-emulation.md says more):
//   - every CUDA thread of a block is its own host thread (not a fiber: TSan must
//     see the threads as concurrent, so a missing __syncthreads is a data race);
//     the blocks of a grid run one after another on those threads;
//   - __syncthreads as a block barrier; a thread that returns leaves it (as on
//     Volta and later); a divergent __syncthreads (threads of a block waiting at
//     different call sites) stops the program with both source lines;
//   - __shfl_sync / __shfl_xor_sync / __shfl_down_sync / __syncwarp over a
//     per-warp barrier; a mask that names an exited lane stops the program;
//   - dynamic shared memory of the launch's size, filled with NaN bytes (reads
//     of unwritten shared memory show), with the 48 KB default and the
//     cudaFuncSetAttribute(MaxDynamicSharedMemorySize) opt-in up to an H100's
//     227 KB enforced; launch-configuration errors reported as the runtime does
//     (cudaGetLastError: cudaErrorInvalidConfiguration, cudaErrorInvalidValue);
//   - cudaMalloc / cudaMemcpy / cudaMemset / streams / events as synchronous host
//     operations on 256-byte-aligned host memory;
//   - __half / __nv_bfloat16 with round-to-nearest-even conversions.
// What it does not: device math precision (expf, sincos here are the host libm's),
// timing, memory ordering beyond the barriers, atomics, cooperative groups,
// static __shared__ arrays, partial-warp shuffle masks.
#ifndef LATTE_CUDA_HOST_EMULATION
#error "tests/cuda_host/include is the CUDA host emulation of latte's tests: define LATTE_CUDA_HOST_EMULATION"
#endif

#include <atomic>
#include <barrier>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <semaphore>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

struct uint3 {
  unsigned x = 0, y = 0, z = 0;
};
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

// ------------------------------------------------------------ half types --

struct __half {
  std::uint16_t bits = 0;
};
struct __nv_bfloat16 {
  std::uint16_t bits = 0;
};

/// float -> binary16, round to nearest even (subnormals, overflow to inf, quiet NaN).
inline __half __float2half_rn(float value) {
  const std::uint32_t f = std::bit_cast<std::uint32_t>(value);
  const auto sign = static_cast<std::uint16_t>((f >> 16) & 0x8000u);
  const std::uint32_t a = f & 0x7fffffffu;
  if (a > 0x7f800000u) return {static_cast<std::uint16_t>(sign | 0x7e00u)};
  if (a >= 0x47800000u) return {static_cast<std::uint16_t>(sign | 0x7c00u)};  // >= 2^16
  std::uint32_t h = 0, rest = 0, tie = 0;
  if (a >= 0x38800000u) {  // a normal half: exponent rebiased by 127 - 15
    h = (((a >> 23) - 112u) << 10) | ((a & 0x7fffffu) >> 13);
    rest = a & 0x1fffu;
    tie = 0x1000u;
  } else if (a >= 0x33000000u) {  // a subnormal half, in units of 2^-24
    const std::uint32_t shift = 126u - (a >> 23), mantissa = (a & 0x7fffffu) | 0x800000u;
    h = mantissa >> shift;
    rest = mantissa & ((1u << shift) - 1u);
    tie = 1u << (shift - 1u);
  } else {
    return {sign};  // below 2^-25 (or 2^-25 itself, a tie to the even 0)
  }
  if (rest > tie || (rest == tie && (h & 1u))) ++h;  // a carry may reach inf: correct
  return {static_cast<std::uint16_t>(sign | h)};
}
inline float __half2float(__half value) {
  const std::uint32_t sign = static_cast<std::uint32_t>(value.bits & 0x8000u) << 16;
  const std::uint32_t exponent = (value.bits >> 10) & 0x1fu, mantissa = value.bits & 0x3ffu;
  if (exponent == 0x1fu) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}
/// float -> bfloat16, round to nearest even (quiet NaN kept).
inline __nv_bfloat16 __float2bfloat16_rn(float value) {
  const std::uint32_t f = std::bit_cast<std::uint32_t>(value);
  if ((f & 0x7fffffffu) > 0x7f800000u) return {static_cast<std::uint16_t>((f >> 16) | 0x40u)};
  return {static_cast<std::uint16_t>((f + 0x7fffu + ((f >> 16) & 1u)) >> 16)};
}
inline float __bfloat162float(__nv_bfloat16 value) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(value.bits) << 16);
}

// ------------------------------------------------------------ runtime API --

enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevicePointer = 17,
  cudaErrorInvalidDeviceFunction = 98,
};
using cudaError_t = cudaError;
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};
enum cudaDeviceAttr {
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
struct CUstream_st;
using cudaStream_t = CUstream_st*;
struct CUevent_st;
using cudaEvent_t = CUevent_st*;

namespace latte_cuda_emulation {

/// An H100's limits (compute capability 9.0).
inline constexpr std::size_t kDefaultSharedBytes = 48 * 1024;
inline constexpr std::size_t kOptInSharedBytes = 227 * 1024;
inline constexpr unsigned kMaxBlockThreads = 1024;

/// The emulated runtime's state: allocations, kernel attributes, the last error.
struct Runtime {
  std::mutex mutex;
  std::map<const void*, std::size_t> allocations;
  std::map<const void*, std::size_t> dynamic_shared_limit;  // kernel -> opted-in bytes
};
inline Runtime& runtime() {
  static Runtime instance;
  return instance;
}
inline thread_local cudaError_t last_error = cudaSuccess;
inline cudaError_t fail(cudaError_t error) {
  last_error = error;
  return error;
}

[[noreturn]] inline void abort_kernel(const char* what) {
  std::fprintf(stderr, "CUDA host emulation: %s (block %u,%u,%u thread %u,%u,%u)\n", what,
               blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z);
  std::fflush(stderr);
  std::abort();
}

/// Checks that every thread of a block reached the same __syncthreads.
struct SyncSiteCheck {
  std::vector<const char*>* files;
  std::vector<unsigned>* lines;
  std::vector<unsigned char>* exited;
  void operator()() noexcept {
    const char* file = nullptr;
    unsigned line = 0;
    for (std::size_t i = 0; i < lines->size(); ++i) {
      if ((*exited)[i]) continue;
      if (file == nullptr) {
        file = (*files)[i];
        line = (*lines)[i];
      } else if ((*lines)[i] != line || std::strcmp((*files)[i], file) != 0) {
        std::fprintf(stderr,
                     "CUDA host emulation: divergent __syncthreads: one thread waits at %s:%u, "
                     "thread %zu at %s:%u\n",
                     file, line, i, (*files)[i], (*lines)[i]);
        std::abort();
      }
    }
  }
};

struct Warp {
  explicit Warp(std::ptrdiff_t lanes) : barrier(lanes), present(lanes >= 32 ? ~0u : (1u << lanes) - 1u) {}
  std::barrier<> barrier;
  std::atomic<unsigned> present;
  // Two sets of slots, used in turn: a lane writes set p of exchange p after
  // every lane has passed exchange p - 1's barrier, so after every read of
  // set p from exchange p - 2. One barrier per shuffle.
  alignas(8) unsigned char slots[2][32][8] = {};
  unsigned parity[32] = {};
};

/// One block: its barrier, warps and dynamic shared memory.
struct Block {
  Block(unsigned threads, std::size_t shared_bytes)
      : sync_files(threads, nullptr),
        sync_lines(threads, 0),
        exited(threads, 0),
        sync(threads, SyncSiteCheck{&sync_files, &sync_lines, &exited}),
        shared(static_cast<unsigned char*>(
            ::operator new(shared_bytes ? shared_bytes : 16, std::align_val_t{16}))) {
    std::memset(shared.get(), 0xff, shared_bytes);  // NaN bytes: unwritten reads show
    for (unsigned first = 0; first < threads; first += 32)
      warps.push_back(std::make_unique<Warp>(std::min<unsigned>(32, threads - first)));
  }
  struct FreeAligned {
    void operator()(unsigned char* p) const { ::operator delete(p, std::align_val_t{16}); }
  };
  std::vector<const char*> sync_files;
  std::vector<unsigned> sync_lines;
  std::vector<unsigned char> exited;
  std::barrier<SyncSiteCheck> sync;
  std::vector<std::unique_ptr<Warp>> warps;
  std::unique_ptr<unsigned char, FreeAligned> shared;
};

inline thread_local Block* current_block = nullptr;
inline thread_local unsigned current_thread = 0;  // linear index in the block

inline unsigned lane() { return current_thread % 32; }
inline Warp& warp() { return *current_block->warps[current_thread / 32]; }

template <class T>
T* dynamic_shared() {
  if (current_block == nullptr) abort_kernel("dynamic shared memory read outside a kernel");
  return reinterpret_cast<T*>(current_block->shared.get());
}

inline void sync_threads(const char* file, unsigned line) {
  Block& block = *current_block;
  block.sync_files[current_thread] = file;
  block.sync_lines[current_thread] = line;
  block.sync.arrive_and_wait();
}

template <class V>
V exchange(unsigned mask, V value, unsigned source_lane) {
  static_assert(sizeof(V) <= 8 && std::is_trivially_copyable_v<V>);
  Warp& w = warp();
  const unsigned present = w.present.load();
  if (mask != present)
    abort_kernel("a warp shuffle whose mask is not the warp's live lanes");
  if (!(present >> (source_lane % 32) & 1u)) abort_kernel("a warp shuffle reads an exited lane");
  const unsigned set = w.parity[lane()];
  w.parity[lane()] ^= 1u;
  std::memcpy(w.slots[set][lane()], &value, sizeof(V));
  w.barrier.arrive_and_wait();
  V result;
  std::memcpy(&result, w.slots[set][source_lane % 32], sizeof(V));
  return result;
}

/// The host threads that play a block's CUDA threads, kept across launches
/// (creating 256 threads per launch would cost more than most emulated kernels).
/// Each thread waits on its own semaphore, so a launch wakes only its threads.
class ThreadPool {
 public:
  /// Runs job(0) .. job(count - 1), each on its own thread, and waits for all.
  void run(unsigned count, const std::function<void(unsigned)>& job) {
    std::lock_guard one_launch_at_a_time(launch_mutex_);
    while (workers_.size() < count) {
      auto worker = std::make_unique<Worker>();
      Worker* self = worker.get();
      worker->thread = std::thread([this, self, index = static_cast<unsigned>(workers_.size())] {
        for (;;) {
          self->start.acquire();
          if (stopping_) return;
          (*job_)(index);
          if (remaining_.fetch_sub(1) == 1) finished_.release();
        }
      });
      workers_.push_back(std::move(worker));
    }
    job_ = &job;
    remaining_ = count;
    for (unsigned i = 0; i < count; ++i) workers_[i]->start.release();
    finished_.acquire();
    job_ = nullptr;
  }
  ~ThreadPool() {
    stopping_ = true;
    for (auto& worker : workers_) worker->start.release();
    for (auto& worker : workers_) worker->thread.join();
  }

 private:
  struct Worker {
    std::binary_semaphore start{0};
    std::thread thread;
  };
  std::mutex launch_mutex_;
  std::vector<std::unique_ptr<Worker>> workers_;
  const std::function<void(unsigned)>* job_ = nullptr;
  std::atomic<unsigned> remaining_{0};
  std::binary_semaphore finished_{0};
  std::atomic<bool> stopping_{false};
};
inline ThreadPool& thread_pool() {
  static ThreadPool pool;
  return pool;
}

/// Runs kernel<<<grid, block, shared_bytes>>>(args...) to completion.
template <class... Params, class... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t shared_bytes,
            cudaStream_t, Args&&... args) {
  const unsigned long long threads = 1ull * block.x * block.y * block.z;
  if (threads == 0 || threads > kMaxBlockThreads || block.z > 64 || grid.x == 0 ||
      grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
    fail(cudaErrorInvalidConfiguration);
    return;
  }
  std::size_t limit = kDefaultSharedBytes;
  {
    std::lock_guard lock(runtime().mutex);
    const auto it = runtime().dynamic_shared_limit.find(reinterpret_cast<const void*>(kernel));
    if (it != runtime().dynamic_shared_limit.end()) limit = std::max(limit, it->second);
  }
  if (shared_bytes > limit) {
    fail(cudaErrorInvalidValue);  // what the runtime answers for too much dynamic shared memory
    return;
  }
  const std::tuple<std::decay_t<Params>...> parameters(std::forward<Args>(args)...);
  const unsigned count = static_cast<unsigned>(threads);
  const unsigned long long blocks = 1ull * grid.x * grid.y * grid.z;
  std::unique_ptr<Block> current;
  unsigned long long next = 0;
  bool done = false;
  uint3 block_index{};
  auto advance = [&]() noexcept {  // runs once per phase, all threads waiting
    current.reset();
    if (next == blocks) {
      done = true;
      return;
    }
    const unsigned long long i = next++;
    block_index = {static_cast<unsigned>(i % grid.x), static_cast<unsigned>(i / grid.x % grid.y),
                   static_cast<unsigned>(i / (1ull * grid.x * grid.y))};
    current = std::make_unique<Block>(count, shared_bytes);
  };
  std::barrier<decltype(advance)> between_blocks(count, advance);
  const std::function<void(unsigned)> body = [&](unsigned linear) {
    current_thread = linear;
    blockDim = block;
    gridDim = grid;
    threadIdx = {linear % block.x, linear / block.x % block.y, linear / (block.x * block.y)};
    for (;;) {
      between_blocks.arrive_and_wait();
      if (done) break;
      current_block = current.get();
      blockIdx = block_index;
      std::apply(kernel, parameters);
      // The thread has returned: it leaves the block's barriers (as on Volta+).
      current_block->exited[linear] = 1;
      Warp& w = warp();
      w.present.fetch_and(~(1u << lane()));
      w.barrier.arrive_and_drop();
      current_block->sync.arrive_and_drop();
      current_block = nullptr;
    }
  };
  thread_pool().run(count, body);
}

}  // namespace latte_cuda_emulation

// The call site by __builtin_FILE / __builtin_LINE (GCC and clang 14 alike;
// std::source_location needs clang 15 with libstdc++).
inline void __syncthreads(const char* file = __builtin_FILE(), unsigned line = __builtin_LINE()) {
  latte_cuda_emulation::sync_threads(file, line);
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  (void)latte_cuda_emulation::exchange(mask, 0, latte_cuda_emulation::lane());
}
template <class V>
V __shfl_sync(unsigned mask, V value, int source_lane, int width = 32) {
  const unsigned base = latte_cuda_emulation::lane() / width * width;
  return latte_cuda_emulation::exchange(mask, value, base + static_cast<unsigned>(source_lane % width));
}
template <class V>
V __shfl_xor_sync(unsigned mask, V value, int lane_mask, int width = 32) {
  const unsigned lane = latte_cuda_emulation::lane();
  unsigned source = lane ^ static_cast<unsigned>(lane_mask);
  if (source / width != lane / width) source = lane;  // outside the segment: own value
  return latte_cuda_emulation::exchange(mask, value, source);
}
template <class V>
V __shfl_down_sync(unsigned mask, V value, unsigned delta, int width = 32) {
  const unsigned lane = latte_cuda_emulation::lane();
  const unsigned source = lane % width + delta < static_cast<unsigned>(width) ? lane + delta : lane;
  return latte_cuda_emulation::exchange(mask, value, source);
}

inline cudaError_t cudaGetLastError() {
  const cudaError_t error = latte_cuda_emulation::last_error;
  latte_cuda_emulation::last_error = cudaSuccess;
  return error;
}
inline cudaError_t cudaPeekAtLastError() { return latte_cuda_emulation::last_error; }
inline const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidDeviceFunction: return "cudaErrorInvalidDeviceFunction";
  }
  return "cudaErrorUnknown";
}
inline const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    case cudaErrorInvalidDeviceFunction: return "invalid device function";
  }
  return "unknown error";
}

inline cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : latte_cuda_emulation::fail(cudaErrorInvalidValue);
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int device) {
  if (device != 0) return latte_cuda_emulation::fail(cudaErrorInvalidValue);
  switch (attribute) {
    case cudaDevAttrMaxSharedMemoryPerBlock:
      *value = static_cast<int>(latte_cuda_emulation::kDefaultSharedBytes);
      return cudaSuccess;
    case cudaDevAttrMultiProcessorCount: *value = 132; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = static_cast<int>(latte_cuda_emulation::kOptInSharedBytes);
      return cudaSuccess;
  }
  return latte_cuda_emulation::fail(cudaErrorInvalidValue);
}
template <class Kernel>
cudaError_t cudaFuncSetAttribute(Kernel* kernel, cudaFuncAttribute attribute, int value) {
  if (attribute != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      static_cast<std::size_t>(value) > latte_cuda_emulation::kOptInSharedBytes)
    return latte_cuda_emulation::fail(cudaErrorInvalidValue);
  auto& rt = latte_cuda_emulation::runtime();
  std::lock_guard lock(rt.mutex);
  rt.dynamic_shared_limit[reinterpret_cast<const void*>(kernel)] = static_cast<std::size_t>(value);
  return cudaSuccess;
}
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }

inline cudaError_t cudaMalloc(void** pointer, std::size_t bytes) {
  *pointer = nullptr;
  if (bytes == 0) return cudaSuccess;
  *pointer = ::operator new(bytes, std::align_val_t{256}, std::nothrow);
  if (*pointer == nullptr) return latte_cuda_emulation::fail(cudaErrorMemoryAllocation);
  auto& rt = latte_cuda_emulation::runtime();
  std::lock_guard lock(rt.mutex);
  rt.allocations[*pointer] = bytes;
  return cudaSuccess;
}
template <class T>
cudaError_t cudaMalloc(T** pointer, std::size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(pointer), bytes);
}
inline cudaError_t cudaFree(void* pointer) {
  if (pointer == nullptr) return cudaSuccess;
  auto& rt = latte_cuda_emulation::runtime();
  {
    std::lock_guard lock(rt.mutex);
    if (rt.allocations.erase(pointer) == 0)
      return latte_cuda_emulation::fail(cudaErrorInvalidDevicePointer);
  }
  ::operator delete(pointer, std::align_val_t{256});
  return cudaSuccess;
}
inline cudaError_t cudaMallocAsync(void** pointer, std::size_t bytes, cudaStream_t) {
  return cudaMalloc(pointer, bytes);
}
inline cudaError_t cudaFreeAsync(void* pointer, cudaStream_t) { return cudaFree(pointer); }
inline cudaError_t cudaMemcpy(void* destination, const void* source, std::size_t bytes,
                              cudaMemcpyKind) {
  if (bytes) std::memmove(destination, source, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* destination, const void* source, std::size_t bytes,
                                   cudaMemcpyKind kind, cudaStream_t = nullptr) {
  return cudaMemcpy(destination, source, bytes, kind);
}
inline cudaError_t cudaMemset(void* destination, int value, std::size_t bytes) {
  if (bytes) std::memset(destination, value, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* destination, int value, std::size_t bytes,
                                   cudaStream_t = nullptr) {
  return cudaMemset(destination, value, bytes);
}
