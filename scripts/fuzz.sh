#!/usr/bin/env bash
# Builds the libFuzzer harness fuzz/fuzz_attention.cpp with clang (ASan + UBSan)
# into build-fuzz/ and runs it for a fixed number of executions.
#
#   scripts/fuzz.sh                   1,000,000 executions, seed 1
#   scripts/fuzz.sh --runs N --seed S N executions from seed S
#   scripts/fuzz.sh --smoke           CI smoke: 20,000 executions, seed 20260101
#   scripts/fuzz.sh -- ARGS...        extra libFuzzer flags (e.g. -- -jobs=2 -workers=2)
#
# The harness hands latte sizes up to 2^62 and past them; its operator new
# refuses any one allocation over 64 MiB with std::bad_alloc (fuzz/memory_cap.hpp).
# To collect every failing input of a long run instead of stopping at the first:
#   scripts/fuzz.sh -- -fork=1 -ignore_crashes=1
# Inputs found to fail are written to build-fuzz/artifacts/ (rerun one with
# build-fuzz/fuzz/fuzz_attention FILE). The corpus grows in build-fuzz/corpus/,
# seeded from fuzz/corpus/. Environment: LATTE_FUZZ_BUILD_DIR (default build-fuzz),
# CXX (default clang++).
set -euo pipefail
cd "$(dirname "$0")/.."

runs=1000000
seed=1
extra=()
while (($#)); do
  case "$1" in
    --runs) runs="$2"; shift 2 ;;
    --seed) seed="$2"; shift 2 ;;
    --smoke) runs=20000; seed=20260101; shift ;;
    --) shift; extra=("$@"); break ;;
    *) echo "fuzz.sh: unknown argument '$1' (see the header of $0)" >&2; exit 2 ;;
  esac
done

build="${LATTE_FUZZ_BUILD_DIR:-build-fuzz}"
compiler="${CXX:-clang++}"
if ! "$compiler" --version 2>/dev/null | grep -qi clang; then
  echo "fuzz.sh: libFuzzer needs clang; '$compiler' is not clang (scripts/setup.sh installs it)" >&2
  exit 1
fi

# OpenMP off: one input is one small call sequence, and threads would only make
# runs slower and less reproducible; threads are TSan's job (scripts/sanitize.sh).
# LATTE_SANITIZE_DEBUG_INFO=none (.ci/run): no debug information, a faster compile
# (a crash's artifact reproduces locally with it).
debug_info=()
if [ "${LATTE_SANITIZE_DEBUG_INFO:-lines}" = none ]; then
  debug_info=(-DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g0 -DNDEBUG")
fi
cmake -S . -B "$build" -G Ninja -DCMAKE_CXX_COMPILER="$compiler" "${debug_info[@]}" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLATTE_BUILD_FUZZERS=ON -DLATTE_BUILD_TESTS=OFF \
  -DLATTE_BUILD_BENCHMARKS=OFF -DLATTE_BUILD_EXAMPLES=OFF -DLATTE_WITH_OPENMP=OFF >/dev/null
cmake --build "$build" --target fuzz_attention

mkdir -p "$build/corpus" "$build/artifacts"
seeds=()
if [ -d fuzz/corpus ]; then seeds=(fuzz/corpus); fi
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

echo "fuzz.sh: fuzz_attention -runs=$runs -seed=$seed"
start=$(date +%s)
log="$build/fuzz.log"
status=0
# -timeout: an input that runs for 30 s is a failure (e.g. a loop over a huge
# batch that an empty call should skip), not a wait of libFuzzer's default 20 min.
"$build/fuzz/fuzz_attention" -runs="$runs" -seed="$seed" -max_len=4096 -timeout=30 -print_final_stats=1 \
  -artifact_prefix="$build/artifacts/" "${extra[@]}" "$build/corpus" "${seeds[@]}" \
  >"$log" 2>&1 || status=$?
elapsed=$(($(date +%s) - start))
executions=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
if [ "$status" -ne 0 ]; then
  tail -n 60 "$log" >&2
  echo "fuzz.sh: FAILED (exit $status) after ${executions:-?} executions, ${elapsed}s; log: $log," \
       "failing inputs: $build/artifacts/" >&2
  exit "$status"
fi
echo "fuzz.sh: ${executions:-?} executions clean in ${elapsed}s (seed $seed); log: $log"
