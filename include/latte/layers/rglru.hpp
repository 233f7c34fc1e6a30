#pragma once
// latte::RGLRU — the real-gated linear recurrent unit of Griffin (De et al.,
// 2024) that papers 000 §2.4 / 001 §4.1 put on Latte's latent-logit path
// (DESIGN §3.2), per channel c:
//
//   r_t = sigmoid(x_t W_a + b_a)          recurrence gate
//   i_t = sigmoid(x_t W_x + b_x)          input gate
//   log a_t = -c * r_t * softplus(Lambda)  (c = 8)
//   h_t = a_t * h_{t-1} + sqrt(1 - a_t^2) * (i_t * x_t),   h_{-1} = 0,   y_t = h_t
//
// W_a, W_x are [C, C] (dense; Griffin's block-diagonal gates are the special case
// with zero off-diagonal blocks) applied as row vector times matrix. sqrt(1 - a^2)
// is evaluated as sqrt(-expm1(2 log a)) so that a -> 1 keeps its digits. We follow
// the equations above at every token; Griffin's own code also replaces the
// multiplier by 1 at a document's first token, which a caller gets by resetting the
// state and scaling that token's input.
// The decode state is h (C values per sequence) plus gate scratch, so a step is
// O(C^2) for the gates and O(C) for the recurrence, whatever the context.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <Eigen/Core>

#include "latte/core/checked_size.hpp"
#include "latte/core/error.hpp"
#include "latte/core/shape_check.hpp"
#include "latte/core/tensor.hpp"
#include "latte/core/types.hpp"
#include "latte/layers/token_mixer.hpp"

namespace latte {

struct RGLRU {
  static constexpr const char* name = "rglru";
  static constexpr bool mixes = true;

  template <Real T>
  struct Weights {
    Tensor<T, 2> recurrence_gate;  ///< W_a [C, C]
    Tensor<T, 1> recurrence_bias;  ///< b_a [C]
    Tensor<T, 2> input_gate;       ///< W_x [C, C]
    Tensor<T, 1> input_bias;       ///< b_x [C]
    Tensor<T, 1> lambda;           ///< Lambda [C]: a_t = sigmoid(-Lambda)^(c r_t)
    double c = 8.0;                ///< the constant c of log a_t = -c r_t softplus(Lambda)

    /// Griffin's initialisation from `seed`: a_t at r_t = 1 uniform in [0.9, 0.999],
    /// gate weights N(0, 1/C), zero biases.
    [[nodiscard]] static Weights initial(index_t channels, std::uint64_t seed) {
      detail::check_positive(channels, "channels");
      detail::checked_count<T>("channels", {channels, channels});
      std::mt19937_64 rng(seed);
      std::normal_distribution<double> gate(0.0, 1.0 / std::sqrt(static_cast<double>(channels)));
      std::uniform_real_distribution<double> decay(0.9, 0.999);
      Weights w{Tensor<T, 2>({channels, channels}), Tensor<T, 1>({channels}),
                Tensor<T, 2>({channels, channels}), Tensor<T, 1>({channels}),
                Tensor<T, 1>({channels})};
      for (index_t i = 0; i < w.recurrence_gate.size(); ++i) {
        w.recurrence_gate.data()[i] = static_cast<T>(gate(rng));
        w.input_gate.data()[i] = static_cast<T>(gate(rng));
      }
      // exp(-c softplus(Lambda)) = a  <=>  Lambda = log(expm1(-log(a) / c)).
      for (index_t i = 0; i < channels; ++i)
        w.lambda(i) = static_cast<T>(std::log(std::expm1(-std::log(decay(rng)) / w.c)));
      return w;
    }
  };

  template <Real T>
  struct State {
    Tensor<T, 2> hidden;  ///< h_{t-1} [B, C]
    Tensor<T, 2> gate_r;  ///< step scratch [B, C] (keeps step allocation-free)
    Tensor<T, 2> gate_i;  ///< step scratch [B, C]
    [[nodiscard]] index_t batch() const noexcept { return hidden.extent(0); }
  };

  template <Real T>
  static void validate(const Weights<T>& weights, index_t channels) {
    validate_named(weights, channels, "mixer");
    detail::require(std::isfinite(weights.c) && weights.c > 0, "mixer.c",
                    detail::expected_given("c", "finite and > 0", weights.c));
  }

  template <Real T>
  [[nodiscard]] static State<T> make_state(const Weights<T>& weights, index_t batch) {
    detail::require(batch >= 0, "batch", detail::expected_given("batch", ">= 0", batch));
    const index_t C = weights.lambda.extent(0);
    return {Tensor<T, 2>({batch, C}), Tensor<T, 2>({batch, C}), Tensor<T, 2>({batch, C})};
  }

  /// y = RG-LRU(x) over [B, T, C], starting from `state`'s h (zero without one) and
  /// leaving h_{T-1} there.
  template <Real T>
  static void forward(const Weights<T>& weights, TensorView<const T, 3> x, TensorView<T, 3> y,
                      std::type_identity_t<State<T>>* state) {
    const index_t B = x.extent(0), Tn = x.extent(1), C = x.extent(2);
    if (B == 0 || Tn == 0) return;
    Matrix<T> gate_r(Tn, C), gate_i(Tn, C);
    std::vector<T> hidden(static_cast<std::size_t>(C));
    for (index_t b = 0; b < B; ++b) {
      const ConstRows<T> rows(x.row(b, index_t{0}), Tn, C, Eigen::OuterStride<>(x.stride(1)));
      gates(weights, rows, gate_r, gate_i);
      if (state != nullptr)
        std::copy_n(state->hidden.view().row(b), C, hidden.begin());
      else
        std::fill(hidden.begin(), hidden.end(), T(0));
      for (index_t t = 0; t < Tn; ++t)
        recur(weights, &gate_r(t, 0), &gate_i(t, 0), x.row(b, t), hidden.data(), y.row(b, t), C);
      if (state != nullptr) std::copy(hidden.begin(), hidden.end(), state->hidden.view().row(b));
    }
  }

  /// Gradients of a loss whose gradient with respect to y = forward(x) (from
  /// h_{-1} = 0) is d_y [B, T, C]: d_x overwritten, and when `d_weights` is given
  /// its gate weights, biases and lambda accumulated (+=; c is a constant). The
  /// forward is recomputed (h_t kept, T x C per sequence), then the reverse scan
  /// with g_t = d_y_t + a_{t+1} g_{t+1}:
  ///   dlog a_t = g_t (a_t h_{t-1} - a_t^2 (i_t x_t) / sqrt(1 - a_t^2)),
  ///   d(i_t x_t) = g_t sqrt(1 - a_t^2),  dr_t = -c softplus(Lambda) dlog a_t,
  ///   dLambda += -c r_t sigmoid(Lambda) dlog a_t, and the gates' pre-activations
  ///   through sigmoid' = s (1 - s) into x, W and b (GEMMs).
  /// At a_t = 1 (r_t softplus(Lambda) = 0) sqrt(1 - a^2) has no derivative; a
  /// finite input never gets there. `states` (training in chunks): h_{-1} is
  /// initial's hidden (zero without one), d_final's hidden the gradient of
  /// h_{T-1} (added to g_{T-1}), and d_initial's hidden (overwritten; the gate
  /// scratch zero) the gradient of h_{-1}, a_0 g_0.
  template <Real T>
  static void backward(const Weights<T>& weights, TensorView<const T, 3> x,
                       TensorView<const T, 3> d_y, TensorView<T, 3> d_x,
                       std::type_identity_t<Weights<T>>* d_weights,
                       const MixerStateGradients<State<T>>& states = {}) {
    const index_t B = x.extent(0), Tn = x.extent(1), C = x.extent(2);
    detail::check_mixer_gradients(x, d_y, d_x);
    if (d_weights) validate_named(*d_weights, C, "d_mixer");
    detail::check_mixer_states(states);
    const std::array<index_t, 2> state_shape{B, C};
    if (states.initial)
      detail::check_shape(states.initial->hidden.view(), "states.initial.mixer.hidden", state_shape, "[B, C]");
    if (states.d_final)
      detail::check_shape(states.d_final->hidden.view(), "states.d_final.mixer.hidden", state_shape, "[B, C]");
    if (states.d_initial) {
      *states.d_initial = {Tensor<T, 2>(state_shape), Tensor<T, 2>(state_shape), Tensor<T, 2>(state_shape)};
      if (states.d_final && Tn == 0)  // no token: h_{-1} is h_{T-1}
        states.d_initial->hidden = states.d_final->hidden;
    }
    if (B == 0 || Tn == 0) return;
    Matrix<T> gate_r(Tn, C), gate_i(Tn, C), hidden(Tn, C),
        d_gate_r(Tn, C), d_gate_i(Tn, C);  // the gates' pre-activation gradients
    std::vector<T> carry(static_cast<std::size_t>(C)), h(static_cast<std::size_t>(C));
    const T c_const = static_cast<T>(weights.c);
    const ConstWeight<T> W_a(weights.recurrence_gate.data(), C, C);
    const ConstWeight<T> W_x(weights.input_gate.data(), C, C);
    for (index_t b = 0; b < B; ++b) {
      const ConstRows<T> X(x.row(b, index_t{0}), Tn, C, Eigen::OuterStride<>(x.stride(1)));
      gates(weights, X, gate_r, gate_i);
      if (states.initial) std::copy_n(states.initial->hidden.view().row(b), C, h.begin());
      else std::fill(h.begin(), h.end(), T(0));
      const std::vector<T> h_initial = h;
      for (index_t t = 0; t < Tn; ++t)
        recur(weights, &gate_r(t, 0), &gate_i(t, 0), x.row(b, t), h.data(), &hidden(t, 0), C);
      if (states.d_final) std::copy_n(states.d_final->hidden.view().row(b), C, carry.begin());
      else std::fill(carry.begin(), carry.end(), T(0));
      for (index_t t = Tn; t-- > 0;) {
        const T* xt = x.row(b, t);
        const T* gy = d_y.row(b, t);
        T* dx = d_x.row(b, t);
        for (index_t c = 0; c < C; ++c) {
          const T r = sigmoid(gate_r(t, c)), i = sigmoid(gate_i(t, c));
          const T softplus_lambda = softplus(weights.lambda(c));
          const T log_a = -c_const * r * softplus_lambda;
          const T a = std::exp(log_a);
          const T multiplier = std::sqrt(-std::expm1(T(2) * log_a));
          const T g = gy[c] + carry[static_cast<std::size_t>(c)];
          const T h_before = t > 0 ? hidden(t - 1, c) : h_initial[static_cast<std::size_t>(c)];
          const T input = i * xt[c];
          const T d_log_a = g * (a * h_before - a * a * input / multiplier);
          const T d_input = g * multiplier;
          dx[c] = d_input * i;
          d_gate_i(t, c) = d_input * xt[c] * i * (T(1) - i);
          d_gate_r(t, c) = -c_const * softplus_lambda * d_log_a * r * (T(1) - r);
          if (d_weights)
            d_weights->lambda(c) += -c_const * r * sigmoid(weights.lambda(c)) * d_log_a;
          carry[static_cast<std::size_t>(c)] = a * g;
        }
      }
      if (states.d_initial) std::copy(carry.begin(), carry.end(), states.d_initial->hidden.view().row(b));
      Rows<T> DX(d_x.row(b, index_t{0}), Tn, C, Eigen::OuterStride<>(d_x.stride(1)));
      DX.noalias() += d_gate_r * W_a.transpose();
      DX.noalias() += d_gate_i * W_x.transpose();
      if (!d_weights) continue;
      Eigen::Map<Matrix<T>>(d_weights->recurrence_gate.data(), C, C).noalias() += X.transpose() * d_gate_r;
      Eigen::Map<Matrix<T>>(d_weights->input_gate.data(), C, C).noalias() += X.transpose() * d_gate_i;
      Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>>(d_weights->recurrence_bias.data(), C) +=
          d_gate_r.colwise().sum();
      Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>>(d_weights->input_bias.data(), C) +=
          d_gate_i.colwise().sum();
    }
  }

  /// Zero weights of `weights`' shapes (to accumulate gradients into); c is copied.
  template <Real T>
  [[nodiscard]] static Weights<T> zeros_like(const Weights<T>& weights) {
    return {Tensor<T, 2>(weights.recurrence_gate.extents()), Tensor<T, 1>(weights.recurrence_bias.extents()),
            Tensor<T, 2>(weights.input_gate.extents()),      Tensor<T, 1>(weights.input_bias.extents()),
            Tensor<T, 1>(weights.lambda.extents()),          weights.c};
  }

  /// One token per sequence: x_t, y_t [B, C].
  template <Real T>
  static void step(const Weights<T>& weights, State<T>& state, TensorView<const T, 2> x_t,
                   TensorView<T, 2> y_t) {
    const index_t B = x_t.extent(0), C = x_t.extent(1);
    if (B == 0) return;
    const ConstRows<T> rows(x_t.data(), B, C, Eigen::OuterStride<>(x_t.stride(0)));
    Rows<T> gate_r(state.gate_r.data(), B, C, Eigen::OuterStride<>(C));
    Rows<T> gate_i(state.gate_i.data(), B, C, Eigen::OuterStride<>(C));
    gates(weights, rows, gate_r, gate_i);
    for (index_t b = 0; b < B; ++b)
      recur(weights, &gate_r(b, 0), &gate_i(b, 0), x_t.row(b), state.hidden.view().row(b),
            y_t.row(b), C);
  }

 private:
  template <class T>
  using Matrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  template <class T>
  using Rows = Eigen::Map<Matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
  template <class T>
  using ConstRows = Eigen::Map<const Matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
  template <class T>
  using ConstWeight = Eigen::Map<const Matrix<T>>;

  /// The weights' shapes, named "<prefix>.recurrence_gate", ...
  template <Real T>
  static void validate_named(const Weights<T>& weights, index_t channels, const std::string& prefix) {
    detail::check_shape(weights.recurrence_gate.view(), prefix + ".recurrence_gate",
                        {channels, channels}, "[C, C]");
    detail::check_shape(weights.recurrence_bias.view(), prefix + ".recurrence_bias", {channels}, "[C]");
    detail::check_shape(weights.input_gate.view(), prefix + ".input_gate", {channels, channels},
                        "[C, C]");
    detail::check_shape(weights.input_bias.view(), prefix + ".input_bias", {channels}, "[C]");
    detail::check_shape(weights.lambda.view(), prefix + ".lambda", {channels}, "[C]");
  }

  /// gate_r = x W_a + b_a, gate_i = x W_x + b_x (pre-activation), one GEMM each.
  template <Real T, class In, class Out>
  static void gates(const Weights<T>& weights, const In& x, Out& gate_r, Out& gate_i) {
    const index_t C = weights.lambda.extent(0);
    const ConstWeight<T> W_a(weights.recurrence_gate.data(), C, C);
    const ConstWeight<T> W_x(weights.input_gate.data(), C, C);
    const Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>> b_a(weights.recurrence_bias.data(), C);
    const Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>> b_x(weights.input_bias.data(), C);
    gate_r.noalias() = x * W_a;
    gate_i.noalias() = x * W_x;
    gate_r.rowwise() += b_a;
    gate_i.rowwise() += b_x;
  }

  /// One token of the recurrence for one sequence, from pre-activation gates.
  template <Real T>
  static void recur(const Weights<T>& weights, const T* gate_r, const T* gate_i, const T* x,
                    T* hidden, T* y, index_t C) {
    for (index_t c = 0; c < C; ++c) {
      const T r = sigmoid(gate_r[c]);
      const T i = sigmoid(gate_i[c]);
      const T log_a = -static_cast<T>(weights.c) * r * softplus(weights.lambda(c));
      const T a = std::exp(log_a);
      const T multiplier = std::sqrt(-std::expm1(T(2) * log_a));
      hidden[c] = a * hidden[c] + multiplier * (i * x[c]);
      y[c] = hidden[c];
    }
  }

  template <Real T>
  static T sigmoid(T z) {
    return z >= 0 ? T(1) / (T(1) + std::exp(-z)) : std::exp(z) / (T(1) + std::exp(z));
  }
  /// log(1 + e^z) without overflow for large z.
  template <Real T>
  static T softplus(T z) {
    return z > 0 ? z + std::log1p(std::exp(-z)) : std::log1p(std::exp(z));
  }
};

}  // namespace latte
