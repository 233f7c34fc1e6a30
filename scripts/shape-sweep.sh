#!/usr/bin/env bash
# The shape sweep: the CPU kernels (causal and bidirectional Latte +- VAPOR, elu+1,
# cosFormer, softmax with a 128 window) over a grid of B, H, L, D, T in fp32 and fp64,
# against this machine's FMA peak and memory bandwidth (bench/latte_sweep.cpp says
# which shapes and how they are timed). Builds latte-sweep, runs it, then
# bench/plot_sweep.py draws the heat maps and checks the targets:
#   docs/shape-sweep.csv           the rows (machine rows first)
#   docs/shape-sweep.png           % of each shape's roofline limit
#   docs/shape-sweep-peak.png      % of the type's FMA peak
#   docs/shape-sweep-summary.txt   worst shapes, target A (>= 50 % of the roofline
#                                  limit where B*H >= threads) and target B (odd L / D
#                                  >= 70 % of their power-of-two neighbour's GFLOP/s)
#
#   scripts/shape-sweep.sh                       the full sweep (about 30 minutes)
#   scripts/shape-sweep.sh --budget-minutes 3    a shorter one (the required shapes still
#                                                all run); other flags pass through:
#                                                --seed S, --min-time S, --only NAME,...,
#                                                --smoke
#
# Environment: LATTE_BUILD_DIR (default build, configured Release if it is not yet);
# LATTE_PLOT_PYTHON, a Python with matplotlib and NumPy. Without it: .venv-peers
# (bench/peers/setup_peers.sh) or python3 when they have matplotlib, else .venv
# (scripts/setup.sh's), where matplotlib is installed from PyPI if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
build="${LATTE_BUILD_DIR:-build}"

has_matplotlib() { [ -x "$1" ] || command -v "$1" >/dev/null 2>&1 && "$1" -c 'import matplotlib, numpy' 2>/dev/null; }
python="${LATTE_PLOT_PYTHON:-}"
if [ -z "$python" ]; then
  for candidate in .venv-peers/bin/python python3; do
    if has_matplotlib "$candidate"; then python="$candidate"; break; fi
  done
fi
if [ -z "$python" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  if ! has_matplotlib .venv/bin/python; then
    echo "shape-sweep.sh: installing matplotlib into .venv/" >&2
    .venv/bin/python -m pip install --quiet --disable-pip-version-check matplotlib numpy
  fi
  python=.venv/bin/python
fi

if [ -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" >/dev/null  # picks up the latte-sweep target, keeps the cache
else
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
fi
cmake --build "$build" --target latte-sweep

csv=docs/shape-sweep.csv
trap 'rm -f "$csv.partial"' EXIT  # a failed run leaves the last CSV as it was
"$build/bench/latte-sweep" "$@" >"$csv.partial"
mv "$csv.partial" "$csv"
"$python" bench/plot_sweep.py "$csv" docs/shape-sweep.png docs/shape-sweep-peak.png \
  docs/shape-sweep-summary.txt
