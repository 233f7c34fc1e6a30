"""PyTorch scaled_dot_product_attention on the CPU, the shapes latte-compare uses.

Appends rows to latte-compare's CSV (same header): causal SDPA and sliding-window
SDPA (window 128 on the left, as a boolean mask), fp32, B=1, H=8, D=64, with as
many threads as latte uses. FLOPs use latte-compare's formulas.

`sdpa_forward_backward` is causal SDPA's forward and backward under autograd, what
training costs a PyTorch user: q, k, v require grad, loss = (out * d_out).sum(),
then torch.autograd.grad(loss, (q, k, v)). Its FLOPs are 3x the forward's, as
latte-compare counts its `*_forward_backward` rows (backward = 2x forward).
"""
import argparse
import os
import time

import torch
import torch.nn.functional as F


def best_time(fn, min_time):
    fn()  # warm-up
    best, spent, runs = float("inf"), 0.0, 0
    while runs < 2 or (spent < min_time and runs < 20):
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        best, spent, runs = min(best, elapsed), spent + elapsed, runs + 1
        if elapsed > 2.0:
            break
    return best


def forward_backward(q, k, v, d_out):
    """Causal SDPA forward, then the gradients of (out * d_out).sum() w.r.t. q, k, v."""
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    return torch.autograd.grad((out * d_out).sum(), leaves)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--t", default="256,1024,4096,16384,65536")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--time-cap", type=float, default=20.0)
    parser.add_argument("--min-time", type=float, default=0.3)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--backward-time-cap", type=float, default=600.0,
                        help="time cap of sdpa_forward_backward (issue 22 asks for it at 64K)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    B, H, D = 1, 8, 64
    previous = {}
    for T in [int(x) for x in args.t.split(",")]:
        q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
        cases = [("sdpa", 2.0 * B * H * (T * (T + 1) / 2) * (2 * D),
                  lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))]
        if T <= 16384:  # the boolean T x T mask itself grows quadratically
            i = torch.arange(T)
            mask = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - args.window)
            terms = sum(min(t + 1, args.window + 1) for t in range(T))
            cases.append(("sdpa_window%d" % args.window, 2.0 * B * H * terms * (2 * D),
                          lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)))
        causal_flops = cases[0][1]
        d_out = torch.randn(B, H, T, D)
        cases.append(("sdpa_forward_backward", 3 * causal_flops,
                      lambda: forward_backward(q, k, v, d_out)))
        for name, flops, fn in cases:
            if name in previous:
                last_t, last_s = previous[name]
                cap = args.backward_time_cap if name.endswith("forward_backward") else args.time_cap
                if last_s * (T / last_t) ** 2 > cap:
                    continue
            if name.endswith("forward_backward"):
                seconds = best_time(fn, args.min_time)
            else:
                with torch.inference_mode():
                    seconds = best_time(fn, args.min_time)
            previous[name] = (T, seconds)
            print(f"{name},causal,torch,{B},{T},{H},0,{D},{seconds:.6e},{B * T / seconds:.6e},"
                  f"{flops / seconds / 1e9:.3f},-1", flush=True)


if __name__ == "__main__":
    main()
