#pragma once
// latte::AttentionLayer<Attention, Mixer, Scalar> — what a model author drops in
// place of multi-head attention (DESIGN §2 "Ops vs layers"): it owns the weights,
// projects with Eigen GEMMs and runs one attention mechanism over H heads,
//
//   y = Mixer(x)                                  (papers 000 §2.4 / 001 §4.1; y = x without one)
//   a_i = (from_mixer_i ? y : x) W_i               one projection per mechanism input
//   o = Attention(a_0, a_1, ...)                   [B, T, H, Dv]
//   out = o W_o                                    [B, T, model_dim]
//
// with x, out [B, T, model_dim], W_i [model_dim, H * width_i] and W_o
// [H * Dv, model_dim] (row vector times matrix, as in PyTorch's x @ W.T with
// W.T stored). Which inputs exist, their widths and which read the mixer come
// from LayerInputs<Attention> (layers/layer_inputs.hpp).
//
// Causal layers decode: make_state(batch, ...) holds the mechanism's state, the
// mixer's state and the step's scratch, so prefill (forward with a state) followed
// by steps continues exactly. States are per sequence batch; a const layer may be
// shared by threads.
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <utility>

#include <Eigen/Core>

#include "latte/core/checked_size.hpp"
#include "latte/core/error.hpp"
#include "latte/core/shape_check.hpp"
#include "latte/core/tensor.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/layers/layer_inputs.hpp"
#include "latte/layers/mechanism_parameters.hpp"
#include "latte/layers/token_mixer.hpp"
#include "latte/policies/execution.hpp"

namespace latte {

template <class Attention, TokenMixer Mixer = NoMixer, Real Scalar = float>
class AttentionLayer {
  using Inputs = LayerInputs<Attention>;
  using Parameters = MechanismParameters<Attention>;
  static constexpr std::size_t input_count = Inputs::count;

 public:
  using attention_type = Attention;
  /// The layer has a backward: its mechanism has one (a Gradients type) and so
  /// does its mixer.
  static constexpr bool trainable =
      requires { typename Attention::template Gradients<Scalar>; } &&
      requires(const typename Mixer::template Weights<Scalar>& w, TensorView<const Scalar, 3> x,
               TensorView<Scalar, 3> y, typename Mixer::template Weights<Scalar>* d) {
        Mixer::backward(w, x, x, y, d);
        Mixer::zeros_like(w);
      };
  /// The layer trains in chunks: causal, with a mechanism whose backward takes
  /// states (not softmax: its KV cache needs no gradient).
  static constexpr bool trains_in_chunks =
      trainable && Attention::direction::is_causal &&
      requires { typename Attention::template StateGradients<Scalar>; } &&
      requires(const typename Mixer::template Weights<Scalar>& w, TensorView<const Scalar, 3> x,
               TensorView<Scalar, 3> y, typename Mixer::template Weights<Scalar>* d,
               const MixerStateGradients<typename Mixer::template State<Scalar>>& states) {
        Mixer::backward(w, x, x, y, d, states);  // a mixer without states: whole sequences only
      };
  using mixer_type = Mixer;
  using scalar_type = Scalar;
  /// Row-major weight matrix [in, out].
  using Matrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

  struct Weights {
    /// One per mechanism input, in LayerInputs order: [model_dim, H * width_i].
    std::array<Matrix, input_count> projections;
    /// [H * Dv, model_dim].
    Matrix output;
    typename Mixer::template Weights<Scalar> mixer{};
    /// Gradients only (zero_weights(), backward): of the parameters the
    /// mechanism owns (MechanismParameters<Attention>: LAVO's relative bias and
    /// bases, conv-compression's weights, VAPOR's angles, LeaP modules; an
    /// empty struct for the others). Their values are the mechanism's, not
    /// here: the constructor ignores this member and weights() leaves it empty.
    typename MechanismParameters<Attention>::template Gradients<Scalar> attention{};
  };

  /// Decode state of a causal layer for `batch` sequences.
  struct State {
    typename Attention::template State<Scalar> attention;
    typename Mixer::template State<Scalar> mixer;
    index_t batch = 0;
    // Step scratch, so that a step does not allocate for its activations.
    Tensor<Scalar, 2> mixed;                             ///< y_t [B, model_dim]
    std::array<Tensor<Scalar, 3>, input_count> projected;  ///< a_i [B, H, width_i]
    Tensor<Scalar, 3> attended;                          ///< o_t [B, H, Dv]
  };

  /// A causal layer's states in a backward (training in chunks): the state the
  /// forward started from (null: a fresh one), the gradient of the state it
  /// left (null: zero; a State of this layer holding the mechanism's and the
  /// mixer's gradients, as their own StateGradients say) and, written when not
  /// null, the gradient of the initial state (make it with make_state; it takes
  /// initial's sizes and position).
  struct StateGradients {
    const State* initial = nullptr;
    const State* d_final = nullptr;
    State* d_initial = nullptr;
  };

  AttentionLayer(Attention attention, index_t model_dim, Weights weights)
      : attention_(std::move(attention)), model_dim_(model_dim), weights_(std::move(weights)) {
    detail::check_positive(model_dim, "model_dim");
    const auto inputs = Inputs::inputs(attention_);
    const index_t H = Inputs::heads(attention_);
    for (std::size_t i = 0; i < input_count; ++i)
      check_matrix(weights_.projections[i], "weights.projections[" + std::string(inputs[i].name) + "]",
                   model_dim_, H * inputs[i].width);
    check_matrix(weights_.output, "weights.output", H * Inputs::value_dim(attention_), model_dim_);
    if constexpr (Mixer::mixes) Mixer::validate(weights_.mixer, model_dim_);
  }

  /// Glorot-uniform projections from `seed` (mixer weights passed in): a start
  /// for examples and tests, not a training recipe.
  [[nodiscard]] static Weights random_weights(const Attention& attention, index_t model_dim,
                                              std::uint64_t seed,
                                              typename Mixer::template Weights<Scalar> mixer = {}) {
    detail::check_positive(model_dim, "model_dim");
    std::mt19937_64 rng(seed);
    const auto glorot = [&rng](index_t rows, index_t cols) {
      const double limit = std::sqrt(6.0 / static_cast<double>(rows + cols));
      std::uniform_real_distribution<double> uniform(-limit, limit);
      Matrix m(rows, cols);
      for (index_t i = 0; i < m.size(); ++i) m.data()[i] = static_cast<Scalar>(uniform(rng));
      return m;
    };
    Weights weights;
    const auto inputs = Inputs::inputs(attention);
    const index_t H = Inputs::heads(attention);
    for (std::size_t i = 0; i < input_count; ++i)
      detail::checked_count<Scalar>("model_dim", {model_dim, H, inputs[i].width});
    detail::checked_count<Scalar>("model_dim", {H, Inputs::value_dim(attention), model_dim});
    for (std::size_t i = 0; i < input_count; ++i)
      weights.projections[i] = glorot(model_dim, H * inputs[i].width);
    weights.output = glorot(H * Inputs::value_dim(attention), model_dim);
    weights.mixer = std::move(mixer);
    return weights;
  }

  [[nodiscard]] const Attention& attention() const noexcept { return attention_; }
  [[nodiscard]] const Weights& weights() const noexcept { return weights_; }
  [[nodiscard]] index_t model_dim() const noexcept { return model_dim_; }
  /// The mechanism's inputs this layer projects, in order.
  [[nodiscard]] std::array<LayerInput, input_count> inputs() const { return Inputs::inputs(attention_); }

  // ------------------------------------------------------------ forward --

  /// out = layer(x) over whole sequences; x, out [B, T, model_dim]. B = 0 or T = 0 is a no-op.
  template <exec::Policy E>
  void forward(E e, TensorView<const Scalar, 3> x, TensorView<Scalar, 3> out) const {
    static_assert(host_backend<E>, "layers hold their weights in host memory; exec::cuda layers are not implemented");
    validate_sequence(x, out);
    run(e, x, out, nullptr);
  }

  /// Prefill: as above, starting from `state` and leaving it after the last token.
  template <exec::Policy E>
    requires Attention::direction::is_causal
  void forward(E e, TensorView<const Scalar, 3> x, TensorView<Scalar, 3> out, State& state) const {
    static_assert(host_backend<E>, "layers hold their weights in host memory; exec::cuda layers are not implemented");
    validate_sequence(x, out);
    validate_state(state, x.extent(0));
    // All or nothing: the mechanism checks its own state inside its forward; if it
    // refuses, the mixer's state must not have advanced either.
    auto mixer_before = state.mixer;
    try {
      run(e, x, out, &state);
    } catch (...) {
      state.mixer = std::move(mixer_before);
      throw;
    }
  }

  /// Decode state for `batch` sequences; `args` go to the mechanism's make_state
  /// (e.g. the first position, or a KV-cache / context capacity).
  template <class... Args>
    requires Attention::direction::is_causal
  [[nodiscard]] State make_state(index_t batch, Args&&... args) const {
    detail::require(batch >= 0, "batch", detail::expected_given("batch", ">= 0", batch));
    const auto inputs = Inputs::inputs(attention_);
    const index_t H = Inputs::heads(attention_);
    State state{attention_.template make_state<Scalar>(batch, std::forward<Args>(args)...),
                Mixer::make_state(weights_.mixer, batch),
                batch,
                Tensor<Scalar, 2>({batch, Mixer::mixes ? model_dim_ : 0}),
                {},
                Tensor<Scalar, 3>({batch, H, Inputs::value_dim(attention_)})};
    for (std::size_t i = 0; i < input_count; ++i)
      state.projected[i] = Tensor<Scalar, 3>({batch, H, inputs[i].width});
    return state;
  }

  /// One token per sequence: x_t, out_t [B, model_dim].
  template <exec::Policy E>
    requires Attention::direction::is_causal
  void step(E e, State& state, TensorView<const Scalar, 2> x_t, TensorView<Scalar, 2> out_t) const {
    static_assert(host_backend<E>, "layers hold their weights in host memory; exec::cuda layers are not implemented");
    validate_state(state, state.batch);
    detail::check_shape(x_t, "x_t", {state.batch, model_dim_}, "[B, model_dim]");
    detail::check_shape(out_t, "out_t", {state.batch, model_dim_}, "[B, model_dim]");
    detail::check_output(out_t, "out_t", detail::named(x_t, "x_t"));
    if (state.batch == 0) return;
    const index_t B = state.batch;
    const auto inputs = Inputs::inputs(attention_);
    const ConstRows x(x_t.data(), B, model_dim_, Eigen::OuterStride<>(x_t.stride(0)));
    const ConstRows y(state.mixed.data(), B, model_dim_, Eigen::OuterStride<>(model_dim_));
    // The mechanism's step validates its state before touching it; mixing first
    // would advance the mixer on a refused call, so keep a copy like forward does.
    auto mixer_before = state.mixer;
    try {
      if constexpr (Mixer::mixes) Mixer::step(weights_.mixer, state.mixer, x_t, state.mixed.view());
      for (std::size_t i = 0; i < input_count; ++i) {
        Tensor<Scalar, 3>& a = state.projected[i];
        Rows rows(a.data(), B, a.extent(1) * a.extent(2), Eigen::OuterStride<>(a.extent(1) * a.extent(2)));
        if (Mixer::mixes && inputs[i].from_mixer)
          rows.noalias() = y * weights_.projections[i];
        else
          rows.noalias() = x * weights_.projections[i];
      }
      call_step(e, state, std::make_index_sequence<input_count>{});
    } catch (...) {
      state.mixer = std::move(mixer_before);
      throw;
    }
    Rows out(out_t.data(), B, model_dim_, Eigen::OuterStride<>(out_t.stride(0)));
    const index_t width = state.attended.extent(1) * state.attended.extent(2);
    out.noalias() = ConstRows(state.attended.data(), B, width, Eigen::OuterStride<>(width)) *
                    weights_.output;
  }

  // ----------------------------------------------------------- backward --

  /// Zero weights of this layer's shapes, to accumulate gradients into.
  [[nodiscard]] Weights zero_weights() const
    requires trainable
  {
    Weights zeros;
    for (std::size_t i = 0; i < input_count; ++i)
      zeros.projections[i] = Matrix::Zero(weights_.projections[i].rows(), weights_.projections[i].cols());
    zeros.output = Matrix::Zero(weights_.output.rows(), weights_.output.cols());
    zeros.mixer = Mixer::zeros_like(weights_.mixer);
    zeros.attention = Parameters::template zeros<Scalar>(attention_);
    return zeros;
  }

  /// Gradients of a loss whose gradient with respect to out = forward(x) is
  /// d_out [B, T, model_dim], over whole sequences: d_x overwritten and, when
  /// `d_weights` is given (make it with zero_weights()), every weight's
  /// gradient accumulated into it (+=): projections, output, mixer, and in
  /// d_weights->attention the parameters the mechanism owns (LAVO's relative
  /// bias and bases, conv-compression's weights, VAPOR's angles, LeaP
  /// modules; a field left empty is skipped). The forward is recomputed (mix,
  /// project, attend), then the output projection, the mechanism's backward,
  /// the projections and the mixer run backwards. To apply an update to the
  /// mechanism's parameters, rebuild it from them and the layer from it
  /// (docs/backward.md "Layers and token mixers").
  /// Extra memory: the activations of one forward and their gradients.
  template <exec::Policy E>
    requires trainable
  void backward(E e, TensorView<const Scalar, 3> x, TensorView<const Scalar, 3> d_out,
                TensorView<Scalar, 3> d_x, Weights* d_weights = nullptr) const {
    run_backward(e, x, d_out, d_x, d_weights, nullptr);
  }

  /// The same for a forward that continued from `states.initial` (training in
  /// chunks): also writes the gradient of the initial state into
  /// `states.d_initial` (the mechanism's and the mixer's), given the gradient of
  /// the state the forward left. Backward over chunks chained through these
  /// equals the backward over the whole sequence.
  template <exec::Policy E>
    requires trains_in_chunks
  void backward(E e, TensorView<const Scalar, 3> x, TensorView<const Scalar, 3> d_out,
                TensorView<Scalar, 3> d_x, Weights* d_weights, const StateGradients& states) const {
    run_backward(e, x, d_out, d_x, d_weights, &states);
  }

 private:
  template <exec::Policy E>
  void run_backward(E e, TensorView<const Scalar, 3> x, TensorView<const Scalar, 3> d_out,
                    TensorView<Scalar, 3> d_x, Weights* d_weights, const StateGradients* states) const {
    static_assert(host_backend<E>, "layers hold their weights in host memory; exec::cuda layers are not implemented");
    validate_backward(x, d_out, d_x, d_weights);
    const index_t B = x.extent(0), Tn = x.extent(1), H = Inputs::heads(attention_);
    if (states) validate_state_gradients(*states, B);
    if (B == 0 || (Tn == 0 && states == nullptr)) return;
    check_workspace(B, Tn);
    const auto inputs = Inputs::inputs(attention_);
    const index_t Dv = Inputs::value_dim(attention_);
    // The forward again, from a copy of the initial state when there is one.
    std::optional<State> replay;
    if (states && states->initial) replay.emplace(*states->initial);
    State* from = replay ? &*replay : nullptr;
    if (states && states->d_initial && states->initial) *states->d_initial = *states->initial;
    Tensor<Scalar, 3> mixed;
    std::array<Tensor<Scalar, 4>, input_count> projected, d_projected;
    project(x, mixed, projected, from);
    Tensor<Scalar, 4> attended({B, Tn, H, Dv}), d_attended({B, Tn, H, Dv});
    call_forward(e, projected, attended, from, std::make_index_sequence<input_count>{});
    for (index_t b = 0; b < B; ++b) {  // out = o W_o: d_o = d_out W_o^T, dW_o += o^T d_out
      const ConstRows g(d_out.row(b, index_t{0}), Tn, model_dim_, Eigen::OuterStride<>(d_out.stride(1)));
      Rows(d_attended.view().row(b, index_t{0}, index_t{0}), Tn, H * Dv, Eigen::OuterStride<>(H * Dv))
          .noalias() = g * weights_.output.transpose();
      if (d_weights)
        d_weights->output.noalias() +=
            ConstRows(attended.view().row(b, index_t{0}, index_t{0}), Tn, H * Dv,
                      Eigen::OuterStride<>(H * Dv)).transpose() * g;
    }
    for (std::size_t i = 0; i < input_count; ++i)
      d_projected[i] = Tensor<Scalar, 4>(projected[i].extents());
    call_backward(e, projected, d_attended, d_projected, d_weights, states,
                  std::make_index_sequence<input_count>{});
    // a_i = src_i W_i: d_src_i += d_a_i W_i^T, dW_i += src_i^T d_a_i.
    Tensor<Scalar, 3> d_mixed({B, Mixer::mixes ? Tn : 0, Mixer::mixes ? model_dim_ : 0});
    for (index_t b = 0; b < B; ++b)
      Rows(d_x.row(b, index_t{0}), Tn, model_dim_, Eigen::OuterStride<>(d_x.stride(1))).setZero();
    for (std::size_t i = 0; i < input_count; ++i) {
      const bool from_mixer = Mixer::mixes && inputs[i].from_mixer;
      const index_t width = H * inputs[i].width;
      for (index_t b = 0; b < B; ++b) {
        const ConstRows da(d_projected[i].view().row(b, index_t{0}, index_t{0}), Tn, width,
                           Eigen::OuterStride<>(width));
        const ConstRows source =
            from_mixer ? ConstRows(mixed.view().row(b, index_t{0}), Tn, model_dim_,
                                   Eigen::OuterStride<>(model_dim_))
                       : ConstRows(x.row(b, index_t{0}), Tn, model_dim_, Eigen::OuterStride<>(x.stride(1)));
        Rows into = from_mixer ? Rows(d_mixed.view().row(b, index_t{0}), Tn, model_dim_,
                                      Eigen::OuterStride<>(model_dim_))
                               : Rows(d_x.row(b, index_t{0}), Tn, model_dim_,
                                      Eigen::OuterStride<>(d_x.stride(1)));
        into.noalias() += da * weights_.projections[i].transpose();
        if (d_weights) d_weights->projections[i].noalias() += source.transpose() * da;
      }
    }
    if constexpr (Mixer::mixes) {  // y = mixer(x): d_x += the mixer's backward of d_y
      Tensor<Scalar, 3> d_x_mixer({B, Tn, model_dim_});
      bool done = false;
      if constexpr (trains_in_chunks) {
        if (states) {
          using MixerState = typename Mixer::template State<Scalar>;
          const MixerStateGradients<MixerState> mixer_states{
              states->initial ? &states->initial->mixer : nullptr,
              states->d_final ? &states->d_final->mixer : nullptr,
              states->d_initial ? &states->d_initial->mixer : nullptr};
          Mixer::backward(weights_.mixer, x, d_mixed.cview(), d_x_mixer.view(),
                          d_weights ? &d_weights->mixer : nullptr, mixer_states);
          done = true;
        }
      }
      if (!done)
        Mixer::backward(weights_.mixer, x, d_mixed.cview(), d_x_mixer.view(),
                        d_weights ? &d_weights->mixer : nullptr);
      for (index_t b = 0; b < B; ++b)
        Rows(d_x.row(b, index_t{0}), Tn, model_dim_, Eigen::OuterStride<>(d_x.stride(1))) +=
            ConstRows(d_x_mixer.view().row(b, index_t{0}), Tn, model_dim_,
                      Eigen::OuterStride<>(model_dim_));
    }
  }

 public:
  // Tag-less overloads run the mechanism's default backend (exec::cpu where it has one).
  void forward(TensorView<const Scalar, 3> x, TensorView<Scalar, 3> out) const {
    forward(default_exec{}, x, out);
  }
  void forward(TensorView<const Scalar, 3> x, TensorView<Scalar, 3> out, State& state) const
    requires Attention::direction::is_causal
  {
    forward(default_exec{}, x, out, state);
  }
  void step(State& state, TensorView<const Scalar, 2> x_t, TensorView<Scalar, 2> out_t) const
    requires Attention::direction::is_causal
  {
    step(default_exec{}, state, x_t, out_t);
  }
  void backward(TensorView<const Scalar, 3> x, TensorView<const Scalar, 3> d_out,
                TensorView<Scalar, 3> d_x, Weights* d_weights = nullptr) const
    requires trainable
  {
    backward(default_exec{}, x, d_out, d_x, d_weights);
  }

 private:
  template <class E>
  static constexpr bool host_backend = !std::is_same_v<E, exec::cuda_t>;
  using default_exec = typename Inputs::default_exec;
  using Rows = Eigen::Map<Matrix, Eigen::Unaligned, Eigen::OuterStride<>>;
  using ConstRows = Eigen::Map<const Matrix, Eigen::Unaligned, Eigen::OuterStride<>>;

  static void check_matrix(const Matrix& m, const std::string& argument, index_t rows,
                           index_t cols) {
    if (m.rows() == rows && m.cols() == cols) return;
    throw Error(argument, detail::expected_given("shape [in, out]",
                                                 format_extents(std::array<index_t, 2>{rows, cols}),
                                                 format_extents(std::array<index_t, 2>{
                                                     static_cast<index_t>(m.rows()),
                                                     static_cast<index_t>(m.cols())})));
  }

  void validate_sequence(const TensorView<const Scalar, 3>& x, const TensorView<Scalar, 3>& out) const {
    check_view(x, "x");
    if (x.extent(2) != model_dim_)  // the message only on failure: validating allocates nothing
      throw Error("x", detail::expected_given("shape [B, T, model_dim]",
                                              format_extents(std::array<index_t, 3>{
                                                  x.extent(0), x.extent(1), model_dim_}),
                                              format_extents(x.extents())));
    detail::check_shape(out, "out", x.extents(), "[B, T, model_dim]");
    detail::check_output(out, "out", detail::named(x, "x"));
  }

  void validate_state(const State& state, index_t batch) const {
    detail::require(state.batch == batch, "state",
                    detail::expected_given("batch", batch, state.batch));
    const auto inputs = Inputs::inputs(attention_);
    const index_t H = Inputs::heads(attention_);
    bool scratch_ok = state.attended.extents() == std::array<index_t, 3>{batch, H, Inputs::value_dim(attention_)} &&
                      state.mixed.extents() == std::array<index_t, 2>{batch, Mixer::mixes ? model_dim_ : 0};
    for (std::size_t i = 0; i < input_count; ++i)
      scratch_ok = scratch_ok &&
                   state.projected[i].extents() == std::array<index_t, 3>{batch, H, inputs[i].width};
    detail::require(scratch_ok, "state",
                    "was not made by this layer's make_state (its scratch has other shapes)");
    if constexpr (requires { state.mixer.batch(); })
      detail::require(state.mixer.batch() == batch, "state",
                      detail::expected_given("mixer state batch", batch, state.mixer.batch()));
  }

  /// The shared body of forward: mix, project, attend, project out.
  template <exec::Policy E>
  void run(E e, TensorView<const Scalar, 3> x, TensorView<Scalar, 3> out, State* state) const {
    const index_t B = x.extent(0), Tn = x.extent(1), H = Inputs::heads(attention_);
    if (B == 0 || Tn == 0) return;
    check_workspace(B, Tn);
    Tensor<Scalar, 3> mixed;
    std::array<Tensor<Scalar, 4>, input_count> projected;
    project(x, mixed, projected, state);
    const index_t Dv = Inputs::value_dim(attention_);
    Tensor<Scalar, 4> attended({B, Tn, H, Dv});
    call_forward(e, projected, attended, state, std::make_index_sequence<input_count>{});
    for (index_t b = 0; b < B; ++b) {
      Rows rows(out.row(b, index_t{0}), Tn, model_dim_, Eigen::OuterStride<>(out.stride(1)));
      rows.noalias() = ConstRows(attended.view().row(b, index_t{0}, index_t{0}), Tn, H * Dv,
                                 Eigen::OuterStride<>(H * Dv)) *
                       weights_.output;
    }
  }

  /// The activations a forward or backward allocates, before any is.
  void check_workspace(index_t B, index_t Tn) const {
    const auto inputs = Inputs::inputs(attention_);
    const index_t H = Inputs::heads(attention_);
    for (std::size_t i = 0; i < input_count; ++i)
      detail::checked_count<Scalar>("x", {B, Tn, H, inputs[i].width});
    detail::checked_count<Scalar>("x", {B, Tn, H, Inputs::value_dim(attention_)});
  }

  /// y = mixer(x) (advancing the mixer's state when given) and a_i = src_i W_i.
  void project(const TensorView<const Scalar, 3>& x, Tensor<Scalar, 3>& mixed,
               std::array<Tensor<Scalar, 4>, input_count>& projected, State* state) const {
    const index_t B = x.extent(0), Tn = x.extent(1), H = Inputs::heads(attention_);
    const auto inputs = Inputs::inputs(attention_);
    mixed = Tensor<Scalar, 3>({B, Mixer::mixes ? Tn : 0, Mixer::mixes ? model_dim_ : 0});
    if constexpr (Mixer::mixes)
      Mixer::forward(weights_.mixer, x, mixed.view(), state != nullptr ? &state->mixer : nullptr);
    for (std::size_t i = 0; i < input_count; ++i) {
      const bool from_mixer = Mixer::mixes && inputs[i].from_mixer;
      projected[i] = Tensor<Scalar, 4>({B, Tn, H, inputs[i].width});
      const index_t width = H * inputs[i].width;
      for (index_t b = 0; b < B; ++b) {
        Rows rows(projected[i].view().row(b, index_t{0}, index_t{0}), Tn, width,
                  Eigen::OuterStride<>(width));
        if (from_mixer)
          rows.noalias() = ConstRows(mixed.view().row(b, index_t{0}), Tn, model_dim_,
                                     Eigen::OuterStride<>(model_dim_)) *
                           weights_.projections[i];
        else
          rows.noalias() = ConstRows(x.row(b, index_t{0}), Tn, model_dim_,
                                     Eigen::OuterStride<>(x.stride(1))) *
                           weights_.projections[i];
      }
    }
  }

  template <exec::Policy E, std::size_t... I>
  void call_backward(E e, const std::array<Tensor<Scalar, 4>, input_count>& projected,
                     const Tensor<Scalar, 4>& d_attended,
                     std::array<Tensor<Scalar, 4>, input_count>& d_projected, Weights* d_weights,
                     const StateGradients* states, std::index_sequence<I...>) const {
    typename Attention::template Gradients<Scalar> gradients{d_projected[I].view()...};
    if (d_weights) Parameters::template attach<Scalar>(d_weights->attention, gradients);
    if constexpr (trains_in_chunks) {
      if (states) {
        const typename Attention::template StateGradients<Scalar> attention_states{
            states->initial ? &states->initial->attention : nullptr,
            states->d_final ? &states->d_final->attention : nullptr,
            states->d_initial ? &states->d_initial->attention : nullptr};
        attention_.backward(e, projected[I].cview()..., d_attended.cview(), gradients, attention_states);
        return;
      }
    }
    attention_.backward(e, projected[I].cview()..., d_attended.cview(), gradients);
  }

  /// A backward's states: each a state of this layer for `batch` sequences,
  /// d_initial one of its own (the mechanism checks its part's kind and sizes).
  void validate_state_gradients(const StateGradients& states, index_t batch) const {
    const std::pair<const State*, const char*> given[] = {{states.initial, "states.initial"},
                                                          {states.d_final, "states.d_final"}};
    for (const auto& [state, name] : given) {
      if (state == nullptr) continue;
      try {
        validate_state(*state, batch);
      } catch (const Error& error) {
        throw detail::renamed(error, name);
      }
    }
    detail::require(states.d_initial == nullptr ||
                         (states.d_initial != states.initial && states.d_initial != states.d_final),
                     "states.d_initial", "must be a state of its own (not initial nor d_final)");
    if (states.d_initial && !states.initial) {
      try {
        validate_state(*states.d_initial, batch);
      } catch (const Error& error) {
        throw detail::renamed(error, "states.d_initial");
      }
    }
  }

  void validate_backward(const TensorView<const Scalar, 3>& x, const TensorView<const Scalar, 3>& d_out,
                         const TensorView<Scalar, 3>& d_x, const Weights* d_weights) const {
    check_view(x, "x");
    if (x.extent(2) != model_dim_)
      throw Error("x", detail::expected_given("shape [B, T, model_dim]",
                                              format_extents(std::array<index_t, 3>{
                                                  x.extent(0), x.extent(1), model_dim_}),
                                              format_extents(x.extents())));
    detail::check_shape(d_out, "d_out", x.extents(), "[B, T, model_dim]");
    detail::check_shape(d_x, "d_x", x.extents(), "[B, T, model_dim]");
    detail::check_output(d_x, "d_x", detail::named(x, "x"), detail::named(d_out, "d_out"));
    if (!d_weights) return;
    const auto inputs = Inputs::inputs(attention_);
    const index_t H = Inputs::heads(attention_);
    for (std::size_t i = 0; i < input_count; ++i)
      check_matrix(d_weights->projections[i],
                   "d_weights.projections[" + std::string(inputs[i].name) + "]", model_dim_,
                   H * inputs[i].width);
    check_matrix(d_weights->output, "d_weights.output", H * Inputs::value_dim(attention_), model_dim_);
    if constexpr (Mixer::mixes) {
      try {  // the mixer names its weights "mixer.<name>": here they are d_weights.mixer's
        Mixer::validate(d_weights->mixer, model_dim_);
      } catch (const Error& error) {
        throw detail::renamed(error, "d_weights." + error.argument());
      }
    }
    Parameters::template validate<Scalar>(d_weights->attention, attention_, "d_weights.attention");
  }

  template <exec::Policy E, std::size_t... I>
  void call_forward(E e, const std::array<Tensor<Scalar, 4>, input_count>& projected,
                    Tensor<Scalar, 4>& attended, State* state, std::index_sequence<I...>) const {
    if constexpr (Attention::direction::is_causal) {
      if (state != nullptr) {
        attention_.forward(e, projected[I].cview()..., attended.view(), state->attention);
        return;
      }
    }
    attention_.forward(e, projected[I].cview()..., attended.view());
  }

  template <exec::Policy E, std::size_t... I>
  void call_step(E e, State& state, std::index_sequence<I...>) const {
    attention_.step(e, state.attention, state.projected[I].cview()..., state.attended.view());
  }

  Attention attention_;
  index_t model_dim_;
  Weights weights_;
};

}  // namespace latte
