#!/usr/bin/env bash
# One comparison, side by side on this machine: latte-compare, then the peers
# (PyTorch SDPA forward and forward + backward, the paper's JAX scan and its
# jax.grad, flash-linear-attention's naive chunk linear attention and naive
# recurrent GSA forward and under autograd, and torch transcriptions of Latte
# Macchiato, LAVO and conv-compression under autograd, each first checked against
# latte's forward) and latte's own Python calls (latte.torch's ops, forward and
# under autograd, and the NumPy binding, in rounds with latte-compare: the Python
# call's overhead) appending to the same CSV, then the plot and the summary.
# latte's module for the peers: installed into .venv-peers with `pip install .`,
# as the README has a user do (scikit-build-core and nanobind come from
# setup_peers.sh; --no-build-isolation keeps build-python/ incremental, so each
# run rebuilds only what changed and times the same sources as latte-compare).
#   bench/peers/run_all.sh [lengths] [csv]      (defaults: 256..1M, bench/results.csv)
set -euo pipefail
cd "$(dirname "$0")/../.."
lengths="${1:-256,1024,4096,16384,65536,262144,1048576}"
csv="${2:-bench/results.csv}"
[ -x .venv-peers/bin/python ] || bench/peers/setup_peers.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target latte-compare latte-peer-check >/dev/null
CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" .venv-peers/bin/pip install --quiet --no-build-isolation .
threads="$(nproc)"
export OMP_NUM_THREADS="$threads"
build/bench/latte-compare --csv --rounds 5 --t "$lengths" > "$csv"
.venv-peers/bin/python bench/peers/sdpa.py --threads "$threads" --t "$lengths" --time-cap 60 >> "$csv"
peer_lengths=$(echo "$lengths" | tr ',' '\n' | awk '$1 <= 65536' | paste -sd, -)
.venv-peers/bin/python bench/peers/jax_scan.py --t "$peer_lengths" >> "$csv"
fla_lengths=$(echo "$lengths" | tr ',' '\n' | awk '$1 <= 16384' | paste -sd, -)
# fla's GSA under autograd grows as T^2 (minutes at 4K): its own --time-cap
.venv-peers/bin/python bench/peers/fla_naive.py --threads "$threads" --t "$fla_lengths" --time-cap 600 >> "$csv"
.venv-peers/bin/python bench/peers/torch_mechanisms.py --threads "$threads" --t "$fla_lengths" >> "$csv"
.venv-peers/bin/python bench/peers/latte_torch.py --threads "$threads" --t "$peer_lengths" >> "$csv"
.venv-peers/bin/python bench/plot.py "$csv" docs/scaling.png
.venv-peers/bin/python bench/summary.py "$csv"
