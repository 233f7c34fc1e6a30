#pragma once
// CPU backend for Latte's backward: the reference recurrences of
// backends/reference/latte.hpp (DESIGN §3.6), one task per (batch, head) over
// OpenMP threads. Not yet vectorised or blocked: the xsimd scan is issue 22's
// next step (docs/backward.md says where the speed stands).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "latte/backends/cpu/parallel.hpp"
#include "latte/backends/reference/latte.hpp"
#include "latte/core/checked_size.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/policies/positional.hpp"
#include "latte/policies/stabilizer.hpp"

namespace latte::cpu {

namespace detail {

/// The [1, T, 1, D] view of one (batch, head) of a [B, T, H, D] view.
template <class T>
TensorView<T, 4> head_view(const TensorView<T, 4>& x, index_t b, index_t h) {
  return TensorView<T, 4>(x.data() + b * x.stride(0) + h * x.stride(2),
                          {1, x.extent(1), 1, x.extent(3)},
                          {x.stride(0), x.stride(1), x.stride(2), x.stride(3)});
}

/// Runs `backward(head views..., angles of the head, d_angles of the task)`
/// for every (batch, head) in parallel; per-task angle gradients are summed
/// into `d_angles` [H * (Dv/2)] afterwards, in a fixed order.
template <Real T, class Backward>
void for_each_head(const TensorView<const T, 4>& q, index_t Dv, const std::vector<double>& angles,
                   double* d_angles, Backward&& backward) {
  const index_t B = q.extent(0), H = q.extent(2), pairs = Dv / 2, heads = B * H;
  std::vector<double> task_d_angles(d_angles ? static_cast<std::size_t>(
                                                   latte::detail::checked_count<double>(
                                                       "d_angles", {heads, pairs}))
                                             : 0);
  parallel_for(heads, thread_count(), [&](index_t i, int) {
    const index_t b = i / H, h = i % H;
    const std::vector<double> head_angles =
        angles.empty() ? std::vector<double>{}
                       : std::vector<double>(angles.begin() + h * pairs,
                                             angles.begin() + (h + 1) * pairs);
    backward(b, h, head_angles, d_angles ? task_d_angles.data() + i * pairs : nullptr);
  });
  if (d_angles)
    for (index_t i = 0; i < heads; ++i)
      for (index_t j = 0; j < pairs; ++j) d_angles[(i % H) * pairs + j] += task_d_angles[i * pairs + j];
}

}  // namespace detail

/// Causal Latte backward; the arguments are reference::latte_causal_backward's.
template <Stabilizer Stab, Positional Pos, Real T, class InitialOf, class FinalGradientOf,
          class InitialGradientOf>
void latte_causal_backward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                           TensorView<const T, 4> v, TensorView<const T, 4> g,
                           TensorView<T, 4> dq, TensorView<T, 4> dk, TensorView<T, 4> dv,
                           const std::vector<double>& angles, std::int64_t first_position,
                           InitialOf&& initial_of, FinalGradientOf&& final_gradient_of,
                           InitialGradientOf&& initial_gradient_of, double* d_angles) {
  using detail::head_view;
  detail::for_each_head<T>(q, v.extent(3), angles, d_angles,
                           [&](index_t b, index_t h, const std::vector<double>& head_angles,
                               double* head_d_angles) {
    reference::latte_causal_backward<Stab, Pos>(
        head_view(q, b, h), head_view(k, b, h), head_view(v, b, h), head_view(g, b, h),
        head_view(dq, b, h), head_view(dk, b, h), head_view(dv, b, h), head_angles,
        first_position, [&](index_t, index_t, auto carry) { initial_of(b, h, carry); },
        [&](index_t, index_t, const T* m_T) { return final_gradient_of(b, h, m_T); },
        [&](index_t, index_t) { return initial_gradient_of(b, h); }, head_d_angles);
  });
}

/// Bidirectional Latte backward; the arguments are reference::latte_bidirectional_backward's.
template <Stabilizer Stab, Positional Pos, Real T>
void latte_bidirectional_backward(TensorView<const T, 4> q, TensorView<const T, 4> k,
                                  TensorView<const T, 4> v, TensorView<const T, 4> g,
                                  TensorView<T, 4> dq, TensorView<T, 4> dk, TensorView<T, 4> dv,
                                  const std::vector<double>& angles, double* d_angles) {
  using detail::head_view;
  detail::for_each_head<T>(q, v.extent(3), angles, d_angles,
                           [&](index_t b, index_t h, const std::vector<double>& head_angles,
                               double* head_d_angles) {
    reference::latte_bidirectional_backward<Stab, Pos>(
        head_view(q, b, h), head_view(k, b, h), head_view(v, b, h), head_view(g, b, h),
        head_view(dq, b, h), head_view(dk, b, h), head_view(dv, b, h), head_angles,
        head_d_angles);
  });
}

}  // namespace latte::cpu
