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
#include <vector>

#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/policies/positional.hpp"
#include "latte/policies/stabilizer.hpp"

namespace latte::reference {

/// The recurrent carry of one (batch, head): m [L], alpha [L], vtilde [L x Dv].
template <Real T>
struct LatteCarry {
  T* running_max;
  T* normaliser;
  T* memory;
};

/// Sets a carry to the empty prefix.
template <Stabilizer Stab, Real T>
void latte_reset(LatteCarry<T> carry, index_t L, index_t Dv) noexcept {
  std::fill(carry.running_max, carry.running_max + L, Stab::template initial_reference<T>());
  std::fill(carry.normaliser, carry.normaliser + L, T(0));
  std::fill(carry.memory, carry.memory + L * Dv, T(0));
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

/// Absorbs one token into the carry: key logits k_t [L] and the value as the
/// memory stores it (v_t, or R^{-t} v_t under VAPOR) [Dv]
/// (paper 000 eq. 12, stabilised as eq. 21).
template <Stabilizer Stab, Real T>
void latte_absorb(const T* k, const T* value, LatteCarry<T> carry, index_t L,
                  index_t Dv) noexcept {
  for (index_t l = 0; l < L; ++l) {
    const Absorb<T> a = Stab::absorb(carry.running_max[l], k[l]);  // eq. 21
    carry.normaliser[l] = carry.normaliser[l] * a.carry_scale + a.weight;
    T* vtilde = carry.memory + l * Dv;
    for (index_t d = 0; d < Dv; ++d) vtilde[d] = vtilde[d] * a.carry_scale + a.weight * value[d];
  }
}

/// One causal step at absolute position `position` (paper 000 eqs. 12 and 21,
/// VAPOR eq. 22). `rotated` is Dv scratch values.
template <Stabilizer Stab, Positional Pos, Real T>
void latte_causal_step(const T* q, const T* k, const T* v, T* out, LatteCarry<T> carry, index_t L,
                       index_t Dv, const double* theta, std::int64_t position,
                       T* rotated) noexcept {
  const T* value = v;
  if constexpr (Pos::rotates_values) {
    std::copy(v, v + Dv, rotated);
    Pos::rotate(rotated, Dv, theta, -position);  // R^{-s} v_s
    value = rotated;
  }
  latte_absorb<Stab>(k, value, carry, L, Dv);
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

}  // namespace latte::reference
