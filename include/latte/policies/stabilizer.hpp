#pragma once
// Stabilizer policies: how exp(key logit) is kept inside the floating-point range
// while the per-latent normaliser alpha_{t,l} = sum_{s<=t} exp(k_{s,l}) is accumulated.
#include <cmath>
#include <concepts>
#include <limits>

#include "latte/core/types.hpp"

namespace latte {

/// What absorbing one new logit into a running sum does: the carried sums are
/// multiplied by `carry_scale`, then `weight` times the new term is added.
template <Real T>
struct Absorb {
  T carry_scale;
  T weight;
};

/// Exact stabilisation with a running maximum per latent (paper 000 App. B.2,
/// eq. 21): m_t = max(m_{t-1}, k_t); sums are stored scaled by exp(-m_t), so
/// each step rescales by exp(m_{t-1} - m_t) and adds exp(k_t - m_t).
/// Finite and exact for logit sequences such as [1, 10, 1000].
struct RunningMax {
  static constexpr const char* name = "running_max";

  /// The running maximum before any key was seen.
  template <Real T>
  static constexpr T initial_reference() noexcept {
    return -std::numeric_limits<T>::infinity();
  }

  /// Absorbs `logit` into the running maximum `reference` (updated in place).
  template <Real T>
  static Absorb<T> absorb(T& reference, T logit) noexcept {
    const T updated = logit > reference ? logit : reference;
    if (updated == -std::numeric_limits<T>::infinity()) {
      return {T(1), T(0)};  // nothing but -inf so far: the sums stay empty
    }
    const Absorb<T> step{std::exp(reference - updated), std::exp(logit - updated)};  // eq. 21
    reference = updated;
    return step;
  }

  /// The shift used when all logits of a column are known (bidirectional form).
  template <Real T>
  static T reference_for(T column_max) noexcept {
    return column_max == -std::numeric_limits<T>::infinity() ? T(0) : column_max;
  }
};

/// Raw exponentials without any shift: the ablation that overflows on logit
/// spreads such as [1, 10, 1000]. Use it only to show why RunningMax exists.
struct NoStabilizer {
  static constexpr const char* name = "no_stabilizer";

  template <Real T>
  static constexpr T initial_reference() noexcept {
    return T(0);
  }

  template <Real T>
  static Absorb<T> absorb(T& /*reference*/, T logit) noexcept {
    return {T(1), std::exp(logit)};
  }

  template <Real T>
  static T reference_for(T /*column_max*/) noexcept {
    return T(0);
  }
};

/// A stabilizer provides a starting reference, an absorb step and the
/// reference for a fully known column.
template <class P>
concept Stabilizer = requires(double& reference, double logit, float& reference_f, float logit_f) {
  { P::name } -> std::convertible_to<const char*>;
  { P::template initial_reference<double>() } -> std::same_as<double>;
  { P::absorb(reference, logit) } -> std::same_as<Absorb<double>>;
  { P::absorb(reference_f, logit_f) } -> std::same_as<Absorb<float>>;
  { P::reference_for(logit) } -> std::same_as<double>;
};

}  // namespace latte
