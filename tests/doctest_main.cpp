// doctest's runner, its implementation and main(), compiled once and linked
// into every test program (tests/CMakeLists.txt): at -O3 it takes ~9 s to
// compile, which each of the ~30 test programs used to pay.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
