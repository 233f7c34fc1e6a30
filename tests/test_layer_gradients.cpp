// The token mixers' backward (ShortConv<K>, RGLRU) and AttentionLayer::backward
// against the long-double transcriptions of tests/oracles/layer_oracle.hpp (the
// layer: mixer, projections, the mechanism's explicit T x T oracle, output
// projection): every element of d_x and of every weight gradient by central
// differences of <d_out, oracle(x, weights)> on small shapes, random directions
// on larger ones, fp32 and fp64, with weights accumulated (+=) rather than
// overwritten. That includes the parameters the mechanisms own (d_weights.attention:
// LAVO's bias and bases, conv-compression's weights, VAPOR's angles, LeaP
// modules), the oracle evaluated with them perturbed. Bad buffers refused by name;
// mechanisms rebuilt from their parameter accessors give the same layer.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "expect_error.hpp"
#include "gradient_check.hpp"
#include "latte/layers/named_layers.hpp"
#include "latte/layers/rglru.hpp"
#include "latte/layers/short_conv.hpp"
#include "mechanism_adaptors.hpp"
#include "linear_support.hpp"
#include "oracles/conv_compressed_oracle.hpp"
#include "oracles/latte_oracle.hpp"
#include "oracles/lavo_oracle.hpp"
#include "oracles/layer_oracle.hpp"
#include "oracles/linear_oracle.hpp"
#include "oracles/macchiato_oracle.hpp"
#include "oracles/softmax_oracle.hpp"
#include "support.hpp"

namespace test_layer_gradients {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;

template <class T, std::size_t N>
Tensor<T, N> filled(Rng& rng, const std::array<index_t, N>& extents, double scale) {
  return random_tensor<T, N>(rng, extents, scale);
}

template <class T, std::size_t N>
bool same_elements(const Tensor<T, N>& a, const Tensor<T, N>& b) {
  return a.extents() == b.extents() && std::equal(a.data(), a.data() + a.size(), b.data());
}

// ----------------------------------------------------------------- ShortConv --

template <class T, index_t K>
struct ConvProblem {
  using Mixer = ShortConv<K>;
  Tensor<T, 3> x, d_y, d_x;
  typename Mixer::template Weights<T> weights, d_weights;

  ConvProblem(Rng& rng, index_t B, index_t Tn, index_t C) {
    x = filled<T, 3>(rng, {B, Tn, C}, 1.0);
    d_y = filled<T, 3>(rng, {B, Tn, C}, 1.0);
    weights = {filled<T, 2>(rng, {K, C}, 1.0), filled<T, 1>(rng, {C}, 1.0)};
  }
  void run() {
    d_x = Tensor<T, 3>(x.extents());
    // Accumulated: start from a known value and subtract it afterwards.
    d_weights = {Tensor<T, 2>(weights.kernel.extents(), T(0.5)), Tensor<T, 1>(weights.bias.extents(), T(0.5))};
    Mixer::backward(weights, x.cview(), d_y.cview(), d_x.view(), &d_weights);
    for (index_t i = 0; i < d_weights.kernel.size(); ++i) d_weights.kernel.data()[i] -= T(0.5);
    for (index_t i = 0; i < d_weights.bias.size(); ++i) d_weights.bias.data()[i] -= T(0.5);
  }
  struct Loss {
    TensorLD<3> x, d_y;
    TensorLD<2> kernel;
    TensorLD<1> bias;
    long double operator()() const {
      const TensorLD<3> y = short_conv_oracle(kernel, bias, x);
      long double total = 0;
      for (index_t i = 0; i < y.size(); ++i) total += d_y.data()[i] * y.data()[i];
      return total;
    }
    GradientInputs inputs() { return {as_input(x), as_input(kernel), as_input(bias)}; }
  };
  Loss loss() const {
    Loss l{to_long_double(x), to_long_double(d_y), TensorLD<2>(weights.kernel.extents()),
           TensorLD<1>(weights.bias.extents())};
    for (index_t i = 0; i < weights.kernel.size(); ++i) l.kernel.data()[i] = weights.kernel.data()[i];
    for (index_t i = 0; i < weights.bias.size(); ++i) l.bias.data()[i] = weights.bias.data()[i];
    return l;
  }
  std::vector<std::span<const T>> gradients() const {
    return {span_of(d_x), span_of(d_weights.kernel), span_of(d_weights.bias)};
  }
};

constexpr const char* kConvNames[] = {"d_x", "d_mixer.kernel", "d_mixer.bias"};

template <class T>
void conv_cases(std::uint64_t seed) {
  Rng rng(seed);
  for (const std::array<index_t, 3>& shape : {std::array<index_t, 3>{1, 1, 2}, {2, 2, 3}, {1, 7, 4}, {2, 12, 3}}) {
    // Named copies, not a structured binding: clang 14 cannot capture those (CAPTURE).
    const index_t B = shape[0], Tn = shape[1], C = shape[2];
    CAPTURE(Tn);
    ConvProblem<T, 3> three(rng, B, Tn, C);
    three.run();
    check_every_element<T>(three, kConvNames);
    ConvProblem<T, 1> one(rng, B, Tn, C);
    one.run();
    check_every_element<T>(one, kConvNames);
    ConvProblem<T, 5> five(rng, B, Tn, C);
    five.run();
    check_every_element<T>(five, kConvNames);
  }
  for (int c = 0; c < case_count(6); ++c) {
    const index_t Tn = std::uniform_int_distribution<index_t>(1, 300)(rng);
    ConvProblem<T, 4> problem(rng, 2, Tn, 9);
    problem.run();
    check_direction<T>(problem, rng);
  }
}

// --------------------------------------------------------------------- RGLRU --

template <class T>
struct RglruProblem {
  Tensor<T, 3> x, d_y, d_x;
  RGLRU::Weights<T> weights, d_weights;

  RglruProblem(Rng& rng, index_t B, index_t Tn, index_t C, double lambda_low) {
    x = filled<T, 3>(rng, {B, Tn, C}, 1.0);
    d_y = filled<T, 3>(rng, {B, Tn, C}, 1.0);
    weights = RGLRU::Weights<T>::initial(C, rng());
    for (index_t i = 0; i < C; ++i) {  // biases away from zero; Lambda over a wide range
      weights.recurrence_bias(i) = static_cast<T>(std::normal_distribution<double>(0, 1)(rng));
      weights.input_bias(i) = static_cast<T>(std::normal_distribution<double>(0, 1)(rng));
      weights.lambda(i) = static_cast<T>(std::uniform_real_distribution<double>(lambda_low, 2.0)(rng));
    }
  }
  void run() {
    d_x = Tensor<T, 3>(x.extents());
    const index_t C = weights.lambda.extent(0);
    d_weights = {Tensor<T, 2>({C, C}, T(0.25)), Tensor<T, 1>({C}, T(0.25)),
                 Tensor<T, 2>({C, C}, T(0.25)), Tensor<T, 1>({C}, T(0.25)),
                 Tensor<T, 1>({C}, T(0.25))};
    RGLRU::backward(weights, x.cview(), d_y.cview(), d_x.view(), &d_weights);
    for (Tensor<T, 2>* m : {&d_weights.recurrence_gate, &d_weights.input_gate})
      for (index_t i = 0; i < m->size(); ++i) m->data()[i] -= T(0.25);
    for (Tensor<T, 1>* v : {&d_weights.recurrence_bias, &d_weights.input_bias, &d_weights.lambda})
      for (index_t i = 0; i < v->size(); ++i) v->data()[i] -= T(0.25);
  }
  struct Loss {
    TensorLD<3> x, d_y;
    RglruOracleWeights w;
    long double operator()() const {
      const TensorLD<3> y = rglru_oracle(w, x);
      long double total = 0;
      for (index_t i = 0; i < y.size(); ++i) total += d_y.data()[i] * y.data()[i];
      return total;
    }
    GradientInputs inputs() {
      return {as_input(x), w.recurrence_gate, w.recurrence_bias, w.input_gate, w.input_bias, w.lambda};
    }
  };
  Loss loss() const {
    return {to_long_double(x), to_long_double(d_y),
            {long_doubles(weights.recurrence_gate), long_doubles(weights.recurrence_bias),
             long_doubles(weights.input_gate), long_doubles(weights.input_bias),
             long_doubles(weights.lambda), weights.c}};
  }
  std::vector<std::span<const T>> gradients() const {
    return {span_of(d_x),
            span_of(d_weights.recurrence_gate),
            span_of(d_weights.recurrence_bias),
            span_of(d_weights.input_gate),
            span_of(d_weights.input_bias),
            span_of(d_weights.lambda)};
  }
};

constexpr const char* kRglruNames[] = {"d_x", "d_mixer.recurrence_gate", "d_mixer.recurrence_bias",
                                       "d_mixer.input_gate", "d_mixer.input_bias", "d_mixer.lambda"};

template <class T>
void rglru_cases(std::uint64_t seed) {
  Rng rng(seed);
  for (const std::array<index_t, 3>& shape : {std::array<index_t, 3>{1, 1, 2}, {2, 3, 3}, {1, 9, 4}, {2, 16, 3}}) {
    const index_t B = shape[0], Tn = shape[1], C = shape[2];
    for (const double lambda_low : {-2.0, -9.0}) {  // a_t up to 1 - 1e-4 at r = 1
      CAPTURE(Tn);
      CAPTURE(lambda_low);
      RglruProblem<T> problem(rng, B, Tn, C, lambda_low);
      problem.run();
      check_every_element<T>(problem, kRglruNames);
    }
  }
  for (int c = 0; c < case_count(6); ++c) {
    const index_t Tn = std::uniform_int_distribution<index_t>(1, 200)(rng);
    RglruProblem<T> problem(rng, 2, Tn, 7, -4.0);
    problem.run();
    check_direction<T>(problem, rng);
  }
}

// ------------------------------------------------------------ AttentionLayer --


using MatrixLD = Eigen::Matrix<long double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// a[b, t, h, d] = sum_j x[b, t, j] W(j, h * width + d), in long double.
TensorLD<4> project_ld(const TensorLD<3>& x, const MatrixLD& W, index_t heads, index_t width) {
  const index_t B = x.extent(0), Tn = x.extent(1), C = x.extent(2);
  TensorLD<4> a({B, Tn, heads, width});
  for (index_t b = 0; b < B; ++b)
    for (index_t t = 0; t < Tn; ++t)
      for (index_t h = 0; h < heads; ++h)
        for (index_t d = 0; d < width; ++d) {
          long double sum = 0;
          for (index_t j = 0; j < C; ++j) sum += x(b, t, j) * W(j, h * width + d);
          a(b, t, h, d) = sum;
        }
  return a;
}

template <class T, class Mixer>
typename Mixer::template Weights<T> random_mixer(Rng& rng, index_t C) {
  if constexpr (std::is_same_v<Mixer, NoMixer>) {
    return {};
  } else if constexpr (std::is_same_v<Mixer, RGLRU>) {
    return {random_tensor<T, 2>(rng, {C, C}, 1.0 / std::sqrt(double(C))), random_tensor<T, 1>(rng, {C}, 0.5),
            random_tensor<T, 2>(rng, {C, C}, 1.0 / std::sqrt(double(C))), random_tensor<T, 1>(rng, {C}, 0.5),
            uniform_tensor<T, 1>(rng, {C}, -4.0, 2.0)};
  } else {
    return {random_tensor<T, 2>(rng, {Mixer::taps, C}, 0.6), random_tensor<T, 1>(rng, {C}, 0.1)};
  }
}

/// The mixer's weights as long-double vectors, in the order of its gradients.
template <class Mixer, class T>
std::vector<std::vector<long double>> mixer_parameters(const typename Mixer::template Weights<T>& w) {
  if constexpr (std::is_same_v<Mixer, NoMixer>)
    return {};
  else if constexpr (std::is_same_v<Mixer, RGLRU>)
    return {long_doubles(w.recurrence_gate), long_doubles(w.recurrence_bias), long_doubles(w.input_gate),
            long_doubles(w.input_bias), long_doubles(w.lambda)};
  else
    return {long_doubles(w.kernel), long_doubles(w.bias)};
}
template <class Mixer, class T>
std::vector<std::span<const T>> mixer_gradients(const typename Mixer::template Weights<T>& w) {
  if constexpr (std::is_same_v<Mixer, NoMixer>)
    return {};
  else if constexpr (std::is_same_v<Mixer, RGLRU>)
    return {span_of(w.recurrence_gate), span_of(w.recurrence_bias), span_of(w.input_gate),
            span_of(w.input_bias), span_of(w.lambda)};
  else
    return {span_of(w.kernel), span_of(w.bias)};
}

template <class T, class Mechanism, class Mixer>
struct LayerProblem {
  using Layer = AttentionLayer<typename Mechanism::Attention, Mixer, T>;
  LayerShape shape;
  std::optional<Layer> layer;
  Tensor<T, 3> x, d_out, d_x;
  typename Layer::Weights d_weights;
  std::vector<std::vector<T>> attention_gradients;  // d_weights.attention, as Mechanism lists them

  LayerProblem(Rng& rng, const LayerShape& s) : shape(s) {
    const auto attention = Mechanism::make(s);
    layer.emplace(attention, s.model_dim,
                  Layer::random_weights(attention, s.model_dim, rng(), random_mixer<T, Mixer>(rng, s.model_dim)));
    x = random_tensor<T, 3>(rng, {s.batch, s.time, s.model_dim}, 1.0);
    d_out = random_tensor<T, 3>(rng, {s.batch, s.time, s.model_dim}, 1.0);
  }
  template <class E>
  void run(E e, const typename Layer::StateGradients* states = nullptr) {
    d_x = Tensor<T, 3>(x.extents());
    d_weights = layer->zero_weights();
    if constexpr (Layer::trains_in_chunks) {
      if (states) layer->backward(e, x.cview(), d_out.cview(), d_x.view(), &d_weights, *states);
      else layer->backward(e, x.cview(), d_out.cview(), d_x.view(), &d_weights);
    } else {
      layer->backward(e, x.cview(), d_out.cview(), d_x.view(), &d_weights);
    }
    attention_gradients = Mechanism::template parameter_gradients<T>(d_weights.attention);
  }
  struct Loss {
    LayerShape shape;
    TensorLD<3> x, d_out;
    std::vector<MatrixLD> projections;
    MatrixLD output;
    std::vector<std::vector<long double>> mixer;  // the mixer's weights, as mixer_parameters
    std::vector<LayerInput> layer_inputs;
    long double c = 8;
    OwnParameters attention;  // the mechanism's own parameters, as Mechanism::parameters
    long double operator()() const {
      TensorLD<3> y = x;
      if constexpr (std::is_same_v<Mixer, RGLRU>)
        y = rglru_oracle({mixer[0], mixer[1], mixer[2], mixer[3], mixer[4], c}, x);
      else if constexpr (!std::is_same_v<Mixer, NoMixer>) {
        Tensor<long double, 2> kernel({Mixer::taps, shape.model_dim});
        Tensor<long double, 1> bias({shape.model_dim});
        std::copy(mixer[0].begin(), mixer[0].end(), kernel.data());
        std::copy(mixer[1].begin(), mixer[1].end(), bias.data());
        y = short_conv_oracle(kernel, bias, x);
      }
      std::vector<TensorLD<4>> a;
      for (std::size_t i = 0; i < layer_inputs.size(); ++i)
        a.push_back(project_ld(layer_inputs[i].from_mixer && Mixer::mixes ? y : x, projections[i],
                               shape.heads, layer_inputs[i].width));
      const TensorLD<3> out = output_oracle(Mechanism::oracle(shape, attention, a), output);
      long double total = 0;
      for (index_t i = 0; i < out.size(); ++i) total += d_out.data()[i] * out.data()[i];
      return total;
    }
    GradientInputs inputs() {
      GradientInputs in{as_input(x)};
      for (MatrixLD& m : projections) in.emplace_back(m.data(), static_cast<std::size_t>(m.size()));
      in.emplace_back(output.data(), static_cast<std::size_t>(output.size()));
      for (auto& w : mixer) in.emplace_back(w);
      for (auto& w : attention) in.emplace_back(w);
      return in;
    }
  };
  Loss loss() const {
    Loss l{shape, to_long_double(x), to_long_double(d_out), {}, {}, {}, {}, 8, {}};
    for (const auto& W : layer->weights().projections) l.projections.push_back(W.template cast<long double>());
    l.output = layer->weights().output.template cast<long double>();
    l.mixer = mixer_parameters<Mixer, T>(layer->weights().mixer);
    if constexpr (std::is_same_v<Mixer, RGLRU>) l.c = layer->weights().mixer.c;
    for (const LayerInput& input : layer->inputs()) l.layer_inputs.push_back(input);
    l.attention = Mechanism::parameters(layer->attention());
    return l;
  }
  std::vector<std::span<const T>> gradients() const {
    std::vector<std::span<const T>> out{span_of(d_x)};
    for (const auto& W : d_weights.projections) out.emplace_back(W.data(), static_cast<std::size_t>(W.size()));
    out.emplace_back(d_weights.output.data(), static_cast<std::size_t>(d_weights.output.size()));
    for (const auto& g : mixer_gradients<Mixer, T>(d_weights.mixer)) out.push_back(g);
    for (const auto& g : attention_gradients) out.emplace_back(g.data(), g.size());
    return out;
  }
  /// "d_x", "d_weights.projections[<input>]", ..., "d_weights.output", the mixer's.
  std::vector<std::string> names() const {
    std::vector<std::string> out{"d_x"};
    for (const LayerInput& input : layer->inputs())
      out.push_back("d_weights.projections[" + std::string(input.name) + "]");
    out.push_back("d_weights.output");
    for (std::size_t i = 0; i < mixer_gradients<Mixer, T>(d_weights.mixer).size(); ++i)
      out.push_back("d_weights.mixer[" + std::to_string(i) + "]");
    for (const std::string& name : Mechanism::parameter_names()) out.push_back("d_weights.attention." + name);
    return out;
  }
};

template <class T, class P>
void check_layer_every_element(const P& problem, const OracleGradients& expected) {
  const std::vector<std::string> names = problem.names();
  std::vector<const char*> pointers;
  for (const std::string& name : names) pointers.push_back(name.c_str());
  check_every_element<T>(problem, expected, pointers.data());
}

template <class T, class Mechanism, class Mixer>
void layer_cases(std::uint64_t seed) {
  Rng rng(seed);
  // B, T, H, L, Dk, Dv, model_dim, w: every weight element is a loss evaluation pair.
  for (const LayerShape& s : {LayerShape{1, 5, 2, 2, 2, 2, 3, 2}, LayerShape{2, 7, 1, 3, 2, 3, 4, 3}}) {
    CAPTURE(s.time);
    LayerProblem<T, Mechanism, Mixer> problem(rng, s);
    problem.run(exec::reference);
    const OracleGradients expected = oracle_gradients(problem);  // one set for both runs
    check_layer_every_element<T>(problem, expected);
    problem.run(exec::cpu);
    check_layer_every_element<T>(problem, expected);
  }
  for (int c = 0; c < case_count(3); ++c) {
    const LayerShape s{2, std::uniform_int_distribution<index_t>(1, 60)(rng), 2, 5, 4, 6, 8, 9};
    CAPTURE(s.time);
    LayerProblem<T, Mechanism, Mixer> problem(rng, s);
    problem.run(exec::cpu);
    check_direction<T>(problem, rng);
  }
}

/// A fresh state of `layer` for `batch` sequences (conv-compression's holds `capacity` tokens).
template <class Layer>
typename Layer::State fresh_state(const Layer& layer, index_t batch, index_t capacity) {
  if constexpr (requires { layer.attention().template make_state<typename Layer::scalar_type>(batch); })
    return layer.make_state(batch);
  else return layer.make_state(batch, capacity);
}

/// Training a layer in chunks: the backward over [0, T) from `start` (a state
/// after a prelude of 4 tokens, so the mixer's history and the mechanism's
/// state are not zero) equals three chunks' backwards chained through the
/// layer's state gradients (the mechanism's and the mixer's): d_x joined in
/// time, every weight's gradient summed over the chunks.
template <class T, class Mechanism, class Mixer, class E>
void check_layer_chunks(E e, std::uint64_t seed, index_t c1, index_t c2) {
  using P = LayerProblem<T, Mechanism, Mixer>;
  using Layer = typename P::Layer;
  Rng rng(seed);
  const LayerShape s{2, 19, 2, 3, 2, 4, 5, 3};
  P whole(rng, s);
  const Layer& layer = *whole.layer;
  const index_t prelude = 4;
  typename Layer::State start = fresh_state(layer, s.batch, prelude + s.time);
  const Tensor<T, 3> before = random_tensor<T, 3>(rng, {s.batch, prelude, s.model_dim}, 1.0);
  Tensor<T, 3> before_out(before.extents());
  layer.forward(e, before.cview(), before_out.view(), start);
  const typename Layer::StateGradients from_start{.initial = &start};
  whole.run(e, &from_start);

  const std::array<index_t, 4> borders{0, c1, c2, s.time};
  std::vector<P> chunks(3, whole);
  std::vector<typename Layer::State> states{start};
  auto slice = [](const Tensor<T, 3>& x, index_t from, index_t count) {
    Tensor<T, 3> out({x.extent(0), count, x.extent(2)});
    for (index_t b = 0; b < x.extent(0); ++b)
      for (index_t t = 0; t < count; ++t)
        for (index_t c = 0; c < x.extent(2); ++c) out(b, t, c) = x(b, from + t, c);
    return out;
  };
  for (std::size_t i = 0; i < 3; ++i) {
    chunks[i].x = slice(whole.x, borders[i], borders[i + 1] - borders[i]);
    chunks[i].d_out = slice(whole.d_out, borders[i], borders[i + 1] - borders[i]);
    typename Layer::State state = states.back();
    Tensor<T, 3> out(chunks[i].x.extents());
    layer.forward(e, chunks[i].x.cview(), out.view(), state);
    states.push_back(state);
  }
  std::vector<typename Layer::State> d_states(3, fresh_state(layer, s.batch, prelude + s.time));
  for (std::size_t i = 3; i-- > 0;) {
    const typename Layer::StateGradients ends{.initial = &states[i],
                                              .d_final = i == 2 ? nullptr : &d_states[i + 1],
                                              .d_initial = &d_states[i]};
    chunks[i].run(e, &ends);
  }
  const double bound = 50 * Tolerance<T>::relative;
  long double worst = 0, largest = 0;
  for (index_t b = 0; b < s.batch; ++b)
    for (std::size_t i = 0; i < 3; ++i)
      for (index_t t = 0; t < chunks[i].x.extent(1); ++t)
        for (index_t c = 0; c < s.model_dim; ++c) {
          const long double expected = whole.d_x(b, borders[i] + t, c);
          worst = std::max(worst, std::fabs((long double)chunks[i].d_x(b, t, c) - expected));
          largest = std::max(largest, std::fabs(expected));
        }
  CHECK(static_cast<double>(worst / largest) <= bound);
  const auto expected = whole.gradients();
  const std::vector<std::string> names = whole.names();
  for (std::size_t g = 1; g < expected.size(); ++g) {  // every weight: summed over the chunks
    CAPTURE(names[g]);
    long double error = 0, scale = 0;
    for (std::size_t j = 0; j < expected[g].size(); ++j) {
      long double summed = 0;
      for (const P& chunk : chunks) summed += chunk.gradients()[g][j];
      error = std::max(error, std::fabs(summed - expected[g][j]));
      scale = std::max(scale, std::fabs((long double)expected[g][j]));
    }
    CHECK(static_cast<double>(error / std::max(scale, 1e-30L)) <= bound);
  }
}

template <class T, class Mechanism, class Mixer>
void layer_chunk_cases(std::uint64_t seed) {
  for (const auto& cuts : {std::pair<index_t, index_t>{1, 2}, {6, 13}, {0, 18}}) {
    const index_t c1 = cuts.first, c2 = cuts.second;  // names clang 14 can capture
    CAPTURE(c1);
    CAPTURE(c2);
    // exec::cpu only: the layer's own part is backend-agnostic, and each mechanism's
    // state gradients are checked on both backends in its own test file.
    check_layer_chunks<T, Mechanism, Mixer>(exec::cpu, seed, c1, c2);
  }
}

}  // namespace

TEST_CASE("ShortConv backward matches the oracle's gradients") {
  conv_cases<double>(100);
  conv_cases<float>(200);
}

TEST_CASE("RGLRU backward matches the oracle's gradients") {
  rglru_cases<double>(300);
  rglru_cases<float>(400);
}

TEST_CASE("token mixer backward: bad buffers are refused by name") {
  Rng rng(500);
  const index_t C = 3;
  Tensor<float, 3> x({2, 4, C}), d_y({2, 4, C}), d_x({2, 4, C}), wrong({2, 4, C + 1});
  const auto conv = ShortConv<3>::Weights<float>::identity(C);
  auto d_conv = ShortConv<3>::Weights<float>::identity(C);
  ShortConv<3>::backward(conv, x.cview(), d_y.cview(), d_x.view(), &d_conv);  // the valid call
  expect_error([&] { ShortConv<3>::backward(conv, x.cview(), wrong.cview(), d_x.view(), &d_conv); },
               "d_y", "");
  expect_error([&] { ShortConv<3>::backward(conv, x.cview(), d_y.cview(), wrong.view(), &d_conv); },
               "d_x", "");
  expect_error([&] { ShortConv<3>::backward(conv, x.cview(), d_y.cview(), x.view(), &d_conv); },
               "d_x", "");
  auto bad_conv = ShortConv<3>::Weights<float>::identity(C + 1);
  expect_error([&] { ShortConv<3>::backward(conv, x.cview(), d_y.cview(), d_x.view(), &bad_conv); },
               "d_mixer.kernel", "");
  const auto rglru = RGLRU::Weights<float>::initial(C, 1);
  auto d_rglru = RGLRU::Weights<float>::initial(C, 2);
  RGLRU::backward(rglru, x.cview(), d_y.cview(), d_x.view(), &d_rglru);  // the valid call
  expect_error([&] { RGLRU::backward(rglru, x.cview(), wrong.cview(), d_x.view(), &d_rglru); }, "d_y", "");
  expect_error([&] { RGLRU::backward(rglru, x.cview(), d_y.cview(), d_y.view(), &d_rglru); }, "d_x", "");
  auto bad_rglru = RGLRU::Weights<float>::initial(C, 3);
  bad_rglru.lambda = Tensor<float, 1>({C + 1});
  expect_error([&] { RGLRU::backward(rglru, x.cview(), d_y.cview(), d_x.view(), &bad_rglru); },
               "d_mixer.lambda", "");
  // States of another batch or width are refused by name.
  const auto conv_state = ShortConv<3>::make_state(bad_conv, 2);  // C + 1 channels
  expect_error([&] {
    ShortConv<3>::backward(conv, x.cview(), d_y.cview(), d_x.view(), nullptr, {.initial = &conv_state});
  }, "states.initial.mixer.history", "");
  auto own_state = ShortConv<3>::make_state(conv, 2);
  expect_error([&] {
    ShortConv<3>::backward(conv, x.cview(), d_y.cview(), d_x.view(), nullptr,
                           {.initial = &own_state, .d_initial = &own_state});
  }, "states.d_initial", "");
  const auto rglru_state = RGLRU::make_state(rglru, 1);  // batch 1
  expect_error([&] {
    RGLRU::backward(rglru, x.cview(), d_y.cview(), d_x.view(), nullptr, {.d_final = &rglru_state});
  }, "states.d_final.mixer.hidden", "");
}

TEST_CASE("AttentionLayer training in chunks: backward chained through the layer's state gradients equals the whole backward") {
  static_assert(!AttentionLayer<SoftmaxAttention<Causal>, NoMixer, double>::trains_in_chunks);
  static_assert(!AttentionLayer<LatteAttention<Bidirectional>, NoMixer, double>::trains_in_chunks);
  // The layer types of the oracle case below (one instantiation each in this program).
  SUBCASE("Latte + RG-LRU") { layer_chunk_cases<double, LatteMechanism<Causal>, RGLRU>(700); }
  SUBCASE("Latte with VAPOR + ShortConv") {
    layer_chunk_cases<double, LatteMechanism<Causal, VAPOR>, ShortConv<3>>(702);
    layer_chunk_cases<float, LatteMechanism<Causal, VAPOR>, ShortConv<3>>(704);
  }
  SUBCASE("Macchiato (RoPE window) + RG-LRU") { layer_chunk_cases<double, MacchiatoMechanism<Causal>, RGLRU>(706); }
  SUBCASE("linear elu + 1") { layer_chunk_cases<double, LinearMechanism<Causal>, NoMixer>(708); }
  SUBCASE("LeaPformer (LeaP modules)") { layer_chunk_cases<double, LeaPMechanism<Causal>, NoMixer>(710); }
  SUBCASE("LAVO") { layer_chunk_cases<double, LavoMechanism<Causal>, NoMixer>(712); }
  SUBCASE("conv-compression") { layer_chunk_cases<double, ConvCompressedMechanism<Causal>, NoMixer>(714); }
}

TEST_CASE("AttentionLayer backward matches the layer oracle's gradients") {
  SUBCASE("Latte + RG-LRU, causal") {
    layer_cases<double, LatteMechanism<Causal>, RGLRU>(600);
    layer_cases<float, LatteMechanism<Causal>, RGLRU>(601);
  }
  SUBCASE("Latte + ShortConv, bidirectional") {
    layer_cases<double, LatteMechanism<Bidirectional>, ShortConv<3>>(602);
    layer_cases<float, LatteMechanism<Bidirectional>, ShortConv<3>>(603);
  }
  SUBCASE("Macchiato (RoPE window) + RG-LRU, causal") {
    layer_cases<double, MacchiatoMechanism<Causal>, RGLRU>(604);
    layer_cases<float, MacchiatoMechanism<Causal>, RGLRU>(605);
  }
  SUBCASE("Macchiato + ShortConv, bidirectional") {
    layer_cases<double, MacchiatoMechanism<Bidirectional>, ShortConv<3>>(606);
  }
  SUBCASE("Latte with VAPOR angles + ShortConv, causal") {
    layer_cases<double, LatteMechanism<Causal, VAPOR>, ShortConv<3>>(615);
    layer_cases<float, LatteMechanism<Causal, VAPOR>, ShortConv<3>>(616);
  }
  SUBCASE("Latte with VAPOR angles, bidirectional") {
    layer_cases<double, LatteMechanism<Bidirectional, VAPOR>, NoMixer>(617);
  }
  SUBCASE("Macchiato (VAPOR latents, RoPE window), causal") {
    layer_cases<double, MacchiatoMechanism<Causal, VAPOR>, NoMixer>(618);
    layer_cases<float, MacchiatoMechanism<Causal, VAPOR>, NoMixer>(619);
  }
  SUBCASE("LeaPformer (LeaP modules), causal") {
    // relu (features and hidden units) has a kink at 0 that a central difference
    // must not straddle: seed 621 puts a query feature within a step of it.
    layer_cases<double, LeaPMechanism<Causal>, NoMixer>(620);
    layer_cases<float, LeaPMechanism<Causal>, NoMixer>(623);
  }
  SUBCASE("LeaPformer (LeaP modules), bidirectional") {
    layer_cases<double, LeaPMechanism<Bidirectional>, NoMixer>(622);
  }
  SUBCASE("softmax, causal") { layer_cases<double, SoftmaxMechanism<Causal>, NoMixer>(607); }
  SUBCASE("linear elu + 1, causal") { layer_cases<double, LinearMechanism<Causal>, NoMixer>(608); }
  SUBCASE("LAVO, causal") {
    layer_cases<double, LavoMechanism<Causal>, NoMixer>(609);
    layer_cases<float, LavoMechanism<Causal>, NoMixer>(610);
  }
  SUBCASE("LAVO, bidirectional") { layer_cases<double, LavoMechanism<Bidirectional>, NoMixer>(611); }
  SUBCASE("conv-compression, causal") {
    layer_cases<double, ConvCompressedMechanism<Causal>, NoMixer>(612);
    layer_cases<float, ConvCompressedMechanism<Causal>, NoMixer>(613);
  }
  SUBCASE("conv-compression, bidirectional") {
    layer_cases<double, ConvCompressedMechanism<Bidirectional>, NoMixer>(614);
  }
}

TEST_CASE("AttentionLayer backward: bad buffers are refused by name") {
  const LatteAttention<Causal> attention({.heads = 2, .latents = 3, .value_dim = 4});
  using Layer = LatteLayer<Causal, ShortConv<3>>;
  const Layer layer(attention, 6,
                    Layer::random_weights(attention, 6, 1, ShortConv<3>::Weights<float>::identity(6)));
  Tensor<float, 3> x({2, 5, 6}), d_out({2, 5, 6}), d_x({2, 5, 6}), wrong({2, 5, 7});
  auto d_weights = layer.zero_weights();
  layer.backward(exec::cpu, x.cview(), d_out.cview(), d_x.view(), &d_weights);  // the valid call
  expect_error([&] { layer.backward(exec::cpu, x.cview(), wrong.cview(), d_x.view(), &d_weights); }, "d_out", "");
  expect_error([&] { layer.backward(exec::cpu, x.cview(), d_out.cview(), wrong.view(), &d_weights); }, "d_x", "");
  expect_error([&] { layer.backward(exec::cpu, x.cview(), d_out.cview(), x.view(), &d_weights); }, "d_x", "");
  auto bad = layer.zero_weights();
  bad.output = Layer::Matrix::Zero(3, 3);
  expect_error([&] { layer.backward(exec::cpu, x.cview(), d_out.cview(), d_x.view(), &bad); },
               "d_weights.output", "");
  bad = layer.zero_weights();
  bad.projections[1] = Layer::Matrix::Zero(6, 5);
  expect_error([&] { layer.backward(exec::cpu, x.cview(), d_out.cview(), d_x.view(), &bad); },
               "d_weights.projections[key_logits]", "");
  bad = layer.zero_weights();
  bad.mixer.bias = Tensor<float, 1>({5});
  expect_error([&] { layer.backward(exec::cpu, x.cview(), d_out.cview(), d_x.view(), &bad); },
               "d_weights.mixer.bias", "");
  static_assert(LavoLayer<Causal>::trainable && LavoLayer<Bidirectional>::trainable);
  static_assert(ConvCompressedLayer<Causal>::trainable && ConvCompressedLayer<Bidirectional>::trainable);
}

TEST_CASE("AttentionLayer backward: mechanism parameter gradients, bad buffers refused by name") {
  const LayerShape s{1, 6, 2, 2, 2, 4, 5, 2};
  Tensor<float, 3> x({1, 6, 5}), d_out({1, 6, 5}), d_x({1, 6, 5});
  Rng rng(700);
  x = random_tensor<float, 3>(rng, x.extents(), 1.0);
  d_out = random_tensor<float, 3>(rng, d_out.extents(), 1.0);
  auto backward = [&](const auto& layer, auto& d_weights) {
    layer.backward(exec::cpu, x.cview(), d_out.cview(), d_x.view(), &d_weights);
  };
  auto layer_of = [&](const auto& attention) {
    using Layer = AttentionLayer<std::decay_t<decltype(attention)>, NoMixer, float>;
    return Layer(attention, 5, Layer::random_weights(attention, 5, 3));
  };
  SUBCASE("LAVO: relative bias and bases") {
    const auto layer = layer_of(LavoMechanism<Causal>::make(s));
    auto d_weights = layer.zero_weights();
    CHECK(d_weights.attention.relative_bias.extents() == std::array<index_t, 2>{2, 3});
    CHECK(d_weights.attention.bases.extents() == std::array<index_t, 3>{2, 2, 4});
    backward(layer, d_weights);  // the valid call
    // An empty field is not wanted: the other still accumulates the same gradient.
    auto only_bias = layer.zero_weights();
    only_bias.attention.bases = {};
    backward(layer, only_bias);
    CHECK(only_bias.attention.bases.size() == 0);
    CHECK(same_elements(only_bias.attention.relative_bias, d_weights.attention.relative_bias));
    auto bad = layer.zero_weights();
    bad.attention.relative_bias = Tensor<float, 2>({2, 5});
    expect_error([&] { backward(layer, bad); }, "d_weights.attention.relative_bias", "");
    bad = layer.zero_weights();
    bad.attention.bases = Tensor<float, 3>({2, 4, 2});
    expect_error([&] { backward(layer, bad); }, "d_weights.attention.bases", "");
  }
  SUBCASE("conv-compression: every weight") {
    const auto layer = layer_of(ConvCompressedMechanism<Causal>::make(s));
    auto d_weights = layer.zero_weights();
    backward(layer, d_weights);  // the valid call
    auto skipped = layer.zero_weights();
    skipped.attention = {};  // not wanted
    backward(layer, skipped);
    CHECK(skipped.attention.conv_weight.empty());
    CHECK(skipped.output == d_weights.output);
    auto bad = layer.zero_weights();
    bad.attention = ConvCompressedParams::zeros({.heads = 2, .key_dim = 2, .value_dim = 4, .group_size = 3, .levels = 2});
    expect_error([&] { backward(layer, bad); }, "d_weights.attention.conv_weight[0]", "");
    bad.attention = ConvCompressedParams::zeros({.heads = 2, .key_dim = 2, .value_dim = 4, .group_size = 2, .levels = 1});
    expect_error([&] { backward(layer, bad); }, "d_weights.attention.conv_weight", "");
    bad = layer.zero_weights();
    bad.attention.cross_value = Tensor<double, 3>({2, 4, 3});
    expect_error([&] { backward(layer, bad); }, "d_weights.attention.cross_value", "");
  }
  SUBCASE("VAPOR angles (Latte, Macchiato)") {
    const auto latte = layer_of(LatteMechanism<Causal, VAPOR>::make(s));
    auto d_weights = latte.zero_weights();
    CHECK(d_weights.attention.angles.extents() == std::array<index_t, 2>{2, 2});
    backward(latte, d_weights);  // the valid call
    d_weights.attention.angles = Tensor<float, 2>({2, 3});
    expect_error([&] { backward(latte, d_weights); }, "d_weights.attention.angles", "");
    const auto macchiato = layer_of(MacchiatoMechanism<Causal, VAPOR>::make(s));
    auto d_macchiato = macchiato.zero_weights();
    backward(macchiato, d_macchiato);  // the valid call
    d_macchiato.attention.angles = Tensor<float, 2>({3, 2});
    expect_error([&] { backward(macchiato, d_macchiato); }, "d_weights.attention.angles", "");
    static_assert(std::is_same_v<decltype(LatteLayer<Causal>::Weights{}.attention), NoMechanismParameters>);
  }
  SUBCASE("LeaP modules") {
    const auto layer = layer_of(LeaPMechanism<Causal>::make(s));
    auto d_weights = layer.zero_weights();
    backward(layer, d_weights);  // the valid call
    auto bad = layer.zero_weights();
    bad.attention.query_module.w1 = Tensor<double, 2>({2, 3});
    expect_error([&] { backward(layer, bad); }, "d_weights.attention.query_module.w1", "");
    bad = layer.zero_weights();
    bad.attention.key_module.b1 = Tensor<double, 1>({1});
    expect_error([&] { backward(layer, bad); }, "d_weights.attention.key_module.b1", "");
  }
}

TEST_CASE("AttentionLayer: mechanisms rebuilt from their parameter accessors give the same layer") {
  // What a training step does after updating the parameters (here: unchanged).
  const LayerShape s{2, 9, 2, 3, 2, 4, 5, 3};
  Rng rng(800);
  const Tensor<double, 3> x = random_tensor<double, 3>(rng, {2, 9, 5}, 1.0);
  auto same_output = [&](const auto& attention, const auto& rebuilt) {
    using Layer = AttentionLayer<std::decay_t<decltype(attention)>, NoMixer, double>;
    const auto weights = Layer::random_weights(attention, 5, 4);
    Tensor<double, 3> out(x.extents()), again(x.extents());
    Layer(attention, 5, weights).forward(exec::cpu, x.cview(), out.view());
    Layer(rebuilt, 5, weights).forward(exec::cpu, x.cview(), again.view());
    CHECK(same_elements(again, out));
  };
  const auto lavo = LavoMechanism<Causal>::make(s);
  same_output(lavo, Lavo<Causal>(lavo.dims(), {.bases = lavo.bases(), .relative_bias = lavo.relative_bias(),
                                               .scale = lavo.scale(), .empty_memory = lavo.empty_memory()}));
  const auto conv = ConvCompressedMechanism<Bidirectional>::make(s);
  same_output(conv, ConvCompressedAttention<Bidirectional>(conv.dims(), conv.params(), conv.scale()));
  const auto latte = LatteMechanism<Causal, VAPOR>::make(s);
  same_output(latte, LatteAttention<Causal, RunningMax, VAPOR>(latte.dims(), VAPOR::params_from(latte.angles())));
  const auto macchiato = MacchiatoMechanism<Causal, VAPOR>::make(s);
  same_output(macchiato, LatteMacchiato<Causal, RunningMax, VAPOR, RoPE>(
                             macchiato.dims(), {.scale = macchiato.scale(), .vapor_scope = macchiato.vapor_scope()},
                             VAPOR::params_from(macchiato.latent_angles()),
                             RoPE::params_from(macchiato.window_angles())));
  const auto leap = LeaPMechanism<Causal>::make(s);
  same_output(leap, LeaPformer<Causal>(leap.dims(), leap.options()));
}

}  // namespace test_layer_gradients
