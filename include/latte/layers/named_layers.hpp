#pragma once
// One layer per mechanism, by name: AttentionLayer over that mechanism's defaults.
// Other policy choices: AttentionLayer<TheMechanism<...>, Mixer, Scalar>.
//
//   latte::LatteLayer<latte::Causal, latte::RGLRU> layer(
//       latte::LatteAttention<latte::Causal>({.heads = 8, .latents = 64, .value_dim = 64}),
//       512, weights);
#include "latte/layers/attention_layer.hpp"
#include "latte/layers/token_mixer.hpp"
#include "latte/mechanisms/conv_compressed_attention.hpp"
#include "latte/mechanisms/cosformer.hpp"
#include "latte/mechanisms/latte_attention.hpp"
#include "latte/mechanisms/latte_macchiato.hpp"
#include "latte/mechanisms/lavo.hpp"
#include "latte/mechanisms/leapformer.hpp"
#include "latte/mechanisms/linear_attention.hpp"
#include "latte/mechanisms/softmax_attention.hpp"
#include "latte/policies/positional.hpp"
#include "latte/policies/window.hpp"

namespace latte {

/// Latte with a token mixer on the latent-logit path (paper 000 §2.4: Latte-Conv,
/// Latte-RGLRU).
template <Direction Dir, TokenMixer Mixer = NoMixer, Real Scalar = float>
using LatteLayer = AttentionLayer<LatteAttention<Dir>, Mixer, Scalar>;

/// Latte Macchiato with RoPE on the window (paper 000 §4: Latte-Conv-SWA,
/// Latte-RGLRU-SWA).
template <Direction Dir, TokenMixer Mixer = NoMixer, Real Scalar = float>
using MacchiatoLayer =
    AttentionLayer<LatteMacchiato<Dir, RunningMax, NoPositional, RoPE>, Mixer, Scalar>;

template <Direction Dir, Window Win = NoWindow, Real Scalar = float>
using SoftmaxLayer = AttentionLayer<SoftmaxAttention<Dir, Win>, NoMixer, Scalar>;

template <Direction Dir, FeatureMap Map, Real Scalar = float>
using LinearLayer = AttentionLayer<LinearAttention<Dir, Map>, NoMixer, Scalar>;

template <Direction Dir, Real Scalar = float>
using CosFormerLayer = AttentionLayer<CosFormer<Dir>, NoMixer, Scalar>;

template <Direction Dir, Real Scalar = float>
using LeaPformerLayer = AttentionLayer<LeaPformer<Dir>, NoMixer, Scalar>;

template <Direction Dir, Real Scalar = float>
using LavoLayer = AttentionLayer<Lavo<Dir>, NoMixer, Scalar>;

template <Direction Dir, Real Scalar = float>
using ConvCompressedLayer = AttentionLayer<ConvCompressedAttention<Dir>, NoMixer, Scalar>;

}  // namespace latte
