"""Latte Macchiato, LAVO and convolutional-compression attention in plain PyTorch,
forward + backward under autograd on the CPU: what training one of them costs a
PyTorch user who writes the mechanism from its definition.

Each mechanism is transcribed from its definition (DESIGN.md §3.2, §3.4, §3.5;
papers 000 §2.3, 002 §3, 003 §4; the explicit T x T transcriptions in
tests/golden/make_gradient_golden.py) in the blocked, vectorised form a user
writes at 16K tokens, where the T x T matrices do not fit in memory: attention
over a sliding window as dense blocks (each block of queries against its own and
the previous block of keys, masked to the band), sums over the past as
per-chunk GEMMs plus the earlier chunks' sums (Macchiato's latent part: chunks of
128 tokens, each chunk's sums rescaled to the running maximum by a chunks x chunks
decay matrix, as in Mamba-2's minimal SSD code). No Python loop over tokens or
chunks.

  macchiato        causal, RunningMax, RoPE on the window (latte-compare's
                   macchiato rows): B1 H8 L64 Dk=Dv=64, window 128; gradients of the
                   query / key logits, window queries / keys and values (no learned
                   parameters: RoPE's angles are the fixed schedule).
  lavo             causal (latte-compare's lavo rows): d = r = 64, window 64;
                   gradients of q, k, v and the relative bias P (the bases stay
                   fixed, as the paper keeps them and latte-compare's rows do).
  conv_compressed  causal, levels 2, M = 64 (latte-compare's conv_compressed rows):
                   gradients of q, k, v and every weight (convolutions, biases,
                   level and cross projections).

Before any timing, each transcription's forward is checked against latte's own
(build/bench/latte-peer-check, bench/peer_check.cpp) on the same inputs and
weights, at --check-t tokens (conv-compression: at least 2 M^L, so that its cross read
is exercised), in float32 (max |diff| <= 1e-5 x max(1, max |out|))
and float64 (<= 1e-10 x that): a mismatch stops the script before it times
anything. The check's errors go to stderr. --check-gradients instead compares the
blocked forms' outputs and autograd gradients with the explicit T x T transcriptions of
tests/golden/make_gradient_golden.py (float64, small T) and exits.

Timed: with torch.set_num_threads(--threads), the inputs and the learned
parameters as leaves requiring grad, out = mechanism(...), loss = (out *
d_out).sum(), torch.autograd.grad(loss, leaves); best of the repeats. Rows
`<mechanism>_forward_backward,causal,torch` are appended to latte-compare's CSV,
FLOPs 3x latte-compare's forward model (bench/flop_models.hpp, transcribed below).

  .venv-peers/bin/python bench/peers/torch_mechanisms.py --t 4096,16384 >> results.csv
"""
import math
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

from peer_common import best_time, csv_row, lengths, parser

B, H, D = 1, 8, 64
MACCHIATO = dict(latents=64, window=128)
LAVO = dict(bases=64, window=64)
CONV = dict(group=64, levels=2)
CHUNK = 128  # chunk of Macchiato's latent part (128: the fastest of 64, 128, 256 at 16K here)


# ------------------------------------------------------------------ helpers --

def causal_band_attention(q, k, v, left, bias=None):
    """Softmax attention of query t over keys t - left <= s <= t, in blocks of queries
    (a multiple of 64, at least `left`), each against its own and the previous block
    of keys, masked to the band. q, k [B, H, T, Dk], v [B, H, T, Dv]; scale 1/sqrt(Dk).
    Without a bias: scaled_dot_product_attention (its CPU flash kernel) on
    [B * H, blocks, block, D]. `bias` [H, 2 * left + 1] adds bias[h, (s - t) + left]
    to the scores (LAVO's relative bias P; the causal band reads its first left + 1
    entries): written out, since SDPA has no gradient for its mask (it would fall
    back to its math path, slower than this)."""
    b, h, n, dk = q.shape
    block = -(-max(left, 1) // 64) * 64
    blocks = -(-n // block)
    pad = blocks * block - n
    if pad:  # causal: tokens appended at the end change nothing before them
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    q, k, v = (x.reshape(b * h, blocks, block, x.shape[-1]) for x in (q, k, v))
    # keys of block i: blocks i - 1 and i (a block of zeros before the first, masked)
    k2, v2 = (torch.cat([x[:, :-1], x[:, 1:]], dim=2)
              for x in (F.pad(y, (0, 0, 0, 0, 1, 0)) for y in (k, v)))  # [B H, blocks, 2 block, D]
    t = torch.arange(block).reshape(block, 1)
    s = torch.arange(2 * block).reshape(1, 2 * block) - block               # s - (block start)
    band = (s <= t) & (s >= t - left)                                       # [block, 2 block]
    allowed = torch.stack([band & (s >= 0)] + [band] * (blocks - 1))         # [blocks, block, 2 block]
    if bias is None:
        # (a 4-D mask: with a 3-D one SDPA takes its math path)
        out = F.scaled_dot_product_attention(q, k2, v2, attn_mask=allowed[None])
    else:
        offsets = (s - t + left).clamp(0, 2 * left)                         # [block, 2 block]
        scores = (q @ k2.transpose(-1, -2)) / math.sqrt(dk)                 # [B H, blocks, block, 2 block]
        scores = scores.unflatten(0, (b, h)) + bias[:, offsets].unsqueeze(1)  # + [H, 1, block, 2 block]
        p = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
        out = p.flatten(0, 1) @ v2
    return out.reshape(b, h, blocks * block, -1)[:, :, :n]


def rope_tables(n, dim, dtype):
    """cos and sin of t * theta_i, theta_i = 10000^(-2i/dim) (computed in float64)."""
    theta = 10000.0 ** (-2.0 * torch.arange(dim // 2, dtype=torch.float64) / dim)
    angle = torch.arange(n, dtype=torch.float64)[:, None] * theta
    return torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)


def rotate_pairs(x, cos, sin):
    """RoPE on adjacent pairs (2i, 2i + 1): [x, y] -> [c x - s y, s x + c y]."""
    first, second = x[..., 0::2], x[..., 1::2]
    return torch.stack([cos * first - sin * second, sin * first + cos * second], -1).flatten(-2)


# ---------------------------------------------------------------- Macchiato --

def causal_latent_mixture(p, k, v, chunk=CHUNK):
    """Latte's causal latent part (paper 000 eq. 10) weighted by p(l|t):
    sum_l p[t, l] sum_{s<=t} exp(k[s, l]) v_s / sum_{s<=t} exp(k[s, l]), p, k [B, H, T, L].
    Per chunk of `chunk` tokens: the earlier chunks' sums ([L, Dv + 1], the last column
    the normaliser) plus the chunk's own causal part, as GEMMs. Stabilised by the
    running maximum of the keys at the end of each chunk (every exp <= 1). (A Python
    loop carrying the sums chunk to chunk instead costs thousands of small ops under
    autograd: slower here, and much slower when the cores are shared.)"""
    b, h, n, latents = k.shape
    dv = v.shape[-1]
    chunks = -(-n // chunk)
    pad = chunks * chunk - n
    if pad:
        p, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (p, k, v))
    p, k = p.unflatten(2, (chunks, chunk)), k.unflatten(2, (chunks, chunk))  # [b, h, c, chunk, L]
    v = torch.cat([v, torch.ones_like(v[..., :1])], -1).unflatten(2, (chunks, chunk))  # [.., Dv+1]
    with torch.no_grad():  # the reference cancels between numerator and normaliser
        top = k.amax(3).cummax(2).values                                   # [b, h, c, L]
    e = torch.exp(k - top.unsqueeze(3))                                    # [b, h, c, chunk, L]
    totals = e.transpose(-1, -2) @ v                                       # [b, h, c, L, Dv+1]
    # chunk c's carry at its reference top[c]: sum over chunks j < c of
    # exp(top[j] - top[c]) totals[j] (factors <= 1), as one batched GEMM over chunks
    earlier = torch.ones(chunks, chunks, dtype=torch.bool).tril(-1)        # [c, j]: j < c
    top_l = top.transpose(2, 3)                                            # [b, h, L, c]
    decay = torch.exp(top_l.unsqueeze(-2) - top_l.unsqueeze(-1)).masked_fill(~earlier, 0.0)
    before = (decay @ totals.transpose(2, 3)).transpose(2, 3)              # [b, h, c, L, Dv+1]
    normaliser = before[..., dv].unsqueeze(3) + e.cumsum(3)               # [b, h, c, chunk, L]
    a = p / normaliser
    causal = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    within = (a @ e.transpose(-1, -2)).masked_fill(~causal, 0.0)           # [b, h, c, chunk, chunk]
    out = within @ v[..., :dv] + a @ before[..., :dv]
    return out.flatten(2, 3)[:, :, :n]


def macchiato(q, k, wq, wk, v, window, rope):
    """Causal Latte Macchiato (paper 000 eqs. 13-16), [B, H, T, *]: p(l|t) =
    softmax_{l=0..L}(q_t); o_t = p(0|t) sum_{t-w<=s<=t} softmax(R^t wq_t . R^s wk_s /
    sqrt(Dk)) v_s + sum_{l>=1} p(l|t) sum_{s<=t} p(s|l,t) v_s. `rope`: (cos, sin)."""
    p = torch.softmax(q, dim=-1)
    cos, sin = rope
    local = causal_band_attention(rotate_pairs(wq, cos, sin), rotate_pairs(wk, cos, sin), v, window)
    return causal_latent_mixture(p[..., 1:], k, v) + p[..., :1] * local


# --------------------------------------------------------------------- LAVO --

def lavo(q, k, v, relative_bias, bases, window):
    """Causal LAVO (paper 002), [B, H, T, d], bases [H, r, d], relative_bias [H, 2w - 1]:
    F_local(t) = softmax over t - w < s <= t of q_t . k_s / sqrt(d) + P[(s - t) + w - 1];
    memory H = mean of B F_local(s) over the complete windows before t's (zero while
    empty); g = softmax(H (.) B q / sqrt(d)) weighted sum of H_i b_i; o = (F_local + g) / 2."""
    b, h, n, d = q.shape
    scale = 1.0 / math.sqrt(d)
    local = causal_band_attention(q, k, v, window - 1, bias=relative_bias)
    windows = -(-n // window)
    pad = windows * window - n
    projected = F.pad(local, (0, 0, 0, pad)) @ bases.transpose(-1, -2)     # [b, h, T', r]: B f_s
    sums = projected.unflatten(2, (windows, window)).sum(3).cumsum(2)      # [b, h, windows, r]
    count = (torch.arange(windows, dtype=q.dtype) * window).clamp(min=1).reshape(windows, 1)
    mean = F.pad(sums[:, :, :-1], (0, 0, 1, 0)) / count                    # windows before j
    mean = mean.repeat_interleave(window, dim=2)[:, :, :n]                 # [b, h, T, r]
    bq = q @ bases.transpose(-1, -2)                                       # [b, h, T, r]
    read = (torch.softmax(scale * mean * bq, dim=-1) * mean) @ bases       # [b, h, T, d]
    return (local + read) / 2


# ---------------------------------------------------------- conv-compressed --

def conv_compressed(q, k, v, weights, group, levels):
    """Causal convolutional-compression attention (paper 003 §4), [B, H, T, *]:
    y0 = window attention over t - (M-1) <= s <= t; c^(l) = the stride-M convolution of
    y^(l-1) (complete groups), y^(l) = window attention over c^(l) with the level's
    projections; o_t = y0_t + softmax over j < floor(t / M^L) of Wq_x y0_t . Wk_x c^(L)_j
    (scale 1/sqrt(Dk)) of Wv_x c^(L)_j. `weights`: the lists conv_weight [H, M, Dv, Dv],
    conv_bias [H, Dv], level_query / level_key [H, Dk, Dv], level_value [H, Dv, Dv] and
    cross_query / cross_key [H, Dk, Dv], cross_value [H, Dv, Dv] ([out, in])."""
    b, h, n, dk = q.shape
    dv = v.shape[-1]
    scale = 1.0 / math.sqrt(dk)

    def project(x, w):  # x [b, h, m, in], w [h, out, in]
        return x @ w.transpose(-1, -2).unsqueeze(0)

    y0 = causal_band_attention(q, k, v, group - 1)
    y = y0
    for level in range(levels):
        groups = y.shape[2] // group
        w = weights["conv_weight"][level]                                  # [h, M, out, in]
        c = (y[:, :, :groups * group].reshape(b, h, groups, group * dv)
             @ w.transpose(-1, -2).reshape(1, h, group * dv, dv)
             + weights["conv_bias"][level].reshape(1, h, 1, dv))
        if level + 1 == levels:
            break
        y = causal_band_attention(project(c, weights["level_query"][level]),
                                  project(c, weights["level_key"][level]),
                                  project(c, weights["level_value"][level]), group - 1)
    top = c.shape[2]
    t = torch.arange(n).reshape(n, 1)
    j = torch.arange(top).reshape(1, top)
    visible = (j + 1) * group ** levels <= t                               # [T, top]
    scores = scale * project(y0, weights["cross_query"]) @ \
        project(c, weights["cross_key"]).transpose(-1, -2)
    # a query that sees no compressed token reads zero (masked with a finite number: no NaN)
    p = torch.softmax(scores.masked_fill(~visible, -1e30), dim=-1) * visible
    return y0 + p @ project(c, weights["cross_value"])


CONV_FIELDS = ("conv_weight", "conv_bias", "level_query", "level_key", "level_value",
               "cross_query", "cross_key", "cross_value")


# ------------------------------------------------------------------ cases ---

def flops_macchiato(T):
    """bench/flop_models.hpp macchiato_token_flops, times the tokens and heads."""
    L, w = MACCHIATO["latents"], MACCHIATO["window"]
    return B * T * H * (4.0 * L * D + 2.0 * (w + 1) * (D + D))


def flops_lavo(T):
    """bench/flop_models.hpp lavo_forward_flops (causal)."""
    r, w = LAVO["bases"], LAVO["window"]
    keys = sum(min(t + 1, w) for t in range(T))
    return B * H * (4.0 * keys * D + 6.0 * r * D * T)


def flops_conv(T):
    """bench/flop_models.hpp conv_compressed_forward_flops (causal, Dk = Dv = D)."""
    M, levels = CONV["group"], CONV["levels"]

    def window(n):
        return 2.0 * sum(min(j, M - 1) + 1 for j in range(n)) * (D + D)
    flops, n = window(T), T
    for level in range(1, levels + 1):
        flops += 2.0 * n * D * D
        n //= M
        if level < levels:
            flops += n * 2.0 * D * (2 * D + D) + window(n)
    reads = sum(t // M ** levels for t in range(T))
    return B * H * (flops + T * 2.0 * D * D + n * 2.0 * D * (D + D) + 2.0 * reads * (D + D))


class Case:
    """One mechanism: its inputs (named, [B, H, T, *]) and learned parameters, the
    function under test, and how latte-peer-check reads them."""

    def __init__(self, name, T, dtype, generator):
        self.name, self.T, self.dtype = name, T, dtype
        normal = lambda *shape, std=1.0: (torch.randn(*shape, generator=generator,  # noqa: E731
                                                      dtype=torch.float64) * std)
        self.fixed = {}    # constants of the function (not differentiated)
        self.params = {}   # learned parameters, float64 masters: name -> tensor or list
        if name == "macchiato":
            L, w = MACCHIATO["latents"], MACCHIATO["window"]
            self.inputs = dict(query_logits=normal(B, H, T, L + 1), key_logits=normal(B, H, T, L),
                               window_queries=normal(B, H, T, D), window_keys=normal(B, H, T, D),
                               values=normal(B, H, T, D))
            self.meta = dict(L=L, Dk=D, Dv=D, window=w)
            self.fixed["rope"] = rope_tables(T, D, dtype)
            self.function = lambda q, k, wq, wk, v: macchiato(q, k, wq, wk, v, w, self.fixed["rope"])
            self.L, self.flops = L, flops_macchiato(T)
        elif name == "lavo":
            r, w = LAVO["bases"], LAVO["window"]
            self.inputs = dict(queries=normal(B, H, T, D), keys=normal(B, H, T, D),
                               values=normal(B, H, T, D))
            self.meta = dict(d=D, r=r, window=w)
            # the paper's orthonormal bases (rows of Q from a QR), fixed; P learned
            self.fixed["bases"] = torch.linalg.qr(normal(H, D, D))[0][:, :, :r].transpose(1, 2)
            self.params["relative_bias"] = normal(H, 2 * w - 1, std=0.5)
            bases = self.fixed["bases"].to(dtype)
            self.function = lambda q, k, v, P: lavo(q, k, v, P, bases, w)
            self.L, self.flops = r, flops_lavo(T)
        elif name == "conv_compressed":
            M, levels = CONV["group"], CONV["levels"]
            self.inputs = dict(queries=normal(B, H, T, D), keys=normal(B, H, T, D),
                               values=normal(B, H, T, D))
            self.meta = dict(Dk=D, Dv=D, M=M, levels=levels)
            # bench/conv_compressed_weights.hpp's draw: normals of std 1 / sqrt(fan-in)
            per_level = levels - 1
            self.params = dict(
                conv_weight=[normal(H, M, D, D, std=1 / math.sqrt(M * D)) for _ in range(levels)],
                conv_bias=[normal(H, D, std=0.5) for _ in range(levels)],
                level_query=[normal(H, D, D, std=1 / math.sqrt(D)) for _ in range(per_level)],
                level_key=[normal(H, D, D, std=1 / math.sqrt(D)) for _ in range(per_level)],
                level_value=[normal(H, D, D, std=1 / math.sqrt(D)) for _ in range(per_level)],
                cross_query=normal(H, D, D, std=1 / math.sqrt(D)),
                cross_key=normal(H, D, D, std=1 / math.sqrt(D)),
                cross_value=normal(H, D, D, std=1 / math.sqrt(D)))

            def function(q, k, v, *flat):
                weights, at = {}, 0
                for field in CONV_FIELDS:  # the per-level lists, then the cross projections
                    if isinstance(self.params[field], list):
                        count = len(self.params[field])
                        weights[field], at = list(flat[at:at + count]), at + count
                    else:
                        weights[field], at = flat[at], at + 1
                return conv_compressed(q, k, v, weights, M, levels)
            self.function = function
            self.L, self.flops = M, flops_conv(T)
        else:
            raise ValueError(name)

    def param_list(self):
        """The learned parameters in the function's argument order, flat."""
        flat = []
        for value in self.params.values():
            flat += value if isinstance(value, list) else [value]
        return flat

    def arguments(self):
        """Inputs then parameters, in the timed dtype."""
        return [x.to(self.dtype) for x in list(self.inputs.values()) + self.param_list()]

    def write(self, directory):
        """Everything latte-peer-check reads: meta.txt, inputs in latte's [B, T, H, *]
        layout and the timed dtype, parameters in float64."""
        sizes = dict(B=B, T=self.T, H=H, **self.meta)
        with open(os.path.join(directory, "meta.txt"), "w") as meta:
            meta.writelines(f"{key} {value}\n" for key, value in sizes.items())
        np_dtype = np.float32 if self.dtype == torch.float32 else np.float64
        for key, x in self.inputs.items():
            x.to(self.dtype).permute(0, 2, 1, 3).contiguous().numpy().astype(np_dtype).tofile(
                os.path.join(directory, key + ".bin"))
        saved = dict(self.params)
        if "bases" in self.fixed:
            saved["bases"] = self.fixed["bases"]
        for key, value in saved.items():
            for i, x in enumerate(value if isinstance(value, list) else [value]):
                suffix = f"_{i}" if isinstance(value, list) else ""
                x.contiguous().numpy().astype(np.float64).tofile(
                    os.path.join(directory, key + suffix + ".bin"))


def check(name, T, dtype, tool, seed):
    """Max |torch - latte| of the forward at T tokens in `dtype`, and max |out|."""
    case = Case(name, T, dtype, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ours = case.function(*case.arguments())
    with tempfile.TemporaryDirectory() as directory:
        case.write(directory)
        dtype_name = "float32" if dtype == torch.float32 else "float64"
        subprocess.run([tool, name, dtype_name, directory], check=True)
        latte = np.fromfile(os.path.join(directory, "out.bin"),
                            dtype=np.float32 if dtype == torch.float32 else np.float64)
    latte = torch.from_numpy(latte).reshape(B, T, H, -1).permute(0, 2, 1, 3)
    return (ours.to(torch.float64) - latte.to(torch.float64)).abs().max().item(), \
        latte.abs().max().item()


def check_gradients():
    """Outputs and autograd gradients of the blocked forms above against the explicit
    T x T transcriptions of tests/golden/make_gradient_golden.py (float64, small sizes,
    windows and groups small enough that several blocks, chunks and levels take part).
    Returns the largest difference per mechanism."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "tests", "golden"))
    import make_gradient_golden as golden  # sets torch's default dtype to float64
    generator = torch.Generator().manual_seed(2)
    b, h, dim = 1, 3, 8
    normal = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    bthd = lambda x: x.permute(0, 2, 1, 3)  # noqa: E731  ([B, H, T, *] <-> [B, T, H, *])

    def largest(function, reference, arguments, d_out):
        results = []
        for f in (function, reference):
            leaves = [x.detach().clone().requires_grad_(True) for x in arguments]
            out = f(*leaves)
            results.append([out.detach()] + list(torch.autograd.grad((out * d_out).sum(), leaves)))
        return max((x - y).abs().max().item() for x, y in zip(*results))

    errors = {}
    T, w, latents = 300, 130, 5  # w = 130: blocks of 192 queries; 3 chunks of 128
    args = [normal(b, h, T, latents + 1), 3 * normal(b, h, T, latents), normal(b, h, T, dim),
            normal(b, h, T, dim), normal(b, h, T, dim)]
    rope = rope_tables(T, dim, torch.float64)
    errors["macchiato"] = largest(
        lambda *x: macchiato(*x, w, rope),
        lambda *x: bthd(golden.macchiato(*map(bthd, x), True, w, rope=True)),
        args, normal(b, h, T, dim))
    T, w, r = 150, 8, 6
    bases = torch.linalg.qr(normal(h, dim, dim))[0][:, :, :r].transpose(1, 2)
    errors["lavo"] = largest(
        lambda q, k, v, P: lavo(q, k, v, P, bases, w),
        lambda q, k, v, P: bthd(golden.lavo(bthd(q), bthd(k), bthd(v), bases, P, True, w)),
        [normal(b, h, T, dim) for _ in range(3)] + [normal(h, 2 * w - 1)], normal(b, h, T, dim))
    T, M, levels = 150, 4, 2
    shapes = dict(conv_weight=[(h, M, dim, dim)] * levels, conv_bias=[(h, dim)] * levels,
                  level_query=[(h, dim, dim)], level_key=[(h, dim, dim)],
                  level_value=[(h, dim, dim)], cross_query=(h, dim, dim),
                  cross_key=(h, dim, dim), cross_value=(h, dim, dim))
    flat = [normal(*shape) / math.sqrt(shape[-1]) for field in CONV_FIELDS
            for shape in (shapes[field] if isinstance(shapes[field], list) else [shapes[field]])]

    def weights(values):
        out, at = {}, 0
        for field in CONV_FIELDS:
            count = len(shapes[field]) if isinstance(shapes[field], list) else 0
            out[field], at = (list(values[at:at + count]), at + count) if count else \
                (values[at], at + 1)
        return out
    errors["conv_compressed"] = largest(
        lambda q, k, v, *x: conv_compressed(q, k, v, weights(x), M, levels),
        lambda q, k, v, *x: bthd(golden.conv_compressed(bthd(q), bthd(k), bthd(v), weights(x),
                                                        True, M, levels, M - 1, 0)),
        [normal(b, h, T, dim) for _ in range(3)] + flat, normal(b, h, T, dim))
    return errors


def forward_backward(function, arguments, d_out):
    """The mechanism's forward, then the gradients of (out * d_out).sum() with respect
    to every input and learned parameter."""
    leaves = [x.detach().requires_grad_(True) for x in arguments]
    out = function(*leaves)
    return torch.autograd.grad((out * d_out).sum(), leaves)


def main():
    arguments = parser("4096,16384", time_cap=300.0)
    arguments.add_argument("--mechanisms", default="macchiato,lavo,conv_compressed")
    arguments.add_argument("--check-t", type=int, default=1024,
                           help="length of the check against latte's forward")
    arguments.add_argument("--latte-peer-check", default="build/bench/latte-peer-check")
    arguments.add_argument("--check-gradients", action="store_true",
                           help="only compare outputs and gradients with the explicit T x T "
                                "transcriptions of tests/golden/make_gradient_golden.py (float64)")
    args = arguments.parse_args()
    if args.check_gradients:
        for name, error in check_gradients().items():
            print(f"{name}: max |blocked - explicit| over the output and every gradient: {error:.2e}")
            if error > 1e-10:
                sys.exit(f"torch_mechanisms.py: {name}'s blocked form disagrees with the explicit one")
        return
    torch.set_num_threads(args.threads)
    mechanisms = args.mechanisms.split(",")
    for name in mechanisms:
        # conv-compression's cross read starts at token M^L: check past its second top-level token
        T = max(args.check_t, 2 * CONV["group"] ** CONV["levels"]) if name == "conv_compressed" \
            else args.check_t
        for dtype, tolerance in ((torch.float32, 1e-5), (torch.float64, 1e-10)):
            error, scale = check(name, T, dtype, args.latte_peer_check, seed=1)
            bound = tolerance * max(1.0, scale)
            verdict = "ok" if error <= bound else "MISMATCH"
            print(f"# check {name} T={T} {str(dtype)[6:]}: max |torch - latte| = "
                  f"{error:.3e} (max |out| {scale:.3f}, bound {bound:.1e}) {verdict}",
                  file=sys.stderr, flush=True)
            if error > bound:
                sys.exit(f"torch_mechanisms.py: the torch {name} does not match latte's forward; "
                         "nothing timed")
    for name in mechanisms:
        previous = None
        for T in lengths(args.t):
            if previous and previous[1] * T / previous[0] > args.time_cap:
                print(f"# {name} T={T} skipped (predicted past --time-cap)", file=sys.stderr)
                continue
            case = Case(name, T, torch.float32, torch.Generator().manual_seed(T))
            inputs = case.arguments()
            d_out = torch.randn(B, H, T, D)
            seconds = best_time(lambda: forward_backward(case.function, inputs, d_out),
                                args.min_time)
            previous = (T, seconds)
            print(csv_row(f"{name}_forward_backward", "causal", "torch", B, T, H, case.L, D,
                          seconds, 3 * case.flops), flush=True)


if __name__ == "__main__":
    main()
