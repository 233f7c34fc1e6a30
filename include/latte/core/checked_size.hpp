#pragma once
// Checked size arithmetic: every product or sum of sizes that allocates or
// indexes (state fields, KV and window rings, angle tables, weight shapes,
// workspaces) is computed here, so a size that would wrap is refused with a
// latte::Error naming the argument before anything is allocated or written.
//
// A size that fits but is merely huge is not refused here: the allocator
// answers it with std::bad_alloc.
//
// Empty calls: a forward whose output has no elements (T = 0, or B = 0)
// validates its shapes and returns; it allocates nothing and loops over
// nothing, whatever the other extents are. Mechanism sizes (heads, dims,
// latents, windows) are >= 1, so an output is empty only through B or T.
#include <cstddef>
#include <initializer_list>
#include <limits>
#include <span>
#include <string>
#include <string_view>

#include "latte/core/error.hpp"
#include "latte/core/types.hpp"

namespace latte::detail {

namespace sizes {
[[noreturn]] inline void refuse(std::string_view argument, std::string_view operation,
                                std::span<const index_t> terms, std::size_t element_size,
                                index_t limit) {
  const char* join = operation == "product" ? " * " : " + ";
  std::string given;
  for (const index_t term : terms) given += (given.empty() ? "" : join) + std::to_string(term);
  if (element_size > 1) given += " elements of " + std::to_string(element_size) + " bytes";
  throw Error(argument, expected_given(std::string("size ") + std::string(operation) +
                                           " of non-negative terms",
                                       "at most " + std::to_string(limit), given));
}
}  // namespace sizes

/// The product of `factors`, each >= 0, as an element count whose bytes
/// (`element_size` each) index_t can hold; throws latte::Error naming
/// `argument`, with the factors, on a negative factor or an overflow.
/// (Not [[nodiscard]]: a call may be the check alone.)
inline index_t checked_product(std::string_view argument, std::span<const index_t> factors,
                               std::size_t element_size = 1) {
  const index_t limit =
      std::numeric_limits<index_t>::max() / static_cast<index_t>(element_size ? element_size : 1);
  bool zero = false, negative = false;
  for (const index_t f : factors) {
    zero = zero || f == 0;
    negative = negative || f < 0;
  }
  if (negative) sizes::refuse(argument, "product", factors, element_size, limit);
  if (zero) return 0;  // a zero factor: no allocation, whatever the others are
  index_t product = 1;
  for (const index_t f : factors) {
    if (f > limit / product) sizes::refuse(argument, "product", factors, element_size, limit);
    product *= f;
  }
  return product;
}

inline index_t checked_product(std::string_view argument, std::initializer_list<index_t> factors,
                               std::size_t element_size = 1) {
  return checked_product(argument, std::span(factors.begin(), factors.size()), element_size);
}

/// `checked_product` for an allocation of `factors` elements of type T.
template <class T>
index_t checked_count(std::string_view argument, std::initializer_list<index_t> factors) {
  return checked_product(argument, factors, sizeof(T));
}

/// The sum of `terms`, each >= 0; throws latte::Error naming `argument` on a
/// negative term or an overflow of index_t.
[[nodiscard]] inline index_t checked_sum(std::string_view argument,
                                         std::initializer_list<index_t> terms) {
  constexpr index_t limit = std::numeric_limits<index_t>::max();
  index_t sum = 0;
  for (const index_t t : terms) {
    if (t < 0 || t > limit - sum)
      sizes::refuse(argument, "sum", std::span(terms.begin(), terms.size()), 1, limit);
    sum += t;
  }
  return sum;
}

}  // namespace latte::detail
