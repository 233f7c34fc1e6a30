#pragma once
// What LatteMacchiato::backward writes besides reading the forward's inputs.
//
// Gradients are of a scalar loss whose gradient with respect to the output is
// the `d_out` passed to backward. Nothing is kept from the forward: backward
// recomputes what it needs from the inputs (docs/backward.md).
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"

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

}  // namespace latte
