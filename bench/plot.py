"""Log-log plot of time vs T from a latte-compare CSV: forward rows on the left, forward +
backward rows on the right, each mechanism of latte and each peer one line (solid: latte's C++;
dotted: latte's Python calls, bench/peers/latte_torch.py; dashed: the peers). Rows of one
variant measured for another question (backward alone, bf16 / fp32 pairs, plain vs compensated
sums, packed prefill, serving, decode, unaligned arrays) stay in the CSV and out of the plot."""
import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

VARIANTS = ("decode", "bf16", "fp32", "_plain", "_compensated", "packed", "one_sequence", "serving", "pool_step",
            "_unaligned")


def panel_of(mechanism):
    """0: forward, 1: forward + backward, None: left out."""
    if mechanism == "fma_peak" or any(v in mechanism for v in VARIANTS):
        return None
    if mechanism.endswith("_forward_backward"):
        return 1
    return None if mechanism.endswith("_backward") else 0


def main(path, out):
    series = [defaultdict(list), defaultdict(list)]
    with open(path) as f:
        for row in csv.DictReader(f):
            panel = panel_of(row["mechanism"])
            # latte_torch.py's copy of the latte-cpu rows, and the C++ time inside its Python calls
            if panel is None or row["backend"] == "latte-cpu-ref" or row["backend"].endswith("-kernel"):
                continue
            name = row["mechanism"].removesuffix("_forward_backward")
            label = f'{name} ({row["direction"]}, {row["backend"]})'
            series[panel][label].append((int(row["T"]), float(row["seconds"])))
    fig, axes = plt.subplots(1, 2, figsize=(15, 7))
    for ax, lines, title in zip(axes, series, ("forward", "forward + backward")):
        for label, points in sorted(lines.items()):
            points.sort()
            xs, ys = zip(*points)
            backend = label[label.rindex(", ") + 2:-1]
            style = "--" if backend in ("torch", "jax", "fla") else \
                ":" if backend in ("latte-torch", "latte-numpy") else "-"
            ax.loglog(xs, ys, style, marker="o", markersize=3, label=label)
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("seconds (B=1, H=8, L=64, D=64, fp32)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6.5, ncol=1, loc="upper left")
    fig.suptitle("latte exec::cpu vs peers, measured side by side on one machine")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
