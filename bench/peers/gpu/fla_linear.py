"""flash-linear-attention (fla) peer: chunk_linear_attn and fused_recurrent_linear_attn.

fla is pure Python + Triton. The GPU machine has no network: `scripts/gpu-check.sh
--pack-deps` downloads its wheels (flash-linear-attention and fla-core) into
build-gpu-deps/wheels/ here; scripts/gpu-check.sh installs them there with
`pip install --no-deps --no-index --target <dir>` and puts <dir> on PYTHONPATH.
Without them this script says so and exits 0.

Shapes: fla's benchmark shapes (B, T, H, D) = (4,2048,16,128), (2,16384,16,128),
(8,1024,8,64); bf16; rows as latte-compare's CSV, mechanism fla_chunk_linear /
fla_fused_recurrent_linear, L = D (the key features). FLOPs of causal linear
attention (chunked or recurrent, state D x D per head): 4 * B*T*H*D*D.
"""
import argparse
import sys

import torch


def time_cuda(fn):
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    batches = []
    for _ in range(5):
        start.record()
        for _ in range(10):
            fn()
        stop.record()
        stop.synchronize()
        batches.append(start.elapsed_time(stop) / 1e3 / 10)
    return sorted(batches)[2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4x2048x16x128,2x16384x16x128,8x1024x8x64")
    args = parser.parse_args()
    try:
        from fla.ops.linear_attn import chunk_linear_attn, fused_recurrent_linear_attn
    except Exception as error:
        print(f"fla_linear: flash-linear-attention not importable ({error}); place its wheel "
              "next to bench/peers/gpu/fla_linear.py", file=sys.stderr)
        return 0
    for shape in args.shapes.split(","):
        B, T, H, D = (int(x) for x in shape.split("x"))
        q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4.0 * B * T * H * D * D
        for name, fn in (("fla_chunk_linear", chunk_linear_attn),
                         ("fla_fused_recurrent_linear", fused_recurrent_linear_attn)):
            try:
                # fla changed layouts across versions: [B, T, H, D] with head_first=False
                # (newer), or [B, H, T, D] without that keyword (older).
                run = lambda fn=fn: fn(q, k, v, head_first=False)  # noqa: E731
                try:
                    run()
                except TypeError:
                    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
                    run = lambda fn=fn, qt=qt, kt=kt, vt=vt: fn(qt, kt, vt)  # noqa: E731
                with torch.inference_mode():
                    seconds = time_cuda(run)
            except Exception as error:
                print(f"fla_linear: {name} {shape}: {error}", file=sys.stderr)
                continue
            print(f"{name},causal,fla-cuda-bf16,{B},{T},{H},{D},{D},{seconds:.6e},"
                  f"{B * T / seconds:.6e},{flops / seconds / 1e9:.3f},-1", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
