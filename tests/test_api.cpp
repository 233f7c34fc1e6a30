// The public API as users spell it: policy spellings and defaults, supports(),
// strided TensorViews (bit-identical to contiguous copies on the reference
// backend), Tensor -> TensorView conversions, Eigen interop and format_extents.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <new>
#include <ostream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "expect_error.hpp"
#include "support.hpp"

namespace test_api {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte::test;
using latte::index_t;

// ------------------------------------------------------ spelling, defaults --

static_assert(
    std::is_same_v<latte::LatteAttention<latte::Causal>,
                   latte::LatteAttention<latte::Causal, latte::RunningMax, latte::NoPositional>>);
static_assert(std::is_same_v<
              latte::LatteAttention<latte::Bidirectional>,
              latte::LatteAttention<latte::Bidirectional, latte::RunningMax, latte::NoPositional>>);
static_assert(std::is_same_v<latte::SoftmaxAttention<latte::Causal>,
                             latte::SoftmaxAttention<latte::Causal, latte::NoWindow>>);

using Vapor = latte::LatteAttention<latte::Causal, latte::RunningMax, latte::VAPOR>;
static_assert(std::is_same_v<Vapor::direction, latte::Causal>);
static_assert(std::is_same_v<Vapor::stabilizer, latte::RunningMax>);
static_assert(std::is_same_v<Vapor::positional, latte::VAPOR>);
static_assert(std::is_same_v<Vapor::State<float>, latte::LatteState<float>>);
static_assert(
    std::is_same_v<latte::SoftmaxAttention<latte::Causal>::State<double>, latte::KVCache<double>>);

static_assert(latte::Direction<latte::Causal> && latte::Direction<latte::Bidirectional>);
static_assert(latte::Stabilizer<latte::RunningMax> && latte::Stabilizer<latte::NoStabilizer>);
static_assert(latte::Positional<latte::NoPositional> && latte::Positional<latte::VAPOR>);
static_assert(latte::Window<latte::NoWindow> && latte::Window<latte::SlidingWindow>);
static_assert(!latte::Direction<latte::RunningMax>);
static_assert(latte::exec::Policy<latte::exec::reference_t>);
static_assert(!latte::exec::Policy<int>);

/// Only causal attention has a decode state.
template <class A>
concept HasDecode = requires(const A& attention) {
  attention.template make_state<float>(1);
};
static_assert(HasDecode<latte::LatteAttention<latte::Causal>>);
static_assert(!HasDecode<latte::LatteAttention<latte::Bidirectional>>);
static_assert(HasDecode<latte::SoftmaxAttention<latte::Causal, latte::SlidingWindow>>);
static_assert(!HasDecode<latte::SoftmaxAttention<latte::Bidirectional>>);

TEST_CASE("the documented spelling LatteAttention<Causal, RunningMax, VAPOR> builds and runs") {
  // The example of mechanisms/latte_attention.hpp, at a small T.
  latte::LatteAttention<latte::Causal, latte::RunningMax, latte::VAPOR> attn(
      {.heads = 8, .latents = 64, .value_dim = 64});
  CHECK(attn.dims().heads == 8);
  CHECK(attn.dims().latents == 64);
  CHECK(attn.dims().value_dim == 64);
  Rng rng(1);
  const auto q = random_tensor<float, 4>(rng, {1, 3, 8, 64}, 1.0);
  const auto k = random_tensor<float, 4>(rng, {1, 3, 8, 64}, 1.0);
  const auto v = random_tensor<float, 4>(rng, {1, 3, 8, 64}, 1.0);
  latte::Tensor<float, 4> out({1, 3, 8, 64}, std::nanf(""));
  attn.forward(latte::exec::reference, q, k, v, out.view());
  CHECK(all_finite(out));
  CHECK(attn.kind<float>() == "LatteAttention<causal,running_max,vapor>/float32");
  CHECK(latte::LatteAttention<latte::Causal>::kind<double>() ==
        "LatteAttention<causal,running_max,no_positional>/float64");
  CHECK(latte::SoftmaxAttention<latte::Bidirectional, latte::SlidingWindow>::kind<float>() ==
        "SoftmaxAttention<bidirectional,sliding_window>/float32");
  CHECK(latte::SoftmaxAttention<latte::Causal>::kind<float>() ==
        "SoftmaxAttention<causal,full>/float32");
}

TEST_CASE("defaults: softmax scale is 1/sqrt(Dk); windows default to zero; VAPOR base 10000") {
  const latte::SoftmaxAttention<latte::Causal> softmax({.heads = 2, .key_dim = 16, .value_dim = 3});
  CHECK(softmax.scale() == 1.0 / std::sqrt(16.0));
  const latte::SoftmaxAttention<latte::Causal> scaled({.heads = 2, .key_dim = 16, .value_dim = 3},
                                                      {}, 0.125);
  CHECK(scaled.scale() == 0.125);
  const latte::SlidingWindow window;
  CHECK(window.left == 0);
  CHECK(window.right == 0);
  const latte::VAPOR::Params params;
  CHECK(params.base == 10000.0);
  CHECK(params.angles.size() == 0);
}

TEST_CASE("defaults: VAPOR without angles is the RoPE schedule base^(-2i/Dv) for every head") {
  const latte::LatteDims dims{.heads = 3, .latents = 5, .value_dim = 8};
  latte::VAPOR::Params explicit_angles;
  explicit_angles.angles = latte::Tensor<double, 2>({3, 4});
  for (index_t h = 0; h < 3; ++h)
    for (index_t i = 0; i < 4; ++i) explicit_angles.angles(h, i) = latte::rope_theta(i, 8, 10000.0);
  const Vapor by_default(dims), by_hand(dims, explicit_angles);
  latte::VAPOR::Params other_base;
  other_base.base = 500.0;
  const Vapor rebased(dims, other_base);

  Rng rng(2);
  const auto q = random_tensor<double, 4>(rng, {2, 40, 3, 5}, 1.0);
  const auto k = random_tensor<double, 4>(rng, {2, 40, 3, 5}, 1.0);
  const auto v = random_tensor<double, 4>(rng, {2, 40, 3, 8}, 1.0);
  latte::Tensor<double, 4> a({2, 40, 3, 8}), b({2, 40, 3, 8}), c({2, 40, 3, 8});
  by_default.forward(latte::exec::reference, q, k, v, a.view());
  by_hand.forward(latte::exec::reference, q, k, v, b.view());
  rebased.forward(latte::exec::reference, q, k, v, c.view());
  CHECK(bit_equal(a, b));
  CHECK_FALSE(bit_equal(a, c));  // the base is used
}

// ----------------------------------------------------------------- supports --

TEST_CASE("supports: reference and cpu are available, cuda says why not") {
  static_assert(latte::exec::implemented<latte::exec::reference_t>);
  static_assert(latte::exec::implemented<latte::exec::cpu_t>);
  static_assert(!latte::exec::implemented<latte::exec::cuda_t>);
  static_assert(std::is_same_v<latte::exec::default_t, latte::exec::cpu_t>);

  for (const latte::Support& available :
       {latte::supports(latte::exec::reference), latte::supports(latte::exec::cpu)}) {
    CHECK(available.ok);
    CHECK(static_cast<bool>(available));
    CHECK(available.reason.empty());
  }

  const latte::Support cuda = latte::supports(latte::exec::cuda);
  CHECK_FALSE(cuda.ok);
  CHECK_FALSE(static_cast<bool>(cuda));
  CHECK(cuda.reason.find("'cuda'") != std::string::npos);
  CHECK(cuda.reason.find("not implemented") != std::string::npos);
  CHECK(cuda.reason.find("latte::exec::cpu") != std::string::npos);
  // Support is contextually convertible to bool only (explicit).
  static_assert(!std::is_convertible_v<latte::Support, bool>);
  static_assert(std::is_constructible_v<bool, latte::Support>);
}

// ------------------------------------------------------------ strided views --

/// A [T, B, H, D] buffer holding x (a [B, T, H, D] tensor), and a [B, T, H, D]
/// strided view into it.
template <class T>
struct TimeMajor {
  std::vector<T> storage;
  index_t B, Tn, H, D;

  explicit TimeMajor(const latte::Tensor<T, 4>& x)
      : storage(static_cast<std::size_t>(x.size()), T(-777)),
        B(x.extent(0)),
        Tn(x.extent(1)),
        H(x.extent(2)),
        D(x.extent(3)) {
    for (index_t b = 0; b < B; ++b)
      for (index_t t = 0; t < Tn; ++t)
        for (index_t h = 0; h < H; ++h)
          for (index_t d = 0; d < D; ++d) view()(b, t, h, d) = x(b, t, h, d);
  }
  [[nodiscard]] latte::TensorView<T, 4> view() {
    return {storage.data(), {B, Tn, H, D}, {H * D, B * H * D, D, 1}};
  }
  /// Copies the viewed elements back into a contiguous [B, T, H, D] tensor.
  [[nodiscard]] latte::Tensor<T, 4> contiguous() {
    latte::Tensor<T, 4> x({B, Tn, H, D});
    for (index_t b = 0; b < B; ++b)
      for (index_t t = 0; t < Tn; ++t)
        for (index_t h = 0; h < H; ++h)
          for (index_t d = 0; d < D; ++d) x(b, t, h, d) = view()(b, t, h, d);
    return x;
  }
};

template <class A>
A make_attention(index_t heads, index_t qk_dim, index_t value_dim) {
  if constexpr (requires { typename A::stabilizer; }) {
    return A(latte::LatteDims{.heads = heads, .latents = qk_dim, .value_dim = value_dim});
  } else if constexpr (std::is_same_v<typename A::window_type, latte::SlidingWindow>) {
    return A(latte::SoftmaxDims{.heads = heads, .key_dim = qk_dim, .value_dim = value_dim},
             latte::SlidingWindow{.left = 3, .right = A::direction::is_causal ? 0 : 2});
  } else {
    return A(latte::SoftmaxDims{.heads = heads, .key_dim = qk_dim, .value_dim = value_dim});
  }
}

using CausalLatte = latte::LatteAttention<latte::Causal>;
using BidirectionalLatte = latte::LatteAttention<latte::Bidirectional>;
using BidirectionalVapor =
    latte::LatteAttention<latte::Bidirectional, latte::RunningMax, latte::VAPOR>;
using CausalSoftmax = latte::SoftmaxAttention<latte::Causal>;
using BidirectionalSoftmax = latte::SoftmaxAttention<latte::Bidirectional>;
using WindowedSoftmax = latte::SoftmaxAttention<latte::Bidirectional, latte::SlidingWindow>;
using CausalWindowedSoftmax = latte::SoftmaxAttention<latte::Causal, latte::SlidingWindow>;

#define API_TYPES                                                                                  \
  CausalLatte, BidirectionalLatte, Vapor, BidirectionalVapor, CausalSoftmax, BidirectionalSoftmax, \
      WindowedSoftmax, CausalWindowedSoftmax

TEST_CASE_TEMPLATE("strided [T, B, H, D] views give bit-identical output to contiguous copies", A,
                   API_TYPES) {
  const index_t B = 3, Tn = 17, H = 2, Dqk = 5, Dv = 6;
  const A attention = make_attention<A>(H, Dqk, Dv);
  Rng rng(3);
  const auto q = random_tensor<float, 4>(rng, {B, Tn, H, Dqk}, 1.5);
  const auto k = random_tensor<float, 4>(rng, {B, Tn, H, Dqk}, 1.5);
  const auto v = random_tensor<float, 4>(rng, {B, Tn, H, Dv}, 1.0);

  latte::Tensor<float, 4> expected({B, Tn, H, Dv});
  attention.forward(latte::exec::reference, q, k, v, expected.view());

  TimeMajor<float> qs(q), ks(k), vs(v), outs(latte::Tensor<float, 4>({B, Tn, H, Dv}));
  // Strided inputs and a strided output.
  attention.forward(latte::exec::reference, qs.view(), ks.view(), vs.view(), outs.view());
  CHECK(bit_equal(outs.contiguous(), expected));
  // Strided inputs, contiguous output.
  latte::Tensor<float, 4> out({B, Tn, H, Dv});
  attention.forward(latte::exec::reference, qs.view(), ks.view(), vs.view(), out.view());
  CHECK(bit_equal(out, expected));
}

TEST_CASE_TEMPLATE("views into one fused [B, T, H, Dq + Dk + Dv] buffer give bit-identical output",
                   A, API_TYPES) {
  const index_t B = 2, Tn = 9, H = 3, Dqk = 4, Dv = 5, F = 2 * Dqk + Dv;
  const A attention = make_attention<A>(H, Dqk, Dv);
  Rng rng(4);
  const auto fused = random_tensor<double, 4>(rng, {B, Tn, H, F}, 1.0);
  const std::array<index_t, 4> strides{Tn * H * F, H * F, F, 1};
  const latte::TensorView<const double, 4> q(fused.data(), {B, Tn, H, Dqk}, strides);
  const latte::TensorView<const double, 4> k(fused.data() + Dqk, {B, Tn, H, Dqk}, strides);
  const latte::TensorView<const double, 4> v(fused.data() + 2 * Dqk, {B, Tn, H, Dv}, strides);
  latte::Tensor<double, 4> out({B, Tn, H, Dv});
  attention.forward(latte::exec::reference, q, k, v, out.view());

  latte::Tensor<double, 4> qc({B, Tn, H, Dqk}), kc({B, Tn, H, Dqk}), vc({B, Tn, H, Dv});
  for (index_t b = 0; b < B; ++b)
    for (index_t t = 0; t < Tn; ++t)
      for (index_t h = 0; h < H; ++h) {
        for (index_t d = 0; d < Dqk; ++d)
          qc(b, t, h, d) = q(b, t, h, d), kc(b, t, h, d) = k(b, t, h, d);
        for (index_t d = 0; d < Dv; ++d) vc(b, t, h, d) = v(b, t, h, d);
      }
  latte::Tensor<double, 4> expected({B, Tn, H, Dv});
  attention.forward(latte::exec::reference, qc, kc, vc, expected.view());
  CHECK(bit_equal(out, expected));
}

TEST_CASE_TEMPLATE("strided step views give bit-identical decode output", A, CausalLatte, Vapor,
                   CausalSoftmax, CausalWindowedSoftmax) {
  const index_t B = 2, Tn = 11, H = 3, Dqk = 4, Dv = 6;
  const A attention = make_attention<A>(H, Dqk, Dv);
  Rng rng(5);
  const auto q = random_tensor<float, 4>(rng, {B, Tn, H, Dqk}, 1.0);
  const auto k = random_tensor<float, 4>(rng, {B, Tn, H, Dqk}, 1.0);
  const auto v = random_tensor<float, 4>(rng, {B, Tn, H, Dv}, 1.0);
  TimeMajor<float> qs(q), ks(k), vs(v);
  auto state_of = [&] {
    if constexpr (requires { typename A::stabilizer; })
      return attention.template make_state<float>(B);
    else
      return attention.template make_state<float>(B, Tn);
  };
  auto contiguous_state = state_of(), strided_state = state_of();
  latte::Tensor<float, 3> expected({B, H, Dv}), out({B, H, Dv});
  for (index_t t = 0; t < Tn; ++t) {
    attention.step(latte::exec::reference, contiguous_state, time_step(q, t), time_step(k, t),
                   time_step(v, t), expected.view());
    // Time step t of the [T, B, H, D] buffers: a [B, H, D] view with batch stride H * D.
    auto at = [&](TimeMajor<float>& x, index_t D) {
      return latte::TensorView<const float, 3>(x.storage.data() + t * B * H * D, {B, H, D},
                                               {H * D, D, 1});
    };
    attention.step(latte::exec::reference, strided_state, at(qs, Dqk), at(ks, Dqk), at(vs, Dv),
                   out.view());
    CAPTURE(t);
    CHECK(bit_equal(out, expected));
  }
}

// ---------------------------------------------------- Tensor -> TensorView --

static_assert(std::is_convertible_v<latte::Tensor<float, 4>&, latte::TensorView<float, 4>>);
static_assert(std::is_convertible_v<latte::Tensor<float, 4>&, latte::TensorView<const float, 4>>);
static_assert(
    std::is_convertible_v<const latte::Tensor<float, 4>&, latte::TensorView<const float, 4>>);
static_assert(!std::is_convertible_v<const latte::Tensor<float, 4>&, latte::TensorView<float, 4>>);
static_assert(
    std::is_convertible_v<latte::TensorView<float, 4>, latte::TensorView<const float, 4>>);
static_assert(
    !std::is_convertible_v<latte::TensorView<const float, 4>, latte::TensorView<float, 4>>);
static_assert(!std::is_convertible_v<latte::TensorView<float, 4>, latte::TensorView<double, 4>>);
static_assert(!std::is_convertible_v<latte::TensorView<float, 4>, latte::TensorView<float, 3>>);
static_assert(
    std::is_same_v<decltype(latte::TensorView(std::declval<float*>(), std::array<index_t, 3>{})),
                   latte::TensorView<float, 3>>);

TEST_CASE("Tensor converts to mutable and const views of the same storage") {
  latte::Tensor<float, 4> x({2, 3, 4, 5}, 1.0f);
  CHECK(x.size() == 120);

  const latte::TensorView<float, 4> mutable_view = x;
  const latte::TensorView<const float, 4> const_view = x;
  const latte::TensorView<const float, 4> from_mutable = mutable_view;
  for (const auto* view : {&const_view, &from_mutable}) {
    CHECK(view->data() == x.data());
    CHECK(view->extents() == x.extents());
    CHECK(view->strides() == std::array<index_t, 4>{60, 20, 5, 1});
  }
  CHECK(mutable_view.data() == x.data());
  CHECK(x.cview().data() == x.data());
  CHECK(std::as_const(x).view().data() == x.data());

  mutable_view(1, 2, 3, 4) = 9.0f;  // writes through
  CHECK(x(1, 2, 3, 4) == 9.0f);
  CHECK(x.data()[119] == 9.0f);
  CHECK(const_view(1, 2, 3, 4) == 9.0f);
  CHECK(mutable_view.row(1, 2, 3) == x.data() + 115);
  CHECK(mutable_view.size() == 120);
  CHECK_FALSE(mutable_view.empty());

  const latte::Tensor<float, 4> empty({2, 0, 4, 5});
  const latte::TensorView<const float, 4> empty_view = empty;
  CHECK(empty_view.empty());
  CHECK(empty_view.size() == 0);
  CHECK(latte::TensorView<float, 2>().empty());
}

TEST_CASE("HugePageAllocator: 2 MiB alignment from 2 MiB up, 64 bytes below; Tensor uses it") {
  using Allocator = latte::HugePageAllocator<float>;
  constexpr std::size_t huge = Allocator::huge_page_bytes;
  const auto address = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p); };
  Allocator allocator;
  for (const std::size_t count : {std::size_t{1}, std::size_t{17}, huge / sizeof(float) - 1,
                                  huge / sizeof(float), 3 * huge / sizeof(float) + 5}) {
    float* block = allocator.allocate(count);
    const std::size_t expected = count * sizeof(float) >= huge ? huge : 64;
    CHECK(address(block) % expected == 0);
    block[0] = 1.0f;  // both ends are ours to write
    block[count - 1] = 2.0f;
    allocator.deallocate(block, count);
  }
  const latte::Tensor<float, 3> large({64, 8, 1024}, 0.5f);  // 2 MiB exactly
  CHECK(address(large.data()) % huge == 0);
  CHECK(large.data()[large.size() - 1] == 0.5f);
  const latte::Tensor<double, 1> small({3}, 0.25);
  CHECK(address(small.data()) % 64 == 0);
  CHECK_THROWS_AS((void)allocator.allocate(std::size_t(-1) / 2), std::bad_array_new_length);
  std::vector<float, Allocator> buffer(1 << 20, 1.0f);  // the spelling the header documents
  CHECK(address(buffer.data()) % huge == 0);
}

TEST_CASE("Decode states keep their fields and step scratch 64-byte aligned, restored ones too") {
  // The cpu step's vector loads of a misaligned state straddle cache lines;
  // the decode step's time then depended on where the allocator put it.
  const auto aligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 64 == 0; };
  const CausalLatte attention({.heads = 3, .latents = 5, .value_dim = 7});
  for (int trial = 0; trial < 4; ++trial) {  // several allocations, several placements
    auto state = attention.make_state<float>(2);
    const std::vector<std::byte> bytes = state.save();
    auto restored = attention.make_state<float>(2);
    restored.restore(bytes);
    for (auto* s : {&state, &restored}) {
      for (std::size_t field = 0; field < 3; ++field) CHECK(aligned(s->field(field)));
      CHECK(aligned(s->scratch()));
    }
  }
  const latte::LinearAttention<latte::Causal, latte::EluPlusOne> linear({2, 5, 3});
  auto linear_state = linear.make_state<double>(1);
  CHECK(aligned(linear_state.field(0)));
  CHECK(aligned(linear_state.scratch()));
}

TEST_CASE("Tensors pass straight into forward") {
  const CausalLatte attention({.heads = 2, .latents = 3, .value_dim = 4});
  Rng rng(6);
  const auto q = random_tensor<double, 4>(rng, {1, 6, 2, 3}, 1.0);
  const auto k = random_tensor<double, 4>(rng, {1, 6, 2, 3}, 1.0);
  const auto v = random_tensor<double, 4>(rng, {1, 6, 2, 4}, 1.0);
  latte::Tensor<double, 4> a({1, 6, 2, 4}), b({1, 6, 2, 4});
  attention.forward(latte::exec::reference, q, k, v, a.view());
  attention.forward(latte::exec::reference, q.cview(), k.view(), v.cview(),
                    latte::TensorView<double, 4>(b));
  CHECK(bit_equal(a, b));
}

// --------------------------------------------------------------------- Eigen --

template <class X>
concept LatteViewable = requires(X& x) {
  latte::view(x);
};
static_assert(LatteViewable<Eigen::Tensor<float, 4, Eigen::RowMajor>>);
static_assert(!LatteViewable<Eigen::Tensor<float, 4>>);  // column-major is refused
static_assert(!LatteViewable<Eigen::Tensor<float, 3, Eigen::RowMajor>>);

TEST_CASE("Eigen: view of a row-major Eigen::Tensor aliases its storage element by element") {
  Eigen::Tensor<float, 4, Eigen::RowMajor> x(2, 3, 4, 5);
  x.setRandom();
  const latte::TensorView<float, 4> view = latte::view(x);
  CHECK(view.data() == x.data());
  CHECK(view.extents() == std::array<index_t, 4>{2, 3, 4, 5});
  CHECK(view.strides() == std::array<index_t, 4>{60, 20, 5, 1});
  for (index_t b = 0; b < 2; ++b)
    for (index_t t = 0; t < 3; ++t)
      for (index_t h = 0; h < 4; ++h)
        for (index_t d = 0; d < 5; ++d) CHECK(view(b, t, h, d) == x(b, t, h, d));
  view(1, 2, 3, 4) = 42.0f;
  CHECK(x(1, 2, 3, 4) == 42.0f);

  Eigen::TensorMap<Eigen::Tensor<float, 4, Eigen::RowMajor>> map(x.data(), 2, 3, 4, 5);
  const latte::TensorView<float, 4> map_view = latte::view(map);
  CHECK(map_view.data() == x.data());
  CHECK(map_view.extents() == view.extents());
  CHECK(map_view.strides() == view.strides());
}

TEST_CASE("Eigen: head_matrix is the T x D matrix of one (batch, head)") {
  Eigen::Tensor<double, 4, Eigen::RowMajor> x(2, 7, 3, 4);
  x.setRandom();
  const latte::TensorView<double, 4> view = latte::view(x);
  for (index_t b = 0; b < 2; ++b)
    for (index_t h = 0; h < 3; ++h) {
      auto m = latte::head_matrix(view, b, h);
      static_assert(std::is_same_v<decltype(m), latte::HeadMatrix<double>>);
      REQUIRE(m.rows() == 7);
      REQUIRE(m.cols() == 4);
      CHECK(m.outerStride() == view.stride(1));
      for (index_t t = 0; t < 7; ++t)
        for (index_t d = 0; d < 4; ++d) CHECK(m(t, d) == view(b, t, h, d));
    }
  // Writes through the map land in the tensor.
  auto m = latte::head_matrix(view, 1, 2);
  m(6, 3) = -5.0;
  CHECK(x(1, 6, 2, 3) == -5.0);
  m.row(0).setZero();
  for (index_t d = 0; d < 4; ++d) CHECK(x(1, 0, 2, d) == 0.0);

  // A const view gives a read-only map.
  const latte::TensorView<const double, 4> const_view = view;
  const auto c = latte::head_matrix(const_view, 0, 1);
  static_assert(std::is_same_v<std::remove_const_t<decltype(c)>, latte::ConstHeadMatrix<double>>);
  CHECK(c(3, 2) == x(0, 3, 1, 2));
}

TEST_CASE("Eigen: head_matrix of a strided [T, B, H, D] view") {
  Rng rng(7);
  const auto x = random_tensor<float, 4>(rng, {2, 6, 3, 4}, 1.0);
  TimeMajor<float> stored(x);
  const auto view = stored.view();
  const auto m = latte::head_matrix(view, 1, 2);
  CHECK(m.outerStride() == 2 * 3 * 4);
  for (index_t t = 0; t < 6; ++t)
    for (index_t d = 0; d < 4; ++d) CHECK(m(t, d) == x(1, t, 2, d));
  // Eigen arithmetic on heads: the row sums of head (1, 2).
  const Eigen::VectorXf sums = m.rowwise().sum();
  for (index_t t = 0; t < 6; ++t) {
    float expected = 0;
    for (index_t d = 0; d < 4; ++d) expected += x(1, t, 2, d);
    CHECK(sums(t) == doctest::Approx(expected).epsilon(1e-6));
  }
}

TEST_CASE("Eigen: Eigen-backed views give the same output as latte::Tensor") {
  const Vapor attention({.heads = 2, .latents = 3, .value_dim = 4});
  Eigen::Tensor<float, 4, Eigen::RowMajor> q(2, 8, 2, 3), k(2, 8, 2, 3), v(2, 8, 2, 4),
      out(2, 8, 2, 4);
  q.setRandom();
  k.setRandom();
  v.setRandom();
  attention.forward(latte::exec::reference, latte::view(q), latte::view(k), latte::view(v),
                    latte::view(out));

  latte::Tensor<float, 4> qt({2, 8, 2, 3}), kt({2, 8, 2, 3}), vt({2, 8, 2, 4}),
      expected({2, 8, 2, 4});
  std::memcpy(qt.data(), q.data(), sizeof(float) * static_cast<std::size_t>(qt.size()));
  std::memcpy(kt.data(), k.data(), sizeof(float) * static_cast<std::size_t>(kt.size()));
  std::memcpy(vt.data(), v.data(), sizeof(float) * static_cast<std::size_t>(vt.size()));
  attention.forward(latte::exec::reference, qt, kt, vt, expected.view());
  CHECK(std::memcmp(out.data(), expected.data(),
                    sizeof(float) * static_cast<std::size_t>(expected.size())) == 0);
}

// ------------------------------------------------------------ format_extents --

TEST_CASE("format_extents renders extents for messages") {
  CHECK(latte::format_extents<4>({2, 128, 8, 64}) == "[2, 128, 8, 64]");
  CHECK(latte::format_extents<1>({5}) == "[5]");
  CHECK(latte::format_extents<2>({0, -3}) == "[0, -3]");
  CHECK(latte::format_extents(latte::Tensor<float, 3>({1, 2, 3}).extents()) == "[1, 2, 3]");
}

TEST_CASE("latte::Error names the argument and is a std::invalid_argument") {
  static_assert(std::is_base_of_v<std::invalid_argument, latte::Error>);
  const latte::Error error("values", "dimension T (time): expected 128, given 127");
  CHECK(error.argument() == "values");
  CHECK(std::string(error.what()) ==
        "latte: argument 'values': dimension T (time): expected 128, given 127");
  CHECK_THROWS_AS(((void)latte::Tensor<float, 2>({2, -1})), std::invalid_argument);
  latte::test::expect_error([] { (void)latte::Tensor<float, 2>({2, -1}); }, "extents",
                            "non-negative, given [2, -1]");
}

TEST_CASE("version macros agree") {
  CHECK(std::string(LATTE_VERSION_STRING) == std::to_string(LATTE_VERSION_MAJOR) + "." +
                                                 std::to_string(LATTE_VERSION_MINOR) + "." +
                                                 std::to_string(LATTE_VERSION_PATCH));
}

}  // namespace

TEST_CASE("Calls without an execution tag run on exec::cpu") {
  Rng rng(9);
  const auto q = random_tensor<float, 4>(rng, {1, 300, 2, 6}, 1.0);
  const auto v = random_tensor<float, 4>(rng, {1, 300, 2, 4}, 1.0);
  const latte::LatteAttention<latte::Causal> attention({2, 6, 4});
  latte::Tensor<float, 4> by_default(v.extents()), on_cpu(v.extents());
  attention.forward(q, q, v, by_default.view());
  attention.forward(latte::exec::cpu, q, q, v, on_cpu.view());
  CHECK(bit_equal(by_default, on_cpu));
  auto state = attention.make_state<float>(1);
  auto state_cpu = attention.make_state<float>(1);
  attention.forward(q, q, v, by_default.view(), state);
  attention.forward(latte::exec::cpu, q, q, v, on_cpu.view(), state_cpu);
  latte::Tensor<float, 3> step_in({1, 2, 6}), value({1, 2, 4}), a({1, 2, 4}), b({1, 2, 4});
  attention.step(state, step_in, step_in, value, a.view());
  attention.step(latte::exec::cpu, state_cpu, step_in, step_in, value, b.view());
  CHECK(bit_equal(a, b));
  const latte::SoftmaxAttention<latte::Causal> softmax({2, 6, 4});
  softmax.forward(q, q, v, by_default.view());
  softmax.forward(latte::exec::cpu, q, q, v, on_cpu.view());
  CHECK(bit_equal(by_default, on_cpu));
  // Macchiato: forward, forward with a state, step and backward.
  const latte::LatteMacchiato<latte::Causal> macchiato(
      {.heads = 2, .latents = 5, .key_dim = 6, .value_dim = 4, .window = 3});
  macchiato.forward(q, latte::reference::latent_logits(q.cview()), q, q, v, by_default.view());
  macchiato.forward(latte::exec::cpu, q, latte::reference::latent_logits(q.cview()), q, q, v, on_cpu.view());
  CHECK(bit_equal(by_default, on_cpu));
  auto m_state = macchiato.make_state<float>(1);
  auto m_state_cpu = macchiato.make_state<float>(1);
  macchiato.forward(q, latte::reference::latent_logits(q.cview()), q, q, v, by_default.view(), m_state);
  macchiato.forward(latte::exec::cpu, q, latte::reference::latent_logits(q.cview()), q, q, v, on_cpu.view(),
                    m_state_cpu);
  latte::Tensor<float, 3> step_logits({1, 2, 5});
  macchiato.step(m_state, step_in, step_logits, step_in, step_in, value, a.view());
  macchiato.step(latte::exec::cpu, m_state_cpu, step_in, step_logits, step_in, step_in, value, b.view());
  CHECK(bit_equal(a, b));
  latte::Tensor<float, 4> dq(q.extents()), dk({1, 300, 2, 5}), dwq(q.extents()), dwk(q.extents()),
      dv(v.extents()), dq2(q.extents()), dk2({1, 300, 2, 5}), dwq2(q.extents()), dwk2(q.extents()),
      dv2(v.extents());
  macchiato.backward(q, latte::reference::latent_logits(q.cview()), q, q, v, v,
                     latte::MacchiatoGradients<float>{dq.view(), dk.view(), dwq.view(), dwk.view(), dv.view()});
  macchiato.backward(latte::exec::cpu, q, latte::reference::latent_logits(q.cview()), q, q, v, v,
                     latte::MacchiatoGradients<float>{dq2.view(), dk2.view(), dwq2.view(), dwk2.view(), dv2.view()});
  CHECK(bit_equal(dq, dq2));
  CHECK(bit_equal(dv, dv2));
  // LAVO: forward, forward with a state, step, cross_forward and backward.
  const auto x = random_tensor<float, 4>(rng, {1, 300, 2, 6}, 1.0);
  latte::Tensor<float, 4> lavo_a(x.extents()), lavo_b(x.extents());
  const latte::Lavo<latte::Causal> lavo({.heads = 2, .dim = 6, .bases = 3, .window = 7});
  lavo.forward(x, x, x, lavo_a.view());
  lavo.forward(latte::exec::cpu, x, x, x, lavo_b.view());
  CHECK(bit_equal(lavo_a, lavo_b));
  auto l_state = lavo.make_state<float>(1);
  auto l_state_cpu = lavo.make_state<float>(1);
  lavo.forward(x, x, x, lavo_a.view(), l_state);
  lavo.forward(latte::exec::cpu, x, x, x, lavo_b.view(), l_state_cpu);
  latte::Tensor<float, 3> token({1, 2, 6}, 0.5f), lavo_step_a({1, 2, 6}), lavo_step_b({1, 2, 6});
  lavo.step(l_state, token, token, token, lavo_step_a.view());
  lavo.step(latte::exec::cpu, l_state_cpu, token, token, token, lavo_step_b.view());
  CHECK(bit_equal(lavo_step_a, lavo_step_b));
  const latte::Lavo<latte::Bidirectional> lavo_cross({.heads = 2, .dim = 6, .bases = 3, .window = 7});
  lavo_cross.cross_forward(x, q, lavo_a.view());
  lavo_cross.cross_forward(latte::exec::cpu, x, q, lavo_b.view());
  CHECK(bit_equal(lavo_a, lavo_b));
  latte::Tensor<float, 4> ldq(x.extents()), ldk(x.extents()), ldv(x.extents()), ldq2(x.extents()),
      ldk2(x.extents()), ldv2(x.extents());
  lavo.backward(x, x, x, x, latte::LavoGradients<float>{ldq.view(), ldk.view(), ldv.view()});
  lavo.backward(latte::exec::cpu, x, x, x, x,
                latte::LavoGradients<float>{ldq2.view(), ldk2.view(), ldv2.view()});
  CHECK(bit_equal(ldq, ldq2));
  CHECK(bit_equal(ldv, ldv2));
}

}  // namespace test_api
#undef API_TYPES
