// Edge cases, decided and tested (issue 7, item 5; the decisions are written
// down in docs/numerics.md). Every expectation is the long-double oracle of
// tests/oracles/ or an exact property that follows from the definition:
//   - all -inf latent logits for a row (query side, key side, a whole latent);
//   - sliding windows larger than T;
//   - T = 1 and L = 1;
//   - absolute positions near 2^31 (first_position = 2^31 - 5, steps crossing
//     2^31) for VAPOR, RoPE and cosFormer decode;
//   - zero values give exact zeros;
//   - a NaN in one input element stays in exactly the outputs that depend on
//     it, and leaves every other output bit-identical to the clean run;
//   - a decode state saved by one backend continues on the other;
//   - a state whose position is at the end of int64 refuses further tokens.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "oracles/conv_compressed_oracle.hpp"
#include "oracles/latte_oracle.hpp"
#include "oracles/lavo_oracle.hpp"
#include "oracles/linear_oracle.hpp"
#include "oracles/macchiato_oracle.hpp"
#include "oracles/softmax_oracle.hpp"
#include "expect_error.hpp"
#include "state_bytes.hpp"
#include "support.hpp"

namespace test_edge_cases {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr std::int64_t kTwo31 = std::int64_t{1} << 31;

/// The default RoPE / VAPOR schedule base^(-2i/D), written independently in long double.
std::vector<long double> rope_schedule(index_t heads, index_t dim) {
  std::vector<long double> angles;
  for (index_t h = 0; h < heads; ++h)
    for (index_t i = 0; i < dim / 2; ++i)
      angles.push_back(std::pow(10000.0L, -2.0L * i / (long double)dim));
  return angles;
}

long double inverse_sqrt(index_t n) { return 1.0L / std::sqrt((long double)n); }

/// Steps `state` through every token of the inputs ([B, T, H, *] each) and
/// returns the outputs [B, T, H, out_dim].
template <class E, class Attention, class State, class T, class... Inputs>
Tensor<T, 4> decode(const Attention& attention, State& state, index_t out_dim,
                    const Tensor<T, 4>& first, const Inputs&... rest) {
  const index_t B = first.extent(0), Tn = first.extent(1), H = first.extent(2);
  Tensor<T, 4> out({B, Tn, H, out_dim});
  Tensor<T, 3> row({B, H, out_dim});
  for (index_t t = 0; t < Tn; ++t) {
    attention.step(E{}, state, time_step(first, t), time_step(rest, t)..., row.view());
    set_time_step(out, t, row);
  }
  return out;
}

/// True when every element is exactly zero.
template <class T>
bool all_zero(const Tensor<T, 4>& x) {
  for (index_t i = 0; i < x.size(); ++i)
    if (x.data()[i] != T(0)) return false;
  return true;
}

template <class T>
void check_close(const Tensor<T, 4>& out, const TensorLD<4>& oracle, const std::string& what) {
  const double error = relative_error(out, oracle);
  INFO(what << ": relative error " << error);
  CHECK(error <= Tolerance<T>::relative);
}

// ================================================== all -inf latent logits --

TEST_CASE_TEMPLATE("Latte: rows and latents whose logits are all -inf", T, float, double) {
  // Query side: a query whose L logits are all -inf reads zero. Key side: a
  // token whose L key logits are all -inf gets no weight; a latent with no
  // finite key so far contributes nothing; at t = 0 with no finite key at all
  // the output is zero. (LatteAttention's documented conventions, which the
  // oracle implements from the definition.)
  Rng rng(1);
  const index_t B = 2, Tn = 37, H = 2, L = 5, Dv = 6;
  auto q = random_tensor<T, 4>(rng, {B, Tn, H, L}, 2.0);
  auto k = random_tensor<T, 4>(rng, {B, Tn, H, L}, 2.0);
  const auto v = uniform_tensor<T, 4>(rng, {B, Tn, H, Dv}, -1, 1);
  const T neg_inf = static_cast<T>(kNegInf);
  for (index_t l = 0; l < L; ++l) {
    q(0, 3, 1, l) = neg_inf;                                  // query row
    q(1, 0, 0, l) = neg_inf;                                  // query row at t = 0
    for (index_t h = 0; h < H; ++h) k(0, 0, h, l) = neg_inf;  // batch 0: no finite key at t = 0
    k(0, 5, 1, l) = neg_inf;                                  // one key row later on
    k(1, 20, 0, l) = neg_inf;
  }
  for (index_t s = 0; s < 10; ++s)
    k(1, s, 1, 2) = neg_inf;  // latent 2 of (1, h=1): empty for t < 10
  for (index_t s = 0; s < Tn; ++s) k(1, s, 0, 4) = neg_inf;  // latent 4 of (1, h=0): always empty

  auto check_zero_rows = [&](const Tensor<T, 4>& out, bool causal) {
    for (index_t d = 0; d < Dv; ++d) {
      CHECK(out(0, 3, 1, d) == T(0));
      CHECK(out(1, 0, 0, d) == T(0));
      if (causal)
        for (index_t h = 0; h < H; ++h) CHECK(out(0, 0, h, d) == T(0));
    }
  };
  for (const bool causal : {true, false}) {
    const auto oracle = latte_oracle(causal, q, k, v);
    Tensor<T, 4> ref(v.extents()), cpu(v.extents());
    if (causal) {
      const LatteAttention<Causal> attention({.heads = H, .latents = L, .value_dim = Dv});
      attention.forward(exec::reference, q, k, v, ref.view());
      attention.forward(exec::cpu, q, k, v, cpu.view());
      auto ref_state = attention.make_state<T>(B);
      auto cpu_state = attention.make_state<T>(B);
      const auto ref_decoded = decode<exec::reference_t>(attention, ref_state, Dv, q, k, v);
      const auto cpu_decoded = decode<exec::cpu_t>(attention, cpu_state, Dv, q, k, v);
      check_close(ref_decoded, oracle, "causal decode, reference");
      check_close(cpu_decoded, oracle, "causal decode, cpu");
      check_zero_rows(ref_decoded, true);
      check_zero_rows(cpu_decoded, true);
    } else {
      const LatteAttention<Bidirectional> attention({.heads = H, .latents = L, .value_dim = Dv});
      attention.forward(exec::reference, q, k, v, ref.view());
      attention.forward(exec::cpu, q, k, v, cpu.view());
    }
    check_close(ref, oracle, causal ? "causal reference" : "bidirectional reference");
    check_close(cpu, oracle, causal ? "causal cpu" : "bidirectional cpu");
    check_zero_rows(ref, causal);
    check_zero_rows(cpu, causal);
  }
}

TEST_CASE("LatteMacchiato: a query whose L + 1 logits are all -inf reads zero") {
  Rng rng(2);
  const index_t B = 1, Tn = 19, H = 2, L = 3, Dk = 4, Dv = 4, w = 3;
  auto q = random_tensor<double, 4>(rng, {B, Tn, H, L + 1}, 2.0);
  auto k = random_tensor<double, 4>(rng, {B, Tn, H, L}, 2.0);
  const auto wq = random_tensor<double, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto wk = random_tensor<double, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto v = uniform_tensor<double, 4>(rng, {B, Tn, H, Dv}, -1, 1);
  for (index_t l = 0; l <= L; ++l) q(0, 6, 1, l) = kNegInf;
  for (index_t l = 0; l < L; ++l) k(0, 2, 0, l) = kNegInf;  // a key row of the latents
  for (index_t s = 0; s < 8; ++s) k(0, s, 1, 1) = kNegInf;  // a latent empty until t = 8
  const LatteMacchiato<Causal> attention(
      {.heads = H, .latents = L, .key_dim = Dk, .value_dim = Dv, .window = w});
  const MacchiatoSpec spec{.causal = true, .window = w, .scale = inverse_sqrt(Dk)};
  const auto oracle = macchiato_oracle(spec, q, k, wq, wk, v);
  Tensor<double, 4> out(v.extents());
  attention.forward(exec::reference, q, k, wq, wk, v, out.view());
  auto state = attention.make_state<double>(B);
  const auto decoded = decode<exec::reference_t>(attention, state, Dv, q, k, wq, wk, v);
  check_close(out, oracle, "forward");
  check_close(decoded, oracle, "decode");
  for (index_t d = 0; d < Dv; ++d) {
    CHECK(out(0, 6, 1, d) == 0.0);
    CHECK(decoded(0, 6, 1, d) == 0.0);
  }
}

// ============================================== windows larger than T ------

TEST_CASE("SoftmaxAttention: sliding windows larger than T are full attention") {
  Rng rng(3);
  const index_t B = 2, Tn = 23, H = 2, Dk = 5, Dv = 3;
  const auto q = random_tensor<float, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto k = random_tensor<float, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto v = uniform_tensor<float, 4>(rng, {B, Tn, H, Dv}, -1, 1);
  const long double scale = inverse_sqrt(Dk);
  const auto full = softmax_oracle({.causal = false}, scale, q, k, v);
  const auto causal_full = softmax_oracle({.causal = true}, scale, q, k, v);
  for (const index_t side : {Tn, 3 * Tn, index_t{1} << 40}) {
    INFO("window sides " << side);
    const SoftmaxAttention<Bidirectional, SlidingWindow> bidirectional(
        {.heads = H, .key_dim = Dk, .value_dim = Dv}, SlidingWindow{.left = side, .right = side});
    Tensor<float, 4> ref(v.extents()), cpu(v.extents());
    bidirectional.forward(exec::reference, q, k, v, ref.view());
    bidirectional.forward(exec::cpu, q, k, v, cpu.view());
    check_close(ref, full, "bidirectional reference");
    check_close(cpu, full, "bidirectional cpu");
    const SoftmaxAttention<Causal, SlidingWindow> causal(
        {.heads = H, .key_dim = Dk, .value_dim = Dv}, SlidingWindow{.left = side});
    causal.forward(exec::reference, q, k, v, ref.view());
    causal.forward(exec::cpu, q, k, v, cpu.view());
    check_close(ref, causal_full, "causal reference");
    check_close(cpu, causal_full, "causal cpu");
    if (side < Tn * 4) {  // decode keeps left + 1 tokens: only for windows that fit memory
      auto ref_state = causal.make_state<float>(B);
      auto cpu_state = causal.make_state<float>(B);
      check_close(decode<exec::reference_t>(causal, ref_state, Dv, q, k, v), causal_full,
                  "causal decode reference");
      check_close(decode<exec::cpu_t>(causal, cpu_state, Dv, q, k, v), causal_full,
                  "causal decode cpu");
    }
  }
}

TEST_CASE("LatteMacchiato, Lavo, ConvCompressedAttention: windows larger than T") {
  Rng rng(4);
  const index_t B = 1, Tn = 11, H = 2, L = 3, D = 4;
  const auto q = random_tensor<double, 4>(rng, {B, Tn, H, D}, 1.0);
  const auto k = random_tensor<double, 4>(rng, {B, Tn, H, D}, 1.0);
  const auto v = uniform_tensor<double, 4>(rng, {B, Tn, H, D}, -1, 1);
  const auto latent_q = random_tensor<double, 4>(rng, {B, Tn, H, L + 1}, 1.5);
  const auto latent_k = random_tensor<double, 4>(rng, {B, Tn, H, L}, 1.5);
  for (const bool causal : {true, false}) {
    const index_t w = 3 * Tn;
    // Macchiato: window w > T covers every s.
    const MacchiatoSpec spec{.causal = causal, .window = w, .scale = inverse_sqrt(D)};
    const auto macchiato_oracle_out = macchiato_oracle(spec, latent_q, latent_k, q, k, v);
    Tensor<double, 4> out(v.extents());
    if (causal) {
      const LatteMacchiato<Causal> macchiato(
          {.heads = H, .latents = L, .key_dim = D, .value_dim = D, .window = w});
      macchiato.forward(exec::reference, latent_q, latent_k, q, k, v, out.view());
      auto state = macchiato.make_state<double>(B);
      check_close(decode<exec::reference_t>(macchiato, state, D, latent_q, latent_k, q, k, v),
                  macchiato_oracle_out, "macchiato decode, w = 3T");
    } else {
      LatteMacchiato<Bidirectional>(
          {.heads = H, .latents = L, .key_dim = D, .value_dim = D, .window = w})
          .forward(exec::reference, latent_q, latent_k, q, k, v, out.view());
    }
    check_close(out, macchiato_oracle_out, causal ? "macchiato causal" : "macchiato bidirectional");

    // LAVO: w > T, one (incomplete) window: causal memory always empty.
    const index_t r = 3;
    LavoOracleSpec lavo_spec{.causal = causal, .window = w, .bases = r, .scale = inverse_sqrt(D)};
    const Tensor<double, 3> basis = orthonormal_bases(H, r, D, 9);
    lavo_spec.basis.assign(basis.data(), basis.data() + basis.size());
    lavo_spec.relative_bias.assign(static_cast<std::size_t>(H * (2 * w - 1)), 0.0L);
    const auto lavo_oracle_out = lavo_oracle(lavo_spec, q, k, v);
    const LavoDims lavo_dims{.heads = H, .dim = D, .bases = r, .window = w};
    if (causal) {
      const Lavo<Causal> lavo(lavo_dims, {.basis_seed = 9});
      lavo.forward(exec::reference, q, k, v, out.view());
      auto state = lavo.make_state<double>(B);
      check_close(decode<exec::reference_t>(lavo, state, D, q, k, v), lavo_oracle_out,
                  "lavo decode, w = 3T");
    } else {
      Lavo<Bidirectional>(lavo_dims, {.basis_seed = 9})
          .forward(exec::reference, q, k, v, out.view());
    }
    check_close(out, lavo_oracle_out, causal ? "lavo causal" : "lavo bidirectional");
  }
  // Conv: group M > T (no complete group: output = window attention) and window_left > T.
  for (const index_t group : {index_t{2}, 2 * Tn}) {
    ConvCompressedDims dims{.heads = H,
                            .key_dim = D,
                            .value_dim = D,
                            .group_size = group,
                            .levels = 1,
                            .window_left = 5 * Tn};
    ConvCompressedParams params = ConvCompressedParams::zeros(dims);
    Rng weights(5);
    auto fill = [&](auto& tensor) {
      for (index_t i = 0; i < tensor.size(); ++i)
        tensor.data()[i] = std::normal_distribution<double>(0.0, 0.5)(weights);
    };
    for (auto& w : params.conv_weight) fill(w);
    for (auto& b : params.conv_bias) fill(b);
    fill(params.cross_query), fill(params.cross_key), fill(params.cross_value);
    const ConvCompressedAttention<Causal> conv(dims, params);
    const ConvCompressedSpec spec{.causal = true,
                                  .group_size = group,
                                  .levels = 1,
                                  .window_left = 5 * Tn,
                                  .window_right = 0,
                                  .scale = inverse_sqrt(D)};
    const auto oracle = conv_compressed_oracle(spec, params, q, k, v);
    Tensor<double, 4> out(v.extents());
    conv.forward(exec::reference, q, k, v, out.view());
    check_close(out, oracle.out, "conv, window_left 5T, M = " + std::to_string(group));
    auto state = conv.make_state<double>(B, Tn);
    check_close(decode<exec::reference_t>(conv, state, D, q, k, v), oracle.out, "conv decode");
  }
}

// ======================================================== T = 1 and L = 1 --

TEST_CASE_TEMPLATE("T = 1 and L = 1: Latte and softmax (reference and cpu) against the oracles", T,
                   float, double) {
  Rng rng(6);
  for (const auto& sizes : {std::pair<index_t, index_t>{1, 7}, {1, 1}, {41, 1}}) {
    const index_t Tn = sizes.first, L = sizes.second;  // not bindings: INFO captures them (clang 14)
    INFO("T = " << Tn << ", L = " << L);
    const index_t B = 2, H = 3, Dv = 5;
    const auto q = random_tensor<T, 4>(rng, {B, Tn, H, L}, 2.0);
    const auto k = random_tensor<T, 4>(rng, {B, Tn, H, L}, 2.0);
    const auto v = uniform_tensor<T, 4>(rng, {B, Tn, H, Dv}, -1, 1);
    const LatteAttention<Causal, RunningMax, VAPOR> causal(
        {.heads = H, .latents = L, .value_dim = Dv});
    const LatteAttention<Bidirectional> bidirectional({.heads = H, .latents = L, .value_dim = Dv});
    const auto causal_oracle = latte_oracle(true, q, k, v, rope_schedule(H, Dv));
    const auto bidirectional_oracle = latte_oracle(false, q, k, v);
    Tensor<T, 4> out(v.extents());
    causal.forward(exec::reference, q, k, v, out.view());
    check_close(out, causal_oracle, "latte causal reference");
    causal.forward(exec::cpu, q, k, v, out.view());
    check_close(out, causal_oracle, "latte causal cpu");
    auto state = causal.template make_state<T>(B);
    check_close(decode<exec::cpu_t>(causal, state, Dv, q, k, v), causal_oracle, "latte decode cpu");
    bidirectional.forward(exec::reference, q, k, v, out.view());
    check_close(out, bidirectional_oracle, "latte bidirectional reference");
    bidirectional.forward(exec::cpu, q, k, v, out.view());
    check_close(out, bidirectional_oracle, "latte bidirectional cpu");
    if (Tn == 1) {
      const SoftmaxAttention<Causal> softmax({.heads = H, .key_dim = L, .value_dim = Dv});
      const auto oracle = softmax_oracle({.causal = true}, inverse_sqrt(L), q, k, v);
      softmax.forward(exec::reference, q, k, v, out.view());
      check_close(out, oracle, "softmax reference T = 1");
      softmax.forward(exec::cpu, q, k, v, out.view());
      check_close(out, oracle, "softmax cpu T = 1");
    }
  }
}

TEST_CASE("T = 1: LatteMacchiato (L = 1), LinearAttention, Lavo, ConvCompressedAttention") {
  Rng rng(7);
  const index_t B = 2, Tn = 1, H = 2, D = 4;
  const auto q = random_tensor<double, 4>(rng, {B, Tn, H, D}, 1.0);
  const auto k = random_tensor<double, 4>(rng, {B, Tn, H, D}, 1.0);
  const auto v = uniform_tensor<double, 4>(rng, {B, Tn, H, D}, -1, 1);
  Tensor<double, 4> out(v.extents());
  {
    const index_t L = 1;
    const auto latent_q = random_tensor<double, 4>(rng, {B, Tn, H, L + 1}, 1.0);
    const auto latent_k = random_tensor<double, 4>(rng, {B, Tn, H, L}, 1.0);
    const LatteMacchiato<Causal> attention(
        {.heads = H, .latents = L, .key_dim = D, .value_dim = D, .window = 1});
    attention.forward(exec::reference, latent_q, latent_k, q, k, v, out.view());
    check_close(out,
                macchiato_oracle({.causal = true, .window = 1, .scale = inverse_sqrt(D)}, latent_q,
                                 latent_k, q, k, v),
                "macchiato");
  }
  {
    const LinearAttention<Causal, EluPlusOne> attention({.heads = H, .key_dim = D, .value_dim = D});
    attention.forward(exec::reference, q, k, v, out.view());
    check_close(out, linear_oracle({.causal = true, .feature = oracle_elu_plus_one}, q, k, v),
                "linear");
    const CosFormer<Causal> cosformer({.heads = H, .key_dim = D, .value_dim = D});
    cosformer.forward(exec::reference, q, k, v, out.view());
    LinearOracleSpec spec{.causal = true, .feature = oracle_relu, .clamp = true};
    spec.query_proportions = spec.key_proportions = oracle_position_proportions(B, Tn, H, 1.0L);
    check_close(out, linear_oracle(spec, q, k, v), "cosFormer, M = T = 1");
  }
  {
    const index_t r = 2, w = 1;
    const Lavo<Causal> attention({.heads = H, .dim = D, .bases = r, .window = w},
                                 {.basis_seed = 3});
    LavoOracleSpec spec{.causal = true, .window = w, .bases = r, .scale = inverse_sqrt(D)};
    const auto& basis = attention.bases();
    spec.basis.assign(basis.data(), basis.data() + basis.size());
    spec.relative_bias.assign(static_cast<std::size_t>(H * (2 * w - 1)), 0.0L);
    attention.forward(exec::reference, q, k, v, out.view());
    check_close(out, lavo_oracle(spec, q, k, v), "lavo");
  }
  {
    const ConvCompressedDims dims{
        .heads = H, .key_dim = D, .value_dim = D, .group_size = 1, .levels = 1};
    ConvCompressedParams params = ConvCompressedParams::zeros(dims);
    for (auto& w : params.conv_weight) w.fill(0.25);
    params.cross_value.fill(0.5);
    const ConvCompressedAttention<Causal> attention(dims, params);
    attention.forward(exec::reference, q, k, v, out.view());
    const ConvCompressedSpec spec{
        .causal = true, .group_size = 1, .levels = 1, .scale = inverse_sqrt(D)};
    check_close(out, conv_compressed_oracle(spec, params, q, k, v).out, "conv");
  }
}

// ======================================================= positions near 2^31

TEST_CASE_TEMPLATE("VAPOR: decode from first_position 2^31 - 5 across 2^31 (reference and cpu)", T,
                   float, double) {
  // Positions are int64: crossing 2^31 is ordinary. VAPOR is relative, so the
  // oracle at positions p0 .. p0 + T - 1 is the oracle at 0 .. T - 1. The
  // angles p * theta are reduced exactly enough (core/angles.hpp) that float64
  // keeps its tolerance at 2^31 and beyond, up to 2^40 here.
  Rng rng(8);
  const index_t B = 1, Tn = 12, H = 2, L = 4, Dv = 8;
  const auto q = random_tensor<T, 4>(rng, {B, Tn, H, L}, 2.0);
  const auto k = random_tensor<T, 4>(rng, {B, Tn, H, L}, 2.0);
  const auto v = uniform_tensor<T, 4>(rng, {B, Tn, H, Dv}, -1, 1);
  const LatteAttention<Causal, RunningMax, VAPOR> attention(
      {.heads = H, .latents = L, .value_dim = Dv});
  const auto oracle = latte_oracle(true, q, k, v, rope_schedule(H, Dv));
  for (const std::int64_t first :
       {kTwo31 - 5, kTwo31, std::int64_t{1} << 32, (std::int64_t{1} << 40) + 3}) {
    INFO("first_position " << first);
    auto ref_state = attention.template make_state<T>(B, first);
    auto cpu_state = attention.template make_state<T>(B, first);
    check_close(decode<exec::reference_t>(attention, ref_state, Dv, q, k, v), oracle,
                "decode reference");
    check_close(decode<exec::cpu_t>(attention, cpu_state, Dv, q, k, v), oracle, "decode cpu");
    CHECK(ref_state.position() == first + Tn);
    auto prefill_state = attention.template make_state<T>(B, first);
    Tensor<T, 4> out(v.extents());
    attention.forward(exec::cpu, q, k, v, out.view(), prefill_state);
    check_close(out, oracle, "forward(state) cpu");
    auto ref_prefill = attention.template make_state<T>(B, first);
    attention.forward(exec::reference, q, k, v, out.view(), ref_prefill);
    check_close(out, oracle, "forward(state) reference");
  }
}

TEST_CASE_TEMPLATE("RoPE (LinearAttention, LatteMacchiato window): decode across 2^31", T, float,
                   double) {
  Rng rng(9);
  const index_t B = 1, Tn = 12, H = 2, Dk = 6, Dv = 4;
  const auto q = random_tensor<T, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto k = random_tensor<T, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto v = uniform_tensor<T, 4>(rng, {B, Tn, H, Dv}, -1, 1);
  {
    const LinearAttention<Causal, EluPlusOne, NoReweight, RoPE> attention(
        {.heads = H, .key_dim = Dk, .value_dim = Dv});
    LinearOracleSpec spec{.causal = true, .feature = oracle_elu_plus_one};
    spec.angles = rope_schedule(H, Dk);
    const auto oracle = linear_oracle(spec, q, k, v);
    auto state = attention.template make_state<T>(B, kTwo31 - 5);
    check_close(decode<exec::reference_t>(attention, state, Dv, q, k, v), oracle, "linear RoPE");
  }
  {
    const index_t L = 2, w = 3;
    const auto latent_q = random_tensor<T, 4>(rng, {B, Tn, H, L + 1}, 1.0);
    const auto latent_k = random_tensor<T, 4>(rng, {B, Tn, H, L}, 1.0);
    const LatteMacchiato<Causal, RunningMax, VAPOR, RoPE> attention(
        {.heads = H, .latents = L, .key_dim = Dk, .value_dim = Dv, .window = w});
    const auto oracle =
        macchiato_oracle({.causal = true, .window = w, .scale = inverse_sqrt(Dk)}, latent_q,
                         latent_k, q, k, v, rope_schedule(H, Dv), rope_schedule(H, Dk));
    auto state = attention.template make_state<T>(B, kTwo31 - 5);
    check_close(decode<exec::reference_t>(attention, state, Dv, latent_q, latent_k, q, k, v),
                oracle, "macchiato VAPOR + RoPE");
  }
}

TEST_CASE_TEMPLATE("cosFormer: decode across 2^31 with M >= the position bound", T, float, double) {
  // P = (i + 1) / M at the absolute positions i = p0 .. p0 + T - 1; M must be
  // >= p0 + T (make_state and step refuse otherwise: see the malformed table).
  Rng rng(10);
  const index_t B = 1, Tn = 12, H = 2, Dk = 4, Dv = 3;
  const auto q = random_tensor<T, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto k = random_tensor<T, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto v = uniform_tensor<T, 4>(rng, {B, Tn, H, Dv}, -1, 1);
  const std::int64_t first = kTwo31 - 5;
  for (const index_t length :
       {index_t(first + Tn), index_t(first + Tn + 1000), index_t(4) * kTwo31}) {
    INFO("M = " << length);
    const CosFormer<Causal> attention({.heads = H, .key_dim = Dk, .value_dim = Dv},
                                      {.reweight = {.length = length}});
    LinearOracleSpec spec{.causal = true, .feature = oracle_relu, .clamp = true};
    spec.query_proportions = spec.key_proportions =
        oracle_position_proportions(B, Tn, H, (long double)length, first);
    const auto oracle = linear_oracle(spec, q, k, v);
    auto state = attention.template make_state<T>(B, first);
    check_close(decode<exec::reference_t>(attention, state, Dv, q, k, v), oracle, "decode");
    auto prefill = attention.template make_state<T>(B, first);
    Tensor<T, 4> out(v.extents());
    attention.forward(exec::reference, q, k, v, out.view(), prefill);
    check_close(out, oracle, "forward(state)");
  }
}

// ==================================================== zero values -> zeros --

TEST_CASE_TEMPLATE("zero values give exact zeros in every mechanism", T, float, double) {
  Rng rng(11);
  const index_t B = 2, Tn = 29, H = 2, L = 5, D = 6;
  const auto q = random_tensor<T, 4>(rng, {B, Tn, H, D}, 1.5);
  const auto k = random_tensor<T, 4>(rng, {B, Tn, H, D}, 1.5);
  const auto latent_q = random_tensor<T, 4>(rng, {B, Tn, H, L + 1}, 2.0);
  const auto latent_k = random_tensor<T, 4>(rng, {B, Tn, H, L}, 2.0);
  const auto latent_q_l = random_tensor<T, 4>(rng, {B, Tn, H, L}, 2.0);
  const Tensor<T, 4> v({B, Tn, H, D}, T(0));
  Tensor<T, 4> out(v.extents());
  auto expect_zero = [&](const std::string& what, const std::function<void()>& run) {
    out.fill(T(7));
    run();
    INFO(what);
    CHECK(all_zero(out));
  };
  const LatteAttention<Causal, RunningMax, VAPOR> latte({.heads = H, .latents = L, .value_dim = D});
  const LatteAttention<Bidirectional, RunningMax, VAPOR> latte_bi(
      {.heads = H, .latents = L, .value_dim = D});
  expect_zero("latte causal reference",
              [&] { latte.forward(exec::reference, latent_q_l, latent_k, v, out.view()); });
  expect_zero("latte causal cpu",
              [&] { latte.forward(exec::cpu, latent_q_l, latent_k, v, out.view()); });
  expect_zero("latte bidirectional cpu",
              [&] { latte_bi.forward(exec::cpu, latent_q_l, latent_k, v, out.view()); });
  expect_zero("latte decode cpu", [&] {
    auto state = latte.template make_state<T>(B, 1000);
    out = decode<exec::cpu_t>(latte, state, D, latent_q_l, latent_k, v);
  });
  const SoftmaxAttention<Causal> softmax({.heads = H, .key_dim = D, .value_dim = D});
  expect_zero("softmax reference", [&] { softmax.forward(exec::reference, q, k, v, out.view()); });
  expect_zero("softmax cpu", [&] { softmax.forward(exec::cpu, q, k, v, out.view()); });
  const LatteMacchiato<Causal, RunningMax, VAPOR, RoPE> macchiato(
      {.heads = H, .latents = L, .key_dim = D, .value_dim = D, .window = 4});
  expect_zero("macchiato",
              [&] { macchiato.forward(exec::reference, latent_q, latent_k, q, k, v, out.view()); });
  const LinearAttention<Causal, EluPlusOne, NoReweight, RoPE> linear(
      {.heads = H, .key_dim = D, .value_dim = D});
  expect_zero("linear RoPE", [&] { linear.forward(exec::reference, q, k, v, out.view()); });
  const CosFormer<Bidirectional> cosformer({.heads = H, .key_dim = D, .value_dim = D});
  expect_zero("cosFormer", [&] { cosformer.forward(exec::reference, q, k, v, out.view()); });
  const Lavo<Causal> lavo({.heads = H, .dim = D, .bases = 4, .window = 3});
  expect_zero("lavo", [&] { lavo.forward(exec::reference, q, k, v, out.view()); });
  // Conv: the compressed tokens are b + sum W y; with zero values y = 0, so the
  // output is zero exactly when the convolution biases are zero (any weights).
  const ConvCompressedDims dims{
      .heads = H, .key_dim = D, .value_dim = D, .group_size = 2, .levels = 2};
  ConvCompressedParams params = ConvCompressedParams::zeros(dims);
  for (auto& w : params.conv_weight) w.fill(0.3);
  for (auto& w : params.level_query) w.fill(0.2);
  for (auto& w : params.level_key) w.fill(-0.1);
  for (auto& w : params.level_value) w.fill(0.4);
  params.cross_query.fill(0.1), params.cross_key.fill(0.2), params.cross_value.fill(0.3);
  const ConvCompressedAttention<Causal> conv(dims, params);
  expect_zero("conv (zero biases)", [&] { conv.forward(exec::reference, q, k, v, out.view()); });
}

// ================================================================== NaN --

/// The NaN policy check: `affected(b, t, h, d)` says which outputs depend on
/// the NaN input. Those must be NaN; every other output must be bit-identical
/// to the run without the NaN and match the clean oracle.
template <class T>
void check_nan_isolation(const Tensor<T, 4>& with_nan, const Tensor<T, 4>& clean,
                         const TensorLD<4>& clean_oracle,
                         const std::function<bool(index_t, index_t, index_t, index_t)>& affected,
                         const std::string& what) {
  INFO(what);
  index_t wrong_affected = 0, wrong_unaffected = 0, affected_count = 0;
  long double worst = 0, scale = 0;
  for (index_t b = 0; b < clean.extent(0); ++b)
    for (index_t t = 0; t < clean.extent(1); ++t)
      for (index_t h = 0; h < clean.extent(2); ++h)
        for (index_t d = 0; d < clean.extent(3); ++d) {
          const T x = with_nan(b, t, h, d);
          if (affected(b, t, h, d)) {
            ++affected_count;
            if (!std::isnan(x)) ++wrong_affected;
            continue;
          }
          if (std::memcmp(&x, &clean(b, t, h, d), sizeof(T)) != 0) ++wrong_unaffected;
          worst = std::max(worst, std::fabs((long double)x - clean_oracle(b, t, h, d)));
          scale = std::max(scale, std::fabs(clean_oracle(b, t, h, d)));
        }
  CHECK(affected_count > 0);
  CHECK(wrong_affected == 0);
  CHECK(wrong_unaffected == 0);
  CHECK(static_cast<double>(worst / scale) <= Tolerance<T>::relative);
}

TEST_CASE_TEMPLATE("NaN in one input element: Latte (reference and cpu, causal and bidirectional)",
                   T, float, double) {
  // Causal Latte: o_t depends on q_t, and on k_s, v_s for s <= t. A NaN in
  // q_{t0} (one latent) makes row t0 NaN (every feature: p(l|t0) is NaN for
  // every l); a NaN in k_{s0} makes rows t >= s0 NaN; a NaN in feature d0 of
  // v_{s0} makes feature d0 of rows t >= s0 NaN, and with VAPOR the pair
  // (2i, 2i + 1) holding d0. Other batches, heads and rows are untouched.
  // Bidirectional: the same with "every t" for keys and values.
  Rng rng(12);
  const index_t B = 2, Tn = 300, H = 3, L = 6, Dv = 8;  // T = 300: cpu segments when B * H = 1
  const auto q = random_tensor<T, 4>(rng, {B, Tn, H, L}, 2.0);
  const auto k = random_tensor<T, 4>(rng, {B, Tn, H, L}, 2.0);
  const auto v = uniform_tensor<T, 4>(rng, {B, Tn, H, Dv}, -1, 1);
  const T nan = static_cast<T>(kNaN);
  const index_t b0 = 1, h0 = 2, t0 = 140, d0 = 5;
  for (const bool causal : {true, false}) {
    const auto oracle =
        latte_oracle(causal, q, k, v, causal ? rope_schedule(H, Dv) : std::vector<long double>{});
    auto run = [&](auto e, const Tensor<T, 4>& qq, const Tensor<T, 4>& kk, const Tensor<T, 4>& vv) {
      Tensor<T, 4> out(vv.extents());
      if (causal)
        LatteAttention<Causal, RunningMax, VAPOR>({.heads = H, .latents = L, .value_dim = Dv})
            .forward(e, qq, kk, vv, out.view());
      else
        LatteAttention<Bidirectional>({.heads = H, .latents = L, .value_dim = Dv})
            .forward(e, qq, kk, vv, out.view());
      return out;
    };
    auto later = [&](index_t t) { return !causal || t >= t0; };
    auto same_head = [&](index_t b, index_t h) { return b == b0 && h == h0; };
    for (const int which : {0, 1, 2}) {
      auto qn = q, kn = k, vn = v;
      std::function<bool(index_t, index_t, index_t, index_t)> affected;
      std::string what;
      if (which == 0) {
        qn(b0, t0, h0, 3) = nan;
        affected = [&](index_t b, index_t t, index_t h, index_t) {
          return same_head(b, h) && t == t0;
        };
        what = "query logit";
      } else if (which == 1) {
        kn(b0, t0, h0, 3) = nan;
        affected = [&](index_t b, index_t t, index_t h, index_t) {
          return same_head(b, h) && later(t);
        };
        what = "key logit";
      } else {
        vn(b0, t0, h0, d0) = nan;
        affected = [&](index_t b, index_t t, index_t h, index_t d) {
          const bool feature = causal ? d / 2 == d0 / 2 : d == d0;  // VAPOR rotates pairs
          return same_head(b, h) && later(t) && feature;
        };
        what = "value";
      }
      what += causal ? " (causal + VAPOR)" : " (bidirectional)";
      check_nan_isolation(run(exec::reference, qn, kn, vn), run(exec::reference, q, k, v), oracle,
                          affected, what + ", reference");
      check_nan_isolation(run(exec::cpu, qn, kn, vn), run(exec::cpu, q, k, v), oracle, affected,
                          what + ", cpu");
    }
  }
  // B * H = 1, T = 1200: the cpu kernel's two-pass segmented path.
  const auto q1 = random_tensor<T, 4>(rng, {1, 1200, 1, 16}, 2.0);
  const auto k1 = random_tensor<T, 4>(rng, {1, 1200, 1, 16}, 2.0);
  const auto v1 = uniform_tensor<T, 4>(rng, {1, 1200, 1, 16}, -1, 1);
  auto k1n = k1;
  k1n(0, 700, 0, 0) = nan;
  const LatteAttention<Causal> attention({.heads = 1, .latents = 16, .value_dim = 16});
  Tensor<T, 4> clean(v1.extents()), with_nan(v1.extents());
  attention.forward(exec::cpu, q1, k1, v1, clean.view());
  attention.forward(exec::cpu, q1, k1n, v1, with_nan.view());
  check_nan_isolation(
      with_nan, clean, latte_oracle(true, q1, k1, v1),
      [](index_t, index_t t, index_t, index_t) { return t >= 700; },
      "key logit, cpu segmented path");
}

TEST_CASE_TEMPLATE("NaN in one input element: SoftmaxAttention (reference and cpu)", T, float,
                   double) {
  // o_t depends on q_t, and on k_s, v_s for s in t's allowed set (s <= t;
  // t - left <= s <= t + right with a window). NaN in q_{t0}: row t0; in
  // k_{s0}: the rows whose allowed set holds s0; in feature d0 of v_{s0}:
  // feature d0 of those rows.
  Rng rng(13);
  const index_t B = 2, Tn = 150, H = 2, Dk = 8, Dv = 6;
  const auto q = random_tensor<T, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto k = random_tensor<T, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto v = uniform_tensor<T, 4>(rng, {B, Tn, H, Dv}, -1, 1);
  const T nan = static_cast<T>(kNaN);
  const index_t b0 = 0, h0 = 1, s0 = 77, d0 = 2, left = 9, right = 4;
  const long double scale = inverse_sqrt(Dk);
  for (const bool windowed : {false, true}) {
    const MaskSpec mask = windowed ? MaskSpec{.causal = false, .left = left, .right = right}
                                   : MaskSpec{.causal = true};
    const auto oracle = softmax_oracle(mask, scale, q, k, v);
    auto run = [&](auto e, const Tensor<T, 4>& qq, const Tensor<T, 4>& kk, const Tensor<T, 4>& vv) {
      Tensor<T, 4> out(vv.extents());
      const SoftmaxDims dims{.heads = H, .key_dim = Dk, .value_dim = Dv};
      if (windowed)
        SoftmaxAttention<Bidirectional, SlidingWindow>(dims, {.left = left, .right = right})
            .forward(e, qq, kk, vv, out.view());
      else
        SoftmaxAttention<Causal>(dims).forward(e, qq, kk, vv, out.view());
      return out;
    };
    for (const int which : {0, 1, 2}) {
      auto qn = q, kn = k, vn = v;
      std::function<bool(index_t, index_t, index_t, index_t)> affected;
      std::string what = windowed ? "window " : "causal ";
      auto sees = [&](index_t b, index_t t, index_t h) {
        return b == b0 && h == h0 && mask.allowed(t, s0);
      };
      if (which == 0) {
        qn(b0, s0, h0, 1) = nan;
        affected = [&](index_t b, index_t t, index_t h, index_t) {
          return b == b0 && h == h0 && t == s0;
        };
        what += "query";
      } else if (which == 1) {
        kn(b0, s0, h0, 1) = nan;
        affected = [&](index_t b, index_t t, index_t h, index_t) { return sees(b, t, h); };
        what += "key";
      } else {
        vn(b0, s0, h0, d0) = nan;
        affected = [&](index_t b, index_t t, index_t h, index_t d) {
          return sees(b, t, h) && d == d0;
        };
        what += "value";
      }
      check_nan_isolation(run(exec::reference, qn, kn, vn), run(exec::reference, q, k, v), oracle,
                          affected, what + ", reference");
      check_nan_isolation(run(exec::cpu, qn, kn, vn), run(exec::cpu, q, k, v), oracle, affected,
                          what + ", cpu");
    }
  }
}

TEST_CASE(
    "NaN in one input element: LinearAttention, LatteMacchiato, Lavo, ConvCompressedAttention") {
  Rng rng(14);
  const index_t B = 2, Tn = 24, H = 2, D = 4, L = 3, w = 3;
  const auto q = random_tensor<double, 4>(rng, {B, Tn, H, D}, 1.0);
  const auto k = random_tensor<double, 4>(rng, {B, Tn, H, D}, 1.0);
  const auto v = uniform_tensor<double, 4>(rng, {B, Tn, H, D}, -1, 1);
  const auto latent_q = random_tensor<double, 4>(rng, {B, Tn, H, L + 1}, 1.5);
  const auto latent_k = random_tensor<double, 4>(rng, {B, Tn, H, L}, 1.5);
  const index_t b0 = 1, h0 = 0, s0 = 10, d0 = 1;
  auto head = [&](index_t b, index_t h) { return b == b0 && h == h0; };
  using Affected = std::function<bool(index_t, index_t, index_t, index_t)>;

  SUBCASE(
      "LinearAttention<causal, elu_plus_one / relu>: q -> row; k -> rows t >= s; v -> feature d0 "
      "of rows t >= s") {
    // Both feature maps keep a NaN feature NaN (relu(NaN) is NaN, as in PyTorch).
    auto check_map = [&](const auto& attention, const OracleFeatureMap& feature,
                         const std::string& name) {
      const auto oracle = linear_oracle({.causal = true, .feature = feature}, q, k, v);
      Tensor<double, 4> clean(v.extents());
      attention.forward(exec::reference, q, k, v, clean.view());
      auto clean_state = attention.template make_state<double>(B);
      const auto clean_decoded = decode<exec::reference_t>(attention, clean_state, D, q, k, v);
      for (const int which : {0, 1, 2}) {
        auto qn = q, kn = k, vn = v;
        (which == 0 ? qn : which == 1 ? kn : vn)(b0, s0, h0, d0) = kNaN;
        const Affected affected = [&](index_t b, index_t t, index_t h, index_t d) {
          if (!head(b, h)) return false;
          if (which == 0) return t == s0;
          return t >= s0 && (which == 1 || d == d0);
        };
        const std::string what = name + ", input " + std::to_string(which);
        Tensor<double, 4> out(v.extents());
        attention.forward(exec::reference, qn, kn, vn, out.view());
        check_nan_isolation(out, clean, oracle, affected, what);
        auto state = attention.template make_state<double>(B);
        check_nan_isolation(decode<exec::reference_t>(attention, state, D, qn, kn, vn),
                            clean_decoded, oracle, affected, what + " (decode)");
      }
    };
    check_map(LinearAttention<Causal, EluPlusOne>({.heads = H, .key_dim = D, .value_dim = D}),
              oracle_elu_plus_one, "linear elu_plus_one");
    check_map(LinearAttention<Causal, Relu>({.heads = H, .key_dim = D, .value_dim = D}),
              oracle_relu, "linear relu");
  }
  SUBCASE("LatteMacchiato<causal, vapor, rope> (reference and cpu)") {
    // The latent part reads v_s (s <= t) rotated by VAPOR (pairs), the window
    // part reads v_s for t - w <= s <= t (features as they are), so a NaN in
    // feature d0 of v_{s0} reaches the pair of d0 in rows t >= s0. A NaN in a
    // window key k'_{s0} reaches rows s0 .. s0 + w (all features); in a window
    // query or a query logit, its own row; in a key logit, rows t >= s0.
    const LatteMacchiato<Causal, RunningMax, VAPOR, RoPE> attention(
        {.heads = H, .latents = L, .key_dim = D, .value_dim = D, .window = w});
    const auto oracle =
        macchiato_oracle({.causal = true, .window = w, .scale = inverse_sqrt(D)}, latent_q,
                         latent_k, q, k, v, rope_schedule(H, D), rope_schedule(H, D));
    Tensor<double, 4> clean(v.extents()), clean_cpu(v.extents());
    attention.forward(exec::reference, latent_q, latent_k, q, k, v, clean.view());
    attention.forward(exec::cpu, latent_q, latent_k, q, k, v, clean_cpu.view());
    for (const int which : {0, 1, 2, 3, 4}) {
      auto lq = latent_q, lk = latent_k, wq = q, wk = k, vn = v;
      Tensor<double, 4>* inputs[] = {&lq, &lk, &wq, &wk, &vn};
      (*inputs[which])(b0, s0, h0, which == 4 ? d0 : 1) = kNaN;
      const Affected affected = [&](index_t b, index_t t, index_t h, index_t d) {
        if (!head(b, h)) return false;
        switch (which) {
          case 0:
          case 2:
            return t == s0;  // query logit, window query
          case 1:
            return t >= s0;  // key logit
          case 3:
            return t >= s0 && t <= s0 + w;  // window key
          default:
            return t >= s0 && d / 2 == d0 / 2;  // value
        }
      };
      Tensor<double, 4> out(v.extents()), out_cpu(v.extents());
      attention.forward(exec::reference, lq, lk, wq, wk, vn, out.view());
      check_nan_isolation(out, clean, oracle, affected,
                          "macchiato, input " + std::to_string(which));
      // exec::cpu: the window pass's GEMM-or-row choice depends on the band only.
      attention.forward(exec::cpu, lq, lk, wq, wk, vn, out_cpu.view());
      check_nan_isolation(out_cpu, clean_cpu, oracle, affected,
                          "macchiato cpu, input " + std::to_string(which));
    }
  }
  SUBCASE("Lavo<causal>") {
    // Local part: t - w < s <= t. Memory: the local outputs of complete
    // windows before t's window, mixed over every feature by the bases. A NaN
    // in feature d0 of v_{s0}: feature d0 of rows s0 .. s0 + w - 1, and every
    // feature of rows t >= (floor(s0 / w) + 1) w. A NaN in q_{s0}: row s0.
    const index_t r = 3;
    const Lavo<Causal> attention({.heads = H, .dim = D, .bases = r, .window = w},
                                 {.basis_seed = 4});
    LavoOracleSpec spec{.causal = true, .window = w, .bases = r, .scale = inverse_sqrt(D)};
    spec.basis.assign(attention.bases().data(),
                      attention.bases().data() + attention.bases().size());
    spec.relative_bias.assign(static_cast<std::size_t>(H * (2 * w - 1)), 0.0L);
    const auto oracle = lavo_oracle(spec, q, k, v);
    Tensor<double, 4> clean(v.extents());
    attention.forward(exec::reference, q, k, v, clean.view());
    const index_t memory_from = (s0 / w + 1) * w;
    for (const int which : {0, 1, 2}) {
      auto qn = q, kn = k, vn = v;
      (which == 0 ? qn : which == 1 ? kn : vn)(b0, s0, h0, d0) = kNaN;
      const Affected affected = [&](index_t b, index_t t, index_t h, index_t d) {
        if (!head(b, h)) return false;
        // A query changes its own row and, through F_local(s0), the memory.
        if (which == 0) return t == s0 || t >= memory_from;
        const bool local = t >= s0 && t < s0 + w && (which == 1 || d == d0);
        return local || t >= memory_from;
      };
      Tensor<double, 4> out(v.extents());
      attention.forward(exec::reference, qn, kn, vn, out.view());
      check_nan_isolation(out, clean, oracle, affected, "lavo, input " + std::to_string(which));
    }
  }
  SUBCASE("ConvCompressedAttention<causal>, levels = 1") {
    // y0_t reads v_s for t - left <= s <= t; group j = floor(s0 / M) is
    // compressed (all features mixed) and read by t >= (j + 1) M. The cross
    // query of row t is Wq_x y0_t, so a NaN in y0_t spreads over row t's cross
    // part whenever t reads any compressed token (t >= M).
    const index_t M = 2, left = 3;
    const ConvCompressedDims dims{.heads = H,
                                  .key_dim = D,
                                  .value_dim = D,
                                  .group_size = M,
                                  .levels = 1,
                                  .window_left = left};
    ConvCompressedParams params = ConvCompressedParams::zeros(dims);
    Rng weights(15);
    auto fill = [&](auto& tensor) {
      for (index_t i = 0; i < tensor.size(); ++i)
        tensor.data()[i] = std::normal_distribution<double>(0.0, 0.5)(weights);
    };
    for (auto& x : params.conv_weight) fill(x);
    for (auto& x : params.conv_bias) fill(x);
    fill(params.cross_query), fill(params.cross_key), fill(params.cross_value);
    const ConvCompressedAttention<Causal> attention(dims, params);
    const ConvCompressedSpec spec{.causal = true,
                                  .group_size = M,
                                  .levels = 1,
                                  .window_left = left,
                                  .window_right = 0,
                                  .scale = inverse_sqrt(D)};
    const auto oracle = conv_compressed_oracle(spec, params, q, k, v).out;
    Tensor<double, 4> clean(v.extents());
    attention.forward(exec::reference, q, k, v, clean.view());
    for (const int which : {0, 1, 2}) {
      auto qn = q, kn = k, vn = v;
      (which == 0 ? qn : which == 1 ? kn : vn)(b0, s0, h0, d0) = kNaN;
      const Affected affected = [&](index_t b, index_t t, index_t h, index_t d) {
        if (!head(b, h)) return false;
        const bool in_window = t >= s0 && t <= s0 + left;
        const bool reads_compressed = t >= M;
        const index_t group_read_from = (s0 / M + 1) * M;  // rows that read group floor(s0 / M)
        // A query changes its own row's y0 (every feature), which is compressed.
        if (which == 0) return t == s0 || t >= group_read_from;
        // A key changes the window rows that see it (every feature), then their group.
        if (which == 1) return in_window || t >= group_read_from;
        return (in_window && (d == d0 || reads_compressed)) || t >= group_read_from;
      };
      Tensor<double, 4> out(v.extents());
      attention.forward(exec::reference, qn, kn, vn, out.view());
      check_nan_isolation(out, clean, oracle, affected, "conv, input " + std::to_string(which));
    }
  }
}

// ======================================== positions at the end of int64 --

/// Byte offsets in a saved state (core/state_storage.hpp: magic, kind, sizes
/// (name, value), position): of each size's value, then of the position.
std::vector<std::size_t> header_offsets(const std::vector<std::byte>& bytes) {
  std::size_t offset = 8;  // "latteST3"
  auto read_u64 = [&] {
    std::uint64_t value = 0;
    std::memcpy(&value, bytes.data() + offset, sizeof value);
    offset += sizeof value;
    return value;
  };
  offset += read_u64();  // kind
  const std::uint64_t sizes = read_u64();
  std::vector<std::size_t> offsets;
  for (std::uint64_t i = 0; i < sizes; ++i) {
    offset += read_u64();  // name
    offsets.push_back(offset);
    offset += sizeof(std::int64_t);
  }
  offsets.push_back(offset);  // position
  return offsets;
}

/// The saved bytes with the value at `offset` replaced by `value`, re-signed.
std::vector<std::byte> patched(std::vector<std::byte> bytes, std::size_t offset,
                               std::int64_t value) {
  std::memcpy(bytes.data() + offset, &value, sizeof value);
  return resigned(std::move(bytes));
}

/// The saved bytes of a state with its position replaced by `position`.
std::vector<std::byte> with_position(const std::vector<std::byte>& bytes, std::int64_t position) {
  return patched(bytes, header_offsets(bytes).back(), position);
}

/// `state` restored at INT64_MAX - 1 takes one more token by step; then a
/// step and a two-token forward(state) are refused and leave the position.
template <class Attention, class State, class Step, class Forward>
void check_position_end(const Attention& attention, State& state, const Step& step,
                        const Forward& forward_two, const std::string& what) {
  INFO(what);
  constexpr std::int64_t last = std::numeric_limits<std::int64_t>::max();
  using T = typename std::remove_reference_t<decltype(*state.field(0))>;
  state = attention.template load_state<T>(with_position(state.save(), last - 1));
  REQUIRE(state.position() == last - 1);
  expect_error([&] { forward_two(state); }, "state", "position + new tokens");
  CHECK(state.position() == last - 1);
  step(state);
  CHECK(state.position() == last);
  expect_error([&] { step(state); }, "state", "position + new tokens");
  CHECK(state.position() == last);
}

TEST_CASE_TEMPLATE("a state at position INT64_MAX refuses more tokens (every mechanism)", T, float,
                   double) {
  // Positions are int64 and a restored state may sit anywhere in it: every
  // mechanism's state refuses the token whose position would overflow instead
  // of wrapping (signed overflow is undefined behaviour).
  Rng rng(17);
  const index_t B = 1, Two = 2, H = 2, L = 3, D = 4;
  const auto q = random_tensor<T, 4>(rng, {B, Two, H, D}, 1.0);
  const auto k = random_tensor<T, 4>(rng, {B, Two, H, D}, 1.0);
  const auto v = random_tensor<T, 4>(rng, {B, Two, H, D}, 1.0);
  const auto lq = random_tensor<T, 4>(rng, {B, Two, H, L}, 1.0);
  const auto lq1 = random_tensor<T, 4>(rng, {B, Two, H, L + 1}, 1.0);
  const auto lk = random_tensor<T, 4>(rng, {B, Two, H, L}, 1.0);
  Tensor<T, 4> out({B, Two, H, D});
  Tensor<T, 3> row({B, H, D});
  {
    const LatteAttention<Causal, RunningMax, VAPOR> attention(
        {.heads = H, .latents = L, .value_dim = D});
    auto state = attention.template make_state<T>(B);
    for (const bool cpu : {false, true})
      check_position_end(
          attention, state,
          [&](auto& s) {
            if (cpu)
              attention.step(exec::cpu, s, time_step(lq, 0), time_step(lk, 0), time_step(v, 0),
                             row.view());
            else
              attention.step(exec::reference, s, time_step(lq, 0), time_step(lk, 0),
                             time_step(v, 0), row.view());
          },
          [&](auto& s) { attention.forward(exec::cpu, lq, lk, v, out.view(), s); },
          cpu ? "latte cpu" : "latte reference");
  }
  {
    const SoftmaxAttention<Causal, SlidingWindow> attention(
        {.heads = H, .key_dim = D, .value_dim = D}, SlidingWindow{.left = 3});
    auto state = attention.template make_state<T>(B);
    check_position_end(
        attention, state,
        [&](auto& s) {
          attention.step(exec::cpu, s, time_step(q, 0), time_step(k, 0), time_step(v, 0),
                         row.view());
        },
        [&](auto& s) { attention.forward(exec::cpu, q, k, v, out.view(), s); },
        "softmax sliding-window cache");
  }
  {
    const LinearAttention<Causal, EluPlusOne, NoReweight, RoPE> attention(
        {.heads = H, .key_dim = D, .value_dim = D});
    auto state = attention.template make_state<T>(B);
    check_position_end(
        attention, state,
        [&](auto& s) {
          attention.step(exec::cpu, s, time_step(q, 0), time_step(k, 0), time_step(v, 0),
                         row.view());
        },
        [&](auto& s) { attention.forward(exec::cpu, q, k, v, out.view(), s); }, "linear RoPE");
  }
  {
    const LatteMacchiato<Causal, RunningMax, VAPOR, RoPE> attention(
        {.heads = H, .latents = L, .key_dim = D, .value_dim = D, .window = 2});
    auto state = attention.template make_state<T>(B);
    check_position_end(
        attention, state,
        [&](auto& s) {
          attention.step(exec::cpu, s, time_step(lq1, 0), time_step(lk, 0), time_step(q, 0),
                         time_step(k, 0), time_step(v, 0), row.view());
        },
        [&](auto& s) { attention.forward(exec::cpu, lq1, lk, q, k, v, out.view(), s); },
        "macchiato");
  }
  {
    const Lavo<Causal> attention({.heads = H, .dim = D, .bases = 2, .window = 2});
    auto state = attention.template make_state<T>(B);
    check_position_end(
        attention, state,
        [&](auto& s) {
          attention.step(exec::cpu, s, time_step(q, 0), time_step(k, 0), time_step(v, 0),
                         row.view());
        },
        [&](auto& s) { attention.forward(exec::cpu, q, k, v, out.view(), s); }, "lavo");
  }
}

TEST_CASE("saved states announcing a batch or capacity the buffer cannot hold are refused") {
  // A corrupted size must be refused before any field count is computed from
  // it (the fuzzer found batch * heads * latents overflowing in load_state).
  const index_t H = 2, L = 3, D = 4;
  const std::int64_t huge = std::int64_t{1} << 62;
  // `too_many`: a modest size that still exceeds what the saved buffer holds.
  auto check = [&](const auto& attention, const auto& state, std::size_t size_index,
                   std::int64_t too_many, const char* needle, const std::string& what) {
    INFO(what);
    const std::vector<std::byte> bytes = state.save();
    const auto offsets = header_offsets(bytes);
    REQUIRE(size_index + 1 < offsets.size());
    for (const std::int64_t value : {huge, std::numeric_limits<std::int64_t>::max(), too_many})
      expect_error(
          [&] {
            (void)attention.template load_state<float>(patched(bytes, offsets[size_index], value));
          },
          "bytes", needle);
    CHECK(attention.template load_state<float>(bytes).save() == bytes);
  };
  const LatteAttention<Causal, RunningMax, VAPOR> latte({.heads = H, .latents = L, .value_dim = D});
  check(latte, latte.make_state<float>(1), 0, 3, "saved batch", "latte");
  const LatteMacchiato<Causal, RunningMax, VAPOR, RoPE> macchiato(
      {.heads = H, .latents = L, .key_dim = D, .value_dim = D, .window = 2});
  check(macchiato, macchiato.make_state<float>(1), 0, 3, "saved batch", "macchiato");
  const LinearAttention<Causal, EluPlusOne> linear({.heads = H, .key_dim = D, .value_dim = D});
  check(linear, linear.make_state<float>(1), 0, 3, "saved batch", "linear");
  const Lavo<Causal> lavo({.heads = H, .dim = D, .bases = 2, .window = 2});
  check(lavo, lavo.make_state<float>(1), 0, 3, "saved batch", "lavo");
  const SoftmaxAttention<Causal> softmax({.heads = H, .key_dim = D, .value_dim = D});
  check(softmax, softmax.make_state<float>(1, 5), 0, 3, "saved batch", "softmax batch");
  check(softmax, softmax.make_state<float>(1, 5), 4, 1000, "saved capacity", "softmax capacity");
}

// ============================================ state across backends --------

/// prefill on backend E1 with forward(state), save, load_state, continue on
/// backend E2 with forward(state) and steps; every output against the oracle.
template <class E1, class E2, class Attention, class T>
Tensor<T, 4> prefill_then_continue(const Attention& attention,
                                   typename Attention::template State<T> state,
                                   const Tensor<T, 4>& q, const Tensor<T, 4>& k,
                                   const Tensor<T, 4>& v, index_t prefill, index_t middle) {
  const index_t B = v.extent(0), Tn = v.extent(1), H = v.extent(2), Dv = v.extent(3);
  Tensor<T, 4> out(v.extents());
  Tensor<T, 4> head({B, prefill, H, Dv});
  attention.forward(E1{}, time_slice(q, 0, prefill), time_slice(k, 0, prefill),
                    time_slice(v, 0, prefill), head.view(), state);
  for (index_t t = 0; t < prefill; ++t) set_time_step(out, t, time_step(head, t));
  const std::vector<std::byte> bytes = state.save();
  auto restored = attention.template load_state<T>(bytes);
  CHECK(restored.position() == state.position());
  Tensor<T, 4> part({B, middle, H, Dv});
  attention.forward(E2{}, time_slice(q, prefill, middle), time_slice(k, prefill, middle),
                    time_slice(v, prefill, middle), part.view(), restored);
  for (index_t t = 0; t < middle; ++t) set_time_step(out, prefill + t, time_step(part, t));
  Tensor<T, 3> row({B, H, Dv});
  for (index_t t = prefill + middle; t < Tn; ++t) {
    attention.step(E2{}, restored, time_step(q, t), time_step(k, t), time_step(v, t), row.view());
    set_time_step(out, t, row);
  }
  return out;
}

TEST_CASE_TEMPLATE("state saved by exec::cpu continues on exec::reference and vice versa", T, float,
                   double) {
  Rng rng(16);
  const index_t B = 2, Tn = 90, H = 3, L = 7, Dk = 5, Dv = 6, prefill = 37, middle = 20;
  const auto q = random_tensor<T, 4>(rng, {B, Tn, H, L}, 2.0);
  const auto k = random_tensor<T, 4>(rng, {B, Tn, H, L}, 2.0);
  const auto v = uniform_tensor<T, 4>(rng, {B, Tn, H, Dv}, -1, 1);
  {
    const LatteAttention<Causal, RunningMax, VAPOR> attention(
        {.heads = H, .latents = L, .value_dim = Dv});
    const auto oracle = latte_oracle(true, q, k, v, rope_schedule(H, Dv));
    check_close(prefill_then_continue<exec::cpu_t, exec::reference_t>(
                    attention, attention.template make_state<T>(B, 1000), q, k, v, prefill, middle),
                oracle, "latte: cpu -> reference");
    check_close(prefill_then_continue<exec::reference_t, exec::cpu_t>(
                    attention, attention.template make_state<T>(B, 1000), q, k, v, prefill, middle),
                oracle, "latte: reference -> cpu");
  }
  const auto sq = random_tensor<T, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto sk = random_tensor<T, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const long double scale = inverse_sqrt(Dk);
  {
    const SoftmaxAttention<Causal> attention({.heads = H, .key_dim = Dk, .value_dim = Dv});
    const auto oracle = softmax_oracle({.causal = true}, scale, sq, sk, v);
    check_close(prefill_then_continue<exec::cpu_t, exec::reference_t>(
                    attention, attention.template make_state<T>(B, Tn), sq, sk, v, prefill, middle),
                oracle, "softmax KV cache: cpu -> reference");
    check_close(prefill_then_continue<exec::reference_t, exec::cpu_t>(
                    attention, attention.template make_state<T>(B, Tn), sq, sk, v, prefill, middle),
                oracle, "softmax KV cache: reference -> cpu");
  }
  {
    // A sliding-window cache whose ring has wrapped before the save.
    const index_t left = 11;
    const SoftmaxAttention<Causal, SlidingWindow> attention(
        {.heads = H, .key_dim = Dk, .value_dim = Dv}, SlidingWindow{.left = left});
    const auto oracle = softmax_oracle({.causal = true, .left = left}, scale, sq, sk, v);
    check_close(prefill_then_continue<exec::cpu_t, exec::reference_t>(
                    attention, attention.template make_state<T>(B), sq, sk, v, prefill, middle),
                oracle, "windowed KV cache: cpu -> reference");
    check_close(prefill_then_continue<exec::reference_t, exec::cpu_t>(
                    attention, attention.template make_state<T>(B), sq, sk, v, prefill, middle),
                oracle, "windowed KV cache: reference -> cpu");
  }
}


// ============================================= values near the largest float

/// Values as large as a mechanism's exact sums allow: |v| <= max / bound, where
/// `bound` is the largest factor by which the reference backend's sums can
/// exceed max |v|. The cpu kernels must keep within the same bound (no
/// intermediate larger than the reference's): finite, and close to the oracle.
template <class T>
Tensor<T, 4> values_near_max(Rng& rng, const std::array<index_t, 4>& extents, double bound) {
  auto v = uniform_tensor<T, 4>(rng, extents, 0.5, 1.0);
  const double largest = static_cast<double>(std::numeric_limits<T>::max()) / bound;
  for (index_t i = 0; i < v.size(); ++i)
    v.data()[i] = static_cast<T>((i % 3 ? largest : -largest) * double(v.data()[i]));
  return v;
}

template <class T>
void check_near_max(const Tensor<T, 4>& out, const TensorLD<4>& oracle, const std::string& what) {
  INFO(what);
  CHECK(all_finite(out));
  check_close(out, oracle, what);
}

TEST_CASE_TEMPLATE("values near the largest finite number: exec::cpu stays within the reference's bound",
                   T, float, double) {
  // Fails before: the cpu Latte scans let their shift lag the maximum by up to
  // 8 (terms up to e^8 times a value) and the bidirectional read-out summed
  // e_{t,l} M_l before dividing by beta_t (up to L times a value). L = 17 takes
  // the cpu scans' vector lanes (and their scalar tail); T = 70 two blocks of
  // the bidirectional pass.
  for (const index_t Tn : {1, 2, 3, 40, 70}) {
    CAPTURE(Tn);
    Rng rng(static_cast<std::uint64_t>(100 + Tn));
    const index_t B = 1, H = 2, L = 17, D = 6;
    const auto q = uniform_tensor<T, 4>(rng, {B, Tn, H, D}, -1, 1);
    const auto k = uniform_tensor<T, 4>(rng, {B, Tn, H, D}, -1, 1);
    const auto latent_q = random_tensor<T, 4>(rng, {B, Tn, H, L}, 1.0);
    auto latent_k = random_tensor<T, 4>(rng, {B, Tn, H, L}, 1.0);
    for (index_t t = 0; t < Tn; ++t)  // latent 0's keys rise by 4 a token; latent 1's
      for (index_t h = 0; h < H; ++h) {  // step up by 5 in the second block
        latent_k(0, t, h, 0) = T(4 * t);
        latent_k(0, t, h, 1) = T(t < 64 ? 0 : 5);
      }
    const auto macchiato_q = random_tensor<T, 4>(rng, {B, Tn, H, L + 1}, 1.0);
    // Convex mechanisms: every sum is at most T times max |v| (weights <= 1).
    const auto v = values_near_max<T>(rng, {B, Tn, H, D}, 2.0 * Tn);
    Tensor<T, 4> out(v.extents());
    {
      const LatteAttention<Causal> causal({.heads = H, .latents = L, .value_dim = D});
      const LatteAttention<Bidirectional> bidirectional({.heads = H, .latents = L, .value_dim = D});
      const auto causal_oracle = latte_oracle(true, latent_q, latent_k, v);
      causal.forward(exec::cpu, latent_q, latent_k, v, out.view());
      check_near_max(out, causal_oracle, "latte causal cpu");
      auto state = causal.template make_state<T>(B);
      check_near_max(decode<exec::cpu_t>(causal, state, D, latent_q, latent_k, v), causal_oracle,
                     "latte causal cpu decode");
      bidirectional.forward(exec::cpu, latent_q, latent_k, v, out.view());
      check_near_max(out, latte_oracle(false, latent_q, latent_k, v), "latte bidirectional cpu");
    }
    {
      const auto angles = rope_schedule(H, D);
      const LatteAttention<Causal, RunningMax, VAPOR> causal(
          {.heads = H, .latents = L, .value_dim = D});
      const LatteAttention<Bidirectional, RunningMax, VAPOR> bidirectional(
          {.heads = H, .latents = L, .value_dim = D});
      causal.forward(exec::cpu, latent_q, latent_k, v, out.view());
      check_near_max(out, latte_oracle(true, latent_q, latent_k, v, angles), "latte VAPOR causal cpu");
      bidirectional.forward(exec::cpu, latent_q, latent_k, v, out.view());
      check_near_max(out, latte_oracle(false, latent_q, latent_k, v, angles),
                     "latte VAPOR bidirectional cpu");
    }
    for (const bool causal : {true, false}) {
      const index_t window = 2;
      const MacchiatoSpec spec{.causal = causal, .window = window, .scale = inverse_sqrt(D)};
      const auto oracle = macchiato_oracle(spec, macchiato_q, latent_k, q, k, v);
      const MacchiatoDims dims{.heads = H, .latents = L, .key_dim = D, .value_dim = D, .window = window};
      if (causal) LatteMacchiato<Causal>(dims).forward(exec::cpu, macchiato_q, latent_k, q, k, v, out.view());
      else LatteMacchiato<Bidirectional>(dims).forward(exec::cpu, macchiato_q, latent_k, q, k, v, out.view());
      check_near_max(out, oracle, causal ? "macchiato causal cpu" : "macchiato bidirectional cpu");
    }
    {
      const SoftmaxDims dims{.heads = H, .key_dim = D, .value_dim = D};
      SoftmaxAttention<Causal>(dims).forward(exec::cpu, q, k, v, out.view());
      check_near_max(out, softmax_oracle({.causal = true}, inverse_sqrt(D), q, k, v), "softmax causal cpu");
      SoftmaxAttention<Bidirectional>(dims).forward(exec::cpu, q, k, v, out.view());
      check_near_max(out, softmax_oracle({.causal = false}, inverse_sqrt(D), q, k, v),
                     "softmax bidirectional cpu");
      SoftmaxAttention<Causal, SlidingWindow>(dims, {.left = 1}).forward(exec::cpu, q, k, v, out.view());
      check_near_max(out, softmax_oracle({.causal = true, .left = 1}, inverse_sqrt(D), q, k, v),
                     "softmax window cpu");
    }
    {
      // Linear family: weights phi(q) . phi(k) <= 4 D (elu + 1 <= 2 on [-1, 1]).
      const auto v_linear = values_near_max<T>(rng, {B, Tn, H, D}, 2.0 * Tn * 4 * D);
      Tensor<T, 4> out_linear(v_linear.extents());
      const LinearDims dims{.heads = H, .key_dim = D, .value_dim = D};
      for (const bool causal : {true, false}) {
        const LinearOracleSpec spec{.causal = causal, .feature = oracle_elu_plus_one};
        if (causal) LinearAttention<Causal, EluPlusOne>(dims).forward(exec::cpu, q, k, v_linear, out_linear.view());
        else LinearAttention<Bidirectional, EluPlusOne>(dims).forward(exec::cpu, q, k, v_linear, out_linear.view());
        check_near_max(out_linear, linear_oracle(spec, q, k, v_linear),
                       causal ? "linear causal cpu" : "linear bidirectional cpu");
      }
    }
  }
}

}  // namespace

}  // namespace test_edge_cases
