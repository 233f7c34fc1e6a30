#pragma once
// latte::TensorView<T, N> — a non-owning strided view.
//
// Activations are [B, T, H, D] (batch, time, head, feature), the layout of
// FlashAttention and flash-linear-attention. The last (feature) dimension is
// contiguous (stride 1); the other strides are free, so a view can address
// a slice of a fused QKV buffer or a [T, B, H, D] tensor without copying.
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>

#include "latte/core/error.hpp"
#include "latte/core/types.hpp"

namespace latte {

template <class T, std::size_t N>
class TensorView {
  static_assert(N >= 1, "a TensorView has at least one dimension");

 public:
  using element_type = T;
  using extents_type = std::array<index_t, N>;
  static constexpr std::size_t rank = N;

  TensorView() = default;

  /// A contiguous row-major view of `extents`.
  TensorView(T* data, const extents_type& extents) : data_(data), extents_(extents) {
    // Unsigned, so that absurd extents wrap instead of overflowing (check_view refuses them).
    std::uint64_t stride = 1;
    for (std::size_t d = N; d-- > 0;) {
      strides_[d] = static_cast<index_t>(stride);
      stride *= static_cast<std::uint64_t>(extents_[d]);
    }
  }

  /// A strided view; strides are in elements. The last stride must be 1.
  TensorView(T* data, const extents_type& extents, const extents_type& strides)
      : data_(data), extents_(extents), strides_(strides) {}

  /// Views of T convert to views of const T.
  template <class U>
    requires(std::is_same_v<const U, T> && !std::is_same_v<U, T>)
  TensorView(const TensorView<U, N>& other)  // NOLINT(google-explicit-constructor)
      : data_(other.data()), extents_(other.extents()), strides_(other.strides()) {}

  [[nodiscard]] T* data() const noexcept { return data_; }
  [[nodiscard]] const extents_type& extents() const noexcept { return extents_; }
  [[nodiscard]] const extents_type& strides() const noexcept { return strides_; }
  [[nodiscard]] index_t extent(std::size_t d) const noexcept { return extents_[d]; }
  [[nodiscard]] index_t stride(std::size_t d) const noexcept { return strides_[d]; }

  [[nodiscard]] index_t size() const noexcept {
    index_t count = 1;
    for (index_t e : extents_) count *= e;
    return count;
  }
  /// Some extent is 0 (decided without size(), which overflows on absurd extents).
  [[nodiscard]] bool empty() const noexcept {
    for (index_t e : extents_)
      if (e == 0) return true;
    return false;
  }

  /// Element access; unchecked (kernels only run on validated views).
  template <class... Index>
    requires(sizeof...(Index) == N)
  [[nodiscard]] T& operator()(Index... index) const noexcept {
    const std::array<index_t, N> at{static_cast<index_t>(index)...};
    index_t offset = 0;
    for (std::size_t d = 0; d < N; ++d) offset += at[d] * strides_[d];
    return data_[offset];
  }

  /// Pointer to the contiguous innermost row at the leading N-1 indices.
  template <class... Index>
    requires(sizeof...(Index) == N - 1)
  [[nodiscard]] T* row(Index... index) const noexcept {
    const std::array<index_t, N - 1> at{static_cast<index_t>(index)...};
    index_t offset = 0;
    for (std::size_t d = 0; d + 1 < N; ++d) offset += at[d] * strides_[d];
    return data_ + offset;
  }

  /// Address range [first, last) of the bytes this view can touch (empty: both null).
  [[nodiscard]] std::array<const std::byte*, 2> byte_range() const noexcept {
    if (empty() || data_ == nullptr) return {nullptr, nullptr};
    index_t last = 0;
    for (std::size_t d = 0; d < N; ++d) last += (extents_[d] - 1) * strides_[d];
    const auto* first = reinterpret_cast<const std::byte*>(data_);
    return {first, first + (last + 1) * static_cast<index_t>(sizeof(T))};
  }

 private:
  T* data_ = nullptr;
  extents_type extents_{};
  extents_type strides_{};
};

template <class T, std::size_t N>
TensorView(T*, const std::array<index_t, N>&) -> TensorView<T, N>;

/// Renders extents as "[2, 128, 8, 64]" for error messages.
template <std::size_t N>
[[nodiscard]] std::string format_extents(const std::array<index_t, N>& extents) {
  std::string text = "[";
  for (std::size_t d = 0; d < N; ++d) {
    if (d) text += ", ";
    text += std::to_string(extents[d]);
  }
  return text + "]";
}

/// Checks the structural invariants every kernel relies on: non-negative
/// extents, non-negative strides, a contiguous last dimension, an element count
/// and byte span that index_t can hold, and non-null data when the view is not
/// empty. Throws latte::Error naming `argument`.
template <class T, std::size_t N>
void check_view(const TensorView<T, N>& view, std::string_view argument) {
  // Messages are built only on failure: step() calls this per token.
  for (std::size_t d = 0; d < N; ++d) {
    if (view.extent(d) < 0)
      throw Error(argument, "extents must be non-negative, given " + format_extents(view.extents()));
    if (view.stride(d) < 0)
      throw Error(argument, "strides must be non-negative, given " + format_extents(view.strides()));
  }
  if (view.extent(N - 1) > 1 && view.stride(N - 1) != 1)
    throw Error(argument, detail::expected_given("stride of the feature (last) dimension", 1,
                                                 view.stride(N - 1)));
  // Its element count and the bytes it spans must fit index_t: size() and
  // byte_range() compute them, and no real buffer is larger.
  if (!view.empty()) {
    constexpr index_t most = std::numeric_limits<index_t>::max();
    index_t count = 1, last = 0;  // elements, and the offset of the last one
    bool countable = true;
    for (std::size_t d = 0; d < N && countable; ++d) {
      const index_t extent = view.extent(d), stride = view.stride(d);
      countable = extent <= most / count && (stride == 0 || extent - 1 <= (most - last) / stride);
      if (countable) {
        count *= extent;
        last += (extent - 1) * stride;
      }
    }
    if (!countable || last >= most / static_cast<index_t>(sizeof(T)))
      throw Error(argument, "extents " + format_extents(view.extents()) + " with strides " +
                                format_extents(view.strides()) +
                                " address more elements or bytes than index_t can count");
  }
  if (!view.empty() && view.data() == nullptr)
    throw Error(argument,
                "data is null but the view has " + std::to_string(view.size()) + " elements");
}

/// True when two views may share memory (conservative: compares address ranges).
template <class T, std::size_t N, class U, std::size_t M>
[[nodiscard]] bool may_overlap(const TensorView<T, N>& a, const TensorView<U, M>& b) noexcept {
  const auto [a_first, a_last] = a.byte_range();
  const auto [b_first, b_last] = b.byte_range();
  if (a_first == nullptr || b_first == nullptr) return false;
  return a_first < b_last && b_first < a_last;
}

}  // namespace latte
