#pragma once
// Helpers shared by the linear-attention tests: the family's headers, random
// LeaP modules, inputs suited to each feature map, and the oracle spec that
// matches an attention's configuration (built from the definitions, not from
// the library's kernels).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numbers>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <doctest/doctest.h>

#include "latte/mechanisms/cosformer.hpp"
#include "latte/mechanisms/leapformer.hpp"
#include "latte/mechanisms/linear_attention.hpp"
#include "oracles/linear_oracle.hpp"
#include "support.hpp"

namespace latte::test {

/// A LeaP module D -> D / leap_factor -> 1 with seeded Gaussian weights scaled
/// so that the proportions spread over (0, 1).
inline LeaPModule random_leap_module(Rng& rng, index_t input_dim, index_t leap_factor) {
  const index_t hidden = input_dim / leap_factor;
  std::normal_distribution<double> normal(0.0, 1.0);
  LeaPModule module;
  module.w1 = Tensor<double, 2>({hidden, input_dim});
  module.b1 = Tensor<double, 1>({hidden});
  module.w2 = Tensor<double, 1>({hidden});
  const double scale = 1.0 / std::sqrt(static_cast<double>(input_dim));
  for (index_t i = 0; i < module.w1.size(); ++i) module.w1.data()[i] = scale * normal(rng);
  for (index_t j = 0; j < hidden; ++j) {
    module.b1(j) = 0.5 * normal(rng);
    module.w2(j) = 2.0 * normal(rng);
  }
  module.b2 = 0.5 * normal(rng);
  return module;
}

/// The divisors of n (the valid LeaP step-down factors for a feature dim n).
inline std::vector<index_t> divisors(index_t n) {
  std::vector<index_t> values;
  for (index_t d = 1; d <= n; ++d)
    if (n % d == 0) values.push_back(d);
  return values;
}

/// Query/key inputs for a feature map: Gaussian, except for Identity, whose
/// features are the inputs themselves and are kept positive (0.05 .. 1) so the
/// denominator is a sum of positive terms (the clamp of a sign-indefinite
/// denominator has its own test).
template <class Map, class T>
Tensor<T, 4> feature_input(Rng& rng, const std::array<index_t, 4>& extents, double stddev = 1.0) {
  if constexpr (std::is_same_v<Map, Identity>) return uniform_tensor<T, 4>(rng, extents, 0.05, 1.0);
  else return random_tensor<T, 4>(rng, extents, stddev);
}

/// Values in [-0.5, 1): of both signs but with a positive mean. In a
/// bidirectional or cross head with Dv = 1 every output row is the same single
/// ratio sum_s w_s v_s / sum_s w_s; with zero-mean values that sum can cancel
/// almost completely (by a factor of hundreds over 1000 terms), and the fp32
/// rounding of any summation order then exceeds the normwise tolerance. The
/// positive mean keeps the sum well conditioned; the kernel is unchanged.
template <class T>
Tensor<T, 4> value_input(Rng& rng, const std::array<index_t, 4>& extents) {
  return uniform_tensor<T, 4>(rng, extents, -0.5, 1.0);
}

/// The oracle's own phi for the library's feature maps.
template <class Map>
OracleFeatureMap oracle_feature_map() {
  if constexpr (std::is_same_v<Map, Relu>) return oracle_relu;
  else if constexpr (std::is_same_v<Map, EluPlusOne>) return oracle_elu_plus_one;
  else return oracle_identity;
}

/// The RoPE schedule theta_i = 10000^(-2i/F) recomputed from its definition,
/// or the given [H, F/2] angles, as an [H * (F/2)] table.
inline std::vector<long double> oracle_rope_angles(const Tensor<double, 2>& given, index_t H,
                                                   index_t F) {
  const index_t pairs = F / 2;
  std::vector<long double> angles(static_cast<std::size_t>(H * pairs));
  for (index_t h = 0; h < H; ++h)
    for (index_t i = 0; i < pairs; ++i)
      angles[h * pairs + i] = given.size() ? (long double)given(h, i)
                                           : std::pow(10000.0L, -2.0L * i / (long double)F);
  return angles;
}

/// A clamp for the rotated RoPE denominator that keeps every row well
/// conditioned. |w_ts| <= |phi(q_t)| |phi(k_s)| (rotations keep norms), so with
/// c = max_t |phi(q_t)| sum_{s allowed} |phi(k_s)| / 8, a row whose denominator
/// is >= c has condition sum_s |w_ts| / D_t <= 8, and a row below c is clamped
/// (exercising the clamp). Without it a rotated denominator can pass through 0
/// (it is sign-indefinite by construction) and amplify rounding by 10^3 or
/// more in a few rows, which no summation order avoids.
template <class T>
Normaliser well_conditioned_rotated_clamp(const Tensor<T, 4>& q, const Tensor<T, 4>& k,
                                          bool causal, const OracleFeatureMap& feature) {
  long double bound = 0;
  for (index_t b = 0; b < q.extent(0); ++b)
    for (index_t h = 0; h < q.extent(2); ++h) {
      long double keys = 0;
      std::vector<long double> prefix;  // sum_{s <= t} |phi(k_s)|
      for (index_t s = 0; s < k.extent(1); ++s) {
        long double norm = 0;
        for (long double x : feature(oracle_row(k, b, s, h))) norm += x * x;
        keys += std::sqrt(norm);
        prefix.push_back(keys);
      }
      for (index_t t = 0; t < q.extent(1); ++t) {
        long double norm = 0;
        for (long double x : feature(oracle_row(q, b, t, h))) norm += x * x;
        bound = std::max(bound, std::sqrt(norm) * (causal ? prefix[t] : keys));
      }
    }
  return Normaliser::clamp_min(std::max(static_cast<double>(bound / 8), 1e-6));
}

/// The normaliser part of an oracle spec.
inline void set_oracle_normaliser(LinearOracleSpec& spec, const Normaliser& normaliser) {
  spec.clamp = normaliser.kind == Normaliser::Kind::clamp_min;
  spec.value = normaliser.value;
}

/// A random normaliser: the default, another epsilon, or a clamp.
inline Normaliser random_normaliser(Rng& rng, const Normaliser& fallback) {
  switch (std::uniform_int_distribution<int>(0, 3)(rng)) {
    case 0: return fallback;
    case 1: return Normaliser::additive(1e-3);
    case 2: return Normaliser::clamp_min(0.5);
    default: return Normaliser::clamp_min(1e-6);
  }
}

/// The second sequence length of a cross-attention case whose oracle cost
/// T * S * B * H * (F + Dv) stays under `budget`.
inline index_t random_source_length(Rng& rng, const Shape& s, index_t feature_dim, double budget) {
  for (;;) {
    const index_t source = pick(rng, sequence_lengths());
    const double cost = double(s.time) * double(source) * double(s.batch * s.heads) *
                        double(feature_dim + s.value_dim);
    if (cost <= budget || source <= 2) return source;
  }
}

/// "LinearAttention<causal,relu,no_reweight,no_positional>" for attention type A.
template <class A>
std::string type_label() {
  const std::string kind = A::template kind<double>();
  return kind.substr(0, kind.find('/'));
}

/// "B=2 T=13 H=3 Dk=7 Dv=5": a case's shape for failure messages.
inline std::string describe(const Shape& s, index_t source = -1) {
  std::string text = "B=" + std::to_string(s.batch) + " T=" + std::to_string(s.time);
  if (source >= 0) text += " S=" + std::to_string(source);
  return text + " H=" + std::to_string(s.heads) + " Dk=" + std::to_string(s.latents) +
         " Dv=" + std::to_string(s.value_dim);
}

/// `seed` shifted by the environment variable LATTE_TEST_SEED_OFFSET (default 0),
/// to stress the random-shape tests with other draws without editing them.
inline std::uint64_t test_seed(std::uint64_t seed) {
  const char* offset = std::getenv("LATTE_TEST_SEED_OFFSET");
  return offset ? seed + std::strtoull(offset, nullptr, 10) : seed;
}

/// Runs `cases` oracle cases: make_case(rng, c, about) returns {out, oracle} and
/// describes the case in `about`; checks each against Tolerance<T> and prints
/// one [oracle] line with the worst normwise relative error.
template <class T, class MakeCase>
void run_oracle_cases(const std::string& label, const char* direction, std::uint64_t seed,
                      int cases, MakeCase&& make_case) {
  Rng rng(test_seed(seed));
  double worst = 0;
  long long elements = 0;
  for (int c = 0; c < cases; ++c) {
    std::string about;
    const auto [out, oracle] = make_case(rng, c, about);
    const double error = relative_error(out, oracle);
    CHECK_MESSAGE(error <= Tolerance<T>::relative,
                  label << " " << std::string(direction) << " case " << c << " " << about << " error=" << error);
    worst = std::max(worst, error);
    elements += out.size();
  }
  std::printf("[oracle] %-58s %-13s %s cases=%d elements=%lld max_rel_error=%.3e (tol %.0e)\n",
              label.c_str(), direction, dtype_name<T>(), cases, elements, worst,
              Tolerance<T>::relative);
}

/// A LeaP module's weights as long-double vectors the checks can perturb.
struct ModuleLD {
  std::vector<long double> w1, b1, w2, b2;
  ModuleLD() = default;
  explicit ModuleLD(const LeaPModule& m)
      : w1(m.w1.data(), m.w1.data() + m.w1.size()), b1(m.b1.data(), m.b1.data() + m.b1.size()),
        w2(m.w2.data(), m.w2.data() + m.w2.size()), b2{m.b2} {}
  /// P = sigmoid(W2 relu(W1 phi(x) + b1) + b2) for every row of x (paper 004 eq. 10).
  std::vector<OracleProportion> proportions(const TensorLD<4>& x,
                                            const OracleFeatureMap& feature) const {
    const index_t B = x.extent(0), Tn = x.extent(1), H = x.extent(2);
    const index_t hidden = static_cast<index_t>(b1.size());
    std::vector<OracleProportion> p(static_cast<std::size_t>(B * Tn * H));
    for (index_t b = 0; b < B; ++b)
      for (index_t t = 0; t < Tn; ++t)
        for (index_t h = 0; h < H; ++h) {
          const auto phi = feature(oracle_row(x, b, t, h));
          const index_t F = static_cast<index_t>(phi.size());
          long double logit = b2[0];
          for (index_t j = 0; j < hidden; ++j) {
            long double pre = b1[j];
            for (index_t f = 0; f < F; ++f) pre += w1[j * F + f] * phi[f];
            logit += w2[j] * std::fmax(pre, 0.0L);
          }
          p[(b * Tn + t) * H + h] = {1 / (1 + std::exp(-logit)), 1 / (1 + std::exp(logit))};
        }
    return p;
  }
};

}  // namespace latte::test
