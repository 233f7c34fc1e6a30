// Thread safety (issue 7, item 4): a const attention object is shared by
// threads. Many std::threads call forward concurrently on one const object,
// each with its own output, and every result is bit-identical to the same
// call made alone; threads stepping their own states through one const object
// reproduce the single-threaded decode bit for bit. The single-threaded
// results are themselves checked against the long-double oracles, so the
// comparison is anchored to the definitions, not only to the kernel.
//
// States are per sequence: one state is stepped by one thread at a time
// (docs/numerics.md); this test never shares a state between threads.
//
// Kept small (a few hundred tokens, 8 threads) so that it also runs under
// ThreadSanitizer in seconds. The cpu backend runs OpenMP inside each call;
// OpenMP nested under std::threads gives each thread its own team.
#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "oracles/latte_oracle.hpp"
#include "oracles/linear_oracle.hpp"
#include "oracles/macchiato_oracle.hpp"
#include "oracles/softmax_oracle.hpp"
#include "support.hpp"

namespace test_thread_safety {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;

constexpr int kThreads = 8;
constexpr int kRepeats = 2;

/// Runs `work(thread_index)` on kThreads threads released together; returns
/// one failure message per thread (empty: that thread's results were right).
std::vector<std::string> run_together(const std::function<std::string(int)>& work) {
  std::vector<std::string> failures(kThreads);
  std::atomic<int> arrived{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  threads.reserve(kThreads);
  for (int i = 0; i < kThreads; ++i)
    threads.emplace_back([&, i] {
      arrived.fetch_add(1);
      while (!go.load()) std::this_thread::yield();
      try {
        failures[static_cast<std::size_t>(i)] = work(i);
      } catch (const std::exception& error) {
        failures[static_cast<std::size_t>(i)] = std::string("threw: ") + error.what();
      }
    });
  while (arrived.load() < kThreads) std::this_thread::yield();
  go.store(true);
  for (auto& thread : threads) thread.join();
  return failures;
}

void check_no_failures(const std::vector<std::string>& failures) {
  for (std::size_t i = 0; i < failures.size(); ++i) {
    INFO("thread " << i << ": " << failures[i]);
    CHECK(failures[i].empty());
  }
}

/// Calls `forward(out)` alone, then from kThreads threads at once (each with
/// its own out, kRepeats times): every concurrent out must equal the lone one
/// bit for bit. Returns the lone result.
template <class T>
Tensor<T, 4> check_concurrent_forward(const std::array<index_t, 4>& out_extents,
                                      const std::function<void(TensorView<T, 4>)>& forward) {
  Tensor<T, 4> alone(out_extents);
  forward(alone.view());
  std::vector<Tensor<T, 4>> outs(kThreads, Tensor<T, 4>(out_extents));
  check_no_failures(run_together([&](int i) -> std::string {
    auto& out = outs[static_cast<std::size_t>(i)];
    for (int r = 0; r < kRepeats; ++r) {
      out.fill(T(-7));
      forward(out.view());
      if (!bit_equal(out, alone))
        return "repeat " + std::to_string(r) + " differs from the lone call";
    }
    return {};
  }));
  return alone;
}

std::vector<long double> rope_schedule(index_t heads, index_t dim) {
  std::vector<long double> angles;
  for (index_t h = 0; h < heads; ++h)
    for (index_t i = 0; i < dim / 2; ++i)
      angles.push_back(std::pow(10000.0L, -2.0L * i / (long double)dim));
  return angles;
}

// ------------------------------------------------------------- forward --

TEST_CASE("Latte causal + VAPOR, exec::cpu: concurrent forward on one const object") {
  Rng rng(101);
  // B * H = 1 and T = 1024: the cpu kernel splits time into segments (its
  // two-pass path); B * H = 6, T = 97: one (b, h) per task.
  for (const std::array<index_t, 5> shape :
       {std::array<index_t, 5>{1, 1024, 1, 16, 16}, std::array<index_t, 5>{2, 97, 3, 7, 10}}) {
    const auto [B, Tn, H, L, Dv] = shape;
    const auto q = random_tensor<float, 4>(rng, {B, Tn, H, L}, 2.0);
    const auto k = random_tensor<float, 4>(rng, {B, Tn, H, L}, 2.0);
    const auto v = uniform_tensor<float, 4>(rng, {B, Tn, H, Dv}, -1, 1);
    const LatteAttention<Causal, RunningMax, VAPOR> attention(
        {.heads = H, .latents = L, .value_dim = Dv});
    const auto alone = check_concurrent_forward<float>(
        v.extents(), [&](TensorView<float, 4> out) { attention.forward(exec::cpu, q, k, v, out); });
    CHECK(relative_error(alone, latte_oracle(true, q, k, v, rope_schedule(H, Dv))) <=
          Tolerance<float>::relative);
  }
}

TEST_CASE("Latte bidirectional, exec::cpu: concurrent forward on one const object") {
  Rng rng(102);
  const index_t B = 2, Tn = 150, H = 3, L = 16, Dv = 24;
  const auto q = random_tensor<double, 4>(rng, {B, Tn, H, L}, 2.0);
  const auto k = random_tensor<double, 4>(rng, {B, Tn, H, L}, 2.0);
  const auto v = uniform_tensor<double, 4>(rng, {B, Tn, H, Dv}, -1, 1);
  const LatteAttention<Bidirectional> attention({.heads = H, .latents = L, .value_dim = Dv});
  const auto alone = check_concurrent_forward<double>(
      v.extents(), [&](TensorView<double, 4> out) { attention.forward(exec::cpu, q, k, v, out); });
  CHECK(relative_error(alone, latte_oracle(false, q, k, v)) <= Tolerance<double>::relative);
}

TEST_CASE("Softmax causal and sliding window, exec::cpu: concurrent forward on one const object") {
  Rng rng(103);
  const index_t B = 2, Tn = 130, H = 2, Dk = 16, Dv = 12;
  const auto q = random_tensor<float, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto k = random_tensor<float, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto v = uniform_tensor<float, 4>(rng, {B, Tn, H, Dv}, -1, 1);
  const long double scale = 1.0L / std::sqrt((long double)Dk);
  const SoftmaxAttention<Causal> causal({.heads = H, .key_dim = Dk, .value_dim = Dv});
  const auto causal_alone = check_concurrent_forward<float>(
      v.extents(), [&](TensorView<float, 4> out) { causal.forward(exec::cpu, q, k, v, out); });
  CHECK(relative_error(causal_alone, softmax_oracle({.causal = true}, scale, q, k, v)) <=
        Tolerance<float>::relative);
  const SoftmaxAttention<Bidirectional, SlidingWindow> windowed(
      {.heads = H, .key_dim = Dk, .value_dim = Dv}, SlidingWindow{.left = 17, .right = 5});
  const auto windowed_alone = check_concurrent_forward<float>(
      v.extents(), [&](TensorView<float, 4> out) { windowed.forward(exec::cpu, q, k, v, out); });
  CHECK(relative_error(windowed_alone,
                       softmax_oracle({.causal = false, .left = 17, .right = 5}, scale, q, k, v)) <=
        Tolerance<float>::relative);
}

TEST_CASE("LatteMacchiato and LinearAttention, exec::reference: concurrent forward") {
  Rng rng(104);
  const index_t B = 2, Tn = 40, H = 2, L = 5, Dk = 6, Dv = 8, w = 4;
  const auto q = random_tensor<double, 4>(rng, {B, Tn, H, L + 1}, 1.5);
  const auto k = random_tensor<double, 4>(rng, {B, Tn, H, L}, 1.5);
  const auto wq = random_tensor<double, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto wk = random_tensor<double, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto v = uniform_tensor<double, 4>(rng, {B, Tn, H, Dv}, -1, 1);
  const LatteMacchiato<Causal, RunningMax, VAPOR, RoPE> macchiato(
      {.heads = H, .latents = L, .key_dim = Dk, .value_dim = Dv, .window = w});
  const auto macchiato_alone = check_concurrent_forward<double>(
      v.extents(),
      [&](TensorView<double, 4> out) { macchiato.forward(exec::reference, q, k, wq, wk, v, out); });
  const MacchiatoSpec spec{.causal = true, .window = w, .scale = 1.0L / std::sqrt((long double)Dk)};
  CHECK(relative_error(macchiato_alone,
                       macchiato_oracle(spec, q, k, wq, wk, v, rope_schedule(H, Dv),
                                        rope_schedule(H, Dk))) <= Tolerance<double>::relative);

  const LinearAttention<Causal, EluPlusOne> linear({.heads = H, .key_dim = Dk, .value_dim = Dv});
  const auto linear_alone = check_concurrent_forward<double>(
      v.extents(),
      [&](TensorView<double, 4> out) { linear.forward(exec::reference, wq, wk, v, out); });
  LinearOracleSpec linear_spec{.causal = true, .feature = oracle_elu_plus_one};
  CHECK(relative_error(linear_alone, linear_oracle(linear_spec, wq, wk, v)) <=
        Tolerance<double>::relative);
}

// -------------------------------------------------------------- decode --

/// Steps `state` through every token of (q, k, v) and returns the outputs.
template <class E, class Attention, class T, class State>
Tensor<T, 4> decode(const Attention& attention, State& state, const Tensor<T, 4>& q,
                    const Tensor<T, 4>& k, const Tensor<T, 4>& v) {
  Tensor<T, 4> out({v.extent(0), v.extent(1), v.extent(2), v.extent(3)});
  Tensor<T, 3> row({v.extent(0), v.extent(2), v.extent(3)});
  for (index_t t = 0; t < q.extent(1); ++t) {
    attention.step(E{}, state, time_step(q, t), time_step(k, t), time_step(v, t), row.view());
    set_time_step(out, t, row);
  }
  return out;
}

TEST_CASE("concurrent step: each thread its own state, one const attention object") {
  Rng rng(105);
  const index_t B = 2, Tn = 60, H = 3, L = 8, Dk = 8, Dv = 10;
  const auto latent_q = random_tensor<float, 4>(rng, {B, Tn, H, L}, 2.0);
  const auto latent_k = random_tensor<float, 4>(rng, {B, Tn, H, L}, 2.0);
  const auto q = random_tensor<float, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto k = random_tensor<float, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto v = uniform_tensor<float, 4>(rng, {B, Tn, H, Dv}, -1, 1);

  SUBCASE("LatteAttention<causal, running_max, vapor>, exec::cpu") {
    const LatteAttention<Causal, RunningMax, VAPOR> attention(
        {.heads = H, .latents = L, .value_dim = Dv});
    auto lone_state = attention.make_state<float>(B);
    const auto alone = decode<exec::cpu_t>(attention, lone_state, latent_q, latent_k, v);
    CHECK(relative_error(alone, latte_oracle(true, latent_q, latent_k, v, rope_schedule(H, Dv))) <=
          Tolerance<float>::relative);
    check_no_failures(run_together([&](int) -> std::string {
      auto state = attention.make_state<float>(B);
      const auto mine = decode<exec::cpu_t>(attention, state, latent_q, latent_k, v);
      return bit_equal(mine, alone) ? "" : "decode differs from the lone decode";
    }));
  }
  SUBCASE("SoftmaxAttention<causal> KV cache, exec::cpu") {
    const SoftmaxAttention<Causal> attention({.heads = H, .key_dim = Dk, .value_dim = Dv});
    auto lone_state = attention.make_state<float>(B, Tn);
    const auto alone = decode<exec::cpu_t>(attention, lone_state, q, k, v);
    CHECK(relative_error(alone, softmax_oracle({.causal = true}, 1.0L / std::sqrt((long double)Dk),
                                               q, k, v)) <= Tolerance<float>::relative);
    check_no_failures(run_together([&](int) -> std::string {
      auto state = attention.make_state<float>(B, Tn);
      const auto mine = decode<exec::cpu_t>(attention, state, q, k, v);
      return bit_equal(mine, alone) ? "" : "decode differs from the lone decode";
    }));
  }
  SUBCASE("LinearAttention<causal, elu_plus_one>, exec::reference") {
    const LinearAttention<Causal, EluPlusOne> attention(
        {.heads = H, .key_dim = Dk, .value_dim = Dv});
    auto lone_state = attention.make_state<float>(B);
    const auto alone = decode<exec::reference_t>(attention, lone_state, q, k, v);
    LinearOracleSpec spec{.causal = true, .feature = oracle_elu_plus_one};
    CHECK(relative_error(alone, linear_oracle(spec, q, k, v)) <= Tolerance<float>::relative);
    check_no_failures(run_together([&](int) -> std::string {
      auto state = attention.make_state<float>(B);
      const auto mine = decode<exec::reference_t>(attention, state, q, k, v);
      return bit_equal(mine, alone) ? "" : "decode differs from the lone decode";
    }));
  }
}

TEST_CASE("forward and step threads mixed on one const Latte object (exec::cpu)") {
  Rng rng(106);
  const index_t B = 1, Tn = 300, H = 2, L = 8, Dv = 8;
  const auto q = random_tensor<float, 4>(rng, {B, Tn, H, L}, 2.0);
  const auto k = random_tensor<float, 4>(rng, {B, Tn, H, L}, 2.0);
  const auto v = uniform_tensor<float, 4>(rng, {B, Tn, H, Dv}, -1, 1);
  const LatteAttention<Causal, RunningMax, VAPOR> attention(
      {.heads = H, .latents = L, .value_dim = Dv});
  Tensor<float, 4> whole(v.extents());
  attention.forward(exec::cpu, q, k, v, whole.view());
  auto lone_state = attention.make_state<float>(B);
  const auto stepped = decode<exec::cpu_t>(attention, lone_state, q, k, v);
  const auto oracle = latte_oracle(true, q, k, v, rope_schedule(H, Dv));
  CHECK(relative_error(whole, oracle) <= Tolerance<float>::relative);
  CHECK(relative_error(stepped, oracle) <= Tolerance<float>::relative);
  check_no_failures(run_together([&](int i) -> std::string {
    if (i % 2 == 0) {
      Tensor<float, 4> out(v.extents());
      attention.forward(exec::cpu, q, k, v, out.view());
      return bit_equal(out, whole) ? "" : "forward differs from the lone forward";
    }
    auto state = attention.make_state<float>(B);
    // Prefill half with forward(state), decode the rest.
    Tensor<float, 4> out(v.extents()), head({B, Tn / 2, H, Dv});
    attention.forward(exec::cpu, time_slice(q, 0, Tn / 2), time_slice(k, 0, Tn / 2),
                      time_slice(v, 0, Tn / 2), head.view(), state);
    for (index_t t = 0; t < Tn / 2; ++t) set_time_step(out, t, time_step(head, t));
    Tensor<float, 3> row({B, H, Dv});
    for (index_t t = Tn / 2; t < Tn; ++t) {
      attention.step(exec::cpu, state, time_step(q, t), time_step(k, t), time_step(v, t),
                     row.view());
      set_time_step(out, t, row);
    }
    // Prefill + decode is a different summation order than forward: compare to the oracle.
    return relative_error(out, oracle) <= Tolerance<float>::relative
               ? ""
               : "prefill + decode off the oracle";
  }));
}

}  // namespace

}  // namespace test_thread_safety
