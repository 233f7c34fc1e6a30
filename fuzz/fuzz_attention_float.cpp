// fuzz_attention's calls in float (see fuzz_attention.hpp).
#include "fuzz_attention.hpp"

namespace latte_fuzz {
template void run<float>(Fuzz&, const Sizes&, bool);
}  // namespace latte_fuzz
