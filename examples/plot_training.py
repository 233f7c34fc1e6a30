"""Training curves of examples/train_lm and examples/python/train_mqar.py: eval
accuracy and eval loss per step.

    python examples/plot_training.py [--title TEXT] OUT.png RUN.csv [RUN.csv ...]

Each CSV is what `train_lm --csv` or `train_mqar.py --csv` writes (attention, step,
seconds, train_loss, eval_loss, eval_accuracy); one line per run, labelled by its
attention column and its last `seconds`. Needs matplotlib.
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read(path):
    with open(path) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        sys.exit(f"{path}: no rows")
    label = rows[0]["attention"]
    column = lambda name: [float(row[name]) for row in rows]  # noqa: E731
    return label, column("step"), column("eval_accuracy"), column("eval_loss"), column("seconds")[-1]


def main(out, paths, title="multi-query associative recall, examples/train_lm"):
    fig, (accuracy, loss) = plt.subplots(1, 2, figsize=(10, 4))
    for path in paths:
        label, steps, acc, eval_loss, seconds = read(path)
        name = f"{label} ({seconds:.0f} s)"
        accuracy.plot(steps, [100 * a for a in acc], marker="o", markersize=2, label=name)
        loss.plot(steps, eval_loss, marker="o", markersize=2, label=name)
    accuracy.set_ylabel("eval accuracy (%)")
    loss.set_ylabel("eval cross-entropy")
    loss.set_yscale("log")
    for ax in (accuracy, loss):
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    args = sys.argv[1:]
    options = {"title": args[1]} if args[:1] == ["--title"] and len(args) > 1 else {}
    args = args[2:] if options else args
    if len(args) < 2:
        sys.exit(__doc__)
    main(args[0], args[1:], **options)
