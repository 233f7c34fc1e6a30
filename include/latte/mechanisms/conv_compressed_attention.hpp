#pragma once
// latte::ConvCompressedAttention<Direction> — convolutional-compression attention
// (paper 003 §4, DESIGN §3.5), with approach 2's hierarchy as `levels`:
//
//   (1) y^(0) = sliding-window softmax attention over the projected inputs q, k, v;
//   (2) every complete group of M consecutive tokens of y^(0) is compressed to one
//       token by a learned convolution (kernel M, stride M, Dv -> Dv, with bias):
//       c^(1)_j = b^(1) + sum_{i<M} W^(1)_i y^(0)_{jM+i};
//       approach 2 (levels L > 1): y^(l) = sliding-window attention over c^(l) with
//       the level's own projections, c^(l+1) = its convolution, up to c^(L);
//   (3) query t cross-attends, with the op's own projections Wq_x, Wk_x, Wv_x, to the
//       top-level tokens: keys Wk_x c^(L)_j, values Wv_x c^(L)_j, query Wq_x y^(0)_t,
//       over j < floor(t / M^L) (Causal: block-causal; the first M^L tokens see none)
//       or over every j (Bidirectional);
//   (4) o_t = y^(0)_t + cross_t (the Residual combiner).
//
// Inputs are already projected, as for SoftmaxAttention: queries and keys
// [B, T, H, Dk], values [B, T, H, Dv]; the output is [B, T, H, Dv]. Whatever the
// op computes internally it projects with parameters it owns (ConvCompressedParams):
// the convolutions of every level, the window-attention projections of the
// compressed levels 1..L-1 and the cross-attention projections. Heads are
// independent (each head has its own weights, as in paper 003's per-head modules).
// Every softmax uses `scale` (default 1/sqrt(Dk)). Causal decode keeps the window
// rings, the open groups' partial sums and the compressed tokens (ConvCompressedState).
// Backends: exec::reference (scalar loops, backends/reference/conv_compressed.hpp) and
// exec::cpu (GEMM/SIMD/OpenMP, backends/cpu/conv_compressed.hpp); exec::cuda does not
// compile yet.
//
//   latte::ConvCompressedAttention<latte::Causal> attn(
//       {.heads = 8, .key_dim = 64, .value_dim = 64, .group_size = 64, .levels = 1}, params);
//   attn.forward(latte::exec::cpu, q, k, v, out.view());
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include "latte/backends/cpu/conv_compressed.hpp"
#include "latte/backends/reference/conv_compressed.hpp"
#include "latte/core/checked_size.hpp"
#include "latte/core/shape_check.hpp"
#include "latte/core/state_storage.hpp"
#include "latte/core/tensor.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/mechanisms/conv_compressed_state.hpp"
#include "latte/policies/direction.hpp"
#include "latte/policies/execution.hpp"
#include "latte/policies/window.hpp"

namespace latte {

/// Sizes and hyper-parameters of a convolutional-compression attention.
struct ConvCompressedDims {
  index_t heads = 0;
  index_t key_dim = 0;     ///< Dk: query/key features per head (inputs and internal projections)
  index_t value_dim = 0;   ///< Dv: value features per head; the convolutions keep Dv
  index_t group_size = 0;  ///< M: tokens per compressed token (kernel = stride = M)
  index_t levels = 1;      ///< L: compressions (1 = paper 003's approach 1, > 1 = approach 2)
  /// Sliding window at every level: query t sees t - window_left <= s <= t + window_right.
  /// Default left M - 1 (M tokens including t, paper 003's window of size M, so the
  /// window and the compressed groups before t's group together cover every s <= t);
  /// default right 0 (Causal, where it must be 0) or M - 1 (Bidirectional).
  std::optional<index_t> window_left = std::nullopt;
  std::optional<index_t> window_right = std::nullopt;
};

/// The op's own weights, fp64 (converted to the compute type once, at construction).
/// Matrices are [out, in], as torch.nn.Linear / Conv1d store them; entry l of a
/// per-level list belongs to level l + 1. A torch Conv1d(Dv, Dv, M, stride=M)
/// weight w[o][d][i] of head h goes to conv_weight[l](h, i, o, d).
struct ConvCompressedParams {
  std::vector<Tensor<double, 4>> conv_weight;  ///< L x [H, M, Dv, Dv]: W^(l)_i
  std::vector<Tensor<double, 2>> conv_bias;    ///< L x [H, Dv]: b^(l)
  std::vector<Tensor<double, 3>> level_query;  ///< (L-1) x [H, Dk, Dv]: Wq^(l), l = 1..L-1
  std::vector<Tensor<double, 3>> level_key;    ///< (L-1) x [H, Dk, Dv]: Wk^(l)
  std::vector<Tensor<double, 3>> level_value;  ///< (L-1) x [H, Dv, Dv]: Wv^(l)
  Tensor<double, 3> cross_query;               ///< [H, Dk, Dv]: Wq_x, applied to y^(0)_t
  Tensor<double, 3> cross_key;                 ///< [H, Dk, Dv]: Wk_x, applied to c^(L)_j
  Tensor<double, 3> cross_value;               ///< [H, Dv, Dv]: Wv_x, applied to c^(L)_j

  /// Zero weights of the shapes `dims` needs, to be filled by the caller.
  [[nodiscard]] static ConvCompressedParams zeros(const ConvCompressedDims& dims) {
    detail::check_positive(dims.heads, "dims.heads");
    detail::check_positive(dims.key_dim, "dims.key_dim");
    detail::check_positive(dims.value_dim, "dims.value_dim");
    detail::check_positive(dims.group_size, "dims.group_size");
    detail::check_positive(dims.levels, "dims.levels");
    const index_t H = dims.heads, Dk = dims.key_dim, Dv = dims.value_dim;
    count(dims);
    ConvCompressedParams params;
    for (index_t level = 1; level <= dims.levels; ++level) {
      params.conv_weight.emplace_back(std::array<index_t, 4>{H, dims.group_size, Dv, Dv});
      params.conv_bias.emplace_back(std::array<index_t, 2>{H, Dv});
      if (level == dims.levels) break;
      params.level_query.emplace_back(std::array<index_t, 3>{H, Dk, Dv});
      params.level_key.emplace_back(std::array<index_t, 3>{H, Dk, Dv});
      params.level_value.emplace_back(std::array<index_t, 3>{H, Dv, Dv});
    }
    params.cross_query = Tensor<double, 3>({H, Dk, Dv});
    params.cross_key = Tensor<double, 3>({H, Dk, Dv});
    params.cross_value = Tensor<double, 3>({H, Dv, Dv});
    return params;
  }

  /// How many weights `dims` needs; throws latte::Error naming "dims" when
  /// that count overflows (checked before any weight is allocated).
  static index_t count(const ConvCompressedDims& dims) {
    const index_t H = dims.heads, Dk = dims.key_dim, Dv = dims.value_dim;
    const index_t per_level = detail::checked_sum(
        "dims", {detail::checked_product("dims", {dims.group_size, Dv, Dv}), Dv,
                 detail::checked_product("dims", {3, Dk, Dv}), detail::checked_product("dims", {Dv, Dv})});
    return detail::checked_count<double>("dims", {H, detail::checked_sum("dims", {dims.levels, 1}),
                                                  per_level});
  }
};

/// The caller-owned buffers ConvCompressedAttention::backward fills.
template <Real T>
struct ConvCompressedGradients {
  TensorView<T, 4> d_queries;  ///< [B, T, H, Dk], overwritten
  TensorView<T, 4> d_keys;     ///< [B, T, H, Dk], overwritten
  TensorView<T, 4> d_values;   ///< [B, T, H, Dv], overwritten
  /// The op's own weights' gradients (convolutions, biases, level and cross
  /// projections), shaped as ConvCompressedParams::zeros(dims) makes them.
  /// Accumulated (+=, summed in double inside the call); nullptr: not wanted.
  ConvCompressedParams* d_params = nullptr;
};

/// Causal convolutional-compression attention's state in a backward (training
/// in chunks, as LatteStateGradients). A state's gradient is with respect to
/// the state as saved: every level's window ring (level 0: the keys and values
/// given; level l >= 1: Wk^(l) c^(l)_j and Wv^(l) c^(l)_j), the open groups'
/// partial convolution sums and the compressed store (Wk_x c^(L)_j,
/// Wv_x c^(L)_j). Slots that hold no token (a ring not yet full, the store past
/// its floor(position / M^L) tokens, the sum of a level whose open group has
/// no tap yet) are not part of the state: their gradient is ignored when given
/// and written as 0. A gradient lives in a ConvCompressedState of the same
/// batch and context capacity at the position of the state it is the gradient of.
template <Real T>
struct ConvCompressedStateGradients {
  /// The state the forward continued from, as it was before the forward
  /// (nullptr: a fresh state at position 0).
  const ConvCompressedState<T>* initial = nullptr;
  /// The gradient of the state the forward left (nullptr: zero); copy that
  /// state, then fill its fields.
  const ConvCompressedState<T>* d_final = nullptr;
  /// Written when not null: the gradient of `initial` (make it with
  /// make_state(batch, context_capacity); it takes initial's position).
  ConvCompressedState<T>* d_initial = nullptr;
};

template <Direction Dir>
class ConvCompressedAttention {
 public:
  using direction = Dir;
  template <Real T>
  using State = ConvCompressedState<T>;
  template <Real T>
  using InputView = std::type_identity_t<TensorView<const T, 4>>;
  template <Real T>
  using StepInputView = std::type_identity_t<TensorView<const T, 3>>;
  /// What backward writes (its first members: the inputs' gradients, in call order).
  template <Real T>
  using Gradients = ConvCompressedGradients<T>;
  /// A causal backward's states (training in chunks).
  template <Real T>
  using StateGradients = ConvCompressedStateGradients<T>;

  /// `params` must have the shapes ConvCompressedParams::zeros(dims) has, with
  /// finite entries; `scale` (every softmax) defaults to 1/sqrt(Dk).
  ConvCompressedAttention(ConvCompressedDims dims, const ConvCompressedParams& params,
                          std::optional<double> scale = std::nullopt)
      : dims_(dims) {
    detail::check_positive(dims.heads, "dims.heads");
    detail::check_positive(dims.key_dim, "dims.key_dim");
    detail::check_positive(dims.value_dim, "dims.value_dim");
    detail::check_positive(dims.group_size, "dims.group_size");
    detail::check_positive(dims.levels, "dims.levels");
    window_.left = dims.window_left.value_or(dims.group_size - 1);
    window_.right = dims.window_right.value_or(Dir::is_causal ? 0 : dims.group_size - 1);
    detail::require(window_.left >= 0, "dims.window_left",
                    detail::expected_given("window size to the left", ">= 0", window_.left));
    detail::require(window_.right >= 0, "dims.window_right",
                    detail::expected_given("window size to the right", ">= 0", window_.right));
    detail::require(!Dir::is_causal || window_.right == 0, "dims.window_right",
                    detail::expected_given("window size to the right under Causal", 0,
                                           window_.right));
    ConvCompressedParams::count(dims);
    dims_.window_left = window_.left;
    dims_.window_right = window_.right;
    scale_ = scale.value_or(1.0 / std::sqrt(static_cast<double>(dims.key_dim)));
    detail::require(std::isfinite(scale_), "scale",
                    detail::expected_given("value", "a finite number", scale_));
    validate_params(params);
    fill_weights(params, weights_float_);
    fill_weights(params, weights_double_);
  }

  /// The dims with the window sides resolved.
  [[nodiscard]] const ConvCompressedDims& dims() const noexcept { return dims_; }
  [[nodiscard]] const SlidingWindow& window() const noexcept { return window_; }
  [[nodiscard]] double scale() const noexcept { return scale_; }
  /// M^L: input tokens per top-level compressed token (saturates at INT64_MAX).
  [[nodiscard]] std::int64_t tokens_per_compressed_token() const noexcept {
    return reference::tokens_per_compressed_token(dims_.group_size, dims_.levels);
  }

  /// The weights as given (fp64, exactly): with dims() and scale() what a
  /// training step needs to rebuild the op from updated weights,
  /// ConvCompressedAttention(a.dims(), updated, a.scale()).
  [[nodiscard]] ConvCompressedParams params() const {
    ConvCompressedParams params = ConvCompressedParams::zeros(dims_);
    add_flat(weights_double_, params);
    return params;
  }

  /// Throws latte::Error naming `<name>.<field>` unless `params` has the
  /// shapes ConvCompressedParams::zeros(dims()) has (a gradient buffer's check).
  void validate_shapes(const ConvCompressedParams& params, const std::string& name) const {
    validate_params(params, name, false);
  }

  /// "ConvCompressedAttention<causal>/float32": names states and benchmarks.
  template <Real T>
  [[nodiscard]] static std::string kind() {
    return std::string("ConvCompressedAttention<") + Dir::name + ">/" + dtype_name<T>();
  }

  /// Whole-sequence forward. T = 0 (or B = 0) is a no-op.
  template <exec::Policy E, Real T>
  void forward(E, InputView<T> queries, InputView<T> keys, InputView<T> values,
               TensorView<T, 4> out) const {
    require_host_backend<E>();
    validate_sequence(queries, keys, values, out);
    if (out.empty()) return;  // no output: allocate and loop over nothing
    if constexpr (std::is_same_v<E, exec::cpu_t>)
      cpu::conv_compressed_forward<Dir::is_causal>(queries, keys, values, out, weights<T>(),
                                                   static_cast<T>(scale_), window_);
    else
      reference::conv_compressed_forward<Dir::is_causal>(queries, keys, values, out, weights<T>(),
                                                         static_cast<T>(scale_), window_);
  }

  /// Gradients of a loss whose gradient with respect to `out` is `d_out`
  /// [B, T, H, Dv]: writes d_queries, d_keys, d_values and, when given,
  /// accumulates the op's weights' gradients into *d_params. The forward is
  /// recomputed; extra memory: y^(0) and its gradient [B, T, H, Dv] and the
  /// levels above (O(T / M (Dk + Dv)) per head in flight).
  template <exec::Policy E, Real T>
  void backward(E e, InputView<T> queries, InputView<T> keys, InputView<T> values,
                InputView<T> d_out, const ConvCompressedGradients<T>& gradients) const {
    run_backward(e, queries, keys, values, d_out, gradients,
                 static_cast<const ConvCompressedStateGradients<T>*>(nullptr));
  }

  /// Causal backward of a forward that continued from `states.initial`, with
  /// the gradient of the state it left (`states.d_final`); writes the gradient
  /// of the initial state into `states.d_initial`. Backward over chunks chained
  /// through these equals the backward over the whole sequence. Extra memory
  /// as above, plus, after a state with tokens, copies of the inputs and their
  /// gradients over min(R, position) + T rows (level 0's ring comes first).
  template <exec::Policy E, Real T>
    requires(Dir::is_causal)
  void backward(E e, InputView<T> queries, InputView<T> keys, InputView<T> values,
                InputView<T> d_out, const ConvCompressedGradients<T>& gradients,
                const ConvCompressedStateGradients<T>& states) const {
    run_backward(e, queries, keys, values, d_out, gradients, &states);
  }

  /// A fresh decode state for `batch` sequences that can absorb up to
  /// `context_capacity` tokens (its compressed store holds
  /// floor(context_capacity / M^L) tokens per head, allocated now).
  template <Real T>
    requires(Dir::is_causal)
  [[nodiscard]] State<T> make_state(index_t batch, index_t context_capacity) const {
    detail::check_positive(batch, "batch");
    detail::check_positive(context_capacity, "context_capacity");
    // One sequence's rings and compressed store first, so that a huge capacity is named as such.
    const ConvCompressedStateShape one = state_shape(1, context_capacity);
    const index_t per_token = detail::checked_sum("dims", {dims_.key_dim, dims_.value_dim});
    detail::checked_count<T>("context_capacity", {dims_.heads, dims_.levels, one.ring(), per_token});
    detail::checked_count<T>("context_capacity",
                             {dims_.heads, one.compressed_capacity(), per_token});
    return State<T>(kind<T>(), state_shape(batch, context_capacity));
  }

  /// Restores a state saved with State::save() by an attention of this type and
  /// dims. The buffer is checked whole before a state is allocated from it.
  template <Real T>
    requires(Dir::is_causal)
  [[nodiscard]] State<T> load_state(std::span<const std::byte> bytes) const {
    const auto header = StateStorage<T>::read_header(bytes, kind<T>());
    detail::require(header.sizes.size() == 8, "bytes",
                    detail::expected_given("saved sizes", 8, header.sizes.size()));
    const index_t batch = header.sizes.front().value, capacity = header.sizes.back().value;
    detail::require(batch >= 1, "bytes", detail::expected_given("saved batch", ">= 1", batch));
    detail::require(capacity >= 1, "bytes",
                    detail::expected_given("saved context_capacity", ">= 1", capacity));
    // The field counts of a corrupted size could overflow: bound the sizes by
    // the buffer before computing them.
    const ConvCompressedStateShape shape = state_shape(1, capacity);
    const auto elements = static_cast<index_t>(bytes.size() / sizeof(T));
    const index_t per_token = dims_.key_dim + dims_.value_dim;
    detail::require(shape.compressed_capacity() <= elements / per_token, "bytes",
                    detail::expected_given("saved context_capacity",
                                           "one that fits the buffer", capacity));
    const index_t per_head = per_token * (dims_.levels * shape.ring() +
                                          shape.compressed_capacity()) +
                             dims_.levels * dims_.value_dim;
    detail::require(batch <= elements / (dims_.heads * per_head), "bytes",
                    detail::expected_given("saved batch", "one that fits the buffer", batch));
    const ConvCompressedStateShape saved = state_shape(batch, capacity);
    StateStorage<T>::require_layout(header, State<T>::sizes_for(saved), State<T>::fields_for(saved));
    State<T> state(kind<T>(), saved);
    state.restore(bytes);  // checks the saved position too (ConvCompressedState::check_saved)
    return state;
  }

  /// Forward that continues from `state` and leaves it at the end of the
  /// sequence, so prefill + step continues exactly: O(T * (M * (Dk + Dv) + T / M^L *
  /// (Dk + Dv) + Dv^2)) per head, like the whole-sequence forward. exec::cpu runs it
  /// blocked as that forward does (a fresh state: the same blocked forward; a state
  /// with tokens: cpu::conv_compressed_forward_with_state); exec::reference steps.
  template <exec::Policy E, Real T>
    requires(Dir::is_causal)
  void forward(E, InputView<T> queries, InputView<T> keys, InputView<T> values,
               TensorView<T, 4> out, State<T>& state) const {
    require_host_backend<E>();
    validate_sequence(queries, keys, values, out);
    validate_state(state, queries.extent(0), queries.extent(1));
    if (out.empty()) return;  // no output: allocate and loop over nothing
    const index_t Tn = queries.extent(1);
    if constexpr (std::is_same_v<E, exec::cpu_t>) {
      auto carry_of = [&](index_t b, index_t h) { return state.carry(b, h); };
      if (state.position() == 0)  // a fresh state: the blocked forward fills it
        cpu::conv_compressed_forward<true>(queries, keys, values, out, weights<T>(),
                                           static_cast<T>(scale_), window_, carry_of,
                                           state.shape().ring());
      else
        cpu::conv_compressed_forward_with_state(queries, keys, values, out, weights<T>(),
                                                static_cast<T>(scale_), window_.left,
                                                state.shape().ring(), state.position(),
                                                carry_of);
      state.advance(Tn);
      return;
    }
    for (index_t t = 0; t < Tn; ++t) {
      for (index_t b = 0; b < state.batch(); ++b)
        for (index_t h = 0; h < dims_.heads; ++h)
          step_head(state, b, h, queries.row(b, t, h), keys.row(b, t, h), values.row(b, t, h),
                    out.row(b, t, h));
      state.advance(1);
    }
  }

  /// Next-token decode: inputs [B, H, Dk], [B, H, Dk], [B, H, Dv]; out [B, H, Dv].
  /// O((window + 1) * (Dk + Dv) + position / M^L * (Dk + Dv) + L * Dv^2) per head;
  /// no allocation.
  template <exec::Policy E, Real T>
    requires(Dir::is_causal)
  void step(E, State<T>& state, StepInputView<T> queries, StepInputView<T> keys,
            StepInputView<T> values, TensorView<T, 3> out) const {
    require_host_backend<E>();
    const index_t B = state.batch(), H = dims_.heads;
    validate_state(state, B, 1);
    detail::check_shape(queries, "queries", {B, H, dims_.key_dim}, "[B, H, Dk]");
    detail::check_shape(keys, "keys", {B, H, dims_.key_dim}, "[B, H, Dk]");
    detail::check_shape(values, "values", {B, H, dims_.value_dim}, "[B, H, Dv]");
    detail::check_shape(out, "out", {B, H, dims_.value_dim}, "[B, H, Dv]");
    check_outputs_distinct(queries, keys, values, out);
    for (index_t b = 0; b < B; ++b)
      for (index_t h = 0; h < H; ++h) {
        if constexpr (std::is_same_v<E, exec::cpu_t>)
          cpu::conv_compressed_step(queries.row(b, h), keys.row(b, h), values.row(b, h),
                                    out.row(b, h), state.carry(b, h), weights<T>(), h,
                                    static_cast<T>(scale_), window_.left, state.shape().ring(),
                                    state.position(), state.scratch());
        else
          step_head(state, b, h, queries.row(b, h), keys.row(b, h), values.row(b, h),
                    out.row(b, h));
      }
    state.advance(1);
  }

  /// The weights in the compute type T, flat and per head (the backends'
  /// layout): what latte/distributed/'s level pipeline computes with.
  template <Real T>
  [[nodiscard]] const reference::ConvCompressedWeights<T>& weights() const noexcept {
    if constexpr (std::is_same_v<T, float>) return weights_float_;
    else return weights_double_;
  }

 private:
  /// exec::reference and exec::cpu run this mechanism; there is no CUDA kernel yet.
  template <class E>
  static void require_host_backend() {
    static_assert(!std::is_same_v<E, exec::cuda_t>,
                  "ConvCompressedAttention has no exec::cuda kernel in this version of latte: "
                  "use latte::exec::cpu or latte::exec::reference");
  }

  [[nodiscard]] ConvCompressedStateShape state_shape(index_t batch, index_t capacity) const {
    return {.batch = batch,
            .heads = dims_.heads,
            .key_dim = dims_.key_dim,
            .value_dim = dims_.value_dim,
            .group_size = dims_.group_size,
            .levels = dims_.levels,
            .window_left = window_.left,
            .context_capacity = capacity};
  }

  /// The states of a causal backward as reference::conv_compressed_backward
  /// reads them (reference::ConvCompressedHeadStates per (batch, head)).
  template <Real T>
  struct BackwardStates {
    std::int64_t position;
    index_t ring;
    const State<T>* initial;
    const State<T>* d_final;
    State<T>* d_initial;
    template <Real U>
      requires std::is_same_v<U, T>
    [[nodiscard]] reference::ConvCompressedHeadStates<T> of(index_t b, index_t h) const noexcept {
      reference::ConvCompressedHeadStates<T> head{.position = position, .ring = ring};
      if (initial) head.initial = initial->carry(b, h);
      if (d_final) head.d_final = d_final->carry(b, h);
      if (d_initial) head.d_initial = d_initial->carry(b, h);
      return head;
    }
  };

  template <exec::Policy E, Real T>
  void run_backward(E, const TensorView<const T, 4>& queries, const TensorView<const T, 4>& keys,
                    const TensorView<const T, 4>& values, const TensorView<const T, 4>& d_out,
                    const ConvCompressedGradients<T>& gradients,
                    const ConvCompressedStateGradients<T>* states) const {
    static_assert(!std::is_same_v<E, exec::cuda_t> && !exec::cuda_unavailable<E>,
                  "ConvCompressedAttention::backward runs on exec::reference and exec::cpu (no "
                  "CUDA backward yet)");
    static_assert(exec::implemented<E>, "this execution backend is not implemented yet");
    validate_backward(queries, keys, values, d_out, gradients);
    const index_t B = queries.extent(0), Tn = queries.extent(1);
    if (states) validate_state_gradients(*states, B, Tn);
    const State<T>* initial = states ? states->initial : nullptr;
    const State<T>* d_final = states ? states->d_final : nullptr;
    State<T>* d_initial = states ? states->d_initial : nullptr;
    if constexpr (Dir::is_causal) {
      if (d_initial) {  // initial's position and sizes (else d_final's, else its own), zeros
        if (initial) *d_initial = *initial;
        else if (d_final) *d_initial = make_state<T>(B, d_final->context_capacity());
        else *d_initial = make_state<T>(B, std::max<index_t>(d_initial->context_capacity(), 1));
        for (int field = 0; field < 5; ++field)
          std::fill_n(d_initial->field(field), d_initial->field_size(field), T(0));
      }
    }
    std::optional<reference::ConvCompressedWeightGradients> flat;
    if (gradients.d_params) flat.emplace(zero_weight_gradients());
    using Parts = std::conditional_t<std::is_same_v<E, exec::cpu_t>, cpu::ConvCompressedParts,
                                     reference::ReferenceConvCompressedParts>;
    if (Tn > 0 && B > 0) {
      if constexpr (Dir::is_causal) {
        const ConvCompressedStateShape shape =
            initial ? initial->shape() : (d_final ? d_final->shape() : state_shape(B, 1));
        const BackwardStates<T> ends{initial ? initial->position() : 0, shape.ring(), initial,
                                     d_final, d_initial};
        reference::conv_compressed_backward<true, Parts>(
            queries, keys, values, d_out, gradients.d_queries, gradients.d_keys,
            gradients.d_values, weights<T>(), static_cast<T>(scale_), window_,
            flat ? &*flat : nullptr, ends);
      } else {
        reference::conv_compressed_backward<false, Parts>(
            queries, keys, values, d_out, gradients.d_queries, gradients.d_keys,
            gradients.d_values, weights<T>(), static_cast<T>(scale_), window_,
            flat ? &*flat : nullptr);
      }
    } else if constexpr (Dir::is_causal) {  // no token: the initial state's gradient is d_final's
      if (d_initial && d_final) copy_live_gradients(*d_final, *d_initial, B);
    }
    if (flat) add_flat(*flat, *gradients.d_params);
  }

  /// d_initial = d_final on the fields' live slots (a backward over no token).
  template <Real T>
  void copy_live_gradients(const State<T>& d_final, State<T>& d_initial, index_t batch) const {
    const ConvCompressedStateShape& s = d_initial.shape();
    const reference::ConvLevelGeometry geometry(d_initial.position(), 0, s.group_size, s.levels);
    const index_t R = s.ring(), Dk = s.key_dim, Dv = s.value_dim;
    for (index_t b = 0; b < batch; ++b)
      for (index_t h = 0; h < s.heads; ++h) {
        const reference::ConvCompressedCarry<const T> from = d_final.carry(b, h);
        const reference::ConvCompressedCarry<T> to = d_initial.carry(b, h);
        for (index_t level = 0; level < s.levels; ++level) {
          const std::int64_t count = geometry.before[static_cast<std::size_t>(level)];
          for (std::int64_t token = count - std::min<std::int64_t>(R, count); token < count; ++token) {
            const index_t slot = level * R + static_cast<index_t>(token % R);
            std::copy_n(from.window_keys + slot * Dk, Dk, to.window_keys + slot * Dk);
            std::copy_n(from.window_values + slot * Dv, Dv, to.window_values + slot * Dv);
          }
          if (geometry.taps_after(level + 1, s.group_size) > 0)
            std::copy_n(from.group_sums + level * Dv, Dv, to.group_sums + level * Dv);
        }
        const auto stored = static_cast<index_t>(geometry.before[static_cast<std::size_t>(s.levels)]);
        std::copy_n(from.compressed_keys, stored * Dk, to.compressed_keys);
        std::copy_n(from.compressed_values, stored * Dv, to.compressed_values);
      }
  }

  template <Real T>
  void validate_state_gradients(const ConvCompressedStateGradients<T>& states, index_t batch,
                                index_t tokens) const {
    const State<T>* sized = states.initial ? states.initial : states.d_final;
    if (sized == nullptr) return;  // d_initial alone: a fresh state's gradient, remade below
    detail::require_backward_states(
        states, kind<T>(), State<T>::sizes_for(state_shape(batch, sized->context_capacity())),
        tokens);
    if (states.initial) {
      validate_state(*states.initial, batch, tokens);  // room for the tokens
    } else {
      detail::require(tokens <= sized->context_capacity(), "states.d_final",
                      detail::expected_given("context_capacity", ">= " + std::to_string(tokens),
                                             sized->context_capacity()));
    }
  }

  template <Real T>
  void step_head(State<T>& state, index_t b, index_t h, const T* q, const T* k, const T* v,
                 T* out) const {
    reference::conv_compressed_step(q, k, v, out, state.carry(b, h), weights<T>(), h,
                                    static_cast<T>(scale_), window_.left, state.shape().ring(),
                                    state.position(), state.scratch());
  }

  // -- parameters ------------------------------------------------------------

  template <std::size_t N>
  static void check_param(const Tensor<double, N>& tensor, const std::string& name,
                          const std::array<index_t, N>& expected, std::string_view layout,
                          bool finite = true) {
    detail::check_shape(tensor.cview(), name, expected, layout);
    for (index_t i = 0; i < tensor.size() && finite; ++i)
      if (!std::isfinite(tensor.data()[i]))
        throw Error(name, "every weight must be finite (flat index " + std::to_string(i) +
                              " is " + std::to_string(tensor.data()[i]) + ")");
  }

  template <class List>
  static void check_count(const List& list, std::string_view name, index_t expected,
                          std::string_view what) {
    detail::require(static_cast<index_t>(list.size()) == expected, name,
                    detail::expected_given(what, expected, list.size()));
  }

  /// The shapes (and, for weights, finiteness) of a ConvCompressedParams named `prefix`.
  void validate_params(const ConvCompressedParams& p, const std::string& prefix = "params",
                       bool finite = true) const {
    const index_t H = dims_.heads, Dk = dims_.key_dim, Dv = dims_.value_dim, L = dims_.levels;
    auto name = [&](const char* field) { return prefix + "." + field; };
    check_count(p.conv_weight, name("conv_weight"), L, "number of tensors (one per level)");
    check_count(p.conv_bias, name("conv_bias"), L, "number of tensors (one per level)");
    const char* below_top = "number of tensors (one per level below the top, L - 1)";
    check_count(p.level_query, name("level_query"), L - 1, below_top);
    check_count(p.level_key, name("level_key"), L - 1, below_top);
    check_count(p.level_value, name("level_value"), L - 1, below_top);
    auto at = [&](const char* field, index_t i) { return name(field) + "[" + std::to_string(i) + "]"; };
    for (index_t l = 0; l < L; ++l) {
      check_param<4>(p.conv_weight[l], at("conv_weight", l), {H, dims_.group_size, Dv, Dv},
                     "[H, M, Dv, Dv]", finite);
      check_param<2>(p.conv_bias[l], at("conv_bias", l), {H, Dv}, "[H, Dv]", finite);
    }
    for (index_t l = 0; l + 1 < L; ++l) {
      check_param<3>(p.level_query[l], at("level_query", l), {H, Dk, Dv}, "[H, Dk, Dv]", finite);
      check_param<3>(p.level_key[l], at("level_key", l), {H, Dk, Dv}, "[H, Dk, Dv]", finite);
      check_param<3>(p.level_value[l], at("level_value", l), {H, Dv, Dv}, "[H, Dv, Dv]", finite);
    }
    check_param<3>(p.cross_query, name("cross_query"), {H, Dk, Dv}, "[H, Dk, Dv]", finite);
    check_param<3>(p.cross_key, name("cross_key"), {H, Dk, Dv}, "[H, Dk, Dv]", finite);
    check_param<3>(p.cross_value, name("cross_value"), {H, Dv, Dv}, "[H, Dv, Dv]", finite);
  }

  template <Real T>
  void validate_backward(const TensorView<const T, 4>& q, const TensorView<const T, 4>& k,
                         const TensorView<const T, 4>& v, const TensorView<const T, 4>& d_out,
                         const ConvCompressedGradients<T>& gradients) const {
    check_view(q, "queries");
    const index_t B = q.extent(0), Tn = q.extent(1), H = dims_.heads, Dk = dims_.key_dim,
                  Dv = dims_.value_dim;
    detail::check_shape(q, "queries", {B, Tn, H, Dk}, "[B, T, H, Dk]");
    detail::check_shape(k, "keys", {B, Tn, H, Dk}, "[B, T, H, Dk]");
    detail::check_shape(v, "values", {B, Tn, H, Dv}, "[B, T, H, Dv]");
    detail::check_shape(d_out, "d_out", {B, Tn, H, Dv}, "[B, T, H, Dv]");
    // Named references, not a structured binding: clang 14 cannot capture those.
    const TensorView<T, 4>& dq = gradients.d_queries;
    const TensorView<T, 4>& dk = gradients.d_keys;
    const TensorView<T, 4>& dv = gradients.d_values;
    detail::check_shape(dq, "gradients.d_queries", {B, Tn, H, Dk}, "[B, T, H, Dk]");
    detail::check_shape(dk, "gradients.d_keys", {B, Tn, H, Dk}, "[B, T, H, Dk]");
    detail::check_shape(dv, "gradients.d_values", {B, Tn, H, Dv}, "[B, T, H, Dv]");
    const auto in = std::tuple(detail::named(q, "queries"), detail::named(k, "keys"),
                               detail::named(v, "values"), detail::named(d_out, "d_out"));
    std::apply([&](const auto&... inputs) {
      detail::check_output(dq, "gradients.d_queries", inputs...);
      detail::check_output(dk, "gradients.d_keys", inputs..., detail::named(dq, "gradients.d_queries"));
      detail::check_output(dv, "gradients.d_values", inputs..., detail::named(dq, "gradients.d_queries"),
                           detail::named(dk, "gradients.d_keys"));
    }, in);
    if (gradients.d_params) validate_params(*gradients.d_params, "gradients.d_params", false);
  }

  /// into += the flat fp64 weights (fill_weights' layout), tensor by tensor.
  static void add_flat(const reference::ConvCompressedWeights<double>& flat, ConvCompressedParams& into) {
    std::size_t i = 0;
    auto add = [&i](const std::vector<double>& from, auto& tensor) {
      for (index_t e = 0; e < tensor.size(); ++e) tensor.data()[e] += from[i++];
    };
    for (auto& tensor : into.conv_weight) add(flat.conv_weight, tensor);
    i = 0;
    for (auto& tensor : into.conv_bias) add(flat.conv_bias, tensor);
    i = 0;
    for (auto& tensor : into.level_query) add(flat.level_query, tensor);
    i = 0;
    for (auto& tensor : into.level_key) add(flat.level_key, tensor);
    i = 0;
    for (auto& tensor : into.level_value) add(flat.level_value, tensor);
    i = 0;
    add(flat.cross_query, into.cross_query);
    i = 0;
    add(flat.cross_key, into.cross_key);
    i = 0;
    add(flat.cross_value, into.cross_value);
  }

  /// Zeros shaped as the flat weights this object holds (weights_double_, which
  /// fill_weights laid out), each field sized once: the backward's accumulator of
  /// the weights' gradients.
  [[nodiscard]] reference::ConvCompressedWeightGradients zero_weight_gradients() const {
    reference::ConvCompressedWeightGradients w;
    w.heads = weights_double_.heads;
    w.key_dim = weights_double_.key_dim;
    w.value_dim = weights_double_.value_dim;
    w.group_size = weights_double_.group_size;
    w.levels = weights_double_.levels;
    using Field = std::vector<double> reference::ConvCompressedWeightGradients::*;
    for (Field field : {&reference::ConvCompressedWeightGradients::conv_weight,
                        &reference::ConvCompressedWeightGradients::conv_bias,
                        &reference::ConvCompressedWeightGradients::level_query,
                        &reference::ConvCompressedWeightGradients::level_key,
                        &reference::ConvCompressedWeightGradients::level_value,
                        &reference::ConvCompressedWeightGradients::cross_query,
                        &reference::ConvCompressedWeightGradients::cross_key,
                        &reference::ConvCompressedWeightGradients::cross_value})
      (w.*field).assign((weights_double_.*field).size(), 0.0);
    return w;
  }

  template <Real T>
  void fill_weights(const ConvCompressedParams& p, reference::ConvCompressedWeights<T>& w) const {
    w.heads = dims_.heads;
    w.key_dim = dims_.key_dim;
    w.value_dim = dims_.value_dim;
    w.group_size = dims_.group_size;
    w.levels = dims_.levels;
    auto append = [](std::vector<T>& flat, const auto& tensor) {
      for (index_t i = 0; i < tensor.size(); ++i) flat.push_back(static_cast<T>(tensor.data()[i]));
    };
    for (const auto& tensor : p.conv_weight) append(w.conv_weight, tensor);
    for (const auto& tensor : p.conv_bias) append(w.conv_bias, tensor);
    for (const auto& tensor : p.level_query) append(w.level_query, tensor);
    for (const auto& tensor : p.level_key) append(w.level_key, tensor);
    for (const auto& tensor : p.level_value) append(w.level_value, tensor);
    append(w.cross_query, p.cross_query);
    append(w.cross_key, p.cross_key);
    append(w.cross_value, p.cross_value);
  }

  // -- validation ------------------------------------------------------------

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

  template <class Q, class K, class V, class O>
  static void check_outputs_distinct(const Q& q, const K& k, const V& v, const O& out) {
    detail::check_output(out, "out", detail::named(q, "queries"), detail::named(k, "keys"),
                         detail::named(v, "values"));
  }

 public:
  /// Throws latte::Error unless `state` belongs to this attention (kind and sizes)
  /// and can take `new_tokens` more tokens of `batch` sequences (capacity): the
  /// check every call with a state makes first. Public so that a caller running
  /// many states (forward_packed) checks them all before any of them moves.
  /// Allocation-free on success (step calls it per token).
  template <Real T>
  void validate_state(const State<T>& state, index_t batch, index_t new_tokens) const {
    const ConvCompressedStateShape& s = state.shape();
    const bool matches = state.kind() == kinds_.template get<T>() && s.batch == batch &&
                         s.heads == dims_.heads && s.key_dim == dims_.key_dim &&
                         s.value_dim == dims_.value_dim && s.group_size == dims_.group_size &&
                         s.levels == dims_.levels && s.window_left == window_.left;
    if (!matches)
      state.require_matches(kind<T>(),
                            State<T>::sizes_for(state_shape(batch, s.context_capacity)));
    state.require_room(new_tokens);
    if (state.position() + new_tokens > s.context_capacity)  // the message only on failure
      detail::require(false, "state",
                      detail::expected_given("context_capacity for " +
                                                 std::to_string(state.position() + new_tokens) +
                                                 " tokens",
                                             ">= " + std::to_string(state.position() + new_tokens),
                                             s.context_capacity));
  }

 private:
  ConvCompressedDims dims_;
  SlidingWindow window_{};
  double scale_ = 1.0;
  detail::KindNames kinds_{kind<float>(), kind<double>()};
  reference::ConvCompressedWeights<float> weights_float_;
  reference::ConvCompressedWeights<double> weights_double_;
};

}  // namespace latte
