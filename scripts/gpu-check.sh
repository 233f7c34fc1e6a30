#!/usr/bin/env bash
# One command for a GPU machine (CMake, nvcc, PyTorch, Triton, JAX; no network):
# builds latte's CUDA tests and benchmark, runs the tests (cuda == long-double
# oracle / reference), the GPU benchmark and the peers (torch SDPA flash/cuDNN,
# the paper's JAX scan, fla when its wheels were packed), and writes
# one CSV plus a summary of ratios.
#
#   scripts/gpu-check.sh [--step STEP] [OUT_DIR]
#       STEP: all (default) | build-tests | bench | peers; OUT_DIR: $OUT, else ./build-gpu-out
#   scripts/gpu-check.sh --pack-deps        (on a dev machine) copy Eigen 3.4 and doctest
#                                           into build-gpu-deps/ for a GPU machine without
#                                           them, and download the fla peer's wheels
#
# With the `run` device tool (commands of at most 600 s, at most 8 files back):
# first `scripts/gpu-check.sh --pack-deps` here, then
#   run(command="scripts/gpu-check.sh", carry=["build-gpu-deps"], timeout_s=600)
# or, one step per call (each step's caps add up to under 600 s; bench and peers
# reuse the warm machine's build-gpu/):
#   scripts/gpu-check.sh --step build-tests    configure, build (keeps going past a
#                                              failed target), CUDA tests (~2 min)
#   scripts/gpu-check.sh --step bench          latte-cuda-bench bf16 / fp16 / fp32, SDPA (~1 min)
#   scripts/gpu-check.sh --step peers          the paper's JAX scan, fla (~5 min)
# Every part runs even if an earlier one failed, each under its own cap, and all
# within LATTE_GPU_CHECK_BUDGET seconds (default 540: a part that would run past it
# gets the time left, or is skipped under 15 s). After each part OUT_DIR's five
# files are up to date, so a call stopped at its limit still returns results:
# status.txt (one verdict per part), results.csv (latte-compare's header),
# summary.txt (ratios), machine.txt, logs.tgz (every part's log; also in
# build-gpu/check-logs/). On a GPU machine a CUDA test that skips is a failure.
# Without a GPU (a dry run) the build runs when nvcc is there and every step that
# needs the GPU is reported NOT RUN, never as passed.
set -u
cd "$(dirname "$0")/.."
root="$PWD"
deps="$root/build-gpu-deps"

if [ "${1:-}" = "--pack-deps" ]; then
  rm -rf "$deps" && mkdir -p "$deps/include" "$deps/share" "$deps/lib/cmake"
  cp -r /usr/include/eigen3 "$deps/include/" && cp -r /usr/share/eigen3 "$deps/share/"
  cp -r /usr/include/doctest "$deps/include/" && cp -r /usr/lib/cmake/doctest "$deps/lib/cmake/"
  # Debian's doctest config hard-codes /usr: make it relative to where it lies.
  sed -i 's|^set(_IMPORT_PREFIX "/usr")|get_filename_component(_IMPORT_PREFIX "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)|' \
    "$deps/lib/cmake/doctest/doctestTargets.cmake"
  # The fla peer (pure Python + Triton) for a GPU machine without network.
  mkdir -p "$deps/wheels"
  python3 -m pip download -q --no-deps -d "$deps/wheels" flash-linear-attention==0.6.0 fla-core==0.6.0 \
    || echo "fla wheels not downloaded: the fla peer will be skipped"
  du -sh "$deps"
  exit 0
fi

step=all
if [ "${1:-}" = "--step" ]; then
  step="${2:?--step needs all, build-tests, bench or peers}"
  shift 2
fi
case "$step" in all | build-tests | bench | peers) ;; *)
  echo "gpu-check: unknown step '$step' (all, build-tests, bench, peers)" >&2
  exit 2 ;;
esac
out="${1:-${OUT:-$root/build-gpu-out}}"
mkdir -p "$out"
build="$root/build-gpu"
logs="$build/check-logs"
mkdir -p "$logs"
csv="$out/results.csv"
status="$out/status.txt"
: > "$status"
echo "mechanism,direction,backend,B,T,H,L,D,seconds,tokens_per_s,gflops,extra_bytes" > "$csv"
start_time=$(date +%s)
budget="${LATTE_GPU_CHECK_BUDGET:-540}"
has_gpu=false
nvidia-smi -L 2> /dev/null | grep -q '^GPU ' && has_gpu=true

# publish: OUT_DIR's summary and log archive, brought up to date after every part.
publish() {
  python3 "$root/bench/peers/gpu/summary_gpu.py" "$csv" > "$out/summary.txt" 2>&1
  tar czf "$out/logs.tgz" -C "$build" check-logs 2> /dev/null
}

# part NAME CAP_SECONDS LOG command...: runs one part, records its verdict; a log
# ending in .csv has its result rows appended to results.csv.
part() {
  local name="$1" cap="$2" log="$logs/$3"
  shift 3
  local left=$(( budget - ($(date +%s) - start_time) ))
  if [ "$left" -lt 15 ]; then
    echo "$name: SKIPPED (budget of ${budget}s spent)" | tee -a "$status"
    return 0
  fi
  [ "$cap" -gt "$left" ] && cap="$left"
  echo "== $name (cap ${cap}s, log $log)"
  local t0=$(date +%s)
  timeout --kill-after=10 "$cap" "$@" > "$log" 2>&1
  local rc=$?
  local verdict=ok
  [ $rc -eq 124 ] && verdict="TIMED OUT"
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && verdict="FAILED rc=$rc"
  if [ "$name" = cuda-tests ] && [ $rc -eq 0 ] && grep -qi 'skipped' "$log"; then
    verdict="FAILED (a CUDA test skipped on a GPU machine)"
  fi
  echo "$name: $verdict ($(( $(date +%s) - t0 )) s)" | tee -a "$status"
  tail -n 5 "$log"
  case "$log" in *.csv) grep -E '^[a-z_0-9]+,(causal|bidirectional),' "$log" >> "$csv" ;; esac
  publish
  return 0
}

# not_run NAME WHY: a part that could not run here, reported as such.
not_run() { echo "$1: NOT RUN ($2)" | tee -a "$status"; }

{
  nvidia-smi || echo "nvidia-smi: no GPU here"
  nvcc --version || true
  cmake --version | head -1
  python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name())' || true
  python3 -c 'import jax; print("jax", jax.__version__, jax.devices())' || true
  python3 -c 'import triton; print("triton", triton.__version__)' || true
} > "$out/machine.txt" 2>&1
head -n 25 "$out/machine.txt"

prefix_args=()
[ -d "$deps" ] && prefix_args=(-DCMAKE_PREFIX_PATH="$deps")
generator=(-G "Unix Makefiles") keep_going=(-k)
command -v ninja > /dev/null && generator=(-G Ninja) keep_going=(-k 0)
jobs=$(nproc)
bench="$build/bench/cuda/latte-cuda-bench"
lengths="1024,2048,4096,8192,16384,32768,65536"

if [ "$step" = all ] || [ "$step" = build-tests ]; then
  if command -v nvcc > /dev/null; then
    part configure 60 configure.log \
      cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DLATTE_WITH_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DLATTE_WITH_XSIMD=OFF -DLATTE_WITH_OPENMP=OFF \
      -DLATTE_BUILD_BENCHMARKS=OFF -DLATTE_BUILD_CUDA_BENCHMARK=ON -DLATTE_BUILD_EXAMPLES=OFF \
      "${prefix_args[@]}"
    part build 300 build.log \
      cmake --build "$build" -j "$jobs" --target test_cuda_host test_cuda_latte test_cuda_softmax \
      test_cuda_decode latte-cuda-bench -- "${keep_going[@]}"
  else
    not_run configure "no nvcc"
    not_run build "no nvcc"
  fi
  if $has_gpu; then
    part cuda-tests 200 tests.log \
      ctest --test-dir "$build" -L '^cuda$' -j 4 --output-on-failure --timeout 190
  else
    not_run cuda-tests "no GPU"
  fi
fi

if [ "$step" = all ] || [ "$step" = bench ]; then
  if ! $has_gpu; then
    not_run bench "no GPU"
  elif [ ! -x "$bench" ]; then
    not_run bench "latte-cuda-bench not built: run the build-tests step first"
  else
    part bench-bf16 120 bench-bf16.csv "$bench" --dtype bf16 --t "$lengths"
    part sdpa 90 sdpa.csv python3 bench/peers/gpu/sdpa_gpu.py --t "$lengths" --dtypes bf16,fp16
    part bench-fp16 45 bench-fp16.csv "$bench" --dtype fp16 --t 1024,8192,65536
    part bench-fp32 45 bench-fp32.csv "$bench" --dtype fp32 --t 1024,8192,65536
  fi
fi

if [ "$step" = all ] || [ "$step" = peers ]; then
  if ! $has_gpu; then
    not_run peers "no GPU"
  else
    part jax-scan 120 jax.csv python3 bench/peers/gpu/jax_scan_gpu.py --t 1024,4096
    fla_wheels=("$deps"/wheels/*.whl bench/peers/gpu/*.whl)
    fla_wheels=($(ls "${fla_wheels[@]}" 2> /dev/null))
    if [ ${#fla_wheels[@]} -gt 0 ]; then
      part fla-install 30 fla-install.log \
        python3 -m pip install --no-deps --no-index --target "$build/fla-site" "${fla_wheels[@]}"
      part fla 150 fla.csv env PYTHONPATH="$build/fla-site${PYTHONPATH:+:$PYTHONPATH}" \
        python3 bench/peers/gpu/fla_linear.py
    else
      not_run fla "no wheels: run 'scripts/gpu-check.sh --pack-deps' where pip reaches PyPI"
    fi
  fi
fi

publish
cat "$out/summary.txt"
echo "== gpu-check ($step) done in $(( $(date +%s) - start_time )) s; results in $out"
cat "$status"
! grep -qE ': (FAILED|TIMED OUT)' "$status"
