"""latte's own Python calls on the CPU: the torch ops of latte.torch and the NumPy binding,
beside latte-compare's C++ call.

What a PyTorch user of latte pays, at latte-compare's core shape (B1 H8 L64 D64, fp32):
`lt.latte_attention` (causal Latte) and `lt.linear_attention` (causal, elu + 1), forward,
and forward + backward under autograd (q, k, v require grad, then
torch.autograd.grad(out, (q, k, v), d_out): latte's C++ backward through
register_autograd); and the plain
NumPy `latte.LatteAttention.forward` / `latte.LinearAttention.forward` (a new output
array each call, as a user calls it). The Python call's overhead (issue 25: <= 5 % over
the C++ call at T >= 4K) is measured two ways, both printed by bench/summary.py:
- on the same calls: every timed Python call also reads `latte.kernel_seconds()` (the
  time its C++ kernels ran, inside the binding with the GIL released), so the C++ time
  comes from the very call whose wall time is the Python row's (backends
  `latte-torch-kernel`, `latte-numpy-kernel`: the kernel time of each row's best call).
  Nothing but the Python side differs, whatever the machine's neighbours do meanwhile;
- against latte-compare's rows for the same mechanisms and shape, which this script runs
  itself (--latte-compare, `--only` of the four rows): each of --rounds rounds runs
  latte-compare, then the Python calls, and every row keeps its best round. Separate
  processes on a shared 2-core machine: +-15 % between rounds is common.

Before any timing, at each length, each op's forward is checked against the NumPy
binding's on the same inputs (the same C++ kernel: max |diff| <= 1e-6 x max(1, max |out|)).

Rows (latte-compare's CSV): `latte`, `linear_elu` (forward), backends `latte-torch` and
`latte-numpy`; `latte_forward_backward`, `linear_elu_forward_backward`, backend
`latte-torch`; each with its `-kernel` twin (the C++ time inside that row's best call);
and latte-compare's rows for those four mechanisms as this script measured
them, backend `latte-cpu-ref` (run_all.sh's own latte-compare run has them as latte-cpu;
the plot leaves the -ref rows out). FLOPs: latte-compare's formulas.

latte's module is imported as `import latte`: run_all.sh installs it into .venv-peers
with `pip install .` (the README's way); PYTHONPATH=<a CMake build>/python (configured
with -DLATTE_BUILD_PYTHON=ON for the same Python) also works.

  .venv-peers/bin/python bench/peers/latte_torch.py --t 4096,16384,65536 >> results.csv
"""
import csv
import io
import os
import subprocess
import sys
import time

# PyTorch's own switch (read when torch loads): tensors of 2 MiB and more in transparent huge
# pages, as latte-compare's inputs and latte's outputs are. Without it, torch's q, k, v sit in
# 4 KiB pages and, at T = 64K, the same kernel reading them takes 9-12 % longer (TLB misses) on
# this machine: the pages', not the call's. THP_MEM_ALLOC_ENABLE=0 measures that case.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import latte
import latte.torch as lt
import torch

from peer_common import csv_row, lengths, parser

B, H, L, D = 1, 8, 64, 64
ROWS = ("latte", "latte_forward_backward", "linear_elu", "linear_elu_forward_backward")


def flops(mechanism, T):
    """latte-compare's: Latte 4 B T H L D, linear elu + 1 B T H (4 L D + 3 L); x3 with the backward."""
    forward = 4.0 * B * T * H * L * D if mechanism.startswith("latte") else \
        float(B) * T * H * (4.0 * L * D + 3.0 * L)
    return 3 * forward if mechanism.endswith("forward_backward") else forward


def forward_backward(op, q, k, v, d_out):
    """op's forward, then the gradients with respect to q, k, v of a loss whose gradient with
    respect to the output is d_out (that of (out * d_out).sum(), without the loss's own
    T-sized torch ops, which latte-compare's rows do not have either)."""
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    return torch.autograd.grad(op(*leaves), leaves, grad_outputs=d_out)


def best_call(fn, min_time, max_runs=20):
    """(wall seconds, C++ kernel seconds) of fn()'s fastest call after a warm-up call: at least
    two timed calls, more until min_time is spent (at most max_runs), one only past 2 s (as
    peer_common.best_time). The kernel seconds are latte.kernel_seconds()'s growth over that call."""
    fn()
    best, spent, runs = (float("inf"), 0.0), 0.0, 0
    while runs < 2 or (spent < min_time and runs < max_runs):
        kernel, start = latte.kernel_seconds(), time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        best, spent, runs = min(best, (elapsed, latte.kernel_seconds() - kernel)), spent + elapsed, runs + 1
        if elapsed > 2.0:
            break
    return best


def cases(T, generator):
    """(mechanism, backend, fn) of the Python calls at T tokens, each op checked first."""
    q, k, v, d_out = (torch.randn(B, T, H, D, generator=generator) for _ in range(4))
    arrays = [x.numpy() for x in (q, k, v)]
    mechanisms = (
        ("latte", lambda *x: lt.latte_attention(*x, causal=True),
         latte.LatteAttention(H, L, D, causal=True)),
        ("linear_elu", lambda *x: lt.linear_attention(*x, causal=True, feature_map="elu_plus_one"),
         latte.LinearAttention(H, L, D, causal=True, feature_map="elu_plus_one")))
    result = []
    for name, op, binding in mechanisms:
        ours, reference = op(q, k, v), torch.from_numpy(binding.forward(*arrays))
        error, scale = (ours - reference).abs().max().item(), reference.abs().max().item()
        bound = 1e-6 * max(1.0, scale)
        print(f"# check {name} T={T}: max |torch op - NumPy binding| = {error:.3e} (bound {bound:.1e}) "
              f"{'ok' if error <= bound else 'MISMATCH'}", file=sys.stderr, flush=True)
        if error > bound:
            sys.exit(f"latte_torch.py: latte.torch's {name} differs from the NumPy binding; nothing timed")
        result += [(name, "latte-torch", lambda op=op: op(q, k, v)),
                   (name, "latte-numpy", lambda binding=binding: binding.forward(*arrays)),
                   (name + "_forward_backward", "latte-torch",
                    lambda op=op: forward_backward(op, q, k, v, d_out))]
    return result


def main():
    arguments = parser("4096,16384,65536", time_cap=60.0)
    arguments.add_argument("--rounds", type=int, default=3,
                           help="rounds of latte-compare then the Python calls; each row keeps its best")
    arguments.add_argument("--latte-compare", default="build/bench/latte-compare",
                           help="latte-compare to run for the latte-cpu-ref rows ('' for none)")
    args = arguments.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(1)
    timed = {T: cases(T, generator) for T in lengths(args.t)}
    best = {}  # (mechanism, backend, T) -> seconds
    kernels = {}  # (mechanism, backend + "-kernel", T) -> the C++ seconds inside best's call

    def keep(key, seconds):
        best[key] = min(seconds, best.get(key, float("inf")))

    for _ in range(args.rounds):
        if args.latte_compare:
            table = subprocess.run([args.latte_compare, "--csv", "--only",
                                    "latte$,linear_elu$,latte_forward_backward$,linear_elu_forward_backward$", "--t", args.t,
                                    "--min-time", str(args.min_time)],
                                   check=True, capture_output=True, text=True).stdout
            for row in csv.DictReader(io.StringIO(table)):
                if row["mechanism"] in ROWS and row["direction"] == "causal":
                    keep((row["mechanism"], "latte-cpu-ref", int(row["T"])), float(row["seconds"]))
        for T, calls in timed.items():
            for mechanism, backend, fn in calls:
                wall, kernel = best_call(fn, args.min_time)
                if wall < best.get((mechanism, backend, T), float("inf")):
                    kernels[(mechanism, backend + "-kernel", T)] = kernel
                keep((mechanism, backend, T), wall)
    best.update(kernels)
    for (mechanism, backend, T), seconds in sorted(best.items(), key=lambda x: (x[0][2], x[0][0], x[0][1])):
        print(csv_row(mechanism, "causal", backend, B, T, H, L, D, seconds, flops(mechanism, T)), flush=True)


if __name__ == "__main__":
    main()
