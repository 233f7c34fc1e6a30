// Sizes nobody should pass: every size product that would wrap is refused with
// a latte::Error naming the argument before anything is allocated, and a
// forward with no output elements (T = 0, any B) allocates nothing.
#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <source_location>
#include <vector>

#include "allocation_counter.hpp"
#include "expect_error.hpp"
#include "latte/attention.hpp"
#include "latte/core/checked_size.hpp"
#include "latte/layers/named_layers.hpp"

namespace test_huge_sizes {  // every test file's own namespace: tests/CMakeLists.txt

namespace {

using latte::index_t;
using latte::test::expect_error;

constexpr index_t huge = index_t{1} << 62;
constexpr index_t most = std::numeric_limits<index_t>::max();
constexpr index_t huge_batch = index_t{1} << 40;  // a batch no per-batch workspace can hold

/// A view of `extents` over a small buffer: with an extent 0 it addresses nothing.
template <class T>
latte::TensorView<T, 4> empty_view(std::vector<float>& buffer, std::array<index_t, 4> extents) {
  return latte::TensorView<T, 4>(buffer.data(), extents);
}

/// `call` must not allocate (the T = 0 forwards).
template <class F>
void expect_no_allocation(F&& call, int line = __builtin_LINE()) {  // clang 14 has no std::source_location
  const long before = latte::test::allocations.load();
  call();
  INFO("call at line " << line);
  CHECK(latte::test::allocations.load() - before == 0);
}

}  // namespace

TEST_CASE("checked_size: products and sums that overflow are refused, with their terms") {
  using latte::detail::checked_count;
  using latte::detail::checked_product;
  using latte::detail::checked_sum;
  CHECK(checked_product("n", {3, 4, 5}) == 60);
  CHECK(checked_product("n", {huge, huge, 0}) == 0);  // a zero factor allocates nothing
  CHECK(checked_sum("n", {most - 1, 1}) == most);
  CHECK(checked_count<double>("n", {most / 8}) == most / 8);
  expect_error([] { (void)checked_product("batch", {huge, 2}); }, "batch", "4611686018427387904 * 2");
  expect_error([] { (void)checked_count<float>("batch", {most / 4 + 1}); }, "batch", "4 bytes");
  expect_error([] { (void)checked_sum("window", {most, 1}); }, "window");
  expect_error([] { (void)checked_product("dims", {-1, 2}); }, "dims");
}

TEST_CASE("make_state: a batch or capacity whose state would wrap is refused") {
  const latte::LatteAttention<latte::Causal> latte_attn({.heads = 2, .latents = 4, .value_dim = 4});
  expect_error([&] { (void)latte_attn.make_state<float>(huge); }, "batch");
  expect_error([&] { (void)latte_attn.make_state<double>(most); }, "batch");

  const latte::SoftmaxAttention<latte::Causal> softmax({.heads = 2, .key_dim = 4, .value_dim = 4});
  expect_error([&] { (void)softmax.make_state<float>(huge, 8); }, "batch");
  expect_error([&] { (void)softmax.make_state<float>(1, huge); }, "capacity");

  const latte::LatteMacchiato<latte::Causal> macchiato(
      {.heads = 2, .latents = 4, .key_dim = 4, .value_dim = 4, .window = 4});
  expect_error([&] { (void)macchiato.make_state<float>(huge); }, "batch");

  const latte::LinearAttention<latte::Causal, latte::Relu> linear(
      {.heads = 2, .key_dim = 4, .value_dim = 4});
  expect_error([&] { (void)linear.make_state<float>(huge); }, "batch");
  latte::CosFormer<latte::Causal>::Options cos_options;
  cos_options.reweight.length = 64;
  const latte::CosFormer<latte::Causal> cosformer({.heads = 2, .key_dim = 4, .value_dim = 4},
                                                  cos_options);
  expect_error([&] { (void)cosformer.make_state<float>(huge); }, "batch");
  const latte::LeaPformer<latte::Causal> leap({.heads = 2, .key_dim = 4, .value_dim = 4});
  expect_error([&] { (void)leap.make_state<float>(huge); }, "batch");

  const latte::Lavo<latte::Causal> lavo({.heads = 2, .dim = 4, .bases = 2, .window = 4});
  expect_error([&] { (void)lavo.make_state<float>(huge); }, "batch");

  const latte::ConvCompressedDims conv_dims{
      .heads = 2, .key_dim = 4, .value_dim = 4, .group_size = 2, .levels = 1};
  const latte::ConvCompressedAttention<latte::Causal> conv(
      conv_dims, latte::ConvCompressedParams::zeros(conv_dims));
  expect_error([&] { (void)conv.make_state<float>(huge, 16); }, "batch");
  expect_error([&] { (void)conv.make_state<float>(1, huge); }, "context_capacity");
}

TEST_CASE("windows: a ring of left + 1 that would wrap is refused; a huge window still runs") {
  using Windowed = latte::SoftmaxAttention<latte::Causal, latte::SlidingWindow>;
  const Windowed wide({.heads = 2, .key_dim = 4, .value_dim = 4},
                      latte::SlidingWindow{.left = huge - 1});
  expect_error([&] { (void)wide.make_state<float>(1); }, "window.left");
  const Windowed widest({.heads = 2, .key_dim = 4, .value_dim = 4},
                        latte::SlidingWindow{.left = most});
  expect_error([&] { (void)widest.make_state<double>(1); }, "window.left");

  // Macchiato's decode ring holds w + 1 slots per head.
  const latte::LatteMacchiato<latte::Causal> macchiato(
      {.heads = 256, .latents = 1, .key_dim = 2, .value_dim = 2, .window = index_t{1} << 52});
  expect_error([&] { (void)macchiato.make_state<double>(1); }, "dims.window");

  // LAVO's ring is w x d per head.
  expect_error(
      [] {
        (void)latte::Lavo<latte::Causal>(
            {.heads = index_t{1} << 20, .dim = index_t{1} << 20, .bases = 1, .window = index_t{1} << 30});
      },
      "dims.window");

  // A conv-compressed window wider than any context: its ring is the context, and it decodes.
  latte::ConvCompressedDims dims{.heads = 1, .key_dim = 2, .value_dim = 2, .group_size = 2,
                                 .levels = 1, .window_left = most};
  const latte::ConvCompressedAttention<latte::Causal> conv(dims,
                                                           latte::ConvCompressedParams::zeros(dims));
  auto state = conv.make_state<float>(1, 8);
  CHECK(state.shape().ring() == 8);
  latte::Tensor<float, 3> q({1, 1, 2}, 0.5f), out({1, 1, 2});
  for (int t = 0; t < 8; ++t) conv.step(latte::exec::reference, state, q, q, q, out.view());
  CHECK(out(0, 0, 0) == doctest::Approx(0.5f));
}

TEST_CASE("constructors: tables and weights whose size would wrap are refused") {
  const index_t big = index_t{1} << 32;
  expect_error([&] {
    (void)latte::LatteAttention<latte::Causal>({.heads = 4, .latents = big, .value_dim = big});
  }, "dims");
  expect_error([&] {
    (void)latte::LatteAttention<latte::Causal, latte::RunningMax, latte::VAPOR>(
        {.heads = big, .latents = 1, .value_dim = big});
  }, "dims");
  expect_error([&] {
    (void)latte::SoftmaxAttention<latte::Causal>({.heads = big, .key_dim = big, .value_dim = 1});
  }, "dims");
  expect_error([&] {
    (void)latte::LatteMacchiato<latte::Causal>(
        {.heads = big, .latents = 1, .key_dim = big, .value_dim = 1, .window = 1});
  }, "dims");
  expect_error([&] {
    (void)latte::LinearAttention<latte::Causal, latte::Relu, latte::NoReweight, latte::RoPE>(
        {.heads = big, .key_dim = big, .value_dim = 1});
  }, "dims");
  expect_error([&] {
    (void)latte::CosFormer<latte::Causal>({.heads = 2, .key_dim = big, .value_dim = big});
  }, "dims");
  expect_error([&] {
    (void)latte::LeaPformer<latte::Causal>({.heads = 2, .key_dim = big, .value_dim = big});
  }, "dims");
  expect_error([&] {
    (void)latte::Lavo<latte::Causal>({.heads = big, .dim = big, .bases = 1, .window = 1});
  }, "dims");
  expect_error([&] {
    (void)latte::ConvCompressedParams::zeros(
        {.heads = 1, .key_dim = 1, .value_dim = 1, .group_size = 1, .levels = huge});
  }, "dims");
  expect_error([&] {
    (void)latte::ConvCompressedParams::zeros(
        {.heads = 1, .key_dim = 1, .value_dim = big, .group_size = big, .levels = 1});
  }, "dims");
  (void)latte::Tensor<float, 3>({huge, huge, 0});  // a zero extent: nothing to allocate
  expect_error([&] { (void)latte::Tensor<float, 2>({huge, 2}); }, "extents");
  expect_error([&] { (void)latte::RGLRU::Weights<float>::initial(huge, 1); }, "channels");

  const latte::LatteAttention<latte::Causal> attention({.heads = 2, .latents = 4, .value_dim = 4});
  expect_error([&] { (void)latte::LatteLayer<latte::Causal>::random_weights(attention, huge, 1); },
               "model_dim");
  const latte::LatteLayer<latte::Causal> layer(
      attention, 8, latte::LatteLayer<latte::Causal>::random_weights(attention, 8, 1));
  expect_error([&] { (void)layer.make_state(huge); }, "batch");
}

TEST_CASE("rotations of a dimension below 2: no pair to turn, so no loop over a huge head count") {
  // The angle tables are [H, D/2]: empty for D = 1 whatever H is. Each constructor
  // below looped over every head before building its empty table (2^40 passes, a hang).
  const index_t heads = huge_batch;
  (void)latte::LatteAttention<latte::Causal, latte::RunningMax, latte::VAPOR>(
      {.heads = heads, .latents = 1, .value_dim = 1});
  (void)latte::LinearAttention<latte::Causal, latte::Relu, latte::NoReweight, latte::RoPE>(
      {.heads = heads, .key_dim = 1, .value_dim = 1});
  (void)latte::LatteMacchiato<latte::Causal, latte::RunningMax, latte::VAPOR, latte::RoPE>(
      {.heads = heads, .latents = 1, .key_dim = 1, .value_dim = 1, .window = 1});
  CHECK(latte::VAPOR::resolve_angles({}, heads, 1).empty());
}

TEST_CASE("T = 0 with a huge batch: validated, then nothing allocated and nothing run") {
  std::vector<float> buffer(64, 0.0f);
  const index_t B = huge_batch, H = 2;
  auto in = [&](index_t D) { return empty_view<const float>(buffer, {B, 0, H, D}); };
  std::vector<float> out_buffer(64, 0.0f);
  auto result = [&](index_t D) { return empty_view<float>(out_buffer, {B, 0, H, D}); };

  auto both = [&](auto&& run, int line = __builtin_LINE()) {
    expect_no_allocation([&] { run(latte::exec::reference); }, line);
    expect_no_allocation([&] { run(latte::exec::cpu); }, line);
  };

  const latte::LatteAttention<latte::Causal> causal({.heads = H, .latents = 4, .value_dim = 4});
  const latte::LatteAttention<latte::Bidirectional, latte::RunningMax, latte::VAPOR> bidir(
      {.heads = H, .latents = 4, .value_dim = 4});
  both([&](auto e) { causal.forward(e, in(4), in(4), in(4), result(4)); });
  both([&](auto e) { bidir.forward(e, in(4), in(4), in(4), result(4)); });

  const latte::SoftmaxAttention<latte::Causal, latte::SlidingWindow> softmax(
      {.heads = H, .key_dim = 4, .value_dim = 4}, latte::SlidingWindow{.left = 3});
  both([&](auto e) { softmax.forward(e, in(4), in(4), in(4), result(4)); });

  const latte::LatteMacchiato<latte::Causal> macchiato(
      {.heads = H, .latents = 4, .key_dim = 4, .value_dim = 4, .window = 2});
  const latte::LatteMacchiato<latte::Bidirectional> macchiato_bi(
      {.heads = H, .latents = 4, .key_dim = 4, .value_dim = 4, .window = 2});
  both([&](auto e) { macchiato.forward(e, in(5), in(4), in(4), in(4), in(4), result(4)); });
  both([&](auto e) { macchiato_bi.forward(e, in(5), in(4), in(4), in(4), in(4), result(4)); });

  const latte::LinearAttention<latte::Causal, latte::Relu> linear({.heads = H, .key_dim = 4, .value_dim = 4});
  const latte::LinearAttention<latte::Bidirectional, latte::EluPlusOne, latte::NoReweight, latte::RoPE>
      linear_bi({.heads = H, .key_dim = 4, .value_dim = 4});
  const latte::CosFormer<latte::Causal> cosformer({.heads = H, .key_dim = 4, .value_dim = 4});
  both([&](auto e) { linear.forward(e, in(4), in(4), in(4), result(4)); });
  both([&](auto e) { linear_bi.forward(e, in(4), in(4), in(4), result(4)); });
  both([&](auto e) { linear_bi.cross_forward(e, in(4), in(4), in(4), result(4)); });
  both([&](auto e) { cosformer.forward(e, in(4), in(4), in(4), result(4)); });

  const latte::Lavo<latte::Causal> lavo({.heads = H, .dim = 4, .bases = 2, .window = 2});
  const latte::Lavo<latte::Bidirectional> lavo_bi({.heads = H, .dim = 4, .bases = 2, .window = 2});
  both([&](auto e) { lavo.forward(e, in(4), in(4), in(4), result(4)); });
  both([&](auto e) { lavo_bi.forward(e, in(4), in(4), in(4), result(4)); });
  both([&](auto e) { lavo_bi.cross_forward(e, in(4), in(4), result(4)); });

  const latte::ConvCompressedDims conv_dims{
      .heads = H, .key_dim = 4, .value_dim = 4, .group_size = 2, .levels = 2};
  const latte::ConvCompressedAttention<latte::Causal> conv(
      conv_dims, latte::ConvCompressedParams::zeros(conv_dims));
  const latte::ConvCompressedAttention<latte::Bidirectional> conv_bi(
      conv_dims, latte::ConvCompressedParams::zeros(conv_dims));
  both([&](auto e) { conv.forward(e, in(4), in(4), in(4), result(4)); });
  both([&](auto e) { conv_bi.forward(e, in(4), in(4), in(4), result(4)); });

  // A wrong shape is still an error when T = 0.
  expect_error([&] { causal.forward(latte::exec::cpu, in(4), in(3), in(4), result(4)); },
               "key_logits");

  // Layers: x, out [B, 0, model_dim].
  const latte::LatteAttention<latte::Causal> attention({.heads = H, .latents = 4, .value_dim = 4});
  const latte::LatteLayer<latte::Causal> layer(
      attention, 8, latte::LatteLayer<latte::Causal>::random_weights(attention, 8, 1));
  const latte::TensorView<const float, 3> x(buffer.data(), {B, 0, 8});
  const latte::TensorView<float, 3> y(out_buffer.data(), {B, 0, 8});
  both([&](auto e) { layer.forward(e, x, y); });
}

TEST_CASE("T = 0 forwards that continue a state leave it as it was and allocate nothing") {
  std::vector<float> buffer(64, 0.0f), out_buffer(64, 0.0f);
  const index_t B = 3, H = 2;
  auto in = [&](index_t D) { return empty_view<const float>(buffer, {B, 0, H, D}); };
  auto result = [&](index_t D) { return empty_view<float>(out_buffer, {B, 0, H, D}); };
  const latte::LatteMacchiato<latte::Causal> macchiato(
      {.heads = H, .latents = 4, .key_dim = 4, .value_dim = 4, .window = 2});
  auto state = macchiato.make_state<float>(B);
  const auto before = state.save();
  expect_no_allocation(
      [&] { macchiato.forward(latte::exec::cpu, in(5), in(4), in(4), in(4), in(4), result(4), state); });
  CHECK(state.save() == before);
  const latte::Lavo<latte::Causal> lavo({.heads = H, .dim = 4, .bases = 2, .window = 2});
  auto lavo_state = lavo.make_state<float>(B);
  expect_no_allocation(
      [&] { lavo.forward(latte::exec::cpu, in(4), in(4), in(4), result(4), lavo_state); });
}

}  // namespace test_huge_sizes
