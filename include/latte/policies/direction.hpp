#pragma once
// Direction policies: which keys a query may see.
#include <concepts>

namespace latte {

/// Query t attends to keys s <= t. Has recurrent decode (make_state / step).
struct Causal {
  static constexpr bool is_causal = true;
  static constexpr const char* name = "causal";
};

/// Query t attends to every key of the sequence. Whole-sequence forward only.
struct Bidirectional {
  static constexpr bool is_causal = false;
  static constexpr const char* name = "bidirectional";
};

/// A direction policy says whether it is causal and what it is called.
template <class P>
concept Direction = requires {
  { P::is_causal } -> std::convertible_to<bool>;
  { P::name } -> std::convertible_to<const char*>;
};

}  // namespace latte
