#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite (CTest) in ./build. Here the
# package_conan_create test must run: without conan it fails (LATTE_REQUIRE_CONAN),
# where a plain `ctest` reports it skipped. The Python module is built with the rest
# (nanobind from .venv/) and tests/python runs as the python_tests CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DLATTE_REQUIRE_CONAN=ON \
  -DLATTE_BUILD_PYTHON=ON -DPython_EXECUTABLE="$PWD/.venv/bin/python"
cmake --build build -j "$(nproc)"
ctest --test-dir build --output-on-failure -j "$(nproc)"
