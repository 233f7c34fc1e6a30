// The token mixers' backward (ShortConv<K>, RGLRU) against the long-double
// transcriptions of tests/oracles/layer_oracle.hpp: every element of d_x and of
// every weight gradient by central differences of <d_y, oracle(x, weights)> on
// small shapes, random directions on larger ones, fp32 and fp64, with weights
// accumulated (+=) rather than overwritten; bad buffers refused by name.
#include <doctest/doctest.h>

#include <cmath>
#include <numbers>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "expect_error.hpp"
#include "gradient_check.hpp"
#include "latte/layers/rglru.hpp"
#include "latte/layers/short_conv.hpp"
#include "oracles/layer_oracle.hpp"
#include "support.hpp"

namespace {
using namespace latte;
using namespace latte::test;

template <class T, std::size_t N>
Tensor<T, N> filled(Rng& rng, const std::array<index_t, N>& extents, double scale) {
  return random_tensor<T, N>(rng, extents, scale);
}

template <class T, std::size_t N>
std::vector<long double> long_doubles(const Tensor<T, N>& x) {
  return {x.data(), x.data() + x.size()};
}

// ----------------------------------------------------------------- ShortConv --

template <class T, index_t K>
struct ConvProblem {
  using Mixer = ShortConv<K>;
  Tensor<T, 3> x, d_y, d_x;
  typename Mixer::template Weights<T> weights, d_weights;

  ConvProblem(Rng& rng, index_t B, index_t Tn, index_t C) {
    x = filled<T, 3>(rng, {B, Tn, C}, 1.0);
    d_y = filled<T, 3>(rng, {B, Tn, C}, 1.0);
    weights = {filled<T, 2>(rng, {K, C}, 1.0), filled<T, 1>(rng, {C}, 1.0)};
  }
  void run() {
    d_x = Tensor<T, 3>(x.extents());
    // Accumulated: start from a known value and subtract it afterwards.
    d_weights = {Tensor<T, 2>(weights.kernel.extents(), T(0.5)), Tensor<T, 1>(weights.bias.extents(), T(0.5))};
    Mixer::backward(weights, x.cview(), d_y.cview(), d_x.view(), &d_weights);
    for (index_t i = 0; i < d_weights.kernel.size(); ++i) d_weights.kernel.data()[i] -= T(0.5);
    for (index_t i = 0; i < d_weights.bias.size(); ++i) d_weights.bias.data()[i] -= T(0.5);
  }
  struct Loss {
    TensorLD<3> x, d_y;
    TensorLD<2> kernel;
    TensorLD<1> bias;
    long double operator()() const {
      const TensorLD<3> y = short_conv_oracle(kernel, bias, x);
      long double total = 0;
      for (index_t i = 0; i < y.size(); ++i) total += d_y.data()[i] * y.data()[i];
      return total;
    }
    GradientInputs inputs() { return {as_input(x), as_input(kernel), as_input(bias)}; }
  };
  Loss loss() const {
    Loss l{to_long_double(x), to_long_double(d_y), TensorLD<2>(weights.kernel.extents()),
           TensorLD<1>(weights.bias.extents())};
    for (index_t i = 0; i < weights.kernel.size(); ++i) l.kernel.data()[i] = weights.kernel.data()[i];
    for (index_t i = 0; i < weights.bias.size(); ++i) l.bias.data()[i] = weights.bias.data()[i];
    return l;
  }
  std::vector<std::span<const T>> gradients() const {
    return {span_of(d_x), span_of(d_weights.kernel), span_of(d_weights.bias)};
  }
};

constexpr const char* kConvNames[] = {"d_x", "d_mixer.kernel", "d_mixer.bias"};

template <class T>
void conv_cases(std::uint64_t seed) {
  Rng rng(seed);
  for (const auto [B, Tn, C] : {std::array<index_t, 3>{1, 1, 2}, {2, 2, 3}, {1, 7, 4}, {2, 12, 3}}) {
    CAPTURE(Tn);
    ConvProblem<T, 3> three(rng, B, Tn, C);
    three.run();
    check_every_element<T>(three, kConvNames);
    ConvProblem<T, 1> one(rng, B, Tn, C);
    one.run();
    check_every_element<T>(one, kConvNames);
    ConvProblem<T, 5> five(rng, B, Tn, C);
    five.run();
    check_every_element<T>(five, kConvNames);
  }
  for (int c = 0; c < case_count(6); ++c) {
    const index_t Tn = std::uniform_int_distribution<index_t>(1, 300)(rng);
    ConvProblem<T, 4> problem(rng, 2, Tn, 9);
    problem.run();
    check_direction<T>(problem, rng);
  }
}

// --------------------------------------------------------------------- RGLRU --

template <class T>
struct RglruProblem {
  Tensor<T, 3> x, d_y, d_x;
  RGLRU::Weights<T> weights, d_weights;

  RglruProblem(Rng& rng, index_t B, index_t Tn, index_t C, double lambda_low) {
    x = filled<T, 3>(rng, {B, Tn, C}, 1.0);
    d_y = filled<T, 3>(rng, {B, Tn, C}, 1.0);
    weights = RGLRU::Weights<T>::initial(C, rng());
    for (index_t i = 0; i < C; ++i) {  // biases away from zero; Lambda over a wide range
      weights.recurrence_bias(i) = static_cast<T>(std::normal_distribution<double>(0, 1)(rng));
      weights.input_bias(i) = static_cast<T>(std::normal_distribution<double>(0, 1)(rng));
      weights.lambda(i) = static_cast<T>(std::uniform_real_distribution<double>(lambda_low, 2.0)(rng));
    }
  }
  void run() {
    d_x = Tensor<T, 3>(x.extents());
    const index_t C = weights.lambda.extent(0);
    d_weights = {Tensor<T, 2>({C, C}, T(0.25)), Tensor<T, 1>({C}, T(0.25)),
                 Tensor<T, 2>({C, C}, T(0.25)), Tensor<T, 1>({C}, T(0.25)),
                 Tensor<T, 1>({C}, T(0.25))};
    RGLRU::backward(weights, x.cview(), d_y.cview(), d_x.view(), &d_weights);
    for (Tensor<T, 2>* m : {&d_weights.recurrence_gate, &d_weights.input_gate})
      for (index_t i = 0; i < m->size(); ++i) m->data()[i] -= T(0.25);
    for (Tensor<T, 1>* v : {&d_weights.recurrence_bias, &d_weights.input_bias, &d_weights.lambda})
      for (index_t i = 0; i < v->size(); ++i) v->data()[i] -= T(0.25);
  }
  struct Loss {
    TensorLD<3> x, d_y;
    RglruOracleWeights w;
    long double operator()() const {
      const TensorLD<3> y = rglru_oracle(w, x);
      long double total = 0;
      for (index_t i = 0; i < y.size(); ++i) total += d_y.data()[i] * y.data()[i];
      return total;
    }
    GradientInputs inputs() {
      return {as_input(x), w.recurrence_gate, w.recurrence_bias, w.input_gate, w.input_bias, w.lambda};
    }
  };
  Loss loss() const {
    return {to_long_double(x), to_long_double(d_y),
            {long_doubles(weights.recurrence_gate), long_doubles(weights.recurrence_bias),
             long_doubles(weights.input_gate), long_doubles(weights.input_bias),
             long_doubles(weights.lambda), weights.c}};
  }
  std::vector<std::span<const T>> gradients() const {
    return {span_of(d_x),
            span_of(d_weights.recurrence_gate),
            span_of(d_weights.recurrence_bias),
            span_of(d_weights.input_gate),
            span_of(d_weights.input_bias),
            span_of(d_weights.lambda)};
  }
};

constexpr const char* kRglruNames[] = {"d_x", "d_mixer.recurrence_gate", "d_mixer.recurrence_bias",
                                       "d_mixer.input_gate", "d_mixer.input_bias", "d_mixer.lambda"};

template <class T>
void rglru_cases(std::uint64_t seed) {
  Rng rng(seed);
  for (const auto [B, Tn, C] : {std::array<index_t, 3>{1, 1, 2}, {2, 3, 3}, {1, 9, 4}, {2, 16, 3}}) {
    for (const double lambda_low : {-2.0, -9.0}) {  // a_t up to 1 - 1e-4 at r = 1
      CAPTURE(Tn);
      CAPTURE(lambda_low);
      RglruProblem<T> problem(rng, B, Tn, C, lambda_low);
      problem.run();
      check_every_element<T>(problem, kRglruNames);
    }
  }
  for (int c = 0; c < case_count(6); ++c) {
    const index_t Tn = std::uniform_int_distribution<index_t>(1, 200)(rng);
    RglruProblem<T> problem(rng, 2, Tn, 7, -4.0);
    problem.run();
    check_direction<T>(problem, rng);
  }
}

}  // namespace

TEST_CASE("ShortConv backward matches the oracle's gradients") {
  conv_cases<double>(100);
  conv_cases<float>(200);
}

TEST_CASE("RGLRU backward matches the oracle's gradients") {
  rglru_cases<double>(300);
  rglru_cases<float>(400);
}

TEST_CASE("token mixer backward: bad buffers are refused by name") {
  Rng rng(500);
  const index_t C = 3;
  Tensor<float, 3> x({2, 4, C}), d_y({2, 4, C}), d_x({2, 4, C}), wrong({2, 4, C + 1});
  const auto conv = ShortConv<3>::Weights<float>::identity(C);
  auto d_conv = ShortConv<3>::Weights<float>::identity(C);
  ShortConv<3>::backward(conv, x.cview(), d_y.cview(), d_x.view(), &d_conv);  // the valid call
  expect_error([&] { ShortConv<3>::backward(conv, x.cview(), wrong.cview(), d_x.view(), &d_conv); },
               "d_y", "");
  expect_error([&] { ShortConv<3>::backward(conv, x.cview(), d_y.cview(), wrong.view(), &d_conv); },
               "d_x", "");
  expect_error([&] { ShortConv<3>::backward(conv, x.cview(), d_y.cview(), x.view(), &d_conv); },
               "d_x", "");
  auto bad_conv = ShortConv<3>::Weights<float>::identity(C + 1);
  expect_error([&] { ShortConv<3>::backward(conv, x.cview(), d_y.cview(), d_x.view(), &bad_conv); },
               "d_mixer.kernel", "");
  const auto rglru = RGLRU::Weights<float>::initial(C, 1);
  auto d_rglru = RGLRU::Weights<float>::initial(C, 2);
  RGLRU::backward(rglru, x.cview(), d_y.cview(), d_x.view(), &d_rglru);  // the valid call
  expect_error([&] { RGLRU::backward(rglru, x.cview(), wrong.cview(), d_x.view(), &d_rglru); }, "d_y", "");
  expect_error([&] { RGLRU::backward(rglru, x.cview(), d_y.cview(), d_y.view(), &d_rglru); }, "d_x", "");
  auto bad_rglru = RGLRU::Weights<float>::initial(C, 3);
  bad_rglru.lambda = Tensor<float, 1>({C + 1});
  expect_error([&] { RGLRU::backward(rglru, x.cview(), d_y.cview(), d_x.view(), &bad_rglru); },
               "d_mixer.lambda", "");
}
