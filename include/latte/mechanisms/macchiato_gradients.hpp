#pragma once
// What LatteMacchiato::backward writes and reads besides the forward's inputs.
//
// Gradients are of a scalar loss whose gradient with respect to the output is
// the `d_out` passed to backward. Nothing is kept from the forward: backward
// recomputes what it needs from the inputs (docs/backward.md).
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/mechanisms/macchiato_state.hpp"

namespace latte {

/// The caller-owned buffers LatteMacchiato::backward fills.
template <Real T>
struct MacchiatoGradients {
  TensorView<T, 4> d_query_logits;    ///< [B, T, H, L + 1], overwritten
  TensorView<T, 4> d_key_logits;      ///< [B, T, H, L], overwritten
  TensorView<T, 4> d_window_queries;  ///< [B, T, H, Dk], overwritten
  TensorView<T, 4> d_window_keys;     ///< [B, T, H, Dk], overwritten
  TensorView<T, 4> d_values;          ///< [B, T, H, Dv], overwritten
  /// [H, Dv/2]: VAPOR's angles, when they are learned. Accumulated (+=, summed
  /// in double inside the call); leave empty when the angles are fixed. The
  /// window's RoPE angles are fixed (no gradient).
  TensorView<T, 2> d_angles{};
};

/// Causal Latte Macchiato's state in a backward (training in chunks, as
/// LatteStateGradients). A state's gradient is with respect to the state as
/// saved: Latte's stored normaliser and memory (the running maximum held
/// fixed, as LatteAttention's) and the ring's stored window keys and values
/// (R^s k'_s under RoPE; R^{-s} v_s with VAPOR on every state, else v_s). It
/// lives in a MacchiatoState whose running_max, window_fill and position are
/// those of the state it is the gradient of.
template <Real T>
struct MacchiatoStateGradients {
  /// The state the forward continued from, as it was before the forward
  /// (nullptr: a fresh state at position 0).
  const MacchiatoState<T>* initial = nullptr;
  /// The gradient of the state the forward left (nullptr: zero); copy that
  /// state, then fill normaliser, memory, window_keys and window_values.
  const MacchiatoState<T>* d_final = nullptr;
  /// Written when not null: the gradient of `initial` (make it with make_state(batch)).
  MacchiatoState<T>* d_initial = nullptr;
};

}  // namespace latte
