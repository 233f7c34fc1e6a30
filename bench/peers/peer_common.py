"""What the CPU peers share: their command line, best-of timing and latte-compare's CSV row.

latte-compare's CSV (bench/latte_compare.cpp) has the header
    mechanism,direction,backend,B,T,H,L,D,seconds,tokens_per_s,gflops,extra_bytes
and the peers append rows to it: `seconds` is the best of the repeats, `gflops` the
row's FLOP count (latte-compare's formulas; forward + backward rows count 3x the
forward, as latte-compare's *_forward_backward rows do) over that time, and
`extra_bytes` -1 (not measured).
"""
import argparse
import os
import time


def parser(default_t, time_cap, threads=True):
    """An argument parser with the options every peer takes: --t (comma-separated
    lengths), --min-time, --time-cap and, for the torch peers, --threads."""
    result = argparse.ArgumentParser()
    result.add_argument("--t", default=default_t, help="comma-separated sequence lengths")
    result.add_argument("--min-time", type=float, default=0.3,
                        help="repeat a run until this many seconds were spent (best of the repeats)")
    result.add_argument("--time-cap", type=float, default=time_cap,
                        help="skip a run its previous length predicts to take longer (seconds)")
    if threads:
        result.add_argument("--threads", type=int, default=os.cpu_count(),
                            help="torch.set_num_threads: as many as latte uses")
    return result


def lengths(text):
    return [int(x) for x in text.split(",")]


def best_time(fn, min_time, max_runs=20, wait=lambda result: result):
    """Best wall time of fn() after a warm-up call: at least two timed runs, more
    until min_time is spent (at most max_runs), one only past 2 s. `wait` blocks on
    an asynchronous result (jax.block_until_ready)."""
    wait(fn())  # warm-up (and compilation)
    best, spent, runs = float("inf"), 0.0, 0
    while runs < 2 or (spent < min_time and runs < max_runs):
        start = time.perf_counter()
        wait(fn())
        elapsed = time.perf_counter() - start
        best, spent, runs = min(best, elapsed), spent + elapsed, runs + 1
        if elapsed > 2.0:
            break
    return best


def csv_row(mechanism, direction, backend, B, T, H, L, D, seconds, flops):
    """One latte-compare CSV row (no trailing newline)."""
    return (f"{mechanism},{direction},{backend},{B},{T},{H},{L},{D},{seconds:.6e},"
            f"{B * T / seconds:.6e},{flops / seconds / 1e9:.3f},-1")
