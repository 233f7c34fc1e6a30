"""Heat maps and a target check from a latte-sweep CSV (scripts/shape-sweep.sh).

    python bench/plot_sweep.py SWEEP.csv ROOFLINE.png PEAK.png SUMMARY.txt

ROOFLINE.png: one panel per mechanism + direction (rows) and type (columns); a cell
per shape measured, x the (L, D) pairs, y the (B, H, T) combinations present; the
colour and the number are the shape's GFLOP/s as a % of its own roofline limit
(the CSV's roofline_gflops: min(FMA peak, flops / min_bytes * memory bandwidth)).
Shapes not measured stay blank. PEAK.png: the same as a % of the type's FMA peak.

SUMMARY.txt: the machine rows, per mechanism and type the worst shape by % of
roofline among the shapes with B*H >= threads (the CSV's `threads` row; 2 if it
has none), and two targets, met or not met with the worst shape named:
  A: every shape with B*H >= threads reaches >= 50 % of its roofline limit;
  B: no shape whose L or D is not a power of two runs below 70 % of the GFLOP/s
     of its nearest neighbour with power-of-two L and D (same mechanism,
     direction, type, B, H, T; L = 63 -> 64, D = 65 -> 64; cosFormer's L column
     is E = 2L: 126 -> 128), among the shapes whose neighbour was measured.
Needs matplotlib and NumPy.
"""
import csv
import math
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

MACHINE = {"threads", "fma_peak", "fma_peak_fp64", "memory_bandwidth"}
TARGET_A = 50.0  # % of the roofline limit
TARGET_B = 0.70  # of the power-of-two neighbour's GFLOP/s
DTYPES = ["fp32", "fp64"]


def read(path):
    machine, shapes = {}, {}
    with open(path) as f:
        for row in csv.DictReader(f):
            if row["mechanism"] in MACHINE:
                machine[row["mechanism"]] = float(row["gflops"])
                continue
            key = (row["mechanism"], row["direction"], row["dtype"],
                   int(row["B"]), int(row["H"]), int(row["T"]), int(row["L"]), int(row["D"]))
            shape = {
                "gflops": float(row["gflops"]),
                "roofline": float(row["roofline_gflops"]),
                "seconds": float(row["seconds"]),
            }
            if key not in shapes or shape["gflops"] > shapes[key]["gflops"]:
                shapes[key] = shape  # a shape measured twice keeps its best
    peaks = {"fp32": machine.get("fma_peak", 0.0), "fp64": machine.get("fma_peak_fp64", 0.0)}
    for (_, _, dtype, *_), shape in shapes.items():
        shape["of_roofline"] = 100.0 * shape["gflops"] / shape["roofline"] if shape["roofline"] else float("nan")
        shape["of_peak"] = 100.0 * shape["gflops"] / peaks[dtype] if peaks.get(dtype) else float("nan")
    return machine, shapes


def t_label(T):
    return f"{T // 1024}K" if T % 1024 == 0 else str(T)


def shape_name(key):
    _, _, _, B, H, T, L, D = key
    return f"B{B} H{H} T{t_label(T)} L{L} D{D}"


def pair_name(key):
    mechanism, direction, dtype = key[:3]
    return f"{mechanism} {direction} {dtype}"


def panels(shapes):
    """(mechanism, direction) in the order first met, each with its shapes per dtype."""
    order, grouped = [], defaultdict(dict)
    for key, shape in shapes.items():
        md = key[:2]
        if md not in order:
            order.append(md)
        grouped[(md, key[2])][key[3:]] = shape  # (B, H, T, L, D) -> shape
    return order, grouped


def heat_maps(shapes, metric, title, out):
    order, grouped = panels(shapes)
    if not order:
        raise SystemExit("plot_sweep.py: no measured rows in the CSV")
    axes_of = {}
    heights = []
    for md in order:
        # both types of a mechanism on the same axes: the union of their shapes
        cells = [key for dtype in DTYPES for key in grouped.get((md, dtype), {})]
        ys = sorted({(B, H, T) for B, H, T, _, _ in cells})
        xs = sorted({(L, D) for _, _, _, L, D in cells})
        for dtype in DTYPES:
            axes_of[(md, dtype)] = (xs, ys)
        heights.append(max(len(ys), 1))
    max_x = max(len(axes_of[(md, DTYPES[0])][0]) for md in order)
    width = 2 * (0.42 * max(max_x, 4) + 1.4)
    height = sum(0.2 * h + 1.0 for h in heights)
    fig, axes = plt.subplots(len(order), len(DTYPES), figsize=(width, height), squeeze=False,
                             gridspec_kw={"height_ratios": [h + 5 for h in heights]})
    cmap = plt.get_cmap("RdYlGn").copy()
    cmap.set_bad("white")
    image = None
    for i, md in enumerate(order):
        for j, dtype in enumerate(DTYPES):
            ax = axes[i][j]
            cells = grouped.get((md, dtype), {})
            xs, ys = axes_of[(md, dtype)]
            ax.set_title(f"{md[0]} {md[1]}, {dtype}", fontsize=8)
            if not cells:
                ax.axis("off")
                continue
            grid = np.full((len(ys), len(xs)), np.nan)
            for (B, H, T, L, D), shape in cells.items():
                grid[ys.index((B, H, T)), xs.index((L, D))] = shape[metric]
            image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=100,
                              aspect="auto", interpolation="nearest")
            for r in range(len(ys)):
                for c in range(len(xs)):
                    if not math.isnan(grid[r, c]):
                        ax.text(c, r, f"{grid[r, c]:.0f}", ha="center", va="center", fontsize=5)
            ax.set_xticks(range(len(xs)))
            ax.set_xticklabels([f"L{L}\nD{D}" for L, D in xs], fontsize=5)
            ax.set_yticks(range(len(ys)))
            ax.set_yticklabels([f"B{B} H{H} T{t_label(T)}" for B, H, T in ys], fontsize=5)
            ax.tick_params(length=0)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.93, 1 - 0.5 / height))  # room for the two-line title
    if image is not None:
        bar = fig.add_axes((0.945, 0.3, 0.012, 0.4))
        fig.colorbar(image, cax=bar).ax.tick_params(labelsize=6)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    print(f"wrote {out}")


def nearest_power_of_two(n):
    low = 1 << (n.bit_length() - 1)
    high = low * 2
    return low if n - low < high - n else high


def summary(machine, shapes, path, out):
    threads = int(machine.get("threads", 2))
    lines = [f"shape sweep summary of {path}",
             f"machine: {threads} threads, FMA peak {machine.get('fma_peak', 0):.1f} GFLOP/s fp32, "
             f"{machine.get('fma_peak_fp64', 0):.1f} GFLOP/s fp64, memory bandwidth "
             f"{machine.get('memory_bandwidth', 0):.1f} GB/s",
             f"rows: {len(shapes)} measured, "
             f"{sum(1 for k in shapes if k[3] * k[4] >= threads)} with B*H >= {threads}", ""]

    pairs = []
    for key in shapes:
        if key[:3] not in pairs:
            pairs.append(key[:3])

    # worst shape by % of roofline, B*H >= threads; target A
    lines.append(f"worst shape by % of its roofline limit (B*H >= {threads}), per mechanism and type:")
    a_lines, a_all_below, a_count, a_worst = [], 0, 0, None
    for pair in pairs:
        own = [(k, s) for k, s in shapes.items() if k[:3] == pair and k[3] * k[4] >= threads]
        if not own:
            lines.append(f"  {pair_name(pair + (0,) * 5):34s} no shape with B*H >= {threads}")
            continue
        k, s = min(own, key=lambda item: item[1]["of_roofline"])
        median = float(np.median([x["of_roofline"] for _, x in own]))
        lines.append(f"  {pair_name(k):34s} {shape_name(k):26s} {s['of_roofline']:5.1f} % "
                     f"({s['gflops']:.1f} of {s['roofline']:.1f} GFLOP/s; {len(own)} shapes, "
                     f"median {median:.0f} %)")
        below = [x for x in own if x[1]["of_roofline"] < TARGET_A]
        a_all_below += len(below)
        a_count += len(own)
        if a_worst is None or s["of_roofline"] < a_worst[1]["of_roofline"]:
            a_worst = (k, s)
        verdict = "met" if not below else f"NOT MET ({len(below)} of {len(own)} shapes below)"
        a_lines.append(f"  {pair_name(k):34s} {verdict}; worst {shape_name(k)} at "
                       f"{s['of_roofline']:.1f} %")
    lines.append("")
    if a_worst is None:
        lines.append(f"target A: no shape with B*H >= {threads} measured")
    else:
        verdict = "met" if a_all_below == 0 else f"NOT MET ({a_all_below} of {a_count} shapes below)"
        lines.append(f"target A (every shape with B*H >= {threads} reaches >= {TARGET_A:.0f} % of "
                     f"its roofline limit): {verdict}; worst {pair_name(a_worst[0])} "
                     f"{shape_name(a_worst[0])} at {a_worst[1]['of_roofline']:.1f} %")
    lines += a_lines
    lines.append("")

    # target B: non-power-of-two L or D against the power-of-two neighbour
    compared, missing = defaultdict(list), 0
    for key, shape in shapes.items():
        mechanism, direction, dtype, B, H, T, L, D = key
        L2, D2 = nearest_power_of_two(L), nearest_power_of_two(D)
        if (L2, D2) == (L, D):
            continue
        neighbour = shapes.get((mechanism, direction, dtype, B, H, T, L2, D2))
        if neighbour is None:
            missing += 1
            continue
        compared[key[:3]].append((key, shape["gflops"] / neighbour["gflops"], (L2, D2)))
    every = [c for pair in pairs for c in compared.get(pair, [])]
    if not every:
        lines.append("target B: no shape with a non-power-of-two L or D next to a measured neighbour")
    else:
        below = [c for c in every if c[1] < TARGET_B]
        worst = min(every, key=lambda c: c[1])
        verdict = "met" if not below else f"NOT MET ({len(below)} of {len(every)} shapes below)"
        lines.append(f"target B (no shape with a non-power-of-two L or D below {TARGET_B:.0%} of the "
                     f"GFLOP/s of its power-of-two neighbour; {len(every)} compared, {missing} without "
                     f"a measured neighbour): {verdict}; worst {pair_name(worst[0])} "
                     f"{shape_name(worst[0])} at {worst[1]:.2f}x of L{worst[2][0]} D{worst[2][1]}")
        for pair in pairs:
            own = compared.get(pair)
            if not own:
                continue
            k, ratio, (L2, D2) = min(own, key=lambda c: c[1])
            n_below = sum(1 for c in own if c[1] < TARGET_B)
            verdict = "met" if n_below == 0 else f"NOT MET ({n_below} of {len(own)} shapes below)"
            lines.append(f"  {pair_name(k):34s} {verdict}; worst {shape_name(k)} at {ratio:.2f}x "
                         f"of L{L2} D{D2}")
        if below:
            lines.append("  every shape below the target:")
            for k, ratio, (L2, D2) in sorted(below, key=lambda c: c[1]):
                lines.append(f"    {pair_name(k):34s} {shape_name(k):26s} {ratio:.2f}x of L{L2} D{D2}")
    text = "\n".join(lines) + "\n"
    with open(out, "w") as f:
        f.write(text)
    print(text, end="")
    print(f"wrote {out}")


def main(path, roofline_png, peak_png, summary_txt):
    machine, shapes = read(path)
    heat_maps(shapes, "of_roofline",
              "latte-sweep: GFLOP/s as % of each shape's roofline limit\n"
              "min(FMA peak, flops / min_bytes x memory bandwidth); blank: not measured",
              roofline_png)
    heat_maps(shapes, "of_peak", "latte-sweep: GFLOP/s as % of the type's FMA peak\nblank: not measured",
              peak_png)
    summary(machine, shapes, path, summary_txt)


if __name__ == "__main__":
    if len(sys.argv) != 5:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
