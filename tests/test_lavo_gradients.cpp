// Lavo::backward and Lavo::cross_backward against the long-double oracle
// written from the definition (tests/oracles/lavo_oracle.hpp): gradients of the
// loss <d_out, oracle(q, k, v; P, B)> by central differences (every element of
// q, k, v, the relative bias P and the bases B, small shapes) and along random
// directions (random shapes and windows), causal and bidirectional, both
// empty-memory rules, cross-attention (empty source included), on
// exec::reference and exec::cpu, fp32 and fp64; saturated softmaxes; chunked
// training through the state gradients; bad gradient buffers.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

#include "expect_error.hpp"
#include "gradient_check.hpp"
#include "latte/core/orthonormal_basis.hpp"
#include "latte/mechanisms/lavo.hpp"
#include "oracles/lavo_oracle.hpp"
#include "support.hpp"

namespace test_lavo_gradients {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;

struct LavoShape {
  index_t batch, time, heads, dim, bases, window;
};

/// The weights of one problem: orthonormal or arbitrary bases, a random bias.
struct LavoWeights {
  Tensor<double, 3> bases;
  Tensor<double, 2> bias;
};

template <class T>
LavoWeights random_weights(Rng& rng, const LavoShape& s, bool orthonormal, double bias_scale) {
  LavoWeights weights;
  weights.bases = orthonormal ? rounded_to<T>(orthonormal_bases(s.heads, s.bases, s.dim, rng()))
                              : rounded_to<T>(random_tensor<double, 3>(rng, {s.heads, s.bases, s.dim}, 0.7));
  weights.bias = rounded_to<T>(random_tensor<double, 2>(rng, {s.heads, 2 * s.window - 1}, bias_scale));
  return weights;
}

/// One self-attention backward problem: inputs, d_out, the attention, the kernel's gradients.
template <class T, class Dir>
struct Problem {
  LavoShape shape;
  Tensor<T, 4> q, k, v, g;
  LavoWeights weights;
  bool local_only = false;
  std::optional<Lavo<Dir>> attention;
  Tensor<T, 4> dq, dk, dv;
  Tensor<T, 2> d_bias;
  Tensor<T, 3> d_bases;

  Problem(Rng& rng, const LavoShape& s, double input_scale, bool local_only_rule = false)
      : shape(s), local_only(local_only_rule) {
    const std::array<index_t, 4> extents{s.batch, s.time, s.heads, s.dim};
    q = random_tensor<T, 4>(rng, extents, input_scale);
    k = random_tensor<T, 4>(rng, extents, input_scale);
    v = uniform_tensor<T, 4>(rng, extents, -1, 1);
    g = uniform_tensor<T, 4>(rng, extents, -1, 1);
    weights = random_weights<T>(rng, s, rng() % 2 == 0, 1.0);
    rebuild();
  }

  void rebuild() {
    attention.emplace(LavoDims{.heads = shape.heads, .dim = shape.dim, .bases = shape.bases,
                               .window = shape.window},
                      LavoParams{.bases = weights.bases,
                                 .relative_bias = weights.bias,
                                 .empty_memory = local_only ? LavoEmptyMemory::local_only
                                                            : LavoEmptyMemory::zero});
  }

  template <class E>
  void run(E e, const LavoStateGradients<T>* states = nullptr) {
    dq = Tensor<T, 4>(q.extents());
    dk = Tensor<T, 4>(k.extents());
    dv = Tensor<T, 4>(v.extents());
    d_bias = Tensor<T, 2>({shape.heads, 2 * shape.window - 1});
    d_bases = Tensor<T, 3>({shape.heads, shape.bases, shape.dim});
    const LavoGradients<T> gradients{dq.view(), dk.view(), dv.view(), d_bias.view(), d_bases.view()};
    if constexpr (Dir::is_causal) {
      if (states) {
        attention->backward(e, q.cview(), k.cview(), v.cview(), g.cview(), gradients, *states);
        return;
      }
    }
    attention->backward(e, q.cview(), k.cview(), v.cview(), g.cview(), gradients);
  }

  /// The oracle's loss over long-double copies, and the spans it reads.
  struct Loss {
    LavoOracleSpec spec;
    TensorLD<4> q, k, v, g;
    long double operator()() const {
      const TensorLD<4> out = lavo_oracle(spec, q, k, v);
      long double total = 0;
      for (index_t i = 0; i < out.size(); ++i) total += g.data()[i] * out.data()[i];
      return total;
    }
    GradientInputs inputs() {
      return {as_input(q), as_input(k), as_input(v), spec.relative_bias, spec.basis};
    }
  };
  Loss loss() const {
    return {{.causal = Dir::is_causal,
             .window = shape.window,
             .bases = shape.bases,
             .scale = 1.0L / std::sqrt((long double)shape.dim),
             .local_only_without_memory = local_only,
             .basis = widen(weights.bases),
             .relative_bias = widen(weights.bias)},
            to_long_double(q), to_long_double(k), to_long_double(v), to_long_double(g)};
  }
  std::vector<std::span<const T>> gradients() const {
    return {span_of(dq), span_of(dk), span_of(dv), span_of(d_bias), span_of(d_bases)};
  }
};

constexpr const char* kNames[] = {"d_queries", "d_keys", "d_values", "d_relative_bias", "d_bases"};

template <class T, class Dir>
void every_element_cases(std::uint64_t seed) {
  Rng rng(seed);
  // Each loss evaluation rebuilds every T x T matrix: B * H * T^2 stays small.
  constexpr LavoShape shapes[] = {{2, 1, 2, 3, 2, 1},  {1, 2, 2, 4, 4, 1}, {2, 7, 1, 4, 3, 2},
                                  {1, 23, 2, 4, 2, 5}, {1, 17, 1, 5, 5, 17}, {1, 30, 1, 4, 3, 3}};
  for (const LavoShape& s : shapes) {
    // fp32 (whose tolerance is looser) and sanitizer runs take the shorter shapes.
    if ((std::is_same_v<T, float> || case_count(2) < 2) && s.time > 25) continue;
    for (const bool local_only : {false, true}) {
      if (local_only && !Dir::is_causal) continue;  // the rule is about the causal empty memory
      Problem<T, Dir> problem(rng, s, 1.5, local_only);
      CAPTURE(s.time);
      CAPTURE(s.window);
      CAPTURE(local_only);
      problem.run(exec::reference);
      const OracleGradients expected = oracle_gradients(problem);  // one set for both runs
      check_every_element<T>(problem, expected, kNames);
      problem.run(exec::cpu);
      check_every_element<T>(problem, expected, kNames);
    }
  }
}

template <class T, class Dir>
void direction_cases(std::uint64_t seed, int cases) {
  Rng rng(seed);
  for (int c = 0; c < case_count(cases); ++c) {
    const index_t time = pick(rng, std::array<index_t, 5>{1, 9, 33, 64, 100});
    const index_t dim = pick(rng, std::array<index_t, 3>{1, 6, 16});
    const index_t bases = pick(rng, std::array<index_t, 3>{1, dim, (dim + 1) / 2});
    const index_t window = pick(rng, std::array<index_t, 5>{1, 2, 7, 16, time + 2});
    const LavoShape s{pick(rng, std::array<index_t, 2>{1, 2}), time,
                      pick(rng, std::array<index_t, 2>{1, 3}), dim, bases, window};
    Problem<T, Dir> problem(rng, s, pick(rng, std::array{0.5, 1.5, 4.0}), rng() % 3 == 0);
    CAPTURE(s.batch);
    CAPTURE(s.time);
    CAPTURE(s.heads);
    CAPTURE(s.dim);
    CAPTURE(s.bases);
    CAPTURE(s.window);
    problem.run(exec::reference);
    check_direction<T>(problem, rng);
    problem.run(exec::cpu);
    check_direction<T>(problem, rng);
  }
}

}  // namespace

TEST_CASE("causal LAVO backward matches the oracle's gradients (q, k, v, P, B)") {
  SUBCASE("fp64") {
    every_element_cases<double, Causal>(100);
    direction_cases<double, Causal>(101, 12);
  }
  SUBCASE("fp32") {
    every_element_cases<float, Causal>(200);
    direction_cases<float, Causal>(201, 12);
  }
}

TEST_CASE("bidirectional LAVO backward matches the oracle's gradients (q, k, v, P, B)") {
  SUBCASE("fp64") {
    every_element_cases<double, Bidirectional>(300);
    direction_cases<double, Bidirectional>(301, 12);
  }
  SUBCASE("fp32") {
    every_element_cases<float, Bidirectional>(400);
    direction_cases<float, Bidirectional>(401, 12);
  }
}

namespace {

/// One cross-attention backward problem.
template <class T>
struct CrossProblem {
  LavoShape shape;
  index_t source_length;
  Tensor<T, 4> q, source, g;
  LavoWeights weights;
  std::optional<Lavo<Bidirectional>> attention;
  Tensor<T, 4> dq, d_source;
  Tensor<T, 3> d_bases;

  CrossProblem(Rng& rng, const LavoShape& s, index_t source_tokens, double input_scale)
      : shape(s), source_length(source_tokens) {
    q = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, s.dim}, input_scale);
    source = random_tensor<T, 4>(rng, {s.batch, source_tokens, s.heads, s.dim}, input_scale);
    g = uniform_tensor<T, 4>(rng, {s.batch, s.time, s.heads, s.dim}, -1, 1);
    weights = random_weights<T>(rng, s, rng() % 2 == 0, 0.0);
    attention.emplace(LavoDims{.heads = s.heads, .dim = s.dim, .bases = s.bases, .window = s.window},
                      LavoParams{.bases = weights.bases});
  }

  template <class E>
  void run(E e) {
    dq = Tensor<T, 4>(q.extents());
    d_source = Tensor<T, 4>(source.extents());
    d_bases = Tensor<T, 3>({shape.heads, shape.bases, shape.dim});
    attention->cross_backward(e, q.cview(), source.cview(), g.cview(),
                              LavoCrossGradients<T>{dq.view(), d_source.view(), d_bases.view()});
  }

  struct Loss {
    LavoOracleSpec spec;
    TensorLD<4> q, source, g;
    long double operator()() const {
      const TensorLD<4> out = lavo_cross_oracle(spec, q, source);
      long double total = 0;
      for (index_t i = 0; i < out.size(); ++i) total += g.data()[i] * out.data()[i];
      return total;
    }
    GradientInputs inputs() { return {as_input(q), as_input(source), spec.basis}; }
  };
  Loss loss() const {
    return {{.causal = false,
             .window = shape.window,
             .bases = shape.bases,
             .scale = 1.0L / std::sqrt((long double)shape.dim),
             .basis = widen(weights.bases),
             .relative_bias = widen(weights.bias)},
            to_long_double(q), to_long_double(source), to_long_double(g)};
  }
  std::vector<std::span<const T>> gradients() const {
    return {span_of(dq), span_of(d_source), span_of(d_bases)};
  }
};

constexpr const char* kCrossNames[] = {"d_queries", "d_source", "d_bases"};

template <class T>
void cross_cases(std::uint64_t seed) {
  Rng rng(seed);
  constexpr std::array<std::pair<LavoShape, index_t>, 4> every_element{{
      {{2, 1, 2, 3, 2, 1}, 4}, {{1, 6, 2, 4, 4, 1}, 1}, {{1, 9, 1, 5, 3, 1}, 13}, {{1, 3, 2, 4, 2, 1}, 0}}};
  for (const auto& shape_and_source : every_element) {
    const index_t source_tokens = shape_and_source.second;  // a name clang 14 can capture
    CrossProblem<T> problem(rng, shape_and_source.first, source_tokens, 1.5);
    CAPTURE(source_tokens);
    problem.run(exec::reference);
    const OracleGradients expected = oracle_gradients(problem);  // one set for both runs
    check_every_element<T>(problem, expected, kCrossNames);
    problem.run(exec::cpu);
    check_every_element<T>(problem, expected, kCrossNames);
  }
  for (int c = 0; c < case_count(10); ++c) {
    const index_t dim = pick(rng, std::array<index_t, 3>{1, 6, 16});
    const LavoShape s{pick(rng, std::array<index_t, 2>{1, 2}), pick(rng, std::array<index_t, 3>{1, 17, 70}),
                      pick(rng, std::array<index_t, 2>{1, 3}), dim,
                      pick(rng, std::array<index_t, 2>{1, dim}), 1};
    CrossProblem<T> problem(rng, s, pick(rng, std::array<index_t, 3>{1, 20, 90}),
                            pick(rng, std::array{0.5, 3.0}));
    CAPTURE(s.time);
    CAPTURE(s.dim);
    problem.run(exec::reference);
    check_direction<T>(problem, rng);
    problem.run(exec::cpu);
    check_direction<T>(problem, rng);
  }
}

}  // namespace

TEST_CASE("LAVO cross_backward matches the oracle's gradients (queries, source, B)") {
  cross_cases<double>(500);
  cross_cases<float>(600);
}

TEST_CASE("LAVO backward: saturated local and memory softmaxes, zero values") {
  Rng rng(700);
  auto saturated = [&]<class T, class Dir>(T, Dir) {
    Problem<T, Dir> problem(rng, {1, 19, 2, 4, 3, 4}, 1.0);
    // Logits |q . k / 2| up to L ~ c^2 (k in [-c, c], every other q entry too). A logit is
    // computed with an error up to ~D u L, which moves the saturated softmax's
    // surviving weights, and so every gradient, by that much relatively: the
    // conditioning of the definition, not the kernel's. fp64: c = 60 (L ~ 3600,
    // D u L ~ 3e-12). fp32: c = 12 (L ~ 144, D u L ~ 3.4e-5, within the gradient
    // tolerance; c = 60 would put the bound at 8.6e-4, above any fp32 kernel's
    // reach). Logit gaps of hundreds still underflow exp to exactly 0 in either
    // dtype (fp32 below -104), so both softmaxes saturate.
    const double c = std::is_same_v<T, float> ? 12.0 : 60.0;
    std::uniform_real_distribution<double> spread(-c, c);
    for (index_t i = 0; i < problem.k.size(); ++i) problem.k.data()[i] = static_cast<T>(spread(rng));
    for (index_t i = 0; i < problem.q.size(); i += 2) problem.q.data()[i] = static_cast<T>(spread(rng));
    for (index_t h = 0; h < 2; ++h)
      for (index_t e = 0; e < 4; ++e) problem.v(0, 13, h, e) = 0;
    std::optional<OracleGradients> expected;
    for (const bool cpu : {false, true}) {
      if (cpu) problem.run(exec::cpu);
      else problem.run(exec::reference);
      if (!expected) expected = oracle_gradients(problem);
      for (const auto& gradient : problem.gradients())
        CHECK(std::all_of(gradient.begin(), gradient.end(), [](T x) { return std::isfinite(x); }));
      check_every_element<T>(problem, *expected, kNames);
    }
  };
  saturated(double{}, Causal{});
  saturated(float{}, Causal{});
  saturated(double{}, Bidirectional{});
  saturated(float{}, Bidirectional{});
}

namespace {

/// Backward over [0, T) from `start` equals the backward over three chunks
/// [0, c1), [c1, c2), [c2, T) chained through the state: forwards from `start`
/// leave S1, S2; the last chunk's backward from S2 gives dS2 (the ring, the
/// window's sum, the memory); the middle one's from S1 with d_final = dS2 gives
/// dS1 (a middle chunk shorter than w passes ring slots it does not overwrite
/// through); the first one's with d_final = dS1. `start` is the state a
/// forward over a prelude of `prelude` tokens left.
template <class T, class E>
void check_chunks(E e, Rng& rng, const LavoShape& s, index_t c1, index_t c2, index_t prelude) {
  using P = Problem<T, Causal>;
  P whole(rng, s, 1.5);
  const auto& attention = *whole.attention;
  auto start = attention.template make_state<T>(s.batch);
  if (prelude > 0) {
    P before(rng, {s.batch, prelude, s.heads, s.dim, s.bases, s.window}, 1.5);
    Tensor<T, 4> out(before.v.extents());
    attention.forward(e, before.q.cview(), before.k.cview(), before.v.cview(), out.view(), start);
  }
  const LavoStateGradients<T> from_start{.initial = &start};
  whole.run(e, &from_start);

  const std::array<index_t, 4> borders{0, c1, c2, s.time};
  std::vector<P> chunks(3, whole);
  std::vector<LavoState<T>> states{start};  // the state before each chunk
  for (std::size_t i = 0; i < 3; ++i) {
    P& chunk = chunks[i];
    const index_t from = borders[i], count = borders[i + 1] - borders[i];
    chunk.q = time_slice(whole.q, from, count);
    chunk.k = time_slice(whole.k, from, count);
    chunk.v = time_slice(whole.v, from, count);
    chunk.g = time_slice(whole.g, from, count);
    chunk.rebuild();
    auto state = states.back();
    Tensor<T, 4> out(chunk.v.extents());
    attention.forward(e, chunk.q.cview(), chunk.k.cview(), chunk.v.cview(), out.view(), state);
    states.push_back(state);
  }
  std::vector<LavoState<T>> d_states(3, attention.template make_state<T>(s.batch));
  for (std::size_t i = 3; i-- > 0;) {  // d_states[i]: the gradient of the state before chunk i
    const LavoStateGradients<T> ends{.initial = &states[i],
                                     .d_final = i == 2 ? nullptr : &d_states[i + 1],
                                     .d_initial = &d_states[i]};
    chunks[i].run(e, &ends);
  }

  auto joined = [&](Tensor<T, 4> P::*gradient) {
    return join_in_time(join_in_time(chunks[0].*gradient, chunks[1].*gradient),
                        to_long_double(chunks[2].*gradient));
  };
  // Both sides are sums of the same terms grouped differently: rounding only.
  const double bound = 50 * Tolerance<T>::relative;
  CHECK(relative_error(whole.dq, joined(&P::dq)) <= bound);
  CHECK(relative_error(whole.dk, joined(&P::dk)) <= bound);
  CHECK(relative_error(whole.dv, joined(&P::dv)) <= bound);
  Tensor<T, 2> d_bias = chunks[0].d_bias;
  Tensor<T, 3> d_bases = chunks[0].d_bases;
  for (index_t i = 0; i < d_bias.size(); ++i) d_bias.data()[i] += chunks[1].d_bias.data()[i];
  for (index_t i = 0; i < d_bases.size(); ++i) d_bases.data()[i] += chunks[1].d_bases.data()[i];
  CHECK(sum_error(d_bias, chunks[2].d_bias, whole.d_bias) <= bound);
  CHECK(sum_error(d_bases, chunks[2].d_bases, whole.d_bases) <= bound);
}

}  // namespace

TEST_CASE("LAVO training in chunks: backward chained through the state gradients equals the whole backward") {
  Rng rng(800);
  for (const auto& cuts : {std::pair<index_t, index_t>{1, 2}, {3, 5}, {8, 17}, {17, 18},
                           {20, 40}, {0, 41}, {40, 41}}) {
    const index_t c1 = cuts.first, c2 = cuts.second;  // names clang 14 can capture
    for (const index_t prelude : {0, 2, 9}) {
      CAPTURE(c1);
      CAPTURE(c2);
      CAPTURE(prelude);
      const LavoShape s{2, 41, 2, 6, 3, 4};  // w = 4: rings partly and wholly filled
      check_chunks<double>(exec::reference, rng, s, c1, c2, prelude);
      check_chunks<double>(exec::cpu, rng, s, c1, c2, prelude);
      check_chunks<float>(exec::cpu, rng, s, c1, c2, prelude);
      check_chunks<float>(exec::reference, rng, {1, 41, 1, 4, 4, 16}, c1, c2, prelude);  // w > chunks
    }
  }
}

TEST_CASE("LAVO backward: empty sequences, and bad gradient buffers are refused by name") {
  const Lavo<Causal> attention({.heads = 2, .dim = 4, .bases = 3, .window = 2});
  Tensor<float, 4> q({1, 5, 2, 4}), k({1, 5, 2, 4}), v({1, 5, 2, 4}), g({1, 5, 2, 4});
  Tensor<float, 4> dq({1, 5, 2, 4}), dk({1, 5, 2, 4}), dv({1, 5, 2, 4}), wrong({1, 5, 2, 5});
  Tensor<float, 2> d_bias({2, 3}), wrong_bias({2, 2});
  Tensor<float, 3> d_bases({2, 3, 4}), wrong_bases({2, 4, 4});
  auto call = [&](LavoGradients<float> gradients, TensorView<const float, 4> d_out) {
    attention.backward(exec::reference, q.cview(), k.cview(), v.cview(), d_out, gradients);
  };
  auto valid = [&] {
    return LavoGradients<float>{dq.view(), dk.view(), dv.view(), d_bias.view(), d_bases.view()};
  };
  call(valid(), g.cview());  // the valid call first
  auto with = [&](auto change) {
    LavoGradients<float> gradients = valid();
    change(gradients);
    return gradients;
  };
  expect_error([&] { call(valid(), wrong.cview()); }, "d_out", "");
  expect_error([&] { call(with([&](auto& x) { x.d_queries = wrong.view(); }), g.cview()); },
               "gradients.d_queries", "");
  expect_error([&] { call(with([&](auto& x) { x.d_keys = dq.view(); }), g.cview()); },
               "gradients.d_keys", "");
  expect_error([&] { call(with([&](auto& x) { x.d_values = g.view(); }), g.cview()); },
               "gradients.d_values", "");
  expect_error([&] { call(with([&](auto& x) { x.d_relative_bias = wrong_bias.view(); }), g.cview()); },
               "gradients.d_relative_bias", "");
  expect_error([&] { call(with([&](auto& x) { x.d_bases = wrong_bases.view(); }), g.cview()); },
               "gradients.d_bases", "");
  auto other_state = Lavo<Causal>({.heads = 2, .dim = 4, .bases = 3, .window = 3}).make_state<float>(1);
  expect_error([&] {
    attention.backward(exec::cpu, q.cview(), k.cview(), v.cview(), g.cview(), valid(),
                       LavoStateGradients<float>{.initial = &other_state});
  }, "states.initial", "");
  auto state = attention.make_state<float>(1);
  expect_error([&] {
    attention.backward(exec::cpu, q.cview(), k.cview(), v.cview(), g.cview(), valid(),
                       LavoStateGradients<float>{.initial = &state, .d_initial = &state});
  }, "states.d_initial", "");
  Tensor<float, 4> source({1, 3, 2, 4}), d_source({1, 3, 2, 4});
  const Lavo<Bidirectional> cross({.heads = 2, .dim = 4, .bases = 3, .window = 2});
  expect_error([&] {
    cross.cross_backward(exec::cpu, q.cview(), source.cview(), g.cview(),
                         LavoCrossGradients<float>{dq.view(), dq.view()});
  }, "gradients.d_source", "");
  // T = 0: nothing to write; the initial state's gradient is d_final's.
  Tensor<float, 4> none({1, 0, 2, 4}), none_dq({1, 0, 2, 4}), none_dk({1, 0, 2, 4}), none_dv({1, 0, 2, 4});
  auto d_final = attention.make_state<float>(1), d_initial = attention.make_state<float>(1);
  std::fill_n(d_final.field(3), d_final.field_size(3), 2.5f);
  attention.backward(exec::cpu, none.cview(), none.cview(), none.cview(), none.cview(),
                     LavoGradients<float>{none_dq.view(), none_dk.view(), none_dv.view()},
                     LavoStateGradients<float>{.d_final = &d_final, .d_initial = &d_initial});
  CHECK(d_initial.field(3)[0] == 2.5f);
  CHECK(d_initial.field(4)[0] == 2.5f);
}

}  // namespace test_lavo_gradients
