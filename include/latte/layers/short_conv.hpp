#pragma once
// latte::ShortConv<K> — the short causal depthwise convolution of paper 000
// §2.4 eq. 17 (paper 001 eq. 18), K = 3 in the papers' models:
//
//   y_{t,c} = b_c + sum_{i=0}^{K-1} w_{i,c} x_{t-i,c},   x_{s} = 0 for s < 0
//
// (the papers write the sum to K with K taps; we keep K taps, i = 0..K-1, and an
// optional bias b, zero by default). The decode state is the last K - 1 inputs
// per sequence, so a step costs O(K * C) whatever the context.
#include <algorithm>
#include <array>
#include <string>
#include <type_traits>

#include "latte/core/error.hpp"
#include "latte/core/shape_check.hpp"
#include "latte/core/tensor.hpp"
#include "latte/core/types.hpp"
#include "latte/layers/token_mixer.hpp"

namespace latte {

template <index_t K = 3>
struct ShortConv {
  static_assert(K >= 1, "ShortConv<K>: K (taps) must be at least 1");
  static constexpr const char* name = "short_conv";
  static constexpr bool mixes = true;
  static constexpr index_t taps = K;

  template <Real T>
  struct Weights {
    Tensor<T, 2> kernel;  ///< [K, C]: kernel(i, c) = w_{i,c} multiplies x_{t-i,c}
    Tensor<T, 1> bias;    ///< [C]

    /// w_0 = 1, the rest 0: y = x (a starting point that changes nothing).
    [[nodiscard]] static Weights identity(index_t channels) {
      detail::check_positive(channels, "channels");
      Weights weights{Tensor<T, 2>({K, channels}), Tensor<T, 1>({channels})};
      for (index_t c = 0; c < channels; ++c) weights.kernel(index_t{0}, c) = T(1);
      return weights;
    }
  };

  /// The last K - 1 inputs of each sequence, oldest first: history(b, K - 2) = x_{t-1}.
  template <Real T>
  struct State {
    Tensor<T, 3> history;  ///< [B, K - 1, C]
    [[nodiscard]] index_t batch() const noexcept { return history.extent(0); }
  };

  template <Real T>
  static void validate(const Weights<T>& weights, index_t channels) {
    detail::check_shape(weights.kernel.view(), "mixer.kernel", {K, channels}, "[K, C]");
    detail::check_shape(weights.bias.view(), "mixer.bias", {channels}, "[C]");
  }

  template <Real T>
  [[nodiscard]] static State<T> make_state(const Weights<T>& weights, index_t batch) {
    detail::require(batch >= 0, "batch", detail::expected_given("batch", ">= 0", batch));
    return {Tensor<T, 3>({batch, K - 1, weights.bias.extent(0)})};
  }

  /// y = conv(x) over [B, T, C]; x_{s < 0} come from `state` (zeros without one),
  /// which is left holding the last K - 1 inputs.
  template <Real T>
  static void forward(const Weights<T>& weights, TensorView<const T, 3> x, TensorView<T, 3> y,
                      std::type_identity_t<State<T>>* state) {
    const index_t B = x.extent(0), Tn = x.extent(1), C = x.extent(2);
    for (index_t b = 0; b < B; ++b)
      for (index_t t = 0; t < Tn; ++t) {
        T* y_t = y.row(b, t);
        for (index_t c = 0; c < C; ++c) y_t[c] = weights.bias(c);
        for (index_t i = 0; i < K; ++i) {
          const T* source = input_row(x, state, b, t - i);
          if (source == nullptr) continue;
          for (index_t c = 0; c < C; ++c) y_t[c] += weights.kernel(i, c) * source[c];
        }
      }
    if (state == nullptr || K == 1) return;
    // New history: the last K - 1 of (old history, x), read before overwriting.
    for (index_t b = 0; b < B; ++b) {
      if (Tn >= K - 1) {
        for (index_t j = 0; j < K - 1; ++j)
          std::copy_n(x.row(b, Tn - (K - 1) + j), C, state->history.view().row(b, j));
      } else {
        T* history = state->history.view().row(b, index_t{0});
        std::copy(history + Tn * C, history + (K - 1) * C, history);
        for (index_t j = 0; j < Tn; ++j)
          std::copy_n(x.row(b, j), C, state->history.view().row(b, K - 1 - Tn + j));
      }
    }
  }

  /// Gradients of a loss whose gradient with respect to y = forward(x, state)
  /// is d_y [B, T, C]: d_x overwritten, and when `d_weights` is given its
  /// kernel [K, C] and bias [C] accumulated (+=):
  ///   d_x_{s,c} = sum_i w_{i,c} d_y_{s+i,c},  d_w_{i,c} += sum_t d_y_{t,c} x_{t-i,c},
  ///   d_b_c += sum_t d_y_{t,c}.
  /// `states` (training in chunks): x_{s < 0} are initial's history (zeros
  /// without one); d_final's history, the gradient of the last K - 1 inputs the
  /// forward left, is added to those inputs' gradients; d_initial's history
  /// (overwritten) is the gradient of initial's, d_x_s for s = -(K - 1)..-1.
  template <Real T>
  static void backward(const Weights<T>& weights, TensorView<const T, 3> x,
                       TensorView<const T, 3> d_y, TensorView<T, 3> d_x,
                       std::type_identity_t<Weights<T>>* d_weights,
                       const MixerStateGradients<State<T>>& states = {}) {
    const index_t B = x.extent(0), Tn = x.extent(1), C = x.extent(2);
    detail::check_mixer_gradients(x, d_y, d_x);
    if (d_weights) {
      detail::check_shape(d_weights->kernel.view(), "d_mixer.kernel", {K, C}, "[K, C]");
      detail::check_shape(d_weights->bias.view(), "d_mixer.bias", {C}, "[C]");
    }
    check_states(states, B, C);
    // Rows s = -(K - 1)..T - 1: the history's gradient rows first, then d_x.
    auto d_row = [&](index_t b, index_t s) -> T* {
      return s >= 0 ? d_x.row(b, s) : states.d_initial->history.view().row(b, K - 1 + s);
    };
    const index_t first = states.d_initial != nullptr ? -(K - 1) : 0;
    for (index_t b = 0; b < B; ++b)
      for (index_t s = first; s < Tn; ++s) {
        T* out = d_row(b, s);
        std::fill_n(out, C, T(0));
        for (index_t i = std::max<index_t>(0, -s); i < K && s + i < Tn; ++i) {
          const T* g = d_y.row(b, s + i);
          for (index_t c = 0; c < C; ++c) out[c] += weights.kernel(i, c) * g[c];
        }
      }
    if (states.d_final != nullptr && K > 1)  // the final history: inputs T - (K - 1)..T - 1
      for (index_t b = 0; b < B; ++b)
        for (index_t j = 0; j < K - 1; ++j) {
          const index_t s = Tn - (K - 1) + j;
          if (s < first) continue;  // an initial input that is not asked for
          const T* g = states.d_final->history.view().row(b, j);
          T* out = d_row(b, s);
          for (index_t c = 0; c < C; ++c) out[c] += g[c];
        }
    if (!d_weights) return;
    for (index_t b = 0; b < B; ++b)
      for (index_t t = 0; t < Tn; ++t) {
        const T* g = d_y.row(b, t);
        for (index_t c = 0; c < C; ++c) d_weights->bias(c) += g[c];
        for (index_t i = 0; i < K; ++i) {
          const T* source = input_row(x, states.initial, b, t - i);
          if (source == nullptr) continue;
          for (index_t c = 0; c < C; ++c) d_weights->kernel(i, c) += g[c] * source[c];
        }
      }
  }

  /// Zero weights of `weights`' shapes (to accumulate gradients into).
  template <Real T>
  [[nodiscard]] static Weights<T> zeros_like(const Weights<T>& weights) {
    return {Tensor<T, 2>(weights.kernel.extents()), Tensor<T, 1>(weights.bias.extents())};
  }

  /// One token: y_t = conv over (history, x_t); the history shifts by one.
  template <Real T>
  static void step(const Weights<T>& weights, State<T>& state, TensorView<const T, 2> x_t,
                   TensorView<T, 2> y_t) {
    const index_t B = x_t.extent(0), C = x_t.extent(1);
    for (index_t b = 0; b < B; ++b) {
      const T* x = x_t.row(b);
      T* y = y_t.row(b);
      for (index_t c = 0; c < C; ++c) y[c] = weights.bias(c) + weights.kernel(index_t{0}, c) * x[c];
      for (index_t i = 1; i < K; ++i) {
        const T* past = state.history.view().row(b, K - 1 - i);
        for (index_t c = 0; c < C; ++c) y[c] += weights.kernel(i, c) * past[c];
      }
      if constexpr (K > 1) {
        T* history = state.history.view().row(b, index_t{0});
        std::copy(history + C, history + (K - 1) * C, history);
        std::copy_n(x, C, history + (K - 2) * C);
      }
    }
  }

 private:
  template <Real T>
  static void check_states(const MixerStateGradients<State<T>>& states, index_t batch, index_t channels) {
    detail::check_mixer_states(states);
    const std::array<index_t, 3> shape{batch, K - 1, channels};
    if (states.initial)
      detail::check_shape(states.initial->history.view(), "states.initial.mixer.history", shape, "[B, K - 1, C]");
    if (states.d_final)
      detail::check_shape(states.d_final->history.view(), "states.d_final.mixer.history", shape, "[B, K - 1, C]");
    if (states.d_initial) states.d_initial->history = Tensor<T, 3>(shape);
  }

  /// Row x_s of sequence b: from x for s >= 0, from the history for s < 0
  /// (nullptr when it is before the history, i.e. zero).
  template <Real T>
  static const T* input_row(TensorView<const T, 3> x, const State<T>* state, index_t b, index_t s) {
    if (s >= 0) return x.row(b, s);
    if (state == nullptr || -s > K - 1) return nullptr;
    return state->history.view().row(b, K - 1 + s);
  }
};

}  // namespace latte
