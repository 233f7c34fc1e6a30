#pragma once
// latte::LatteAttention<Direction, Stabilizer, Positional, Summation> — Latte (paper 000 §2,
// paper 001 §4): attention through L latent states,
//   p(l|t) = softmax_l(q_t),  p(s|l,t) = exp(k_{s,l}) / sum_{s'<=t} exp(k_{s',l}),
//   o_t = sum_l p(l|t) sum_{s<=t} p(s|l,t) v_s          (Causal, eq. 10)
//   o_t = sum_l p(l|t) sum_s p(s|l) v_s                  (Bidirectional, eq. 5)
// in O(T * L * Dv) time, with O(L * Dv) next-token decode per head.
//
// Inputs are already projected: query and key latent logits [B, T, H, L] and
// values [B, T, H, Dv]; the output is [B, T, H, Dv].
//
//   latte::LatteAttention<latte::Causal, latte::RunningMax, latte::VAPOR> attn({.heads = 8,
//       .latents = 64, .value_dim = 64});
//   attn.forward(latte::exec::reference, q, k, v, out.view());
//
// Causal states sum over the whole past as compensated sums (Summation =
// CompensatedSums, the default; PlainSums is faster and its error grows with
// the context: policies/summation.hpp, docs/numerics.md "Long contexts").
//
// backward(exec, q, k, v, d_out, gradients[, state_gradients]) gives the
// gradients of the inputs (and of VAPOR's angles, of the initial state) for a
// given d_out; it keeps nothing from the forward (docs/backward.md).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <utility>
#include <span>
#include <limits>
#include <string>
#include <vector>

#include "latte/backends/cpu/latte.hpp"
#include "latte/backends/reference/latte.hpp"
#include "latte/core/checked_size.hpp"
#include "latte/core/half_float.hpp"
#include "latte/core/shape_check.hpp"
#include "latte/core/state_storage.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/mechanisms/latte_carry_gradients.hpp"
#include "latte/mechanisms/latte_gradients.hpp"
#include "latte/mechanisms/latte_state.hpp"
#include "latte/policies/bf16_products.hpp"
#include "latte/policies/direction.hpp"
#include "latte/policies/execution.hpp"
#include "latte/policies/positional.hpp"
#include "latte/policies/stabilizer.hpp"
#include "latte/policies/summation.hpp"
#if LATTE_CUDA_KERNELS
#include "latte/backends/cuda/latte.cuh"
#endif

namespace latte {

/// Sizes fixed by a Latte layer's weights.
struct LatteDims {
  index_t heads = 0;
  index_t latents = 0;    ///< L: latent states per head
  index_t value_dim = 0;  ///< Dv: value features per head
};

template <Direction Dir, Stabilizer Stab = RunningMax, Positional Pos = NoPositional,
          Summation Sum = CompensatedSums>
class LatteAttention {
 public:
  using direction = Dir;
  using stabilizer = Stab;
  using positional = Pos;
  using summation = Sum;
  template <Real T>
  using State = LatteState<T>;
  /// What backward writes (its first members: the inputs' gradients, in call order).
  template <Real T>
  using Gradients = LatteGradients<T>;
  /// A causal backward's states (training in chunks).
  template <Real T>
  using StateGradients = LatteStateGradients<T>;
  template <Real T>
  using InputView = std::type_identity_t<TensorView<const T, 4>>;
  template <Real T>
  using StepInputView = std::type_identity_t<TensorView<const T, 3>>;

  static_assert(!Pos::rotates_queries_keys,
                "Latte has no queries/keys to rotate (latent logits): use VAPOR for positions");

  /// `positional` carries VAPOR's angles [H, Dv/2] (default: RoPE schedule, base 10000).
  explicit LatteAttention(LatteDims dims, typename Pos::Params positional = {}) : dims_(dims) {
    detail::check_positive(dims.heads, "dims.heads");
    detail::check_positive(dims.latents, "dims.latents");
    detail::check_positive(dims.value_dim, "dims.value_dim");
    detail::checked_count<double>("dims", {dims.heads, carry_size()});  // one sequence's carries
    angles_ = Pos::resolve_angles(positional, dims.heads, dims.value_dim);
  }

  [[nodiscard]] const LatteDims& dims() const noexcept { return dims_; }
  /// VAPOR's angles as used, [H, Dv/2] (0 x 0 without VAPOR): rebuild with
  /// updated ones through VAPOR::params_from(view).
  [[nodiscard]] TensorView<const double, 2> angles() const noexcept {
    const bool any = !angles_.empty();
    return {angles_.data(), {any ? dims_.heads : 0, any ? dims_.value_dim / 2 : 0}};
  }

  /// "LatteAttention<causal,running_max,vapor>/float32": names states and
  /// benchmarks (",plain" after the positional name with PlainSums).
  template <Real T>
  [[nodiscard]] static std::string kind() {
    return std::string("LatteAttention<") + Dir::name + "," + Stab::name + "," + Pos::name +
           (Sum::compensated ? "" : std::string(",") + Sum::name) + ">/" + dtype_name<T>();
  }

  /// Whole-sequence forward. T = 0 (or B = 0) is a no-op. With exec::cuda the
  /// views address device memory and the work is queued on the tag's stream.
  template <exec::Policy E, Real T>
  void forward(E e, InputView<T> query_logits, InputView<T> key_logits, InputView<T> values,
               TensorView<T, 4> out) const {
    static_assert(!exec::cuda_unavailable<E>,
                  "latte::exec::cuda needs this file compiled by nvcc with LATTE_WITH_CUDA "
                  "(the CUDA kernels are .cuh templates that exist in CUDA translation units only)");
    static_assert(exec::implemented<E> || exec::cuda_unavailable<E>,
                  "this execution backend is not implemented yet");
    validate_sequence(query_logits, key_logits, values, out);
    if (out.empty()) return;  // no output: allocate and loop over nothing
    if constexpr (std::is_same_v<E, exec::cuda_t>) {
#if LATTE_CUDA_KERNELS
      forward_cuda(e, query_logits, key_logits, values, out);
#endif
    } else if constexpr (Dir::is_causal) {
      with_fresh_carries<T>(query_logits.extent(0), [&](auto&& carry_of) {
        if constexpr (std::is_same_v<E, exec::cpu_t>)
          cpu::latte_causal_forward<Stab, Pos>(query_logits, key_logits, values, out, angles_, 0,
                                               carry_of);
        else
          reference::latte_causal_forward<Stab, Pos>(query_logits, key_logits, values, out,
                                                     angles_, 0, carry_of);
      });
    } else if constexpr (std::is_same_v<E, exec::cpu_t>) {
      cpu::latte_bidirectional_forward<Stab, Pos>(query_logits, key_logits, values, out, angles_);
    } else {
      reference::latte_bidirectional_forward<Stab, Pos>(query_logits, key_logits, values, out,
                                                        angles_);
    }
    (void)e;
  }

  /// exec::cpu with bf16 / fp16 activations (latte::bfloat16, latte::float16):
  /// the kernels widen each row exactly to fp32 as they read it, sum in fp32
  /// and round each output once (docs/numerics.md, "16-bit activations").
  /// Causal states are fp32 (make_state<float>). Other mechanisms, and
  /// exec::reference, take 16-bit activations through HalfPrecision
  /// (serving/half_precision.hpp).
  template <HalfFloat H>
  void forward(exec::cpu_t, std::type_identity_t<TensorView<const H, 4>> query_logits,
               std::type_identity_t<TensorView<const H, 4>> key_logits,
               std::type_identity_t<TensorView<const H, 4>> values, TensorView<H, 4> out) const {
    validate_sequence(query_logits, key_logits, values, out);
    if (out.empty()) return;
    if constexpr (Dir::is_causal)
      with_fresh_carries<float>(query_logits.extent(0), [&](auto&& carry_of) {
        cpu::latte_causal_forward<Stab, Pos>(query_logits, key_logits, values, out, angles_, 0, carry_of);
      });
    else
      cpu::latte_bidirectional_forward<Stab, Pos>(query_logits, key_logits, values, out, angles_);
  }
  /// exec::cpu, bidirectional, bf16 activations, with latte::bf16_products:
  /// both contractions round their operands to bf16 and run on AVX-512 BF16 dot
  /// products, sums in fp32 (policies/bf16_products.hpp; the bound in
  /// docs/numerics.md, "bf16 products"). Without AVX-512 BF16, the call above.
  void forward(exec::cpu_t, Bf16Products, TensorView<const bfloat16, 4> query_logits,
               TensorView<const bfloat16, 4> key_logits, TensorView<const bfloat16, 4> values,
               TensorView<bfloat16, 4> out) const
    requires(!Dir::is_causal)
  {
    validate_sequence(query_logits, key_logits, values, out);
    if (out.empty()) return;
    cpu::latte_bidirectional_forward<Stab, Pos, bfloat16, true>(query_logits, key_logits, values,
                                                                out, angles_);
  }
  template <HalfFloat H>
    requires(Dir::is_causal)
  void forward(exec::cpu_t, std::type_identity_t<TensorView<const H, 4>> query_logits,
               std::type_identity_t<TensorView<const H, 4>> key_logits,
               std::type_identity_t<TensorView<const H, 4>> values, TensorView<H, 4> out,
               LatteState<float>& state) const {
    validate_sequence(query_logits, key_logits, values, out);
    validate_state(state, query_logits.extent(0), query_logits.extent(1));
    if (out.empty()) return;
    cpu::latte_causal_forward<Stab, Pos>(query_logits, key_logits, values, out, angles_,
                                         state.position(),
                                         [&](index_t b, index_t h) { return carry(state, b, h); });
    state.advance(query_logits.extent(1));
  }

#if LATTE_CUDA_KERNELS
  /// exec::cuda with fp16 or bf16 inputs and output; every sum is fp32.
  template <cuda::HalfElement T>
  void forward(exec::cuda_t e, std::type_identity_t<TensorView<const T, 4>> query_logits,
               std::type_identity_t<TensorView<const T, 4>> key_logits,
               std::type_identity_t<TensorView<const T, 4>> values, TensorView<T, 4> out) const {
    validate_sequence(query_logits, key_logits, values, out);
    forward_cuda(e, query_logits, key_logits, values, out);
  }
#endif

  /// A fresh decode state for `batch` sequences whose first token sits at
  /// absolute position `first_position` (VAPOR rotates by positions).
  template <Real T>
    requires(Dir::is_causal)
  [[nodiscard]] State<T> make_state(index_t batch, std::int64_t first_position = 0) const {
    detail::check_positive(batch, "batch");
    detail::require(first_position >= 0, "first_position",
                    detail::expected_given("value", ">= 0", first_position));
    State<T> state(kind<T>(), batch, dims_.heads, dims_.latents, dims_.value_dim, first_position);
    for (index_t b = 0; b < batch; ++b)
      for (index_t h = 0; h < dims_.heads; ++h)
        reference::latte_reset<Stab>(state.carry(b, h), dims_.latents, dims_.value_dim);
    return state;
  }

  /// Restores a state saved with State::save() by an attention of this type.
  /// The buffer is checked whole before a state is allocated from it.
  template <Real T>
    requires(Dir::is_causal)
  [[nodiscard]] State<T> load_state(std::span<const std::byte> bytes) const {
    const auto header = StateStorage<T>::read_header(bytes, kind<T>());
    const LatteDims& d = dims_;
    const index_t batch = StateStorage<T>::saved_batch(
        header, bytes, State<T>::sizes_for(1, d.heads, d.latents, d.value_dim),
        [&](index_t b) { return State<T>::fields_for(b, d.heads, d.latents, d.value_dim); });
    StateStorage<T>::require_layout(header,
                                    State<T>::sizes_for(batch, d.heads, d.latents, d.value_dim),
                                    State<T>::fields_for(batch, d.heads, d.latents, d.value_dim));
    State<T> state = make_state<T>(batch);
    state.restore(bytes);
    return state;
  }

  /// Forward that continues from `state` and leaves it at the end of the
  /// sequence, so prefill + step continues exactly.
  template <exec::Policy E, Real T>
    requires(Dir::is_causal)
  void forward(E, InputView<T> query_logits, InputView<T> key_logits, InputView<T> values,
               TensorView<T, 4> out, State<T>& state) const {
    static_assert(!std::is_same_v<E, exec::cuda_t>,
                  "LatteState lives in host memory: decode on exec::cuda runs through "
                  "latte::cuda::latte_step / latte_forward with a LatteDeviceCarry "
                  "(backends/cuda/latte.cuh)");
    static_assert(exec::implemented<E>, "this execution backend is not implemented yet");
    validate_sequence(query_logits, key_logits, values, out);
    validate_state(state, query_logits.extent(0), query_logits.extent(1));
    if (out.empty()) return;  // no output: allocate and loop over nothing
    auto carry_of = [&](index_t b, index_t h) { return carry(state, b, h); };
    if constexpr (std::is_same_v<E, exec::cpu_t>)
      cpu::latte_causal_forward<Stab, Pos>(query_logits, key_logits, values, out, angles_,
                                           state.position(), carry_of);
    else
      reference::latte_causal_forward<Stab, Pos>(query_logits, key_logits, values, out, angles_,
                                                 state.position(), carry_of);
    state.advance(query_logits.extent(1));
  }

  /// Advances `state` over key_logits [B, T, H, L] and values [B, T, H, Dv]
  /// without computing their outputs: the state forward would leave, in the
  /// memory pass alone (no queries read). For a prompt whose outputs are not
  /// needed, and a slice's summary in sequence parallelism (latte/distributed/).
  template <exec::Policy E, Real T>
    requires(Dir::is_causal)
  void absorb(E, InputView<T> key_logits, InputView<T> values, State<T>& state) const {
    static_assert(!std::is_same_v<E, exec::cuda_t>,
                  "LatteState lives in host memory: absorb runs on exec::cpu or exec::reference");
    static_assert(exec::implemented<E>, "this execution backend is not implemented yet");
    check_view(key_logits, "key_logits");
    const index_t B = key_logits.extent(0), Tn = key_logits.extent(1);
    detail::check_shape(key_logits, "key_logits", {B, Tn, dims_.heads, dims_.latents},
                        "[B, T, H, L]");
    detail::check_shape(values, "values", {B, Tn, dims_.heads, dims_.value_dim}, "[B, T, H, Dv]");
    validate_state(state, B, Tn);
    auto carry_of = [&](index_t b, index_t h) { return carry(state, b, h); };
    if constexpr (std::is_same_v<E, exec::cpu_t>)
      cpu::latte_causal_absorb<Stab, Pos>(key_logits, values, angles_, state.position(), carry_of);
    else
      reference::latte_causal_absorb<Stab, Pos>(key_logits, values, angles_, state.position(),
                                                carry_of);
    state.advance(Tn);
  }

  /// Adds to gradients.d_key_logits, d_values (and d_angles, when not empty)
  /// what `d_final`, the gradient of the state a causal forward over
  /// key_logits [B, T, H, L] and values [B, T, H, Dv] left, gives those tokens
  /// (gradients.d_query_logits is not touched: no output depends on it). The
  /// tokens sit at positions d_final.position() - T on; d_final holds the
  /// gradient as a backward's states.d_final does (its running_max the
  /// reference). By linearity, backward(..., {initial, d_final}) equals
  /// backward(..., {initial}) plus this, in O(T L Dv) per head without a scan:
  /// latte/distributed/ finds each rank's final-state gradient after its
  /// backward and adds it this way.
  template <exec::Policy E, Real T>
    requires(Dir::is_causal)
  void final_state_backward(E, InputView<T> key_logits, InputView<T> values,
                            const State<T>& d_final, const LatteGradients<T>& gradients) const {
    static_assert(exec::implemented<E> && !std::is_same_v<E, exec::cuda_t>,
                  "final_state_backward runs on exec::cpu or exec::reference");
    check_view(key_logits, "key_logits");
    const index_t B = key_logits.extent(0), Tn = key_logits.extent(1), H = dims_.heads;
    const index_t L = dims_.latents, Dv = dims_.value_dim, pairs = Dv / 2;
    detail::check_shape(key_logits, "key_logits", {B, Tn, H, L}, "[B, T, H, L]");
    detail::check_shape(values, "values", {B, Tn, H, Dv}, "[B, T, H, Dv]");
    d_final.require_kind_and_sizes(kind<T>(), State<T>::sizes_for(B, H, L, Dv), "d_final");
    detail::require(d_final.position() >= Tn, "d_final",
                    detail::expected_given("position (the tokens end there)",
                                           ">= T = " + std::to_string(Tn), d_final.position()));
    detail::check_shape(gradients.d_key_logits, "gradients.d_key_logits", {B, Tn, H, L},
                        "[B, T, H, L]");
    detail::check_shape(gradients.d_values, "gradients.d_values", {B, Tn, H, Dv}, "[B, T, H, Dv]");
    if (!gradients.d_angles.empty())
      detail::check_shape(gradients.d_angles, "gradients.d_angles",
                          {Pos::rotates_values ? H : 0, Pos::rotates_values ? pairs : 0},
                          "[H, Dv/2]");
    std::vector<double> d_angles;  // summed in double, as backward does
    if (!gradients.d_angles.empty()) d_angles.assign(static_cast<std::size_t>(H * pairs), 0.0);
    auto final_of = [&](index_t b, index_t h) {
      const index_t head = b * H + h;
      return std::tuple{d_final.field(0) + head * L, d_final.field(1) + head * L,
                        d_final.field(2) + head * L * Dv};
    };
    double* d_theta = d_angles.empty() ? nullptr : d_angles.data();
    if constexpr (std::is_same_v<E, exec::cpu_t>)
      cpu::latte_final_state_backward<Pos>(key_logits, values, angles_, d_final.position() - Tn,
                                           final_of, gradients.d_key_logits, gradients.d_values,
                                           d_theta);
    else
      reference::latte_final_state_backward<Pos>(key_logits, values, angles_,
                                                 d_final.position() - Tn, final_of,
                                                 gradients.d_key_logits, gradients.d_values,
                                                 d_theta);
    detail::add_angle_sums(gradients.d_angles, d_angles);
  }

  /// Next-token decode: inputs [B, H, L], [B, H, L], [B, H, Dv]; out [B, H, Dv].
  /// O(L * Dv) per head, independent of the tokens already absorbed; no allocation.
  template <exec::Policy E, Real T>
    requires(Dir::is_causal)
  void step(E, State<T>& state, StepInputView<T> query_logits, StepInputView<T> key_logits,
            StepInputView<T> values, TensorView<T, 3> out) const {
    static_assert(!std::is_same_v<E, exec::cuda_t>,
                  "LatteState lives in host memory: decode on exec::cuda runs through "
                  "latte::cuda::latte_step / latte_forward with a LatteDeviceCarry "
                  "(backends/cuda/latte.cuh)");
    static_assert(exec::implemented<E>, "this execution backend is not implemented yet");
    const index_t B = state.batch(), H = dims_.heads, L = dims_.latents, Dv = dims_.value_dim;
    validate_state(state, state.batch());
    detail::check_shape(query_logits, "query_logits", {B, H, L}, "[B, H, L]");
    detail::check_shape(key_logits, "key_logits", {B, H, L}, "[B, H, L]");
    detail::check_shape(values, "values", {B, H, Dv}, "[B, H, Dv]");
    detail::check_shape(out, "out", {B, H, Dv}, "[B, H, Dv]");
    check_outputs_distinct(query_logits, key_logits, values, out);
    if constexpr (std::is_same_v<E, exec::cpu_t>) {
      cpu::latte_causal_step<Stab, Pos>(
          query_logits, key_logits, values, out, angles_, state.position(),
          [&](index_t b, index_t h) { return carry(state, b, h); }, state.scratch());
    } else {
      const index_t pairs = Dv / 2;
      for (index_t b = 0; b < B; ++b)
        for (index_t h = 0; h < H; ++h)
          reference::latte_causal_step<Stab, Pos>(
              query_logits.row(b, h), key_logits.row(b, h), values.row(b, h), out.row(b, h),
              carry(state, b, h), L, Dv, angles_.empty() ? nullptr : angles_.data() + h * pairs,
              state.position(), state.scratch());
    }
    state.advance(1);
  }

  /// Gradients of a loss whose gradient with respect to `out` is `d_out`
  /// [B, T, H, Dv]: writes d_query_logits, d_key_logits, d_values and, when
  /// given, accumulates d_angles [H, Dv/2] (VAPOR). The forward is recomputed
  /// from the inputs; extra memory is O(T * L) per (batch, head) in flight.
  template <exec::Policy E, Real T>
  void backward(E e, InputView<T> query_logits, InputView<T> key_logits, InputView<T> values,
                InputView<T> d_out, const LatteGradients<T>& gradients) const {
    if constexpr (Dir::is_causal)
      backward(e, query_logits, key_logits, values, d_out, gradients, LatteStateGradients<T>{});
    else
      run_backward(e, query_logits, key_logits, values, d_out, gradients,
                   static_cast<const LatteStateGradients<T>*>(nullptr));
  }

  /// Causal backward of a forward that continued from `states.initial`, with
  /// the gradient of the state it left (`states.d_final`); writes the gradient
  /// of the initial state into `states.d_initial`. Backward over chunks chained
  /// through these equals the backward over the whole sequence.
  template <exec::Policy E, Real T>
    requires(Dir::is_causal)
  void backward(E e, InputView<T> query_logits, InputView<T> key_logits, InputView<T> values,
                InputView<T> d_out, const LatteGradients<T>& gradients,
                const LatteStateGradients<T>& states) const {
    run_backward(e, query_logits, key_logits, values, d_out, gradients, &states);
  }

  // The same calls without an execution tag run on exec::default_t (exec::cpu).
  template <Real T>
  void forward(InputView<T> query_logits, InputView<T> key_logits, InputView<T> values,
               TensorView<T, 4> out) const {
    forward(exec::default_t{}, query_logits, key_logits, values, out);
  }
  template <Real T>
    requires(Dir::is_causal)
  void forward(InputView<T> query_logits, InputView<T> key_logits, InputView<T> values, TensorView<T, 4> out,
               State<T>& state) const {
    forward(exec::default_t{}, query_logits, key_logits, values, out, state);
  }
  template <Real T>
  void backward(InputView<T> query_logits, InputView<T> key_logits, InputView<T> values,
                InputView<T> d_out, const LatteGradients<T>& gradients) const {
    backward(exec::default_t{}, query_logits, key_logits, values, d_out, gradients);
  }
  template <Real T>
    requires(Dir::is_causal)
  void backward(InputView<T> query_logits, InputView<T> key_logits, InputView<T> values,
                InputView<T> d_out, const LatteGradients<T>& gradients,
                const LatteStateGradients<T>& states) const {
    backward(exec::default_t{}, query_logits, key_logits, values, d_out, gradients, states);
  }
  template <Real T>
    requires(Dir::is_causal)
  void step(State<T>& state, StepInputView<T> query_logits, StepInputView<T> key_logits,
            StepInputView<T> values, TensorView<T, 3> out) const {
    step(exec::default_t{}, state, query_logits, key_logits, values, out);
  }

 private:
#if LATTE_CUDA_KERNELS
  template <class T>
  void forward_cuda(exec::cuda_t e, TensorView<const T, 4> q, TensorView<const T, 4> k,
                    TensorView<const T, 4> v, TensorView<T, 4> out) const {
    static_assert(cuda::DeviceElement<T>,
                  "exec::cuda takes float, __half or __nv_bfloat16 inputs (not double)");
    static_assert(std::is_same_v<Stab, RunningMax>,
                  "exec::cuda implements Latte with the RunningMax stabiliser only");
    if constexpr (cuda::DeviceElement<T> && std::is_same_v<Stab, RunningMax>)
      cuda::latte_forward<Dir::is_causal, Pos>(cuda::stream_of(e.stream), q, k, v, out, angles_);
  }
#endif

  template <exec::Policy E, Real T>
  void run_backward(E, const TensorView<const T, 4>& q, const TensorView<const T, 4>& k,
                    const TensorView<const T, 4>& v, const TensorView<const T, 4>& d_out,
                    const LatteGradients<T>& gradients,
                    const LatteStateGradients<T>* states) const {
    static_assert(!std::is_same_v<E, exec::cuda_t> && !exec::cuda_unavailable<E>,
                  "LatteAttention::backward runs on exec::reference and exec::cpu (no CUDA "
                  "backward yet)");
    static_assert(exec::implemented<E>, "this execution backend is not implemented yet");
    validate_backward(q, k, v, d_out, gradients);
    const index_t B = q.extent(0), Tn = q.extent(1), H = dims_.heads, L = dims_.latents,
                  Dv = dims_.value_dim, pairs = Dv / 2;
    if (states) validate_state_gradients(*states, B, Tn);
    std::vector<double> d_angles;  // summed in double: terms grow with the position
    if (!gradients.d_angles.empty())
      d_angles.assign(static_cast<std::size_t>(H * pairs), 0.0);
    if (Tn > 0 && B > 0) {
      if constexpr (Dir::is_causal) {
        const LatteState<T>* initial = states ? states->initial : nullptr;
        const std::int64_t first_position = initial ? initial->position() : 0;
        LatteState<T>* d_initial = states ? states->d_initial : nullptr;
        if (d_initial) {
          *d_initial = initial ? *initial : make_state<T>(B);
          clear_low_parts(*d_initial);  // a gradient lives in the sum fields
        }
        detail::LatteCarryHooks<Stab, T, LatteState<T>> hooks(
            initial, states ? states->d_final : nullptr, d_initial, B, H, L, Dv);
        auto initial_of = [&](index_t b, index_t h, reference::LatteCarry<T> carry) {
          hooks.initial_of(b, h, carry);
        };
        auto final_gradient_of = [&](index_t b, index_t h, const T* m_T) {
          return hooks.final_gradient_of(b, h, m_T);
        };
        auto initial_gradient_of = [&](index_t b, index_t h) {
          return hooks.initial_gradient_of(b, h);
        };
        if constexpr (std::is_same_v<E, exec::cpu_t>)
          cpu::latte_causal_backward<Stab, Pos, Sum>(
              q, k, v, d_out, gradients.d_query_logits, gradients.d_key_logits,
              gradients.d_values, angles_, first_position, initial_of, final_gradient_of,
              initial_gradient_of, d_angles.empty() ? nullptr : d_angles.data());
        else
          reference::latte_causal_backward<Stab, Pos, Sum>(
              q, k, v, d_out, gradients.d_query_logits, gradients.d_key_logits,
              gradients.d_values, angles_, first_position, initial_of, final_gradient_of,
              initial_gradient_of, d_angles.empty() ? nullptr : d_angles.data());
      } else if constexpr (std::is_same_v<E, exec::cpu_t>) {
        cpu::latte_bidirectional_backward<Stab, Pos>(
            q, k, v, d_out, gradients.d_query_logits, gradients.d_key_logits, gradients.d_values,
            angles_, d_angles.empty() ? nullptr : d_angles.data());
      } else {
        reference::latte_bidirectional_backward<Stab, Pos>(
            q, k, v, d_out, gradients.d_query_logits, gradients.d_key_logits, gradients.d_values,
            angles_, d_angles.empty() ? nullptr : d_angles.data());
      }
    } else if constexpr (Dir::is_causal) {  // no token: the initial state's gradient is d_final's
      if (!states || !states->d_initial) return;
      *states->d_initial = states->initial ? *states->initial : make_state<T>(B);
      clear_low_parts(*states->d_initial);
      const index_t per_latent = B * H * L;
      for (const auto& [field, count] : {std::pair{1, per_latent}, std::pair{2, per_latent * Dv}}) {
        T* into = states->d_initial->field(field);
        if (states->d_final) std::copy_n(states->d_final->field(field), count, into);
        else std::fill_n(into, count, T(0));
      }
    }
    detail::add_angle_sums(gradients.d_angles, d_angles);
  }

  template <class T>
  void validate_backward(const TensorView<const T, 4>& q, const TensorView<const T, 4>& k,
                         const TensorView<const T, 4>& v, const TensorView<const T, 4>& d_out,
                         const LatteGradients<T>& gradients) const {
    check_view(q, "query_logits");
    const index_t B = q.extent(0), Tn = q.extent(1), H = dims_.heads, L = dims_.latents,
                  Dv = dims_.value_dim;
    detail::check_shape(q, "query_logits", {B, Tn, H, L}, "[B, T, H, L]");
    detail::check_shape(k, "key_logits", {B, Tn, H, L}, "[B, T, H, L]");
    detail::check_shape(v, "values", {B, Tn, H, Dv}, "[B, T, H, Dv]");
    detail::check_shape(d_out, "d_out", {B, Tn, H, Dv}, "[B, T, H, Dv]");
    // Named references, not a structured binding: clang 14 cannot capture those.
    const TensorView<T, 4>& dq = gradients.d_query_logits;
    const TensorView<T, 4>& dk = gradients.d_key_logits;
    const TensorView<T, 4>& dv = gradients.d_values;
    const TensorView<T, 2>& d_angles = gradients.d_angles;
    detail::check_shape(dq, "gradients.d_query_logits", {B, Tn, H, L}, "[B, T, H, L]");
    detail::check_shape(dk, "gradients.d_key_logits", {B, Tn, H, L}, "[B, T, H, L]");
    detail::check_shape(dv, "gradients.d_values", {B, Tn, H, Dv}, "[B, T, H, Dv]");
    const auto inputs = std::tuple(detail::named(q, "query_logits"), detail::named(k, "key_logits"),
                                   detail::named(v, "values"), detail::named(d_out, "d_out"));
    std::apply([&](const auto&... in) {
      detail::check_output(dq, "gradients.d_query_logits", in...);
      detail::check_output(dk, "gradients.d_key_logits", in..., detail::named(dq, "gradients.d_query_logits"));
      detail::check_output(dv, "gradients.d_values", in..., detail::named(dq, "gradients.d_query_logits"),
                           detail::named(dk, "gradients.d_key_logits"));
    }, inputs);
    if (d_angles.empty()) return;
    detail::require(Pos::rotates_values, "gradients.d_angles",
                    "only VAPOR has angles to differentiate (leave d_angles empty)");
    detail::check_shape(d_angles, "gradients.d_angles", {H, Dv / 2}, "[H, Dv/2]");
    std::apply([&](const auto&... in) {
      detail::check_output(d_angles, "gradients.d_angles", in...,
                           detail::named(dq, "gradients.d_query_logits"),
                           detail::named(dk, "gradients.d_key_logits"),
                           detail::named(dv, "gradients.d_values"));
    }, inputs);
  }

  template <Real T>
  void validate_state_gradients(const LatteStateGradients<T>& states, index_t batch,
                                index_t tokens) const {
    detail::require_backward_states(
        states, kind<T>(), State<T>::sizes_for(batch, dims_.heads, dims_.latents, dims_.value_dim),
        tokens);
  }

  /// Calls run(carry_of) with carry_of(b, h) the fresh carry of (b, h), for
  /// `batch` sequences (a causal forward without a state).
  template <Real T, class Run>
  void with_fresh_carries(index_t batch, Run&& run) const {
    const index_t L = dims_.latents, Dv = dims_.value_dim;
    std::vector<T> carries(static_cast<std::size_t>(
        detail::checked_count<T>("query_logits", {batch, dims_.heads, carry_size()})));
    run([&](index_t b, index_t h) {
      T* base = carries.data() + (b * dims_.heads + h) * carry_size();
      const auto carry = reference::latte_carry_at(base, L, Dv);
      reference::latte_reset<Stab>(carry, L, Dv);
      return summed_by<Sum>(carry);
    });
  }

  /// Zeroes a state's low parts (fields 3, 4): a state gradient does not use them.
  template <Real T>
  static void clear_low_parts(LatteState<T>& state) noexcept {
    for (int field : {3, 4}) std::fill_n(state.field(field), state.field_size(field), T(0));
  }

  /// A state's carry of (b, h) as Sum adds to it.
  template <Real T>
  [[nodiscard]] static reference::LatteCarry<T> carry(LatteState<T>& state, index_t b, index_t h) {
    return summed_by<Sum>(state.carry(b, h));
  }

  /// One (batch, head)'s carry: m, alpha [L], vtilde [L x Dv] and the low
  /// parts of alpha and vtilde (reference::latte_carry_size, checked).
  [[nodiscard]] index_t carry_size() const {
    const index_t L = dims_.latents;
    return detail::checked_sum(
        "dims", {L, L, L, detail::checked_product("dims", {2, L, dims_.value_dim})});
  }

  template <class T>
  void validate_sequence(const TensorView<const T, 4>& q, const TensorView<const T, 4>& k,
                         const TensorView<const T, 4>& v, const TensorView<T, 4>& out) const {
    check_view(q, "query_logits");
    const index_t B = q.extent(0), Tn = q.extent(1), H = dims_.heads;
    detail::check_shape(q, "query_logits", {B, Tn, H, dims_.latents}, "[B, T, H, L]");
    detail::check_shape(k, "key_logits", {B, Tn, H, dims_.latents}, "[B, T, H, L]");
    detail::check_shape(v, "values", {B, Tn, H, dims_.value_dim}, "[B, T, H, Dv]");
    detail::check_shape(out, "out", {B, Tn, H, dims_.value_dim}, "[B, T, H, Dv]");
    check_outputs_distinct(q, k, v, out);
  }

  template <class Q, class K, class V, class O>
  static void check_outputs_distinct(const Q& q, const K& k, const V& v, const O& out) {
    detail::check_output(out, "out", detail::named(q, "query_logits"),
                         detail::named(k, "key_logits"), detail::named(v, "values"));
  }

 public:
  /// Throws latte::Error unless `state` belongs to this attention (kind and sizes)
  /// and can take `new_tokens` more tokens of `batch` sequences (capacity): the
  /// check every call with a state makes first. Public so that a caller running
  /// many states (forward_packed) checks them all before any of them moves.
  /// Allocation-free on success (step calls it per token).
  template <Real T>
  void validate_state(const State<T>& state, index_t batch, index_t new_tokens = 1) const {
    const bool matches = state.kind() == kinds_.template get<T>() && state.batch() == batch &&
                         state.heads() == dims_.heads && state.latents() == dims_.latents &&
                         state.value_dim() == dims_.value_dim;
    if (!matches)
      state.require_matches(kind<T>(), State<T>::sizes_for(batch, dims_.heads, dims_.latents,
                                                           dims_.value_dim));
    state.require_room(new_tokens);
  }

 private:
  LatteDims dims_;
  detail::KindNames kinds_{kind<float>(), kind<double>()};
  std::vector<double> angles_;  // [H * (Dv/2)] for VAPOR, empty otherwise
};

}  // namespace latte
