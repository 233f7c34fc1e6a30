// Adversarial numerics: logit spreads, the NoStabilizer failure mode, VAPOR at
// large positions, rows of the implied attention summing to one, masked
// latents and zero values.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>

#include "latte/backends/cpu/rotation.hpp"
#include "latte/backends/cpu/run_rotations.hpp"
#include "latte/backends/cpu/simd.hpp"
#include "latte/core/angles.hpp"
#include "oracles/latte_oracle.hpp"
#include "oracles/softmax_oracle.hpp"
#include "support.hpp"

namespace test_numerics {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;

/// [1, T, 1, L] key logits whose latent 0 is the paper's [1, 10, 1000] pattern.
template <class T>
Tensor<T, 4> paper_spread_keys(Rng& rng, index_t L) {
  auto k = random_tensor<T, 4>(rng, {1, 3, 1, L}, 1.0);
  k(0, 0, 0, 0) = 1;
  k(0, 1, 0, 0) = 10;
  k(0, 2, 0, 0) = 1000;
  return k;
}

template <class T, class Stab, class E = exec::reference_t>
Tensor<T, 4> latte_forward(bool causal, const Tensor<T, 4>& q, const Tensor<T, 4>& k,
                           const Tensor<T, 4>& v) {
  Tensor<T, 4> out(v.extents());
  const LatteDims dims{q.extent(2), q.extent(3), v.extent(3)};
  if (causal)
    LatteAttention<Causal, Stab>(dims).forward(E{}, q, k, v, out.view());
  else
    LatteAttention<Bidirectional, Stab>(dims).forward(E{}, q, k, v, out.view());
  return out;
}

template <class T, class E>
void paper_example() {
  Rng rng(401);
  for (index_t L : {1, 4}) {
    const auto q = random_tensor<T, 4>(rng, {1, 3, 1, L}, 1.0);
    const auto k = paper_spread_keys<T>(rng, L);
    const auto v = uniform_tensor<T, 4>(rng, {1, 3, 1, 5}, -1, 1);
    for (bool causal : {true, false}) {
      const auto stable = latte_forward<T, RunningMax, E>(causal, q, k, v);
      CHECK(all_finite(stable));
      CHECK(relative_error(stable, latte_oracle(causal, q, k, v)) <= Tolerance<T>::relative);
      // The ablation: raw exp(1000) overflows and the output is NaN.
      const auto raw = latte_forward<T, NoStabilizer, E>(causal, q, k, v);
      CHECK_FALSE(all_finite(raw));
    }
  }
  // In the causal case the first two rows see only [1] and [1, 10]: p(s|l,t) there
  // must be the exact prefix softmax, which a single global max (1000) would
  // underflow to 0/0. With L = 1 the output is p(s|t) v exactly.
  const Tensor<T, 4> q({1, 3, 1, 1}, T(0));
  const auto k = paper_spread_keys<T>(rng, 1);
  Tensor<T, 4> v({1, 3, 1, 1});
  v(0, 0, 0, 0) = 1;
  v(0, 1, 0, 0) = 2;
  v(0, 2, 0, 0) = 4;
  const auto out = latte_forward<T, RunningMax, E>(true, q, k, v);
  const double w = std::exp(-9.0);  // p(s=0 | t=1) = e^1 / (e^1 + e^10)
  CHECK(double(out(0, 0, 0, 0)) == doctest::Approx(1.0).epsilon(1e-6));
  CHECK(double(out(0, 1, 0, 0)) == doctest::Approx((w * 1 + 2) / (w + 1)).epsilon(1e-6));
  CHECK(double(out(0, 2, 0, 0)) == doctest::Approx(4.0).epsilon(1e-6));
}

template <class T, class E>
void random_spreads() {
  Rng rng(402);
  double worst = 0;
  int cases = 0, overflow_cases = 0;
  const int cases_per_spread = case_count(12);
  for (double spread : {1e3, 3e3, 1e4}) {
    for (int c = 0; c < cases_per_spread; ++c, ++cases) {
      const Shape s = random_shape(rng, 2e6);
      const auto q = uniform_tensor<T, 4>(rng, {s.batch, s.time, s.heads, s.latents},
                                          -spread / 2, spread / 2);
      const auto k = uniform_tensor<T, 4>(rng, {s.batch, s.time, s.heads, s.latents},
                                          -spread / 2, spread / 2);
      const auto v = uniform_tensor<T, 4>(rng, {s.batch, s.time, s.heads, s.value_dim}, -1, 1);
      for (bool causal : {true, false}) {
        const auto out = latte_forward<T, RunningMax, E>(causal, q, k, v);
        REQUIRE(all_finite(out));
        const double error = relative_error(out, latte_oracle(causal, q, k, v));
        CHECK_MESSAGE(error <= Tolerance<T>::relative, "spread " << spread << " case " << c);
        worst = std::max(worst, error);
      }
      // NoStabilizer overflows as soon as one key logit exceeds log(max of T).
      const T k_max = *std::max_element(k.data(), k.data() + k.size());
      if (double(k_max) > std::log(double(std::numeric_limits<T>::max()))) {
        const auto raw = latte_forward<T, NoStabilizer, E>(true, q, k, v);
        CHECK_FALSE(all_finite(raw));
        ++overflow_cases;
      }
    }
  }
  CHECK(overflow_cases >= cases_per_spread);  // the ablation's failure was actually exercised
  std::printf("[spread] Latte RunningMax (%s) %s spreads 1e3..1e4 cases=%d max_rel_error=%.3e; "
              "NoStabilizer non-finite in %d of them\n",
              E::name, dtype_name<T>(), cases, worst, overflow_cases);
}

}  // namespace

namespace {

/// Largest error of the cpu backend's vector exp over `xs`, in units in the
/// last place of the exact result (std::exp in long double, rounded to T; the
/// unit of a subnormal or zero result is the smallest subnormal). Lanes whose
/// exact result overflows T must give inf.
template <class T>
double simd_exp_max_ulp(const std::vector<T>& xs) {
  constexpr auto W = static_cast<index_t>(cpu::simd::width<T>);
  const auto n = static_cast<index_t>(xs.size());
  double worst = 0;
  std::vector<T> lanes(W);
  for (index_t i = 0; i < n; i += W) {
    for (index_t j = 0; j < W; ++j) lanes[j] = xs[std::min(i + j, n - 1)];
    cpu::simd::store(lanes.data(), cpu::simd::exp(cpu::simd::load(lanes.data())));
    for (index_t j = 0; j < W && i + j < n; ++j) {
      const long double exact = std::exp(static_cast<long double>(xs[i + j]));
      const T rounded = static_cast<T>(exact);
      if (std::isinf(rounded)) {
        CHECK_MESSAGE(std::isinf(lanes[j]), "exp(", xs[i + j], ") = ", lanes[j]);
        continue;
      }
      const T unit = rounded < std::numeric_limits<T>::min()
                         ? std::numeric_limits<T>::denorm_min()
                         : std::nextafter(rounded, std::numeric_limits<T>::infinity()) - rounded;
      worst = std::max(worst, static_cast<double>(std::fabs(lanes[j] - exact) / unit));
    }
  }
  return worst;
}

}  // namespace

TEST_CASE_TEMPLATE("cpu exp: within 2 ulp everywhere, subnormal and infinite ends, NaN kept", T,
                   float, double) {
  // Every 4099th float (every 2^40 + 7th double) of magnitude up to past
  // where exp overflows and underflows to 0, both signs.
  const T top = std::is_same_v<T, float> ? T(110) : T(760);
  using Bits = std::conditional_t<std::is_same_v<T, float>, std::uint32_t, std::uint64_t>;
  const Bits stride = std::is_same_v<T, float> ? Bits(4099) : (Bits(1) << 40) + 7;
  std::vector<T> xs;
  for (Bits bits = 0;; bits += stride) {
    T x;
    std::memcpy(&x, &bits, sizeof x);
    if (!(x <= top)) break;
    xs.push_back(x);
    xs.push_back(-x);
  }
  CAPTURE(xs.size());
  const double worst = simd_exp_max_ulp(xs);
  CAPTURE(worst);
  CHECK(worst <= 2.0);  // measured with AVX-512: 1.53 ulp over every float in [-110, 110]
  // The ends: -inf -> 0, +inf -> inf, NaN stays NaN; e^x just below the
  // overflow threshold is finite and the first subnormals are produced.
  const T inf = std::numeric_limits<T>::infinity();
  auto exp_of = [](T x) {
    std::vector<T> lanes(cpu::simd::width<T>, x);
    cpu::simd::store(lanes.data(), cpu::simd::exp(cpu::simd::load(lanes.data())));
    return lanes[0];
  };
  CHECK(exp_of(-inf) == T(0));
  CHECK(exp_of(inf) == inf);
  CHECK(std::isnan(exp_of(std::numeric_limits<T>::quiet_NaN())));
  CHECK(exp_of(T(0)) == T(1));
  CHECK(exp_of(-T(0)) == T(1));
  CHECK(std::isfinite(exp_of(std::nextafter(std::log(std::numeric_limits<T>::max()), T(0)))));
  std::vector<T> subnormal_args{std::log(std::numeric_limits<T>::min()) - T(2)};
  CHECK(simd_exp_max_ulp(subnormal_args) <= 2.0);
}

TEST_CASE_TEMPLATE(
    "cpu reduce_add_each / reduce_max_each: lane j has the bits of batch j's reduction", T, float,
    double) {
  // The batched softmax stage (latent_softmax_exps) reduces a whole group of
  // rows with one transposing tree; the decode step reduces its one row with
  // reduce_add / reduce_max. Their bits must agree, and lanes whose
  // magnitudes span 2^-40 .. 2^40 make every misplaced pair show.
  constexpr std::size_t W = cpu::simd::width<T>;
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> exponent(-40.0, 40.0);
  std::bernoulli_distribution negative(0.5);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<T> lanes(W * W);
    for (T& x : lanes) x = T((negative(rng) ? -1.0 : 1.0) * std::exp2(exponent(rng)));
    if (trial % 7 == 0) lanes[trial % (W * W)] = -std::numeric_limits<T>::infinity();
    std::vector<cpu::simd::batch<T>> rows;
    for (std::size_t j = 0; j < W; ++j) rows.push_back(cpu::simd::load(lanes.data() + j * W));
    std::vector<T> sums(W), maxima(W);
    cpu::simd::store(sums.data(), cpu::simd::reduce_add_each(rows.data()));
    cpu::simd::store(maxima.data(), cpu::simd::reduce_max_each(rows.data()));
    for (std::size_t j = 0; j < W; ++j) {
      CAPTURE(trial);
      CAPTURE(j);
      const T one_sum = cpu::simd::reduce_add(rows[j]);
      CHECK(std::memcmp(&sums[j], &one_sum, sizeof(T)) == 0);
      CHECK(maxima[j] == *std::max_element(lanes.begin() + j * W, lanes.begin() + (j + 1) * W));
      // and the sum is a sum: within W rounding errors of the exact one
      long double exact = 0, magnitude = 0;
      for (std::size_t i = 0; i < W; ++i) {
        exact += lanes[j * W + i];
        magnitude += std::fabs(static_cast<long double>(lanes[j * W + i]));
      }
      if (std::isfinite(static_cast<double>(exact)))
        CHECK(std::fabs(static_cast<double>(sums[j] - exact)) <=
              double(W) * std::numeric_limits<T>::epsilon() * static_cast<double>(magnitude));
    }
  }
}

TEST_CASE_TEMPLATE("cpu vector tails: load_first / store_first touch the first n lanes only",
                   T, float, double) {
  // Rows whose length is not a multiple of the width end in a masked vector
  // (simd::for_each_vector, for_each_vector_group): lanes past n read `fill`,
  // and nothing at or past p + n is written.
  namespace simd = cpu::simd;
  constexpr index_t W = static_cast<index_t>(simd::width<T>);
  const T guard = T(-7.25), fill = T(3.5);
  for (index_t n = 0; n <= W; ++n) {
    CAPTURE(n);
    std::vector<T> in(static_cast<std::size_t>(2 * W), guard), out(in.size(), guard), lanes(in.size());
    for (index_t i = 0; i < n; ++i) in[static_cast<std::size_t>(i)] = T(i + 1);
    simd::store(lanes.data(), simd::load_first(in.data(), n, fill));
    for (index_t i = 0; i < W; ++i) CHECK(lanes[std::size_t(i)] == (i < n ? T(i + 1) : fill));
    simd::store_first(out.data(), simd::load(in.data()), n);
    for (index_t i = 0; i < 2 * W; ++i) CHECK(out[std::size_t(i)] == (i < n ? T(i + 1) : guard));
  }
  // The groups of for_each_vector_group<T, 3> cover [0, n) once, in order: whole
  // groups of 3 vectors, then one of ceil(rest / W) vectors ending in `last` lanes.
  for (index_t n = 0; n <= 7 * W; ++n) {
    CAPTURE(n);
    index_t covered = 0;
    bool tail_seen = false;
    simd::for_each_vector_group<T, 3>(n, [&](index_t i, index_t last, auto vectors, auto tail) {
      CHECK(i == covered);
      CHECK(!tail_seen);
      CHECK(last >= 1);
      CHECK(last <= W);
      CHECK((tail.value || (vectors.value == 3 && last == W)));
      covered += (vectors.value - 1) * W + last;
      tail_seen = tail.value;
    });
    CHECK(covered == n);
  }
}

TEST_CASE("Key logits [1, 10, 1000]: RunningMax exact, NoStabilizer overflows") {
  paper_example<float, exec::reference_t>();
  paper_example<double, exec::reference_t>();
  paper_example<float, exec::cpu_t>();
  paper_example<double, exec::cpu_t>();
}

TEST_CASE("Logit spreads up to 1e4 stay finite and exact") {
  random_spreads<float, exec::reference_t>();
  random_spreads<double, exec::reference_t>();
  random_spreads<float, exec::cpu_t>();
  random_spreads<double, exec::cpu_t>();
}

/// The oracle for rotation_cos_sin: position * theta and its reduction in
/// 80-bit long double, every product exact inside a long double fma, with 2pi
/// in four chunks of <= 32 bits (Cody and Waite); slow (software fmal) but
/// independent of the double-fma algorithm under test.
long double oracle_reduced_angle(std::int64_t position, double theta) {
  constexpr long double chunk1 = 0x1.921fb544p+2L, chunk2 = 0x1.0b4611a6p-32L,
                        chunk3 = 0x1.3198a2ep-67L, chunk4 = 0x1.b839a252049c1p-102L;
  const auto n = static_cast<long double>(position);
  const auto th = static_cast<long double>(theta);
  const long double product = n * th;
  const long double product_error = std::fma(n, th, -product);
  const long double k = std::nearbyint(product / (chunk1 + chunk2));
  long double reduced = std::fma(-k, chunk1, product);
  reduced = std::fma(-k, chunk2, reduced);
  reduced = std::fma(-k, chunk3, reduced);
  return std::fma(-k, chunk4, reduced) + product_error;
}

TEST_CASE("rotation_cos_sin: reduced angles accurate to positions 2^40 (and any int64)") {
  Rng rng(23);
  std::uniform_int_distribution<int> magnitude(0, 40);
  std::uniform_int_distribution<int> pair(0, 31);
  double worst = 0;
  for (int i = 0; i < 20000; ++i) {
    const int bits = magnitude(rng);
    std::int64_t position = std::uniform_int_distribution<std::int64_t>(
        0, (std::int64_t{1} << bits))(rng);
    if (i % 5 == 0) position = -position;
    const double theta = std::pow(10000.0, -2.0 * pair(rng) / 64.0);  // RoPE / VAPOR schedule
    const long double angle = oracle_reduced_angle(position, theta);
    const CosSin got = rotation_cos_sin(position, theta);
    worst = std::max({worst, (double)std::fabs(got.cos - std::cos(angle)),
                      (double)std::fabs(got.sin - std::sin(angle))});
  }
  INFO("worst |cos/sin - oracle| up to 2^40: " << worst);
  CHECK(worst <= 1e-15);
  // Beyond 2^40 the product no longer fits the oracle's precision either; the
  // values stay finite and on the unit circle for every int64 and finite theta.
  for (const std::int64_t position : {std::numeric_limits<std::int64_t>::max(),
                                      std::numeric_limits<std::int64_t>::min(),
                                      std::int64_t{1} << 53, (std::int64_t{1} << 62) + 12345}) {
    for (const double theta : {0.5, 1e300, 1e308, std::numeric_limits<double>::max()}) {
      INFO("position " << position << ", theta " << theta);
      const CosSin got = rotation_cos_sin(position, theta);  // fuzzer: 1e300 gave NaN
      CHECK(std::isfinite(got.cos));
      CHECK(std::fabs(got.cos * got.cos + got.sin * got.sin - 1.0) <= 1e-15);
    }
  }
}

TEST_CASE_TEMPLATE(
    "cpu RotationStepper + rotate_pairs: R^{+p} and R^{-p} of a row against the oracle's angles",
    T, float, double) {
  // The stepper's interleaved rows advance by complex multiplication between
  // exact anchors (every 1024 steps in fp32, 64 in fp64); rotate_pairs applies
  // them with a pair swap. 2500 steps from position 10^6 - 3 cross several
  // anchors; n = 13 and 33 leave an odd last value (copied as it is) and a
  // tail past the last whole vector.
  for (const index_t n : {2, 13, 33, 64}) {
    const index_t pairs = n / 2;
    std::vector<double> theta(static_cast<std::size_t>(pairs));
    for (index_t i = 0; i < pairs; ++i) theta[i] = std::pow(10000.0, -2.0 * double(i) / double(n));
    const std::int64_t start = 999'997;
    cpu::RotationStepper<T> stepper(pairs);
    stepper.seek(theta.data(), start);
    Rng rng(31 + n);
    std::normal_distribution<double> normal(0.0, 1.0);
    double worst = 0;  // in units of the type's epsilon times the pair's magnitude
    for (int step = 0; step < 2500; ++step) {
      const std::int64_t position = start + step;
      REQUIRE(stepper.position() == position);
      std::vector<T> row(static_cast<std::size_t>(n)), forward(row.size()), inverse(row.size());
      for (T& x : row) x = T(normal(rng));
      cpu::rotate_pairs<true>(row.data(), forward.data(), stepper.cos_row(), stepper.sin_row(), n);
      cpu::rotate_pairs<false>(row.data(), inverse.data(), stepper.cos_row(), stepper.sin_row(), n);
      for (index_t i = 0; i < pairs; ++i) {
        const long double angle = oracle_reduced_angle(position, theta[i]);
        const long double c = std::cos(angle), sn = std::sin(angle);
        const long double x = row[2 * i], y = row[2 * i + 1];
        const double scale = double(std::fabs(x) + std::fabs(y)) * std::numeric_limits<T>::epsilon();
        worst = std::max({worst, double(std::fabs(forward[2 * i] - (c * x - sn * y))) / scale,
                          double(std::fabs(forward[2 * i + 1] - (sn * x + c * y))) / scale,
                          double(std::fabs(inverse[2 * i] - (c * x + sn * y))) / scale,
                          double(std::fabs(inverse[2 * i + 1] - (c * y - sn * x))) / scale});
      }
      if (n % 2 == 1) {
        CHECK(forward[n - 1] == row[n - 1]);
        CHECK(inverse[n - 1] == row[n - 1]);
      }
      stepper.next();
    }
    // fp32: the rows are the rounded exact values (the double drift, ~1e-13
    // after 1024 steps, is far below fp32's epsilon), so the two products and
    // a sum cost about one epsilon. fp64: up to 63 steps of drift since the
    // last anchor, measured ~15 epsilon (3e-15); the bound leaves 2x.
    const double bound = std::is_same_v<T, float> ? 2.0 : 32.0;
    INFO("n = " << n << ", worst error " << worst << " eps * (|x| + |y|)");
    CHECK(worst <= bound);
  }
}

TEST_CASE_TEMPLATE("cpu RunRotations: rows of runs of positions against the oracle's angles", T,
                   float, double) {
  // Each row is a base rotation (moved in double by whole runs, exact again
  // every 64 runs in fp32 / 4 in fp64) times an offset (j theta, j < 16), both
  // rounded to T and multiplied in T. Runs of 16 cross many anchors; a short
  // run re-anchors; seeks that bring the same angles and position again reuse
  // the kept offsets and base, and other angles replace them.
  constexpr index_t run = 16;
  for (const index_t pairs : {1, 6, 32}) {
    std::vector<double> theta(static_cast<std::size_t>(pairs)), other(theta.size());
    for (index_t i = 0; i < pairs; ++i) {
      theta[i] = std::pow(10000.0, -2.0 * double(i) / double(2 * pairs));
      other[i] = 0.7 + 0.3 * double(i);
    }
    const index_t width = 2 * pairs;
    cpu::RunRotations<T> rotations(pairs, run);
    std::vector<T> cos_rows(static_cast<std::size_t>(run * width)), sin_rows(cos_rows.size());
    double worst = 0;  // in units of the type's epsilon
    auto check_runs = [&](const std::vector<double>& angles, std::int64_t start,
                          const std::vector<index_t>& lengths) {
      rotations.seek(angles.data(), start);
      std::int64_t position = start;
      for (const index_t n : lengths) {
        REQUIRE(rotations.position() == position);
        rotations.fill(n, cos_rows.data(), sin_rows.data(), width);
        for (index_t j = 0; j < n; ++j)
          for (index_t i = 0; i < pairs; ++i) {
            const long double angle = oracle_reduced_angle(position + j, angles[i]);
            const long double c = std::cos(angle), sn = std::sin(angle);
            const T* cos_row = cos_rows.data() + j * width;
            const T* sin_row = sin_rows.data() + j * width;
            const long double error = std::max({std::fabs(cos_row[2 * i] - c),
                                                std::fabs(cos_row[2 * i + 1] - c),
                                                std::fabs(sin_row[2 * i] + sn),
                                                std::fabs(sin_row[2 * i + 1] - sn)});
            worst = std::max(worst, double(error) / std::numeric_limits<T>::epsilon());
          }
        position += n;
      }
    };
    std::vector<index_t> lengths(150, run);  // 2400 positions
    lengths.insert(lengths.begin() + 70, 5);  // a short run inside
    check_runs(theta, 999'997, lengths);
    check_runs(theta, 999'997, {run, run, 3});  // the same seek again (kept base)
    check_runs(theta, 12, {run, 7});            // same angles, another position
    check_runs(other, 12, {run, run});          // other angles
    check_runs(theta, 999'997, {run, run});     // back to the first
    // fp32: base and offset each rounded to fp32, then two products and a sum:
    // measured 1.0 epsilon. fp64: an offset is up to 15 products of the
    // one-position rotation and the base up to 3 run products past its anchor:
    // measured 16 epsilon (3.6e-15; the RotationStepper above drifts as far).
    // The bounds leave 2x.
    const double bound = std::is_same_v<T, float> ? 2.0 : 32.0;
    std::printf("[rotation] RunRotations %s pairs=%ld worst row error %.2f eps (bound %.0f)\n",
                dtype_name<T>(), static_cast<long>(pairs), worst, bound);
    CHECK(worst <= bound);
  }
}

TEST_CASE("VAPOR at positions up to 1e7 in float32 matches float64 and the oracle") {
  Rng rng(403);
  const index_t B = 1, Tn = 40, H = 2, L = 6, Dv = 16;
  const auto q64 = random_tensor<double, 4>(rng, {B, Tn, H, L}, 2.0);
  const auto k64 = random_tensor<double, 4>(rng, {B, Tn, H, L}, 2.0);
  const auto v64 = uniform_tensor<double, 4>(rng, {B, Tn, H, Dv}, -1, 1);
  Tensor<float, 4> q32(q64.extents()), k32(k64.extents()), v32(v64.extents());
  for (index_t i = 0; i < q64.size(); ++i) q32.data()[i] = float(q64.data()[i]);
  for (index_t i = 0; i < k64.size(); ++i) k32.data()[i] = float(k64.data()[i]);
  for (index_t i = 0; i < v64.size(); ++i) v32.data()[i] = float(v64.data()[i]);
  // Angles up to 1 rad per step: at 1e7 the angle is ~1e7 rad, where a float32
  // product position*theta would be off by whole radians.
  VAPOR::Params params;
  params.angles = uniform_tensor<double, 2>(rng, {H, Dv / 2}, 0.01, 1.0);
  std::vector<long double> angles;
  for (index_t i = 0; i < params.angles.size(); ++i) angles.push_back(params.angles.data()[i]);
  const LatteAttention<Causal, RunningMax, VAPOR> attention({H, L, Dv}, params);
  const auto oracle = latte_oracle(true, q32, k32, v32, angles);
  auto run = [&](auto e) {
  for (std::int64_t first : {std::int64_t{0}, std::int64_t{1'000'003}, std::int64_t{9'999'960}}) {
    auto state32 = attention.make_state<float>(B, first);
    auto state64 = attention.make_state<double>(B, first);
    Tensor<float, 4> out32(v32.extents());
    Tensor<double, 4> out64(v64.extents());
    attention.forward(e, q32, k32, v32, out32.view(), state32);
    attention.forward(e, q64, k64, v64, out64.view(), state64);
    CHECK(state32.position() == first + Tn);
    const double error = relative_error(out32, oracle);
    CHECK_MESSAGE(error <= Tolerance<float>::relative, "first position " << first);
    TensorLD<4> as_ld(out64.extents());
    for (index_t i = 0; i < out64.size(); ++i) as_ld.data()[i] = out64.data()[i];
    CHECK(relative_error(out32, as_ld) <= Tolerance<float>::relative);
    std::printf("[vapor] (%s) positions %lld..%lld float32 vs oracle max_rel_error=%.3e\n",
                decltype(e)::name, static_cast<long long>(first),
                static_cast<long long>(first + Tn), error);
  }
  };
  run(exec::reference);
  run(exec::cpu);
}

/// With one-hot values v_s = e_s (Dv = T), output row t is row t of the implied
/// attention matrix: it must match the oracle matrix, be zero above the
/// diagonal when causal, and sum to 1.
template <class T, class E>
void implied_rows(bool causal) {
  Rng rng(404);
  for (index_t Tn : {1, 2, 17, 61}) {
    for (index_t L : {1, 7}) {
      const auto q = random_tensor<T, 4>(rng, {1, Tn, 1, L}, 3.0);
      const auto k = random_tensor<T, 4>(rng, {1, Tn, 1, L}, 3.0);
      Tensor<T, 4> one_hot({1, Tn, 1, Tn}, T(0));
      for (index_t s = 0; s < Tn; ++s) one_hot(0, s, 0, s) = 1;
      const auto rows = latte_forward<T, RunningMax, E>(causal, q, k, one_hot);
      const auto matrix = latte_attention_matrix(causal, q, k, 0, 0);
      for (index_t t = 0; t < Tn; ++t) {
        double total = 0;
        for (index_t s = 0; s < Tn; ++s) {
          total += rows(0, t, 0, s);
          CHECK(std::fabs(double(rows(0, t, 0, s)) - double(matrix[t * Tn + s])) <=
                Tolerance<T>::relative);
          if (causal && s > t) CHECK(rows(0, t, 0, s) == T(0));
        }
        CHECK(std::fabs(total - 1.0) <= Tolerance<T>::relative);
      }
    }
  }
}

TEST_CASE("Rows of the implied attention matrix sum to 1") {
  implied_rows<float, exec::reference_t>(true);
  implied_rows<float, exec::reference_t>(false);
  implied_rows<double, exec::reference_t>(true);
  implied_rows<double, exec::reference_t>(false);
  implied_rows<float, exec::cpu_t>(true);
  implied_rows<float, exec::cpu_t>(false);
  implied_rows<double, exec::cpu_t>(true);
  implied_rows<double, exec::cpu_t>(false);
}

TEST_CASE("Softmax rows sum to 1 and large scores stay finite") {
  Rng rng(405);
  const index_t Tn = 33;
  auto q = random_tensor<float, 4>(rng, {1, Tn, 1, 4}, 30.0);  // scores up to ~1e3
  auto k = random_tensor<float, 4>(rng, {1, Tn, 1, 4}, 30.0);
  Tensor<float, 4> one_hot({1, Tn, 1, Tn}, 0.f);
  for (index_t s = 0; s < Tn; ++s) one_hot(0, s, 0, s) = 1;
  for (const bool use_cpu : {false, true}) {
  Tensor<float, 4> rows(one_hot.extents());
  if (use_cpu)
    SoftmaxAttention<Causal>({1, 4, Tn}).forward(exec::cpu, q, k, one_hot, rows.view());
  else
    SoftmaxAttention<Causal>({1, 4, Tn}).forward(exec::reference, q, k, one_hot, rows.view());
  REQUIRE(all_finite(rows));
  CHECK(relative_error(rows, softmax_oracle({.causal = true}, 0.5L, q, k, one_hot)) <=
        Tolerance<float>::relative);
  for (index_t t = 0; t < Tn; ++t) {
    double total = 0;
    for (index_t s = 0; s < Tn; ++s) total += rows(0, t, 0, s);
    CHECK(std::fabs(total - 1.0) <= Tolerance<float>::relative);
  }
  }
}

TEST_CASE_TEMPLATE("Masked latents (-inf logits) follow the documented convention", E,
                   exec::reference_t, exec::cpu_t) {
  constexpr double inf = std::numeric_limits<double>::infinity();
  Rng rng(406);
  const index_t Tn = 23, L = 5, Dv = 4;
  auto q = random_tensor<double, 4>(rng, {1, Tn, 1, L}, 2.0);
  auto k = random_tensor<double, 4>(rng, {1, Tn, 1, L}, 2.0);
  const auto v = uniform_tensor<double, 4>(rng, {1, Tn, 1, Dv}, -1, 1);
  for (index_t t = 0; t < Tn; ++t) {
    k(0, t, 0, 1) = -inf;              // latent 1: never any key mass
    if (t < 10) k(0, t, 0, 2) = -inf;  // latent 2: empty until t = 10
    if (t % 3 == 0) q(0, t, 0, 3) = -inf;  // the query ignores latent 3 sometimes
  }
  for (index_t l = 0; l < L; ++l) q(0, 7, 0, l) = -inf;  // query 7 ignores every latent
  for (bool causal : {true, false}) {
    const auto out = latte_forward<double, RunningMax, E>(causal, q, k, v);
    REQUIRE(all_finite(out));
    CHECK(relative_error(out, latte_oracle(causal, q, k, v)) <= Tolerance<double>::relative);
    for (index_t d = 0; d < Dv; ++d) CHECK(out(0, 7, 0, d) == 0.0);
  }
}

TEST_CASE_TEMPLATE("All-zero values give exactly zero output", E, exec::reference_t,
                   exec::cpu_t) {
  Rng rng(407);
  const auto q = random_tensor<float, 4>(rng, {2, 31, 3, 7}, 5.0);
  const auto k = random_tensor<float, 4>(rng, {2, 31, 3, 7}, 5.0);
  const Tensor<float, 4> v({2, 31, 3, 6}, 0.f);
  for (bool causal : {true, false}) {
    const auto out = latte_forward<float, RunningMax, E>(causal, q, k, v);
    for (index_t i = 0; i < out.size(); ++i) CHECK(out.data()[i] == 0.f);
  }
}

}  // namespace test_numerics
