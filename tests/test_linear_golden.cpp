// Golden values from the official code (tests/golden/make_linear_golden.py
// re-implements, in numpy, OpenNLPLab/cosFormer's left_product and
// OSU-STARLAB/LeaPformer's leapformer_attn_train, leapformer_attn_bidir_infer and
// leapformer_attn_causal_infer on fixed seeds). Our CosFormer and LeaPformer,
// with their default options, must reproduce them: forward against the
// quadratic paths, step-by-step decode against the incremental decoder, and
// cross_forward against both cross-attention paths.
#include <doctest/doctest.h>

#include <cstdio>
#include <string>
#include <string_view>

#include "golden/linear_golden.hpp"
#include "linear_support.hpp"

namespace test_linear_golden {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;
namespace g = latte::test::golden;

const g::Array& golden_array(std::string_view name) {
  for (const g::Array& array : g::kArrays)
    if (array.name == name) return array;
  FAIL("no golden array named " << std::string(name));
  return g::kArrays[0];
}

template <class T>
Tensor<T, 4> golden_tensor(std::string_view name) {
  const g::Array& array = golden_array(name);
  REQUIRE(array.rank == 4);
  Tensor<T, 4> tensor({array.shape[0], array.shape[1], array.shape[2], array.shape[3]});
  REQUIRE(static_cast<std::size_t>(tensor.size()) == array.values.size());
  for (index_t i = 0; i < tensor.size(); ++i) tensor.data()[i] = static_cast<T>(array.values[i]);
  return tensor;
}

TensorLD<4> golden_expected(std::string_view name) { return golden_tensor<long double>(name); }

LeaPModule golden_module(const std::string& side) {
  const g::Array& w1 = golden_array("leap/" + side + "/w1");
  const g::Array& b1 = golden_array("leap/" + side + "/b1");
  const g::Array& w2 = golden_array("leap/" + side + "/w2");
  const g::Array& b2 = golden_array("leap/" + side + "/b2");
  return LeaPModule::from<double>(
      TensorView<const double, 2>(w1.values.data(), {w1.shape[0], w1.shape[1]}),
      TensorView<const double, 1>(b1.values.data(), {b1.shape[0]}),
      TensorView<const double, 1>(w2.values.data(), {w2.shape[0]}), b2.values[0]);
}

template <class T>
void check_golden(const Tensor<T, 4>& out, std::string_view name, const char* what) {
  const double error = relative_error(out, golden_expected(name));
  CHECK_MESSAGE(error <= Tolerance<T>::relative, what << " vs " << std::string(name));
  std::printf("[golden] %-46s vs %-38s %s max_rel_error=%.3e (tol %.0e)\n", what,
              std::string(name).c_str(), dtype_name<T>(), error, Tolerance<T>::relative);
}

constexpr LinearDims kDims{.heads = g::kHeads, .key_dim = g::kDim, .value_dim = g::kDim};

template <class T, class E>
void cosformer_golden(E backend) {
  const auto q = golden_tensor<T>("self/q"), k = golden_tensor<T>("self/k");
  const auto v = golden_tensor<T>("self/v");
  const auto cq = golden_tensor<T>("cross/q"), ck = golden_tensor<T>("cross/k");
  const auto cv = golden_tensor<T>("cross/v");
  Tensor<T, 4> out(v.extents()), cross_out(cq.extents());
  // Defaults: M = T (max(S, T) for cross), clamp_min(1e-6), as cosFormer's code.
  CosFormer<Bidirectional>(kDims).forward(backend, q, k, v, out.view());
  check_golden(out, "cosformer/left_product/bidirectional", "CosFormer<Bidirectional>::forward");
  CosFormer<Causal>(kDims).forward(backend, q, k, v, out.view());
  check_golden(out, "cosformer/left_product/causal", "CosFormer<Causal>::forward");
  CosFormer<Bidirectional>(kDims).cross_forward(backend, cq, ck, cv, cross_out.view());
  check_golden(cross_out, "cosformer/left_product/cross", "CosFormer<Bidirectional>::cross_forward");
  // Decode with M = T reproduces the causal values token by token.
  const CosFormer<Causal> decoder(kDims, {.reweight = {.length = g::kSelfLength}});
  auto state = decoder.template make_state<T>(g::kBatch);
  Tensor<T, 3> row({g::kBatch, g::kHeads, g::kDim});
  for (index_t t = 0; t < g::kSelfLength; ++t) {
    decoder.step(backend, state, time_step(q, t), time_step(k, t), time_step(v, t),
                 row.view());
    set_time_step(out, t, row);
  }
  check_golden(out, "cosformer/left_product/causal", "CosFormer<Causal>::step (M = T)");
}

template <class T, class E>
void leapformer_golden(E backend) {
  const auto q = golden_tensor<T>("self/q"), k = golden_tensor<T>("self/k");
  const auto v = golden_tensor<T>("self/v");
  const auto cq = golden_tensor<T>("cross/q"), ck = golden_tensor<T>("cross/k");
  const auto cv = golden_tensor<T>("cross/v");
  LeaPReweight::Params leap{.query_module = golden_module("query"),
                            .key_module = golden_module("key"),
                            .leap_factor = g::kLeapFactor};
  Tensor<T, 4> out(v.extents()), cross_out(cq.extents());
  // Default normaliser clamp_min(0.1), as LeaPformer's code.
  const LeaPformer<Causal> causal(kDims, {.reweight = leap});
  causal.forward(backend, q, k, v, out.view());
  check_golden(out, "leapformer/train/causal", "LeaPformer<Causal>::forward");
  auto state = causal.template make_state<T>(g::kBatch);
  Tensor<T, 3> row({g::kBatch, g::kHeads, g::kDim});
  for (index_t t = 0; t < g::kSelfLength; ++t) {
    causal.step(backend, state, time_step(q, t), time_step(k, t), time_step(v, t),
                row.view());
    set_time_step(out, t, row);
  }
  check_golden(out, "leapformer/causal_infer/self", "LeaPformer<Causal>::step");
  const LeaPformer<Bidirectional> bidirectional(kDims, {.reweight = leap});
  bidirectional.forward(backend, q, k, v, out.view());
  check_golden(out, "leapformer/train/bidirectional", "LeaPformer<Bidirectional>::forward");
  bidirectional.cross_forward(backend, cq, ck, cv, cross_out.view());
  check_golden(cross_out, "leapformer/train/cross", "LeaPformer<Bidirectional>::cross_forward");
  check_golden(cross_out, "leapformer/bidir_infer/cross", "LeaPformer<Bidirectional>::cross_forward");
  check_golden(cross_out, "leapformer/causal_infer/cross", "LeaPformer<Bidirectional>::cross_forward");
}

}  // namespace

TEST_CASE("CosFormer reproduces cosFormer's left_product (bidirectional, causal, cross, decode)") {
  cosformer_golden<double>(exec::reference);
  cosformer_golden<float>(exec::reference);
  cosformer_golden<double>(exec::cpu);
  cosformer_golden<float>(exec::cpu);
}

TEST_CASE("LeaPformer reproduces leapformer_attn_train / _bidir_infer / _causal_infer") {
  leapformer_golden<double>(exec::reference);
  leapformer_golden<float>(exec::reference);
  leapformer_golden<double>(exec::cpu);
  leapformer_golden<float>(exec::cpu);
}

TEST_CASE("LeaP module proportions equal the official module's") {
  const LeaPModule module = golden_module("query");
  const g::Array& expected = golden_array("leap/proportions/self/q");
  const auto q = golden_tensor<double>("self/q");
  double worst = 0;
  std::vector<double> phi(static_cast<std::size_t>(g::kDim));
  for (index_t b = 0; b < g::kBatch; ++b)
    for (index_t t = 0; t < g::kSelfLength; ++t)
      for (index_t h = 0; h < g::kHeads; ++h) {
        Relu::apply(std::span<const double>(q.view().row(b, t, h), phi.size()),
                    std::span<double>(phi));
        const Proportion p = module.evaluate(phi.data());
        const double want = expected.values[(b * g::kSelfLength + t) * g::kHeads + h];
        worst = std::max(worst, std::fabs(p.value - want));
        CHECK(std::fabs(p.value + p.complement - 1.0) <= 1e-15);
      }
  CHECK(worst <= 1e-15);
  std::printf("[golden] LeaPModule::evaluate vs leap/proportions/self/q max_abs_error=%.3e\n", worst);
}

TEST_CASE("golden values are sensitive to the documented conventions") {
  // A wrong normaliser or M changes the results by far more than the tolerance,
  // so the comparisons above can fail.
  const auto q = golden_tensor<double>("self/q"), k = golden_tensor<double>("self/k");
  const auto v = golden_tensor<double>("self/v");
  Tensor<double, 4> out(v.extents());
  CosFormer<Causal>(kDims, {.reweight = {.length = g::kSelfLength + 1}})
      .forward(exec::reference, q, k, v, out.view());
  CHECK(relative_error(out, golden_expected("cosformer/left_product/causal")) > 1e-3);
  LeaPReweight::Params leap{.query_module = golden_module("query"),
                            .key_module = golden_module("key"),
                            .leap_factor = g::kLeapFactor};
  LeaPformer<Causal>(kDims, {.normaliser = Normaliser::additive(1e-6), .reweight = leap})
      .forward(exec::reference, q, k, v, out.view());
  CHECK(relative_error(out, golden_expected("leapformer/train/causal")) > 1e-3);
}

}  // namespace test_linear_golden
