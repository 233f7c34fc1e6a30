// LatteMacchiato::backward against the explicit T x T oracle
// (tests/oracles/macchiato_oracle.hpp): gradients of the long-double loss
// <d_out, oracle(q, k, q', k', v, angles)> by central differences (every
// element, small shapes) and along random directions (random shapes and
// windows), for both directions, both stabilisers, the positional set-ups
// (none, RoPE window, VAPOR + RoPE, VAPOR on the whole mixture, learned VAPOR
// angles), on exec::reference and exec::cpu, fp32 and fp64; the adversarial
// inputs the forward survives; bad gradient buffers.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <numbers>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

#include "expect_error.hpp"
#include "gradient_check.hpp"
#include "latte/mechanisms/latte_macchiato.hpp"
#include "oracles/macchiato_oracle.hpp"
#include "support.hpp"

namespace test_macchiato_gradients {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;

struct MacchiatoShape {
  index_t batch, time, heads, latents, key_dim, value_dim, window;
};

/// One backward problem: inputs, d_out, the attention, and the kernel's gradients.
template <class T, class Dir, class Stab, class LatentPos, class WindowPos>
struct Problem {
  using Attention = LatteMacchiato<Dir, Stab, LatentPos, WindowPos>;
  MacchiatoShape shape;
  Tensor<T, 4> q, k, wq, wk, v, g;
  typename LatentPos::Params latent_params{};
  typename WindowPos::Params window_params{};
  MacchiatoOptions options;
  std::optional<Attention> attention;
  Tensor<T, 4> dq, dk, dwq, dwk, dv;
  Tensor<T, 2> d_angles;

  Problem(Rng& rng, const MacchiatoShape& s, double logit_scale, bool all_states)
      : shape(s) {
    const index_t B = s.batch, Tn = s.time, H = s.heads;
    q = random_tensor<T, 4>(rng, {B, Tn, H, s.latents + 1}, logit_scale);
    k = random_tensor<T, 4>(rng, {B, Tn, H, s.latents}, logit_scale);
    wq = random_tensor<T, 4>(rng, {B, Tn, H, s.key_dim}, 1.5);
    wk = random_tensor<T, 4>(rng, {B, Tn, H, s.key_dim}, 1.5);
    v = uniform_tensor<T, 4>(rng, {B, Tn, H, s.value_dim}, -1, 1);
    g = uniform_tensor<T, 4>(rng, {B, Tn, H, s.value_dim}, -1, 1);
    if constexpr (LatentPos::rotates_values)
      latent_params.angles = uniform_tensor<double, 2>(rng, {H, s.value_dim / 2}, 0.0, std::numbers::pi);
    if constexpr (WindowPos::rotates_queries_keys)
      window_params.angles = uniform_tensor<double, 2>(rng, {H, s.key_dim / 2}, 0.0, std::numbers::pi);
    if (all_states) options.vapor_scope = VaporScope::all_states;
    attention.emplace(MacchiatoDims{.heads = H, .latents = s.latents, .key_dim = s.key_dim,
                                    .value_dim = s.value_dim, .window = s.window},
                      options, latent_params, window_params);
  }

  template <class E>
  void run(E e, const MacchiatoStateGradients<T>* states = nullptr) {
    dq = Tensor<T, 4>(q.extents());
    dk = Tensor<T, 4>(k.extents());
    dwq = Tensor<T, 4>(wq.extents());
    dwk = Tensor<T, 4>(wk.extents());
    dv = Tensor<T, 4>(v.extents());
    MacchiatoGradients<T> gradients{dq.view(), dk.view(), dwq.view(), dwk.view(), dv.view()};
    if constexpr (LatentPos::rotates_values) {
      d_angles = Tensor<T, 2>({shape.heads, shape.value_dim / 2});
      gradients.d_angles = d_angles.view();
    }
    if constexpr (Dir::is_causal) {
      if (states) {
        attention->backward(e, q.cview(), k.cview(), wq.cview(), wk.cview(), v.cview(),
                            g.cview(), gradients, *states);
        return;
      }
    }
    attention->backward(e, q.cview(), k.cview(), wq.cview(), wk.cview(), v.cview(), g.cview(),
                        gradients);
  }

  /// The oracle's loss over long-double copies, and the spans it reads.
  struct Loss {
    MacchiatoSpec spec;
    TensorLD<4> q, k, wq, wk, v, g;
    std::vector<long double> value_angles, key_angles;
    long double operator()() const {
      const TensorLD<4> out = macchiato_oracle(spec, q, k, wq, wk, v, value_angles, key_angles);
      long double total = 0;
      for (index_t i = 0; i < out.size(); ++i) total += g.data()[i] * out.data()[i];
      return total;
    }
    GradientInputs inputs() {
      GradientInputs in{as_input(q), as_input(k), as_input(wq), as_input(wk), as_input(v)};
      if constexpr (LatentPos::rotates_values) in.emplace_back(value_angles);
      return in;
    }
  };
  Loss loss() const {
    Loss l{{.causal = Dir::is_causal, .window = shape.window,
            .scale = 1.0L / std::sqrt((long double)shape.key_dim),
            .vapor_on_window = options.vapor_scope == VaporScope::all_states},
           to_long_double(q), to_long_double(k), to_long_double(wq), to_long_double(wk),
           to_long_double(v), to_long_double(g), {}, {}};
    if constexpr (LatentPos::rotates_values)
      for (index_t i = 0; i < latent_params.angles.size(); ++i)
        l.value_angles.push_back(latent_params.angles.data()[i]);
    if constexpr (WindowPos::rotates_queries_keys)
      for (index_t i = 0; i < window_params.angles.size(); ++i)
        l.key_angles.push_back(window_params.angles.data()[i]);
    return l;
  }
  std::vector<std::span<const T>> gradients() const {
    std::vector<std::span<const T>> out{span_of(dq), span_of(dk), span_of(dwq), span_of(dwk),
                                        span_of(dv)};
    if constexpr (LatentPos::rotates_values) out.push_back(span_of(d_angles));
    return out;
  }
};

constexpr const char* kNames[] = {"d_query_logits", "d_key_logits", "d_window_queries",
                                  "d_window_keys", "d_values", "d_angles"};

template <class T, class Dir, class Stab, class LatentPos, class WindowPos>
void every_element_cases(std::uint64_t seed, bool all_states) {
  Rng rng(seed);
  // Each loss evaluation rebuilds every T x T matrix: B * H * T^2 stays small.
  constexpr MacchiatoShape shapes[] = {{2, 1, 2, 3, 2, 4, 1},  {1, 2, 2, 2, 4, 2, 1},
                                       {2, 7, 1, 3, 4, 6, 2},  {1, 23, 2, 3, 2, 4, 5},
                                       {1, 40, 1, 2, 4, 4, 40}};
  for (const MacchiatoShape& s : shapes) {
    // fp32 (whose tolerance is looser) and sanitizer runs take the shorter shapes.
    if ((std::is_same_v<T, float> || case_count(2) < 2) && s.time > 30) continue;
    for (const double logit_scale : std::array{3.0, 0.5}) {
      if (logit_scale == 0.5 && (std::is_same_v<T, float> || case_count(2) < 2))
        continue;  // sanitizer runs: one scale
      Problem<T, Dir, Stab, LatentPos, WindowPos> problem(rng, s, logit_scale, all_states);
      CAPTURE(s.time);
      CAPTURE(s.window);
      CAPTURE(logit_scale);
      problem.run(exec::reference);
      const OracleGradients expected = oracle_gradients(problem);  // one set for both runs
      check_every_element<T>(problem, expected, kNames);
      problem.run(exec::cpu);
      check_every_element<T>(problem, expected, kNames);
    }
  }
}

template <class T, class Dir, class Stab, class LatentPos, class WindowPos>
void direction_cases(std::uint64_t seed, int cases, bool all_states) {
  Rng rng(seed);
  for (int c = 0; c < case_count(cases); ++c) {
    const Shape base = random_shape(rng, 2e6);
    const index_t key_dim = pick(rng, std::array<index_t, 3>{2, 5, 16});
    const index_t window = pick(rng, std::array<index_t, 4>{1, 3, 17, base.time + 2});
    const MacchiatoShape s{base.batch, base.time,      base.heads, base.latents,
                           key_dim,    base.value_dim, window};
    Problem<T, Dir, Stab, LatentPos, WindowPos> problem(rng, s, pick(rng, std::array{0.5, 2.0, 5.0}),
                                                        all_states);
    CAPTURE(s.batch);
    CAPTURE(s.time);
    CAPTURE(s.heads);
    CAPTURE(s.latents);
    CAPTURE(s.key_dim);
    CAPTURE(s.value_dim);
    CAPTURE(s.window);
    problem.run(exec::reference);
    check_direction<T>(problem, rng);
    problem.run(exec::cpu);
    check_direction<T>(problem, rng);
  }
}

template <class T, class Dir>
void all_configurations(std::uint64_t seed) {
  SUBCASE("RunningMax, no positions") {
    every_element_cases<T, Dir, RunningMax, NoPositional, NoPositional>(seed, false);
    direction_cases<T, Dir, RunningMax, NoPositional, NoPositional>(seed + 1, 8, false);
  }
  SUBCASE("RunningMax, RoPE window") {
    every_element_cases<T, Dir, RunningMax, NoPositional, RoPE>(seed + 2, false);
    direction_cases<T, Dir, RunningMax, NoPositional, RoPE>(seed + 3, 6, false);
  }
  SUBCASE("RunningMax, VAPOR (learned angles) on the latent states, RoPE window") {
    every_element_cases<T, Dir, RunningMax, VAPOR, RoPE>(seed + 4, false);
    direction_cases<T, Dir, RunningMax, VAPOR, RoPE>(seed + 5, 6, false);
  }
  SUBCASE("RunningMax, VAPOR (learned angles) on every state") {
    every_element_cases<T, Dir, RunningMax, VAPOR, NoPositional>(seed + 6, true);
    direction_cases<T, Dir, RunningMax, VAPOR, NoPositional>(seed + 7, 6, true);
  }
  SUBCASE("NoStabilizer, no positions") {
    every_element_cases<T, Dir, NoStabilizer, NoPositional, NoPositional>(seed + 8, false);
    direction_cases<T, Dir, NoStabilizer, NoPositional, NoPositional>(seed + 9, 4, false);
  }
}

}  // namespace

TEST_CASE("causal Latte Macchiato backward matches the oracle's gradients, fp64") {
  all_configurations<double, Causal>(100);
}
TEST_CASE("causal Latte Macchiato backward matches the oracle's gradients, fp32") {
  all_configurations<float, Causal>(200);
}
TEST_CASE("bidirectional Latte Macchiato backward matches the oracle's gradients, fp64") {
  all_configurations<double, Bidirectional>(300);
}
TEST_CASE("bidirectional Latte Macchiato backward matches the oracle's gradients, fp32") {
  all_configurations<float, Bidirectional>(400);
}

TEST_CASE("Latte Macchiato backward: logit spreads up to 1e4, -inf logits, zero values") {
  Rng rng(500);
  auto adversarial = [&]<class T, class Dir>(T, Dir) {
    const MacchiatoShape s{1, 19, 2, 4, 4, 4, 3};
    Problem<T, Dir, RunningMax, VAPOR, RoPE> problem(rng, s, 1.0, true);
    std::uniform_real_distribution<double> spread(-5000.0, 5000.0);
    for (index_t i = 0; i < problem.k.size(); ++i) problem.k.data()[i] = static_cast<T>(spread(rng));
    for (index_t i = 0; i < problem.q.size(); i += 3) problem.q.data()[i] = static_cast<T>(spread(rng));
    constexpr T minus_inf = -std::numeric_limits<T>::infinity();
    for (index_t h = 0; h < 2; ++h) {
      for (index_t t = 0; t < 7; ++t) problem.k(0, t, h, 1) = minus_inf;  // a latent empty up to t = 6
      problem.k(0, 11, h, 3) = minus_inf;
      for (index_t l = 0; l <= 4; ++l) problem.q(0, 4, h, l) = minus_inf;  // a query reading nothing
      for (index_t l = 1; l <= 4; ++l) problem.q(0, 6, h, l) = minus_inf;  // only the window
      problem.q(0, 8, h, 0) = minus_inf;                                  // only the latents
      problem.q(0, 9, h, 2) = minus_inf;
      for (index_t d = 0; d < 4; ++d) problem.v(0, 13, h, d) = 0;
    }
    check_adversarial<T>(problem, kNames);
  };
  adversarial(double{}, Causal{});
  adversarial(float{}, Causal{});
  adversarial(double{}, Bidirectional{});
  adversarial(float{}, Bidirectional{});
}

TEST_CASE("causal Macchiato backward (VAPOR, RoPE) at positions near 1e7 in fp32 matches the oracle") {
  // The output depends on t - s only, so a sequence starting at 10^7 has the
  // oracle's gradients at position 0: angles included.
  Rng rng(600);
  for (const bool all_states : {false, true}) {
    Problem<float, Causal, RunningMax, VAPOR, RoPE> problem(rng, {1, 23, 2, 3, 4, 6, 5}, 2.0,
                                                            all_states);
    for (const std::int64_t first : {std::int64_t{9'999'989}, std::int64_t{1} << 40}) {
      CAPTURE(first);
      CAPTURE(all_states);
      const auto fresh = problem.attention->template make_state<float>(1, first);
      const MacchiatoStateGradients<float> states{.initial = &fresh};
      problem.run(exec::reference, &states);
      const OracleGradients expected = oracle_gradients(problem);  // one set for both runs
      check_every_element<float>(problem, expected, kNames);
      problem.run(exec::cpu, &states);
      check_every_element<float>(problem, expected, kNames);
    }
  }
}

namespace {

/// Backward over [0, T) from `start` equals the backward over two chunks [0,
/// cut), [cut, T) chained through the state: forward chunk 1 from `start`
/// leaves S1; backward of chunk 2 from S1 gives dS1 (Latte's carry and the
/// window ring); backward of chunk 1 with d_final = dS1. `start` is the state
/// a forward over a prelude of `prelude` tokens left (its ring filled).
template <class T, class LatentPos, class WindowPos, class E>
void check_chunks(E e, Rng& rng, const MacchiatoShape& s, index_t cut, index_t prelude,
                  bool all_states) {
  using P = Problem<T, Causal, RunningMax, LatentPos, WindowPos>;
  P whole(rng, s, 3.0, all_states);
  const auto& attention = *whole.attention;
  auto start = attention.template make_state<T>(s.batch, 5);
  if (prelude > 0) {
    P before(rng, {s.batch, prelude, s.heads, s.latents, s.key_dim, s.value_dim, s.window}, 3.0,
             all_states);
    Tensor<T, 4> out(before.v.extents());
    attention.forward(e, before.q.cview(), before.k.cview(), before.wq.cview(), before.wk.cview(),
                      before.v.cview(), out.view(), start);
  }
  const MacchiatoStateGradients<T> from_start{.initial = &start};
  whole.run(e, &from_start);

  auto part = [&](const Tensor<T, 4>& x, index_t first, index_t count) {
    return time_slice(x, first, count);
  };
  const index_t rest = s.time - cut;
  auto state = start;
  Tensor<T, 4> out({s.batch, cut, s.heads, s.value_dim});
  attention.forward(e, part(whole.q, 0, cut).cview(), part(whole.k, 0, cut).cview(),
                    part(whole.wq, 0, cut).cview(), part(whole.wk, 0, cut).cview(),
                    part(whole.v, 0, cut).cview(), out.view(), state);
  const auto s1 = state;
  P second = whole, first = whole;
  for (auto [chunk, from, count] : {std::tuple{&second, cut, rest}, std::tuple{&first, index_t{0}, cut}}) {
    chunk->q = part(whole.q, from, count);
    chunk->k = part(whole.k, from, count);
    chunk->wq = part(whole.wq, from, count);
    chunk->wk = part(whole.wk, from, count);
    chunk->v = part(whole.v, from, count);
    chunk->g = part(whole.g, from, count);
  }
  auto d_s1 = attention.template make_state<T>(s.batch);
  const MacchiatoStateGradients<T> later{.initial = &s1, .d_initial = &d_s1};
  second.run(e, &later);
  const MacchiatoStateGradients<T> earlier{.initial = &start, .d_final = &d_s1};
  first.run(e, &earlier);

  // Both sides are sums of the same terms grouped differently: rounding only.
  const double bound = 50 * Tolerance<T>::relative;
  CHECK(relative_error(whole.dq, join_in_time(first.dq, second.dq)) <= bound);
  CHECK(relative_error(whole.dk, join_in_time(first.dk, second.dk)) <= bound);
  CHECK(relative_error(whole.dwq, join_in_time(first.dwq, second.dwq)) <= bound);
  CHECK(relative_error(whole.dwk, join_in_time(first.dwk, second.dwk)) <= bound);
  CHECK(relative_error(whole.dv, join_in_time(first.dv, second.dv)) <= bound);
  if constexpr (LatentPos::rotates_values)
    CHECK(sum_error(first.d_angles, second.d_angles, whole.d_angles) <= bound);
}

}  // namespace

TEST_CASE("Macchiato training in chunks: backward chained through the state gradients equals the whole backward") {
  Rng rng(700);
  for (const index_t cut : {1, 3, 17, 40}) {
    for (const index_t prelude : {0, 2, 9}) {
      CAPTURE(cut);
      CAPTURE(prelude);
      const MacchiatoShape s{2, 41, 2, 5, 4, 6, 4};  // w = 4: rings partly and wholly filled
      check_chunks<double, NoPositional, NoPositional>(exec::reference, rng, s, cut, prelude, false);
      check_chunks<double, VAPOR, RoPE>(exec::reference, rng, s, cut, prelude, false);
      check_chunks<double, VAPOR, NoPositional>(exec::cpu, rng, s, cut, prelude, true);
      check_chunks<float, VAPOR, RoPE>(exec::cpu, rng, s, cut, prelude, false);
      check_chunks<float, VAPOR, NoPositional>(exec::reference, rng, s, cut, prelude, true);
    }
  }
}

TEST_CASE("Latte Macchiato backward: empty sequences, and bad gradient buffers are refused by name") {
  using Attention = LatteMacchiato<Causal, RunningMax, VAPOR, RoPE>;
  const Attention attention({.heads = 2, .latents = 3, .key_dim = 2, .value_dim = 4, .window = 2});
  Tensor<float, 4> q({1, 5, 2, 4}), k({1, 5, 2, 3}), wq({1, 5, 2, 2}), wk({1, 5, 2, 2});
  Tensor<float, 4> v({1, 5, 2, 4}), g({1, 5, 2, 4});
  Tensor<float, 4> dq({1, 5, 2, 4}), dk({1, 5, 2, 3}), dwq({1, 5, 2, 2}), dwk({1, 5, 2, 2});
  Tensor<float, 4> dv({1, 5, 2, 4}), wrong({1, 5, 2, 5});
  Tensor<float, 2> d_angles({2, 2}), wrong_angles({2, 3});
  auto call = [&](MacchiatoGradients<float> gradients, TensorView<const float, 4> d_out) {
    attention.backward(exec::reference, q.cview(), k.cview(), wq.cview(), wk.cview(), v.cview(),
                       d_out, gradients);
  };
  auto valid = [&] {
    return MacchiatoGradients<float>{dq.view(), dk.view(), dwq.view(), dwk.view(), dv.view(),
                                     d_angles.view()};
  };
  call(valid(), g.cview());  // the valid call first
  auto with = [&](auto change) {
    MacchiatoGradients<float> gradients = valid();
    change(gradients);
    return gradients;
  };
  expect_error([&] { call(valid(), wrong.cview()); }, "d_out", "");
  expect_error([&] { call(with([&](auto& x) { x.d_query_logits = dk.view(); }), g.cview()); },
               "gradients.d_query_logits", "");
  expect_error([&] { call(with([&](auto& x) { x.d_key_logits = dq.view(); }), g.cview()); },
               "gradients.d_key_logits", "");
  expect_error([&] { call(with([&](auto& x) { x.d_window_queries = wrong.view(); }), g.cview()); },
               "gradients.d_window_queries", "");
  expect_error([&] { call(with([&](auto& x) { x.d_window_keys = dwq.view(); }), g.cview()); },
               "gradients.d_window_keys", "");
  expect_error([&] { call(with([&](auto& x) { x.d_values = g.view(); }), g.cview()); },
               "gradients.d_values", "");
  expect_error([&] { call(with([&](auto& x) { x.d_window_queries = wq.view(); }), g.cview()); },
               "gradients.d_window_queries", "");
  expect_error([&] { call(with([&](auto& x) { x.d_angles = wrong_angles.view(); }), g.cview()); },
               "gradients.d_angles", "");
  const LatteMacchiato<Causal> plain({.heads = 2, .latents = 3, .key_dim = 2, .value_dim = 4, .window = 2});
  expect_error([&] {
    plain.backward(exec::reference, q.cview(), k.cview(), wq.cview(), wk.cview(), v.cview(),
                   g.cview(), valid());
  }, "gradients.d_angles", "");
  // T = 0: nothing to write, nothing read.
  Tensor<float, 4> none_q({1, 0, 2, 4}), none_k({1, 0, 2, 3}), none_w({1, 0, 2, 2}),
      none_v({1, 0, 2, 4});
  Tensor<float, 4> none_dq({1, 0, 2, 4}), none_dk({1, 0, 2, 3}), none_dwq({1, 0, 2, 2}),
      none_dwk({1, 0, 2, 2}), none_dv({1, 0, 2, 4});
  attention.backward(exec::cpu, none_q.cview(), none_k.cview(), none_w.cview(), none_w.cview(),
                     none_v.cview(), none_v.cview(),
                     MacchiatoGradients<float>{none_dq.view(), none_dk.view(), none_dwq.view(),
                                               none_dwk.view(), none_dv.view()});
}

}  // namespace test_macchiato_gradients
