// Prints latte::build_info(): tests/CMakeLists.txt builds it through latte::latte
// and cmake/latte_plain_compiler_test.cmake with the bare compiler, and compares.
// The mechanisms in reverse order first, then the umbrella header: a name one
// backend leaves visible to another's templates (two `Rows`, linear's and
// conv-compression's, 2026-12-07) fails to compile here. The test programs
// see the headers in attention.hpp's order only (their precompiled header).
#include <latte/mechanisms/softmax_attention.hpp>
#include <latte/mechanisms/linear_attention.hpp>
#include <latte/mechanisms/leapformer.hpp>
#include <latte/mechanisms/lavo.hpp>
#include <latte/mechanisms/latte_macchiato.hpp>
#include <latte/mechanisms/latte_attention.hpp>
#include <latte/mechanisms/cosformer.hpp>
#include <latte/mechanisms/conv_compressed_attention.hpp>
#include <latte/attention.hpp>

#include <iostream>

int main() {
  std::cout << latte::build_info() << '\n';
  return 0;
}
