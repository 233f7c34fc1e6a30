#pragma once
// main() of a CUDA test that needs a device: without one it prints why and
// returns 77, which CTest reports as SKIPPED (SKIP_RETURN_CODE).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "cuda_support.hpp"

int main(int argc, char** argv) {
  if (!latte::test::cuda_device_present(argv[0])) return latte::test::kSkipReturnCode;
  doctest::Context context(argc, argv);
  return context.run();
}
