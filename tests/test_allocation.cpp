// Decode steps allocate nothing: this executable counts every operator new.
#include <doctest/doctest.h>

#include <atomic>
#include <cstdlib>
#include <new>

#include "allocation_counter.hpp"
#include "support.hpp"

namespace test_allocation {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;

/// Allocations made by `steps` calls of step() after one warm-up call.
template <class Attention, class E, class State, class In>
long allocations_in_steps(const Attention& attention, E e, State& state, const In& q,
                          const In& k, const In& v, Tensor<float, 3>& out, int steps) {
  attention.step(e, state, q, k, v, out.view());
  const long before = allocations.load();
  for (int i = 0; i < steps; ++i) attention.step(e, state, q, k, v, out.view());
  return allocations.load() - before;
}
}  // namespace

TEST_CASE("the counter sees plain and over-aligned allocations (latte::Tensor's)") {
  long before = allocations.load();
  { const Tensor<float, 2> small({3, 5}); }
  CHECK(allocations.load() - before == 1);
  before = allocations.load();
  { const Tensor<float, 2> large({1024, 1024}); }  // 4 MiB: the 2 MiB-aligned form
  CHECK(allocations.load() - before == 1);
  before = allocations.load();
  { const std::vector<int> plain(7); }
  CHECK(allocations.load() - before == 1);
}

TEST_CASE_TEMPLATE("Latte step allocates nothing", E, exec::reference_t, exec::cpu_t) {
  Rng rng(501);
  const index_t B = 2, H = 3, L = 17, Dv = 10;
  const auto q = random_tensor<float, 3>(rng, {B, H, L}, 1.0);
  const auto k = random_tensor<float, 3>(rng, {B, H, L}, 1.0);
  const auto v = random_tensor<float, 3>(rng, {B, H, Dv}, 1.0);
  Tensor<float, 3> out({B, H, Dv});
  const LatteAttention<Causal, RunningMax, VAPOR> vapor({H, L, Dv});
  auto state = vapor.make_state<float>(B);
  CHECK(allocations_in_steps(vapor, E{}, state, q, k, v, out, 50) == 0);
  const LatteAttention<Causal> plain({H, L, Dv});
  auto plain_state = plain.make_state<float>(B);
  CHECK(allocations_in_steps(plain, E{}, plain_state, q, k, v, out, 50) == 0);
}

TEST_CASE_TEMPLATE("Softmax KV-cache step allocates nothing", E, exec::reference_t, exec::cpu_t) {
  Rng rng(502);
  const index_t B = 2, H = 8, D = 16;
  const auto q = random_tensor<float, 3>(rng, {B, H, D}, 1.0);
  Tensor<float, 3> out({B, H, D});
  const SoftmaxAttention<Causal> full({H, D, D});
  auto cache = full.make_state<float>(B, 100);
  CHECK(allocations_in_steps(full, E{}, cache, q, q, q, out, 50) == 0);
  const SoftmaxAttention<Causal, SlidingWindow> windowed({H, D, D}, {.left = 5});
  auto ring = windowed.make_state<float>(B);
  CHECK(allocations_in_steps(windowed, E{}, ring, q, q, q, out, 50) == 0);
}

TEST_CASE_TEMPLATE("Lavo and ConvCompressed steps allocate nothing", E, exec::reference_t, exec::cpu_t) {
  Rng rng(503);
  const index_t B = 2, H = 3, D = 16;
  const auto q = random_tensor<float, 3>(rng, {B, H, D}, 1.0);
  Tensor<float, 3> out({B, H, D});
  const Lavo<Causal> lavo({.heads = H, .dim = D, .bases = 5, .window = 7});
  auto lavo_state = lavo.make_state<float>(B);
  CHECK(allocations_in_steps(lavo, E{}, lavo_state, q, q, q, out, 50) == 0);
  const ConvCompressedDims dims{.heads = H, .key_dim = D, .value_dim = D, .group_size = 3, .levels = 2};
  const ConvCompressedAttention<Causal> conv(dims, ConvCompressedParams::zeros(dims));
  auto conv_state = conv.make_state<float>(B, 100);
  CHECK(allocations_in_steps(conv, E{}, conv_state, q, q, q, out, 50) == 0);
}

}  // namespace test_allocation
