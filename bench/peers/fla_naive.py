"""flash-linear-attention's naive_chunk_linear_attn, forward + backward on the CPU.

fla's Triton kernels do not run on a CPU; `fla.ops.linear_attn.naive.naive_chunk_linear_attn`
(chunks of 64 in plain torch) is what a PyTorch user has here. It runs on elu + 1
features with normalize=True and scale=1 (latte's causal LinearAttention<EluPlusOne>,
whose normaliser differs only in its epsilon, 1e-6 vs fla's 1e-10), under autograd:
q, k, v require grad, the features are computed inside the graph, loss =
(out * d_out).sum(), then torch.autograd.grad(loss, (q, k, v)).

Appends `fla_naive_chunk_forward_backward,causal,fla` rows to latte-compare's CSV
(same header): fp32, B=1, H=8, Dk=Dv=64, T a multiple of 64 (others are skipped),
with as many threads as latte uses. FLOPs are 3x latte-compare's linear_elu forward
(backward = 2x forward, as latte-compare counts its *_forward_backward rows).
"""
import torch
import torch.nn.functional as F
from fla.ops.linear_attn.naive import naive_chunk_linear_attn

from peer_common import best_time, csv_row, lengths, parser


def forward_backward(q, k, v, d_out):
    """Causal elu + 1 linear attention through fla's naive chunk form, then its gradients."""
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    query, key, value = leaves
    out = naive_chunk_linear_attn(F.elu(query) + 1, F.elu(key) + 1, value, scale=1.0,
                                  normalize=True)
    return torch.autograd.grad((out * d_out).sum(), leaves)


def main():
    args = parser("1024,4096,16384", time_cap=60.0).parse_args()
    torch.set_num_threads(args.threads)
    B, H, D = 1, 8, 64
    previous = None
    for T in lengths(args.t):
        if T % 64:
            continue  # the naive form splits T into chunks of 64
        if previous and previous[1] * T / previous[0] > args.time_cap:
            continue
        q, k, v, d_out = (torch.randn(B, T, H, D) for _ in range(4))  # fla's [B, T, H, D]
        seconds = best_time(lambda: forward_backward(q, k, v, d_out), args.min_time)
        previous = (T, seconds)
        flops = 3 * float(B) * T * H * (4.0 * D * D + 3.0 * D)
        print(csv_row("fla_naive_chunk_forward_backward", "causal", "fla", B, T, H, D, D, seconds,
                      flops), flush=True)


if __name__ == "__main__":
    main()
