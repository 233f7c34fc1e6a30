// ConvCompressedAttention (paper 003 §4, DESIGN §3.5): the reference and cpu backends,
// each against the explicit long-double oracle on >= 200 random shapes per direction,
// dtype and hierarchy (levels = 1 and levels >= 2); decode equivalence
// (prefill + steps == oracle), chunked prefill, save/restore bit-exactness,
// causality, and every malformed call.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "latte/mechanisms/conv_compressed_attention.hpp"
#include "oracles/conv_compressed_oracle.hpp"
#include "oracles/softmax_oracle.hpp"
#include "expect_error.hpp"
#include "state_bytes.hpp"
#include "support.hpp"

namespace test_conv_compressed {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;

constexpr int kOracleCases = 200;
constexpr int kDecodeCases = 60;

/// A weight drawn from N(0, stddev^2), rounded to T so that the op (which
/// computes with T weights) and the oracle see the same number.
template <class T>
double weight(Rng& rng, double stddev) {
  return static_cast<double>(static_cast<T>(std::normal_distribution<double>(0.0, stddev)(rng)));
}

template <class T, std::size_t N>
void fill(Rng& rng, Tensor<double, N>& tensor, double stddev) {
  for (index_t i = 0; i < tensor.size(); ++i) tensor.data()[i] = weight<T>(rng, stddev);
}

/// Random weights of the shapes `dims` needs, variance-preserving (standard
/// deviation 1/sqrt(fan-in), as a trained layer's initialisation), so that every
/// part of the output (window, compressed tokens, cross read) is of order one.
template <class T>
ConvCompressedParams random_params(Rng& rng, const ConvCompressedDims& dims) {
  ConvCompressedParams params = ConvCompressedParams::zeros(dims);
  const double Dv = double(dims.value_dim), M = double(dims.group_size);
  for (auto& w : params.conv_weight) fill<T>(rng, w, 1.0 / std::sqrt(M * Dv));
  for (auto& b : params.conv_bias) fill<T>(rng, b, 0.5);
  for (auto& w : params.level_query) fill<T>(rng, w, 1.0 / std::sqrt(Dv));
  for (auto& w : params.level_key) fill<T>(rng, w, 1.0 / std::sqrt(Dv));
  for (auto& w : params.level_value) fill<T>(rng, w, 1.0 / std::sqrt(Dv));
  fill<T>(rng, params.cross_query, 1.0 / std::sqrt(Dv));
  fill<T>(rng, params.cross_key, 1.0 / std::sqrt(Dv));
  fill<T>(rng, params.cross_value, 1.0 / std::sqrt(Dv));
  return params;
}

/// One random problem: shape, hyper-parameters, weights and inputs.
template <class T>
struct Problem {
  ConvCompressedDims dims;
  ConvCompressedParams params;
  std::optional<double> scale;
  Tensor<T, 4> q, k, v;
  ConvCompressedSpec spec;
  index_t batch = 0, time = 0;

  [[nodiscard]] std::string describe() const {
    return "B=" + std::to_string(batch) + " T=" + std::to_string(time) +
           " H=" + std::to_string(dims.heads) + " Dk=" + std::to_string(dims.key_dim) +
           " Dv=" + std::to_string(dims.value_dim) + " M=" + std::to_string(dims.group_size) +
           " levels=" + std::to_string(dims.levels) +
           " window=" + std::to_string(spec.window_left) + "," +
           std::to_string(spec.window_right) + (scale ? " scale=0.37" : "");
  }
};

/// Group sizes: mostly ones whose M^levels <= T (so compressed tokens exist and
/// are read), sometimes any size up to T + 3 (no complete group, or one).
index_t random_group_size(Rng& rng, index_t time, index_t levels) {
  auto fits = [&](index_t M) {
    long double span = 1;
    for (index_t l = 0; l < levels; ++l) span *= (long double)M;
    return span <= (long double)time;
  };
  const double draw = std::uniform_real_distribution<double>(0, 1)(rng);
  if (draw < 0.5) {
    std::vector<index_t> small;
    for (index_t M : {1, 2, 3, 4, 5, 7, 8, 16, 31, 64})
      if (fits(M)) small.push_back(M);
    if (!small.empty()) return pick(rng, small);
  }
  if (draw < 0.85) {
    index_t largest = 1;
    while (fits(largest + 1)) ++largest;
    return std::uniform_int_distribution<index_t>(1, largest)(rng);
  }
  return std::uniform_int_distribution<index_t>(1, time + 3)(rng);
}

template <class T, class Dir>
Problem<T> random_problem(Rng& rng, bool hierarchical, double budget, int case_index) {
  Problem<T> p;
  const Shape s = random_shape(rng, budget);
  p.batch = s.batch;
  p.time = s.time;
  p.dims.heads = s.heads;
  p.dims.key_dim = s.latents;  // Dk from {1, 7, 64}
  p.dims.value_dim = s.value_dim;
  p.dims.levels = hierarchical ? pick(rng, std::array<index_t, 3>{2, 2, 3}) : 1;
  p.dims.group_size = random_group_size(rng, s.time, p.dims.levels);
  const index_t M = p.dims.group_size;
  p.spec.causal = Dir::is_causal;
  p.spec.group_size = M;
  p.spec.levels = p.dims.levels;
  p.spec.window_left = M - 1;
  p.spec.window_right = Dir::is_causal ? 0 : M - 1;
  if (std::uniform_int_distribution<int>(0, 9)(rng) < 3) {  // a window other than M
    std::uniform_int_distribution<index_t> side(0, s.time + 2);
    p.spec.window_left = side(rng);
    p.dims.window_left = p.spec.window_left;
    if constexpr (!Dir::is_causal) {
      p.spec.window_right = side(rng);
      p.dims.window_right = p.spec.window_right;
    }
  }
  if (case_index % 3 == 0) p.scale = 0.37;
  p.spec.scale = p.scale ? 0.37L : 1.0L / std::sqrt((long double)p.dims.key_dim);
  p.params = random_params<T>(rng, p.dims);
  const double input_scale = pick(rng, std::array{0.5, 1.0, 3.0});
  p.q = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, p.dims.key_dim}, input_scale);
  p.k = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, p.dims.key_dim}, input_scale);
  p.v = uniform_tensor<T, 4>(rng, {s.batch, s.time, s.heads, p.dims.value_dim}, -1, 1);
  return p;
}

template <std::size_t N>
long double max_abs(const TensorLD<N>& x) {
  long double m = 0;
  for (index_t i = 0; i < x.size(); ++i) m = std::max(m, std::fabs(x.data()[i]));
  return m;
}

/// Whole-sequence forward against the oracle.
template <class T, class Dir>
void run_oracle_cases(bool hierarchical, std::uint64_t seed) {
  Rng rng(seed);
  double worst = 0, worst_cpu = 0;
  long long elements = 0;
  int with_cross = 0;  // cases whose cross part is a visible share of the output
  const int cases_run = case_count(kOracleCases);
  for (int c = 0; c < cases_run; ++c) {
    const Problem<T> p = random_problem<T, Dir>(rng, hierarchical, 3e6, c);
    const ConvCompressedAttention<Dir> attention(p.dims, p.params, p.scale);
    Tensor<T, 4> out(p.v.extents()), out_cpu(p.v.extents());
    attention.forward(exec::reference, p.q, p.k, p.v, out.view());
    attention.forward(exec::cpu, p.q, p.k, p.v, out_cpu.view());
    const auto oracle = conv_compressed_oracle(p.spec, p.params, p.q, p.k, p.v);
    const double error = relative_error(out, oracle.out);
    const double error_cpu = relative_error(out_cpu, oracle.out);
    CHECK_MESSAGE(std::max(error, error_cpu) <= Tolerance<T>::relative,
                  "case " << c << " " << p.describe() << " reference error=" << error
                          << " cpu error=" << error_cpu);
    worst = std::max(worst, error);
    worst_cpu = std::max(worst_cpu, error_cpu);
    elements += out.size();
    if (max_abs(oracle.global) > 0.05L * max_abs(oracle.out)) ++with_cross;
  }
  // The oracle comparison must exercise the compressed path, not only the window.
  CHECK(with_cross >= cases_run / 2);
  std::printf("[oracle] ConvCompressedAttention<%s> levels%s %s cases=%d elements=%lld "
              "with_cross=%d max_rel_error reference=%.3e cpu=%.3e (tol %.0e)\n",
              Dir::name, hierarchical ? ">=2" : "=1", dtype_name<T>(), cases_run, elements,
              with_cross, worst, worst_cpu, Tolerance<T>::relative);
}

/// Prefill of the first `prefill` tokens through forward(..., state), the rest by step().
template <class T, class E = exec::reference_t>
Tensor<T, 4> prefill_then_step(const ConvCompressedAttention<Causal>& attention,
                               ConvCompressedState<T>& state, const Tensor<T, 4>& q,
                               const Tensor<T, 4>& k, const Tensor<T, 4>& v, index_t prefill) {
  const index_t Tn = q.extent(1);
  Tensor<T, 4> out(v.extents());
  Tensor<T, 4> head({v.extent(0), prefill, v.extent(2), v.extent(3)});
  attention.forward(E{}, time_slice(q, 0, prefill), time_slice(k, 0, prefill),
                    time_slice(v, 0, prefill), head.view(), state);
  for (index_t t = 0; t < prefill; ++t) set_time_step(out, t, time_step(head, t));
  Tensor<T, 3> row({v.extent(0), v.extent(2), v.extent(3)});
  for (index_t t = prefill; t < Tn; ++t) {
    attention.step(E{}, state, time_step(q, t), time_step(k, t), time_step(v, t), row.view());
    set_time_step(out, t, row);
  }
  return out;
}

template <class T>
void run_decode_cases(bool hierarchical, std::uint64_t seed) {
  Rng rng(seed);
  double worst = 0, worst_cpu = 0;
  const int cases_run = case_count(kDecodeCases);
  for (int c = 0; c < cases_run; ++c) {
    const Problem<T> p = random_problem<T, Causal>(rng, hierarchical, 2e6, c);
    const ConvCompressedAttention<Causal> attention(p.dims, p.params, p.scale);
    const auto oracle = conv_compressed_oracle(p.spec, p.params, p.q, p.k, p.v);
    const index_t prefill = std::uniform_int_distribution<index_t>(0, p.time)(rng);
    const index_t capacity = p.time + std::uniform_int_distribution<index_t>(0, 3)(rng);
    auto state = attention.make_state<T>(p.batch, capacity);
    const auto decoded = prefill_then_step(attention, state, p.q, p.k, p.v, prefill);
    CHECK(state.position() == p.time);
    CHECK(state.compressed_tokens() ==
          p.time / reference::tokens_per_compressed_token(p.dims.group_size, p.dims.levels));
    auto state_cpu = attention.make_state<T>(p.batch, capacity);
    const auto decoded_cpu =
        prefill_then_step<T, exec::cpu_t>(attention, state_cpu, p.q, p.k, p.v, prefill);
    CHECK(state_cpu.position() == p.time);
    const double error = relative_error(decoded, oracle.out);
    const double error_cpu = relative_error(decoded_cpu, oracle.out);
    CHECK_MESSAGE(std::max(error, error_cpu) <= Tolerance<T>::relative,
                  "case " << c << " " << p.describe() << " prefill=" << prefill
                          << " reference error=" << error << " cpu error=" << error_cpu);
    worst = std::max(worst, error);
    worst_cpu = std::max(worst_cpu, error_cpu);
  }
  std::printf("[decode] ConvCompressedAttention<causal> levels%s %s cases=%d max_rel_error "
              "reference=%.3e cpu=%.3e\n",
              hierarchical ? ">=2" : "=1", dtype_name<T>(), cases_run, worst, worst_cpu);
}

/// A fixed problem for the structural tests.
template <class T, class Dir = Causal>
Problem<T> fixed_problem(index_t B, index_t Tn, index_t H, index_t Dk, index_t Dv, index_t M,
                         index_t levels, std::uint64_t seed) {
  Rng rng(seed);
  Problem<T> p;
  p.batch = B;
  p.time = Tn;
  p.dims = {.heads = H, .key_dim = Dk, .value_dim = Dv, .group_size = M, .levels = levels};
  p.spec = {.causal = Dir::is_causal,
            .group_size = M,
            .levels = levels,
            .window_left = M - 1,
            .window_right = Dir::is_causal ? 0 : M - 1,
            .scale = 1.0L / std::sqrt((long double)Dk)};
  p.params = random_params<T>(rng, p.dims);
  p.q = random_tensor<T, 4>(rng, {B, Tn, H, Dk}, 1.0);
  p.k = random_tensor<T, 4>(rng, {B, Tn, H, Dk}, 1.0);
  p.v = uniform_tensor<T, 4>(rng, {B, Tn, H, Dv}, -1, 1);
  return p;
}

}  // namespace

// ------------------------------------------------------------------ oracle --

TEST_CASE("ConvCompressed causal, levels = 1 == oracle") {
  run_oracle_cases<float, Causal>(false, 601);
  run_oracle_cases<double, Causal>(false, 602);
}
TEST_CASE("ConvCompressed causal, levels >= 2 == oracle") {
  run_oracle_cases<float, Causal>(true, 603);
  run_oracle_cases<double, Causal>(true, 604);
}
TEST_CASE("ConvCompressed bidirectional, levels = 1 == oracle") {
  run_oracle_cases<float, Bidirectional>(false, 605);
  run_oracle_cases<double, Bidirectional>(false, 606);
}
TEST_CASE("ConvCompressed bidirectional, levels >= 2 == oracle") {
  run_oracle_cases<float, Bidirectional>(true, 607);
  run_oracle_cases<double, Bidirectional>(true, 608);
}

TEST_CASE("The oracle's window part is the softmax oracle's sliding window") {
  // With no complete top-level group the output is y^(0) alone: sliding-window
  // softmax attention, which tests/oracles/softmax_oracle.hpp defines independently.
  for (const bool causal : {true, false}) {
    const auto p = fixed_problem<double>(2, 37, 3, 5, 4, 40, 1, 609);
    ConvCompressedSpec spec = p.spec;
    spec.causal = causal;
    spec.window_right = causal ? 0 : 39;
    const auto oracle = conv_compressed_oracle(spec, p.params, p.q, p.k, p.v);
    const MaskSpec mask{.causal = causal, .left = 39, .right = causal ? 0 : 39};
    const auto softmax = softmax_oracle(mask, spec.scale, p.q, p.k, p.v);
    CHECK(max_abs(oracle.global) == 0);
    long double worst = 0;
    for (index_t i = 0; i < softmax.size(); ++i)
      worst = std::max(worst, std::fabs(oracle.out.data()[i] - softmax.data()[i]));
    CHECK(worst <= 1e-15L * max_abs(softmax));
    CHECK(max_abs(softmax) > 0.1L);
  }
}

TEST_CASE("Block-causal: tokens of the first top-level block read no compressed token") {
  for (const index_t levels : {1, 2}) {
    const index_t M = 3, span = levels == 1 ? 3 : 9;
    auto p = fixed_problem<double>(1, 40, 2, 4, 6, M, levels, 610);
    const auto oracle = conv_compressed_oracle(p.spec, p.params, p.q, p.k, p.v);
    const ConvCompressedAttention<Causal> attention(p.dims, p.params);
    Tensor<double, 4> out(p.v.extents());
    attention.forward(exec::reference, p.q, p.k, p.v, out.view());
    CHECK(relative_error(out, oracle.out) <= Tolerance<double>::relative);
    for (index_t t = 0; t < 40; ++t)
      for (index_t h = 0; h < 2; ++h)
        for (index_t d = 0; d < 6; ++d) {
          const bool reads_compressed = oracle.global(0, t, h, d) != 0;
          // t sees c^(L)_j iff (j + 1) M^L <= t: the first reader is t = M^L.
          REQUIRE(reads_compressed == (t >= span));
        }
  }
}

TEST_CASE("Causal: an input at position p changes no output before p") {
  for (const index_t levels : {1, 2}) {
    auto p = fixed_problem<float>(2, 50, 3, 5, 4, 3, levels, 611);
    const ConvCompressedAttention<Causal> attention(p.dims, p.params);
    Tensor<float, 4> before(p.v.extents()), after(p.v.extents());
    attention.forward(exec::reference, p.q, p.k, p.v, before.view());
    const index_t changed = 26;  // the last token of group 8 (levels 1) / group 2 (levels 2)
    for (index_t h = 0; h < 3; ++h) {
      for (index_t d = 0; d < 5; ++d) p.k(1, changed, h, d) += 2.0f;
      for (index_t d = 0; d < 4; ++d) p.v(1, changed, h, d) = -p.v(1, changed, h, d) + 0.5f;
    }
    attention.forward(exec::reference, p.q, p.k, p.v, after.view());
    for (index_t t = 0; t < 50; ++t)
      for (index_t h = 0; h < 3; ++h)
        for (index_t d = 0; d < 4; ++d) {
          CHECK(before(0, t, h, d) == after(0, t, h, d));  // the other sequence of the batch
          if (t < changed) CHECK(before(1, t, h, d) == after(1, t, h, d));
        }
    // It does change the output at p and at the first reader of its compressed token.
    // t = 32 is past p's window (30..32), so the change can only arrive there
    // through the compressed tokens (c^(1)_8, or c^(2)_2 with levels = 2).
    const index_t beyond_window = 32;
    bool changed_at_p = false, changed_beyond_window = false;
    for (index_t d = 0; d < 4; ++d) {
      changed_at_p = changed_at_p || before(1, changed, 0, d) != after(1, changed, 0, d);
      changed_beyond_window = changed_beyond_window ||
                              before(1, beyond_window, 0, d) != after(1, beyond_window, 0, d);
    }
    CHECK(changed_at_p);
    CHECK(changed_beyond_window);
  }
}

TEST_CASE("A mis-specified oracle is caught: the comparison is sensitive to M, L and the window") {
  const auto p = fixed_problem<double>(1, 60, 2, 4, 5, 3, 2, 612);
  const ConvCompressedAttention<Causal> attention(p.dims, p.params);
  Tensor<double, 4> out(p.v.extents());
  attention.forward(exec::reference, p.q, p.k, p.v, out.view());
  CHECK(relative_error(out, conv_compressed_oracle(p.spec, p.params, p.q, p.k, p.v).out) <=
        Tolerance<double>::relative);
  ConvCompressedSpec wider = p.spec;
  wider.window_left += 1;
  CHECK(relative_error(out, conv_compressed_oracle(wider, p.params, p.q, p.k, p.v).out) > 1e-3);
  ConvCompressedSpec one_level = p.spec;
  one_level.levels = 1;  // the level-1 tokens read directly instead of the level-2 ones
  ConvCompressedParams one_level_params = p.params;
  one_level_params.conv_weight.resize(1);
  one_level_params.conv_bias.resize(1);
  CHECK(relative_error(out, conv_compressed_oracle(one_level, one_level_params, p.q, p.k, p.v)
                                .out) > 1e-3);
}

// ------------------------------------------------------------------ decode --

TEST_CASE("ConvCompressed decode, levels = 1: prefill + steps == oracle") {
  run_decode_cases<float>(false, 621);
  run_decode_cases<double>(false, 622);
}
TEST_CASE("ConvCompressed decode, levels >= 2: prefill + steps == oracle") {
  run_decode_cases<float>(true, 623);
  run_decode_cases<double>(true, 624);
}

TEST_CASE("ConvCompressed: chunked prefill equals the oracle") {
  // B = 2, H = 3 (exec::cpu runs heads on threads) and B = H = 1 (query blocks on threads).
  for (const auto& shape : {std::array<index_t, 3>{2, 3, 1}, {2, 3, 2}, {2, 3, 3}, {1, 1, 1},
                            {1, 1, 2}}) {
    const index_t B = shape[0], H = shape[1], levels = shape[2];  // (clang 14: no captured bindings)
    const auto p = fixed_problem<double>(B, 97, H, 5, 6, 3, levels, 625 + levels);
    const ConvCompressedAttention<Causal> attention(p.dims, p.params);
    const auto oracle = conv_compressed_oracle(p.spec, p.params, p.q, p.k, p.v);
    auto run = [&](auto backend) {
      CAPTURE(decltype(backend)::name);
      CAPTURE(B);
      CAPTURE(levels);
      auto state = attention.make_state<double>(B, 97);
      Tensor<double, 4> out(p.v.extents());
      index_t first = 0;
      for (index_t chunk : {0, 1, 13, 40, 43}) {  // boundaries inside and between groups
        Tensor<double, 4> part({B, chunk, H, 6});
        attention.forward(backend, time_slice(p.q, first, chunk), time_slice(p.k, first, chunk),
                          time_slice(p.v, first, chunk), part.view(), state);
        for (index_t t = 0; t < chunk; ++t) set_time_step(out, first + t, time_step(part, t));
        first += chunk;
      }
      REQUIRE(first == 97);
      CHECK(relative_error(out, oracle.out) <= Tolerance<double>::relative);
    };
    run(exec::reference);
    run(exec::cpu);
  }
}

TEST_CASE("ConvCompressed: save/restore continues bit-exactly") {
  for (const index_t levels : {1, 2}) {
    for (const index_t split : {1, 28, 30, 32}) {  // mid-group, group end, top-group end
      const auto p = fixed_problem<float>(2, 64, 3, 5, 8, 4, levels, 630);
      const ConvCompressedAttention<Causal> attention(p.dims, p.params);
      auto state = attention.make_state<float>(2, 64);
      Tensor<float, 4> head({2, split, 3, 8});
      attention.forward(exec::reference, time_slice(p.q, 0, split), time_slice(p.k, 0, split),
                        time_slice(p.v, 0, split), head.view(), state);
      const std::vector<std::byte> bytes = state.save();
      auto restored = attention.load_state<float>(bytes);
      CHECK(restored.position() == split);
      CHECK(restored.save() == bytes);
      const index_t rest = 64 - split;
      Tensor<float, 4> original_out({2, rest, 3, 8}), restored_out({2, rest, 3, 8});
      attention.forward(exec::reference, time_slice(p.q, split, rest),
                        time_slice(p.k, split, rest), time_slice(p.v, split, rest),
                        original_out.view(), state);
      attention.forward(exec::reference, time_slice(p.q, split, rest),
                        time_slice(p.k, split, rest), time_slice(p.v, split, rest),
                        restored_out.view(), restored);
      CHECK(bit_equal(original_out, restored_out));
      CHECK(state.save() == restored.save());
      // restore() into an existing state of the same shape continues the same way.
      auto other = attention.make_state<float>(2, 64);
      other.restore(bytes);
      CHECK(other.position() == split);
    }
  }
}

TEST_CASE("ConvCompressed state: O(window + T / M^L) memory, fixed at make_state") {
  const auto p = fixed_problem<float>(1, 8, 2, 4, 6, 8, 2, 631);
  const ConvCompressedAttention<Causal> attention(p.dims, p.params);
  for (const index_t capacity : {64, 6400}) {
    auto state = attention.make_state<float>(1, capacity);
    // rings: 2 levels x min(M, capacity) slots x (Dk + Dv); group sums: 2 x Dv;
    // compressed store: capacity / M^2 x (Dk + Dv); per head.
    const std::size_t expected = 2 * (2 * 8 * 10 + 2 * 6 + (capacity / 64) * 10);
    CHECK(state.bytes() == expected * sizeof(float));
    CHECK(state.compressed_tokens() == 0);
  }
  auto state = attention.make_state<float>(1, 200);
  const std::size_t bytes = state.bytes();
  Rng rng(632);
  const auto q = random_tensor<float, 4>(rng, {1, 130, 2, 4}, 1.0);
  const auto v = uniform_tensor<float, 4>(rng, {1, 130, 2, 6}, -1, 1);
  Tensor<float, 4> out({1, 130, 2, 6});
  attention.forward(exec::reference, q, q, v, out.view(), state);
  CHECK(state.bytes() == bytes);
  CHECK(state.compressed_tokens() == 2);  // floor(130 / 64)
}

TEST_CASE("ConvCompressed: group size 1 and levels 3 (every token compressed at every level)") {
  auto p = fixed_problem<double>(1, 23, 2, 3, 4, 1, 3, 633);
  const ConvCompressedAttention<Causal> attention(p.dims, p.params);
  const auto oracle = conv_compressed_oracle(p.spec, p.params, p.q, p.k, p.v);
  Tensor<double, 4> out(p.v.extents()), out_cpu(p.v.extents());
  attention.forward(exec::reference, p.q, p.k, p.v, out.view());
  attention.forward(exec::cpu, p.q, p.k, p.v, out_cpu.view());
  CHECK(relative_error(out, oracle.out) <= Tolerance<double>::relative);
  CHECK(relative_error(out_cpu, oracle.out) <= Tolerance<double>::relative);
  auto state = attention.make_state<double>(1, 23), state_cpu = attention.make_state<double>(1, 23);
  const auto decoded = prefill_then_step(attention, state, p.q, p.k, p.v, 5);
  CHECK(relative_error(decoded, oracle.out) <= Tolerance<double>::relative);
  const auto decoded_cpu = prefill_then_step<double, exec::cpu_t>(attention, state_cpu, p.q, p.k,
                                                                  p.v, 5);
  CHECK(relative_error(decoded_cpu, oracle.out) <= Tolerance<double>::relative);
}

TEST_CASE("ConvCompressed: M^L beyond int64 means no compressed token ever") {
  auto p = fixed_problem<double>(1, 30, 1, 3, 4, 1000, 7, 634);  // 1000^7 > 2^63
  p.dims.window_left = 4;
  p.spec.window_left = 4;
  const ConvCompressedAttention<Causal> attention(p.dims, p.params);
  CHECK(attention.tokens_per_compressed_token() == std::numeric_limits<std::int64_t>::max());
  Tensor<double, 4> out(p.v.extents()), out_cpu(p.v.extents());
  attention.forward(exec::reference, p.q, p.k, p.v, out.view());
  attention.forward(exec::cpu, p.q, p.k, p.v, out_cpu.view());
  const auto oracle = conv_compressed_oracle(p.spec, p.params, p.q, p.k, p.v);
  CHECK(max_abs(oracle.global) == 0);
  CHECK(relative_error(out, oracle.out) <= Tolerance<double>::relative);
  CHECK(relative_error(out_cpu, oracle.out) <= Tolerance<double>::relative);
  auto state = attention.make_state<double>(1, 1000);
  CHECK(state.shape().compressed_capacity() == 0);
}

TEST_CASE("ConvCompressed: zero values and zero weights give exactly zero output") {
  auto p = fixed_problem<double>(1, 30, 2, 3, 4, 3, 2, 635);
  p.params = ConvCompressedParams::zeros(p.dims);
  p.v.fill(0.0);
  auto run = [&](auto backend) {
    for (auto* direction : {"causal", "bidirectional"}) {
      Tensor<double, 4> out(p.v.extents(), 7.0);
      if (std::string_view(direction) == "causal")
        ConvCompressedAttention<Causal>(p.dims, p.params)
            .forward(backend, p.q, p.k, p.v, out.view());
      else
        ConvCompressedAttention<Bidirectional>(p.dims, p.params)
            .forward(backend, p.q, p.k, p.v, out.view());
      CHECK(std::all_of(out.data(), out.data() + out.size(), [](double x) { return x == 0.0; }));
    }
  };
  run(exec::reference);
  run(exec::cpu);
}

TEST_CASE("ConvCompressed: defaults") {
  const auto p = fixed_problem<float>(1, 4, 2, 4, 6, 5, 1, 636);
  const ConvCompressedAttention<Causal> causal(p.dims, p.params);
  CHECK(causal.window().left == 4);
  CHECK(causal.window().right == 0);
  CHECK(causal.scale() == doctest::Approx(0.5));
  CHECK(causal.dims().window_left == 4);
  const ConvCompressedAttention<Bidirectional> bidirectional(p.dims, p.params, 0.25);
  CHECK(bidirectional.window().left == 4);
  CHECK(bidirectional.window().right == 4);
  CHECK(bidirectional.scale() == 0.25);
  CHECK(ConvCompressedAttention<Causal>::kind<float>() ==
        "ConvCompressedAttention<causal>/float32");
}

TEST_CASE("ConvCompressed: large scores (window and cross) stay finite and exact") {
  for (const bool causal : {true, false}) {
    auto p = fixed_problem<double>(1, 45, 2, 8, 4, 3, 2, 637);
    for (index_t i = 0; i < p.q.size(); ++i) p.q.data()[i] *= 30, p.k.data()[i] *= 30;
    for (auto* w : {&p.params.cross_query, &p.params.cross_key})
      for (index_t i = 0; i < w->size(); ++i) w->data()[i] *= 40;  // cross scores ~ 1e2..1e3
    p.spec.causal = causal;
    p.spec.window_right = causal ? 0 : 2;
    const auto oracle = conv_compressed_oracle(p.spec, p.params, p.q, p.k, p.v);
    auto run = [&](auto backend) {
      CAPTURE(decltype(backend)::name);
      Tensor<double, 4> out(p.v.extents());
      if (causal)
        ConvCompressedAttention<Causal>(p.dims, p.params)
            .forward(backend, p.q, p.k, p.v, out.view());
      else
        ConvCompressedAttention<Bidirectional>(p.dims, p.params)
            .forward(backend, p.q, p.k, p.v, out.view());
      CHECK(all_finite(out));
      CHECK(relative_error(out, oracle.out) <= Tolerance<double>::relative);
    };
    run(exec::reference);
    run(exec::cpu);
  }
}

TEST_CASE("ConvCompressed: strided views into one fused QKV buffer give bit-identical output") {
  const auto p = fixed_problem<float>(2, 29, 3, 4, 5, 3, 2, 638);
  const ConvCompressedAttention<Causal> attention(p.dims, p.params);
  Tensor<float, 4> expected(p.v.extents());
  attention.forward(exec::reference, p.q, p.k, p.v, expected.view());
  const index_t width = 4 + 4 + 5;  // [B, T, H, Dk + Dk + Dv]
  Tensor<float, 4> fused({2, 29, 3, width});
  for (index_t b = 0; b < 2; ++b)
    for (index_t t = 0; t < 29; ++t)
      for (index_t h = 0; h < 3; ++h) {
        for (index_t d = 0; d < 4; ++d) fused(b, t, h, d) = p.q(b, t, h, d);
        for (index_t d = 0; d < 4; ++d) fused(b, t, h, 4 + d) = p.k(b, t, h, d);
        for (index_t d = 0; d < 5; ++d) fused(b, t, h, 8 + d) = p.v(b, t, h, d);
      }
  const std::array<index_t, 4> strides{29 * 3 * width, 3 * width, width, 1};
  auto part = [&](index_t offset, index_t dim) {
    return TensorView<const float, 4>(fused.data() + offset, {2, 29, 3, dim}, strides);
  };
  // out as [T, B, H, Dv] memory viewed as [B, T, H, Dv].
  std::vector<float> out_storage(static_cast<std::size_t>(2 * 29 * 3 * 5));
  const TensorView<float, 4> out(out_storage.data(), {2, 29, 3, 5}, {3 * 5, 2 * 3 * 5, 5, 1});
  attention.forward(exec::reference, part(0, 4), part(4, 4), part(8, 5), out);
  bool identical = true;
  for (index_t b = 0; b < 2; ++b)
    for (index_t t = 0; t < 29; ++t)
      for (index_t h = 0; h < 3; ++h)
        for (index_t d = 0; d < 5; ++d) identical = identical && out(b, t, h, d) == expected(b, t, h, d);
  CHECK(identical);
  // The decode path through the same strided views.
  auto state = attention.make_state<float>(2, 29);
  attention.forward(exec::reference, part(0, 4), part(4, 4), part(8, 5), out, state);
  Tensor<float, 4> decoded(p.v.extents());
  for (index_t b = 0; b < 2; ++b)
    for (index_t t = 0; t < 29; ++t)
      for (index_t h = 0; h < 3; ++h)
        for (index_t d = 0; d < 5; ++d) decoded(b, t, h, d) = out(b, t, h, d);
  CHECK(relative_error(decoded, conv_compressed_oracle(p.spec, p.params, p.q, p.k, p.v).out) <=
        Tolerance<float>::relative);
  // The cpu backend through the same strided views, whole and with a state.
  auto copy_out = [&] {
    Tensor<float, 4> copy(p.v.extents());
    for (index_t b = 0; b < 2; ++b)
      for (index_t t = 0; t < 29; ++t)
        for (index_t h = 0; h < 3; ++h)
          for (index_t d = 0; d < 5; ++d) copy(b, t, h, d) = out(b, t, h, d);
    return copy;
  };
  const auto oracle = conv_compressed_oracle(p.spec, p.params, p.q, p.k, p.v).out;
  attention.forward(exec::cpu, part(0, 4), part(4, 4), part(8, 5), out);
  CHECK(relative_error(copy_out(), oracle) <= Tolerance<float>::relative);
  auto state_cpu = attention.make_state<float>(2, 29);
  attention.forward(exec::cpu, part(0, 4), part(4, 4), part(8, 5), out, state_cpu);
  CHECK(relative_error(copy_out(), oracle) <= Tolerance<float>::relative);
}

// --------------------------------------------------------------- bad input --

namespace {

constexpr index_t kB = 2, kT = 7, kH = 3, kDk = 4, kDv = 5, kM = 2, kLevels = 2;
const ConvCompressedDims kDims{
    .heads = kH, .key_dim = kDk, .value_dim = kDv, .group_size = kM, .levels = kLevels};

ConvCompressedParams good_params(ConvCompressedDims dims = kDims) {
  Rng rng(640);
  return random_params<float>(rng, dims);
}

struct Inputs {
  Tensor<float, 4> q, k, v, out;
  static Inputs make(index_t batch = kB, index_t time = kT) {
    Rng rng(641);
    return {random_tensor<float, 4>(rng, {batch, time, kH, kDk}, 1.0),
            random_tensor<float, 4>(rng, {batch, time, kH, kDk}, 1.0),
            uniform_tensor<float, 4>(rng, {batch, time, kH, kDv}, -1, 1),
            Tensor<float, 4>({batch, time, kH, kDv})};
  }
  template <class A>
  void forward(const A& attention) {
    attention.forward(exec::reference, q.cview(), k.cview(), v.cview(), out.view());
  }
  template <class A, class S>
  void forward(const A& attention, S& state) {
    attention.forward(exec::reference, q.cview(), k.cview(), v.cview(), out.view(), state);
  }
};

struct StepInputs {
  Tensor<float, 3> q, k, v, out;
  static StepInputs make(index_t batch = kB) {
    Rng rng(642);
    return {random_tensor<float, 3>(rng, {batch, kH, kDk}, 1.0),
            random_tensor<float, 3>(rng, {batch, kH, kDk}, 1.0),
            uniform_tensor<float, 3>(rng, {batch, kH, kDv}, -1, 1),
            Tensor<float, 3>({batch, kH, kDv})};
  }
  template <class S>
  void step(const ConvCompressedAttention<Causal>& attention, S& state) {
    attention.step(exec::reference, state, q.cview(), k.cview(), v.cview(), out.view());
  }
};

using CausalCC = ConvCompressedAttention<Causal>;
using BidirectionalCC = ConvCompressedAttention<Bidirectional>;

}  // namespace

TEST_CASE_TEMPLATE("dims: group size M <= 0", A, CausalCC, BidirectionalCC) {
  CHECK_NOTHROW(A(kDims, good_params()));
  for (const index_t M : {0, -1, -64}) {
    ConvCompressedDims dims = kDims;
    dims.group_size = M;
    expect_error([&] { A(dims, good_params()); }, "dims.group_size", ">= 1");
  }
}
TEST_CASE_TEMPLATE("dims: levels <= 0", A, CausalCC, BidirectionalCC) {
  for (const index_t levels : {0, -1}) {
    ConvCompressedDims dims = kDims;
    dims.levels = levels;
    expect_error([&] { A(dims, good_params()); }, "dims.levels", ">= 1");
  }
}
TEST_CASE_TEMPLATE("dims: heads, key_dim, value_dim <= 0", A, CausalCC, BidirectionalCC) {
  ConvCompressedDims dims = kDims;
  dims.heads = 0;
  expect_error([&] { A(dims, good_params()); }, "dims.heads");
  dims = kDims;
  dims.key_dim = -1;
  expect_error([&] { A(dims, good_params()); }, "dims.key_dim");
  dims = kDims;
  dims.value_dim = 0;
  expect_error([&] { A(dims, good_params()); }, "dims.value_dim");
  expect_error([&] { A(ConvCompressedDims{}, good_params()); }, "dims.heads");
}
TEST_CASE("dims: windows") {
  ConvCompressedDims dims = kDims;
  dims.window_left = 0;
  CHECK_NOTHROW(CausalCC(dims, good_params()));
  dims.window_left = -1;
  expect_error([&] { CausalCC(dims, good_params()); }, "dims.window_left", ">= 0");
  dims = kDims;
  dims.window_right = 1;
  CHECK_NOTHROW(BidirectionalCC(dims, good_params()));
  expect_error([&] { CausalCC(dims, good_params()); }, "dims.window_right", "under Causal");
  dims.window_right = -2;
  expect_error([&] { BidirectionalCC(dims, good_params()); }, "dims.window_right", ">= 0");
}
TEST_CASE("scale: not finite") {
  CHECK_NOTHROW(CausalCC(kDims, good_params(), 0.5));
  expect_error([] { CausalCC(kDims, good_params(), std::numeric_limits<double>::infinity()); },
               "scale");
  expect_error([] { CausalCC(kDims, good_params(), std::numeric_limits<double>::quiet_NaN()); },
               "scale");
}

TEST_CASE("params: conv weight of the wrong shape, in every dimension") {
  CHECK_NOTHROW(CausalCC(kDims, good_params()));
  for (std::size_t level = 0; level < 2; ++level)
    for (std::size_t dim = 0; dim < 4; ++dim)
      for (const index_t delta : {-1, +1}) {
        ConvCompressedParams params = good_params();
        auto extents = params.conv_weight[level].extents();
        extents[dim] += delta;
        params.conv_weight[level] = Tensor<double, 4>(extents, 0.1);
        expect_error([&] { CausalCC(kDims, params); },
                     "params.conv_weight[" + std::to_string(level) + "]", "[H, M, Dv, Dv]");
      }
  // The message names both shapes.
  ConvCompressedParams params = good_params();
  params.conv_weight[0] = Tensor<double, 4>({kH, kM + 1, kDv, kDv});
  expect_error([&] { CausalCC(kDims, params); }, "params.conv_weight[0]",
               "expected [3, 2, 5, 5], given [3, 3, 5, 5]");
}
TEST_CASE("params: conv weight given as the transposed torch layout [H, Dv, Dv, M]") {
  ConvCompressedDims dims = kDims;
  dims.group_size = 3;
  ConvCompressedParams params = good_params(dims);
  params.conv_weight[1] = Tensor<double, 4>({kH, kDv, kDv, 3});
  expect_error([&] { CausalCC(dims, params); }, "params.conv_weight[1]", "[H, M, Dv, Dv]");
}
TEST_CASE("params: one conv weight per level") {
  ConvCompressedParams params = good_params();
  params.conv_weight.pop_back();
  expect_error([&] { CausalCC(kDims, params); }, "params.conv_weight", "expected 2, given 1");
  params = good_params();
  params.conv_weight.push_back(params.conv_weight.back());
  expect_error([&] { CausalCC(kDims, params); }, "params.conv_weight", "expected 2, given 3");
  params = good_params();
  params.conv_bias.clear();
  expect_error([&] { CausalCC(kDims, params); }, "params.conv_bias", "expected 2, given 0");
}
TEST_CASE("params: bias and projections of the wrong shape or count") {
  ConvCompressedParams params = good_params();
  params.conv_bias[1] = Tensor<double, 2>({kH, kDv + 1});
  expect_error([&] { CausalCC(kDims, params); }, "params.conv_bias[1]", "[H, Dv]");
  params = good_params();
  params.level_query[0] = Tensor<double, 3>({kH, kDv, kDk});  // [in, out]: transposed
  expect_error([&] { CausalCC(kDims, params); }, "params.level_query[0]", "[H, Dk, Dv]");
  params = good_params();
  params.level_key.clear();
  expect_error([&] { CausalCC(kDims, params); }, "params.level_key", "expected 1, given 0");
  params = good_params();
  params.level_value[0] = Tensor<double, 3>({kH + 1, kDv, kDv});
  expect_error([&] { CausalCC(kDims, params); }, "params.level_value[0]", "[H, Dv, Dv]");
  params = good_params();
  params.cross_query = Tensor<double, 3>({kH, kDk + 1, kDv});
  expect_error([&] { CausalCC(kDims, params); }, "params.cross_query", "[H, Dk, Dv]");
  params = good_params();
  params.cross_key = Tensor<double, 3>();
  expect_error([&] { CausalCC(kDims, params); }, "params.cross_key", "[H, Dk, Dv]");
  params = good_params();
  params.cross_value = Tensor<double, 3>({kH, kDv, kDk});
  expect_error([&] { BidirectionalCC(kDims, params); }, "params.cross_value", "[H, Dv, Dv]");
  // levels = 1 needs no level projections, and rejects some.
  ConvCompressedDims one = kDims;
  one.levels = 1;
  params = good_params(one);
  CHECK_NOTHROW(CausalCC(one, params));
  params.level_query.push_back(Tensor<double, 3>({kH, kDk, kDv}));
  expect_error([&] { CausalCC(one, params); }, "params.level_query", "expected 0, given 1");
}
TEST_CASE("params: non-finite weights") {
  for (const double bad : {std::numeric_limits<double>::quiet_NaN(),
                           std::numeric_limits<double>::infinity()}) {
    ConvCompressedParams params = good_params();
    params.conv_weight[1](2, 1, 4, 3) = bad;
    expect_error([&] { CausalCC(kDims, params); }, "params.conv_weight[1]", "finite");
    params = good_params();
    params.cross_value(0, 0, 0) = bad;
    expect_error([&] { CausalCC(kDims, params); }, "params.cross_value", "finite");
  }
}

TEST_CASE_TEMPLATE("forward: every input and the output with a wrong extent", A, CausalCC,
                   BidirectionalCC) {
  const A attention(kDims, good_params());
  const std::array<std::string_view, 4> names{"queries", "keys", "values", "out"};
  for (int which = 0; which < 4; ++which)
    for (std::size_t dim = 0; dim < 4; ++dim) {
      if (which == 0 && dim < 2) continue;  // queries fix B and T
      Inputs in = Inputs::make();
      REQUIRE_NOTHROW(in.forward(attention));
      Tensor<float, 4>* tensors[] = {&in.q, &in.k, &in.v, &in.out};
      auto extents = tensors[which]->extents();
      extents[dim] += 1;
      *tensors[which] = Tensor<float, 4>(extents, 0.25f);
      expect_error([&] { in.forward(attention); }, names[static_cast<std::size_t>(which)]);
    }
  Inputs in = Inputs::make();
  in.q = Tensor<float, 4>({kB, kT, kH, kDk + 1});
  expect_error([&] { in.forward(attention); }, "queries", "[B, T, H, Dk]");
}
TEST_CASE_TEMPLATE("forward: out aliases an input; T = 0 is a no-op", A, CausalCC,
                   BidirectionalCC) {
  const A attention(kDims, good_params());
  Inputs in = Inputs::make();
  const TensorView<float, 4> aliased(in.v.data(), in.v.extents());
  expect_error(
      [&] { attention.forward(exec::reference, in.q.cview(), in.k.cview(), in.v.cview(), aliased); },
      "out", "aliases input 'values'");
  Inputs empty = Inputs::make(kB, 0);
  std::vector<float> sentinel(16, 42.0f);
  CHECK_NOTHROW(attention.forward(exec::reference, empty.q.cview(), empty.k.cview(),
                                  empty.v.cview(), TensorView<float, 4>(sentinel.data(), {kB, 0, kH, kDv})));
  CHECK(std::all_of(sentinel.begin(), sentinel.end(), [](float x) { return x == 42.0f; }));
}

TEST_CASE("step: inputs with a wrong extent do not advance the state") {
  const CausalCC attention(kDims, good_params());
  auto state = attention.make_state<float>(kB, 16);
  const std::array<std::string_view, 4> names{"queries", "keys", "values", "out"};
  for (int which = 0; which < 4; ++which)
    for (std::size_t dim = 0; dim < 3; ++dim) {
      StepInputs in = StepInputs::make();
      REQUIRE_NOTHROW(in.step(attention, state));
      const auto position = state.position();
      const auto saved = state.save();
      Tensor<float, 3>* tensors[] = {&in.q, &in.k, &in.v, &in.out};
      auto extents = tensors[which]->extents();
      extents[dim] += (dim == 0 ? -1 : 1);
      *tensors[which] = Tensor<float, 3>(extents, 0.25f);
      expect_error([&] { in.step(attention, state); }, names[static_cast<std::size_t>(which)]);
      CHECK(state.position() == position);
      CHECK(state.save() == saved);
    }
}
TEST_CASE("step: out aliases the values") {
  const CausalCC attention(kDims, good_params());
  auto state = attention.make_state<float>(kB, 16);
  StepInputs in = StepInputs::make();
  const TensorView<float, 3> aliased(in.v.data(), in.v.extents());
  expect_error(
      [&] {
        attention.step(exec::reference, state, in.q.cview(), in.k.cview(), in.v.cview(), aliased);
      },
      "out", "aliases input 'values'");
  CHECK(state.position() == 0);
}

TEST_CASE("state: capacity, batch and a state of another attention") {
  const CausalCC attention(kDims, good_params());
  expect_error([&] { (void)attention.make_state<float>(0, 16); }, "batch");
  expect_error([&] { (void)attention.make_state<float>(kB, 0); }, "context_capacity");
  // A step past the capacity.
  auto state = attention.make_state<float>(kB, 3);
  StepInputs in = StepInputs::make();
  for (int i = 0; i < 3; ++i) REQUIRE_NOTHROW(in.step(attention, state));
  expect_error([&] { in.step(attention, state); }, "state", "context_capacity");
  CHECK(state.position() == 3);
  // A forward longer than the capacity.
  auto small = attention.make_state<float>(kB, kT - 1);
  Inputs seq = Inputs::make();
  expect_error([&] { seq.forward(attention, small); }, "state", "context_capacity");
  CHECK(small.position() == 0);
  // Another batch size.
  auto other_batch = attention.make_state<float>(kB + 1, 16);
  expect_error([&] { seq.forward(attention, other_batch); }, "state", "state sizes");
  expect_error([&] { in.step(attention, other_batch); }, "queries");  // step takes B from the state
  // Another group size, level count or window: the layout differs.
  for (int change = 0; change < 3; ++change) {
    ConvCompressedDims dims = kDims;
    if (change == 0) dims.group_size = 3;
    if (change == 1) dims.levels = 1;
    if (change == 2) dims.window_left = 5;
    const CausalCC other(dims, good_params(dims));
    auto foreign = other.make_state<float>(kB, 16);
    expect_error([&] { in.step(attention, foreign); }, "state", "state sizes");
  }
  // A default-constructed state.
  ConvCompressedState<float> empty;
  expect_error([&] { in.step(attention, empty); }, "state", "state kind");
}

TEST_CASE("load_state: truncations, trailing bytes, other kinds and corrupted sizes") {
  const CausalCC attention(kDims, good_params());
  auto state = attention.make_state<float>(kB, 16);
  Inputs in = Inputs::make();
  in.forward(attention, state);
  const std::vector<std::byte> bytes = state.save();
  REQUIRE_NOTHROW((void)attention.load_state<float>(bytes));
  for (std::size_t n = 0; n < bytes.size(); n += 7) {
    const std::span<const std::byte> cut(bytes.data(), n);
    CHECK_THROWS_AS((void)attention.load_state<float>(cut), latte::Error);
  }
  std::vector<std::byte> longer = bytes;
  longer.insert(longer.end() - 4, std::byte{0});  // before the checksum, signed
  expect_error([&] { (void)attention.load_state<float>(resigned(longer)); }, "bytes",
               "state data bytes");
  expect_error([&] { (void)attention.load_state<double>(bytes); }, "bytes", "state kind");
  std::vector<std::byte> garbage(bytes.size(), std::byte{0x5a});
  expect_error([&] { (void)attention.load_state<float>(garbage); }, "bytes", "magic");
  // Bytes of an attention with another group size.
  ConvCompressedDims dims = kDims;
  dims.group_size = 3;
  const CausalCC other(dims, good_params(dims));
  expect_error([&] { (void)other.load_state<float>(bytes); }, "bytes", "saved state sizes");
  // Corrupt a size value: sizes are (name, int64) pairs after the magic and the kind.
  const std::string kind = CausalCC::kind<float>();
  const std::vector<std::string> names{"batch",  "heads",       "key_dim",         "value_dim",
                                       "group_size", "levels", "window_left", "context_capacity"};
  auto value_offset = [&](std::size_t index) {
    std::size_t offset = 8 + 8 + kind.size() + 8;
    for (std::size_t i = 0; i < index; ++i) offset += 8 + names[i].size() + 8;
    return offset + 8 + names[index].size();
  };
  auto patched_at = [&](std::size_t offset, std::int64_t value) {
    std::vector<std::byte> copy = bytes;
    std::memcpy(copy.data() + offset, &value, sizeof value);
    return resigned(std::move(copy));
  };
  auto patched = [&](std::size_t index, std::int64_t value) {
    return patched_at(value_offset(index), value);
  };
  REQUIRE(patched(0, kB) == bytes);  // the offsets are right
  expect_error([&] { (void)attention.load_state<float>(patched(0, std::int64_t(1) << 60)); },
               "bytes", "saved batch");
  expect_error([&] { (void)attention.load_state<float>(patched(7, std::int64_t(1) << 62)); },
               "bytes", "context_capacity");
  expect_error([&] { (void)attention.load_state<float>(patched(7, 5)); }, "bytes",
               "saved field");  // a smaller capacity has smaller fields
  // The position follows the sizes: past context_capacity 16 is no state's.
  const std::size_t position_offset = value_offset(7) + 8;
  REQUIRE(patched_at(position_offset, 7) == bytes);  // the state is at position 7
  expect_error([&] { (void)attention.load_state<float>(patched_at(position_offset, 17)); },
               "bytes", "saved position");
  {
    auto target = attention.make_state<float>(kB, 16);
    expect_error([&] { target.restore(patched_at(position_offset, 17)); }, "bytes",
                 "saved position");
    CHECK(target.position() == 0);
    CHECK_NOTHROW(target.restore(patched_at(position_offset, 16)));
  }
  expect_error([&] { (void)attention.load_state<float>(patched(7, 40)); }, "bytes");
  expect_error([&] { (void)attention.load_state<float>(patched(4, 3)); }, "bytes",
               "saved state sizes");
  // restore() of a rejected buffer leaves the state as it was.
  const auto before = state.save();
  CHECK_THROWS_AS(state.restore(patched(7, 40)), latte::Error);
  CHECK(state.save() == before);
}

}  // namespace test_conv_compressed
