#pragma once
// latte::SoftmaxAttention<Direction, Window> — exact scaled dot-product attention
// (DESIGN §3.1), the baseline every linear mechanism is measured against:
//   o_t = sum_s a_ts v_s,  a_ts = softmax_s(scale * q_t . k_s) over the allowed s,
// allowed = all s (Bidirectional), s <= t (Causal), and with
// SlidingWindow{left, right}: t - left <= s <= t + right (FlashAttention's convention).
// Default scale 1/sqrt(Dk). Causal decode keeps a KV cache (KVCache<T>).
// backward gives the gradients of a loss from d_out (DESIGN §3.6).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

#include "latte/backends/cpu/softmax.hpp"
#include "latte/backends/reference/softmax.hpp"
#include "latte/core/checked_size.hpp"
#include "latte/core/shape_check.hpp"
#include "latte/core/state_storage.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/mechanisms/kv_cache.hpp"
#include "latte/mechanisms/softmax_gradients.hpp"
#include "latte/policies/direction.hpp"
#include "latte/policies/execution.hpp"
#include "latte/policies/window.hpp"
#if LATTE_CUDA_KERNELS
#include "latte/backends/cuda/softmax.cuh"
#endif

namespace latte {

struct SoftmaxDims {
  index_t heads = 0;
  index_t key_dim = 0;    ///< Dk: query/key features per head
  index_t value_dim = 0;  ///< Dv: value features per head
};

template <Direction Dir, Window Win = NoWindow>
class SoftmaxAttention {
  // Decode (KV cache) knows these two windows; a user-defined window works in forward only.
  static constexpr bool decodes_window =
      std::is_same_v<Win, NoWindow> || std::is_same_v<Win, SlidingWindow>;

 public:
  using direction = Dir;
  using window_type = Win;
  template <Real T>
  using State = KVCache<T>;
  /// What backward writes (its first members: the inputs' gradients, in call order).
  template <Real T>
  using Gradients = SoftmaxGradients<T>;
  template <Real T>
  using InputView = std::type_identity_t<TensorView<const T, 4>>;
  template <Real T>
  using StepInputView = std::type_identity_t<TensorView<const T, 3>>;

  /// `scale` defaults to 1/sqrt(Dk).
  explicit SoftmaxAttention(SoftmaxDims dims, Win window = {},
                            std::optional<double> scale = std::nullopt)
      : dims_(dims), window_(window) {
    detail::check_positive(dims.heads, "dims.heads");
    detail::check_positive(dims.key_dim, "dims.key_dim");
    detail::check_positive(dims.value_dim, "dims.value_dim");
    window.validate(Dir::is_causal);
    // One cached token of every head (load_state divides by it).
    detail::checked_count<double>(
        "dims", {dims.heads, detail::checked_sum("dims", {dims.key_dim, dims.value_dim})});
    scale_ = scale.value_or(1.0 / std::sqrt(static_cast<double>(dims.key_dim)));
    detail::require(std::isfinite(scale_), "scale",
                    detail::expected_given("value", "a finite number", scale_));
  }

  [[nodiscard]] const SoftmaxDims& dims() const noexcept { return dims_; }
  [[nodiscard]] const Win& window() const noexcept { return window_; }

  /// The work of a causal prefill of `length` tokens, as the keys its queries
  /// attend to in all (n (n + 1) / 2; with a window of `left`, n min(n, left + 1)):
  /// forward_packed's schedule weighs sequences by it (a linear-time mechanism,
  /// by its length).
  [[nodiscard]] double prefill_cost(index_t length) const noexcept {
    const double n = static_cast<double>(length);
    if constexpr (std::is_same_v<Win, SlidingWindow>)
      return n * std::min(n, static_cast<double>(window_.left) + 1.0);
    else
      return n * (n + 1.0) / 2.0;
  }
  [[nodiscard]] double scale() const noexcept { return scale_; }

  template <Real T>
  [[nodiscard]] static std::string kind() {
    return std::string("SoftmaxAttention<") + Dir::name + "," + Win::name + ">/" + dtype_name<T>();
  }

  /// Whole-sequence forward. T = 0 (or B = 0) is a no-op. With exec::cuda the
  /// views address device memory and the work is queued on the tag's stream.
  template <exec::Policy E, Real T>
  void forward(E e, InputView<T> queries, InputView<T> keys, InputView<T> values,
               TensorView<T, 4> out) const {
    static_assert(!exec::cuda_unavailable<E>,
                  "latte::exec::cuda needs this file compiled by nvcc with LATTE_WITH_CUDA "
                  "(the CUDA kernels are .cuh templates that exist in CUDA translation units only)");
    static_assert(exec::implemented<E> || exec::cuda_unavailable<E>,
                  "this execution backend is not implemented yet");
    validate_sequence(queries, keys, values, out);
    (void)e;
    if (out.empty()) return;  // no output: allocate and loop over nothing
    if constexpr (std::is_same_v<E, exec::cuda_t>) {
#if LATTE_CUDA_KERNELS
      forward_cuda(e, queries, keys, values, out);
#endif
    } else if constexpr (std::is_same_v<E, exec::cpu_t>)
      cpu::softmax_forward<Dir::is_causal>(queries, keys, values, out, static_cast<T>(scale_),
                                           window_);
    else
      reference::softmax_forward<Dir::is_causal>(queries, keys, values, out,
                                                 static_cast<T>(scale_), window_);
  }

  /// Gradients of a loss L with respect to queries, keys and values, given
  /// d_out = dL/dout [B, T, H, Dv] (FlashAttention-2's backward, DESIGN §3.6).
  /// Nothing is kept from the forward: each row's softmax and <d_out, out> are
  /// recomputed. Overwrites the three gradient buffers, which must not share
  /// an element with an input or with each other. T = 0 is a no-op.
  template <exec::Policy E, Real T>
  void backward(E e, InputView<T> queries, InputView<T> keys, InputView<T> values,
                InputView<T> d_out, SoftmaxGradients<T> gradients) const {
    static_assert(!std::is_same_v<E, exec::cuda_t>,
                  "SoftmaxAttention::backward runs on exec::reference and exec::cpu only for now");
    static_assert(exec::implemented<E>, "this execution backend is not implemented yet");
    validate_backward(queries, keys, values, d_out, gradients);
    (void)e;
    if (d_out.empty()) return;  // no gradient to write: allocate and loop over nothing
    const auto [d_queries, d_keys, d_values] = gradients;
    if constexpr (std::is_same_v<E, exec::cpu_t>)
      cpu::softmax_backward<Dir::is_causal>(queries, keys, values, d_out, d_queries, d_keys,
                                            d_values, static_cast<T>(scale_), window_);
    else
      reference::softmax_backward<Dir::is_causal>(queries, keys, values, d_out, d_queries, d_keys,
                                                  d_values, static_cast<T>(scale_), window_);
  }

#if LATTE_CUDA_KERNELS
  /// exec::cuda with fp16 or bf16 inputs and output; every sum is fp32.
  template <cuda::HalfElement T>
  void forward(exec::cuda_t e, std::type_identity_t<TensorView<const T, 4>> queries,
               std::type_identity_t<TensorView<const T, 4>> keys,
               std::type_identity_t<TensorView<const T, 4>> values, TensorView<T, 4> out) const {
    validate_sequence(queries, keys, values, out);
    forward_cuda(e, queries, keys, values, out);
  }
#endif

  /// A KV cache for `batch` sequences. With SlidingWindow the capacity is
  /// left + 1 and `capacity` is ignored; without a window it is the longest
  /// context the cache can hold.
  template <Real T>
    requires(Dir::is_causal && decodes_window)
  [[nodiscard]] State<T> make_state(index_t batch, index_t capacity = 0) const {
    detail::check_positive(batch, "batch");
    capacity = tokens_visible_at_most(capacity);
    detail::check_positive(capacity, "capacity");
    // One sequence's cache first, so that a huge window or capacity is named as such.
    detail::checked_count<T>(std::is_same_v<Win, SlidingWindow> ? "window.left" : "capacity",
                             {dims_.heads, capacity, dims_.key_dim + dims_.value_dim});
    return State<T>(kind<T>(), batch, dims_.heads, dims_.key_dim, dims_.value_dim, capacity);
  }

  /// Restores a cache saved with State::save() by an attention of this type.
  /// The buffer is checked whole before a cache is allocated from it.
  template <Real T>
    requires(Dir::is_causal)
  [[nodiscard]] State<T> load_state(std::span<const std::byte> bytes) const {
    const auto header = StateStorage<T>::read_header(bytes, kind<T>());
    detail::require(header.sizes.size() == 5, "bytes",
                    detail::expected_given("saved sizes", 5, header.sizes.size()));
    const index_t capacity = header.sizes[4].value;
    const index_t needed = tokens_visible_at_most(1);
    detail::require(capacity >= needed, "bytes",
                    detail::expected_given("saved capacity", ">= " + std::to_string(needed),
                                           capacity));
    const SoftmaxDims& d = dims_;
    // Bound the capacity by the buffer before any count is computed from it.
    const index_t per_slot = d.heads * (d.key_dim + d.value_dim);
    const auto slots_held = static_cast<index_t>(bytes.size() / sizeof(T)) / per_slot;
    detail::require(capacity <= slots_held, "bytes",
                    detail::expected_given("saved capacity",
                                           "<= " + std::to_string(slots_held) +
                                               " (what the buffer can hold)",
                                           capacity));
    const index_t batch = StateStorage<T>::saved_batch(
        header, bytes, State<T>::sizes_for(1, d.heads, d.key_dim, d.value_dim, capacity),
        [&](index_t b) {
          return State<T>::fields_for(b, d.heads, d.key_dim, d.value_dim, capacity);
        });
    StateStorage<T>::require_layout(
        header, State<T>::sizes_for(batch, d.heads, d.key_dim, d.value_dim, capacity),
        State<T>::fields_for(batch, d.heads, d.key_dim, d.value_dim, capacity));
    State<T> state(kind<T>(), batch, d.heads, d.key_dim, d.value_dim, capacity);
    state.restore(bytes);
    return state;
  }

  /// Forward that continues from the cache and leaves it at the end of the sequence.
  template <exec::Policy E, Real T>
    requires(Dir::is_causal)
  void forward(E e, InputView<T> queries, InputView<T> keys, InputView<T> values,
               TensorView<T, 4> out, State<T>& state) const {
    static_assert(!std::is_same_v<E, exec::cuda_t>,
                  "KVCache lives in host memory: decode on exec::cuda runs through "
                  "latte::cuda::softmax_step with a KVDeviceCache (backends/cuda/softmax.cuh)");
    validate_sequence(queries, keys, values, out);
    validate_state(state, queries.extent(0), queries.extent(1));
    if constexpr (std::is_same_v<E, exec::cpu_t> && std::is_same_v<Win, SlidingWindow>) {
      // Blocked: the windowed softmax over the tokens, the first window.left
      // rows again over the cache (their windows reach into it).
      cpu::window_outputs_after_ring(queries, keys, values, out, static_cast<T>(scale_),
                                     window_.left, state.capacity(), state.position(),
                                     [&](index_t b, index_t h) { return state.slots(b, h); });
      state.advance(queries.extent(1));
      return;
    }
    for (index_t t = 0; t < queries.extent(1); ++t) {
      auto at = [t](const auto& view) { return slice_time(view, t); };
      step(e, state, at(queries), at(keys), at(values), at(out));
    }
  }

  /// Advances the cache over keys [B, T, H, Dk] and values [B, T, H, Dv]
  /// without computing outputs: the slots forward would leave (the last
  /// `capacity` tokens'). For a prompt whose outputs are not needed, and a
  /// slice's summary in sequence parallelism (latte/distributed/).
  template <exec::Policy E, Real T>
    requires(Dir::is_causal && decodes_window)
  void absorb(E, InputView<T> keys, InputView<T> values, State<T>& state) const {
    static_assert(!std::is_same_v<E, exec::cuda_t>,
                  "KVCache lives in host memory: use exec::cpu or exec::reference");
    check_view(keys, "keys");
    const index_t B = keys.extent(0), Tn = keys.extent(1), H = dims_.heads;
    detail::check_shape(keys, "keys", {B, Tn, H, dims_.key_dim}, "[B, T, H, Dk]");
    detail::check_shape(values, "values", {B, Tn, H, dims_.value_dim}, "[B, T, H, Dv]");
    validate_state(state, B, Tn);
    const index_t capacity = state.capacity();
    for (index_t b = 0; b < B; ++b)
      for (index_t h = 0; h < H; ++h) {
        const reference::KVSlots<T> slots = state.slots(b, h);
        for (index_t t = std::max<index_t>(0, Tn - capacity); t < Tn; ++t) {
          const auto slot = static_cast<index_t>((state.position() + t) % capacity);
          std::copy_n(keys.row(b, t, h), dims_.key_dim, slots.keys + slot * dims_.key_dim);
          std::copy_n(values.row(b, t, h), dims_.value_dim, slots.values + slot * dims_.value_dim);
        }
      }
    state.advance(Tn);
  }

  /// Next-token decode: inputs [B, H, Dk], [B, H, Dk], [B, H, Dv]; out [B, H, Dv].
  /// O(context * D) per head: the KV-cache baseline.
  template <exec::Policy E, Real T>
    requires(Dir::is_causal)
  void step(E, State<T>& state, StepInputView<T> queries, StepInputView<T> keys,
            StepInputView<T> values, TensorView<T, 3> out) const {
    static_assert(!std::is_same_v<E, exec::cuda_t>,
                  "KVCache lives in host memory: decode on exec::cuda runs through "
                  "latte::cuda::softmax_step with a KVDeviceCache (backends/cuda/softmax.cuh)");
    static_assert(exec::implemented<E>, "this execution backend is not implemented yet");
    const index_t B = state.batch(), H = dims_.heads;
    validate_state(state, B, 1);
    detail::check_shape(queries, "queries", {B, H, dims_.key_dim}, "[B, H, Dk]");
    detail::check_shape(keys, "keys", {B, H, dims_.key_dim}, "[B, H, Dk]");
    detail::check_shape(values, "values", {B, H, dims_.value_dim}, "[B, H, Dv]");
    detail::check_shape(out, "out", {B, H, dims_.value_dim}, "[B, H, Dv]");
    check_outputs_distinct(queries, keys, values, out);
    const std::int64_t position = state.position();
    // Every token so far, or the window's most recent ones.
    const std::int64_t visible =
        std::min<std::int64_t>(position + 1, tokens_visible_at_most(position + 1));
    const index_t capacity = state.capacity(), Dk = dims_.key_dim, Dv = dims_.value_dim;
    const auto seen = static_cast<index_t>(visible);
    const T scale = static_cast<T>(scale_);
    if constexpr (std::is_same_v<E, exec::cpu_t>) {
      // Threads only pay off on long contexts; a short step runs on the calling thread.
      const double work = double(B * H) * double(seen) * double(Dk + Dv);
      const int workers = work >= 1 << 18 ? cpu::thread_count() : 1;
      cpu::parallel_for(B * H, workers, [&](index_t i, int) {
        const index_t b = i / H, h = i % H;
        cpu::softmax_decode_step(queries.row(b, h), keys.row(b, h), values.row(b, h),
                                 out.row(b, h), state.slots(b, h), capacity, Dk, Dv, scale,
                                 position, seen);
      });
    } else {
      for (index_t b = 0; b < B; ++b)
        for (index_t h = 0; h < H; ++h)
          reference::softmax_decode_step(queries.row(b, h), keys.row(b, h), values.row(b, h),
                                         out.row(b, h), state.slots(b, h), capacity, Dk, Dv,
                                         scale, position, seen);
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
  void backward(InputView<T> queries, InputView<T> keys, InputView<T> values, InputView<T> d_out,
                SoftmaxGradients<T> gradients) const {
    backward(exec::default_t{}, queries, keys, values, d_out, gradients);
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

 private:
#if LATTE_CUDA_KERNELS
  template <class T>
  void forward_cuda(exec::cuda_t e, TensorView<const T, 4> q, TensorView<const T, 4> k,
                    TensorView<const T, 4> v, TensorView<T, 4> out) const {
    static_assert(cuda::DeviceElement<T>,
                  "exec::cuda takes float, __half or __nv_bfloat16 inputs (not double)");
    static_assert(std::is_same_v<Win, NoWindow> || std::is_same_v<Win, SlidingWindow>,
                  "exec::cuda softmax takes NoWindow or SlidingWindow");
    if constexpr (cuda::DeviceElement<T> &&
                  (std::is_same_v<Win, NoWindow> || std::is_same_v<Win, SlidingWindow>))
      cuda::softmax_forward<Dir::is_causal>(cuda::stream_of(e.stream), q, k, v, out,
                                            static_cast<float>(scale_), window_);
  }
#endif

  /// The most tokens a query sees: the window's left side + 1, or `context`.
  [[nodiscard]] index_t tokens_visible_at_most(index_t context) const noexcept {
    if constexpr (std::is_same_v<Win, SlidingWindow>)  // left + 1, saturating (no overflow)
      return window_.left == std::numeric_limits<index_t>::max() ? window_.left : window_.left + 1;
    else
      return context;
  }

  template <class T>
  static TensorView<T, 3> slice_time(const TensorView<T, 4>& view, index_t t) {
    return TensorView<T, 3>(view.data() + t * view.stride(1),
                            {view.extent(0), view.extent(2), view.extent(3)},
                            {view.stride(0), view.stride(2), view.stride(3)});
  }

  template <class T>
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

  template <class T>
  void validate_backward(const TensorView<const T, 4>& q, const TensorView<const T, 4>& k,
                         const TensorView<const T, 4>& v, const TensorView<const T, 4>& d_out,
                         const SoftmaxGradients<T>& gradients) const {
    check_view(q, "queries");
    const index_t B = q.extent(0), Tn = q.extent(1), H = dims_.heads;
    const index_t Dk = dims_.key_dim, Dv = dims_.value_dim;
    detail::check_shape(q, "queries", {B, Tn, H, Dk}, "[B, T, H, Dk]");
    detail::check_shape(k, "keys", {B, Tn, H, Dk}, "[B, T, H, Dk]");
    detail::check_shape(v, "values", {B, Tn, H, Dv}, "[B, T, H, Dv]");
    detail::check_shape(d_out, "d_out", {B, Tn, H, Dv}, "[B, T, H, Dv]");
    const auto& [d_queries, d_keys, d_values] = gradients;
    detail::check_shape(d_queries, "d_queries", {B, Tn, H, Dk}, "[B, T, H, Dk]");
    detail::check_shape(d_keys, "d_keys", {B, Tn, H, Dk}, "[B, T, H, Dk]");
    detail::check_shape(d_values, "d_values", {B, Tn, H, Dv}, "[B, T, H, Dv]");
    auto check_gradient = [&](const TensorView<T, 4>& gradient, std::string_view name) {
      detail::check_output(gradient, name, detail::named(q, "queries"), detail::named(k, "keys"),
                           detail::named(v, "values"), detail::named(d_out, "d_out"));
    };
    check_gradient(d_queries, "d_queries");
    check_gradient(d_keys, "d_keys");
    check_gradient(d_values, "d_values");
    // A pair of gradient buffers sharing an element is reported on the later one.
    auto check_apart = [](const TensorView<T, 4>& later, std::string_view later_name,
                          const TensorView<T, 4>& earlier, std::string_view earlier_name) {
      if (detail::shares_element(later, earlier))
        throw Error(later_name, std::string("shares elements with '") +
                                    std::string(earlier_name) +
                                    "'; gradient buffers must not share memory");
    };
    check_apart(d_keys, "d_keys", d_queries, "d_queries");
    check_apart(d_values, "d_values", d_queries, "d_queries");
    check_apart(d_values, "d_values", d_keys, "d_keys");
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
                         state.heads() == dims_.heads && state.key_dim() == dims_.key_dim &&
                         state.value_dim() == dims_.value_dim;
    if (!matches)
      state.require_matches(kind<T>(), State<T>::sizes_for(batch, dims_.heads, dims_.key_dim,
                                                           dims_.value_dim, state.capacity()));
    state.require_room(new_tokens);
    const std::int64_t needed = tokens_visible_at_most(state.position() + new_tokens);
    if (state.capacity() < needed)  // message built only on failure (step calls this per token)
      throw Error("state", detail::expected_given(
                               std::is_same_v<Win, SlidingWindow>
                                   ? std::string("KV cache capacity for the window (left + 1)")
                                   : "KV cache capacity for " + std::to_string(needed) + " tokens",
                               ">= " + std::to_string(needed), state.capacity()));
  }

 private:
  SoftmaxDims dims_;
  Win window_;
  detail::KindNames kinds_{kind<float>(), kind<double>()};
  double scale_ = 1.0;
};

}  // namespace latte
