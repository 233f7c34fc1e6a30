// ConvCompressedAttention::backward against the long-double oracle written from
// the definition (tests/oracles/conv_compressed_oracle.hpp: every attention an
// explicit matrix): gradients of <d_out, oracle(q, k, v; weights)> by central
// differences (every element of q, k, v and of every weight: convolutions,
// biases, level and cross projections; small shapes) and along random
// directions, causal and bidirectional, levels 1 to 3, default and custom
// windows, on exec::reference and exec::cpu, fp32 and fp64; bad buffers.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "expect_error.hpp"
#include "gradient_check.hpp"
#include "latte/mechanisms/conv_compressed_attention.hpp"
#include "oracles/conv_compressed_oracle.hpp"
#include "support.hpp"

namespace test_conv_compressed_gradients {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;

struct ConvShape {
  index_t batch, time, heads, key_dim, value_dim, group_size, levels;
  std::optional<index_t> window_left{}, window_right{};
};

template <class T, std::size_t N>
Tensor<double, N> rounded_random(Rng& rng, const std::array<index_t, N>& extents, double scale) {
  Tensor<double, N> x = random_tensor<double, N>(rng, extents, scale);
  for (index_t i = 0; i < x.size(); ++i) x.data()[i] = static_cast<double>(static_cast<T>(x.data()[i]));
  return x;
}

template <class T, class Dir>
struct Problem {
  ConvShape shape;
  ConvCompressedDims dims;
  ConvCompressedParams params;
  Tensor<T, 4> q, k, v, g;
  std::optional<ConvCompressedAttention<Dir>> attention;
  Tensor<T, 4> dq, dk, dv;
  std::vector<std::vector<T>> weight_gradients;  // d_params, in for_each_weight's order

  Problem(Rng& rng, const ConvShape& s, double input_scale) : shape(s) {
    dims = {.heads = s.heads, .key_dim = s.key_dim, .value_dim = s.value_dim,
            .group_size = s.group_size, .levels = s.levels, .window_left = s.window_left,
            .window_right = s.window_right};
    params = ConvCompressedParams::zeros(dims);
    const double Dv = double(s.value_dim), M = double(s.group_size);
    for (auto& w : params.conv_weight) w = rounded_random<T, 4>(rng, w.extents(), 1.0 / std::sqrt(M * Dv));
    for (auto& w : params.conv_bias) w = rounded_random<T, 2>(rng, w.extents(), 0.5);
    for (auto* list : {&params.level_query, &params.level_key, &params.level_value})
      for (auto& w : *list) w = rounded_random<T, 3>(rng, w.extents(), 1.0 / std::sqrt(Dv));
    for (auto* w : {&params.cross_query, &params.cross_key, &params.cross_value})
      *w = rounded_random<T, 3>(rng, w->extents(), 1.0 / std::sqrt(Dv));
    attention.emplace(dims, params);
    q = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, s.key_dim}, input_scale);
    k = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, s.key_dim}, input_scale);
    v = uniform_tensor<T, 4>(rng, {s.batch, s.time, s.heads, s.value_dim}, -1, 1);
    g = uniform_tensor<T, 4>(rng, {s.batch, s.time, s.heads, s.value_dim}, -1, 1);
  }

  template <class E>
  void run(E e, const ConvCompressedStateGradients<T>* states = nullptr) {
    dq = Tensor<T, 4>(q.extents());
    dk = Tensor<T, 4>(k.extents());
    dv = Tensor<T, 4>(v.extents());
    ConvCompressedParams d_params = ConvCompressedParams::zeros(dims);
    const ConvCompressedGradients<T> gradients{dq.view(), dk.view(), dv.view(), &d_params};
    if constexpr (Dir::is_causal) {
      if (states) attention->backward(e, q.cview(), k.cview(), v.cview(), g.cview(), gradients, *states);
      else attention->backward(e, q.cview(), k.cview(), v.cview(), g.cview(), gradients);
    } else {
      attention->backward(e, q.cview(), k.cview(), v.cview(), g.cview(), gradients);
    }
    weight_gradients.clear();
    for_each_weight(d_params, [&](const auto& w) {
      weight_gradients.emplace_back(w.data(), w.data() + w.size());
    });
  }

  struct Loss {
    ConvCompressedSpec spec;
    ParamsLD params;
    TensorLD<4> q, k, v, g;
    long double operator()() const {
      const TensorLD<4> out = conv_compressed_oracle(spec, params, q, k, v).out;
      long double total = 0;
      for (index_t i = 0; i < out.size(); ++i) total += g.data()[i] * out.data()[i];
      return total;
    }
    GradientInputs inputs() {
      GradientInputs in{as_input(q), as_input(k), as_input(v)};
      for_each_weight(params, [&](auto& w) { in.emplace_back(as_input(w)); });
      return in;
    }
  };
  Loss loss() const {
    const ConvCompressedAttention<Dir>& a = *attention;
    Loss l{{.causal = Dir::is_causal,
            .group_size = shape.group_size,
            .levels = shape.levels,
            .window_left = a.window().left,
            .window_right = a.window().right,
            .scale = 1.0L / std::sqrt((long double)shape.key_dim)},
           {}, to_long_double(q), to_long_double(k), to_long_double(v), to_long_double(g)};
    for (const auto& w : params.conv_weight) l.params.conv_weight.push_back(to_long_double(w));
    for (const auto& w : params.conv_bias) l.params.conv_bias.push_back(to_long_double(w));
    for (const auto& w : params.level_query) l.params.level_query.push_back(to_long_double(w));
    for (const auto& w : params.level_key) l.params.level_key.push_back(to_long_double(w));
    for (const auto& w : params.level_value) l.params.level_value.push_back(to_long_double(w));
    l.params.cross_query = to_long_double(params.cross_query);
    l.params.cross_key = to_long_double(params.cross_key);
    l.params.cross_value = to_long_double(params.cross_value);
    return l;
  }
  std::vector<std::span<const T>> gradients() const {
    std::vector<std::span<const T>> out{span_of(dq), span_of(dk), span_of(dv)};
    for (const auto& w : weight_gradients) out.emplace_back(w.data(), w.size());
    return out;
  }
  /// d_queries, d_keys, d_values, then every weight's gradient.
  std::vector<std::string> names() const {
    std::vector<std::string> n{"d_queries", "d_keys", "d_values"};
    for (std::size_t i = 0; i < weight_gradients.size(); ++i) n.push_back("d_params weight " + std::to_string(i));
    return n;
  }
};

template <class T, class P>
void check_all_elements(const P& problem, const OracleGradients& expected) {
  const std::vector<std::string> names = problem.names();
  std::vector<const char*> pointers;
  for (const std::string& name : names) pointers.push_back(name.c_str());
  check_every_element<T>(problem, expected, pointers.data());
}

template <class T, class Dir>
void every_element_cases(std::uint64_t seed) {
  Rng rng(seed);
  const ConvShape shapes[] = {{1, 9, 2, 2, 3, 2, 1},         {2, 12, 1, 3, 2, 2, 2},
                              {1, 17, 1, 2, 2, 3, 2},        {1, 8, 1, 2, 2, 2, 3},
                              {1, 13, 1, 2, 3, 3, 1, 1, {}}, {1, 11, 2, 2, 2, 2, 2, 4, {}}};
  for (const ConvShape& s : shapes) {
    if ((std::is_same_v<T, float> || case_count(2) < 2) && s.time > 12) continue;
    CAPTURE(s.time);
    CAPTURE(s.group_size);
    CAPTURE(s.levels);
    Problem<T, Dir> problem(rng, s, 1.5);
    problem.run(exec::reference);
    const OracleGradients expected = oracle_gradients(problem);  // one set for both runs
    check_all_elements<T>(problem, expected);
    problem.run(exec::cpu);
    check_all_elements<T>(problem, expected);
  }
}

template <class T, class Dir>
void direction_cases(std::uint64_t seed, int cases) {
  Rng rng(seed);
  for (int c = 0; c < case_count(cases); ++c) {
    const ConvShape s{pick(rng, std::array<index_t, 2>{1, 2}),
                      pick(rng, std::array<index_t, 4>{1, 7, 30, 70}),
                      pick(rng, std::array<index_t, 2>{1, 3}),
                      pick(rng, std::array<index_t, 2>{2, 5}),
                      pick(rng, std::array<index_t, 2>{3, 6}),
                      pick(rng, std::array<index_t, 3>{1, 2, 4}),
                      pick(rng, std::array<index_t, 3>{1, 2, 3})};
    CAPTURE(s.batch);
    CAPTURE(s.time);
    CAPTURE(s.group_size);
    CAPTURE(s.levels);
    Problem<T, Dir> problem(rng, s, pick(rng, std::array{0.5, 2.0}));
    problem.run(exec::reference);
    check_direction<T>(problem, rng);
    problem.run(exec::cpu);
    check_direction<T>(problem, rng);
  }
}

}  // namespace

TEST_CASE("causal conv-compression backward matches the oracle's gradients (inputs and every weight)") {
  every_element_cases<double, Causal>(100);
  every_element_cases<float, Causal>(101);
  direction_cases<double, Causal>(102, 10);
  direction_cases<float, Causal>(103, 10);
}

TEST_CASE("bidirectional conv-compression backward matches the oracle's gradients (inputs and every weight)") {
  every_element_cases<double, Bidirectional>(200);
  every_element_cases<float, Bidirectional>(201);
  direction_cases<double, Bidirectional>(202, 10);
  direction_cases<float, Bidirectional>(203, 10);
}

namespace {

/// Backward over [0, T) from `start` equals the backward over three chunks
/// [0, c1), [c1, c2), [c2, T) chained through the state: forwards from `start`
/// leave S1, S2; the last chunk's backward from S2 gives dS2 (every level's
/// ring, the open groups' sums, the compressed store); the middle one's from
/// S1 with d_final = dS2 gives dS1 (a chunk shorter than a ring or a group
/// passes what it does not overwrite or close through); the first one's with
/// d_final = dS1. `start` is the state a forward over `prelude` tokens left,
/// so the groups of every level are open at arbitrary taps.
template <class T, class E>
void check_chunks(E e, Rng& rng, const ConvShape& s, index_t c1, index_t c2, index_t prelude) {
  using P = Problem<T, Causal>;
  P whole(rng, s, 1.5);
  const ConvCompressedAttention<Causal>& attention = *whole.attention;
  auto start = attention.template make_state<T>(s.batch, prelude + s.time);
  if (prelude > 0) {
    const Tensor<T, 4> q = random_tensor<T, 4>(rng, {s.batch, prelude, s.heads, s.key_dim}, 1.5);
    const Tensor<T, 4> k = random_tensor<T, 4>(rng, {s.batch, prelude, s.heads, s.key_dim}, 1.5);
    const Tensor<T, 4> v = uniform_tensor<T, 4>(rng, {s.batch, prelude, s.heads, s.value_dim}, -1, 1);
    Tensor<T, 4> out(v.extents());
    attention.forward(e, q.cview(), k.cview(), v.cview(), out.view(), start);
  }
  const ConvCompressedStateGradients<T> from_start{.initial = &start};
  whole.run(e, &from_start);

  const std::array<index_t, 4> borders{0, c1, c2, s.time};
  std::vector<P> chunks(3, whole);
  std::vector<ConvCompressedState<T>> states{start};  // the state before each chunk
  for (std::size_t i = 0; i < 3; ++i) {
    P& chunk = chunks[i];
    const index_t from = borders[i], count = borders[i + 1] - borders[i];
    chunk.q = time_slice(whole.q, from, count);
    chunk.k = time_slice(whole.k, from, count);
    chunk.v = time_slice(whole.v, from, count);
    chunk.g = time_slice(whole.g, from, count);
    auto state = states.back();
    Tensor<T, 4> out(chunk.v.extents());
    attention.forward(e, chunk.q.cview(), chunk.k.cview(), chunk.v.cview(), out.view(), state);
    states.push_back(state);
  }
  std::vector<ConvCompressedState<T>> d_states(3);
  for (std::size_t i = 3; i-- > 0;) {  // d_states[i]: the gradient of the state before chunk i
    const ConvCompressedStateGradients<T> ends{.initial = &states[i],
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
  for (std::size_t w = 0; w < whole.weight_gradients.size(); ++w) {
    CAPTURE(w);
    long double worst = 0, largest = 0;
    for (std::size_t i = 0; i < whole.weight_gradients[w].size(); ++i) {
      long double summed = 0;
      for (const P& chunk : chunks) summed += chunk.weight_gradients[w][i];
      worst = std::max(worst, std::fabs(summed - whole.weight_gradients[w][i]));
      largest = std::max(largest, std::fabs((long double)whole.weight_gradients[w][i]));
    }
    CHECK(static_cast<double>(worst / std::max(largest, 1e-30L)) <= bound);
  }
}

}  // namespace

TEST_CASE("conv-compression training in chunks: backward chained through the state gradients equals the whole backward") {
  Rng rng(300);
  for (const auto& cuts : {std::pair<index_t, index_t>{1, 2}, {3, 5}, {7, 16}, {16, 17}, {0, 30}, {29, 30}}) {
    const index_t c1 = cuts.first, c2 = cuts.second;  // names clang 14 can capture
    for (const index_t prelude : {0, 3, 13}) {
      CAPTURE(c1);
      CAPTURE(c2);
      CAPTURE(prelude);
      // {B, T, H, Dk, Dv, M, levels, window left}: rings partly and wholly
      // filled, groups open at every level, a window wider than the chunks.
      const ConvShape shapes[] = {{2, 30, 2, 3, 4, 2, 2}, {1, 30, 1, 2, 3, 2, 3, 4, {}},
                                  {1, 30, 2, 3, 2, 3, 1, 1, {}}, {1, 30, 1, 2, 2, 2, 2, 11, {}}};
      for (const ConvShape& s : shapes) {
        CAPTURE(s.levels);
        check_chunks<double>(exec::reference, rng, s, c1, c2, prelude);
        check_chunks<double>(exec::cpu, rng, s, c1, c2, prelude);
      }
      check_chunks<float>(exec::cpu, rng, shapes[0], c1, c2, prelude);
      check_chunks<float>(exec::reference, rng, shapes[1], c1, c2, prelude);
    }
  }
}

TEST_CASE("conv-compression backward: empty sequences, and bad gradient buffers are refused by name") {
  const ConvCompressedDims dims{.heads = 2, .key_dim = 3, .value_dim = 4, .group_size = 2, .levels = 2};
  const ConvCompressedAttention<Causal> attention(dims, ConvCompressedParams::zeros(dims));
  Tensor<float, 4> q({1, 6, 2, 3}), k({1, 6, 2, 3}), v({1, 6, 2, 4}), g({1, 6, 2, 4});
  Tensor<float, 4> dq({1, 6, 2, 3}), dk({1, 6, 2, 3}), dv({1, 6, 2, 4}), wrong({1, 6, 2, 5});
  ConvCompressedParams d_params = ConvCompressedParams::zeros(dims);
  auto call = [&](ConvCompressedGradients<float> gradients, TensorView<const float, 4> d_out) {
    attention.backward(exec::cpu, q.cview(), k.cview(), v.cview(), d_out, gradients);
  };
  auto valid = [&] { return ConvCompressedGradients<float>{dq.view(), dk.view(), dv.view(), &d_params}; };
  call(valid(), g.cview());  // the valid call first
  auto with = [&](auto change) {
    ConvCompressedGradients<float> gradients = valid();
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
  ConvCompressedParams other = ConvCompressedParams::zeros({.heads = 2, .key_dim = 3, .value_dim = 4,
                                                            .group_size = 3, .levels = 2});
  expect_error([&] { call(with([&](auto& x) { x.d_params = &other; }), g.cview()); },
               "gradients.d_params.conv_weight[0]", "");
  ConvCompressedParams one_level = ConvCompressedParams::zeros({.heads = 2, .key_dim = 3, .value_dim = 4,
                                                                .group_size = 2, .levels = 1});
  expect_error([&] { call(with([&](auto& x) { x.d_params = &one_level; }), g.cview()); },
               "gradients.d_params.conv_weight", "");
  // T = 0: nothing to write.
  Tensor<float, 4> none_q({1, 0, 2, 3}), none_v({1, 0, 2, 4}), none_dq({1, 0, 2, 3}),
      none_dk({1, 0, 2, 3}), none_dv({1, 0, 2, 4});
  attention.backward(exec::reference, none_q.cview(), none_q.cview(), none_v.cview(), none_v.cview(),
                     ConvCompressedGradients<float>{none_dq.view(), none_dk.view(), none_dv.view()});

  // States: each of the wrong kind or size, too small, or shared, is refused by name.
  auto with_states = [&](const ConvCompressedStateGradients<float>& states) {
    attention.backward(exec::cpu, q.cview(), k.cview(), v.cview(), g.cview(), valid(), states);
  };
  const ConvCompressedDims wider{.heads = 2, .key_dim = 3, .value_dim = 5, .group_size = 2, .levels = 2};
  const auto other_state = ConvCompressedAttention<Causal>(wider, ConvCompressedParams::zeros(wider))
                         .make_state<float>(1, 16);
  auto state = attention.make_state<float>(1, 16), small = attention.make_state<float>(1, 8);
  auto d_state = attention.make_state<float>(1, 16);
  expect_error([&] { with_states({.initial = &other_state}); }, "states.initial", "");
  expect_error([&] { with_states({.initial = &state, .d_final = &small}); }, "states.d_final", "");
  expect_error([&] { with_states({.d_final = &other_state}); }, "states.d_final", "");
  expect_error([&] { with_states({.initial = &state, .d_initial = &state}); }, "states.d_initial", "");
  expect_error([&] { with_states({.d_final = &d_state, .d_initial = &d_state}); }, "states.d_initial", "");
  Tensor<float, 4> out({1, 6, 2, 4});
  attention.forward(exec::cpu, q.cview(), k.cview(), v.cview(), out.view(), small);  // 6 of 8 tokens
  expect_error([&] { with_states({.initial = &small}); }, "state", "context_capacity");
  auto tiny = attention.make_state<float>(1, 4);
  expect_error([&] { with_states({.d_final = &tiny}); }, "states.d_final", "context_capacity");

  // T = 0: the initial state's gradient is d_final's on the slots that hold a
  // token (6 tokens, M = 2, ring 2: level 0's slots 0-1, level 1's (3 tokens)
  // slots 0-1, no open group, one compressed token), zero elsewhere.
  auto d_final = small, d_initial = attention.make_state<float>(1, 8);
  for (int field = 0; field < 5; ++field) std::fill_n(d_final.field(field), d_final.field_size(field), 2.5f);
  attention.backward(exec::cpu, none_q.cview(), none_q.cview(), none_v.cview(), none_v.cview(),
                     ConvCompressedGradients<float>{none_dq.view(), none_dk.view(), none_dv.view()},
                     ConvCompressedStateGradients<float>{.initial = &small, .d_final = &d_final,
                                                         .d_initial = &d_initial});
  CHECK(d_initial.position() == 6);
  const auto carry = std::as_const(d_initial).carry(0, 1);
  CHECK(carry.window_keys[0] == 2.5f);
  CHECK(carry.window_values[2 * 4 + 4 + 3] == 2.5f);  // level 1, slot 1, last element
  CHECK(carry.group_sums[0] == 0.0f);                  // level 1's group: 6 = 3 x 2, closed
  CHECK(carry.group_sums[4] == 2.5f);                  // level 2's group: 3 tokens, 1 tap open
  CHECK(carry.compressed_keys[0] == 2.5f);             // floor(6 / 4) = 1 stored token
  CHECK(carry.compressed_keys[3] == 0.0f);             // slot 1: empty
}

}  // namespace test_conv_compressed_gradients
