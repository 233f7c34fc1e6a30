// SoftmaxAttention::backward (reference and cpu, fp32 and fp64) against the
// gradients of the long-double loss L = <d_out, softmax_oracle(q, k, v)>
// (tests/gradient_check.hpp): every element by central differences on small
// shapes, directional derivatives on random shapes up to T = 1000, and the
// adversarial inputs of DESIGN §4 (score spreads of ~1e3, zero values, rows
// that see one key).
//
// Inputs are drawn as floats, so the fp32 and fp64 calls differentiate the same
// function and share one reference. The error of a backward is normwise over its
// whole gradient (d_queries, d_keys, d_values as one vector, the gradient of L
// with respect to all of its inputs): max |g - ref| / max |ref|, which stays
// meaningful where one of the three is exactly zero (T = 1, one visible key).
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "allocation_counter.hpp"
#include "gradient_check.hpp"
#include "oracles/softmax_oracle.hpp"
#include "support.hpp"

namespace test_softmax_gradients {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;

/// One backward problem: a mask (a window when `windowed`), an attention scale
/// that fp32 represents exactly, and float-valued inputs and d_out.
struct GradientCase {
  MaskSpec mask;
  bool windowed = false;
  double scale = 1.0;
  Tensor<float, 4> q, k, v, d_out;
};

GradientCase make_case(Rng& rng, MaskSpec mask, bool windowed, std::array<index_t, 5> shape,
                       double input_scale) {
  const auto [B, Tn, H, Dk, Dv] = shape;
  GradientCase c;
  c.mask = mask;
  c.windowed = windowed;
  c.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(Dk)));
  c.q = random_tensor<float, 4>(rng, {B, Tn, H, Dk}, input_scale);
  c.k = random_tensor<float, 4>(rng, {B, Tn, H, Dk}, input_scale);
  c.v = uniform_tensor<float, 4>(rng, {B, Tn, H, Dv}, -1, 1);
  c.d_out = random_tensor<float, 4>(rng, {B, Tn, H, Dv}, 1.0);
  return c;
}

std::string describe(const GradientCase& c) {
  const auto& e = c.q.extents();
  return "B=" + std::to_string(e[0]) + " T=" + std::to_string(e[1]) + " H=" +
         std::to_string(e[2]) + " Dk=" + std::to_string(e[3]) +
         " Dv=" + std::to_string(c.v.extent(3)) + (c.mask.causal ? " causal" : " bidirectional") +
         (c.windowed ? " window=" + std::to_string(c.mask.left) + "," + std::to_string(c.mask.right)
                     : "");
}

template <class T, std::size_t N>
Tensor<T, N> converted(const Tensor<float, N>& x) {
  Tensor<T, N> out(x.extents());
  for (index_t i = 0; i < x.size(); ++i) out.data()[i] = static_cast<T>(x.data()[i]);
  return out;
}

/// Head (b, h) of a [B, T, H, D] tensor as a long-double [1, T, 1, D] tensor.
TensorLD<4> head_of(const Tensor<float, 4>& x, index_t b, index_t h) {
  TensorLD<4> head({1, x.extent(1), 1, x.extent(3)});
  for (index_t t = 0; t < x.extent(1); ++t)
    for (index_t d = 0; d < x.extent(3); ++d) head(0, t, 0, d) = x(b, t, h, d);
  return head;
}

/// <d_out, oracle(q, k, v)> in long double.
struct OracleLoss {
  const MaskSpec& mask;
  long double scale;
  TensorLD<4>&q, &k, &v;
  const TensorLD<4>& d_out;
  long double operator()() const {
    const TensorLD<4> out = softmax_oracle(mask, scale, q, k, v);
    long double loss = 0;
    for (index_t i = 0; i < out.size(); ++i) loss += d_out.data()[i] * out.data()[i];
    return loss;
  }
};

/// dL/dq, dL/dk, dL/dv of every element by central differences (head by head:
/// a head's loss reads only that head).
std::array<TensorLD<4>, 3> central_gradients(const GradientCase& c,
                                             long double step = 1e-4L) {
  std::array<TensorLD<4>, 3> gradient{TensorLD<4>(c.q.extents()), TensorLD<4>(c.k.extents()),
                                      TensorLD<4>(c.v.extents())};
  for (index_t b = 0; b < c.q.extent(0); ++b)
    for (index_t h = 0; h < c.q.extent(2); ++h) {
      TensorLD<4> q = head_of(c.q, b, h), k = head_of(c.k, b, h), v = head_of(c.v, b, h);
      const TensorLD<4> d_out = head_of(c.d_out, b, h);
      const OracleLoss loss{c.mask, static_cast<long double>(c.scale), q, k, v, d_out};
      const GradientValues head =
          central_differences(loss, {as_input(q), as_input(k), as_input(v)}, step);
      for (std::size_t input = 0; input < 3; ++input) {
        const index_t D = gradient[input].extent(3);
        for (index_t t = 0; t < c.q.extent(1); ++t)
          for (index_t d = 0; d < D; ++d)
            gradient[input](b, t, h, d) = head[input][static_cast<std::size_t>(t * D + d)];
      }
    }
  return gradient;
}

/// Calls f(attention) with the SoftmaxAttention type and window of the case.
template <class F>
void with_attention(const GradientCase& c, F&& f) {
  const SoftmaxDims dims{.heads = c.q.extent(2), .key_dim = c.q.extent(3),
                         .value_dim = c.v.extent(3)};
  if (c.windowed) {
    const SlidingWindow window{.left = c.mask.left, .right = std::max<index_t>(c.mask.right, 0)};
    if (c.mask.causal)
      f(SoftmaxAttention<Causal, SlidingWindow>(dims, window, c.scale));
    else
      f(SoftmaxAttention<Bidirectional, SlidingWindow>(dims, window, c.scale));
  } else if (c.mask.causal) {
    f(SoftmaxAttention<Causal>(dims, {}, c.scale));
  } else {
    f(SoftmaxAttention<Bidirectional>(dims, {}, c.scale));
  }
}

template <class T>
using Gradients = std::array<Tensor<T, 4>, 3>;

/// The backends a case runs on. exec::cpu picks its schedule by heads per
/// worker (cpu::softmax_backward_by_head): on 1 thread a case of B H >= 2 runs one head per
/// task, on 16 threads every case here runs the three block passes.
enum class Run { reference, cpu_1_thread, cpu_16_threads };
constexpr std::array<Run, 3> kRuns{Run::reference, Run::cpu_1_thread, Run::cpu_16_threads};
constexpr std::array<const char*, 3> kRunNames{"reference", "cpu 1 thread", "cpu 16 threads"};

/// Runs f() with OpenMP's thread count set to `threads`, then restores it.
template <class F>
void with_threads(int threads, F&& f) {
#if LATTE_WITH_OPENMP
  const int before = omp_get_max_threads();
  omp_set_num_threads(threads);
  f();
  omp_set_num_threads(before);
#else
  (void)threads;
  f();
#endif
}

/// The backward of the case on `e` in dtype T (gradient buffers prefilled with NaN,
/// so an element the backward does not write shows).
template <class T, class E>
Gradients<T> backward_of(const GradientCase& c, E e) {
  const auto q = converted<T>(c.q), k = converted<T>(c.k), v = converted<T>(c.v);
  const auto d_out = converted<T>(c.d_out);
  const T nan = std::numeric_limits<T>::quiet_NaN();
  Gradients<T> g{Tensor<T, 4>(q.extents(), nan), Tensor<T, 4>(k.extents(), nan),
                 Tensor<T, 4>(v.extents(), nan)};
  with_attention(c, [&](const auto& attention) {
    attention.backward(e, q, k, v, d_out,
                       SoftmaxGradients<T>{g[0].view(), g[1].view(), g[2].view()});
  });
  return g;
}

template <class T>
Gradients<T> backward_on(const GradientCase& c, Run run) {
  Gradients<T> g;
  if (run == Run::reference) return backward_of<T>(c, exec::reference);
  with_threads(run == Run::cpu_1_thread ? 1 : 16, [&] { g = backward_of<T>(c, exec::cpu); });
  return g;
}

/// max |g - ref| / max |ref| over the three gradients together (+inf on NaN or inf).
template <class T>
double gradient_error(const Gradients<T>& g, const std::array<TensorLD<4>, 3>& reference) {
  long double worst = 0, scale = 0;
  for (std::size_t input = 0; input < 3; ++input)
    for (index_t i = 0; i < g[input].size(); ++i) {
      const T x = g[input].data()[i];
      if (!std::isfinite(x)) return std::numeric_limits<double>::infinity();
      worst = std::max(worst, std::fabs((long double)x - reference[input].data()[i]));
      scale = std::max(scale, std::fabs(reference[input].data()[i]));
    }
  return static_cast<double>(scale == 0 ? worst : worst / scale);
}

/// Worst errors per run and dtype (fp32 runs, then fp64 runs), for the summary lines.
struct Worst {
  std::array<double, 6> error{};
  int checks = 0, failures = 0;
  /// Counts one check of run `slot` (fp64: slot + 3) and keeps the worst error.
  bool record(std::size_t slot, double error_value, double tolerance) {
    ++checks;
    const bool ok = error_value <= tolerance;
    failures += !ok;
    error[slot] = std::max(error[slot], error_value);
    return ok;
  }
};

/// Calls f(gradients, slot, name) for every run in fp32, then in fp64.
template <class F>
void for_each_run(const GradientCase& c, F&& f) {
  for (std::size_t i = 0; i < kRuns.size(); ++i)
    f(backward_on<float>(c, kRuns[i]), i, std::string(kRunNames[i]) + " fp32");
  for (std::size_t i = 0; i < kRuns.size(); ++i)
    f(backward_on<double>(c, kRuns[i]), i + 3, std::string(kRunNames[i]) + " fp64");
}

/// Checks every run of the case against `reference`.
void check_against(const GradientCase& c, const std::array<TensorLD<4>, 3>& reference,
                   Worst& worst, const std::string& label) {
  for_each_run(c, [&]<class T>(const Gradients<T>& g, std::size_t slot, const std::string& name) {
    const double error = gradient_error(g, reference), tolerance = Tolerance<T>::gradient;
    CHECK_MESSAGE(worst.record(slot, error, tolerance),
                  label << " " << describe(c) << " " << name << " error=" << error << " (tol "
                        << tolerance << ")");
  });
}

void print_worst(const char* kind, const std::string& label, int cases, const Worst& worst) {
  std::printf("[%s] %s: cases=%d checks=%d failed=%d\n  max error fp32: reference %.2e, cpu 1 "
              "thread %.2e, cpu 16 threads %.2e; fp64: %.2e, %.2e, %.2e\n",
              kind, label.c_str(), cases, worst.checks, worst.failures, worst.error[0],
              worst.error[1], worst.error[2], worst.error[3], worst.error[4], worst.error[5]);
}

/// A mask family: direction, and window sides (-1: unbounded, -2: random per case).
struct MaskFamily {
  const char* label;
  bool causal;
  bool windowed;
  index_t left, right;
};

MaskSpec draw_mask(Rng& rng, const MaskFamily& family, index_t Tn) {
  std::uniform_int_distribution<index_t> side(0, Tn + 2);
  MaskSpec mask{.causal = family.causal};
  if (!family.windowed) return mask;
  mask.left = family.left == -2 ? side(rng) : family.left;
  mask.right = family.causal ? 0 : family.right == -2 ? side(rng) : family.right;
  return mask;
}

const std::vector<MaskFamily>& mask_families() {
  static const std::vector<MaskFamily> families{
      {"causal", true, false, -1, -1},
      {"bidirectional", false, false, -1, -1},
      {"causal window left 0 (one key per row)", true, true, 0, 0},
      {"causal window left 3", true, true, 3, 0},
      {"causal window random left", true, true, -2, 0},
      {"bidirectional window 0,0 (one key per row)", false, true, 0, 0},
      {"bidirectional window 0,2", false, true, 0, 2},
      {"bidirectional window 3,1", false, true, 3, 1},
      {"bidirectional window random", false, true, -2, -2},
  };
  return families;
}

}  // namespace

TEST_CASE("softmax backward == central differences of the oracle, every element") {
  Rng rng(2201);
  const std::array<index_t, 10> lengths{1, 2, 3, 5, 7, 11, 13, 17, 31, 40};
  std::uniform_int_distribution<index_t> small(1, 2), dim(1, 8);
  for (const MaskFamily& family : mask_families()) {
    Worst worst;
    const int cases = case_count(4);
    for (int i = 0; i < cases; ++i) {
      // The first case of every family is the largest shape, T = 40.
      const index_t Tn = i == 0 ? 40 : pick(rng, lengths);
      const index_t B = small(rng), H = small(rng), Dk = dim(rng), Dv = dim(rng);
      const GradientCase c = make_case(rng, draw_mask(rng, family, Tn), family.windowed,
                                       {B, Tn, H, Dk, Dv}, pick(rng, std::array{0.5, 1.0, 3.0}));
      check_against(c, central_gradients(c), worst, family.label);
    }
    print_worst("every element", family.label, cases, worst);
  }
}

TEST_CASE("softmax backward: directional derivatives on random shapes up to T = 1000") {
  Rng rng(2202);
  const std::array<MaskFamily, 4> families{mask_families()[0], mask_families()[1],
                                           mask_families()[4], mask_families()[8]};
  for (const MaskFamily& family : families) {
    Worst worst;
    const int cases = case_count(12);
    for (int i = 0; i < cases; ++i) {
      // The first case of every family is T = 1000 (the oracle affords one head there).
      Shape s = random_shape(rng, 3e6);
      if (i == 0) s = {.batch = 1, .time = 1000, .heads = 1, .latents = 1, .value_dim = 1};
      const GradientCase c =
          make_case(rng, draw_mask(rng, family, s.time), family.windowed,
                    {s.batch, s.time, s.heads, s.latents, s.value_dim},
                    pick(rng, std::array{0.5, 1.0, 3.0}));
      // The long-double inputs and a random direction per input.
      TensorLD<4> q = converted<long double>(c.q), k = converted<long double>(c.k),
                  v = converted<long double>(c.v);
      const TensorLD<4> d_out = converted<long double>(c.d_out);
      const GradientInputs inputs{as_input(q), as_input(k), as_input(v)};
      GradientValues direction;
      std::normal_distribution<double> normal(0.0, 1.0);
      for (const auto& input : inputs) {
        auto& values = direction.emplace_back(input.size());
        for (long double& x : values) x = normal(rng);
      }
      const OracleLoss loss{c.mask, static_cast<long double>(c.scale), q, k, v, d_out};
      const long double derivative = directional_derivative(loss, inputs, direction);
      for_each_run(c, [&]<class T>(const Gradients<T>& g, std::size_t slot,
                                   const std::string& name) {
        DirectionalProduct product;
        for (std::size_t input = 0; input < 3; ++input)
          accumulate_product(product,
                             std::span<const T>(g[input].data(),
                                                static_cast<std::size_t>(g[input].size())),
                             direction[input]);
        const double error = product.magnitude == 0
                                 ? static_cast<double>(std::fabs(derivative))
                                 : static_cast<double>(std::fabs(product.value - derivative) /
                                                       product.magnitude);
        CHECK_MESSAGE(worst.record(slot, error, Tolerance<T>::gradient),
                      family.label << " " << describe(c) << " " << name
                                   << " directional error=" << error);
      });
    }
    print_worst("directional", family.label, cases, worst);
  }
}

TEST_CASE("softmax backward: score spreads of ~1e3 give finite gradients equal to the oracle's") {
  // Queries and keys of standard deviation 30 (the forward's large-score test):
  // most rows are nearly one-hot.
  Rng rng(2203);
  for (const MaskFamily& family : {mask_families()[0], mask_families()[1], mask_families()[7]}) {
    Worst worst;
    for (int i = 0; i < 2; ++i) {
      const index_t Tn = i == 0 ? 33 : 12;
      const GradientCase c = make_case(rng, draw_mask(rng, family, Tn), family.windowed,
                                       {1, Tn, 2, 4, 5}, 30.0);
      // A smaller step: the loss's derivatives grow like (scale |k|)^n.
      check_against(c, central_gradients(c, 1e-6L), worst,
                    std::string("spread 1e3 ") + family.label);
    }
    print_worst("large spread", family.label, 2, worst);
  }
}

TEST_CASE("softmax backward: zero values give zero d_queries and d_keys, d_values = P^T d_out") {
  Rng rng(2204);
  for (const MaskFamily& family : {mask_families()[0], mask_families()[1], mask_families()[8]}) {
    GradientCase c =
        make_case(rng, draw_mask(rng, family, 19), family.windowed, {2, 19, 2, 5, 3}, 1.0);
    for (index_t i = 0; i < c.v.size(); ++i) c.v.data()[i] = 0.0f;
    Worst worst;
    check_against(c, central_gradients(c), worst, std::string("zero values ") + family.label);
    print_worst("zero values", family.label, 1, worst);
    // o = 0 and <d_out, v_s> = 0: dS = P (0 - 0) is exactly zero, so are dq and dk.
    auto exactly_zero = [](const auto& tensor) {
      for (index_t i = 0; i < tensor.size(); ++i)
        if (tensor.data()[i] != 0) return false;
      return true;
    };
    for_each_run(c, [&](const auto& g, std::size_t, const std::string& name) {
      CHECK_MESSAGE((exactly_zero(g[0]) && exactly_zero(g[1])), name);
    });
  }
}

TEST_CASE("softmax backward: windows where rows see one key") {
  // left = right = 0: every row sees itself only (o_t = v_t, dv = d_out, dq = dk = 0);
  // window 0,1 bidirectional: the last row sees one key, the others two;
  // a causal window of left 0 on a long sequence crosses the cpu blocks.
  Rng rng(2205);
  const std::array<MaskSpec, 3> masks{MaskSpec{.causal = false, .left = 0, .right = 0},
                                      MaskSpec{.causal = false, .left = 0, .right = 1},
                                      MaskSpec{.causal = true, .left = 0, .right = 0}};
  const std::array<index_t, 3> lengths{23, 37, 70};
  for (std::size_t i = 0; i < masks.size(); ++i) {
    const GradientCase c = make_case(rng, masks[i], true, {1, lengths[i], 2, 3, 4}, 1.0);
    Worst worst;
    check_against(c, central_gradients(c), worst, "one visible key");
    print_worst("one key", describe(c), 1, worst);
  }
}

TEST_CASE("softmax backward: T = 0 validates and allocates nothing; gradients are overwritten") {
  const SoftmaxAttention<Causal> attention({.heads = 2, .key_dim = 3, .value_dim = 4});
  Tensor<float, 4> q({1, 0, 2, 3}), k({1, 0, 2, 3}), v({1, 0, 2, 4}), g({1, 0, 2, 4});
  Tensor<float, 4> dq({1, 0, 2, 3}), dk({1, 0, 2, 3}), dv({1, 0, 2, 4});
  {
    const SoftmaxGradients<float> into{dq.view(), dk.view(), dv.view()};
    const long before = allocations.load();
    attention.backward(exec::cpu, q, k, v, g, into);
    attention.backward(exec::reference, q, k, v, g, into);
    CHECK(allocations.load() - before == 0);
  }
  // A wrong d_values shape at T = 0 is still refused.
  Tensor<float, 4> bad({1, 0, 2, 5});
  CHECK_THROWS_AS(attention.backward(exec::cpu, q, k, v, g,
                                     SoftmaxGradients<float>{dq.view(), dk.view(), bad.view()}),
                  latte::Error);
  // Gradients hold garbage before the call: overwritten, not accumulated into.
  Rng rng(2206);
  const GradientCase c = make_case(rng, {.causal = true}, false, {1, 70, 1, 4, 4}, 1.0);
  for (auto run : {0, 1}) {
    const auto clean = run == 0 ? backward_of<double>(c, exec::reference)
                                : backward_of<double>(c, exec::cpu);
    Gradients<double> dirty{Tensor<double, 4>(c.q.extents(), 7.0),
                            Tensor<double, 4>(c.k.extents(), -3.0),
                            Tensor<double, 4>(c.v.extents(), 1e30)};
    with_attention(c, [&](const auto& attention) {
      const auto q64 = converted<double>(c.q), k64 = converted<double>(c.k),
                 v64 = converted<double>(c.v), g64 = converted<double>(c.d_out);
      const SoftmaxGradients<double> into{dirty[0].view(), dirty[1].view(), dirty[2].view()};
      if (run == 0)
        attention.backward(exec::reference, q64, k64, v64, g64, into);
      else
        attention.backward(q64, k64, v64, g64, into);  // exec::default_t
    });
    for (std::size_t i = 0; i < 3; ++i) CHECK(bit_equal(clean[i], dirty[i]));
  }
}

TEST_CASE("softmax backward: gradients interleaved in one buffer are accepted") {
  // d_queries and d_keys as the even and odd halves of each row of one
  // [B, T, H, 2 Dk] buffer: element-disjoint, so accepted, and the same bits.
  Rng rng(2207);
  const GradientCase c = make_case(rng, {.causal = false}, false, {2, 9, 2, 3, 2}, 1.0);
  const index_t B = 2, Tn = 9, H = 2, Dk = 3;
  const auto expected = backward_of<float>(c, exec::cpu);
  Tensor<float, 4> both({B, Tn, H, 2 * Dk}, -1.0f), dv(c.v.extents());
  const std::array<index_t, 4> strides{Tn * H * 2 * Dk, H * 2 * Dk, 2 * Dk, 1};
  const TensorView<float, 4> dq(both.data(), {B, Tn, H, Dk}, strides);
  const TensorView<float, 4> dk(both.data() + Dk, {B, Tn, H, Dk}, strides);
  with_attention(c, [&](const auto& attention) {
    attention.backward(exec::cpu, c.q, c.k, c.v, c.d_out,
                       SoftmaxGradients<float>{dq, dk, dv.view()});
  });
  bool same = true;
  for (index_t b = 0; b < B; ++b)
    for (index_t t = 0; t < Tn; ++t)
      for (index_t h = 0; h < H; ++h)
        for (index_t d = 0; d < Dk; ++d)
          same = same && dq(b, t, h, d) == expected[0](b, t, h, d) &&
                 dk(b, t, h, d) == expected[1](b, t, h, d);
  CHECK(same);
  CHECK(bit_equal(dv, expected[2]));
}

TEST_CASE("softmax backward: a NaN key reaches no d_queries row that cannot see it") {
  // Key s0 is NaN. A query row that cannot see s0 reads neither its score nor
  // k_s0, so its d_queries row must be the same bits as with k_s0 finite. On
  // cpu, tiles on the band's edge contract only the keys each row sees (a GEMM
  // would multiply dS = 0 by NaN). A window of 5 keys each side over 150
  // positions crosses the 64-key blocks.
  Rng rng(2208);
  const index_t Tn = 150, s0 = 70;
  for (const MaskSpec& mask : {MaskSpec{.causal = true, .left = 5, .right = 0},
                               MaskSpec{.causal = false, .left = 5, .right = 5}}) {
    GradientCase c = make_case(rng, mask, true, {1, Tn, 2, 4, 3}, 1.0);
    std::vector<Gradients<float>> clean;
    for (Run run : kRuns) clean.push_back(backward_on<float>(c, run));
    for (index_t h = 0; h < 2; ++h) c.k(0, s0, h, 1) = std::numeric_limits<float>::quiet_NaN();
    for (std::size_t i = 0; i < kRuns.size(); ++i) {
      const Gradients<float> after = backward_on<float>(c, kRuns[i]);
      int rows_checked = 0, rows_changed = 0;
      for (index_t t = 0; t < Tn; ++t) {
        if (mask.allowed(t, s0)) continue;
        ++rows_checked;
        bool same = true;
        for (index_t h = 0; h < 2; ++h)
          for (index_t d = 0; d < 4; ++d)
            same = same && clean[i][0](0, t, h, d) == after[0](0, t, h, d);
        rows_changed += !same;
      }
      CHECK_MESSAGE(rows_changed == 0, std::string(kRunNames[i])
                                           << (mask.causal ? " causal" : " bidirectional") << ": "
                                           << rows_changed << " of " << rows_checked
                                           << " rows that cannot see the NaN key changed");
    }
  }
}

}  // namespace test_softmax_gradients
