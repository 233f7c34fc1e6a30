#pragma once
// The bad-input tests' one assertion: a call throws latte::Error naming its argument.
#include <doctest/doctest.h>

#include <string>
#include <string_view>

#include "latte/core/error.hpp"

namespace latte::test {

/// `call()` must throw latte::Error naming `argument`, whose message contains `needle`.
template <class F>
void expect_error(F&& call, std::string_view argument, std::string_view needle = "expected") {
  CHECK_THROWS_AS(call(), latte::Error);
  try {
    call();
  } catch (const latte::Error& error) {
    const std::string what = error.what();
    INFO("what(): " << what);
    CHECK(error.argument() == std::string(argument));
    CHECK(what.find("latte: argument '" + std::string(argument) + "'") == 0);
    CHECK(what.find(std::string(needle)) != std::string::npos);
  } catch (...) {
    // CHECK_THROWS_AS has already reported the wrong exception type.
  }
}

}  // namespace latte::test
