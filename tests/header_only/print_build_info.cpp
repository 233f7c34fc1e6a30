// Prints latte::build_info(): tests/CMakeLists.txt builds it through latte::latte
// and cmake/latte_plain_compiler_test.cmake with the bare compiler, and compares.
#include <latte/attention.hpp>

#include <iostream>

int main() {
  std::cout << latte::build_info() << '\n';
  return 0;
}
