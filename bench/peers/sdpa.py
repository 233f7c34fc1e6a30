"""PyTorch scaled_dot_product_attention on the CPU, the shapes latte-compare uses.

Appends rows to latte-compare's CSV (same header): causal SDPA and sliding-window
SDPA (window 128 on the left, as a boolean mask), fp32, B=1, H=8, D=64, with as
many threads as latte uses. FLOPs use latte-compare's formulas.

`sdpa_forward_backward` is causal SDPA's forward and backward under autograd, what
training costs a PyTorch user: q, k, v require grad, loss = (out * d_out).sum(),
then torch.autograd.grad(loss, (q, k, v)). Its FLOPs are 3x the forward's, as
latte-compare counts its `*_forward_backward` rows (backward = 2x forward).
"""
import torch
import torch.nn.functional as F

from peer_common import best_time, csv_row, lengths, parser


def forward_backward(q, k, v, d_out):
    """Causal SDPA forward, then the gradients of (out * d_out).sum() w.r.t. q, k, v."""
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    return torch.autograd.grad((out * d_out).sum(), leaves)


def main():
    arguments = parser("256,1024,4096,16384,65536", time_cap=20.0)
    arguments.add_argument("--window", type=int, default=128)
    arguments.add_argument("--backward-time-cap", type=float, default=600.0,
                           help="time cap of sdpa_forward_backward (issue 22 asks for it at 64K)")
    args = arguments.parse_args()
    torch.set_num_threads(args.threads)
    B, H, D = 1, 8, 64
    previous = {}
    for T in lengths(args.t):
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
            print(csv_row(name, "causal", "torch", B, T, H, 0, D, seconds, flops), flush=True)


if __name__ == "__main__":
    main()
