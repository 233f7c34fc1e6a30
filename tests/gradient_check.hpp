#pragma once
// Reference gradients from an oracle's loss, for the backward tests.
//
// A gradient test builds a scalar loss L(x) = <d_out, f(x)> in long double from
// one of the explicit T x T oracles (tests/oracles/) over long-double copies of
// the inputs, and checks a backward kernel's gradients against
//   - central_differences: dL/dx for every element of every input (small shapes);
//   - directional_derivative: the derivative of L along a random direction
//     (any shape the oracle can afford), compared with <gradient, direction>.
// Both use central differences with one Richardson step,
//   D(h) = (L(x + h) - L(x - h)) / 2h,   D = (4 D(h/2) - D(h)) / 3,
// whose error is O(h^4) plus long double's rounding of L over h (~1e-19 |L| / h).
// Steps are absolute: logits vary on a scale of 1 whatever their size (a
// softmax sees differences), so a logit of 5000 takes the same step as one of 1.
// Per element h = 1e-4; along a direction of many elements h = 1e-6, since the
// loss's higher derivatives along it grow with the number of elements.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <optional>
#include <random>
#include <span>
#include <vector>

#include <doctest/doctest.h>

#include "oracles/tensor_ld.hpp"
#include "support.hpp"
#include "tolerances.hpp"

namespace latte::test {

/// The inputs a loss reads, as long-double spans the checks perturb in place
/// (and restore).
using GradientInputs = std::vector<std::span<long double>>;

/// One long double per element of every input.
using GradientValues = std::vector<std::vector<long double>>;

template <class T, std::size_t N>
std::span<long double> as_input(Tensor<T, N>& tensor) {
  static_assert(std::is_same_v<T, long double>, "the checks perturb long-double copies");
  return {tensor.data(), static_cast<std::size_t>(tensor.size())};
}

/// Richardson-extrapolated central difference of `loss` along the perturbation
/// `apply(+h)` / `apply(-h)`; `apply(0)` restores.
template <class Loss, class Apply>
long double richardson_difference(Loss& loss, Apply&& apply, long double h) {
  auto central = [&](long double step) {
    apply(step);
    const long double plus = loss();
    apply(-step);
    const long double minus = loss();
    apply(0);
    return (plus - minus) / (2 * step);
  };
  const long double coarse = central(h), fine = central(h / 2);
  return (4 * fine - coarse) / 3;
}

/// dL/dx for every element x of every input.
template <class Loss>
GradientValues central_differences(Loss&& loss, const GradientInputs& inputs,
                                   long double step = 1e-4L) {
  GradientValues gradient;
  for (const std::span<long double> input : inputs) {
    std::vector<long double>& out = gradient.emplace_back(input.size());
    for (std::size_t i = 0; i < input.size(); ++i) {
      const long double x = input[i];
      if (!std::isfinite(x)) continue;  // -inf logits: no neighbourhood, gradient 0
      out[i] = richardson_difference(loss, [&](long double h) { input[i] = x + h; }, step);
    }
  }
  return gradient;
}

/// The derivative of L along `direction` (one vector per input, same sizes).
/// Elements that are not finite stay where they are.
template <class Loss>
long double directional_derivative(Loss&& loss, const GradientInputs& inputs,
                                   const GradientValues& direction,
                                   long double step = 1e-6L) {
  GradientValues origin;
  for (const std::span<long double> input : inputs) origin.emplace_back(input.begin(), input.end());
  auto apply = [&](long double h) {
    for (std::size_t j = 0; j < inputs.size(); ++j)
      for (std::size_t i = 0; i < inputs[j].size(); ++i)
        if (std::isfinite(origin[j][i])) inputs[j][i] = origin[j][i] + h * direction[j][i];
  };
  return richardson_difference(loss, apply, step);
}

/// <gradient, direction> and sum |gradient_i direction_i| (the scale a
/// directional derivative's error is measured against: no cancellation hides
/// an error in one term).
struct DirectionalProduct {
  long double value = 0;
  long double magnitude = 0;
};
template <class T>
void accumulate_product(DirectionalProduct& product, std::span<const T> gradient,
                        const std::vector<long double>& direction) {
  for (std::size_t i = 0; i < direction.size(); ++i) {
    const long double term = (long double)gradient[i] * direction[i];
    product.value += term;
    product.magnitude += std::fabs(term);
  }
}

template <class T, std::size_t N>
TensorLD<N> to_long_double(const Tensor<T, N>& x) {
  TensorLD<N> y(x.extents());
  for (index_t i = 0; i < x.size(); ++i) y.data()[i] = x.data()[i];
  return y;
}

/// max |got - expected| / scale over one gradient, scale = max |expected| but
/// at least 1 % of `floor` (the largest entry of all the problem's gradients):
/// a gradient that is exactly zero (dq and dk at T = 1) is measured against the
/// others, not against the differences' own noise.
template <class T>
double gradient_error(std::span<const T> got, const std::vector<long double>& expected,
                      long double floor) {
  long double worst = 0, scale = floor / 100;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    if (!std::isfinite(static_cast<double>(got[i]))) return std::numeric_limits<double>::infinity();
    worst = std::max(worst, std::fabs((long double)got[i] - expected[i]));
    scale = std::max(scale, std::fabs(expected[i]));
  }
  return static_cast<double>(scale == 0 ? worst : worst / scale);
}

template <class T, std::size_t N>
std::span<const T> span_of(const Tensor<T, N>& x) {
  return {x.data(), static_cast<std::size_t>(x.size())};
}

/// [B, T1, H, D] then [B, T2, H, D] along time, in long double (two chunks'
/// gradients, to compare with the whole sequence's).
template <class T>
TensorLD<4> join_in_time(const Tensor<T, 4>& a, const Tensor<T, 4>& b) {
  const index_t cut = a.extent(1);
  TensorLD<4> x({a.extent(0), cut + b.extent(1), a.extent(2), a.extent(3)});
  for (index_t bb = 0; bb < x.extent(0); ++bb)
    for (index_t t = 0; t < x.extent(1); ++t)
      for (index_t h = 0; h < x.extent(2); ++h)
        for (index_t d = 0; d < x.extent(3); ++d)
          x(bb, t, h, d) = t < cut ? a(bb, t, h, d) : b(bb, t - cut, h, d);
  return x;
}

/// relative_error of first + second (two chunks' accumulated parameter
/// gradients) against whole's.
template <class T, std::size_t N>
double sum_error(const Tensor<T, N>& first, const Tensor<T, N>& second, const Tensor<T, N>& whole) {
  Tensor<T, N> summed(first.extents());
  TensorLD<N> expected(whole.extents());
  for (index_t i = 0; i < summed.size(); ++i) {
    summed.data()[i] = first.data()[i] + second.data()[i];
    expected.data()[i] = whole.data()[i];
  }
  return relative_error(summed, expected);
}

/// The oracle's gradients of a problem's loss by central differences, and their
/// largest entry (gradient_error's floor). They depend on the problem's inputs
/// only, so one set serves the reference and the cpu run of the same problem
/// (the differences cost hundreds of oracle evaluations; the runs cost one each).
struct OracleGradients {
  GradientValues values;
  long double largest = 0;
};

template <class P>
OracleGradients oracle_gradients(P& problem) {
  auto loss = problem.loss();
  OracleGradients expected{central_differences(loss, loss.inputs())};
  for (const auto& gradient : expected.values)
    for (const long double x : gradient) expected.largest = std::max(expected.largest, std::fabs(x));
  return expected;
}

/// Every element of the kernel's gradients (problem.gradients(): one span per
/// input of problem.loss(), in the same order, named by `names`) against the
/// oracle's.
template <class T, class P>
void check_every_element(const P& problem, const OracleGradients& expected, const char* const* names) {
  const auto got = problem.gradients();
  for (std::size_t j = 0; j < got.size(); ++j) {
    INFO(std::string(names[j]));
    CHECK(gradient_error(got[j], expected.values[j], expected.largest) <= Tolerance<T>::gradient);
  }
}

/// Every element's gradient against central differences of the oracle's loss.
/// A problem has loss() (an object with operator() and inputs()) and
/// gradients() (the kernel's, one span per input, in the same order, named
/// by `names`).
template <class T, class P>
void check_every_element(P& problem, const char* const* names) {
  check_every_element<T>(problem, oracle_gradients(problem), names);
}

/// A problem's gradients after a run: every one finite, and exactly 0 for
/// each -inf entry of the problem's q and k (gradients dq, dk).
template <class T, class P>
void check_finite_and_zero_at_minus_inf(const P& problem) {
  constexpr T minus_inf = -std::numeric_limits<T>::infinity();
  for (const auto& gradient : problem.gradients())
    CHECK(std::all_of(gradient.begin(), gradient.end(), [](T x) { return std::isfinite(x); }));
  for (index_t i = 0; i < problem.k.size(); ++i)
    if (problem.k.data()[i] == minus_inf) CHECK(problem.dk.data()[i] == T(0));
  for (index_t i = 0; i < problem.q.size(); ++i)
    if (problem.q.data()[i] == minus_inf) CHECK(problem.dq.data()[i] == T(0));
}

/// An adversarial problem (logit spreads, -inf logits, zero values) on both
/// backends: check_finite_and_zero_at_minus_inf and every element against the oracle.
template <class T, class P>
void check_adversarial(P& problem, const char* const* names) {
  std::optional<OracleGradients> expected;
  for (const bool cpu : {false, true}) {
    if (cpu) problem.run(exec::cpu);
    else problem.run(exec::reference);
    if (!expected) expected = oracle_gradients(problem);
    check_finite_and_zero_at_minus_inf<T>(problem);
    check_every_element<T>(problem, *expected, names);
  }
}

/// <gradient, direction> against the oracle loss's derivative along a random direction.
template <class T, class P, class Random>
void check_direction(P& problem, Random& rng) {
  auto loss = problem.loss();
  const GradientInputs inputs = loss.inputs();
  GradientValues direction;
  std::normal_distribution<double> normal(0.0, 1.0);
  for (const auto& input : inputs) {
    auto& d = direction.emplace_back(input.size());
    for (auto& x : d) x = normal(rng);
  }
  const long double expected = directional_derivative(loss, inputs, direction);
  DirectionalProduct product;
  const auto got = problem.gradients();
  for (std::size_t j = 0; j < got.size(); ++j) accumulate_product(product, got[j], direction[j]);
  const double error = product.magnitude == 0
                           ? static_cast<double>(std::fabs(expected))
                           : static_cast<double>(std::fabs(product.value - expected) / product.magnitude);
  CHECK(error <= Tolerance<T>::gradient);
}

}  // namespace latte::test
