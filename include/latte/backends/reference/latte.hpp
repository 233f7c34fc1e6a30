#pragma once
// Reference backend for Latte: scalar loops that read like the paper.
//
// Symbols follow paper 000: q (query latent logits), k (key latent logits),
// v (values), alpha_{t,l} (normaliser), vtilde_{t,l} (latent memory),
// m_{t,l} (running maximum), R (VAPOR rotation). The kernels receive
// validated views and never allocate more than O(L * Dv) workspace.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "latte/core/compensated_sum.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/policies/positional.hpp"
#include "latte/policies/stabilizer.hpp"
#include "latte/policies/summation.hpp"

namespace latte::reference {

/// The recurrent carry of one (batch, head): m [L], alpha [L], vtilde [L x Dv].
/// With `normaliser_low` and `memory_low` (a decode state's), alpha and vtilde
/// are compensated sums (core/compensated_sum.hpp): alpha and vtilde hold the
/// rounded sums, the *_low arrays what rounding dropped, so that their error
/// does not grow with the number of tokens absorbed. Null: plain sums (the
/// scratch carries of a backward's recomputation, which start every chunk anew).
template <Real T>
struct LatteCarry {
  T* running_max;
  T* normaliser;
  T* memory;
  T* normaliser_low = nullptr;
  T* memory_low = nullptr;
  [[nodiscard]] bool compensated() const noexcept { return memory_low != nullptr; }
};

/// Values in one compensated carry: m, alpha, alpha's low part [L] and vtilde,
/// vtilde's low part [L x Dv] (checked against index_t overflow by the caller).
inline index_t latte_carry_size(index_t L, index_t Dv) noexcept { return 3 * L + 2 * L * Dv; }

/// The compensated carry laid out in latte_carry_size(L, Dv) values at `base`.
template <Real T>
LatteCarry<T> latte_carry_at(T* base, index_t L, index_t Dv) noexcept {
  return {base, base + L, base + 2 * L, base + 2 * L + L * Dv, base + 3 * L + L * Dv};
}

/// The carry of head `head` in a state whose fields 0-4 hold every head's m and
/// alpha [L], vtilde [L x Dv], then alpha's and vtilde's low parts (LatteState,
/// MacchiatoState); `field(i)` gives field i's data (T* or const T*).
template <class Field>
auto latte_head_carry(Field&& field, index_t head, index_t L, index_t Dv) noexcept {
  using T = std::remove_pointer_t<decltype(field(0))>;
  return LatteCarry<T>{field(0) + head * L, field(1) + head * L, field(2) + head * L * Dv,
                       field(3) + head * L, field(4) + head * L * Dv};
}

/// Sets a carry to the empty prefix.
template <Stabilizer Stab, Real T>
void latte_reset(LatteCarry<T> carry, index_t L, index_t Dv) noexcept {
  std::fill(carry.running_max, carry.running_max + L, Stab::template initial_reference<T>());
  std::fill(carry.normaliser, carry.normaliser + L, T(0));
  std::fill(carry.memory, carry.memory + L * Dv, T(0));
  if (carry.compensated()) {
    std::fill(carry.normaliser_low, carry.normaliser_low + L, T(0));
    std::fill(carry.memory_low, carry.memory_low + L * Dv, T(0));
  }
}

/// Reads the memory with the query distribution:
/// out = sum_l p(l|t) vtilde_l / alpha_l (paper 000 eqs. 10-11). A latent whose
/// keys were all -inf so far has alpha = 0 and contributes nothing; a query
/// whose logits are all -inf reads zero.
template <Real T>
void latte_read(const T* q, const T* normaliser, const T* memory, index_t L, index_t Dv,
                T* out) noexcept {
  std::fill(out, out + Dv, T(0));
  T q_max = -std::numeric_limits<T>::infinity();
  for (index_t l = 0; l < L; ++l) q_max = std::max(q_max, q[l]);
  if (q_max == -std::numeric_limits<T>::infinity()) return;
  T beta = 0;  // eq. 9, shifted by q_max
  for (index_t l = 0; l < L; ++l) beta += std::exp(q[l] - q_max);
  for (index_t l = 0; l < L; ++l) {
    if (normaliser[l] == T(0)) continue;
    const T gamma = std::exp(q[l] - q_max) / (beta * normaliser[l]);  // eq. 11
    const T* vtilde = memory + l * Dv;
    for (index_t d = 0; d < Dv; ++d) out[d] += gamma * vtilde[d];
  }
}

/// Latent l's part of latte_absorb, given its rescale and weight:
/// alpha_l <- c alpha_l + w, vtilde_l <- c vtilde_l + w value.
template <Real T>
void latte_absorb_term(Absorb<T> a, const T* value, LatteCarry<T> carry, index_t l,
                       index_t Dv) noexcept {
  T* vtilde = carry.memory + l * Dv;
  if (carry.compensated()) {
    T* vtilde_low = carry.memory_low + l * Dv;
    if (a.carry_scale != T(1)) {
      detail::compensated_scale(carry.normaliser[l], carry.normaliser_low[l], a.carry_scale);
      for (index_t d = 0; d < Dv; ++d) detail::compensated_scale(vtilde[d], vtilde_low[d], a.carry_scale);
    }
    detail::compensated_add(carry.normaliser[l], carry.normaliser_low[l], a.weight);
    for (index_t d = 0; d < Dv; ++d)
      detail::compensated_add(vtilde[d], vtilde_low[d], detail::rounded_product(a.weight, value[d]));
    return;
  }
  carry.normaliser[l] = carry.normaliser[l] * a.carry_scale + a.weight;
  for (index_t d = 0; d < Dv; ++d) vtilde[d] = vtilde[d] * a.carry_scale + a.weight * value[d];
}

/// Absorbs one token into the carry: key logits k_t [L] and the value as the
/// memory stores it (v_t, or R^{-t} v_t under VAPOR) [Dv]
/// (paper 000 eq. 12, stabilised as eq. 21), as compensated sums when the
/// carry has its low parts.
template <Stabilizer Stab, Real T>
void latte_absorb(const T* k, const T* value, LatteCarry<T> carry, index_t L,
                  index_t Dv) noexcept {
  for (index_t l = 0; l < L; ++l)
    latte_absorb_term(Stab::absorb(carry.running_max[l], k[l]), value, carry, l, Dv);  // eq. 21
}

/// Absorbs the token at absolute position `position` (eq. 21; VAPOR eq. 22
/// enters R^{-s} v_s). `rotated` is Dv scratch values.
template <Stabilizer Stab, Positional Pos, Real T>
void latte_absorb_token(const T* k, const T* v, LatteCarry<T> carry, index_t L, index_t Dv,
                        const double* theta, std::int64_t position, T* rotated) noexcept {
  const T* value = v;
  if constexpr (Pos::rotates_values) {
    std::copy(v, v + Dv, rotated);
    Pos::rotate(rotated, Dv, theta, -position);  // R^{-s} v_s
    value = rotated;
  }
  latte_absorb<Stab>(k, value, carry, L, Dv);
}

/// carry <- the carry of carry's tokens followed by `later`'s (each started
/// from an empty carry where its tokens begin): both sums rescaled to the
/// larger running maximum and added. The associative merge that segments a
/// scan over threads (cpu latte_causal_forward) and over ranks
/// (latte/distributed/). Compensated carries merge their pairs by TwoSum.
template <Real T>
void latte_append_carry(LatteCarry<T> carry, LatteCarry<const T> later, index_t L,
                        index_t Dv) noexcept {
  constexpr T neg_inf = -std::numeric_limits<T>::infinity();
  for (index_t l = 0; l < L; ++l) {
    const T m_a = carry.running_max[l], m_b = later.running_max[l];
    const T m = std::max(m_a, m_b);
    const T scale_a = m_a == neg_inf ? T(0) : std::exp(m_a - m);
    const T scale_b = m_b == neg_inf ? T(0) : std::exp(m_b - m);
    carry.running_max[l] = m;
    if (carry.compensated()) {  // both compensated: (a, a_low) scale_a + (b, b_low) scale_b
      auto merge = [&](T& hi, T& lo, T later_hi, T later_lo) {
        detail::compensated_scale(hi, lo, scale_a);
        detail::compensated_scale(later_hi, later_lo, scale_b);
        detail::compensated_add(hi, lo, later_hi);
        detail::compensated_add(hi, lo, later_lo);
      };
      merge(carry.normaliser[l], carry.normaliser_low[l], later.normaliser[l],
            later.normaliser_low[l]);
      for (index_t d = 0; d < Dv; ++d)
        merge(carry.memory[l * Dv + d], carry.memory_low[l * Dv + d], later.memory[l * Dv + d],
              later.memory_low[l * Dv + d]);
      continue;
    }
    carry.normaliser[l] = carry.normaliser[l] * scale_a + later.normaliser[l] * scale_b;
    T* mem_a = carry.memory + l * Dv;
    const T* mem_b = later.memory + l * Dv;
    for (index_t d = 0; d < Dv; ++d) mem_a[d] = mem_a[d] * scale_a + mem_b[d] * scale_b;
  }
}

/// One causal step at absolute position `position` (paper 000 eqs. 12 and 21,
/// VAPOR eq. 22). `rotated` is Dv scratch values.
template <Stabilizer Stab, Positional Pos, Real T>
void latte_causal_step(const T* q, const T* k, const T* v, T* out, LatteCarry<T> carry, index_t L,
                       index_t Dv, const double* theta, std::int64_t position,
                       T* rotated) noexcept {
  latte_absorb_token<Stab, Pos>(k, v, carry, L, Dv, theta, position, rotated);
  latte_read(q, carry.normaliser, carry.memory, L, Dv, out);
  if constexpr (Pos::rotates_values) Pos::rotate(out, Dv, theta, position);  // R^t
}

/// Causal Latte over a whole [B, T, H, *] sequence, continuing from `carry_of`
/// (a callable (b, h) -> LatteCarry) at absolute position `first_position`.
template <Stabilizer Stab, Positional Pos, Real T, class CarryOf>
void latte_causal_forward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                          TensorView<const T, 4> v, TensorView<T, 4> out,
                          const std::vector<double>& angles, std::int64_t first_position,
                          CarryOf&& carry_of) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), L = q.extent(3);
  const index_t Dv = v.extent(3), pairs = Dv / 2;
  std::vector<T> rotated(static_cast<std::size_t>(Dv));
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h) {
      const LatteCarry<T> carry = carry_of(b, h);
      const double* theta = angles.empty() ? nullptr : angles.data() + h * pairs;
      for (index_t t = 0; t < Tn; ++t)
        latte_causal_step<Stab, Pos>(q.row(b, t, h), k.row(b, t, h), v.row(b, t, h),
                                     out.row(b, t, h), carry, L, Dv, theta, first_position + t,
                                     rotated.data());
    }
}

/// Absorbs a [B, T, H, *] sequence into carry_of(b, h) from absolute position
/// `first_position` without reading it: the carry forward would leave.
template <Stabilizer Stab, Positional Pos, Real T, class CarryOf>
void latte_causal_absorb(TensorView<const T, 4> k, TensorView<const T, 4> v,
                         const std::vector<double>& angles, std::int64_t first_position,
                         CarryOf&& carry_of) {
  const index_t B = k.extent(0), Tn = k.extent(1), H = k.extent(2), L = k.extent(3);
  const index_t Dv = v.extent(3), pairs = Dv / 2;
  std::vector<T> rotated(static_cast<std::size_t>(Dv));
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h) {
      const LatteCarry<T> carry = carry_of(b, h);
      const double* theta = angles.empty() ? nullptr : angles.data() + h * pairs;
      for (index_t t = 0; t < Tn; ++t)
        latte_absorb_token<Stab, Pos>(k.row(b, t, h), v.row(b, t, h), carry, L, Dv, theta,
                                      first_position + t, rotated.data());
    }
}

/// Bidirectional Latte (paper 000 eqs. 5-7, VAPOR eq. 22 without the causal limit):
/// o_t = R^t sum_l p(l|t) sum_s p(s|l) R^{-s} v_s.
template <Stabilizer Stab, Positional Pos, Real T>
void latte_bidirectional_forward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                                 TensorView<const T, 4> v, TensorView<T, 4> out,
                                 const std::vector<double>& angles) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), L = q.extent(3);
  const index_t Dv = v.extent(3), pairs = Dv / 2;
  std::vector<T> shift(static_cast<std::size_t>(L)), normaliser(static_cast<std::size_t>(L));
  std::vector<T> memory(static_cast<std::size_t>(L * Dv)), rotated(static_cast<std::size_t>(Dv));
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h) {
      const double* theta = angles.empty() ? nullptr : angles.data() + h * pairs;
      // p(s|l) = exp(k_{s,l} - shift_l) / alpha_l, shift_l from the column maximum.
      for (index_t l = 0; l < L; ++l) {
        T column_max = -std::numeric_limits<T>::infinity();
        for (index_t s = 0; s < Tn; ++s) column_max = std::max(column_max, k(b, s, h, l));
        shift[l] = Stab::reference_for(column_max);
      }
      std::fill(normaliser.begin(), normaliser.end(), T(0));
      std::fill(memory.begin(), memory.end(), T(0));
      for (index_t s = 0; s < Tn; ++s) {
        const T* value = v.row(b, s, h);
        if constexpr (Pos::rotates_values) {
          std::copy(value, value + Dv, rotated.data());
          Pos::rotate(rotated.data(), Dv, theta, -static_cast<std::int64_t>(s));
          value = rotated.data();
        }
        const T* ks = k.row(b, s, h);
        for (index_t l = 0; l < L; ++l) {
          const T weight = std::exp(ks[l] - shift[l]);
          normaliser[l] += weight;
          for (index_t d = 0; d < Dv; ++d) memory[l * Dv + d] += weight * value[d];
        }
      }
      for (index_t t = 0; t < Tn; ++t) {
        T* o = out.row(b, t, h);
        latte_read(q.row(b, t, h), normaliser.data(), memory.data(), L, Dv, o);
        if constexpr (Pos::rotates_values) Pos::rotate(o, Dv, theta, static_cast<std::int64_t>(t));
      }
    }
}

// ------------------------------------------------------------------ backward --
//
// Gradients of the scalar loss sum_t <g_t, o_t> (g = d_out), DESIGN §3.6.
// The recurrences are differentiated as the forward runs them: on the stored
// (scaled) normaliser alpha^_t = c_t alpha^_{t-1} + w_t and memory
// M^_t = c_t M^_{t-1} + w_t vtilde_t, with the stabiliser's factors
// c_t = exp(m_{t-1} - m_t) <= 1 and w_t = exp(k_t - m_t) <= 1 and the
// references m held fixed (the output does not depend on them). Their adjoints
//   Mbar_t = c_{t+1} Mbar_{t+1} + p(l|t) g~_t / alpha^_t,
//   Abar_t = c_{t+1} Abar_{t+1} - p(l|t) dp_{t,l} / alpha^_t,
//   dp_{t,l} = <g~_t, M^_t> / alpha^_t,
// give dvtilde_t = sum_l w_t Mbar_t and dk_t = w_t (<vtilde_t, Mbar_t> + Abar_t),
// and dq_{t,l} = p(l|t) (dp_{t,l} - sum_j p(j|t) dp_{t,j}). Every factor of the
// reverse scan is one the forward already formed (c, w <= 1), and 1 / alpha^
// is at most 1 with RunningMax (the maximum's own term is exp(0)), so no
// exponential with a positive argument and no overflow, whatever the spread.
// A -inf key has w = 0 and gets exactly 0; a latent whose keys so far are all
// -inf (alpha^ = 0) is read as 0 by the forward and gets no gradient through
// the read. VAPOR: vtilde_s = R^{-s} v_s and g~_t = R^{-t} g_t, dv_s = R^s dvtilde_s.

/// One (batch, head)'s gradient with respect to a carry's stored normaliser [L]
/// and memory [L x Dv] (the running maximum held fixed).
template <class T>
struct LatteCarryGradient {
  T* normaliser;
  T* memory;
};

/// dtheta_i += position * <a, J b>_i per pair (J turns a pair by +90 degrees):
/// the angle gradient of R^position b read by a (DESIGN §3.6, VAPOR).
template <Real T>
void accumulate_angle_gradient(double* d_theta, index_t Dv, const T* a, const T* b,
                               std::int64_t position) noexcept {
  for (index_t i = 0; i < Dv / 2; ++i)
    d_theta[i] += static_cast<double>(position) *
                  (static_cast<double>(a[2 * i + 1]) * b[2 * i] -
                   static_cast<double>(a[2 * i]) * b[2 * i + 1]);
}

/// The gradients a final state's gradient alone gives the tokens the state
/// absorbed (the causal backward with d_out = 0; DESIGN §3.6). A carry's
/// stored sums against the reference m (held fixed, docs/backward.md) are
/// alpha_l = sum_s w_{s,l} and vtilde_l = sum_s w_{s,l} R^{-s} v_s with
/// w_{s,l} = exp(k_{s,l} - m_l), so with D = (Dalpha, Dvtilde) the state's gradient:
///   dk_{s,l} += w_{s,l} (Dalpha_l + <Dvtilde_l, R^{-s} v_s>)
///   dv_s     += R^{s} sum_l w_{s,l} Dvtilde_l
///   dtheta_i += -s <sum_l w_{s,l} Dvtilde_l, J R^{-s} v_s>_i   (VAPOR, eq. 22)
/// Tokens [B, T, H, *] from absolute position `first_position`;
/// final_of(b, h) gives {m [L], Dalpha [L], Dvtilde [L x Dv]}; adds into dk,
/// dv and (when not null) d_theta [H * Dv/2]. O(T L Dv) per head; w <= 1
/// where m is at least every key logit (the state's reference).
template <Positional Pos, Real T, class FinalOf>
void latte_final_state_backward(TensorView<const T, 4> k, TensorView<const T, 4> v,
                                const std::vector<double>& angles, std::int64_t first_position,
                                FinalOf&& final_of, TensorView<T, 4> dk, TensorView<T, 4> dv,
                                double* d_theta) {
  const index_t B = k.extent(0), Tn = k.extent(1), H = k.extent(2), L = k.extent(3);
  const index_t Dv = v.extent(3), pairs = Dv / 2;
  std::vector<T> rotated(static_cast<std::size_t>(Dv)), d_rotated(static_cast<std::size_t>(Dv));
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h) {
      const auto [m, d_normaliser, d_memory] = final_of(b, h);
      const double* theta = angles.empty() ? nullptr : angles.data() + h * pairs;
      for (index_t t = 0; t < Tn; ++t) {
        const std::int64_t s = first_position + t;
        const T* value = v.row(b, t, h);
        std::copy(value, value + Dv, rotated.data());
        if constexpr (Pos::rotates_values) Pos::rotate(rotated.data(), Dv, theta, -s);  // R^{-s} v_s
        std::fill(d_rotated.begin(), d_rotated.end(), T(0));
        const T* key = k.row(b, t, h);
        T* d_key = dk.row(b, t, h);
        for (index_t l = 0; l < L; ++l) {
          if (key[l] == -std::numeric_limits<T>::infinity()) continue;  // w = 0
          const T weight = std::exp(key[l] - m[l]);
          const T* row = d_memory + l * Dv;
          T read = d_normaliser[l];
          for (index_t d = 0; d < Dv; ++d) {
            read += row[d] * rotated[static_cast<std::size_t>(d)];
            d_rotated[static_cast<std::size_t>(d)] += weight * row[d];
          }
          d_key[l] += weight * read;
        }
        if constexpr (Pos::rotates_values) {
          if (d_theta != nullptr)
            accumulate_angle_gradient(d_theta + h * pairs, Dv, d_rotated.data(), rotated.data(), -s);
          Pos::rotate(d_rotated.data(), Dv, theta, s);  // R^{s}: the transpose of R^{-s}
        }
        T* d_value = dv.row(b, t, h);
        for (index_t d = 0; d < Dv; ++d) d_value[d] += d_rotated[static_cast<std::size_t>(d)];
      }
    }
}

/// p(l|t) = softmax_l(q_t) into `p` (all zero when every logit is -inf).
template <Real T>
void latent_softmax(const T* q, index_t L, T* p) noexcept {
  T q_max = -std::numeric_limits<T>::infinity();
  for (index_t l = 0; l < L; ++l) q_max = std::max(q_max, q[l]);
  std::fill(p, p + L, T(0));
  if (q_max == -std::numeric_limits<T>::infinity()) return;
  T beta = 0;
  for (index_t l = 0; l < L; ++l) beta += (p[l] = std::exp(q[l] - q_max));
  for (index_t l = 0; l < L; ++l) p[l] /= beta;
}

/// The read's backward for one token (paper 000 eq. 11 differentiated):
/// dp_l = <g, M^_l> / alpha^_l, dq_l = p_l (dp_l - sum_j p_j dp_j); returns
/// p_l / alpha^_l and p_l dp_l / alpha^_l (0 where alpha^_l = 0) in `read_weight`
/// and `read_dp`, and y = sum_l p_l M^_l / alpha^_l (the unrotated output) when
/// `y` is not null. Returns sum_l p_l dp_l = <g, y>.
template <Real T>
T latte_read_backward(const T* q, const T* g, const T* normaliser, const T* memory, index_t L,
                      index_t Dv, T* dq, T* p, T* read_weight, T* read_dp, T* y) noexcept {
  latent_softmax(q, L, p);
  T mean_dp = 0;
  for (index_t l = 0; l < L; ++l) {
    read_weight[l] = read_dp[l] = dq[l] = 0;  // dq holds dp_l until the mean is known
    if (normaliser[l] == T(0) || p[l] == T(0)) continue;
    const T* vtilde = memory + l * Dv;
    T dot = 0;
    for (index_t d = 0; d < Dv; ++d) dot += g[d] * vtilde[d];
    dq[l] = dot / normaliser[l];
    read_weight[l] = p[l] / normaliser[l];
    read_dp[l] = read_weight[l] * dq[l];
    mean_dp += p[l] * dq[l];
  }
  for (index_t l = 0; l < L; ++l) dq[l] = p[l] * (dq[l] - mean_dp);
  if (y) {
    std::fill(y, y + Dv, T(0));
    for (index_t l = 0; l < L; ++l)
      for (index_t d = 0; d < Dv; ++d) y[d] += read_weight[l] * memory[l * Dv + d];
  }
  return mean_dp;
}

/// Causal Latte backward over a whole [B, T, H, *] sequence starting at
/// absolute position `first_position`. `initial_of(b, h)` fills a carry with the
/// state the forward started from; `final_gradient_of(b, h, m_T)` returns the
/// gradient of the state the forward left (LatteCarryGradient<const T>, null
/// members: none), given the recomputed running maximum m_T [L] to express it
/// against; `initial_gradient_of(b, h)` returns where the initial state's
/// gradient goes (null members: not asked). `d_angles` [H * (Dv/2)] doubles,
/// accumulated, or null. `read_dots` [B, T, H], when not empty, receives each
/// token's <g_t, o_t> (Latte Macchiato's mixture needs it). Workspace
/// O(T * L + L * Dv) per call. With Sum = CompensatedSums the sums over the
/// whole past (alpha^, M^) and future (their adjoints) are compensated
/// (TwoSum per term and element, as latte_absorb's), so that their error does
/// not grow with T; PlainSums: plain running sums.
template <Stabilizer Stab, Positional Pos, Summation Sum = CompensatedSums, Real T,
          class InitialOf, class FinalGradientOf, class InitialGradientOf>
void latte_causal_backward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                           TensorView<const T, 4> v, TensorView<const T, 4> g,
                           TensorView<T, 4> dq, TensorView<T, 4> dk, TensorView<T, 4> dv,
                           const std::vector<double>& angles, std::int64_t first_position,
                           InitialOf&& initial_of, FinalGradientOf&& final_gradient_of,
                           InitialGradientOf&& initial_gradient_of, double* d_angles,
                           TensorView<T, 3> read_dots = {}) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), L = q.extent(3);
  const index_t Dv = v.extent(3), pairs = Dv / 2;
  const auto n = [](index_t count) { return static_cast<std::size_t>(count); };
  // Per token of one (batch, head): c_t, w_t, p_t / alpha^_t, p_t dp_t / alpha^_t.
  std::vector<T> carry_scale(n(Tn * L)), weight(n(Tn * L)), read_weight(n(Tn * L)),
      read_dp(n(Tn * L));
  std::vector<T> carry_buffer(n(2 * L + L * Dv)), memory_bar(n(L * Dv)), normaliser_bar(n(L));
  // The low parts of alpha^, M^, Abar and Mbar [L | L x Dv | L | L x Dv] (compensated sums).
  std::vector<T> low(Sum::compensated ? n(2 * (L + L * Dv)) : 0);
  std::vector<T> p(n(L)), rotated(n(Dv)), g_rotated(n(Dv)), y(n(Dv)), d_vtilde(n(Dv));
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h) {
      const double* theta = angles.empty() ? nullptr : angles.data() + h * pairs;
      double* d_theta = d_angles ? d_angles + h * pairs : nullptr;
      LatteCarry<T> carry{carry_buffer.data(), carry_buffer.data() + L,
                          carry_buffer.data() + 2 * L};
      initial_of(b, h, carry);
      T *normaliser_bar_low = nullptr, *memory_bar_low = nullptr;
      if constexpr (Sum::compensated) {
        std::fill(low.begin(), low.end(), T(0));
        carry.normaliser_low = low.data();
        carry.memory_low = low.data() + L;
        normaliser_bar_low = low.data() + L + L * Dv;
        memory_bar_low = normaliser_bar_low + L;
      }
      auto rotate_to = [&](const T* from, T* to, std::int64_t position) {
        std::copy(from, from + Dv, to);
        if constexpr (Pos::rotates_values) Pos::rotate(to, Dv, theta, position);
        else (void)position;
      };
      // Pass 1, forward: the carry's factors and each token's read backward.
      for (index_t t = 0; t < Tn; ++t) {
        const std::int64_t position = first_position + t;
        rotate_to(v.row(b, t, h), rotated.data(), -position);  // vtilde_t
        const T* kt = k.row(b, t, h);
        for (index_t l = 0; l < L; ++l) {
          const Absorb<T> a = Stab::absorb(carry.running_max[l], kt[l]);  // eq. 21
          carry_scale[n(t * L + l)] = a.carry_scale;
          weight[n(t * L + l)] = a.weight;
          latte_absorb_term(a, rotated.data(), carry, l, Dv);
        }
        rotate_to(g.row(b, t, h), g_rotated.data(), -position);  // g~_t
        const T g_dot_o = latte_read_backward(
            q.row(b, t, h), g_rotated.data(), carry.normaliser, carry.memory, L, Dv,
            dq.row(b, t, h), p.data(), read_weight.data() + t * L, read_dp.data() + t * L,
            d_theta ? y.data() : nullptr);
        if (!read_dots.empty()) read_dots(b, t, h) = g_dot_o;
        if (d_theta) accumulate_angle_gradient(d_theta, Dv, g_rotated.data(), y.data(), t);
      }
      // Pass 2, reverse: the adjoints of the stored normaliser and memory.
      std::fill(memory_bar.begin(), memory_bar.end(), T(0));
      std::fill(normaliser_bar.begin(), normaliser_bar.end(), T(0));
      const LatteCarryGradient<const T> final_gradient = final_gradient_of(b, h, carry.running_max);
      if (final_gradient.memory) std::copy(final_gradient.memory, final_gradient.memory + L * Dv, memory_bar.begin());
      if (final_gradient.normaliser)
        std::copy(final_gradient.normaliser, final_gradient.normaliser + L, normaliser_bar.begin());
      if (d_theta && final_gradient.memory && first_position != 0)
        // The origin move below turns the final memory M^_T by R^{-first_position}
        // too: -first_position * <dM^_T, J M^_T>.
        for (index_t l = 0; l < L; ++l)
          accumulate_angle_gradient(d_theta, Dv, final_gradient.memory + l * Dv,
                                    carry.memory + l * Dv, -first_position);
      for (index_t t = Tn; t-- > 0;) {
        const std::int64_t position = first_position + t;
        const T* gt = g.row(b, t, h);
        rotate_to(gt, g_rotated.data(), -position);
        rotate_to(v.row(b, t, h), rotated.data(), -position);
        std::fill(d_vtilde.begin(), d_vtilde.end(), T(0));
        T* dkt = dk.row(b, t, h);
        for (index_t l = 0; l < L; ++l) {
          T* bar = memory_bar.data() + l * Dv;
          const T rw = read_weight[n(t * L + l)], rdp = read_dp[n(t * L + l)];
          if constexpr (Sum::compensated) {
            detail::compensated_add(normaliser_bar[n(l)], normaliser_bar_low[l], -rdp);
            for (index_t d = 0; d < Dv; ++d)
              detail::compensated_add(bar[d], memory_bar_low[l * Dv + d],
                                      detail::rounded_product(rw, g_rotated[n(d)]));
          } else {
            normaliser_bar[n(l)] -= rdp;
            for (index_t d = 0; d < Dv; ++d) bar[d] += rw * g_rotated[n(d)];
          }
          const T w = weight[n(t * L + l)];
          T dot = 0;
          for (index_t d = 0; d < Dv; ++d) {
            d_vtilde[n(d)] += w * bar[d];
            dot += rotated[n(d)] * bar[d];
          }
          dkt[l] = w == T(0) ? T(0) : w * (dot + normaliser_bar[n(l)]);
          // Into the adjoints of the carry before token t.
          const T c = carry_scale[n(t * L + l)];
          if constexpr (Sum::compensated) {
            if (c != T(1)) {
              detail::compensated_scale(normaliser_bar[n(l)], normaliser_bar_low[l], c);
              for (index_t d = 0; d < Dv; ++d)
                detail::compensated_scale(bar[d], memory_bar_low[l * Dv + d], c);
            }
          } else {
            normaliser_bar[n(l)] *= c;
            for (index_t d = 0; d < Dv; ++d) bar[d] *= c;
          }
        }
        if (d_theta) accumulate_angle_gradient(d_theta, Dv, d_vtilde.data(), rotated.data(), -t);
        rotate_to(d_vtilde.data(), dv.row(b, t, h), position);  // dv_t = R^t dvtilde_t
      }
      if (d_theta && first_position != 0) {
        // The angle terms above weigh positions from the first token (t, not
        // first_position + t: fp32 at position 1e7 keeps its digits). Moving
        // the origin to first_position turns the initial memory M^_0 by
        // R^{first_position}, which adds first_position * <Mbar_0, J M^_0>.
        initial_of(b, h, carry);
        for (index_t l = 0; l < L; ++l)
          accumulate_angle_gradient(d_theta, Dv, memory_bar.data() + l * Dv,
                                    carry.memory + l * Dv, first_position);
      }
      const LatteCarryGradient<T> initial_gradient = initial_gradient_of(b, h);
      if (initial_gradient.memory) std::copy(memory_bar.begin(), memory_bar.end(), initial_gradient.memory);
      if (initial_gradient.normaliser)
        std::copy(normaliser_bar.begin(), normaliser_bar.end(), initial_gradient.normaliser);
    }
}

/// Bidirectional Latte backward (DESIGN §3.6): with alpha^_l = sum_s w_{s,l},
/// M^_l = sum_s w_{s,l} vtilde_s (w = exp(k - shift), the shift held fixed),
/// Mbar_l = sum_t p(l|t) g~_t / alpha^_l and Abar_l = -sum_t p(l|t) dp_{t,l} / alpha^_l:
/// dvtilde_s = sum_l w_{s,l} Mbar_l, dk_{s,l} = w_{s,l} (<vtilde_s, Mbar_l> + Abar_l).
/// `read_dots` as in latte_causal_backward.
template <Stabilizer Stab, Positional Pos, Real T>
void latte_bidirectional_backward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                                  TensorView<const T, 4> v, TensorView<const T, 4> g,
                                  TensorView<T, 4> dq, TensorView<T, 4> dk, TensorView<T, 4> dv,
                                  const std::vector<double>& angles, double* d_angles,
                                  TensorView<T, 3> read_dots = {}) {
  const index_t B = q.extent(0), Tn = q.extent(1), H = q.extent(2), L = q.extent(3);
  const index_t Dv = v.extent(3), pairs = Dv / 2;
  const auto n = [](index_t count) { return static_cast<std::size_t>(count); };
  std::vector<T> shift(n(L)), normaliser(n(L)), memory(n(L * Dv)), normaliser_bar(n(L)),
      memory_bar(n(L * Dv));
  std::vector<T> p(n(L)), read_weight(n(L)), read_dp(n(L)), rotated(n(Dv)), y(n(Dv)),
      d_vtilde(n(Dv));
  for (index_t b = 0; b < B; ++b)
    for (index_t h = 0; h < H; ++h) {
      const double* theta = angles.empty() ? nullptr : angles.data() + h * pairs;
      double* d_theta = d_angles ? d_angles + h * pairs : nullptr;
      auto rotate_to = [&](const T* from, T* to, std::int64_t position) {
        std::copy(from, from + Dv, to);
        if constexpr (Pos::rotates_values) Pos::rotate(to, Dv, theta, position);
        else (void)position;
      };
      // The forward's sums, as latte_bidirectional_forward forms them.
      for (index_t l = 0; l < L; ++l) {
        T column_max = -std::numeric_limits<T>::infinity();
        for (index_t s = 0; s < Tn; ++s) column_max = std::max(column_max, k(b, s, h, l));
        shift[n(l)] = Stab::reference_for(column_max);
      }
      std::fill(normaliser.begin(), normaliser.end(), T(0));
      std::fill(memory.begin(), memory.end(), T(0));
      for (index_t s = 0; s < Tn; ++s) {
        rotate_to(v.row(b, s, h), rotated.data(), -static_cast<std::int64_t>(s));
        for (index_t l = 0; l < L; ++l) {
          const T w = std::exp(k(b, s, h, l) - shift[n(l)]);
          normaliser[n(l)] += w;
          for (index_t d = 0; d < Dv; ++d) memory[n(l * Dv + d)] += w * rotated[n(d)];
        }
      }
      // The reads' backward: dq, and the adjoints of the sums.
      std::fill(normaliser_bar.begin(), normaliser_bar.end(), T(0));
      std::fill(memory_bar.begin(), memory_bar.end(), T(0));
      for (index_t t = 0; t < Tn; ++t) {
        const std::int64_t position = t;
        T* g_rotated = rotated.data();
        rotate_to(g.row(b, t, h), g_rotated, -position);
        const T g_dot_o = latte_read_backward(
            q.row(b, t, h), g_rotated, normaliser.data(), memory.data(), L, Dv, dq.row(b, t, h),
            p.data(), read_weight.data(), read_dp.data(), d_theta ? y.data() : nullptr);
        if (!read_dots.empty()) read_dots(b, t, h) = g_dot_o;
        if (d_theta) accumulate_angle_gradient(d_theta, Dv, g_rotated, y.data(), position);
        for (index_t l = 0; l < L; ++l) {
          normaliser_bar[n(l)] -= read_dp[n(l)];
          for (index_t d = 0; d < Dv; ++d) memory_bar[n(l * Dv + d)] += read_weight[n(l)] * g_rotated[d];
        }
      }
      // The sums' backward: dk and dv.
      for (index_t s = 0; s < Tn; ++s) {
        const std::int64_t position = s;
        rotate_to(v.row(b, s, h), rotated.data(), -position);
        std::fill(d_vtilde.begin(), d_vtilde.end(), T(0));
        for (index_t l = 0; l < L; ++l) {
          const T w = std::exp(k(b, s, h, l) - shift[n(l)]);
          const T* bar = memory_bar.data() + l * Dv;
          T dot = 0;
          for (index_t d = 0; d < Dv; ++d) {
            d_vtilde[n(d)] += w * bar[d];
            dot += rotated[n(d)] * bar[d];
          }
          dk(b, s, h, l) = w == T(0) ? T(0) : w * (dot + normaliser_bar[n(l)]);
        }
        if (d_theta)
          accumulate_angle_gradient(d_theta, Dv, d_vtilde.data(), rotated.data(), -position);
        rotate_to(d_vtilde.data(), dv.row(b, s, h), position);
      }
    }
}

}  // namespace latte::reference
