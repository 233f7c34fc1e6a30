// LatteAttention::backward against the explicit T x T oracle: gradients of the
// long-double loss <d_out, oracle(q, k, v, angles)> by central differences
// (every element, small shapes) and along random directions (random shapes up
// to T = 1000), for both directions, both stabilisers, NoPositional and VAPOR
// with learned angles, on exec::reference and exec::cpu, fp32 and fp64; the
// adversarial inputs the forward survives; and training in chunks chained
// through the state gradients.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <numbers>
#include <optional>
#include <string>

#include "expect_error.hpp"
#include "gradient_check.hpp"
#include "oracles/latte_oracle.hpp"
#include "support.hpp"

namespace test_latte_gradients {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;

/// One backward problem: inputs, d_out, the attention, and the kernel's gradients.
template <class T, class Dir, class Stab, class Pos>
struct Problem {
  using Attention = LatteAttention<Dir, Stab, Pos>;
  Tensor<T, 4> q, k, v, g;
  typename Pos::Params params{};
  std::optional<Attention> attention;
  Tensor<T, 4> dq, dk, dv;
  Tensor<T, 2> d_angles;

  Problem(Rng& rng, const Shape& s, double logit_scale) {
    q = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, s.latents}, logit_scale);
    k = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, s.latents}, logit_scale);
    v = uniform_tensor<T, 4>(rng, {s.batch, s.time, s.heads, s.value_dim}, -1, 1);
    g = uniform_tensor<T, 4>(rng, {s.batch, s.time, s.heads, s.value_dim}, -1, 1);
    if constexpr (Pos::rotates_values)
      params.angles = uniform_tensor<double, 2>(rng, {s.heads, s.value_dim / 2}, 0.0, std::numbers::pi);
    attention.emplace(LatteDims{.heads = s.heads, .latents = s.latents, .value_dim = s.value_dim},
                      params);
  }

  template <class E>
  void run(E e, const LatteStateGradients<T>& states = {}) {
    dq = Tensor<T, 4>(q.extents());
    dk = Tensor<T, 4>(k.extents());
    dv = Tensor<T, 4>(v.extents());
    LatteGradients<T> gradients{dq.view(), dk.view(), dv.view()};
    if constexpr (Pos::rotates_values) {
      d_angles = Tensor<T, 2>({q.extent(2), v.extent(3) / 2});
      gradients.d_angles = d_angles.view();
    }
    if constexpr (Dir::is_causal)
      attention->backward(e, q.cview(), k.cview(), v.cview(), g.cview(), gradients, states);
    else
      attention->backward(e, q.cview(), k.cview(), v.cview(), g.cview(), gradients);
  }

  /// The oracle's loss over long-double copies, and the spans it reads.
  struct Loss {
    TensorLD<4> q, k, v, g;
    std::vector<long double> angles;
    long double operator()() const {
      const TensorLD<4> out = latte_oracle(Dir::is_causal, q, k, v, angles);
      long double total = 0;
      for (index_t i = 0; i < out.size(); ++i) total += g.data()[i] * out.data()[i];
      return total;
    }
    GradientInputs inputs() {
      GradientInputs in{as_input(q), as_input(k), as_input(v)};
      if constexpr (Pos::rotates_values) in.emplace_back(angles);
      return in;
    }
  };
  Loss loss() const {
    Loss l{to_long_double(q), to_long_double(k), to_long_double(v), to_long_double(g), {}};
    if constexpr (Pos::rotates_values)
      for (index_t i = 0; i < params.angles.size(); ++i) l.angles.push_back(params.angles.data()[i]);
    return l;
  }
  std::vector<std::span<const T>> gradients() const {
    std::vector<std::span<const T>> out{span_of(dq), span_of(dk), span_of(dv)};
    if constexpr (Pos::rotates_values) out.push_back(span_of(d_angles));
    return out;
  }
};

constexpr const char* kGradientNames[] = {"d_query_logits", "d_key_logits", "d_values", "d_angles"};

template <class T, class Dir, class Stab, class Pos>
void every_element_cases(std::uint64_t seed) {
  Rng rng(seed);
  // Each loss evaluation rebuilds every T x T matrix: B * H * T^2 stays small.
  constexpr Shape shapes[] = {{2, 1, 2, 3, 6}, {2, 2, 2, 3, 1}, {2, 7, 1, 8, 6},
                              {1, 23, 2, 3, 5}, {1, 40, 1, 4, 4}};
  for (const Shape& s : shapes) {
    for (const double logit_scale : std::array{4.0, 0.5}) {
      if (logit_scale == 0.5 && case_count(2) < 2) continue;  // sanitizer runs: one scale
      Problem<T, Dir, Stab, Pos> problem(rng, s, logit_scale);
      CAPTURE(s.time);
      CAPTURE(logit_scale);
      problem.run(exec::reference);
      const OracleGradients expected = oracle_gradients(problem);  // one set for both runs
      check_every_element<T>(problem, expected, kGradientNames);
      problem.run(exec::cpu);
      check_every_element<T>(problem, expected, kGradientNames);
    }
  }
}

template <class T, class Dir, class Stab, class Pos>
void direction_cases(std::uint64_t seed, int cases) {
  Rng rng(seed);
  // The random shapes' widths are whole vectors (64) or a tail alone (1, 5, 7);
  // the last case's rows end in a masked vector after whole ones (L = 37,
  // Dv = 38: 32 + 5 and 32 + 6 lanes, float and double, AVX-512 and AVX2).
  for (int c = 0; c <= case_count(cases); ++c) {
    const Shape s = c < case_count(cases) ? random_shape(rng, 4e6) : Shape{1, 45, 2, 37, 38};
    Problem<T, Dir, Stab, Pos> problem(rng, s, pick(rng, std::array{0.5, 2.0, 6.0}));
    CAPTURE(s.batch);
    CAPTURE(s.time);
    CAPTURE(s.heads);
    CAPTURE(s.latents);
    CAPTURE(s.value_dim);
    problem.run(exec::reference);
    check_direction<T>(problem, rng);
    problem.run(exec::cpu);
    check_direction<T>(problem, rng);
  }
}

template <class T, class Dir>
void all_policies(std::uint64_t seed) {
  SUBCASE("RunningMax, NoPositional") {
    every_element_cases<T, Dir, RunningMax, NoPositional>(seed);
    direction_cases<T, Dir, RunningMax, NoPositional>(seed + 1, 12);
  }
  SUBCASE("RunningMax, VAPOR (learned angles)") {
    every_element_cases<T, Dir, RunningMax, VAPOR>(seed + 2);
    direction_cases<T, Dir, RunningMax, VAPOR>(seed + 3, 12);
  }
  SUBCASE("NoStabilizer, NoPositional") {
    every_element_cases<T, Dir, NoStabilizer, NoPositional>(seed + 4);
    direction_cases<T, Dir, NoStabilizer, NoPositional>(seed + 5, 6);
  }
  SUBCASE("NoStabilizer, VAPOR") {
    every_element_cases<T, Dir, NoStabilizer, VAPOR>(seed + 6);
    direction_cases<T, Dir, NoStabilizer, VAPOR>(seed + 7, 6);
  }
}

}  // namespace

TEST_CASE("causal Latte backward matches the oracle's gradients, fp64") { all_policies<double, Causal>(100); }
TEST_CASE("causal Latte backward matches the oracle's gradients, fp32") { all_policies<float, Causal>(200); }
TEST_CASE("bidirectional Latte backward matches the oracle's gradients, fp64") {
  all_policies<double, Bidirectional>(300);
}
TEST_CASE("bidirectional Latte backward matches the oracle's gradients, fp32") {
  all_policies<float, Bidirectional>(400);
}

TEST_CASE("Latte backward: latent logit spreads up to 1e4, -inf logits, zero values") {
  Rng rng(500);
  auto adversarial = [&]<class T, class Dir>(T, Dir) {
    const Shape s{1, 19, 2, 5, 4};
    Problem<T, Dir, RunningMax, VAPOR> problem(rng, s, 1.0);
    std::uniform_real_distribution<double> spread(-5000.0, 5000.0);
    for (index_t i = 0; i < problem.k.size(); ++i) problem.k.data()[i] = static_cast<T>(spread(rng));
    for (index_t i = 0; i < problem.q.size(); i += 3) problem.q.data()[i] = static_cast<T>(spread(rng));
    constexpr T minus_inf = -std::numeric_limits<T>::infinity();
    for (index_t h = 0; h < 2; ++h) {
      for (index_t t = 0; t < 7; ++t) problem.k(0, t, h, 1) = minus_inf;  // a latent empty up to t = 6
      problem.k(0, 11, h, 3) = minus_inf;
      for (index_t l = 0; l < 5; ++l) problem.q(0, 4, h, l) = minus_inf;  // a query reading nothing
      problem.q(0, 9, h, 2) = minus_inf;
      for (index_t d = 0; d < 4; ++d) problem.v(0, 13, h, d) = 0;
    }
    check_adversarial<T>(problem, kGradientNames);
  };
  adversarial(double{}, Causal{});
  adversarial(float{}, Causal{});
  adversarial(double{}, Bidirectional{});
  adversarial(float{}, Bidirectional{});
}

TEST_CASE("causal VAPOR backward at positions near 1e7 in fp32 matches the oracle") {
  // The output depends on t - s only, so a sequence starting at 10^7 has the
  // oracle's gradients at position 0: angles and values included.
  Rng rng(600);
  const Shape s{1, 31, 2, 4, 6};
  Problem<float, Causal, RunningMax, VAPOR> problem(rng, s, 2.0);
  for (const std::int64_t first : {std::int64_t{9'999'989}, std::int64_t{1} << 40}) {
    CAPTURE(first);
    const auto fresh = problem.attention->template make_state<float>(1, first);
    problem.run(exec::reference, {.initial = &fresh});
    const OracleGradients expected = oracle_gradients(problem);  // one set for both runs
    check_every_element<float>(problem, expected, kGradientNames);
    problem.run(exec::cpu, {.initial = &fresh});
    check_every_element<float>(problem, expected, kGradientNames);
  }
}

namespace {

/// Backward over [0, T) equals the backward over two chunks [0, cut), [cut, T)
/// chained through the state: forward chunk 1 from `start` leaves S1; backward
/// of chunk 2 from S1 gives dS1; backward of chunk 1 with d_final = dS1.
template <class T, class Stab, class Pos, class E>
void check_chunks(E e, Rng& rng, const Shape& s, index_t cut, std::int64_t first_position) {
  using Attention = LatteAttention<Causal, Stab, Pos>;
  Problem<T, Causal, Stab, Pos> whole(rng, s, 3.0);
  const Attention& attention = *whole.attention;
  const auto start = attention.template make_state<T>(s.batch, first_position);
  whole.run(e, {.initial = &start});

  auto part = [&](const Tensor<T, 4>& x, index_t first, index_t count) {
    return time_slice(x, first, count);
  };
  const index_t rest = s.time - cut;
  auto state = start;
  Tensor<T, 4> out({s.batch, cut, s.heads, s.value_dim});
  attention.forward(e, part(whole.q, 0, cut).cview(), part(whole.k, 0, cut).cview(),
                    part(whole.v, 0, cut).cview(), out.view(), state);
  const auto s1 = state;
  Problem<T, Causal, Stab, Pos> second = whole;
  second.q = part(whole.q, cut, rest);
  second.k = part(whole.k, cut, rest);
  second.v = part(whole.v, cut, rest);
  second.g = part(whole.g, cut, rest);
  auto d_s1 = attention.template make_state<T>(s.batch);
  second.run(e, {.initial = &s1, .d_initial = &d_s1});
  Problem<T, Causal, Stab, Pos> first = whole;
  first.q = part(whole.q, 0, cut);
  first.k = part(whole.k, 0, cut);
  first.v = part(whole.v, 0, cut);
  first.g = part(whole.g, 0, cut);
  first.run(e, {.initial = &start, .d_final = &d_s1});

  // Both sides are sums of the same terms grouped differently: rounding only.
  const double bound = 50 * Tolerance<T>::relative;
  CHECK(relative_error(whole.dq, join_in_time(first.dq, second.dq)) <= bound);
  CHECK(relative_error(whole.dk, join_in_time(first.dk, second.dk)) <= bound);
  CHECK(relative_error(whole.dv, join_in_time(first.dv, second.dv)) <= bound);
  if constexpr (Pos::rotates_values)
    CHECK(sum_error(first.d_angles, second.d_angles, whole.d_angles) <= bound);
}

}  // namespace

TEST_CASE("training in chunks: backward chained through the state gradients equals the whole backward") {
  Rng rng(700);
  for (const index_t cut : {1, 17, 63}) {
    CAPTURE(cut);
    const Shape s{2, 64, 3, 7, 6};
    check_chunks<double, RunningMax, NoPositional>(exec::reference, rng, s, cut, 0);
    check_chunks<double, RunningMax, VAPOR>(exec::reference, rng, s, cut, 5);
    check_chunks<double, RunningMax, VAPOR>(exec::cpu, rng, s, cut, 0);
    check_chunks<double, NoStabilizer, NoPositional>(exec::cpu, rng, s, cut, 0);
    check_chunks<float, RunningMax, VAPOR>(exec::cpu, rng, s, cut, 1000);
    check_chunks<float, RunningMax, NoPositional>(exec::reference, rng, s, cut, 0);
  }
}

TEST_CASE("Latte backward: empty sequences, and bad gradient buffers are refused by name") {
  const LatteAttention<Causal, RunningMax, VAPOR> attention({.heads = 2, .latents = 3, .value_dim = 4});
  Tensor<float, 4> q({1, 5, 2, 3}), k({1, 5, 2, 3}), v({1, 5, 2, 4}), g({1, 5, 2, 4});
  Tensor<float, 4> dq({1, 5, 2, 3}), dk({1, 5, 2, 3}), dv({1, 5, 2, 4}), wrong({1, 5, 2, 5});
  Tensor<float, 2> d_angles({2, 2}), wrong_angles({2, 3});
  auto call = [&](LatteGradients<float> gradients, TensorView<const float, 4> d_out) {
    attention.backward(exec::reference, q.cview(), k.cview(), v.cview(), d_out, gradients);
  };
  expect_error([&] { call({dq.view(), dk.view(), wrong.view()}, g.cview()); }, "gradients.d_values", "");
  expect_error([&] { call({dk.view(), dk.view(), dv.view()}, g.cview()); }, "gradients.d_key_logits", "");
  expect_error([&] { call({dq.view(), dk.view(), dv.view()}, wrong.cview()); }, "d_out", "");
  expect_error([&] { call({q.view(), dk.view(), dv.view()}, g.cview()); }, "gradients.d_query_logits", "");
  expect_error([&] { call({dq.view(), dk.view(), g.view()}, g.cview()); }, "gradients.d_values", "");
  expect_error([&] { call({dq.view(), dk.view(), dv.view(), wrong_angles.view()}, g.cview()); },
         "gradients.d_angles", "");
  const LatteAttention<Causal> plain({.heads = 2, .latents = 3, .value_dim = 4});
  expect_error([&] {
    plain.backward(exec::reference, q.cview(), k.cview(), v.cview(), g.cview(),
                   LatteGradients<float>{dq.view(), dk.view(), dv.view(), d_angles.view()});
  }, "gradients.d_angles", "");
  const auto other = LatteAttention<Causal, RunningMax, VAPOR>({.heads = 2, .latents = 3, .value_dim = 2})
                         .make_state<float>(1);
  expect_error([&] {
    attention.backward(exec::reference, q.cview(), k.cview(), v.cview(), g.cview(),
                       LatteGradients<float>{dq.view(), dk.view(), dv.view()},
                       LatteStateGradients<float>{.initial = &other});
  }, "states.initial", "");
  auto state = attention.make_state<float>(1);
  expect_error([&] {
    attention.backward(exec::reference, q.cview(), k.cview(), v.cview(), g.cview(),
                       LatteGradients<float>{dq.view(), dk.view(), dv.view()},
                       LatteStateGradients<float>{.initial = &state, .d_initial = &state});
  }, "states.d_initial", "");
  // T = 0: nothing to write; the initial state's gradient is the final one's.
  Tensor<float, 4> none({1, 0, 2, 3}), none_v({1, 0, 2, 4});
  auto d_final = attention.make_state<float>(1);
  d_final.field(2)[5] = 3.0f;
  auto d_initial = attention.make_state<float>(1);
  attention.backward(exec::cpu, none.cview(), none.cview(), none_v.cview(), none_v.cview(),
                     LatteGradients<float>{none.view(), none.view(), none_v.view()},
                     LatteStateGradients<float>{.initial = &state, .d_final = &d_final,
                                                .d_initial = &d_initial});
  CHECK(d_initial.field(2)[5] == 3.0f);
  // A d_final whose running_max is not the final state's (a fresh state: -inf)
  // is found inside a head's task: on exec::cpu with several heads over threads
  // it must still arrive as latte::Error, not std::terminate from the OpenMP region.
  for (auto& x : {&q, &k, &v, &g})
    for (index_t i = 0; i < x->size(); ++i) x->data()[i] = 0.25f * float(i % 7) - 0.5f;
  const auto fresh = attention.make_state<float>(1);
  expect_error([&] {
    attention.backward(exec::cpu, q.cview(), k.cview(), v.cview(), g.cview(),
                       LatteGradients<float>{dq.view(), dk.view(), dv.view()},
                       LatteStateGradients<float>{.d_final = &fresh});
  }, "states.d_final", "running_max must be the final state's");
}

}  // namespace test_latte_gradients
