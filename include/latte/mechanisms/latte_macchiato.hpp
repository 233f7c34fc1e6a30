#pragma once
// latte::LatteMacchiato<Direction, Stabilizer, LatentPos, WindowPos> — Latte Macchiato
// (paper 000 §2.3 Definition 3, paper 001 §4.1): a latent state l = 0 allocated to
// local softmax attention, mixed with Latte's latent states l = 1..L by one softmax
// over L + 1 query logits, so the weights over s stay normalised:
//   p(l|t) = softmax_{l=0..L}(q_t),
//   o_t = p(0|t) sum_{s in W(t)} p0(s|t) v_s + sum_{l=1..L} p(l|t) sum_s p(s|l,t) v_s   (eq. 13)
//   p0(s|t) = exp(scale q'_t . k'_s) / sum_{s' in W(t)} exp(scale q'_t . k'_s')       (eq. 16)
// W(t) = {t - w <= s <= t} (Causal; w + 1 tokens), {|t - s| <= w} (Bidirectional),
// p(s|l,t) as in LatteAttention (causal prefix or whole sequence).
//
// Inputs are already projected, [B, T, H, *]:
//   query_logits   [.., L + 1]  column 0 is the local state's logit, 1..L the latents'
//   key_logits     [.., L]      Latte's key latent logits
//   window_queries [.., Dk]     q'_t of the local softmax (RoPE-rotated with WindowPos = RoPE)
//   window_keys    [.., Dk]     k'_s
//   values         [.., Dv]     shared by both parts; out [.., Dv]
// Cost O(T * (L * Dv + w * (Dk + Dv))); causal decode O(L * Dv + w * (Dk + Dv)) per head
// with a state of that size (Latte's carry + a ring of the last w + 1 keys / values).
//
// Decided here (the papers are silent): `scale` defaults to 1/sqrt(Dk) (paper 000
// eq. 2 omits it "for presentation clarity"; scale = 1 is eq. 16 verbatim); a latent
// whose keys so far are all -inf contributes nothing and a query whose L + 1 logits
// are all -inf reads zero (LatteAttention's conventions); VAPOR, the latent states'
// positional encoding, acts on the latent states only by default — see VaporScope.
//
//   latte::LatteMacchiato<latte::Causal, latte::RunningMax, latte::NoPositional, latte::RoPE>
//       attn({.heads = 8, .latents = 64, .key_dim = 64, .value_dim = 64, .window = 128});
//   attn.forward(latte::exec::reference, q, k, window_q, window_k, v, out.view());
//   attn.backward(latte::exec::cpu, q, k, window_q, window_k, v, d_out,
//                 latte::MacchiatoGradients<float>{dq, dk, d_window_q, d_window_k, dv});
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include "latte/backends/cpu/latte/forward.hpp"
#include "latte/backends/cpu/macchiato.hpp"
#include "latte/backends/reference/latte.hpp"
#include "latte/backends/reference/macchiato.hpp"
#include "latte/core/error.hpp"
#include "latte/core/checked_size.hpp"
#include "latte/core/shape_check.hpp"
#include "latte/core/state_storage.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/mechanisms/latte_carry_gradients.hpp"
#include "latte/mechanisms/macchiato_gradients.hpp"
#include "latte/mechanisms/macchiato_state.hpp"
#include "latte/policies/direction.hpp"
#include "latte/policies/execution.hpp"
#include "latte/policies/positional.hpp"
#include "latte/policies/stabilizer.hpp"

namespace latte {

/// Sizes fixed by a Latte Macchiato layer's weights.
struct MacchiatoDims {
  index_t heads = 0;
  index_t latents = 0;    ///< L: latent states per head (the query logits have L + 1)
  index_t key_dim = 0;    ///< Dk: window query / key features per head
  index_t value_dim = 0;  ///< Dv: value features per head
  index_t window = 0;     ///< w >= 1: causal t - w <= s <= t, bidirectional |t - s| <= w
};

/// Which part of the mixture VAPOR (LatentPos = VAPOR) rotates.
enum class VaporScope {
  /// The default: only the latent states 1..L read R^{t-s} v_s; the local
  /// state reads v_s and takes its positions from WindowPos (RoPE). Paper 000
  /// introduces VAPOR for the latent states, where relative q/k encodings are
  /// meaningless, and uses RoPE for the window (§4.1); pre-trained window
  /// weights (§4.5) expect plain values.
  latent_states,
  /// Eq. 22 applied to Macchiato's whole p(s|t): every state reads R^{t-s} v_s,
  /// o_t = sum_s p(s|t) R^{t-s} v_s.
  all_states,
};

[[nodiscard]] constexpr const char* vapor_scope_name(VaporScope scope) noexcept {
  return scope == VaporScope::all_states ? "all_states" : "latent_states";
}

/// Parameters that are not sizes.
struct MacchiatoOptions {
  /// The window's score scale; default 1/sqrt(Dk). Must be finite.
  std::optional<double> scale;
  /// Only meaningful with LatentPos = VAPOR.
  VaporScope vapor_scope = VaporScope::latent_states;
};

template <Direction Dir, Stabilizer Stab = RunningMax, Positional LatentPos = NoPositional,
          Positional WindowPos = NoPositional>
class LatteMacchiato {
  static_assert(!LatentPos::rotates_queries_keys,
                "LatteMacchiato: LatentPos acts on the latent states, which have logits, not "
                "query/key vectors; use NoPositional or VAPOR there and put RoPE in WindowPos");
  static_assert(!WindowPos::rotates_values,
                "LatteMacchiato: WindowPos rotates the window's queries and keys; use "
                "NoPositional or RoPE there and put VAPOR in LatentPos");

 public:
  using direction = Dir;
  using stabilizer = Stab;
  using latent_positional = LatentPos;
  using window_positional = WindowPos;
  template <Real T>
  using State = MacchiatoState<T>;
  /// What backward writes (its first members: the inputs' gradients, in call order).
  template <Real T>
  using Gradients = MacchiatoGradients<T>;
  /// A causal backward's states (training in chunks).
  template <Real T>
  using StateGradients = MacchiatoStateGradients<T>;
  template <Real T>
  using InputView = std::type_identity_t<TensorView<const T, 4>>;
  template <Real T>
  using StepInputView = std::type_identity_t<TensorView<const T, 3>>;

  /// `latent_positional` carries VAPOR's angles [H, Dv/2], `window_positional`
  /// RoPE's angles [H, Dk/2] (each defaults to the RoPE schedule, base 10000).
  explicit LatteMacchiato(MacchiatoDims dims, MacchiatoOptions options = {},
                          typename LatentPos::Params latent_positional = {},
                          typename WindowPos::Params window_positional = {})
      : dims_(dims), options_(options) {
    detail::check_positive(dims.heads, "dims.heads");
    detail::check_positive(dims.latents, "dims.latents");
    detail::check_positive(dims.key_dim, "dims.key_dim");
    detail::check_positive(dims.value_dim, "dims.value_dim");
    detail::require(dims.window >= 1, "dims.window",
                    detail::expected_given("window size w (tokens on each allowed side)", ">= 1",
                                           dims.window));
    detail::checked_count<double>("dims", {dims.heads, carry_size()});  // one sequence's carries
    detail::checked_count<double>("dims", {dims.heads, window_row()});  // one ring slot per head
    scale_ = options.scale.value_or(1.0 / std::sqrt(static_cast<double>(dims.key_dim)));
    detail::require(std::isfinite(scale_), "options.scale",
                    detail::expected_given("value", "a finite number", scale_));
    latent_angles_ = resolve_named<LatentPos>(latent_positional, dims.value_dim,
                                              "latent_positional");
    key_angles_ = resolve_named<WindowPos>(window_positional, dims.key_dim, "window_positional");
    kinds_ = {kind<float>(), kind<double>()};
  }

  [[nodiscard]] const MacchiatoDims& dims() const noexcept { return dims_; }
  [[nodiscard]] double scale() const noexcept { return scale_; }
  [[nodiscard]] VaporScope vapor_scope() const noexcept { return options_.vapor_scope; }
  /// The angles as used, for rebuilding with updated ones (Pos::params_from(view)):
  /// VAPOR's on the latent states [H, Dv/2] and RoPE's on the window [H, Dk/2]
  /// (0 x 0 under NoPositional).
  [[nodiscard]] TensorView<const double, 2> latent_angles() const noexcept {
    return angle_view(latent_angles_, dims_.value_dim);
  }
  [[nodiscard]] TensorView<const double, 2> window_angles() const noexcept {
    return angle_view(key_angles_, dims_.key_dim);
  }

  /// "LatteMacchiato<causal,running_max,vapor[latent_states],rope>/float32": names
  /// states (a state made under one VaporScope is refused by the other).
  template <Real T>
  [[nodiscard]] std::string kind() const {
    std::string latent = LatentPos::name;
    if constexpr (LatentPos::rotates_values)
      latent += std::string("[") + vapor_scope_name(options_.vapor_scope) + "]";
    return std::string("LatteMacchiato<") + Dir::name + "," + Stab::name + "," + latent + "," +
           WindowPos::name + ">/" + dtype_name<T>();
  }

  /// Whole-sequence forward. T = 0 (or B = 0) is a no-op.
  template <exec::Policy E, Real T>
  void forward(E, InputView<T> query_logits, InputView<T> key_logits,
               InputView<T> window_queries, InputView<T> window_keys, InputView<T> values,
               TensorView<T, 4> out) const {
    require_host_backend<E>();
    validate_sequence(query_logits, key_logits, window_queries, window_keys, values, out);
    if (out.empty()) return;  // no output: allocate and loop over nothing
    if constexpr (std::is_same_v<E, exec::cpu_t>) {
      if constexpr (Dir::is_causal) {
        const index_t L = dims_.latents, Dv = dims_.value_dim, carry_size = this->carry_size();
        std::vector<T> carries(static_cast<std::size_t>(detail::checked_count<T>(
            "query_logits", {query_logits.extent(0), dims_.heads, carry_size})));
        auto carry_of = [&](index_t b, index_t h) {
          const auto carry =
              reference::latte_carry_at(carries.data() + (b * dims_.heads + h) * carry_size, L, Dv);
          reference::latte_reset<Stab>(carry, L, Dv);
          return carry;
        };
        auto fresh_ring = [](index_t, index_t) { return reference::KVSlots<T>{nullptr, nullptr}; };
        // A fresh sequence needs at most T ring slots (no w + 1 overflow for huge windows).
        const index_t ring = dims_.window >= query_logits.extent(1) ? query_logits.extent(1)
                                                                     : dims_.window + 1;
        cpu::macchiato_causal_forward<Stab, LatentPos, WindowPos>(
            query_logits, key_logits, window_queries, window_keys, values, out, window_spec(), 0,
            0, ring, carry_of, fresh_ring);
      } else {
        cpu::macchiato_bidirectional_forward<Stab, LatentPos, WindowPos>(
            query_logits, key_logits, window_queries, window_keys, values, out, window_spec());
      }
    } else if constexpr (Dir::is_causal) {
      const index_t B = query_logits.extent(0), Tn = query_logits.extent(1), H = dims_.heads;
      const index_t L = dims_.latents, Dk = dims_.key_dim, Dv = dims_.value_dim;
      if (B == 0 || Tn == 0) return;
      // One head's carry, a ring of min(w + 1, T) slots (token t in slot t % capacity) and scratch.
      const index_t capacity = dims_.window >= Tn ? Tn : dims_.window + 1;  // no w + 1 overflow
      std::vector<T> workspace(static_cast<std::size_t>(detail::checked_sum(
          "window_keys", {carry_size(), detail::checked_count<T>("window_keys", {capacity, window_row()}),
                          reference::MacchiatoScratch<T>::size(Dk, Dv)})));
      T* base = workspace.data();
      const auto carry = reference::latte_carry_at(base, L, Dv);
      T* ring_base = base + carry_size();
      const reference::KVSlots<T> ring{ring_base, ring_base + capacity * Dk};
      const auto scratch =
          reference::MacchiatoScratch<T>::carve(ring_base + capacity * (Dk + Dv), Dk, Dv);
      for (index_t b = 0; b < B; ++b)
        for (index_t h = 0; h < H; ++h) {
          reference::latte_reset<Stab>(carry, L, Dv);
          for (index_t t = 0; t < Tn; ++t)
            causal_step_kernel(query_logits, key_logits, window_queries, window_keys, values, out,
                               b, t, h, carry, ring, capacity, std::min(t + 1, capacity), t,
                               scratch);
        }
    } else {
      reference::macchiato_bidirectional_forward<Stab, LatentPos, WindowPos>(
          query_logits, key_logits, window_queries, window_keys, values, out,
          static_cast<T>(scale_), dims_.window, latent_angles_, key_angles_,
          options_.vapor_scope == VaporScope::all_states);
    }
  }

  /// A fresh decode state for `batch` sequences whose first token sits at
  /// absolute position `first_position` (RoPE and VAPOR rotate by positions).
  template <Real T>
    requires(Dir::is_causal)
  [[nodiscard]] State<T> make_state(index_t batch, std::int64_t first_position = 0) const {
    detail::check_positive(batch, "batch");
    detail::require(first_position >= 0, "first_position",
                    detail::expected_given("value", ">= 0", first_position));
    // The ring's fill count (0..w + 1) is stored as a T and must stay exact.
    constexpr index_t exact_up_to = index_t{1} << std::numeric_limits<T>::digits;
    if (dims_.window >= exact_up_to)
      throw Error("dims.window",
                  detail::expected_given(std::string("window size for a ") + dtype_name<T>() +
                                             " decode state",
                                         "<= " + std::to_string(exact_up_to - 1), dims_.window));
    // One sequence's ring first, so that a huge window is named as such.
    detail::checked_count<T>("dims.window", {dims_.heads, dims_.window + 1, window_row()});
    const MacchiatoDims& d = dims_;
    State<T> state(kind<T>(), batch, d.heads, d.latents, d.key_dim, d.value_dim, d.window,
                   first_position);
    for (index_t b = 0; b < batch; ++b)
      for (index_t h = 0; h < d.heads; ++h)
        reference::latte_reset<Stab>(state.carry(b, h), d.latents, d.value_dim);
    state.set_window_fill(0);
    return state;
  }

  /// Restores a state saved with State::save() by an attention of this type.
  /// The buffer is checked whole before a state is allocated from it.
  template <Real T>
    requires(Dir::is_causal)
  [[nodiscard]] State<T> load_state(std::span<const std::byte> bytes) const {
    const auto header = StateStorage<T>::read_header(bytes, kind<T>());
    const MacchiatoDims& d = dims_;
    const index_t batch = StateStorage<T>::saved_batch(
        header, bytes, State<T>::sizes_for(1, d.heads, d.latents, d.key_dim, d.value_dim, d.window),
        [&](index_t b) {
          return State<T>::fields_for(b, d.heads, d.latents, d.key_dim, d.value_dim, d.window);
        });
    StateStorage<T>::require_layout(
        header, State<T>::sizes_for(batch, d.heads, d.latents, d.key_dim, d.value_dim, d.window),
        State<T>::fields_for(batch, d.heads, d.latents, d.key_dim, d.value_dim, d.window));
    State<T> state = make_state<T>(batch);
    state.restore(bytes);  // checks the saved window_fill too (MacchiatoState::check_saved)
    return state;
  }

  /// Forward that continues from `state` and leaves it at the end of the
  /// sequence, so prefill + step continues exactly.
  template <exec::Policy E, Real T>
    requires(Dir::is_causal)
  void forward(E, InputView<T> query_logits, InputView<T> key_logits,
               InputView<T> window_queries, InputView<T> window_keys, InputView<T> values,
               TensorView<T, 4> out, State<T>& state) const {
    require_host_backend<E>();
    validate_sequence(query_logits, key_logits, window_queries, window_keys, values, out);
    validate_state(state, query_logits.extent(0), query_logits.extent(1));
    if (out.empty()) return;  // no output: allocate and loop over nothing
    const index_t B = query_logits.extent(0), Tn = query_logits.extent(1);
    const index_t capacity = state.capacity(), fill = state.window_fill();
    const std::int64_t first = state.position();
    if constexpr (std::is_same_v<E, exec::cpu_t>)
      cpu::macchiato_causal_forward<Stab, LatentPos, WindowPos>(
          query_logits, key_logits, window_queries, window_keys, values, out, window_spec(), first,
          fill, capacity, [&](index_t b, index_t h) { return state.carry(b, h); },
          [&](index_t b, index_t h) { return state.ring(b, h); });
    else
      for (index_t b = 0; b < B; ++b)
        for (index_t h = 0; h < dims_.heads; ++h)
          for (index_t t = 0; t < Tn; ++t)
            causal_step_kernel(query_logits, key_logits, window_queries, window_keys, values,
                               out, b, t, h, state.carry(b, h), state.ring(b, h), capacity,
                               std::min(fill + t + 1, capacity), first + t, state.scratch());
    state.set_window_fill(std::min(fill + Tn, capacity));
    state.advance(Tn);
  }

  /// Advances `state` over key_logits [B, T, H, L], window_keys [B, T, H, Dk]
  /// and values [B, T, H, Dv] without computing outputs (no queries read): the
  /// latent carry as Latte's absorb, and the window ring's last w + 1 tokens
  /// stored as the window reads them. The state forward would leave; for a
  /// prompt whose outputs are not needed and a slice's summary in sequence
  /// parallelism (latte/distributed/).
  template <exec::Policy E, Real T>
    requires(Dir::is_causal)
  void absorb(E, InputView<T> key_logits, InputView<T> window_keys, InputView<T> values,
              State<T>& state) const {
    require_host_backend<E>();
    check_view(key_logits, "key_logits");
    const index_t B = key_logits.extent(0), Tn = key_logits.extent(1), H = dims_.heads;
    const index_t Dk = dims_.key_dim, Dv = dims_.value_dim;
    detail::check_shape(key_logits, "key_logits", {B, Tn, H, dims_.latents}, "[B, T, H, L]");
    detail::check_shape(window_keys, "window_keys", {B, Tn, H, Dk}, "[B, T, H, Dk]");
    detail::check_shape(values, "values", {B, Tn, H, Dv}, "[B, T, H, Dv]");
    validate_state(state, B, Tn);
    const std::int64_t first = state.position();
    const index_t capacity = state.capacity(), fill = state.window_fill();
    auto carry_of = [&](index_t b, index_t h) { return state.carry(b, h); };
    if constexpr (std::is_same_v<E, exec::cpu_t>)
      cpu::latte_causal_absorb<Stab, LatentPos>(key_logits, values, latent_angles_, first, carry_of);
    else
      reference::latte_causal_absorb<Stab, LatentPos>(key_logits, values, latent_angles_, first,
                                                      carry_of);
    // The ring: token s in slot s % (w + 1), R^s k_s under RoPE, R^{-s} v_s when
    // VAPOR acts on the window (as the step stores them).
    for (index_t b = 0; b < B; ++b)
      for (index_t h = 0; h < H; ++h) {
        const reference::KVSlots<T> ring = state.ring(b, h);
        const reference::MacchiatoAngles angles = angles_of(h);
        for (index_t t = std::max<index_t>(0, Tn - capacity); t < Tn; ++t) {
          const std::int64_t position = first + t;
          const index_t slot = static_cast<index_t>(position % capacity);
          T* key = ring.keys + slot * Dk;
          T* value = ring.values + slot * Dv;
          std::copy_n(window_keys.row(b, t, h), Dk, key);
          std::copy_n(values.row(b, t, h), Dv, value);
          if constexpr (WindowPos::rotates_queries_keys)
            WindowPos::rotate(key, Dk, angles.key_theta, position);
          if constexpr (LatentPos::rotates_values)
            if (angles.rotate_window_values) LatentPos::rotate(value, Dv, angles.value_theta, -position);
        }
      }
    state.set_window_fill(std::min(fill + Tn, capacity));
    state.advance(Tn);
  }

  /// Next-token decode: inputs [B, H, L + 1], [B, H, L], [B, H, Dk], [B, H, Dk],
  /// [B, H, Dv]; out [B, H, Dv]. O(L * Dv + w * (Dk + Dv)) per head, independent
  /// of the tokens already absorbed; no allocation.
  template <exec::Policy E, Real T>
    requires(Dir::is_causal)
  void step(E, State<T>& state, StepInputView<T> query_logits, StepInputView<T> key_logits,
            StepInputView<T> window_queries, StepInputView<T> window_keys,
            StepInputView<T> values, TensorView<T, 3> out) const {
    require_host_backend<E>();  // both run the same allocation-free step kernel
    const index_t B = state.batch(), H = dims_.heads, L = dims_.latents;
    const index_t Dk = dims_.key_dim, Dv = dims_.value_dim;
    validate_state(state, B, 1);
    detail::check_shape(query_logits, "query_logits", {B, H, L + 1}, "[B, H, L+1]");
    detail::check_shape(key_logits, "key_logits", {B, H, L}, "[B, H, L]");
    detail::check_shape(window_queries, "window_queries", {B, H, Dk}, "[B, H, Dk]");
    detail::check_shape(window_keys, "window_keys", {B, H, Dk}, "[B, H, Dk]");
    detail::check_shape(values, "values", {B, H, Dv}, "[B, H, Dv]");
    detail::check_shape(out, "out", {B, H, Dv}, "[B, H, Dv]");
    check_outputs_distinct(query_logits, key_logits, window_queries, window_keys, values, out);
    const index_t capacity = state.capacity(), fill = state.window_fill();
    const std::int64_t position = state.position();
    for (index_t b = 0; b < B; ++b)
      for (index_t h = 0; h < H; ++h)
        reference::macchiato_causal_step<Stab, LatentPos, WindowPos>(
            query_logits.row(b, h), key_logits.row(b, h), window_queries.row(b, h),
            window_keys.row(b, h), values.row(b, h), out.row(b, h), state.carry(b, h),
            state.ring(b, h), capacity, std::min(fill + 1, capacity), sizes(),
            static_cast<T>(scale_), angles_of(h), position, state.scratch());
    state.set_window_fill(std::min(fill + 1, capacity));
    state.advance(1);
  }

  /// Gradients of a loss whose gradient with respect to `out` is `d_out`
  /// [B, T, H, Dv], for a forward over a whole sequence from a fresh state:
  /// writes the five input gradients and, when given, accumulates d_angles
  /// [H, Dv/2] (VAPOR). The forward is recomputed from the inputs (Latte's and
  /// the window's backwards, mixed as docs/backward.md derives); extra memory
  /// O(B * T * H * (Dk + Dv)).
  template <exec::Policy E, Real T>
  void backward(E e, InputView<T> query_logits, InputView<T> key_logits,
                InputView<T> window_queries, InputView<T> window_keys, InputView<T> values,
                InputView<T> d_out, const MacchiatoGradients<T>& gradients) const {
    run_backward(e, query_logits, key_logits, window_queries, window_keys, values, d_out,
                 gradients, static_cast<const MacchiatoStateGradients<T>*>(nullptr));
  }

  /// Causal backward of a forward that continued from `states.initial`, with
  /// the gradient of the state it left (`states.d_final`); writes the gradient
  /// of the initial state into `states.d_initial`. Backward over chunks chained
  /// through these equals the backward over the whole sequence.
  template <exec::Policy E, Real T>
    requires(Dir::is_causal)
  void backward(E e, InputView<T> query_logits, InputView<T> key_logits,
                InputView<T> window_queries, InputView<T> window_keys, InputView<T> values,
                InputView<T> d_out, const MacchiatoGradients<T>& gradients,
                const MacchiatoStateGradients<T>& states) const {
    run_backward(e, query_logits, key_logits, window_queries, window_keys, values, d_out,
                 gradients, &states);
  }

  // The same calls without an execution tag run on exec::default_t (exec::cpu).
  template <Real T>
  void forward(InputView<T> query_logits, InputView<T> key_logits, InputView<T> window_queries,
               InputView<T> window_keys, InputView<T> values, TensorView<T, 4> out) const {
    forward(exec::default_t{}, query_logits, key_logits, window_queries, window_keys, values, out);
  }
  template <Real T>
    requires(Dir::is_causal)
  void forward(InputView<T> query_logits, InputView<T> key_logits, InputView<T> window_queries,
               InputView<T> window_keys, InputView<T> values, TensorView<T, 4> out,
               State<T>& state) const {
    forward(exec::default_t{}, query_logits, key_logits, window_queries, window_keys, values, out,
            state);
  }
  template <Real T>
    requires(Dir::is_causal)
  void step(State<T>& state, StepInputView<T> query_logits, StepInputView<T> key_logits,
            StepInputView<T> window_queries, StepInputView<T> window_keys,
            StepInputView<T> values, TensorView<T, 3> out) const {
    step(exec::default_t{}, state, query_logits, key_logits, window_queries, window_keys, values,
         out);
  }
  template <Real T>
  void backward(InputView<T> query_logits, InputView<T> key_logits, InputView<T> window_queries,
                InputView<T> window_keys, InputView<T> values, InputView<T> d_out,
                const MacchiatoGradients<T>& gradients) const {
    backward(exec::default_t{}, query_logits, key_logits, window_queries, window_keys, values,
             d_out, gradients);
  }
  template <Real T>
    requires(Dir::is_causal)
  void backward(InputView<T> query_logits, InputView<T> key_logits, InputView<T> window_queries,
                InputView<T> window_keys, InputView<T> values, InputView<T> d_out,
                const MacchiatoGradients<T>& gradients,
                const MacchiatoStateGradients<T>& states) const {
    backward(exec::default_t{}, query_logits, key_logits, window_queries, window_keys, values,
             d_out, gradients, states);
  }

 private:
  template <exec::Policy E>
  static void require_host_backend() {
    static_assert(!std::is_same_v<E, exec::cuda_t>,
                  "LatteMacchiato has no exec::cuda kernel yet; use exec::cpu or exec::reference");
  }

  /// The states a causal backward continues from and gives back (the hooks of
  /// reference::macchiato_backward, see FreshMacchiatoStates).
  template <Real T>
  struct StatesOf {
    detail::LatteCarryHooks<Stab, T, State<T>> carry;
    const State<T>* initial;
    const State<T>* d_final;
    State<T>* d_initial;
    std::int64_t first_position;
    index_t fill;
    void initial_of(index_t b, index_t h, reference::LatteCarry<T> c) const { carry.initial_of(b, h, c); }
    reference::LatteCarryGradient<const T> final_gradient_of(index_t b, index_t h, const T* m_T) {
      return carry.final_gradient_of(b, h, m_T);
    }
    reference::LatteCarryGradient<T> initial_gradient_of(index_t b, index_t h) const {
      return carry.initial_gradient_of(b, h);
    }
    reference::RingRows<const T> ring_of(index_t b, index_t h) const { return initial->ring(b, h); }
    reference::RingRows<const T> final_ring_gradient_of(index_t b, index_t h) const {
      if (!d_final) return {nullptr, nullptr};
      return d_final->ring(b, h);
    }
    reference::RingRows<T> initial_ring_gradient_of(index_t b, index_t h) const {
      if (!d_initial) return {nullptr, nullptr};
      const reference::KVSlots<T> ring = d_initial->ring(b, h);
      return {ring.keys, ring.values};
    }
  };

  template <exec::Policy E, Real T>
  void run_backward(E, const TensorView<const T, 4>& q, const TensorView<const T, 4>& k,
                    const TensorView<const T, 4>& wq, const TensorView<const T, 4>& wk,
                    const TensorView<const T, 4>& v, const TensorView<const T, 4>& d_out,
                    const MacchiatoGradients<T>& gradients,
                    const MacchiatoStateGradients<T>* states) const {
    static_assert(!std::is_same_v<E, exec::cuda_t> && !exec::cuda_unavailable<E>,
                  "LatteMacchiato::backward runs on exec::reference and exec::cpu (no CUDA "
                  "backward yet)");
    static_assert(exec::implemented<E>, "this execution backend is not implemented yet");
    validate_backward(q, k, wq, wk, v, d_out, gradients);
    const index_t B = q.extent(0), Tn = q.extent(1), H = dims_.heads, L = dims_.latents;
    const index_t Dv = dims_.value_dim, pairs = Dv / 2;
    if (states) validate_state_gradients(*states, B, Tn);
    const State<T>* initial = states ? states->initial : nullptr;
    const State<T>* d_final = states ? states->d_final : nullptr;
    State<T>* d_initial = states ? states->d_initial : nullptr;
    if constexpr (Dir::is_causal) {
      if (d_initial) {  // the initial state's fields, then its gradient fields zeroed or filled
        *d_initial = initial ? *initial : make_state<T>(B);
        // alpha, vtilde, their low parts (unused in a gradient), the ring's keys and values
        for (int field : {1, 2, 3, 4, 5, 6})
          std::fill_n(d_initial->field(field), d_initial->field_size(field), T(0));
      }
    }
    std::vector<double> d_angles;  // summed in double: terms grow with the position
    if (!gradients.d_angles.empty()) d_angles.assign(static_cast<std::size_t>(H * pairs), 0.0);
    const reference::MacchiatoGradientViews<T> views{
        gradients.d_query_logits, gradients.d_key_logits, gradients.d_window_queries,
        gradients.d_window_keys, gradients.d_values};
    const reference::MacchiatoBackwardSpec spec{
        dims_.window, dims_.window + 1, scale_, &latent_angles_, &key_angles_,
        options_.vapor_scope == VaporScope::all_states};
    using Parts = std::conditional_t<std::is_same_v<E, exec::cpu_t>, cpu::MacchiatoParts,
                                     reference::ReferenceMacchiatoParts>;
    double* angles_out = d_angles.empty() ? nullptr : d_angles.data();
    if (B > 0 && Tn > 0) {
      if constexpr (Dir::is_causal) {
        StatesOf<T> hooks{{initial, d_final, d_initial, B, H, L, Dv},
                          initial, d_final, d_initial,
                          initial ? initial->position() : 0, initial ? initial->window_fill() : 0};
        reference::macchiato_backward<true, Stab, LatentPos, WindowPos, Parts>(
            q, k, wq, wk, v, d_out, views, spec, angles_out, hooks);
      } else {
        reference::FreshMacchiatoStates<Stab, T> fresh{L, Dv, dims_.window + 1};
        reference::macchiato_backward<false, Stab, LatentPos, WindowPos, Parts>(
            q, k, wq, wk, v, d_out, views, spec, angles_out, fresh);
      }
    } else if (d_initial && d_final) {  // no token: the initial state's gradient is d_final's
      for (int field : {1, 2, 5, 6})  // alpha, vtilde, the ring's keys and values
        std::copy_n(d_final->field(field), d_final->field_size(field), d_initial->field(field));
      for (int field : {3, 4})  // the low parts: unused in a gradient
        std::fill_n(d_initial->field(field), d_initial->field_size(field), T(0));
    }
    detail::add_angle_sums(gradients.d_angles, d_angles);
  }

  template <Real T>
  void validate_state_gradients(const MacchiatoStateGradients<T>& states, index_t batch,
                                index_t tokens) const {
    const MacchiatoDims& d = dims_;
    detail::require_backward_states(
        states, kind<T>(),
        State<T>::sizes_for(batch, d.heads, d.latents, d.key_dim, d.value_dim, d.window), tokens);
    if (states.initial) validate_state(*states.initial, batch, tokens);  // its window_fill too
  }

  [[nodiscard]] cpu::MacchiatoWindowSpec window_spec() const noexcept {
    return {dims_.window, scale_, &key_angles_, &latent_angles_,
            options_.vapor_scope == VaporScope::all_states};
  }

  [[nodiscard]] reference::MacchiatoSizes sizes() const noexcept {
    return {dims_.latents, dims_.key_dim, dims_.value_dim};
  }

  [[nodiscard]] reference::MacchiatoAngles angles_of(index_t h) const noexcept {
    const index_t value_pairs = dims_.value_dim / 2, key_pairs = dims_.key_dim / 2;
    return {latent_angles_.empty() ? nullptr : latent_angles_.data() + h * value_pairs,
            key_angles_.empty() ? nullptr : key_angles_.data() + h * key_pairs,
            options_.vapor_scope == VaporScope::all_states};
  }

  /// Token t of (b, h) through the causal step kernel, at absolute `position`.
  template <Real T>
  void causal_step_kernel(const TensorView<const T, 4>& q, const TensorView<const T, 4>& k,
                          const TensorView<const T, 4>& wq, const TensorView<const T, 4>& wk,
                          const TensorView<const T, 4>& v, const TensorView<T, 4>& out, index_t b,
                          index_t t, index_t h, reference::LatteCarry<T> carry,
                          reference::KVSlots<T> ring, index_t capacity, index_t visible,
                          std::int64_t position, reference::MacchiatoScratch<T> scratch) const {
    reference::macchiato_causal_step<Stab, LatentPos, WindowPos>(
        q.row(b, t, h), k.row(b, t, h), wq.row(b, t, h), wk.row(b, t, h), v.row(b, t, h),
        out.row(b, t, h), carry, ring, capacity, visible, sizes(), static_cast<T>(scale_),
        angles_of(h), position, scratch);
  }

  /// One (batch, head)'s latent carry (m, alpha [L], vtilde [L x Dv] and the
  /// low parts of alpha and vtilde: reference::latte_carry_size, checked) and
  /// window slot (Dk + Dv).
  [[nodiscard]] index_t carry_size() const {
    const index_t L = dims_.latents;
    return detail::checked_sum(
        "dims", {L, L, L, detail::checked_product("dims", {2, L, dims_.value_dim})});
  }
  [[nodiscard]] index_t window_row() const {
    return detail::checked_sum("dims", {dims_.key_dim, dims_.value_dim});
  }

  [[nodiscard]] TensorView<const double, 2> angle_view(const std::vector<double>& table,
                                                     index_t dim) const noexcept {
    const bool any = !table.empty();
    return {table.data(), {any ? dims_.heads : 0, any ? dim / 2 : 0}};
  }

  /// A positional policy's angle table; its errors are renamed
  /// "<which>.angles" / "<which>.base" so the two tables are told apart.
  template <Positional Pos>
  [[nodiscard]] std::vector<double> resolve_named(const typename Pos::Params& params, index_t dim,
                                                  std::string_view which) const {
    try {
      return Pos::resolve_angles(params, dims_.heads, dim);
    } catch (const Error& error) {
      throw detail::renamed(error, std::string(which) + "." + error.argument());
    }
  }

  template <Real T>
  void validate_sequence(const TensorView<const T, 4>& q, const TensorView<const T, 4>& k,
                         const TensorView<const T, 4>& wq, const TensorView<const T, 4>& wk,
                         const TensorView<const T, 4>& v, const TensorView<T, 4>& out) const {
    validate_inputs(q, k, wq, wk, v);
    detail::check_shape(out, "out", {q.extent(0), q.extent(1), dims_.heads, dims_.value_dim},
                        "[B, T, H, Dv]");
    check_outputs_distinct(q, k, wq, wk, v, out);
  }

  /// The five inputs' shapes, B and T from query_logits.
  template <class T>
  void validate_inputs(const TensorView<const T, 4>& q, const TensorView<const T, 4>& k,
                       const TensorView<const T, 4>& wq, const TensorView<const T, 4>& wk,
                       const TensorView<const T, 4>& v) const {
    check_view(q, "query_logits");
    const index_t B = q.extent(0), Tn = q.extent(1), H = dims_.heads;
    const index_t L = dims_.latents, Dk = dims_.key_dim, Dv = dims_.value_dim;
    detail::check_shape(q, "query_logits", {B, Tn, H, L + 1}, "[B, T, H, L+1]");
    detail::check_shape(k, "key_logits", {B, Tn, H, L}, "[B, T, H, L]");
    detail::check_shape(wq, "window_queries", {B, Tn, H, Dk}, "[B, T, H, Dk]");
    detail::check_shape(wk, "window_keys", {B, Tn, H, Dk}, "[B, T, H, Dk]");
    detail::check_shape(v, "values", {B, Tn, H, Dv}, "[B, T, H, Dv]");
  }

  template <class T>
  void validate_backward(const TensorView<const T, 4>& q, const TensorView<const T, 4>& k,
                         const TensorView<const T, 4>& wq, const TensorView<const T, 4>& wk,
                         const TensorView<const T, 4>& v, const TensorView<const T, 4>& d_out,
                         const MacchiatoGradients<T>& gradients) const {
    validate_inputs(q, k, wq, wk, v);
    const index_t B = q.extent(0), Tn = q.extent(1), H = dims_.heads;
    const index_t L = dims_.latents, Dk = dims_.key_dim, Dv = dims_.value_dim;
    detail::check_shape(d_out, "d_out", {B, Tn, H, Dv}, "[B, T, H, Dv]");
    // Named references, not a structured binding: clang 14 cannot capture those.
    const TensorView<T, 4>& dq = gradients.d_query_logits;
    const TensorView<T, 4>& dk = gradients.d_key_logits;
    const TensorView<T, 4>& dwq = gradients.d_window_queries;
    const TensorView<T, 4>& dwk = gradients.d_window_keys;
    const TensorView<T, 4>& dv = gradients.d_values;
    const TensorView<T, 2>& d_angles = gradients.d_angles;
    detail::check_shape(dq, "gradients.d_query_logits", {B, Tn, H, L + 1}, "[B, T, H, L+1]");
    detail::check_shape(dk, "gradients.d_key_logits", {B, Tn, H, L}, "[B, T, H, L]");
    detail::check_shape(dwq, "gradients.d_window_queries", {B, Tn, H, Dk}, "[B, T, H, Dk]");
    detail::check_shape(dwk, "gradients.d_window_keys", {B, Tn, H, Dk}, "[B, T, H, Dk]");
    detail::check_shape(dv, "gradients.d_values", {B, Tn, H, Dv}, "[B, T, H, Dv]");
    const auto inputs = std::tuple(
        detail::named(q, "query_logits"), detail::named(k, "key_logits"),
        detail::named(wq, "window_queries"), detail::named(wk, "window_keys"),
        detail::named(v, "values"), detail::named(d_out, "d_out"));
    const auto n_dq = detail::named(dq, "gradients.d_query_logits");
    const auto n_dk = detail::named(dk, "gradients.d_key_logits");
    const auto n_dwq = detail::named(dwq, "gradients.d_window_queries");
    const auto n_dwk = detail::named(dwk, "gradients.d_window_keys");
    std::apply([&](const auto&... in) {
      detail::check_output(dq, "gradients.d_query_logits", in...);
      detail::check_output(dk, "gradients.d_key_logits", in..., n_dq);
      detail::check_output(dwq, "gradients.d_window_queries", in..., n_dq, n_dk);
      detail::check_output(dwk, "gradients.d_window_keys", in..., n_dq, n_dk, n_dwq);
      detail::check_output(dv, "gradients.d_values", in..., n_dq, n_dk, n_dwq, n_dwk);
    }, inputs);
    if (d_angles.empty()) return;
    detail::require(LatentPos::rotates_values, "gradients.d_angles",
                    "only VAPOR has angles to differentiate (leave d_angles empty)");
    detail::check_shape(d_angles, "gradients.d_angles", {H, Dv / 2}, "[H, Dv/2]");
    std::apply([&](const auto&... in) {
      detail::check_output(d_angles, "gradients.d_angles", in..., n_dq, n_dk, n_dwq, n_dwk,
                           detail::named(dv, "gradients.d_values"));
    }, inputs);
  }

  template <class Q, class K, class WQ, class WK, class V, class O>
  static void check_outputs_distinct(const Q& q, const K& k, const WQ& wq, const WK& wk,
                                     const V& v, const O& out) {
    detail::check_output(out, "out", detail::named(q, "query_logits"),
                         detail::named(k, "key_logits"), detail::named(wq, "window_queries"),
                         detail::named(wk, "window_keys"), detail::named(v, "values"));
  }

 public:
  /// Throws latte::Error unless `state` belongs to this attention (kind and sizes)
  /// and can take `new_tokens` more tokens of `batch` sequences (capacity): the
  /// check every call with a state makes first. Public so that a caller running
  /// many states (forward_packed) checks them all before any of them moves.
  /// Allocation-free on success (step calls it per token).
  template <Real T>
  void validate_state(const State<T>& state, index_t batch, index_t new_tokens) const {
    const MacchiatoDims& d = dims_;
    const bool matches = state.kind() == kinds_.template get<T>() && state.batch() == batch &&
                         state.heads() == d.heads && state.latents() == d.latents &&
                         state.key_dim() == d.key_dim && state.value_dim() == d.value_dim &&
                         state.window() == d.window;
    if (!matches)
      state.require_matches(kind<T>(), State<T>::sizes_for(batch, d.heads, d.latents, d.key_dim,
                                                           d.value_dim, d.window));
    state.require_room(new_tokens);
    if (state.window_fill() < 0)
      throw Error("state", detail::expected_given(
                               "window_fill",
                               "an integer in [0, " + std::to_string(state.window_fill_limit()) +
                                   "] (min(w + 1, position))",
                               *state.field(7)));
  }

 private:
  MacchiatoDims dims_;
  MacchiatoOptions options_;
  double scale_ = 1.0;
  std::vector<double> latent_angles_;  // [H * (Dv/2)] for VAPOR, empty otherwise
  std::vector<double> key_angles_;     // [H * (Dk/2)] for RoPE, empty otherwise
  detail::KindNames kinds_;
};

}  // namespace latte
