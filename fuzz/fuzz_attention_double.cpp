// fuzz_attention's calls in double (see fuzz_attention.hpp).
#include "fuzz_attention.hpp"

namespace latte_fuzz {
template void run<double>(Fuzz&, const Sizes&, bool);
}  // namespace latte_fuzz
