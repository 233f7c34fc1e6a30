#pragma once
// What Lavo::backward and Lavo::cross_backward write and read besides the
// forward's inputs.
//
// Gradients are of a scalar loss whose gradient with respect to the output is
// the `d_out` passed to backward. Nothing is kept from the forward: backward
// recomputes what it needs from the inputs (docs/backward.md).
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/mechanisms/lavo_state.hpp"

namespace latte {

/// The caller-owned buffers Lavo::backward fills.
template <Real T>
struct LavoGradients {
  TensorView<T, 4> d_queries;  ///< [B, T, H, d], overwritten
  TensorView<T, 4> d_keys;     ///< [B, T, H, d], overwritten
  TensorView<T, 4> d_values;   ///< [B, T, H, d], overwritten
  /// [H, 2w - 1]: the relative bias P. Accumulated (+=, summed in double inside
  /// the call); leave empty when P is not trained.
  TensorView<T, 2> d_relative_bias{};
  /// [H, r, d]: the bases B (the paper keeps them orthonormal and fixed; a
  /// model may train them). Accumulated as d_relative_bias; may be left empty.
  TensorView<T, 3> d_bases{};
};

/// The caller-owned buffers Lavo::cross_backward fills.
template <Real T>
struct LavoCrossGradients {
  TensorView<T, 4> d_queries;  ///< [B, Tq, H, d], overwritten
  TensorView<T, 4> d_source;   ///< [B, Ts, H, d], overwritten
  TensorView<T, 3> d_bases{};  ///< [H, r, d], accumulated; may be left empty
};

/// Causal LAVO's state in a backward (training in chunks, as
/// LatteStateGradients). A state's gradient is with respect to the state as
/// saved: the ring's keys and values (slot s % w), window_sum, and the
/// memory's total memory_sum + memory_compensation (one number in two words:
/// d_initial gets its gradient in both fields, and of d_final the memory_sum
/// field is read). It lives in a LavoState at the position of the state it is
/// the gradient of.
template <Real T>
struct LavoStateGradients {
  /// The state the forward continued from, as it was before the forward
  /// (nullptr: a fresh state at position 0).
  const LavoState<T>* initial = nullptr;
  /// The gradient of the state the forward left (nullptr: zero).
  const LavoState<T>* d_final = nullptr;
  /// Written when not null: the gradient of `initial` (make it with make_state(batch)).
  LavoState<T>* d_initial = nullptr;
};

}  // namespace latte
