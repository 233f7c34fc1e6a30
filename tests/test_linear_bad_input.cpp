// Malformed calls to the linear-attention family: every invalid call throws
// latte::Error naming the offending argument. Each case first makes the valid
// call (it must not throw), then changes exactly one thing.
#include <doctest/doctest.h>

#include <cstring>
#include <initializer_list>
#include <limits>
#include <string>
#include <string_view>

#include "expect_error.hpp"
#include "linear_support.hpp"
#include "state_bytes.hpp"

namespace test_linear_bad_input {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;

constexpr index_t kB = 2, kT = 5, kH = 3, kDk = 8, kDv = 6, kLength = 4 * kT;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

using CausalRelu = LinearAttention<Causal, Relu>;
using BidirectionalElu = LinearAttention<Bidirectional, EluPlusOne>;
using CausalCos = CosFormer<Causal>;
using BidirectionalCos = CosFormer<Bidirectional>;
using CausalLeap = LeaPformer<Causal>;
using BidirectionalLeap = LeaPformer<Bidirectional>;
using CausalRope = LinearAttention<Causal, EluPlusOne, NoReweight, RoPE>;

#define ALL_TYPES CausalRelu, BidirectionalElu, CausalCos, BidirectionalCos, CausalLeap, BidirectionalLeap, CausalRope
#define CAUSAL_TYPES CausalRelu, CausalCos, CausalLeap, CausalRope
#define BIDIRECTIONAL_TYPES BidirectionalElu, BidirectionalCos, BidirectionalLeap
#define LEAP_TYPES CausalLeap, BidirectionalLeap

LeaPReweight::Params leap_params(index_t key_dim = kDk, index_t leap_factor = 4) {
  Rng rng(3);
  return {.query_module = random_leap_module(rng, key_dim, leap_factor),
          .key_module = random_leap_module(rng, key_dim, leap_factor),
          .leap_factor = leap_factor};
}

/// A valid attention of type A with the fixture sizes (cosFormer with M = 4 T).
template <class A>
A make_attention(index_t heads = kH) {
  const LinearDims dims{.heads = heads, .key_dim = kDk, .value_dim = kDv};
  typename A::Options options;
  if constexpr (A::position_proportions) options.reweight.length = kLength;
  if constexpr (A::learned_proportions) options.reweight = leap_params();
  return A(dims, options);
}

struct Inputs {
  Tensor<float, 4> q, k, v, out;
  static Inputs make(index_t batch = kB, index_t time = kT, std::uint64_t seed = 7) {
    Rng rng(seed);
    return {random_tensor<float, 4>(rng, {batch, time, kH, kDk}, 1.0),
            random_tensor<float, 4>(rng, {batch, time, kH, kDk}, 1.0),
            uniform_tensor<float, 4>(rng, {batch, time, kH, kDv}, -1, 1),
            Tensor<float, 4>({batch, time, kH, kDv})};
  }
  Tensor<float, 4>& operator[](int which) {
    Tensor<float, 4>* tensors[] = {&q, &k, &v, &out};
    return *tensors[which];
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
  static StepInputs make(index_t batch = kB, std::uint64_t seed = 11) {
    Rng rng(seed);
    return {random_tensor<float, 3>(rng, {batch, kH, kDk}, 1.0),
            random_tensor<float, 3>(rng, {batch, kH, kDk}, 1.0),
            uniform_tensor<float, 3>(rng, {batch, kH, kDv}, -1, 1), Tensor<float, 3>({batch, kH, kDv})};
  }
  Tensor<float, 3>& operator[](int which) {
    Tensor<float, 3>* tensors[] = {&q, &k, &v, &out};
    return *tensors[which];
  }
  template <class A, class S>
  void step(const A& attention, S& state) {
    attention.step(exec::reference, state, q.cview(), k.cview(), v.cview(), out.view());
  }
};

constexpr std::string_view kNames[] = {"queries", "keys", "values", "out"};

// ---------------------------------------------------- compile-time API --

static_assert(FeatureMap<Relu> && FeatureMap<EluPlusOne> && FeatureMap<Identity>);
static_assert(!FeatureMap<Causal> && !FeatureMap<int>);
static_assert(Reweight<NoReweight> && Reweight<CosFormerReweight> && Reweight<LeaPReweight>);
static_assert(!Reweight<Relu>);
static_assert(std::is_same_v<LinearAttention<Causal, Relu>,
                             LinearAttention<Causal, Relu, NoReweight, NoPositional>>);
static_assert(std::is_same_v<CausalCos::State<float>, LinearState<float>>);

template <class A>
concept HasDecode = requires(const A& attention) { attention.template make_state<float>(1); };
template <class A>
concept HasCross = requires(const A& attention, const Tensor<float, 4>& x, Tensor<float, 4>& out) {
  attention.cross_forward(exec::reference, x, x, x, out.view());
};
template <class A>
concept TakesProportions = requires(const A& attention, const Tensor<float, 4>& x,
                                    Tensor<float, 4>& out) {
  attention.forward(exec::reference, x, x, x, SequenceProportions<float>{}, out.view());
};
static_assert(HasDecode<CausalRelu> && HasDecode<CausalCos> && HasDecode<CausalLeap> &&
              HasDecode<CausalRope>);
static_assert(!HasDecode<BidirectionalElu> && !HasDecode<BidirectionalCos> &&
              !HasDecode<BidirectionalLeap>);
static_assert(HasCross<BidirectionalElu> && HasCross<BidirectionalCos> && HasCross<BidirectionalLeap>);
static_assert(!HasCross<CausalRelu> && !HasCross<CausalLeap>);
static_assert(TakesProportions<CausalLeap> && TakesProportions<BidirectionalLeap>);
static_assert(!TakesProportions<CausalCos> && !TakesProportions<CausalRelu>);

// ------------------------------------------------------------- forward --

TEST_CASE_TEMPLATE("forward: each tensor with one extent off names that tensor", A, ALL_TYPES) {
  const A attention = make_attention<A>();
  for (int which = 0; which < 4; ++which)
    for (std::size_t dim = 0; dim < 4; ++dim)
      for (index_t delta : {-1, +1}) {
        CAPTURE(which);
        CAPTURE(dim);
        CAPTURE(delta);
        Inputs in = Inputs::make();
        REQUIRE_NOTHROW(in.forward(attention));
        if (which == 0 && dim <= 1) continue;  // B and T are taken from the queries
        auto extents = in[which].extents();
        extents[dim] += delta;
        in[which] = Tensor<float, 4>(extents, 0.25f);
        expect_error([&] { in.forward(attention); }, kNames[which], "expected");
      }
}

TEST_CASE_TEMPLATE("forward: the message names the layout and both extents", A, ALL_TYPES) {
  const A attention = make_attention<A>();
  Inputs in = Inputs::make();
  in.k = Tensor<float, 4>({kB, kT, kH, kDk + 1});
  expect_error([&] { in.forward(attention); }, "keys", "[B, T, H, Dk]");
  expect_error([&] { in.forward(attention); }, "keys",
               "expected " + format_extents<4>({kB, kT, kH, kDk}) + ", given " +
                   format_extents<4>({kB, kT, kH, kDk + 1}));
}

TEST_CASE_TEMPLATE("forward: T = 0 and B = 0 are no-ops; T = 0 still checks extents", A, ALL_TYPES) {
  const A attention = make_attention<A>();
  std::vector<float> sentinel(64, 42.0f);
  for (auto [batch, time] : {std::pair<index_t, index_t>{kB, 0}, {0, kT}}) {
    Inputs in = Inputs::make(batch, time);
    const TensorView<float, 4> out(sentinel.data(), {batch, time, kH, kDv});
    CHECK_NOTHROW(attention.forward(exec::reference, in.q.cview(), in.k.cview(), in.v.cview(), out));
  }
  CHECK(std::all_of(sentinel.begin(), sentinel.end(), [](float x) { return x == 42.0f; }));
  Inputs in = Inputs::make(kB, 0);
  in.v = Tensor<float, 4>({kB, 0, kH, kDv + 1});
  expect_error([&] { in.forward(attention); }, "values");
}

TEST_CASE_TEMPLATE("forward: out aliasing an input", A, ALL_TYPES) {
  const A attention = make_attention<A>();
  Inputs in = Inputs::make();
  REQUIRE_NOTHROW(in.forward(attention));
  const TensorView<float, 4> on_values(in.v.data(), in.v.extents());
  expect_error([&] { attention.forward(exec::reference, in.q.cview(), in.k.cview(), in.v.cview(), on_values); },
               "out", "aliases input 'values'");
  std::vector<float> buffer(static_cast<std::size_t>(in.q.size() + in.out.size()), 0.5f);
  const TensorView<const float, 4> queries(buffer.data(), in.q.extents());
  const TensorView<float, 4> after(buffer.data() + in.q.size(), in.out.extents());
  REQUIRE_NOTHROW(attention.forward(exec::reference, queries, in.k.cview(), in.v.cview(), after));
  const TensorView<float, 4> overlapping(buffer.data() + in.q.size() - 1, in.out.extents());
  expect_error([&] { attention.forward(exec::reference, queries, in.k.cview(), in.v.cview(), overlapping); },
               "out", "aliases input 'queries'");
}

TEST_CASE_TEMPLATE("forward: structurally invalid views", A, ALL_TYPES) {
  const A attention = make_attention<A>();
  Inputs in = Inputs::make();
  std::vector<float> buffer(static_cast<std::size_t>(2 * in.k.size()), 0.5f);
  const TensorView<const float, 4> strided(buffer.data(), in.k.extents(),
                                           {kT * kH * 2 * kDk, kH * 2 * kDk, 2 * kDk, 2});
  expect_error([&] { attention.forward(exec::reference, in.q.cview(), strided, in.v.cview(), in.out.view()); },
               "keys", "stride of the feature (last) dimension: expected 1, given 2");
  const TensorView<const float, 4> null(nullptr, in.v.extents());
  expect_error([&] { attention.forward(exec::reference, in.q.cview(), in.k.cview(), null, in.out.view()); },
               "values", "null");
  const TensorView<const float, 4> reversed(in.q.data() + (kT - 1) * kH * kDk, in.q.extents(),
                                            {kT * kH * kDk, -kH * kDk, kDk, 1});
  expect_error([&] { attention.forward(exec::reference, reversed, in.k.cview(), in.v.cview(), in.out.view()); },
               "queries", "non-negative");
}

// ---------------------------------------------------------------- cross --

TEST_CASE_TEMPLATE("cross_forward: source and target shapes", A, BIDIRECTIONAL_TYPES) {
  const A attention = make_attention<A>();
  Rng rng(5);
  const index_t S = 9;
  auto q = random_tensor<float, 4>(rng, {kB, kT, kH, kDk}, 1.0);
  auto k = random_tensor<float, 4>(rng, {kB, S, kH, kDk}, 1.0);
  auto v = uniform_tensor<float, 4>(rng, {kB, S, kH, kDv}, -1, 1);
  Tensor<float, 4> out({kB, kT, kH, kDv});
  auto call = [&] { attention.cross_forward(exec::reference, q, k, v, out.view()); };
  REQUIRE_NOTHROW(call());
  v = Tensor<float, 4>({kB, S - 1, kH, kDv});
  expect_error(call, "values", "[B, S, H, Dv]");
  v = Tensor<float, 4>({kB, S, kH, kDv});
  out = Tensor<float, 4>({kB, S, kH, kDv});
  expect_error(call, "out", "[B, T, H, Dv]");
  out = Tensor<float, 4>({kB, kT, kH, kDv});
  k = Tensor<float, 4>({kB + 1, S, kH, kDk});
  expect_error(call, "keys", "[B, S, H, Dk]");
  k = Tensor<float, 4>({kB, S, kH, kDk - 1});
  expect_error(call, "keys", "[B, S, H, Dk]");
  k = Tensor<float, 4>({kB, 0, kH, kDk});  // an empty source is valid: the output is zero
  v = Tensor<float, 4>({kB, 0, kH, kDv});
  if constexpr (!A::learned_proportions) {
    CHECK_NOTHROW(call());
    CHECK(std::all_of(out.data(), out.data() + out.size(), [](float x) { return x == 0.0f; }));
  }
}

// ---------------------------------------------------------- constructor --

TEST_CASE_TEMPLATE("dims: heads, key_dim, value_dim must be >= 1", A, ALL_TYPES) {
  CHECK_NOTHROW(make_attention<A>());
  typename A::Options options = make_attention<A>().options();
  expect_error([&] { A({.heads = 0, .key_dim = kDk, .value_dim = kDv}, options); }, "dims.heads");
  expect_error([&] { A({.heads = kH, .key_dim = 0, .value_dim = kDv}, options); }, "dims.key_dim");
  expect_error([&] { A({.heads = kH, .key_dim = kDk, .value_dim = -1}, options); }, "dims.value_dim");
}

TEST_CASE_TEMPLATE("normaliser: value must be finite and > 0", A, ALL_TYPES) {
  typename A::Options options = make_attention<A>().options();
  const LinearDims dims{kH, kDk, kDv};
  for (Normaliser good : {Normaliser::additive(1e-9), Normaliser::clamp_min(0.1)}) {
    options.normaliser = good;
    CHECK_NOTHROW(A(dims, options));
  }
  for (double bad : {0.0, -1e-6, kNaN, kInf}) {
    CAPTURE(bad);
    options.normaliser = Normaliser::additive(bad);
    expect_error([&] { A(dims, options); }, "normaliser", "finite and > 0");
    options.normaliser = Normaliser::clamp_min(bad);
    expect_error([&] { A(dims, options); }, "normaliser", "clamp_min");
  }
}

TEST_CASE("rope_denominator: rotated without RoPE") {
  CHECK_NOTHROW(CausalRope({kH, kDk, kDv}, {.rope_denominator = RopeDenominator::rotated}));
  expect_error([] { CausalRelu({kH, kDk, kDv}, {.rope_denominator = RopeDenominator::rotated}); },
               "rope_denominator", "expected unrotated, given rotated");
}

TEST_CASE("RoPE angles: shape [H, Dk/2], finite, base > 1") {
  CausalRope::Options options;
  options.positional.angles = Tensor<double, 2>({kH, kDk / 2}, 0.1);
  CHECK_NOTHROW(CausalRope({kH, kDk, kDv}, options));
  options.positional.angles = Tensor<double, 2>({kH, kDk / 2 + 1}, 0.1);
  expect_error([&] { CausalRope({kH, kDk, kDv}, options); }, "angles", "[H, Dk/2]");
  options.positional.angles = Tensor<double, 2>({kH + 1, kDk / 2}, 0.1);
  expect_error([&] { CausalRope({kH, kDk, kDv}, options); }, "angles", "expected");
  options.positional.angles = Tensor<double, 2>({kH, kDk / 2}, 0.1);
  options.positional.angles(1, 2) = kNaN;
  expect_error([&] { CausalRope({kH, kDk, kDv}, options); }, "angles", "finite");
  options.positional = {};
  options.positional.base = 1.0;
  expect_error([&] { CausalRope({kH, kDk, kDv}, options); }, "base");
  options.positional.base = std::numeric_limits<double>::infinity();
  expect_error([&] { CausalRope({kH, kDk, kDv}, options); }, "base", "finite");
}

/// A feature map whose phi has no features.
struct EmptyFeatures {
  static constexpr const char* name = "empty";
  static constexpr index_t feature_dim(index_t) { return 0; }
  template <class T>
  static void apply(std::span<const T>, std::span<T>) noexcept {}
};

TEST_CASE("a custom feature map with feature_dim 0") {
  static_assert(FeatureMap<EmptyFeatures>);
  expect_error([] { LinearAttention<Causal, EmptyFeatures>({kH, kDk, kDv}); }, "feature_map", ">= 1");
}

// ------------------------------------------------------------------ LeaP --

TEST_CASE_TEMPLATE("LeaP: leap_factor must divide Dk", A, LEAP_TYPES) {
  const LinearDims dims{kH, kDk, kDv};
  CHECK_NOTHROW(A(dims, {.reweight = leap_params(kDk, 8)}));
  for (index_t bad : {3, 5, 16, 0, -4}) {
    CAPTURE(bad);
    LeaPReweight::Params params = leap_params();
    params.leap_factor = bad;
    expect_error([&] { A(dims, {.reweight = params}); }, "leap_factor", "a divisor of 8");
  }
  // The default factor 4 does not divide Dk = 7.
  expect_error([] { A({kH, 7, kDv}); }, "leap_factor", "given 4");
  CHECK_NOTHROW(A({kH, 7, kDv}, {.reweight = {.leap_factor = 7}}));
}

TEST_CASE_TEMPLATE("LeaP: both modules or neither", A, LEAP_TYPES) {
  LeaPReweight::Params params = leap_params();
  params.key_module.reset();
  expect_error([&] { A({kH, kDk, kDv}, {.reweight = params}); }, "key_module", "both");
  params = leap_params();
  params.query_module.reset();
  expect_error([&] { A({kH, kDk, kDv}, {.reweight = params}); }, "query_module", "both");
  CHECK_NOTHROW(A({kH, kDk, kDv}));  // neither: proportions are passed per call
}

TEST_CASE("LeaP: module weights of the wrong shape or not finite") {
  auto with = [](auto&& change) {
    LeaPReweight::Params params = leap_params();
    change(params);
    return [params] { CausalLeap({kH, kDk, kDv}, {.reweight = params}); };
  };
  CHECK_NOTHROW(with([](LeaPReweight::Params&) {})());
  expect_error(with([](auto& p) { p.query_module->w1 = Tensor<double, 2>({3, kDk}); }),
               "query_module.w1", "expected [2, 8], given [3, 8]");
  expect_error(with([](auto& p) { p.key_module->w1 = Tensor<double, 2>({2, kDk + 1}); }),
               "key_module.w1", "[D / leap_factor, D]");
  expect_error(with([](auto& p) { p.query_module->b1 = Tensor<double, 1>({1}); }),
               "query_module.b1", "expected [2], given [1]");
  expect_error(with([](auto& p) { p.key_module->w2 = Tensor<double, 1>({4}); }),
               "key_module.w2", "expected [2], given [4]");
  expect_error(with([](auto& p) { p.query_module->w1(1, 3) = kNaN; }), "query_module.w1", "finite");
  expect_error(with([](auto& p) { p.key_module->b2 = kInf; }), "key_module.b2", "finite");
}

TEST_CASE("LeaPModule::from: views with a feature stride") {
  std::vector<float> w(32, 0.1f), b(2, 0.0f);
  const TensorView<const float, 1> b1(b.data(), {2});
  CHECK_NOTHROW((void)LeaPModule::from<float>(TensorView<const float, 2>(w.data(), {2, 8}), b1, b1, 0.0f));
  const TensorView<const float, 2> strided(w.data(), {2, 8}, {16, 2});
  expect_error([&] { (void)LeaPModule::from<float>(strided, b1, b1, 0.0f); }, "w1", "stride");
}

TEST_CASE_TEMPLATE("LeaP without modules needs proportions", A, LEAP_TYPES) {
  const A attention({kH, kDk, kDv});
  Inputs in = Inputs::make();
  const Tensor<float, 3> p({kB, kT, kH}, 0.5f);
  CHECK_NOTHROW(attention.forward(exec::reference, in.q, in.k, in.v, SequenceProportions<float>{p, p},
                                  in.out.view()));
  expect_error([&] { in.forward(attention); }, "proportions", "no LeaP modules");
  if constexpr (Causal::is_causal == A::direction::is_causal) {
    auto state = attention.template make_state<float>(kB);
    StepInputs step = StepInputs::make();
    const Tensor<float, 2> ps({kB, kH}, 0.5f);
    CHECK_NOTHROW(attention.step(exec::reference, state, step.q, step.k, step.v,
                                 StepProportions<float>{ps, ps}, step.out.view()));
    expect_error([&] { step.step(attention, state); }, "proportions", "no LeaP modules");
    expect_error([&] { in.forward(attention, state); }, "proportions");
    CHECK(state.position() == 1);
  }
}

TEST_CASE_TEMPLATE("LeaP: proportion tensors of the wrong shape", A, LEAP_TYPES) {
  const A attention = make_attention<A>();
  Inputs in = Inputs::make();
  Tensor<float, 3> pq({kB, kT, kH}, 0.5f), pk({kB, kT, kH}, 0.5f);
  auto call = [&] {
    attention.forward(exec::reference, in.q, in.k, in.v, SequenceProportions<float>{pq, pk},
                      in.out.view());
  };
  REQUIRE_NOTHROW(call());
  for (std::size_t dim = 0; dim < 3; ++dim) {
    CAPTURE(dim);
    std::array<index_t, 3> extents{kB, kT, kH};
    extents[dim] += 1;
    pq = Tensor<float, 3>(extents, 0.5f);
    expect_error(call, "query_proportions", "[B, T, H]");
    pq = Tensor<float, 3>({kB, kT, kH}, 0.5f);
    pk = Tensor<float, 3>(extents, 0.5f);
    expect_error(call, "key_proportions", "[B, T, H]");
    pk = Tensor<float, 3>({kB, kT, kH}, 0.5f);
  }
  const TensorView<const float, 3> null(nullptr, {kB, kT, kH});
  expect_error([&] {
    attention.forward(exec::reference, in.q, in.k, in.v, SequenceProportions<float>{pq, null},
                      in.out.view());
  }, "key_proportions", "null");
}

TEST_CASE_TEMPLATE("LeaP: proportions outside [0, 1]", A, LEAP_TYPES) {
  const A attention = make_attention<A>();
  Inputs in = Inputs::make();
  Tensor<float, 3> pq({kB, kT, kH}, 0.0f), pk({kB, kT, kH}, 1.0f);  // both ends are valid
  auto call = [&] {
    attention.forward(exec::reference, in.q, in.k, in.v, SequenceProportions<float>{pq, pk},
                      in.out.view());
  };
  REQUIRE_NOTHROW(call());
  for (float bad : {-0.01f, 1.0001f, float(kNaN), float(kInf)}) {
    CAPTURE(bad);
    pq(1, 3, 2) = bad;
    expect_error(call, "query_proportions", "proportion at [1, 3, 2]: expected a value in [0, 1]");
    pq(1, 3, 2) = 0.5f;
    pk(0, kT - 1, 0) = bad;
    expect_error(call, "key_proportions", "[0, 4, 0]");
    pk(0, kT - 1, 0) = 0.5f;
  }
}

TEST_CASE("LeaP: out aliasing the proportions") {
  const CausalLeap attention = make_attention<CausalLeap>();
  Inputs in = Inputs::make();
  const Tensor<float, 3> pk({kB, kT, kH}, 0.5f);
  std::vector<float> buffer(static_cast<std::size_t>(in.out.size()), 0.5f);
  const TensorView<const float, 3> pq(buffer.data(), {kB, kT, kH});
  const TensorView<float, 4> out(buffer.data(), in.out.extents());
  expect_error([&] {
    attention.forward(exec::reference, in.q, in.k, in.v, SequenceProportions<float>{pq, pk}, out);
  }, "out", "aliases input 'query_proportions'");
}

TEST_CASE("LeaP: cross-attention key proportions are [B, S, H]") {
  const BidirectionalLeap attention = make_attention<BidirectionalLeap>();
  Rng rng(9);
  const index_t S = 7;
  const auto q = random_tensor<float, 4>(rng, {kB, kT, kH, kDk}, 1.0);
  const auto k = random_tensor<float, 4>(rng, {kB, S, kH, kDk}, 1.0);
  const auto v = uniform_tensor<float, 4>(rng, {kB, S, kH, kDv}, -1, 1);
  Tensor<float, 4> out({kB, kT, kH, kDv});
  const Tensor<float, 3> pq({kB, kT, kH}, 0.5f), pk({kB, S, kH}, 0.5f), wrong({kB, kT, kH}, 0.5f);
  CHECK_NOTHROW(attention.cross_forward(exec::reference, q, k, v, SequenceProportions<float>{pq, pk},
                                        out.view()));
  expect_error([&] {
    attention.cross_forward(exec::reference, q, k, v, SequenceProportions<float>{pq, wrong}, out.view());
  }, "key_proportions", "[B, S, H]");
}

TEST_CASE("LeaP: step proportions [B, H]") {
  const CausalLeap attention = make_attention<CausalLeap>();
  auto state = attention.make_state<float>(kB);
  StepInputs in = StepInputs::make();
  Tensor<float, 2> pq({kB, kH}, 0.5f), pk({kB, kH}, 0.5f);
  auto call = [&] {
    attention.step(exec::reference, state, in.q, in.k, in.v, StepProportions<float>{pq, pk},
                   in.out.view());
  };
  REQUIRE_NOTHROW(call());
  pk = Tensor<float, 2>({kB, kH + 1}, 0.5f);
  expect_error(call, "key_proportions", "[B, H]");
  pk = Tensor<float, 2>({kB, kH}, 0.5f);
  pq(1, 1) = 2.0f;
  expect_error(call, "query_proportions", "[0, 1]");
  CHECK(state.position() == 1);  // rejected steps do not advance
}

// ------------------------------------------------------------- cosFormer --

TEST_CASE_TEMPLATE("cosFormer: length M >= 1", A, CausalCos, BidirectionalCos) {
  CHECK_NOTHROW(A({kH, kDk, kDv}, {.reweight = {.length = 1}}));
  for (index_t bad : {0, -3}) {
    CAPTURE(bad);
    expect_error([&] { A({kH, kDk, kDv}, {.reweight = {.length = bad}}); }, "length", ">= 1");
  }
}

TEST_CASE("cosFormer: decode needs the length M") {
  const CausalCos unsized({kH, kDk, kDv});
  Inputs in = Inputs::make();
  CHECK_NOTHROW(in.forward(unsized));  // forward: M defaults to T
  expect_error([&] { (void)unsized.make_state<float>(kB); }, "length", "given none");
  const CausalCos sized({kH, kDk, kDv}, {.reweight = {.length = kT}});
  CHECK_NOTHROW((void)sized.make_state<float>(kB, kT - 1));
  // at M: the state after the last token, which takes no more
  auto ended = sized.make_state<float>(kB, kT);
  expect_error([&] { in.forward(sized, ended); }, "length", "positions used");
  expect_error([&] { (void)sized.make_state<float>(kB, kT + 1); }, "first_position", "<= 5");
}

TEST_CASE("cosFormer: positions past M in decode") {
  const CausalCos attention({kH, kDk, kDv}, {.reweight = {.length = kT + 2}});
  auto state = attention.make_state<float>(kB);
  Inputs in = Inputs::make();
  REQUIRE_NOTHROW(in.forward(attention, state));  // positions 0..4
  Inputs three = Inputs::make(kB, 3);
  expect_error([&] { three.forward(attention, state); }, "length", "expected >= 8, given 7");
  CHECK(state.position() == kT);  // nothing of the rejected call was absorbed
  StepInputs step = StepInputs::make();
  REQUIRE_NOTHROW(step.step(attention, state));
  REQUIRE_NOTHROW(step.step(attention, state));  // position M - 1: P = 1
  const auto saved = state.save();
  expect_error([&] { step.step(attention, state); }, "length", "expected >= 8, given 7");
  CHECK(state.position() == kT + 2);
  CHECK(state.save() == saved);
}

TEST_CASE("cosFormer: forward and cross_forward longer than a given M") {
  const CausalCos causal({kH, kDk, kDv}, {.reweight = {.length = kT - 1}});
  Inputs in = Inputs::make();
  expect_error([&] { in.forward(causal); }, "length", "expected >= 5, given 4");
  const BidirectionalCos bidirectional({kH, kDk, kDv}, {.reweight = {.length = 8}});
  Rng rng(4);
  const auto q = random_tensor<float, 4>(rng, {kB, kT, kH, kDk}, 1.0);
  auto k = random_tensor<float, 4>(rng, {kB, 8, kH, kDk}, 1.0);
  auto v = uniform_tensor<float, 4>(rng, {kB, 8, kH, kDv}, -1, 1);
  Tensor<float, 4> out({kB, kT, kH, kDv});
  CHECK_NOTHROW(bidirectional.cross_forward(exec::reference, q, k, v, out.view()));
  k = random_tensor<float, 4>(rng, {kB, 9, kH, kDk}, 1.0);
  v = uniform_tensor<float, 4>(rng, {kB, 9, kH, kDv}, -1, 1);
  expect_error([&] { bidirectional.cross_forward(exec::reference, q, k, v, out.view()); }, "length",
               "expected >= 9, given 8");
}

// ----------------------------------------------------------------- state --

TEST_CASE_TEMPLATE("make_state: batch >= 1, first_position >= 0", A, CAUSAL_TYPES) {
  const A attention = make_attention<A>();
  CHECK_NOTHROW((void)attention.template make_state<float>(1, 3));
  expect_error([&] { (void)attention.template make_state<float>(0); }, "batch");
  expect_error([&] { (void)attention.template make_state<float>(kB, -1); }, "first_position");
}

TEST_CASE_TEMPLATE("step: each tensor with one extent off names that tensor", A, CAUSAL_TYPES) {
  const A attention = make_attention<A>();
  auto state = attention.template make_state<float>(kB);
  for (int which = 0; which < 4; ++which)
    for (std::size_t dim = 0; dim < 3; ++dim) {
      CAPTURE(which);
      CAPTURE(dim);
      StepInputs in = StepInputs::make();
      REQUIRE_NOTHROW(in.step(attention, state));
      const auto position = state.position();
      auto extents = in[which].extents();
      extents[dim] += 1;
      in[which] = Tensor<float, 3>(extents, 0.25f);
      expect_error([&] { in.step(attention, state); }, kNames[which], "expected");
      CHECK(state.position() == position);
    }
}

TEST_CASE_TEMPLATE("step and forward: states that do not belong to the attention", A, CAUSAL_TYPES) {
  const A attention = make_attention<A>();
  StepInputs in = StepInputs::make();
  Inputs seq = Inputs::make();
  {  // another batch size
    auto state = attention.template make_state<float>(kB + 1);
    expect_error([&] { seq.forward(attention, state); }, "state", "batch=");
    CHECK(state.position() == 0);
  }
  {  // another head count
    auto state = make_attention<A>(kH + 1).template make_state<float>(kB);
    expect_error([&] { in.step(attention, state); }, "state", "heads=");
  }
  {  // default-constructed
    typename A::template State<float> state;
    expect_error([&] { in.step(attention, state); }, "state", "<empty state>");
  }
  {  // a state of another attention type
    using Other = std::conditional_t<std::is_same_v<A, CausalRelu>, CausalRope, CausalRelu>;
    auto state = make_attention<Other>().template make_state<float>(kB);
    expect_error([&] { in.step(attention, state); }, "state", "state kind: expected " +
                                                                  A::template kind<float>());
  }
}

TEST_CASE("state: another cosFormer length or RoPE denominator") {
  StepInputs in = StepInputs::make();
  const CausalCos cos20({kH, kDk, kDv}, {.reweight = {.length = 20}});
  auto state25 = CausalCos({kH, kDk, kDv}, {.reweight = {.length = 25}}).make_state<float>(kB);
  expect_error([&] { in.step(cos20, state25); }, "state", "length=20");
  expect_error([&] { (void)cos20.load_state<float>(state25.save()); }, "bytes", "length=20");
  const CausalRope unrotated({kH, kDk, kDv});
  auto rotated = CausalRope({kH, kDk, kDv}, {.rope_denominator = RopeDenominator::rotated})
                     .make_state<float>(kB);
  expect_error([&] { in.step(unrotated, rotated); }, "state", "rotated_denominator=0");
  expect_error([&] { (void)unrotated.load_state<float>(rotated.save()); }, "bytes",
               "rotated_denominator=0");
}

TEST_CASE_TEMPLATE("load_state: truncations, a trailing byte, garbage, another dtype", A, CAUSAL_TYPES) {
  const A attention = make_attention<A>();
  auto state = attention.template make_state<float>(kB);
  Inputs in = Inputs::make(kB, 3);
  in.forward(attention, state);
  auto bytes = state.save();
  REQUIRE_NOTHROW((void)attention.template load_state<float>(bytes));
  for (std::size_t n = 0; n < bytes.size(); n += 7) {
    CAPTURE(n);
    expect_error([&] { (void)attention.template load_state<float>({bytes.data(), n}); }, "bytes", "");
  }
  expect_error([&] { (void)attention.template load_state<double>(bytes); }, "bytes", "float64");
  bytes.insert(bytes.end() - 4, std::byte{0});  // before the checksum, signed
  resign(bytes);
  expect_error([&] { (void)attention.template load_state<float>(bytes); }, "bytes", "state data bytes");
  Rng rng(99);
  for (auto& byte : bytes) byte = static_cast<std::byte>(rng() & 0xff);
  expect_error([&] { (void)attention.template load_state<float>(bytes); }, "bytes", "magic");
}

TEST_CASE("restore: a rejected buffer leaves the state unchanged") {
  const CausalRelu attention({kH, kDk, kDv});
  auto state = attention.make_state<float>(kB);
  Inputs mine = Inputs::make(kB, 2, 1);
  mine.forward(attention, state);
  const auto before = state.save();
  auto other = attention.make_state<float>(kB);
  Inputs theirs = Inputs::make(kB, 4, 2);
  theirs.forward(attention, other);
  auto bytes = other.save();
  bytes.resize(bytes.size() - 8);
  expect_error([&] { state.restore(bytes); }, "bytes", "");
  CHECK(state.save() == before);
}

}  // namespace

}  // namespace test_linear_bad_input
#undef ALL_TYPES
#undef CAUSAL_TYPES
#undef BIDIRECTIONAL_TYPES
#undef LEAP_TYPES
