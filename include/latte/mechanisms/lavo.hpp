#pragma once
// latte::Lavo<Direction> — Linear Attention Via Orthogonal memory (paper 002).
//
// Per batch and head, with queries q_t, keys k_t, values v_t in R^d and
// orthonormal bases B = [b_1 .. b_r]^T in R^{r x d} (r <= d):
//   CODE (eq. 3):  H = (1/n) sum_s B f_s in R^r,  X~ = B (.) H (row i is H_i b_i)
//   read (eq. 6):  g(q) = softmax(scale X~ q)^T X~
//   F_local(t)  = sum_s softmax_s(scale q_t . k_s + P[(s - t) + w - 1]) v_s    (§3.2, §3.3)
//   o_t         = (F_local(t) + g_t(q_t)) / 2                                  (§3.2)
// Causal: t sees keys s = t - w + 1 .. t (the w most recent tokens, crossing the
// window border), and its memory compresses f_s = F_local(s) of the tokens of
// the complete windows before t's window (window j holds positions [j w, (j+1) w)):
// n = floor(t / w) w tokens. Decode keeps O(w * d + r) per head (LavoState).
// Bidirectional: t sees keys |s - t| <= w - 1 (all 2w - 1 entries of P) and the
// memory compresses F_local of every token. Cross-attention (§3.4, eqs. 5-6):
// cross_forward(queries, source): X~ = CODE(source), o_t = g(q_t), no local part.
//
// Decisions where the paper is silent (documented parameters or conventions):
//  - What is compressed: the locally attended outputs F_local (§3.2: "we perform
//    local attention on the tokens in each window before compressing the global
//    context"), the same F_local that enters o_t. The memory is both the keys and
//    the values of the read, so queries, keys and values share one size d.
//  - scale: the paper writes softmax(q^T K^T) and softmax(q^T X~^T) without a
//    scale; fairseq-style code scales q once, so one `scale` (default 1/sqrt(d))
//    multiplies q . k in the local part and X~ q in the read; P is added after it.
//  - Empty memory (the first window under Causal; an empty cross source):
//    LavoEmptyMemory::zero (default) takes the mean of no tokens as H = 0, so
//    X~ = 0 and g = 0: o_t = F_local / 2, what a zero-initialised memory gives;
//    LavoEmptyMemory::local_only gives o_t = F_local instead.
//  - Bidirectional local band |s - t| <= w - 1 and whole-sequence memory: §3.2
//    describes the causal split only; this is the band P (2w - 1 entries) covers.
//  - Bases and bias are per head: [H, r, d] and [H, 2w - 1]. Any finite B is
//    accepted (a trained B may drift from orthonormality); orthonormal_bases()
//    builds the paper's initialisation and is the default. P defaults to zeros.
//
//   latte::Lavo<latte::Causal> attn({.heads = 8, .dim = 64, .bases = 64, .window = 64});
//   attn.forward(latte::exec::cpu, q, k, v, out.view());
//
// backward(exec, q, k, v, d_out, gradients[, state_gradients]) and
// cross_backward(exec, queries, source, d_out, gradients) give the gradients of
// a loss with the given d_out, P's and B's included (docs/backward.md "LAVO").
//
// Backends: exec::reference (scalar loops, backends/reference/lavo.hpp) and
// exec::cpu (blocked GEMM/SIMD kernels, backends/cpu/lavo.hpp); no exec::cuda yet.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "latte/backends/cpu/lavo.hpp"
#include "latte/backends/reference/lavo.hpp"
#include "latte/core/orthonormal_basis.hpp"
#include "latte/core/checked_size.hpp"
#include "latte/core/shape_check.hpp"
#include "latte/core/state_storage.hpp"
#include "latte/core/tensor.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/mechanisms/lavo_gradients.hpp"
#include "latte/mechanisms/lavo_state.hpp"
#include "latte/policies/direction.hpp"
#include "latte/policies/execution.hpp"

namespace latte {

/// Sizes fixed by a LAVO layer's weights.
struct LavoDims {
  index_t heads = 0;
  index_t dim = 0;     ///< d: query, key and value features per head
  index_t bases = 0;   ///< r: orthonormal bases per head, 1 <= r <= d
  index_t window = 0;  ///< w: window of context dissection and of the local part, >= 1
};

/// What o_t is while the memory holds no token (see the header comment).
enum class LavoEmptyMemory {
  zero,        ///< H = 0 reads F_global = 0: o_t = F_local / 2 (default)
  local_only,  ///< o_t = F_local
};

/// LAVO's weights and options.
struct LavoParams {
  /// B per head, [H, r, d]. Empty (0 x 0 x 0): orthonormal_bases(H, r, d, basis_seed).
  Tensor<double, 3> bases{};
  std::uint64_t basis_seed = 0;
  /// P per head, [H, 2w - 1] (index (s - t) + w - 1). Empty (0 x 0): zeros, no bias.
  Tensor<double, 2> relative_bias{};
  /// Multiplies q . k and X~ q; default 1/sqrt(d).
  std::optional<double> scale{};
  LavoEmptyMemory empty_memory = LavoEmptyMemory::zero;
};

template <Direction Dir>
class Lavo {
 public:
  using direction = Dir;
  template <Real T>
  using State = LavoState<T>;
  template <Real T>
  using InputView = std::type_identity_t<TensorView<const T, 4>>;
  template <Real T>
  using StepInputView = std::type_identity_t<TensorView<const T, 3>>;
  /// What backward writes (its first members: the inputs' gradients, in call order).
  template <Real T>
  using Gradients = LavoGradients<T>;
  /// A causal backward's states (training in chunks).
  template <Real T>
  using StateGradients = LavoStateGradients<T>;

  /// The largest window accepted (2w - 1 and the w x d ring must stay representable).
  static constexpr index_t max_window = index_t{1} << 30;

  explicit Lavo(LavoDims dims, LavoParams params = {})
      : dims_(dims), empty_memory_(params.empty_memory) {
    detail::check_positive(dims.heads, "dims.heads");
    detail::check_positive(dims.dim, "dims.dim");
    detail::check_positive(dims.bases, "dims.bases");
    detail::check_positive(dims.window, "dims.window");
    detail::require(dims.window <= max_window, "dims.window",
                    detail::expected_given("window size", "<= " + std::to_string(max_window),
                                           dims.window));
    detail::require(dims.bases <= dims.dim, "dims.bases",
                    detail::expected_given("orthonormal bases r in R^d (r <= d = " +
                                               std::to_string(dims.dim) + ")",
                                           "<= " + std::to_string(dims.dim), dims.bases));
    detail::require(params.empty_memory == LavoEmptyMemory::zero ||
                        params.empty_memory == LavoEmptyMemory::local_only,
                    "empty_memory",
                    detail::expected_given("value", "LavoEmptyMemory::zero or ::local_only",
                                           static_cast<int>(params.empty_memory)));
    const index_t H = dims.heads, r = dims.bases, d = dims.dim, bias_length = 2 * dims.window - 1;
    detail::checked_count<double>("dims", {H, r, d});                 // the bases
    detail::checked_count<double>("dims.window", {H, dims.window, d});  // one sequence's ring
    if (params.bases.size() == 0 && params.bases.extents() == std::array<index_t, 3>{}) {
      bases_ = orthonormal_bases(H, r, d, params.basis_seed);
    } else {
      const std::array<index_t, 3> expected{H, r, d};
      detail::require(params.bases.extents() == expected, "bases",
                      detail::expected_given("shape [H, r, d]", format_extents(expected),
                                             format_extents(params.bases.extents())));
      require_finite(params.bases.data(), params.bases.size(), "bases");
      bases_ = std::move(params.bases);
    }
    if (params.relative_bias.size() == 0 &&
        params.relative_bias.extents() == std::array<index_t, 2>{}) {
      relative_bias_ = Tensor<double, 2>({H, bias_length}, 0.0);
    } else {
      const std::array<index_t, 2> expected{H, bias_length};
      detail::require(params.relative_bias.extents() == expected, "relative_bias",
                      detail::expected_given("shape [H, 2w - 1]", format_extents(expected),
                                             format_extents(params.relative_bias.extents())));
      require_finite(params.relative_bias.data(), params.relative_bias.size(), "relative_bias");
      relative_bias_ = std::move(params.relative_bias);
    }
    scale_ = params.scale.value_or(1.0 / std::sqrt(static_cast<double>(d)));
    detail::require(std::isfinite(scale_), "scale",
                    detail::expected_given("value", "a finite number", scale_));
    basis_f32_.assign(bases_.data(), bases_.data() + bases_.size());
    basis_f64_.assign(bases_.data(), bases_.data() + bases_.size());
    bias_f32_.assign(relative_bias_.data(), relative_bias_.data() + relative_bias_.size());
    bias_f64_.assign(relative_bias_.data(), relative_bias_.data() + relative_bias_.size());
  }

  [[nodiscard]] const LavoDims& dims() const noexcept { return dims_; }
  /// B [H, r, d] as used (the given bases, or the seeded orthonormal ones).
  [[nodiscard]] const Tensor<double, 3>& bases() const noexcept { return bases_; }
  /// P [H, 2w - 1] as used.
  [[nodiscard]] const Tensor<double, 2>& relative_bias() const noexcept { return relative_bias_; }
  [[nodiscard]] double scale() const noexcept { return scale_; }
  [[nodiscard]] LavoEmptyMemory empty_memory() const noexcept { return empty_memory_; }

  /// "Lavo<causal>/float32": names states and benchmarks.
  template <Real T>
  [[nodiscard]] static std::string kind() {
    return std::string("Lavo<") + Dir::name + ">/" + dtype_name<T>();
  }

  /// Whole-sequence self-attention: queries, keys, values [B, T, H, d]; out [B, T, H, d].
  /// T = 0 (or B = 0) is a no-op.
  template <exec::Policy E, Real T>
  void forward(E, InputView<T> queries, InputView<T> keys, InputView<T> values,
               TensorView<T, 4> out) const {
    require_host_backend<E>();
    validate_sequence(queries, keys, values, out);
    if (out.empty()) return;  // no output: allocate and loop over nothing
    if constexpr (std::is_same_v<E, exec::cpu_t>) {
      auto head_of = [&](index_t h) { return head<T>(h); };
      if constexpr (Dir::is_causal)
        cpu::lavo_causal_forward(queries, keys, values, out, 0, head_of,
                                 [](index_t, index_t) { return reference::LavoCarry<T>{}; });
      else
        cpu::lavo_bidirectional_forward(queries, keys, values, out, head_of);
    } else if constexpr (Dir::is_causal) {
      // A ring of min(w, T) slots suffices for a sequence that starts at position 0.
      const index_t capacity = std::max<index_t>(1, std::min(dims_.window, queries.extent(1)));
      const index_t d = dims_.dim, r = dims_.bases;
      std::vector<T> storage(static_cast<std::size_t>(2 * capacity * d + 3 * r +
                                                      reference::lavo_step_scratch(d, r)));
      T* base = storage.data();
      const reference::LavoCarry<T> carry{base,         base + capacity * d, capacity,
                                          base + 2 * capacity * d,
                                          base + 2 * capacity * d + r,
                                          base + 2 * capacity * d + 2 * r};
      T* scratch = base + 2 * capacity * d + 3 * r;
      reference::lavo_causal_forward(
          queries, keys, values, out, 0, [&](index_t h) { return head<T>(h); },
          [&](index_t, index_t) {
            std::fill(storage.begin(), storage.end(), T(0));
            return std::pair{carry, scratch};
          });
    } else {
      reference::lavo_bidirectional_forward(queries, keys, values, out,
                                            [&](index_t h) { return head<T>(h); });
    }
  }

  /// Cross-attention (paper 002 §3.4): queries [B, Tq, H, d] read the orthogonal
  /// memory of `source` [B, Ts, H, d] (the source features to compress, already
  /// projected per head); out [B, Tq, H, d]. No local part, no causal limit.
  /// Ts = 0 is an empty memory and reads zero.
  template <exec::Policy E, Real T>
  void cross_forward(E, InputView<T> queries, InputView<T> source, TensorView<T, 4> out) const {
    require_host_backend<E>();
    check_view(queries, "queries");
    const index_t B = queries.extent(0), Tq = queries.extent(1), H = dims_.heads, d = dims_.dim;
    detail::check_shape(queries, "queries", {B, Tq, H, d}, "[B, Tq, H, d]");
    check_view(source, "source");
    detail::check_shape(source, "source", {B, source.extent(1), H, d}, "[B, Ts, H, d]");
    detail::check_shape(out, "out", {B, Tq, H, d}, "[B, Tq, H, d]");
    detail::check_distinct_elements(out, "out");
    detail::check_no_overlap(out, "out", queries, "queries");
    detail::check_no_overlap(out, "out", source, "source");
    if (out.empty()) return;  // no output: allocate and loop over nothing
    if constexpr (std::is_same_v<E, exec::cpu_t>)
      cpu::lavo_cross_forward(queries, source, out, [&](index_t h) { return head<T>(h); });
    else
      reference::lavo_cross_forward(queries, source, out, [&](index_t h) { return head<T>(h); });
  }

  /// Gradients of a loss whose gradient with respect to `out` is `d_out`
  /// [B, T, H, d]: writes d_queries, d_keys, d_values and, when given,
  /// accumulates d_relative_bias [H, 2w - 1] and d_bases [H, r, d]. The forward
  /// is recomputed from the inputs; extra memory is O(T (d + r)) per (batch,
  /// head) in flight.
  template <exec::Policy E, Real T>
  void backward(E e, InputView<T> queries, InputView<T> keys, InputView<T> values,
                InputView<T> d_out, const LavoGradients<T>& gradients) const {
    run_backward(e, queries, keys, values, d_out, gradients,
                 static_cast<const LavoStateGradients<T>*>(nullptr));
  }

  /// Causal backward of a forward that continued from `states.initial`, with
  /// the gradient of the state it left (`states.d_final`); writes the gradient
  /// of the initial state into `states.d_initial`. Backward over chunks chained
  /// through these equals the backward over the whole sequence.
  template <exec::Policy E, Real T>
    requires(Dir::is_causal)
  void backward(E e, InputView<T> queries, InputView<T> keys, InputView<T> values,
                InputView<T> d_out, const LavoGradients<T>& gradients,
                const LavoStateGradients<T>& states) const {
    run_backward(e, queries, keys, values, d_out, gradients, &states);
  }

  /// Gradients of cross_forward: writes d_queries [B, Tq, H, d] and d_source
  /// [B, Ts, H, d]; accumulates d_bases [H, r, d] when given.
  template <exec::Policy E, Real T>
  void cross_backward(E, InputView<T> queries, InputView<T> source, InputView<T> d_out,
                      const LavoCrossGradients<T>& gradients) const {
    require_host_backward<E>();
    check_view(queries, "queries");
    const index_t B = queries.extent(0), Tq = queries.extent(1), Ts = source.extent(1),
                  H = dims_.heads, d = dims_.dim;
    detail::check_shape(queries, "queries", {B, Tq, H, d}, "[B, Tq, H, d]");
    check_view(source, "source");
    detail::check_shape(source, "source", {B, Ts, H, d}, "[B, Ts, H, d]");
    detail::check_shape(d_out, "d_out", {B, Tq, H, d}, "[B, Tq, H, d]");
    const TensorView<T, 4>& dq = gradients.d_queries;
    const TensorView<T, 4>& ds = gradients.d_source;
    detail::check_shape(dq, "gradients.d_queries", {B, Tq, H, d}, "[B, Tq, H, d]");
    detail::check_shape(ds, "gradients.d_source", {B, Ts, H, d}, "[B, Ts, H, d]");
    const auto inputs = std::tuple(detail::named(queries, "queries"), detail::named(source, "source"),
                                   detail::named(d_out, "d_out"));
    std::apply([&](const auto&... in) {
      detail::check_output(dq, "gradients.d_queries", in...);
      detail::check_output(ds, "gradients.d_source", in..., detail::named(dq, "gradients.d_queries"));
      check_bases_gradient(gradients.d_bases, in..., detail::named(dq, "gradients.d_queries"),
                           detail::named(ds, "gradients.d_source"));
    }, inputs);
    ParameterSums sums(gradients.d_bases, {});
    if (B > 0) {
      if constexpr (std::is_same_v<E, exec::cpu_t>)
        cpu::lavo_cross_backward(queries, source, d_out, dq, ds,
                                 [&](index_t h) { return head<T>(h); }, sums.pointers());
      else
        reference::lavo_cross_backward(queries, source, d_out, dq, ds,
                                       [&](index_t h) { return head<T>(h); }, sums.pointers());
    }
    sums.add_to(gradients.d_bases, {});
  }

  /// A fresh decode state for `batch` sequences whose first token sits at
  /// absolute position `first_position` (window borders are counted from
  /// position 0: a state started later is a slice's, whose ring and sums
  /// latte/distributed/ fills from the slices before it).
  template <Real T>
    requires(Dir::is_causal)
  [[nodiscard]] State<T> make_state(index_t batch, std::int64_t first_position = 0) const {
    detail::check_positive(batch, "batch");
    detail::require(first_position >= 0, "first_position",
                    detail::expected_given("value", ">= 0", first_position));
    return State<T>(kind<T>(), batch, dims_.heads, dims_.dim, dims_.bases, dims_.window,
                    first_position);
  }

  /// Restores a state saved with State::save() by an attention of this type and
  /// these dims. The buffer is checked whole before a state is allocated from it.
  template <Real T>
    requires(Dir::is_causal)
  [[nodiscard]] State<T> load_state(std::span<const std::byte> bytes) const {
    const auto header = StateStorage<T>::read_header(bytes, kind<T>());
    const LavoDims& d = dims_;
    const index_t batch = StateStorage<T>::saved_batch(
        header, bytes, State<T>::sizes_for(1, d.heads, d.dim, d.bases, d.window),
        [&](index_t b) { return State<T>::fields_for(b, d.heads, d.dim, d.bases, d.window); });
    StateStorage<T>::require_layout(
        header, State<T>::sizes_for(batch, d.heads, d.dim, d.bases, d.window),
        State<T>::fields_for(batch, d.heads, d.dim, d.bases, d.window));
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
    require_host_backend<E>();
    validate_sequence(queries, keys, values, out);
    validate_state(state, queries.extent(0), queries.extent(1));
    if (out.empty()) return;  // no output: allocate and loop over nothing
    if constexpr (std::is_same_v<E, exec::cpu_t>)
      cpu::lavo_causal_forward(
          queries, keys, values, out, state.position(), [&](index_t h) { return head<T>(h); },
          [&](index_t b, index_t h) { return state.carry(b, h); });
    else
      reference::lavo_causal_forward(
          queries, keys, values, out, state.position(), [&](index_t h) { return head<T>(h); },
          [&](index_t b, index_t h) { return std::pair{state.carry(b, h), state.scratch()}; });
    state.advance(queries.extent(1));
  }

  /// Advances `state` over queries, keys and values [B, T, H, d] without
  /// returning outputs. LAVO's memory sums the tokens' locally attended
  /// outputs, so this runs the forward into a buffer of its own ([B, T, H, d])
  /// and drops the outputs: the state forward would leave. For sequence
  /// parallelism (latte/distributed/).
  template <exec::Policy E, Real T>
    requires(Dir::is_causal)
  void absorb(E e, InputView<T> queries, InputView<T> keys, InputView<T> values,
              State<T>& state) const {
    check_view(queries, "queries");
    Tensor<T, 4> dropped({queries.extent(0), queries.extent(1), dims_.heads, dims_.dim});
    forward(e, queries, keys, values, dropped.view(), state);
  }

  /// Next-token decode: queries, keys, values [B, H, d]; out [B, H, d].
  /// O(w * d + r * d) per head, independent of the tokens already absorbed; no allocation.
  template <exec::Policy E, Real T>
    requires(Dir::is_causal)
  void step(E, State<T>& state, StepInputView<T> queries, StepInputView<T> keys,
            StepInputView<T> values, TensorView<T, 3> out) const {
    require_host_backend<E>();
    const index_t B = state.batch(), H = dims_.heads, d = dims_.dim;
    validate_state(state, B, 1);
    detail::check_shape(queries, "queries", {B, H, d}, "[B, H, d]");
    detail::check_shape(keys, "keys", {B, H, d}, "[B, H, d]");
    detail::check_shape(values, "values", {B, H, d}, "[B, H, d]");
    detail::check_shape(out, "out", {B, H, d}, "[B, H, d]");
    check_outputs_distinct(queries, keys, values, out);
    for (index_t b = 0; b < B; ++b)
      for (index_t h = 0; h < H; ++h) {
        if constexpr (std::is_same_v<E, exec::cpu_t>)
          cpu::lavo_causal_step(queries.row(b, h), keys.row(b, h), values.row(b, h),
                                out.row(b, h), state.carry(b, h), head<T>(h), state.position(),
                                state.scratch());
        else
          reference::lavo_causal_step(queries.row(b, h), keys.row(b, h), values.row(b, h),
                                      out.row(b, h), state.carry(b, h), head<T>(h),
                                      state.position(), state.scratch());
      }
    state.advance(1);
  }

  // The same calls without an execution tag run on exec::default_t (exec::cpu).
  template <Real T>
  void forward(InputView<T> queries, InputView<T> keys, InputView<T> values,
               TensorView<T, 4> out) const {
    forward(exec::default_t{}, queries, keys, values, out);
  }
  template <Real T>
    requires(Dir::is_causal)
  void forward(InputView<T> queries, InputView<T> keys, InputView<T> values, TensorView<T, 4> out,
               State<T>& state) const {
    forward(exec::default_t{}, queries, keys, values, out, state);
  }
  template <Real T>
    requires(Dir::is_causal)
  void step(State<T>& state, StepInputView<T> queries, StepInputView<T> keys,
            StepInputView<T> values, TensorView<T, 3> out) const {
    step(exec::default_t{}, state, queries, keys, values, out);
  }
  template <Real T>
  void cross_forward(InputView<T> queries, InputView<T> source, TensorView<T, 4> out) const {
    cross_forward(exec::default_t{}, queries, source, out);
  }
  template <Real T>
  void backward(InputView<T> queries, InputView<T> keys, InputView<T> values, InputView<T> d_out,
                const LavoGradients<T>& gradients) const {
    backward(exec::default_t{}, queries, keys, values, d_out, gradients);
  }
  template <Real T>
    requires(Dir::is_causal)
  void backward(InputView<T> queries, InputView<T> keys, InputView<T> values, InputView<T> d_out,
                const LavoGradients<T>& gradients, const LavoStateGradients<T>& states) const {
    backward(exec::default_t{}, queries, keys, values, d_out, gradients, states);
  }
  template <Real T>
  void cross_backward(InputView<T> queries, InputView<T> source, InputView<T> d_out,
                      const LavoCrossGradients<T>& gradients) const {
    cross_backward(exec::default_t{}, queries, source, d_out, gradients);
  }

 private:
  /// exec::reference and exec::cpu run LAVO; there is no CUDA kernel for it yet.
  template <class E>
  static void require_host_backend() {
    static_assert(!std::is_same_v<E, exec::cuda_t>,
                  "Lavo has no exec::cuda kernel in this version of latte: use "
                  "latte::exec::cpu or latte::exec::reference");
  }

  template <class E>
  static void require_host_backward() {
    static_assert(!std::is_same_v<E, exec::cuda_t> && !exec::cuda_unavailable<E>,
                  "Lavo::backward runs on exec::reference and exec::cpu (no CUDA backward yet)");
    static_assert(exec::implemented<E>, "this execution backend is not implemented yet");
  }

  /// The parameters' gradients of one call, summed in double, then added to
  /// the caller's buffers (which may be empty: not wanted).
  struct ParameterSums {
    std::vector<double> bases, bias;
    template <Real T>
    ParameterSums(const TensorView<T, 3>& d_bases, const TensorView<T, 2>& d_bias)
        : bases(static_cast<std::size_t>(d_bases.empty() ? 0 : d_bases.size()), 0.0),
          bias(static_cast<std::size_t>(d_bias.empty() ? 0 : d_bias.size()), 0.0) {}
    [[nodiscard]] reference::LavoParameterGradients pointers() noexcept {
      return {bases.empty() ? nullptr : bases.data(), bias.empty() ? nullptr : bias.data()};
    }
    template <Real T>
    void add_to(const TensorView<T, 3>& d_bases, const TensorView<T, 2>& d_bias) const {
      std::size_t i = 0;
      for (index_t h = 0; h < d_bases.extent(0) && !bases.empty(); ++h)
        for (index_t a = 0; a < d_bases.extent(1); ++a)
          for (index_t c = 0; c < d_bases.extent(2); ++c) d_bases(h, a, c) += static_cast<T>(bases[i++]);
      i = 0;
      for (index_t h = 0; h < d_bias.extent(0) && !bias.empty(); ++h)
        for (index_t a = 0; a < d_bias.extent(1); ++a) d_bias(h, a) += static_cast<T>(bias[i++]);
    }
  };

  template <Real T, class... Inputs>
  void check_bases_gradient(const TensorView<T, 3>& d_bases, const Inputs&... inputs) const {
    if (d_bases.empty()) return;
    detail::check_shape(d_bases, "gradients.d_bases", {dims_.heads, dims_.bases, dims_.dim},
                        "[H, r, d]");
    detail::check_output(d_bases, "gradients.d_bases", inputs...);
  }

  template <exec::Policy E, Real T>
  void run_backward(E, const TensorView<const T, 4>& q, const TensorView<const T, 4>& k,
                    const TensorView<const T, 4>& v, const TensorView<const T, 4>& d_out,
                    const LavoGradients<T>& gradients,
                    const LavoStateGradients<T>* states) const {
    require_host_backward<E>();
    validate_backward(q, k, v, d_out, gradients);
    const index_t B = q.extent(0), Tn = q.extent(1);
    if (states) validate_state_gradients(*states, B, Tn);
    const State<T>* initial = states ? states->initial : nullptr;
    const State<T>* d_final = states ? states->d_final : nullptr;
    State<T>* d_initial = states ? states->d_initial : nullptr;
    if constexpr (Dir::is_causal)
      if (d_initial) *d_initial = initial ? *initial : make_state<T>(B);  // sizes and position
    ParameterSums sums(gradients.d_bases, gradients.d_relative_bias);
    auto head_of = [&](index_t h) { return head<T>(h); };
    if (B > 0 && Tn > 0) {
      if constexpr (Dir::is_causal) {
        auto initial_of = [&](index_t b, index_t h) {
          return initial ? initial->saved_carry(b, h) : reference::LavoSavedCarry<T>{};
        };
        auto final_gradient_of = [&](index_t b, index_t h) {
          return d_final ? d_final->saved_carry(b, h) : reference::LavoSavedCarry<T>{};
        };
        auto initial_gradient_of = [&](index_t b, index_t h) {
          return d_initial ? d_initial->carry(b, h) : reference::LavoCarry<T>{};
        };
        const std::int64_t first_position = initial ? initial->position() : 0;
        if constexpr (std::is_same_v<E, exec::cpu_t>)
          cpu::lavo_causal_backward(q, k, v, d_out, gradients.d_queries, gradients.d_keys,
                                    gradients.d_values, first_position, head_of, initial_of,
                                    final_gradient_of, initial_gradient_of, sums.pointers());
        else
          reference::lavo_causal_backward(q, k, v, d_out, gradients.d_queries, gradients.d_keys,
                                          gradients.d_values, first_position, head_of, initial_of,
                                          final_gradient_of, initial_gradient_of, sums.pointers());
      } else if constexpr (std::is_same_v<E, exec::cpu_t>) {
        cpu::lavo_bidirectional_backward(q, k, v, d_out, gradients.d_queries, gradients.d_keys,
                                         gradients.d_values, head_of, sums.pointers());
      } else {
        reference::lavo_bidirectional_backward(q, k, v, d_out, gradients.d_queries,
                                               gradients.d_keys, gradients.d_values, head_of,
                                               sums.pointers());
      }
    } else if (d_initial) {  // no token: the initial state's gradient is d_final's (or zero)
      for (std::size_t field = 0; field < 5; ++field) {
        T* into = d_initial->field(field);
        if (d_final) std::copy_n(d_final->field(field), d_initial->field_size(field), into);
        else std::fill_n(into, d_initial->field_size(field), T(0));
      }
      // memory_compensation carries the total's gradient, as memory_sum
      std::copy_n(d_initial->field(3), d_initial->field_size(3), d_initial->field(4));
    }
    sums.add_to(gradients.d_bases, gradients.d_relative_bias);
  }

  template <Real T>
  void validate_backward(const TensorView<const T, 4>& q, const TensorView<const T, 4>& k,
                         const TensorView<const T, 4>& v, const TensorView<const T, 4>& d_out,
                         const LavoGradients<T>& gradients) const {
    check_view(q, "queries");
    const index_t B = q.extent(0), Tn = q.extent(1), H = dims_.heads, d = dims_.dim;
    detail::check_shape(q, "queries", {B, Tn, H, d}, "[B, T, H, d]");
    detail::check_shape(k, "keys", {B, Tn, H, d}, "[B, T, H, d]");
    detail::check_shape(v, "values", {B, Tn, H, d}, "[B, T, H, d]");
    detail::check_shape(d_out, "d_out", {B, Tn, H, d}, "[B, T, H, d]");
    // Named references, not a structured binding: clang 14 cannot capture those.
    const TensorView<T, 4>& dq = gradients.d_queries;
    const TensorView<T, 4>& dk = gradients.d_keys;
    const TensorView<T, 4>& dv = gradients.d_values;
    const TensorView<T, 2>& d_bias = gradients.d_relative_bias;
    detail::check_shape(dq, "gradients.d_queries", {B, Tn, H, d}, "[B, T, H, d]");
    detail::check_shape(dk, "gradients.d_keys", {B, Tn, H, d}, "[B, T, H, d]");
    detail::check_shape(dv, "gradients.d_values", {B, Tn, H, d}, "[B, T, H, d]");
    const auto inputs = std::tuple(detail::named(q, "queries"), detail::named(k, "keys"),
                                   detail::named(v, "values"), detail::named(d_out, "d_out"));
    std::apply([&](const auto&... in) {
      detail::check_output(dq, "gradients.d_queries", in...);
      detail::check_output(dk, "gradients.d_keys", in..., detail::named(dq, "gradients.d_queries"));
      detail::check_output(dv, "gradients.d_values", in..., detail::named(dq, "gradients.d_queries"),
                           detail::named(dk, "gradients.d_keys"));
      const auto written = std::tuple(detail::named(dq, "gradients.d_queries"),
                                      detail::named(dk, "gradients.d_keys"),
                                      detail::named(dv, "gradients.d_values"));
      std::apply([&](const auto&... out) {
        if (!d_bias.empty()) {
          detail::check_shape(d_bias, "gradients.d_relative_bias", {H, 2 * dims_.window - 1},
                              "[H, 2w - 1]");
          detail::check_output(d_bias, "gradients.d_relative_bias", in..., out...);
        }
        check_bases_gradient(gradients.d_bases, in..., out...,
                             detail::named(d_bias, "gradients.d_relative_bias"));
      }, written);
    }, inputs);
  }

  template <Real T>
  void validate_state_gradients(const LavoStateGradients<T>& states, index_t batch,
                                index_t tokens) const {
    const LavoDims& d = dims_;
    detail::require_backward_states(
        states, kind<T>(), State<T>::sizes_for(batch, d.heads, d.dim, d.bases, d.window), tokens);
  }

  static void require_finite(const double* data, index_t count, const char* argument) {
    for (index_t i = 0; i < count; ++i)
      detail::require(std::isfinite(data[i]), argument,
                      "every element must be finite (element " + std::to_string(i) + " is " +
                          std::to_string(data[i]) + ")");
  }

  template <Real T>
  [[nodiscard]] reference::LavoHead<T> head(index_t h) const noexcept {
    const index_t d = dims_.dim, r = dims_.bases, bias_length = 2 * dims_.window - 1;
    const T* basis = nullptr;
    const T* bias = nullptr;
    if constexpr (std::is_same_v<T, float>) {
      basis = basis_f32_.data();
      bias = bias_f32_.data();
    } else {
      basis = basis_f64_.data();
      bias = bias_f64_.data();
    }
    return {basis + h * r * d,
            bias + h * bias_length,
            d,
            r,
            dims_.window,
            static_cast<T>(scale_),
            empty_memory_ == LavoEmptyMemory::local_only};
  }

  template <Real T>
  void validate_sequence(const TensorView<const T, 4>& q, const TensorView<const T, 4>& k,
                         const TensorView<const T, 4>& v, const TensorView<T, 4>& out) const {
    check_view(q, "queries");
    const index_t B = q.extent(0), Tn = q.extent(1), H = dims_.heads, d = dims_.dim;
    detail::check_shape(q, "queries", {B, Tn, H, d}, "[B, T, H, d]");
    detail::check_shape(k, "keys", {B, Tn, H, d}, "[B, T, H, d]");
    detail::check_shape(v, "values", {B, Tn, H, d}, "[B, T, H, d]");
    detail::check_shape(out, "out", {B, Tn, H, d}, "[B, T, H, d]");
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
    const bool matches = state.kind() == kinds_.template get<T>() && state.batch() == batch &&
                         state.heads() == dims_.heads && state.dim() == dims_.dim &&
                         state.bases() == dims_.bases && state.window() == dims_.window;
    if (!matches)
      state.require_matches(kind<T>(), State<T>::sizes_for(batch, dims_.heads, dims_.dim,
                                                           dims_.bases, dims_.window));
    state.require_room(new_tokens);
  }

 private:
  LavoDims dims_;
  LavoEmptyMemory empty_memory_;
  Tensor<double, 3> bases_;
  Tensor<double, 2> relative_bias_;
  double scale_ = 1.0;
  std::vector<float> basis_f32_, bias_f32_;
  std::vector<double> basis_f64_, bias_f64_;
  detail::KindNames kinds_{kind<float>(), kind<double>()};
};

}  // namespace latte
