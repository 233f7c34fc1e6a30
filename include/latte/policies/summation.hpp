#pragma once
// Summation policies: how a causal state adds each new token to its sums over
// the whole past (Latte's alpha and vtilde; docs/numerics.md, "Long contexts").
//
// CompensatedSums (the default) keeps each sum as a pair hi + lo and adds
// through TwoSum (core/compensated_sum.hpp): its error is that of a few
// roundings at any context length (fp32: ~1e-6 of the output at 2^20 tokens,
// against ~2e-3 for plain sums). PlainSums adds in the state's type alone:
// cheaper (measured side by side in docs/numerics.md), with an error that
// grows linearly with the tokens absorbed. Both read and write the same state
// layout; PlainSums leaves the low parts zero, and states of the two policies
// have different kinds (one does not load or step the other's).
#include <concepts>

namespace latte {

/// The default: error independent of the context length.
struct CompensatedSums {
  static constexpr const char* name = "compensated";
  static constexpr bool compensated = true;
};

/// Plain running sums: faster prefill and decode, error growing with the context.
struct PlainSums {
  static constexpr const char* name = "plain";
  static constexpr bool compensated = false;
};

template <class S>
concept Summation = requires {
  { S::name } -> std::convertible_to<const char*>;
  { S::compensated } -> std::convertible_to<bool>;
};

/// A carry as summation policy S adds to it: without compensation its low
/// parts are dropped (null), which the kernels read as plain sums.
template <Summation S, class Carry>
[[nodiscard]] Carry summed_by(Carry carry) noexcept {
  if constexpr (!S::compensated) {
    carry.normaliser_low = nullptr;
    carry.memory_low = nullptr;
  }
  return carry;
}

}  // namespace latte
