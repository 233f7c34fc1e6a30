// Decode equivalence: forward(T) == prefill(T1) + (T - T1) steps (both equal to
// the oracle), chunked prefill, positions continuing across calls (VAPOR), and
// save/restore continuing bit-exactly.
#include <doctest/doctest.h>

#include <cstdio>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "oracles/latte_oracle.hpp"
#include "oracles/softmax_oracle.hpp"
#include "support.hpp"

namespace test_decode {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;

constexpr int kCases = 60;

std::vector<long double> rope_angles(index_t H, index_t Dv) {
  std::vector<long double> angles;
  for (index_t h = 0; h < H; ++h)
    for (index_t i = 0; i < Dv / 2; ++i)
      angles.push_back(std::pow(10000.0L, -2.0L * i / (long double)Dv));
  return angles;
}

/// Runs prefill of the first `prefill` tokens through forward(..., state), the
/// rest through step(), and returns the whole output.
template <class E, class Attention, class T, class State>
Tensor<T, 4> prefill_then_step(const Attention& attention, State& state, const Tensor<T, 4>& q,
                               const Tensor<T, 4>& k, const Tensor<T, 4>& v, index_t prefill) {
  const index_t Tn = q.extent(1);
  Tensor<T, 4> out({v.extent(0), Tn, v.extent(2), v.extent(3)});
  Tensor<T, 4> head_out({v.extent(0), prefill, v.extent(2), v.extent(3)});
  attention.forward(E{}, time_slice(q, 0, prefill), time_slice(k, 0, prefill),
                    time_slice(v, 0, prefill), head_out.view(), state);
  for (index_t t = 0; t < prefill; ++t) set_time_step(out, t, time_step(head_out, t));
  Tensor<T, 3> row({v.extent(0), v.extent(2), v.extent(3)});
  for (index_t t = prefill; t < Tn; ++t) {
    attention.step(E{}, state, time_step(q, t), time_step(k, t), time_step(v, t),
                   row.view());
    set_time_step(out, t, row);
  }
  return out;
}

template <class E, class T, class Pos>
void latte_decode_cases(std::uint64_t seed) {
  Rng rng(seed);
  double worst = 0;
  const int cases_run = case_count(kCases);
  for (int c = 0; c < cases_run; ++c) {
    const Shape s = random_shape(rng, 1e7);
    const auto q = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, s.latents}, 2.0);
    const auto k = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, s.latents}, 2.0);
    const auto v = uniform_tensor<T, 4>(rng, {s.batch, s.time, s.heads, s.value_dim}, -1, 1);
    const LatteAttention<Causal, RunningMax, Pos> attention(
        {.heads = s.heads, .latents = s.latents, .value_dim = s.value_dim});
    const auto oracle = latte_oracle(true, q, k, v,
                                     Pos::rotates_values ? rope_angles(s.heads, s.value_dim)
                                                         : std::vector<long double>{});
    Tensor<T, 4> whole(v.extents());
    attention.forward(E{}, q, k, v, whole.view());

    const index_t prefill = std::uniform_int_distribution<index_t>(0, s.time)(rng);
    auto state = attention.template make_state<T>(s.batch);
    const auto decoded = prefill_then_step<E>(attention, state, q, k, v, prefill);
    CHECK(state.position() == s.time);

    const double error_whole = relative_error(whole, oracle);
    const double error_decoded = relative_error(decoded, oracle);
    CHECK_MESSAGE(error_whole <= Tolerance<T>::relative, "case " << c);
    CHECK_MESSAGE(error_decoded <= Tolerance<T>::relative,
                  "case " << c << " T=" << s.time << " prefill=" << prefill);
    worst = std::max({worst, error_whole, error_decoded});
  }
  std::printf("[decode] (%s) LatteAttention<Causal,RunningMax,%s> %s cases=%d "
              "max_rel_error=%.3e\n",
              E::name, Pos::name, dtype_name<T>(), cases_run, worst);
}

template <class E, class T, class Win>
void softmax_decode_cases(std::uint64_t seed) {
  Rng rng(seed);
  double worst = 0;
  const int cases_run = case_count(kCases);
  for (int c = 0; c < cases_run; ++c) {
    const Shape s = random_shape(rng, 1e7);
    const index_t Dk = s.latents;
    const auto q = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, Dk}, 1.0);
    const auto k = random_tensor<T, 4>(rng, {s.batch, s.time, s.heads, Dk}, 1.0);
    const auto v = uniform_tensor<T, 4>(rng, {s.batch, s.time, s.heads, s.value_dim}, -1, 1);
    Win window{};
    MaskSpec mask{.causal = true};
    if constexpr (std::is_same_v<Win, SlidingWindow>) {
      window.left = std::uniform_int_distribution<index_t>(0, s.time + 1)(rng);
      mask.left = window.left;
    }
    const SoftmaxAttention<Causal, Win> attention(
        {.heads = s.heads, .key_dim = Dk, .value_dim = s.value_dim}, window);
    const auto oracle =
        softmax_oracle(mask, 1.0L / std::sqrt((long double)Dk), q, k, v);
    const index_t prefill = std::uniform_int_distribution<index_t>(0, s.time)(rng);
    auto cache = attention.template make_state<T>(s.batch, s.time);
    const auto decoded = prefill_then_step<E>(attention, cache, q, k, v, prefill);
    const double error = relative_error(decoded, oracle);
    CHECK_MESSAGE(error <= Tolerance<T>::relative,
                  "case " << c << " T=" << s.time << " prefill=" << prefill);
    worst = std::max(worst, error);
    // The same sequence as two prefills: the second continues the cache (on
    // exec::cpu with a window, blocked, its first rows reading the cache).
    auto chunked = attention.template make_state<T>(s.batch, s.time);
    Tensor<T, 4> out(oracle.extents()), first_out({s.batch, prefill, s.heads, s.value_dim}),
        rest_out({s.batch, s.time - prefill, s.heads, s.value_dim});
    attention.forward(E{}, time_slice(q, 0, prefill).view(), time_slice(k, 0, prefill).view(),
                      time_slice(v, 0, prefill).view(), first_out.view(), chunked);
    const index_t rest = s.time - prefill;
    attention.forward(E{}, time_slice(q, prefill, rest).view(), time_slice(k, prefill, rest).view(),
                      time_slice(v, prefill, rest).view(), rest_out.view(), chunked);
    for (index_t t = 0; t < s.time; ++t)
      set_time_step(out, t, t < prefill ? time_step(first_out, t) : time_step(rest_out, t - prefill));
    CHECK_MESSAGE(relative_error(out, oracle) <= Tolerance<T>::relative,
                  "two prefills: case " << c << " T=" << s.time << " first=" << prefill);
  }
  std::printf("[decode] (%s) SoftmaxAttention<Causal,%s> (KV cache) %s cases=%d "
              "max_rel_error=%.3e\n",
              E::name, Win::name, dtype_name<T>(), cases_run, worst);
}

}  // namespace

TEST_CASE_TEMPLATE("Latte: prefill + steps == forward == oracle", E, exec::reference_t,
                   exec::cpu_t) {
  latte_decode_cases<E, float, NoPositional>(301);
  latte_decode_cases<E, double, NoPositional>(302);
}
TEST_CASE_TEMPLATE("Latte VAPOR: positions continue across forward and step", E,
                   exec::reference_t, exec::cpu_t) {
  latte_decode_cases<E, float, VAPOR>(303);
  latte_decode_cases<E, double, VAPOR>(304);
}
TEST_CASE_TEMPLATE("Softmax KV cache: prefill + steps == oracle", E, exec::reference_t,
                   exec::cpu_t) {
  softmax_decode_cases<E, float, NoWindow>(305);
  softmax_decode_cases<E, double, NoWindow>(306);
  softmax_decode_cases<E, float, SlidingWindow>(307);
  softmax_decode_cases<E, double, SlidingWindow>(308);
}

TEST_CASE("cpu: one head split into time segments (two-pass scan) == oracle") {
#if defined(_OPENMP)
  omp_set_num_threads(std::max(2, omp_get_max_threads()));  // force several segments
#endif
  Rng rng(313);
  for (const double spread : {2.0, 2000.0}) {
    const index_t Tn = 3001, L = 5, Dv = 6;
    const auto q = random_tensor<double, 4>(rng, {1, Tn, 1, L}, 2.0);
    auto k = uniform_tensor<double, 4>(rng, {1, Tn, 1, L}, -spread / 2, spread / 2);
    k(0, 2000, 0, 1) = spread;  // a new maximum deep inside a later segment
    const auto v = uniform_tensor<double, 4>(rng, {1, Tn, 1, Dv}, -1, 1);
    const LatteAttention<Causal, RunningMax, VAPOR> attention({1, L, Dv});
    const auto oracle = latte_oracle(true, q, k, v, rope_angles(1, Dv));
    Tensor<double, 4> out(v.extents());
    attention.forward(exec::cpu, q, k, v, out.view());
    CHECK(relative_error(out, oracle) <= Tolerance<double>::relative);
    // The same through a state that already holds a prefix, then compare the tail.
    auto state = attention.make_state<double>(1);
    Tensor<double, 4> head({1, 700, 1, Dv}), tail({1, Tn - 700, 1, Dv});
    attention.forward(exec::cpu, time_slice(q, 0, 700), time_slice(k, 0, 700),
                      time_slice(v, 0, 700), head.view(), state);
    attention.forward(exec::cpu, time_slice(q, 700, Tn - 700), time_slice(k, 700, Tn - 700),
                      time_slice(v, 700, Tn - 700), tail.view(), state);
    Tensor<double, 4> joined(v.extents());
    for (index_t t = 0; t < Tn; ++t)
      set_time_step(joined, t, t < 700 ? time_step(head, t) : time_step(tail, t - 700));
    CHECK(relative_error(joined, oracle) <= Tolerance<double>::relative);
    CHECK(state.position() == Tn);
  }
}

TEST_CASE("Latte: chunked prefill equals one forward") {
  Rng rng(309);
  const index_t B = 2, Tn = 97, H = 3, L = 7, Dv = 6;
  const auto q = random_tensor<double, 4>(rng, {B, Tn, H, L}, 3.0);
  const auto k = random_tensor<double, 4>(rng, {B, Tn, H, L}, 3.0);
  const auto v = uniform_tensor<double, 4>(rng, {B, Tn, H, Dv}, -1, 1);
  const LatteAttention<Causal, RunningMax, VAPOR> attention({H, L, Dv});
  const auto oracle = latte_oracle(true, q, k, v, rope_angles(H, Dv));
  auto state = attention.make_state<double>(B);
  Tensor<double, 4> out({B, Tn, H, Dv});
  index_t first = 0;
  for (index_t chunk : {0, 1, 13, 40, 43}) {
    Tensor<double, 4> part({B, chunk, H, Dv});
    attention.forward(exec::reference, time_slice(q, first, chunk), time_slice(k, first, chunk),
                      time_slice(v, first, chunk), part.view(), state);
    for (index_t t = 0; t < chunk; ++t) set_time_step(out, first + t, time_step(part, t));
    first += chunk;
  }
  REQUIRE(first == Tn);
  CHECK(relative_error(out, oracle) <= Tolerance<double>::relative);
}

template <class Attention, class T>
void check_save_restore(const Attention& attention, const Tensor<T, 4>& q, const Tensor<T, 4>& k,
                        const Tensor<T, 4>& v, index_t split,
                        typename Attention::template State<T> state) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = v.extent(2), Dv = v.extent(3);
  Tensor<T, 4> head({B, split, H, Dv});
  attention.forward(exec::reference, time_slice(q, 0, split), time_slice(k, 0, split),
                    time_slice(v, 0, split), head.view(), state);
  const std::vector<std::byte> bytes = state.save();
  auto restored = attention.template load_state<T>(bytes);
  CHECK(restored.position() == state.position());
  CHECK(restored.save() == bytes);
  Tensor<T, 4> rest_original({B, Tn - split, H, Dv}), rest_restored({B, Tn - split, H, Dv});
  attention.forward(exec::reference, time_slice(q, split, Tn - split),
                    time_slice(k, split, Tn - split), time_slice(v, split, Tn - split),
                    rest_original.view(), state);
  attention.forward(exec::reference, time_slice(q, split, Tn - split),
                    time_slice(k, split, Tn - split), time_slice(v, split, Tn - split),
                    rest_restored.view(), restored);
  CHECK(bit_equal(rest_original, rest_restored));
  CHECK(state.save() == restored.save());
}

TEST_CASE("Latte: save/restore continues bit-exactly") {
  Rng rng(310);
  const index_t B = 2, Tn = 64, H = 3, L = 5, Dv = 8;
  const auto q = random_tensor<float, 4>(rng, {B, Tn, H, L}, 4.0);
  const auto k = random_tensor<float, 4>(rng, {B, Tn, H, L}, 4.0);
  const auto v = uniform_tensor<float, 4>(rng, {B, Tn, H, Dv}, -1, 1);
  const LatteAttention<Causal, RunningMax, VAPOR> attention({H, L, Dv});
  check_save_restore(attention, q, k, v, 29, attention.make_state<float>(B, 1000));
  const LatteAttention<Causal> plain({H, L, Dv});
  check_save_restore(plain, q, k, v, 1, plain.make_state<float>(B));
}

TEST_CASE("Softmax KV cache: save/restore continues bit-exactly") {
  Rng rng(311);
  const index_t B = 1, Tn = 50, H = 2, Dk = 4, Dv = 3;
  const auto q = random_tensor<double, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto k = random_tensor<double, 4>(rng, {B, Tn, H, Dk}, 1.0);
  const auto v = uniform_tensor<double, 4>(rng, {B, Tn, H, Dv}, -1, 1);
  const SoftmaxAttention<Causal> full({H, Dk, Dv});
  check_save_restore(full, q, k, v, 20, full.make_state<double>(B, Tn));
  const SoftmaxAttention<Causal, SlidingWindow> windowed({H, Dk, Dv}, {.left = 7});
  check_save_restore(windowed, q, k, v, 33, windowed.make_state<double>(B));
}

TEST_CASE("Latte state size is independent of the context length") {
  const LatteAttention<Causal, RunningMax, VAPOR> attention({4, 16, 8});
  auto state = attention.make_state<float>(1);
  const std::size_t bytes_before = state.bytes();
  Rng rng(312);
  for (index_t n : {10, 1000}) {
    const auto q = random_tensor<float, 4>(rng, {1, n, 4, 16}, 1.0);
    const auto v = uniform_tensor<float, 4>(rng, {1, n, 4, 8}, -1, 1);
    Tensor<float, 4> out({1, n, 4, 8});
    attention.forward(exec::reference, q, q, v, out.view(), state);
    CHECK(state.bytes() == bytes_before);
    CHECK(state.save().size() == attention.make_state<float>(1).save().size());
  }
}

}  // namespace test_decode
