#!/usr/bin/env bash
# The training comparison of issues 22, 25 and 26 in one run, side by side on
# this machine: latte-compare's forward, backward and forward + backward rows of
# causal Latte (with and without VAPOR), linear elu + 1, Latte Macchiato, LAVO and
# conv-compression, then the peers under autograd (PyTorch SDPA, the paper's
# Listing 1 scan under jax.grad, flash-linear-attention's naive chunk linear
# attention and naive recurrent GSA, torch transcriptions of Macchiato, LAVO and
# conv-compression), then latte's own torch ops and NumPy calls in rounds with
# latte-compare (the Python call's overhead), all into one CSV; then the summary.
# A shorter sibling of bench/peers/run_all.sh (no 256..1M scaling sweep, no plot),
# for the lengths the targets name. It needs the peers' environment
# (bench/peers/setup_peers.sh, ~6 GB) and latte's Python module: the CMake build's
# (build/python, -DLATTE_BUILD_PYTHON=ON, as scripts/test.sh configures it) when
# there is one, else `pip install .` into .venv-peers.
#   scripts/training-bench.sh [lengths] [csv]
#       (defaults: 4096,16384,65536 and docs/benchmark-training.csv)
set -euo pipefail
cd "$(dirname "$0")/.."
lengths="${1:-4096,16384,65536}"
csv="${2:-docs/benchmark-training.csv}"
[ -x .venv-peers/bin/python ] || bench/peers/setup_peers.sh
cmake --build build -j "$(nproc)" --target latte-compare latte-peer-check >/dev/null
if ls build/python/latte/_latte.*.so >/dev/null 2>&1 &&
  PYTHONPATH=build/python .venv-peers/bin/python -c "import latte" 2>/dev/null; then
  export PYTHONPATH="$PWD/build/python"
else
  CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" .venv-peers/bin/pip install --quiet --no-build-isolation .
fi
threads="$(nproc)"
export OMP_NUM_THREADS="$threads"
short=$(echo "$lengths" | tr ',' '\n' | awk '$1 <= 16384' | paste -sd, -)
build/bench/latte-compare --csv --rounds 3 --t "$lengths" \
  --only 'latte$,latte_backward,latte_forward_backward,latte_vapor,linear_elu,macchiato,lavo,conv' > "$csv"
.venv-peers/bin/python bench/peers/sdpa.py --threads "$threads" --t "$lengths" --time-cap 60 >> "$csv"
.venv-peers/bin/python bench/peers/jax_scan.py --t "$short" >> "$csv"
# fla's GSA under autograd grows as T^2 (minutes at 4K): what fits in --time-cap
.venv-peers/bin/python bench/peers/fla_naive.py --threads "$threads" --t "$short" --time-cap 300 >> "$csv"
.venv-peers/bin/python bench/peers/torch_mechanisms.py --threads "$threads" --t "$short" >> "$csv"
.venv-peers/bin/python bench/peers/latte_torch.py --threads "$threads" --t "$lengths" >> "$csv"
.venv-peers/bin/python bench/summary.py "$csv"
