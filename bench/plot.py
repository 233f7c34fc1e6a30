"""Log-log plot of time vs T per mechanism and peer from a latte-compare CSV."""
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(path, out):
    series = defaultdict(list)
    with open(path) as f:
        for row in csv.DictReader(f):
            if (row["mechanism"] == "fma_peak" or "decode" in row["mechanism"]
                    or row["backend"] == "latte-cpu-ref"):  # latte_torch.py's copy of latte-cpu rows
                continue
            label = f'{row["mechanism"]} ({row["direction"]}, {row["backend"]})'
            series[label].append((int(row["T"]), float(row["seconds"])))
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for label, points in sorted(series.items()):
        points.sort()
        xs, ys = zip(*points)
        backend = label[label.rindex(", ") + 2:-1]
        # dashed: the peers; dotted: latte's Python calls (bench/peers/latte_torch.py); solid: latte's C++
        style = "--" if backend in ("torch", "jax", "fla") else \
            ":" if backend in ("latte-torch", "latte-numpy") else "-"
        ax.loglog(xs, ys, style, marker="o", markersize=3, label=label)
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("seconds per forward (B=1, H=8, L=64, D=64, fp32)")
    ax.set_title("latte exec::cpu vs peers, measured side by side on one machine")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
