// bf16 / fp16 activations (core/half_float.hpp, backends/cpu/half_conversion.hpp,
// serving/half_precision.hpp).
//  - The formats: every one of the 65536 bit patterns of each widens to the value
//    its fields define (decoded here with ldexp) and rounds back to itself; fp32
//    values round to the nearest of all 65536 (a search of the sorted table, ties
//    to the even pattern, past the largest finite value to inf), on random bit
//    patterns and on every value, midpoint and their neighbours.
//  - The CPU rows (AVX2 / F16C) give the scalar bits at every length.
//  - Every mechanism (causal and bidirectional), exec::reference and exec::cpu,
//    bf16 and fp16: HalfPrecision's output against the explicit T x T oracle of
//    the rounded inputs, element by element within u |o| + (1 + u) tol_fp32 max|o|
//    (one rounding of a result within the fp32 bound, docs/numerics.md); causal
//    also from a state over two calls, then decode steps; packed prefill; wide
//    logits and -inf logits; bad calls refused by name.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "expect_error.hpp"
#include "gradient_check.hpp"
#include "latte/backends/cpu/half_conversion.hpp"
#include "latte/core/half_float.hpp"
#include "latte/serving/half_precision.hpp"
#include "latte/serving/packed_prefill.hpp"
#include "mechanism_adaptors.hpp"
#include "support.hpp"
#include "tolerances.hpp"

namespace test_half_precision {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;

/// The value a bit pattern's fields define: sign, biased exponent, stored significand.
template <HalfFloat H>
double decoded(std::uint16_t bits) {
  constexpr bool bf16 = std::is_same_v<H, bfloat16>;
  constexpr int significand_bits = bf16 ? 7 : 10, bias = bf16 ? 127 : 15, top = bf16 ? 255 : 31;
  const int exponent = (bits >> significand_bits) & top;
  const double significand = bits & ((1 << significand_bits) - 1);
  const double sign = (bits & 0x8000) ? -1.0 : 1.0;
  if (exponent == top)
    return significand == 0 ? sign * std::numeric_limits<double>::infinity()
                            : std::numeric_limits<double>::quiet_NaN();
  if (exponent == 0) return sign * std::ldexp(significand, 1 - bias - significand_bits);
  return sign * std::ldexp(1.0 + std::ldexp(significand, -significand_bits), exponent - bias);
}

/// Every non-negative finite value of H in increasing order with its bits, and
/// last the first power of two past the largest (where rounding gives inf).
template <HalfFloat H>
std::vector<std::pair<double, std::uint16_t>> value_table() {
  std::vector<std::pair<double, std::uint16_t>> table;
  for (std::uint32_t b = 0; b < 0x8000; ++b) {
    const double v = decoded<H>(static_cast<std::uint16_t>(b));
    if (std::isfinite(v)) table.emplace_back(v, static_cast<std::uint16_t>(b));
  }
  std::sort(table.begin(), table.end());
  const std::uint16_t inf = std::is_same_v<H, bfloat16> ? 0x7f80 : 0x7c00;
  table.emplace_back(std::is_same_v<H, bfloat16> ? std::ldexp(1.0, 128) : 65536.0, inf);
  return table;
}

/// The bits of x rounded to nearest, ties to the even pattern, by search.
template <HalfFloat H>
std::uint16_t nearest_bits(const std::vector<std::pair<double, std::uint16_t>>& table, float x) {
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= table.back().first) return sign | table.back().second;  // past the top: inf
  const auto above = std::lower_bound(table.begin(), table.end(), std::make_pair(a, std::uint16_t{0}));
  if (above->first == a) return sign | above->second;
  const auto below = above - 1;
  const double down = a - below->first, up = above->first - a;  // exact in double
  if (down < up) return sign | below->second;
  if (up < down) return sign | above->second;
  return sign | ((below->second & 1) == 0 ? below->second : above->second);
}

template <HalfFloat H>
void check_format() {
  const auto table = value_table<H>();
  int widen_failures = 0, round_trip_failures = 0, nearest_failures = 0;
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    const H x = H::from_bits(static_cast<std::uint16_t>(b));
    const double expected = decoded<H>(x.bits());
    const float value = static_cast<float>(x);
    if (std::isnan(expected)) {
      widen_failures += !std::isnan(value);
      round_trip_failures += !std::isnan(static_cast<float>(H(value)));
      continue;
    }
    widen_failures += !(static_cast<double>(value) == expected && std::signbit(value) == std::signbit(expected));
    round_trip_failures += H(value).bits() != x.bits();
  }
  CHECK(widen_failures == 0);
  CHECK(round_trip_failures == 0);
  // Every value, the midpoints to its neighbours and the floats next to them.
  std::vector<float> probes;
  for (std::size_t i = 0; i + 1 < table.size(); ++i) {
    const float v = static_cast<float>(table[i].first);
    const float mid = static_cast<float>((table[i].first + table[i + 1].first) / 2);  // exact in fp32
    for (float p : {v, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f)}) {
      probes.push_back(p);
      probes.push_back(-p);
    }
  }
  Rng rng(7);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  for (int i = 0; i < 200000; ++i) probes.push_back(std::bit_cast<float>(any_bits(rng)));
  probes.push_back(std::numeric_limits<float>::infinity());
  probes.push_back(-std::numeric_limits<float>::infinity());
  probes.push_back(std::numeric_limits<float>::max());
  probes.push_back(std::numeric_limits<float>::denorm_min());
  for (float p : probes) {
    if (std::isnan(p)) {
      nearest_failures += !std::isnan(static_cast<float>(H(p)));
      continue;
    }
    const std::uint16_t got = H(p).bits(), want = nearest_bits<H>(table, p);
    if (got != want && nearest_failures++ < 5)
      MESSAGE(half_dtype_name<H>() << ": " << p << " gave " << got << ", nearest is " << want);
  }
  CHECK(nearest_failures == 0);
  MESSAGE(std::string(half_dtype_name<H>()) << ": " << probes.size() << " fp32 values rounded");
}

template <HalfFloat H>
void check_rows() {
  Rng rng(11);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  std::normal_distribution<float> normal;
  for (index_t n = 0; n <= 41; ++n) {
    std::vector<float> wide(static_cast<std::size_t>(n)), back(static_cast<std::size_t>(n));
    for (float& x : wide) x = (any_bits(rng) % 3 == 0) ? std::bit_cast<float>(any_bits(rng)) : normal(rng);
    std::vector<H> narrow(static_cast<std::size_t>(n));
    cpu::narrow_row(wide.data(), narrow.data(), n);
    cpu::widen_row(static_cast<const H*>(narrow.data()), back.data(), n);
    for (index_t i = 0; i < n; ++i) {
      CAPTURE(n);
      CAPTURE(i);
      const H scalar(wide[static_cast<std::size_t>(i)]);
      CHECK(narrow[static_cast<std::size_t>(i)].bits() == scalar.bits());
      CHECK(std::bit_cast<std::uint32_t>(back[static_cast<std::size_t>(i)]) ==
            std::bit_cast<std::uint32_t>(static_cast<float>(scalar)));
    }
  }
}

TEST_CASE("bfloat16 and float16: exact widening, nearest-even rounding, against a search of every value") {
  SUBCASE("bfloat16") { check_format<bfloat16>(); }
  SUBCASE("float16") { check_format<float16>(); }
}

TEST_CASE("half conversion rows: the vectorised rows give the scalar bits at every length") {
  check_rows<bfloat16>();
  check_rows<float16>();
}

/// Inputs drawn in fp32 and rounded to H, with their exact long-double values.
template <HalfFloat H>
struct Rounded {
  Tensor<H, 4> value;
  TensorLD<4> exact;
};

template <HalfFloat H>
Rounded<H> rounded_input(Rng& rng, const std::array<index_t, 4>& extents, double stddev) {
  const Tensor<float, 4> draw = random_tensor<float, 4>(rng, extents, stddev);
  Rounded<H> r{Tensor<H, 4>(extents), TensorLD<4>(extents)};
  for (index_t i = 0; i < draw.size(); ++i) {
    r.value.data()[i] = H(draw.data()[i]);
    r.exact.data()[i] = static_cast<float>(r.value.data()[i]);
  }
  return r;
}

/// No term of a head's own in the bound.
inline double no_head_term(index_t, index_t) { return 0; }

/// max over elements of |out - oracle| / (u |oracle| + (1 + u) (head_term(b, h) +
/// tol_fp32 max|oracle|) + subnormal step): at most 1 when the output is one
/// rounding of a result within the fp32 bound (plus head_term, where a mode
/// rounds more: bf16 products).
template <HalfFloat H, class HeadTerm = double (*)(index_t, index_t)>
double bound_ratio(const TensorView<const H, 4>& out, const TensorLD<4>& oracle, index_t oracle_first = 0,
                   HeadTerm head_term = no_head_term) {
  const double u = H::unit_roundoff, tiny = std::is_same_v<H, float16> ? std::ldexp(1.0, -25) : 0.0;
  long double scale = 0;
  for (index_t t = 0; t < out.extent(1); ++t)
    for (index_t b = 0; b < out.extent(0); ++b)
      for (index_t h = 0; h < out.extent(2); ++h)
        for (index_t d = 0; d < out.extent(3); ++d)
          scale = std::max(scale, std::fabs(oracle(b, oracle_first + t, h, d)));
  double worst = 0;
  for (index_t b = 0; b < out.extent(0); ++b)
    for (index_t t = 0; t < out.extent(1); ++t)
      for (index_t h = 0; h < out.extent(2); ++h)
        for (index_t d = 0; d < out.extent(3); ++d) {
          const long double o = oracle(b, oracle_first + t, h, d);
          const double got = static_cast<float>(out(b, t, h, d));
          if (!std::isfinite(got)) return std::numeric_limits<double>::infinity();
          const double bound =
              u * double(std::fabs(o)) + (1 + u) * (head_term(b, h) + Tolerance<float>::relative * double(scale)) + tiny;
          worst = std::max(worst, double(std::fabs(got - o)) / bound);
        }
  return worst;
}

template <HalfFloat H, class Mechanism>
struct HalfProblem {
  using Attention = typename Mechanism::Attention;
  using Inputs = LayerInputs<Attention>;
  static constexpr std::size_t kInputs = Inputs::count;

  LayerShape shape;
  Attention attention;
  std::vector<Rounded<H>> inputs;

  HalfProblem(Rng& rng, const LayerShape& s, double logit_scale) : shape(s), attention(Mechanism::make(s)) {
    for (const LayerInput& input : Inputs::inputs(attention))
      inputs.push_back(rounded_input<H>(rng, {s.batch, s.time, Inputs::heads(attention), input.width},
                                        input.name != "values" ? logit_scale : 1.0));
  }
  TensorLD<4> oracle() const {
    std::vector<TensorLD<4>> exact;
    for (const Rounded<H>& x : inputs) exact.push_back(x.exact);
    return Mechanism::oracle(shape, Mechanism::parameters(attention), exact);
  }
  std::array<index_t, 4> out_extents(index_t tokens) const {
    return {shape.batch, tokens, Inputs::heads(attention), Inputs::value_dim(attention)};
  }
  /// Views of tokens [first, first + count) of every input.
  auto views(index_t first, index_t count) const {
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return std::make_tuple(detail::time_slice(inputs[I].value.cview(), first, count)...);
    }(std::make_index_sequence<kInputs>{});
  }
};

template <class Attention>
inline constexpr bool is_latte = false;
template <class Dir, class Stab, class Pos, class Sum>
inline constexpr bool is_latte<LatteAttention<Dir, Stab, Pos, Sum>> = true;

template <HalfFloat H, class Mechanism, class E>
void half_cases(E e, std::uint64_t seed, double logit_scale = 1.0) {
  using Attention = typename Mechanism::Attention;
  Rng rng(seed);
  // batch, time, heads, latents, key_dim, value_dim, model_dim (unused), window
  // For Latte, which reads 16-bit rows itself on exec::cpu, a fourth shape: one
  // head of 520 tokens, long enough for its kernels to split time across threads
  // (staged rows crossing the segments' edges).
  const LayerShape shapes[] = {{2, 37, 2, 3, 4, 4, 0, 2}, {1, 70, 3, 5, 2, 6, 0, 3}, {2, 19, 1, 8, 6, 18, 0, 1},
                               {1, 520, 1, 16, 4, 32, 0, 4}};
  constexpr int shape_count = is_latte<Attention> ? 4 : 3;
  double worst = 0;
  for (int c = 0; c < case_count(shape_count); ++c) {
    const LayerShape& s = shapes[c % shape_count];
    CAPTURE(c);
    const HalfProblem<H, Mechanism> problem(rng, s, logit_scale);
    const TensorLD<4> oracle = problem.oracle();
    const HalfPrecision half(problem.attention);
    Tensor<H, 4> out(problem.out_extents(s.time));
    std::apply([&](const auto&... view) { half.forward(e, view..., out.view()); }, problem.views(0, s.time));
    const double whole = bound_ratio<H>(out.cview(), oracle);
    CHECK(whole <= 1.0);
    worst = std::max(worst, whole);
    if constexpr (Attention::direction::is_causal) {
      // Two calls through one fp32 state, then the last three tokens as decode steps.
      auto state = fresh_state<float>(problem.attention, s.time, s.batch);
      const index_t first = s.time / 3, second = s.time - first - 3;
      Tensor<H, 4> out1(problem.out_extents(first)), out2(problem.out_extents(second));
      std::apply([&](const auto&... view) { half.forward(e, view..., out1.view(), state); }, problem.views(0, first));
      std::apply([&](const auto&... view) { half.forward(e, view..., out2.view(), state); },
                 problem.views(first, second));
      const double r1 = bound_ratio<H>(out1.cview(), oracle), r2 = bound_ratio<H>(out2.cview(), oracle, first);
      CHECK(r1 <= 1.0);
      CHECK(r2 <= 1.0);
      worst = std::max({worst, r1, r2});
      for (index_t t = first + second; t < s.time; ++t) {
        Tensor<H, 3> step_out({s.batch, out.extent(2), out.extent(3)});
        std::vector<Tensor<H, 3>> rows;
        for (const Rounded<H>& x : problem.inputs) rows.push_back(time_step(x.value, t));
        [&]<std::size_t... I>(std::index_sequence<I...>) {
          half.step(e, state, rows[I].cview()..., step_out.view());
        }(std::make_index_sequence<HalfProblem<H, Mechanism>::kInputs>{});
        Tensor<H, 4> as_sequence({s.batch, 1, out.extent(2), out.extent(3)});
        std::copy(step_out.data(), step_out.data() + step_out.size(), as_sequence.data());
        const double r = bound_ratio<H>(as_sequence.cview(), oracle, t);
        CHECK(r <= 1.0);
        worst = std::max(worst, r);
      }
    }
  }
  MESSAGE(std::string(half_dtype_name<H>()) << " " << std::string(E::name)
                                            << ": worst error / bound " << worst);
}

template <class Mechanism>
void every_backend_and_type(std::uint64_t seed) {
  half_cases<bfloat16, Mechanism>(exec::reference, seed);
  half_cases<bfloat16, Mechanism>(exec::cpu, seed + 1);
  half_cases<float16, Mechanism>(exec::reference, seed + 2);
  half_cases<float16, Mechanism>(exec::cpu, seed + 3);
}

}  // namespace

TEST_CASE("HalfPrecision: every mechanism within one rounding of its oracle on the rounded inputs") {
  SUBCASE("Latte, causal") { every_backend_and_type<LatteMechanism<Causal>>(300); }
  SUBCASE("Latte, bidirectional") { every_backend_and_type<LatteMechanism<Bidirectional>>(310); }
  SUBCASE("Latte, causal, VAPOR") { every_backend_and_type<LatteMechanism<Causal, VAPOR>>(320); }
  SUBCASE("Latte, bidirectional, VAPOR") { every_backend_and_type<LatteMechanism<Bidirectional, VAPOR>>(330); }
  SUBCASE("Macchiato, causal") { every_backend_and_type<MacchiatoMechanism<Causal>>(340); }
  SUBCASE("Macchiato, bidirectional") { every_backend_and_type<MacchiatoMechanism<Bidirectional>>(350); }
  SUBCASE("softmax, causal") { every_backend_and_type<SoftmaxMechanism<Causal>>(360); }
  SUBCASE("softmax, bidirectional") { every_backend_and_type<SoftmaxMechanism<Bidirectional>>(370); }
  SUBCASE("linear elu + 1, causal") { every_backend_and_type<LinearMechanism<Causal>>(380); }
  SUBCASE("linear elu + 1, bidirectional") { every_backend_and_type<LinearMechanism<Bidirectional>>(390); }
  SUBCASE("LeaPformer, causal") { every_backend_and_type<LeaPMechanism<Causal>>(400); }
  SUBCASE("LAVO, causal") { every_backend_and_type<LavoMechanism<Causal>>(410); }
  SUBCASE("conv-compression, causal") { every_backend_and_type<ConvCompressedMechanism<Causal>>(420); }
}

TEST_CASE("HalfPrecision: wide and -inf logits stay within the bound") {
  // Latent logits spread over +-60 (exp underflows between latents) in bf16, whose
  // rounding of a logit of 60 moves it by up to 0.25; and rows of -inf logits.
  half_cases<bfloat16, LatteMechanism<Causal>>(exec::cpu, 500, 20.0);
  half_cases<bfloat16, LatteMechanism<Bidirectional>>(exec::cpu, 510, 20.0);
  half_cases<float16, SoftmaxMechanism<Causal>>(exec::cpu, 520, 8.0);
  Rng rng(530);
  const LayerShape s{1, 40, 2, 4, 4, 6, 0, 2};
  HalfProblem<bfloat16, LatteMechanism<Causal>> problem(rng, s, 1.0);
  const bfloat16 minus_inf(-std::numeric_limits<float>::infinity());
  for (index_t t = 0; t < s.time; t += 3)  // every third key all -inf, every fifth query too
    for (index_t h = 0; h < s.heads; ++h)
      for (index_t l = 0; l < s.latents; ++l) {
        problem.inputs[1].value(0, t, h, l) = minus_inf;
        problem.inputs[1].exact(0, t, h, l) = -std::numeric_limits<long double>::infinity();
        if (t % 5 == 0) {
          problem.inputs[0].value(0, t, h, l) = minus_inf;
          problem.inputs[0].exact(0, t, h, l) = -std::numeric_limits<long double>::infinity();
        }
      }
  Tensor<bfloat16, 4> out(problem.out_extents(s.time));
  const HalfPrecision half(problem.attention);
  std::apply([&](const auto&... view) { half.forward(exec::cpu, view..., out.view()); }, problem.views(0, s.time));
  CHECK(bound_ratio<bfloat16>(out.cview(), problem.oracle()) <= 1.0);
}

namespace {

/// bound_ratio with the term of latte::bf16_products (docs/numerics.md, "bf16
/// products"): c u m_v, m_v the head's largest |value| (c = 4) or, with VAPOR,
/// its largest value pair norm (c = 5).
template <class Pos>
double products_bound_ratio(const TensorView<const bfloat16, 4>& out, const TensorLD<4>& oracle,
                            const TensorLD<4>& values) {
  const double u = bfloat16::unit_roundoff, c = Pos::rotates_values ? 5 : 4;
  const index_t H = values.extent(2);
  std::vector<double> term(static_cast<std::size_t>(values.extent(0) * H));
  for (index_t b = 0; b < values.extent(0); ++b)
    for (index_t h = 0; h < H; ++h) {
      long double m_v = 0;
      for (index_t t = 0; t < values.extent(1); ++t)
        for (index_t d = 0; d < values.extent(3); ++d) {
          const long double x = values(b, t, h, d);
          m_v = std::max(m_v, Pos::rotates_values ? std::hypot(x, values(b, t, h, d ^ 1)) : std::fabs(x));
        }
      term[static_cast<std::size_t>(b * H + h)] = c * u * double(m_v);
    }
  return bound_ratio<bfloat16>(out, oracle, 0,
                               [&](index_t b, index_t h) { return term[static_cast<std::size_t>(b * H + h)]; });
}

/// latte::bf16_products on random shapes (odd token and latent counts, Dv past
/// the last whole vector, one head of 520 tokens split over threads), logits of
/// spread `logit_scale`; `cancelling` values: +-3 by token parity plus noise,
/// so that outputs are near 0 against values of 3. Returns whether any output
/// differed from the exact bf16 forward's (the products path ran).
template <class Pos>
bool products_cases(std::uint64_t seed, double logit_scale, bool cancelling) {
  using Mechanism = LatteMechanism<Bidirectional, Pos>;
  Rng rng(seed);
  std::normal_distribution<float> noise(0.0f, 0.05f);
  const LayerShape shapes[] = {{2, 37, 2, 3, 4, 4, 0, 1},   {1, 70, 3, 5, 2, 18, 0, 1}, {2, 19, 1, 8, 6, 64, 0, 1},
                               {1, 520, 1, 16, 4, 32, 0, 1}, {1, 129, 2, 64, 4, 72, 0, 1}, {3, 65, 2, 7, 4, 80, 0, 1}};
  double worst = 0;
  bool differs = false;
  for (int c = 0; c < case_count(6); ++c) {
    const LayerShape& s = shapes[c % 6];
    CAPTURE(c);
    HalfProblem<bfloat16, Mechanism> problem(rng, s, logit_scale);
    Rounded<bfloat16>& values = problem.inputs[2];
    if (cancelling)
      for (index_t i = 0; i < values.value.size(); ++i) {
        const index_t t = i / (s.heads * s.value_dim) % s.time;
        values.value.data()[i] = bfloat16((t % 2 == 0 ? 3.0f : -3.0f) + noise(rng));
        values.exact.data()[i] = static_cast<float>(values.value.data()[i]);
      }
    Tensor<bfloat16, 4> out(problem.out_extents(s.time)), exact(problem.out_extents(s.time));
    std::apply([&](const auto&... view) { problem.attention.forward(exec::cpu, bf16_products, view..., out.view()); },
               problem.views(0, s.time));
    std::apply([&](const auto&... view) { problem.attention.forward(exec::cpu, view..., exact.view()); },
               problem.views(0, s.time));
    const double r = products_bound_ratio<Pos>(out.cview(), problem.oracle(), values.exact);
    CHECK(r <= 1.0);
    worst = std::max(worst, r);
    for (index_t i = 0; i < out.size(); ++i) differs = differs || out.data()[i].bits() != exact.data()[i].bits();
  }
  const std::string label = std::string("bf16 products") + (Pos::rotates_values ? ", VAPOR" : "") +
                            (cancelling ? ", cancelling values" : "");
  MESSAGE(label << ": worst error / bound " << worst);
  return differs;
}

}  // namespace

TEST_CASE("bf16 products: bidirectional Latte within its bound of the rounded inputs' oracle") {
  // On a CPU with AVX-512 BF16 the products path must have run (its rounding
  // changes some output bits); elsewhere the exact kernels answer the call.
  for (const bool vapor : {false, true}) {
    const bool differs = vapor ? products_cases<VAPOR>(700, 1.0, false) : products_cases<NoPositional>(710, 1.0, false);
    CHECK(differs == cpu::bf16_products_available);
  }
  products_cases<NoPositional>(720, 20.0, false);  // wide logits (exp underflows between keys)
  products_cases<NoPositional>(730, 1.0, true);
  products_cases<VAPOR>(740, 1.0, true);
}

TEST_CASE("bf16 products: bad calls are refused by name, the output untouched") {
  const LatteAttention<Bidirectional> attention({2, 4, 6});
  Tensor<bfloat16, 4> q({1, 5, 2, 4}), k({1, 5, 2, 4}), v({1, 5, 2, 6}), out({1, 5, 2, 6}), short_v({1, 5, 2, 5});
  const bfloat16 sentinel(7.0f);
  out.fill(sentinel);
  auto untouched = [&] {
    return std::all_of(out.data(), out.data() + out.size(), [&](bfloat16 x) { return x.bits() == sentinel.bits(); });
  };
  expect_error([&] { attention.forward(exec::cpu, bf16_products, q.cview(), k.cview(), short_v.cview(), out.view()); },
               "values");
  CHECK(untouched());
  expect_error([&] {
    attention.forward(exec::cpu, bf16_products, q.cview(), k.cview(), TensorView<const bfloat16, 4>(out.view()), out.view());
  }, "out", "alias");
  CHECK(untouched());
  expect_error([&] {
    attention.forward(exec::cpu, bf16_products, q.cview(), TensorView<const bfloat16, 4>(nullptr, k.extents()), v.cview(),
                      out.view());
  }, "key_logits", "null");
  CHECK(untouched());
}

TEST_CASE("HalfPrecision: packed prefill of bf16 sequences equals each sequence's oracle") {
  Rng rng(600);
  const LayerShape s{1, 90, 2, 4, 4, 8, 0, 2};
  const HalfProblem<bfloat16, LatteMechanism<Causal, VAPOR>> problem(rng, s, 1.0);
  const std::vector<index_t> cu{0, 5, 5, 61, 90};
  Tensor<bfloat16, 4> out(problem.out_extents(s.time));
  for (auto e : {0, 1}) {
    const HalfPrecision half(problem.attention);
    if (e == 0)
      forward_packed(half, exec::cpu, std::span<const index_t>(cu), problem.views(0, s.time), out.view());
    else
      forward_packed(half, exec::reference, std::span<const index_t>(cu), problem.views(0, s.time), out.view());
    for (std::size_t i = 0; i + 1 < cu.size(); ++i) {
      const index_t length = cu[i + 1] - cu[i];
      if (length == 0) continue;
      std::vector<TensorLD<4>> exact;
      for (const auto& x : problem.inputs) exact.push_back(time_slice(x.exact, cu[i], length));
      const TensorLD<4> oracle =
          LatteMechanism<Causal, VAPOR>::oracle(s, LatteMechanism<Causal, VAPOR>::parameters(problem.attention), exact);
      CAPTURE(i);
      CHECK(bound_ratio<bfloat16>(detail::time_slice(out.cview(), cu[i], length), oracle) <= 1.0);
    }
  }
}

TEST_CASE("HalfPrecision: bad calls are refused by name, the output untouched") {
  const LatteAttention<Causal> attention({2, 4, 6});
  const HalfPrecision half(attention);
  Tensor<bfloat16, 4> q({1, 5, 2, 4}), k({1, 5, 2, 4}), v({1, 5, 2, 6}), out({1, 5, 2, 6}), short_v({1, 5, 2, 5});
  const bfloat16 sentinel(7.0f);
  out.fill(sentinel);
  auto untouched = [&] {
    return std::all_of(out.data(), out.data() + out.size(), [&](bfloat16 x) { return x.bits() == sentinel.bits(); });
  };
  // The attention's own shape check, on the fp32 copies, names its argument.
  expect_error([&] { half.forward(exec::cpu, q.cview(), k.cview(), short_v.cview(), out.view()); }, "values");
  CHECK(untouched());
  // What only the 16-bit views show: aliasing, a null pointer, a strided feature axis.
  for (bool cpu : {false, true}) {
    auto call = [&](auto e) { half.forward(e, q.cview(), k.cview(), TensorView<const bfloat16, 4>(out.view()), out.view()); };
    expect_error([&] { cpu ? call(exec::cpu) : call(exec::reference); }, "out", "alias");
  }
  CHECK(untouched());
  // (exec::reference goes through HalfPrecision's conversion, which names arguments by
  // place; LatteAttention reads bf16 itself on exec::cpu and names them.)
  expect_error([&] {
    half.forward(exec::reference, q.cview(), TensorView<const bfloat16, 4>(nullptr, k.extents()), v.cview(), out.view());
  }, "inputs[1]", "null");
  CHECK(untouched());
  expect_error([&] {
    half.forward(exec::cpu, q.cview(), TensorView<const bfloat16, 4>(nullptr, k.extents()), v.cview(), out.view());
  }, "key_logits", "null");
  CHECK(untouched());
  expect_error([&] {
    half.forward(exec::reference, TensorView<const bfloat16, 4>(q.data(), {1, 5, 2, 2}, {40, 8, 4, 2}), k.cview(),
                 v.cview(), out.view());
  }, "inputs[0]");
  CHECK(untouched());
  expect_error([&] {
    half.forward(exec::cpu, q.cview(), k.cview(), v.cview(), TensorView<bfloat16, 4>(out.data(), out.extents(), {60, 0, 6, 1}));
  }, "out", "twice");
  CHECK(untouched());
  // A state of another batch: the attention's state check, before anything moves.
  auto state = attention.make_state<float>(3);
  const auto saved = state.save();
  expect_error([&] { half.forward(exec::cpu, q.cview(), k.cview(), v.cview(), out.view(), state); }, "state");
  CHECK(untouched());
  CHECK(state.save() == saved);
}

}  // namespace test_half_precision
