// Linear attention with the Relu, EluPlusOne and Identity feature maps and with
// RoPE (paper 004 App. A.6), reference backend, against the explicit T x S
// oracle on >= 200 random shapes per mechanism x direction (causal,
// bidirectional, cross) x dtype. Normalisers vary across cases; values are
// drawn from [-0.5, 1) (see value_input in linear_support.hpp).
// LATTE_TEST_SEED_OFFSET=n reruns every random-shape test with other draws.
#include <doctest/doctest.h>

#include <numbers>

#include "linear_support.hpp"

namespace {
using namespace latte;
using namespace latte::test;

constexpr int kCases = 200;
constexpr double kBudget = 1.2e6;  // T^2 * B * H * (Dk + Dv) per oracle case

template <class T, class Dir, class Map>
void feature_map_cases(std::uint64_t seed) {
  using A = LinearAttention<Dir, Map>;
  run_oracle_cases<T>(type_label<A>(), Dir::name, seed, kCases,
                      [](Rng& rng, int, std::string& about) {
    const Shape s = random_shape(rng, kBudget);
    const index_t Dk = s.latents, Dv = s.value_dim;
    const auto q = feature_input<Map, T>(rng, {s.batch, s.time, s.heads, Dk});
    const auto k = feature_input<Map, T>(rng, {s.batch, s.time, s.heads, Dk});
    const auto v = value_input<T>(rng, {s.batch, s.time, s.heads, Dv});
    const Normaliser normaliser = random_normaliser(rng, NoReweight::default_normaliser());
    const A attention({.heads = s.heads, .key_dim = Dk, .value_dim = Dv},
                      {.normaliser = normaliser});
    Tensor<T, 4> out(v.extents());
    attention.forward(exec::reference, q, k, v, out.view());
    LinearOracleSpec spec{.causal = Dir::is_causal, .feature = oracle_feature_map<Map>()};
    set_oracle_normaliser(spec, normaliser);
    about = describe(s) + " normaliser=" + normaliser.name();
    return std::pair{std::move(out), linear_oracle(spec, q, k, v)};
  });
}

template <class T, class Map>
void feature_map_cross_cases(std::uint64_t seed) {
  using A = LinearAttention<Bidirectional, Map>;
  run_oracle_cases<T>(type_label<A>(), "cross", seed, kCases,
                      [](Rng& rng, int, std::string& about) {
    const Shape s = random_shape(rng, kBudget);
    const index_t Dk = s.latents, Dv = s.value_dim;
    const index_t S = random_source_length(rng, s, Dk, kBudget);
    const auto q = feature_input<Map, T>(rng, {s.batch, s.time, s.heads, Dk});
    const auto k = feature_input<Map, T>(rng, {s.batch, S, s.heads, Dk});
    const auto v = value_input<T>(rng, {s.batch, S, s.heads, Dv});
    const Normaliser normaliser = random_normaliser(rng, NoReweight::default_normaliser());
    const A attention({.heads = s.heads, .key_dim = Dk, .value_dim = Dv},
                      {.normaliser = normaliser});
    Tensor<T, 4> out({s.batch, s.time, s.heads, Dv});
    attention.cross_forward(exec::reference, q, k, v, out.view());
    LinearOracleSpec spec{.causal = false, .feature = oracle_feature_map<Map>()};
    set_oracle_normaliser(spec, normaliser);
    about = describe(s, S) + " normaliser=" + normaliser.name();
    return std::pair{std::move(out), linear_oracle(spec, q, k, v)};
  });
}

/// RoPE on phi(q), phi(k) with EluPlusOne features (paper 004's "RoPE w/ Linear
/// Attn."). Odd cases use the rotated denominator with the default schedule and
/// a clamp that keeps every row well conditioned (well_conditioned_rotated_clamp);
/// even cases the un-rotated denominator, half of them with learned-looking
/// angles in (0, pi).
template <class T, class Dir>
void rope_cases(std::uint64_t seed) {
  using A = LinearAttention<Dir, EluPlusOne, NoReweight, RoPE>;
  run_oracle_cases<T>(type_label<A>(), Dir::name, seed, kCases,
                      [](Rng& rng, int c, std::string& about) {
    const Shape s = random_shape(rng, kBudget / 2);
    const index_t Dk = s.latents, Dv = s.value_dim;
    const auto q = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, Dk}, 1.0);
    const auto k = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, Dk}, 1.0);
    const auto v = value_input<T>(rng, {s.batch, s.time, s.heads, Dv});
    typename A::Options options;
    options.normaliser = random_normaliser(rng, NoReweight::default_normaliser());
    const bool rotated = c % 2 == 1;
    if (rotated) {
      options.rope_denominator = RopeDenominator::rotated;
      options.normaliser = well_conditioned_rotated_clamp(q, k, Dir::is_causal, oracle_elu_plus_one);
    }
    if (c % 4 == 2)
      options.positional.angles =
          uniform_tensor<double, 2>(rng, {s.heads, Dk / 2}, 0.0, std::numbers::pi);
    const A attention({.heads = s.heads, .key_dim = Dk, .value_dim = Dv}, options);
    Tensor<T, 4> out(v.extents());
    attention.forward(exec::reference, q, k, v, out.view());
    LinearOracleSpec spec{.causal = Dir::is_causal,
                          .feature = oracle_elu_plus_one,
                          .angles = oracle_rope_angles(options.positional.angles, s.heads, Dk),
                          .rotated_denominator = rotated};
    set_oracle_normaliser(spec, options.normaliser);
    about = describe(s) + (rotated ? " rotated" : " unrotated") + " denominator, " +
            (options.positional.angles.size() ? "given angles" : "default schedule");
    return std::pair{std::move(out), linear_oracle(spec, q, k, v)};
  });
}

}  // namespace

TEST_CASE("LinearAttention<Relu> == oracle (causal, bidirectional, cross; float, double)") {
  feature_map_cases<float, Causal, Relu>(501);
  feature_map_cases<double, Causal, Relu>(502);
  feature_map_cases<float, Bidirectional, Relu>(503);
  feature_map_cases<double, Bidirectional, Relu>(504);
  feature_map_cross_cases<float, Relu>(505);
  feature_map_cross_cases<double, Relu>(506);
}
TEST_CASE("LinearAttention<EluPlusOne> == oracle (causal, bidirectional, cross; float, double)") {
  feature_map_cases<float, Causal, EluPlusOne>(511);
  feature_map_cases<double, Causal, EluPlusOne>(512);
  feature_map_cases<float, Bidirectional, EluPlusOne>(513);
  feature_map_cases<double, Bidirectional, EluPlusOne>(514);
  feature_map_cross_cases<float, EluPlusOne>(515);
  feature_map_cross_cases<double, EluPlusOne>(516);
}
TEST_CASE("LinearAttention<Identity> == oracle (causal, bidirectional, cross; float, double)") {
  feature_map_cases<float, Causal, Identity>(521);
  feature_map_cases<double, Causal, Identity>(522);
  feature_map_cases<float, Bidirectional, Identity>(523);
  feature_map_cases<double, Bidirectional, Identity>(524);
  feature_map_cross_cases<float, Identity>(525);
  feature_map_cross_cases<double, Identity>(526);
}
TEST_CASE("LinearAttention<EluPlusOne, NoReweight, RoPE> == oracle (float, double)") {
  rope_cases<float, Causal>(531);
  rope_cases<double, Causal>(532);
  rope_cases<float, Bidirectional>(533);
  rope_cases<double, Bidirectional>(534);
}
