// Random weights for ConvCompressedAttention benchmarks (bench_conv_compressed.cpp
// and latte-compare): variance-preserving normals (standard deviation
// 1 / sqrt(fan-in)), so activations keep their scale through the levels the way
// trained weights would. The time of a forward does not depend on the values.
#pragma once

#include <latte/mechanisms/conv_compressed_attention.hpp>

#include <cmath>
#include <random>

namespace latte::bench {

inline ConvCompressedParams random_conv_compressed_params(const ConvCompressedDims& dims,
                                                          unsigned seed = 42) {
  ConvCompressedParams params = ConvCompressedParams::zeros(dims);
  std::mt19937 rng(seed);
  auto fill = [&](auto& tensor, double fan_in) {
    std::normal_distribution<double> normal(0.0, 1.0 / std::sqrt(fan_in));
    for (index_t i = 0; i < tensor.size(); ++i) tensor.data()[i] = normal(rng);
  };
  const double Dv = double(dims.value_dim);
  for (auto& w : params.conv_weight) fill(w, double(dims.group_size) * Dv);
  for (auto& b : params.conv_bias) fill(b, 4.0);
  for (auto& w : params.level_query) fill(w, Dv);
  for (auto& w : params.level_key) fill(w, Dv);
  for (auto& w : params.level_value) fill(w, Dv);
  fill(params.cross_query, Dv);
  fill(params.cross_key, Dv);
  fill(params.cross_value, Dv);
  return params;
}

}  // namespace latte::bench
