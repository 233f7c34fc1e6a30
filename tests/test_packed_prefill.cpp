// Packed variable-length prefill (latte::forward_packed, serving/packed_prefill.hpp)
// for every causal mechanism (softmax with and without a window, cosFormer and
// RoPE linear among them), on exec::reference and exec::cpu, fp32 and fp64:
// N sequences of random lengths (empty ones and a long one among them) packed
// along one time axis, each continuing from its own state after a random prefix
// absorbed by the mechanism's plain forward, then a second packed call continuing
// from the states the first left. Every output row is checked against the
// mechanism's explicit T x T oracle over that sequence's whole stream (prefix,
// first part, second part), so a sequence that reads another's tokens or a state
// that is not written back fails. Also: fresh starts without states, the same
// bits on a repeated call, the thread schedule, and bad calls refused by name
// with every state unchanged.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "expect_error.hpp"
#include "gradient_check.hpp"
#include "latte/serving/half_precision.hpp"
#include "latte/serving/packed_prefill.hpp"
#include "mechanism_adaptors.hpp"
#include "support.hpp"
#include "tolerances.hpp"

namespace test_packed_prefill {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;

/// One sequence's tokens of every input: [1, tokens, H, width] each.
template <class T>
using Streams = std::vector<Tensor<T, 4>>;

/// Tokens [first, first + count) of every stream, copied.
template <class T>
Streams<T> tokens_of(const Streams<T>& streams, index_t first, index_t count) {
  Streams<T> out;
  for (const Tensor<T, 4>& x : streams) out.push_back(time_slice(x, first, count));
  return out;
}

/// Views of the inputs, as the tuple forward_packed takes.
template <std::size_t... I, class T>
auto view_tuple(const Streams<T>& inputs, std::index_sequence<I...>) {
  return std::make_tuple(inputs[I].cview()...);
}

template <class T, class Mechanism>
struct PackedProblem {
  using Attention = typename Mechanism::Attention;
  using Inputs = LayerInputs<Attention>;
  using State = typename Attention::template State<T>;
  static constexpr std::size_t kInputs = Inputs::count;

  LayerShape shape;
  Attention attention;
  index_t heads, value_dim;
  std::vector<Streams<T>> sequences;  // each sequence's whole stream
  std::vector<index_t> prefix, first, second;  // tokens: before, in call 1, in call 2

  PackedProblem(Rng& rng, const LayerShape& s, index_t count, index_t long_length)
      : shape(s), attention(Mechanism::make(s)) {
    heads = Inputs::heads(attention);
    value_dim = Inputs::value_dim(attention);
    const auto widths = Inputs::inputs(attention);
    std::uniform_int_distribution<index_t> short_length(0, 9), prefix_length(0, 6);
    for (index_t i = 0; i < count; ++i) {
      prefix.push_back(prefix_length(rng));
      first.push_back(i == count / 2 ? long_length : short_length(rng));
      second.push_back(short_length(rng));
      const index_t tokens = prefix.back() + first.back() + second.back();
      Streams<T> streams;
      for (const LayerInput& input : widths)
        streams.push_back(random_tensor<T, 4>(rng, {1, tokens, heads, input.width}, 1.0));
      sequences.push_back(std::move(streams));
    }
  }

  /// The sequences' tokens [offset_i, offset_i + lengths_i) packed along time.
  Streams<T> packed(const std::vector<index_t>& offsets, const std::vector<index_t>& lengths,
                    std::vector<index_t>& cu_seqlens) const {
    cu_seqlens.assign(1, 0);
    for (index_t length : lengths) cu_seqlens.push_back(cu_seqlens.back() + length);
    const auto widths = Inputs::inputs(attention);
    Streams<T> out;
    for (std::size_t j = 0; j < kInputs; ++j) {
      Tensor<T, 4> x({1, cu_seqlens.back(), heads, widths[j].width});
      for (std::size_t i = 0; i < sequences.size(); ++i)
        for (index_t t = 0; t < lengths[i]; ++t)
          for (index_t h = 0; h < heads; ++h)
            for (index_t d = 0; d < widths[j].width; ++d)
              x(0, cu_seqlens[i] + t, h, d) = sequences[i][j](0, offsets[i] + t, h, d);
      out.push_back(std::move(x));
    }
    return out;
  }

  /// The oracle's output over sequence i's whole stream.
  TensorLD<4> oracle(std::size_t i) const {
    std::vector<TensorLD<4>> inputs;
    for (const Tensor<T, 4>& x : sequences[i]) inputs.push_back(to_long_double(x));
    return Mechanism::oracle(shape, Mechanism::parameters(attention), inputs);
  }

  /// Each sequence's prefix through the plain forward with its own state.
  std::vector<State> states_after_prefix(auto e) const {
    std::vector<State> states;
    for (std::size_t i = 0; i < sequences.size(); ++i) {
      states.push_back(fresh_state<T>(attention, prefix[i] + first[i] + second[i]));
      const Streams<T> head = tokens_of(sequences[i], 0, prefix[i]);
      Tensor<T, 4> out({1, prefix[i], heads, value_dim});
      std::apply([&](const auto&... view) { attention.forward(e, view..., out.view(), states.back()); },
                 view_tuple(head, std::make_index_sequence<kInputs>{}));
    }
    return states;
  }

  Tensor<T, 4> run_packed(auto e, const std::vector<index_t>& offsets, const std::vector<index_t>& lengths,
                          std::vector<State>* states) const {
    std::vector<index_t> cu_seqlens;
    const Streams<T> inputs = packed(offsets, lengths, cu_seqlens);
    Tensor<T, 4> out({1, cu_seqlens.back(), heads, value_dim});
    const auto views = view_tuple(inputs, std::make_index_sequence<kInputs>{});
    if (states) {
      std::vector<State*> pointers;
      for (State& s : *states) pointers.push_back(&s);
      forward_packed(attention, e, std::span<const index_t>(cu_seqlens), views, out.view(),
                     std::span<State* const>(pointers));
    } else {
      forward_packed(attention, e, std::span<const index_t>(cu_seqlens), views, out.view());
    }
    return out;
  }
};

/// max |out - oracle| / max |oracle| over sequence i's rows of a packed output,
/// against the oracle's rows [first, first + length) of that sequence.
template <class T>
double sequence_error(const Tensor<T, 4>& out, index_t packed_first, const TensorLD<4>& oracle,
                      index_t first, index_t length) {
  if (length == 0) return 0;
  Tensor<T, 4> rows = time_slice(out, packed_first, length);
  TensorLD<4> expected({1, length, oracle.extent(2), oracle.extent(3)});
  for (index_t t = 0; t < length; ++t)
    for (index_t h = 0; h < oracle.extent(2); ++h)
      for (index_t d = 0; d < oracle.extent(3); ++d) expected(0, t, h, d) = oracle(0, first + t, h, d);
  return relative_error(rows, expected);
}

template <class T, class Mechanism, class E>
void packed_cases(E e, std::uint64_t seed) {
  Rng rng(seed);
  // batch, time, heads, latents, key_dim, value_dim, model_dim (unused), window
  const LayerShape shapes[] = {{1, 0, 2, 3, 4, 4, 0, 2}, {1, 0, 3, 5, 2, 6, 0, 3}, {1, 0, 1, 2, 6, 2, 0, 1}};
  double worst = 0;
  for (int c = 0; c < case_count(6); ++c) {
    const LayerShape& s = shapes[c % 3];
    const index_t count = std::uniform_int_distribution<index_t>(1, 6)(rng);
    const index_t long_length = std::uniform_int_distribution<index_t>(10, 70)(rng);
    const PackedProblem<T, Mechanism> problem(rng, s, count, long_length);
    CAPTURE(c);
    CAPTURE(count);
    std::vector<typename PackedProblem<T, Mechanism>::State> states = problem.states_after_prefix(e);
    const Tensor<T, 4> out1 = problem.run_packed(e, problem.prefix, problem.first, &states);
    std::vector<index_t> after_first(problem.prefix.size());
    for (std::size_t i = 0; i < after_first.size(); ++i) after_first[i] = problem.prefix[i] + problem.first[i];
    const Tensor<T, 4> out2 = problem.run_packed(e, after_first, problem.second, &states);
    index_t at1 = 0, at2 = 0;
    for (std::size_t i = 0; i < problem.sequences.size(); ++i) {
      CAPTURE(i);
      if (problem.first[i] + problem.second[i] > 0) {  // (an oracle needs a token)
        const TensorLD<4> oracle = problem.oracle(i);
        const double e1 = sequence_error(out1, at1, oracle, problem.prefix[i], problem.first[i]);
        const double e2 = sequence_error(out2, at2, oracle, after_first[i], problem.second[i]);
        CHECK(e1 <= Tolerance<T>::relative);
        CHECK(e2 <= Tolerance<T>::relative);
        worst = std::max({worst, e1, e2});
      }
      at1 += problem.first[i];
      at2 += problem.second[i];
    }
    // Without states every sequence starts fresh: the oracle over its first part alone.
    const std::vector<index_t> zeros(problem.first.size(), 0);
    std::vector<index_t> fresh_lengths = problem.first;
    const Tensor<T, 4> fresh = problem.run_packed(e, problem.prefix, fresh_lengths, nullptr);
    index_t at = 0;
    for (std::size_t i = 0; i < problem.sequences.size(); ++i) {
      if (problem.first[i] > 0) {
        Streams<T> part = tokens_of(problem.sequences[i], problem.prefix[i], problem.first[i]);
        std::vector<TensorLD<4>> inputs;
        for (const Tensor<T, 4>& x : part) inputs.push_back(to_long_double(x));
        const TensorLD<4> oracle = Mechanism::oracle(s, Mechanism::parameters(problem.attention), inputs);
        CHECK(sequence_error(fresh, at, oracle, 0, problem.first[i]) <= Tolerance<T>::relative);
      }
      at += problem.first[i];
    }
    // The same call again gives the same bits.
    std::vector<typename PackedProblem<T, Mechanism>::State> again = problem.states_after_prefix(e);
    CHECK(bit_equal(problem.run_packed(e, problem.prefix, problem.first, &again), out1));
  }
  MESSAGE(std::string(dtype_name<T>()) << " " << std::string(E::name) << ": worst relative error " << worst);
}

template <class Mechanism>
void every_backend(std::uint64_t seed) {
  packed_cases<double, Mechanism>(exec::reference, seed);
  packed_cases<float, Mechanism>(exec::reference, seed + 1);
  packed_cases<double, Mechanism>(exec::cpu, seed + 2);
  packed_cases<float, Mechanism>(exec::cpu, seed + 3);
}

/// Sequences' tokens [offsets[i], offsets[i] + lengths[i]) of row-major [1, n_i, ...]
/// tensors (the same trailing extents), packed along time into one [1, total, ...].
template <class T, std::size_t N>
Tensor<T, N> pack_tokens(const std::vector<Tensor<T, N>>& parts, const std::vector<index_t>& offsets,
                         const std::vector<index_t>& lengths) {
  auto extents = parts[0].extents();
  extents[1] = std::accumulate(lengths.begin(), lengths.end(), index_t{0});
  Tensor<T, N> packed(extents);
  index_t row = 1;  // elements per token
  for (std::size_t d = 2; d < N; ++d) row *= extents[d];
  T* to = packed.data();
  for (std::size_t i = 0; i < parts.size(); ++i)
    to = std::copy_n(parts[i].data() + offsets[i] * row, lengths[i] * row, to);
  return packed;
}

/// LeaPformer with proportions given per call (SequenceProportions, two [1, total_T, H]
/// views after v): two packed calls through fresh states, then fresh starts, against
/// the oracle of each sequence's whole stream with those proportions.
template <class T, class E>
void given_proportions_cases(E e, std::uint64_t seed) {
  using A = LeaPformer<Causal>;
  Rng rng(seed);
  const index_t H = 2, Dk = 4, Dv = 6;
  typename A::Options options;
  options.reweight.leap_factor = 1;
  options.reweight.query_module = random_leap_module(rng, Dk, 1);  // unused: proportions are given
  options.reweight.key_module = random_leap_module(rng, Dk, 1);
  const A attention({H, Dk, Dv}, options);
  double worst = 0;
  for (int c = 0; c < case_count(6); ++c) {
    CAPTURE(c);
    const index_t count = std::uniform_int_distribution<index_t>(1, 6)(rng);
    std::uniform_int_distribution<index_t> short_length(0, 9);
    std::vector<index_t> first, second, zeros(static_cast<std::size_t>(count), 0);
    std::vector<Tensor<T, 4>> q, k, v;
    std::vector<Tensor<T, 3>> pq, pk;
    for (index_t i = 0; i < count; ++i) {
      first.push_back(i == count / 2 ? std::uniform_int_distribution<index_t>(10, 70)(rng) : short_length(rng));
      second.push_back(short_length(rng));
      const index_t n = first.back() + second.back();
      q.push_back(random_tensor<T, 4>(rng, {1, n, H, Dk}, 1.0));
      k.push_back(random_tensor<T, 4>(rng, {1, n, H, Dk}, 1.0));
      v.push_back(random_tensor<T, 4>(rng, {1, n, H, Dv}, 1.0));
      pq.push_back(uniform_tensor<T, 3>(rng, {1, n, H}, 0, 1));
      pk.push_back(uniform_tensor<T, 3>(rng, {1, n, H}, 0, 1));
    }
    std::vector<typename A::template State<T>> states;
    for (index_t i = 0; i < count; ++i) states.push_back(attention.template make_state<T>(1));
    std::vector<typename A::template State<T>*> pointers;
    for (auto& state : states) pointers.push_back(&state);
    auto run = [&](const std::vector<index_t>& offsets, const std::vector<index_t>& lengths, bool with_states) {
      std::vector<index_t> cu{0};
      for (index_t length : lengths) cu.push_back(cu.back() + length);
      const Tensor<T, 4> qp = pack_tokens(q, offsets, lengths), kp = pack_tokens(k, offsets, lengths),
                         vp = pack_tokens(v, offsets, lengths);
      const Tensor<T, 3> pqp = pack_tokens(pq, offsets, lengths), pkp = pack_tokens(pk, offsets, lengths);
      Tensor<T, 4> out({1, cu.back(), H, Dv});
      const auto inputs = std::make_tuple(qp.cview(), kp.cview(), vp.cview(), SequenceProportions<T>{pqp.cview(), pkp.cview()});
      if (with_states)
        forward_packed(attention, e, std::span<const index_t>(cu), inputs, out.view(),
                       std::span<typename A::template State<T>* const>(pointers));
      else
        forward_packed(attention, e, std::span<const index_t>(cu), inputs, out.view());
      return out;
    };
    auto oracle = [&](index_t i) {  // over sequence i's whole stream
      LinearOracleSpec spec{.causal = true, .feature = oracle_relu};
      spec.query_proportions = oracle_given_proportions(pq[i]);
      spec.key_proportions = oracle_given_proportions(pk[i]);
      set_oracle_normaliser(spec, options.normaliser);
      return linear_oracle(spec, to_long_double(q[i]), to_long_double(k[i]), to_long_double(v[i]));
    };
    const Tensor<T, 4> out1 = run(zeros, first, true), out2 = run(first, second, true), fresh = run(zeros, first, false);
    index_t at1 = 0, at2 = 0;
    for (index_t i = 0; i < count; ++i) {
      CAPTURE(i);
      if (first[i] + second[i] > 0) {
        const TensorLD<4> whole = oracle(i);
        const double e1 = sequence_error(out1, at1, whole, 0, first[i]);
        const double e2 = sequence_error(out2, at2, whole, first[i], second[i]);
        const double e3 = sequence_error(fresh, at1, whole, 0, first[i]);  // causal: the same rows
        CHECK(e1 <= Tolerance<T>::relative);
        CHECK(e2 <= Tolerance<T>::relative);
        CHECK(e3 <= Tolerance<T>::relative);
        worst = std::max({worst, e1, e2, e3});
      }
      at1 += first[i];
      at2 += second[i];
    }
  }
  MESSAGE(std::string(dtype_name<T>()) << " " << std::string(E::name) << ": worst relative error " << worst);
}

}  // namespace

TEST_CASE("forward_packed: every causal mechanism equals its oracle per sequence, with and without states") {
  SUBCASE("Latte") { every_backend<LatteMechanism<Causal>>(100); }
  SUBCASE("Latte, VAPOR") { every_backend<LatteMechanism<Causal, VAPOR>>(110); }
  SUBCASE("Macchiato (RoPE window)") { every_backend<MacchiatoMechanism<Causal>>(120); }
  SUBCASE("Macchiato (VAPOR latents, RoPE window)") { every_backend<MacchiatoMechanism<Causal, VAPOR>>(130); }
  SUBCASE("softmax (KV cache)") { every_backend<SoftmaxMechanism<Causal>>(140); }
  SUBCASE("softmax, sliding window (ring KV cache)") { every_backend<WindowedSoftmaxMechanism<Causal>>(145); }
  SUBCASE("cosFormer (positions from each sequence's start)") { every_backend<CosFormerMechanism<Causal>>(155); }
  SUBCASE("linear elu + 1, RoPE") { every_backend<RopeLinearMechanism<Causal>>(157); }
  SUBCASE("linear, elu + 1") { every_backend<LinearMechanism<Causal>>(150); }
  SUBCASE("LeaPformer (LeaP modules)") { every_backend<LeaPMechanism<Causal>>(160); }
  SUBCASE("LeaPformer (given proportions)") {
    given_proportions_cases<double>(exec::reference, 165);
    given_proportions_cases<float>(exec::reference, 166);
    given_proportions_cases<double>(exec::cpu, 167);
    given_proportions_cases<float>(exec::cpu, 168);
  }
  SUBCASE("LAVO") { every_backend<LavoMechanism<Causal>>(170); }
  SUBCASE("conv-compression") { every_backend<ConvCompressedMechanism<Causal>>(180); }
}

TEST_CASE("PackedSequences::schedule: a long prompt runs on every worker, short ones are spread") {
  std::vector<index_t> cu{0, 65536};
  for (int i = 0; i < 50; ++i) cu.push_back(cu.back() + 100);
  const PackedSequences sequences(cu, cu.back());
  const auto plan = sequences.schedule(2);
  REQUIRE(plan.size() == 3);
  CHECK(plan[0] == std::vector<index_t>{0});
  CHECK(plan[1].size() == 25);
  CHECK(plan[2].size() == 25);
  // Greedy longest-first onto the least loaded worker: loads within one sequence.
  // Lengths 5, 0, 35, 1, 0, 9, 2: the 35 runs on both workers (35 >= 52 / 2); 9 | 5 + 2 + 1.
  const std::vector<index_t> mixed{0, 5, 5, 40, 41, 41, 50, 52};
  const PackedSequences m(mixed, 52);
  const auto p = m.schedule(2);
  CHECK(p[0] == std::vector<index_t>{2});
  CHECK(p[1] == std::vector<index_t>{5});
  CHECK(p[2] == std::vector<index_t>{0, 6, 3});
  const auto serial = m.schedule(1);
  CHECK(serial[0] == std::vector<index_t>{0, 1, 2, 3, 4, 5, 6});  // one worker: every sequence in order
}

TEST_CASE("PackedSequences::schedule: softmax's prompts weigh the keys they attend to") {
  // One 4K prompt and sixty 256-token prompts: by length the 4K prompt is 4096 of
  // 19456 tokens (under half: it would share a worker); by softmax's work it is
  // 8.4M of 10.4M keys attended, so it runs alone on both workers.
  std::vector<index_t> cu{0, 4096};
  for (int i = 0; i < 60; ++i) cu.push_back(cu.back() + 256);
  const PackedSequences sequences(cu, cu.back());
  const auto by_length = sequences.schedule(2);
  CHECK(by_length[0].empty());
  const SoftmaxAttention<Causal> softmax({.heads = 2, .key_dim = 4, .value_dim = 4});
  CHECK(softmax.prefill_cost(4096) == 4096.0 * 4097 / 2);
  const auto by_work = sequences.schedule(2, [&](index_t length) { return detail::prefill_cost(softmax, length); });
  CHECK(by_work[0] == std::vector<index_t>{0});
  CHECK(by_work[1].size() == 30);
  CHECK(by_work[2].size() == 30);
  // A window bounds the keys per query: the same prompts weigh n min(n, left + 1).
  const SoftmaxAttention<Causal, SlidingWindow> windowed({.heads = 2, .key_dim = 4, .value_dim = 4},
                                                         SlidingWindow{.left = 127});
  CHECK(windowed.prefill_cost(4096) == 4096.0 * 128);
  CHECK(windowed.prefill_cost(100) == 100.0 * 100);
  const auto windowed_plan =
      sequences.schedule(2, [&](index_t length) { return detail::prefill_cost(windowed, length); });
  CHECK(windowed_plan[0].empty());
  // Linear-time mechanisms and HalfPrecision over softmax take the same weights.
  CHECK(detail::prefill_cost(LatteAttention<Causal>({.heads = 2, .latents = 4, .value_dim = 4}), 4096) == 4096.0);
  CHECK(detail::prefill_cost(HalfPrecision(softmax), 4096) == softmax.prefill_cost(4096));
}

TEST_CASE("forward_packed: bad calls are refused by name and leave every state unchanged") {
  const LatteAttention<Causal> attention({.heads = 2, .latents = 3, .value_dim = 4});
  Rng rng(7);
  const Tensor<float, 4> q = random_tensor<float, 4>(rng, {1, 9, 2, 3}, 1.0);
  const Tensor<float, 4> k = random_tensor<float, 4>(rng, {1, 9, 2, 3}, 1.0);
  const Tensor<float, 4> v = random_tensor<float, 4>(rng, {1, 9, 2, 4}, 1.0);
  Tensor<float, 4> out({1, 9, 2, 4});
  using State = LatteAttention<Causal>::State<float>;
  State a = attention.make_state<float>(1), b = attention.make_state<float>(1);
  State two = attention.make_state<float>(2);
  const auto bytes_a = a.save(), bytes_b = b.save();
  std::vector<State*> states{&a, &b};
  const auto inputs = std::make_tuple(q.cview(), k.cview(), v.cview());
  const auto call = [&](std::vector<index_t> cu, std::vector<State*> s) {
    forward_packed(attention, exec::cpu, std::span<const index_t>(cu), inputs, out.view(),
                   std::span<State* const>(s));
  };
  expect_error([&] { call({0, 4, 8}, states); }, "cu_seqlens", "cu_seqlens[N]");
  expect_error([&] { call({1, 4, 9}, states); }, "cu_seqlens", "cu_seqlens[0]");
  expect_error([&] { call({0, 5, 4, 9}, {&a, &b, &two}); }, "cu_seqlens", "cu_seqlens[2]");
  expect_error([&] { call({0}, {}); }, "cu_seqlens", "N + 1");
  expect_error([&] { call({0, 4, 9}, {&a}); }, "states", "one per sequence");
  expect_error([&] { call({0, 4, 9}, {&a, &a}); }, "states", "the same state");
  expect_error([&] { call({0, 4, 9}, {&a, nullptr}); }, "states", "null");
  expect_error([&] { call({0, 4, 9}, {&a, &two}); }, "states[1]", "");
  const auto call_on = [&](const Tensor<float, 4>& keys, const Tensor<float, 4>& values) {
    std::vector<index_t> cu{0, 4, 9};
    forward_packed(attention, exec::cpu, std::span<const index_t>(cu),
                   std::make_tuple(q.cview(), keys.cview(), values.cview()), out.view(),
                   std::span<State* const>(states));
  };
  const Tensor<float, 4> short_k = random_tensor<float, 4>(rng, {1, 8, 2, 3}, 1.0);
  expect_error([&] { call_on(short_k, v); }, "inputs[1]", "total_T");
  const Tensor<float, 4> wide_v = random_tensor<float, 4>(rng, {1, 9, 2, 5}, 1.0);
  expect_error([&] { call_on(k, wide_v); }, "values", "");
  CHECK(a.save() == bytes_a);
  CHECK(b.save() == bytes_b);
  // A KV cache without room for its sequence: refused before any other state moves.
  const SoftmaxAttention<Causal> softmax({.heads = 2, .key_dim = 3, .value_dim = 4});
  auto roomy = softmax.make_state<float>(1, 16), tight = softmax.make_state<float>(1, 4);
  const auto roomy_bytes = roomy.save();
  std::vector<index_t> cu{0, 4, 9};
  std::vector<SoftmaxAttention<Causal>::State<float>*> caches{&roomy, &tight};
  expect_error([&] {
    forward_packed(softmax, exec::cpu, std::span<const index_t>(cu), inputs, out.view(),
                   std::span<SoftmaxAttention<Causal>::State<float>* const>(caches));
  }, "states[1]", "capacity");
  CHECK(roomy.save() == roomy_bytes);
  // LeaPformer's given proportions: each view packed, apart from out, within [0, 1]
  // (all checked before the first sequence runs: its state would have moved).
  const LeaPformer<Causal> leap({.heads = 2, .key_dim = 3, .value_dim = 4}, {.reweight = {.leap_factor = 1}});
  auto p = leap.make_state<float>(1), r = leap.make_state<float>(1);
  const auto p_bytes = p.save(), r_bytes = r.save();
  std::vector<LeaPformer<Causal>::State<float>*> leap_states{&p, &r};
  const Tensor<float, 3> half(std::array<index_t, 3>{1, 9, 2}, 0.5f), short_half(std::array<index_t, 3>{1, 8, 2}, 0.5f);
  Tensor<float, 3> above(std::array<index_t, 3>{1, 9, 2}, 0.5f);
  above(0, 6, 1) = 1.5f;  // in the second sequence
  const auto leap_call = [&](const Tensor<float, 3>& queries, const Tensor<float, 3>& keys, TensorView<float, 4> o) {
    forward_packed(leap, exec::cpu, std::span<const index_t>(cu),
                   std::make_tuple(q.cview(), k.cview(), v.cview(), SequenceProportions<float>{queries.cview(), keys.cview()}),
                   o, std::span<LeaPformer<Causal>::State<float>* const>(leap_states));
  };
  expect_error([&] { leap_call(half, short_half, out.view()); }, "inputs[3].keys", "total_T");
  expect_error([&] { leap_call(half, above, out.view()); }, "key_proportions", "");  // before any sequence runs
  Tensor<float, 4> joint({1, 9, 2, 4});
  expect_error([&] {
    forward_packed(leap, exec::cpu, std::span<const index_t>(cu),
                   std::make_tuple(q.cview(), k.cview(), v.cview(),
                                   SequenceProportions<float>{TensorView<const float, 3>(joint.data(), {1, 9, 2}), half.cview()}),
                   joint.view(), std::span<LeaPformer<Causal>::State<float>* const>(leap_states));
  }, "out", "inputs[3].queries");
  CHECK(p.save() == p_bytes);
  CHECK(r.save() == r_bytes);
}

}  // namespace test_packed_prefill
