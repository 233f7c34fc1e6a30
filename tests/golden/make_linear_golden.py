#!/usr/bin/env python3
"""Golden values for latte's linear-attention family from the official reference code.

Re-implements, in numpy and float64, the attention cores of
  * OpenNLPLab/cosFormer, cosformer.py: CosformerAttention.left_product (the
    explicit-matrix product the repository checks its `forward` against) and
    CosformerAttention.forward (the linear product),
  * OSU-STARLAB/LeaPformer, fairseq-leapformer/fairseq/modules/leapformer_attention.py:
    leapformer_attn_train (quadratic path, with fairseq's future mask for causal
    self-attention), leapformer_attn_bidir_infer and leapformer_attn_causal_infer
    (the incremental decoder, run token by token for self-attention and over a
    static source for cross-attention),
on fixed seeds, checks that each repository's own pairs of paths agree, and writes
linear_golden.hpp next to this file for tests/test_linear_golden.cpp.

What is reproduced is the attention core between the projections: the inputs are
the projected q, k, v per head (the repositories' q_proj/k_proj/v_proj and, for
cosFormer, out_proj are left out; fairseq's q *= head_dim**-0.5 happens before the
LeaPformer functions are called, so it is part of the given q). Dropout is off
(evaluation). Conventions matched:
  * cosFormer: ReLU features; positions 1-based, index i * pi / 2 / M with
    M = max(src_len, tgt_len) for queries and keys alike; features [q sin, q cos];
    causal mask s <= t; denominator clamp_min(., eps = 1e-6).
  * LeaPformer: ReLU features; LeaP modules Linear(d, d / leap_factor) -> ReLU ->
    Linear(d / leap_factor, 1) -> Sigmoid on relu(q) and relu(k), shared across
    heads; re-weighting sin/cos(pi / 2 * P); denominator clamp_min(., 0.1).
Inputs and weights are rounded to float32 values so the same numbers feed the
float and double tests.

Usage: python3 tests/golden/make_linear_golden.py   (needs numpy only)
"""
import math
import os

import numpy as np

B, H, D = 2, 2, 8          # batch, heads, head dim (Dk = Dv = D)
T_SELF = 6                 # self-attention length
T_CROSS, S_CROSS = 5, 9    # cross-attention: target and source lengths
LEAP_FACTOR = 4            # hidden = D / LEAP_FACTOR = 2
SEED = 20240601


def as_float32_values(x):
    return np.asarray(x, dtype=np.float32).astype(np.float64)


def to_heads(x):
    """[B, N, H, d] (latte's layout) -> [B * H, N, d] (the repositories' bmm layout)."""
    b, n, h, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b * h, n, d)


def from_heads(x, b, h):
    """[B * H, N, d] -> [B, N, H, d]."""
    bh, n, d = x.shape
    return x.reshape(b, h, n, d).transpose(0, 2, 1, 3)


def relu(x):
    return np.maximum(x, 0.0)


# ----------------------------------------------------------------- cosFormer --

def cosformer_features(q, k):
    """ReLU, then [x sin(pi/2 i / m), x cos(pi/2 i / m)] with 1-based i, m = max(L, S)."""
    tgt_len, src_len = q.shape[1], k.shape[1]
    q, k = relu(q), relu(k)
    m = max(src_len, tgt_len)
    index = np.pi / 2 * np.arange(1, m + 1).reshape(1, -1, 1)
    q_ = np.concatenate([q * np.sin(index[:, :tgt_len, :] / m),
                         q * np.cos(index[:, :tgt_len, :] / m)], axis=-1)
    k_ = np.concatenate([k * np.sin(index[:, :src_len, :] / m),
                         k * np.cos(index[:, :src_len, :] / m)], axis=-1)
    return q_, k_


def cosformer_left_product(q, k, v, causal, eps=1e-6):
    """CosformerAttention.left_product on projected [B*H, N, d] heads."""
    q_, k_ = cosformer_features(q, k)
    weights = q_ @ k_.transpose(0, 2, 1)
    if causal:  # attn_mask == -inf above the diagonal -> 0
        tgt_len = q.shape[1]
        allowed = np.tril(np.ones((tgt_len, tgt_len), dtype=bool))
        weights = np.where(allowed[None], weights, 0.0)
    denom = np.maximum(weights.sum(axis=-1, keepdims=True), eps)
    return (weights / denom) @ v


def cosformer_forward(q, k, v, causal, eps=1e-6):
    """CosformerAttention.forward (linear product) on projected heads."""
    q_, k_ = cosformer_features(q, k)
    if causal:
        kv_cum = np.cumsum(np.einsum("nld,nlm->nldm", k_, v), axis=1)
        qkv = np.einsum("nld,nldm->nlm", q_, kv_cum)
        denom = np.maximum(np.einsum("nlm,nlm->nl", q_, np.cumsum(k_, axis=1)), eps)
        return qkv / denom[..., None]
    kv_ = np.einsum("nld,nlm->ndm", k_, v)
    z_ = 1 / np.maximum(np.einsum("nld,nd->nl", q_, k_.sum(axis=1)), eps)
    return np.einsum("nld,ndm,nl->nlm", q_, kv_, z_)


# ---------------------------------------------------------------- LeaPformer --

class LeaPModule:
    """nn.Sequential(Linear(d, d // f), ReLU(), Linear(d // f, 1), Sigmoid())."""

    def __init__(self, rng, d, factor):
        hidden = d // factor
        self.w1 = as_float32_values(rng.normal(0.0, 0.5, size=(hidden, d)))
        self.b1 = as_float32_values(rng.normal(0.0, 0.5, size=(hidden,)))
        self.w2 = as_float32_values(rng.normal(0.0, 1.0, size=(1, hidden)))
        self.b2 = as_float32_values(rng.normal(0.0, 0.5, size=(1,)))

    def __call__(self, x):
        hidden = relu(x @ self.w1.T + self.b1)
        return 1.0 / (1.0 + np.exp(-(hidden @ self.w2.T + self.b2)))


def leap_streams(q, k, q_leap, k_leap):
    q, k = relu(q), relu(k)
    tgt, src = q_leap(q), k_leap(k)
    half_pi = math.pi / 2
    return (q * np.sin(half_pi * tgt), q * np.cos(half_pi * tgt),
            k * np.sin(half_pi * src), k * np.cos(half_pi * src))


def leapformer_attn_train(q, k, v, q_leap, k_leap, causal, linearized=False):
    """leapformer_attn_train: causal uses fairseq's future mask (bool True above the diagonal)."""
    q_sin, q_cos, k_sin, k_cos = leap_streams(q, k, q_leap, k_leap)
    if linearized:
        assert not causal
        attn_weights = q_sin @ (k_sin.transpose(0, 2, 1) @ v) + q_cos @ (k_cos.transpose(0, 2, 1) @ v)
        prob_norm = q_sin @ k_sin.sum(axis=1)[..., None] + q_cos @ k_cos.sum(axis=1)[..., None]
        return attn_weights / np.maximum(prob_norm, 0.1)
    attn_weights = q_sin @ k_sin.transpose(0, 2, 1) + q_cos @ k_cos.transpose(0, 2, 1)
    if causal:
        n = q.shape[1]
        future = np.triu(np.ones((n, n), dtype=bool), 1)
        attn_weights = np.where(future[None], 0.0, attn_weights)
    attn_probs = attn_weights @ v
    if causal:
        norm_sin = np.cumsum(k_sin, axis=1).transpose(0, 2, 1)
        norm_cos = np.cumsum(k_cos, axis=1).transpose(0, 2, 1)
    else:
        norm_sin = k_sin.sum(axis=1)[..., None]
        norm_cos = k_cos.sum(axis=1)[..., None]
    prob_norm = q_sin @ norm_sin + q_cos @ norm_cos
    if causal:
        prob_norm = np.diagonal(prob_norm, axis1=1, axis2=2)[..., None]
    return attn_probs / np.maximum(prob_norm, 0.1)


def leapformer_attn_bidir_infer(q, k, v, q_leap, k_leap):
    q_sin, q_cos, k_sin, k_cos = leap_streams(q, k, q_leap, k_leap)
    attn_weights = q_sin @ (k_sin.transpose(0, 2, 1) @ v) + q_cos @ (k_cos.transpose(0, 2, 1) @ v)
    prob_norm = q_sin @ k_sin.sum(axis=1)[..., None] + q_cos @ k_cos.sum(axis=1)[..., None]
    return attn_weights / np.maximum(prob_norm, 0.1)


def leapformer_attn_causal_infer(q, k, v, q_leap, k_leap, chkpt, self_attn):
    """One call of leapformer_attn_causal_infer; `chkpt` plays simul_attn_chkpts[...][block]."""
    q_sin, q_cos, k_sin, k_cos = leap_streams(q, k, q_leap, k_leap)
    if chkpt["norm_sin"] is not None:
        if self_attn:
            norm_sin = chkpt["norm_sin"] + k_sin.transpose(0, 2, 1)
            norm_cos = chkpt["norm_cos"] + k_cos.transpose(0, 2, 1)
        else:
            norm_sin, norm_cos = chkpt["norm_sin"], chkpt["norm_cos"]
    elif self_attn:
        norm_sin, norm_cos = k_sin.transpose(0, 2, 1), k_cos.transpose(0, 2, 1)
    else:
        norm_sin = k_sin.sum(axis=1)[..., None]
        norm_cos = k_cos.sum(axis=1)[..., None]
    if chkpt["kTv_sin"] is not None:
        if self_attn:
            kv_sin = chkpt["kTv_sin"] + k_sin.transpose(0, 2, 1) @ v
            kv_cos = chkpt["kTv_cos"] + k_cos.transpose(0, 2, 1) @ v
        else:
            kv_sin, kv_cos = chkpt["kTv_sin"], chkpt["kTv_cos"]
    else:
        kv_sin = k_sin.transpose(0, 2, 1) @ v
        kv_cos = k_cos.transpose(0, 2, 1) @ v
    attn_weights = q_sin @ kv_sin + q_cos @ kv_cos
    prob_norm = q_sin @ norm_sin + q_cos @ norm_cos
    chkpt.update(kTv_sin=kv_sin, kTv_cos=kv_cos, norm_sin=norm_sin, norm_cos=norm_cos)
    return attn_weights / np.maximum(prob_norm, 0.1)


def leapformer_decode_self(q, k, v, q_leap, k_leap):
    """Self-attention decoding: one token (query, key, value) per call."""
    chkpt = dict(kTv_sin=None, kTv_cos=None, norm_sin=None, norm_cos=None)
    steps = [leapformer_attn_causal_infer(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1],
                                          q_leap, k_leap, chkpt, True)
             for t in range(q.shape[1])]
    return np.concatenate(steps, axis=1)


def leapformer_decode_cross(q, k, v, q_leap, k_leap):
    """Decoder cross-attention: one query per call over the static source."""
    chkpt = dict(kTv_sin=None, kTv_cos=None, norm_sin=None, norm_cos=None)
    steps = [leapformer_attn_causal_infer(q[:, t:t + 1], k, v, q_leap, k_leap, chkpt, False)
             for t in range(q.shape[1])]
    return np.concatenate(steps, axis=1)


# ------------------------------------------------------------------- output --

def main():
    rng = np.random.default_rng(SEED)
    arrays = []  # (name, array)

    def tensor(shape, scale=1.0):
        return as_float32_values(rng.normal(0.0, scale, size=shape))

    self_q, self_k = tensor((B, T_SELF, H, D)), tensor((B, T_SELF, H, D))
    self_v = tensor((B, T_SELF, H, D))
    cross_q = tensor((B, T_CROSS, H, D))
    cross_k, cross_v = tensor((B, S_CROSS, H, D)), tensor((B, S_CROSS, H, D))
    q_leap, k_leap = LeaPModule(rng, D, LEAP_FACTOR), LeaPModule(rng, D, LEAP_FACTOR)
    arrays += [("self/q", self_q), ("self/k", self_k), ("self/v", self_v),
               ("cross/q", cross_q), ("cross/k", cross_k), ("cross/v", cross_v)]
    for side, module in (("query", q_leap), ("key", k_leap)):
        arrays += [(f"leap/{side}/w1", module.w1), (f"leap/{side}/b1", module.b1),
                   (f"leap/{side}/w2", module.w2.reshape(-1)), (f"leap/{side}/b2", module.b2)]

    sq, sk, sv = to_heads(self_q), to_heads(self_k), to_heads(self_v)
    cq, ck, cv = to_heads(cross_q), to_heads(cross_k), to_heads(cross_v)

    def check(a, b, what):
        error = np.abs(a - b).max() / np.abs(b).max()
        assert error < 1e-13, f"{what}: the repository's two paths differ by {error}"

    # cosFormer: left_product is the golden value; forward must agree with it.
    for name, (q, k, v, causal) in {"bidirectional": (sq, sk, sv, False),
                                    "causal": (sq, sk, sv, True),
                                    "cross": (cq, ck, cv, False)}.items():
        left = cosformer_left_product(q, k, v, causal)
        check(cosformer_forward(q, k, v, causal), left, f"cosFormer {name}")
        arrays.append((f"cosformer/left_product/{name}", from_heads(left, B, H)))

    # LeaPformer: training path (golden for forward) and incremental decoding
    # (golden for decode), which must agree with each other.
    train_causal = leapformer_attn_train(sq, sk, sv, q_leap, k_leap, causal=True)
    decode_self = leapformer_decode_self(sq, sk, sv, q_leap, k_leap)
    check(decode_self, train_causal, "LeaPformer causal train vs causal_infer")
    train_bidir = leapformer_attn_train(sq, sk, sv, q_leap, k_leap, causal=False)
    check(leapformer_attn_train(sq, sk, sv, q_leap, k_leap, False, linearized=True), train_bidir,
          "LeaPformer bidirectional quadratic vs linearized")
    check(leapformer_attn_bidir_infer(sq, sk, sv, q_leap, k_leap), train_bidir,
          "LeaPformer bidirectional train vs bidir_infer")
    train_cross = leapformer_attn_train(cq, ck, cv, q_leap, k_leap, causal=False)
    bidir_infer_cross = leapformer_attn_bidir_infer(cq, ck, cv, q_leap, k_leap)
    decode_cross = leapformer_decode_cross(cq, ck, cv, q_leap, k_leap)
    check(bidir_infer_cross, train_cross, "LeaPformer cross train vs bidir_infer")
    check(decode_cross, train_cross, "LeaPformer cross train vs causal_infer")
    arrays += [("leapformer/train/causal", from_heads(train_causal, B, H)),
               ("leapformer/causal_infer/self", from_heads(decode_self, B, H)),
               ("leapformer/train/bidirectional", from_heads(train_bidir, B, H)),
               ("leapformer/train/cross", from_heads(train_cross, B, H)),
               ("leapformer/bidir_infer/cross", from_heads(bidir_infer_cross, B, H)),
               ("leapformer/causal_infer/cross", from_heads(decode_cross, B, H))]
    proportions = q_leap(relu(sq))[..., 0]  # [B*H, T]
    arrays.append(("leap/proportions/self/q",
                   proportions.reshape(B, H, T_SELF).transpose(0, 2, 1)))

    write_header(arrays, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      "linear_golden.hpp"))


LINEAR_GENERATED_BY = [
    "// Generated by tests/golden/make_linear_golden.py (numpy re-implementation of the",
    "// official cosFormer and LeaPformer attention cores; see that script). Do not edit.",
]


def linear_constants():
    return [
        f"inline constexpr std::ptrdiff_t kBatch = {B}, kHeads = {H}, kDim = {D};",
        f"inline constexpr std::ptrdiff_t kSelfLength = {T_SELF}, kCrossLength = {T_CROSS}, "
        f"kSourceLength = {S_CROSS};",
        f"inline constexpr std::ptrdiff_t kLeapFactor = {LEAP_FACTOR};",
    ]


def write_header(arrays, path, generated_by=None, namespace="latte::test::golden",
                 constants=None):
    """Writes `arrays` ((name, numpy-convertible) pairs) as a table of golden::Array.

    `generated_by` (comment lines), `namespace` and `constants` (C++ lines) default to
    linear_golden.hpp's; tests/golden/make_gradient_golden.py passes its own.
    """
    lines = [
        "#pragma once",
        *(LINEAR_GENERATED_BY if generated_by is None else generated_by),
        "#include <array>",
        "#include <cstddef>",
        "#include <span>",
        "#include <string_view>",
        "",
        f"namespace {namespace} {{",
        "",
        *(linear_constants() if constants is None else constants),
        "",
        "struct Array {",
        "  std::string_view name;",
        "  std::size_t rank;",
        "  std::array<std::ptrdiff_t, 4> shape;",
        "  std::span<const double> values;",
        "};",
        "",
    ]
    for i, (name, array) in enumerate(arrays):
        values = ", ".join(repr(float(x)) for x in np.asarray(array, dtype=np.float64).ravel())
        lines.append(f"// {name} {list(array.shape)}")
        lines.append(f"inline constexpr double kValues{i}[] = {{{values}}};")
    lines += ["", "inline constexpr Array kArrays[] = {"]
    for i, (name, array) in enumerate(arrays):
        shape = list(array.shape) + [1] * (4 - array.ndim)
        lines.append(f'    {{"{name}", {array.ndim}, {{{", ".join(map(str, shape))}}}, kValues{i}}},')
    lines += ["};", "", f"}}  // namespace {namespace}", ""]
    with open(path, "w") as out:
        out.write("\n".join(lines))


if __name__ == "__main__":
    main()
