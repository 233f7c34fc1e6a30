#pragma once
// What LatteAttention::backward writes and reads besides the forward's inputs.
//
// Gradients are of a scalar loss whose gradient with respect to the output is
// the `d_out` passed to backward. Nothing is kept from the forward: backward
// recomputes what it needs from the inputs (docs/backward.md).
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/mechanisms/latte_state.hpp"

namespace latte {

/// The caller-owned buffers LatteAttention::backward fills.
template <Real T>
struct LatteGradients {
  TensorView<T, 4> d_query_logits;  ///< [B, T, H, L], overwritten
  TensorView<T, 4> d_key_logits;    ///< [B, T, H, L], overwritten
  TensorView<T, 4> d_values;        ///< [B, T, H, Dv], overwritten
  /// [H, Dv/2]: VAPOR's angles, when they are learned. Accumulated (+=, summed
  /// in double inside the call); leave empty when the angles are fixed.
  TensorView<T, 2> d_angles{};
};

/// Causal Latte's recurrent state in a backward (training in chunks, as
/// flash-linear-attention's initial_state / dh0 and dht). A state's gradient
/// is with respect to the state as saved: its stored normaliser and memory
/// (scaled by exp(-running_max)), the running maximum held fixed. It lives in
/// a LatteState whose `running_max` field holds that fixed reference and whose
/// `normaliser` and `memory` fields hold the gradient.
template <Real T>
struct LatteStateGradients {
  /// The state the forward continued from, as it was before the forward
  /// (nullptr: a fresh state at position 0). Its position is the first token's.
  const LatteState<T>* initial = nullptr;
  /// The gradient of the state the forward left (nullptr: zero). Its
  /// running_max must be that state's: copy the state, then fill the rest.
  const LatteState<T>* d_final = nullptr;
  /// Written when not null: the gradient of `initial` (its running_max and
  /// position are copied from `initial`). Make it with make_state(batch).
  LatteState<T>* d_initial = nullptr;
};

}  // namespace latte
