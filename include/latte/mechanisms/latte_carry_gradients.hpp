#pragma once
// The state hooks of the causal Latte backward (reference / cpu
// latte_causal_backward) for a state whose fields 0, 1, 2 are Latte's carry:
// running_max and normaliser [B H L], memory [B H L Dv] (LatteState,
// MacchiatoState). Shared by LatteAttention and LatteMacchiato.
//
// A carry's gradient is with respect to the stored normaliser and memory,
// the running maximum held fixed (docs/backward.md).
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "latte/backends/reference/latte.hpp"
#include "latte/core/checked_size.hpp"
#include "latte/core/error.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/policies/stabilizer.hpp"

namespace latte::detail {

/// d_angles [H, Dv/2] += the angle gradient a backward summed in double
/// (`sums`, H * Dv/2 values; nothing when empty).
template <Real T>
void add_angle_sums(const TensorView<T, 2>& d_angles, const std::vector<double>& sums) {
  if (sums.empty()) return;
  const index_t pairs = d_angles.extent(1);
  for (index_t h = 0; h < d_angles.extent(0); ++h)
    for (index_t i = 0; i < pairs; ++i)
      d_angles(h, i) += static_cast<T>(sums[static_cast<std::size_t>(h * pairs + i)]);
}

template <Stabilizer Stab, Real T, class State>
class LatteCarryHooks {
 public:
  /// Any of the states may be null: a fresh start, no final gradient, no
  /// initial gradient asked for.
  LatteCarryHooks(const State* initial, const State* d_final, State* d_initial, index_t batch,
                  index_t heads, index_t latents, index_t value_dim)
      : initial_(initial), d_final_(d_final), d_initial_(d_initial), heads_(heads), L_(latents),
        Dv_(value_dim) {
    if (d_final)  // per (batch, head): L + L * Dv, used only where m_F != m_T
      rescaled_.resize(static_cast<std::size_t>(checked_count<T>(
          "states.d_final", {batch, heads, checked_sum("dims", {L_, checked_product("dims", {L_, Dv_})})})));
  }

  /// The carry the forward started from (reset when there is no initial state).
  void initial_of(index_t b, index_t h, reference::LatteCarry<T> carry) const {
    if (!initial_) return reference::latte_reset<Stab>(carry, L_, Dv_);
    // The sums as one value each: fl(hi + lo) of the state's compensated pairs.
    const reference::LatteCarry<const T> from = initial_->carry(b, h);
    std::copy_n(from.running_max, L_, carry.running_max);
    for (index_t l = 0; l < L_; ++l) carry.normaliser[l] = from.normaliser[l] + from.normaliser_low[l];
    for (index_t i = 0; i < L_ * Dv_; ++i) carry.memory[i] = from.memory[i] + from.memory_low[i];
  }

  /// The final state's gradient, re-expressed against the recomputed running
  /// maximum m_T where it differs from d_final's (factor exp(m_T - m_F): the
  /// stored memory is the sum times exp(-m)). Heads may call it concurrently.
  reference::LatteCarryGradient<const T> final_gradient_of(index_t b, index_t h, const T* m_T) {
    if (!d_final_) return {nullptr, nullptr};
    const index_t head = b * heads_ + h;
    const T* m_F = d_final_->field(0) + head * L_;
    const T* normaliser = d_final_->field(1) + head * L_;
    const T* memory = d_final_->field(2) + head * L_ * Dv_;
    if (std::equal(m_F, m_F + L_, m_T)) return {normaliser, memory};
    T* scaled = rescaled_.data() + head * (L_ + L_ * Dv_);
    for (index_t l = 0; l < L_; ++l) {
      require(m_F[l] > -std::numeric_limits<T>::infinity() ||
                  m_T[l] == -std::numeric_limits<T>::infinity(),
              "states.d_final",
              "running_max must be the final state's (copy the state the forward left, then fill "
              "normaliser and memory): latent " + std::to_string(l) + " of (batch " +
                  std::to_string(b) + ", head " + std::to_string(h) +
                  ") has -inf where the final state's is finite");
      const T factor = m_F[l] == m_T[l] ? T(1) : std::exp(m_T[l] - m_F[l]);
      scaled[l] = normaliser[l] * factor;
      for (index_t d = 0; d < Dv_; ++d) scaled[L_ + l * Dv_ + d] = memory[l * Dv_ + d] * factor;
    }
    return {scaled, scaled + L_};
  }

  /// Where the initial carry's gradient goes (null when not asked for).
  reference::LatteCarryGradient<T> initial_gradient_of(index_t b, index_t h) const {
    if (!d_initial_) return {nullptr, nullptr};
    const index_t head = b * heads_ + h;
    return {d_initial_->field(1) + head * L_, d_initial_->field(2) + head * L_ * Dv_};
  }

 private:
  const State* initial_;
  const State* d_final_;
  State* d_initial_;
  index_t heads_, L_, Dv_;
  std::vector<T> rescaled_;
};

}  // namespace latte::detail
