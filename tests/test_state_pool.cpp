// latte::StatePool (serving/state_pool.hpp) for every causal mechanism, on
// exec::reference and exec::cpu, fp32 and fp64: thousands of random operations
// (acquire, packed prefill into chosen slots, one step over any set of slots each
// at its own position, save and restore of one slot, release) against per-sequence
// reference runs (each request's own state through the mechanism's plain forward
// and step), and every request's outputs, when it retires, against the mechanism's
// explicit T x T oracle over the tokens it absorbed. Bad slot handles, double
// releases, a full pool, a slot of another pool, repeated slots, wrong rows and
// damaged bytes are refused by name with every live state unchanged. The same
// operations run twice give the same bits, and step allocates nothing (after a
// first step, which may let the OpenMP runtime set up).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "allocation_counter.hpp"
#include "expect_error.hpp"
#include "gradient_check.hpp"
#include "latte/serving/state_pool.hpp"
#include "mechanism_adaptors.hpp"
#include "support.hpp"
#include "tolerances.hpp"

namespace test_state_pool {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;

constexpr index_t kLongest = 96;  // tokens a request may absorb (KV-cache / context capacity)
constexpr index_t kSlots = 5;

template <class T, class A>
StatePool<A, T> make_pool(const A& attention) {
  if constexpr (state_needs_capacity<A>)
    return StatePool<A, T>(attention, kSlots, kLongest);
  else
    return StatePool<A, T>(attention, kSlots);
}

/// Calls f(std::make_tuple(views[0], ..., views[K - 1])).
template <std::size_t K, class V, class F>
decltype(auto) as_tuple(const std::vector<V>& views, F&& f) {
  return [&]<std::size_t... I>(std::index_sequence<I...>) -> decltype(auto) {
    return f(std::make_tuple(views[I]...));
  }(std::make_index_sequence<K>{});
}

/// One live request: its pool slot, its own state run alone, every token it
/// absorbed ([1, t, H, width] per input) and every output the pool gave it.
template <class T, class A>
struct Request {
  PoolSlot slot;
  typename A::template State<T> alone;
  std::vector<Tensor<T, 4>> tokens;
  Tensor<T, 4> outputs;
  index_t length = 0;
};

/// A saved slot: its bytes and the request as it was when saved.
template <class T, class A>
struct Saved {
  PoolSlot slot;
  std::vector<std::byte> bytes;
  Request<T, A> request;
};

template <class T, class Mechanism, class E>
struct PoolRun {
  using A = typename Mechanism::Attention;
  using Inputs = LayerInputs<A>;
  static constexpr std::size_t K = Inputs::count;

  E e;
  Rng rng;
  LayerShape shape;
  A attention;
  StatePool<A, T> pool;
  index_t heads, value_dim;
  std::vector<index_t> widths;
  std::vector<Request<T, A>> live;
  std::optional<Saved<T, A>> saved;
  std::vector<T> transcript;  // every output the pool gave, in order (the bit-for-bit check)
  double worst = 0;
  int retired = 0, refused = 0;
  bool count_allocations = false;  // step() then checks that the pool's step allocates nothing

  PoolRun(E exec_tag, std::uint64_t seed, const LayerShape& s)
      : e(exec_tag), rng(seed), shape(s), attention(Mechanism::make(s)), pool(make_pool<T>(attention)) {
    heads = Inputs::heads(attention);
    value_dim = Inputs::value_dim(attention);
    for (const LayerInput& input : Inputs::inputs(attention)) widths.push_back(input.width);
  }

  std::vector<Tensor<T, 4>> random_tokens(index_t rows, index_t count) {
    std::vector<Tensor<T, 4>> out;
    for (index_t w : widths) out.push_back(random_tensor<T, 4>(rng, {rows, count, heads, w}, 1.0));
    return out;
  }

  /// Appends tokens [first, first + count) of row `row` of `x` to the request.
  void absorb(Request<T, A>& r, const std::vector<Tensor<T, 4>>& x, index_t row, index_t first, index_t count,
              const Tensor<T, 4>& out, index_t out_row, index_t out_first) {
    for (std::size_t j = 0; j < K; ++j) {
      Tensor<T, 4> grown({1, r.length + count, heads, widths[j]});
      for (index_t t = 0; t < r.length; ++t)
        for (index_t h = 0; h < heads; ++h)
          for (index_t d = 0; d < widths[j]; ++d) grown(0, t, h, d) = r.tokens[j](0, t, h, d);
      for (index_t t = 0; t < count; ++t)
        for (index_t h = 0; h < heads; ++h)
          for (index_t d = 0; d < widths[j]; ++d) grown(0, r.length + t, h, d) = x[j](row, first + t, h, d);
      r.tokens[j] = std::move(grown);
    }
    Tensor<T, 4> grown({1, r.length + count, heads, value_dim});
    for (index_t t = 0; t < r.length; ++t)
      for (index_t h = 0; h < heads; ++h)
        for (index_t d = 0; d < value_dim; ++d) grown(0, t, h, d) = r.outputs(0, t, h, d);
    for (index_t t = 0; t < count; ++t)
      for (index_t h = 0; h < heads; ++h)
        for (index_t d = 0; d < value_dim; ++d) {
          grown(0, r.length + t, h, d) = out(out_row, out_first + t, h, d);
          transcript.push_back(out(out_row, out_first + t, h, d));
        }
    r.outputs = std::move(grown);
    r.length += count;
  }

  /// The request's own state, run alone over the same tokens, gives the same outputs.
  void check_alone(Request<T, A>& r, index_t first, index_t count) {
    std::vector<Tensor<T, 4>> part;
    for (const Tensor<T, 4>& x : r.tokens) part.push_back(time_slice(x, first, count));
    Tensor<T, 4> out({1, count, heads, value_dim});
    std::vector<TensorView<const T, 4>> views;
    for (const Tensor<T, 4>& x : part) views.push_back(x.cview());
    as_tuple<K>(views, [&](const auto& tuple) {
      std::apply([&](const auto&... v) { attention.forward(e, v..., out.view(), r.alone); }, tuple);
    });
    const Tensor<T, 4> got = time_slice(r.outputs, first, count);
    const double error = relative_error(got, to_long_double(out));
    CHECK(error <= Tolerance<T>::relative);
    worst = std::max(worst, error);
  }

  std::vector<std::vector<std::byte>> live_bytes() const {
    std::vector<std::vector<std::byte>> bytes;
    for (const auto& r : live) bytes.push_back(pool.save(r.slot));
    return bytes;
  }

  /// `call` must be refused naming `argument`, with the pool unchanged.
  template <class F>
  void refused_unchanged(F&& call, const char* argument) {
    const auto before = live_bytes();
    const index_t count = pool.live();
    expect_error(call, argument, "");
    CHECK(live_bytes() == before);
    CHECK(pool.live() == count);
    ++refused;
  }

  void acquire() {
    if (pool.live() == pool.capacity()) {
      refused_unchanged([&] { (void)pool.acquire(); }, "pool");
      return;
    }
    Request<T, A> r{pool.acquire(), fresh_state<T>(attention, kLongest), {}, Tensor<T, 4>({1, 0, heads, value_dim}), 0};
    for (index_t w : widths) r.tokens.push_back(Tensor<T, 4>({1, 0, heads, w}));
    live.push_back(std::move(r));
  }

  void retire(std::size_t i) {
    Request<T, A>& r = live[i];
    if (r.length > 0) {
      std::vector<TensorLD<4>> inputs;
      for (const Tensor<T, 4>& x : r.tokens) inputs.push_back(to_long_double(x));
      const TensorLD<4> oracle = Mechanism::oracle(shape, Mechanism::parameters(attention), inputs);
      const double error = relative_error(r.outputs, oracle);
      CHECK(error <= Tolerance<T>::relative);
      worst = std::max(worst, error);
    }
    const PoolSlot slot = r.slot;
    pool.release(slot);
    if (saved && saved->slot == slot) saved.reset();
    live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
    ++retired;
    refused_unchanged([&] { pool.release(slot); }, "slot");  // a double release
  }

  /// A random subset of the live requests (distinct, in random order) with room for `tokens`.
  std::vector<std::size_t> pick_live(index_t tokens) {
    std::vector<std::size_t> chosen;
    for (std::size_t i = 0; i < live.size(); ++i)
      if (live[i].length + tokens <= kLongest && std::uniform_int_distribution<int>(0, 2)(rng) > 0)
        chosen.push_back(i);
    std::shuffle(chosen.begin(), chosen.end(), rng);
    return chosen;
  }

  void prefill() {
    std::vector<std::size_t> chosen = pick_live(12);
    if (chosen.empty()) return;
    std::vector<index_t> lengths, cu{0};
    for (std::size_t i = 0; i < chosen.size(); ++i) {
      lengths.push_back(std::uniform_int_distribution<index_t>(0, 12)(rng));
      cu.push_back(cu.back() + lengths.back());
    }
    const std::vector<Tensor<T, 4>> x = random_tokens(1, cu.back());
    Tensor<T, 4> out({1, cu.back(), heads, value_dim});
    std::vector<PoolSlot> slots;
    for (std::size_t i : chosen) slots.push_back(live[i].slot);
    std::vector<TensorView<const T, 4>> views;
    for (const Tensor<T, 4>& t : x) views.push_back(t.cview());
    as_tuple<K>(views, [&](const auto& tuple) {
      pool.forward_packed(e, std::span<const PoolSlot>(slots), std::span<const index_t>(cu), tuple, out.view());
    });
    for (std::size_t n = 0; n < chosen.size(); ++n) {
      Request<T, A>& r = live[chosen[n]];
      const index_t first = r.length;
      absorb(r, x, 0, cu[n], lengths[n], out, 0, cu[n]);
      check_alone(r, first, lengths[n]);
    }
  }

  void step() {
    std::vector<std::size_t> chosen = pick_live(1);
    const index_t N = static_cast<index_t>(chosen.size());
    const std::vector<Tensor<T, 4>> x = random_tokens(N, 1);  // [N, 1, H, w]: row n for chosen[n]
    std::vector<Tensor<T, 3>> rows;
    for (const Tensor<T, 4>& t : x) {
      Tensor<T, 3> r({N, heads, t.extent(3)});
      for (index_t n = 0; n < N; ++n)
        for (index_t h = 0; h < heads; ++h)
          for (index_t d = 0; d < t.extent(3); ++d) r(n, h, d) = t(n, 0, h, d);
      rows.push_back(std::move(r));
    }
    Tensor<T, 3> out({N, heads, value_dim});
    std::vector<PoolSlot> slots;
    for (std::size_t i : chosen) slots.push_back(live[i].slot);
    std::vector<TensorView<const T, 3>> views;
    for (const Tensor<T, 3>& r : rows) views.push_back(r.cview());
    as_tuple<K>(views, [&](const auto& tuple) {
      const long before = allocations.load();
      pool.step(e, std::span<const PoolSlot>(slots), tuple, out.view());
      if (count_allocations) CHECK(allocations.load() == before);
      if (N >= 2) {  // a slot twice, and a row too few: refused, nothing moves
        std::vector<PoolSlot> twice = slots;
        twice.back() = twice.front();
        refused_unchanged([&] { pool.step(e, std::span<const PoolSlot>(twice), tuple, out.view()); }, "slots");
        refused_unchanged([&] {
          pool.step(e, std::span<const PoolSlot>(slots).first(slots.size() - 1), tuple, out.view());
        }, "out");
      }
    });
    Tensor<T, 4> out4({N, 1, heads, value_dim});
    for (index_t n = 0; n < N; ++n)
      for (index_t h = 0; h < heads; ++h)
        for (index_t d = 0; d < value_dim; ++d) out4(n, 0, h, d) = out(n, h, d);
    for (index_t n = 0; n < N; ++n) {
      Request<T, A>& r = live[chosen[static_cast<std::size_t>(n)]];
      const index_t first = r.length;
      absorb(r, x, n, 0, 1, out4, n, 0);
      check_alone(r, first, 1);
    }
  }

  void save_or_restore() {
    if (live.empty()) return;
    if (!saved || std::uniform_int_distribution<int>(0, 1)(rng) == 0) {
      Request<T, A>& r = live[std::uniform_int_distribution<std::size_t>(0, live.size() - 1)(rng)];
      saved = Saved<T, A>{r.slot, pool.save(r.slot), r};
      return;
    }
    auto it = std::find_if(live.begin(), live.end(), [&](const auto& r) { return r.slot == saved->slot; });
    REQUIRE(it != live.end());
    std::vector<std::byte> damaged = saved->bytes;
    damaged[damaged.size() / 2] ^= std::byte{1};
    refused_unchanged([&] { pool.restore(it->slot, damaged); }, "bytes");
    pool.restore(it->slot, saved->bytes);
    *it = saved->request;  // the request as it was: its tokens, outputs and state run alone
  }

  void bad_handles() {
    if (live.empty()) return;
    const PoolSlot slot = live.front().slot;
    PoolSlot out_of_range = slot;
    out_of_range.index = kSlots + 3;
    refused_unchanged([&] { pool.release(out_of_range); }, "slot");
    StatePool<A, T> other = make_pool<T>(attention);
    const PoolSlot foreign = other.acquire();
    refused_unchanged([&] { (void)pool.save(foreign); }, "slot");
    refused_unchanged([&] { pool.release(PoolSlot{}); }, "slot");
  }

  void run(int operations) {
    for (int op = 0; op < operations; ++op) {
      CAPTURE(op);
      switch (std::uniform_int_distribution<int>(0, 9)(rng)) {
        case 0: case 1: acquire(); break;
        case 2: if (!live.empty()) retire(std::uniform_int_distribution<std::size_t>(0, live.size() - 1)(rng)); break;
        case 3: case 4: prefill(); break;
        case 5: case 6: case 7: step(); break;
        case 8: save_or_restore(); break;
        default: bad_handles(); break;
      }
    }
    while (!live.empty()) retire(live.size() - 1);
  }
};

template <class T, class Mechanism, class E>
void pool_cases(E e, std::uint64_t seed) {
  const LayerShape shape{1, 0, 2, 3, 4, 4, 0, 2};
  const int operations = case_count(400);
  PoolRun<T, Mechanism, E> first(e, seed, shape);
  first.run(operations);
  PoolRun<T, Mechanism, E> again(e, seed, shape);
  again.run(operations);
  CHECK(first.transcript == again.transcript);  // bit for bit, same thread count
  CHECK(first.retired > 0);
  MESSAGE(std::string(dtype_name<T>()) << " " << std::string(E::name) << ": " << operations << " operations, "
          << first.retired << " requests retired, " << first.refused
          << " bad calls refused, worst relative error " << first.worst);
}

/// Steps over every live slot, after one step that lets a threading runtime set
/// itself up, allocate nothing (operator new counted).
template <class T, class Mechanism, class E>
void step_allocates_nothing(E e, std::uint64_t seed) {
  PoolRun<T, Mechanism, E> run(e, seed, LayerShape{1, 0, 2, 3, 4, 4, 0, 2});
  for (index_t i = 0; i < kSlots; ++i) run.acquire();
  run.prefill();
  run.step();
  run.count_allocations = true;
  for (int i = 0; i < 8; ++i) run.step();
}

template <class Mechanism>
void every_backend(std::uint64_t seed) {
  pool_cases<double, Mechanism>(exec::reference, seed);
  pool_cases<float, Mechanism>(exec::reference, seed + 1);
  pool_cases<double, Mechanism>(exec::cpu, seed + 2);
  pool_cases<float, Mechanism>(exec::cpu, seed + 3);
  step_allocates_nothing<double, Mechanism>(exec::reference, seed + 4);
  step_allocates_nothing<float, Mechanism>(exec::cpu, seed + 5);
}

/// A float pool stepped with bf16 / fp16 activations: each output row is the
/// fp32 step's on the widened inputs, rounded once (the fp32 step is checked
/// against the oracle above), and the states are the fp32 states' bytes. After
/// the first call of a size, a step allocates nothing.
template <HalfFloat H, class Mechanism>
void half_steps(std::uint64_t seed) {
  using A = typename Mechanism::Attention;
  using Inputs = LayerInputs<A>;
  constexpr std::size_t K = Inputs::count;
  Rng rng(seed);
  const LayerShape shape{1, 0, 2, 3, 4, 4, 0, 2};
  const A attention = Mechanism::make(shape);
  const index_t heads = Inputs::heads(attention), value_dim = Inputs::value_dim(attention);
  auto half_pool = make_pool<float>(attention), plain_pool = make_pool<float>(attention);
  std::vector<PoolSlot> half_slots, plain_slots;
  for (int i = 0; i < 3; ++i) {
    half_slots.push_back(half_pool.acquire());
    plain_slots.push_back(plain_pool.acquire());
  }
  int mismatches = 0;
  for (int step = 0; step < 10; ++step) {
    const index_t N = step % 3 + 1;  // the first N slots
    std::vector<Tensor<H, 3>> rows;
    std::vector<Tensor<float, 3>> widened;
    for (const LayerInput& input : Inputs::inputs(attention)) {
      const Tensor<float, 3> draw = random_tensor<float, 3>(rng, {N, heads, input.width}, 1.0);
      Tensor<H, 3> row(draw.extents());
      Tensor<float, 3> wide(draw.extents());
      for (index_t i = 0; i < draw.size(); ++i) {
        row.data()[i] = H(draw.data()[i]);
        wide.data()[i] = static_cast<float>(row.data()[i]);
      }
      rows.push_back(std::move(row));
      widened.push_back(std::move(wide));
    }
    Tensor<H, 3> out({N, heads, value_dim});
    Tensor<float, 3> plain_out({N, heads, value_dim});
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      const long before = allocations.load();
      half_pool.step(exec::cpu, std::span<const PoolSlot>(half_slots).first(static_cast<std::size_t>(N)),
                     std::make_tuple(rows[I].cview()...), out.view());
      if (step >= 3) CHECK(allocations.load() == before);  // every size has been seen
      plain_pool.step(exec::cpu, std::span<const PoolSlot>(plain_slots).first(static_cast<std::size_t>(N)),
                      std::make_tuple(widened[I].cview()...), plain_out.view());
    }(std::make_index_sequence<K>{});
    for (index_t i = 0; i < out.size(); ++i) mismatches += out.data()[i].bits() != H(plain_out.data()[i]).bits();
  }
  CHECK(mismatches == 0);
  for (std::size_t i = 0; i < 3; ++i) CHECK(half_pool.save(half_slots[i]) == plain_pool.save(plain_slots[i]));
  // A 16-bit step is refused like an fp32 one: a row too few, nothing moves.
  const auto before = half_pool.save(half_slots[0]);
  std::vector<Tensor<H, 3>> short_rows;
  for (const LayerInput& input : Inputs::inputs(attention)) short_rows.push_back(Tensor<H, 3>({1, heads, input.width}));
  Tensor<H, 3> out({2, heads, value_dim});
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    expect_error([&] {
      half_pool.step(exec::cpu, std::span<const PoolSlot>(half_slots).first(2), std::make_tuple(short_rows[I].cview()...),
                     out.view());
    }, "inputs[0]", "rows");
  }(std::make_index_sequence<K>{});
  CHECK(half_pool.save(half_slots[0]) == before);
}

}  // namespace

TEST_CASE("StatePool: bf16 / fp16 steps are the fp32 step on the rounded inputs, rounded once") {
  half_steps<bfloat16, LatteMechanism<Causal, VAPOR>>(300);
  half_steps<float16, LatteMechanism<Causal, VAPOR>>(301);
  half_steps<bfloat16, MacchiatoMechanism<Causal>>(302);
  half_steps<bfloat16, SoftmaxMechanism<Causal>>(303);
  half_steps<float16, LinearMechanism<Causal>>(304);
}

TEST_CASE("StatePool: random acquire / prefill / step / save / restore / release against lone runs and the oracle") {
  SUBCASE("Latte, VAPOR") { every_backend<LatteMechanism<Causal, VAPOR>>(200); }
  SUBCASE("Macchiato (VAPOR latents, RoPE window)") { every_backend<MacchiatoMechanism<Causal, VAPOR>>(210); }
  SUBCASE("softmax (KV cache)") { every_backend<SoftmaxMechanism<Causal>>(220); }
  SUBCASE("linear, elu + 1") { every_backend<LinearMechanism<Causal>>(230); }
  SUBCASE("LeaPformer (LeaP modules)") { every_backend<LeaPMechanism<Causal>>(240); }
  SUBCASE("LAVO") { every_backend<LavoMechanism<Causal>>(250); }
  SUBCASE("conv-compression") { every_backend<ConvCompressedMechanism<Causal>>(260); }
}

TEST_CASE("StatePool: a full pool, slots acquired fresh, handles dead after release") {
  const LatteAttention<Causal> attention({.heads = 2, .latents = 3, .value_dim = 4});
  StatePool<LatteAttention<Causal>, float> pool(attention, 2);
  const PoolSlot a = pool.acquire(), b = pool.acquire();
  CHECK(pool.live() == 2);
  expect_error([&] { (void)pool.acquire(); }, "pool", "slots in use");
  const std::vector<std::byte> fresh = pool.save(b);
  Tensor<float, 3> q({1, 2, 3}, 0.5f), k({1, 2, 3}, 0.25f), v({1, 2, 4}, 1.0f), out({1, 2, 4});
  const std::vector<PoolSlot> one{a};
  pool.step(exec::cpu, std::span<const PoolSlot>(one), std::make_tuple(q.cview(), k.cview(), v.cview()), out.view());
  CHECK(pool.state(a).position() == 1);
  pool.release(a);
  expect_error([&] { (void)pool.state(a); }, "slot", "was released");
  const PoolSlot c = pool.acquire();  // the same slot again, fresh, under a new handle
  CHECK(c.index == a.index);
  CHECK(pool.save(c) == fresh);
  expect_error([&] { pool.release(a); }, "slot", "was released");  // the old handle stays dead
  expect_error([&] { StatePool<LatteAttention<Causal>, float>(attention, 0); }, "slots", "");
}

}  // namespace test_state_pool
