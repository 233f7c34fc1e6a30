#pragma once
// bf16 twins of a call's fp32 views, for the tables and harnesses that build
// malformed fp32 calls (malformed_cases.hpp, the fuzz harness): every buffer
// behind the views gets a bf16 copy, and each view maps to a view of the copy
// with the same element offset, extents and strides. So a null pointer stays
// null, a negative or doubled stride stays one, and out aliasing or overlapping
// an input does so element for element, as in the fp32 call. After a call that
// succeeded, write_back() widens the bf16 out into the fp32 out, where the
// table's "writes all of out" check reads it.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <vector>

#include "latte/core/half_float.hpp"
#include "latte/core/tensor_view.hpp"

namespace latte::test {

/// One fp32 buffer behind a call's views.
struct FloatBuffer {
  const float* data;
  index_t count;
};

template <std::size_t N, HalfFloat H = bfloat16>
class HalfShadow {
 public:
  /// Twins of the elements the views address (the views must fit their buffers).
  HalfShadow(const std::vector<TensorView<const float, N>>& inputs, const TensorView<float, N>& out)
      : HalfShadow(spans(inputs, out), inputs, out) {}

  /// Twins of whole buffers (for views that may not fit them: a refused call's).
  HalfShadow(const std::vector<FloatBuffer>& buffers, const std::vector<TensorView<const float, N>>& inputs,
             const TensorView<float, N>& out) {
    for (const FloatBuffer& b : buffers)
      if (b.data != nullptr && b.count > 0) groups_.push_back({b.data, b.data + b.count, {}});
    std::sort(groups_.begin(), groups_.end(), [](const Group& a, const Group& b) { return less(a.lo, b.lo); });
    std::vector<Group> merged;  // overlapping spans share one copy (aliasing is kept)
    for (const Group& g : groups_) {
      if (!merged.empty() && less(g.lo, merged.back().hi)) {
        if (less(merged.back().hi, g.hi)) merged.back().hi = g.hi;
      } else {
        merged.push_back(g);
      }
    }
    groups_ = std::move(merged);
    for (Group& g : groups_)
      for (const float* p = g.lo; p != g.hi; ++p) g.copy.push_back(H(*p));
    for (const auto& view : inputs)
      inputs_.emplace_back(map(view.data()), view.extents(), view.strides());
    out_ = TensorView<H, N>(const_cast<H*>(map(out.data())), out.extents(), out.strides());
    for (const Group& g : groups_) before_.push_back(g.copy);
  }
  HalfShadow(const HalfShadow&) = delete;
  HalfShadow& operator=(const HalfShadow&) = delete;

  [[nodiscard]] const std::vector<TensorView<const H, N>>& inputs() const noexcept { return inputs_; }
  [[nodiscard]] const TensorView<H, N>& out() const noexcept { return out_; }

  /// Whether any copied element changed since construction.
  [[nodiscard]] bool changed() const {
    for (std::size_t g = 0; g < groups_.size(); ++g)
      for (std::size_t i = 0; i < groups_[g].copy.size(); ++i)
        if (groups_[g].copy[i].bits() != before_[g][i].bits()) return true;
    return false;
  }

  /// out <- float(the bf16 out), element by element.
  void write_back(const TensorView<float, N>& out) const {
    if (out.data() == nullptr || out.empty()) return;
    std::array<index_t, N> at{};
    for (;;) {
      index_t from = 0;
      for (std::size_t d = 0; d < N; ++d) from += at[d] * out.stride(d);
      out.data()[from] = static_cast<float>(out_.data()[from]);
      std::size_t d = N;
      while (d-- > 0 && ++at[d] == out.extent(d)) at[d] = 0;
      if (d == static_cast<std::size_t>(-1)) return;
    }
  }

 private:
  struct Group {
    const float *lo, *hi;
    std::vector<H> copy;
  };
  static bool less(const float* a, const float* b) {
    return reinterpret_cast<std::uintptr_t>(a) < reinterpret_cast<std::uintptr_t>(b);
  }
  static std::vector<FloatBuffer> spans(const std::vector<TensorView<const float, N>>& inputs,
                                        const TensorView<float, N>& out) {
    std::vector<FloatBuffer> buffers;
    auto add = [&](const float* data, const auto& view) {
      if (data == nullptr || view.empty()) return;
      index_t low = 0, high = 0;
      for (std::size_t d = 0; d < N; ++d) {
        const index_t reach = (view.extent(d) - 1) * view.stride(d);
        (reach < 0 ? low : high) += reach;
      }
      buffers.push_back({data + low, high - low + 1});
    };
    for (const auto& view : inputs) add(view.data(), view);
    add(out.data(), out);
    return buffers;
  }
  const H* map(const float* data) const {
    if (data == nullptr) return nullptr;
    for (const Group& g : groups_)
      if (!less(data, g.lo) && less(data, g.hi)) return g.copy.data() + (data - g.lo);
    return &empty_;  // an empty view: any address
  }

  std::vector<Group> groups_;
  std::vector<std::vector<H>> before_;
  std::vector<TensorView<const H, N>> inputs_;
  TensorView<H, N> out_;
  H empty_{};
};

/// Runs call(bf16 inputs, bf16 out) on twins of `inputs` and `out`; on success
/// writes the result back into `out`. A call that throws after changing a twin
/// is reported as a std::logic_error (a refused call must change nothing).
template <std::size_t N, class Call>
void call_in_bf16(const std::vector<TensorView<const float, N>>& inputs, const TensorView<float, N>& out,
                  Call&& call) {
  HalfShadow<N> shadow(inputs, out);
  try {
    call(shadow.inputs(), shadow.out());
  } catch (...) {
    if (shadow.changed()) throw std::logic_error("a refused bf16 call changed its buffers");
    throw;
  }
  shadow.write_back(out);
}

}  // namespace latte::test
