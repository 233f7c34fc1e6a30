// Adversarial numerics of the linear-attention family: denominators <= 0 (the
// Identity map on mixed-sign inputs, RoPE with a rotated denominator) are
// clamped as documented and stay finite; saturated LeaP sigmoids keep the
// relative precision of 1 - P; all-zero features and values; rows summing to
// one; a normaliser below float's range.
#include <doctest/doctest.h>

#include <cmath>
#include <numbers>

#include "linear_support.hpp"

namespace test_linear_numerics {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;

template <class A, class T>
Tensor<T, 4> run(const A& attention, const Tensor<T, 4>& q, const Tensor<T, 4>& k,
                 const Tensor<T, 4>& v) {
  Tensor<T, 4> out(v.extents());
  attention.forward(exec::reference, q, k, v, out.view());
  return out;
}

}  // namespace

TEST_CASE("a negative denominator (Identity map) is clamped: max(D, 0) + eps or max(D, c)") {
  // T = 2, Dk = Dv = 1: D_0 = 1 * 1 = 1, D_1 = 1 * 1 + 1 * (-3) = -2.
  Tensor<double, 4> q({1, 2, 1, 1}, 1.0), k({1, 2, 1, 1}), v({1, 2, 1, 1});
  k(0, 0, 0, 0) = 1.0;
  k(0, 1, 0, 0) = -3.0;
  v(0, 0, 0, 0) = 1.0;
  v(0, 1, 0, 0) = 2.0;
  const auto additive = run(LinearAttention<Causal, Identity>({1, 1, 1}), q, k, v);
  CHECK(additive(0, 0, 0, 0) == doctest::Approx(1.0 / (1.0 + 1e-6)).epsilon(1e-15));
  CHECK(additive(0, 1, 0, 0) == doctest::Approx((1.0 - 6.0) / 1e-6).epsilon(1e-12));  // -5 / eps
  const auto clamped = run(
      LinearAttention<Causal, Identity>({1, 1, 1}, {.normaliser = Normaliser::clamp_min(0.5)}), q,
      k, v);
  CHECK(clamped(0, 0, 0, 0) == doctest::Approx(1.0).epsilon(1e-15));
  CHECK(clamped(0, 1, 0, 0) == doctest::Approx(-10.0).epsilon(1e-15));
  LinearOracleSpec spec{.causal = true, .feature = oracle_identity};
  CHECK(relative_error(additive, linear_oracle(spec, q, k, v)) <= Tolerance<double>::relative);
  spec.clamp = true;
  spec.value = 0.5L;
  CHECK(relative_error(clamped, linear_oracle(spec, q, k, v)) <= Tolerance<double>::relative);
}

TEST_CASE("RoPE: a rotated denominator <= 0 is clamped, the un-rotated one is not") {
  // Dk = 2, one pair turning by pi per position: R^{-1} k_0 = -k_0.
  using A = LinearAttention<Causal, Identity, NoReweight, RoPE>;
  typename A::Options options;
  options.positional.angles = Tensor<double, 2>({1, 1}, std::numbers::pi);
  options.normaliser = Normaliser::clamp_min(0.25);
  Tensor<double, 4> q({1, 2, 1, 2}, 0.0), k({1, 2, 1, 2}, 0.0), v({1, 2, 1, 1});
  q(0, 0, 0, 0) = q(0, 1, 0, 0) = 1.0;
  k(0, 0, 0, 0) = 1.0;
  k(0, 1, 0, 0) = 0.1;
  v(0, 0, 0, 0) = 1.0;
  v(0, 1, 0, 0) = 1.0;
  // Scores at t = 1: -1 (s = 0) and 0.1 (s = 1); rotated D_1 = -0.9, un-rotated 1.1.
  const auto unrotated = run(A({1, 2, 1}, options), q, k, v);
  options.rope_denominator = RopeDenominator::rotated;
  const auto rotated = run(A({1, 2, 1}, options), q, k, v);
  CHECK(unrotated(0, 1, 0, 0) == doctest::Approx(-0.9 / 1.1).epsilon(1e-14));
  CHECK(rotated(0, 1, 0, 0) == doctest::Approx(-0.9 / 0.25).epsilon(1e-14));
  LinearOracleSpec spec{.causal = true, .feature = oracle_identity, .angles = {std::numbers::pi_v<long double>},
                        .clamp = true, .value = 0.25L};
  CHECK(relative_error(unrotated, linear_oracle(spec, q, k, v)) <= Tolerance<double>::relative);
  spec.rotated_denominator = true;
  CHECK(relative_error(rotated, linear_oracle(spec, q, k, v)) <= Tolerance<double>::relative);
}

TEST_CASE("Identity on mixed-sign inputs: finite and equal to the oracle's clamped definition") {
  Rng rng(801);
  for (int c = 0; c < 20; ++c) {
    const index_t Tn = 1 + static_cast<index_t>(rng() % 40), Dk = 3, Dv = 4;
    const auto q = random_tensor<double, 4>(rng, {1, Tn, 2, Dk}, 1.0);
    const auto k = random_tensor<double, 4>(rng, {1, Tn, 2, Dk}, 1.0);
    const auto v = uniform_tensor<double, 4>(rng, {1, Tn, 2, Dv}, -1, 1);
    // clamp_min(1): a denominator near 0 is replaced, so the output is well conditioned.
    const LinearAttention<Causal, Identity> attention({2, Dk, Dv},
                                                      {.normaliser = Normaliser::clamp_min(1.0)});
    const auto out = run(attention, q, k, v);
    CHECK(all_finite(out));
    LinearOracleSpec spec{.causal = true, .feature = oracle_identity, .clamp = true, .value = 1.0L};
    CHECK(relative_error(out, linear_oracle(spec, q, k, v)) <= 1e-11);  // cond. up to ~10 x fp64 tol
  }
}

TEST_CASE("LeaP with saturated sigmoids (P within 1e-13 of 0 and 1) keeps 1 - P exact (fp64)") {
  // Query logits ~ +30 and key logits ~ -30: cos(pi/2 (P_q - P_k)) ~ 1e-13 for every
  // pair. Forming 1 - P by subtraction would leave ~3 significant digits here.
  Rng rng(802);
  const index_t B = 1, Tn = 23, H = 2, Dk = 8, Dv = 3;
  LeaPReweight::Params leap{.query_module = random_leap_module(rng, Dk, 4),
                            .key_module = random_leap_module(rng, Dk, 4),
                            .leap_factor = 4};
  leap.query_module->b2 = 30.0;
  leap.key_module->b2 = -30.0;
  for (index_t j = 0; j < 2; ++j) {
    leap.query_module->w2(j) *= 0.25;
    leap.key_module->w2(j) *= 0.25;
  }
  const auto q = random_tensor<double, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto k = random_tensor<double, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto v = uniform_tensor<double, 4>(rng, {B, Tn, H, Dv}, -1, 1);
  for (const Normaliser normaliser : {Normaliser::clamp_min(0.1), Normaliser::additive(1e-30)}) {
    const LeaPformer<Causal> attention({H, Dk, Dv}, {.normaliser = normaliser, .reweight = leap});
    const auto out = run(attention, q, k, v);
    LinearOracleSpec spec{.causal = true, .feature = oracle_relu};
    set_oracle_normaliser(spec, normaliser);
    spec.query_proportions = oracle_leap_proportions(q, *leap.query_module, oracle_relu);
    spec.key_proportions = oracle_leap_proportions(k, *leap.key_module, oracle_relu);
    CHECK(spec.query_proportions[0].complement < 1e-10);
    const double error = relative_error(out, linear_oracle(spec, q, k, v));
    CHECK(error <= Tolerance<double>::relative);
    std::printf("[numerics] LeaPformer saturated sigmoids, %-9s float64 max_rel_error=%.3e\n",
                normaliser.name(), error);
  }
}

TEST_CASE_TEMPLATE("all-zero features or values give zero outputs, never NaN", T, float, double) {
  Rng rng(803);
  const index_t B = 2, Tn = 17, H = 3, Dk = 5, Dv = 4;
  const auto positive = uniform_tensor<T, 4>(rng, {B, Tn, H, Dk}, 0.1, 1.0);
  Tensor<T, 4> negative(positive.extents());
  for (index_t i = 0; i < negative.size(); ++i) negative.data()[i] = -positive.data()[i];
  const auto v = uniform_tensor<T, 4>(rng, {B, Tn, H, Dv}, -1, 1);
  const Tensor<T, 4> zero_values({B, Tn, H, Dv}, T(0));
  auto all_zero = [](const Tensor<T, 4>& x) {
    return std::all_of(x.data(), x.data() + x.size(), [](T value) { return value == T(0); });
  };
  for (const Normaliser normaliser : {Normaliser::additive(), Normaliser::clamp_min(1e-6),
                                      Normaliser::additive(1e-50)}) {  // 1e-50 underflows in float
    // ReLU of negative queries is 0: no weight anywhere, D = 0.
    CHECK(all_zero(run(LinearAttention<Causal, Relu>({H, Dk, Dv}, {.normaliser = normaliser}),
                       negative, positive, v)));
    CHECK(all_zero(run(CosFormer<Bidirectional>({H, Dk, Dv}, {.normaliser = normaliser}), positive,
                       negative, v)));
    CHECK(all_zero(run(LinearAttention<Causal, EluPlusOne>({H, Dk, Dv}, {.normaliser = normaliser}),
                       positive, negative, zero_values)));
  }
}

TEST_CASE_TEMPLATE("rows sum to one: constant values come back unchanged", T, float, double) {
  Rng rng(804);
  const index_t B = 1, Tn = 200, H = 2, Dk = 16, Dv = 3;
  const auto q = random_tensor<T, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto k = random_tensor<T, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const Tensor<T, 4> ones({B, Tn, H, Dv}, T(1));
  const Normaliser tiny = Normaliser::additive(1e-30);
  auto max_deviation = [](const Tensor<T, 4>& out) {
    double worst = 0;
    for (index_t i = 0; i < out.size(); ++i) worst = std::max(worst, std::fabs(double(out.data()[i]) - 1.0));
    return worst;
  };
  CHECK(max_deviation(run(LinearAttention<Causal, EluPlusOne>({H, Dk, Dv}, {.normaliser = tiny}), q, k,
                          ones)) <= Tolerance<T>::relative);
  CHECK(max_deviation(run(LinearAttention<Bidirectional, EluPlusOne, NoReweight, RoPE>(
                              {H, Dk, Dv}, {.normaliser = tiny,
                                            .rope_denominator = RopeDenominator::rotated}),
                          q, k, ones)) <= Tolerance<T>::relative);
  typename CosFormer<Causal>::Options options;
  options.normaliser = tiny;
  // Relu features: the first queries can see only zero-feature keys; start at t = 8.
  const auto cos_out = run(CosFormer<Causal>({H, Dk, Dv}, options), q, k, ones);
  double worst = 0;
  for (index_t t = 8; t < Tn; ++t)
    for (index_t h = 0; h < H; ++h) worst = std::max(worst, std::fabs(double(cos_out(0, t, h, 0)) - 1.0));
  CHECK(worst <= Tolerance<T>::relative);
}

}  // namespace test_linear_numerics
