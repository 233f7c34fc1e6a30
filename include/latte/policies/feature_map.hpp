#pragma once
// Feature-map policies for linear attention: phi in
//   o_t = sum_s phi(q_t) . phi(k_s) v_s / sum_s phi(q_t) . phi(k_s)     (paper 001 eq. 4)
// A feature map turns one query or key row x (Dk features) into phi(x)
// (feature_dim(Dk) features, Dk unless the map says otherwise).
//
// Write your own by providing a name and a static `apply` on a row, e.g.
//
//   struct Squared {
//     static constexpr const char* name = "squared";
//     template <class T>
//     static void apply(std::span<const T> x, std::span<T> phi) noexcept {
//       for (std::size_t i = 0; i < x.size(); ++i) phi[i] = x[i] * x[i];
//     }
//   };
//   latte::LinearAttention<latte::Causal, Squared> attention({.heads = 8, .key_dim = 64,
//                                                             .value_dim = 64});
//
// and optionally `static index_t feature_dim(index_t key_dim)` when phi(x) has
// another size than x (examples/custom_policy.cpp). Maps whose features can be
// negative are allowed: linear attention then clamps a negative denominator
// (policies/normaliser.hpp).
//
// backward() needs the map's derivative: a static `backward(x, d_phi, d_x)`
// that writes d_x = J_phi(x)^T d_phi (the DifferentiableFeatureMap concept),
// for Squared above d_x[i] = 2 x[i] d_phi[i]. The built-in maps have one.
#include <cmath>
#include <concepts>
#include <cstddef>
#include <span>

#include "latte/core/types.hpp"

namespace latte {

/// phi(x) = max(x, 0), elementwise: cosFormer's and LeaPformer's map (paper 004 §2.3).
struct Relu {
  static constexpr const char* name = "relu";
  template <Real T>
  static void apply(std::span<const T> x, std::span<T> phi) noexcept {
    // x < 0 rather than x > 0: a NaN feature stays NaN (the NaN policy, docs/numerics.md).
    for (std::size_t i = 0; i < x.size(); ++i) phi[i] = x[i] < T(0) ? T(0) : x[i];
  }
  /// d_x = d_phi where x > 0, 0 elsewhere (0 at x = 0, as torch.relu).
  template <Real T>
  static void backward(std::span<const T> x, std::span<const T> d_phi, std::span<T> d_x) noexcept {
    for (std::size_t i = 0; i < x.size(); ++i) d_x[i] = x[i] > T(0) ? d_phi[i] : T(0);
  }
};

/// phi(x) = elu(x) + 1 = x + 1 for x > 0, exp(x) otherwise (Katharopoulos et al.
/// 2020): strictly positive. exp(x) is evaluated directly rather than as
/// expm1(x) + 1, so very negative inputs keep their relative precision.
struct EluPlusOne {
  static constexpr const char* name = "elu_plus_one";
  template <Real T>
  static void apply(std::span<const T> x, std::span<T> phi) noexcept {
    for (std::size_t i = 0; i < x.size(); ++i) phi[i] = x[i] > T(0) ? x[i] + T(1) : std::exp(x[i]);
  }
  /// d_x = d_phi for x > 0, exp(x) d_phi otherwise (the two agree at 0).
  template <Real T>
  static void backward(std::span<const T> x, std::span<const T> d_phi, std::span<T> d_x) noexcept {
    for (std::size_t i = 0; i < x.size(); ++i)
      d_x[i] = x[i] > T(0) ? d_phi[i] : std::exp(x[i]) * d_phi[i];
  }
};

/// phi(x) = x: features that are already what the caller wants (for example
/// computed upstream). Not sign-definite: see the clamp in policies/normaliser.hpp.
struct Identity {
  static constexpr const char* name = "identity";
  template <Real T>
  static void apply(std::span<const T> x, std::span<T> phi) noexcept {
    for (std::size_t i = 0; i < x.size(); ++i) phi[i] = x[i];
  }
  template <Real T>
  static void backward(std::span<const T>, std::span<const T> d_phi, std::span<T> d_x) noexcept {
    for (std::size_t i = 0; i < d_phi.size(); ++i) d_x[i] = d_phi[i];
  }
};

/// A feature map has a name and maps a float or double row x to phi(x).
template <class M>
concept FeatureMap = requires(std::span<const float> xf, std::span<float> phif,
                              std::span<const double> xd, std::span<double> phid) {
  { M::name } -> std::convertible_to<const char*>;
  M::apply(xf, phif);
  M::apply(xd, phid);
};

/// A feature map whose derivative backward() can use: backward(x, d_phi, d_x)
/// writes d_x = J_phi(x)^T d_phi (x and d_x of Dk values, d_phi of feature_dim).
template <class M>
concept DifferentiableFeatureMap =
    FeatureMap<M> && requires(std::span<const float> xf, std::span<const float> dphif,
                              std::span<float> dxf, std::span<const double> xd,
                              std::span<const double> dphid, std::span<double> dxd) {
      M::backward(xf, dphif, dxf);
      M::backward(xd, dphid, dxd);
    };

namespace detail {

/// Size of phi(x) for a Dk-feature row: M::feature_dim(Dk) when the map
/// declares it, Dk otherwise.
template <FeatureMap M>
[[nodiscard]] constexpr index_t feature_dim_of(index_t key_dim) {
  if constexpr (requires { { M::feature_dim(key_dim) } -> std::convertible_to<index_t>; })
    return static_cast<index_t>(M::feature_dim(key_dim));
  else
    return key_dim;
}

}  // namespace detail
}  // namespace latte
