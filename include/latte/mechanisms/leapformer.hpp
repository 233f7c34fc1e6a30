#pragma once
// latte::LeaPformer<Direction> — LeaPformer (paper 004 §3): cosFormer's
// re-weighting cos(pi/2 (P_q,t - P_k,s)) with proportions from Learned
// Proportions modules, P = sigmoid(W2 relu(W1 relu(x) + b1) + b2) on the ReLU
// features of each query and key (one module for the queries, one for the keys,
// shared across heads; hidden = Dk / leap_factor, default 4). No length is
// needed, so causal decode works for sequences of unknown length; the state is
// the sin and cos streams (S, z) per head. Proportions can also be passed per
// call as [B, T, H] tensors (SequenceProportions) or [B, H] per step.
//
//   latte::LeaPReweight::Params leap{.query_module = query_module, .key_module = key_module};
//   latte::LeaPformer<latte::Causal> attention({.heads = 8, .key_dim = 64, .value_dim = 64},
//                                              {.reweight = leap});
//
// Default normaliser clamp_min(0.1), as LeaPformer's official code.
#include "latte/mechanisms/linear_attention.hpp"
#include "latte/policies/feature_map.hpp"
#include "latte/policies/reweight.hpp"

namespace latte {

template <Direction Dir>
using LeaPformer = LinearAttention<Dir, Relu, LeaPReweight>;

}  // namespace latte
