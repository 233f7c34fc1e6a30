#pragma once
// The headers every test program includes, precompiled once and reused by all
// of them (tests/CMakeLists.txt): the whole public API with Eigen and xsimd,
// the test helpers and doctest take ~10 s to parse, which each test program
// used to pay. A test still includes what it uses; this only makes it cheaper.
#include <doctest/doctest.h>

#include "support.hpp"
