// latte::distributed against the single-process result (issue 28): one
// sequence cut across the ranks of MPI_COMM_WORLD, even and uneven slices
// (slices of 0 and 1 tokens), random shapes and adversarial logits (a spread
// of 30 and a jump of the running maximum at a slice boundary); outputs, the
// last rank's decode state and the gradients must equal those of the whole
// sequence on one rank within the oracle tolerances; the bytes each rank hands
// MPI must be the theory's; bad input must make every rank throw the same
// latte::Error. Run under mpirun with 1 to 4 ranks (tests/CMakeLists.txt).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "latte/distributed.hpp"
#include "mpi_bytes.hpp"

namespace {

using latte::index_t;
using latte::Tensor;
using latte::TensorView;

int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}
int world_size() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

/// Every rank draws the same whole-sequence tensors from the same seed.
template <class T>
Tensor<T, 4> random_input(std::mt19937_64& rng, std::array<index_t, 4> extents, double stddev,
                          double shift = 0, index_t shift_from = 0) {
  Tensor<T, 4> tensor(extents);
  std::normal_distribution<double> normal(0.0, stddev);
  for (index_t b = 0; b < extents[0]; ++b)
    for (index_t t = 0; t < extents[1]; ++t)
      for (index_t h = 0; h < extents[2]; ++h)
        for (index_t d = 0; d < extents[3]; ++d)
          tensor(b, t, h, d) = static_cast<T>(normal(rng) + (t >= shift_from ? shift : 0.0));
  return tensor;
}

/// Tokens [first, first + length) of a [B, T, H, D] tensor (a strided view).
template <class T>
TensorView<T, 4> tokens(TensorView<T, 4> whole, std::int64_t first, std::int64_t length) {
  return {whole.data() + first * whole.stride(1),
          {whole.extent(0), static_cast<index_t>(length), whole.extent(2), whole.extent(3)},
          whole.strides()};
}

/// max |a - b| / max(1, max |b|) over a slice of b.
template <class T>
double relative_difference(TensorView<const T, 4> a, TensorView<const T, 4> b) {
  double worst = 0, scale = 1;
  for (index_t i = 0; i < a.extent(0); ++i)
    for (index_t t = 0; t < a.extent(1); ++t)
      for (index_t h = 0; h < a.extent(2); ++h)
        for (index_t d = 0; d < a.extent(3); ++d) {
          worst = std::max(worst, std::abs(double(a(i, t, h, d)) - double(b(i, t, h, d))));
          scale = std::max(scale, std::abs(double(b(i, t, h, d))));
        }
  return worst / scale;
}

/// Where rank `rank`'s slice sits: {first, length, total} of `lengths`.
std::array<std::int64_t, 3> slice_of(const std::vector<std::int64_t>& lengths, int rank) {
  std::int64_t first = 0, total = 0;
  for (int r = 0; r < static_cast<int>(lengths.size()); ++r) {
    if (r == rank) first = total;
    total += lengths[static_cast<std::size_t>(r)];
  }
  return {first, lengths[static_cast<std::size_t>(rank)], total};
}

/// The slices this test cuts a sequence into for `ranks` ranks.
std::vector<std::vector<std::int64_t>> slice_patterns(int ranks) {
  std::vector<std::vector<std::int64_t>> patterns;
  patterns.emplace_back(static_cast<std::size_t>(ranks), 9);  // even
  std::vector<std::int64_t> uneven, edges;
  for (int r = 0; r < ranks; ++r) {
    uneven.push_back(r == 0 ? 0 : r == 1 ? 1 : 5 + 7 * r);   // empty, one token, longer
    edges.push_back(r == ranks - 1 ? 0 : r % 2 ? 1 : 23);      // the last rank empty
  }
  if (ranks == 1) uneven = {1}, edges = {0};
  patterns.push_back(uneven);
  patterns.push_back(edges);
  patterns.emplace_back(static_cast<std::size_t>(ranks), 300);  // past the cpu chunks
  return patterns;
}

template <class T>
double tolerance() {
  return std::is_same_v<T, double> ? 1e-11 : 2e-5;
}

/// Forward, final state and (where the mechanism has one across ranks)
/// backward of `attention` across the ranks against the same calls over the
/// whole sequence on this rank.
template <class T, class Attention, class E>
void check_against_whole(E e, const Attention& attention, index_t B, index_t features,
                         const std::vector<std::int64_t>& lengths, double key_stddev,
                         std::uint64_t seed) {
  const auto dims = latte::distributed::SequenceParallel<Attention>::dims(attention);
  const index_t H = dims[0], Dv = dims[2];
  const int rank = world_rank();
  const std::array<std::int64_t, 3> where = slice_of(lengths, rank);  // (no bindings: clang 14 cannot capture them)
  const std::int64_t first = where[0], length = where[1], total = where[2];
  const index_t Tn = static_cast<index_t>(total);
  std::mt19937_64 rng(seed);
  // Keys jump by +40 from the middle on: the running maximum moves at a slice boundary.
  auto q = random_input<T>(rng, {B, Tn, H, features}, 1.0);
  auto k = random_input<T>(rng, {B, Tn, H, features}, key_stddev, key_stddev > 3 ? 40.0 : 0.0, Tn / 2);
  auto v = random_input<T>(rng, {B, Tn, H, Dv}, 1.0);
  auto d_out = random_input<T>(rng, {B, Tn, H, Dv}, 1.0);
  auto step_q = random_input<T>(rng, {1, B, H, features}, 1.0);
  auto step_k = random_input<T>(rng, {1, B, H, features}, 1.0);
  auto step_v = random_input<T>(rng, {1, B, H, Dv}, 1.0);

  // The whole sequence on this rank.
  Tensor<T, 4> whole_out({B, Tn, H, Dv});
  auto whole_state = attention.template make_state<T>(B);
  attention.forward(e, q.view(), k.view(), v.view(), whole_out.view(), whole_state);

  // This rank's slice.
  auto slice = [&](auto& tensor) {
    return TensorView<const T, 4>(tokens<T>(tensor.view(), first, length));
  };
  Tensor<T, 4> out({B, static_cast<index_t>(length), H, Dv});
  auto state = latte::distributed::forward(e, MPI_COMM_WORLD, attention, slice(q), slice(k),
                                           slice(v), out.view());
  INFO("rank " << rank << " of " << lengths.size() << ", slice [" << first << ", "
                << first + length << ") of " << total);
  CHECK(state.position() == first + length);
  CHECK(relative_difference<T>(out.view(), slice(whole_out)) <= tolerance<T>());

  // The last rank continues the whole sequence: one decode step from each state.
  if (rank == static_cast<int>(lengths.size()) - 1) {
    TensorView<const T, 3> sq({step_q.data(), {B, H, features}}), sk({step_k.data(), {B, H, features}}),
        sv({step_v.data(), {B, H, Dv}});
    Tensor<T, 3> from_parts({B, H, Dv}), from_whole({B, H, Dv});
    attention.step(e, state, sq, sk, sv, from_parts.view());
    attention.step(e, whole_state, sq, sk, sv, from_whole.view());
    TensorView<const T, 4> a(from_parts.data(), {1, B, H, Dv}), b(from_whole.data(), {1, B, H, Dv});
    CHECK(relative_difference<T>(a, b) <= tolerance<T>());
  }

  if constexpr (!latte::distributed::detail::BackwardAcrossRanks<Attention>) return;
  else {  // the gradients, where the mechanism has a backward across ranks
  Tensor<T, 4> whole_dq({B, Tn, H, features}), whole_dk({B, Tn, H, features}), whole_dv({B, Tn, H, Dv});
  typename Attention::template Gradients<T> whole_gradients{whole_dq.view(), whole_dk.view(), whole_dv.view()};
  attention.backward(e, q.view(), k.view(), v.view(), d_out.view(), whole_gradients);
  Tensor<T, 4> dq({B, static_cast<index_t>(length), H, features}),
      dk({B, static_cast<index_t>(length), H, features}), dv({B, static_cast<index_t>(length), H, Dv});
  typename Attention::template Gradients<T> gradients{dq.view(), dk.view(), dv.view()};
  latte::distributed::backward(e, MPI_COMM_WORLD, attention, slice(q), slice(k), slice(v),
                               slice(d_out), gradients);
  CHECK(relative_difference<T>(dq.view(), slice(whole_dq)) <= tolerance<T>());
  CHECK(relative_difference<T>(dk.view(), slice(whole_dk)) <= tolerance<T>());
  CHECK(relative_difference<T>(dv.view(), slice(whole_dv)) <= tolerance<T>());
  }
}

template <class T, class Attention>
void check_all_patterns(const Attention& attention, index_t features, double key_stddev,
                        std::uint64_t seed) {
  for (const auto& lengths : slice_patterns(world_size())) {
    check_against_whole<T>(latte::exec::cpu, attention, 2, features, lengths, key_stddev, seed);
    check_against_whole<T>(latte::exec::reference, attention, 1, features, lengths, key_stddev,
                           seed + 1);
  }
}

using CausalLatte = latte::LatteAttention<latte::Causal, latte::RunningMax>;
using CausalVapor = latte::LatteAttention<latte::Causal, latte::RunningMax, latte::VAPOR>;
using EluLinear = latte::LinearAttention<latte::Causal, latte::EluPlusOne>;
using CosFormer = latte::LinearAttention<latte::Causal, latte::Relu, latte::CosFormerReweight>;
using RopeLinear = latte::LinearAttention<latte::Causal, latte::EluPlusOne, latte::NoReweight, latte::RoPE>;

TEST_CASE("Latte across ranks equals Latte on one rank (fp64 and fp32, spread 1 and 30)") {
  const CausalLatte attention({.heads = 2, .latents = 5, .value_dim = 6});
  check_all_patterns<double>(attention, 5, 1.0, 11);
  check_all_patterns<double>(attention, 5, 30.0, 12);
  check_all_patterns<float>(attention, 5, 3.0, 13);
}

TEST_CASE("Random shapes of the oracle tests and random slices across ranks: Latte and elu+1") {
  // The oracle tests' axes: B in {1, 2}, H in {1, 3, 8}, L (or Dk) in {1, 7, 64}, Dv in
  // {1, 5, 64}; every rank's slice 0-80 tokens; the same draws on every rank.
  std::mt19937_64 rng(121);
  auto pick = [&](std::initializer_list<index_t> from) {
    return *(from.begin() + std::uniform_int_distribution<std::size_t>(0, from.size() - 1)(rng));
  };
  for (int draw = 0; draw < 6; ++draw) {
    const index_t B = pick({1, 2}), H = pick({1, 3, 8}), L = pick({1, 7, 64}), Dv = pick({1, 5, 64});
    std::vector<std::int64_t> lengths;
    for (int r = 0; r < world_size(); ++r)
      lengths.push_back(std::uniform_int_distribution<std::int64_t>(0, 80)(rng));
    const double spread = draw % 2 ? 30.0 : 1.0;
    INFO("draw " << draw << ": B " << B << " H " << H << " L " << L << " Dv " << Dv);
    const CausalLatte latte({.heads = H, .latents = L, .value_dim = Dv});
    check_against_whole<double>(latte::exec::cpu, latte, B, L, lengths, spread, 130 + draw);
    check_against_whole<double>(latte::exec::reference, latte, B, L, lengths, spread, 140 + draw);
    const EluLinear linear({.heads = H, .key_dim = L, .value_dim = Dv});
    check_against_whole<double>(latte::exec::cpu, linear, B, L, lengths, 1.0, 150 + draw);
  }
}

TEST_CASE("Latte with VAPOR across ranks: positions and the angles' gradient") {
  const index_t B = 2, H = 2, L = 4, Dv = 6;
  const CausalVapor attention({.heads = H, .latents = L, .value_dim = Dv});
  check_all_patterns<double>(attention, L, 3.0, 21);
  // The angles' gradient [H, Dv/2], summed over the ranks, accumulated (+=) on every rank.
  const int rank = world_rank();
  std::mt19937_64 rng(22);
  for (const auto& lengths : slice_patterns(world_size())) {
    const std::array<std::int64_t, 3> where = slice_of(lengths, rank);  // (no bindings: clang 14 cannot capture them)
    const std::int64_t first = where[0], slice_length = where[1], total = where[2];
    const index_t Tn = static_cast<index_t>(total), length = static_cast<index_t>(slice_length);
    auto q = random_input<double>(rng, {B, Tn, H, L}, 1.0);
    auto k = random_input<double>(rng, {B, Tn, H, L}, 3.0);
    auto v = random_input<double>(rng, {B, Tn, H, Dv}, 1.0);
    auto d_out = random_input<double>(rng, {B, Tn, H, Dv}, 1.0);
    Tensor<double, 4> dq({B, Tn, H, L}), dk({B, Tn, H, L}), dv({B, Tn, H, Dv});
    Tensor<double, 2> whole_angles({H, Dv / 2}), part_angles({H, Dv / 2}, 1.0);
    attention.backward(latte::exec::cpu, q.view(), k.view(), v.view(), d_out.view(),
                       latte::LatteGradients<double>{dq.view(), dk.view(), dv.view(),
                                                     whole_angles.view()});
    auto slice = [&](auto& x) {
      return TensorView<const double, 4>(tokens<double>(x.view(), first, length));
    };
    Tensor<double, 4> sq({B, length, H, L}), sk({B, length, H, L}), sv({B, length, H, Dv});
    latte::distributed::backward(
        latte::exec::cpu, MPI_COMM_WORLD, attention, slice(q), slice(k), slice(v), slice(d_out),
        latte::LatteGradients<double>{sq.view(), sk.view(), sv.view(), part_angles.view()});
    double worst = 0, scale = 1;
    for (index_t h = 0; h < H; ++h)
      for (index_t i = 0; i < Dv / 2; ++i) {
        worst = std::max(worst, std::abs(part_angles(h, i) - 1.0 - whole_angles(h, i)));
        scale = std::max(scale, std::abs(whole_angles(h, i)));
      }
    INFO("rank " << rank << ", slice [" << first << ", " << first + length << ") of " << total);
    CHECK(worst / scale <= 1e-11);
  }
}

TEST_CASE("The linear family across ranks: elu+1, cosFormer, RoPE") {
  check_all_patterns<double>(EluLinear({.heads = 2, .key_dim = 5, .value_dim = 3}), 5, 1.0, 31);
  const std::int64_t longest = 4 * 300 + 2;
  check_all_patterns<double>(CosFormer({.heads = 2, .key_dim = 4, .value_dim = 3},
                                       {.reweight = {.length = longest}}),
                             4, 1.0, 32);
  check_all_patterns<double>(RopeLinear({.heads = 1, .key_dim = 6, .value_dim = 4}), 6, 1.0, 33);
  check_all_patterns<float>(EluLinear({.heads = 2, .key_dim = 5, .value_dim = 3}), 5, 1.0, 34);
}

std::int64_t sent(const latte_test::MpiBytes& bytes, const std::string& function) {
  const auto found = bytes.sent.find(function);
  return found == bytes.sent.end() ? 0 : found->second;
}

/// A LeaP module of `hidden` units over `features` inputs with N(0, 0.5) weights.
latte::LeaPModule random_module(std::mt19937_64& rng, index_t hidden, index_t features) {
  auto w1 = random_input<double>(rng, {1, 1, hidden, features}, 0.5);
  auto b1 = random_input<double>(rng, {1, 1, 1, hidden}, 0.5);
  auto w2 = random_input<double>(rng, {1, 1, 1, hidden}, 0.5);
  return latte::LeaPModule::from<double>(TensorView<const double, 2>(w1.data(), {hidden, features}),
                                         TensorView<const double, 1>(b1.data(), {hidden}),
                                         TensorView<const double, 1>(w2.data(), {hidden}), 0.1);
}

/// max |a - b| over a module's weights, relative to max(1, max |b|).
double module_difference(const latte::LeaPModule& a, const latte::LeaPModule& b) {
  double worst = std::abs(a.b2 - b.b2), scale = std::max(1.0, std::abs(b.b2));
  auto compare = [&](const double* x, const double* y, index_t n) {
    for (index_t i = 0; i < n; ++i) {
      worst = std::max(worst, std::abs(x[i] - y[i]));
      scale = std::max(scale, std::abs(y[i]));
    }
  };
  compare(a.w1.data(), b.w1.data(), a.w1.size());
  compare(a.b1.data(), b.b1.data(), a.b1.size());
  compare(a.w2.data(), b.w2.data(), a.w2.size());
  return worst / scale;
}

TEST_CASE("LeaPformer with modules across ranks: the modules' weight gradients summed over ranks") {
  using Leap = latte::LinearAttention<latte::Causal, latte::Relu, latte::LeaPReweight>;
  std::mt19937_64 rng(71);
  const index_t Dk = 8, Dv = 3, H = 2, B = 1;
  const Leap attention({.heads = H, .key_dim = Dk, .value_dim = Dv},
                       {.reweight = {.query_module = random_module(rng, 2, Dk),
                                     .key_module = random_module(rng, 2, Dk)}});
  check_all_patterns<double>(attention, Dk, 1.0, 72);
  const int rank = world_rank();
  for (const auto& lengths : slice_patterns(world_size())) {
    const std::array<std::int64_t, 3> where = slice_of(lengths, rank);  // (no bindings: clang 14 cannot capture them)
    const std::int64_t first = where[0], slice_length = where[1], total = where[2];
    const index_t Tn = static_cast<index_t>(total), length = static_cast<index_t>(slice_length);
    auto q = random_input<double>(rng, {B, Tn, H, Dk}, 1.0);
    auto k = random_input<double>(rng, {B, Tn, H, Dk}, 1.0);
    auto v = random_input<double>(rng, {B, Tn, H, Dv}, 1.0);
    auto d_out = random_input<double>(rng, {B, Tn, H, Dv}, 1.0);
    const latte::LeaPModule& own = *attention.options().reweight.query_module;
    latte::LeaPModule whole_q = own.zeros_like(), whole_k = own.zeros_like();
    Tensor<double, 4> dq({B, Tn, H, Dk}), dk({B, Tn, H, Dk}), dv({B, Tn, H, Dv});
    latte::LinearGradients<double> whole{dq.view(), dk.view(), dv.view()};
    whole.d_query_module = &whole_q;
    whole.d_key_module = &whole_k;
    attention.backward(latte::exec::cpu, q.view(), k.view(), v.view(), d_out.view(), whole);
    // Accumulated (+=): start from ones.
    latte::LeaPModule parts_q = own.zeros_like(), parts_k = own.zeros_like();
    auto shift = [](latte::LeaPModule& m, double by) {  // every weight += by
      auto add = [&](auto& t) {
        for (index_t i = 0; i < t.size(); ++i) t.data()[i] += by;
      };
      add(m.w1), add(m.b1), add(m.w2);
      m.b2 += by;
    };
    shift(parts_q, 1.0), shift(parts_k, 1.0);
    Tensor<double, 4> sq({B, length, H, Dk}), sk({B, length, H, Dk}), sv({B, length, H, Dv});
    latte::LinearGradients<double> parts{sq.view(), sk.view(), sv.view()};
    parts.d_query_module = &parts_q;
    parts.d_key_module = &parts_k;
    auto slice = [&](auto& x) { return TensorView<const double, 4>(tokens<double>(x.view(), first, length)); };
    latte::distributed::backward(latte::exec::cpu, MPI_COMM_WORLD, attention, slice(q), slice(k),
                                 slice(v), slice(d_out), parts);
    shift(parts_q, -1.0), shift(parts_k, -1.0);
    INFO("rank " << rank << ", slice [" << first << ", " << first + length << ") of " << total);
    CHECK(module_difference(parts_q, whole_q) <= 1e-11);
    CHECK(module_difference(parts_k, whole_k) <= 1e-11);
  }
}

/// Uniform proportions in [0, 1] [B, T, H], the same on every rank.
Tensor<double, 3> random_proportions(std::mt19937_64& rng, index_t B, index_t Tn, index_t H) {
  Tensor<double, 3> p({B, Tn, H});
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  for (index_t i = 0; i < p.size(); ++i) p.data()[i] = uniform(rng);
  return p;
}

TEST_CASE("LeaPformer with given proportions across ranks: outputs, inputs' and proportions' gradients") {
  using Leap = latte::LinearAttention<latte::Causal, latte::Relu, latte::LeaPReweight>;
  const index_t Dk = 8, Dv = 3, H = 2, B = 2;
  const Leap attention({.heads = H, .key_dim = Dk, .value_dim = Dv});
  std::mt19937_64 rng(73);
  const int rank = world_rank();
  auto check = [&](auto e, const std::vector<std::int64_t>& lengths) {
    const std::array<std::int64_t, 3> where = slice_of(lengths, rank);  // (no bindings: clang 14 cannot capture them)
    const std::int64_t first = where[0], slice_length = where[1], total = where[2];
    const index_t Tn = static_cast<index_t>(total), length = static_cast<index_t>(slice_length);
    auto q = random_input<double>(rng, {B, Tn, H, Dk}, 1.0);
    auto k = random_input<double>(rng, {B, Tn, H, Dk}, 1.0);
    auto v = random_input<double>(rng, {B, Tn, H, Dv}, 1.0);
    auto d_out = random_input<double>(rng, {B, Tn, H, Dv}, 1.0);
    auto pq = random_proportions(rng, B, Tn, H), pk = random_proportions(rng, B, Tn, H);
    // The whole sequence on this rank.
    Tensor<double, 4> whole_out({B, Tn, H, Dv});
    auto whole_state = attention.make_state<double>(B);
    attention.forward(e, q.view(), k.view(), v.view(), {pq.view(), pk.view()}, whole_out.view(),
                      whole_state);
    Tensor<double, 4> dq({B, Tn, H, Dk}), dk({B, Tn, H, Dk}), dv({B, Tn, H, Dv});
    Tensor<double, 3> dpq({B, Tn, H}), dpk({B, Tn, H});
    latte::LinearGradients<double> whole{dq.view(), dk.view(), dv.view()};
    whole.d_query_proportions = dpq.view();
    whole.d_key_proportions = dpk.view();
    attention.backward(e, q.view(), k.view(), v.view(), {pq.view(), pk.view()}, d_out.view(), whole);

    // This rank's slice.
    auto slice = [&](auto& x) {
      return TensorView<const double, 4>(tokens<double>(x.view(), first, length));
    };
    auto slice3 = [&](Tensor<double, 3>& x) {
      return TensorView<double, 3>(x.data() + first * x.view().stride(1), {B, length, H},
                                   x.view().strides());
    };
    const latte::SequenceProportions<double> proportions{slice3(pq), slice3(pk)};
    Tensor<double, 4> out({B, length, H, Dv});
    auto state = latte::distributed::forward(
        e, MPI_COMM_WORLD, attention, std::tuple{slice(q), slice(k), slice(v), proportions},
        out.view());
    INFO("rank " << rank << ", slice [" << first << ", " << first + length << ") of " << total);
    CHECK(state.position() == first + length);
    CHECK(relative_difference<double>(out.view(), slice(whole_out)) <= 1e-11);
    Tensor<double, 4> sq({B, length, H, Dk}), sk({B, length, H, Dk}), sv({B, length, H, Dv});
    Tensor<double, 3> spq({B, length, H}), spk({B, length, H});  // accumulated (+=): from ones
    for (auto* p : {&spq, &spk})
      for (index_t i = 0; i < p->size(); ++i) p->data()[i] = 1.0;
    latte::LinearGradients<double> parts{sq.view(), sk.view(), sv.view()};
    parts.d_query_proportions = spq.view();
    parts.d_key_proportions = spk.view();
    latte::distributed::backward(e, MPI_COMM_WORLD, attention, slice(q), slice(k), slice(v),
                                 proportions, slice(d_out), parts);
    CHECK(relative_difference<double>(sq.view(), slice(dq)) <= 1e-11);
    CHECK(relative_difference<double>(sk.view(), slice(dk)) <= 1e-11);
    CHECK(relative_difference<double>(sv.view(), slice(dv)) <= 1e-11);
    for (auto* p : {&spq, &spk})
      for (index_t i = 0; i < p->size(); ++i) p->data()[i] -= 1.0;
    auto as4 = [&](TensorView<double, 3> x) {
      return TensorView<const double, 4>(x.data(), {1, x.extent(0), x.extent(1), x.extent(2)},
                                         {0, x.stride(0), x.stride(1), x.stride(2)});
    };
    CHECK(relative_difference<double>(as4(spq.view()), as4(slice3(dpq))) <= 1e-11);
    CHECK(relative_difference<double>(as4(spk.view()), as4(slice3(dpk))) <= 1e-11);
  };
  for (const auto& lengths : slice_patterns(world_size())) {
    check(latte::exec::cpu, lengths);
    check(latte::exec::reference, lengths);
  }
}

/// Latte Macchiato's forward and final state across the ranks (no backward
/// across ranks yet): the window's halo travels in the state's ring.
template <class T, class Attention, class E>
void check_macchiato(E e, const Attention& attention, index_t B,
                     const std::vector<std::int64_t>& lengths, std::uint64_t seed) {
  const auto& dims = attention.dims();
  const index_t H = dims.heads, L = dims.latents, Dk = dims.key_dim, Dv = dims.value_dim;
  const int rank = world_rank();
  const std::array<std::int64_t, 3> where = slice_of(lengths, rank);  // (no bindings: clang 14 cannot capture them)
  const std::int64_t first = where[0], length = where[1], total = where[2];
  const index_t Tn = static_cast<index_t>(total);
  std::mt19937_64 rng(seed);
  auto q = random_input<T>(rng, {B, Tn, H, L + 1}, 1.0);
  auto k = random_input<T>(rng, {B, Tn, H, L}, 3.0);
  auto wq = random_input<T>(rng, {B, Tn, H, Dk}, 1.0);
  auto wk = random_input<T>(rng, {B, Tn, H, Dk}, 1.0);
  auto v = random_input<T>(rng, {B, Tn, H, Dv}, 1.0);
  auto step_inputs = random_input<T>(rng, {5, B, H, std::max(L + 1, std::max(Dk, Dv))}, 1.0);
  Tensor<T, 4> whole_out({B, Tn, H, Dv});
  auto whole_state = attention.template make_state<T>(B);
  attention.forward(e, q.view(), k.view(), wq.view(), wk.view(), v.view(), whole_out.view(),
                    whole_state);
  auto slice = [&](auto& tensor) {
    return TensorView<const T, 4>(tokens<T>(tensor.view(), first, length));
  };
  Tensor<T, 4> out({B, static_cast<index_t>(length), H, Dv});
  auto state = latte::distributed::forward(
      e, MPI_COMM_WORLD, attention,
      std::tuple{slice(q), slice(k), slice(wq), slice(wk), slice(v)}, out.view());
  INFO("rank " << rank << " of " << lengths.size() << ", slice [" << first << ", "
                << first + length << ") of " << total);
  CHECK(state.position() == first + length);
  CHECK(relative_difference<T>(out.view(), slice(whole_out)) <= tolerance<T>());
  if (rank == static_cast<int>(lengths.size()) - 1) {
    auto row = [&](index_t i, index_t width) {
      return TensorView<const T, 3>(step_inputs.data() + i * step_inputs.view().stride(0),
                                    {B, H, width}, {step_inputs.view().stride(1),
                                                    step_inputs.view().stride(2), 1});
    };
    Tensor<T, 3> from_parts({B, H, Dv}), from_whole({B, H, Dv});
    attention.step(e, state, row(0, L + 1), row(1, L), row(2, Dk), row(3, Dk), row(4, Dv),
                   from_parts.view());
    attention.step(e, whole_state, row(0, L + 1), row(1, L), row(2, Dk), row(3, Dk), row(4, Dv),
                   from_whole.view());
    TensorView<const T, 4> a(from_parts.data(), {1, B, H, Dv}), b(from_whole.data(), {1, B, H, Dv});
    CHECK(relative_difference<T>(a, b) <= tolerance<T>());
  }
}

TEST_CASE("Latte Macchiato across ranks: the window's halo travels in the state's ring") {
  using Plain = latte::LatteMacchiato<latte::Causal>;
  using Rotary = latte::LatteMacchiato<latte::Causal, latte::RunningMax, latte::VAPOR, latte::RoPE>;
  const Plain plain({.heads = 2, .latents = 3, .key_dim = 4, .value_dim = 6, .window = 5});
  const Rotary rotary({.heads = 2, .latents = 3, .key_dim = 4, .value_dim = 6, .window = 12},
                      {.scale = {}, .vapor_scope = latte::VaporScope::all_states});
  for (const auto& lengths : slice_patterns(world_size())) {
    check_macchiato<double>(latte::exec::cpu, plain, 2, lengths, 61);
    check_macchiato<double>(latte::exec::reference, plain, 1, lengths, 62);
    check_macchiato<double>(latte::exec::cpu, rotary, 2, lengths, 63);
    check_macchiato<float>(latte::exec::cpu, rotary, 1, lengths, 64);
  }
}

TEST_CASE("Softmax with a sliding window across ranks: the KV cache's ring is the halo") {
  using Windowed = latte::SoftmaxAttention<latte::Causal, latte::SlidingWindow>;
  // Windows of 3 (inside a 9-token slice) and 40 (across several slices).
  for (index_t left : {3, 40}) {
    const Windowed attention({.heads = 2, .key_dim = 4, .value_dim = 5}, {.left = left, .right = 0});
    check_all_patterns<double>(attention, 4, 1.0, 101 + static_cast<std::uint64_t>(left));
    check_all_patterns<float>(attention, 4, 1.0, 111 + static_cast<std::uint64_t>(left));
  }
}

TEST_CASE("LAVO across ranks: the halo first, then the windows' sums") {
  using CausalLavo = latte::Lavo<latte::Causal>;
  // Windows of 4 (slices cross many borders) and 16 (a window spans several slices).
  for (index_t w : {4, 16}) {
    const CausalLavo attention({.heads = 2, .dim = 6, .bases = 3, .window = w}, {.basis_seed = 5});
    check_all_patterns<double>(attention, 6, 1.0, 81 + static_cast<std::uint64_t>(w));
    check_all_patterns<float>(attention, 6, 1.0, 91 + static_cast<std::uint64_t>(w));
  }
  const CausalLavo local_only({.heads = 1, .dim = 4, .bases = 2, .window = 7},
                              {.empty_memory = latte::LavoEmptyMemory::local_only});
  check_all_patterns<double>(local_only, 4, 1.0, 99);
}

/// Random weights of the shapes `dims` needs (1/sqrt(fan-in), as
/// test_conv_compressed.cpp draws them), the same on every rank.
latte::ConvCompressedParams random_conv_params(std::mt19937_64& rng,
                                               const latte::ConvCompressedDims& dims) {
  latte::ConvCompressedParams params = latte::ConvCompressedParams::zeros(dims);
  const double Dv = double(dims.value_dim), M = double(dims.group_size);
  auto fill = [&](auto& tensor, double stddev) {
    std::normal_distribution<double> normal(0.0, stddev);
    for (index_t i = 0; i < tensor.size(); ++i) tensor.data()[i] = normal(rng);
  };
  for (auto& w : params.conv_weight) fill(w, 1.0 / std::sqrt(M * Dv));
  for (auto& b : params.conv_bias) fill(b, 0.5);
  for (auto* list : {&params.level_query, &params.level_key, &params.level_value})
    for (auto& w : *list) fill(w, 1.0 / std::sqrt(Dv));
  for (auto* w : {&params.cross_query, &params.cross_key, &params.cross_value})
    fill(*w, 1.0 / std::sqrt(Dv));
  return params;
}

/// Convolutional compression's forward and final state across the ranks
/// against the whole sequence on this rank (the level pipeline).
template <class T, class E>
void check_conv_compressed(E e, const latte::ConvCompressedAttention<latte::Causal>& attention,
                           index_t B, const std::vector<std::int64_t>& lengths,
                           std::uint64_t seed) {
  const auto& dims = attention.dims();
  const index_t H = dims.heads, Dk = dims.key_dim, Dv = dims.value_dim;
  const int rank = world_rank();
  const std::array<std::int64_t, 3> where = slice_of(lengths, rank);  // (no bindings: clang 14 cannot capture them)
  const std::int64_t first = where[0], length = where[1], total = where[2];
  const index_t Tn = static_cast<index_t>(total), capacity = Tn + 1;
  std::mt19937_64 rng(seed);
  auto q = random_input<T>(rng, {B, Tn, H, Dk}, 1.0);
  auto k = random_input<T>(rng, {B, Tn, H, Dk}, 1.0);
  auto v = random_input<T>(rng, {B, Tn, H, Dv}, 1.0);
  auto step_inputs = random_input<T>(rng, {3, B, H, std::max(Dk, Dv)}, 1.0);
  Tensor<T, 4> whole_out({B, Tn, H, Dv});
  auto whole_state = attention.template make_state<T>(B, capacity);
  attention.forward(e, q.view(), k.view(), v.view(), whole_out.view(), whole_state);
  auto slice = [&](auto& tensor) {
    return TensorView<const T, 4>(tokens<T>(tensor.view(), first, length));
  };
  Tensor<T, 4> out({B, static_cast<index_t>(length), H, Dv});
  auto state = latte::distributed::forward(e, MPI_COMM_WORLD, attention, slice(q), slice(k),
                                           slice(v), out.view(), capacity);
  INFO("rank " << rank << " of " << lengths.size() << ", slice [" << first << ", "
                << first + length << ") of " << total << ", M " << dims.group_size
                << ", levels " << dims.levels << ", window " << attention.window().left);
  CHECK(state.position() == first + length);
  CHECK(state.context_capacity() == capacity);
  CHECK(relative_difference<T>(out.view(), slice(whole_out)) <= tolerance<T>());
  if (rank == static_cast<int>(lengths.size()) - 1) {  // one decode step past the sequence
    auto row = [&](index_t i, index_t width) {
      return TensorView<const T, 3>(step_inputs.data() + i * step_inputs.view().stride(0),
                                    {B, H, width}, {step_inputs.view().stride(1),
                                                    step_inputs.view().stride(2), 1});
    };
    Tensor<T, 3> from_parts({B, H, Dv}), from_whole({B, H, Dv});
    attention.step(e, state, row(0, Dk), row(1, Dk), row(2, Dv), from_parts.view());
    attention.step(e, whole_state, row(0, Dk), row(1, Dk), row(2, Dv), from_whole.view());
    TensorView<const T, 4> a(from_parts.data(), {1, B, H, Dv}), b(from_whole.data(), {1, B, H, Dv});
    CHECK(relative_difference<T>(a, b) <= tolerance<T>());
  }
}

TEST_CASE("Convolutional compression across ranks: rings, straddling groups and top-level tokens") {
  using ConvCompressed = latte::ConvCompressedAttention<latte::Causal>;
  std::mt19937_64 rng(71);
  // One level with M = 4 (groups straddle slices of 1 and 9 tokens); two levels
  // with M = 3 and a window of 5 (level 1's ring spans slices); three levels of
  // M = 2 with a window of 1.
  const std::vector<latte::ConvCompressedDims> shapes = {
      {.heads = 2, .key_dim = 3, .value_dim = 4, .group_size = 4, .levels = 1},
      {.heads = 1, .key_dim = 4, .value_dim = 3, .group_size = 3, .levels = 2, .window_left = 5},
      {.heads = 2, .key_dim = 2, .value_dim = 3, .group_size = 2, .levels = 3, .window_left = 1}};
  std::uint64_t seed = 171;
  for (const auto& dims : shapes) {
    const ConvCompressed attention(dims, random_conv_params(rng, dims));
    for (const auto& lengths : slice_patterns(world_size())) {
      check_conv_compressed<double>(latte::exec::cpu, attention, 2, lengths, seed++);
      check_conv_compressed<double>(latte::exec::reference, attention, 1, lengths, seed++);
      check_conv_compressed<float>(latte::exec::cpu, attention, 1, lengths, seed++);
    }
  }
}

/// Scan rounds in which the rank at scan position `position` of `ranks` sends.
int scan_sends(int position, int ranks) {
  int sends = 0;
  for (int d = 1; d < ranks; d *= 2) sends += position + d < ranks ? 1 : 0;
  return sends;
}

TEST_CASE("Bytes each rank hands MPI: one state per scan round, against ring attention's keys and values") {
  const index_t B = 1, H = 4, L = 16, Dv = 64;
  const std::int64_t length = 4096;
  const int P = world_size(), rank = world_rank();
  const CausalLatte attention({.heads = H, .latents = L, .value_dim = Dv});
  std::mt19937_64 rng(41 + static_cast<std::uint64_t>(rank));
  auto q = random_input<float>(rng, {B, length, H, L}, 1.0);
  auto k = random_input<float>(rng, {B, length, H, L}, 1.0);
  auto v = random_input<float>(rng, {B, length, H, Dv}, 1.0);
  auto d_out = random_input<float>(rng, {B, length, H, Dv}, 1.0);
  Tensor<float, 4> out({B, length, H, Dv});
  // A state: running max, normaliser and its low part [L], memory and its low part [L x Dv].
  const std::int64_t state_bytes = B * H * (3 * L + 2 * L * Dv) * std::int64_t(sizeof(float));
  const std::int64_t agreement_bytes = 10 * 8 + 2 * 4;  // the descriptions; two error flags

  latte_test::reset_mpi_bytes();
  (void)latte::distributed::forward(latte::exec::cpu, MPI_COMM_WORLD, attention, q.view(), k.view(),
                                    v.view(), out.view());
  const latte_test::MpiBytes forward = latte_test::mpi_bytes();
  CHECK(sent(forward, "MPI_Sendrecv") == scan_sends(rank, P) * state_bytes);
  CHECK(sent(forward, "MPI_Allgather") + sent(forward, "MPI_Allreduce") == agreement_bytes);
  CHECK(forward.total() == scan_sends(rank, P) * state_bytes + agreement_bytes);

  Tensor<float, 4> dq({B, length, H, L}), dk({B, length, H, L}), dv({B, length, H, Dv});
  latte_test::reset_mpi_bytes();
  latte::distributed::backward(latte::exec::cpu, MPI_COMM_WORLD, attention, q.view(), k.view(),
                               v.view(), d_out.view(),
                               latte::LatteGradients<float>{dq.view(), dk.view(), dv.view()});
  const latte_test::MpiBytes backward = latte_test::mpi_bytes();
  // The forward's scan, then the reverse scan of the states' gradients.
  const std::int64_t backward_scans = (scan_sends(rank, P) + scan_sends(P - 1 - rank, P)) * state_bytes;
  CHECK(sent(backward, "MPI_Sendrecv") == backward_scans);
  CHECK(backward.total() == backward_scans + agreement_bytes);

  // Ring attention passes every rank's keys and values around the ring: P - 1
  // slices of [B, T, H, L + Dv] per rank.
  const std::int64_t ring = (P - 1) * B * length * H * (L + Dv) * std::int64_t(sizeof(float));
  if (rank == 0)
    MESSAGE("P = " << P << ", slice " << length << " tokens, B H L Dv = " << B << " " << H << " "
                   << L << " " << Dv << " fp32: rank 0 sends " << forward.total()
                   << " bytes in the forward, " << backward.total()
                   << " in the backward; ring attention would send " << ring);
}

TEST_CASE("Bytes of convolutional compression: a ring and a partial sum per level and scan round, top-level tokens to later ranks") {
  const index_t B = 1, H = 4, Dk = 64, Dv = 64, M = 8, levels = 2;  // window M - 1: rings of 8
  const std::int64_t length = 4096;
  const int P = world_size(), rank = world_rank();
  std::mt19937_64 rng(43);
  const latte::ConvCompressedDims dims{
      .heads = H, .key_dim = Dk, .value_dim = Dv, .group_size = M, .levels = levels};
  const latte::ConvCompressedAttention<latte::Causal> attention(dims, random_conv_params(rng, dims));
  auto q = random_input<float>(rng, {B, length, H, Dk}, 1.0);
  auto k = random_input<float>(rng, {B, length, H, Dk}, 1.0);
  auto v = random_input<float>(rng, {B, length, H, Dv}, 1.0);
  Tensor<float, 4> out({B, length, H, Dv});
  latte_test::reset_mpi_bytes();
  (void)latte::distributed::forward(latte::exec::cpu, MPI_COMM_WORLD, attention, q.view(), k.view(),
                                    v.view(), out.view());
  const latte_test::MpiBytes forward = latte_test::mpi_bytes();
  const std::int64_t f = sizeof(float);
  const std::int64_t ring_bytes = B * H * M * (Dk + Dv) * f, group_bytes = B * H * Dv * f;
  const std::int64_t scans = levels * scan_sends(rank, P) * (ring_bytes + group_bytes);
  // Every slice holds length / M^2 = 64 top-level tokens, sent to each later rank.
  const std::int64_t top = (P - 1 - rank) * (length / (M * M)) * B * H * (Dk + Dv) * f;
  const std::int64_t agreement_bytes = 10 * 8 + 2 * 4;
  CHECK(sent(forward, "MPI_Sendrecv") == scans);
  CHECK(sent(forward, "MPI_Alltoallv") == top);
  CHECK(forward.total() == scans + top + agreement_bytes);
  const std::int64_t ring = (P - 1) * B * length * H * (Dk + Dv) * f;
  if (rank == 0)
    MESSAGE("conv compression M = " << M << ", " << levels << " levels, P = " << P << ", slice "
            << length << " tokens, B H Dk Dv = " << B << " " << H << " " << Dk << " " << Dv
            << " fp32: rank 0 sends " << forward.total() << " bytes; ring attention would send "
            << ring);
}

/// Every rank catches a latte::Error from `call`, and all catch the same one.
template <class Call>
void check_every_rank_throws(Call&& call, const std::string& argument, const std::string& says) {
  std::string message = "(no error)", caught_argument;
  try {
    call();
  } catch (const latte::Error& error) {
    message = error.what();
    caught_argument = error.argument();
  }
  INFO("rank " << world_rank() << ": " << message);
  CHECK(caught_argument == argument);
  CHECK(message.find(says) != std::string::npos);
  // The same text on every rank: compare checksums and lengths.
  const std::int64_t mine[2] = {
      latte::crc32c(std::as_bytes(std::span<const char>(message.data(), message.size()))),
      static_cast<std::int64_t>(message.size())};
  std::vector<std::int64_t> all(2 * static_cast<std::size_t>(world_size()));
  MPI_Allgather(mine, 2, MPI_INT64_T, all.data(), 2, MPI_INT64_T, MPI_COMM_WORLD);
  for (int r = 0; r < world_size(); ++r) {
    CHECK(all[2 * static_cast<std::size_t>(r)] == mine[0]);
    CHECK(all[2 * static_cast<std::size_t>(r) + 1] == mine[1]);
  }
}

TEST_CASE("A rank with bad input or another attention makes every rank throw the same latte::Error") {
  const int P = world_size(), rank = world_rank(), culprit = P - 1;
  const index_t B = 1, H = 2, L = 3, Dv = 4, Tn = 5;
  std::mt19937_64 rng(51);
  auto q = random_input<double>(rng, {B, Tn, H, L}, 1.0);
  auto v = random_input<double>(rng, {B, Tn, H, Dv}, 1.0);
  auto wrong_v = random_input<double>(rng, {B, Tn, H, Dv + 1}, 1.0);
  Tensor<double, 4> out({B, Tn, H, Dv}), wide_out({B, Tn, H, Dv + 1});
  const CausalLatte attention({.heads = H, .latents = L, .value_dim = Dv});
  const std::string who = "rank " + std::to_string(culprit);
  check_every_rank_throws(
      [&] {
        const bool bad = rank == culprit;
        (void)latte::distributed::forward(latte::exec::cpu, MPI_COMM_WORLD, attention, q.view(),
                                          q.view(), bad ? wrong_v.view() : v.view(), out.view());
      },
      "values", who + ": shape [B, T, H, Dv]: expected [1, 5, 2, 4], given [1, 5, 2, 5]");
  if (P < 2) return;  // disagreements need two ranks
  const CausalLatte other({.heads = H, .latents = L, .value_dim = Dv + 1});
  check_every_rank_throws(
      [&] {
        const bool bad = rank == culprit;
        if (bad)
          (void)latte::distributed::forward(latte::exec::cpu, MPI_COMM_WORLD, other, q.view(),
                                            q.view(), wrong_v.view(), wide_out.view());
        else
          (void)latte::distributed::forward(latte::exec::cpu, MPI_COMM_WORLD, attention, q.view(),
                                            q.view(), v.view(), out.view());
      },
      "attention", "expected the same attention on every rank");
  auto q2 = random_input<double>(rng, {2, Tn, H, L}, 1.0);
  auto v2 = random_input<double>(rng, {2, Tn, H, Dv}, 1.0);
  Tensor<double, 4> out2({2, Tn, H, Dv});
  check_every_rank_throws(
      [&] {
        if (rank == culprit)
          (void)latte::distributed::forward(latte::exec::cpu, MPI_COMM_WORLD, attention, q2.view(),
                                            q2.view(), v2.view(), out2.view());
        else
          (void)latte::distributed::forward(latte::exec::cpu, MPI_COMM_WORLD, attention, q.view(),
                                            q.view(), v.view(), out.view());
      },
      "batch", "the same batch B on every rank");
  Tensor<double, 4> dq({B, Tn, H, L}), dk({B, Tn, H, L}), dv({B, Tn, H, Dv});
  check_every_rank_throws(
      [&] {
        if (rank == culprit)
          latte::distributed::backward(latte::exec::cpu, MPI_COMM_WORLD, attention, q.view(),
                                       q.view(), v.view(), TensorView<const double, 4>(out.view()),
                                       latte::LatteGradients<double>{dq.view(), dk.view(), dv.view()});
        else
          (void)latte::distributed::forward(latte::exec::cpu, MPI_COMM_WORLD, attention, q.view(),
                                            q.view(), v.view(), out.view());
      },
      "comm", "every rank must make the same call");

  // LeaPformer: a proportion outside [0, 1] on one rank, found before the scan.
  using Leap = latte::LinearAttention<latte::Causal, latte::Relu, latte::LeaPReweight>;
  const Leap leap({.heads = H, .key_dim = 4, .value_dim = Dv});
  auto lq = random_input<double>(rng, {B, Tn, H, 4}, 1.0);
  Tensor<double, 3> proportions({B, Tn, H}), bad_proportions({B, Tn, H});
  for (index_t i = 0; i < proportions.size(); ++i)
    proportions.data()[i] = bad_proportions.data()[i] = 0.5;
  bad_proportions(0, 3, 1) = 1.5;
  check_every_rank_throws(
      [&] {
        const auto& p = rank == culprit ? bad_proportions : proportions;
        (void)latte::distributed::forward(
            latte::exec::cpu, MPI_COMM_WORLD, leap,
            std::tuple{TensorView<const double, 4>(lq.view()), TensorView<const double, 4>(lq.view()),
                       TensorView<const double, 4>(v.view()),
                       latte::SequenceProportions<double>{p.view(), p.view()}},
            out.view());
      },
      "query_proportions", who + ": proportion at [0, 3, 1]: expected a value in [0, 1], given 1.5");

  // Convolutional compression: a capacity other ranks do not share, or one too small.
  const latte::ConvCompressedDims conv_dims{.heads = H, .key_dim = L, .value_dim = Dv, .group_size = 2};
  const latte::ConvCompressedAttention<latte::Causal> conv(conv_dims, random_conv_params(rng, conv_dims));
  auto conv_forward = [&](index_t capacity) {
    (void)latte::distributed::forward(latte::exec::cpu, MPI_COMM_WORLD, conv, q.view(), q.view(),
                                      v.view(), out.view(), capacity);
  };
  check_every_rank_throws([&] { conv_forward(P * Tn - 1); }, "context_capacity",
                          "expected >= the sequence's " + std::to_string(P * Tn));
  if (P > 1)
    check_every_rank_throws([&] { conv_forward(rank == culprit ? 1000 : 999); }, "attention",
                            "expected the same attention on every rank");
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  // Rank 0 reports to stdout; every other rank to a file of its own, printed
  // after the run when that rank failed, so that no rank's failure goes unseen.
  const int rank = world_rank();
  const std::string report = "test_sequence_parallel.rank" + std::to_string(rank) + ".txt";
  doctest::Context context(argc, argv);
  if (rank != 0) context.setOption("out", report.c_str());
  const int failed = context.run() != 0 ? 1 : 0;
  if (rank != 0) {
    std::ifstream text(report);
    if (failed) std::cerr << "=== rank " << rank << " failed:\n" << text.rdbuf() << std::flush;
    std::remove(report.c_str());
  }
  int failed_ranks = 0;
  MPI_Allreduce(&failed, &failed_ranks, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (rank == 0)
    std::printf("[mpi] %d of %d ranks failed\n", failed_ranks, world_size());
  MPI_Finalize();
  return failed_ranks > 0 ? 1 : 0;
}
