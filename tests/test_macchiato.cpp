// Latte Macchiato (reference backend) against the explicit T x T oracle
// (tests/oracles/macchiato_oracle.hpp): >= 200 random shapes per direction and
// dtype (positional set-ups cycling through none, RoPE window, VAPOR + RoPE,
// VAPOR on the whole mixture), implied rows summing to 1, the two limits
// (p(0|t) = 0 is Latte, p(0|t) = 1 is sliding-window softmax), decode
// equivalence and bit-exact save/restore, adversarial logits, and every
// malformed call (each bad-input case first makes the valid call, then changes
// exactly one thing).
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numbers>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "latte/mechanisms/latte_macchiato.hpp"
#include "oracles/latte_oracle.hpp"
#include "oracles/macchiato_oracle.hpp"
#include "oracles/softmax_oracle.hpp"
#include "expect_error.hpp"
#include "support.hpp"

namespace test_macchiato {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;

constexpr int kOracleCases = 200;  // per direction and dtype
constexpr int kDecodeCases = 60;   // per dtype
constexpr double kOracleBudget = 1.8e7;
constexpr double kDecodeBudget = 6e6;

// ------------------------------------------------------------ random cases --

struct MacchiatoShape {
  index_t batch, time, heads, latents, key_dim, value_dim, window;
};

/// w in {1, 2, uniform in [1, T], T - 1, T + 3, 128}: windows inside, at and past the sequence.
index_t random_window(Rng& rng, index_t Tn) {
  switch (std::uniform_int_distribution<int>(0, 5)(rng)) {
    case 0: return 1;
    case 1: return 2;
    case 2: return std::uniform_int_distribution<index_t>(1, std::max<index_t>(1, Tn))(rng);
    case 3: return std::max<index_t>(1, Tn - 1);
    case 4: return Tn + 3;
    default: return 128;
  }
}

MacchiatoShape random_macchiato_shape(Rng& rng, double budget) {
  const Shape s = random_shape(rng, budget);
  const index_t key_dim = pick(rng, std::array<index_t, 4>{1, 4, 5, 64});
  return {s.batch, s.time, s.heads, s.latents, key_dim, s.value_dim, random_window(rng, s.time)};
}

template <class T>
struct Inputs {
  Tensor<T, 4> q, k, wq, wk, v;  // [.., L + 1], [.., L], [.., Dk], [.., Dk], [.., Dv]
};

template <class T>
Inputs<T> random_inputs(Rng& rng, const MacchiatoShape& s, double logit_scale,
                        double score_scale) {
  const index_t B = s.batch, Tn = s.time, H = s.heads;
  return {random_tensor<T, 4>(rng, {B, Tn, H, s.latents + 1}, logit_scale),
          random_tensor<T, 4>(rng, {B, Tn, H, s.latents}, logit_scale),
          random_tensor<T, 4>(rng, {B, Tn, H, s.key_dim}, score_scale),
          random_tensor<T, 4>(rng, {B, Tn, H, s.key_dim}, score_scale),
          uniform_tensor<T, 4>(rng, {B, Tn, H, s.value_dim}, -1, 1)};
}

/// The positional set-ups a case runs under.
enum Config { kPlain = 0, kRope = 1, kVaporRope = 2, kVaporAllStates = 3 };
constexpr const char* kConfigNames[] = {"plain", "rope", "vapor+rope", "vapor[all_states]"};

/// Calls fn.template operator()<LatentPos, WindowPos>() for `config`.
template <class Fn>
void with_config(Config config, Fn&& fn) {
  switch (config) {
    case kPlain: fn.template operator()<NoPositional, NoPositional>(); break;
    case kRope: fn.template operator()<NoPositional, RoPE>(); break;
    case kVaporRope: fn.template operator()<VAPOR, RoPE>(); break;
    case kVaporAllStates: fn.template operator()<VAPOR, NoPositional>(); break;
  }
}

/// Angles as long double for the oracle; the default schedule is recomputed
/// here from its definition base^(-2i/D).
std::vector<long double> oracle_angles(const Tensor<double, 2>& given, index_t H, index_t D) {
  const index_t pairs = D / 2;
  std::vector<long double> angles(static_cast<std::size_t>(H * pairs));
  for (index_t h = 0; h < H; ++h)
    for (index_t i = 0; i < pairs; ++i)
      angles[h * pairs + i] = given.size() ? (long double)given(h, i)
                                           : std::pow(10000.0L, -2.0L * i / (long double)D);
  return angles;
}

/// Everything a case passes to the attention and to the oracle.
struct Setup {
  MacchiatoOptions options;
  VAPOR::Params vapor;
  RoPE::Params rope;
  MacchiatoSpec spec;
  std::vector<long double> value_angles, key_angles;
};

Setup random_setup(Rng& rng, Config config, const MacchiatoShape& s, bool causal) {
  Setup setup;
  const bool vapor = config == kVaporRope || config == kVaporAllStates;
  const bool rope = config == kRope || config == kVaporRope;
  if (vapor) {
    if (rng() % 2) setup.vapor.angles = uniform_tensor<double, 2>(
                       rng, {s.heads, s.value_dim / 2}, 0.0, std::numbers::pi);
    setup.value_angles = oracle_angles(setup.vapor.angles, s.heads, s.value_dim);
  }
  if (rope) {
    if (rng() % 2) setup.rope.angles = uniform_tensor<double, 2>(
                       rng, {s.heads, s.key_dim / 2}, 0.0, std::numbers::pi);
    setup.key_angles = oracle_angles(setup.rope.angles, s.heads, s.key_dim);
  }
  if (config == kVaporAllStates) setup.options.vapor_scope = VaporScope::all_states;
  long double scale = 1.0L / std::sqrt((long double)s.key_dim);
  if (rng() % 4 == 0) {
    setup.options.scale = 0.75;
    scale = 0.75L;
  }
  setup.spec = {.causal = causal, .window = s.window, .scale = scale,
                .vapor_on_window = config == kVaporAllStates};
  return setup;
}

template <class Dir, class LatentPos, class WindowPos>
LatteMacchiato<Dir, RunningMax, LatentPos, WindowPos> make_attention(const MacchiatoShape& s,
                                                                      const Setup& setup) {
  typename LatentPos::Params latent{};
  typename WindowPos::Params window{};
  if constexpr (LatentPos::rotates_values) latent = setup.vapor;
  if constexpr (WindowPos::rotates_queries_keys) window = setup.rope;
  return LatteMacchiato<Dir, RunningMax, LatentPos, WindowPos>(
      {.heads = s.heads, .latents = s.latents, .key_dim = s.key_dim, .value_dim = s.value_dim,
       .window = s.window},
      setup.options, latent, window);
}

template <class T>
TensorLD<4> oracle_of(const Setup& setup, const Inputs<T>& in) {
  return macchiato_oracle(setup.spec, in.q, in.k, in.wq, in.wk, in.v, setup.value_angles,
                          setup.key_angles);
}

std::string describe(const MacchiatoShape& s) {
  return "B=" + std::to_string(s.batch) + " T=" + std::to_string(s.time) +
         " H=" + std::to_string(s.heads) + " L=" + std::to_string(s.latents) +
         " Dk=" + std::to_string(s.key_dim) + " Dv=" + std::to_string(s.value_dim) +
         " w=" + std::to_string(s.window);
}

// ------------------------------------------------------------------ oracle --

template <class T, class Dir>
void oracle_cases(std::uint64_t seed) {
  Rng rng(seed);
  std::array<double, 4> worst{};
  double overall = 0;
  long long elements = 0;
  int long_cases = 0, window_past_end = 0;
  const int cases_run = case_count(kOracleCases);
  for (int c = 0; c < cases_run; ++c) {
    const auto config = static_cast<Config>(c % 4);
    const MacchiatoShape s = random_macchiato_shape(rng, kOracleBudget);
    const double logit_scale = pick(rng, std::array{0.5, 2.0, 6.0});
    // Window scores of std up to ~2 (Dk = 64): fp32's own error in a score grows
    // with eps * sum_i |q_i k_i| * scale (the dot product's conditioning, not the
    // kernel's); large score spreads are tested below with exactly representable scores.
    const double score_scale = pick(rng, std::array{0.5, 1.0, 1.5});
    const Inputs<T> in = random_inputs<T>(rng, s, logit_scale, score_scale);
    const Setup setup = random_setup(rng, config, s, Dir::is_causal);
    Tensor<T, 4> out(in.v.extents()), out_cpu(in.v.extents());
    with_config(config, [&]<class LatentPos, class WindowPos>() {
      const auto attention = make_attention<Dir, LatentPos, WindowPos>(s, setup);
      attention.forward(exec::reference, in.q, in.k, in.wq, in.wk, in.v, out.view());
      attention.forward(exec::cpu, in.q, in.k, in.wq, in.wk, in.v, out_cpu.view());
    });
    const auto oracle = oracle_of(setup, in);
    const double error = std::max(relative_error(out, oracle), relative_error(out_cpu, oracle));
    CHECK_MESSAGE(relative_error(out, oracle) <= Tolerance<T>::relative,
                  "reference " << Dir::name << " " << kConfigNames[config] << " case " << c << " "
                               << describe(s));
    CHECK_MESSAGE(relative_error(out_cpu, oracle) <= Tolerance<T>::relative,
                  "cpu " << Dir::name << " " << kConfigNames[config] << " case " << c << " "
                         << describe(s));
    worst[config] = std::max(worst[config], error);
    overall = std::max(overall, error);
    elements += out.size();
    long_cases += s.time == 1000;
    window_past_end += s.window >= s.time;
  }
  std::printf("[oracle] LatteMacchiato<%s> %s cases=%d (reference and cpu each) (T=1000: %d, w >= T: %d) elements=%lld "
              "max_rel_error=%.3e (plain %.1e, rope %.1e, vapor+rope %.1e, vapor[all_states] "
              "%.1e; tol %.0e)\n",
              Dir::name, dtype_name<T>(), cases_run, long_cases, window_past_end, elements,
              overall, worst[0], worst[1], worst[2], worst[3], Tolerance<T>::relative);
}

// ------------------------------------------------------------------ decode --

/// The first `prefill` tokens through forward(..., state), the rest through step().
template <class A, class T, class E = exec::reference_t>
Tensor<T, 4> prefill_then_step(const A& attention, typename A::template State<T>& state,
                               const Inputs<T>& in, index_t prefill, E backend = {}) {
  const index_t Tn = in.v.extent(1);
  Tensor<T, 4> out(in.v.extents());
  Tensor<T, 4> head({in.v.extent(0), prefill, in.v.extent(2), in.v.extent(3)});
  attention.forward(backend, time_slice(in.q, 0, prefill), time_slice(in.k, 0, prefill),
                    time_slice(in.wq, 0, prefill), time_slice(in.wk, 0, prefill),
                    time_slice(in.v, 0, prefill), head.view(), state);
  for (index_t t = 0; t < prefill; ++t) set_time_step(out, t, time_step(head, t));
  Tensor<T, 3> row({in.v.extent(0), in.v.extent(2), in.v.extent(3)});
  for (index_t t = prefill; t < Tn; ++t) {
    attention.step(backend, state, time_step(in.q, t), time_step(in.k, t),
                   time_step(in.wq, t), time_step(in.wk, t), time_step(in.v, t), row.view());
    set_time_step(out, t, row);
  }
  return out;
}

template <class T>
void decode_cases(std::uint64_t seed) {
  Rng rng(seed);
  std::array<double, 4> worst{};
  const int cases_run = case_count(kDecodeCases);
  for (int c = 0; c < cases_run; ++c) {
    const auto config = static_cast<Config>(c % 4);
    const MacchiatoShape s = random_macchiato_shape(rng, kDecodeBudget);
    const Inputs<T> in = random_inputs<T>(rng, s, 2.0, 1.0);
    const Setup setup = random_setup(rng, config, s, true);
    const auto oracle = oracle_of(setup, in);
    // Positions continue from `first`: RoPE and VAPOR depend on t - s only.
    // fp64 keeps first small: the double angle first * theta carries ~ulp(first * pi).
    const std::int64_t first = std::is_same_v<T, float>
                                   ? pick(rng, std::array<std::int64_t, 3>{0, 1000, 1'000'003})
                                   : pick(rng, std::array<std::int64_t, 3>{0, 7, 1000});
    const index_t prefill = std::uniform_int_distribution<index_t>(0, s.time)(rng);
    with_config(config, [&]<class LatentPos, class WindowPos>() {
      const auto attention = make_attention<Causal, LatentPos, WindowPos>(s, setup);
      Tensor<T, 4> whole(in.v.extents()), whole_cpu(in.v.extents());
      attention.forward(exec::reference, in.q, in.k, in.wq, in.wk, in.v, whole.view());
      attention.forward(exec::cpu, in.q, in.k, in.wq, in.wk, in.v, whole_cpu.view());
      auto state_cpu = attention.template make_state<T>(s.batch, first);
      const auto decoded_cpu = prefill_then_step(attention, state_cpu, in, prefill, exec::cpu);
      CHECK_MESSAGE(relative_error(whole_cpu, oracle) <= Tolerance<T>::relative,
                    "cpu " << kConfigNames[config] << " case " << c << " " << describe(s));
      CHECK_MESSAGE(relative_error(decoded_cpu, oracle) <= Tolerance<T>::relative,
                    "cpu " << kConfigNames[config] << " case " << c << " " << describe(s)
                           << " prefill=" << prefill);
      CHECK(state_cpu.window_fill() == std::min(s.time, s.window + 1));
      auto state = attention.template make_state<T>(s.batch, first);
      const auto decoded = prefill_then_step(attention, state, in, prefill);
      CHECK(state.position() == first + s.time);
      CHECK(state.window_fill() == std::min(s.time, s.window + 1));
      const double error_whole = relative_error(whole, oracle);
      const double error_decoded = relative_error(decoded, oracle);
      CHECK_MESSAGE(error_whole <= Tolerance<T>::relative,
                    kConfigNames[config] << " case " << c << " " << describe(s));
      CHECK_MESSAGE(error_decoded <= Tolerance<T>::relative,
                    kConfigNames[config] << " case " << c << " " << describe(s) << " prefill="
                                         << prefill << " first=" << first
                                         << " error=" << error_decoded);
      worst[config] = std::max({worst[config], error_whole, error_decoded});
    });
  }
  std::printf("[decode] LatteMacchiato<Causal> prefill+steps %s cases=%d max_rel_error=%.3e "
              "(plain %.1e, rope %.1e, vapor+rope %.1e, vapor[all_states] %.1e)\n",
              dtype_name<T>(), cases_run, *std::max_element(worst.begin(), worst.end()),
              worst[0], worst[1], worst[2], worst[3]);
}

}  // namespace

TEST_CASE("LatteMacchiato causal == oracle (float, double)") {
  oracle_cases<float, Causal>(501);
  oracle_cases<double, Causal>(502);
}
TEST_CASE("LatteMacchiato bidirectional == oracle (float, double)") {
  oracle_cases<float, Bidirectional>(503);
  oracle_cases<double, Bidirectional>(504);
}
namespace {

/// T = 1000 (rare among the random shapes) for every set-up, window and direction.
template <class T>
void long_sequence_cases() {
  Rng rng(507);
  double worst = 0;
  int cases = 0;
  for (index_t w : {1, 37, 999}) {
    for (int config_index = 0; config_index < 4; ++config_index) {
      const auto config = static_cast<Config>(config_index);
      const MacchiatoShape s{1, 1000, 1, 3, 5, 4, w};
      const Inputs<T> in = random_inputs<T>(rng, s, 2.0, 1.0);
      for (bool causal : {true, false}) {
        const Setup setup = random_setup(rng, config, s, causal);
        const auto oracle = oracle_of(setup, in);
        // One head: exec::cpu splits the causal window pass into time segments.
        for (const bool cpu : {false, true}) {
          Tensor<T, 4> out(in.v.extents());
          with_config(config, [&]<class LatentPos, class WindowPos>() {
            auto run = [&](const auto& attention) {
              if (cpu)
                attention.forward(exec::cpu, in.q, in.k, in.wq, in.wk, in.v, out.view());
              else
                attention.forward(exec::reference, in.q, in.k, in.wq, in.wk, in.v, out.view());
            };
            if (causal)
              run(make_attention<Causal, LatentPos, WindowPos>(s, setup));
            else
              run(make_attention<Bidirectional, LatentPos, WindowPos>(s, setup));
          });
          const double error = relative_error(out, oracle);
          CHECK_MESSAGE(error <= Tolerance<T>::relative,
                        (cpu ? "cpu " : "reference ") << kConfigNames[config]
                                                      << (causal ? " causal" : " bidirectional")
                                                      << " w=" << w);
          worst = std::max(worst, error);
          ++cases;
        }
      }
    }
  }
  std::printf("[oracle] LatteMacchiato T=1000, w in {1, 37, 999}, both directions, all set-ups, "
              "reference and cpu %s cases=%d max_rel_error=%.3e\n",
              dtype_name<T>(), cases, worst);
}

}  // namespace

TEST_CASE("LatteMacchiato: T = 1000 == oracle (float, double)") {
  long_sequence_cases<float>();
  long_sequence_cases<double>();
}
TEST_CASE("LatteMacchiato: prefill + steps == forward == oracle, positions continue") {
  decode_cases<float>(505);
  decode_cases<double>(506);
}

namespace {

// ------------------------------------------------------------ implied rows --

/// With one-hot values v_s = e_s (Dv = T), output row t is row t of the implied
/// attention matrix Local + Latent: it must match the oracle's, vanish above
/// the diagonal when causal, and sum to 1.
template <class T, class Dir, class WindowPos>
void implied_rows() {
  Rng rng(510);
  double worst_sum = 0;
  for (index_t Tn : {1, 2, 17, 61}) {
    for (index_t L : {1, 7}) {
      for (index_t w : {1, 5, 70}) {
        const MacchiatoShape s{1, Tn, 1, L, 4, Tn, w};
        Inputs<T> in = random_inputs<T>(rng, s, 3.0, 1.5);
        in.v = Tensor<T, 4>({1, Tn, 1, Tn}, T(0));
        for (index_t i = 0; i < Tn; ++i) in.v(0, i, 0, i) = 1;
        Setup setup = random_setup(rng, WindowPos::rotates_queries_keys ? kRope : kPlain, s,
                                   Dir::is_causal);
        Tensor<T, 4> rows(in.v.extents());
        make_attention<Dir, NoPositional, WindowPos>(s, setup)
            .forward(exec::reference, in.q, in.k, in.wq, in.wk, in.v, rows.view());
        const auto m = macchiato_attention_matrices(
            setup.spec, in.q, in.k, in.wq, in.wk, 0, 0,
            setup.key_angles.empty() ? nullptr : setup.key_angles.data());
        for (index_t t = 0; t < Tn; ++t) {
          double total = 0;
          for (index_t j = 0; j < Tn; ++j) {
            total += rows(0, t, 0, j);
            const double expected = double(m.local[t * Tn + j] + m.latent[t * Tn + j]);
            CHECK(std::fabs(double(rows(0, t, 0, j)) - expected) <= Tolerance<T>::relative);
            if (Dir::is_causal && j > t) CHECK(rows(0, t, 0, j) == T(0));
          }
          CHECK(std::fabs(total - 1.0) <= Tolerance<T>::relative);
          worst_sum = std::max(worst_sum, std::fabs(total - 1.0));
        }
      }
    }
  }
  std::printf("[rows] LatteMacchiato<%s,%s> %s: rows sum to 1 within %.1e\n", Dir::name,
              WindowPos::name, dtype_name<T>(), worst_sum);
}

}  // namespace

TEST_CASE("LatteMacchiato: rows of the implied attention matrix sum to 1") {
  implied_rows<float, Causal, NoPositional>();
  implied_rows<float, Bidirectional, RoPE>();
  implied_rows<double, Causal, RoPE>();
  implied_rows<double, Bidirectional, NoPositional>();
}

// The two limits of the mixture, checked against the other mechanisms' own
// oracles: p(0|t) = 0 (q_{t,0} = -inf) is Latte over the L latents; p(0|t) = 1
// (q_{t,1..L} = -inf) is sliding-window softmax attention.
TEST_CASE("LatteMacchiato: p(0|t) = 0 is Latte, p(0|t) = 1 is sliding-window softmax") {
  constexpr double inf = std::numeric_limits<double>::infinity();
  Rng rng(511);
  for (bool causal : {true, false}) {
    const MacchiatoShape s{2, 37, 3, 5, 6, 4, 4};
    const Inputs<double> in = random_inputs<double>(rng, s, 2.0, 1.0);
    const MacchiatoDims dims{s.heads, s.latents, s.key_dim, s.value_dim, s.window};
    auto run = [&](const Tensor<double, 4>& q) {
      Tensor<double, 4> out(in.v.extents());
      if (causal)
        LatteMacchiato<Causal>(dims).forward(exec::reference, q, in.k, in.wq, in.wk, in.v,
                                             out.view());
      else
        LatteMacchiato<Bidirectional>(dims).forward(exec::reference, q, in.k, in.wq, in.wk, in.v,
                                                    out.view());
      return out;
    };
    Tensor<double, 4> no_local = in.q, only_local = in.q;
    Tensor<double, 4> latent_logits({s.batch, s.time, s.heads, s.latents});
    for (index_t b = 0; b < s.batch; ++b)
      for (index_t t = 0; t < s.time; ++t)
        for (index_t h = 0; h < s.heads; ++h) {
          no_local(b, t, h, 0) = -inf;
          for (index_t l = 1; l <= s.latents; ++l) {
            only_local(b, t, h, l) = -inf;
            latent_logits(b, t, h, l - 1) = in.q(b, t, h, l);
          }
        }
    const double latte_error =
        relative_error(run(no_local), latte_oracle(causal, latent_logits, in.k, in.v));
    const MaskSpec mask{.causal = causal, .left = s.window, .right = causal ? -1 : s.window};
    const double softmax_error = relative_error(
        run(only_local),
        softmax_oracle(mask, 1.0L / std::sqrt((long double)s.key_dim), in.wq, in.wk, in.v));
    CHECK(latte_error <= Tolerance<double>::relative);
    CHECK(softmax_error <= Tolerance<double>::relative);
    // And a query whose L + 1 logits are all -inf reads zero.
    Tensor<double, 4> none = only_local;
    for (index_t h = 0; h < s.heads; ++h) none(1, 9, h, 0) = -inf;
    const auto out = run(none);
    REQUIRE(all_finite(out));
    for (index_t h = 0; h < s.heads; ++h)
      for (index_t d = 0; d < s.value_dim; ++d) CHECK(out(1, 9, h, d) == 0.0);
  }
}

namespace {

// ------------------------------------------------------------- adversarial --

template <class T, class Dir>
Tensor<T, 4> plain_forward(const MacchiatoShape& s, const Inputs<T>& in, bool stabilized = true,
                           std::optional<double> scale = std::nullopt) {
  const MacchiatoDims dims{s.heads, s.latents, s.key_dim, s.value_dim, s.window};
  const MacchiatoOptions options{.scale = scale, .vapor_scope = VaporScope::latent_states};
  Tensor<T, 4> out(in.v.extents());
  if (stabilized)
    LatteMacchiato<Dir>(dims, options)
        .forward(exec::reference, in.q, in.k, in.wq, in.wk, in.v, out.view());
  else
    LatteMacchiato<Dir, NoStabilizer>(dims, options)
        .forward(exec::reference, in.q, in.k, in.wq, in.wk, in.v, out.view());
  return out;
}

/// Integers in [-bound, bound]: their products and sums are exact in fp32 (below 2^24).
template <class T>
Tensor<T, 4> integer_tensor(Rng& rng, const std::array<index_t, 4>& extents, index_t bound) {
  Tensor<T, 4> tensor(extents);
  std::uniform_int_distribution<index_t> uniform(-bound, bound);
  for (index_t i = 0; i < tensor.size(); ++i) tensor.data()[i] = static_cast<T>(uniform(rng));
  return tensor;
}

template <class T>
void adversarial_spreads() {
  Rng rng(512);
  double worst = 0;
  int cases = 0, overflow_cases = 0;
  for (double spread : {1e3, 3e3, 1e4}) {
    for (int c = 0; c < 10; ++c, ++cases) {
      const MacchiatoShape s = random_macchiato_shape(rng, 2e6);
      const double half = spread / 2;
      // Window scores q'_t . k'_s (scale 1) of magnitude up to ~spread, exact in fp32.
      const auto bound = static_cast<index_t>(std::ceil(std::sqrt(spread / double(s.key_dim))));
      Inputs<T> in{
          uniform_tensor<T, 4>(rng, {s.batch, s.time, s.heads, s.latents + 1}, -half, half),
          uniform_tensor<T, 4>(rng, {s.batch, s.time, s.heads, s.latents}, -half, half),
          integer_tensor<T>(rng, {s.batch, s.time, s.heads, s.key_dim}, bound),
          integer_tensor<T>(rng, {s.batch, s.time, s.heads, s.key_dim}, bound),
          uniform_tensor<T, 4>(rng, {s.batch, s.time, s.heads, s.value_dim}, -1, 1)};
      for (bool causal : {true, false}) {
        const auto out = causal ? plain_forward<T, Causal>(s, in, true, 1.0)
                                : plain_forward<T, Bidirectional>(s, in, true, 1.0);
        REQUIRE(all_finite(out));
        const MacchiatoSpec spec{.causal = causal, .window = s.window, .scale = 1.0L};
        const double error =
            relative_error(out, macchiato_oracle(spec, in.q, in.k, in.wq, in.wk, in.v));
        CHECK_MESSAGE(error <= Tolerance<T>::relative,
                      "spread " << spread << " case " << c << " " << describe(s));
        worst = std::max(worst, error);
      }
      // The NoStabilizer ablation overflows once a key logit exceeds log(max of T)
      // (when the latent part carries any weight at all).
      const T k_max = *std::max_element(in.k.data(), in.k.data() + in.k.size());
      if (double(k_max) > std::log(double(std::numeric_limits<T>::max()))) {
        for (index_t i = 0; i < in.q.size(); ++i) in.q.data()[i] = 0;  // every state weighted
        CHECK_FALSE(all_finite(plain_forward<T, Causal>(s, in, false, 1.0)));
        ++overflow_cases;
      }
    }
  }
  CHECK(overflow_cases >= 10);
  std::printf("[spread] LatteMacchiato RunningMax %s spreads 1e3..1e4 (query, key logits and "
              "window scores) cases=%d max_rel_error=%.3e; NoStabilizer non-finite in %d\n",
              dtype_name<T>(), 2 * cases, worst, overflow_cases);
}

}  // namespace

TEST_CASE("LatteMacchiato: logit and score spreads up to 1e4 stay finite and exact") {
  adversarial_spreads<float>();
  adversarial_spreads<double>();
}

TEST_CASE("LatteMacchiato: key logits [1, 10, 1000] in float32") {
  // Paper 000 App. B.2's sequence on latent 1; p(0|t) = 1/2 mixes it with the window.
  Rng rng(513);
  const MacchiatoShape s{1, 3, 1, 1, 2, 3, 1};
  Inputs<float> in = random_inputs<float>(rng, s, 1.0, 1.0);
  in.k(0, 0, 0, 0) = 1;
  in.k(0, 1, 0, 0) = 10;
  in.k(0, 2, 0, 0) = 1000;
  for (index_t t = 0; t < 3; ++t) in.q(0, t, 0, 0) = in.q(0, t, 0, 1) = 0;
  const auto out = plain_forward<float, Causal>(s, in);
  REQUIRE(all_finite(out));
  const MacchiatoSpec spec{.causal = true, .window = 1, .scale = 1.0L / std::sqrt(2.0L)};
  CHECK(relative_error(out, macchiato_oracle(spec, in.q, in.k, in.wq, in.wk, in.v)) <=
        Tolerance<float>::relative);
  CHECK_FALSE(all_finite(plain_forward<float, Causal>(s, in, false)));
}

TEST_CASE("LatteMacchiato: all-zero values give exactly zero output") {
  Rng rng(514);
  const MacchiatoShape s{2, 31, 3, 7, 5, 6, 4};
  Inputs<float> in = random_inputs<float>(rng, s, 5.0, 2.0);
  in.v.fill(0.f);
  for (const auto& out : {plain_forward<float, Causal>(s, in),
                          plain_forward<float, Bidirectional>(s, in)})
    for (index_t i = 0; i < out.size(); ++i) CHECK(out.data()[i] == 0.f);
}

// ---------------------------------------------------------- decode, state --

TEST_CASE("LatteMacchiato: chunked prefill equals one forward and the oracle") {
  Rng rng(515);
  const MacchiatoShape s{2, 97, 3, 7, 6, 5, 9};
  const Inputs<double> in = random_inputs<double>(rng, s, 3.0, 1.0);
  for (Config config : {kPlain, kVaporRope, kVaporAllStates}) {
    const Setup setup = random_setup(rng, config, s, true);
    const auto oracle = oracle_of(setup, in);
    with_config(config, [&]<class LatentPos, class WindowPos>() {
      const auto attention = make_attention<Causal, LatentPos, WindowPos>(s, setup);
      auto chunked = [&](auto backend) {
        auto state = attention.template make_state<double>(s.batch, 40);
        Tensor<double, 4> out(in.v.extents());
        index_t first = 0;
        for (index_t chunk : {0, 1, 4, 13, 40, 39}) {
          Tensor<double, 4> part({s.batch, chunk, s.heads, s.value_dim});
          auto slice = [&](const Tensor<double, 4>& x) { return time_slice(x, first, chunk); };
          attention.forward(backend, slice(in.q), slice(in.k), slice(in.wq), slice(in.wk),
                            slice(in.v), part.view(), state);
          for (index_t t = 0; t < chunk; ++t) set_time_step(out, first + t, time_step(part, t));
          first += chunk;
        }
        REQUIRE(first == s.time);
        CHECK(state.position() == 40 + s.time);
        CHECK(relative_error(out, oracle) <= Tolerance<double>::relative);
      };
      chunked(exec::reference);
      chunked(exec::cpu);
    });
  }
}

namespace {

/// Forward `split` tokens, save, restore (load_state and restore()), continue
/// both through forward and step: the outputs and the states must be bit-equal.
template <class A, class T>
void check_save_restore(const A& attention, const Inputs<T>& in, index_t split,
                        std::int64_t first) {
  const index_t B = in.v.extent(0), Tn = in.v.extent(1), H = in.v.extent(2), Dv = in.v.extent(3);
  auto state = attention.template make_state<T>(B, first);
  Tensor<T, 4> head({B, split, H, Dv});
  auto slice = [](const Tensor<T, 4>& x, index_t from, index_t count) {
    return time_slice(x, from, count);
  };
  attention.forward(exec::reference, slice(in.q, 0, split), slice(in.k, 0, split),
                    slice(in.wq, 0, split), slice(in.wk, 0, split), slice(in.v, 0, split),
                    head.view(), state);
  const std::vector<std::byte> bytes = state.save();
  auto loaded = attention.template load_state<T>(bytes);
  auto restored = attention.template make_state<T>(B);
  restored.restore(bytes);
  CHECK(loaded.position() == state.position());
  CHECK(loaded.window_fill() == state.window_fill());
  CHECK(loaded.save() == bytes);
  CHECK(restored.save() == bytes);
  // The rest: half by forward, half by step, identically for the three states.
  const index_t rest = Tn - split, by_forward = rest / 2;
  auto continue_from = [&](typename A::template State<T>& s) {
    Tensor<T, 4> out({B, rest, H, Dv});
    Tensor<T, 4> part({B, by_forward, H, Dv});
    attention.forward(exec::reference, slice(in.q, split, by_forward),
                      slice(in.k, split, by_forward), slice(in.wq, split, by_forward),
                      slice(in.wk, split, by_forward), slice(in.v, split, by_forward),
                      part.view(), s);
    for (index_t t = 0; t < by_forward; ++t) set_time_step(out, t, time_step(part, t));
    Tensor<T, 3> row({B, H, Dv});
    for (index_t t = split + by_forward; t < Tn; ++t) {
      attention.step(exec::reference, s, time_step(in.q, t), time_step(in.k, t),
                     time_step(in.wq, t), time_step(in.wk, t), time_step(in.v, t), row.view());
      set_time_step(out, t - split, row);
    }
    return out;
  };
  const auto original = continue_from(state);
  CHECK(bit_equal(original, continue_from(loaded)));
  CHECK(bit_equal(original, continue_from(restored)));
  CHECK(state.save() == loaded.save());
  CHECK(state.save() == restored.save());
}

}  // namespace

TEST_CASE("LatteMacchiato: save/restore continues bit-exactly (ring filling and wrapped)") {
  Rng rng(516);
  const MacchiatoShape s{2, 64, 3, 5, 4, 8, 7};
  const Inputs<float> in = random_inputs<float>(rng, s, 4.0, 1.0);
  for (Config config : {kPlain, kRope, kVaporRope, kVaporAllStates}) {
    const Setup setup = random_setup(rng, config, s, true);
    with_config(config, [&]<class LatentPos, class WindowPos>() {
      const auto attention = make_attention<Causal, LatentPos, WindowPos>(s, setup);
      for (index_t split : {0, 1, 5, 8, 29}) {  // before, at and past w + 1 = 8 tokens
        CAPTURE(split);
        check_save_restore(attention, in, split, split % 2 ? 1000 : 0);
      }
    });
  }
}

TEST_CASE("LatteMacchiato: state size is independent of the context length") {
  const LatteMacchiato<Causal, RunningMax, VAPOR, RoPE> attention({4, 16, 8, 8, 6});
  auto state = attention.make_state<float>(1);
  const std::size_t bytes = state.bytes();
  // Per head: m, alpha, vtilde, then the window ring; the fill count; the low
  // parts of alpha and vtilde (compensated sums).
  CHECK(bytes == sizeof(float) * (4 * (16 + 16 + 16 * 8) + 4 * 7 * (8 + 8) + 1 + 4 * (16 + 16 * 8)));
  Rng rng(517);
  for (index_t n : {10, 1000}) {
    const MacchiatoShape s{1, n, 4, 16, 8, 8, 6};
    const Inputs<float> in = random_inputs<float>(rng, s, 1.0, 1.0);
    Tensor<float, 4> out(in.v.extents());
    attention.forward(exec::reference, in.q, in.k, in.wq, in.wk, in.v, out.view(), state);
    CHECK(state.bytes() == bytes);
    CHECK(state.save().size() == attention.make_state<float>(1).save().size());
  }
}

// ============================================================== bad input ==

namespace {

constexpr index_t kB = 2, kT = 5, kH = 3, kL = 4, kDk = 6, kDv = 4, kW = 2;
constexpr MacchiatoDims kDims{.heads = kH, .latents = kL, .key_dim = kDk, .value_dim = kDv,
                              .window = kW};

using PlainMacchiato = LatteMacchiato<Causal>;
using RopeVaporMacchiato = LatteMacchiato<Causal, RunningMax, VAPOR, RoPE>;
using BidirectionalMacchiato = LatteMacchiato<Bidirectional, RunningMax, NoPositional, RoPE>;
#define MACCHIATO_TYPES PlainMacchiato, RopeVaporMacchiato, BidirectionalMacchiato
#define CAUSAL_MACCHIATO_TYPES PlainMacchiato, RopeVaporMacchiato

enum Arg { kQuery = 0, kKey, kWindowQuery, kWindowKey, kValues, kOut };
constexpr std::string_view arg_name(int which) {
  constexpr std::string_view names[] = {"query_logits",   "key_logits", "window_queries",
                                        "window_keys",    "values",     "out"};
  return names[which];
}
constexpr std::array<index_t, 6> kFeature{kL + 1, kL, kDk, kDk, kDv, kDv};

/// Valid [B, T, H, *] forward inputs, plus the output.
struct Call {
  std::array<Tensor<float, 4>, 6> tensors;
  static Call make(index_t batch = kB, index_t time = kT, std::uint64_t seed = 7) {
    Rng rng(seed);
    Call call;
    for (int i = 0; i < 6; ++i)
      call.tensors[i] = random_tensor<float, 4>(rng, {batch, time, kH, kFeature[i]}, 1.0);
    return call;
  }
  Tensor<float, 4>& operator[](int which) { return tensors[which]; }
  template <class A>
  void forward(const A& a) {
    a.forward(exec::reference, tensors[0].cview(), tensors[1].cview(), tensors[2].cview(),
              tensors[3].cview(), tensors[4].cview(), tensors[5].view());
  }
  template <class A, class S>
  void forward(const A& a, S& state) {
    a.forward(exec::reference, tensors[0].cview(), tensors[1].cview(), tensors[2].cview(),
              tensors[3].cview(), tensors[4].cview(), tensors[5].view(), state);
  }
};

/// Valid [B, H, *] step inputs, plus the output.
struct StepCall {
  std::array<Tensor<float, 3>, 6> tensors;
  static StepCall make(index_t batch = kB, std::uint64_t seed = 11) {
    Rng rng(seed);
    StepCall call;
    for (int i = 0; i < 6; ++i)
      call.tensors[i] = random_tensor<float, 3>(rng, {batch, kH, kFeature[i]}, 1.0);
    return call;
  }
  Tensor<float, 3>& operator[](int which) { return tensors[which]; }
  template <class A, class S>
  void step(const A& a, S& state) {
    a.step(exec::reference, state, tensors[0].cview(), tensors[1].cview(), tensors[2].cview(),
           tensors[3].cview(), tensors[4].cview(), tensors[5].view());
  }
};

/// Forward with tensor `which` replaced by one whose extent `dim` is off by `delta`.
template <class A>
void expect_forward_extent_error(int which, int dim, index_t delta) {
  const A attention(kDims);
  Call call = Call::make();
  REQUIRE_NOTHROW(call.forward(attention));
  auto extents = call[which].extents();
  extents[static_cast<std::size_t>(dim)] += delta;
  call[which] = Tensor<float, 4>(extents, 0.25f);
  expect_error([&] { call.forward(attention); }, arg_name(which), "expected");
}

/// Step with tensor `which` replaced by one whose extent `dim` is off by `delta`.
template <class A>
void expect_step_extent_error(int which, int dim, index_t delta) {
  const A attention(kDims);
  auto state = attention.template make_state<float>(kB);
  StepCall call = StepCall::make();
  REQUIRE_NOTHROW(call.step(attention, state));
  const auto saved = state.save();
  auto extents = call[which].extents();
  extents[static_cast<std::size_t>(dim)] += delta;
  call[which] = Tensor<float, 3>(extents, 0.25f);
  expect_error([&] { call.step(attention, state); }, arg_name(which), "expected");
  CHECK(state.save() == saved);  // a rejected step leaves the state as it was
}

}  // namespace

// ---- forward: one mismatched extent per argument --

TEST_CASE_TEMPLATE("forward: query_logits with L instead of L + 1 columns", A, MACCHIATO_TYPES) {
  expect_forward_extent_error<A>(kQuery, 3, -1);
}
TEST_CASE_TEMPLATE("forward: query_logits with another head count", A, MACCHIATO_TYPES) {
  expect_forward_extent_error<A>(kQuery, 2, +1);
}
TEST_CASE_TEMPLATE("forward: key_logits with L + 1 columns", A, MACCHIATO_TYPES) {
  expect_forward_extent_error<A>(kKey, 3, +1);
}
TEST_CASE_TEMPLATE("forward: key_logits with another sequence length", A, MACCHIATO_TYPES) {
  expect_forward_extent_error<A>(kKey, 1, -1);
}
TEST_CASE_TEMPLATE("forward: window_queries with another key size Dk", A, MACCHIATO_TYPES) {
  expect_forward_extent_error<A>(kWindowQuery, 3, -1);
}
TEST_CASE_TEMPLATE("forward: window_queries with another batch size", A, MACCHIATO_TYPES) {
  expect_forward_extent_error<A>(kWindowQuery, 0, +1);
}
TEST_CASE_TEMPLATE("forward: window_keys with another head count", A, MACCHIATO_TYPES) {
  expect_forward_extent_error<A>(kWindowKey, 2, -1);
}
TEST_CASE_TEMPLATE("forward: window_keys with another sequence length", A, MACCHIATO_TYPES) {
  expect_forward_extent_error<A>(kWindowKey, 1, +1);
}
TEST_CASE_TEMPLATE("forward: values with another value size Dv", A, MACCHIATO_TYPES) {
  expect_forward_extent_error<A>(kValues, 3, +1);
}
TEST_CASE_TEMPLATE("forward: values with another batch size", A, MACCHIATO_TYPES) {
  expect_forward_extent_error<A>(kValues, 0, -1);
}
TEST_CASE_TEMPLATE("forward: out with another value size Dv", A, MACCHIATO_TYPES) {
  expect_forward_extent_error<A>(kOut, 3, -1);
}
TEST_CASE_TEMPLATE("forward: out with another sequence length", A, MACCHIATO_TYPES) {
  expect_forward_extent_error<A>(kOut, 1, +1);
}

TEST_CASE("forward: the message names the layout and both extents") {
  const PlainMacchiato attention(kDims);
  Call call = Call::make();
  call[kQuery] = Tensor<float, 4>({kB, kT, kH, kL});
  expect_error([&] { call.forward(attention); }, "query_logits", "[B, T, H, L+1]");
  expect_error([&] { call.forward(attention); }, "query_logits",
               "expected " + format_extents<4>({kB, kT, kH, kL + 1}) + ", given " +
                   format_extents<4>({kB, kT, kH, kL}));
}

TEST_CASE_TEMPLATE("forward: T = 0 and B = 0 are no-ops that leave out untouched", A,
                   MACCHIATO_TYPES) {
  const A attention(kDims);
  for (auto [batch, time] : {std::array<index_t, 2>{kB, 0}, std::array<index_t, 2>{0, kT}}) {
    Call call = Call::make(batch, time);
    std::vector<float> sentinel(64, 42.0f);
    const TensorView<float, 4> out(sentinel.data(), {batch, time, kH, kDv});
    CHECK_NOTHROW(attention.forward(exec::reference, call[0].cview(), call[1].cview(),
                                    call[2].cview(), call[3].cview(), call[4].cview(), out));
    CHECK(std::all_of(sentinel.begin(), sentinel.end(), [](float x) { return x == 42.0f; }));
  }
}

// ---- step: one mismatched extent per argument --

TEST_CASE_TEMPLATE("step: query_logits with L instead of L + 1 columns", A,
                   CAUSAL_MACCHIATO_TYPES) {
  expect_step_extent_error<A>(kQuery, 2, -1);
}
TEST_CASE_TEMPLATE("step: key_logits with another head count", A, CAUSAL_MACCHIATO_TYPES) {
  expect_step_extent_error<A>(kKey, 1, +1);
}
TEST_CASE_TEMPLATE("step: window_queries with another key size", A, CAUSAL_MACCHIATO_TYPES) {
  expect_step_extent_error<A>(kWindowQuery, 2, +1);
}
TEST_CASE_TEMPLATE("step: window_keys with another key size", A, CAUSAL_MACCHIATO_TYPES) {
  expect_step_extent_error<A>(kWindowKey, 2, -1);
}
TEST_CASE_TEMPLATE("step: values with another batch size", A, CAUSAL_MACCHIATO_TYPES) {
  expect_step_extent_error<A>(kValues, 0, +1);
}
TEST_CASE_TEMPLATE("step: out with another value size", A, CAUSAL_MACCHIATO_TYPES) {
  expect_step_extent_error<A>(kOut, 2, +1);
}

// ---- dims and options --

TEST_CASE_TEMPLATE("dims.window <= 0", A, MACCHIATO_TYPES) {
  CHECK_NOTHROW((void)A(kDims));
  MacchiatoDims dims = kDims;
  dims.window = 0;
  expect_error([&] { (void)A(dims); }, "dims.window", "expected >= 1, given 0");
  dims.window = -3;
  expect_error([&] { (void)A(dims); }, "dims.window", "given -3");
}
TEST_CASE_TEMPLATE("dims.heads, latents, key_dim, value_dim = 0", A, MACCHIATO_TYPES) {
  for (const char* name : {"dims.heads", "dims.latents", "dims.key_dim", "dims.value_dim"}) {
    MacchiatoDims dims = kDims;
    const std::string_view field(name);
    if (field == "dims.heads") dims.heads = 0;
    if (field == "dims.latents") dims.latents = 0;
    if (field == "dims.key_dim") dims.key_dim = 0;
    if (field == "dims.value_dim") dims.value_dim = 0;
    expect_error([&] { (void)A(dims); }, name);
  }
}
TEST_CASE("options.scale not finite") {
  CHECK_NOTHROW(PlainMacchiato(kDims, {.scale = 0.5}));
  expect_error([] { PlainMacchiato(kDims, {.scale = std::numeric_limits<double>::infinity()}); },
               "options.scale");
  expect_error([] { PlainMacchiato(kDims, {.scale = std::numeric_limits<double>::quiet_NaN()}); },
               "options.scale");
}
TEST_CASE("make_state: float32 window too large for an exact fill count") {
  MacchiatoDims dims{.heads = 1, .latents = 1, .key_dim = 1, .value_dim = 1,
                     .window = index_t{1} << 24};
  const PlainMacchiato attention(dims);
  expect_error([&] { (void)attention.make_state<float>(1); }, "dims.window", "<= 16777215");
}
TEST_CASE("make_state: batch 0 or a negative first position") {
  const PlainMacchiato attention(kDims);
  CHECK_NOTHROW((void)attention.make_state<float>(1, 3));
  expect_error([&] { (void)attention.make_state<float>(0); }, "batch");
  expect_error([&] { (void)attention.make_state<float>(1, -1); }, "first_position");
}

// ---- RoPE and VAPOR angles --

TEST_CASE("RoPE: window angles of the wrong shape [H, Dk/2 + 1] or [H + 1, Dk/2]") {
  RoPE::Params good, wide, tall;
  good.angles = Tensor<double, 2>({kH, kDk / 2}, 0.1);
  wide.angles = Tensor<double, 2>({kH, kDk / 2 + 1}, 0.1);
  tall.angles = Tensor<double, 2>({kH + 1, kDk / 2}, 0.1);
  CHECK_NOTHROW(RopeVaporMacchiato(kDims, {}, {}, good));
  expect_error([&] { RopeVaporMacchiato(kDims, {}, {}, wide); }, "window_positional.angles",
               "shape [H, Dk/2]: expected [3, 3], given [3, 4]");
  expect_error([&] { BidirectionalMacchiato(kDims, {}, {}, tall); }, "window_positional.angles",
               "given [4, 3]");
}
TEST_CASE("RoPE: a NaN window angle or a base <= 1") {
  RoPE::Params params;
  params.angles = Tensor<double, 2>({kH, kDk / 2}, 0.1);
  params.angles(1, 2) = std::numeric_limits<double>::quiet_NaN();
  expect_error([&] { RopeVaporMacchiato(kDims, {}, {}, params); }, "window_positional.angles",
               "finite");
  RoPE::Params base;
  base.base = 1.0;
  expect_error([&] { RopeVaporMacchiato(kDims, {}, {}, base); }, "window_positional.base");
  base.base = std::numeric_limits<double>::infinity();
  expect_error([&] { RopeVaporMacchiato(kDims, {}, {}, base); }, "window_positional.base", "finite");
}
TEST_CASE("VAPOR: latent angles of the wrong shape [H, Dv/2 + 1]") {
  VAPOR::Params good, bad;
  good.angles = Tensor<double, 2>({kH, kDv / 2}, 0.1);
  bad.angles = Tensor<double, 2>({kH, kDv / 2 + 1}, 0.1);
  CHECK_NOTHROW(RopeVaporMacchiato(kDims, {}, good));
  expect_error([&] { RopeVaporMacchiato(kDims, {}, bad); }, "latent_positional.angles",
               "[H, Dv/2]");
}

// ---- aliasing --

TEST_CASE_TEMPLATE("forward: out aliases one of the five inputs", A, MACCHIATO_TYPES) {
  const A attention(kDims);
  for (int which = kQuery; which <= kValues; ++which) {
    CAPTURE(which);
    Call call = Call::make();
    // out placed right after input `which` in one buffer: valid; one element earlier: aliasing.
    const index_t n = call[which].size(), n_out = call[kOut].size();
    std::vector<float> buffer(static_cast<std::size_t>(n + n_out), 0.5f);
    std::copy(call[which].data(), call[which].data() + n, buffer.data());
    std::array<TensorView<const float, 4>, 5> in;
    for (int i = 0; i < 5; ++i) in[i] = call[i].cview();
    in[which] = TensorView<const float, 4>(buffer.data(), call[which].extents());
    auto run = [&](float* out_data) {
      attention.forward(exec::reference, in[0], in[1], in[2], in[3], in[4],
                        TensorView<float, 4>(out_data, call[kOut].extents()));
    };
    REQUIRE_NOTHROW(run(buffer.data() + n));
    expect_error([&] { run(buffer.data() + n - 1); }, "out",
                 "aliases input '" + std::string(arg_name(which)) + "'");
  }
}
TEST_CASE("forward: out addresses some elements twice (a zero stride)") {
  const PlainMacchiato attention(kDims);
  Call call = Call::make();
  std::vector<float> buffer(static_cast<std::size_t>(kB * kT * kDv), 0.f);
  const TensorView<float, 4> repeated(buffer.data(), {kB, kT, kH, kDv},
                                      {kT * kDv, kDv, 0, 1});  // every head on one row
  expect_error(
      [&] {
        attention.forward(exec::reference, call[0].cview(), call[1].cview(), call[2].cview(),
                          call[3].cview(), call[4].cview(), repeated);
      },
      "out", "distinct");
}
TEST_CASE_TEMPLATE("step: out is the window_keys buffer", A, CAUSAL_MACCHIATO_TYPES) {
  const A attention(kDims);
  auto state = attention.template make_state<float>(kB);
  StepCall call = StepCall::make();
  REQUIRE_NOTHROW(call.step(attention, state));
  call[kWindowKey] = Tensor<float, 3>({kB, kH, kDk}, 0.5f);
  const TensorView<float, 3> out(call[kWindowKey].data(), {kB, kH, kDv});
  expect_error(
      [&] {
        attention.step(exec::reference, state, call[0].cview(), call[1].cview(), call[2].cview(),
                       call[3].cview(), call[4].cview(), out);
      },
      "out", "aliases input 'window_keys'");
  CHECK(state.position() == 1);
}

// ---- wrong states --

TEST_CASE("state: a state of another positional policy") {
  const RopeVaporMacchiato attention(kDims);
  const PlainMacchiato other(kDims);
  auto own = attention.make_state<float>(kB);
  StepCall call = StepCall::make();
  REQUIRE_NOTHROW(call.step(attention, own));
  auto foreign = other.make_state<float>(kB);
  expect_error([&] { call.step(attention, foreign); }, "state",
               "expected LatteMacchiato<causal,running_max,vapor[latent_states],rope>/float32, "
               "given LatteMacchiato<causal,running_max,no_positional,no_positional>/float32");
  CHECK(foreign.position() == 0);
}
TEST_CASE("state: a state made under the other VaporScope") {
  const RopeVaporMacchiato latent_only(kDims);
  const RopeVaporMacchiato all_states(kDims, {.scale = std::nullopt, .vapor_scope = VaporScope::all_states});
  auto foreign = all_states.make_state<float>(kB);
  Call call = Call::make();
  REQUIRE_NOTHROW(call.forward(all_states, foreign));
  expect_error([&] { call.forward(latent_only, foreign); }, "state", "vapor[all_states]");
  CHECK(foreign.position() == kT);
}
TEST_CASE("state: a state of another window size") {
  const PlainMacchiato attention(kDims);
  MacchiatoDims wider = kDims;
  wider.window = kW + 1;
  auto foreign = PlainMacchiato(wider).make_state<float>(kB);
  StepCall call = StepCall::make();
  expect_error([&] { call.step(attention, foreign); }, "state", "window=2");
}
TEST_CASE("state: forward with a state of another batch size") {
  const PlainMacchiato attention(kDims);
  auto state = attention.make_state<float>(kB + 1);
  Call call = Call::make();
  expect_error([&] { call.forward(attention, state); }, "state", "batch=");
  CHECK(state.position() == 0);
}
TEST_CASE("state: a default-constructed state") {
  const PlainMacchiato attention(kDims);
  PlainMacchiato::State<float> state;
  StepCall call = StepCall::make();
  expect_error([&] { call.step(attention, state); }, "state", "<empty state>");
}
TEST_CASE("state: a corrupted window_fill (not an integer in [0, w + 1])") {
  const PlainMacchiato attention(kDims);
  for (float bad : {2.5f, -1.0f, float(kW + 2), std::numeric_limits<float>::quiet_NaN()}) {
    CAPTURE(bad);
    auto state = attention.make_state<float>(kB);
    StepCall call = StepCall::make();
    REQUIRE_NOTHROW(call.step(attention, state));
    *state.field(7) = bad;
    expect_error([&] { call.step(attention, state); }, "state", "window_fill");
    CHECK(state.position() == 1);
    // Saved, it is refused by load_state before use.
    expect_error([&] { (void)attention.load_state<float>(state.save()); }, "bytes", "window_fill");
  }
}
TEST_CASE("state: a window_fill above the position (the ring would be read before token 0)") {
  // A state at position p holds at most p tokens; a larger fill made the step read
  // ring slot (p + 1 - visible) % (w + 1) < 0, out of bounds (ASan, before the fix).
  const PlainMacchiato attention(kDims);
  for (const std::int64_t position : {std::int64_t{0}, std::int64_t{1}}) {
    CAPTURE(position);
    auto state = attention.make_state<float>(kB, position);
    *state.field(7) = static_cast<float>(position + 1);
    StepCall call = StepCall::make();
    expect_error([&] { call.step(attention, state); }, "state", "min(w + 1, position)");
    CHECK(state.position() == position);
    expect_error([&] { (void)attention.load_state<float>(state.save()); }, "bytes", "window_fill");
    auto target = attention.make_state<float>(kB);
    const auto before = target.save();
    expect_error([&] { target.restore(state.save()); }, "bytes", "window_fill");
    CHECK(target.save() == before);
  }
}
TEST_CASE("state: forward with T = 0 leaves the state unchanged") {
  const RopeVaporMacchiato attention(kDims);
  auto state = attention.make_state<float>(kB);
  Call prefix = Call::make(kB, 3);
  prefix.forward(attention, state);
  const auto saved = state.save();
  Call empty = Call::make(kB, 0);
  CHECK_NOTHROW(empty.forward(attention, state));
  CHECK(state.position() == 3);
  CHECK(state.save() == saved);
}

// ---- saved bytes --

namespace {
std::vector<std::byte> saved_macchiato(index_t window = kW, index_t tokens = 4) {
  MacchiatoDims dims = kDims;
  dims.window = window;
  const RopeVaporMacchiato attention(dims);
  auto state = attention.make_state<float>(kB);
  Call call = Call::make(kB, tokens);
  call.forward(attention, state);
  return state.save();
}
}  // namespace

TEST_CASE("load_state: every truncation of valid bytes") {
  const RopeVaporMacchiato attention(kDims);
  const auto bytes = saved_macchiato();
  REQUIRE_NOTHROW((void)attention.load_state<float>(bytes));
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    CAPTURE(n);
    expect_error([&] { (void)attention.load_state<float>({bytes.data(), n}); }, "bytes", "");
  }
}
TEST_CASE("load_state: bytes of another window size, kind or dtype") {
  const RopeVaporMacchiato attention(kDims);
  expect_error([&] { (void)attention.load_state<float>(saved_macchiato(kW + 1)); }, "bytes",
               "window=");
  expect_error([&] { (void)attention.load_state<double>(saved_macchiato()); }, "bytes",
               "state kind");
  expect_error([&] { (void)PlainMacchiato(kDims).load_state<float>(saved_macchiato()); }, "bytes",
               "state kind");
  const LatteAttention<Causal> latte({kH, kL, kDv});
  expect_error([&] { (void)attention.load_state<float>(latte.make_state<float>(kB).save()); },
               "bytes", "state kind");
}
TEST_CASE("restore: a rejected buffer leaves the state unchanged") {
  const RopeVaporMacchiato attention(kDims);
  auto state = attention.make_state<float>(kB);
  Call call = Call::make(kB, 2, 3);
  call.forward(attention, state);
  const auto before = state.save();
  auto bytes = saved_macchiato(kW, 6);
  bytes.resize(bytes.size() - 8);  // cut the checksum and inside the last field
  expect_error([&] { state.restore(bytes); }, "bytes", "");
  CHECK(state.save() == before);
}

TEST_CASE("LatteMacchiato exec::cpu: one head split over time segments continues a state exactly") {
  // B = H = 1 and T = 1500 make the cpu kernels split time into segments (the
  // window pass prefills each segment's buffer from the tokens before it; the
  // first reads the state's ring as it was before the call, the last leaves the
  // newest tokens in it). The state comes from a 300-token prefill; 50 cpu steps
  // then continue from the ring the segmented call left.
  Rng rng(517);
  for (const index_t w : {1, 37, 63}) {
    const MacchiatoShape s{1, 1850, 1, 5, 6, 8, w};
    const Inputs<double> in = random_inputs<double>(rng, s, 3.0, 1.0);
    for (Config config : {kPlain, kRope, kVaporAllStates}) {
      const Setup setup = random_setup(rng, config, s, true);
      const auto oracle = oracle_of(setup, in);
      with_config(config, [&]<class LatentPos, class WindowPos>() {
        const auto attention = make_attention<Causal, LatentPos, WindowPos>(s, setup);
        auto state = attention.template make_state<double>(1, 5);
        Tensor<double, 4> out(in.v.extents()), head({1, 300, 1, s.value_dim}),
            tail({1, 1500, 1, s.value_dim});
        attention.forward(exec::reference, time_slice(in.q, 0, 300), time_slice(in.k, 0, 300),
                          time_slice(in.wq, 0, 300), time_slice(in.wk, 0, 300),
                          time_slice(in.v, 0, 300), head.view(), state);
        attention.forward(exec::cpu, time_slice(in.q, 300, 1500), time_slice(in.k, 300, 1500),
                          time_slice(in.wq, 300, 1500), time_slice(in.wk, 300, 1500),
                          time_slice(in.v, 300, 1500), tail.view(), state);
        for (index_t t = 0; t < 300; ++t) set_time_step(out, t, time_step(head, t));
        for (index_t t = 0; t < 1500; ++t) set_time_step(out, 300 + t, time_step(tail, t));
        CHECK(state.position() == 5 + 1800);
        CHECK(state.window_fill() == s.window + 1);
        Tensor<double, 3> row({1, 1, s.value_dim});
        for (index_t t = 1800; t < s.time; ++t) {
          attention.step(exec::cpu, state, time_step(in.q, t), time_step(in.k, t),
                         time_step(in.wq, t), time_step(in.wk, t), time_step(in.v, t),
                         row.view());
          set_time_step(out, t, row);
        }
        CHECK_MESSAGE(relative_error(out, oracle) <= Tolerance<double>::relative,
                      kConfigNames[config] << " w=" << w);
      });
    }
  }
}

}  // namespace test_macchiato
#undef MACCHIATO_TYPES
#undef CAUSAL_MACCHIATO_TYPES
