// absorb and append_state (what latte/distributed/ builds on), without MPI:
// absorb leaves the state forward leaves; a sequence cut into pieces, each
// absorbed from a fresh state at its first position and appended in order,
// gives the state of the whole sequence, however the appends are grouped
// (associativity), checked by decoding on from it against the state of one
// forward over the whole sequence, on both backends and in fp64 and fp32.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "latte/attention.hpp"
#include "support.hpp"

namespace test_state_merge {

using latte::index_t;
using latte::Tensor;
using latte::TensorView;

template <class T>
Tensor<T, 4> draw(std::mt19937_64& rng, std::array<index_t, 4> extents, double stddev, double shift = 0) {
  Tensor<T, 4> x(extents);
  std::normal_distribution<double> normal(shift, stddev);
  for (index_t i = 0; i < x.size(); ++i) x.data()[i] = static_cast<T>(normal(rng));
  return x;
}

template <class T>
TensorView<const T, 4> tokens(const Tensor<T, 4>& x, index_t first, index_t length) {
  const auto v = x.view();
  return {v.data() + first * v.stride(1), {v.extent(0), length, v.extent(2), v.extent(3)}, v.strides()};
}

/// Largest difference of the sums two states hold, relative to the largest
/// sum. Latte's sums are stored scaled by exp(-reference) against a reference
/// the kernel chooses (a running maximum, raised lazily by exec::cpu), so they
/// are compared scaled to the larger of the two references; compensated pairs
/// as hi + lo.
template <class State>
double state_difference(const State& a, const State& b) {
  double worst = 0, scale = 1e-300;
  auto compare = [&](double x, double y) {
    worst = std::max(worst, std::abs(x - y));
    scale = std::max(scale, std::abs(y));
  };
  if constexpr (requires { a.latents(); }) {
    const index_t rows = a.batch() * a.heads() * a.latents(), Dv = a.value_dim();
    for (index_t i = 0; i < rows; ++i) {
      const double m_a = a.field(0)[i], m_b = b.field(0)[i];
      if (std::isinf(m_a) || std::isinf(m_b)) {  // a latent no key reached (or -inf keys only)
        CHECK(m_a == m_b);
        continue;
      }
      const double m = std::max(m_a, m_b), scale_a = std::exp(m_a - m), scale_b = std::exp(m_b - m);
      compare((double(a.field(1)[i]) + a.field(3)[i]) * scale_a,
              (double(b.field(1)[i]) + b.field(3)[i]) * scale_b);
      for (index_t d = 0; d < Dv; ++d)
        compare((double(a.field(2)[i * Dv + d]) + a.field(4)[i * Dv + d]) * scale_a,
                (double(b.field(2)[i * Dv + d]) + b.field(4)[i * Dv + d]) * scale_b);
    }
  } else {  // linear: memory, normaliser and their low parts
    for (std::size_t f = 0; f < 2; ++f)
      for (std::size_t i = 0; i < a.field_size(f); ++i)
        compare(double(a.field(f)[i]) + a.field(f + 2)[i], double(b.field(f)[i]) + b.field(f + 2)[i]);
  }
  return worst / scale;
}

template <class T, class Attention, class E>
void check_merge(E e, const Attention& attention, index_t features, index_t Dv, double key_stddev,
                 std::uint64_t seed, index_t B = 2) {
  const index_t H = attention.dims().heads;
  const std::vector<index_t> cuts = {0, 1, 1, 40, 333, 700};  // pieces of 1, 0, 39, 293, 367 tokens
  const index_t Tn = cuts.back();
  std::mt19937_64 rng(seed);
  auto q = draw<T>(rng, {B, Tn, H, features}, 1.0);
  auto k = draw<T>(rng, {B, Tn, H, features}, key_stddev);
  auto v = draw<T>(rng, {B, Tn, H, Dv}, 1.0);
  // Keys of the last piece far above the rest: the running maximum moves between pieces.
  for (index_t b = 0; b < B; ++b)
    for (index_t t = cuts[4]; t < Tn; ++t)
      for (index_t h = 0; h < H; ++h)
        for (index_t d = 0; d < features; ++d) k(b, t, h, d) += static_cast<T>(key_stddev > 3 ? 30 : 0);
  Tensor<T, 4> out({B, Tn, H, Dv});
  auto whole = attention.template make_state<T>(B);
  attention.forward(e, q.view(), k.view(), v.view(), out.view(), whole);

  const double tolerance = std::is_same_v<T, double> ? 1e-13 : 1e-6;
  auto absorbed = attention.template make_state<T>(B);
  attention.absorb(e, k.view(), v.view(), absorbed);
  CHECK(absorbed.position() == whole.position());
  CHECK(state_difference(absorbed, whole) <= tolerance);

  using State = std::remove_cvref_t<decltype(whole)>;
  std::vector<State> pieces;
  for (std::size_t p = 0; p + 1 < cuts.size(); ++p) {
    pieces.push_back(attention.template make_state<T>(B, cuts[p]));
    attention.absorb(e, tokens(k, cuts[p], cuts[p + 1] - cuts[p]),
                     tokens(v, cuts[p], cuts[p + 1] - cuts[p]), pieces.back());
  }
  // ((((p0 p1) p2) p3) p4) and (p0 (p1 (p2 (p3 p4)))).
  State left = pieces[0];
  for (std::size_t p = 1; p < pieces.size(); ++p) left.append_state(pieces[p]);
  State right = pieces.back();
  for (std::size_t p = pieces.size() - 1; p-- > 0;) {
    State merged = pieces[p];
    merged.append_state(right);
    right = merged;
  }
  CHECK(left.position() == Tn);
  CHECK(right.position() == Tn);
  CHECK(state_difference(left, whole) <= tolerance);
  CHECK(state_difference(right, whole) <= tolerance);
  // A state appended before an earlier one is refused.
  State early = attention.template make_state<T>(B, 5);
  CHECK_THROWS_AS(left.append_state(early), latte::Error);
}

TEST_CASE("absorb, and append_state is the associative merge: Latte (RunningMax, VAPOR)") {
  const latte::LatteAttention<latte::Causal, latte::RunningMax> latte_plain({.heads = 2, .latents = 6, .value_dim = 5});
  const latte::LatteAttention<latte::Causal, latte::RunningMax, latte::VAPOR> vapor({.heads = 2, .latents = 4, .value_dim = 6});
  for (double spread : {1.0, 30.0}) {
    check_merge<double>(latte::exec::cpu, latte_plain, 6, 5, spread, 1);
    check_merge<double>(latte::exec::reference, latte_plain, 6, 5, spread, 2);
    check_merge<float>(latte::exec::cpu, latte_plain, 6, 5, spread, 3);
    check_merge<double>(latte::exec::cpu, vapor, 4, 6, spread, 4);
  }
  // One head, enough work for two threads: exec::cpu cuts a head's tokens into
  // pieces and appends them (with OMP_NUM_THREADS >= 2).
  const latte::LatteAttention<latte::Causal, latte::RunningMax, latte::VAPOR> one_head({.heads = 1, .latents = 16, .value_dim = 32});
  check_merge<double>(latte::exec::cpu, one_head, 16, 32, 3.0, 5, 1);
}

TEST_CASE("absorb, and append_state is the associative merge: the linear family") {
  const latte::LinearAttention<latte::Causal, latte::EluPlusOne> elu({.heads = 2, .key_dim = 5, .value_dim = 3});
  const latte::LinearAttention<latte::Causal, latte::Relu, latte::CosFormerReweight> cosformer(
      {.heads = 2, .key_dim = 4, .value_dim = 3}, {.reweight = {.length = 1000}});
  const latte::LinearAttention<latte::Causal, latte::EluPlusOne, latte::NoReweight, latte::RoPE> rope(
      {.heads = 1, .key_dim = 6, .value_dim = 4});
  check_merge<double>(latte::exec::cpu, elu, 5, 3, 1.0, 11);
  check_merge<double>(latte::exec::reference, elu, 5, 3, 1.0, 12);
  check_merge<float>(latte::exec::cpu, elu, 5, 3, 1.0, 13);
  check_merge<double>(latte::exec::cpu, cosformer, 4, 3, 1.0, 14);
  check_merge<double>(latte::exec::reference, cosformer, 4, 3, 1.0, 15);
  check_merge<double>(latte::exec::cpu, rope, 6, 4, 1.0, 16);
  const latte::LinearAttention<latte::Causal, latte::EluPlusOne> one_head({.heads = 1, .key_dim = 16, .value_dim = 32});
  check_merge<double>(latte::exec::cpu, one_head, 16, 32, 1.0, 17, 1);
}

/// final_state_backward is the final state's share of the chunked backward:
/// backward(..., {initial, d_final}) = backward(..., {initial}) + its terms.
template <class T, class Attention, class E>
void check_final_state_share(E e, const Attention& attention, double key_stddev, std::uint64_t seed) {
  const index_t B = 2, H = attention.dims().heads, L = attention.dims().latents;
  const index_t Dv = attention.dims().value_dim, Tn = 300, before = 77;
  std::mt19937_64 rng(seed);
  auto q = draw<T>(rng, {B, before + Tn, H, L}, 1.0);
  auto k = draw<T>(rng, {B, before + Tn, H, L}, key_stddev);
  auto v = draw<T>(rng, {B, before + Tn, H, Dv}, 1.0);
  auto d_out = draw<T>(rng, {B, Tn, H, Dv}, 1.0);
  // The chunk's initial state (after `before` tokens) and the state it leaves.
  auto initial = attention.template make_state<T>(B);
  attention.absorb(e, tokens(k, 0, before), tokens(v, 0, before), initial);
  auto final_state = initial;
  attention.absorb(e, tokens(k, before, Tn), tokens(v, before, Tn), final_state);
  // A gradient of the final state, against its reference.
  auto d_final = final_state;
  for (std::size_t f = 1; f < 3; ++f)
    for (std::size_t i = 0; i < d_final.field_size(f); ++i)
      d_final.field(f)[i] = static_cast<T>(std::normal_distribution<double>(0, 1)(rng));
  for (std::size_t f = 3; f < 5; ++f) std::fill_n(d_final.field(f), d_final.field_size(f), T(0));
  const auto qs = tokens(q, before, Tn), ks = tokens(k, before, Tn), vs = tokens(v, before, Tn);
  Tensor<T, 4> dq({B, Tn, H, L}), dk({B, Tn, H, L}), dv({B, Tn, H, Dv});
  Tensor<T, 4> sq({B, Tn, H, L}), sk({B, Tn, H, L}), sv({B, Tn, H, Dv});
  Tensor<T, 2> angles_with({H, Dv / 2}), angles_share({H, Dv / 2});
  const bool vapor = attention.angles().size() > 0;
  attention.backward(e, qs, ks, vs, d_out.view(),
                     latte::LatteGradients<T>{dq.view(), dk.view(), dv.view(),
                                              vapor ? angles_with.view() : TensorView<T, 2>{}},
                     latte::LatteStateGradients<T>{&initial, &d_final, nullptr});
  attention.backward(e, qs, ks, vs, d_out.view(),
                     latte::LatteGradients<T>{sq.view(), sk.view(), sv.view(),
                                              vapor ? angles_share.view() : TensorView<T, 2>{}},
                     latte::LatteStateGradients<T>{&initial, nullptr, nullptr});
  attention.final_state_backward(e, ks, vs, d_final,
                                 latte::LatteGradients<T>{sq.view(), sk.view(), sv.view(),
                                                          vapor ? angles_share.view() : TensorView<T, 2>{}});
  auto difference = [](const auto& a, const auto& b) {
    double worst = 0, scale = 1;
    for (index_t i = 0; i < a.size(); ++i) {
      worst = std::max(worst, std::abs(double(a.data()[i]) - double(b.data()[i])));
      scale = std::max(scale, std::abs(double(b.data()[i])));
    }
    return worst / scale;
  };
  const double tolerance = std::is_same_v<T, double> ? 1e-12 : 2e-5;
  CHECK(difference(sq, dq) == 0.0);  // no output depends on the final state
  CHECK(difference(sk, dk) <= tolerance);
  CHECK(difference(sv, dv) <= tolerance);
  if (vapor) CHECK(difference(angles_share, angles_with) <= tolerance);
}

/// <D, S(k, v)> in long double, from the definition of the stored sums
/// against the reference m: alpha_l = sum_s exp(k_{s,l} - m_l) and
/// vtilde_l = sum_s exp(k_{s,l} - m_l) R^{-s} v_s (R^p turns pair i by p theta_i).
template <class T>
long double final_state_pairing(const std::vector<long double>& k, const std::vector<long double>& v,
                                index_t Tn, index_t L, index_t Dv, std::int64_t first,
                                const double* theta, const T* m, const T* d_alpha,
                                const T* d_memory) {
  long double total = 0;
  for (index_t s = 0; s < Tn; ++s) {
    std::vector<long double> rotated(static_cast<std::size_t>(Dv));
    for (index_t d = 0; d < Dv; ++d) rotated[d] = v[s * Dv + d];
    for (index_t i = 0; theta != nullptr && i < Dv / 2; ++i) {
      const long double angle = -static_cast<long double>(first + s) * theta[i];
      const long double x = rotated[2 * i], y = rotated[2 * i + 1];
      rotated[2 * i] = std::cos(angle) * x - std::sin(angle) * y;
      rotated[2 * i + 1] = std::sin(angle) * x + std::cos(angle) * y;
    }
    for (index_t l = 0; l < L; ++l) {
      const long double w = std::exp(k[s * L + l] - static_cast<long double>(m[l]));
      long double read = d_alpha[l];
      for (index_t d = 0; d < Dv; ++d) read += static_cast<long double>(d_memory[l * Dv + d]) * rotated[d];
      total += w * read;
    }
  }
  return total;
}

/// final_state_backward against central differences of that definition:
/// the directional derivative along random (dk, dv) directions, fp64.
template <class Attention, class E>
void check_final_state_directional(E e, const Attention& attention, double key_stddev,
                                   std::uint64_t seed) {
  const index_t H = attention.dims().heads, L = attention.dims().latents;
  const index_t Dv = attention.dims().value_dim, Tn = 37, before = 11;
  std::mt19937_64 rng(seed);
  auto k = draw<double>(rng, {1, before + Tn, H, L}, key_stddev);
  auto v = draw<double>(rng, {1, before + Tn, H, Dv}, 1.0);
  auto dir_k = draw<double>(rng, {1, Tn, H, L}, 1.0);
  auto dir_v = draw<double>(rng, {1, Tn, H, Dv}, 1.0);
  auto state = attention.template make_state<double>(1);
  attention.absorb(e, k.view(), v.view(), state);  // the reference m covers every key
  auto d_final = state;
  for (std::size_t f = 1; f < 3; ++f)
    for (std::size_t i = 0; i < d_final.field_size(f); ++i)
      d_final.field(f)[i] = std::normal_distribution<double>(0, 1)(rng);
  Tensor<double, 4> dk({1, Tn, H, L}), dv({1, Tn, H, Dv}), dq({1, Tn, H, L});
  attention.final_state_backward(e, tokens(k, before, Tn), tokens(v, before, Tn), d_final,
                                 latte::LatteGradients<double>{dq.view(), dk.view(), dv.view()});
  const auto angles = attention.angles();
  for (index_t h = 0; h < H; ++h) {
    const double* theta = angles.size() > 0 ? angles.data() + h * (Dv / 2) : nullptr;
    const double* m = d_final.field(0) + h * L;
    const double* d_alpha = d_final.field(1) + h * L;
    const double* d_memory = d_final.field(2) + h * L * Dv;
    auto pairing = [&](long double step) {
      std::vector<long double> ks(static_cast<std::size_t>(Tn * L)), vs(static_cast<std::size_t>(Tn * Dv));
      for (index_t s = 0; s < Tn; ++s) {
        for (index_t l = 0; l < L; ++l) ks[s * L + l] = k(0, before + s, h, l) + step * dir_k(0, s, h, l);
        for (index_t d = 0; d < Dv; ++d) vs[s * Dv + d] = v(0, before + s, h, d) + step * dir_v(0, s, h, d);
      }
      return final_state_pairing(ks, vs, Tn, L, Dv, before, theta, m, d_alpha, d_memory);
    };
    const long double epsilon = 1e-6L;
    const long double numeric = (pairing(epsilon) - pairing(-epsilon)) / (2 * epsilon);
    long double analytic = 0;
    for (index_t s = 0; s < Tn; ++s) {
      for (index_t l = 0; l < L; ++l) analytic += static_cast<long double>(dk(0, s, h, l)) * dir_k(0, s, h, l);
      for (index_t d = 0; d < Dv; ++d) analytic += static_cast<long double>(dv(0, s, h, d)) * dir_v(0, s, h, d);
    }
    INFO("head " << h << ": analytic " << double(analytic) << ", central difference " << double(numeric));
    CHECK(std::abs(double(analytic - numeric)) <= 1e-8 * std::max(1.0, std::abs(double(numeric))));
  }
}

TEST_CASE("final_state_backward against central differences of the stored sums' definition") {
  const latte::LatteAttention<latte::Causal, latte::RunningMax> plain({.heads = 2, .latents = 5, .value_dim = 4});
  const latte::LatteAttention<latte::Causal, latte::RunningMax, latte::VAPOR> vapor({.heads = 2, .latents = 3, .value_dim = 6});
  for (double spread : {1.0, 30.0}) {
    check_final_state_directional(latte::exec::cpu, plain, spread, 31);
    check_final_state_directional(latte::exec::reference, plain, spread, 32);
    check_final_state_directional(latte::exec::cpu, vapor, spread, 33);
    check_final_state_directional(latte::exec::reference, vapor, spread, 34);
  }
}

TEST_CASE("final_state_backward: the final state's share of Latte's chunked backward") {
  const latte::LatteAttention<latte::Causal, latte::RunningMax> plain({.heads = 2, .latents = 6, .value_dim = 5});
  const latte::LatteAttention<latte::Causal, latte::RunningMax, latte::VAPOR> vapor({.heads = 2, .latents = 4, .value_dim = 8});
  for (double spread : {1.0, 30.0}) {
    check_final_state_share<double>(latte::exec::cpu, plain, spread, 21);
    check_final_state_share<double>(latte::exec::reference, plain, spread, 22);
    check_final_state_share<double>(latte::exec::cpu, vapor, spread, 23);
    check_final_state_share<double>(latte::exec::reference, vapor, spread, 24);
    check_final_state_share<float>(latte::exec::cpu, vapor, spread, 25);
  }
}

}  // namespace test_state_merge
