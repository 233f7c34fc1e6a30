#pragma once
// LeaPModule: the compact network of Learned Proportions (paper 004 §3.2-3.3,
// eq. 10) that turns one feature row into a proportion in (0, 1):
//
//   P = sigmoid(W2 . relu(W1 x + b1) + b2),   x = phi(q_t) or phi(k_s)
//
// W1 is [hidden, D] with hidden = D / leap_factor (PyTorch's nn.Linear(D, hidden)
// weight layout), b1 [hidden], W2 [hidden] (nn.Linear(hidden, 1) weight,
// flattened), b2 a scalar. One module serves the queries and one the keys of
// every head (paper 004 §3.3). Weights are kept and evaluated in double.
#include <array>
#include <cmath>
#include <string>

#include "latte/core/error.hpp"
#include "latte/core/tensor.hpp"
#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/policies/proportion.hpp"

namespace latte {

struct LeaPModule {
  Tensor<double, 2> w1 = {};  ///< [hidden, D]
  Tensor<double, 1> b1 = {};  ///< [hidden]
  Tensor<double, 1> w2 = {};  ///< [hidden]
  double b2 = 0.0;

  [[nodiscard]] index_t hidden() const noexcept { return w1.extent(0); }

  /// A module from float or double views (copied), e.g. trained PyTorch weights.
  template <Real T>
  [[nodiscard]] static LeaPModule from(TensorView<const T, 2> w1, TensorView<const T, 1> b1,
                                       TensorView<const T, 1> w2, T b2) {
    check_view(w1, "w1");
    check_view(b1, "b1");
    check_view(w2, "w2");
    LeaPModule module;
    module.w1 = Tensor<double, 2>({w1.extent(0), w1.extent(1)});
    for (index_t j = 0; j < w1.extent(0); ++j)
      for (index_t f = 0; f < w1.extent(1); ++f) module.w1(j, f) = w1(j, f);
    module.b1 = Tensor<double, 1>({b1.extent(0)});
    for (index_t j = 0; j < b1.extent(0); ++j) module.b1(j) = b1(j);
    module.w2 = Tensor<double, 1>({w2.extent(0)});
    for (index_t j = 0; j < w2.extent(0); ++j) module.w2(j) = w2(j);
    module.b2 = b2;
    return module;
  }

  /// Throws latte::Error naming `<name>.w1` etc. unless the module maps
  /// `input_dim` features through `hidden` units with finite weights.
  void validate(const std::string& name, index_t input_dim, index_t hidden_units) const {
    auto check = [&](const auto& tensor, const std::string& part, const auto& expected,
                     const char* layout) {
      detail::require(tensor.extents() == expected, name + "." + part,
                      detail::expected_given(std::string("shape ") + layout,
                                             format_extents(expected),
                                             format_extents(tensor.extents())));
      for (index_t i = 0; i < tensor.size(); ++i)
        detail::require(std::isfinite(tensor.data()[i]), name + "." + part,
                        "every weight must be finite (element " + std::to_string(i) + ")");
    };
    check(w1, "w1", std::array<index_t, 2>{hidden_units, input_dim}, "[D / leap_factor, D]");
    check(b1, "b1", std::array<index_t, 1>{hidden_units}, "[D / leap_factor]");
    check(w2, "w2", std::array<index_t, 1>{hidden_units}, "[D / leap_factor]");
    detail::require(std::isfinite(b2), name + ".b2", detail::expected_given("value", "finite", b2));
  }

  /// z = W2 . relu(W1 x + b1) + b2 for one row x of the module's input size.
  template <Real T>
  [[nodiscard]] double logit(const T* x) const noexcept {
    const index_t H = w1.extent(0), D = w1.extent(1);
    double z = b2;
    for (index_t j = 0; j < H; ++j) {
      double pre = b1(j);
      for (index_t f = 0; f < D; ++f) pre += w1(j, f) * static_cast<double>(x[f]);
      z += w2(j) * (pre > 0.0 ? pre : 0.0);  // relu
    }
    return z;
  }

  /// P(x) = sigmoid(z) for one row x (paper 004 eq. 10), with its complement sigmoid(-z).
  template <Real T>
  [[nodiscard]] Proportion evaluate(const T* x) const noexcept {
    return Proportion::from_logit(logit(x));
  }

  /// A module of this one's shape with every weight 0: where backward()
  /// accumulates a module's gradient.
  [[nodiscard]] LeaPModule zeros_like() const {
    LeaPModule zeros;
    zeros.w1 = Tensor<double, 2>({w1.extent(0), w1.extent(1)});
    zeros.b1 = Tensor<double, 1>({b1.extent(0)});
    zeros.w2 = Tensor<double, 1>({w2.extent(0)});
    return zeros;
  }

  /// Gradient of P(x) given dL/dP = d_proportion at the row x evaluated to
  /// `proportion`: adds dL/dx into d_x and, when `gradient` is not null, the
  /// weights' gradients into it (a module of this shape). dP/dz = P (1 - P).
  template <Real T>
  void backward(const T* x, const Proportion& proportion, double d_proportion, T* d_x,
                LeaPModule* gradient) const noexcept {
    const index_t H = w1.extent(0), D = w1.extent(1);
    const double d_logit = d_proportion * proportion.value * proportion.complement;
    if (gradient) gradient->b2 += d_logit;
    for (index_t j = 0; j < H; ++j) {
      double pre = b1(j);
      for (index_t f = 0; f < D; ++f) pre += w1(j, f) * static_cast<double>(x[f]);
      if (gradient) gradient->w2(j) += d_logit * (pre > 0.0 ? pre : 0.0);
      if (!(pre > 0.0)) continue;  // relu: no gradient through an inactive unit
      const double d_pre = d_logit * w2(j);
      if (gradient) {
        gradient->b1(j) += d_pre;
        for (index_t f = 0; f < D; ++f) gradient->w1(j, f) += d_pre * static_cast<double>(x[f]);
      }
      for (index_t f = 0; f < D; ++f) d_x[f] += static_cast<T>(d_pre * w1(j, f));
    }
  }
};

}  // namespace latte
