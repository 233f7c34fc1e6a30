// Compiled by the host C++ compiler (not nvcc), with or without LATTE_WITH_CUDA:
// naming exec::cuda here must stop the build with the static_assert that says
// to compile the file with nvcc (never a link error). Built only by the CTest
// test cuda_in_host_only_file_is_a_clear_static_assert, which expects that message.
#include <latte/attention.hpp>

void forward_on_cuda_from_a_host_only_file() {
  latte::Tensor<float, 4> q({1, 4, 1, 2}), k({1, 4, 1, 2}), v({1, 4, 1, 3}), out({1, 4, 1, 3});
  const latte::LatteAttention<latte::Causal> attention({1, 2, 3});
  attention.forward(latte::exec::cuda, q, k, v, out.view());
}
