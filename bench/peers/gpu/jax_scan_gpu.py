"""The causal Latte scan of paper 000 (Appendix D, Listing 1) with JAX on the GPU.

The functions are bench/peers/jax_scan.py's (the listing as published, and the
same scan on projected inputs); this script only runs them on JAX's default
device (the GPU when jax[cuda] is installed) and labels rows backend jax-<platform>.
fp32, B=1, H=8, L=64, D=64 per head. FLOPs: 4 * B*T*H*L*D.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402

from jax_scan import causal_latte, causal_latte_core  # noqa: E402


def best_time(fn, min_time):
    jax.block_until_ready(fn())  # compile + warm-up
    best, spent, runs = float("inf"), 0.0, 0
    while runs < 2 or (spent < min_time and runs < 10):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        elapsed = time.perf_counter() - start
        best, spent, runs = min(best, elapsed), spent + elapsed, runs + 1
        if elapsed > 2.0:
            break
    return best


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--t", default="1024,4096,16384,65536")
    parser.add_argument("--min-time", type=float, default=0.3)
    parser.add_argument("--time-cap", type=float, default=30.0)
    args = parser.parse_args()
    platform = jax.devices()[0].platform
    print(f"jax_scan_gpu: devices {jax.devices()}", file=sys.stderr)
    B, H, L, D = 1, 8, 64, 64
    key = jax.random.PRNGKey(0)
    previous = {}
    for T in [int(x) for x in args.t.split(",")]:
        ks = jax.random.split(key, 7)
        X = jax.random.normal(ks[0], (B, T, H * D))
        Wq, Wk = (jax.random.normal(k, (H * D, H * L)) / (H * D) ** 0.5 for k in ks[1:3])
        Wv = jax.random.normal(ks[3], (H * D, H * D)) / (H * D) ** 0.5
        Q, K = (jax.random.normal(k, (T, B, H, L)) for k in ks[4:6])
        V = jax.random.normal(ks[6], (T, B, H, D))
        flops = 4.0 * B * T * H * L * D
        for name, fn in (("jax_scan_core", lambda: causal_latte_core(Q, K, V)),
                         ("jax_scan_listing1", lambda: causal_latte(Wq, Wk, Wv, H, X))):
            if name in previous and previous[name][1] * T / previous[name][0] > args.time_cap:
                continue
            seconds = best_time(fn, args.min_time)
            previous[name] = (T, seconds)
            print(f"{name},causal,jax-{platform},{B},{T},{H},{L},{D},{seconds:.6e},"
                  f"{B * T / seconds:.6e},{flops / seconds / 1e9:.3f},-1", flush=True)


if __name__ == "__main__":
    main()
