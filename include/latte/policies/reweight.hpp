#pragma once
// Re-weighting policies for linear attention (paper 004 §2.3, §3):
//
//   w_ts = phi(q_t) . phi(k_s) * sigma(P_q,t, P_k,s),
//   sigma(a, b) = cos(pi/2 (a - b)) = sin(pi a/2) sin(pi b/2) + cos(pi a/2) cos(pi b/2)
//
// so the cosine re-weighting splits exactly into two feature streams
// [sin(pi P/2) phi, cos(pi P/2) phi] (paper 004 eqs. 6-9). The policies differ in
// where the proportions P in [0, 1] come from:
//   NoReweight          sigma = 1, one stream
//   CosFormerReweight   P = (i + 1) / M from the 0-based position i (cosFormer;
//                       paper 004 eq. 9), M the length (a parameter)
//   LeaPReweight        P from learned LeaP modules on phi(q_t), phi(k_s)
//                       (paper 004 eq. 10), or given per token as tensors
#include <cmath>
#include <concepts>
#include <cstdint>
#include <numbers>
#include <optional>

#include "latte/core/tensor_view.hpp"
#include "latte/core/types.hpp"
#include "latte/policies/leap_module.hpp"
#include "latte/policies/normaliser.hpp"
#include "latte/policies/proportion.hpp"

namespace latte {

/// Where a re-weighting policy's proportions come from.
enum class ProportionSource { none, position, learned };

/// sigma = 1: plain linear attention (paper 001 eq. 4). Default normaliser:
/// additive epsilon = 1e-6 (DESIGN §3.3).
struct NoReweight {
  static constexpr const char* name = "no_reweight";
  static constexpr index_t streams = 1;
  static constexpr ProportionSource source = ProportionSource::none;
  struct Params {};
  [[nodiscard]] static constexpr Normaliser default_normaliser() noexcept {
    return Normaliser::additive(1e-6);
  }
};

/// cosFormer (Qin et al. 2022; paper 004 eq. 9): P = (i + 1) / M for the
/// 0-based position i, i.e. the official code's 1-based index / M.
/// `length` M defaults to T in a self-attention forward and to max(S, T) in
/// cross-attention (as cosFormer's code does); decode needs it given, with
/// M >= every position + 1 reached, so that P stays in (0, 1].
/// Default normaliser: clamp_min(1e-6), as in cosFormer's code.
struct CosFormerReweight {
  static constexpr const char* name = "cosformer";
  static constexpr index_t streams = 2;
  static constexpr ProportionSource source = ProportionSource::position;
  struct Params {
    std::optional<index_t> length = {};  ///< M
  };
  [[nodiscard]] static constexpr Normaliser default_normaliser() noexcept {
    return Normaliser::clamp_min(1e-6);
  }
  /// P = (position + 1) / M.
  [[nodiscard]] static Proportion proportion(std::int64_t position, index_t length) noexcept {
    return Proportion::at_position(static_cast<double>(position), static_cast<double>(length));
  }
};

/// LeaPformer (paper 004 §3): proportions from two LeaP modules (one for the
/// queries, one for the keys, shared across heads) applied to phi(q_t) and
/// phi(k_s), hidden size D / leap_factor (default 4, must divide D). Without
/// modules, every call passes precomputed proportions instead.
/// Default normaliser: clamp_min(0.1), as in LeaPformer's code.
struct LeaPReweight {
  static constexpr const char* name = "leap";
  static constexpr index_t streams = 2;
  static constexpr ProportionSource source = ProportionSource::learned;
  struct Params {
    std::optional<LeaPModule> query_module = {};  ///< LeaP_Q
    std::optional<LeaPModule> key_module = {};    ///< LeaP_K
    index_t leap_factor = 4;
  };
  [[nodiscard]] static constexpr Normaliser default_normaliser() noexcept {
    return Normaliser::clamp_min(0.1);
  }
};

/// Precomputed proportions for a whole call (paper 004 eq. 8): P_q [B, T, H] and
/// P_k [B, S, H] (S = T for self-attention), every value in [0, 1].
template <Real T>
struct SequenceProportions {
  TensorView<const T, 3> queries = {};
  TensorView<const T, 3> keys = {};
};

/// Precomputed proportions for one decode step: P_q and P_k [B, H], in [0, 1].
template <Real T>
struct StepProportions {
  TensorView<const T, 2> queries = {};
  TensorView<const T, 2> keys = {};
};

/// The two stream weights of a proportion: sin(pi P / 2) and
/// cos(pi P / 2) = sin(pi (1 - P) / 2), both to full relative precision.
template <Real T>
void cos_reweight_streams(const Proportion& proportion, T* weights) noexcept {
  weights[0] = static_cast<T>(std::sin(std::numbers::pi / 2.0 * proportion.value));
  weights[1] = static_cast<T>(std::sin(std::numbers::pi / 2.0 * proportion.complement));
}

/// A re-weighting policy names itself, its stream count, its proportion
/// source, its parameters and its paper's default normaliser.
template <class R>
concept Reweight = requires {
  { R::name } -> std::convertible_to<const char*>;
  { R::streams } -> std::convertible_to<index_t>;
  { R::source } -> std::convertible_to<ProportionSource>;
  typename R::Params;
  { R::default_normaliser() } -> std::same_as<Normaliser>;
} && (R::streams == 1) == (R::source == ProportionSource::none);

}  // namespace latte
