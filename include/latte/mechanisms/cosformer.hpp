#pragma once
// latte::CosFormer<Direction> — cosFormer (Qin et al. 2022; paper 004 eqs. 7 and 9):
// ReLU features re-weighted by cos(pi/2 (P_q,t - P_k,s)) with P = (i + 1) / M
// for the 0-based position i, split exactly into a sin and a cos stream
// (feature dim 2 * Dk). M defaults to T in forward (max(S, T) in cross_forward)
// and must be given for decode, where every position + 1 reached must be <= M:
//
//   latte::CosFormer<latte::Causal> attention({.heads = 8, .key_dim = 64, .value_dim = 64},
//                                             {.reweight = {.length = 4096}});
//   auto state = attention.make_state<float>(1);  // decodes up to 4096 positions
//
// Default normaliser clamp_min(1e-6), as cosFormer's official code.
#include "latte/mechanisms/linear_attention.hpp"
#include "latte/policies/feature_map.hpp"
#include "latte/policies/reweight.hpp"

namespace latte {

template <Direction Dir>
using CosFormer = LinearAttention<Dir, Relu, CosFormerReweight>;

}  // namespace latte
