// cosFormer and LeaPformer (paper 004 eqs. 6-10), on exec::reference and on
// exec::cpu, each against the explicit T x S oracle on >= 200 random shapes per
// mechanism x direction (causal, bidirectional, cross) x dtype. The oracle forms cos(pi/2 (P_q - P_k))
// directly; the library uses the sin/cos stream decomposition.
//   cosFormer: half the cases with the default M (T, or max(S, T) for cross),
//              half with a larger given M.
//   LeaPformer: proportions from random LeaP modules (leap_factor drawn from the
//              divisors of Dk), or, in half the cases, given tensors in [0, 1]
//              (exact 0 and 1 included).
// Plus compositions with RoPE (cosFormer + RoPE, LeaP + RoPE).
#include <doctest/doctest.h>

#include "linear_backends.hpp"

namespace test_linear_reweight_oracle {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;

const int kCases = case_count(200);
constexpr double kBudget = 1e6;

/// Proportions in [0, 1] with some exact endpoints.
template <class T>
Tensor<T, 3> random_proportions(Rng& rng, const std::array<index_t, 3>& extents) {
  auto p = uniform_tensor<T, 3>(rng, extents, 0.0, 1.0);
  std::uniform_int_distribution<int> coin(0, 15);
  for (index_t i = 0; i < p.size(); ++i) {
    const int draw = coin(rng);
    if (draw == 0) p.data()[i] = T(0);
    if (draw == 1) p.data()[i] = T(1);
  }
  return p;
}

/// A cosFormer (Pos = NoPositional) or cosFormer + RoPE case; `source` < 0: self-attention.
template <class T, class Dir, class Pos>
auto cosformer_case(Rng& rng, int c, std::string& about, bool cross) {
  using A = LinearAttention<Dir, Relu, CosFormerReweight, Pos>;
  const Shape s = random_shape(rng, Pos::rotates_queries_keys ? kBudget / 2 : kBudget);
  const index_t Dk = s.latents, Dv = s.value_dim;
  const index_t S = cross ? random_source_length(rng, s, 2 * Dk, kBudget) : s.time;
  const auto q = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, Dk}, 1.0);
  const auto k = random_tensor<T, 4>(rng, {s.batch, S, s.heads, Dk}, 1.0);
  const auto v = value_input<T>(rng, {s.batch, S, s.heads, Dv});
  typename A::Options options;
  options.normaliser = random_normaliser(rng, CosFormerReweight::default_normaliser());
  const index_t longest = std::max(s.time, S);
  index_t length = longest;  // the default M
  if (c % 2 == 1) {
    length = longest + std::uniform_int_distribution<index_t>(0, 2 * longest)(rng);
    options.reweight.length = length;
  }
  const A attention({.heads = s.heads, .key_dim = Dk, .value_dim = Dv}, options);
  auto [out, out_cpu] = on_both_backends<T>({s.batch, s.time, s.heads, Dv}, [&](auto e, auto o) {
    if constexpr (Dir::is_causal) attention.forward(e, q, k, v, o);
    else if (cross) attention.cross_forward(e, q, k, v, o);
    else attention.forward(e, q, k, v, o);
  });
  LinearOracleSpec spec{
      .causal = Dir::is_causal,
      .feature = oracle_relu,
      .query_proportions = oracle_position_proportions(s.batch, s.time, s.heads, length),
      .key_proportions = oracle_position_proportions(s.batch, S, s.heads, length)};
  if constexpr (Pos::rotates_queries_keys)
    spec.angles = oracle_rope_angles({}, s.heads, Dk);
  set_oracle_normaliser(spec, options.normaliser);
  about = describe(s, cross ? S : -1) + " M=" + std::to_string(length) +
          (options.reweight.length ? " (given)" : " (default)");
  return BackendOutputs<T>{std::move(out), std::move(out_cpu), linear_oracle(spec, q, k, v)};
}

template <class T, class Dir, class Pos>
auto leap_case(Rng& rng, int c, std::string& about, bool cross) {
  using A = LinearAttention<Dir, Relu, LeaPReweight, Pos>;
  const Shape s = random_shape(rng, Pos::rotates_queries_keys ? kBudget / 2 : kBudget);
  const index_t Dk = s.latents, Dv = s.value_dim;
  const index_t S = cross ? random_source_length(rng, s, 2 * Dk, kBudget) : s.time;
  const auto q = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, Dk}, 1.0);
  const auto k = random_tensor<T, 4>(rng, {s.batch, S, s.heads, Dk}, 1.0);
  const auto v = value_input<T>(rng, {s.batch, S, s.heads, Dv});
  typename A::Options options;
  options.normaliser = random_normaliser(rng, LeaPReweight::default_normaliser());
  options.reweight.leap_factor = pick(rng, divisors(Dk));
  options.reweight.query_module = random_leap_module(rng, Dk, options.reweight.leap_factor);
  options.reweight.key_module = random_leap_module(rng, Dk, options.reweight.leap_factor);
  const A attention({.heads = s.heads, .key_dim = Dk, .value_dim = Dv}, options);
  const std::array<index_t, 4> extents{s.batch, s.time, s.heads, Dv};
  std::pair<Tensor<T, 4>, Tensor<T, 4>> outputs;
  LinearOracleSpec spec{.causal = Dir::is_causal, .feature = oracle_relu};
  const bool given = c % 2 == 1;
  if (given) {
    const auto pq = random_proportions<T>(rng, {s.batch, s.time, s.heads});
    const auto pk = random_proportions<T>(rng, {s.batch, S, s.heads});
    const SequenceProportions<T> proportions{pq, pk};
    outputs = on_both_backends<T>(extents, [&](auto e, auto o) {
      if constexpr (Dir::is_causal) attention.forward(e, q, k, v, proportions, o);
      else if (cross) attention.cross_forward(e, q, k, v, proportions, o);
      else attention.forward(e, q, k, v, proportions, o);
    });
    spec.query_proportions = oracle_given_proportions(pq);
    spec.key_proportions = oracle_given_proportions(pk);
  } else {
    outputs = on_both_backends<T>(extents, [&](auto e, auto o) {
      if constexpr (Dir::is_causal) attention.forward(e, q, k, v, o);
      else if (cross) attention.cross_forward(e, q, k, v, o);
      else attention.forward(e, q, k, v, o);
    });
    spec.query_proportions = oracle_leap_proportions(q, *options.reweight.query_module, oracle_relu);
    spec.key_proportions = oracle_leap_proportions(k, *options.reweight.key_module, oracle_relu);
  }
  if constexpr (Pos::rotates_queries_keys)
    spec.angles = oracle_rope_angles({}, s.heads, Dk);
  set_oracle_normaliser(spec, options.normaliser);
  about = describe(s, cross ? S : -1) + " leap_factor=" +
          std::to_string(options.reweight.leap_factor) +
          (given ? " given proportions" : " LeaP modules");
  return BackendOutputs<T>{std::move(outputs.first), std::move(outputs.second),
                           linear_oracle(spec, q, k, v)};
}

template <class T, class Dir, class Pos = NoPositional>
void cosformer_cases(std::uint64_t seed, bool cross = false, int cases = kCases) {
  using A = LinearAttention<Dir, Relu, CosFormerReweight, Pos>;
  run_backend_cases<T>(type_label<A>(), cross ? "cross" : Dir::name, seed, cases,
                      [cross](Rng& rng, int c, std::string& about) {
                        return cosformer_case<T, Dir, Pos>(rng, c, about, cross);
                      });
}

template <class T, class Dir, class Pos = NoPositional>
void leap_cases(std::uint64_t seed, bool cross = false, int cases = kCases) {
  using A = LinearAttention<Dir, Relu, LeaPReweight, Pos>;
  run_backend_cases<T>(type_label<A>(), cross ? "cross" : Dir::name, seed, cases,
                      [cross](Rng& rng, int c, std::string& about) {
                        return leap_case<T, Dir, Pos>(rng, c, about, cross);
                      });
}

}  // namespace

static_assert(std::is_same_v<CosFormer<Causal>, LinearAttention<Causal, Relu, CosFormerReweight>>);
static_assert(std::is_same_v<LeaPformer<Bidirectional>,
                             LinearAttention<Bidirectional, Relu, LeaPReweight, NoPositional>>);

TEST_CASE("CosFormer == oracle (causal, bidirectional, cross; float, double)") {
  cosformer_cases<float, Causal>(601);
  cosformer_cases<double, Causal>(602);
  cosformer_cases<float, Bidirectional>(603);
  cosformer_cases<double, Bidirectional>(604);
  cosformer_cases<float, Bidirectional>(605, true);
  cosformer_cases<double, Bidirectional>(606, true);
}
TEST_CASE("LeaPformer == oracle (causal, bidirectional, cross; float, double)") {
  leap_cases<float, Causal>(611);
  leap_cases<double, Causal>(612);
  leap_cases<float, Bidirectional>(613);
  leap_cases<double, Bidirectional>(614);
  leap_cases<float, Bidirectional>(615, true);
  leap_cases<double, Bidirectional>(616, true);
}
TEST_CASE("compositions: cosFormer + RoPE, LeaP + RoPE == oracle") {
  cosformer_cases<float, Causal, RoPE>(621, false, 60);
  cosformer_cases<double, Bidirectional, RoPE>(622, false, 60);
  leap_cases<double, Causal, RoPE>(623, false, 60);
  leap_cases<float, Bidirectional, RoPE>(624, true, 60);
}

}  // namespace test_linear_reweight_oracle
