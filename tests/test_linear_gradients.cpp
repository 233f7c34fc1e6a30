// LinearAttention::backward (and cross_backward) against the explicit T x S
// oracle of tests/oracles/linear_oracle.hpp: gradients of the long-double loss
// <d_out, oracle(q, k, v, ...)> by central differences (every element, small
// shapes) and along random directions (random shapes up to T = 1000), for the
// built-in feature maps and a user map with its derivative, cosFormer,
// LeaPformer with LeaP modules (module weight gradients) and with given
// proportions (proportion gradients), RoPE with either denominator; causal,
// bidirectional and cross; exec::reference and exec::cpu, fp32 and fp64; -inf
// and zero inputs; RoPE at positions near 1e7 in fp32; and training in chunks
// chained through the state gradients.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "expect_error.hpp"
#include "gradient_check.hpp"
#include "linear_support.hpp"

namespace test_linear_gradients {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;

/// A user's feature map with its derivative and another feature size:
/// phi(x) = [softplus(x), softplus(-x)] (F = 2 Dk), smooth and positive.
struct SoftplusPair {
  static constexpr const char* name = "softplus_pair";
  static index_t feature_dim(index_t key_dim) { return 2 * key_dim; }
  template <class T>
  static void apply(std::span<const T> x, std::span<T> phi) noexcept {
    const std::size_t n = x.size();
    for (std::size_t i = 0; i < n; ++i) {
      phi[i] = std::log1p(std::exp(x[i]));
      phi[n + i] = std::log1p(std::exp(-x[i]));
    }
  }
  template <class T>
  static void backward(std::span<const T> x, std::span<const T> d_phi, std::span<T> d_x) noexcept {
    const std::size_t n = x.size();
    for (std::size_t i = 0; i < n; ++i) {
      const T sigmoid = T(1) / (T(1) + std::exp(-x[i]));
      d_x[i] = sigmoid * d_phi[i] - (T(1) - sigmoid) * d_phi[n + i];
    }
  }
};

std::vector<long double> oracle_softplus_pair(const std::vector<long double>& x) {
  std::vector<long double> phi(2 * x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    phi[i] = std::log1p(std::exp(x[i]));
    phi[x.size() + i] = std::log1p(std::exp(-x[i]));
  }
  return phi;
}

template <class Map>
OracleFeatureMap feature_of() {
  if constexpr (std::is_same_v<Map, SoftplusPair>) return oracle_softplus_pair;
  else return oracle_feature_map<Map>();
}

/// Keeps |x| >= 0.01: central differences with steps of 1e-4 must not straddle
/// relu's kink at 0.
template <class T, std::size_t N>
void away_from_zero(Tensor<T, N>& x) {
  for (index_t i = 0; i < x.size(); ++i) {
    T& value = x.data()[i];
    if (std::fabs(value) < T(0.01)) value = value < 0 ? T(-0.01) : T(0.01);
  }
}

/// The smallest |W1 phi(x) + b1| of a module over every row of x: how close a
/// hidden unit sits to relu's kink.
template <class Map, class T>
double distance_to_kink(const LeaPModule& module, const Tensor<T, 4>& x) {
  const auto feature = feature_of<Map>();
  double nearest = std::numeric_limits<double>::infinity();
  for (index_t b = 0; b < x.extent(0); ++b)
    for (index_t t = 0; t < x.extent(1); ++t)
      for (index_t h = 0; h < x.extent(2); ++h) {
        const auto phi = feature(oracle_row(x, b, t, h));
        for (index_t j = 0; j < module.hidden(); ++j) {
          long double pre = module.b1(j);
          for (index_t f = 0; f < module.w1.extent(1); ++f) pre += module.w1(j, f) * phi[f];
          nearest = std::min(nearest, static_cast<double>(std::fabs(pre)));
        }
      }
  return nearest;
}

/// A random LeaP module none of whose hidden units comes within 1e-3 of the
/// kink on the rows of x (steps of 1e-4 move a unit by less), drawn again
/// until it does not.
template <class Map, class T>
LeaPModule kink_free_module(Rng& rng, const Tensor<T, 4>& x, index_t F, index_t leap_factor) {
  for (;;) {
    LeaPModule module = random_leap_module(rng, F, leap_factor);
    if (distance_to_kink<Map>(module, x) >= 1e-3) return module;
  }
}

/// How a problem is set up beyond its shape.
struct Setup {
  index_t source = -1;            ///< S for cross-attention (-1: self-attention)
  bool given_proportions = false;  ///< LeaP: proportion tensors instead of modules
  bool rotated_denominator = false;
  index_t leap_factor = 2;
};

/// One backward problem: inputs, d_out, the attention, and the kernel's gradients.
template <class T, class A>
struct Problem {
  using Dir = typename A::direction;
  using Map = typename A::feature_map;
  using Rw = typename A::reweight;
  using Pos = typename A::positional;
  static constexpr bool learned = A::learned_proportions;

  Setup setup;
  Tensor<T, 4> q, k, v, g;
  Tensor<T, 3> pq, pk;  // given proportions
  typename A::Options options{};
  std::optional<A> attention;
  Tensor<T, 4> dq, dk, dv;
  Tensor<T, 3> dpq, dpk;
  LeaPModule d_query_module, d_key_module;
  std::vector<Tensor<T, 1>> module_gradients;  // the modules' gradients, as T, for gradients()

  Problem(Rng& rng, const Shape& s, Setup setup_, std::optional<index_t> cosformer_length = {})
      : setup(setup_) {
    const index_t Sn = setup.source >= 0 ? setup.source : s.time;
    q = feature_input<Map, T>(rng, {s.batch, s.time, s.heads, s.latents});
    k = feature_input<Map, T>(rng, {s.batch, Sn, s.heads, s.latents});
    v = value_input<T>(rng, {s.batch, Sn, s.heads, s.value_dim});
    g = uniform_tensor<T, 4>(rng, {s.batch, s.time, s.heads, s.value_dim}, -1, 1);
    away_from_zero(q);
    away_from_zero(k);
    const index_t F = detail::feature_dim_of<Map>(s.latents);
    if constexpr (A::position_proportions) options.reweight.length = cosformer_length;
    if constexpr (learned) {
      options.reweight.leap_factor = F % setup.leap_factor == 0 ? setup.leap_factor : 1;
      if (setup.given_proportions) {
        pq = uniform_tensor<T, 3>(rng, {s.batch, s.time, s.heads}, 0.02, 0.98);
        pk = uniform_tensor<T, 3>(rng, {s.batch, Sn, s.heads}, 0.02, 0.98);
      } else {
        options.reweight.query_module = kink_free_module<Map>(rng, q, F, options.reweight.leap_factor);
        options.reweight.key_module = kink_free_module<Map>(rng, k, F, options.reweight.leap_factor);
      }
    }
    if constexpr (Pos::rotates_queries_keys) {
      if (setup.rotated_denominator) {
        options.rope_denominator = RopeDenominator::rotated;
        options.normaliser = well_conditioned_rotated_clamp(q, k, Dir::is_causal, feature_of<Map>());
      }
    }
    attention.emplace(LinearDims{.heads = s.heads, .key_dim = s.latents, .value_dim = s.value_dim},
                      options);
  }

  template <class E>
  void run(E e, const LinearStateGradients<T>& states = {}) {
    dq = Tensor<T, 4>(q.extents());
    dk = Tensor<T, 4>(k.extents());
    dv = Tensor<T, 4>(v.extents());
    LinearGradients<T> gradients{dq.view(), dk.view(), dv.view()};
    if constexpr (learned) {
      if (setup.given_proportions) {
        dpq = Tensor<T, 3>(pq.extents());
        dpk = Tensor<T, 3>(pk.extents());
        gradients.d_query_proportions = dpq.view();
        gradients.d_key_proportions = dpk.view();
        run_with(e, gradients, states, SequenceProportions<T>{pq.cview(), pk.cview()});
        return;
      }
      d_query_module = options.reweight.query_module->zeros_like();
      d_key_module = options.reweight.key_module->zeros_like();
      gradients.d_query_module = &d_query_module;
      gradients.d_key_module = &d_key_module;
      run_with(e, gradients, states);
      module_gradients.clear();
      for (const LeaPModule* m : {&d_query_module, &d_key_module}) {
        auto add = [&](const double* x, index_t n) {
          Tensor<T, 1> copy({n});
          for (index_t i = 0; i < n; ++i) copy(i) = static_cast<T>(x[i]);
          module_gradients.push_back(std::move(copy));
        };
        add(m->w1.data(), m->w1.size());
        add(m->b1.data(), m->b1.size());
        add(m->w2.data(), m->w2.size());
        add(&m->b2, 1);
      }
      return;
    }
    run_with(e, gradients, states);
  }

  template <class E, class... Proportions>
  void run_with(E e, const LinearGradients<T>& gradients, const LinearStateGradients<T>& states,
                Proportions... given) {
    if constexpr (!Dir::is_causal) {
      (void)states;
      if (setup.source >= 0)
        attention->cross_backward(e, q.cview(), k.cview(), v.cview(), given..., g.cview(),
                                  gradients);
      else
        attention->backward(e, q.cview(), k.cview(), v.cview(), given..., g.cview(), gradients);
    } else {
      attention->backward(e, q.cview(), k.cview(), v.cview(), given..., g.cview(), gradients,
                          states);
    }
  }

  /// The oracle's loss over long-double copies, and the spans it reads.
  struct Loss {
    const Problem* problem;
    TensorLD<4> q, k, v, g;
    TensorLD<3> pq, pk;
    std::vector<ModuleLD> modules;
    std::int64_t first_position = 0;

    long double operator()() const {
      LinearOracleSpec spec;
      spec.causal = Dir::is_causal;
      spec.feature = feature_of<Map>();
      set_oracle_normaliser(spec, problem->attention->options().normaliser);
      const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), Sn = k.extent(1);
      if constexpr (A::position_proportions) {
        const long double M = static_cast<long double>(
            problem->options.reweight.length.value_or(std::max(Tn, Sn)));
        spec.query_proportions = oracle_position_proportions(B, Tn, H, M, first_position);
        spec.key_proportions = oracle_position_proportions(B, Sn, H, M, first_position);
      }
      if constexpr (learned) {
        if (problem->setup.given_proportions) {
          spec.query_proportions = oracle_given_proportions(pq);
          spec.key_proportions = oracle_given_proportions(pk);
        } else {
          spec.query_proportions = modules[0].proportions(q, spec.feature);
          spec.key_proportions = modules[1].proportions(k, spec.feature);
        }
      }
      if constexpr (Pos::rotates_queries_keys) {
        spec.angles = oracle_rope_angles({}, H, problem->attention->feature_dim());
        spec.rotated_denominator = problem->setup.rotated_denominator;
      }
      const TensorLD<4> out = linear_oracle(spec, q, k, v);
      long double total = 0;
      for (index_t i = 0; i < out.size(); ++i) total += g.data()[i] * out.data()[i];
      return total;
    }
    GradientInputs inputs() {
      GradientInputs in{as_input(q), as_input(k), as_input(v)};
      if constexpr (learned) {
        if (problem->setup.given_proportions) {
          in.push_back(as_input(pq));
          in.push_back(as_input(pk));
        } else {
          for (ModuleLD& m : modules)
            for (auto* part : {&m.w1, &m.b1, &m.w2, &m.b2}) in.emplace_back(*part);
        }
      }
      return in;
    }
  };
  Loss loss(std::int64_t first_position = 0) const {
    Loss l{this, to_long_double(q), to_long_double(k), to_long_double(v), to_long_double(g),
           {}, {}, {}, first_position};
    if constexpr (learned) {
      if (setup.given_proportions) {
        l.pq = to_long_double(pq);
        l.pk = to_long_double(pk);
      } else {
        l.modules.emplace_back(*options.reweight.query_module);
        l.modules.emplace_back(*options.reweight.key_module);
      }
    }
    return l;
  }
  std::vector<std::span<const T>> gradients() const {
    std::vector<std::span<const T>> out{span_of(dq), span_of(dk), span_of(dv)};
    if constexpr (learned) {
      if (setup.given_proportions) {
        out.push_back(span_of(dpq));
        out.push_back(span_of(dpk));
      } else {
        for (const Tensor<T, 1>& m : module_gradients) out.push_back(span_of(m));
      }
    }
    return out;
  }
  std::vector<const char*> names() const {
    std::vector<const char*> out{"d_queries", "d_keys", "d_values"};
    if constexpr (learned) {
      if (setup.given_proportions) {
        out.insert(out.end(), {"d_query_proportions", "d_key_proportions"});
      } else {
        out.insert(out.end(), {"d_query_module.w1", "d_query_module.b1", "d_query_module.w2",
                               "d_query_module.b2", "d_key_module.w1", "d_key_module.b1",
                               "d_key_module.w2", "d_key_module.b2"});
      }
    }
    return out;
  }
};

/// Central differences once, then both backends against them.
template <class T, class A>
void check_both_backends(Problem<T, A>& problem, std::int64_t first_position = 0) {
  auto loss = problem.loss(first_position);
  const GradientValues expected = central_differences(loss, loss.inputs());
  long double largest = 0;
  for (const auto& gradient : expected)
    for (const long double x : gradient) largest = std::max(largest, std::fabs(x));
  const auto names = problem.names();
  LinearStateGradients<T> states;
  std::optional<typename A::template State<T>> initial;
  if constexpr (A::direction::is_causal) {
    if (first_position != 0) {
      initial.emplace(problem.attention->template make_state<T>(problem.q.extent(0), first_position));
      states.initial = &*initial;
    }
  }
  for (const bool cpu : {false, true}) {
    CAPTURE(cpu);
    if (cpu) problem.run(exec::cpu, states);
    else problem.run(exec::reference, states);
    const auto got = problem.gradients();
    REQUIRE(got.size() == expected.size());
    for (std::size_t j = 0; j < got.size(); ++j) {
      INFO(std::string(names[j]));
      CHECK(gradient_error(got[j], expected[j], largest) <= Tolerance<T>::gradient);
    }
  }
}

template <class T, class A>
void every_element_cases(std::uint64_t seed, Setup setup = {}) {
  Rng rng(seed);
  // Each loss evaluation rebuilds every T x S matrix: B * H * T * S stays small.
  constexpr Shape shapes[] = {{2, 1, 2, 3, 5}, {1, 9, 2, 4, 1}, {2, 13, 1, 8, 6},
                              {1, 40, 1, 4, 3}};
  for (const Shape& s : shapes) {
    if (s.time == 40 && case_count(2) < 2) continue;  // sanitizer runs: the three smaller shapes
    Setup here = setup;
    if (here.source >= 0) here.source = s.time == 1 ? 3 : s.time / 2 + 5;  // S != T
    Problem<T, A> problem(rng, s, here);
    CAPTURE(s.time);
    CAPTURE(here.source);
    check_both_backends(problem);
  }
}

template <class T, class A>
void direction_cases(std::uint64_t seed, int cases, Setup setup = {}) {
  Rng rng(seed);
  for (int c = 0; c < case_count(cases); ++c) {
    Shape s = random_shape(rng, 4e6);
    s.latents = std::min<index_t>(s.latents, 16);  // the oracle's cost grows with F
    Setup here = setup;
    if (here.source >= 0) here.source = random_source_length(rng, s, s.latents, 4e6);
    Problem<T, A> problem(rng, s, here);
    CAPTURE(s.batch);
    CAPTURE(s.time);
    CAPTURE(s.heads);
    CAPTURE(s.latents);
    CAPTURE(s.value_dim);
    CAPTURE(here.source);
    for (const bool cpu : {false, true}) {
      CAPTURE(cpu);
      if (cpu) problem.run(exec::cpu);
      else problem.run(exec::reference);
      check_direction<T>(problem, rng);
    }
  }
}

/// Every element and random directions for one attention type, in its
/// self-attention and (bidirectional) cross-attention forms.
template <class T, class A>
void oracle_cases(std::uint64_t seed, Setup setup = {}) {
  every_element_cases<T, A>(seed, setup);
  direction_cases<T, A>(seed + 1, 3, setup);
  if constexpr (!A::direction::is_causal) {
    Setup cross = setup;
    cross.source = 0;
    every_element_cases<T, A>(seed + 2, cross);
    direction_cases<T, A>(seed + 3, 2, cross);
  }
}

template <class T, class Dir>
void all_mechanisms(std::uint64_t seed) {
  SUBCASE("elu + 1") { oracle_cases<T, LinearAttention<Dir, EluPlusOne>>(seed); }
  SUBCASE("relu") { oracle_cases<T, LinearAttention<Dir, Relu>>(seed + 10); }
  SUBCASE("identity") { every_element_cases<T, LinearAttention<Dir, Identity>>(seed + 20); }
  SUBCASE("a user's map with its derivative") {
    oracle_cases<T, LinearAttention<Dir, SoftplusPair>>(seed + 30);
  }
  SUBCASE("cosFormer") { oracle_cases<T, CosFormer<Dir>>(seed + 40); }
  SUBCASE("LeaPformer, LeaP modules") { oracle_cases<T, LeaPformer<Dir>>(seed + 50); }
  SUBCASE("LeaPformer, given proportions") {
    oracle_cases<T, LeaPformer<Dir>>(seed + 60, {.given_proportions = true});
  }
  SUBCASE("RoPE, un-rotated denominator") {
    oracle_cases<T, LinearAttention<Dir, EluPlusOne, NoReweight, RoPE>>(seed + 70);
  }
  SUBCASE("RoPE, rotated denominator") {
    oracle_cases<T, LinearAttention<Dir, EluPlusOne, NoReweight, RoPE>>(
        seed + 80, {.rotated_denominator = true});
  }
}

}  // namespace

TEST_CASE("causal linear-family backward matches the oracle's gradients, fp64") {
  all_mechanisms<double, Causal>(1000);
}
TEST_CASE("causal linear-family backward matches the oracle's gradients, fp32") {
  all_mechanisms<float, Causal>(2000);
}
TEST_CASE("bidirectional and cross linear-family backward matches the oracle's gradients, fp64") {
  all_mechanisms<double, Bidirectional>(3000);
}
TEST_CASE("bidirectional and cross linear-family backward matches the oracle's gradients, fp32") {
  all_mechanisms<float, Bidirectional>(4000);
}

TEST_CASE("linear backward: -inf and zero inputs give finite gradients, exactly 0 through phi = 0") {
  Rng rng(5000);
  auto adversarial = [&]<class T, class A>(T, A*) {
    const Shape s{1, 17, 2, 4, 3};
    Problem<T, A> problem(rng, s, {});
    constexpr T minus_inf = -std::numeric_limits<T>::infinity();
    for (index_t h = 0; h < 2; ++h) {
      problem.k(0, 3, h, 1) = minus_inf;
      problem.q(0, 5, h, 2) = minus_inf;
      for (index_t d = 0; d < 4; ++d) problem.q(0, 8, h, d) = minus_inf;  // a query with phi = 0
      for (index_t d = 0; d < 3; ++d) problem.v(0, 11, h, d) = 0;
    }
    for (const bool cpu : {false, true}) {
      CAPTURE(cpu);
      if (cpu) problem.run(exec::cpu);
      else problem.run(exec::reference);
      check_finite_and_zero_at_minus_inf<T>(problem);
    }
    check_both_backends(problem);
  };
  adversarial(double{}, static_cast<LinearAttention<Causal, EluPlusOne>*>(nullptr));
  adversarial(float{}, static_cast<LinearAttention<Bidirectional, EluPlusOne>*>(nullptr));
  adversarial(double{}, static_cast<CosFormer<Causal>*>(nullptr));
  adversarial(float{}, static_cast<LeaPformer<Causal>*>(nullptr));
}

TEST_CASE("causal RoPE linear backward at positions near 1e7 in fp32 matches the oracle") {
  // Scores depend on s - t only, so a sequence starting at 10^7 has the
  // oracle's gradients at position 0.
  Rng rng(6000);
  const Shape s{1, 29, 2, 6, 4};
  Problem<float, LinearAttention<Causal, EluPlusOne, NoReweight, RoPE>> problem(rng, s, {});
  for (const std::int64_t first : {std::int64_t{9'999'989}, std::int64_t{1} << 40}) {
    CAPTURE(first);
    check_both_backends(problem, first);
  }
}

namespace {

/// Backward over [0, T) equals the backward over two chunks [0, cut), [cut, T)
/// chained through the state: forward chunk 1 from `start` leaves S1; backward
/// of chunk 2 from S1 gives dS1; backward of chunk 1 with d_final = dS1.
template <class T, class A, class E>
void check_chunks(E e, Rng& rng, const Shape& s, index_t cut, std::int64_t first_position,
                  Setup setup = {}) {
  std::optional<index_t> length;
  if constexpr (A::position_proportions) length = first_position + s.time + 3;
  Problem<T, A> whole(rng, s, setup, length);
  const A& attention = *whole.attention;
  const auto start = attention.template make_state<T>(s.batch, first_position);
  whole.run(e, {.initial = &start});

  const index_t rest = s.time - cut;
  auto state = start;
  Tensor<T, 4> out({s.batch, cut, s.heads, s.value_dim});
  const Tensor<T, 4> q1 = time_slice(whole.q, 0, cut), k1 = time_slice(whole.k, 0, cut),
                     v1 = time_slice(whole.v, 0, cut);
  attention.forward(e, q1.cview(), k1.cview(), v1.cview(), out.view(), state);
  const auto s1 = state;
  Problem<T, A> second = whole;
  second.q = time_slice(whole.q, cut, rest);
  second.k = time_slice(whole.k, cut, rest);
  second.v = time_slice(whole.v, cut, rest);
  second.g = time_slice(whole.g, cut, rest);
  auto d_s1 = attention.template make_state<T>(s.batch);
  second.run(e, {.initial = &s1, .d_initial = &d_s1});
  Problem<T, A> first = whole;
  first.q = q1;
  first.k = k1;
  first.v = v1;
  first.g = time_slice(whole.g, 0, cut);
  first.run(e, {.initial = &start, .d_final = &d_s1});

  // Both sides are sums of the same terms grouped differently: rounding only.
  const double bound = 50 * Tolerance<T>::relative;
  CHECK(relative_error(whole.dq, join_in_time(first.dq, second.dq)) <= bound);
  CHECK(relative_error(whole.dk, join_in_time(first.dk, second.dk)) <= bound);
  CHECK(relative_error(whole.dv, join_in_time(first.dv, second.dv)) <= bound);
  if constexpr (A::learned_proportions) {  // module gradients: the two chunks' sum
    for (std::size_t j = 0; j < whole.module_gradients.size(); ++j)
      CHECK(sum_error(first.module_gradients[j], second.module_gradients[j],
                      whole.module_gradients[j]) <= bound);
  }
}

}  // namespace

TEST_CASE("linear training in chunks: backward chained through the state gradients equals the whole backward") {
  Rng rng(7000);
  for (const index_t cut : {1, 17, 70}) {
    CAPTURE(cut);
    const Shape s{2, 100, 3, 6, 5};
    check_chunks<double, LinearAttention<Causal, EluPlusOne>>(exec::reference, rng, s, cut, 0);
    check_chunks<double, LinearAttention<Causal, EluPlusOne>>(exec::cpu, rng, s, cut, 0);
    check_chunks<float, LinearAttention<Causal, EluPlusOne>>(exec::cpu, rng, s, cut, 0);
    check_chunks<double, CosFormer<Causal>>(exec::cpu, rng, s, cut, 4);
    check_chunks<double, LeaPformer<Causal>>(exec::cpu, rng, s, cut, 0);
    check_chunks<double, LeaPformer<Causal>>(exec::reference, rng, s, cut, 0);
    check_chunks<double, LinearAttention<Causal, EluPlusOne, NoReweight, RoPE>>(exec::cpu, rng, s,
                                                                               cut, 1000);
    check_chunks<float, LinearAttention<Causal, Relu, NoReweight, RoPE>>(exec::reference, rng, s,
                                                                         cut, 7);
  }
}

TEST_CASE("linear backward: empty sequences, and bad gradient buffers are refused by name") {
  const LeaPformer<Causal> given({.heads = 2, .key_dim = 4, .value_dim = 3});
  Tensor<float, 4> q({1, 5, 2, 4}), k({1, 5, 2, 4}), v({1, 5, 2, 3}), g({1, 5, 2, 3});
  Tensor<float, 4> dq({1, 5, 2, 4}), dk({1, 5, 2, 4}), dv({1, 5, 2, 3}), wrong({1, 5, 2, 5});
  Tensor<float, 3> p({1, 5, 2}, 0.5f), dp({1, 5, 2}), wrong_p({1, 4, 2});
  const SequenceProportions<float> proportions{p.cview(), p.cview()};
  auto call = [&](LinearGradients<float> gradients, TensorView<const float, 4> d_out) {
    given.backward(exec::reference, q.cview(), k.cview(), v.cview(), proportions, d_out, gradients);
  };
  expect_error([&] { call({dq.view(), dk.view(), wrong.view()}, g.cview()); }, "gradients.d_values", "");
  expect_error([&] { call({dk.view(), dk.view(), dv.view()}, g.cview()); }, "gradients.d_keys", "");
  expect_error([&] { call({dq.view(), dk.view(), dv.view()}, wrong.cview()); }, "d_out", "");
  expect_error([&] { call({q.view(), dk.view(), dv.view()}, g.cview()); }, "gradients.d_queries", "");
  expect_error([&] { call({dq.view(), dk.view(), g.view()}, g.cview()); }, "gradients.d_values", "");
  expect_error([&] { call({dq.view(), dk.view(), dv.view(), wrong_p.view()}, g.cview()); },
         "gradients.d_query_proportions", "");
  expect_error([&] { call({dq.view(), dk.view(), dv.view(), dp.view(), dp.view()}, g.cview()); },
         "gradients.d_key_proportions", "");
  expect_error([&] { call({dq.view(), dk.view(), dv.view(), p.view()}, g.cview()); },
         "gradients.d_query_proportions", "");
  {  // d_queries over the given proportions: named as the gradient, not as an 'out'
    std::vector<float> shared(40, 0.5f);
    const TensorView<const float, 3> over(shared.data(), {1, 5, 2});
    const TensorView<float, 4> d_queries(shared.data(), {1, 5, 2, 4});
    expect_error([&] {
      given.backward(exec::reference, q.cview(), k.cview(), v.cview(),
                     SequenceProportions<float>{over, over}, g.cview(),
                     LinearGradients<float>{d_queries, dk.view(), dv.view()});
    }, "gradients.d_queries", "");
  }
  // Without proportions and without modules there is nothing to differentiate through.
  expect_error([&] {
    given.backward(exec::reference, q.cview(), k.cview(), v.cview(), g.cview(),
                   LinearGradients<float>{dq.view(), dk.view(), dv.view()});
  }, "proportions", "");
  LeaPModule module_gradient;
  expect_error([&] {
    call({dq.view(), dk.view(), dv.view(), {}, {}, &module_gradient}, g.cview());
  }, "gradients.d_query_module", "");
  const LinearAttention<Causal, EluPlusOne> plain({.heads = 2, .key_dim = 4, .value_dim = 3});
  expect_error([&] {
    plain.backward(exec::reference, q.cview(), k.cview(), v.cview(), g.cview(),
                   LinearGradients<float>{dq.view(), dk.view(), dv.view(), dp.view()});
  }, "gradients.d_query_proportions", "");
  const auto other =
      LinearAttention<Causal, EluPlusOne>({.heads = 2, .key_dim = 4, .value_dim = 2}).make_state<float>(1);
  expect_error([&] {
    plain.backward(exec::reference, q.cview(), k.cview(), v.cview(), g.cview(),
                   LinearGradients<float>{dq.view(), dk.view(), dv.view()},
                   LinearStateGradients<float>{.initial = &other});
  }, "states.initial", "");
  auto state = plain.make_state<float>(1);
  expect_error([&] {
    plain.backward(exec::reference, q.cview(), k.cview(), v.cview(), g.cview(),
                   LinearGradients<float>{dq.view(), dk.view(), dv.view()},
                   LinearStateGradients<float>{.initial = &state, .d_initial = &state});
  }, "states.d_initial", "");
  // T = 0: nothing to write; the initial state's gradient is the final one's.
  Tensor<float, 4> none({1, 0, 2, 4}), none_v({1, 0, 2, 3});
  auto d_final = plain.make_state<float>(1);
  d_final.field(0)[5] = 3.0f;
  auto d_initial = plain.make_state<float>(1);
  plain.backward(exec::cpu, none.cview(), none.cview(), none_v.cview(), none_v.cview(),
                 LinearGradients<float>{none.view(), none.view(), none_v.view()},
                 LinearStateGradients<float>{.initial = &state, .d_final = &d_final,
                                             .d_initial = &d_initial});
  CHECK(d_initial.field(0)[5] == 3.0f);
}

}  // namespace test_linear_gradients
