#!/usr/bin/env bash
# One command for a GPU machine (CMake, nvcc, PyTorch, Triton, JAX; no network):
# builds latte's CUDA tests and benchmark, runs the tests (cuda == long-double
# oracle / reference), the GPU benchmark and the peers (torch SDPA flash/cuDNN,
# the paper's JAX scan, fla if its wheel sits in bench/peers/gpu/), and writes
# one CSV plus a summary of ratios.
#
#   scripts/gpu-check.sh [OUT_DIR]          default OUT_DIR: $OUT, else ./build-gpu-out
#   scripts/gpu-check.sh --pack-deps        (on a dev machine) copy Eigen 3.4 and doctest
#                                           into build-gpu-deps/ for a GPU machine without them
#
# With the `run` device tool: first `scripts/gpu-check.sh --pack-deps` here, then
#   run(command="scripts/gpu-check.sh", carry=["build-gpu-deps"], timeout_s=600)
# Every part runs even if an earlier one failed, each under its own time cap;
# OUT_DIR gets results.csv, summary.txt, test and build logs and status.txt.
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

# part NAME CAP_SECONDS LOG command...: runs one part, records its exit status.
part() {
  local name="$1" cap="$2" log="$3"
  shift 3
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

part configure 300 "$out/configure.log" \
  cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DLATTE_WITH_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DLATTE_WITH_XSIMD=OFF -DLATTE_WITH_OPENMP=OFF \
  -DLATTE_BUILD_BENCHMARKS=OFF -DLATTE_BUILD_CUDA_BENCHMARK=ON -DLATTE_BUILD_EXAMPLES=OFF \
  "${prefix_args[@]}"
part build 900 "$out/build.log" \
  cmake --build "$build" -j "$jobs" --target test_cuda_host test_cuda_latte test_cuda_softmax \
  test_cuda_decode latte-cuda-bench
part cuda-tests 900 "$out/tests.log" \
  ctest --test-dir "$build" -L cuda -j 4 --output-on-failure --timeout 600

echo "mechanism,direction,backend,B,T,H,L,D,seconds,tokens_per_s,gflops,extra_bytes" > "$csv"
bench="$build/bench/cuda/latte-cuda-bench"
lengths="1024,2048,4096,8192,16384,32768,65536"
part bench-bf16 600 "$out/bench-bf16.csv" "$bench" --dtype bf16 --t "$lengths"
part bench-fp16 300 "$out/bench-fp16.csv" "$bench" --dtype fp16 --t 1024,8192,65536
part bench-fp32 300 "$out/bench-fp32.csv" "$bench" --dtype fp32 --t 1024,8192,65536
part sdpa 600 "$out/sdpa.csv" python3 bench/peers/gpu/sdpa_gpu.py --t "$lengths" --dtypes bf16,fp16
part jax-scan 600 "$out/jax.csv" python3 bench/peers/gpu/jax_scan_gpu.py --t 1024,4096,16384,65536

fla_wheel=$(ls bench/peers/gpu/*.whl 2> /dev/null | head -1)
if [ -n "$fla_wheel" ]; then
  part fla-install 120 "$out/fla-install.log" \
    python3 -m pip install --no-deps --no-index --target "$build/fla-site" "$fla_wheel"
  part fla 600 "$out/fla.csv" env PYTHONPATH="$build/fla-site${PYTHONPATH:+:$PYTHONPATH}" \
    python3 bench/peers/gpu/fla_linear.py
else
  echo "fla: skipped (no wheel in bench/peers/gpu/: build one elsewhere with" \
    "'pip wheel flash-linear-attention --no-deps' and place it there)" | tee -a "$status"
fi

for part_csv in bench-bf16 bench-fp16 bench-fp32 sdpa jax fla; do
  [ -f "$out/$part_csv.csv" ] && grep -E '^[a-z_0-9]+,(causal|bidirectional),' "$out/$part_csv.csv" >> "$csv"
done
python3 bench/peers/gpu/summary_gpu.py "$csv" > "$out/summary.txt" 2>&1
cat "$out/summary.txt"
echo "== gpu-check done in $(( $(date +%s) - start_time )) s; results in $out"
cat "$status"
