#!/usr/bin/env bash
# The long-context error measurement (docs/numerics.md, "Long contexts"):
# builds bench/long_context_error.cpp in Release and runs it over 2^20 tokens
# and 10^7 decode steps, for key-logit spreads 1, 3 and 10, with compensated
# and plain sums (forward, decode, the backward of Latte and elu+1, and
# conv-compression's forward); the CSV goes to docs/long-context-results.csv.
#
#   scripts/long-context.sh                    the full run (about 10 minutes on 2 cores)
#   scripts/long-context.sh --steps 100000     shorter decode runs (other flags pass through)
#
# Environment: LATTE_BUILD_DIR (default build-long-context).
set -euo pipefail
cd "$(dirname "$0")/.."
build="${LATTE_BUILD_DIR:-build-long-context}"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLATTE_BUILD_TESTS=OFF \
  -DLATTE_BUILD_EXAMPLES=OFF -DLATTE_BUILD_BENCHMARKS=ON >/dev/null
cmake --build "$build" --target latte-long-context-error
"$build/bench/latte-long-context-error" "$@" | tee docs/long-context-results.csv
