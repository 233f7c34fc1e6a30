"""Ratios from scripts/gpu-check.sh's CSV (latte-compare's header).

  python3 bench/peers/gpu/summary_gpu.py results.csv

Prints, for each T: causal Latte (latte-cuda-bf16) vs PyTorch SDPA causal bf16
(flash and cuDNN backends; ratio = SDPA seconds / Latte seconds, > 1 means Latte
is faster), the crossover T, the paper's JAX scan vs Latte, Latte's achieved
TFLOP/s, and fla's linear attention rows with latte's linear-attention CUDA
rows when there are any. Formulas (multiply-add = 2):
  latte causal:    4 * B*T*H*L*D
  softmax causal:  2 * B*H*T*(T+1)/2 * (Dk+Dv)
  linear causal:   4 * B*T*H*D*D
"""
import csv
import sys


def main():
    path = sys.argv[1]
    rows = []
    with open(path) as f:
        for row in csv.DictReader(f):
            if row.get("mechanism") in (None, "mechanism"):
                continue
            try:
                row["T"], row["seconds"] = int(row["T"]), float(row["seconds"])
                row["gflops"] = float(row["gflops"])
            except (KeyError, ValueError):
                continue
            rows.append(row)

    def pick(mechanism, backend, direction="causal"):
        return {r["T"]: r for r in rows if r["mechanism"] == mechanism
                and r["backend"] == backend and r["direction"] == direction}

    print("FLOPs (multiply-add = 2): latte causal 4*B*T*H*L*D; softmax causal "
          "2*B*H*T*(T+1)/2*(Dk+Dv); linear causal 4*B*T*H*D*D")
    latte = pick("latte", "latte-cuda-bf16")
    if not latte:
        print("no latte-cuda-bf16 rows (latte-cuda-bench did not run?)")
    for peer in ("sdpa_flash", "sdpa_cudnn"):
        sdpa = pick(peer, "torch-cuda-bf16")
        if not latte or not sdpa:
            print(f"\n{peer}: no rows to compare")
            continue
        print(f"\ncausal Latte bf16 (B=1,H=8,L=64,D=64) vs {peer} causal bf16 (B=1,H=8,D=64)")
        print(f"{'T':>8} {'latte s':>12} {'sdpa s':>12} {'sdpa/latte':>11} {'latte TFLOP/s':>14}")
        crossover = None
        for T in sorted(set(latte) & set(sdpa)):
            ratio = sdpa[T]["seconds"] / latte[T]["seconds"]
            if ratio > 1 and crossover is None:
                crossover = T
            print(f"{T:>8} {latte[T]['seconds']:>12.4e} {sdpa[T]['seconds']:>12.4e} "
                  f"{ratio:>10.2f}x {latte[T]['gflops'] / 1e3:>14.3f}")
        print(f"first T where Latte is faster than {peer}: {crossover}")
    for scan in ("jax_scan_core", "jax_scan_listing1"):
        jax_rows = {r["T"]: r for r in rows if r["mechanism"] == scan and r["backend"].startswith("jax-")}
        common = sorted(set(latte) & set(jax_rows))
        if common:
            print(f"\n{scan} ({jax_rows[common[0]]['backend']}, fp32) / latte-cuda-bf16 seconds: " +
                  ", ".join(f"T={T}: {jax_rows[T]['seconds'] / latte[T]['seconds']:.1f}x" for T in common))
    fla = [r for r in rows if r["backend"].startswith("fla-")]
    linear = [r for r in rows if r["mechanism"].startswith("linear") and r["backend"].startswith("latte-cuda")]
    print()
    if not fla:
        print("fla: no rows (its step did not run, or no wheels: scripts/gpu-check.sh --pack-deps)")
    for r in fla:
        mine = [x for x in linear if (x["B"], x["T"], x["H"], x["D"]) == (r["B"], str(r["T"]), r["H"], r["D"])]
        versus = (f"latte/fla = {r['seconds'] / mine[0]['seconds']:.2f}x" if mine
                  else "no latte CUDA linear-attention row (kernel not in this version)")
        print(f"{r['mechanism']} (B,T,H,D)=({r['B']},{r['T']},{r['H']},{r['D']}): "
              f"{r['seconds']:.4e} s, {r['gflops'] / 1e3:.3f} TFLOP/s; {versus}")


if __name__ == "__main__":
    main()
