// Decode for every causal member of the linear-attention family: prefill
// (forward with a state) of a random prefix, then one step per token, equals the
// oracle; positions continue across calls (RoPE up to 10^7 in fp32, cosFormer's
// P = (p + 1) / M from a state's first position); chunked prefill equals one
// forward; save/restore continues bit-exactly; the state size does not depend
// on the context. Every check runs on exec::reference and on exec::cpu; the cpu
// kernel's split of time into segments (fewer heads than threads) and its
// allocation-free step have their own tests.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <new>

#include "allocation_counter.hpp"
#include "linear_support.hpp"

#if defined(LATTE_WITH_OPENMP)
#include <omp.h>
#endif

namespace test_linear_decode {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;

const int kCases = case_count(60);
constexpr double kBudget = 1e6;

template <class T>
Tensor<T, 2> proportion_step(const Tensor<T, 3>& p, index_t t) {
  Tensor<T, 2> row({p.extent(0), p.extent(2)});
  for (index_t b = 0; b < p.extent(0); ++b)
    for (index_t h = 0; h < p.extent(2); ++h) row(b, h) = p(b, t, h);
  return row;
}

template <class T>
Tensor<T, 3> proportion_slice(const Tensor<T, 3>& p, index_t first, index_t count) {
  Tensor<T, 3> part({p.extent(0), count, p.extent(2)});
  for (index_t b = 0; b < p.extent(0); ++b)
    for (index_t t = 0; t < count; ++t)
      for (index_t h = 0; h < p.extent(2); ++h) part(b, t, h) = p(b, first + t, h);
  return part;
}

/// Given proportions P_q, P_k [B, T, H], or none.
template <class T>
struct GivenProportions {
  Tensor<T, 3> queries, keys;
  [[nodiscard]] bool empty() const { return queries.size() == 0 && keys.size() == 0; }
};

/// forward(e, ..., state) over the first `prefill` tokens, then step(e, ...) per token.
template <class A, class T, class E>
Tensor<T, 4> prefill_then_step(E e, const A& attention, typename A::template State<T>& state,
                               const Tensor<T, 4>& q, const Tensor<T, 4>& k,
                               const Tensor<T, 4>& v, index_t prefill,
                               const GivenProportions<T>& given = {}) {
  const index_t B = v.extent(0), Tn = q.extent(1), H = v.extent(2), Dv = v.extent(3);
  Tensor<T, 4> out({B, Tn, H, Dv});
  Tensor<T, 4> head({B, prefill, H, Dv});
  if constexpr (A::learned_proportions) {
    if (!given.empty()) {
      const auto pq = proportion_slice(given.queries, 0, prefill);
      const auto pk = proportion_slice(given.keys, 0, prefill);
      attention.forward(e, time_slice(q, 0, prefill), time_slice(k, 0, prefill),
                        time_slice(v, 0, prefill), SequenceProportions<T>{pq, pk}, head.view(),
                        state);
    }
  }
  if (given.empty())
    attention.forward(e, time_slice(q, 0, prefill), time_slice(k, 0, prefill),
                      time_slice(v, 0, prefill), head.view(), state);
  for (index_t t = 0; t < prefill; ++t) set_time_step(out, t, time_step(head, t));
  Tensor<T, 3> row({B, H, Dv});
  for (index_t t = prefill; t < Tn; ++t) {
    if constexpr (A::learned_proportions) {
      if (!given.empty()) {
        const auto pq = proportion_step(given.queries, t), pk = proportion_step(given.keys, t);
        attention.step(e, state, time_step(q, t), time_step(k, t), time_step(v, t),
                       StepProportions<T>{pq, pk}, row.view());
      }
    }
    if (given.empty())
      attention.step(e, state, time_step(q, t), time_step(k, t), time_step(v, t), row.view());
    set_time_step(out, t, row);
  }
  return out;
}

/// The whole-sequence forward without a state (positions from 0).
template <class A, class T, class E>
Tensor<T, 4> whole_forward(E e, const A& attention, const Tensor<T, 4>& q, const Tensor<T, 4>& k,
                           const Tensor<T, 4>& v, const GivenProportions<T>& given) {
  Tensor<T, 4> out(v.extents());
  if constexpr (A::learned_proportions) {
    if (!given.empty()) {
      attention.forward(e, q, k, v, SequenceProportions<T>{given.queries, given.keys}, out.view());
      return out;
    }
  }
  attention.forward(e, q, k, v, out.view());
  return out;
}

/// One decode case: the attention, its inputs, the first position and the oracle spec.
template <class A, class T>
struct DecodeCase {
  A attention;
  Tensor<T, 4> q, k, v;
  std::int64_t first_position = 0;
  GivenProportions<T> given;
  LinearOracleSpec spec;
};

/// Runs kCases cases built by make(rng, c): decode (prefill + steps from the
/// case's first position) against the oracle, and the whole forward (positions
/// from 0) against the same oracle where it does not depend on the first
/// position (everything but cosFormer with a first position > 0).
template <class A, class T, class Make>
void decode_cases(std::uint64_t seed, Make&& make, const char* variant = "") {
  Rng rng(test_seed(seed));
  double worst[2] = {0, 0};
  for (int c = 0; c < kCases; ++c) {
    DecodeCase<A, T> dc = make(rng, c);
    const index_t Tn = dc.q.extent(1), B = dc.q.extent(0);
    const auto oracle = linear_oracle(dc.spec, dc.q, dc.k, dc.v);
    const index_t prefill = std::uniform_int_distribution<index_t>(0, Tn)(rng);
    auto check_backend = [&](auto e, double& worst_error) {
      auto state = dc.attention.template make_state<T>(B, dc.first_position);
      const auto decoded =
          prefill_then_step(e, dc.attention, state, dc.q, dc.k, dc.v, prefill, dc.given);
      CHECK(state.position() == dc.first_position + Tn);
      double error = relative_error(decoded, oracle);
      // Positions from 0 give the same oracle unless the proportions depend on them.
      if (dc.first_position == 0 || !A::position_proportions)
        error = std::max(error, relative_error(whole_forward(e, dc.attention, dc.q, dc.k, dc.v,
                                                             dc.given),
                                               oracle));
      CHECK_MESSAGE(error <= Tolerance<T>::relative,
                    decltype(e)::name << " case " << c << " T=" << Tn << " prefill=" << prefill
                                      << " first position " << dc.first_position
                                      << " error=" << error);
      worst_error = std::max(worst_error, error);
    };
    check_backend(exec::reference, worst[0]);
    check_backend(exec::cpu, worst[1]);
  }
  std::printf("[decode] %-58s %-22s %s cases=%d max_rel_error reference=%.3e cpu=%.3e "
              "(tol %.0e)\n",
              type_label<A>().c_str(), variant, dtype_name<T>(), kCases, worst[0], worst[1],
              Tolerance<T>::relative);
}

template <class A, class T>
auto base_inputs(Rng& rng, const Shape& s) {
  using Map = typename A::feature_map;
  const index_t Dk = s.latents, Dv = s.value_dim;
  return std::tuple{feature_input<Map, T>(rng, {s.batch, s.time, s.heads, Dk}),
                    feature_input<Map, T>(rng, {s.batch, s.time, s.heads, Dk}),
                    value_input<T>(rng, {s.batch, s.time, s.heads, Dv})};
}

template <class Map, class T>
void feature_map_decode(std::uint64_t seed) {
  using A = LinearAttention<Causal, Map>;
  decode_cases<A, T>(seed, [](Rng& rng, int) {
    const Shape s = random_shape(rng, kBudget);
    auto [q, k, v] = base_inputs<A, T>(rng, s);
    const Normaliser normaliser = random_normaliser(rng, NoReweight::default_normaliser());
    LinearOracleSpec spec{.causal = true, .feature = oracle_feature_map<Map>()};
    set_oracle_normaliser(spec, normaliser);
    const std::int64_t first = std::uniform_int_distribution<std::int64_t>(0, 1000)(rng);
    return DecodeCase<A, T>{A({s.heads, s.latents, s.value_dim}, {.normaliser = normaliser}),
                            std::move(q), std::move(k), std::move(v), first, {}, spec};
  });
}

/// cosFormer decode from a first position p0 with M >= p0 + T (M = p0 + T exactly
/// in a third of the cases, so the last token has P = 1).
template <class T>
void cosformer_decode(std::uint64_t seed) {
  using A = CosFormer<Causal>;
  decode_cases<A, T>(seed, [](Rng& rng, int c) {
    const Shape s = random_shape(rng, kBudget);
    auto [q, k, v] = base_inputs<A, T>(rng, s);
    const std::int64_t first = c % 2 ? std::uniform_int_distribution<std::int64_t>(1, 500)(rng) : 0;
    const index_t length = first + s.time + (c % 3 ? std::uniform_int_distribution<index_t>(1, 300)(rng) : 0);
    typename A::Options options;
    options.reweight.length = length;
    options.normaliser = random_normaliser(rng, CosFormerReweight::default_normaliser());
    LinearOracleSpec spec{
        .causal = true,
        .feature = oracle_relu,
        .query_proportions = oracle_position_proportions(s.batch, s.time, s.heads, length, first),
        .key_proportions = oracle_position_proportions(s.batch, s.time, s.heads, length, first)};
    set_oracle_normaliser(spec, options.normaliser);
    return DecodeCase<A, T>{A({s.heads, s.latents, s.value_dim}, options), std::move(q),
                            std::move(k), std::move(v), first, {}, spec};
  });
}

/// LeaPformer decode with LeaP modules, or with proportions given per call.
template <class T>
void leap_decode(std::uint64_t seed, bool given) {
  using A = LeaPformer<Causal>;
  decode_cases<A, T>(
      seed,
      [given](Rng& rng, int) {
        const Shape s = random_shape(rng, kBudget);
        auto [q, k, v] = base_inputs<A, T>(rng, s);
        typename A::Options options;
        options.reweight.leap_factor = pick(rng, divisors(s.latents));
        options.reweight.query_module = random_leap_module(rng, s.latents, options.reweight.leap_factor);
        options.reweight.key_module = random_leap_module(rng, s.latents, options.reweight.leap_factor);
        LinearOracleSpec spec{.causal = true, .feature = oracle_relu};
        GivenProportions<T> proportions;
        if (given) {
          proportions.queries = uniform_tensor<T, 3>(rng, {s.batch, s.time, s.heads}, 0, 1);
          proportions.keys = uniform_tensor<T, 3>(rng, {s.batch, s.time, s.heads}, 0, 1);
          spec.query_proportions = oracle_given_proportions(proportions.queries);
          spec.key_proportions = oracle_given_proportions(proportions.keys);
        } else {
          spec.query_proportions = oracle_leap_proportions(q, *options.reweight.query_module, oracle_relu);
          spec.key_proportions = oracle_leap_proportions(k, *options.reweight.key_module, oracle_relu);
        }
        set_oracle_normaliser(spec, options.normaliser);
        const std::int64_t first = std::uniform_int_distribution<std::int64_t>(0, 1000)(rng);
        return DecodeCase<A, T>{A({s.heads, s.latents, s.value_dim}, options), std::move(q),
                                std::move(k), std::move(v), first, std::move(proportions), spec};
      },
      given ? "(given proportions)" : "(LeaP modules)");
}

/// RoPE decode from a first position: up to 10^7 in fp32 (angles are formed in
/// double, so fp64 is tested up to 10^3 where their rounding stays below its
/// tolerance); the oracle depends on relative distances only.
template <class T>
void rope_decode(std::uint64_t seed, RopeDenominator denominator) {
  using A = LinearAttention<Causal, EluPlusOne, NoReweight, RoPE>;
  decode_cases<A, T>(
      seed,
      [denominator](Rng& rng, int c) {
        const Shape s = random_shape(rng, kBudget / 2);
        auto [q, k, v] = base_inputs<A, T>(rng, s);
        typename A::Options options;
        options.rope_denominator = denominator;
        if (denominator == RopeDenominator::rotated)
          options.normaliser = well_conditioned_rotated_clamp(q, k, true, oracle_elu_plus_one);
        std::int64_t first = std::uniform_int_distribution<std::int64_t>(0, 1000)(rng);
        if (std::is_same_v<T, float> && c % 2) first = 10'000'000 + first;
        LinearOracleSpec spec{.causal = true,
                              .feature = oracle_elu_plus_one,
                              .angles = oracle_rope_angles({}, s.heads, s.latents),
                              .rotated_denominator = denominator == RopeDenominator::rotated};
        set_oracle_normaliser(spec, options.normaliser);
        return DecodeCase<A, T>{A({s.heads, s.latents, s.value_dim}, options), std::move(q),
                                std::move(k), std::move(v), first, {}, spec};
      },
      denominator == RopeDenominator::rotated ? "(rotated denominator)" : "(unrotated)");
}

}  // namespace

TEST_CASE("LinearAttention<Causal, Relu | EluPlusOne | Identity>: prefill + steps == oracle") {
  feature_map_decode<Relu, float>(701);
  feature_map_decode<Relu, double>(702);
  feature_map_decode<EluPlusOne, float>(703);
  feature_map_decode<EluPlusOne, double>(704);
  feature_map_decode<Identity, float>(705);
  feature_map_decode<Identity, double>(706);
}
TEST_CASE("CosFormer<Causal>: prefill + steps == oracle, P = (p + 1) / M from the first position") {
  cosformer_decode<float>(711);
  cosformer_decode<double>(712);
}
TEST_CASE("LeaPformer<Causal>: prefill + steps == oracle (modules, given proportions)") {
  leap_decode<float>(721, false);
  leap_decode<double>(722, false);
  leap_decode<float>(723, true);
  leap_decode<double>(724, true);
}
TEST_CASE("RoPE linear attention: positions continue across forward and step") {
  rope_decode<float>(731, RopeDenominator::unrotated);
  rope_decode<double>(732, RopeDenominator::unrotated);
  rope_decode<float>(733, RopeDenominator::rotated);
  rope_decode<double>(734, RopeDenominator::rotated);
}

TEST_CASE_TEMPLATE("chunked prefill equals one forward (cosFormer + RoPE, LeaP)", E,
                   exec::reference_t, exec::cpu_t) {
  Rng rng(741);
  const index_t B = 2, Tn = 97, H = 3, Dk = 8, Dv = 6;
  const auto q = random_tensor<double, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto k = random_tensor<double, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto v = uniform_tensor<double, 4>(rng, {B, Tn, H, Dv}, -1, 1);
  auto chunked = [&](const auto& attention, auto state) {
    Tensor<double, 4> out({B, Tn, H, Dv});
    index_t first = 0;
    for (index_t chunk : {0, 1, 13, 40, 0, 43}) {
      Tensor<double, 4> part({B, chunk, H, Dv});
      attention.forward(E{}, time_slice(q, first, chunk), time_slice(k, first, chunk),
                        time_slice(v, first, chunk), part.view(), state);
      for (index_t t = 0; t < chunk; ++t) set_time_step(out, first + t, time_step(part, t));
      first += chunk;
    }
    REQUIRE(first == Tn);
    CHECK(state.position() == Tn);
    return out;
  };
  {
    using A = LinearAttention<Causal, Relu, CosFormerReweight, RoPE>;
    typename A::Options options;
    options.reweight.length = Tn;
    const A attention({H, Dk, Dv}, options);
    Tensor<double, 4> whole({B, Tn, H, Dv});
    attention.forward(E{}, q, k, v, whole.view());
    const auto out = chunked(attention, attention.make_state<double>(B));
    const LinearOracleSpec spec{.causal = true,
                                .feature = oracle_relu,
                                .query_proportions = oracle_position_proportions(B, Tn, H, Tn),
                                .key_proportions = oracle_position_proportions(B, Tn, H, Tn),
                                .angles = oracle_rope_angles({}, H, Dk),
                                .clamp = true};
    CHECK(relative_error(out, linear_oracle(spec, q, k, v)) <= Tolerance<double>::relative);
    CHECK(relative_error(whole, linear_oracle(spec, q, k, v)) <= Tolerance<double>::relative);
  }
  {
    typename LeaPformer<Causal>::Options options;
    options.reweight.query_module = random_leap_module(rng, Dk, 4);
    options.reweight.key_module = random_leap_module(rng, Dk, 4);
    const LeaPformer<Causal> attention({H, Dk, Dv}, options);
    const auto out = chunked(attention, attention.make_state<double>(B));
    LinearOracleSpec spec{.causal = true, .feature = oracle_relu, .clamp = true, .value = 0.1L};
    spec.query_proportions = oracle_leap_proportions(q, *options.reweight.query_module, oracle_relu);
    spec.key_proportions = oracle_leap_proportions(k, *options.reweight.key_module, oracle_relu);
    CHECK(relative_error(out, linear_oracle(spec, q, k, v)) <= Tolerance<double>::relative);
  }
}

/// Runs [0, split) into `state`, saves, restores, and checks that both states
/// continue bit-identically over [split, T).
template <class E, class A, class T>
void check_save_restore(const A& attention, typename A::template State<T> state,
                        const Tensor<T, 4>& q, const Tensor<T, 4>& k, const Tensor<T, 4>& v,
                        index_t split) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = v.extent(2), Dv = v.extent(3);
  Tensor<T, 4> head({B, split, H, Dv});
  attention.forward(E{}, time_slice(q, 0, split), time_slice(k, 0, split),
                    time_slice(v, 0, split), head.view(), state);
  const std::vector<std::byte> bytes = state.save();
  auto restored = attention.template load_state<T>(bytes);
  CHECK(restored.position() == state.position());
  CHECK(restored.save() == bytes);
  Tensor<T, 4> rest_original({B, Tn - split, H, Dv}), rest_restored({B, Tn - split, H, Dv});
  const auto qs = time_slice(q, split, Tn - split), ks = time_slice(k, split, Tn - split);
  const auto vs = time_slice(v, split, Tn - split);
  attention.forward(E{}, qs, ks, vs, rest_original.view(), state);
  attention.forward(E{}, qs, ks, vs, rest_restored.view(), restored);
  CHECK(bit_equal(rest_original, rest_restored));
  CHECK(state.save() == restored.save());
  // Stepping on from both also agrees bit for bit.
  Tensor<T, 3> a({B, H, Dv}), b({B, H, Dv});
  attention.step(E{}, state, time_step(q, 0), time_step(k, 0), time_step(v, 0), a.view());
  attention.step(E{}, restored, time_step(q, 0), time_step(k, 0), time_step(v, 0), b.view());
  CHECK(std::equal(a.data(), a.data() + a.size(), b.data()));
}

TEST_CASE_TEMPLATE("save/restore continues bit-exactly (every causal configuration)", E,
                   exec::reference_t, exec::cpu_t) {
  Rng rng(751);
  const index_t B = 2, Tn = 40, H = 3, Dk = 8, Dv = 5;
  const auto q = random_tensor<float, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto k = random_tensor<float, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto v = uniform_tensor<float, 4>(rng, {B, Tn, H, Dv}, -1, 1);
  const LinearAttention<Causal, Relu> relu({H, Dk, Dv});
  check_save_restore<E>(relu, relu.make_state<float>(B), q, k, v, 17);
  const LinearAttention<Causal, EluPlusOne, NoReweight, RoPE> rope(
      {H, Dk, Dv}, {.rope_denominator = RopeDenominator::rotated});
  check_save_restore<E>(rope, rope.make_state<float>(B, 123456), q, k, v, 1);
  const CosFormer<Causal> cosformer({H, Dk, Dv}, {.reweight = {.length = 1000}});
  check_save_restore<E>(cosformer, cosformer.make_state<float>(B, 500), q, k, v, 29);
  typename LeaPformer<Causal>::Options options;
  options.reweight.query_module = random_leap_module(rng, Dk, 2);
  options.reweight.key_module = random_leap_module(rng, Dk, 2);
  options.reweight.leap_factor = 2;
  const LeaPformer<Causal> leap({H, Dk, Dv}, options);
  check_save_restore<E>(leap, leap.make_state<float>(B), q, k, v, 39);
}

TEST_CASE_TEMPLATE("the state size does not depend on the context length", E, exec::reference_t,
                   exec::cpu_t) {
  const CosFormer<Causal> attention({4, 16, 8}, {.reweight = {.length = 5000}});
  auto state = attention.make_state<float>(1);
  const std::size_t bytes_before = state.bytes();
  // H * E * (Dv + 1), twice: S and z with their low parts (compensated sums)
  CHECK(bytes_before == 2 * std::size_t{4} * (2 * 16) * (8 + 1) * sizeof(float));
  Rng rng(752);
  for (index_t n : {10, 1000}) {
    const auto q = random_tensor<float, 4>(rng, {1, n, 4, 16}, 1.0);
    const auto v = uniform_tensor<float, 4>(rng, {1, n, 4, 8}, -1, 1);
    Tensor<float, 4> out({1, n, 4, 8});
    attention.forward(E{}, q, q, v, out.view(), state);
    CHECK(state.bytes() == bytes_before);
    CHECK(state.save().size() == attention.make_state<float>(1).save().size());
  }
}

/// Runs `body` with OpenMP's thread count set to `threads` (a no-op without OpenMP).
template <class Body>
void with_threads(int threads, Body&& body) {
#if defined(LATTE_WITH_OPENMP)
  const int before = omp_get_max_threads();
  omp_set_num_threads(threads);
  body();
  omp_set_num_threads(before);
#else
  (void)threads;
  body();
#endif
}

// With fewer heads than threads the cpu kernels split time (causal: segment
// sums, a prefix of states, then outputs per segment; bidirectional: partial
// sums of S, z over source ranges). B = H = 1 and T = 1500 take that path for
// 2, 3 and 4 threads; the causal run continues a state (first position 300),
// so every segment starts from a non-zero carry at a non-zero position.
TEST_CASE("exec::cpu with fewer heads than threads (time split into segments) == oracle") {
  Rng rng(761);
  const index_t B = 1, H = 1, Tn = 1500, prefix = 300, Dk = 16, Dv = 24;
  const auto q = random_tensor<double, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto k = random_tensor<double, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto v = value_input<double>(rng, {B, Tn, H, Dv});
  // prefix tokens in one call, then the rest from the state.
  auto in_two_calls = [&](const auto& attention) {
    Tensor<double, 4> out({B, Tn, H, Dv});
    auto state = attention.template make_state<double>(B);
    Tensor<double, 4> head({B, prefix, H, Dv}), rest({B, Tn - prefix, H, Dv});
    attention.forward(exec::cpu, time_slice(q, 0, prefix), time_slice(k, 0, prefix),
                      time_slice(v, 0, prefix), head.view(), state);
    attention.forward(exec::cpu, time_slice(q, prefix, Tn - prefix),
                      time_slice(k, prefix, Tn - prefix), time_slice(v, prefix, Tn - prefix),
                      rest.view(), state);
    for (index_t t = 0; t < prefix; ++t) set_time_step(out, t, time_step(head, t));
    for (index_t t = prefix; t < Tn; ++t) set_time_step(out, t, time_step(rest, t - prefix));
    return out;
  };
  {
    using A = LinearAttention<Causal, Relu, CosFormerReweight, RoPE>;
    const A attention({H, Dk, Dv}, {.reweight = {.length = Tn}});
    LinearOracleSpec spec{.causal = true,
                          .feature = oracle_relu,
                          .query_proportions = oracle_position_proportions(B, Tn, H, Tn),
                          .key_proportions = oracle_position_proportions(B, Tn, H, Tn),
                          .angles = oracle_rope_angles({}, H, Dk)};
    set_oracle_normaliser(spec, attention.options().normaliser);
    const auto oracle = linear_oracle(spec, q, k, v);
    for (int threads : {2, 3, 4})
      with_threads(threads, [&] {
        const double error = relative_error(in_two_calls(attention), oracle);
        CHECK_MESSAGE(error <= Tolerance<double>::relative,
                      "cosFormer + RoPE, " << threads << " threads: error=" << error);
      });
  }
  {
    typename LeaPformer<Causal>::Options options;
    options.reweight.query_module = random_leap_module(rng, Dk, 4);
    options.reweight.key_module = random_leap_module(rng, Dk, 4);
    const LeaPformer<Causal> attention({H, Dk, Dv}, options);
    LinearOracleSpec spec{.causal = true, .feature = oracle_relu};
    spec.query_proportions = oracle_leap_proportions(q, *options.reweight.query_module, oracle_relu);
    spec.key_proportions = oracle_leap_proportions(k, *options.reweight.key_module, oracle_relu);
    set_oracle_normaliser(spec, options.normaliser);
    const auto oracle = linear_oracle(spec, q, k, v);
    for (int threads : {2, 3})
      with_threads(threads, [&] {
        const double error = relative_error(in_two_calls(attention), oracle);
        CHECK_MESSAGE(error <= Tolerance<double>::relative,
                      "LeaP, " << threads << " threads: error=" << error);
      });
  }
  {
    const LinearAttention<Bidirectional, EluPlusOne, NoReweight, RoPE> attention({H, Dk, Dv});
    LinearOracleSpec spec{.causal = false,
                          .feature = oracle_elu_plus_one,
                          .angles = oracle_rope_angles({}, H, Dk)};
    set_oracle_normaliser(spec, attention.options().normaliser);
    const auto oracle = linear_oracle(spec, q, k, v);
    const index_t S = 700;  // cross-attention over the first S tokens
    const auto ks = time_slice(k, 0, S), vs = time_slice(v, 0, S);
    const auto cross_oracle = linear_oracle(spec, q, ks, vs);
    for (int threads : {2, 3})
      with_threads(threads, [&] {
        Tensor<double, 4> out({B, Tn, H, Dv}), cross({B, Tn, H, Dv});
        attention.forward(exec::cpu, q, k, v, out.view());
        attention.cross_forward(exec::cpu, q, ks, vs, cross.view());
        const double error = relative_error(out, oracle);
        const double cross_error = relative_error(cross, cross_oracle);
        CHECK_MESSAGE(std::max(error, cross_error) <= Tolerance<double>::relative,
                      "bidirectional RoPE, " << threads << " threads: error=" << error
                                             << " cross error=" << cross_error);
      });
  }
}

/// Allocations made by `steps` calls of step(e, ...) after one warm-up call.
template <class A, class E, class... Proportions>
long allocations_in_steps(E e, const A& attention, typename A::template State<float>& state,
                          const Tensor<float, 3>& q, const Tensor<float, 3>& k,
                          const Tensor<float, 3>& v, Tensor<float, 3>& out, int steps,
                          const Proportions&... proportions) {
  attention.step(e, state, q, k, v, proportions..., out.view());
  const long before = allocations.load();
  for (int i = 0; i < steps; ++i) attention.step(e, state, q, k, v, proportions..., out.view());
  return allocations.load() - before;
}

TEST_CASE_TEMPLATE("step allocates nothing (every causal configuration)", E, exec::reference_t,
                   exec::cpu_t) {
  Rng rng(771);
  const index_t B = 2, H = 3, Dk = 8, Dv = 5;
  const auto q = random_tensor<float, 3>(rng, {B, H, Dk}, 1.0);
  const auto k = random_tensor<float, 3>(rng, {B, H, Dk}, 1.0);
  const auto v = random_tensor<float, 3>(rng, {B, H, Dv}, 1.0);
  Tensor<float, 3> out({B, H, Dv});
  const LinearAttention<Causal, EluPlusOne> plain({H, Dk, Dv});
  auto plain_state = plain.make_state<float>(B);
  CHECK(allocations_in_steps(E{}, plain, plain_state, q, k, v, out, 50) == 0);
  const LinearAttention<Causal, EluPlusOne, NoReweight, RoPE> rope(
      {H, Dk, Dv}, {.rope_denominator = RopeDenominator::unrotated});
  auto rope_state = rope.make_state<float>(B, 1000);
  CHECK(allocations_in_steps(E{}, rope, rope_state, q, k, v, out, 50) == 0);
  const CosFormer<Causal> cosformer({H, Dk, Dv}, {.reweight = {.length = 100}});
  auto cosformer_state = cosformer.make_state<float>(B);
  CHECK(allocations_in_steps(E{}, cosformer, cosformer_state, q, k, v, out, 50) == 0);
  typename LeaPformer<Causal>::Options options;
  options.reweight.query_module = random_leap_module(rng, Dk, 2);
  options.reweight.key_module = random_leap_module(rng, Dk, 2);
  options.reweight.leap_factor = 2;
  const LeaPformer<Causal> leap({H, Dk, Dv}, options);
  auto leap_state = leap.make_state<float>(B);
  CHECK(allocations_in_steps(E{}, leap, leap_state, q, k, v, out, 50) == 0);
  const auto p = uniform_tensor<float, 2>(rng, {B, H}, 0, 1);
  CHECK(allocations_in_steps(E{}, leap, leap_state, q, k, v, out, 50,
                             StepProportions<float>{p, p}) == 0);
}

}  // namespace test_linear_decode
