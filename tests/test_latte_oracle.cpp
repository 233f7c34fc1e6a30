// Latte (reference backend) against the explicit T x T oracle on >= 200 random
// shapes per direction, positional policy and dtype.
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <numbers>

#include "oracles/latte_oracle.hpp"
#include "support.hpp"

#if LATTE_WITH_OPENMP
#include <omp.h>
#endif

namespace test_latte_oracle {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;

constexpr int kCases = 200;

/// The angles a VAPOR attention was given, as long double for the oracle; the
/// default schedule is recomputed here from its definition base^(-2i/Dv).
std::vector<long double> oracle_angles(const Tensor<double, 2>& given, index_t H, index_t Dv) {
  const index_t pairs = Dv / 2;
  std::vector<long double> angles(static_cast<std::size_t>(H * pairs));
  for (index_t h = 0; h < H; ++h)
    for (index_t i = 0; i < pairs; ++i)
      angles[h * pairs + i] = given.size() ? (long double)given(h, i)
                                           : std::pow(10000.0L, -2.0L * i / (long double)Dv);
  return angles;
}

template <class T, class Dir, class Pos>
void run_oracle_cases(const char* label, std::uint64_t seed) {
  Rng rng(seed);
  double worst_reference = 0, worst_cpu = 0;
  long long elements = 0;
  const int cases_run = case_count(kCases);
  for (int c = 0; c < cases_run; ++c) {
    const Shape s = random_shape(rng);
    const double logit_scale = pick(rng, std::array{0.5, 2.0, 6.0});
    const auto q = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, s.latents}, logit_scale);
    const auto k = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, s.latents}, logit_scale);
    const auto v = uniform_tensor<T, 4>(rng, {s.batch, s.time, s.heads, s.value_dim}, -1, 1);
    typename Pos::Params params{};
    std::vector<long double> angles;
    if constexpr (Pos::rotates_values) {
      if (c % 2 == 1) {  // half the cases: learned-looking angles in (0, pi)
        params.angles = uniform_tensor<double, 2>(rng, {s.heads, s.value_dim / 2}, 0.0,
                                                  std::numbers::pi);
      }
      angles = oracle_angles(params.angles, s.heads, s.value_dim);
    }
    const LatteAttention<Dir, RunningMax, Pos> attention(
        {.heads = s.heads, .latents = s.latents, .value_dim = s.value_dim}, params);
    const auto oracle = latte_oracle(Dir::is_causal, q, k, v, angles);
    Tensor<T, 4> out(v.extents()), out_cpu(v.extents());
    attention.forward(exec::reference, q, k, v, out.view());
    attention.forward(exec::cpu, q, k, v, out_cpu.view());
    const double error = relative_error(out, oracle), error_cpu = relative_error(out_cpu, oracle);
    CHECK_MESSAGE(std::max(error, error_cpu) <= Tolerance<T>::relative,
                  label << " case " << c << " B=" << s.batch << " T=" << s.time
                        << " H=" << s.heads << " L=" << s.latents << " Dv=" << s.value_dim
                        << " reference error=" << error << " cpu error=" << error_cpu);
    worst_reference = std::max(worst_reference, error);
    worst_cpu = std::max(worst_cpu, error_cpu);
    elements += out.size();
  }
  std::printf("[oracle] %-44s %s cases=%d elements=%lld max_rel_error reference=%.3e "
              "cpu=%.3e (tol %.0e)\n",
              label, dtype_name<T>(), cases_run, elements, worst_reference, worst_cpu,
              Tolerance<T>::relative);
}

}  // namespace

TEST_CASE("Latte causal == oracle (float, double)") {
  run_oracle_cases<float, Causal, NoPositional>("LatteAttention<Causal>", 101);
  run_oracle_cases<double, Causal, NoPositional>("LatteAttention<Causal>", 102);
}
TEST_CASE("Latte bidirectional == oracle (float, double)") {
  run_oracle_cases<float, Bidirectional, NoPositional>("LatteAttention<Bidirectional>", 103);
  run_oracle_cases<double, Bidirectional, NoPositional>("LatteAttention<Bidirectional>", 104);
}
TEST_CASE("Latte causal VAPOR == oracle (float, double)") {
  run_oracle_cases<float, Causal, VAPOR>("LatteAttention<Causal,RunningMax,VAPOR>", 105);
  run_oracle_cases<double, Causal, VAPOR>("LatteAttention<Causal,RunningMax,VAPOR>", 106);
}
TEST_CASE("Latte bidirectional VAPOR == oracle (float, double)") {
  run_oracle_cases<float, Bidirectional, VAPOR>("LatteAttention<Bidirectional,RunningMax,VAPOR>",
                                                107);
  run_oracle_cases<double, Bidirectional, VAPOR>("LatteAttention<Bidirectional,RunningMax,VAPOR>",
                                                 108);
}

// The cpu causal scan works in runs of 16 tokens (each run's latent stage,
// then its memory passes), four tokens per pass while no running max moves
// (two pairs when one does, then a pair and a single token at a run's end)
// and splits Dv into register blocks of 2 vectors, the last block of 1 or 2
// ending in a masked vector (as the L-wide stages end in one: L = 37).
// The random shapes above have Dv in {1, 5, 64} only; these widths reach every
// block remainder for float (16 lanes) and double (8 lanes) under AVX-512 and
// AVX2, at lengths that end a run on each of the quad, pair and single paths
// (first run or a later one), with keys scaled so that maxima move almost
// never or often (rescaling quads; the reference moves only when a key passes
// it by more than 8, and with keys rising by 400 it must, or fp32 overflows),
// without and with VAPOR (rotations in rows per run of positions,
// run_rotations.hpp). A scaled run (sanitizers) takes every shape with one
// of these six variants, rotating (variant_runs, support.hpp).
TEST_CASE_TEMPLATE("Latte causal cpu == oracle at every register-block remainder", T, float,
                   double) {
  Rng rng(109);
  double worst = 0;
  int cases = 0;
  int shape = 0;
  for (const index_t Dv : {8, 16, 24, 40, 72})
    for (const index_t L : {3, 37, 64})
      for (const index_t Tn : {1, 2, 3, 4, 5, 6, 7, 13, 16, 17, 18, 19, 35, 301}) {
        ++shape;
        for (int variant = 0; variant < 6; ++variant) {
          if (!variant_runs(shape, variant, 6)) continue;
          const double key_scale = std::array{0.1, 8.0, 400.0}[variant / 2];
          const bool vapor = variant % 2 == 1;
          const auto q = random_tensor<T, 4>(rng, {1, Tn, 2, L}, 2.0);
          // 400: keys of scale 8 that also rise by 400 logits over the sequence.
          auto k = random_tensor<T, 4>(rng, {1, Tn, 2, L}, std::min(key_scale, 8.0));
          if (key_scale == 400.0)
            for (index_t t = 0; t < Tn; ++t)
              for (index_t h = 0; h < 2; ++h)
                for (index_t l = 0; l < L; ++l)
                  k(0, t, h, l) += T(key_scale * double(t) / double(Tn));
          const auto v = uniform_tensor<T, 4>(rng, {1, Tn, 2, Dv}, -1, 1);
          const LatteDims dims{.heads = 2, .latents = L, .value_dim = Dv};
          Tensor<T, 4> out(v.extents());
          std::vector<long double> angles;
          if (vapor) {
            LatteAttention<Causal, RunningMax, VAPOR>(dims).forward(exec::cpu, q, k, v,
                                                                    out.view());
            angles = oracle_angles({}, 2, Dv);
          } else {
            LatteAttention<Causal>(dims).forward(exec::cpu, q, k, v, out.view());
          }
          const double error = relative_error(out, latte_oracle(true, q, k, v, angles));
          CHECK_MESSAGE(error <= Tolerance<T>::relative,
                        "T=" << Tn << " L=" << L << " Dv=" << Dv << " key scale " << key_scale
                             << (vapor ? " VAPOR" : "") << " error=" << error);
          worst = std::max(worst, error);
          ++cases;
        }
      }
  std::printf("[oracle] Latte causal cpu register-block remainders %s cases=%d max_rel_error=%.3e\n",
              dtype_name<T>(), cases, worst);
}

// The cpu bidirectional pass works in blocks of 64 tokens: a latent's shift
// is set from the first block's column maximum and moves (rescaling what was
// summed before and taking the block's exponentials again) only when a later
// block's maximum passes it by more than 8; its contractions run in register
// tiles of 4 latents / 4 rows by 4 vectors, the last tile of 1 to 4 vectors
// ending in a masked one. With fewer heads than threads each head's sequence
// is cut into segments of whole blocks whose sums are merged. These cases
// reach each tile remainder (L mod 4, Dv past the last whole tile in 1 to 4
// vectors, odd Dv = 57 among them, T mod 4 and mod 64), each key-column group
// remainder (L = 20, 63) and each way the key pass copies the value rows (L below one vector,
// in a one-vector and in a four-vector column group) for float and double,
// with keys that rise along the sequence by 8 logits (the maximum moves in
// every block, the shift lags it) or by 400 (the shift moves in every block:
// without the move, fp32 overflows), keys that fall (the first block holds
// the maximum), and the NoStabilizer form (shift 0); every later segment
// holds a larger maximum when keys rise. With 3 threads, one head runs as 3
// segments (VAPOR seeks its rotation at each) and two as one segment each;
// a worker's first two (head, block) items copy their values apart, the
// rest in the key pass. A scaled run takes every shape with one of the five
// key variants, rotating.
TEST_CASE_TEMPLATE("Latte bidirectional cpu == oracle across blocks, segments and tile remainders",
                   T, float, double) {
#if LATTE_WITH_OPENMP
  const int threads_before = omp_get_max_threads();
  omp_set_num_threads(3);
#endif
  Rng rng(110);
  double worst = 0;
  int cases = 0;
  int shape = 0;
  for (const index_t Dv : {2, 8, 16, 24, 40, 57, 72})
    for (const index_t L : {1, 3, 6, 20, 63, 64})
      for (const index_t Tn : {1, 3, 5, 63, 64, 65, 130, 301}) {
        ++shape;
        for (int keys = 0; keys < 5; ++keys) {  // rising by 8 / 400, falling, NoStabilizer, VAPOR
          if (!variant_runs(shape, keys, 5) || (keys == 4 && Dv % 2 == 1)) continue;
          const index_t H = 1 + cases % 2;
          const auto q = random_tensor<T, 4>(rng, {1, Tn, H, L}, 2.0);
          auto k = random_tensor<T, 4>(rng, {1, Tn, H, L}, 1.0);
          if (keys < 3) {  // a drift across the sequence
            const double drift = std::array{8.0, 400.0, -8.0}[keys];
            for (index_t t = 0; t < Tn; ++t)
              for (index_t h = 0; h < H; ++h)
                for (index_t l = 0; l < L; ++l) k(0, t, h, l) += T(drift * double(t) / double(Tn));
          }
          const auto v = uniform_tensor<T, 4>(rng, {1, Tn, H, Dv}, -1, 1);
          const LatteDims dims{.heads = H, .latents = L, .value_dim = Dv};
          Tensor<T, 4> out(v.extents());
          std::vector<long double> angles;
          if (keys < 3) {
            LatteAttention<Bidirectional>(dims).forward(exec::cpu, q, k, v, out.view());
          } else if (keys == 3) {
            LatteAttention<Bidirectional, NoStabilizer>(dims).forward(exec::cpu, q, k, v,
                                                                      out.view());
          } else {
            LatteAttention<Bidirectional, RunningMax, VAPOR>(dims).forward(exec::cpu, q, k, v,
                                                                           out.view());
            angles = oracle_angles({}, H, Dv);
          }
          const double error = relative_error(out, latte_oracle(false, q, k, v, angles));
          CHECK_MESSAGE(error <= Tolerance<T>::relative,
                        "T=" << Tn << " H=" << H << " L=" << L << " Dv=" << Dv << " keys "
                             << keys << " error=" << error);
          worst = std::max(worst, error);
          ++cases;
        }
      }
#if LATTE_WITH_OPENMP
  omp_set_num_threads(threads_before);
#endif
  std::printf("[oracle] Latte bidirectional cpu blocks, segments and tile remainders %s cases=%d "
              "max_rel_error=%.3e\n",
              dtype_name<T>(), cases, worst);
}

}  // namespace test_latte_oracle
