// Small helpers shared by the per-mechanism examples: random tensors, the
// --tokens flag, and the largest difference between two outputs.
#pragma once
#include <latte/attention.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

namespace example {

template <std::size_t N>
latte::Tensor<float, N> random_tensor(std::mt19937& rng, const std::array<latte::index_t, N>& extents,
                                      float stddev = 1.0f) {
  latte::Tensor<float, N> tensor(extents);
  std::normal_distribution<float> normal(0.0f, stddev);
  for (latte::index_t i = 0; i < tensor.size(); ++i) tensor.data()[i] = normal(rng);
  return tensor;
}

/// `--tokens N` (default `fallback`); exits with a usage line on anything else.
inline latte::index_t tokens_flag(int argc, char** argv, latte::index_t fallback) {
  if (argc == 1) return fallback;
  if (argc == 3 && std::string(argv[1]) == "--tokens" && std::atol(argv[2]) >= 2)
    return std::atol(argv[2]);
  std::fprintf(stderr, "usage: %s [--tokens N]  (N >= 2)\n", argv[0]);
  std::exit(2);
}

/// Time step t of a [B, T, H, D] tensor as a [B, H, D] view (no copy).
template <class T>
latte::TensorView<T, 3> at_time(latte::Tensor<std::remove_const_t<T>, 4>& x, latte::index_t t) {
  auto v = x.view();
  return latte::TensorView<T, 3>(v.data() + t * v.stride(1), {v.extent(0), v.extent(2), v.extent(3)},
                                 {v.stride(0), v.stride(2), v.stride(3)});
}

/// max |a - b| over two tensors of the same shape.
template <std::size_t N>
double max_difference(const latte::Tensor<float, N>& a, const latte::Tensor<float, N>& b) {
  double worst = 0;
  for (latte::index_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::fabs(double(a.data()[i]) - double(b.data()[i])));
  return worst;
}

}  // namespace example
