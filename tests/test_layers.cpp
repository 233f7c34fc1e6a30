// Layers (include/latte/layers/): the token mixers against their definitions
// written out in long double, and whole layers — mixer, projections, attention,
// output projection — against the long-double chain of tests/oracles/layer_oracle.hpp
// feeding the explicit T x T attention oracles. Decode through a layer (prefill at
// a random split, then steps) against the same oracle, and bad input.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "latte/attention.hpp"
#include "oracles/conv_compressed_oracle.hpp"
#include "oracles/latte_oracle.hpp"
#include "oracles/lavo_oracle.hpp"
#include "oracles/layer_oracle.hpp"
#include "oracles/linear_oracle.hpp"
#include "oracles/macchiato_oracle.hpp"
#include "oracles/softmax_oracle.hpp"
#include "expect_error.hpp"
#include "support.hpp"

namespace test_layers {  // every test file's own namespace: tests/CMakeLists.txt

using namespace latte;
using namespace latte::test;

namespace {

template <class T>
Tensor<T, 3> rows_slice(const Tensor<T, 3>& x, index_t first, index_t count) {
  Tensor<T, 3> part({x.extent(0), count, x.extent(2)});
  for (index_t b = 0; b < x.extent(0); ++b)
    for (index_t t = 0; t < count; ++t)
      for (index_t c = 0; c < x.extent(2); ++c) part(b, t, c) = x(b, first + t, c);
  return part;
}

template <class T>
Tensor<T, 2> token(const Tensor<T, 3>& x, index_t t) {
  Tensor<T, 2> row({x.extent(0), x.extent(2)});
  for (index_t b = 0; b < x.extent(0); ++b)
    for (index_t c = 0; c < x.extent(2); ++c) row(b, c) = x(b, t, c);
  return row;
}

template <class T>
void put_rows(Tensor<T, 3>& into, const Tensor<T, 3>& part, index_t first) {
  for (index_t b = 0; b < part.extent(0); ++b)
    for (index_t t = 0; t < part.extent(1); ++t)
      for (index_t c = 0; c < part.extent(2); ++c) into(b, first + t, c) = part(b, t, c);
}

template <class T>
void put_token(Tensor<T, 3>& into, const Tensor<T, 2>& row, index_t t) {
  for (index_t b = 0; b < row.extent(0); ++b)
    for (index_t c = 0; c < row.extent(1); ++c) into(b, t, c) = row(b, c);
}

// ---- mixers: random weights and their oracles --

template <class T, class Mixer>
typename Mixer::template Weights<T> random_mixer(Rng& rng, index_t C) {
  if constexpr (std::is_same_v<Mixer, NoMixer>) {
    return {};
  } else if constexpr (std::is_same_v<Mixer, RGLRU>) {
    typename RGLRU::Weights<T> w{random_tensor<T, 2>(rng, {C, C}, 1.0 / std::sqrt(double(C))),
                                  random_tensor<T, 1>(rng, {C}, 0.5),
                                  random_tensor<T, 2>(rng, {C, C}, 1.0 / std::sqrt(double(C))),
                                  random_tensor<T, 1>(rng, {C}, 0.5),
                                  uniform_tensor<T, 1>(rng, {C}, -4.0, 2.0)};
    return w;
  } else {
    return {random_tensor<T, 2>(rng, {Mixer::taps, C}, 0.6), random_tensor<T, 1>(rng, {C}, 0.1)};
  }
}

template <class T, class Mixer>
TensorLD<3> mixer_oracle(const typename Mixer::template Weights<T>& w, const TensorLD<3>& x) {
  if constexpr (std::is_same_v<Mixer, NoMixer>) {
    return x;
  } else if constexpr (std::is_same_v<Mixer, RGLRU>) {
    const auto ld = [](const auto& t) {
      return std::vector<long double>(t.data(), t.data() + t.size());
    };
    return rglru_oracle({ld(w.recurrence_gate), ld(w.recurrence_bias), ld(w.input_gate),
                         ld(w.input_bias), ld(w.lambda), (long double)w.c},
                        x);
  } else {
    return short_conv_oracle(w.kernel, w.bias, x);
  }
}

// ---- mechanisms: how to build one for a shape, and its oracle --

struct LayerShape {
  index_t batch, time, heads, latents, key_dim, value_dim, model_dim, window;
};

LayerShape random_layer_shape(Rng& rng) {
  static const std::array<index_t, 3> heads{1, 2, 3}, small{1, 4, 7}, models{1, 6, 16};
  for (;;) {
    LayerShape s{pick(rng, std::array<index_t, 2>{1, 2}), pick(rng, sequence_lengths()),
                 pick(rng, heads), pick(rng, small), pick(rng, small), pick(rng, small),
                 pick(rng, models), pick(rng, std::array<index_t, 3>{1, 3, 16})};
    const double cost = double(s.time) * double(s.time) * double(s.batch * s.heads) *
                        double(s.latents + s.value_dim + s.key_dim);
    if (cost <= 1.5e7) return s;
  }
}

// Each case builds its mechanism for a shape (drawing any weights it owns from
// `rng`) and evaluates the mechanism's explicit oracle on projected inputs.

template <class Dir>
struct LatteCase {
  using Attention = LatteAttention<Dir>;
  inline static const std::string name = "LatteAttention<" + std::string(Dir::name) + ">";
  Attention attention;
  LatteCase(const LayerShape& s, Rng&) : attention({s.heads, s.latents, s.value_dim}) {}
  TensorLD<4> oracle(const LayerShape&, const std::vector<Tensor<double, 4>>& a) const {
    return latte_oracle(Dir::is_causal, a[0], a[1], a[2]);
  }
  template <class Layer>
  auto make_state(const Layer& layer, const LayerShape& s) const {
    return layer.make_state(s.batch);
  }
};

/// LatteMacchiato<Dir> with RoPE on the window, as MacchiatoLayer builds it.
template <class Dir>
struct MacchiatoCase {
  using Attention = LatteMacchiato<Dir, RunningMax, NoPositional, RoPE>;
  inline static const std::string name = "LatteMacchiato<" + std::string(Dir::name) + ",RoPE window>";
  Attention attention;
  MacchiatoCase(const LayerShape& s, Rng&)
      : attention({s.heads, s.latents, s.key_dim, s.value_dim, s.window}) {}
  TensorLD<4> oracle(const LayerShape& s, const std::vector<Tensor<double, 4>>& a) const {
    std::vector<long double> key_angles;  // the RoPE schedule base^(-2i/Dk), from its definition
    for (index_t h = 0; h < s.heads; ++h)
      for (index_t i = 0; i < s.key_dim / 2; ++i)
        key_angles.push_back(std::pow(10000.0L, -2.0L * i / (long double)s.key_dim));
    const MacchiatoSpec spec{.causal = Dir::is_causal,
                             .window = s.window,
                             .scale = 1.0L / std::sqrt((long double)s.key_dim)};
    return macchiato_oracle(spec, a[0], a[1], a[2], a[3], a[4], {}, key_angles);
  }
  template <class Layer>
  auto make_state(const Layer& layer, const LayerShape& s) const {
    return layer.make_state(s.batch);
  }
};

template <class Dir>
struct SoftmaxCase {
  using Attention = SoftmaxAttention<Dir>;
  inline static const std::string name = "SoftmaxAttention<" + std::string(Dir::name) + ">";
  Attention attention;
  SoftmaxCase(const LayerShape& s, Rng&) : attention({s.heads, s.key_dim, s.value_dim}) {}
  TensorLD<4> oracle(const LayerShape& s, const std::vector<Tensor<double, 4>>& a) const {
    return softmax_oracle(MaskSpec{.causal = Dir::is_causal},
                          1.0L / std::sqrt((long double)s.key_dim), a[0], a[1], a[2]);
  }
  template <class Layer>
  auto make_state(const Layer& layer, const LayerShape& s) const {
    return layer.make_state(s.batch, std::max<index_t>(s.time, 1));  // KV-cache capacity
  }
};

template <class Dir>
struct LinearCase {
  using Attention = LinearAttention<Dir, EluPlusOne>;
  inline static const std::string name = "LinearAttention<" + std::string(Dir::name) + ",elu_plus_one>";
  Attention attention;
  LinearCase(const LayerShape& s, Rng&) : attention({s.heads, s.key_dim, s.value_dim}) {}
  TensorLD<4> oracle(const LayerShape&, const std::vector<Tensor<double, 4>>& a) const {
    return linear_oracle(LinearOracleSpec{.causal = Dir::is_causal, .feature = oracle_elu_plus_one},
                         a[0], a[1], a[2]);
  }
  template <class Layer>
  auto make_state(const Layer& layer, const LayerShape& s) const {
    return layer.make_state(s.batch);
  }
};

/// LAVO with d = Dv, r = min(L, d), window w and a random relative bias.
template <class Dir>
struct LavoCase {
  using Attention = Lavo<Dir>;
  inline static const std::string name = "Lavo<" + std::string(Dir::name) + ">";
  Attention attention;
  LavoCase(const LayerShape& s, Rng& rng)
      : attention({.heads = s.heads, .dim = s.value_dim, .bases = std::min(s.latents, s.value_dim),
                   .window = s.window},
                  {.basis_seed = rng(),
                   .relative_bias = random_tensor<double, 2>(rng, {s.heads, 2 * s.window - 1}, 1.0)}) {}
  TensorLD<4> oracle(const LayerShape& s, const std::vector<Tensor<double, 4>>& a) const {
    LavoOracleSpec spec{.causal = Dir::is_causal,
                        .window = s.window,
                        .bases = std::min(s.latents, s.value_dim),
                        .scale = 1.0L / std::sqrt((long double)s.value_dim)};
    spec.basis = widen(attention.bases());
    spec.relative_bias = widen(attention.relative_bias());
    return lavo_oracle(spec, a[0], a[1], a[2]);
  }
  template <class Layer>
  auto make_state(const Layer& layer, const LayerShape& s) const {
    return layer.make_state(s.batch);
  }
};

/// Paper 003 approach 1 (levels = 1) with group size M = w and random weights.
template <class Dir>
struct ConvCompressedCase {
  using Attention = ConvCompressedAttention<Dir>;
  inline static const std::string name = "ConvCompressedAttention<" + std::string(Dir::name) + ">";
  ConvCompressedParams params;
  Attention attention;
  ConvCompressedCase(const LayerShape& s, Rng& rng)
      : params(random_params(s, rng)), attention(dims(s), params) {}
  static ConvCompressedDims dims(const LayerShape& s) {
    return {.heads = s.heads, .key_dim = s.key_dim, .value_dim = s.value_dim, .group_size = s.window};
  }
  static ConvCompressedParams random_params(const LayerShape& s, Rng& rng) {
    ConvCompressedParams p = ConvCompressedParams::zeros(dims(s));
    std::normal_distribution<double> normal(0.0, 0.4);
    const auto fill = [&](auto& t) {
      for (index_t i = 0; i < t.size(); ++i) t.data()[i] = normal(rng);
    };
    for (auto& t : p.conv_weight) fill(t);
    for (auto& t : p.conv_bias) fill(t);
    fill(p.cross_query);
    fill(p.cross_key);
    fill(p.cross_value);
    return p;
  }
  TensorLD<4> oracle(const LayerShape& s, const std::vector<Tensor<double, 4>>& a) const {
    const ConvCompressedSpec spec{.causal = Dir::is_causal,
                                  .group_size = s.window,
                                  .levels = 1,
                                  .window_left = s.window - 1,
                                  .window_right = Dir::is_causal ? 0 : s.window - 1,
                                  .scale = 1.0L / std::sqrt((long double)s.key_dim)};
    return conv_compressed_oracle(spec, params, a[0], a[1], a[2]).out;
  }
  template <class Layer>
  auto make_state(const Layer& layer, const LayerShape& s) const {
    return layer.make_state(s.batch, std::max<index_t>(s.time, 1));  // context capacity
  }
};

/// The whole layer in long double: mixer, projections (rounded to double for the
/// attention oracle), attention oracle, output projection.
template <class T, class Case, class Mixer, class Layer>
TensorLD<3> layer_oracle(const LayerShape& s, const Case& mechanism, const Layer& layer,
                        const Tensor<T, 3>& x) {
  const TensorLD<3> x_ld = to_long_double(x);
  const TensorLD<3> y_ld = mixer_oracle<T, Mixer>(layer.weights().mixer, x_ld);
  std::vector<Tensor<double, 4>> projected;
  const auto inputs = layer.inputs();
  for (std::size_t i = 0; i < inputs.size(); ++i)
    projected.push_back(project_oracle(inputs[i].from_mixer ? y_ld : x_ld,
                                       layer.weights().projections[i], s.heads, inputs[i].width));
  return output_oracle(mechanism.oracle(s, projected), layer.weights().output);
}

template <class T, class Case, class Mixer>
void check_layer_cases(int cases, std::uint64_t seed) {
  using Layer = AttentionLayer<typename Case::Attention, Mixer, T>;
  Rng rng(seed);
  double worst = 0, worst_decode = 0;
  for (int c = 0; c < cases; ++c) {
    const LayerShape s = random_layer_shape(rng);
    const Case mechanism(s, rng);
    const Layer layer(mechanism.attention, s.model_dim,
                      Layer::random_weights(mechanism.attention, s.model_dim, rng(),
                                            random_mixer<T, Mixer>(rng, s.model_dim)));
    const auto x = random_tensor<T, 3>(rng, {s.batch, s.time, s.model_dim}, 1.0);
    Tensor<T, 3> out({s.batch, s.time, s.model_dim});
    layer.forward(x.view(), out.view());
    const TensorLD<3> expected = layer_oracle<T, Case, Mixer>(s, mechanism, layer, x);
    const double error = relative_error(out, expected);
    worst = std::max(worst, error);
    INFO("case " << c << " B=" << s.batch << " T=" << s.time << " H=" << s.heads << " L="
                 << s.latents << " Dk=" << s.key_dim << " Dv=" << s.value_dim
                 << " model=" << s.model_dim << " w=" << s.window);
    CHECK(error <= Tolerance<T>::relative);
    if constexpr (Case::Attention::direction::is_causal) {
      // Decode: prefill the first `split` tokens, then one step per token.
      const index_t split = std::uniform_int_distribution<index_t>(0, s.time)(rng);
      auto state = mechanism.make_state(layer, s);
      Tensor<T, 3> decoded({s.batch, s.time, s.model_dim});
      Tensor<T, 3> prefix_out({s.batch, split, s.model_dim});
      layer.forward(rows_slice(x, 0, split).view(), prefix_out.view(), state);
      put_rows(decoded, prefix_out, 0);
      Tensor<T, 2> out_t({s.batch, s.model_dim});
      for (index_t t = split; t < s.time; ++t) {
        layer.step(state, token(x, t).view(), out_t.view());
        put_token(decoded, out_t, t);
      }
      const double decode_error = relative_error(decoded, expected);
      worst_decode = std::max(worst_decode, decode_error);
      CHECK(decode_error <= Tolerance<T>::relative);
    }
  }
  std::ostringstream decode;
  if (Case::Attention::direction::is_causal) decode << ", decode " << worst_decode;
  MESSAGE(Case::name << "/" << std::string(dtype_name<T>()) << " + " << std::string(Mixer::name)
                     << ": " << cases << " cases, max rel err " << worst << decode.str());
}

template <class Case, class Mixer>
void check_both_dtypes(int cases, std::uint64_t seed) {
  check_layer_cases<float, Case, Mixer>(cases, seed);
  check_layer_cases<double, Case, Mixer>(cases, seed + 1);
}

}  // namespace

// ---------------------------------------------------------------- mixers --

TEST_CASE_TEMPLATE("ShortConv matches its definition; steps and split prefill continue it", T, float,
                   double) {
  Rng rng(11);
  double worst = 0;
  for (int c = 0; c < case_count(60); ++c) {
    const index_t B = pick(rng, std::array<index_t, 2>{1, 3}), Tn = pick(rng, sequence_lengths()),
                  C = pick(rng, std::array<index_t, 3>{1, 5, 16});
    auto check = [&]<index_t K>() {
      const auto w = random_mixer<T, ShortConv<K>>(rng, C);
      ShortConv<K>::validate(w, C);
      const auto x = random_tensor<T, 3>(rng, {B, Tn, C}, 1.0);
      const TensorLD<3> expected = short_conv_oracle(w.kernel, w.bias, to_long_double(x));
      Tensor<T, 3> y({B, Tn, C});
      ShortConv<K>::forward(w, x.cview(), y.view(), nullptr);
      const double error = relative_error(y, expected);
      worst = std::max(worst, error);
      CHECK(error <= Tolerance<T>::relative);
      // Two prefills (the first may be shorter than the history), then steps.
      const index_t first = std::uniform_int_distribution<index_t>(0, Tn)(rng);
      const index_t second = std::uniform_int_distribution<index_t>(0, Tn - first)(rng);
      auto state = ShortConv<K>::make_state(w, B);
      Tensor<T, 3> decoded({B, Tn, C});
      for (const auto& [from, count] : {std::pair{index_t{0}, first}, std::pair{first, second}}) {
        Tensor<T, 3> part({B, count, C});
        ShortConv<K>::forward(w, rows_slice(x, from, count).cview(), part.view(), &state);
        put_rows(decoded, part, from);
      }
      Tensor<T, 2> y_t({B, C});
      for (index_t t = first + second; t < Tn; ++t) {
        ShortConv<K>::step(w, state, token(x, t).cview(), y_t.view());
        put_token(decoded, y_t, t);
      }
      CHECK(relative_error(decoded, expected) <= Tolerance<T>::relative);
    };
    switch (c % 4) {
      case 0: check.template operator()<1>(); break;
      case 1: check.template operator()<2>(); break;
      case 2: check.template operator()<3>(); break;
      default: check.template operator()<4>(); break;
    }
  }
  MESSAGE("ShortConv<1..4> " << std::string(dtype_name<T>()) << ": max rel err " << worst);
}

TEST_CASE_TEMPLATE("RGLRU matches the Griffin equations; steps and split prefill continue it", T,
                   float, double) {
  Rng rng(12);
  double worst = 0;
  for (int c = 0; c < case_count(60); ++c) {
    const index_t B = pick(rng, std::array<index_t, 2>{1, 3}), Tn = pick(rng, sequence_lengths()),
                  C = pick(rng, std::array<index_t, 3>{1, 5, 16});
    const auto w = c % 2 ? random_mixer<T, RGLRU>(rng, C) : RGLRU::Weights<T>::initial(C, rng());
    RGLRU::validate(w, C);
    const auto x = random_tensor<T, 3>(rng, {B, Tn, C}, 1.0);
    const TensorLD<3> expected = mixer_oracle<T, RGLRU>(w, to_long_double(x));
    Tensor<T, 3> y({B, Tn, C});
    RGLRU::forward(w, x.cview(), y.view(), nullptr);
    const double error = relative_error(y, expected);
    worst = std::max(worst, error);
    CHECK(error <= Tolerance<T>::relative);
    const index_t split = std::uniform_int_distribution<index_t>(0, Tn)(rng);
    auto state = RGLRU::make_state(w, B);
    Tensor<T, 3> decoded({B, Tn, C}), part({B, split, C});
    RGLRU::forward(w, rows_slice(x, 0, split).cview(), part.view(), &state);
    put_rows(decoded, part, 0);
    Tensor<T, 2> y_t({B, C});
    for (index_t t = split; t < Tn; ++t) {
      RGLRU::step(w, state, token(x, t).cview(), y_t.view());
      put_token(decoded, y_t, t);
    }
    CHECK(relative_error(decoded, expected) <= Tolerance<T>::relative);
  }
  MESSAGE("RGLRU " << std::string(dtype_name<T>()) << ": max rel err " << worst);
}

TEST_CASE("RGLRU keeps digits when a -> 1 and stays bounded for huge inputs") {
  // Lambda = -30: softplus ~ 9.4e-14, so a = 1 - 7.5e-13 r; 1 - a^2 cancels
  // catastrophically unless evaluated as -expm1(2 log a).
  const index_t C = 1;
  RGLRU::Weights<double> w{Tensor<double, 2>({C, C}), Tensor<double, 1>({C}),
                           Tensor<double, 2>({C, C}), Tensor<double, 1>({C}),
                           Tensor<double, 1>({C}, -30.0)};
  Tensor<double, 3> x({1, 3, C}, 1.0), y({1, 3, C});
  RGLRU::forward(w, x.cview(), y.view(), nullptr);
  const TensorLD<3> expected = mixer_oracle<double, RGLRU>(w, to_long_double(x));
  CHECK(relative_error(y, expected) <= Tolerance<double>::relative);
  w.lambda.fill(40.0);
  x.fill(1e300);
  RGLRU::forward(w, x.cview(), y.view(), nullptr);
  CHECK(all_finite(y));
}

// ---------------------------------------------------------------- layers --

TEST_CASE("LatteLayer (no mixer, ShortConv<3>, RGLRU) matches the long-double layer oracle") {
  check_both_dtypes<LatteCase<Causal>, NoMixer>(case_count(40), 100);
  check_both_dtypes<LatteCase<Causal>, ShortConv<3>>(case_count(40), 110);
  check_both_dtypes<LatteCase<Causal>, RGLRU>(case_count(40), 120);
  check_both_dtypes<LatteCase<Bidirectional>, NoMixer>(case_count(40), 130);
  check_both_dtypes<LatteCase<Bidirectional>, RGLRU>(case_count(40), 140);
}

TEST_CASE("MacchiatoLayer (ShortConv<3>, RGLRU; RoPE window) matches the long-double layer oracle") {
  check_both_dtypes<MacchiatoCase<Causal>, ShortConv<3>>(case_count(40), 200);
  check_both_dtypes<MacchiatoCase<Causal>, RGLRU>(case_count(40), 210);
  check_both_dtypes<MacchiatoCase<Bidirectional>, RGLRU>(case_count(40), 220);
}

TEST_CASE("SoftmaxLayer and LinearLayer match the long-double layer oracle") {
  check_both_dtypes<SoftmaxCase<Causal>, NoMixer>(case_count(40), 300);
  check_both_dtypes<SoftmaxCase<Bidirectional>, NoMixer>(case_count(40), 310);
  check_both_dtypes<LinearCase<Causal>, NoMixer>(case_count(40), 320);
  check_both_dtypes<LinearCase<Bidirectional>, NoMixer>(case_count(40), 330);
}

TEST_CASE("LavoLayer and ConvCompressedLayer match the long-double layer oracle") {
  check_both_dtypes<LavoCase<Causal>, NoMixer>(case_count(30), 400);
  check_both_dtypes<LavoCase<Bidirectional>, NoMixer>(case_count(30), 410);
  check_both_dtypes<ConvCompressedCase<Causal>, NoMixer>(case_count(30), 420);
  check_both_dtypes<ConvCompressedCase<Bidirectional>, NoMixer>(case_count(30), 430);
}

// ------------------------------------------------------------- bad input --

TEST_CASE("Layers reject malformed weights, inputs and states, naming the argument") {
  using Layer = LatteLayer<Causal, ShortConv<3>, float>;
  const LatteAttention<Causal> attention({.heads = 2, .latents = 3, .value_dim = 4});
  const index_t model = 5;
  const auto good = Layer::random_weights(attention, model, 1, ShortConv<3>::Weights<float>::identity(model));
  auto with = [&](auto edit) {
    auto weights = good;
    edit(weights);
    return weights;
  };
  expect_error([&] { Layer(attention, 0, good); }, "model_dim", "");
  expect_error([&] { Layer(attention, model, with([](auto& w) { w.projections[0].resize(5, 5); })); },
                     "weights.projections[query_logits]", "");
  expect_error([&] { Layer(attention, model, with([](auto& w) { w.projections[2].resize(4, 8); })); },
                     "weights.projections[values]", "");
  expect_error([&] { Layer(attention, model, with([](auto& w) { w.output.resize(8, 4); })); },
                     "weights.output", "");
  expect_error([&] { Layer(attention, model, with([](auto& w) { w.mixer.kernel = Tensor<float, 2>({2, 5}); })); },
                     "mixer.kernel", "");
  expect_error([&] { Layer(attention, model, with([](auto& w) { w.mixer.bias = Tensor<float, 1>({4}); })); },
                     "mixer.bias", "");
  using Rglru = LatteLayer<Causal, RGLRU, float>;
  const auto rglru = RGLRU::Weights<float>::initial(model, 2);
  auto rglru_with = [&](auto edit) {
    auto weights = Rglru::random_weights(attention, model, 3, rglru);
    edit(weights.mixer);
    return weights;
  };
  expect_error([&] { Rglru(attention, model, rglru_with([](auto& m) { m.lambda = Tensor<float, 1>({6}); })); },
                     "mixer.lambda", "");
  expect_error([&] { Rglru(attention, model, rglru_with([](auto& m) { m.input_gate = Tensor<float, 2>({5, 4}); })); },
                     "mixer.input_gate", "");
  expect_error([&] { Rglru(attention, model, rglru_with([](auto& m) { m.c = 0; })); }, "mixer.c", "");

  const Layer layer(attention, model, good);
  Tensor<float, 3> x({2, 7, model}, 0.5f), out({2, 7, model}, 7.0f);
  expect_error([&] { layer.forward(Tensor<float, 3>({2, 7, 4}).cview(), out.view()); }, "x", "");
  expect_error([&] { layer.forward(x.cview(), Tensor<float, 3>({2, 6, model}).view()); }, "out", "");
  expect_error([&] { layer.forward(TensorView<const float, 3>(out.data(), out.extents()), out.view()); },
                     "out", "");
  expect_error([&] { layer.forward(TensorView<const float, 3>(nullptr, {2, 7, model}), out.view()); }, "x", "");
  for (index_t i = 0; i < out.size(); ++i) REQUIRE(out.data()[i] == 7.0f);  // nothing written

  auto state = layer.make_state(2);
  Tensor<float, 2> x_t({2, model}, 0.5f), out_t({2, model});
  expect_error([&] { layer.step(state, Tensor<float, 2>({3, model}).cview(), out_t.view()); }, "x_t", "");
  expect_error([&] { layer.step(state, x_t.cview(), Tensor<float, 2>({2, 4}).view()); }, "out_t", "");
  expect_error([&] { layer.forward(Tensor<float, 3>({3, 2, model}).cview(), Tensor<float, 3>({3, 2, model}).view(), state); },
                     "state", "");
  // A state of another layer (other scratch shapes) is refused before anything moves.
  const Layer other(LatteAttention<Causal>({.heads = 2, .latents = 4, .value_dim = 4}), model,
                    Layer::random_weights(LatteAttention<Causal>({.heads = 2, .latents = 4, .value_dim = 4}),
                                          model, 4, ShortConv<3>::Weights<float>::identity(model)));
  auto foreign = other.make_state(2);
  expect_error([&] { layer.step(foreign, x_t.cview(), out_t.view()); }, "state", "");
  expect_error([&] { (void)layer.make_state(-1); }, "batch", "");
}

TEST_CASE("A refused prefill leaves the mixer state where it was") {
  // The mechanism refuses the state (the KV cache is full), after the mixer could
  // have advanced: the layer restores the mixer, so decoding can go on.
  using Layer = AttentionLayer<SoftmaxAttention<Causal>, ShortConv<3>, double>;
  const SoftmaxAttention<Causal> attention({.heads = 1, .key_dim = 2, .value_dim = 2});
  Rng rng(77);
  const Layer layer(attention, 3,
                    Layer::random_weights(attention, 3, 5, random_mixer<double, ShortConv<3>>(rng, 3)));
  auto state = layer.make_state(1, 4);
  const auto x = random_tensor<double, 3>(rng, {1, 6, 3}, 1.0);
  Tensor<double, 3> out({1, 3, 3});
  layer.forward(rows_slice(x, 0, 3).cview(), out.view(), state);
  const auto history = state.mixer.history;
  Tensor<double, 3> too_long({1, 3, 3});
  expect_error([&] { layer.forward(rows_slice(x, 3, 3).cview(), too_long.view(), state); },
                     "state", "");
  CHECK(bit_equal(state.mixer.history, history));
}

}  // namespace test_layers
