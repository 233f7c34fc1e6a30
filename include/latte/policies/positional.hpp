#pragma once
// Positional policies: NoPositional, VAPOR (value-acting positional rotations,
// paper 000 App. B.3) and RoPE (rotary query/key embeddings).
#include <array>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <string>
#include <vector>

#include "latte/core/angles.hpp"
#include "latte/core/checked_size.hpp"
#include "latte/core/error.hpp"
#include "latte/core/tensor.hpp"
#include "latte/core/types.hpp"

namespace latte {

/// No positional information: Latte is then invariant to token order within
/// the prefix it attends to.
struct NoPositional {
  static constexpr bool rotates_values = false;
  static constexpr bool rotates_queries_keys = false;
  static constexpr const char* name = "no_positional";
  struct Params {};

  static std::vector<double> resolve_angles(const Params&, index_t /*heads*/,
                                            index_t /*value_dim*/) {
    return {};
  }
};

namespace detail {

/// Block-diagonal 2x2 rotations R^n on adjacent feature pairs (2i, 2i+1),
/// pair i turning by n * theta_{h,i}; with an odd dimension the last feature
/// is not rotated. Shared by VAPOR (on values) and RoPE (on queries and keys).
struct PairRotation {
  struct Params {
    /// Per-head angles [H, D/2] (learned upstream). Empty (0 x 0): the RoPE
    /// schedule theta_i = base^(-2i/D), the same for every head.
    Tensor<double, 2> angles;
    /// Base of the default schedule.
    double base = 10000.0;
  };

  /// Angles from a float or double [H, D/2] view (copied).
  template <Real T>
  static Params params_from(TensorView<const T, 2> angles) {
    check_view(angles, "angles");
    Params params;
    params.angles = Tensor<double, 2>({angles.extent(0), angles.extent(1)});
    for (index_t h = 0; h < angles.extent(0); ++h)
      for (index_t i = 0; i < angles.extent(1); ++i) params.angles(h, i) = angles(h, i);
    return params;
  }

  /// A flat [heads * (dim / 2)] table of angles, validated.
  static std::vector<double> resolve_angles(const Params& params, index_t heads, index_t dim,
                                            const char* layout = "[H, D/2]") {
    const index_t pairs = dim / 2;
    std::vector<double> table(
        static_cast<std::size_t>(checked_product("dims", {heads, pairs}, sizeof(double))));
    if (params.angles.extent(0) == 0 && params.angles.extent(1) == 0) {  // not given
      require(params.base > 1.0 && std::isfinite(params.base), "base",
              expected_given("base of the RoPE schedule", "finite and > 1", params.base));
      // One flat loop over the table: with no pairs (D < 2) it runs no
      // iteration, however many heads there are.
      for (std::size_t at = 0; at < table.size(); ++at)
        table[at] = rope_theta(static_cast<index_t>(at) % pairs, dim, params.base);
      return table;
    }
    const std::array<index_t, 2> expected{heads, pairs};
    require(params.angles.extents() == expected, "angles",
            expected_given(std::string("shape ") + layout, format_extents(expected),
                           format_extents(params.angles.extents())));
    for (std::size_t at = 0; at < table.size(); ++at) {
      const index_t h = static_cast<index_t>(at) / pairs, i = static_cast<index_t>(at) % pairs;
      const double theta = params.angles(h, i);
      require(std::isfinite(theta), "angles",
              "every angle must be finite (head " + std::to_string(h) + ", pair " +
                  std::to_string(i) + ")");
      table[at] = theta;
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

}  // namespace detail

/// VAPOR: o_t = sum_s p(s|t) R^{t-s} v_s = R^t sum_l p(l|t) sum_s p(s|l,t) R^{-s} v_s
/// (paper 000 eq. 22), R the pair rotation above acting on the value features.
/// Attention weights are unchanged; the memory accumulates R^{-s} v_s and the
/// read-out is rotated by R^t. Angles [H, Dv/2]; reduced in double precision.
struct VAPOR : detail::PairRotation {
  static constexpr bool rotates_values = true;
  static constexpr bool rotates_queries_keys = false;
  static constexpr const char* name = "vapor";
  static std::vector<double> resolve_angles(const Params& params, index_t heads,
                                            index_t value_dim) {
    return PairRotation::resolve_angles(params, heads, value_dim, "[H, Dv/2]");
  }
};

/// RoPE (RoFormer): queries and keys are rotated by R^t and R^s, so their dot
/// product depends on t - s only. Angles [H, Dk/2] (default schedule base 10000).
struct RoPE : detail::PairRotation {
  static constexpr bool rotates_values = false;
  static constexpr bool rotates_queries_keys = true;
  static constexpr const char* name = "rope";
  static std::vector<double> resolve_angles(const Params& params, index_t heads,
                                            index_t key_dim) {
    return PairRotation::resolve_angles(params, heads, key_dim, "[H, Dk/2]");
  }
};

/// A positional policy says what it rotates, carries Params and can
/// turn them into a validated angle table.
template <class P>
concept Positional = requires(const typename P::Params& params) {
  { P::rotates_values } -> std::convertible_to<bool>;
  { P::rotates_queries_keys } -> std::convertible_to<bool>;
  { P::name } -> std::convertible_to<const char*>;
  { P::resolve_angles(params, index_t{}, index_t{}) } -> std::same_as<std::vector<double>>;
};

}  // namespace latte
