"""flash-linear-attention's naive CPU paths, forward and forward + backward.

fla's Triton kernels do not run on a CPU; its naive forms in plain torch are what a
PyTorch user has here:

  fla_naive_chunk           `fla.ops.linear_attn.naive.naive_chunk_linear_attn` (chunks of
                            64) on elu + 1 features with normalize=True and scale=1: latte's
                            causal LinearAttention<EluPlusOne>, whose normaliser differs only
                            in its epsilon (1e-6 vs fla's 1e-10).
  fla_naive_recurrent_gsa   `fla.ops.gsa.naive.naive_recurrent_gsa`, gated slot attention with
                            64 slots and no gate (g=None: fla then normalises each slot by the
                            running softmax over time of its logits s, ABC's form), Latte's
                            closest relative in fla: two Latte passes, the first reading the
                            keys into the slots, whose readout scale q_t . h_t (scale
                            1/sqrt(Dk)) are the second's query logits: out = Latte(ok, s, v).
                            A Python loop over the tokens; under autograd each step's indexing
                            backward writes a gradient as large as the sequence, so its
                            forward + backward grows as T^2.

Each once forward (under torch.inference_mode) and once forward + backward under autograd:
the inputs (q, k, v; and the slot logits s) require grad, elu + 1 is computed inside the
graph, loss = (out * d_out).sum(), then torch.autograd.grad(loss, leaves).

Before any timing, each forward is checked against latte's (float32, --check-t tokens, max
|diff| <= 1e-5 x max(1, max |out|)): fla_naive_chunk against latte.LinearAttention (elu + 1),
fla_naive_recurrent_gsa against two latte.LatteAttention passes (float64): the first with
one-hot query logits per slot (the batch holds one slot each: slot m's read of the keys
h_t[:, m]), the second with ok = scale q_t . h_t, key logits s and values v.

Appends `<row>` and `<row>_forward_backward` rows (`causal,fla`) to latte-compare's CSV (same
header): fp32, B=1, H=8, Dk=Dv=64 (64 slots in the L column of the GSA rows), with as many
threads as latte uses; fla_naive_chunk only at multiples of 64. FLOPs: fla_naive_chunk
latte-compare's linear_elu forward; GSA two of latte-compare's Latte forwards (8 B T H M D);
x3 with the backward (as latte-compare counts its *_forward_backward rows). A run its
previous length predicts past --time-cap is skipped (GSA's forward + backward predicted as T^2);
one predicted past --once-past (default: never) is timed as a single call with no warm-up (GSA's
forward + backward at 16K: one call takes over 17 minutes, and warm-up plus a timed call did not
fit a 34-minute run). Its stderr line says so.
"""
import time
import sys

import latte
import numpy as np
import torch
import torch.nn.functional as F
from fla.ops.gsa.naive import naive_recurrent_gsa
from fla.ops.linear_attn.naive import naive_chunk_linear_attn

from peer_common import best_time, csv_row, lengths, parser

B, H, D, SLOTS = 1, 8, 64, 64


def chunk(q, k, v):
    """Causal elu + 1 linear attention through fla's naive chunk form."""
    return naive_chunk_linear_attn(F.elu(q) + 1, F.elu(k) + 1, v, scale=1.0, normalize=True)


def gsa(q, k, v, s):
    """fla's naive recurrent GSA without a gate (default scale 1/sqrt(Dk))."""
    return naive_recurrent_gsa(q, k, v, s)[0]


def chunk_by_latte(q, k, v):
    return latte.LinearAttention(H, D, D, causal=True, feature_map="elu_plus_one").forward(q, k, v)


def gsa_by_latte(q, k, v, s):
    """GSA without a gate as two Latte passes, in float64 (see the module's docstring)."""
    q, k, v, s = (x.astype(np.float64) for x in (q, k, v, s))
    T, M = s.shape[1], s.shape[3]
    one_hot = np.full((M, T, H, M), -np.inf)
    one_hot[np.arange(M), :, :, np.arange(M)] = 0.0
    slots = latte.LatteAttention(H, M, D, causal=True).forward(
        one_hot, np.broadcast_to(s, (M, T, H, M)), np.broadcast_to(k, (M, T, H, D)))  # [M, T, H, Dk]
    ok = np.ascontiguousarray(np.einsum("thk,mthk->thm", q[0], slots)[None]) / np.sqrt(D)
    return latte.LatteAttention(H, M, D, causal=True).forward(ok, s, v)


ROWS = (  # (row, fla's function, latte's, the inputs' last dimensions, forward FLOPs per token)
    ("fla_naive_chunk", chunk, chunk_by_latte, (D, D, D), B * H * (4.0 * D * D + 3.0 * D)),
    ("fla_naive_recurrent_gsa", gsa, gsa_by_latte, (D, D, D, SLOTS), 8.0 * B * H * SLOTS * D),
)


def forward_backward(function, inputs, d_out):
    """function's forward, then the gradients of (out * d_out).sum() with respect to its inputs."""
    leaves = [x.detach().requires_grad_(True) for x in inputs]
    return torch.autograd.grad((function(*leaves) * d_out).sum(), leaves)


def check(T):
    """Each forward against latte's at T tokens (float32); exits on a mismatch."""
    generator = torch.Generator().manual_seed(1)
    for name, function, reference, dims, _ in ROWS:
        inputs = [torch.randn(B, T, H, d, generator=generator) for d in dims]
        with torch.inference_mode():
            ours = function(*inputs).double().numpy()
        theirs = reference(*(x.numpy() for x in inputs))
        error, scale = np.abs(ours - theirs).max(), np.abs(theirs).max()
        bound = 1e-5 * max(1.0, scale)
        print(f"# check {name} T={T}: max |fla - latte| = {error:.3e} (max |out| {scale:.3f}, bound "
              f"{bound:.1e}) {'ok' if error <= bound else 'MISMATCH'}", file=sys.stderr, flush=True)
        if error > bound:
            sys.exit(f"fla_naive.py: fla's {name} does not match latte's forward; nothing timed")


def main():
    arguments = parser("1024,4096,16384", time_cap=60.0)
    arguments.add_argument("--check-t", type=int, default=512, help="length of the check (a multiple of 64)")
    arguments.add_argument("--once-past", type=float, default=float("inf"),
                           help="time a run predicted past this many seconds as one call, no warm-up")
    args = arguments.parse_args()
    torch.set_num_threads(args.threads)
    check(args.check_t)
    previous = {}  # row -> (T, seconds)
    for T in lengths(args.t):
        for name, function, _, dims, token_flops in ROWS:
            if name == "fla_naive_chunk" and T % 64:
                continue  # the naive chunk form splits T into chunks of 64
            inputs = [torch.randn(B, T, H, d) for d in dims]  # fla's [B, T, H, D]
            d_out = torch.randn(B, T, H, D)
            for row, flops in ((name, token_flops * T), (name + "_forward_backward", 3 * token_flops * T)):
                growth = 2 if row == "fla_naive_recurrent_gsa_forward_backward" else 1
                predicted = previous[row][1] * (T / previous[row][0]) ** growth if row in previous else 0.0
                if predicted > args.time_cap:
                    print(f"# {row} T={T} skipped (predicted past --time-cap)", file=sys.stderr)
                    continue
                if predicted > args.once_past:
                    print(f"# {row} T={T}: one call, no warm-up (predicted {predicted:.0f} s)", file=sys.stderr,
                          flush=True)
                    start = time.perf_counter()
                    if row == name:
                        with torch.inference_mode():
                            function(*inputs)
                    else:
                        forward_backward(function, inputs, d_out)
                    seconds = time.perf_counter() - start
                elif row == name:
                    with torch.inference_mode():
                        seconds = best_time(lambda: function(*inputs), args.min_time)
                else:
                    seconds = best_time(lambda: forward_backward(function, inputs, d_out), args.min_time)
                previous[row] = (T, seconds)
                print(csv_row(row, "causal", "fla", B, T, H, dims[-1], D, seconds, flops), flush=True)


if __name__ == "__main__":
    main()
