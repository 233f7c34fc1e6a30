"""The causal Latte scan of paper 000 (Appendix D, Listing 1) with JAX on the GPU.

The functions are bench/peers/jax_scan.py's (the listing as published, and the
same scan on projected inputs); this script only runs them on JAX's default
device (the GPU when jax[cuda] is installed) and labels rows backend jax-<platform>.
fp32, B=1, H=8, L=64, D=64 per head. FLOPs: 4 * B*T*H*L*D.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402

from jax_scan import run  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--t", default="1024,4096,16384,65536")
    parser.add_argument("--min-time", type=float, default=0.3)
    parser.add_argument("--time-cap", type=float, default=30.0)
    args = parser.parse_args()
    platform = jax.devices()[0].platform
    print(f"jax_scan_gpu: devices {jax.devices()}", file=sys.stderr)
    run([int(x) for x in args.t.split(",")], args.min_time, args.time_cap, f"jax-{platform}")


if __name__ == "__main__":
    main()
