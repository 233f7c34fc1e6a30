#pragma once
// Positional policies for Latte: NoPositional and VAPOR (value-acting
// positional rotations, paper 000 App. B.3).
#include <array>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <vector>

#include "latte/core/angles.hpp"
#include "latte/core/error.hpp"
#include "latte/core/tensor.hpp"
#include "latte/core/types.hpp"

namespace latte {

/// No positional information: Latte is then invariant to token order within
/// the prefix it attends to.
struct NoPositional {
  static constexpr bool rotates_values = false;
  static constexpr const char* name = "no_positional";
  struct Params {};

  static std::vector<double> resolve_angles(const Params&, index_t /*heads*/,
                                            index_t /*value_dim*/) {
    return {};
  }
};

/// VAPOR: o_t = sum_s p(s|t) R^{t-s} v_s = R^t sum_l p(l|t) sum_s p(s|l,t) R^{-s} v_s
/// (paper 000 eq. 22). R is block-diagonal with 2x2 rotations acting on the
/// adjacent value features (2i, 2i+1), pair i turning by theta_{h,i} per step;
/// with an odd value dimension the last feature is not rotated. Attention
/// weights are unchanged; the memory accumulates R^{-s} v_s and the read-out
/// is rotated by R^t. Angles are reduced in double precision (core/angles.hpp).
struct VAPOR {
  static constexpr bool rotates_values = true;
  static constexpr const char* name = "vapor";

  struct Params {
    /// Per-head angles [H, Dv/2] (learned upstream). Empty: the RoPE schedule
    /// theta_i = base^(-2i/Dv), the same for every head.
    Tensor<double, 2> angles;
    /// Base of the default schedule.
    double base = 10000.0;
  };

  /// Angles from a float or double [H, Dv/2] view (copied).
  template <Real T>
  static Params params_from(TensorView<const T, 2> angles) {
    check_view(angles, "angles");
    Params params;
    params.angles = Tensor<double, 2>({angles.extent(0), angles.extent(1)});
    for (index_t h = 0; h < angles.extent(0); ++h)
      for (index_t i = 0; i < angles.extent(1); ++i) params.angles(h, i) = angles(h, i);
    return params;
  }

  /// A flat [heads * (value_dim / 2)] table of angles, validated.
  static std::vector<double> resolve_angles(const Params& params, index_t heads,
                                            index_t value_dim) {
    const index_t pairs = value_dim / 2;
    std::vector<double> table(static_cast<std::size_t>(heads * pairs));
    if (params.angles.extent(0) == 0 && params.angles.extent(1) == 0) {  // not given
      detail::require(params.base > 1.0, "base",
                      detail::expected_given("VAPOR base of the RoPE schedule", "> 1",
                                             params.base));
      for (index_t h = 0; h < heads; ++h)
        for (index_t i = 0; i < pairs; ++i)
          table[static_cast<std::size_t>(h * pairs + i)] = rope_theta(i, value_dim, params.base);
      return table;
    }
    const std::array<index_t, 2> expected{heads, pairs};
    detail::require(params.angles.extents() == expected, "angles",
                    detail::expected_given("shape [H, Dv/2]", format_extents(expected),
                                           format_extents(params.angles.extents())));
    for (index_t h = 0; h < heads; ++h)
      for (index_t i = 0; i < pairs; ++i) {
        const double theta = params.angles(h, i);
        detail::require(std::isfinite(theta), "angles",
                        "every angle must be finite (head " + std::to_string(h) + ", pair " +
                            std::to_string(i) + ")");
        table[static_cast<std::size_t>(h * pairs + i)] = theta;
      }
    return table;
  }

  /// Rotates the pairs of `row` (length `dim`) by R^position, i.e. pair i by
  /// position * theta[i]; a negative position rotates backwards.
  template <Real T>
  static void rotate(T* row, index_t dim, const double* theta, std::int64_t position) noexcept {
    for (index_t i = 0; i < dim / 2; ++i) {
      const CosSin cs = rotation_cos_sin(position, theta[i]);
      const T c = static_cast<T>(cs.cos), s = static_cast<T>(cs.sin);
      const T x = row[2 * i], y = row[2 * i + 1];
      row[2 * i] = c * x - s * y;
      row[2 * i + 1] = s * x + c * y;
    }
  }
};

/// A positional policy says whether it rotates values, carries Params and can
/// turn them into a validated angle table.
template <class P>
concept Positional = requires(const typename P::Params& params) {
  { P::rotates_values } -> std::convertible_to<bool>;
  { P::name } -> std::convertible_to<const char*>;
  { P::resolve_angles(params, index_t{}, index_t{}) } -> std::same_as<std::vector<double>>;
};

}  // namespace latte
