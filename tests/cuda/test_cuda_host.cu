// The host side of the CUDA backend, which runs without a GPU: launch planning
// (chunk size, grids, shared memory, workspace), shape validation before any
// CUDA call, CUDA errors as latte::Error, and what supports() says in a
// translation unit compiled by nvcc.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <string>

#include "latte/attention.hpp"
#include "latte/backends/cuda/launch_plan.hpp"

namespace {
using namespace latte;

constexpr std::size_t kH100SharedMemory = 227 * 1024;  // opt-in bytes per block on sm_90

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("exec::cuda is implemented in an nvcc translation unit with LATTE_WITH_CUDA") {
  static_assert(LATTE_CUDA_KERNELS == 1);
  static_assert(exec::implemented<exec::cuda_t>);
  static_assert(!exec::cuda_unavailable<exec::cuda_t>);
  CHECK(supports(exec::cuda).ok);
  // The tag carries a stream; on() returns a tag for another one.
  int fake_stream = 0;
  const exec::cuda_t on_stream = exec::cuda.on(&fake_stream);
  CHECK(on_stream.stream == &fake_stream);
  CHECK(exec::cuda.stream == nullptr);
}

TEST_CASE("Latte plan: chunk 64 while it fits, smaller chunks for large L x Dv") {
  const auto plan = cuda::plan_latte(2, 1000, 8, 64, 64, kH100SharedMemory);
  CHECK(plan.chunk == 64);
  CHECK(plan.chunks == 16);  // ceil(1000 / 64)
  CHECK(plan.chunk_grid.x == 16);
  CHECK(plan.chunk_grid.y == 8);
  CHECK(plan.chunk_grid.z == 2);
  CHECK(plan.scan_grid.x == (64 * 65 + 255) / 256);
  CHECK(plan.workspace_floats == std::size_t(2 * 8 * 16 * 64 * (3 + 64)));
  CHECK(plan.outputs_smem == cuda::latte_outputs_floats(64, 64, 64) * sizeof(float));
  CHECK(plan.outputs_smem <= kH100SharedMemory);

  CHECK(cuda::plan_latte(1, 3001, 2, 128, 128, kH100SharedMemory).chunk == 64);
  CHECK(cuda::plan_latte(1, 1500, 1, 256, 64, kH100SharedMemory).chunk == 32);
  const auto big = cuda::plan_latte(1, 10, 1, 512, 64, kH100SharedMemory);
  CHECK(big.chunk < 32);
  CHECK(big.chunks == (10 + big.chunk - 1) / big.chunk);
  CHECK(std::max({big.outputs_smem, big.states_smem, big.read_smem}) <= kH100SharedMemory);

  // T = 1 is one chunk; every kernel's memory fits the limit it was planned for.
  const auto one = cuda::plan_latte(1, 1, 1, 1, 1, kH100SharedMemory);
  CHECK(one.chunks == 1);
  CHECK(one.chunk == 64);
}

TEST_CASE("Latte plan: shapes beyond the kernels are latte::Error, not launch failures") {
  try {
    (void)cuda::plan_latte(1, 10, 1, 4096, 1024, kH100SharedMemory);
    FAIL("expected latte::Error");
  } catch (const Error& error) {
    CHECK(error.argument() == "dims");
    CHECK(contains(error.what(), "L = 4096"));
    CHECK(contains(error.what(), "Dv = 1024"));
  }
  CHECK_THROWS_AS((void)cuda::plan_latte(1, 10, 70000, 8, 8, kH100SharedMemory), Error);
  CHECK_THROWS_AS((void)cuda::plan_latte(70000, 10, 1, 8, 8, kH100SharedMemory), Error);
}

TEST_CASE("Softmax plan: value slots per lane and grid") {
  CHECK(cuda::softmax_value_slots(1) == 1);
  CHECK(cuda::softmax_value_slots(32) == 1);
  CHECK(cuda::softmax_value_slots(33) == 2);
  CHECK(cuda::softmax_value_slots(100) == 4);
  CHECK(cuda::softmax_value_slots(256) == 8);
  CHECK_THROWS_AS((void)cuda::softmax_value_slots(257), Error);
  const auto plan = cuda::plan_softmax(2, 1001, 3, 64, 64, kH100SharedMemory);
  CHECK(plan.grid.x == 126);  // ceil(1001 / 8) rows of 8 warps
  CHECK(plan.grid.y == 3);
  CHECK(plan.grid.z == 2);
  CHECK(plan.smem == 8 * 64 * sizeof(float));
}

TEST_CASE("exec::cuda validates shapes on the host before any CUDA call") {
  // Host pointers stand in for device ones: validation fails before a kernel
  // could touch them, so this runs without a GPU.
  Tensor<float, 4> q({1, 5, 2, 4}), k({1, 5, 2, 4}), v({1, 5, 2, 3}), wrong({1, 5, 2, 2});
  const LatteAttention<Causal> latte_attention({2, 4, 3});
  try {
    latte_attention.forward(exec::cuda, q, k, v, wrong.view());
    FAIL("expected latte::Error");
  } catch (const Error& error) {
    CHECK(error.argument() == "out");
    CHECK(contains(error.what(), "[1, 5, 2, 3]"));
  }
  CHECK_THROWS_AS(latte_attention.forward(exec::cuda, q, k, v, v.view()), Error);  // aliasing

  const SoftmaxAttention<Causal> softmax_attention({2, 4, 3});
  try {
    softmax_attention.forward(exec::cuda, q, wrong, v, q.view());
    FAIL("expected latte::Error");
  } catch (const Error& error) {
    CHECK(error.argument() == "keys");
  }
  // fp16 inputs take the same validation.
  Tensor<__half, 4> hq({1, 5, 2, 4}), hk({1, 5, 2, 4}), hv({1, 5, 2, 3}), hwrong({1, 4, 2, 3});
  CHECK_THROWS_AS(latte_attention.forward(exec::cuda, hq.cview(), hk.cview(), hv.cview(),
                                          hwrong.view()),
                  Error);
}

TEST_CASE("CUDA runtime errors become latte::Error with CUDA's message") {
  CHECK_NOTHROW(cuda::check(cudaSuccess, "nothing"));
  try {
    cuda::check(cudaErrorInvalidValue, "cudaMemcpyAsync of the angle table");
    FAIL("expected latte::Error");
  } catch (const Error& error) {
    CHECK(error.argument() == "exec::cuda");
    CHECK(contains(error.what(), "cudaMemcpyAsync of the angle table failed"));
    CHECK(contains(error.what(), "cudaErrorInvalidValue"));
    CHECK(contains(error.what(), cudaGetErrorString(cudaErrorInvalidValue)));
  }
}
