#pragma once
// Shared test helpers: seeded random inputs, random shapes from the sets the
// foundation issue names, and the normwise relative error against an oracle.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "latte/attention.hpp"
#include "oracles/tensor_ld.hpp"
#include "tolerances.hpp"

namespace latte::test {

using Rng = std::mt19937_64;

template <class T, std::size_t N>
Tensor<T, N> random_tensor(Rng& rng, const std::array<index_t, N>& extents, double stddev) {
  Tensor<T, N> tensor(extents);
  std::normal_distribution<double> normal(0.0, stddev);
  for (index_t i = 0; i < tensor.size(); ++i) tensor.data()[i] = static_cast<T>(normal(rng));
  return tensor;
}

template <class T, std::size_t N>
Tensor<T, N> uniform_tensor(Rng& rng, const std::array<index_t, N>& extents, double low,
                            double high) {
  Tensor<T, N> tensor(extents);
  std::uniform_real_distribution<double> uniform(low, high);
  for (index_t i = 0; i < tensor.size(); ++i) tensor.data()[i] = static_cast<T>(uniform(rng));
  return tensor;
}

/// The factor LATTE_TEST_CASE_SCALE holds (1 when unset): sanitizer builds
/// (scripts/sanitize.sh) run 5-20x slower and use 0.1 to stay within CI time.
inline double test_case_scale() {
  const char* text = std::getenv("LATTE_TEST_CASE_SCALE");
  if (text == nullptr || *text == '\0') return 1.0;
  char* end = nullptr;
  const double scale = std::strtod(text, &end);
  if (end == text || *end != '\0' || !(scale > 0) || !std::isfinite(scale))
    throw std::invalid_argument("LATTE_TEST_CASE_SCALE: expected a positive number, given \"" +
                                std::string(text) + "\"");
  return scale;
}

/// How many random cases a loop of `full` cases runs: `full` times
/// test_case_scale(), at least one. The seeds are unchanged, so a scaled run
/// checks a prefix of the full run's cases.
inline int case_count(int full) {
  return std::max(1, static_cast<int>(std::lround(full * test_case_scale())));
}

/// For the exhaustive loops (every shape remainder x every input regime):
/// whether variant `variant` of `variants` runs for the shape numbered `shape`.
/// All of them at full scale; in a scaled run (test_case_scale() < 1) one per
/// shape, rotating with the shape, so every shape is still reached (what a
/// sanitizer looks at) and every variant on about 1 / variants of the shapes.
inline bool variant_runs(int shape, int variant, int variants) {
  return test_case_scale() >= 1.0 || (shape % variants) == variant;
}

/// T in {1, 2, primes up to 257, 1000}.
inline const std::vector<index_t>& sequence_lengths() {
  static const std::vector<index_t> lengths = [] {
    std::vector<index_t> values{1, 2};
    for (index_t n = 3; n <= 257; ++n) {
      bool prime = true;
      for (index_t d = 2; d * d <= n; ++d) prime = prime && (n % d != 0);
      if (prime) values.push_back(n);
    }
    values.push_back(1000);
    return values;
  }();
  return lengths;
}

template <class Container>
auto pick(Rng& rng, const Container& values) {
  std::uniform_int_distribution<std::size_t> index(0, values.size() - 1);
  return values[index(rng)];
}

/// A random shape (B, T, H, L, Dv) from the sets whose oracle cost
/// T^2 * B * H * (L + Dv) stays under `budget` (so T = 1000 comes with small H, L, Dv).
struct Shape {
  index_t batch, time, heads, latents, value_dim;
};
inline Shape random_shape(Rng& rng, double budget = 6e7) {
  static const std::array<index_t, 3> heads{1, 3, 8}, latents{1, 7, 64}, value_dims{1, 5, 64};
  static const std::array<index_t, 2> batches{1, 2};
  for (;;) {
    const Shape s{pick(rng, batches), pick(rng, sequence_lengths()), pick(rng, heads),
                  pick(rng, latents), pick(rng, value_dims)};
    const double cost = double(s.time) * double(s.time) * double(s.batch * s.heads) *
                        double(s.latents + s.value_dim);
    if (cost <= budget) return s;
  }
}

/// A tensor's values rounded to T and widened back: the weights a T kernel
/// computes with (so that an oracle in long double sees the same numbers).
template <class T, std::size_t N>
Tensor<double, N> rounded_to(const Tensor<double, N>& x) {
  Tensor<double, N> y(x.extents());
  for (index_t i = 0; i < x.size(); ++i) y.data()[i] = static_cast<double>(static_cast<T>(x.data()[i]));
  return y;
}

/// A tensor's elements as long doubles, in storage order.
template <class T, std::size_t N>
std::vector<long double> widen(const Tensor<T, N>& x) {
  return std::vector<long double>(x.data(), x.data() + x.size());
}

/// max |out - oracle| / max |oracle| (0 when both are zero; +inf on NaN/inf in out).
template <class T, std::size_t N>
double relative_error(const Tensor<T, N>& out, const TensorLD<N>& oracle) {
  long double worst = 0, scale = 0;
  for (index_t i = 0; i < out.size(); ++i) {
    const long double value = out.data()[i];
    if (!std::isfinite(static_cast<double>(out.data()[i])))
      return std::numeric_limits<double>::infinity();
    worst = std::max(worst, std::fabs(value - oracle.data()[i]));
    scale = std::max(scale, std::fabs(oracle.data()[i]));
  }
  if (scale == 0) return static_cast<double>(worst);
  return static_cast<double>(worst / scale);
}

template <class T, std::size_t N>
bool all_finite(const Tensor<T, N>& tensor) {
  return std::all_of(tensor.data(), tensor.data() + tensor.size(),
                     [](T x) { return std::isfinite(x); });
}

template <class T, std::size_t N>
bool bit_equal(const Tensor<T, N>& a, const Tensor<T, N>& b) {
  return a.extents() == b.extents() && std::equal(a.data(), a.data() + a.size(), b.data());
}

/// The rows [first, first + count) of the time axis of a [B, T, H, D] tensor, copied.
template <class T>
Tensor<T, 4> time_slice(const Tensor<T, 4>& x, index_t first, index_t count) {
  Tensor<T, 4> part({x.extent(0), count, x.extent(2), x.extent(3)});
  for (index_t b = 0; b < x.extent(0); ++b)
    for (index_t t = 0; t < count; ++t)
      for (index_t h = 0; h < x.extent(2); ++h)
        for (index_t d = 0; d < x.extent(3); ++d) part(b, t, h, d) = x(b, first + t, h, d);
  return part;
}

/// Time step t of a [B, T, H, D] tensor as a [B, H, D] tensor, copied.
template <class T>
Tensor<T, 3> time_step(const Tensor<T, 4>& x, index_t t) {
  Tensor<T, 3> row({x.extent(0), x.extent(2), x.extent(3)});
  for (index_t b = 0; b < x.extent(0); ++b)
    for (index_t h = 0; h < x.extent(2); ++h)
      for (index_t d = 0; d < x.extent(3); ++d) row(b, h, d) = x(b, t, h, d);
  return row;
}

/// Writes a [B, H, D] row into time step t of a [B, T, H, D] tensor.
template <class T>
void set_time_step(Tensor<T, 4>& x, index_t t, const Tensor<T, 3>& row) {
  for (index_t b = 0; b < x.extent(0); ++b)
    for (index_t h = 0; h < x.extent(2); ++h)
      for (index_t d = 0; d < x.extent(3); ++d) x(b, t, h, d) = row(b, h, d);
}

}  // namespace latte::test
