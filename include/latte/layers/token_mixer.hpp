#pragma once
// The token-mixer axis of a layer (papers 000 §2.4, 001 §4.1): a causal map
// y = mixer(x) over the model features that feeds the query/key (latent-logit)
// projections, so p(l|t) and p(s|l,t) see more than one token.
//
// A mixer is a policy struct with static hooks over its own weights and state:
//   Weights<T>                  owned by the layer; validate(weights, channels)
//   State<T>                    per sequence: make_state(weights, batch)
//   forward(weights, x, y, state*)  x, y: [B, T, C]; with a state, starts from its
//                                   history and leaves it after the last token
//   step(weights, state, x_t, y_t)  x_t, y_t: [B, C]; O(C) per token
//   backward(weights, x, d_y, d_x, d_weights*[, states])  (optional, for
//                                   training) the gradients of y = forward(x)
//                                   from a zero history, or from states.initial:
//                                   d_x overwritten, d_weights (shaped like
//                                   Weights) accumulated when not null;
//                                   states.d_final's gradient added in and
//                                   states.d_initial written (MixerStateGradients);
//   zeros_like(weights)             with backward: zero weights of those shapes
// Mixers are causal: y_t depends on x_s for s <= t only (also under Bidirectional
// attention, as in the papers' bidirectional models).
#include <concepts>

#include "latte/core/error.hpp"
#include "latte/core/shape_check.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"

namespace latte {

namespace detail {
/// A mixer backward's d_y and d_x: x's shape, d_x sharing no element with x or d_y.
template <Real T>
void check_mixer_gradients(const TensorView<const T, 3>& x, const TensorView<const T, 3>& d_y,
                           const TensorView<T, 3>& d_x) {
  check_shape(d_y, "d_y", x.extents(), "[B, T, C]");
  check_shape(d_x, "d_x", x.extents(), "[B, T, C]");
  check_output(d_x, "d_x", named(x, "x"), named(d_y, "d_y"));
}
}  // namespace detail

template <class M>
concept TokenMixer =
    requires {
      { M::name } -> std::convertible_to<const char*>;
      { M::mixes } -> std::convertible_to<bool>;
      typename M::template Weights<float>;
      typename M::template State<float>;
    } &&
    requires(const typename M::template Weights<float>& weights,
             typename M::template State<float>& state, TensorView<const float, 3> x,
             TensorView<float, 3> y, TensorView<const float, 2> x_t, TensorView<float, 2> y_t,
             index_t count) {
      M::validate(weights, count);
      { M::make_state(weights, count) } -> std::same_as<typename M::template State<float>>;
      M::forward(weights, x, y, &state);
      M::step(weights, state, x_t, y_t);
    };

/// A mixer's states in a backward (training in chunks, as the mechanisms'
/// *StateGradients): the state the forward started from (null: a zero
/// history), the gradient of the state it left (null: zero) and, written when
/// not null, the gradient of the initial state (reshaped to it).
template <class State>
struct MixerStateGradients {
  const State* initial = nullptr;
  const State* d_final = nullptr;
  State* d_initial = nullptr;
};

namespace detail {
/// A mixer backward's d_initial: a state of its own (it is overwritten before the others are read).
template <class State>
void check_mixer_states(const MixerStateGradients<State>& states) {
  require(states.d_initial == nullptr ||
              (states.d_initial != states.initial && states.d_initial != states.d_final),
          "states.d_initial", "must be a state of its own (not initial nor d_final)");
}
}  // namespace detail

/// No mixer: the query/key projections read x itself (y = x, nothing is computed).
struct NoMixer {
  static constexpr const char* name = "no_mixer";
  static constexpr bool mixes = false;
  template <Real T>
  struct Weights {};
  template <Real T>
  struct State {};
  template <Real T>
  static void validate(const Weights<T>&, index_t) {}
  template <Real T>
  [[nodiscard]] static State<T> make_state(const Weights<T>&, index_t) {
    return {};
  }
  template <Real T>
  static void forward(const Weights<T>&, TensorView<const T, 3>, TensorView<T, 3>, State<T>*) {}
  template <Real T>
  static void step(const Weights<T>&, State<T>&, TensorView<const T, 2>, TensorView<T, 2>) {}
  template <Real T>
  static void backward(const Weights<T>&, TensorView<const T, 3>, TensorView<const T, 3>,
                       TensorView<T, 3>, Weights<T>*, const MixerStateGradients<State<T>>& = {}) {}
  template <Real T>
  [[nodiscard]] static Weights<T> zeros_like(const Weights<T>&) {
    return {};
  }
};

}  // namespace latte
