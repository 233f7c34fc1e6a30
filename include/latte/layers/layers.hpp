#pragma once
// Every layer: AttentionLayer, the per-mechanism aliases and the token mixers.
#include "latte/layers/attention_layer.hpp"
#include "latte/layers/layer_inputs.hpp"
#include "latte/layers/mechanism_parameters.hpp"
#include "latte/layers/named_layers.hpp"
#include "latte/layers/rglru.hpp"
#include "latte/layers/short_conv.hpp"
#include "latte/layers/token_mixer.hpp"
