// Latte on exec::cuda against the explicit long-double oracle (tests/oracles):
// random shapes (T = 1, primes, 1000; H, L, Dv odd and even), causal and
// bidirectional, with and without VAPOR, fp32 / fp16 / bf16 inputs; the
// adversarial inputs of tests/test_numerics.cpp; shapes whose kernels need the
// smaller chunk sizes, checked against the reference backend.
#include "cuda_test_main.hpp"

#include <cstdio>
#include <limits>
#include <numbers>

#include "cuda_tolerances.hpp"
#include "oracles/latte_oracle.hpp"

namespace {
using namespace latte;
using namespace latte::test;

/// Angles for the oracle: the given table, or the default schedule base^(-2i/Dv)
/// recomputed from its definition.
std::vector<long double> oracle_angles(const Tensor<double, 2>& given, index_t H, index_t Dv) {
  const index_t pairs = Dv / 2;
  std::vector<long double> angles(static_cast<std::size_t>(H * pairs));
  for (index_t h = 0; h < H; ++h)
    for (index_t i = 0; i < pairs; ++i)
      angles[h * pairs + i] = given.size() ? (long double)given(h, i)
                                           : std::pow(10000.0L, -2.0L * i / (long double)Dv);
  return angles;
}

/// q, k [B, T, H, L] (std 2), v [B, T, H, Dv] in [-1, 1] and learned VAPOR angles
/// in [0.01, 1]: the kernels' angle table and the oracle's long-double angles.
struct VaporProblem {
  Tensor<float, 4> q, k, v;
  std::vector<double> table;
  std::vector<long double> oracle_angles;
};
VaporProblem random_vapor_problem(Rng& rng, index_t B, index_t Tn, index_t H, index_t L,
                                  index_t Dv) {
  VaporProblem p{random_tensor<float, 4>(rng, {B, Tn, H, L}, 2.0),
                 random_tensor<float, 4>(rng, {B, Tn, H, L}, 2.0),
                 uniform_tensor<float, 4>(rng, {B, Tn, H, Dv}, -1, 1), {}, {}};
  VAPOR::Params params;
  params.angles = uniform_tensor<double, 2>(rng, {H, Dv / 2}, 0.01, 1.0);
  p.table = VAPOR::resolve_angles(params, H, Dv);
  p.oracle_angles = oracle_angles(params.angles, H, Dv);
  return p;
}

/// Runs LatteAttention<Dir, RunningMax, Pos>::forward(exec::cuda) on T-typed
/// device copies of q, k, v and returns the output as float.
template <class T, class Dir, class Pos>
Tensor<float, 4> cuda_forward(const LatteAttention<Dir, RunningMax, Pos>& attention,
                              const Tensor<float, 4>& q, const Tensor<float, 4>& k,
                              const Tensor<float, 4>& v) {
  const DeviceTensor<T, 4> qd(q), kd(k), vd(v);
  DeviceTensor<T, 4> out(v.extents());
  attention.forward(exec::cuda, qd.cview(), kd.cview(), vd.cview(), out.view());
  synchronize();
  return out.to_host();
}

template <class T, class Dir, class Pos>
void random_cases(const char* label, std::uint64_t seed, int full_cases) {
  Rng rng(seed);
  double worst = 0;
  const int cases = case_count(full_cases);
  for (int c = 0; c < cases; ++c) {
    const Shape s = random_shape(rng, kCaseBudget);
    const double logit_scale = pick(rng, std::array{0.5, 2.0, 6.0});
    const auto q = rounded_to<T>(
        random_tensor<float, 4>(rng, {s.batch, s.time, s.heads, s.latents}, logit_scale));
    const auto k = rounded_to<T>(
        random_tensor<float, 4>(rng, {s.batch, s.time, s.heads, s.latents}, logit_scale));
    const auto v = rounded_to<T>(
        uniform_tensor<float, 4>(rng, {s.batch, s.time, s.heads, s.value_dim}, -1, 1));
    typename Pos::Params params{};
    std::vector<long double> angles;
    if constexpr (Pos::rotates_values) {
      if (c % 2 == 1)
        params.angles = uniform_tensor<double, 2>(rng, {s.heads, s.value_dim / 2}, 0.0,
                                                  std::numbers::pi);
      angles = oracle_angles(params.angles, s.heads, s.value_dim);
    }
    const LatteAttention<Dir, RunningMax, Pos> attention({s.heads, s.latents, s.value_dim},
                                                         params);
    const auto out = cuda_forward<T>(attention, q, k, v);
    const double error = relative_error(out, latte_oracle(Dir::is_causal, q, k, v, angles));
    CHECK_MESSAGE(error <= CudaTolerance<T>::relative,
                  label << " case " << c << " B=" << s.batch << " T=" << s.time << " H="
                        << s.heads << " L=" << s.latents << " Dv=" << s.value_dim
                        << " error=" << error);
    worst = std::max(worst, error);
  }
  std::printf("[cuda oracle] %-40s %-8s cases=%d max_rel_error=%.3e (tol %.0e)\n", label,
              cuda::element_name<T>(), cases, worst, CudaTolerance<T>::relative);
}

template <class Dir, class Pos>
void all_types(const char* label, std::uint64_t seed) {
  random_cases<float, Dir, Pos>(label, seed, 120);
  random_cases<__half, Dir, Pos>(label, seed + 1, 40);
  random_cases<__nv_bfloat16, Dir, Pos>(label, seed + 2, 40);
}

template <class Dir>
Tensor<float, 4> latte_cuda(const Tensor<float, 4>& q, const Tensor<float, 4>& k,
                            const Tensor<float, 4>& v) {
  const LatteAttention<Dir, RunningMax> attention({q.extent(2), q.extent(3), v.extent(3)});
  return cuda_forward<float>(attention, q, k, v);
}

Tensor<float, 4> latte_cuda(bool causal, const Tensor<float, 4>& q, const Tensor<float, 4>& k,
                            const Tensor<float, 4>& v) {
  return causal ? latte_cuda<Causal>(q, k, v) : latte_cuda<Bidirectional>(q, k, v);
}

}  // namespace

TEST_CASE("cuda Latte causal == oracle (fp32, fp16, bf16)") {
  all_types<Causal, NoPositional>("LatteAttention<Causal>", 1101);
}
TEST_CASE("cuda Latte bidirectional == oracle (fp32, fp16, bf16)") {
  all_types<Bidirectional, NoPositional>("LatteAttention<Bidirectional>", 1111);
}
TEST_CASE("cuda Latte causal VAPOR == oracle (fp32, fp16, bf16)") {
  all_types<Causal, VAPOR>("LatteAttention<Causal,RunningMax,VAPOR>", 1121);
}
TEST_CASE("cuda Latte bidirectional VAPOR == oracle (fp32, fp16, bf16)") {
  all_types<Bidirectional, VAPOR>("LatteAttention<Bidirectional,RunningMax,VAPOR>", 1131);
}

TEST_CASE("cuda Latte: key logits [1, 10, 1000] are exact") {
  Rng rng(1401);
  for (index_t L : {1, 4}) {
    const auto q = random_tensor<float, 4>(rng, {1, 3, 1, L}, 1.0);
    auto k = random_tensor<float, 4>(rng, {1, 3, 1, L}, 1.0);
    k(0, 0, 0, 0) = 1;
    k(0, 1, 0, 0) = 10;
    k(0, 2, 0, 0) = 1000;
    const auto v = uniform_tensor<float, 4>(rng, {1, 3, 1, 5}, -1, 1);
    for (bool causal : {true, false}) {
      const auto out = latte_cuda(causal, q, k, v);
      CHECK(all_finite(out));
      CHECK(relative_error(out, latte_oracle(causal, q, k, v)) <= Tolerance<float>::relative);
    }
  }
}

TEST_CASE("cuda Latte: logit spreads up to 1e4 stay finite and exact") {
  Rng rng(1402);
  double worst = 0;
  int cases = 0;
  for (double spread : {1e3, 3e3, 1e4}) {
    for (int c = 0; c < case_count(12); ++c, ++cases) {
      const Shape s = random_shape(rng, 2e6);
      const auto q = uniform_tensor<float, 4>(rng, {s.batch, s.time, s.heads, s.latents},
                                              -spread / 2, spread / 2);
      const auto k = uniform_tensor<float, 4>(rng, {s.batch, s.time, s.heads, s.latents},
                                              -spread / 2, spread / 2);
      const auto v = uniform_tensor<float, 4>(rng, {s.batch, s.time, s.heads, s.value_dim}, -1, 1);
      for (bool causal : {true, false}) {
        const auto out = latte_cuda(causal, q, k, v);
        REQUIRE(all_finite(out));
        const double error = relative_error(out, latte_oracle(causal, q, k, v));
        CHECK_MESSAGE(error <= Tolerance<float>::relative, "spread " << spread << " case " << c);
        worst = std::max(worst, error);
      }
    }
  }
  std::printf("[cuda spread] spreads 1e3..1e4 cases=%d max_rel_error=%.3e\n", cases, worst);
}

TEST_CASE("cuda Latte: a latent climbing 2 per token takes the per-row path within a chunk") {
  // Latent 0 rises by 2 per token (spread 126 inside a 64-token chunk, beyond the
  // chunk-max path's 60); latent 1 stays within +-1 (the GEMM-shaped path).
  Rng rng(1403);
  const index_t Tn = 200, L = 2, Dv = 6;
  const auto q = random_tensor<float, 4>(rng, {1, Tn, 1, L}, 1.0);
  auto k = uniform_tensor<float, 4>(rng, {1, Tn, 1, L}, -1, 1);
  for (index_t t = 0; t < Tn; ++t) k(0, t, 0, 0) = 2.0f * float(t % 97);
  const auto v = uniform_tensor<float, 4>(rng, {1, Tn, 1, Dv}, -1, 1);
  const auto out = latte_cuda(true, q, k, v);
  CHECK(relative_error(out, latte_oracle(true, q, k, v)) <= Tolerance<float>::relative);
}

TEST_CASE("cuda Latte: masked latents (-inf logits) follow the documented convention") {
  constexpr float inf = std::numeric_limits<float>::infinity();
  Rng rng(1406);
  const index_t Tn = 150, L = 5, Dv = 4;
  auto q = random_tensor<float, 4>(rng, {1, Tn, 1, L}, 2.0);
  auto k = random_tensor<float, 4>(rng, {1, Tn, 1, L}, 2.0);
  const auto v = uniform_tensor<float, 4>(rng, {1, Tn, 1, Dv}, -1, 1);
  for (index_t t = 0; t < Tn; ++t) {
    k(0, t, 0, 1) = -inf;               // never any key mass
    if (t < 70) k(0, t, 0, 2) = -inf;   // empty for the whole first chunk
    if (t % 3 == 0) q(0, t, 0, 3) = -inf;
  }
  for (index_t l = 0; l < L; ++l) q(0, 7, 0, l) = -inf;  // query 7 ignores every latent
  for (bool causal : {true, false}) {
    const auto out = latte_cuda(causal, q, k, v);
    REQUIRE(all_finite(out));
    CHECK(relative_error(out, latte_oracle(causal, q, k, v)) <= Tolerance<float>::relative);
    for (index_t d = 0; d < Dv; ++d) CHECK(out(0, 7, 0, d) == 0.f);
  }
}

TEST_CASE("cuda Latte: all-zero values give exactly zero output") {
  Rng rng(1407);
  const auto q = random_tensor<float, 4>(rng, {2, 131, 3, 7}, 5.0);
  const auto k = random_tensor<float, 4>(rng, {2, 131, 3, 7}, 5.0);
  const Tensor<float, 4> v({2, 131, 3, 6}, 0.f);
  for (bool causal : {true, false}) {
    const auto out = latte_cuda(causal, q, k, v);
    for (index_t i = 0; i < out.size(); ++i) CHECK(out.data()[i] == 0.f);
  }
}

TEST_CASE("cuda Latte: large L x Dv use smaller chunks and match the reference backend") {
  // The oracle is O(T^2); at these sizes the reference backend (itself tested
  // against the oracle) is the rung above.
  Rng rng(1408);
  struct Case {
    index_t T, H, L, Dv;
  };
  // Emulated: fewer tokens, still several of the small chunks these L x Dv take.
  for (const Case c : {Case{gpu_or_emulated(3001, 150), 2, 128, 128},
                       Case{gpu_or_emulated(1500, 90), 1, 256, 64},
                       Case{gpu_or_emulated(700, 70), 3, 33, 255}}) {
    const auto q = random_tensor<float, 4>(rng, {1, c.T, c.H, c.L}, 2.0);
    const auto k = random_tensor<float, 4>(rng, {1, c.T, c.H, c.L}, 2.0);
    const auto v = uniform_tensor<float, 4>(rng, {1, c.T, c.H, c.Dv}, -1, 1);
    for (bool causal : {true, false}) {
      Tensor<float, 4> expected(v.extents());
      if (causal)
        LatteAttention<Causal>({c.H, c.L, c.Dv}).forward(exec::reference, q, k, v, expected.view());
      else
        LatteAttention<Bidirectional>({c.H, c.L, c.Dv})
            .forward(exec::reference, q, k, v, expected.view());
      TensorLD<4> as_ld(expected.extents());
      for (index_t i = 0; i < expected.size(); ++i) as_ld.data()[i] = expected.data()[i];
      const auto out = latte_cuda(causal, q, k, v);
      const double error = relative_error(out, as_ld);
      CHECK_MESSAGE(error <= 2 * Tolerance<float>::relative,  // two fp32 computations
                    "T=" << c.T << " L=" << c.L << " Dv=" << c.Dv << " causal=" << causal
                         << " error=" << error);
    }
  }
}

TEST_CASE("cuda Latte: prefill in two parts through a device carry == one pass (VAPOR at 1e7)") {
  Rng rng(1409);
  const index_t B = 2, Tn = 300, H = 2, L = 6, Dv = 16, split = 131;
  const VaporProblem p = random_vapor_problem(rng, B, Tn, H, L, Dv);
  const auto &q = p.q, &k = p.k, &v = p.v;
  const auto& table = p.table;
  const auto oracle = latte_oracle(true, q, k, v, p.oracle_angles);
  for (long long first : {0LL, 1'000'003LL, 9'999'700LL}) {
    // Carry starts empty: m = -inf, sums 0.
    DeviceArray<float> running_max(B * H * L), normaliser(B * H * L), memory(B * H * L * Dv);
    running_max.upload(std::vector<float>(B * H * L, -std::numeric_limits<float>::infinity()));
    normaliser.fill_bytes(0);
    memory.fill_bytes(0);
    const cuda::LatteDeviceCarry carry{running_max.data(), normaliser.data(), memory.data()};
    const DeviceTensor<float, 4> q1(time_slice(q, 0, split)), k1(time_slice(k, 0, split)),
        v1(time_slice(v, 0, split));
    const DeviceTensor<float, 4> q2(time_slice(q, split, Tn - split)),
        k2(time_slice(k, split, Tn - split)), v2(time_slice(v, split, Tn - split));
    DeviceTensor<float, 4> o1(v1.extents), o2(v2.extents);
    cuda::latte_forward<true, VAPOR>(nullptr, q1.cview(), k1.cview(), v1.cview(), o1.view(), table,
                                     first, carry);
    cuda::latte_forward<true, VAPOR>(nullptr, q2.cview(), k2.cview(), v2.cview(), o2.view(), table,
                                     first + split, carry);
    synchronize();
    Tensor<float, 4> whole(v.extents());
    const auto h1 = o1.to_host(), h2 = o2.to_host();
    for (index_t b = 0; b < B; ++b)
      for (index_t t = 0; t < Tn; ++t)
        for (index_t h = 0; h < H; ++h)
          for (index_t d = 0; d < Dv; ++d)
            whole(b, t, h, d) = t < split ? h1(b, t, h, d) : h2(b, t - split, h, d);
    const double error = relative_error(whole, oracle);
    CHECK_MESSAGE(error <= Tolerance<float>::relative, "first position " << first);
    std::printf("[cuda vapor] positions %lld..%lld prefill in two parts max_rel_error=%.3e\n",
                first, first + Tn, error);
  }
}

TEST_CASE("cuda Latte: bidirectional VAPOR from a first position f sees R^{t-s}, not R^{t-s-f}") {
  // Regression (issue 24): the state kernel rotated by f + s while the read-out
  // rotated by the chunk-local t alone. Bidirectional Latte depends on t - s only,
  // so every first position gives the oracle's output at positions 0..T-1.
  Rng rng(1411);
  const VaporProblem p = random_vapor_problem(rng, 1, 150, 2, 5, 8);
  const auto oracle = latte_oracle(false, p.q, p.k, p.v, p.oracle_angles);
  const DeviceTensor<float, 4> qd(p.q), kd(p.k), vd(p.v);
  for (long long first : {0LL, 7LL, 1'000'003LL}) {
    DeviceTensor<float, 4> out(p.v.extents());
    cuda::latte_forward<false, VAPOR>(nullptr, qd.cview(), kd.cview(), vd.cview(), out.view(),
                                      p.table, first);
    synchronize();
    const double error = relative_error(out.to_host(), oracle);
    CHECK_MESSAGE(error <= Tolerance<float>::relative, "first position " << first);
  }
}

TEST_CASE("cuda Latte: strided (time-major) views") {
  Rng rng(1410);
  const index_t B = 2, Tn = 77, H = 3, L = 8, Dv = 10;
  const auto q = random_tensor<float, 4>(rng, {B, Tn, H, L}, 2.0);
  const auto k = random_tensor<float, 4>(rng, {B, Tn, H, L}, 2.0);
  const auto v = uniform_tensor<float, 4>(rng, {B, Tn, H, Dv}, -1, 1);
  // Device buffers laid out [T, B, H, D]; the views walk them as [B, T, H, D].
  auto time_major = [](const Tensor<float, 4>& x) {
    Tensor<float, 4> y({x.extent(1), x.extent(0), x.extent(2), x.extent(3)});
    for (index_t b = 0; b < x.extent(0); ++b)
      for (index_t t = 0; t < x.extent(1); ++t)
        for (index_t h = 0; h < x.extent(2); ++h)
          for (index_t d = 0; d < x.extent(3); ++d) y(t, b, h, d) = x(b, t, h, d);
    return y;
  };
  auto strided = [&](auto* data, index_t D) {
    using Element = std::remove_pointer_t<decltype(data)>;
    return TensorView<Element, 4>(data, {B, Tn, H, D}, {H * D, B * H * D, D, 1});
  };
  const DeviceTensor<float, 4> qd(time_major(q)), kd(time_major(k)), vd(time_major(v));
  DeviceTensor<float, 4> out(std::array<index_t, 4>{Tn, B, H, Dv});
  const LatteAttention<Causal> attention({H, L, Dv});
  attention.forward(exec::cuda, strided(static_cast<const float*>(qd.array.data()), L),
                    strided(static_cast<const float*>(kd.array.data()), L),
                    strided(static_cast<const float*>(vd.array.data()), Dv),
                    strided(out.array.data(), Dv));
  synchronize();
  const auto host = out.to_host();
  Tensor<float, 4> back(v.extents());
  for (index_t b = 0; b < B; ++b)
    for (index_t t = 0; t < Tn; ++t)
      for (index_t h = 0; h < H; ++h)
        for (index_t d = 0; d < Dv; ++d) back(b, t, h, d) = host(t, b, h, d);
  CHECK(relative_error(back, latte_oracle(true, q, k, v)) <= Tolerance<float>::relative);
}
