// Google Benchmark suite for layers, fp32, B = 1, model_dim = 512, H = 8, L = 64,
// Dv = 64 (the DESIGN §6 head shape behind a 512-wide model):
//
//   layer_forward/<layer>/T:{1024,4096}   whole-sequence forward: mixer, projections,
//                                         attention, output projection
//   layer_step/<layer>                    one decode token (state after 1K tokens)
//
// <layer>: latte (no mixer, exec::cpu attention), latte_conv (ShortConv<3>),
// latte_rglru (RGLRU). items_per_second is tokens/s. The counter "flops" is a rate
// (FLOP/s) from this model per token, a multiply and an add counted as 2 flops:
//   projections 2 C (2 H L + H Dv) + output 2 H Dv C        (C = model_dim)
//   attention   4 H L Dv                                      (absorb + read, causal Latte)
//   mixer       ShortConv: 2 K C;  RGLRU: 4 C^2 (two gate GEMMs) + O(C)
// The gap between latte and latte_rglru is what the mixer costs.
#include <benchmark/benchmark.h>

#include <latte/attention.hpp>

#include <array>
#include <cstdint>
#include <random>

namespace {

using latte::index_t;
constexpr index_t kModel = 512, kHeads = 8, kLatents = 64, kDim = 64;

latte::Tensor<float, 3> random_sequence(index_t tokens, unsigned seed) {
  latte::Tensor<float, 3> x({1, tokens, kModel});
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (index_t i = 0; i < x.size(); ++i) x.data()[i] = normal(rng);
  return x;
}

const latte::LatteAttention<latte::Causal>& attention() {
  static const latte::LatteAttention<latte::Causal> latte(
      {.heads = kHeads, .latents = kLatents, .value_dim = kDim});
  return latte;
}

template <class Mixer>
typename Mixer::template Weights<float> mixer_weights() {
  if constexpr (std::is_same_v<Mixer, latte::RGLRU>)
    return latte::RGLRU::Weights<float>::initial(kModel, 2);
  else if constexpr (std::is_same_v<Mixer, latte::NoMixer>)
    return {};
  else
    return Mixer::template Weights<float>::identity(kModel);
}

template <class Mixer>
latte::LatteLayer<latte::Causal, Mixer> make_layer() {
  using Layer = latte::LatteLayer<latte::Causal, Mixer>;
  return Layer(attention(), kModel,
               Layer::random_weights(attention(), kModel, 1, mixer_weights<Mixer>()));
}

template <class Mixer>
double flops_per_token() {
  double mixer = 0;
  if constexpr (std::is_same_v<Mixer, latte::RGLRU>) mixer = 4.0 * kModel * kModel;
  if constexpr (!std::is_same_v<Mixer, latte::RGLRU> && !std::is_same_v<Mixer, latte::NoMixer>)
    mixer = 2.0 * Mixer::taps * kModel;
  return 2.0 * kModel * (2.0 * kHeads * kLatents + kHeads * kDim) + 2.0 * kHeads * kDim * kModel +
         4.0 * kHeads * kLatents * kDim + mixer;
}

template <class Mixer>
void report(benchmark::State& state, index_t tokens) {
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(tokens));
  state.counters["flops"] = benchmark::Counter(flops_per_token<Mixer>() * double(tokens),
                                               benchmark::Counter::kIsIterationInvariantRate);
}

template <class Mixer>
void layer_forward(benchmark::State& state) {
  const index_t tokens = state.range(0);
  const auto layer = make_layer<Mixer>();
  const auto x = random_sequence(tokens, 3);
  latte::Tensor<float, 3> out({1, tokens, kModel});
  for (auto _ : state) {
    layer.forward(x.view(), out.view());
    benchmark::DoNotOptimize(out.data());
  }
  report<Mixer>(state, tokens);
}

template <class Mixer>
void layer_step(benchmark::State& state) {
  const auto layer = make_layer<Mixer>();
  auto decode = layer.make_state(1);
  const auto prompt = random_sequence(1024, 4);
  latte::Tensor<float, 3> prompt_out({1, 1024, kModel});
  layer.forward(prompt.view(), prompt_out.view(), decode);
  const auto x = random_sequence(1, 5);
  latte::Tensor<float, 2> out({1, kModel});
  const latte::TensorView<const float, 2> x_t(x.data(), {1, kModel});
  for (auto _ : state) {
    layer.step(decode, x_t, out.view());
    benchmark::DoNotOptimize(out.data());
  }
  report<Mixer>(state, 1);
}

}  // namespace

BENCHMARK(layer_forward<latte::NoMixer>)->Name("layer_forward/latte")->Arg(1024)->Arg(4096)->Unit(benchmark::kMillisecond);
BENCHMARK(layer_forward<latte::ShortConv<3>>)->Name("layer_forward/latte_conv")->Arg(1024)->Arg(4096)->Unit(benchmark::kMillisecond);
BENCHMARK(layer_forward<latte::RGLRU>)->Name("layer_forward/latte_rglru")->Arg(1024)->Arg(4096)->Unit(benchmark::kMillisecond);
BENCHMARK(layer_step<latte::NoMixer>)->Name("layer_step/latte")->Unit(benchmark::kMicrosecond);
BENCHMARK(layer_step<latte::ShortConv<3>>)->Name("layer_step/latte_conv")->Unit(benchmark::kMicrosecond);
BENCHMARK(layer_step<latte::RGLRU>)->Name("layer_step/latte_rglru")->Unit(benchmark::kMicrosecond);
