// Linear attention with the Relu, EluPlusOne and Identity feature maps and with
// RoPE (paper 004 App. A.6), on exec::reference and on exec::cpu, each against
// the explicit T x S oracle on >= 200 random shapes per mechanism x direction
// (causal, bidirectional, cross) x dtype. Normalisers vary across cases; values are
// drawn from [-0.5, 1) (see value_input in linear_support.hpp).
// LATTE_TEST_SEED_OFFSET=n reruns every random-shape test with other draws.
#include <doctest/doctest.h>

#include <numbers>
#include <span>

#include "linear_backends.hpp"

namespace test_linear_oracle {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;

const int kCases = case_count(200);
constexpr double kBudget = 1.2e6;  // T^2 * B * H * (Dk + Dv) per oracle case

template <class T, class Dir, class Map>
void feature_map_cases(std::uint64_t seed) {
  using A = LinearAttention<Dir, Map>;
  run_backend_cases<T>(type_label<A>(), Dir::name, seed, kCases,
                      [](Rng& rng, int, std::string& about) {
    const Shape s = random_shape(rng, kBudget);
    const index_t Dk = s.latents, Dv = s.value_dim;
    const auto q = feature_input<Map, T>(rng, {s.batch, s.time, s.heads, Dk});
    const auto k = feature_input<Map, T>(rng, {s.batch, s.time, s.heads, Dk});
    const auto v = value_input<T>(rng, {s.batch, s.time, s.heads, Dv});
    const Normaliser normaliser = random_normaliser(rng, NoReweight::default_normaliser());
    const A attention({.heads = s.heads, .key_dim = Dk, .value_dim = Dv},
                      {.normaliser = normaliser});
    auto [out, out_cpu] = on_both_backends<T>(
        v.extents(), [&](auto e, auto o) { attention.forward(e, q, k, v, o); });
    LinearOracleSpec spec{.causal = Dir::is_causal, .feature = oracle_feature_map<Map>()};
    set_oracle_normaliser(spec, normaliser);
    about = describe(s) + " normaliser=" + normaliser.name();
    return BackendOutputs<T>{std::move(out), std::move(out_cpu), linear_oracle(spec, q, k, v)};
  });
}

template <class T, class Map>
void feature_map_cross_cases(std::uint64_t seed) {
  using A = LinearAttention<Bidirectional, Map>;
  run_backend_cases<T>(type_label<A>(), "cross", seed, kCases,
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
    auto [out, out_cpu] = on_both_backends<T>(
        {s.batch, s.time, s.heads, Dv}, [&](auto e, auto o) { attention.cross_forward(e, q, k, v, o); });
    LinearOracleSpec spec{.causal = false, .feature = oracle_feature_map<Map>()};
    set_oracle_normaliser(spec, normaliser);
    about = describe(s, S) + " normaliser=" + normaliser.name();
    return BackendOutputs<T>{std::move(out), std::move(out_cpu), linear_oracle(spec, q, k, v)};
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
  run_backend_cases<T>(type_label<A>(), Dir::name, seed, kCases,
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
    auto [out, out_cpu] = on_both_backends<T>(
        v.extents(), [&](auto e, auto o) { attention.forward(e, q, k, v, o); });
    LinearOracleSpec spec{.causal = Dir::is_causal,
                          .feature = oracle_elu_plus_one,
                          .angles = oracle_rope_angles(options.positional.angles, s.heads, Dk),
                          .rotated_denominator = rotated};
    set_oracle_normaliser(spec, options.normaliser);
    about = describe(s) + (rotated ? " rotated" : " unrotated") + " denominator, " +
            (options.positional.angles.size() ? "given angles" : "default schedule");
    return BackendOutputs<T>{std::move(out), std::move(out_cpu), linear_oracle(spec, q, k, v)};
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

namespace {

/// The cpu backend's chunked GEMM form (cpu::CausalAlgorithm::chunked, DESIGN §5),
/// which exec::cpu does not choose (the scan measured faster) but keeps for the
/// comparison in bench/bench_linear.cpp: called directly, against the oracle.
template <class T, class Rw, class Pos>
void chunked_cases(std::uint64_t seed, bool rotated) {
  using A = LinearAttention<Causal, EluPlusOne, Rw, Pos>;
  run_oracle_cases<T>(type_label<A>() + " chunked", "causal", seed, case_count(40),
                      [rotated](Rng& rng, int, std::string& about) {
    const Shape s = random_shape(rng, kBudget / 2);
    const index_t Dk = s.latents, Dv = s.value_dim, F = Dk, E = Rw::streams * F;
    const auto q = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, Dk}, 1.0);
    const auto k = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, Dk}, 1.0);
    const auto v = value_input<T>(rng, {s.batch, s.time, s.heads, Dv});
    Normaliser normaliser = random_normaliser(rng, Rw::default_normaliser());
    if (rotated) normaliser = well_conditioned_rotated_clamp(q, k, true, oracle_elu_plus_one);
    const std::vector<double> angles = Pos::resolve_angles({}, s.heads, F);
    const cpu::LinearSpec spec{Dk, F, Rw::streams, Dv, &angles, rotated, normaliser};
    std::vector<T> carries(static_cast<std::size_t>(s.batch * s.heads * (E * Dv + E)));
    Tensor<T, 4> out(v.extents());
    cpu::linear_causal_forward<EluPlusOne, Rw, Pos>(
        q.cview(), k.cview(), v.cview(), out.view(), spec, 0,
        [&](cpu::Side, index_t, index_t, index_t, std::int64_t position, const T*) {
          return Proportion::at_position(double(position), double(s.time));  // cosFormer, M = T
        },
        [&](index_t b, index_t h) {
          T* base = carries.data() + (b * s.heads + h) * (E * Dv + E);
          return cpu::LinearCarry<T>{base, base + E * Dv};
        },
        cpu::CausalAlgorithm::chunked);
    LinearOracleSpec oracle{.causal = true, .feature = oracle_elu_plus_one,
                            .rotated_denominator = rotated};
    if constexpr (Rw::streams == 2) {
      oracle.query_proportions = oracle_position_proportions(s.batch, s.time, s.heads, s.time);
      oracle.key_proportions = oracle_position_proportions(s.batch, s.time, s.heads, s.time);
    }
    if constexpr (Pos::rotates_queries_keys) oracle.angles = oracle_rope_angles({}, s.heads, F);
    set_oracle_normaliser(oracle, normaliser);
    about = describe(s) + (rotated ? " rotated denominator" : "");
    return std::pair{std::move(out), linear_oracle(oracle, q, k, v)};
  });
}

}  // namespace

TEST_CASE("exec::cpu chunked GEMM form == oracle (plain, cosFormer, RoPE)") {
  chunked_cases<float, NoReweight, NoPositional>(541, false);
  chunked_cases<double, NoReweight, NoPositional>(542, false);
  chunked_cases<float, CosFormerReweight, NoPositional>(543, false);
  chunked_cases<double, NoReweight, RoPE>(544, false);
  chunked_cases<float, NoReweight, RoPE>(545, true);
}

namespace {

/// A user's feature map with its own feature_dim: [relu(x), relu(-x)] (2 Dk features).
struct SplitSigns {
  static constexpr const char* name = "split_signs";
  static constexpr index_t feature_dim(index_t key_dim) { return 2 * key_dim; }
  template <class T>
  static void apply(std::span<const T> x, std::span<T> phi) noexcept {
    for (std::size_t i = 0; i < x.size(); ++i) {
      phi[i] = x[i] > T(0) ? x[i] : T(0);
      phi[x.size() + i] = x[i] < T(0) ? -x[i] : T(0);
    }
  }
};

std::vector<long double> oracle_split_signs(const std::vector<long double>& x) {
  std::vector<long double> phi(2 * x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    phi[i] = x[i] > 0 ? x[i] : 0.0L;
    phi[x.size() + i] = x[i] < 0 ? -x[i] : 0.0L;
  }
  return phi;
}

template <class T, class Dir, class Pos>
void user_map_cases(std::uint64_t seed) {
  using A = LinearAttention<Dir, SplitSigns, NoReweight, Pos>;
  run_backend_cases<T>(type_label<A>(), Dir::name, seed, case_count(60),
                       [](Rng& rng, int, std::string& about) {
    const Shape s = random_shape(rng, kBudget / 2);
    const index_t Dk = s.latents, Dv = s.value_dim;
    const auto q = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, Dk}, 1.0);
    const auto k = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, Dk}, 1.0);
    const auto v = value_input<T>(rng, {s.batch, s.time, s.heads, Dv});
    const Normaliser normaliser = random_normaliser(rng, NoReweight::default_normaliser());
    const A attention({.heads = s.heads, .key_dim = Dk, .value_dim = Dv},
                      {.normaliser = normaliser});
    auto [out, out_cpu] = on_both_backends<T>(
        v.extents(), [&](auto e, auto o) { attention.forward(e, q, k, v, o); });
    LinearOracleSpec spec{.causal = Dir::is_causal, .feature = oracle_split_signs};
    if constexpr (Pos::rotates_queries_keys) spec.angles = oracle_rope_angles({}, s.heads, 2 * Dk);
    set_oracle_normaliser(spec, normaliser);
    about = describe(s) + " normaliser=" + normaliser.name();
    return BackendOutputs<T>{std::move(out), std::move(out_cpu), linear_oracle(spec, q, k, v)};
  });
}

}  // namespace

TEST_CASE("a user's feature map with its own feature_dim == oracle (float, double)") {
  user_map_cases<float, Causal, NoPositional>(551);
  user_map_cases<double, Bidirectional, NoPositional>(552);
  user_map_cases<double, Causal, RoPE>(553);
}

}  // namespace test_linear_oracle
