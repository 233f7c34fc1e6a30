// Malformed input: every invalid call throws latte::Error naming the offending
// argument. Each case first makes the valid call (it must not throw), then
// changes exactly one thing and expects the error, so every case can fail.
//
#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "expect_error.hpp"
#include "state_bytes.hpp"
#include "support.hpp"

namespace test_bad_input {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;

// ---------------------------------------------------------------- helpers --

/// As expect_error, but any of `arguments` is an acceptable name.
template <class F>
void expect_error_naming_one_of(F&& call, std::initializer_list<std::string_view> arguments) {
  CHECK_THROWS_AS(call(), latte::Error);
  try {
    call();
  } catch (const latte::Error& error) {
    INFO("what(): " << error.what());
    bool named = false;
    for (std::string_view argument : arguments) named = named || error.argument() == argument;
    CHECK(named);
  } catch (...) {
  }
}

constexpr index_t kB = 2, kT = 5, kH = 3, kL = 4, kDk = 5, kDv = 6;

constexpr LatteDims kLatteDims{.heads = kH, .latents = kL, .value_dim = kDv};
constexpr SoftmaxDims kSoftmaxDims{.heads = kH, .key_dim = kDk, .value_dim = kDv};

using CausalLatte = LatteAttention<Causal>;
using BidirectionalLatte = LatteAttention<Bidirectional>;
using VaporLatte = LatteAttention<Causal, RunningMax, VAPOR>;
using BidirectionalVaporLatte = LatteAttention<Bidirectional, RunningMax, VAPOR>;
using UnstabilizedLatte = LatteAttention<Causal, NoStabilizer>;
using CausalSoftmax = SoftmaxAttention<Causal>;
using WindowedSoftmax = SoftmaxAttention<Bidirectional, SlidingWindow>;
using CausalWindowedSoftmax = SoftmaxAttention<Causal, SlidingWindow>;

#define LATTE_TYPES CausalLatte, BidirectionalLatte, VaporLatte
#define CAUSAL_LATTE_TYPES CausalLatte, VaporLatte
#define SOFTMAX_TYPES CausalSoftmax, WindowedSoftmax
#define ALL_TYPES CausalLatte, BidirectionalLatte, VaporLatte, CausalSoftmax, WindowedSoftmax
#define CAUSAL_TYPES CausalLatte, VaporLatte, CausalSoftmax, CausalWindowedSoftmax

template <class A>
constexpr bool is_latte = requires {
  typename A::stabilizer;
};

/// A valid attention of type A with the fixture sizes (`heads` overridable).
template <class A>
A make_attention(index_t heads = kH) {
  if constexpr (is_latte<A>) {
    LatteDims dims = kLatteDims;
    dims.heads = heads;
    return A(dims);
  } else {
    SoftmaxDims dims = kSoftmaxDims;
    dims.heads = heads;
    if constexpr (std::is_same_v<typename A::window_type, SlidingWindow>) {
      return A(dims, SlidingWindow{.left = 2, .right = A::direction::is_causal ? 0 : 1});
    } else {
      return A(dims);
    }
  }
}

/// L for Latte, Dk for softmax attention.
template <class A>
constexpr index_t qk_dim() {
  return is_latte<A> ? kL : kDk;
}

/// Argument names of the four forward tensors.
template <class A>
constexpr std::string_view arg_name(int which) {
  constexpr std::string_view latte_names[] = {"query_logits", "key_logits", "values", "out"};
  constexpr std::string_view softmax_names[] = {"queries", "keys", "values", "out"};
  return is_latte<A> ? latte_names[which] : softmax_names[which];
}

enum Which { kQuery = 0, kKey = 1, kValues = 2, kOut = 3 };
enum Dim { kBatchDim = 0, kTimeDim = 1, kHeadDim = 2, kFeatureDim = 3 };

/// Valid [B, T, H, *] forward inputs for A, plus the output.
struct Inputs {
  Tensor<float, 4> q, k, v, out;

  template <class A>
  static Inputs make(index_t batch = kB, index_t time = kT, std::uint64_t seed = 7) {
    Rng rng(seed);
    Inputs in;
    in.q = random_tensor<float, 4>(rng, {batch, time, kH, qk_dim<A>()}, 1.0);
    in.k = random_tensor<float, 4>(rng, {batch, time, kH, qk_dim<A>()}, 1.0);
    in.v = uniform_tensor<float, 4>(rng, {batch, time, kH, kDv}, -1, 1);
    in.out = Tensor<float, 4>({batch, time, kH, kDv});
    return in;
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

/// Valid [B, H, *] step inputs for A, plus the output.
struct StepInputs {
  Tensor<float, 3> q, k, v, out;

  template <class A>
  static StepInputs make(index_t batch = kB, std::uint64_t seed = 11) {
    Rng rng(seed);
    StepInputs in;
    in.q = random_tensor<float, 3>(rng, {batch, kH, qk_dim<A>()}, 1.0);
    in.k = random_tensor<float, 3>(rng, {batch, kH, qk_dim<A>()}, 1.0);
    in.v = uniform_tensor<float, 3>(rng, {batch, kH, kDv}, -1, 1);
    in.out = Tensor<float, 3>({batch, kH, kDv});
    return in;
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

/// Forward with tensor `which` replaced by one whose extent `dim` is off by `delta`.
template <class A>
void expect_forward_extent_error(int which, int dim, index_t delta) {
  const A attention = make_attention<A>();
  Inputs in = Inputs::make<A>();
  REQUIRE_NOTHROW(in.forward(attention));
  auto extents = in[which].extents();
  extents[static_cast<std::size_t>(dim)] += delta;
  in[which] = Tensor<float, 4>(extents, 0.25f);
  expect_error([&] { in.forward(attention); }, arg_name<A>(which), "expected");
}

/// Step with tensor `which` replaced by one whose extent `dim` is off by `delta`.
template <class A>
void expect_step_extent_error(int which, int dim, index_t delta) {
  const A attention = make_attention<A>();
  auto state = attention.template make_state<float>(kB, kT);
  StepInputs in = StepInputs::make<A>();
  REQUIRE_NOTHROW(in.step(attention, state));
  const auto position = state.position();
  auto extents = in[which].extents();
  extents[static_cast<std::size_t>(dim)] += delta;
  in[which] = Tensor<float, 3>(extents, 0.25f);
  expect_error([&] { in.step(attention, state); }, arg_name<A>(which), "expected");
  CHECK(state.position() == position);  // a rejected step does not advance the state
}

/// make_state with a capacity for softmax (ignored with SlidingWindow) and none for Latte.
template <class A>
auto make_state(const A& attention, index_t batch, index_t capacity = 4 * kT) {
  if constexpr (is_latte<A>) {
    (void)capacity;
    return attention.template make_state<float>(batch);
  } else {
    return attention.template make_state<float>(batch, capacity);
  }
}

/// Overwrites the int64 at `offset` and re-signs the bytes, so the loaders'
/// own checks (not the checksum) see the edited value.
void patch_int64(std::vector<std::byte>& bytes, std::size_t offset, std::int64_t value) {
  REQUIRE(offset + sizeof value <= bytes.size());
  std::memcpy(bytes.data() + offset, &value, sizeof value);
  resign(bytes);
}

const std::vector<std::string> kLatteSizeNames{"batch", "heads", "latents", "value_dim"};
const std::vector<std::string> kCacheSizeNames{"batch", "heads", "key_dim", "value_dim",
                                               "capacity"};

/// Offset of the value of saved size `index` (StateStorage's layout: magic,
/// kind, size count, then (name, value) pairs, then the position).
std::size_t size_value_offset(const std::string& kind, const std::vector<std::string>& names,
                              std::size_t index) {
  std::size_t offset = 8 + 8 + kind.size() + 8;
  for (std::size_t i = 0; i < index; ++i) offset += 8 + names[i].size() + 8;
  return offset + 8 + names[index].size();
}
/// Offset of the saved position.
std::size_t position_offset(const std::string& kind, const std::vector<std::string>& names) {
  return size_value_offset(kind, names, names.size() - 1) + 8;
}

// ------------------------------------------------ forward: extent mismatch --

TEST_CASE_TEMPLATE("forward: key tensor with another batch size B", A, ALL_TYPES) {
  expect_forward_extent_error<A>(kKey, kBatchDim, +1);
}
TEST_CASE_TEMPLATE("forward: values with another batch size B", A, ALL_TYPES) {
  expect_forward_extent_error<A>(kValues, kBatchDim, -1);
}
TEST_CASE_TEMPLATE("forward: out with another batch size B", A, ALL_TYPES) {
  expect_forward_extent_error<A>(kOut, kBatchDim, +1);
}
TEST_CASE_TEMPLATE("forward: values with another sequence length T", A, ALL_TYPES) {
  expect_forward_extent_error<A>(kValues, kTimeDim, -1);
}
TEST_CASE_TEMPLATE("forward: key tensor with another sequence length T", A, ALL_TYPES) {
  expect_forward_extent_error<A>(kKey, kTimeDim, +1);
}
TEST_CASE_TEMPLATE("forward: out with another sequence length T", A, ALL_TYPES) {
  expect_forward_extent_error<A>(kOut, kTimeDim, +1);
}
TEST_CASE_TEMPLATE("forward: query tensor with another head count H", A, ALL_TYPES) {
  expect_forward_extent_error<A>(kQuery, kHeadDim, +1);
}
TEST_CASE_TEMPLATE("forward: key tensor with another head count H", A, ALL_TYPES) {
  expect_forward_extent_error<A>(kKey, kHeadDim, -1);
}
TEST_CASE_TEMPLATE("forward: values with another head count H", A, ALL_TYPES) {
  expect_forward_extent_error<A>(kValues, kHeadDim, +1);
}
TEST_CASE_TEMPLATE("forward: out with another head count H", A, ALL_TYPES) {
  expect_forward_extent_error<A>(kOut, kHeadDim, -1);
}
TEST_CASE_TEMPLATE("forward: query tensor with another feature size (L or Dk)", A, ALL_TYPES) {
  expect_forward_extent_error<A>(kQuery, kFeatureDim, +1);
}
TEST_CASE_TEMPLATE("forward: key tensor with another feature size (L or Dk)", A, ALL_TYPES) {
  expect_forward_extent_error<A>(kKey, kFeatureDim, -1);
}
TEST_CASE_TEMPLATE("forward: values with another value size Dv", A, ALL_TYPES) {
  expect_forward_extent_error<A>(kValues, kFeatureDim, +1);
}
TEST_CASE_TEMPLATE("forward: out with another value size Dv", A, ALL_TYPES) {
  expect_forward_extent_error<A>(kOut, kFeatureDim, -1);
}

TEST_CASE_TEMPLATE("forward: the message names the layout and both extents", A, ALL_TYPES) {
  const A attention = make_attention<A>();
  Inputs in = Inputs::make<A>();
  REQUIRE_NOTHROW(in.forward(attention));
  in.v = Tensor<float, 4>({kB, kT - 1, kH, kDv});
  const std::string expected = format_extents<4>({kB, kT, kH, kDv});
  const std::string given = format_extents<4>({kB, kT - 1, kH, kDv});
  expect_error([&] { in.forward(attention); }, "values", "[B, T, H, Dv]");
  expect_error([&] { in.forward(attention); }, "values", "expected " + expected);
  expect_error([&] { in.forward(attention); }, "values", "given " + given);
}

// -------------------------------------------------------------- zero sizes --

TEST_CASE_TEMPLATE("forward: T = 0 is a no-op and leaves out untouched", A, ALL_TYPES) {
  const A attention = make_attention<A>();
  Inputs in = Inputs::make<A>(kB, 0);
  std::vector<float> sentinel(64, 42.0f);
  const TensorView<float, 4> out(sentinel.data(), {kB, 0, kH, kDv});
  CHECK_NOTHROW(attention.forward(exec::reference, in.q.cview(), in.k.cview(), in.v.cview(), out));
  CHECK(std::all_of(sentinel.begin(), sentinel.end(), [](float x) { return x == 42.0f; }));
}

TEST_CASE_TEMPLATE("forward: B = 0 is a no-op and leaves out untouched", A, ALL_TYPES) {
  const A attention = make_attention<A>();
  Inputs in = Inputs::make<A>(0, kT);
  std::vector<float> sentinel(64, 42.0f);
  const TensorView<float, 4> out(sentinel.data(), {0, kT, kH, kDv});
  CHECK_NOTHROW(attention.forward(exec::reference, in.q.cview(), in.k.cview(), in.v.cview(), out));
  CHECK(std::all_of(sentinel.begin(), sentinel.end(), [](float x) { return x == 42.0f; }));
}

TEST_CASE_TEMPLATE("forward: T = 0 still checks the other extents", A, ALL_TYPES) {
  const A attention = make_attention<A>();
  Inputs in = Inputs::make<A>(kB, 0);
  REQUIRE_NOTHROW(in.forward(attention));
  in.k = Tensor<float, 4>({kB, 0, kH, qk_dim<A>() + 1});
  expect_error([&] { in.forward(attention); }, arg_name<A>(kKey));
}

TEST_CASE_TEMPLATE("forward with state: T = 0 leaves the state unchanged", A, CAUSAL_TYPES) {
  const A attention = make_attention<A>();
  auto state = make_state(attention, kB);
  Inputs prefix = Inputs::make<A>(kB, 3);
  prefix.forward(attention, state);
  const auto saved = state.save();
  Inputs empty = Inputs::make<A>(kB, 0);
  CHECK_NOTHROW(empty.forward(attention, state));
  CHECK(state.position() == 3);
  CHECK(state.save() == saved);
}

TEST_CASE_TEMPLATE("LatteAttention: dims.heads = 0", A, LATTE_TYPES) {
  CHECK_NOTHROW((void)A(kLatteDims));
  expect_error([] { A({.heads = 0, .latents = kL, .value_dim = kDv}); }, "dims.heads");
  expect_error([] { A({.heads = -2, .latents = kL, .value_dim = kDv}); }, "dims.heads");
}
TEST_CASE_TEMPLATE("LatteAttention: dims.latents = 0", A, LATTE_TYPES) {
  CHECK_NOTHROW((void)A(kLatteDims));
  expect_error([] { A({.heads = kH, .latents = 0, .value_dim = kDv}); }, "dims.latents");
  expect_error([] { A({.heads = kH, .latents = -1, .value_dim = kDv}); }, "dims.latents");
}
TEST_CASE_TEMPLATE("LatteAttention: dims.value_dim = 0", A, LATTE_TYPES) {
  CHECK_NOTHROW((void)A(kLatteDims));
  expect_error([] { A({.heads = kH, .latents = kL, .value_dim = 0}); }, "dims.value_dim");
  expect_error([] { A({.heads = kH, .latents = kL, .value_dim = -4}); }, "dims.value_dim");
}
TEST_CASE("LatteAttention: default-constructed dims name dims.heads first") {
  expect_error([] { CausalLatte(LatteDims{}); }, "dims.heads");
}
TEST_CASE_TEMPLATE("SoftmaxAttention: dims.heads = 0", A, SOFTMAX_TYPES) {
  CHECK_NOTHROW(make_attention<A>());
  expect_error([] { make_attention<A>(0); }, "dims.heads");
}
TEST_CASE("SoftmaxAttention: dims.key_dim = 0") {
  CHECK_NOTHROW((void)CausalSoftmax(kSoftmaxDims));
  expect_error([] { CausalSoftmax({.heads = kH, .key_dim = 0, .value_dim = kDv}); },
               "dims.key_dim");
  expect_error([] { WindowedSoftmax({.heads = kH, .key_dim = 0, .value_dim = kDv}); },
               "dims.key_dim");
}
TEST_CASE("SoftmaxAttention: dims.value_dim = 0") {
  expect_error([] { CausalSoftmax({.heads = kH, .key_dim = kDk, .value_dim = 0}); },
               "dims.value_dim");
  expect_error([] { WindowedSoftmax({.heads = kH, .key_dim = kDk, .value_dim = 0}); },
               "dims.value_dim");
}

// ------------------------------------------------------------------ window --

TEST_CASE("SlidingWindow: negative left") {
  CHECK_NOTHROW(WindowedSoftmax(kSoftmaxDims, SlidingWindow{.left = 0, .right = 0}));
  expect_error([] { WindowedSoftmax(kSoftmaxDims, SlidingWindow{.left = -1, .right = 1}); },
               "window.left");
  expect_error([] { CausalWindowedSoftmax(kSoftmaxDims, SlidingWindow{.left = -3, .right = 0}); },
               "window.left");
}
TEST_CASE("SlidingWindow: negative right") {
  CHECK_NOTHROW(WindowedSoftmax(kSoftmaxDims, SlidingWindow{.left = 1, .right = 3}));
  expect_error([] { WindowedSoftmax(kSoftmaxDims, SlidingWindow{.left = 1, .right = -1}); },
               "window.right");
}
TEST_CASE("SlidingWindow: Causal with right > 0") {
  CHECK_NOTHROW(CausalWindowedSoftmax(kSoftmaxDims, SlidingWindow{.left = 2, .right = 0}));
  expect_error([] { CausalWindowedSoftmax(kSoftmaxDims, SlidingWindow{.left = 2, .right = 1}); },
               "window.right");
}
TEST_CASE("SoftmaxAttention: non-finite scale") {
  CHECK_NOTHROW(CausalSoftmax(kSoftmaxDims, {}, 0.5));
  expect_error([] { CausalSoftmax(kSoftmaxDims, {}, std::numeric_limits<double>::infinity()); },
               "scale");
  expect_error([] { CausalSoftmax(kSoftmaxDims, {}, std::numeric_limits<double>::quiet_NaN()); },
               "scale");
}

// ------------------------------------------------------------ VAPOR angles --

#define VAPOR_TYPES VaporLatte, BidirectionalVaporLatte

VAPOR::Params vapor_angles(index_t heads, index_t pairs, double fill = 0.25) {
  VAPOR::Params params;
  params.angles = Tensor<double, 2>({heads, pairs}, fill);
  return params;
}

TEST_CASE_TEMPLATE("VAPOR: angles with one pair too many [H, Dv/2 + 1]", A, VAPOR_TYPES) {
  CHECK_NOTHROW(A(kLatteDims, vapor_angles(kH, kDv / 2)));
  expect_error([] { A(kLatteDims, vapor_angles(kH, kDv / 2 + 1)); }, "angles", "[H, Dv/2]");
}
TEST_CASE_TEMPLATE("VAPOR: angles with one head too many [H + 1, Dv/2]", A, VAPOR_TYPES) {
  CHECK_NOTHROW(A(kLatteDims, vapor_angles(kH, kDv / 2)));
  expect_error([] { A(kLatteDims, vapor_angles(kH + 1, kDv / 2)); }, "angles", "expected");
}
TEST_CASE_TEMPLATE("VAPOR: angles for an odd Dv use Dv/2 pairs (rounded down)", A, VAPOR_TYPES) {
  const LatteDims odd{.heads = kH, .latents = kL, .value_dim = 7};
  CHECK_NOTHROW(A(odd, vapor_angles(kH, 3)));
  expect_error([&] { A(odd, vapor_angles(kH, 4)); }, "angles");
}
TEST_CASE_TEMPLATE("VAPOR: a NaN angle", A, VAPOR_TYPES) {
  auto params = vapor_angles(kH, kDv / 2);
  CHECK_NOTHROW(A(kLatteDims, params));
  params.angles(kH - 1, 1) = std::numeric_limits<double>::quiet_NaN();
  expect_error([&] { A(kLatteDims, params); }, "angles", "finite");
}
TEST_CASE_TEMPLATE("VAPOR: an infinite angle", A, VAPOR_TYPES) {
  auto params = vapor_angles(kH, kDv / 2);
  params.angles(0, 0) = -std::numeric_limits<double>::infinity();
  expect_error([&] { A(kLatteDims, params); }, "angles", "finite");
}
TEST_CASE_TEMPLATE("VAPOR: a RoPE base <= 1", A, VAPOR_TYPES) {
  VAPOR::Params params;
  params.base = 2.0;
  CHECK_NOTHROW(A(kLatteDims, params));
  params.base = 1.0;
  expect_error([&] { A(kLatteDims, params); }, "base");
  params.base = std::numeric_limits<double>::quiet_NaN();
  expect_error([&] { A(kLatteDims, params); }, "base");
  params.base = std::numeric_limits<double>::infinity();  // theta would be 1, 0, 0, ...
  expect_error([&] { A(kLatteDims, params); }, "base", "finite");
}
TEST_CASE("VAPOR: params_from a float view of the wrong shape") {
  Tensor<float, 2> good({kH, kDv / 2}, 0.5f), bad({kH, kDv / 2 + 1}, 0.5f);
  CHECK_NOTHROW(VaporLatte(kLatteDims, VAPOR::params_from<float>(good.cview())));
  expect_error([&] { VaporLatte(kLatteDims, VAPOR::params_from<float>(bad.cview())); }, "angles");
}
TEST_CASE("VAPOR: params_from a view with feature stride != 1 or null data") {
  std::vector<float> buffer(static_cast<std::size_t>(kH * kDv), 0.5f);
  const TensorView<const float, 2> contiguous(buffer.data(), {kH, kDv / 2});
  CHECK_NOTHROW(VAPOR::params_from<float>(contiguous));
  const TensorView<const float, 2> strided(buffer.data(), {kH, kDv / 2}, {kDv, 2});
  expect_error([&] { (void)VAPOR::params_from<float>(strided); }, "angles", "stride");
  const TensorView<const float, 2> null(nullptr, {kH, kDv / 2});
  expect_error([&] { (void)VAPOR::params_from<float>(null); }, "angles", "null");
}

// ---------------------------------------------------------------- aliasing --

TEST_CASE_TEMPLATE("forward: out is the values buffer", A, ALL_TYPES) {
  const A attention = make_attention<A>();
  Inputs in = Inputs::make<A>();
  REQUIRE_NOTHROW(in.forward(attention));
  const TensorView<float, 4> out(in.v.data(), in.v.extents());
  expect_error(
      [&] { attention.forward(exec::reference, in.q.cview(), in.k.cview(), in.v.cview(), out); },
      "out", "aliases input 'values'");
}

TEST_CASE_TEMPLATE("forward: out overlaps the tail of values", A, ALL_TYPES) {
  const A attention = make_attention<A>();
  Inputs in = Inputs::make<A>();
  const index_t n = in.v.size();
  std::vector<float> buffer(static_cast<std::size_t>(2 * n), 0.5f);
  const TensorView<const float, 4> values(buffer.data(), in.v.extents());
  // Right after values: no overlap, valid.
  const TensorView<float, 4> after(buffer.data() + n, in.v.extents());
  REQUIRE_NOTHROW(attention.forward(exec::reference, in.q.cview(), in.k.cview(), values, after));
  const TensorView<float, 4> overlapping(buffer.data() + n - 1, in.v.extents());
  expect_error(
      [&] { attention.forward(exec::reference, in.q.cview(), in.k.cview(), values, overlapping); },
      "out", "aliases input 'values'");
}

TEST_CASE_TEMPLATE("forward: out overlaps the query tensor", A, ALL_TYPES) {
  const A attention = make_attention<A>();
  Inputs in = Inputs::make<A>();
  const index_t nq = in.q.size(), nout = in.out.size();
  std::vector<float> buffer(static_cast<std::size_t>(nq + nout), 0.5f);
  const TensorView<const float, 4> queries(buffer.data(), in.q.extents());
  const TensorView<float, 4> after(buffer.data() + nq, in.out.extents());
  REQUIRE_NOTHROW(attention.forward(exec::reference, queries, in.k.cview(), in.v.cview(), after));
  const TensorView<float, 4> overlapping(buffer.data() + nq / 2, in.out.extents());
  expect_error(
      [&] { attention.forward(exec::reference, queries, in.k.cview(), in.v.cview(), overlapping); },
      "out", "aliases input '" + std::string(arg_name<A>(kQuery)) + "'");
}

TEST_CASE_TEMPLATE("forward: out starts at the key tensor", A, ALL_TYPES) {
  const A attention = make_attention<A>();
  Inputs in = Inputs::make<A>();
  std::vector<float> buffer(static_cast<std::size_t>(in.k.size() + in.out.size()), 0.5f);
  const TensorView<const float, 4> keys(buffer.data(), in.k.extents());
  const TensorView<float, 4> after(buffer.data() + in.k.size(), in.out.extents());
  REQUIRE_NOTHROW(attention.forward(exec::reference, in.q.cview(), keys, in.v.cview(), after));
  const TensorView<float, 4> same_start(buffer.data(), in.out.extents());
  expect_error(
      [&] { attention.forward(exec::reference, in.q.cview(), keys, in.v.cview(), same_start); },
      "out", "aliases input '" + std::string(arg_name<A>(kKey)) + "'");
}

TEST_CASE_TEMPLATE("forward: out interleaved with values, sharing no element, is accepted",
                   A, ALL_TYPES) {
  // Each (b, t, h) row of values is followed by the row of out at the same
  // index: the byte ranges overlap, no element is shared. One element further
  // back, every out row shares its first element with a values row.
  const A attention = make_attention<A>();
  Inputs in = Inputs::make<A>();
  in.forward(attention);  // separate buffers: what the interleaved call must give
  const auto extents = in.v.extents();
  const std::array<index_t, 4> strides{kT * kH * 2 * kDv, kH * 2 * kDv, 2 * kDv, 1};
  std::vector<float> buffer(static_cast<std::size_t>(2 * in.v.size()), 0.f);
  for (index_t b = 0; b < kB; ++b)
    for (index_t t = 0; t < kT; ++t)
      for (index_t h = 0; h < kH; ++h)
        for (index_t d = 0; d < kDv; ++d)
          buffer[static_cast<std::size_t>(b * strides[0] + t * strides[1] + h * strides[2] + d)] =
              in.v(b, t, h, d);
  const TensorView<const float, 4> values(buffer.data(), extents, strides);
  const TensorView<float, 4> between(buffer.data() + kDv, extents, strides);
  REQUIRE_NOTHROW(
      attention.forward(exec::reference, in.q.cview(), in.k.cview(), values, between));
  bool same = true;
  for (index_t b = 0; b < kB; ++b)
    for (index_t t = 0; t < kT; ++t)
      for (index_t h = 0; h < kH; ++h)
        for (index_t d = 0; d < kDv; ++d) same = same && between(b, t, h, d) == in.out(b, t, h, d);
  CHECK(same);
  const TensorView<float, 4> sharing(buffer.data() + kDv - 1, extents, strides);
  expect_error(
      [&] { attention.forward(exec::reference, in.q.cview(), in.k.cview(), values, sharing); },
      "out", "aliases input 'values'");
  // One-element outputs: the last element of each values row, then the element after it.
  const TensorView<float, 4> last_of_row(buffer.data() + kDv - 1, {kB, kT, kH, 1}, strides);
  const TensorView<float, 4> after_row(buffer.data() + kDv, {kB, kT, kH, 1}, strides);
  CHECK(detail::shares_element(last_of_row, values));
  CHECK_FALSE(detail::shares_element(after_row, values));
  CHECK_FALSE(detail::shares_element(between, values));
}

TEST_CASE_TEMPLATE("step: out is the values buffer", A, CAUSAL_TYPES) {
  const A attention = make_attention<A>();
  auto state = make_state(attention, kB);
  StepInputs in = StepInputs::make<A>();
  REQUIRE_NOTHROW(in.step(attention, state));
  const TensorView<float, 3> out(in.v.data(), in.v.extents());
  expect_error(
      [&] {
        attention.step(exec::reference, state, in.q.cview(), in.k.cview(), in.v.cview(), out);
      },
      "out", "aliases input 'values'");
  CHECK(state.position() == 1);
}

TEST_CASE_TEMPLATE("step: out overlaps the query tensor", A, CAUSAL_TYPES) {
  const A attention = make_attention<A>();
  auto state = make_state(attention, kB);
  StepInputs in = StepInputs::make<A>();
  std::vector<float> buffer(static_cast<std::size_t>(in.q.size() + in.out.size()), 0.5f);
  const TensorView<const float, 3> queries(buffer.data(), in.q.extents());
  const TensorView<float, 3> after(buffer.data() + in.q.size(), in.out.extents());
  REQUIRE_NOTHROW(
      attention.step(exec::reference, state, queries, in.k.cview(), in.v.cview(), after));
  const TensorView<float, 3> overlapping(buffer.data() + 1, in.out.extents());
  expect_error(
      [&] {
        attention.step(exec::reference, state, queries, in.k.cview(), in.v.cview(), overlapping);
      },
      "out", "aliases input");
}

// ---------------------------------------------------- structurally invalid --

TEST_CASE_TEMPLATE("forward: key tensor with feature stride 2", A, ALL_TYPES) {
  const A attention = make_attention<A>();
  Inputs in = Inputs::make<A>();
  const index_t D = qk_dim<A>();
  std::vector<float> buffer(static_cast<std::size_t>(kB * kT * kH * 2 * D), 0.5f);
  const TensorView<const float, 4> dense(buffer.data(), {kB, kT, kH, D},
                                         {kT * kH * 2 * D, kH * 2 * D, 2 * D, 1});
  REQUIRE_NOTHROW(
      attention.forward(exec::reference, in.q.cview(), dense, in.v.cview(), in.out.view()));
  const TensorView<const float, 4> strided(buffer.data(), {kB, kT, kH, D},
                                           {kT * kH * 2 * D, kH * 2 * D, 2 * D, 2});
  expect_error(
      [&] {
        attention.forward(exec::reference, in.q.cview(), strided, in.v.cview(), in.out.view());
      },
      arg_name<A>(kKey), "stride of the feature (last) dimension: expected 1, given 2");
}

TEST_CASE_TEMPLATE("forward: out with feature stride 2", A, ALL_TYPES) {
  const A attention = make_attention<A>();
  Inputs in = Inputs::make<A>();
  std::vector<float> buffer(static_cast<std::size_t>(2 * in.out.size()), 0.5f);
  const TensorView<float, 4> strided(buffer.data(), in.out.extents(),
                                     {kT * kH * 2 * kDv, kH * 2 * kDv, 2 * kDv, 2});
  expect_error(
      [&] {
        attention.forward(exec::reference, in.q.cview(), in.k.cview(), in.v.cview(), strided);
      },
      "out", "stride");
}

TEST_CASE_TEMPLATE("forward: values with null data and nonzero size", A, ALL_TYPES) {
  const A attention = make_attention<A>();
  Inputs in = Inputs::make<A>();
  REQUIRE_NOTHROW(in.forward(attention));
  const TensorView<const float, 4> null(nullptr, in.v.extents());
  expect_error(
      [&] { attention.forward(exec::reference, in.q.cview(), in.k.cview(), null, in.out.view()); },
      "values", "null");
}

TEST_CASE_TEMPLATE("forward: query tensor with null data and nonzero size", A, ALL_TYPES) {
  const A attention = make_attention<A>();
  Inputs in = Inputs::make<A>();
  const TensorView<const float, 4> null(nullptr, in.q.extents());
  expect_error(
      [&] { attention.forward(exec::reference, null, in.k.cview(), in.v.cview(), in.out.view()); },
      arg_name<A>(kQuery), "null");
}

TEST_CASE_TEMPLATE("forward: out with null data and nonzero size", A, ALL_TYPES) {
  const A attention = make_attention<A>();
  Inputs in = Inputs::make<A>();
  const TensorView<float, 4> null(nullptr, in.out.extents());
  expect_error(
      [&] { attention.forward(exec::reference, in.q.cview(), in.k.cview(), in.v.cview(), null); },
      "out", "null");
}

TEST_CASE_TEMPLATE("forward: query tensor with a negative stride", A, ALL_TYPES) {
  const A attention = make_attention<A>();
  Inputs in = Inputs::make<A>();
  const index_t D = qk_dim<A>();
  // Time reversed through a negative stride, starting at the last step.
  const TensorView<const float, 4> reversed(in.q.data() + (kT - 1) * kH * D, in.q.extents(),
                                            {kT * kH * D, -kH * D, D, 1});
  expect_error(
      [&] {
        attention.forward(exec::reference, reversed, in.k.cview(), in.v.cview(), in.out.view());
      },
      arg_name<A>(kQuery), "strides must be non-negative");
}

TEST_CASE_TEMPLATE("forward: values with a negative extent", A, ALL_TYPES) {
  const A attention = make_attention<A>();
  Inputs in = Inputs::make<A>();
  const TensorView<const float, 4> negative(in.v.data(), {kB, kT, kH, -kDv},
                                            {kT * kH * kDv, kH * kDv, kDv, 1});
  expect_error(
      [&] {
        attention.forward(exec::reference, in.q.cview(), in.k.cview(), negative, in.out.view());
      },
      "values", "non-negative");
}

// ------------------------------------------------------------ Latte decode --

TEST_CASE_TEMPLATE("step: inputs of another batch size than the state", A, CAUSAL_TYPES) {
  const A attention = make_attention<A>();
  auto state = make_state(attention, kB + 1);
  StepInputs good = StepInputs::make<A>(kB + 1);
  REQUIRE_NOTHROW(good.step(attention, state));
  StepInputs in = StepInputs::make<A>(kB);
  // The state fixes B for step; the first input of another batch is reported.
  expect_error_naming_one_of([&] { in.step(attention, state); }, {"state", arg_name<A>(kQuery)});
  CHECK(state.position() == 1);
}

TEST_CASE_TEMPLATE("forward with state: a state of another batch size", A, CAUSAL_TYPES) {
  const A attention = make_attention<A>();
  Inputs in = Inputs::make<A>(kB, kT);
  auto good = make_state(attention, kB);
  REQUIRE_NOTHROW(in.forward(attention, good));
  auto state = make_state(attention, kB + 1);
  expect_error([&] { in.forward(attention, state); }, "state", "batch=");
  CHECK(state.position() == 0);
}

TEST_CASE("step: a LatteState of LatteAttention<Causal, NoStabilizer> in LatteAttention<Causal>") {
  const CausalLatte attention(kLatteDims);
  const UnstabilizedLatte other(kLatteDims);
  auto own = attention.make_state<float>(kB);
  StepInputs in = StepInputs::make<CausalLatte>();
  REQUIRE_NOTHROW(in.step(attention, own));
  auto foreign = other.make_state<float>(kB);
  expect_error([&] { in.step(attention, foreign); }, "state",
               "expected LatteAttention<causal,running_max,no_positional>/float32, given "
               "LatteAttention<causal,no_stabilizer,no_positional>/float32");
}

TEST_CASE("forward with state: a LatteState of another stabilizer") {
  const CausalLatte attention(kLatteDims);
  const UnstabilizedLatte other(kLatteDims);
  auto foreign = other.make_state<float>(kB);
  Inputs in = Inputs::make<CausalLatte>();
  expect_error([&] { in.forward(attention, foreign); }, "state", "state kind");
  CHECK(foreign.position() == 0);
}

TEST_CASE("step: a LatteState without VAPOR in a VAPOR attention") {
  const VaporLatte attention(kLatteDims);
  const CausalLatte other(kLatteDims);
  auto own = attention.make_state<float>(kB);
  StepInputs in = StepInputs::make<VaporLatte>();
  REQUIRE_NOTHROW(in.step(attention, own));
  auto foreign = other.make_state<float>(kB);
  expect_error([&] { in.step(attention, foreign); }, "state", "state kind");
}

TEST_CASE_TEMPLATE("step: a state of an attention with other dims", A, CAUSAL_TYPES) {
  const A attention = make_attention<A>();
  const A other = make_attention<A>(kH + 1);
  auto state = make_state(other, kB);
  StepInputs in = StepInputs::make<A>();
  expect_error([&] { in.step(attention, state); }, "state", "expected");
}

TEST_CASE_TEMPLATE("step: a default-constructed state", A, CAUSAL_TYPES) {
  const A attention = make_attention<A>();
  typename A::template State<float> state;
  StepInputs in = StepInputs::make<A>();
  expect_error([&] { in.step(attention, state); }, "state", "<empty state>");
}

TEST_CASE_TEMPLATE("step: query tensor with another feature size", A, CAUSAL_TYPES) {
  expect_step_extent_error<A>(kQuery, 2, +1);
}
TEST_CASE_TEMPLATE("step: key tensor with another head count", A, CAUSAL_TYPES) {
  expect_step_extent_error<A>(kKey, 1, +1);
}
TEST_CASE_TEMPLATE("step: values with another value size", A, CAUSAL_TYPES) {
  expect_step_extent_error<A>(kValues, 2, -1);
}
TEST_CASE_TEMPLATE("step: out with another value size", A, CAUSAL_TYPES) {
  expect_step_extent_error<A>(kOut, 2, +1);
}
TEST_CASE_TEMPLATE("step: out with another batch size", A, CAUSAL_TYPES) {
  expect_step_extent_error<A>(kOut, 0, -1);
}

TEST_CASE_TEMPLATE("step: values with null data", A, CAUSAL_TYPES) {
  const A attention = make_attention<A>();
  auto state = make_state(attention, kB);
  StepInputs in = StepInputs::make<A>();
  REQUIRE_NOTHROW(in.step(attention, state));
  const TensorView<const float, 3> null(nullptr, in.v.extents());
  expect_error(
      [&] {
        attention.step(exec::reference, state, in.q.cview(), in.k.cview(), null, in.out.view());
      },
      "values", "null");
}

TEST_CASE_TEMPLATE("make_state: batch 0", A, CAUSAL_TYPES) {
  const A attention = make_attention<A>();
  CHECK_NOTHROW((void)make_state(attention, 1));
  expect_error([&] { (void)make_state(attention, 0); }, "batch");
  expect_error([&] { (void)make_state(attention, -1); }, "batch");
}

TEST_CASE_TEMPLATE("make_state: negative first position", A, CAUSAL_LATTE_TYPES) {
  const A attention = make_attention<A>();
  CHECK_NOTHROW((void)attention.template make_state<float>(kB, 1000));
  expect_error([&] { (void)attention.template make_state<float>(kB, -1); }, "first_position");
}

/// A state of attention A (batch kB) that has absorbed a few tokens, as bytes.
template <class A>
std::vector<std::byte> saved_state(const A& attention, index_t batch = kB) {
  auto state = attention.template make_state<float>(batch);
  Inputs in = Inputs::make<A>(batch, 3);
  in.forward(attention, state);
  return state.save();
}

TEST_CASE_TEMPLATE("load_state: every truncation of valid bytes", A, CAUSAL_LATTE_TYPES) {
  const A attention = make_attention<A>();
  const auto bytes = saved_state(attention);
  REQUIRE_NOTHROW((void)attention.template load_state<float>(bytes));
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    CAPTURE(n);
    expect_error(
        [&] {
          (void)attention.template load_state<float>({bytes.data(), n});
        },
        "bytes", "");
  }
}

TEST_CASE_TEMPLATE("load_state: one trailing byte", A, CAUSAL_LATTE_TYPES) {
  const A attention = make_attention<A>();
  auto bytes = saved_state(attention);
  auto appended = bytes;
  appended.push_back(std::byte{0});
  expect_error([&] { (void)attention.template load_state<float>(appended); }, "bytes", "CRC-32C");
  // Before the checksum and signed: the data is one byte longer than announced.
  bytes.insert(bytes.end() - 4, std::byte{0});
  resign(bytes);
  expect_error([&] { (void)attention.template load_state<float>(bytes); }, "bytes",
               "state data bytes");
}

TEST_CASE("load_state: bytes of LatteAttention<Causal, NoStabilizer>") {
  const CausalLatte attention(kLatteDims);
  const auto bytes = saved_state(UnstabilizedLatte(kLatteDims));
  REQUIRE_NOTHROW((void)UnstabilizedLatte(kLatteDims).load_state<float>(bytes));
  expect_error([&] { (void)attention.load_state<float>(bytes); }, "bytes", "state kind");
}

TEST_CASE("load_state: float32 bytes loaded as float64") {
  const CausalLatte attention(kLatteDims);
  const auto bytes = saved_state(attention);
  expect_error([&] { (void)attention.load_state<double>(bytes); }, "bytes", "float64");
}

TEST_CASE("load_state: bytes of a softmax KV cache") {
  const CausalLatte attention(kLatteDims);
  const CausalSoftmax softmax(kSoftmaxDims);
  const auto bytes = softmax.make_state<float>(kB, 8).save();
  expect_error([&] { (void)attention.load_state<float>(bytes); }, "bytes", "state kind");
}

TEST_CASE_TEMPLATE("load_state: garbage bytes", A, CAUSAL_LATTE_TYPES) {
  const A attention = make_attention<A>();
  const auto valid = saved_state(attention);
  Rng rng(99);
  std::vector<std::byte> garbage(valid.size());
  for (auto& byte : garbage) byte = static_cast<std::byte>(rng() & 0xff);
  expect_error([&] { (void)attention.template load_state<float>(garbage); }, "bytes", "magic");
  // A valid magic followed by garbage.
  std::memcpy(garbage.data(), valid.data(), 8);
  expect_error([&] { (void)attention.template load_state<float>(garbage); }, "bytes", "");
}

TEST_CASE("load_state: bytes of an attention with other dims") {
  const CausalLatte attention(kLatteDims);
  const CausalLatte other({.heads = kH, .latents = kL + 1, .value_dim = kDv});
  const auto bytes = other.make_state<float>(kB).save();
  REQUIRE_NOTHROW((void)other.load_state<float>(bytes));
  expect_error([&] { (void)attention.load_state<float>(bytes); }, "bytes", "latents=5");
}

TEST_CASE("restore: bytes of another batch size") {
  const CausalLatte attention(kLatteDims);
  const auto bytes = saved_state(attention, kB + 1);
  auto state = attention.make_state<float>(kB);
  REQUIRE_NOTHROW(state.restore(saved_state(attention, kB)));
  expect_error([&] { state.restore(bytes); }, "bytes", "batch=3");
}

// A corrupted batch field is a 'bytes' error found before anything is allocated.
TEST_CASE("load_state: a corrupted, huge batch field") {
  const CausalLatte attention(kLatteDims);
  auto bytes = saved_state(attention);
  patch_int64(bytes, size_value_offset(CausalLatte::kind<float>(), kLatteSizeNames, 0),
              std::int64_t{1} << 50);
  expect_error([&] { (void)attention.load_state<float>(bytes); }, "bytes", "");
}

// A saved position must be >= 0, as make_state requires of first_position.
TEST_CASE("load_state: a negative saved position") {
  const CausalLatte attention(kLatteDims);
  auto bytes = saved_state(attention);
  patch_int64(bytes, position_offset(CausalLatte::kind<float>(), kLatteSizeNames), -5);
  expect_error([&] { (void)attention.load_state<float>(bytes); }, "bytes", "position");
}

// restore is all-or-nothing: a rejected buffer leaves the state as it was.
TEST_CASE("restore: a rejected buffer leaves the state unchanged") {
  const CausalLatte attention(kLatteDims);
  auto state = attention.make_state<float>(kB);
  Inputs mine = Inputs::make<CausalLatte>(kB, 2, 1);
  mine.forward(attention, state);
  const auto before = state.save();

  auto other = attention.make_state<float>(kB);
  Inputs theirs = Inputs::make<CausalLatte>(kB, 4, 2);
  theirs.forward(attention, other);
  auto bytes = other.save();
  bytes.resize(bytes.size() - 8);  // cut the checksum and inside the last field (memory)

  expect_error([&] { state.restore(bytes); }, "bytes", "");
  CHECK(state.save() == before);
}

// ------------------------------------------------------ softmax KV cache --

TEST_CASE("KV cache without a window: a step past its capacity") {
  const CausalSoftmax attention(kSoftmaxDims);
  auto state = attention.make_state<float>(kB, 3);
  StepInputs in = StepInputs::make<CausalSoftmax>();
  for (int t = 0; t < 3; ++t) REQUIRE_NOTHROW(in.step(attention, state));
  expect_error([&] { in.step(attention, state); }, "state", "KV cache capacity");
  CHECK(state.position() == 3);
}

TEST_CASE("KV cache without a window: forward longer than its capacity") {
  const CausalSoftmax attention(kSoftmaxDims);
  auto state = attention.make_state<float>(kB, kT + 2);
  Inputs first = Inputs::make<CausalSoftmax>(kB, kT);
  REQUIRE_NOTHROW(first.forward(attention, state));
  Inputs second = Inputs::make<CausalSoftmax>(kB, 3);
  expect_error([&] { second.forward(attention, state); }, "state", "KV cache capacity");
  CHECK(state.position() == kT);  // nothing of the rejected call was absorbed
}

TEST_CASE("KV cache: make_state with capacity 0 or batch 0") {
  const CausalSoftmax attention(kSoftmaxDims);
  CHECK_NOTHROW((void)attention.make_state<float>(1, 1));
  expect_error([&] { (void)attention.make_state<float>(1); }, "capacity");
  expect_error([&] { (void)attention.make_state<float>(1, -4); }, "capacity");
  expect_error([&] { (void)attention.make_state<float>(0, 16); }, "batch");
  const CausalWindowedSoftmax windowed(kSoftmaxDims, SlidingWindow{.left = 3});
  CHECK_NOTHROW((void)windowed.make_state<float>(1));
  expect_error([&] { (void)windowed.make_state<float>(0); }, "batch");
}

TEST_CASE("KV cache: a cache of another window type") {
  const CausalWindowedSoftmax attention(kSoftmaxDims, SlidingWindow{.left = 3});
  const CausalSoftmax unwindowed(kSoftmaxDims);
  auto foreign = unwindowed.make_state<float>(kB, 4);  // as many slots as the window
  StepInputs in = StepInputs::make<CausalWindowedSoftmax>();
  expect_error([&] { in.step(attention, foreign); }, "state",
               "expected SoftmaxAttention<causal,sliding_window>/float32, given "
               "SoftmaxAttention<causal,full>/float32");
}

// A SlidingWindow cache must hold at least window.left + 1 tokens of this attention.
TEST_CASE("KV cache: a SlidingWindow cache made for a smaller window") {
  const CausalWindowedSoftmax small(kSoftmaxDims, SlidingWindow{.left = 2});
  const CausalWindowedSoftmax large(kSoftmaxDims, SlidingWindow{.left = 6});
  auto own = large.make_state<float>(kB);
  StepInputs in = StepInputs::make<CausalWindowedSoftmax>();
  REQUIRE_NOTHROW(in.step(large, own));
  auto foreign = small.make_state<float>(kB);
  expect_error([&] { in.step(large, foreign); }, "state", "");
}

/// A SlidingWindow{left = 7} cache (8 slots) that has absorbed a few tokens.
std::vector<std::byte> saved_cache(index_t tokens = 3, std::uint64_t seed = 7) {
  const CausalWindowedSoftmax attention(kSoftmaxDims, SlidingWindow{.left = 7});
  auto state = attention.make_state<float>(kB);
  Inputs in = Inputs::make<CausalWindowedSoftmax>(kB, tokens, seed);
  in.forward(attention, state);
  return state.save();
}

TEST_CASE("KV cache: restore of every truncation of valid bytes") {
  const CausalWindowedSoftmax attention(kSoftmaxDims, SlidingWindow{.left = 7});
  const auto bytes = saved_cache();
  auto target = attention.make_state<float>(kB);
  REQUIRE_NOTHROW(target.restore(bytes));
  CHECK(target.position() == 3);
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    CAPTURE(n);
    expect_error([&] { target.restore({bytes.data(), n}); }, "bytes", "");
  }
}

TEST_CASE("KV cache: restore into a cache of another capacity") {
  const CausalWindowedSoftmax attention(kSoftmaxDims, SlidingWindow{.left = 8});
  auto other = attention.make_state<float>(kB);  // 9 slots, same kind
  expect_error([&] { other.restore(saved_cache()); }, "bytes", "capacity=");
}

TEST_CASE("KV cache: restore into a cache of another batch size") {
  const CausalWindowedSoftmax attention(kSoftmaxDims, SlidingWindow{.left = 7});
  auto other = attention.make_state<float>(kB + 1);
  expect_error([&] { other.restore(saved_cache()); }, "bytes", "batch=");
}

TEST_CASE("KV cache: restore of bytes of another kind") {
  const CausalSoftmax unwindowed(kSoftmaxDims);
  auto other = unwindowed.make_state<float>(kB, 8);  // also 8 slots
  expect_error([&] { other.restore(saved_cache()); }, "bytes", "state kind");
  const CausalWindowedSoftmax attention(kSoftmaxDims, SlidingWindow{.left = 7});
  auto state = attention.make_state<float>(kB);
  expect_error([&] { state.restore(saved_state(CausalLatte(kLatteDims))); }, "bytes", "state kind");
}

TEST_CASE("KV cache: restore of garbage bytes") {
  const CausalWindowedSoftmax attention(kSoftmaxDims, SlidingWindow{.left = 7});
  auto state = attention.make_state<float>(kB);
  Rng rng(5);
  std::vector<std::byte> garbage(saved_cache().size());
  for (auto& byte : garbage) byte = static_cast<std::byte>(rng() & 0xff);
  expect_error([&] { state.restore(garbage); }, "bytes", "magic");
}

TEST_CASE("KV cache: restore of a negative saved position") {
  const CausalWindowedSoftmax attention(kSoftmaxDims, SlidingWindow{.left = 7});
  auto state = attention.make_state<float>(kB);
  auto bytes = saved_cache();
  REQUIRE_NOTHROW(state.restore(bytes));
  patch_int64(bytes, position_offset(CausalWindowedSoftmax::kind<float>(), kCacheSizeNames), -1);
  expect_error([&] { state.restore(bytes); }, "bytes", "position");
}

TEST_CASE("KV cache: load_state of every truncation of valid bytes") {
  const CausalWindowedSoftmax attention(kSoftmaxDims, SlidingWindow{.left = 7});
  const auto bytes = saved_cache();
  REQUIRE_NOTHROW((void)attention.load_state<float>(bytes));
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    CAPTURE(n);
    expect_error([&] { (void)attention.load_state<float>({bytes.data(), n}); }, "bytes", "");
  }
}

TEST_CASE("KV cache: load_state of bytes of another kind or garbage") {
  const CausalSoftmax attention(kSoftmaxDims);
  const auto windowed = saved_cache();
  expect_error([&] { (void)attention.load_state<float>(windowed); }, "bytes", "state kind");
  expect_error([&] { (void)attention.load_state<double>(windowed); }, "bytes", "state kind");
  expect_error([&] { (void)attention.load_state<float>(saved_state(CausalLatte(kLatteDims))); },
               "bytes", "state kind");
  Rng rng(17);
  std::vector<std::byte> garbage(windowed.size());
  for (auto& byte : garbage) byte = static_cast<std::byte>(rng() & 0xff);
  expect_error([&] { (void)attention.load_state<float>(garbage); }, "bytes", "magic");
}

TEST_CASE("KV cache: load_state of bytes of a smaller window") {
  // saved_cache() holds left + 1 = 8 tokens: enough for left = 4, not for left = 9.
  const CausalWindowedSoftmax smaller(kSoftmaxDims, SlidingWindow{.left = 4});
  CHECK_NOTHROW((void)smaller.load_state<float>(saved_cache()));
  const CausalWindowedSoftmax larger(kSoftmaxDims, SlidingWindow{.left = 9});
  expect_error([&] { (void)larger.load_state<float>(saved_cache()); }, "bytes", "capacity");
}

// A corrupted capacity field is a 'bytes' error found before anything is allocated.
TEST_CASE("KV cache: load_state with a corrupted, huge capacity field") {
  const CausalSoftmax attention(kSoftmaxDims);
  auto bytes = attention.make_state<float>(kB, 8).save();
  REQUIRE_NOTHROW((void)attention.load_state<float>(bytes));
  patch_int64(bytes, size_value_offset(CausalSoftmax::kind<float>(), kCacheSizeNames, 4),
              std::int64_t{1} << 50);
  expect_error([&] { (void)attention.load_state<float>(bytes); }, "bytes", "");
}

// KVCache::restore is all-or-nothing: a rejected buffer leaves the cache as it was.
TEST_CASE("KV cache: a rejected buffer leaves the cache unchanged") {
  const CausalWindowedSoftmax attention(kSoftmaxDims, SlidingWindow{.left = 7});
  auto state = attention.make_state<float>(kB);
  Inputs mine = Inputs::make<CausalWindowedSoftmax>(kB, 2, 1);
  mine.forward(attention, state);
  const auto before = state.save();
  auto bytes = saved_cache(5, 2);
  bytes.resize(bytes.size() - 8);  // cut the checksum and inside the last field (values)
  expect_error([&] { state.restore(bytes); }, "bytes", "");
  CHECK(state.save() == before);
}

}  // namespace

}  // namespace test_bad_input
#undef LATTE_TYPES
#undef CAUSAL_LATTE_TYPES
#undef SOFTMAX_TYPES
#undef ALL_TYPES
#undef CAUSAL_TYPES
#undef VAPOR_TYPES
