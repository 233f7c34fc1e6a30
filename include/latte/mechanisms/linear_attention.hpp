#pragma once
// latte::LinearAttention<Direction, FeatureMap, Reweight, Positional> — the
// linear-attention family (paper 001 §3.1 eq. 4; paper 004):
//
//   o_t = sum_s w_ts v_s / N(sum_s w'_ts)   over s <= t (Causal) or all s,
//   w_ts = phi(q_t) . R^{s-t} phi(k_s) * cos(pi/2 (P_q,t - P_k,s))
//
// with the feature map phi (policies/feature_map.hpp), optional cosine
// re-weighting with proportions P from positions (cosFormer) or learned LeaP
// modules (policies/reweight.hpp), optional RoPE rotations R on phi(q), phi(k)
// (paper 004 App. A.6) and the normaliser N (policies/normaliser.hpp).
// O(T * E * Dv) time; causal decode keeps S = sum_s e(k_s) v_s^T and
// z = sum_s e'(k_s) per head (LinearState<T>), independent of the context.
//
// Inputs are already projected: queries and keys [B, T, H, Dk], values
// [B, T, H, Dv]; the output is [B, T, H, Dv]. Bidirectional attentions also
// offer cross_forward over a separate source sequence [B, S, H, *].
//
//   latte::LinearAttention<latte::Causal, latte::EluPlusOne> attention({.heads = 8,
//       .key_dim = 64, .value_dim = 64});
//   attention.forward(latte::exec::cpu, q, k, v, out.view());  // or exec::reference
//
// backward(exec, q, k, v, d_out, gradients[, state_gradients]) and
// cross_backward give the gradients of a loss with respect to the inputs
// (and LeaP's proportions or module weights) from its gradient d_out; they
// keep nothing from the forward (docs/backward.md).
//
// Every call also exists without the execution tag, running on exec::default_t
// (exec::cpu).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "latte/backends/cpu/linear.hpp"
#include "latte/backends/reference/linear.hpp"
#include "latte/core/checked_size.hpp"
#include "latte/core/shape_check.hpp"
#include "latte/core/state_storage.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/mechanisms/linear_gradients.hpp"
#include "latte/mechanisms/linear_state.hpp"
#include "latte/policies/direction.hpp"
#include "latte/policies/execution.hpp"
#include "latte/policies/feature_map.hpp"
#include "latte/policies/normaliser.hpp"
#include "latte/policies/positional.hpp"
#include "latte/policies/reweight.hpp"
#include "latte/policies/summation.hpp"

namespace latte {

/// Sizes fixed by a linear-attention layer's weights.
struct LinearDims {
  index_t heads = 0;
  index_t key_dim = 0;    ///< Dk: query/key features per head (before phi)
  index_t value_dim = 0;  ///< Dv: value features per head
};

/// Runtime parameters of a linear attention.
template <Reweight Rw, Positional Pos>
struct LinearOptions {
  /// Default: the paper's own (additive 1e-6; cosFormer clamp_min 1e-6; LeaP clamp_min 0.1).
  Normaliser normaliser = Rw::default_normaliser();
  /// cosFormer: {.length = M}; LeaP: {.query_module, .key_module, .leap_factor}.
  typename Rw::Params reweight = {};
  /// RoPE: angles [H, F/2] (default: RoPE schedule base^(-2i/F), base 10000).
  typename Pos::Params positional = {};
  /// Under RoPE: normalise by the un-rotated (default) or the rotated scores.
  RopeDenominator rope_denominator = RopeDenominator::unrotated;
};

template <Direction Dir, FeatureMap Map, Reweight Rw = NoReweight, Positional Pos = NoPositional,
          Summation Sum = CompensatedSums>
class LinearAttention {
  static_assert(!Pos::rotates_values,
                "VAPOR rotates values; linear attention takes NoPositional or RoPE");

 public:
  using direction = Dir;
  using feature_map = Map;
  using reweight = Rw;
  using positional = Pos;
  using summation = Sum;
  using Options = LinearOptions<Rw, Pos>;
  template <Real T>
  using State = LinearState<T>;
  /// What backward writes (its first members: the inputs' gradients, in call order).
  template <Real T>
  using Gradients = LinearGradients<T>;
  /// A causal backward's states (training in chunks).
  template <Real T>
  using StateGradients = LinearStateGradients<T>;
  template <Real T>
  using InputView = std::type_identity_t<TensorView<const T, 4>>;
  template <Real T>
  using StepInputView = std::type_identity_t<TensorView<const T, 3>>;
  template <Real T>
  using Proportions = std::type_identity_t<SequenceProportions<T>>;
  template <Real T>
  using StepProportionViews = std::type_identity_t<StepProportions<T>>;

  static constexpr bool learned_proportions = Rw::source == ProportionSource::learned;
  static constexpr bool position_proportions = Rw::source == ProportionSource::position;

  explicit LinearAttention(LinearDims dims, Options options = {})
      : dims_(dims), options_(std::move(options)) {
    detail::check_positive(dims.heads, "dims.heads");
    detail::check_positive(dims.key_dim, "dims.key_dim");
    detail::check_positive(dims.value_dim, "dims.value_dim");
    feature_dim_ = detail::feature_dim_of<Map>(dims.key_dim);
    detail::require(feature_dim_ >= 1, "feature_map",
                    detail::expected_given(std::string(Map::name) + " feature_dim(Dk)", ">= 1",
                                           feature_dim_));
    // One sequence's state (memory [E x Dv] and normaliser [E] per head).
    detail::checked_count<double>("dims", {dims.heads, carry_size()});
    options_.normaliser.validate();
    if constexpr (position_proportions) {
      if (options_.reweight.length)
        detail::require(*options_.reweight.length >= 1, "length",
                        detail::expected_given("cosFormer length M", ">= 1",
                                               *options_.reweight.length));
    }
    if constexpr (learned_proportions) validate_leap();
    angles_ = Pos::resolve_angles(options_.positional, dims.heads, feature_dim_);
    detail::require(Pos::rotates_queries_keys ||
                        options_.rope_denominator == RopeDenominator::unrotated,
                    "rope_denominator",
                    detail::expected_given(std::string("denominator without RoPE (positional ") +
                                               Pos::name + ")",
                                           "unrotated", name_of(options_.rope_denominator)));
  }

  [[nodiscard]] const LinearDims& dims() const noexcept { return dims_; }
  [[nodiscard]] const Options& options() const noexcept { return options_; }
  /// F: features of phi(x) per head.
  [[nodiscard]] index_t feature_dim() const noexcept { return feature_dim_; }
  /// E = streams * F: size of the expanded features the state is made of.
  [[nodiscard]] index_t expanded_dim() const noexcept { return Rw::streams * feature_dim_; }

  /// "LinearAttention<causal,relu,cosformer,no_positional>/float32".
  template <Real T>
  [[nodiscard]] static std::string kind() {
    return std::string("LinearAttention<") + Dir::name + "," + Map::name + "," + Rw::name + "," +
           Pos::name + (Sum::compensated ? "" : std::string(",") + Sum::name) + ">/" +
           dtype_name<T>();
  }

  // ------------------------------------------------------------ forward --

  /// Whole-sequence self-attention. T = 0 (or B = 0) is a no-op.
  template <exec::Policy E, Real T>
  void forward(E, InputView<T> queries, InputView<T> keys, InputView<T> values,
               TensorView<T, 4> out) const {
    require_implemented<E>();
    validate_sequence(queries, keys, values, out);
    run_forward<E, T>(queries, keys, values, out, nullptr, nullptr);
  }

  /// As above, with precomputed proportions P_q, P_k [B, T, H] in [0, 1] (LeaP).
  template <exec::Policy E, Real T>
    requires(learned_proportions)
  void forward(E, InputView<T> queries, InputView<T> keys, InputView<T> values,
               Proportions<T> proportions, TensorView<T, 4> out) const {
    require_implemented<E>();
    validate_sequence(queries, keys, values, out);
    validate_proportions(proportions, queries.extent(1), keys.extent(1), out);
    run_forward<E, T>(queries, keys, values, out, &proportions, nullptr);
  }

  /// Cross-attention: queries [B, T, H, Dk] over a source of keys [B, S, H, Dk]
  /// and values [B, S, H, Dv], every source token visible (S may differ from T).
  template <exec::Policy E, Real T>
    requires(!Dir::is_causal)
  void cross_forward(E, InputView<T> queries, InputView<T> keys, InputView<T> values,
                     TensorView<T, 4> out) const {
    require_implemented<E>();
    validate_cross(queries, keys, values, out);
    run_bidirectional<E, T>(queries, keys, values, out, nullptr);
  }

  /// Cross-attention with precomputed proportions P_q [B, T, H] and P_k [B, S, H] (LeaP).
  template <exec::Policy E, Real T>
    requires(!Dir::is_causal && learned_proportions)
  void cross_forward(E, InputView<T> queries, InputView<T> keys, InputView<T> values,
                     Proportions<T> proportions, TensorView<T, 4> out) const {
    require_implemented<E>();
    validate_cross(queries, keys, values, out);
    validate_proportions(proportions, queries.extent(1), keys.extent(1), out);
    run_bidirectional<E, T>(queries, keys, values, out, &proportions);
  }

  // ------------------------------------------------------------- decode --

  /// A fresh decode state for `batch` sequences whose first token sits at
  /// absolute position `first_position` (RoPE and cosFormer use positions).
  /// cosFormer needs Options::reweight.length (M) for decode.
  template <Real T>
    requires(Dir::is_causal)
  [[nodiscard]] State<T> make_state(index_t batch, std::int64_t first_position = 0) const {
    detail::check_positive(batch, "batch");
    detail::require(first_position >= 0, "first_position",
                    detail::expected_given("value", ">= 0", first_position));
    if constexpr (position_proportions) {
      detail::require(options_.reweight.length.has_value(), "length",
                      "cosFormer decode needs the length M (Options::reweight.length): expected "
                      "M >= every position + 1 the state will reach, given none");
      // M itself: the state after the M-th token, which takes no more (a backward's final
      // state gradient sits there); each call then checks position + tokens <= M.
      detail::require(first_position <= *options_.reweight.length, "first_position",
                      detail::expected_given("first position for cosFormer length M = " +
                                                 std::to_string(*options_.reweight.length),
                                             "<= " + std::to_string(*options_.reweight.length),
                                             first_position));
    }
    return State<T>(kind<T>(), sizes_for(batch), first_position);
  }

  /// Restores a state saved with State::save() by an attention of this type
  /// and configuration. The buffer is checked whole before a state is allocated.
  template <Real T>
    requires(Dir::is_causal)
  [[nodiscard]] State<T> load_state(std::span<const std::byte> bytes) const {
    const auto header = StateStorage<T>::read_header(bytes, kind<T>());
    const index_t batch = StateStorage<T>::saved_batch(
        header, bytes, sizes_for(1), [&](index_t b) { return State<T>::fields_for(sizes_for(b)); });
    const auto sizes = sizes_for(batch);
    StateStorage<T>::require_layout(header, sizes, State<T>::fields_for(sizes));
    State<T> state = make_state<T>(batch);
    state.restore(bytes);
    return state;
  }

  /// Forward that continues from `state` and leaves it at the end of the
  /// sequence, so prefill + step continues exactly.
  template <exec::Policy E, Real T>
    requires(Dir::is_causal)
  void forward(E, InputView<T> queries, InputView<T> keys, InputView<T> values,
               TensorView<T, 4> out, State<T>& state) const {
    require_implemented<E>();
    validate_sequence(queries, keys, values, out);
    validate_state(state, queries.extent(0), queries.extent(1));
    run_forward<E, T>(queries, keys, values, out, nullptr, &state);
    state.advance(queries.extent(1));
  }

  /// As above, with precomputed proportions [B, T, H] (LeaP).
  template <exec::Policy E, Real T>
    requires(Dir::is_causal && learned_proportions)
  void forward(E, InputView<T> queries, InputView<T> keys, InputView<T> values,
               Proportions<T> proportions, TensorView<T, 4> out, State<T>& state) const {
    require_implemented<E>();
    validate_sequence(queries, keys, values, out);
    validate_proportions(proportions, queries.extent(1), keys.extent(1), out);
    validate_state(state, queries.extent(0), queries.extent(1));
    run_forward<E, T>(queries, keys, values, out, &proportions, &state);
    state.advance(queries.extent(1));
  }

  /// Advances `state` over keys [B, T, H, Dk] and values [B, T, H, Dv] without
  /// computing outputs: the state forward would leave, from the keys' features
  /// and the S, z sums alone. For a prompt whose outputs are not needed, and a
  /// slice's summary in sequence parallelism (latte/distributed/).
  template <exec::Policy E, Real T>
    requires(Dir::is_causal)
  void absorb(E, InputView<T> keys, InputView<T> values, State<T>& state) const {
    require_implemented<E>();
    require_modules();
    run_absorb<E, T>(keys, values, nullptr, state);
  }

  /// As above, with precomputed proportions [B, T, H] (LeaP): the keys' are
  /// read (P_k weighs what a key adds to the state); the queries' may be empty.
  template <exec::Policy E, Real T>
    requires(Dir::is_causal && learned_proportions)
  void absorb(E, InputView<T> keys, InputView<T> values, Proportions<T> proportions,
              State<T>& state) const {
    require_implemented<E>();
    const index_t B = keys.extent(0), Tn = keys.extent(1);
    check_proportion_values<T, 3>(proportions.keys, "key_proportions", {B, Tn, dims_.heads},
                                  "[B, T, H]", TensorView<T, 4>{});
    run_absorb<E, T>(keys, values, &proportions, state);
  }

 private:
  template <exec::Policy E, Real T>
  void run_absorb(const TensorView<const T, 4>& keys, const TensorView<const T, 4>& values,
                  const SequenceProportions<T>* given, State<T>& state) const {
    check_view(keys, "keys");
    const index_t B = keys.extent(0), Tn = keys.extent(1), H = dims_.heads;
    detail::check_shape(keys, "keys", {B, Tn, H, dims_.key_dim}, "[B, T, H, Dk]");
    detail::check_shape(values, "values", {B, Tn, H, dims_.value_dim}, "[B, T, H, Dv]");
    validate_state(state, B, Tn);
    const reference::LinearSpec call = spec();
    const auto proportion_of = sequence_proportions<T>(given, state.length());
    auto carry_of = [&](index_t b, index_t h) { return carry(state, b, h); };
    if constexpr (std::is_same_v<E, exec::cpu_t>)
      cpu::linear_causal_absorb<Map, Rw, Pos>(keys, values, call, state.position(), proportion_of,
                                              carry_of);
    else
      reference::linear_causal_absorb<Map, Rw, Pos>(keys, values, call, state.position(),
                                                    proportion_of, carry_of);
    state.advance(Tn);
  }

 public:
  /// Next-token decode: queries, keys [B, H, Dk], values [B, H, Dv]; out [B, H, Dv].
  /// O(E * Dv) per head, independent of the tokens already absorbed; no allocation.
  template <exec::Policy E, Real T>
    requires(Dir::is_causal)
  void step(E, State<T>& state, StepInputView<T> queries, StepInputView<T> keys,
            StepInputView<T> values, TensorView<T, 3> out) const {
    require_implemented<E>();
    validate_step(state, queries, keys, values, out);
    require_modules();
    run_step<E, T>(state, queries, keys, values, out, nullptr);
  }

  /// As above, with this token's proportions P_q, P_k [B, H] in [0, 1] (LeaP).
  template <exec::Policy E, Real T>
    requires(Dir::is_causal && learned_proportions)
  void step(E, State<T>& state, StepInputView<T> queries, StepInputView<T> keys,
            StepInputView<T> values, StepProportionViews<T> proportions,
            TensorView<T, 3> out) const {
    require_implemented<E>();
    validate_step(state, queries, keys, values, out);
    const index_t B = state.batch(), H = dims_.heads;
    check_proportion_values(proportions.queries, "query_proportions", {B, H}, "[B, H]", out);
    check_proportion_values(proportions.keys, "key_proportions", {B, H}, "[B, H]", out);
    run_step<E, T>(state, queries, keys, values, out, &proportions);
  }

  // ----------------------------------------------------------- backward --

  /// Gradients of a loss whose gradient with respect to `out` is `d_out`
  /// [B, T, H, Dv]: writes gradients.d_queries, d_keys, d_values and, with LeaP
  /// modules, accumulates into gradients.d_query_module / d_key_module when
  /// given. The forward is recomputed from the inputs.
  template <exec::Policy E, Real T>
  void backward(E, InputView<T> queries, InputView<T> keys, InputView<T> values,
                InputView<T> d_out, const LinearGradients<T>& gradients) const {
    run_backward<E, T>(queries, keys, values, nullptr, d_out, gradients, nullptr, false);
  }

  /// As above, with the forward's precomputed proportions [B, T, H] (LeaP):
  /// their gradients accumulate into gradients.d_query_proportions and
  /// d_key_proportions when those are not empty.
  template <exec::Policy E, Real T>
    requires(learned_proportions)
  void backward(E, InputView<T> queries, InputView<T> keys, InputView<T> values,
                Proportions<T> proportions, InputView<T> d_out,
                const LinearGradients<T>& gradients) const {
    run_backward<E, T>(queries, keys, values, &proportions, d_out, gradients, nullptr, false);
  }

  /// Causal backward of a forward that continued from `states.initial`, with
  /// the gradient of the state it left (`states.d_final`); writes the gradient
  /// of the initial state into `states.d_initial`. Backward over chunks chained
  /// through these equals the backward over the whole sequence.
  template <exec::Policy E, Real T>
    requires(Dir::is_causal)
  void backward(E, InputView<T> queries, InputView<T> keys, InputView<T> values,
                InputView<T> d_out, const LinearGradients<T>& gradients,
                const LinearStateGradients<T>& states) const {
    run_backward<E, T>(queries, keys, values, nullptr, d_out, gradients, &states, false);
  }

  /// As above, with precomputed proportions (LeaP).
  template <exec::Policy E, Real T>
    requires(Dir::is_causal && learned_proportions)
  void backward(E, InputView<T> queries, InputView<T> keys, InputView<T> values,
                Proportions<T> proportions, InputView<T> d_out,
                const LinearGradients<T>& gradients,
                const LinearStateGradients<T>& states) const {
    run_backward<E, T>(queries, keys, values, &proportions, d_out, gradients, &states, false);
  }

  /// Gradients of cross_forward: d_queries [B, T, H, Dk], d_keys [B, S, H, Dk],
  /// d_values [B, S, H, Dv].
  template <exec::Policy E, Real T>
    requires(!Dir::is_causal)
  void cross_backward(E, InputView<T> queries, InputView<T> keys, InputView<T> values,
                      InputView<T> d_out, const LinearGradients<T>& gradients) const {
    run_backward<E, T>(queries, keys, values, nullptr, d_out, gradients, nullptr, true);
  }

  /// As above, with precomputed proportions P_q [B, T, H] and P_k [B, S, H] (LeaP).
  template <exec::Policy E, Real T>
    requires(!Dir::is_causal && learned_proportions)
  void cross_backward(E, InputView<T> queries, InputView<T> keys, InputView<T> values,
                      Proportions<T> proportions, InputView<T> d_out,
                      const LinearGradients<T>& gradients) const {
    run_backward<E, T>(queries, keys, values, &proportions, d_out, gradients, nullptr, true);
  }

  // The same calls without an execution tag run on exec::default_t (exec::cpu).
  template <Real T>
  void forward(InputView<T> queries, InputView<T> keys, InputView<T> values,
               TensorView<T, 4> out) const {
    forward(exec::default_t{}, queries, keys, values, out);
  }
  template <Real T>
    requires(learned_proportions)
  void forward(InputView<T> queries, InputView<T> keys, InputView<T> values,
               Proportions<T> proportions, TensorView<T, 4> out) const {
    forward(exec::default_t{}, queries, keys, values, proportions, out);
  }
  template <Real T>
    requires(!Dir::is_causal)
  void cross_forward(InputView<T> queries, InputView<T> keys, InputView<T> values,
                     TensorView<T, 4> out) const {
    cross_forward(exec::default_t{}, queries, keys, values, out);
  }
  template <Real T>
    requires(!Dir::is_causal && learned_proportions)
  void cross_forward(InputView<T> queries, InputView<T> keys, InputView<T> values,
                     Proportions<T> proportions, TensorView<T, 4> out) const {
    cross_forward(exec::default_t{}, queries, keys, values, proportions, out);
  }
  template <Real T>
    requires(Dir::is_causal)
  void forward(InputView<T> queries, InputView<T> keys, InputView<T> values,
               TensorView<T, 4> out, State<T>& state) const {
    forward(exec::default_t{}, queries, keys, values, out, state);
  }
  template <Real T>
    requires(Dir::is_causal && learned_proportions)
  void forward(InputView<T> queries, InputView<T> keys, InputView<T> values,
               Proportions<T> proportions, TensorView<T, 4> out, State<T>& state) const {
    forward(exec::default_t{}, queries, keys, values, proportions, out, state);
  }
  template <Real T>
    requires(Dir::is_causal)
  void step(State<T>& state, StepInputView<T> queries, StepInputView<T> keys,
            StepInputView<T> values, TensorView<T, 3> out) const {
    step(exec::default_t{}, state, queries, keys, values, out);
  }
  template <Real T>
    requires(Dir::is_causal && learned_proportions)
  void step(State<T>& state, StepInputView<T> queries, StepInputView<T> keys,
            StepInputView<T> values, StepProportionViews<T> proportions,
            TensorView<T, 3> out) const {
    step(exec::default_t{}, state, queries, keys, values, proportions, out);
  }

  template <Real T>
  void backward(InputView<T> queries, InputView<T> keys, InputView<T> values, InputView<T> d_out,
                const LinearGradients<T>& gradients) const {
    backward(exec::default_t{}, queries, keys, values, d_out, gradients);
  }
  template <Real T>
    requires(learned_proportions)
  void backward(InputView<T> queries, InputView<T> keys, InputView<T> values,
                Proportions<T> proportions, InputView<T> d_out,
                const LinearGradients<T>& gradients) const {
    backward(exec::default_t{}, queries, keys, values, proportions, d_out, gradients);
  }
  template <Real T>
    requires(Dir::is_causal)
  void backward(InputView<T> queries, InputView<T> keys, InputView<T> values, InputView<T> d_out,
                const LinearGradients<T>& gradients, const LinearStateGradients<T>& states) const {
    backward(exec::default_t{}, queries, keys, values, d_out, gradients, states);
  }
  template <Real T>
    requires(Dir::is_causal && learned_proportions)
  void backward(InputView<T> queries, InputView<T> keys, InputView<T> values,
                Proportions<T> proportions, InputView<T> d_out,
                const LinearGradients<T>& gradients, const LinearStateGradients<T>& states) const {
    backward(exec::default_t{}, queries, keys, values, proportions, d_out, gradients, states);
  }
  template <Real T>
    requires(!Dir::is_causal)
  void cross_backward(InputView<T> queries, InputView<T> keys, InputView<T> values,
                      InputView<T> d_out, const LinearGradients<T>& gradients) const {
    cross_backward(exec::default_t{}, queries, keys, values, d_out, gradients);
  }
  template <Real T>
    requires(!Dir::is_causal && learned_proportions)
  void cross_backward(InputView<T> queries, InputView<T> keys, InputView<T> values,
                      Proportions<T> proportions, InputView<T> d_out,
                      const LinearGradients<T>& gradients) const {
    cross_backward(exec::default_t{}, queries, keys, values, proportions, d_out, gradients);
  }

 private:
  template <class E>
  static void require_implemented() {
    static_assert(!std::is_same_v<E, exec::cuda_t>,
                  "LinearAttention has no exec::cuda kernel yet; use exec::cpu or exec::reference");
    static_assert(exec::implemented<E>, "this execution backend is not implemented yet");
  }

  [[nodiscard]] reference::LinearSpec spec() const noexcept {
    return {dims_.key_dim,   feature_dim_, Rw::streams, dims_.value_dim, &angles_,
            options_.rope_denominator == RopeDenominator::rotated, options_.normaliser};
  }

  /// The named sizes of a state for `batch` sequences.
  [[nodiscard]] std::vector<StateSize> sizes_for(index_t batch) const {
    std::vector<StateSize> sizes{{"batch", batch},
                                 {"heads", dims_.heads},
                                 {"feature_dim", feature_dim_},
                                 {"streams", Rw::streams},
                                 {"value_dim", dims_.value_dim}};
    if constexpr (position_proportions)
      sizes.push_back({"length", options_.reweight.length.value_or(0)});
    if constexpr (Pos::rotates_queries_keys)
      sizes.push_back({"rotated_denominator",
                       options_.rope_denominator == RopeDenominator::rotated ? 1 : 0});
    return sizes;
  }

  // --------------------------------------------------------- validation --

  void validate_leap() const {
    const auto& params = options_.reweight;
    detail::require(params.leap_factor >= 1 && feature_dim_ % params.leap_factor == 0,
                    "leap_factor",
                    detail::expected_given("LeaP step-down factor (a divisor of the feature "
                                           "dim " + std::to_string(feature_dim_) + ")",
                                           "a divisor of " + std::to_string(feature_dim_),
                                           params.leap_factor));
    detail::require(params.query_module.has_value() == params.key_module.has_value(),
                    params.query_module ? "key_module" : "query_module",
                    "expected both LeaP modules (queries and keys) or neither, given one");
    const index_t hidden = feature_dim_ / params.leap_factor;
    if (params.query_module) params.query_module->validate("query_module", feature_dim_, hidden);
    if (params.key_module) params.key_module->validate("key_module", feature_dim_, hidden);
  }

  /// LeaP without modules needs proportions in every call.
  void require_modules() const {
    if constexpr (learned_proportions)
      detail::require(options_.reweight.query_module.has_value(), "proportions",
                      "this LeaPformer has no LeaP modules: expected precomputed proportions, "
                      "given none");
  }

  /// cosFormer's M for a call that uses positions [0, needed), defaulting to
  /// `fallback` when no length was given.
  /// Allocation-free unless it throws (step calls it per token).
  [[nodiscard]] index_t cosformer_length(index_t needed, index_t fallback) const {
    const index_t length = options_.reweight.length.value_or(fallback);
    if (length < needed)
      throw Error("length", detail::expected_given("cosFormer length M (P = (i + 1) / M must stay "
                                                   "<= 1 for the " + std::to_string(needed) +
                                                   " positions used)",
                                                   ">= " + std::to_string(needed), length));
    return length;
  }

  template <Real T>
  void validate_sequence(const TensorView<const T, 4>& q, const TensorView<const T, 4>& k,
                         const TensorView<const T, 4>& v, const TensorView<T, 4>& out) const {
    check_view(q, "queries");
    const index_t B = q.extent(0), Tn = q.extent(1), H = dims_.heads;
    detail::check_shape(q, "queries", {B, Tn, H, dims_.key_dim}, "[B, T, H, Dk]");
    detail::check_shape(k, "keys", {B, Tn, H, dims_.key_dim}, "[B, T, H, Dk]");
    detail::check_shape(v, "values", {B, Tn, H, dims_.value_dim}, "[B, T, H, Dv]");
    detail::check_shape(out, "out", {B, Tn, H, dims_.value_dim}, "[B, T, H, Dv]");
    check_outputs_distinct(q, k, v, out);
  }

  template <Real T>
  void validate_cross(const TensorView<const T, 4>& q, const TensorView<const T, 4>& k,
                      const TensorView<const T, 4>& v, const TensorView<T, 4>& out) const {
    check_view(q, "queries");
    check_view(k, "keys");
    const index_t B = q.extent(0), Tn = q.extent(1), Sn = k.extent(1), H = dims_.heads;
    detail::check_shape(q, "queries", {B, Tn, H, dims_.key_dim}, "[B, T, H, Dk]");
    detail::check_shape(k, "keys", {B, Sn, H, dims_.key_dim}, "[B, S, H, Dk]");
    detail::check_shape(v, "values", {B, Sn, H, dims_.value_dim}, "[B, S, H, Dv]");
    detail::check_shape(out, "out", {B, Tn, H, dims_.value_dim}, "[B, T, H, Dv]");
    check_outputs_distinct(q, k, v, out);
  }

  template <class Q, class K, class V, class O>
  static void check_outputs_distinct(const Q& q, const K& k, const V& v, const O& out) {
    detail::check_output(out, "out", detail::named(q, "queries"), detail::named(k, "keys"),
                         detail::named(v, "values"));
  }

  /// Shape, and every value finite and in [0, 1] (paper 004 eq. 8); `out`
  /// must not share memory with the proportions (an empty `out`: not checked).
  template <Real T, std::size_t N, class O>
  static void check_proportion_values(const TensorView<const T, N>& proportions,
                                      const char* argument, const std::array<index_t, N>& expected,
                                      const char* layout, const O& out) {
    detail::check_shape(proportions, argument, expected, layout);
    detail::check_no_overlap(out, "out", proportions, argument);
    if (proportions.empty()) return;
    std::array<index_t, N> at{};
    for (;;) {
      const T p = std::apply([&](auto... i) { return proportions(i...); }, at);
      if (!(p >= T(0) && p <= T(1)))  // also rejects NaN
        throw Error(argument, detail::expected_given("proportion at " + format_extents(at),
                                                     "a value in [0, 1]", p));
      std::size_t d = N;  // odometer over the extents
      while (d-- > 0) {
        if (++at[d] < proportions.extent(d)) break;
        at[d] = 0;
        if (d == 0) return;
      }
    }
  }

  template <Real T>
  void validate_proportions(const SequenceProportions<T>& proportions, index_t query_length,
                            index_t key_length, const TensorView<T, 4>& out) const {
    const index_t B = out.extent(0), H = dims_.heads;
    check_proportion_values<T, 3>(proportions.queries, "query_proportions",
                                  {B, query_length, H}, "[B, T, H]", out);
    check_proportion_values<T, 3>(proportions.keys, "key_proportions", {B, key_length, H},
                                  key_length == query_length ? "[B, T, H]" : "[B, S, H]", out);
  }

 public:
  /// Throws latte::Error unless `proportions` are P_q and P_k [B, T, H] with
  /// every value in [0, 1]: what forward checks, for a caller that must know
  /// before it starts (latte/distributed/ checks every rank's first).
  template <Real T>
    requires(learned_proportions)
  void validate_proportions(const SequenceProportions<T>& proportions, index_t batch,
                            index_t length) const {
    const std::array<index_t, 3> expected{batch, length, dims_.heads};
    check_proportion_values<T, 3>(proportions.queries, "query_proportions", expected,
                                  "[B, T, H]", TensorView<T, 4>{});
    check_proportion_values<T, 3>(proportions.keys, "key_proportions", expected, "[B, T, H]",
                                  TensorView<T, 4>{});
  }

  /// Throws latte::Error unless `state` belongs to this attention (kind and sizes)
  /// and can take `new_tokens` more tokens of `batch` sequences (capacity): the
  /// check every call with a state makes first. Public so that a caller running
  /// many states (forward_packed) checks them all before any of them moves.
  /// Allocation-free on success (step calls it per token).
  template <Real T>
  void validate_state(const State<T>& state, index_t batch, index_t new_tokens) const {
    bool matches = state.kind() == kinds_.template get<T>() && state.batch() == batch &&
                   state.heads() == dims_.heads && state.feature_dim() == feature_dim_ &&
                   state.streams() == Rw::streams && state.value_dim() == dims_.value_dim;
    if constexpr (position_proportions)
      matches = matches && state.length() == options_.reweight.length.value_or(0);
    if constexpr (Pos::rotates_queries_keys)
      matches = matches && state.size_of("rotated_denominator") ==
                               (options_.rope_denominator == RopeDenominator::rotated ? 1 : 0);
    if (!matches) state.require_matches(kind<T>(), sizes_for(batch));
    state.require_room(new_tokens);
    if constexpr (position_proportions)
      (void)cosformer_length(static_cast<index_t>(state.position() + new_tokens), 0);
  }

 private:
  template <Real T>
  void validate_step(State<T>& state, const TensorView<const T, 3>& q,
                     const TensorView<const T, 3>& k, const TensorView<const T, 3>& v,
                     const TensorView<T, 3>& out) const {
    const index_t B = state.batch(), H = dims_.heads;
    validate_state(state, B, 1);
    detail::check_shape(q, "queries", {B, H, dims_.key_dim}, "[B, H, Dk]");
    detail::check_shape(k, "keys", {B, H, dims_.key_dim}, "[B, H, Dk]");
    detail::check_shape(v, "values", {B, H, dims_.value_dim}, "[B, H, Dv]");
    detail::check_shape(out, "out", {B, H, dims_.value_dim}, "[B, H, Dv]");
    check_outputs_distinct(q, k, v, out);
  }

  // ------------------------------------------------------------ running --

  /// The proportion of one token: from its position (cosFormer), from the LeaP
  /// module on phi, or read from the given tensor at (b, t, h).
  template <Real T>
  [[nodiscard]] auto sequence_proportions(const SequenceProportions<T>* given,
                                          index_t length) const {
    using reference::Side;
    if constexpr (position_proportions) {
      (void)given;
      return [length](Side, index_t, index_t, index_t, std::int64_t position, const T*) {
        return CosFormerReweight::proportion(position, length);
      };
    } else if constexpr (learned_proportions) {
      (void)length;
      return [this, given](Side side, index_t b, index_t t, index_t h, std::int64_t,
                           const T* phi) {
        if (given)
          return Proportion::of(side == Side::query ? given->queries(b, t, h)
                                                    : given->keys(b, t, h));
        return side == Side::query ? options_.reweight.query_module->evaluate(phi)
                                   : options_.reweight.key_module->evaluate(phi);
      };
    } else {
      (void)given, (void)length;
      return [](Side, index_t, index_t, index_t, std::int64_t, const T*) {
        return Proportion{};  // NoReweight: never asked
      };
    }
  }

  /// One (batch, head)'s state: memory [E x Dv], normaliser [E] and their
  /// low parts (reference::linear_carry_size, checked).
  [[nodiscard]] index_t carry_size() const {
    const index_t E = detail::checked_product("dims", {Rw::streams, feature_dim_});
    return detail::checked_product("dims",
                                   {2, E, detail::checked_sum("dims", {dims_.value_dim, 1})});
  }

  /// A state's carry of (b, h) as Sum adds to it.
  template <Real T>
  [[nodiscard]] static reference::LinearCarry<T> carry(LinearState<T>& state, index_t b, index_t h) {
    return summed_by<Sum>(state.carry(b, h));
  }

  template <class E, Real T>
  void run_forward(const TensorView<const T, 4>& q, const TensorView<const T, 4>& k,
                   const TensorView<const T, 4>& v, const TensorView<T, 4>& out,
                   const SequenceProportions<T>* given, State<T>* state) const {
    if (!given) require_modules();
    if (out.empty()) return;  // no output: allocate and loop over nothing
    if constexpr (Dir::is_causal) {
      const reference::LinearSpec call = spec();
      index_t length = 0;
      if constexpr (position_proportions)
        length = state ? state->length() : cosformer_length(q.extent(1), q.extent(1));
      if (state) {
        if constexpr (std::is_same_v<E, exec::cpu_t>)
          cpu::linear_causal_forward<Map, Rw, Pos>(
              q, k, v, out, call, state->position(), sequence_proportions<T>(given, length),
              [&](index_t b, index_t h) { return carry(*state, b, h); });
        else
          reference::linear_causal_forward<Map, Rw, Pos>(
              q, k, v, out, call, state->position(), sequence_proportions<T>(given, length),
              [&](index_t b, index_t h) { return carry(*state, b, h); });
        return;
      }
      const index_t Ex = call.expanded_dim(), Dv = dims_.value_dim;
      if constexpr (std::is_same_v<E, exec::cpu_t>) {
        // One zeroed carry per (b, h): the heads run in parallel.
        const index_t carry_size = this->carry_size();
        std::vector<T> carries(static_cast<std::size_t>(
            detail::checked_count<T>("queries", {q.extent(0), dims_.heads, carry_size})));
        cpu::linear_causal_forward<Map, Rw, Pos>(
            q, k, v, out, call, 0, sequence_proportions<T>(given, length),
            [&](index_t b, index_t h) {  // zeroed: an empty carry
              return summed_by<Sum>(reference::linear_carry_at(
                  carries.data() + (b * dims_.heads + h) * carry_size, Ex, Dv));
            });
        return;
      }
      std::vector<T> carry_storage(static_cast<std::size_t>(carry_size()));
      reference::linear_causal_forward<Map, Rw, Pos>(
          q, k, v, out, call, 0, sequence_proportions<T>(given, length), [&](index_t, index_t) {
            const auto carry = reference::linear_carry_at(carry_storage.data(), Ex, Dv);
            reference::linear_reset(carry, Ex, Dv);
            return summed_by<Sum>(carry);
          });
    } else {
      (void)state;
      run_bidirectional<E, T>(q, k, v, out, given);
    }
  }

  template <class E, Real T>
  void run_bidirectional(const TensorView<const T, 4>& q, const TensorView<const T, 4>& k,
                         const TensorView<const T, 4>& v, const TensorView<T, 4>& out,
                         const SequenceProportions<T>* given) const {
    if (!given) require_modules();
    if (out.empty()) return;  // no output: allocate and loop over nothing
    index_t length = 0;
    if constexpr (position_proportions) {
      const index_t longest = std::max(q.extent(1), k.extent(1));
      length = cosformer_length(longest, longest);
    }
    if constexpr (std::is_same_v<E, exec::cpu_t>)
      cpu::linear_bidirectional_forward<Map, Rw, Pos>(q, k, v, out, spec(),
                                                      sequence_proportions<T>(given, length));
    else
      reference::linear_bidirectional_forward<Map, Rw, Pos>(
          q, k, v, out, spec(), sequence_proportions<T>(given, length));
  }

  template <class E, Real T>
  void run_step(State<T>& state, const TensorView<const T, 3>& q, const TensorView<const T, 3>& k,
                const TensorView<const T, 3>& v, const TensorView<T, 3>& out,
                const StepProportions<T>* given) const {
    const reference::LinearSpec call = spec();
    const std::int64_t position = state.position();
    const index_t length = state.length();
    if constexpr (std::is_same_v<E, exec::cpu_t>) {
      cpu::linear_causal_step<Map, Rw, Pos>(
          q, k, v, out, call, position,
          [&](reference::Side side, index_t b, index_t h, const T* phi) -> Proportion {
            if constexpr (position_proportions) {
              (void)side, (void)b, (void)h, (void)phi;
              return CosFormerReweight::proportion(position, length);
            } else if constexpr (learned_proportions) {
              if (given)
                return Proportion::of(side == reference::Side::query ? given->queries(b, h)
                                                                     : given->keys(b, h));
              return side == reference::Side::query
                         ? options_.reweight.query_module->evaluate(phi)
                         : options_.reweight.key_module->evaluate(phi);
            } else {
              (void)side, (void)b, (void)h, (void)phi;
              return Proportion{};
            }
          },
          [&](index_t b, index_t h) { return carry(state, b, h); }, state.scratch());
      state.advance(1);
      return;
    }
    for (index_t b = 0; b < state.batch(); ++b)
      for (index_t h = 0; h < dims_.heads; ++h) {
        auto proportion_of = [&](reference::Side side, const T* phi) -> Proportion {
          if constexpr (position_proportions) {
            (void)side, (void)phi;
            return CosFormerReweight::proportion(position, length);
          } else if constexpr (learned_proportions) {
            if (given)
              return Proportion::of(side == reference::Side::query ? given->queries(b, h)
                                                                   : given->keys(b, h));
            return side == reference::Side::query ? options_.reweight.query_module->evaluate(phi)
                                                  : options_.reweight.key_module->evaluate(phi);
          } else {
            (void)side, (void)phi;
            return Proportion{};
          }
        };
        reference::linear_causal_token<Map, Rw, Pos>(q.row(b, h), k.row(b, h), v.row(b, h),
                                                     out.row(b, h), carry(state, b, h), call,
                                                     call.theta(h), position, proportion_of,
                                                     state.scratch());
      }
    state.advance(1);
  }

  // ----------------------------------------------------------- backward --

  /// The gradient of a token's proportion: into the given proportions'
  /// gradient (when wanted) or back through the LeaP module (its input's
  /// gradient always; its weights' into `module_gradients[2 * worker + side]`
  /// when that is not empty). Nothing for cosFormer's fixed proportions.
  template <Real T>
  [[nodiscard]] auto proportion_gradient(const SequenceProportions<T>* given,
                                         const LinearGradients<T>& gradients,
                                         std::vector<LeaPModule>& module_gradients) const {
    using reference::Side;
    if constexpr (learned_proportions) {
      return [this, given, &gradients, &module_gradients](
                 int worker, Side side, index_t b, index_t t, index_t h,
                 const Proportion& proportion, double d_proportion, const T* phi, T* d_phi) {
        const bool query = side == Side::query;
        if (given) {
          const TensorView<T, 3>& into =
              query ? gradients.d_query_proportions : gradients.d_key_proportions;
          if (!into.empty()) into(b, t, h) += static_cast<T>(d_proportion);
          return;
        }
        const LeaPModule& module =
            query ? *options_.reweight.query_module : *options_.reweight.key_module;
        LeaPModule* weights = module_gradients.empty()
                                  ? nullptr
                                  : &module_gradients[static_cast<std::size_t>(
                                        2 * worker + (query ? 0 : 1))];
        module.backward(phi, proportion, d_proportion, d_phi, weights);
      };
    } else {
      (void)given, (void)gradients, (void)module_gradients;
      return [](int, Side, index_t, index_t, index_t, const Proportion&, double, const T*,
                T*) {};
    }
  }

  template <class E, Real T>
  void run_backward(const TensorView<const T, 4>& q, const TensorView<const T, 4>& k,
                    const TensorView<const T, 4>& v, const SequenceProportions<T>* given,
                    const TensorView<const T, 4>& d_out, const LinearGradients<T>& gradients,
                    const LinearStateGradients<T>* states, bool cross) const {
    static_assert(!std::is_same_v<E, exec::cuda_t> && !exec::cuda_unavailable<E>,
                  "LinearAttention::backward runs on exec::reference and exec::cpu (no CUDA "
                  "backward yet)");
    static_assert(exec::implemented<E>, "this execution backend is not implemented yet");
    static_assert(DifferentiableFeatureMap<Map>,
                  "backward needs the feature map's derivative: give the map a static "
                  "backward(x, d_phi, d_x) (policies/feature_map.hpp)");
    validate_backward(q, k, v, given, d_out, gradients, cross);
    if (!given) require_modules();
    const index_t B = q.extent(0), Tn = q.extent(1), H = dims_.heads;
    const index_t Ex = expanded_dim(), Dv = dims_.value_dim;
    if (states) validate_state_gradients(*states, B, Tn);
    // LeaP module weight gradients: one pair per worker, summed at the end.
    std::vector<LeaPModule> module_gradients;
    if constexpr (learned_proportions) {
      if (!given && (gradients.d_query_module || gradients.d_key_module)) {
        const int workers = std::is_same_v<E, exec::cpu_t> ? cpu::thread_count() : 1;
        for (int w = 0; w < workers; ++w) {
          module_gradients.push_back(options_.reweight.query_module->zeros_like());
          module_gradients.push_back(options_.reweight.key_module->zeros_like());
        }
      }
    }
    const auto proportion_backward = proportion_gradient<T>(given, gradients, module_gradients);
    const reference::LinearSpec call = spec();
    if constexpr (Dir::is_causal) {
      (void)cross;
      const LinearState<T>* initial = states ? states->initial : nullptr;
      const LinearState<T>* d_final = states ? states->d_final : nullptr;
      LinearState<T>* d_initial = states ? states->d_initial : nullptr;
      if (d_initial) {
        *d_initial = initial ? *initial : make_state<T>(B);
        for (int field : {2, 3})  // the low parts: a gradient lives in the sum fields
          std::fill_n(d_initial->field(field), d_initial->field_size(field), T(0));
      }
      const std::int64_t first_position = initial ? initial->position() : 0;
      index_t length = 0;
      if constexpr (position_proportions)
        length = initial ? initial->length() : cosformer_length(Tn, Tn);
      auto carry_at = [&](const LinearState<T>& state, index_t b, index_t h) {
        const index_t head = b * H + h;
        return reference::LinearCarry<const T>{state.field(0) + head * Ex * Dv,
                                               state.field(1) + head * Ex};
      };
      if (Tn == 0 || B == 0) {  // no token: the initial state's gradient is d_final's
        if (d_initial)
          for (int field : {0, 1}) {
            T* into = d_initial->field(field);
            const index_t count = field == 0 ? B * H * Ex * Dv : B * H * Ex;
            if (d_final) std::copy_n(d_final->field(field), count, into);
            else std::fill_n(into, count, T(0));
          }
        return;
      }
      auto initial_of = [&](index_t b, index_t h, reference::LinearCarry<T> carry) {
        if (!initial) return reference::linear_reset(carry, Ex, Dv);
        // The sums as one value each: fl(hi + lo) of the state's compensated pairs.
        const reference::LinearCarry<const T> from = initial->carry(b, h);
        for (index_t i = 0; i < Ex * Dv; ++i) carry.memory[i] = from.memory[i] + from.memory_low[i];
        for (index_t i = 0; i < Ex; ++i) carry.normaliser[i] = from.normaliser[i] + from.normaliser_low[i];
      };
      auto final_gradient_of = [&](index_t b, index_t h) {
        return d_final ? carry_at(*d_final, b, h)
                       : reference::LinearCarry<const T>{nullptr, nullptr};
      };
      auto initial_gradient_of = [&](index_t b, index_t h) {
        return d_initial ? d_initial->carry(b, h) : reference::LinearCarry<T>{nullptr, nullptr};
      };
      if constexpr (std::is_same_v<E, exec::cpu_t>)
        cpu::linear_causal_backward<Map, Rw, Pos, Sum>(
            q, k, v, d_out, gradients.d_queries, gradients.d_keys, gradients.d_values, call,
            first_position, sequence_proportions<T>(given, length), proportion_backward,
            initial_of, final_gradient_of, initial_gradient_of);
      else
        reference::linear_causal_backward<Map, Rw, Pos, Sum>(
            q, k, v, d_out, gradients.d_queries, gradients.d_keys, gradients.d_values, call,
            first_position, sequence_proportions<T>(given, length), proportion_backward,
            initial_of, final_gradient_of, initial_gradient_of);
    } else {
      (void)states, (void)cross;
      if (B > 0 && (Tn > 0 || k.extent(1) > 0)) {
        index_t length = 0;
        if constexpr (position_proportions) {
          const index_t longest = std::max(q.extent(1), k.extent(1));
          length = cosformer_length(longest, longest);
        }
        if constexpr (std::is_same_v<E, exec::cpu_t>)
          cpu::linear_bidirectional_backward<Map, Rw, Pos>(
              q, k, v, d_out, gradients.d_queries, gradients.d_keys, gradients.d_values, call,
              sequence_proportions<T>(given, length), proportion_backward);
        else
          reference::linear_bidirectional_backward<Map, Rw, Pos>(
              q, k, v, d_out, gradients.d_queries, gradients.d_keys, gradients.d_values, call,
              sequence_proportions<T>(given, length), proportion_backward);
      }
    }
    add_module_gradients(module_gradients, gradients);
  }

  /// Sums the workers' module weight gradients into the caller's modules.
  template <Real T>
  static void add_module_gradients(const std::vector<LeaPModule>& parts,
                                   const LinearGradients<T>& gradients) {
    for (std::size_t i = 0; i < parts.size(); ++i) {
      LeaPModule* into = i % 2 == 0 ? gradients.d_query_module : gradients.d_key_module;
      if (!into) continue;
      const LeaPModule& part = parts[i];
      for (index_t x = 0; x < part.w1.size(); ++x) into->w1.data()[x] += part.w1.data()[x];
      for (index_t x = 0; x < part.b1.size(); ++x) into->b1.data()[x] += part.b1.data()[x];
      for (index_t x = 0; x < part.w2.size(); ++x) into->w2.data()[x] += part.w2.data()[x];
      into->b2 += part.b2;
    }
  }

  template <Real T>
  void validate_backward(const TensorView<const T, 4>& q, const TensorView<const T, 4>& k,
                         const TensorView<const T, 4>& v, const SequenceProportions<T>* given,
                         const TensorView<const T, 4>& d_out, const LinearGradients<T>& gradients,
                         bool cross) const {
    check_view(q, "queries");
    check_view(k, "keys");
    const index_t B = q.extent(0), Tn = q.extent(1), Sn = cross ? k.extent(1) : Tn,
                  H = dims_.heads, Dk = dims_.key_dim, Dv = dims_.value_dim;
    const char* source = cross ? "[B, S, H, Dk]" : "[B, T, H, Dk]";
    const char* source_values = cross ? "[B, S, H, Dv]" : "[B, T, H, Dv]";
    detail::check_shape(q, "queries", {B, Tn, H, Dk}, "[B, T, H, Dk]");
    detail::check_shape(k, "keys", {B, Sn, H, Dk}, source);
    detail::check_shape(v, "values", {B, Sn, H, Dv}, source_values);
    detail::check_shape(d_out, "d_out", {B, Tn, H, Dv}, "[B, T, H, Dv]");
    // Named references, not a structured binding: clang 14 cannot capture those.
    const TensorView<T, 4>& dq = gradients.d_queries;
    const TensorView<T, 4>& dk = gradients.d_keys;
    const TensorView<T, 4>& dv = gradients.d_values;
    const TensorView<T, 3>& dpq = gradients.d_query_proportions;
    const TensorView<T, 3>& dpk = gradients.d_key_proportions;
    detail::check_shape(dq, "gradients.d_queries", {B, Tn, H, Dk}, "[B, T, H, Dk]");
    detail::check_shape(dk, "gradients.d_keys", {B, Sn, H, Dk}, source);
    detail::check_shape(dv, "gradients.d_values", {B, Sn, H, Dv}, source_values);
    const TensorView<const T, 3> no_proportions{};
    const TensorView<const T, 3>& pq = given ? given->queries : no_proportions;
    const TensorView<const T, 3>& pk = given ? given->keys : no_proportions;
    const auto inputs = std::tuple(detail::named(q, "queries"), detail::named(k, "keys"),
                                   detail::named(v, "values"), detail::named(d_out, "d_out"),
                                   detail::named(pq, "query_proportions"),
                                   detail::named(pk, "key_proportions"));
    std::apply([&](const auto&... in) {
      detail::check_output(dq, "gradients.d_queries", in...);
      detail::check_output(dk, "gradients.d_keys", in..., detail::named(dq, "gradients.d_queries"));
      detail::check_output(dv, "gradients.d_values", in..., detail::named(dq, "gradients.d_queries"),
                           detail::named(dk, "gradients.d_keys"));
    }, inputs);
    // After the overlap checks, which name the gradient (this one would say "out").
    if (given) validate_proportions(*given, Tn, Sn, dq);
    auto check_proportion_gradient = [&](const TensorView<T, 3>& d, const char* name,
                                         index_t length, const char* layout) {
      if (d.empty()) return;
      detail::require(learned_proportions && given != nullptr, name,
                      "only a LeaPformer given precomputed proportions has proportion "
                      "gradients (leave it empty)");
      detail::check_shape(d, name, {B, length, H}, layout);
      std::apply([&](const auto&... in) {
        detail::check_output(d, name, in..., detail::named(dq, "gradients.d_queries"),
                             detail::named(dk, "gradients.d_keys"),
                             detail::named(dv, "gradients.d_values"));
      }, inputs);
    };
    check_proportion_gradient(dpq, "gradients.d_query_proportions", Tn, "[B, T, H]");
    check_proportion_gradient(dpk, "gradients.d_key_proportions", Sn,
                              cross ? "[B, S, H]" : "[B, T, H]");
    if (!dpq.empty() && !dpk.empty())
      detail::check_no_overlap(dpk, "gradients.d_key_proportions", dpq,
                               "gradients.d_query_proportions");
    auto check_module_gradient = [&](const LeaPModule* d, const char* name,
                                     const LeaPModule* other) {
      if (!d) return;
      if constexpr (learned_proportions) {
        detail::require(given == nullptr && options_.reweight.query_module.has_value(), name,
                        "module gradients need a LeaPformer with LeaP modules, called without "
                        "proportions (leave it null)");
        detail::require(d != other, name, "must be a module of its own (not the other side's)");
        const LeaPModule& shape = *options_.reweight.query_module;  // both sides share a shape
        auto check = [&](const auto& tensor, const auto& expected, const char* part) {
          detail::require(tensor.extents() == expected.extents(), std::string(name) + "." + part,
                          detail::expected_given("shape (make it with zeros_like())",
                                                 format_extents(expected.extents()),
                                                 format_extents(tensor.extents())));
        };
        check(d->w1, shape.w1, "w1");
        check(d->b1, shape.b1, "b1");
        check(d->w2, shape.w2, "w2");
      } else {
        (void)other;
        throw Error(name, "only a LeaPformer has LeaP module gradients (leave it null)");
      }
    };
    check_module_gradient(gradients.d_query_module, "gradients.d_query_module",
                          gradients.d_key_module);
    check_module_gradient(gradients.d_key_module, "gradients.d_key_module",
                          gradients.d_query_module);
  }

  template <Real T>
  void validate_state_gradients(const LinearStateGradients<T>& states, index_t batch,
                                index_t tokens) const {
    detail::require_backward_states(states, kind<T>(), sizes_for(batch), tokens);
    if constexpr (position_proportions)
      if (states.initial)
        (void)cosformer_length(static_cast<index_t>(states.initial->position() + tokens), 0);
  }

  LinearDims dims_;
  Options options_;
  index_t feature_dim_ = 0;
  detail::KindNames kinds_{kind<float>(), kind<double>()};
  std::vector<double> angles_;  // [H * (F/2)] for RoPE, empty otherwise
};

}  // namespace latte
