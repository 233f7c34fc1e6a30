#!/usr/bin/env bash
# One command for a GPU machine (CMake, nvcc, PyTorch, Triton, JAX; no network):
# builds latte's CUDA tests and benchmark, runs the tests (cuda == long-double
# oracle / reference), the GPU benchmark and the peers (torch SDPA flash/cuDNN,
# the paper's JAX scan, fla when its wheels were packed), and writes
# one CSV plus a summary of ratios.
#
#   scripts/gpu-check.sh [OUT_DIR]          default OUT_DIR: $OUT, else ./build-gpu-out
#   scripts/gpu-check.sh --pack-deps        (on a dev machine) copy Eigen 3.4 and doctest
#                                           into build-gpu-deps/ for a GPU machine without
#                                           them, and download the fla peer's wheels
#
# With the `run` device tool: first `scripts/gpu-check.sh --pack-deps` here, then
#   run(command="scripts/gpu-check.sh", carry=["build-gpu-deps"], timeout_s=600)
# Every part runs even if an earlier one failed, each under its own time cap and
# all of them within LATTE_GPU_CHECK_BUDGET seconds (default 540, so that one
# device call of at most 600 s holds the whole check: a part that would run past
# the budget gets the time left, or is skipped under 15 s). Correctness first:
# build, CUDA tests, then benchmarks and peers. OUT_DIR gets results.csv,
# summary.txt, test and build logs and status.txt.
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

out="${1:-${OUT:-$root/build-gpu-out}}"
mkdir -p "$out"
build="$root/build-gpu"
csv="$out/results.csv"
status="$out/status.txt"
: > "$status"
start_time=$(date +%s)
budget="${LATTE_GPU_CHECK_BUDGET:-540}"

# part NAME CAP_SECONDS LOG command...: runs one part, records its exit status.
part() {
  local name="$1" cap="$2" log="$3"
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
  echo "$name: $verdict ($(( $(date +%s) - t0 )) s)" | tee -a "$status"
  tail -n 5 "$log"
  return 0
}

{
  nvidia-smi || true
  nvcc --version || true
  cmake --version | head -1
  python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name())' || true
  python3 -c 'import jax; print("jax", jax.__version__, jax.devices())' || true
  python3 -c 'import triton; print("triton", triton.__version__)' || true
} > "$out/machine.txt" 2>&1
head -n 25 "$out/machine.txt"

prefix_args=()
[ -d "$deps" ] && prefix_args=(-DCMAKE_PREFIX_PATH="$deps")
generator=()
command -v ninja > /dev/null && generator=(-G Ninja)
jobs=$(nproc)

part configure 90 "$out/configure.log" \
  cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DLATTE_WITH_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DLATTE_WITH_XSIMD=OFF -DLATTE_WITH_OPENMP=OFF \
  -DLATTE_BUILD_BENCHMARKS=OFF -DLATTE_BUILD_CUDA_BENCHMARK=ON -DLATTE_BUILD_EXAMPLES=OFF \
  "${prefix_args[@]}"
part build 300 "$out/build.log" \
  cmake --build "$build" -j "$jobs" --target test_cuda_host test_cuda_latte test_cuda_softmax \
  test_cuda_decode latte-cuda-bench
part cuda-tests 200 "$out/tests.log" \
  ctest --test-dir "$build" -L cuda -j 4 --output-on-failure --timeout 190

echo "mechanism,direction,backend,B,T,H,L,D,seconds,tokens_per_s,gflops,extra_bytes" > "$csv"
bench="$build/bench/cuda/latte-cuda-bench"
lengths="1024,2048,4096,8192,16384,32768,65536"
part bench-bf16 120 "$out/bench-bf16.csv" "$bench" --dtype bf16 --t "$lengths"
part sdpa 90 "$out/sdpa.csv" python3 bench/peers/gpu/sdpa_gpu.py --t "$lengths" --dtypes bf16,fp16
part bench-fp16 45 "$out/bench-fp16.csv" "$bench" --dtype fp16 --t 1024,8192,65536
part bench-fp32 45 "$out/bench-fp32.csv" "$bench" --dtype fp32 --t 1024,8192,65536
part jax-scan 120 "$out/jax.csv" python3 bench/peers/gpu/jax_scan_gpu.py --t 1024,4096

fla_wheels=("$deps"/wheels/*.whl bench/peers/gpu/*.whl)
fla_wheels=($(ls "${fla_wheels[@]}" 2> /dev/null))
if [ ${#fla_wheels[@]} -gt 0 ]; then
  part fla-install 30 "$out/fla-install.log" \
    python3 -m pip install --no-deps --no-index --target "$build/fla-site" "${fla_wheels[@]}"
  part fla 150 "$out/fla.csv" env PYTHONPATH="$build/fla-site${PYTHONPATH:+:$PYTHONPATH}" \
    python3 bench/peers/gpu/fla_linear.py
else
  echo "fla: skipped (no wheels: run 'scripts/gpu-check.sh --pack-deps' where pip" \
    "reaches PyPI, or place flash-linear-attention and fla-core wheels in bench/peers/gpu/)" | tee -a "$status"
fi

for part_csv in bench-bf16 bench-fp16 bench-fp32 sdpa jax fla; do
  [ -f "$out/$part_csv.csv" ] && grep -E '^[a-z_0-9]+,(causal|bidirectional),' "$out/$part_csv.csv" >> "$csv"
done
python3 bench/peers/gpu/summary_gpu.py "$csv" > "$out/summary.txt" 2>&1
cat "$out/summary.txt"
echo "== gpu-check done in $(( $(date +%s) - start_time )) s; results in $out"
cat "$status"
