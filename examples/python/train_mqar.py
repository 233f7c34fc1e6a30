"""train_mqar: a two-layer language model whose attention is latte's causal Latte
(``latte.torch``), trained on multi-query associative recall (MQAR, Arora et al.
2023 "Zoology"; paper 001 §5.1 trains Latte on it), against linear attention and
exact softmax attention behind the same model.

    python examples/python/train_mqar.py [--attention latte|linear|sdpa|macchiato] [--steps N] [--tokens T]
        [--pairs K] [--queries Q] [--vocab V] [--batch B] [--lr R] [--dim C] [--heads H]
        [--latents L] [--window W] [--conv W] [--seed S] [--eval-every N] [--eval-sequences N]
        [--threads N] [--csv FILE] [--png FILE]

    # with latte's module on the path (PYTHONPATH=build-py/python, or `pip install .`),
    # what docs/train_mqar_*.csv and docs/train_mqar.png come from:
    for a in sdpa latte linear; do
      python examples/python/train_mqar.py --attention $a --threads 1 --csv docs/train_mqar_$a.csv
    done
    python examples/plot_training.py --title "MQAR: V = 8192, T = 256, 16 pairs (examples/python/train_mqar.py)" \
        docs/train_mqar.png docs/train_mqar_*.csv

The task is examples/python/mqar.py's: for a seed and settings, the same sequences as
examples/train_lm.cpp's. Defaults: V = 8192, T = 256, K = 16 pairs, Q = 32 queries
per sequence, batch 32, 500 steps, learning rate 1e-2, model width C = 64, H = 4
heads, L = 64 latents per head. The model:

    h = E[token]                                        embedding [V, C]
    2 x { x = RMSNorm(h); x = conv(x)                    short causal depthwise conv, width W
          h += W_o attention(W_q x, W_k x, W_v x)         H heads of C / H values
          h += W_2 silu(W_1 RMSNorm(h) + b_1) + b_2 }     MLP, hidden 4C
    logits = RMSNorm(h) E^T                             at the query positions only (head tied to E)
    loss = mean cross-entropy of the recalled values

with attention one of
  latte   ``lt.LatteAttention``: W_q, W_k give the [B, T, H, L] latent logits;
  linear  ``lt.LinearAttention`` (elu + 1 feature map) on [B, T, H, C / H] queries and keys;
  sdpa    ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``, the exact baseline.
The short convolution (paper 000's token mixer; Zoology's models have one too) is
what lets a value's position see its key; ``--conv 0`` leaves it out. Tying the head
to the embedding lets a recalled value's embedding score itself from the first step
(untied, the small task of tests/python/test_mqar.py is learned several times more
slowly). Where latte.torch has ``lt.LatteMacchiato``, ``--attention macchiato`` runs
Latte Macchiato: W_q gives L + 1 logits per head (state 0 a causal sliding window of
``--window`` tokens, RoPE on, with its own query and key projections), W_k L.

AdamW (weight decay 0.1 on the projection, conv and MLP weights), linear warm-up
then cosine decay to a tenth of the rate, gradient clipping at norm 1, as
train_lm.cpp. Query accuracy (argmax) is measured on held-out sequences from the
eval stream every N steps; the CSV has train_lm's columns (attention, step, seconds,
train_loss, eval_loss, eval_accuracy; seconds is training time so far, evaluations
excluded), which examples/plot_training.py draws (``--png`` calls it for the one
run). Seeded; torch's threads from ``--threads`` (latte's own OpenMP kernels follow
OMP_NUM_THREADS). On a machine whose cores are shared with other jobs, one thread
can be much faster than two: a thread descheduled at each op's barrier stalls both.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time

import latte.torch as lt
import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mqar  # noqa: E402

# Macchiato where this latte.torch has it (python/latte/torch.py's lt.LatteMacchiato).
ATTENTIONS = ("latte", "linear", "sdpa") + (("macchiato",) if hasattr(lt, "LatteMacchiato") else ())


def _sdpa(q, k, v):
    """Causal softmax attention on [B, T, H, D] tensors (torch wants [B, H, T, D])."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=True).transpose(1, 2)


class Attention(torch.nn.Module):
    """The token mixer of a block: short causal conv, q/k/v projections, the attention, the output projection."""

    def __init__(self, attention: str, dim: int, heads: int, latents: int, conv: int, window: int = 32):
        super().__init__()
        value_dim, latent = dim // heads, attention in ("latte", "macchiato")
        key_dim = latents if latent else value_dim  # per head: latent logits or key features
        query_dim = key_dim + (attention == "macchiato")  # Macchiato: L + 1 states, state 0 the window
        self.heads, self.conv_width = heads, conv
        self.conv = torch.nn.Conv1d(dim, dim, conv, groups=dim) if conv > 0 else None
        self.q = torch.nn.Linear(dim, heads * query_dim, bias=False)
        self.k = torch.nn.Linear(dim, heads * key_dim, bias=False)
        self.v = torch.nn.Linear(dim, dim, bias=False)
        self.o = torch.nn.Linear(dim, dim, bias=False)
        # Macchiato's sliding window (RoPE on) has its own queries and keys, between k and v
        self.window = torch.nn.ModuleList(torch.nn.Linear(dim, dim, bias=False) for _ in range(2)) \
            if attention == "macchiato" else torch.nn.ModuleList()
        self.mechanism = {"latte": lambda: lt.LatteAttention(heads, latents, value_dim),
                          "macchiato": lambda: lt.LatteMacchiato(heads, value_dim, window, rope=True),
                          "linear": lambda: lt.LinearAttention(),
                          "sdpa": lambda: _sdpa}[attention]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        if self.conv is not None:  # causal: pad W - 1 steps on the left
            x = self.conv(F.pad(x.transpose(1, 2), (self.conv_width - 1, 0))).transpose(1, 2)
        projections = (self.q, self.k, *self.window, self.v)
        return self.o(self.mechanism(*(p(x).view(B, T, self.heads, -1) for p in projections)).reshape(B, T, C))


class Block(torch.nn.Module):
    """A pre-norm residual block: h + attention(RMSNorm(h)), then h + MLP(RMSNorm(h))."""

    def __init__(self, attention: str, dim: int, heads: int, latents: int, conv: int, window: int):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.RMSNorm(dim), torch.nn.RMSNorm(dim)
        self.attention = Attention(attention, dim, heads, latents, conv, window)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.SiLU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attention(self.norm1(h))
        return h + self.mlp(self.norm2(h))


class Model(torch.nn.Module):
    """Embedding, blocks, final RMSNorm and output head (tied to the embedding); ``forward`` returns the
    logits at the labelled positions and those labels."""

    def __init__(self, attention: str, vocab: int, dim: int = 64, heads: int = 4, latents: int = 64,
                 conv: int = 3, window: int = 32, blocks: int = 2):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(Block(attention, dim, heads, latents, conv, window) for _ in range(blocks))
        self.norm = torch.nn.RMSNorm(dim)
        torch.nn.init.normal_(self.embedding.weight, std=dim ** -0.5)  # unit-scale logits at first
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embedding.weight  # tied: a recalled value's embedding scores itself

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embedding(tokens)
        for block in self.blocks:
            h = block(h)
        asked = labels >= 0
        return self.head(self.norm(h[asked])), labels[asked]


def evaluate(model: Model, tokens: torch.Tensor, labels: torch.Tensor, chunk: int) -> tuple[float, float]:
    """Mean cross-entropy and query accuracy (argmax) over held-out sequences, ``chunk`` at a time."""
    loss, correct, asked = 0.0, 0, 0
    with torch.no_grad():
        for first in range(0, len(tokens), chunk):
            logits, target = model(tokens[first:first + chunk], labels[first:first + chunk])
            loss += F.cross_entropy(logits, target, reduction="sum").item()
            correct += (logits.argmax(-1) == target).sum().item()
            asked += len(target)
    return loss / asked, correct / asked


def train(task: mqar.Task, attention: str = "latte", *, steps: int = 500, batch: int = 32, lr: float = 1e-2,
          dim: int = 64, heads: int = 4, latents: int = 64, conv: int = 3, window: int = 32, seed: int = 1,
          eval_every: int = 50, eval_sequences: int = 256, csv_path: str | None = None,
          progress: bool = True) -> list[dict]:
    """Trains a fresh model on ``task`` for ``steps`` steps; returns the evaluations, one dict per row of
    the CSV (written to ``csv_path`` as they come when given), the last one after the last step."""
    task.check()
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, given {attention!r}")
    torch.manual_seed(seed)
    model = Model(attention, task.vocab, dim, heads, latents, conv, window)
    decayed = [p for p in model.parameters() if p.dim() >= 2 and p is not model.embedding.weight]
    others = [p for p in model.parameters() if not any(p is q for q in decayed)]
    optimizer = torch.optim.AdamW([{"params": decayed, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}],
                                  lr=lr, betas=(0.9, 0.99))
    warmup = min(100, steps // 10 + 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: (s + 1) / warmup if s + 1 <= warmup else
                                                 0.1 + 0.45 * (1 + math.cos(math.pi * (s + 1 - warmup) /
                                                                            max(1, steps - warmup))))
    train_stream, eval_stream = mqar.streams(seed)
    eval_tokens, eval_labels = map(torch.from_numpy, mqar.draw_batch(task, eval_stream, eval_sequences))
    label = attention
    rows, seconds, smoothed = [], 0.0, None
    out = open(csv_path, "w", newline="") if csv_path else None
    writer = csv.DictWriter(out, ["attention", "step", "seconds", "train_loss", "eval_loss", "eval_accuracy"]) \
        if out else None
    if writer:
        writer.writeheader()
    print(f"{label}: T = {task.tokens}, {task.pairs} pairs, {task.asked} queries, vocab {task.vocab}, "
          f"batch {batch}, {steps} steps, {sum(p.numel() for p in model.parameters())} parameters")
    bar = tqdm(range(1, steps + 1), desc=label, disable=None if progress else True, mininterval=1.0)
    for step in bar:
        start = time.perf_counter()
        tokens, labels = map(torch.from_numpy, mqar.draw_batch(task, train_stream, batch))
        logits, target = model(tokens, labels)
        loss = F.cross_entropy(logits, target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        seconds += time.perf_counter() - start
        smoothed = loss.item() if smoothed is None else 0.95 * smoothed + 0.05 * loss.item()
        if step % eval_every == 0 or step == steps:
            eval_loss, accuracy = evaluate(model, eval_tokens, eval_labels, batch)
            rows.append({"attention": label, "step": step, "seconds": round(seconds, 3), "train_loss": loss.item(),
                         "eval_loss": eval_loss, "eval_accuracy": accuracy})
            if writer:
                writer.writerow(rows[-1])
                out.flush()
            bar.set_postfix(loss=f"{smoothed:.3f}", acc=f"{100 * accuracy:.1f}%")
            if progress:
                tqdm.write(f"step {step:5d}  loss {smoothed:.4f}  eval loss {eval_loss:.4f}  "
                           f"eval accuracy {100 * accuracy:5.1f}%  {seconds:.1f} s")
        elif step % 10 == 0:
            bar.set_postfix(loss=f"{smoothed:.3f}", acc=f"{100 * rows[-1]['eval_accuracy']:.1f}%" if rows else "-")
    if out:
        out.close()
    last = rows[-1]
    print(f"{label}: eval accuracy {100 * last['eval_accuracy']:.1f}% of {task.asked * eval_sequences} recalls, "
          f"eval loss {last['eval_loss']:.4f} after {steps} steps, {seconds:.1f} s training "
          f"({1000 * seconds / steps:.0f} ms per step)")
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attention", choices=ATTENTIONS, default="latte")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--pairs", type=int, default=16)
    parser.add_argument("--queries", type=int, default=32, help="queries per sequence (0: every slot)")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--latents", type=int, default=64, help="Latte's latent states per head")
    parser.add_argument("--window", type=int, default=32, help="Macchiato's window (tokens back)")
    parser.add_argument("--conv", type=int, default=3, help="short causal convolution's width (0: none)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-sequences", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--csv", help="write the evaluations here")
    parser.add_argument("--png", help="draw the CSV's curves here (examples/plot_training.py; needs --csv)")
    args = parser.parse_args(argv)
    if args.png and not args.csv:
        parser.error("--png draws the CSV: give --csv too")
    torch.set_num_threads(args.threads)
    task = mqar.Task(args.tokens, args.pairs, args.vocab, args.queries)
    train(task, args.attention, steps=args.steps, batch=args.batch, lr=args.lr, dim=args.dim, heads=args.heads,
          latents=args.latents, conv=args.conv, window=args.window, seed=args.seed, eval_every=args.eval_every,
          eval_sequences=args.eval_sequences, csv_path=args.csv)
    if args.png:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import plot_training

        plot_training.main(args.png, [args.csv], title=f"MQAR, examples/python/train_mqar.py --attention "
                                                        f"{args.attention}")


if __name__ == "__main__":
    main()
