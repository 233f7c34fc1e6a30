#pragma once
// What LinearAttention::backward (and cross_backward) writes and reads besides
// the forward's inputs.
//
// Gradients are of a scalar loss whose gradient with respect to the output is
// the `d_out` passed to backward. Nothing is kept from the forward: backward
// recomputes what it needs from the inputs (docs/backward.md).
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/mechanisms/linear_state.hpp"
#include "latte/policies/leap_module.hpp"

namespace latte {

/// The caller-owned buffers LinearAttention::backward fills.
template <Real T>
struct LinearGradients {
  TensorView<T, 4> d_queries;  ///< [B, T, H, Dk], overwritten
  TensorView<T, 4> d_keys;     ///< [B, S, H, Dk] (S = T for self-attention), overwritten
  TensorView<T, 4> d_values;   ///< [B, S, H, Dv], overwritten
  /// LeaPformer given proportions: dL/dP_q [B, T, H] and dL/dP_k [B, S, H].
  /// Accumulated (+=); leave empty when the proportions are not learned.
  TensorView<T, 3> d_query_proportions{};
  TensorView<T, 3> d_key_proportions{};
  /// LeaPformer with LeaP modules: the modules' weight gradients, accumulated
  /// (+=, in double) into modules shaped as the attention's (make them with
  /// LeaPModule::zeros_like). nullptr: not wanted (the inputs' gradients
  /// still flow through the modules).
  LeaPModule* d_query_module = nullptr;
  LeaPModule* d_key_module = nullptr;
};

/// Causal linear attention's recurrent state in a backward (training in
/// chunks, as flash-linear-attention's initial_state / dh0 and dht). The
/// gradient is with respect to the state as saved: its memory S and
/// normaliser z, in a LinearState made by the same attention.
template <Real T>
struct LinearStateGradients {
  /// The state the forward continued from, as it was before the forward
  /// (nullptr: a fresh state at position 0). Its position is the first token's.
  const LinearState<T>* initial = nullptr;
  /// dL/d(state the forward left) (nullptr: zero).
  const LinearState<T>* d_final = nullptr;
  /// Written when not null: dL/d(initial) (its position is copied from
  /// `initial`). Make it with make_state(batch).
  LinearState<T>* d_initial = nullptr;
};

}  // namespace latte
