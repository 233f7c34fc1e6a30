// Softmax attention on exec::cuda against the explicit long-double oracle:
// causal, bidirectional and sliding windows on random shapes, fp32 / fp16 / bf16
// inputs, and large scores.
#include "cuda_test_main.hpp"

#include <cstdio>
#include <limits>
#include <utility>
#include <vector>

#include "cuda_tolerances.hpp"
#include "oracles/softmax_oracle.hpp"

namespace {
using namespace latte;
using namespace latte::test;

template <class T, class Dir, class Win>
Tensor<float, 4> cuda_forward(const SoftmaxAttention<Dir, Win>& attention,
                              const Tensor<float, 4>& q, const Tensor<float, 4>& k,
                              const Tensor<float, 4>& v) {
  const DeviceTensor<T, 4> qd(q), kd(k), vd(v);
  DeviceTensor<T, 4> out(v.extents());
  attention.forward(exec::cuda, qd.cview(), kd.cview(), vd.cview(), out.view());
  synchronize();
  return out.to_host();
}

template <class T, class Dir, bool Windowed>
void random_cases(const char* label, std::uint64_t seed, int full_cases) {
  Rng rng(seed);
  static const std::array<index_t, 5> dims{1, 5, 64, 100, 256};
  double worst = 0;
  const int cases = case_count(full_cases);
  for (int c = 0; c < cases; ++c) {
    const index_t B = pick(rng, std::array<index_t, 2>{1, 2});
    const index_t H = pick(rng, std::array<index_t, 3>{1, 3, 8});
    const index_t Dk = pick(rng, dims), Dv = pick(rng, dims);
    index_t Tn = 0;
    do Tn = pick(rng, sequence_lengths());
    while (double(Tn) * double(Tn) * double(B * H) * double(Dk + Dv) > kCaseBudget);
    const auto q = rounded_to<T>(random_tensor<float, 4>(rng, {B, Tn, H, Dk}, 1.0));
    const auto k = rounded_to<T>(random_tensor<float, 4>(rng, {B, Tn, H, Dk}, 1.0));
    const auto v = rounded_to<T>(uniform_tensor<float, 4>(rng, {B, Tn, H, Dv}, -1, 1));
    MaskSpec mask{.causal = Dir::is_causal};
    double error = 0;
    if constexpr (Windowed) {
      const index_t left = pick(rng, std::array<index_t, 4>{0, 1, 16, 100});
      const index_t right = Dir::is_causal ? 0 : pick(rng, std::array<index_t, 3>{0, 3, 40});
      mask.left = left;
      mask.right = right;
      const SoftmaxAttention<Dir, SlidingWindow> attention({H, Dk, Dv}, {left, right});
      error = relative_error(cuda_forward<T>(attention, q, k, v),
                             softmax_oracle(mask, 1.0L / std::sqrt((long double)Dk), q, k, v));
    } else {
      const SoftmaxAttention<Dir> attention({H, Dk, Dv});
      error = relative_error(cuda_forward<T>(attention, q, k, v),
                             softmax_oracle(mask, 1.0L / std::sqrt((long double)Dk), q, k, v));
    }
    CHECK_MESSAGE(error <= CudaTolerance<T>::relative,
                  label << " case " << c << " B=" << B << " T=" << Tn << " H=" << H
                        << " Dk=" << Dk << " Dv=" << Dv << " error=" << error);
    worst = std::max(worst, error);
  }
  std::printf("[cuda oracle] %-40s %-8s cases=%d max_rel_error=%.3e (tol %.0e)\n", label,
              cuda::element_name<T>(), cases, worst, CudaTolerance<T>::relative);
}

template <class Dir, bool Windowed>
void all_types(const char* label, std::uint64_t seed) {
  random_cases<float, Dir, Windowed>(label, seed, 80);
  random_cases<__half, Dir, Windowed>(label, seed + 1, 30);
  random_cases<__nv_bfloat16, Dir, Windowed>(label, seed + 2, 30);
}

}  // namespace

TEST_CASE("cuda softmax causal == oracle") { all_types<Causal, false>("SoftmaxAttention<Causal>", 2101); }
TEST_CASE("cuda softmax bidirectional == oracle") {
  all_types<Bidirectional, false>("SoftmaxAttention<Bidirectional>", 2111);
}
TEST_CASE("cuda softmax causal sliding window == oracle") {
  all_types<Causal, true>("SoftmaxAttention<Causal,sliding_window>", 2121);
}
TEST_CASE("cuda softmax bidirectional sliding window == oracle") {
  all_types<Bidirectional, true>("SoftmaxAttention<Bidirectional,sliding_window>", 2131);
}

TEST_CASE("cuda softmax: window sides near INT64_MAX are unbounded, not overflowed") {
  // Regression (issue 24): the right bound was t + right, which overflows for right
  // near INT64_MAX and left rows empty (zero output) where the oracle is defined.
  Rng rng(2404);
  const index_t Tn = 70, H = 2, Dk = 8, Dv = 6;
  const auto q = random_tensor<float, 4>(rng, {1, Tn, H, Dk}, 1.0);
  const auto k = random_tensor<float, 4>(rng, {1, Tn, H, Dk}, 1.0);
  const auto v = uniform_tensor<float, 4>(rng, {1, Tn, H, Dv}, -1, 1);
  const index_t huge = std::numeric_limits<index_t>::max();
  const long double scale = 1.0L / std::sqrt((long double)Dk);
  const std::vector<std::pair<index_t, index_t>> sides{
      {3, huge}, {huge, huge}, {huge, 2}, {huge - 1, huge - 1}};
  for (const auto& side : sides) {
    const index_t left = side.first, right = side.second;
    const SoftmaxAttention<Bidirectional, SlidingWindow> attention({H, Dk, Dv}, {left, right});
    const double error = relative_error(
        cuda_forward<float>(attention, q, k, v),
        softmax_oracle({.causal = false, .left = left, .right = right}, scale, q, k, v));
    CHECK_MESSAGE(error <= Tolerance<float>::relative, "left " << left << " right " << right);
  }
}

/// Writes its thread index to dynamic shared memory and reads the last one back.
__global__ void shared_memory_round_trip(float* out) {
  float* const shared = cuda::dynamic_shared_floats();
  shared[threadIdx.x] = static_cast<float>(threadIdx.x);
  __syncthreads();
  if (threadIdx.x == 0) out[0] = shared[blockDim.x - 1];
}

TEST_CASE("cuda launch: configuration errors as the runtime reports them (GPU and emulation)") {
  DeviceArray<float> out(1);
  out.fill_bytes(0);
  (void)cudaGetLastError();
  cuda::launch(shared_memory_round_trip, dim3(1), dim3(256), 256 * sizeof(float), nullptr,
               out.data());
  CHECK(cudaGetLastError() == cudaSuccess);
  synchronize();
  CHECK(out.download()[0] == 255.f);
  // More than the 48 KB default without the opt-in: invalid argument.
  const std::size_t big = 64 * 1024;
  cuda::launch(shared_memory_round_trip, dim3(1), dim3(256), big, nullptr, out.data());
  CHECK(cudaGetLastError() == cudaErrorInvalidValue);
  REQUIRE(cudaFuncSetAttribute(shared_memory_round_trip, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(big)) == cudaSuccess);
  cuda::launch(shared_memory_round_trip, dim3(1), dim3(256), big, nullptr, out.data());
  CHECK(cudaGetLastError() == cudaSuccess);
  synchronize();
  // More than 1024 threads in a block: invalid configuration, and check_launch says so.
  cuda::launch(shared_memory_round_trip, dim3(1), dim3(1025), 0, nullptr, out.data());
  CHECK_THROWS_AS(cuda::check_launch("shared_memory_round_trip"), latte::Error);
}

TEST_CASE("cuda softmax: rows sum to 1 and large scores stay finite") {
  Rng rng(2405);
  const index_t Tn = 33;
  const auto q = random_tensor<float, 4>(rng, {1, Tn, 1, 4}, 30.0);  // scores up to ~1e3
  const auto k = random_tensor<float, 4>(rng, {1, Tn, 1, 4}, 30.0);
  Tensor<float, 4> one_hot({1, Tn, 1, Tn}, 0.f);
  for (index_t s = 0; s < Tn; ++s) one_hot(0, s, 0, s) = 1;
  const auto rows = cuda_forward<float>(SoftmaxAttention<Causal>({1, 4, Tn}), q, k, one_hot);
  REQUIRE(all_finite(rows));
  CHECK(relative_error(rows, softmax_oracle({.causal = true}, 0.5L, q, k, one_hot)) <=
        Tolerance<float>::relative);
  for (index_t t = 0; t < Tn; ++t) {
    double total = 0;
    for (index_t s = 0; s < Tn; ++s) total += rows(0, t, 0, s);
    CHECK(std::fabs(total - 1.0) <= Tolerance<float>::relative);
  }
}
