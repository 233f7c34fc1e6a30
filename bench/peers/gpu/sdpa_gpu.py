"""PyTorch scaled_dot_product_attention on the GPU: the causal softmax peer.

Rows in latte-compare's CSV format (mechanism,direction,backend,B,T,H,L,D,...):
mechanism sdpa_flash / sdpa_cudnn / sdpa_efficient, backend torch-cuda-<dtype>,
B=1, H=8, D=64 by default (latte-cuda-bench's shapes). Timed with CUDA events
(median of 5 batches after a warm-up). A backend that cannot run a shape is
reported on stderr and skipped. FLOPs: 2 * B*H*T*(T+1)/2 * (Dk+Dv) (causal).
"""
import argparse
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def time_cuda(fn, time_cap):
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    first = start.elapsed_time(stop) / 1e3
    if first * 3 > time_cap:
        return first
    repeats = max(3, min(200, int(0.05 / max(first, 1e-7))))
    batches = []
    for _ in range(5):
        start.record()
        for _ in range(repeats):
            fn()
        stop.record()
        stop.synchronize()
        batches.append(start.elapsed_time(stop) / 1e3 / repeats)
    return sorted(batches)[2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--t", default="1024,2048,4096,8192,16384,32768,65536")
    parser.add_argument("--b", type=int, default=1)
    parser.add_argument("--h", type=int, default=8)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--dtypes", default="bf16,fp16")
    parser.add_argument("--time-cap", type=float, default=5.0)
    args = parser.parse_args()
    B, H, D = args.b, args.h, args.d
    backends = [("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                ("sdpa_cudnn", getattr(SDPBackend, "CUDNN_ATTENTION", None)),
                ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)]
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    for dtype_name in args.dtypes.split(","):
        dtype = dtypes[dtype_name]
        for T in [int(x) for x in args.t.split(",")]:
            q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=dtype) for _ in range(3))
            flops = 2.0 * B * H * (T * (T + 1) / 2) * (2 * D)
            for name, backend in backends:
                if backend is None:
                    print(f"sdpa_gpu: {name} not in this torch", file=sys.stderr)
                    continue
                try:
                    with sdpa_kernel(backend), torch.inference_mode():
                        seconds = time_cuda(
                            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                            args.time_cap)
                except Exception as error:  # a backend may reject a dtype / shape / GPU
                    print(f"sdpa_gpu: {name} {dtype_name} T={T}: {error}", file=sys.stderr)
                    continue
                print(f"{name},causal,torch-cuda-{dtype_name},{B},{T},{H},0,{D},{seconds:.6e},"
                      f"{B * T / seconds:.6e},{flops / seconds / 1e9:.3f},-1", flush=True)
            del q, k, v
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
