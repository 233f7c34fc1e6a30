#pragma once
// latte::Tensor<T, N> — a small owning, contiguous, row-major tensor for
// examples and tests. Production callers own their memory and pass views.
// Storage comes from HugePageAllocator: long-sequence tensors sit on 2 MiB
// pages where the system allows it (see huge_page_allocator.hpp for why).
#include <algorithm>
#include <array>
#include <cstddef>
#include <vector>

#include "latte/core/checked_size.hpp"
#include "latte/core/error.hpp"
#include "latte/core/huge_page_allocator.hpp"
#include "latte/core/tensor_view.hpp"

namespace latte {

template <class T, std::size_t N>
class Tensor {
 public:
  using extents_type = std::array<index_t, N>;

  Tensor() = default;
  explicit Tensor(const extents_type& extents, T fill = T{}) : extents_(extents) {
    for (index_t e : extents_)
      if (e < 0)  // the message is built only on failure: constructing allocates once
        throw Error("extents", "extents must be non-negative, given " + format_extents(extents_));
    const index_t count = detail::checked_product("extents", extents_, sizeof(T));
    storage_.assign(static_cast<std::size_t>(count), fill);
  }

  [[nodiscard]] TensorView<T, N> view() noexcept { return {storage_.data(), extents_}; }
  [[nodiscard]] TensorView<const T, N> view() const noexcept { return {storage_.data(), extents_}; }
  [[nodiscard]] TensorView<const T, N> cview() const noexcept { return view(); }
  operator TensorView<T, N>() noexcept { return view(); }                   // NOLINT
  operator TensorView<const T, N>() const noexcept { return view(); }      // NOLINT

  [[nodiscard]] const extents_type& extents() const noexcept { return extents_; }
  [[nodiscard]] index_t extent(std::size_t d) const noexcept { return extents_[d]; }
  [[nodiscard]] index_t size() const noexcept { return static_cast<index_t>(storage_.size()); }
  [[nodiscard]] T* data() noexcept { return storage_.data(); }
  [[nodiscard]] const T* data() const noexcept { return storage_.data(); }

  template <class... Index>
    requires(sizeof...(Index) == N)
  [[nodiscard]] T& operator()(Index... index) noexcept { return view()(index...); }
  template <class... Index>
    requires(sizeof...(Index) == N)
  [[nodiscard]] const T& operator()(Index... index) const noexcept { return view()(index...); }

  void fill(T value) { std::fill(storage_.begin(), storage_.end(), value); }

 private:
  extents_type extents_{};
  std::vector<T, HugePageAllocator<T>> storage_;
};

}  // namespace latte
