#!/usr/bin/env bash
# Sets up, builds and runs examples/quickstart.cpp in ./build.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "$(nproc)" --target quickstart
./build/examples/quickstart "$@"
