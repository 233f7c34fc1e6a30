#!/usr/bin/env bash
# Sanitizer runs (issue 7), sized for CI:
#  1. the asan preset (clang's AddressSanitizer + UndefinedBehaviorSanitizer: clang's
#     UBSan sees what GCC's misses, e.g. null + offset on an empty buffer): every test
#     except the packaging ones (label "package": they configure and build
#     consumer projects, which is slow and not about memory), with the random-case
#     loops scaled down by LATTE_TEST_CASE_SCALE (default 0.1: tests/support.hpp);
#  2. the tsan preset (ThreadSanitizer): the tests that run threads
#     (test_thread_safety) and those that use the cpu backend;
#  3. cuda-emulated: the CUDA tests on the host emulation of CUDA (tests/cuda_host,
#     one host thread per CUDA thread) under ASan + UBSan and under TSan, where a
#     missing barrier in a kernel is a data race.
# Build trees: build-asan/ and build-tsan/ (LATTE_SANITIZE_BUILD_ROOT moves them).
# One part alone: scripts/sanitize.sh asan | tsan | cuda-emulated.
# LATTE_ASAN_TESTS / LATTE_TSAN_TESTS (space-separated test names) narrow a part to
# those tests (.ci/run narrows TSan to the threaded and decode tests to fit CI's time limit);
# LATTE_ASAN_PROGRAMS (space-separated test programs: a group of tests/CMakeLists.txt
# such as test_input_checks, or a lone test_*.cpp) narrows the ASan part to those
# programs, built whole and run test by test (their tests carry the program's name
# as a CTest label); .ci/run names its programs there. Without these variables every
# test runs: the full run's result is in docs/sanitizers.md.
# LATTE_SANITIZE_DEBUG_INFO=none builds without debug information (reports name
# functions, not lines): clang's line tables are ~30 % of an ASan compile here
# (test_linear_golden.cpp: 91 s with -g1, 64 s with -g0); .ci/run sets it, a local
# run keeps the line tables (default: lines).
set -euo pipefail
cd "$(dirname "$0")/.."

if (($#)); then parts=("$@"); else parts=(asan tsan cuda-emulated); fi
root="${LATTE_SANITIZE_BUILD_ROOT:-.}"
jobs="$(nproc)"
scale="${LATTE_TEST_CASE_SCALE:-0.1}"
# Tests only; CUDA is off because nvcc does not take the host sanitizer flags.
options=(-DLATTE_BUILD_BENCHMARKS=OFF -DLATTE_BUILD_EXAMPLES=OFF -DLATTE_WITH_CUDA=OFF)
# The presets' optimisation (asan -O1; tsan RelWithDebInfo's -O2) without debug information.
asan_flags=()
tsan_flags=()
if [ "${LATTE_SANITIZE_DEBUG_INFO:-lines}" = none ]; then
  asan_flags=(-DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g0 -DNDEBUG")
  tsan_flags=(-DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g0 -DNDEBUG")
fi

# The tsan tests: the threaded one and the cpu-backend ones that exist in this checkout.
tsan_tests=()
for name in ${LATTE_TSAN_TESTS:-test_thread_safety test_latte_oracle test_softmax_oracle test_decode \
            test_numerics test_api test_allocation test_linear_oracle test_linear_decode}; do
  if [ -f "tests/$name.cpp" ]; then tsan_tests+=("$name"); fi
done
asan_tests=(${LATTE_ASAN_TESTS:-})
asan_programs=(${LATTE_ASAN_PROGRAMS:-})
if ((${#asan_tests[@]})) && ((${#asan_programs[@]})); then
  echo "sanitize.sh: LATTE_ASAN_TESTS and LATTE_ASAN_PROGRAMS both set; set one" >&2
  exit 2
fi

seconds() { date +%s; }

for part in "${parts[@]}"; do
  start=$(seconds)
  case "$part" in
    asan)
      build="$root/build-asan"
      echo "== sanitize: ASan + UBSan (clang), every test except label 'package', LATTE_TEST_CASE_SCALE=$scale"
      cmake --preset asan -B "$build" "${options[@]}" "${asan_flags[@]}" >/dev/null
      selection=(-LE "package|cuda_emulated")  # the emulated CUDA tests: part cuda-emulated
      if ((${#asan_programs[@]})); then
        echo "   (${#asan_programs[@]} test programs: ${asan_programs[*]}; without LATTE_ASAN_PROGRAMS, every one)"
        cmake --build "$build" -j "$jobs" --target "${asan_programs[@]}"
        selection+=(-L "^($(IFS='|'; echo "${asan_programs[*]}"))\$")
      elif ((${#asan_tests[@]})); then
        echo "   (${#asan_tests[@]} test programs: ${asan_tests[*]})"
        cmake --build "$build" -j "$jobs" --target "${asan_tests[@]}"
        selection=(-R "^($(IFS='|'; echo "${asan_tests[*]}"))\$")
      else
        cmake --build "$build" -j "$jobs"
      fi
      ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1" \
      UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
      LATTE_TEST_CASE_SCALE="$scale" \
        ctest --test-dir "$build" --output-on-failure --no-tests=error "${selection[@]}" -j "$jobs" --timeout 900
      ;;
    tsan)
      build="$root/build-tsan"
      echo "== sanitize: TSan, ${tsan_tests[*]}, LATTE_TEST_CASE_SCALE=$scale"
      cmake --preset tsan -B "$build" "${options[@]}" "${tsan_flags[@]}" >/dev/null
      cmake --build "$build" -j "$jobs" --target "${tsan_tests[@]}"
      regex="^($(IFS='|'; echo "${tsan_tests[*]}"))\$"
      TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:ignore_noninstrumented_modules=1" \
      LATTE_TEST_CASE_SCALE="$scale" \
        ctest --test-dir "$build" --output-on-failure -R "$regex" -j "$jobs" --timeout 900
      ;;
    cuda-emulated)
      emulated=(test_cuda_host_emulated test_cuda_decode_emulated test_cuda_latte_emulated
                test_cuda_softmax_emulated)
      echo "== sanitize: the CUDA tests on the host emulation, ASan + UBSan and TSan, LATTE_TEST_CASE_SCALE=$scale"
      for preset in asan tsan; do
        cmake --preset "$preset" -B "$root/build-$preset" "${options[@]}" >/dev/null
        cmake --build "$root/build-$preset" -j "$jobs" --target "${emulated[@]}"
      done
      for name in "${emulated[@]}"; do
        echo "-- $name (ASan + UBSan)"
        ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:strict_string_checks=1" \
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" LATTE_TEST_CASE_SCALE="$scale" \
          "$root/build-asan/tests/cuda_host/$name" --minimal
        echo "-- $name (TSan)"
        TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1" LATTE_TEST_CASE_SCALE="$scale" \
          "$root/build-tsan/tests/cuda_host/$name" --minimal
      done
      ;;
    *)
      echo "sanitize.sh: unknown part '$part' (asan, tsan or cuda-emulated)" >&2
      exit 2
      ;;
  esac
  echo "== sanitize: $part passed in $(($(seconds) - start)) s"
done
