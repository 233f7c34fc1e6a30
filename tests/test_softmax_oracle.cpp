// Exact softmax attention (reference backend) against the explicit T x T
// oracle on >= 200 random shapes per direction, window and dtype.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>

#include "oracles/softmax_oracle.hpp"
#include "support.hpp"

namespace test_softmax_oracle {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;

constexpr int kCases = 200;

template <class T, class Dir, class Win>
void run_oracle_cases(const char* label, std::uint64_t seed) {
  Rng rng(seed);
  double worst_reference = 0, worst_cpu = 0;
  long long elements = 0;
  const int cases_run = case_count(kCases);
  for (int c = 0; c < cases_run; ++c) {
    const Shape s = random_shape(rng);
    const index_t Dk = s.latents;  // Dk from {1, 7, 64}
    const double input_scale = pick(rng, std::array{0.5, 1.0, 3.0});
    const auto q = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, Dk}, input_scale);
    const auto k = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, Dk}, input_scale);
    const auto v = uniform_tensor<T, 4>(rng, {s.batch, s.time, s.heads, s.value_dim}, -1, 1);
    MaskSpec mask{.causal = Dir::is_causal};
    Win window{};
    if constexpr (std::is_same_v<Win, SlidingWindow>) {
      std::uniform_int_distribution<index_t> side(0, s.time + 2);
      window.left = side(rng);
      window.right = Dir::is_causal ? 0 : side(rng);
      mask.left = window.left;
      mask.right = window.right;
    }
    const bool custom_scale = c % 3 == 0;
    const double scale = custom_scale ? 0.37 : 1.0 / std::sqrt(double(Dk));
    const SoftmaxAttention<Dir, Win> attention(
        {.heads = s.heads, .key_dim = Dk, .value_dim = s.value_dim}, window,
        custom_scale ? std::optional<double>(scale) : std::nullopt);
    const long double oracle_scale = custom_scale ? 0.37L : 1.0L / std::sqrt((long double)Dk);
    const auto oracle = softmax_oracle(mask, oracle_scale, q, k, v);
    Tensor<T, 4> out(v.extents()), out_cpu(v.extents());
    attention.forward(exec::reference, q, k, v, out.view());
    attention.forward(exec::cpu, q, k, v, out_cpu.view());
    const double error = relative_error(out, oracle), error_cpu = relative_error(out_cpu, oracle);
    CHECK_MESSAGE(std::max(error, error_cpu) <= Tolerance<T>::relative,
                  label << " case " << c << " B=" << s.batch << " T=" << s.time
                        << " H=" << s.heads << " Dk=" << Dk << " Dv=" << s.value_dim
                        << " window=" << mask.left << "," << mask.right
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

TEST_CASE("Softmax causal == oracle") {
  run_oracle_cases<float, Causal, NoWindow>("SoftmaxAttention<Causal>", 201);
  run_oracle_cases<double, Causal, NoWindow>("SoftmaxAttention<Causal>", 202);
}
TEST_CASE("Softmax bidirectional == oracle") {
  run_oracle_cases<float, Bidirectional, NoWindow>("SoftmaxAttention<Bidirectional>", 203);
  run_oracle_cases<double, Bidirectional, NoWindow>("SoftmaxAttention<Bidirectional>", 204);
}
TEST_CASE("Softmax causal sliding window == oracle") {
  run_oracle_cases<float, Causal, SlidingWindow>("SoftmaxAttention<Causal,SlidingWindow>", 205);
  run_oracle_cases<double, Causal, SlidingWindow>("SoftmaxAttention<Causal,SlidingWindow>", 206);
}
TEST_CASE("Softmax bidirectional sliding window == oracle") {
  run_oracle_cases<float, Bidirectional, SlidingWindow>(
      "SoftmaxAttention<Bidirectional,SlidingWindow>", 207);
  run_oracle_cases<double, Bidirectional, SlidingWindow>(
      "SoftmaxAttention<Bidirectional,SlidingWindow>", 208);
}

}  // namespace test_softmax_oracle
