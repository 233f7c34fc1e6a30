"""Multi-query associative recall (MQAR, Arora et al. 2023 "Zoology"), drawn exactly
as examples/train_lm.cpp draws it, so that for the same seed and settings the
Python and C++ examples train and evaluate on the same sequences
(tests/python/test_mqar.py checks this against tests/golden/mqar_*, written by
``train_lm --print-task N``).

One SplitMix64 stream per split (train: ``seed``, eval: ``seed ^ 0x5DEECE66D``),
sequences drawn one after the other; ``below(n)`` is ``next() % n``. Tokens: 0 is
filler, keys are 1 .. V/2 - 1, values V/2 .. V - 1. Per sequence of T tokens with
K pairs:

1. keys: a partial Fisher-Yates over [1, ..., V/2 - 1]: for i < K,
   j = i + below(V/2 - 1 - i), swap(a[i], a[j]); key_i = a[i];
2. values: value_i = V/2 + below(V/2), i = 0 .. K-1;
3. context: token[2i] = key_i, token[2i + 1] = value_i;
4. queries: S = (T - 2K) / 2 slots, Q of them asked (all S unless ``queries``
   says fewer); for j < Q a partial Fisher-Yates over [0, ..., S - 1] picks
   slot_j, then pair i = below(K): token[2K + 2 slot_j] = key_i,
   token[2K + 2 slot_j + 1] = value_i, and the label at 2K + 2 slot_j (the key)
   is value_i; every other label is -1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

EVAL_SALT = 0x5DEECE66D  # the eval stream's seed is seed ^ EVAL_SALT
_MASK = (1 << 64) - 1


class SplitMix64:
    """Steele, Lea and Flood's 64-bit generator, as train_lm.cpp's ``SplitMix64``."""

    def __init__(self, seed: int):
        self.state = seed & _MASK

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        """A draw in [0, n): ``next() % n``."""
        return self.next() % n


@dataclass(frozen=True)
class Task:
    """MQAR's sizes: T tokens per sequence, K key-value pairs, vocabulary V, Q queries (0: every slot)."""

    tokens: int = 256
    pairs: int = 16
    vocab: int = 8192
    queries: int = 0

    @property
    def slots(self) -> int:
        """Where a query can go: S = (T - 2K) / 2."""
        return (self.tokens - 2 * self.pairs) // 2

    @property
    def asked(self) -> int:
        """Queries per sequence: Q, or S when Q is 0."""
        return self.queries or self.slots

    def check(self) -> None:
        """Raises ValueError where train_lm.cpp's parser would refuse these sizes."""
        if not (self.vocab >= 2 * (self.pairs + 1) + 2 and self.tokens >= 2 * self.pairs + 2
                and 0 <= self.queries <= self.slots and self.pairs >= 1):
            raise ValueError(f"MQAR needs vocab >= 2 (pairs + 1) + 2, tokens >= 2 pairs + 2 and queries <= "
                             f"(tokens - 2 pairs) / 2; given {self}")


def draw_sequence(task: Task, rng: SplitMix64, tokens: np.ndarray, labels: np.ndarray) -> None:
    """Writes one sequence (steps 1-4 of the module comment) into ``tokens`` and ``labels`` ([T] each)."""
    K, half, slots = task.pairs, task.vocab // 2, task.slots
    tokens[:] = 0
    labels[:] = -1
    keys = list(range(1, half))
    for i in range(K):
        j = i + rng.below(half - 1 - i)
        keys[i], keys[j] = keys[j], keys[i]
    values = [half + rng.below(half) for _ in range(K)]
    tokens[0:2 * K:2], tokens[1:2 * K:2] = keys[:K], values
    slot = list(range(slots))
    for j in range(task.asked):
        r = j + rng.below(slots - j)
        slot[j], slot[r] = slot[r], slot[j]
        i, at = rng.below(K), 2 * K + 2 * slot[j]
        tokens[at], tokens[at + 1], labels[at] = keys[i], values[i], values[i]


def draw_batch(task: Task, rng: SplitMix64, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """The next ``batch`` sequences of ``rng``: tokens and labels, int64 ``[batch, T]`` (labels -1 where
    nothing is asked)."""
    tokens = np.empty((batch, task.tokens), dtype=np.int64)
    labels = np.empty((batch, task.tokens), dtype=np.int64)
    for b in range(batch):
        draw_sequence(task, rng, tokens[b], labels[b])
    return tokens, labels


def streams(seed: int) -> tuple[SplitMix64, SplitMix64]:
    """The train and eval streams of ``seed``."""
    return SplitMix64(seed), SplitMix64(seed ^ EVAL_SALT)


def print_task(task: Task, seed: int, count: int) -> str:
    """What ``train_lm --print-task count`` prints for these settings: a header line, then per training
    sequence its tokens, " |", its labels."""
    tokens, labels = draw_batch(task, streams(seed)[0], count)
    lines = [f"# train_lm --print-task {count} --tokens {task.tokens} --pairs {task.pairs} --vocab {task.vocab} "
             f"--queries {task.asked} --seed {seed}"]
    lines += ["".join(f"{t} " for t in row) + "|" + "".join(f" {x}" for x in label)
              for row, label in zip(tokens, labels)]
    return "\n".join(lines) + "\n"
