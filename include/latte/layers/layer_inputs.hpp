#pragma once
// What a layer must project for each mechanism: the mechanism's inputs in call
// order, each with its features per head and whether it is read from the token
// mixer's output y (the query/key path, papers 000 §2.4 / 001 §4.1) or from x.
// One specialisation per mechanism; a user mechanism gets a layer by adding one.
#include <array>
#include <cstddef>
#include <string_view>

#include "latte/core/types.hpp"
#include "latte/mechanisms/conv_compressed_attention.hpp"
#include "latte/mechanisms/latte_attention.hpp"
#include "latte/mechanisms/latte_macchiato.hpp"
#include "latte/mechanisms/lavo.hpp"
#include "latte/mechanisms/linear_attention.hpp"
#include "latte/mechanisms/softmax_attention.hpp"
#include "latte/policies/execution.hpp"

namespace latte {

/// One projected input of a mechanism.
struct LayerInput {
  std::string_view name;  ///< the mechanism's argument name, e.g. "query_logits"
  index_t width = 0;      ///< features per head
  bool from_mixer = false;  ///< read from y = mixer(x) (else from x)
};

/// Specialise for a mechanism: `count`, `inputs(attention)`, `heads(attention)`,
/// `value_dim(attention)` (features per head of its output) and `default_exec`.
template <class Attention>
struct LayerInputs;

template <Direction Dir, Stabilizer Stab, Positional Pos, Summation Sum>
struct LayerInputs<LatteAttention<Dir, Stab, Pos, Sum>> {
  static constexpr std::size_t count = 3;
  using default_exec = exec::cpu_t;
  static std::array<LayerInput, count> inputs(const LatteAttention<Dir, Stab, Pos, Sum>& attention) {
    const LatteDims& d = attention.dims();
    return {{{"query_logits", d.latents, true}, {"key_logits", d.latents, true},
             {"values", d.value_dim, false}}};
  }
  static index_t heads(const LatteAttention<Dir, Stab, Pos, Sum>& a) { return a.dims().heads; }
  static index_t value_dim(const LatteAttention<Dir, Stab, Pos, Sum>& a) { return a.dims().value_dim; }
};

/// Latent logits (L + 1 query, L key) from the mixer; the window's queries and
/// keys (own projections, RoPE inside the mechanism) and the values from x.
template <Direction Dir, Stabilizer Stab, Positional LatentPos, Positional WindowPos>
struct LayerInputs<LatteMacchiato<Dir, Stab, LatentPos, WindowPos>> {
  using Attention = LatteMacchiato<Dir, Stab, LatentPos, WindowPos>;
  static constexpr std::size_t count = 5;
  using default_exec = exec::cpu_t;
  static std::array<LayerInput, count> inputs(const Attention& attention) {
    const MacchiatoDims& d = attention.dims();
    return {{{"query_logits", d.latents + 1, true},
             {"key_logits", d.latents, true},
             {"window_queries", d.key_dim, false},
             {"window_keys", d.key_dim, false},
             {"values", d.value_dim, false}}};
  }
  static index_t heads(const Attention& a) { return a.dims().heads; }
  static index_t value_dim(const Attention& a) { return a.dims().value_dim; }
};

/// Mechanisms called as (queries, keys, values): queries and keys from the mixer.
template <class Attention, class Exec>
struct QueryKeyValueInputs {
  static constexpr std::size_t count = 3;
  using default_exec = Exec;
  static std::array<LayerInput, count> inputs(const Attention& attention) {
    const index_t key_dim = key_dim_of(attention), value_dim = value_dim_of(attention);
    return {{{"queries", key_dim, true}, {"keys", key_dim, true}, {"values", value_dim, false}}};
  }
  static index_t heads(const Attention& a) { return a.dims().heads; }
  static index_t value_dim(const Attention& a) { return value_dim_of(a); }

 private:
  static index_t key_dim_of(const Attention& a) {
    if constexpr (requires { a.dims().key_dim; })
      return a.dims().key_dim;
    else
      return a.dims().dim;
  }
  static index_t value_dim_of(const Attention& a) {
    if constexpr (requires { a.dims().value_dim; })
      return a.dims().value_dim;
    else
      return a.dims().dim;
  }
};

template <Direction Dir, Window Win>
struct LayerInputs<SoftmaxAttention<Dir, Win>>
    : QueryKeyValueInputs<SoftmaxAttention<Dir, Win>, exec::cpu_t> {};
template <Direction Dir, FeatureMap Map, Reweight Rw, Positional Pos, Summation Sum>
struct LayerInputs<LinearAttention<Dir, Map, Rw, Pos, Sum>>
    : QueryKeyValueInputs<LinearAttention<Dir, Map, Rw, Pos, Sum>, exec::cpu_t> {};
template <Direction Dir>
struct LayerInputs<Lavo<Dir>> : QueryKeyValueInputs<Lavo<Dir>, exec::cpu_t> {};
template <Direction Dir>
struct LayerInputs<ConvCompressedAttention<Dir>>
    : QueryKeyValueInputs<ConvCompressedAttention<Dir>, exec::cpu_t> {};

}  // namespace latte
