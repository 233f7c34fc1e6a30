// libFuzzer entry point of fuzz_attention: the first bytes choose the dtype,
// the direction and the common sizes; fuzz_attention.hpp decodes the rest.
// Build and run: scripts/fuzz.sh.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_attention.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  latte_fuzz::Fuzz fuzz(data, size);
  const bool use_double = fuzz.coin(2);
  const bool is_causal = fuzz.coin(2);
  const latte_fuzz::Sizes s{fuzz.size(0, 3), fuzz.size(0, 40), fuzz.size(1, 4)};
  latte_fuzz::current_input = std::string(use_double ? "double" : "float") +
                              (is_causal ? " causal" : " bidirectional") + ", B " +
                              std::to_string(s.batch) + ", T " + std::to_string(s.time) + ", H " +
                              std::to_string(s.heads);
  if (use_double) latte_fuzz::run<double>(fuzz, s, is_causal);
  else latte_fuzz::run<float>(fuzz, s, is_causal);
  return 0;
}
