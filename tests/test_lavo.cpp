// LAVO (paper 002): the reference and cpu backends, each against the long-double
// oracle written from the definition (tests/oracles/lavo_oracle.hpp) on >= 200 random
// shapes per direction and dtype and for cross-attention; the seeded orthonormal bases;
// decode equivalence, chunked prefill, save/restore, constant state size;
// a 10^6-token fp32 context; malformed input.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "latte/core/orthonormal_basis.hpp"
#include "latte/mechanisms/lavo.hpp"
#include "oracles/lavo_oracle.hpp"
#include "expect_error.hpp"
#include "state_bytes.hpp"
#include "support.hpp"

namespace test_lavo {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;

constexpr int kCases = 200;
constexpr int kDecodeCases = 60;

/// A random LAVO configuration for a shape: r, w, bases, bias, scale, empty-memory rule.
struct Config {
  LavoDims dims;
  LavoParams params;
  LavoOracleSpec spec;
  std::string describe;
};

template <class T>
Config random_config(Rng& rng, bool causal, index_t heads, index_t d, index_t time,
                     index_t latents) {
  Config c;
  std::uniform_int_distribution<index_t> any_r(1, d), any_w(1, time + 2);
  const index_t r = pick(rng, std::array<index_t, 4>{1, d, any_r(rng), std::min(latents, d)});
  const index_t w = pick(rng, std::array<index_t, 6>{1, 2, 3, 8, any_w(rng), any_w(rng)});
  c.dims = {.heads = heads, .dim = d, .bases = r, .window = w};

  // Bases: the default seeded orthonormal ones (read back), explicit orthonormal
  // ones, or any finite matrix (a trained B need not stay orthonormal).
  const int basis_kind = std::uniform_int_distribution<int>(0, 2)(rng);
  Tensor<double, 3> basis;
  const std::uint64_t seed = rng();
  if (basis_kind == 0) {
    c.params.basis_seed = seed;
    basis = orthonormal_bases(heads, r, d, seed);  // what the default must be
  } else if (basis_kind == 1) {
    basis = orthonormal_bases(heads, r, d, seed);
    c.params.bases = basis;
  } else {
    basis = rounded_to<T>(random_tensor<double, 3>(rng, {heads, r, d}, 0.7));
    c.params.bases = basis;
  }
  const double bias_scale = pick(rng, std::array{0.0, 1.0, 5.0});
  Tensor<double, 2> bias({heads, 2 * w - 1}, 0.0);
  if (bias_scale > 0) {
    bias = rounded_to<T>(random_tensor<double, 2>(rng, {heads, 2 * w - 1}, bias_scale));
    c.params.relative_bias = bias;
  }
  const bool custom_scale = std::uniform_int_distribution<int>(0, 2)(rng) == 0;
  if (custom_scale) c.params.scale = 0.37;
  const bool local_only = std::uniform_int_distribution<int>(0, 3)(rng) == 0;
  c.params.empty_memory = local_only ? LavoEmptyMemory::local_only : LavoEmptyMemory::zero;

  c.spec.causal = causal;
  c.spec.window = w;
  c.spec.bases = r;
  c.spec.scale = custom_scale ? 0.37L : 1.0L / std::sqrt((long double)d);
  c.spec.local_only_without_memory = local_only;
  c.spec.basis = widen(rounded_to<T>(basis));
  c.spec.relative_bias = widen(bias);
  c.describe = "d=" + std::to_string(d) + " r=" + std::to_string(r) + " w=" + std::to_string(w) +
               " basis_kind=" + std::to_string(basis_kind) + " bias_scale=" +
               std::to_string(bias_scale) + " local_only=" + std::to_string(local_only);
  return c;
}

template <class T, class Dir>
void run_oracle_cases(const char* label, std::uint64_t seed) {
  Rng rng(seed);
  double worst = 0, worst_cpu = 0;
  long long elements = 0;
  const int cases_run = case_count(kCases);
  for (int c = 0; c < cases_run; ++c) {
    const Shape s = random_shape(rng, 1.2e7);
    const index_t d = s.value_dim;
    const Config config = random_config<T>(rng, Dir::is_causal, s.heads, d, s.time, s.latents);
    const double input_scale = pick(rng, std::array{0.5, 1.0, 3.0});
    const auto q = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, d}, input_scale);
    const auto k = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, d}, input_scale);
    const auto v = uniform_tensor<T, 4>(rng, {s.batch, s.time, s.heads, d}, -1, 1);
    const Lavo<Dir> attention(config.dims, config.params);
    Tensor<T, 4> out(v.extents()), out_cpu(v.extents());
    attention.forward(exec::reference, q, k, v, out.view());
    attention.forward(exec::cpu, q, k, v, out_cpu.view());
    const auto oracle = lavo_oracle(config.spec, q, k, v);
    const double error = relative_error(out, oracle), error_cpu = relative_error(out_cpu, oracle);
    CHECK_MESSAGE(std::max(error, error_cpu) <= Tolerance<T>::relative,
                  label << " case " << c << " B=" << s.batch << " T=" << s.time
                        << " H=" << s.heads << " " << config.describe << " reference error="
                        << error << " cpu error=" << error_cpu);
    worst = std::max(worst, error);
    worst_cpu = std::max(worst_cpu, error_cpu);
    elements += out.size();
  }
  std::printf("[oracle] %-44s %s cases=%d elements=%lld max_rel_error reference=%.3e "
              "cpu=%.3e (tol %.0e)\n",
              label, dtype_name<T>(), cases_run, elements, worst, worst_cpu,
              Tolerance<T>::relative);
}

template <class T>
void run_cross_cases(std::uint64_t seed) {
  Rng rng(seed);
  double worst = 0, worst_cpu = 0;
  long long elements = 0;
  int empty_sources = 0;
  const int cases_run = case_count(kCases);
  for (int c = 0; c < cases_run; ++c) {
    const Shape s = random_shape(rng, 1.2e7);
    const index_t d = s.value_dim;
    index_t source_length = pick(rng, sequence_lengths());
    if (c % 25 == 7) source_length = 0;  // an empty source reads zero
    empty_sources += source_length == 0;
    const Config config = random_config<T>(rng, false, s.heads, d, s.time, s.latents);
    const double input_scale = pick(rng, std::array{0.5, 1.0, 3.0});
    const auto q = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, d}, input_scale);
    const auto source =
        random_tensor<T, 4>(rng, {s.batch, source_length, s.heads, d}, input_scale);
    const Lavo<Bidirectional> attention(config.dims, config.params);
    Tensor<T, 4> out(q.extents(), T(7)), out_cpu(q.extents(), T(7));
    attention.cross_forward(exec::reference, q, source, out.view());
    attention.cross_forward(exec::cpu, q, source, out_cpu.view());
    const auto oracle = lavo_cross_oracle(config.spec, q, source);
    const double error = relative_error(out, oracle), error_cpu = relative_error(out_cpu, oracle);
    CHECK_MESSAGE(std::max(error, error_cpu) <= Tolerance<T>::relative,
                  "cross case " << c << " B=" << s.batch << " Tq=" << s.time << " Ts="
                                << source_length << " H=" << s.heads << " " << config.describe
                                << " reference error=" << error << " cpu error=" << error_cpu);
    worst = std::max(worst, error);
    worst_cpu = std::max(worst_cpu, error_cpu);
    elements += out.size();
  }
  CHECK(empty_sources == (cases_run + 17) / 25);  // the cases c < cases_run with c % 25 == 7
  std::printf("[oracle] %-44s %s cases=%d elements=%lld max_rel_error reference=%.3e "
              "cpu=%.3e (tol %.0e)\n",
              "Lavo cross_forward (§3.4)", dtype_name<T>(), cases_run, elements, worst,
              worst_cpu, Tolerance<T>::relative);
}

/// Prefill of the first `prefill` tokens through forward(..., state) (in two calls,
/// split at `split` <= prefill, so the second continues from the state's ring), the
/// rest through step(), all on backend E.
template <class T, class E = exec::reference_t>
Tensor<T, 4> prefill_then_step(const Lavo<Causal>& attention, LavoState<T>& state,
                               const Tensor<T, 4>& q, const Tensor<T, 4>& k, const Tensor<T, 4>& v,
                               index_t prefill, index_t split = 0) {
  const index_t Tn = q.extent(1);
  Tensor<T, 4> out(v.extents());
  for (const auto& [first, count] : {std::pair{index_t{0}, split}, {split, prefill - split}}) {
    Tensor<T, 4> head_out({v.extent(0), count, v.extent(2), v.extent(3)});
    attention.forward(E{}, time_slice(q, first, count), time_slice(k, first, count),
                      time_slice(v, first, count), head_out.view(), state);
    for (index_t t = 0; t < count; ++t) set_time_step(out, first + t, time_step(head_out, t));
  }
  Tensor<T, 3> row({v.extent(0), v.extent(2), v.extent(3)});
  for (index_t t = prefill; t < Tn; ++t) {
    attention.step(E{}, state, time_step(q, t), time_step(k, t), time_step(v, t), row.view());
    set_time_step(out, t, row);
  }
  return out;
}

template <class T>
void run_decode_cases(std::uint64_t seed) {
  Rng rng(seed);
  double worst = 0, worst_cpu = 0;
  const int cases_run = case_count(kDecodeCases);
  for (int c = 0; c < cases_run; ++c) {
    const Shape s = random_shape(rng, 4e6);
    const index_t d = s.value_dim;
    const Config config = random_config<T>(rng, true, s.heads, d, s.time, s.latents);
    const auto q = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, d}, 1.0);
    const auto k = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, d}, 1.0);
    const auto v = uniform_tensor<T, 4>(rng, {s.batch, s.time, s.heads, d}, -1, 1);
    const Lavo<Causal> attention(config.dims, config.params);
    const auto oracle = lavo_oracle(config.spec, q, k, v);
    Tensor<T, 4> whole(v.extents()), whole_cpu(v.extents());
    attention.forward(exec::reference, q, k, v, whole.view());
    attention.forward(exec::cpu, q, k, v, whole_cpu.view());

    const index_t prefill = std::uniform_int_distribution<index_t>(0, s.time)(rng);
    const index_t split = std::uniform_int_distribution<index_t>(0, prefill)(rng);
    auto state = attention.make_state<T>(s.batch);
    const auto decoded = prefill_then_step(attention, state, q, k, v, prefill);
    CHECK(state.position() == s.time);
    auto state_cpu = attention.make_state<T>(s.batch);
    const auto decoded_cpu =
        prefill_then_step<T, exec::cpu_t>(attention, state_cpu, q, k, v, prefill, split);
    CHECK(state_cpu.position() == s.time);

    const double error_whole = relative_error(whole, oracle);
    const double error_decoded = relative_error(decoded, oracle);
    const double error_whole_cpu = relative_error(whole_cpu, oracle);
    const double error_decoded_cpu = relative_error(decoded_cpu, oracle);
    CHECK_MESSAGE(error_whole <= Tolerance<T>::relative, "case " << c << " " << config.describe);
    CHECK_MESSAGE(error_decoded <= Tolerance<T>::relative,
                  "case " << c << " T=" << s.time << " prefill=" << prefill << " "
                          << config.describe << " error=" << error_decoded);
    CHECK_MESSAGE(error_whole_cpu <= Tolerance<T>::relative,
                  "cpu case " << c << " " << config.describe << " error=" << error_whole_cpu);
    CHECK_MESSAGE(error_decoded_cpu <= Tolerance<T>::relative,
                  "cpu case " << c << " T=" << s.time << " prefill=" << prefill << " split="
                              << split << " " << config.describe
                              << " error=" << error_decoded_cpu);
    worst = std::max({worst, error_whole, error_decoded});
    worst_cpu = std::max({worst_cpu, error_whole_cpu, error_decoded_cpu});
  }
  std::printf("[decode] Lavo<Causal> prefill + steps %s cases=%d max_rel_error reference=%.3e "
              "cpu=%.3e\n",
              dtype_name<T>(), cases_run, worst, worst_cpu);
}

}  // namespace

// ------------------------------------------------------- orthonormal bases --

TEST_CASE("orthonormal_bases: rows are orthonormal, reproducible from the seed") {
  for (const auto& sizes : {std::array<index_t, 3>{1, 1, 1}, {3, 5, 5}, {2, 7, 64}, {8, 64, 64},
                            {1, 1, 9}}) {
    const index_t H = sizes[0], r = sizes[1], d = sizes[2];
    const auto bases = orthonormal_bases(H, r, d, 42);
    REQUIRE(bases.extents() == std::array<index_t, 3>{H, r, d});
    double worst = 0;
    for (index_t h = 0; h < H; ++h)
      for (index_t i = 0; i < r; ++i)
        for (index_t j = 0; j < r; ++j) {
          long double dot = 0;
          for (index_t e = 0; e < d; ++e) dot += (long double)bases(h, i, e) * bases(h, j, e);
          worst = std::max(worst, (double)std::fabs(dot - (i == j ? 1.0L : 0.0L)));
        }
    CHECK_MESSAGE(worst <= 1e-14, "H=" << H << " r=" << r << " d=" << d << " worst=" << worst);
    CHECK(bit_equal(bases, orthonormal_bases(H, r, d, 42)));
  }
  const auto a = orthonormal_bases(2, 4, 8, 1), b = orthonormal_bases(2, 4, 8, 2);
  CHECK_FALSE(bit_equal(a, b));
  bool heads_differ = false;
  for (index_t e = 0; e < 8; ++e) heads_differ = heads_differ || a(0, 0, e) != a(1, 0, e);
  CHECK(heads_differ);
  // With R's diagonal made positive, b_1 of head 0 is the first Gaussian column
  // g_1 (the first d numbers of the seeded stream) divided by its norm.
  detail::SeededGaussian gaussian(1);
  std::vector<long double> g(8);
  long double norm = 0;
  for (auto& x : g) {
    x = gaussian.next();
    norm += x * x;
  }
  for (index_t e = 0; e < 8; ++e)
    CHECK(std::fabs(a(0, 0, e) - static_cast<double>(g[e] / std::sqrt(norm))) <= 1e-15);
}

TEST_CASE("orthonormal_bases: the default bases of Lavo are the seeded ones") {
  const LavoDims dims{.heads = 3, .dim = 6, .bases = 4, .window = 2};
  const Lavo<Causal> attention(dims, {.basis_seed = 77});
  CHECK(bit_equal(attention.bases(), orthonormal_bases(3, 4, 6, 77)));
  const Lavo<Causal> other(dims, {.basis_seed = 78});
  CHECK_FALSE(bit_equal(attention.bases(), other.bases()));
  CHECK(attention.relative_bias().extents() == std::array<index_t, 2>{3, 3});
  CHECK(attention.scale() == doctest::Approx(1.0 / std::sqrt(6.0)));
}

TEST_CASE("orthonormal_bases: r > d and zero sizes are errors") {
  CHECK_THROWS_AS((void)orthonormal_bases(1, 5, 4, 0), latte::Error);
  try {
    (void)orthonormal_bases(1, 5, 4, 0);
  } catch (const latte::Error& error) {
    CHECK(error.argument() == "bases");
    CHECK(std::string(error.what()).find("expected <= 4, given 5") != std::string::npos);
  }
  CHECK_THROWS_AS((void)orthonormal_bases(0, 1, 4, 0), latte::Error);
  CHECK_THROWS_AS((void)orthonormal_bases(1, 0, 4, 0), latte::Error);
  CHECK_THROWS_AS((void)orthonormal_bases(1, 1, 0, 0), latte::Error);
}

// ------------------------------------------------------------------ oracle --

TEST_CASE("Lavo causal == oracle") {
  run_oracle_cases<float, Causal>("Lavo<Causal>", 2001);
  run_oracle_cases<double, Causal>("Lavo<Causal>", 2002);
}
TEST_CASE("Lavo bidirectional == oracle") {
  run_oracle_cases<float, Bidirectional>("Lavo<Bidirectional>", 2003);
  run_oracle_cases<double, Bidirectional>("Lavo<Bidirectional>", 2004);
}
TEST_CASE("Lavo cross-attention == oracle") {
  run_cross_cases<float>(2005);
  run_cross_cases<double>(2006);
}

TEST_CASE("Lavo: adversarial inputs (bias spread 1e3, large logits, zero values)") {
  Rng rng(2007);
  const index_t B = 2, Tn = 61, H = 3, d = 9, r = 4, w = 5;
  const LavoDims dims{.heads = H, .dim = d, .bases = r, .window = w};
  auto bias = random_tensor<double, 2>(rng, {H, 2 * w - 1}, 1000.0);
  const auto q = random_tensor<double, 4>(rng, {B, Tn, H, d}, 10.0);
  const auto k = random_tensor<double, 4>(rng, {B, Tn, H, d}, 10.0);
  const auto v = uniform_tensor<double, 4>(rng, {B, Tn, H, d}, -1, 1);
  for (bool causal : {true, false}) {
    LavoOracleSpec spec{.causal = causal, .window = w, .bases = r,
                        .scale = 1.0L / std::sqrt((long double)d)};
    spec.basis = widen(orthonormal_bases(H, r, d, 5));
    spec.relative_bias = widen(bias);
    const auto oracle = lavo_oracle(spec, q, k, v);
    auto run = [&](auto backend) {
      Tensor<double, 4> out(v.extents());
      if (causal) {
        Lavo<Causal>(dims, {.basis_seed = 5, .relative_bias = bias})
            .forward(backend, q, k, v, out.view());
      } else {
        Lavo<Bidirectional>(dims, {.basis_seed = 5, .relative_bias = bias})
            .forward(backend, q, k, v, out.view());
      }
      CAPTURE(decltype(backend)::name);
      CHECK(all_finite(out));
      CHECK(relative_error(out, oracle) <= Tolerance<double>::relative);
    };
    run(exec::reference);
    run(exec::cpu);
  }
  // All-zero values: F_local = 0, H = 0, so every output is exactly zero.
  const Tensor<float, 4> zero_v({B, Tn, H, d}, 0.0f);
  const auto qf = random_tensor<float, 4>(rng, {B, Tn, H, d}, 3.0);
  Tensor<float, 4> out({B, Tn, H, d}, 1.0f), out_cpu({B, Tn, H, d}, 1.0f);
  Lavo<Causal>(dims).forward(exec::reference, qf, qf, zero_v, out.view());
  Lavo<Causal>(dims).forward(exec::cpu, qf, qf, zero_v, out_cpu.view());
  CHECK(std::all_of(out.data(), out.data() + out.size(), [](float x) { return x == 0.0f; }));
  CHECK(std::all_of(out_cpu.data(), out_cpu.data() + out_cpu.size(),
                    [](float x) { return x == 0.0f; }));
}

TEST_CASE("Lavo: the memory only holds complete earlier windows (causality and dissection)") {
  // Changing the query of token t0 changes F_local(t0) and o_t0 only; F_local(t0)
  // enters the memory when t0's window [12, 18) is complete, so o_t is unchanged
  // (bit for bit) for t < t0 and for t0 < t < 18, and changed again from t = 18 on.
  Rng rng(2008);
  const index_t Tn = 40, H = 2, d = 4, w = 6, t0 = 13;
  const Lavo<Causal> attention({.heads = H, .dim = d, .bases = 3, .window = w});
  auto q = random_tensor<double, 4>(rng, {1, Tn, H, d}, 1.0);
  const auto k = random_tensor<double, 4>(rng, {1, Tn, H, d}, 1.0);
  const auto v = uniform_tensor<double, 4>(rng, {1, Tn, H, d}, -1, 1);
  Tensor<double, 4> before({1, Tn, H, d}), after({1, Tn, H, d});
  Tensor<double, 4> before_cpu({1, Tn, H, d}), after_cpu({1, Tn, H, d});
  attention.forward(exec::reference, q, k, v, before.view());
  attention.forward(exec::cpu, q, k, v, before_cpu.view());
  for (index_t h = 0; h < H; ++h)
    for (index_t e = 0; e < d; ++e) q(0, t0, h, e) += 0.5;
  attention.forward(exec::reference, q, k, v, after.view());
  attention.forward(exec::cpu, q, k, v, after_cpu.view());
  auto same_at = [&](const Tensor<double, 4>& x, const Tensor<double, 4>& y, index_t t) {
    for (index_t h = 0; h < H; ++h)
      for (index_t e = 0; e < d; ++e)
        if (x(0, t, h, e) != y(0, t, h, e)) return false;
    return true;
  };
  for (index_t t = 0; t < Tn; ++t) {
    const bool unchanged = t < t0 || (t > t0 && t < 18);
    CHECK_MESSAGE(same_at(before, after, t) == unchanged, "t=" << t);
    CHECK_MESSAGE(same_at(before_cpu, after_cpu, t) == unchanged, "cpu t=" << t);
  }
}

// ------------------------------------------------------------------ decode --

TEST_CASE("Lavo: prefill + steps == forward == oracle") {
  run_decode_cases<float>(2101);
  run_decode_cases<double>(2102);
}

TEST_CASE("Lavo: forward with a state, chunked at any border, equals one forward") {
  Rng rng(2103);
  const index_t B = 2, Tn = 97, H = 3, d = 6, r = 4, w = 7;
  const auto q = random_tensor<double, 4>(rng, {B, Tn, H, d}, 1.0);
  const auto k = random_tensor<double, 4>(rng, {B, Tn, H, d}, 1.0);
  const auto v = uniform_tensor<double, 4>(rng, {B, Tn, H, d}, -1, 1);
  const auto bias = random_tensor<double, 2>(rng, {H, 2 * w - 1}, 1.0);
  const Lavo<Causal> attention({.heads = H, .dim = d, .bases = r, .window = w},
                               {.basis_seed = 9, .relative_bias = bias});
  LavoOracleSpec spec{.causal = true, .window = w, .bases = r,
                      .scale = 1.0L / std::sqrt((long double)d)};
  spec.basis = widen(attention.bases());
  spec.relative_bias = widen(bias);
  const auto oracle = lavo_oracle(spec, q, k, v);
  auto chunked = [&](auto backend, LavoState<double>& state) {
    Tensor<double, 4> out({B, Tn, H, d});
    index_t first = 0;
    for (index_t chunk : {0, 1, 13, 40, 43}) {
      Tensor<double, 4> part({B, chunk, H, d});
      attention.forward(backend, time_slice(q, first, chunk), time_slice(k, first, chunk),
                        time_slice(v, first, chunk), part.view(), state);
      for (index_t t = 0; t < chunk; ++t) set_time_step(out, first + t, time_step(part, t));
      first += chunk;
    }
    REQUIRE(first == Tn);
    CHECK(state.position() == Tn);
    return out;
  };
  auto state = attention.make_state<double>(B), state_cpu = attention.make_state<double>(B);
  const auto out = chunked(exec::reference, state);
  CHECK(relative_error(out, oracle) <= Tolerance<double>::relative);
  CHECK(relative_error(chunked(exec::cpu, state_cpu), oracle) <= Tolerance<double>::relative);
  Tensor<double, 4> whole({B, Tn, H, d});
  // The state-less forward runs the same per-token recurrence (a smaller ring):
  // it must agree bit for bit, a consistency check on top of the oracle's.
  attention.forward(exec::reference, q, k, v, whole.view());
  CHECK(bit_equal(out, whole));
}

TEST_CASE("Lavo cpu: one long head split into time segments, continuing a state") {
  // B * H = 1 with T >> 256: the cpu kernel cuts time into segments at window
  // borders (one per thread) and scans the memory across them; the second
  // forward starts mid-window at position 333 and reads the state's ring.
  Rng rng(2110);
  const index_t Tn = 1500, H = 1, d = 8, r = 5, prefix = 333;
  for (const index_t w : {1, 7, 64, 600}) {
    CAPTURE(w);
    const auto q = random_tensor<double, 4>(rng, {1, Tn, H, d}, 1.0);
    const auto k = random_tensor<double, 4>(rng, {1, Tn, H, d}, 1.0);
    const auto v = uniform_tensor<double, 4>(rng, {1, Tn, H, d}, -1, 1);
    const auto bias = random_tensor<double, 2>(rng, {H, 2 * w - 1}, 1.0);
    const Lavo<Causal> attention({.heads = H, .dim = d, .bases = r, .window = w},
                                 {.basis_seed = 11, .relative_bias = bias});
    LavoOracleSpec spec{.causal = true, .window = w, .bases = r,
                        .scale = 1.0L / std::sqrt((long double)d)};
    spec.basis = widen(attention.bases());
    spec.relative_bias = widen(bias);
    const auto oracle = lavo_oracle(spec, q, k, v);
    Tensor<double, 4> whole({1, Tn, H, d});
    attention.forward(exec::cpu, q, k, v, whole.view());
    CHECK(relative_error(whole, oracle) <= Tolerance<double>::relative);
    auto state = attention.make_state<double>(1);
    const auto continued =
        prefill_then_step<double, exec::cpu_t>(attention, state, q, k, v, Tn, prefix);
    CHECK(relative_error(continued, oracle) <= Tolerance<double>::relative);
  }
}

template <class T, class E>
void check_save_restore(index_t split) {
  Rng rng(2104 + static_cast<std::uint64_t>(split));
  const index_t B = 2, Tn = 64, H = 3, d = 8, r = 5, w = 6;
  const auto q = random_tensor<T, 4>(rng, {B, Tn, H, d}, 2.0);
  const auto k = random_tensor<T, 4>(rng, {B, Tn, H, d}, 2.0);
  const auto v = uniform_tensor<T, 4>(rng, {B, Tn, H, d}, -1, 1);
  const Lavo<Causal> attention({.heads = H, .dim = d, .bases = r, .window = w},
                               {.relative_bias = random_tensor<double, 2>(rng, {H, 2 * w - 1}, 1.0)});
  auto state = attention.make_state<T>(B);
  Tensor<T, 4> head({B, split, H, d});
  attention.forward(E{}, time_slice(q, 0, split), time_slice(k, 0, split),
                    time_slice(v, 0, split), head.view(), state);
  const std::vector<std::byte> bytes = state.save();
  auto restored = attention.load_state<T>(bytes);
  CHECK(restored.position() == split);
  CHECK(restored.save() == bytes);
  Tensor<T, 4> rest_original({B, Tn - split, H, d}), rest_restored({B, Tn - split, H, d});
  attention.forward(E{}, time_slice(q, split, Tn - split),
                    time_slice(k, split, Tn - split), time_slice(v, split, Tn - split),
                    rest_original.view(), state);
  attention.forward(E{}, time_slice(q, split, Tn - split),
                    time_slice(k, split, Tn - split), time_slice(v, split, Tn - split),
                    rest_restored.view(), restored);
  CHECK(bit_equal(rest_original, rest_restored));
  CHECK(state.save() == restored.save());
  // restore() into an existing state of the same attention continues as well.
  auto reused = attention.make_state<T>(B);
  reused.restore(bytes);
  CHECK(reused.save() == bytes);
}

TEST_CASE("Lavo: save/restore continues bit-exactly (mid-window, at a border, at 0)") {
  for (index_t split : {0, 1, 17, 18, 29}) {
    CAPTURE(split);
    check_save_restore<float, exec::reference_t>(split);
    check_save_restore<double, exec::reference_t>(split);
    check_save_restore<float, exec::cpu_t>(split);
    check_save_restore<double, exec::cpu_t>(split);
  }
}

TEST_CASE("Lavo state size is independent of the context length") {
  const index_t B = 2, H = 4, d = 16, r = 8, w = 32;
  const Lavo<Causal> attention({.heads = H, .dim = d, .bases = r, .window = w});
  auto state = attention.make_state<float>(B);
  const std::size_t bytes_before = state.bytes();
  CHECK(bytes_before == std::size_t(B * H * (2 * w * d + 3 * r)) * sizeof(float));
  const std::size_t saved_before = state.save().size();
  Rng rng(2105);
  for (index_t n : {10, 3000}) {
    const auto q = random_tensor<float, 4>(rng, {B, n, H, d}, 1.0);
    const auto v = uniform_tensor<float, 4>(rng, {B, n, H, d}, -1, 1);
    Tensor<float, 4> out({B, n, H, d});
    attention.forward(exec::reference, q, q, v, out.view(), state);
    CHECK(all_finite(out));
    CHECK(state.bytes() == bytes_before);
    CHECK(state.save().size() == saved_before);
  }
  CHECK(state.position() == 3010);
}

TEST_CASE("Lavo fp32: a 10^6-token context keeps the memory mean accurate") {
  // w = 1: F_local(s) = v_s exactly, so o_t = (v_t + read(H_t)) / 2 with
  // H_t = (1/t) sum_{s<t} B v_s, summed here in long double from the definition.
  // Values in [0.9, 1] make the sums large: plain fp32 summation of the memory
  // is off by ~5e-4 here; the compensated sum stays at fp32 rounding.
  const index_t Tn = 1000000, chunk = 65536, H = 1, d = 8, r = 4, w = 1;
  const Lavo<Causal> attention({.heads = H, .dim = d, .bases = r, .window = w}, {.basis_seed = 3});
  LavoOracleSpec spec{.causal = true, .window = w, .bases = r,
                      .scale = 1.0L / std::sqrt((long double)d)};
  spec.basis = widen(rounded_to<float>(attention.bases()));
  const std::vector<index_t> checked{1, 1000, 500000, Tn - 2, Tn - 1};
  std::vector<long double> sum(static_cast<std::size_t>(r), 0.0L);  // sum_{s<t} B v_s
  auto state = attention.make_state<float>(1), state_cpu = attention.make_state<float>(1);
  Rng rng(2106);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> offset(0.9, 1.0);
  double worst = 0, worst_cpu = 0, scale = 0;
  for (index_t first = 0; first < Tn; first += chunk) {
    const index_t n = std::min(chunk, Tn - first);
    Tensor<float, 4> q({1, n, H, d}), v({1, n, H, d}), out({1, n, H, d}), out_cpu({1, n, H, d});
    for (index_t i = 0; i < q.size(); ++i) q.data()[i] = static_cast<float>(normal(rng));
    for (index_t i = 0; i < v.size(); ++i) v.data()[i] = static_cast<float>(offset(rng));
    attention.forward(exec::reference, q, q, v, out.view(), state);
    attention.forward(exec::cpu, q, q, v, out_cpu.view(), state_cpu);
    for (index_t j = 0; j < n; ++j) {
      const index_t t = first + j;
      if (std::find(checked.begin(), checked.end(), t) != checked.end()) {
        std::vector<long double> mean(sum), query(static_cast<std::size_t>(d));
        for (long double& m : mean) m /= (long double)t;
        for (index_t e = 0; e < d; ++e) query[e] = q(0, j, 0, e);
        const auto global = lavo_read(spec, 0, mean, query, d);
        for (index_t e = 0; e < d; ++e) {
          const long double expected = ((long double)v(0, j, 0, e) + global[e]) / 2;
          worst = std::max(worst, (double)std::fabs(out(0, j, 0, e) - expected));
          worst_cpu = std::max(worst_cpu, (double)std::fabs(out_cpu(0, j, 0, e) - expected));
          scale = std::max(scale, (double)std::fabs(expected));
        }
      }
      for (index_t i = 0; i < r; ++i)
        for (index_t e = 0; e < d; ++e) sum[i] += spec.basis[i * d + e] * v(0, j, 0, e);
    }
  }
  CHECK(state.position() == Tn);
  CHECK(state_cpu.position() == Tn);
  std::printf("[oracle] Lavo<Causal> 1e6-token context float32 max_rel_error reference=%.3e "
              "cpu=%.3e\n",
              worst / scale, worst_cpu / scale);
  CHECK(worst / scale <= Tolerance<float>::relative);
  CHECK(worst_cpu / scale <= Tolerance<float>::relative);
}

// --------------------------------------------------------------- bad input --

namespace {

constexpr index_t kB = 2, kT = 5, kH = 3, kD = 6, kR = 4, kW = 3;
constexpr LavoDims kDims{.heads = kH, .dim = kD, .bases = kR, .window = kW};

struct Io {
  Tensor<float, 4> q, k, v, out;
  static Io make(index_t batch = kB, index_t time = kT) {
    Rng rng(5);
    return {random_tensor<float, 4>(rng, {batch, time, kH, kD}, 1.0),
            random_tensor<float, 4>(rng, {batch, time, kH, kD}, 1.0),
            uniform_tensor<float, 4>(rng, {batch, time, kH, kD}, -1, 1),
            Tensor<float, 4>({batch, time, kH, kD})};
  }
};

}  // namespace

TEST_CASE("Lavo bad input: dims") {
  CHECK_NOTHROW((void)Lavo<Causal>(kDims));
  auto with = [](auto change) {
    LavoDims dims = kDims;
    change(dims);
    return [dims] { (void)Lavo<Causal>(dims); };
  };
  expect_error(with([](LavoDims& d) { d.heads = 0; }), "dims.heads");
  expect_error(with([](LavoDims& d) { d.dim = 0; }), "dims.dim");
  expect_error(with([](LavoDims& d) { d.bases = 0; }), "dims.bases");
  expect_error(with([](LavoDims& d) { d.window = 0; }), "dims.window", "expected >= 1, given 0");
  expect_error(with([](LavoDims& d) { d.window = -3; }), "dims.window");
  expect_error(with([](LavoDims& d) { d.window = std::numeric_limits<index_t>::max(); }),
               "dims.window", "expected <= 1073741824");
  expect_error(with([](LavoDims& d) { d.bases = kD + 1; }), "dims.bases",
               "expected <= 6, given 7");
  CHECK_NOTHROW(with([](LavoDims& d) { d.bases = kD; })());
  expect_error([] { (void)Lavo<Bidirectional>(LavoDims{}); }, "dims.heads");
}

TEST_CASE("Lavo bad input: bases of the wrong shape or non-finite") {
  const auto good = orthonormal_bases(kH, kR, kD, 1);
  CHECK_NOTHROW((void)Lavo<Causal>(kDims, {.bases = good}));
  expect_error([] { (void)Lavo<Causal>(kDims, {.bases = orthonormal_bases(kH, kR, kD + 1, 1)}); },
               "bases", "expected [3, 4, 6], given [3, 4, 7]");
  expect_error([] { (void)Lavo<Causal>(kDims, {.bases = orthonormal_bases(kH, kR - 1, kD, 1)}); },
               "bases", "shape [H, r, d]");
  expect_error([] { (void)Lavo<Causal>(kDims, {.bases = orthonormal_bases(kH + 1, kR, kD, 1)}); },
               "bases", "given [4, 4, 6]");
  expect_error([] { (void)Lavo<Causal>(kDims, {.bases = Tensor<double, 3>({kR, kD, kH})}); },
               "bases", "given [4, 6, 3]");
  auto nan_basis = good;
  nan_basis(1, 2, 3) = std::numeric_limits<double>::quiet_NaN();
  expect_error([&] { (void)Lavo<Causal>(kDims, {.bases = nan_basis}); }, "bases", "finite");
  auto inf_basis = good;
  inf_basis(0, 0, 0) = std::numeric_limits<double>::infinity();
  expect_error([&] { (void)Lavo<Bidirectional>(kDims, {.bases = inf_basis}); }, "bases", "finite");
}

TEST_CASE("Lavo bad input: relative bias of the wrong length or non-finite") {
  CHECK_NOTHROW((void)Lavo<Causal>(kDims, {.relative_bias = Tensor<double, 2>({kH, 2 * kW - 1})}));
  expect_error(
      [] { (void)Lavo<Causal>(kDims, {.relative_bias = Tensor<double, 2>({kH, 2 * kW})}); },
      "relative_bias", "expected [3, 5], given [3, 6]");
  expect_error(
      [] { (void)Lavo<Causal>(kDims, {.relative_bias = Tensor<double, 2>({kH, kW})}); },
      "relative_bias", "shape [H, 2w - 1]");
  expect_error(
      [] {
        (void)Lavo<Bidirectional>(kDims, {.relative_bias = Tensor<double, 2>({1, 2 * kW - 1})});
      },
      "relative_bias", "given [1, 5]");
  Tensor<double, 2> nan_bias({kH, 2 * kW - 1});
  nan_bias(2, 4) = std::numeric_limits<double>::quiet_NaN();
  expect_error([&] { (void)Lavo<Causal>(kDims, {.relative_bias = nan_bias}); }, "relative_bias",
               "finite");
}

TEST_CASE("Lavo bad input: scale and empty_memory") {
  expect_error(
      [] { (void)Lavo<Causal>(kDims, {.scale = std::numeric_limits<double>::infinity()}); },
      "scale", "finite");
  expect_error([] { (void)Lavo<Causal>(kDims, {.empty_memory = static_cast<LavoEmptyMemory>(9)}); },
               "empty_memory", "given 9");
}

TEST_CASE("Lavo bad input: forward shapes, strides and aliasing") {
  for (int causal = 0; causal < 2; ++causal) {
    auto run = [causal](Io& io) {
      if (causal)
        Lavo<Causal>(kDims).forward(exec::reference, io.q.cview(), io.k.cview(), io.v.cview(),
                                    io.out.view());
      else
        Lavo<Bidirectional>(kDims).forward(exec::reference, io.q.cview(), io.k.cview(),
                                           io.v.cview(), io.out.view());
    };
    Io io = Io::make();
    REQUIRE_NOTHROW(run(io));
    {
      Io bad = Io::make();
      bad.q = Tensor<float, 4>({kB, kT, kH, kD + 1});
      expect_error([&] { run(bad); }, "queries", "[B, T, H, d]");
    }
    {
      Io bad = Io::make();
      bad.k = Tensor<float, 4>({kB, kT, kH, kD - 1});
      expect_error([&] { run(bad); }, "keys", "expected [2, 5, 3, 6], given [2, 5, 3, 5]");
    }
    {
      Io bad = Io::make();
      bad.v = Tensor<float, 4>({kB, kT + 1, kH, kD});
      expect_error([&] { run(bad); }, "values");
    }
    {
      Io bad = Io::make();
      bad.out = Tensor<float, 4>({kB, kT, kH + 1, kD});
      expect_error([&] { run(bad); }, "out");
    }
    {
      Io bad = Io::make();
      bad.q = Tensor<float, 4>({kB, kT, kH + 1, kD});
      expect_error([&] { run(bad); }, "queries", "given [2, 5, 4, 6]");
    }
    // out aliasing an input.
    Io alias = Io::make();
    const Lavo<Causal> attention(kDims);
    expect_error(
        [&] {
          attention.forward(exec::reference, alias.q.cview(), alias.k.cview(), alias.v.cview(),
                            TensorView<float, 4>(const_cast<float*>(alias.v.data()),
                                                 alias.v.extents()));
        },
        "out", "aliases input 'values'");
    // a key view with feature stride 2.
    Tensor<float, 4> wide({kB, kT, kH, 2 * kD});
    const TensorView<const float, 4> strided(wide.data(), {kB, kT, kH, kD},
                                             {kT * kH * 2 * kD, kH * 2 * kD, 2 * kD, 2});
    expect_error(
        [&] {
          attention.forward(exec::reference, alias.q.cview(), strided, alias.v.cview(),
                            alias.out.view());
        },
        "keys", "stride");
  }
}

TEST_CASE("Lavo bad input: T = 0 and B = 0 are no-ops that leave out untouched") {
  const Lavo<Causal> attention(kDims);
  Io io = Io::make(kB, 0);
  CHECK_NOTHROW(attention.forward(exec::reference, io.q.cview(), io.k.cview(), io.v.cview(),
                                  io.out.view()));
  auto state = attention.make_state<float>(kB);
  const auto before = state.save();
  attention.forward(exec::reference, io.q.cview(), io.k.cview(), io.v.cview(), io.out.view(),
                    state);
  CHECK(state.save() == before);
  Io none = Io::make(0, kT);
  none.out.fill(3.0f);
  Lavo<Bidirectional>(kDims).forward(exec::reference, none.q.cview(), none.k.cview(),
                                     none.v.cview(), none.out.view());
  CHECK(none.out.size() == 0);
}

TEST_CASE("Lavo bad input: cross_forward") {
  const Lavo<Bidirectional> attention(kDims);
  Rng rng(6);
  const auto q = random_tensor<float, 4>(rng, {kB, kT, kH, kD}, 1.0);
  const auto source = random_tensor<float, 4>(rng, {kB, 11, kH, kD}, 1.0);
  Tensor<float, 4> out({kB, kT, kH, kD});
  REQUIRE_NOTHROW(attention.cross_forward(exec::reference, q, source, out.view()));
  const auto short_source = random_tensor<float, 4>(rng, {kB, 1, kH, kD}, 1.0);
  CHECK_NOTHROW(attention.cross_forward(exec::reference, q, short_source, out.view()));
  expect_error(
      [&] {
        attention.cross_forward(exec::reference, q, Tensor<float, 4>({kB + 1, 11, kH, kD}),
                                out.view());
      },
      "source", "expected [2, 11, 3, 6], given [3, 11, 3, 6]");
  expect_error(
      [&] {
        attention.cross_forward(exec::reference, q, Tensor<float, 4>({kB, 11, kH, kD + 2}),
                                out.view());
      },
      "source", "[B, Ts, H, d]");
  expect_error(
      [&] {
        attention.cross_forward(exec::reference, Tensor<float, 4>({kB, kT, kH - 1, kD}), source,
                                out.view());
      },
      "queries", "[B, Tq, H, d]");
  Tensor<float, 4> wrong_out({kB, 11, kH, kD});
  expect_error([&] { attention.cross_forward(exec::reference, q, source, wrong_out.view()); },
               "out", "expected [2, 5, 3, 6], given [2, 11, 3, 6]");
  expect_error(
      [&] {
        attention.cross_forward(exec::reference, q, source,
                                TensorView<float, 4>(const_cast<float*>(source.data()),
                                                     {kB, kT, kH, kD}));
      },
      "out", "aliases input 'source'");
  // The causal attention offers the same cross-attention (its queries only read the source).
  CHECK_NOTHROW(Lavo<Causal>(kDims).cross_forward(exec::reference, q, source, out.view()));
}

TEST_CASE("Lavo bad input: step and forward with a foreign or mismatched state") {
  const Lavo<Causal> attention(kDims);
  Rng rng(7);
  const auto q = random_tensor<float, 3>(rng, {kB, kH, kD}, 1.0);
  Tensor<float, 3> out({kB, kH, kD});
  auto state = attention.make_state<float>(kB);
  REQUIRE_NOTHROW(attention.step(exec::reference, state, q, q, q, out.view()));
  CHECK(state.position() == 1);

  LavoState<float> empty;
  expect_error([&] { attention.step(exec::reference, empty, q, q, q, out.view()); }, "state",
               "<empty state>");
  auto other_batch = attention.make_state<float>(kB + 1);
  Io io = Io::make();
  expect_error(
      [&] {
        attention.forward(exec::reference, io.q.cview(), io.k.cview(), io.v.cview(),
                          io.out.view(), other_batch);
      },
      "state", "batch=3");
  for (LavoDims dims : {LavoDims{kH, kD, kR, kW + 1}, LavoDims{kH, kD, kR - 1, kW},
                        LavoDims{kH + 1, kD, kR, kW}}) {
    auto foreign = Lavo<Causal>(dims).make_state<float>(kB);
    expect_error([&] { attention.step(exec::reference, foreign, q, q, q, out.view()); }, "state",
                 "expected");
  }
  expect_error(
      [&] {
        attention.step(exec::reference, state, Tensor<float, 3>({kB, kH, kD + 1}), q, q,
                       out.view());
      },
      "queries", "[B, H, d]");
  expect_error(
      [&] { attention.step(exec::reference, state, q, q, q, Tensor<float, 3>({kB, kH, 1}).view()); },
      "out", "[B, H, d]");
  expect_error(
      [&] {
        attention.step(exec::reference, state, q, q, q,
                       TensorView<float, 3>(const_cast<float*>(q.data()), q.extents()));
      },
      "out", "aliases input 'queries'");
  CHECK(state.position() == 1);  // rejected steps do not advance
  expect_error([&] { (void)attention.make_state<float>(0); }, "batch");
}

TEST_CASE("Lavo bad input: load_state") {
  const Lavo<Causal> attention(kDims);
  auto state = attention.make_state<float>(kB);
  Io io = Io::make();
  attention.forward(exec::reference, io.q.cview(), io.k.cview(), io.v.cview(), io.out.view(),
                    state);
  const auto bytes = state.save();
  REQUIRE_NOTHROW((void)attention.load_state<float>(bytes));
  for (std::size_t n = 0; n < bytes.size(); n += 7) {
    CAPTURE(n);
    expect_error([&] { (void)attention.load_state<float>({bytes.data(), n}); }, "bytes", "");
  }
  auto trailing = bytes;
  trailing.insert(trailing.end() - 4, std::byte{0});  // before the checksum, signed
  expect_error([&] { (void)attention.load_state<float>(resigned(trailing)); }, "bytes",
               "state data bytes");
  expect_error([&] { (void)attention.load_state<double>(bytes); }, "bytes", "float64");
  const Lavo<Causal> wider({.heads = kH, .dim = kD, .bases = kR, .window = kW + 2});
  expect_error([&] { (void)wider.load_state<float>(bytes); }, "bytes", "window=5");
  const SoftmaxAttention<Causal> softmax({.heads = kH, .key_dim = kD, .value_dim = kD});
  expect_error([&] { (void)attention.load_state<float>(softmax.make_state<float>(kB, 8).save()); },
               "bytes", "state kind");
  std::vector<std::byte> garbage(bytes.size(), std::byte{0x5a});
  expect_error([&] { (void)attention.load_state<float>(garbage); }, "bytes", "magic");
  // A rejected restore leaves the state as it was.
  auto target = attention.make_state<float>(kB);
  const auto target_before = target.save();
  expect_error([&] { target.restore({bytes.data(), bytes.size() - 8}); }, "bytes", "");
  CHECK(target.save() == target_before);
}

}  // namespace test_lavo
