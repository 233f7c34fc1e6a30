#pragma once
// bf16 / fp16 activations for any mechanism: HalfPrecision(attention) takes the
// same calls as the attention (forward, forward from a state, step, and through
// them forward_packed), with its activations (inputs and output) in
// latte::bfloat16 or latte::float16. Where the attention reads 16-bit rows
// itself (LatteAttention's forward on exec::cpu: each block of rows widened in
// cache as the kernel reaches it), the call goes straight to it. Otherwise each
// 16-bit input is widened exactly to fp32, the attention runs its fp32 kernel
// (every sum in fp32, the state in fp32), and the output is rounded once to the
// 16-bit type, to nearest even. Either way the output is the fp32 kernel's on
// the rounded inputs, rounded once.
// So the result is the fp32 result on the rounded inputs, rounded: its error
// against the exact attention of the rounded inputs is at most the fp32 bound
// plus one rounding, u |o| with u = 2^-8 (bf16) or 2^-11 (fp16)
// (docs/numerics.md, "16-bit activations").
//
// Workspace of the converting path: one fp32 copy of the call's 16-bit inputs
// and output, freed when the call returns. States are the mechanism's fp32 states
// (attention.make_state<float>(...)), saved and restored as usual.
//
// Inputs that are already fp32 views (LeaPformer's given proportions, say) pass
// through unconverted. The calls are const and keep nothing between calls, so
// one HalfPrecision may serve several threads as the attention itself would.
#include <array>
#include <cstddef>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "latte/backends/cpu/half_conversion.hpp"
#include "latte/core/checked_size.hpp"
#include "latte/core/half_float.hpp"
#include "latte/core/huge_page_allocator.hpp"
#include "latte/core/shape_check.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/policies/execution.hpp"

namespace latte {

namespace detail {

template <class T>
inline constexpr bool is_tensor_view = false;
template <class T, std::size_t N>
inline constexpr bool is_tensor_view<TensorView<T, N>> = true;

template <class T>
inline constexpr bool is_half_view = false;
template <class T, std::size_t N>
inline constexpr bool is_half_view<TensorView<T, N>> = HalfFloat<T>;

/// The fp32 copy of one input: the view itself when it is not 16-bit.
template <class E, class View>
auto widened_input(E, const View& view, AlignedVector<float>& buffer, const std::string& name) {
  if constexpr (is_half_view<View>) {
    constexpr std::size_t N = View::rank;
    using H = std::remove_const_t<typename View::element_type>;
    buffer.resize(static_cast<std::size_t>(
        checked_product(name, std::span<const index_t>(view.extents()), sizeof(float))));
    const TensorView<const H, N> source = view;
    if constexpr (std::is_same_v<E, exec::cpu_t>) {
      cpu::widen(source, buffer.data());
    } else {  // exec::reference: element by element
      index_t i = 0;
      cpu::detail::for_each_row(source, cpu::detail::row_count(source), 1, [&](index_t offset, index_t) {
        for (index_t d = 0; d < source.extent(N - 1); ++d) buffer[static_cast<std::size_t>(i++)] =
            static_cast<float>(source.data()[offset + d]);
      });
    }
    return TensorView<const float, N>(buffer.data(), view.extents());
  } else {
    return view;
  }
}

template <class E, HalfFloat H, std::size_t N>
void narrowed_output(E, const AlignedVector<float>& buffer, const TensorView<H, N>& out) {
  if constexpr (std::is_same_v<E, exec::cpu_t>) {
    cpu::narrow(buffer.data(), out);
  } else {
    index_t i = 0;
    cpu::detail::for_each_row(out, cpu::detail::row_count(out), 1, [&](index_t offset, index_t) {
      for (index_t d = 0; d < out.extent(N - 1); ++d)
        out.data()[offset + d] = H(buffer[static_cast<std::size_t>(i++)]);
    });
  }
}

}  // namespace detail

/// `Attention` reading and writing 16-bit activations (see the file comment).
/// Holds a reference: the attention must outlive it.
template <class Attention>
class HalfPrecision {
 public:
  using attention_type = Attention;
  using direction = typename Attention::direction;
  /// States stay fp32 whatever the activation type (forward_packed names State<T>).
  template <class T>
  using State = typename Attention::template State<float>;

  explicit HalfPrecision(const Attention& attention) noexcept : attention_(&attention) {}
  [[nodiscard]] const Attention& attention() const noexcept { return *attention_; }

  /// attention.forward(e, inputs..., out) or attention.forward(e, inputs..., out,
  /// state) with the inputs and out in bfloat16 / float16 (all of one type).
  template <exec::Policy E, class... Args>
  void forward(E e, Args&&... args) const {
    static_assert(sizeof...(Args) >= 2, "forward(exec, inputs..., out[, state])");
    constexpr std::size_t n = sizeof...(Args);
    using Last = std::remove_cvref_t<std::tuple_element_t<n - 1, std::tuple<Args...>>>;
    if constexpr (requires { attention_->forward(e, std::forward<Args>(args)...); }) {
      // The attention reads 16-bit rows itself (LatteAttention on exec::cpu).
      attention_->forward(e, std::forward<Args>(args)...);
    } else if constexpr (detail::is_tensor_view<Last>) {
      auto all = std::forward_as_tuple(std::forward<Args>(args)...);
      call(e, all, std::make_index_sequence<n - 1>{}, std::get<n - 1>(all),
           [&](const auto& out, const auto&... inputs) { attention_->forward(e, inputs..., out); });
    } else {
      auto all = std::forward_as_tuple(std::forward<Args>(args)...);
      auto& state = std::get<n - 1>(all);
      call(e, all, std::make_index_sequence<n - 2>{}, std::get<n - 2>(all),
           [&](const auto& out, const auto&... inputs) { attention_->forward(e, inputs..., out, state); });
    }
  }

  /// attention.step(e, state, inputs..., out) with the inputs and out 16-bit.
  template <exec::Policy E, class S, class... Args>
  void step(E e, S& state, Args&&... args) const {
    static_assert(sizeof...(Args) >= 2, "step(exec, state, inputs..., out)");
    auto all = std::forward_as_tuple(std::forward<Args>(args)...);
    constexpr std::size_t n = sizeof...(Args);
    call(e, all, std::make_index_sequence<n - 1>{}, std::get<n - 1>(all),
         [&](const auto& out, const auto&... inputs) { attention_->step(e, state, inputs..., out); });
  }

  /// The attention's prefill cost model, where it has one (forward_packed's schedule).
  [[nodiscard]] double prefill_cost(index_t length) const
    requires requires(const Attention& a) { a.prefill_cost(index_t{}); }
  {
    return attention_->prefill_cost(length);
  }

  /// The attention's own state check (forward_packed calls it before any state moves).
  template <class S>
  void validate_state(const S& state, index_t batch, index_t new_tokens) const {
    attention_->validate_state(state, batch, new_tokens);
  }

 private:
  template <class E, class Tuple, std::size_t... I, class Out, class Run>
  static void call(E e, const Tuple& args, std::index_sequence<I...>, const Out& out, Run&& run) {
    static_assert(detail::is_half_view<std::remove_cvref_t<Out>> &&
                      !std::is_const_v<typename std::remove_cvref_t<Out>::element_type>,
                  "HalfPrecision: out is a TensorView of latte::bfloat16 or latte::float16");
    static_assert(!std::is_same_v<E, exec::cuda_t>,
                  "HalfPrecision runs on exec::cpu and exec::reference; exec::cuda takes "
                  "__half / __nv_bfloat16 directly");
    using H = typename std::remove_cvref_t<Out>::element_type;
    // The 16-bit views are read here, before the attention sees its fp32
    // copies: check what it cannot (pointers, strides, sizes, aliasing) first.
    check_view(out, "out");
    detail::check_distinct_elements(out, "out");
    const std::array<std::string, sizeof...(I)> names{("inputs[" + std::to_string(I) + "]")...};
    auto check_input = [&](const auto& view, const std::string& name) {
      using V = std::remove_cvref_t<decltype(view)>;
      if constexpr (detail::is_tensor_view<V>) {
        static_assert(!detail::is_half_view<V> ||
                          std::is_same_v<std::remove_const_t<typename V::element_type>, H>,
                      "HalfPrecision: every 16-bit input has out's element type");
        check_view(view, name);
        detail::check_no_overlap(out, "out", view, name);
      }
    };
    (check_input(std::get<I>(args), names[I]), ...);
    std::array<AlignedVector<float>, sizeof...(I)> buffers;
    const auto widened = std::make_tuple(detail::widened_input(e, std::get<I>(args), buffers[I], names[I])...);
    AlignedVector<float> out_buffer(static_cast<std::size_t>(
        detail::checked_product("out", std::span<const index_t>(out.extents()), sizeof(float))));
    const TensorView<float, std::remove_cvref_t<Out>::rank> out32(out_buffer.data(), out.extents());
    std::apply([&](const auto&... inputs) { run(out32, inputs...); }, widened);
    detail::narrowed_output(e, out_buffer, out);
  }

  const Attention* attention_;
};

}  // namespace latte
