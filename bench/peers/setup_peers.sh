#!/usr/bin/env bash
# Creates .venv-peers/ (git-ignored) with the peers' Python packages from PyPI:
# PyTorch (scaled_dot_product_attention), JAX (the paper's scan),
# flash-linear-attention (imported as fla: its naive_chunk_linear_attn and
# naive_recurrent_gsa are what a PyTorch user has on a CPU, where fla's Triton
# kernels do not run), matplotlib (the plot), and scikit-build-core + nanobind so
# that run_all.sh can `pip install --no-build-isolation .` latte's own module
# into this venv (bench/peers/latte_torch.py times it). Not a build dependency
# of latte. About 6 GB (PyTorch's wheel brings its CUDA libraries even though the
# peers run on the CPU).
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ ! -x .venv-peers/bin/python ]; then
  python3 -m venv .venv-peers
fi
.venv-peers/bin/pip install --quiet --upgrade pip
.venv-peers/bin/pip install --quiet torch jax matplotlib numpy flash-linear-attention \
  scikit-build-core nanobind
.venv-peers/bin/python -c "import torch, jax, matplotlib, fla; from fla.ops.linear_attn.naive import naive_chunk_linear_attn; from fla.ops.gsa.naive import naive_recurrent_gsa; print('peers ready: torch', torch.__version__, 'jax', jax.__version__, 'fla', fla.__version__)"
