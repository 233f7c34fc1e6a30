#pragma once
// The mechanisms a test runs through their explicit oracles, one adaptor each:
// make(shape) builds the attention, parameters(attention) lists the parameters it
// owns as long-double vectors, oracle(shape, parameters, inputs) evaluates the
// mechanism's explicit T x T oracle on long-double inputs (in the order its
// forward takes them), and parameter_gradients / parameter_names list the
// gradients of those parameters in the same order. Shared by the layer gradient
// tests and the packed-prefill tests.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "linear_support.hpp"
#include "oracles/conv_compressed_oracle.hpp"
#include "oracles/latte_oracle.hpp"
#include "oracles/lavo_oracle.hpp"
#include "oracles/linear_oracle.hpp"
#include "oracles/macchiato_oracle.hpp"
#include "oracles/softmax_oracle.hpp"
#include "support.hpp"

namespace latte::test {

template <class T, std::size_t N>
std::vector<long double> long_doubles(const Tensor<T, N>& x) {
  return {x.data(), x.data() + x.size()};
}
template <class T, std::size_t N>
std::vector<long double> long_doubles(const TensorView<const T, N>& x) {
  return {x.data(), x.data() + x.size()};
}
/// A tensor's (or module part's) elements as T, for the gradient spans.
template <class T, class Tensor>
std::vector<T> as_scalars(const Tensor& x) {
  return {x.data(), x.data() + x.size()};
}

template <class A>
inline constexpr bool state_needs_capacity = false;  // KV caches and context buffers are sized up front
template <class Dir, class Win>
inline constexpr bool state_needs_capacity<SoftmaxAttention<Dir, Win>> = true;
template <class Dir>
inline constexpr bool state_needs_capacity<ConvCompressedAttention<Dir>> = true;

/// A fresh decode state of `batch` sequences; `capacity` tokens where the state is sized up front.
template <class T, class A>
typename A::template State<T> fresh_state(const A& attention, index_t capacity, index_t batch = 1) {
  if constexpr (state_needs_capacity<A>)
    return attention.template make_state<T>(batch, capacity);
  else
    return attention.template make_state<T>(batch);
}

/// The sizes of a test problem (not every mechanism reads every field).
struct LayerShape {
  index_t batch, time, heads, latents, key_dim, value_dim, model_dim, window;
};

/// The parameters a mechanism owns, as long-double vectors (what the loss perturbs).
using OwnParameters = std::vector<std::vector<long double>>;

/// The mechanisms a layer test runs: each builds its attention, evaluates its
/// explicit oracle on long-double projections and its own parameters, and
/// lists those parameters, their gradients (from d_weights.attention) and names
/// in one order. Mechanisms without parameters of their own take these hooks.
struct NoOwnParameters {
  template <class Attention>
  static OwnParameters parameters(const Attention&) {
    return {};
  }
  template <class T, class Gradients>
  static std::vector<std::vector<T>> parameter_gradients(const Gradients&) {
    return {};
  }
  static std::vector<std::string> parameter_names() { return {}; }
};

/// VAPOR's angles [H, Dv/2], away from 0 and from the default schedule.
inline Tensor<double, 2> random_angles(index_t heads, index_t value_dim) {
  Rng rng(77);
  return uniform_tensor<double, 2>(rng, {heads, value_dim / 2}, 0.2, 1.4);
}

/// The hooks of a mechanism whose only parameters are VAPOR's angles (when Pos is VAPOR).
template <class Pos>
struct AngleParameters {
  template <class Attention>
  static OwnParameters parameters(const Attention& attention) {
    if constexpr (Pos::rotates_values) {
      if constexpr (requires(const Attention& a) { a.angles(); })
        return {long_doubles(attention.angles())};
      else
        return {long_doubles(attention.latent_angles())};
    } else {
      return {};
    }
  }
  template <class T, class Gradients>
  static std::vector<std::vector<T>> parameter_gradients(const Gradients& d) {
    if constexpr (Pos::rotates_values)
      return {as_scalars<T>(d.angles)};
    else
      return {};
  }
  static std::vector<std::string> parameter_names() {
    if constexpr (Pos::rotates_values)
      return {"angles"};
    else
      return {};
  }
  static std::vector<long double> angles_of(const OwnParameters& p) {
    return p.empty() ? std::vector<long double>{} : p[0];
  }
};

template <class Dir, class Pos = NoPositional>
struct LatteMechanism : AngleParameters<Pos> {
  using Attention = LatteAttention<Dir, RunningMax, Pos>;
  static Attention make(const LayerShape& s) {
    if constexpr (Pos::rotates_values)
      return Attention({s.heads, s.latents, s.value_dim},
                       VAPOR::params_from(random_angles(s.heads, s.value_dim).cview()));
    else
      return Attention({s.heads, s.latents, s.value_dim});
  }
  static TensorLD<4> oracle(const LayerShape&, const OwnParameters& p, const std::vector<TensorLD<4>>& a) {
    return latte_oracle(Dir::is_causal, a[0], a[1], a[2], AngleParameters<Pos>::angles_of(p));
  }
};
template <class Dir, class LatentPos = NoPositional>
struct MacchiatoMechanism : AngleParameters<LatentPos> {
  using Attention = LatteMacchiato<Dir, RunningMax, LatentPos, RoPE>;
  static Attention make(const LayerShape& s) {
    const MacchiatoDims dims{s.heads, s.latents, s.key_dim, s.value_dim, s.window};
    if constexpr (LatentPos::rotates_values)
      return Attention(dims, {}, VAPOR::params_from(random_angles(s.heads, s.value_dim).cview()));
    else
      return Attention(dims);
  }
  static TensorLD<4> oracle(const LayerShape& s, const OwnParameters& p, const std::vector<TensorLD<4>>& a) {
    std::vector<long double> key_angles;  // the RoPE schedule base^(-2i/Dk), from its definition
    for (index_t h = 0; h < s.heads; ++h)
      for (index_t i = 0; i < s.key_dim / 2; ++i)
        key_angles.push_back(std::pow(10000.0L, -2.0L * i / (long double)s.key_dim));
    const MacchiatoSpec spec{.causal = Dir::is_causal, .window = s.window,
                             .scale = 1.0L / std::sqrt((long double)s.key_dim)};
    return macchiato_oracle(spec, a[0], a[1], a[2], a[3], a[4], AngleParameters<LatentPos>::angles_of(p),
                            key_angles);
  }
};
template <class Dir>
struct SoftmaxMechanism : NoOwnParameters {
  using Attention = SoftmaxAttention<Dir>;
  static Attention make(const LayerShape& s) { return Attention({s.heads, s.key_dim, s.value_dim}); }
  static TensorLD<4> oracle(const LayerShape& s, const OwnParameters&, const std::vector<TensorLD<4>>& a) {
    return softmax_oracle(MaskSpec{.causal = Dir::is_causal}, 1.0L / std::sqrt((long double)s.key_dim),
                          a[0], a[1], a[2]);
  }
};
template <class Dir>
struct LinearMechanism : NoOwnParameters {
  using Attention = LinearAttention<Dir, EluPlusOne>;
  static Attention make(const LayerShape& s) { return Attention({s.heads, s.key_dim, s.value_dim}); }
  static TensorLD<4> oracle(const LayerShape&, const OwnParameters&, const std::vector<TensorLD<4>>& a) {
    return linear_oracle(LinearOracleSpec{.causal = Dir::is_causal, .feature = oracle_elu_plus_one},
                         a[0], a[1], a[2]);
  }
};

template <class Dir>
struct WindowedSoftmaxMechanism : NoOwnParameters {  // SlidingWindow of `window` keys each side
  using Attention = SoftmaxAttention<Dir, SlidingWindow>;
  static Attention make(const LayerShape& s) {
    return Attention({s.heads, s.key_dim, s.value_dim},
                     SlidingWindow{.left = s.window, .right = Dir::is_causal ? 0 : s.window});
  }
  static TensorLD<4> oracle(const LayerShape& s, const OwnParameters&, const std::vector<TensorLD<4>>& a) {
    const MaskSpec mask{.causal = Dir::is_causal, .left = s.window, .right = Dir::is_causal ? -1 : s.window};
    return softmax_oracle(mask, 1.0L / std::sqrt((long double)s.key_dim), a[0], a[1], a[2]);
  }
};
template <class Dir>
struct CosFormerMechanism : NoOwnParameters {  // M given (causal decode needs it)
  static constexpr index_t length = 200;
  using Attention = CosFormer<Dir>;
  static Attention make(const LayerShape& s) {
    return Attention({s.heads, s.key_dim, s.value_dim}, {.reweight = {.length = length}});
  }
  static TensorLD<4> oracle(const LayerShape&, const OwnParameters&, const std::vector<TensorLD<4>>& a) {
    const index_t B = a[0].extent(0), Tn = a[0].extent(1), H = a[0].extent(2);
    LinearOracleSpec spec{.causal = Dir::is_causal,
                          .feature = oracle_relu,
                          .query_proportions = oracle_position_proportions(B, Tn, H, length),
                          .key_proportions = oracle_position_proportions(B, Tn, H, length)};
    set_oracle_normaliser(spec, CosFormerReweight::default_normaliser());
    return linear_oracle(spec, a[0], a[1], a[2]);
  }
};
template <class Dir>
struct RopeLinearMechanism : NoOwnParameters {  // elu + 1 with RoPE, the default schedule
  using Attention = LinearAttention<Dir, EluPlusOne, NoReweight, RoPE>;
  static Attention make(const LayerShape& s) { return Attention({s.heads, s.key_dim, s.value_dim}); }
  static TensorLD<4> oracle(const LayerShape& s, const OwnParameters&, const std::vector<TensorLD<4>>& a) {
    LinearOracleSpec spec{.causal = Dir::is_causal,
                          .feature = oracle_elu_plus_one,
                          .angles = oracle_rope_angles({}, s.heads, s.key_dim)};
    set_oracle_normaliser(spec, NoReweight::default_normaliser());
    return linear_oracle(spec, a[0], a[1], a[2]);
  }
};

template <class Dir>
struct LeaPMechanism {  // relu features, LeaP modules Dk -> Dk -> 1 (leap_factor 1), clamp_min(0.1)
  using Attention = LeaPformer<Dir>;
  static Attention make(const LayerShape& s) {
    Rng rng(88);
    LeaPReweight::Params leap{.query_module = random_leap_module(rng, s.key_dim, 1),
                              .key_module = random_leap_module(rng, s.key_dim, 1),
                              .leap_factor = 1};
    return Attention({s.heads, s.key_dim, s.value_dim}, {.reweight = leap});
  }
  static OwnParameters parameters(const Attention& attention) {
    const ModuleLD query(*attention.options().reweight.query_module);
    const ModuleLD key(*attention.options().reweight.key_module);
    return {query.w1, query.b1, query.w2, query.b2, key.w1, key.b1, key.w2, key.b2};
  }
  static TensorLD<4> oracle(const LayerShape&, const OwnParameters& p, const std::vector<TensorLD<4>>& a) {
    ModuleLD query, key;
    query.w1 = p[0], query.b1 = p[1], query.w2 = p[2], query.b2 = p[3];
    key.w1 = p[4], key.b1 = p[5], key.w2 = p[6], key.b2 = p[7];
    const LinearOracleSpec spec{.causal = Dir::is_causal,
                                .feature = oracle_relu,
                                .query_proportions = query.proportions(a[0], oracle_relu),
                                .key_proportions = key.proportions(a[1], oracle_relu),
                                .clamp = true,
                                .value = 0.1L};
    return linear_oracle(spec, a[0], a[1], a[2]);
  }
  template <class T>
  static std::vector<std::vector<T>> parameter_gradients(const LeaPModuleGradients& d) {
    std::vector<std::vector<T>> out;
    for (const LeaPModule* m : {&d.query_module, &d.key_module}) {
      out.push_back(as_scalars<T>(m->w1));
      out.push_back(as_scalars<T>(m->b1));
      out.push_back(as_scalars<T>(m->w2));
      out.push_back({static_cast<T>(m->b2)});
    }
    return out;
  }
  static std::vector<std::string> parameter_names() {
    return {"query_module.w1", "query_module.b1", "query_module.w2", "query_module.b2",
            "key_module.w1",   "key_module.b1",   "key_module.w2",   "key_module.b2"};
  }
};

template <class Dir>
struct LavoMechanism {  // d = Dv, r = min(L, d), the default seeded bases and a random bias
  using Attention = Lavo<Dir>;
  static Attention make(const LayerShape& s) {
    Rng rng(66);
    return Attention({.heads = s.heads, .dim = s.value_dim,
                      .bases = std::min(s.latents, s.value_dim), .window = s.window},
                     {.relative_bias = random_tensor<double, 2>(rng, {s.heads, 2 * s.window - 1}, 0.5)});
  }
  static OwnParameters parameters(const Attention& attention) {
    return {long_doubles(attention.relative_bias()), long_doubles(attention.bases())};
  }
  static TensorLD<4> oracle(const LayerShape& s, const OwnParameters& p, const std::vector<TensorLD<4>>& a) {
    LavoOracleSpec spec{.causal = Dir::is_causal,
                        .window = s.window,
                        .bases = std::min(s.latents, s.value_dim),
                        .scale = 1.0L / std::sqrt((long double)s.value_dim)};
    spec.relative_bias = p[0];
    spec.basis = p[1];
    return lavo_oracle(spec, a[0], a[1], a[2]);
  }
  template <class T>
  static std::vector<std::vector<T>> parameter_gradients(const LavoParameterGradients<T>& d) {
    return {as_scalars<T>(d.relative_bias), as_scalars<T>(d.bases)};
  }
  static std::vector<std::string> parameter_names() { return {"relative_bias", "bases"}; }
};

template <class Dir>
struct ConvCompressedMechanism {  // M = 2, two levels, weights drawn from a fixed seed
  using Attention = ConvCompressedAttention<Dir>;
  static ConvCompressedDims dims(const LayerShape& s) {
    return {.heads = s.heads, .key_dim = s.key_dim, .value_dim = s.value_dim, .group_size = 2,
            .levels = 2};
  }
  static Attention make(const LayerShape& s) {
    Rng rng(4242);
    ConvCompressedParams p = ConvCompressedParams::zeros(dims(s));
    for_each_weight(p, [&]<std::size_t N>(Tensor<double, N>& w) {
      w = random_tensor<double, N>(rng, w.extents(), 0.5);
    });
    return Attention(dims(s), p);
  }
  /// From the params() accessor: the oracle then also checks that it returns the weights in use.
  static OwnParameters parameters(const Attention& attention) {
    OwnParameters out;
    const ConvCompressedParams p = attention.params();
    for_each_weight(p, [&](const auto& w) { out.push_back(long_doubles(w)); });
    return out;
  }
  static TensorLD<4> oracle(const LayerShape& s, const OwnParameters& p, const std::vector<TensorLD<4>>& a) {
    const Attention attention = make(s);
    const ConvCompressedSpec spec{.causal = Dir::is_causal, .group_size = 2, .levels = 2,
                                  .window_left = attention.window().left,
                                  .window_right = attention.window().right,
                                  .scale = 1.0L / std::sqrt((long double)s.key_dim)};
    ParamsLD params;  // the shapes of zeros(dims), the values of p in for_each_weight's order
    const ConvCompressedParams shapes = ConvCompressedParams::zeros(dims(s));
    for (const auto& w : shapes.conv_weight) params.conv_weight.emplace_back(w.extents());
    for (const auto& w : shapes.conv_bias) params.conv_bias.emplace_back(w.extents());
    for (const auto& w : shapes.level_query) params.level_query.emplace_back(w.extents());
    for (const auto& w : shapes.level_key) params.level_key.emplace_back(w.extents());
    for (const auto& w : shapes.level_value) params.level_value.emplace_back(w.extents());
    params.cross_query = TensorLD<3>(shapes.cross_query.extents());
    params.cross_key = TensorLD<3>(shapes.cross_key.extents());
    params.cross_value = TensorLD<3>(shapes.cross_value.extents());
    std::size_t next = 0;
    for_each_weight(params, [&](auto& w) { std::copy(p[next].begin(), p[next].end(), w.data()), ++next; });
    return conv_compressed_oracle(spec, params, a[0], a[1], a[2]).out;
  }
  template <class T>
  static std::vector<std::vector<T>> parameter_gradients(const ConvCompressedParams& d) {
    std::vector<std::vector<T>> out;
    for_each_weight(d, [&](const auto& w) { out.push_back(as_scalars<T>(w)); });
    return out;
  }
  static std::vector<std::string> parameter_names() {
    return {"conv_weight[0]", "conv_weight[1]", "conv_bias[0]", "conv_bias[1]", "level_query[0]",
            "level_key[0]",   "level_value[0]", "cross_query",  "cross_key",    "cross_value"};
  }
};

}  // namespace latte::test
