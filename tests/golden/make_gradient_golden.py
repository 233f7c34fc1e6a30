#!/usr/bin/env python3
"""Golden gradients for latte's backward passes, from PyTorch autograd.

Each mechanism is transcribed in plain torch, float64, from its definition in the
explicit T x T form (never latte's recurrences or chunked scans), or, for cosFormer
and LeaPformer, from the official code that tests/golden/make_linear_golden.py
already re-implements in numpy (the torch transcriptions below are checked against
those numpy functions to 1e-13 before anything is written). For every case the
script draws the inputs and a d_out, and writes the output and
torch.autograd.grad(sum(d_out * out)) with respect to every input and learned
parameter into gradient_golden.hpp next to this file, for
tests/test_golden_gradients.cpp (Latte, softmax) and the linear family's backward
tests. Inputs are rounded to float32 values so the same numbers feed the float and
double tests; layouts are latte's [B, T, H, D].

Transcribed:
  * Latte (paper 000 eqs. 5 and 10, DESIGN §3.2): p(l|t) = softmax_l(q_t);
    p(s|l,t) = softmax over s <= t (causal) or all s (bidirectional) of k_{s,l};
    o_t = sum_s [sum_l p(l|t) p(s|l,t)] R^{t-s} v_s. R is VAPOR's rotation (paper 000
    App. B.3, eq. 22; include/latte/policies/positional.hpp): R^n turns each value
    pair (2i, 2i+1) by n * theta_{h,i}, [x, y] -> [cos x - sin y, sin x + cos y];
    NoPositional is R = I. VAPOR's angles [H, Dv/2] are learned: their gradient is
    written too. B=2, T=9, H=2, L=5, Dv=6.
  * Softmax attention (DESIGN §3.1): softmax_s(q_t . k_s / sqrt(Dk)) over s <= t
    (causal), all s (bidirectional), and FlashAttention's window
    t - left <= s <= t + right intersected with that. B=2, T=7, H=2, Dk=5, Dv=6.
  * Linear family (DESIGN §3.3), B=2, T=6 (cross: T=5 queries, S=9 keys), H=2,
    Dk=8, Dv=6:
      - cosFormer: CosformerAttention.left_product (ReLU features, 1-based index
        i * pi / 2 / M, M = max(T, S), causal mask, clamp_min(1e-6)), i.e. latte's
        CosFormer with P = (i + 1) / M;
      - LeaPformer: leapformer_attn_train (ReLU features; LeaP modules
        Linear(8, 2) -> ReLU -> Linear(2, 1) -> Sigmoid on relu(q) and relu(k);
        fairseq's future mask; clamp_min(0.1)), with modules, and with given
        proportion tensors [B, T, H] in place of the modules' outputs;
      - elu+1 linear attention: phi = elu + 1, o_t = sum_s (phi(q_t) . phi(k_s)) v_s /
        (sum_s phi(q_t) . phi(k_s) + 1e-6) over s <= t or all s;
      - RoPE linear attention: the same with the numerator's features rotated,
        (R^t phi(q_t)) . (R^s phi(k_s)), theta_i = 10000^(-2i/Dk), and the un-rotated
        denominator (RoFormer eq. 19, latte's default); additive 1e-6.
  * Latte Macchiato (paper 000 §2.3 eqs. 13-16, DESIGN §3.2): p(l|t) = softmax over
    the L + 1 query logits; o_t = sum_s [p(0|t) p0(s|t) R0^{t-s} + sum_{l>=1} p(l|t)
    p(s|l,t) R^{t-s}] v_s with p0 the softmax of (R^t q'_t) . (R^s k'_s) / sqrt(Dk)
    over the window t - w <= s <= t (causal) or |t - s| <= w, RoPE's angles
    10000^(-2i/Dk) (fixed), VAPOR's R with learned angles [H, Dv/2], R0 = R when
    VAPOR acts on every state and I otherwise. B=2, T=9, H=2, L=4, Dk=4, Dv=6, w=3.
  * Token mixers (paper 000 §2.4, DESIGN §3.2): ShortConv y_t = b + sum_{i<K} w_i x_{t-i}
    (K = 3), and Griffin's RG-LRU r = sigmoid(x W_a + b_a), i = sigmoid(x W_x + b_x),
    log a = -8 r softplus(Lambda), h_t = a h_{t-1} + sqrt(1 - a^2) (i x_t), y = h. B=2, T=7, C=5.
  * A layer (latte's MacchiatoLayer<Causal, RGLRU>, paper 000's Latte-RGLRU-SWA): y = RG-LRU(x),
    query / key logits from y, window queries / keys and values from x (row vector times
    [model_dim, H * width] matrices), causal Macchiato with a RoPE window, out = o W_o.
    B=2, T=8, model_dim=6, H=2, L=3, Dk=2, Dv=4, w=3.

Arrays (each 4-D [B, T, H, D] unless noted; `out` is the forward's output):
  latte/<case>/{query_logits, key_logits, values, d_out, out,
                d_query_logits, d_key_logits, d_values}
      case: causal/no_positional, causal/vapor, bidirectional/no_positional,
            bidirectional/vapor, causal/spread (key logits = a per-latent offset
            in [-1000, 1000] + a rising trend (slope in [0, 3] per token) + noise:
            exp overflows without the running maximum, which moves at most steps);
      vapor cases also angles and d_angles [H, Dv/2].
  softmax/<case>/{queries, keys, values, d_out, out, d_queries, d_keys, d_values}
      case: causal, bidirectional, causal_window (left 2), bidirectional_window
            (left 2, right 1).
  linear/self/{queries, keys, values, d_out}, linear/cross/{queries, keys, values,
      d_out}: the inputs shared by the linear cases (cross: keys and values have S).
  linear/<case>/{out, d_queries, d_keys, d_values}
      case: cosformer/{causal, bidirectional, cross}, elu/{causal, bidirectional,
            cross}, rope/{causal, bidirectional}, leap_modules/{causal,
            bidirectional}, leap_proportions/{causal, bidirectional};
      leap_modules/<dir>/{d_query_module, d_key_module}/{w1 [2, 8], b1 [2], w2 [2],
            b2 [1]} (the modules themselves: linear/leap/{query,key}/{w1,b1,w2,b2});
      leap_proportions: inputs linear/leap_proportions/{query, key} [B, T, H] and
            linear/leap_proportions/<dir>/{d_query_proportions, d_key_proportions}.

  macchiato/<case>/{query_logits [.., L+1], key_logits, window_queries, window_keys,
                   values, d_out, out, d_query_logits, d_key_logits, d_window_queries,
                   d_window_keys, d_values} (+ angles, d_angles [H, Dv/2] with VAPOR)
      case: causal/plain, causal/vapor_rope (VAPOR on the latent states, RoPE
            window), causal/vapor_all_states, bidirectional/plain,
            bidirectional/vapor_rope, bidirectional/vapor_all_states.

  mixer/short_conv/{x, kernel [K, C], bias [C], d_y, y, d_x, d_kernel, d_bias}
  mixer/rglru/{x, recurrence_gate [C, C], recurrence_bias, input_gate, input_bias, lambda, d_y,
               y, d_x, d_recurrence_gate, d_recurrence_bias, d_input_gate, d_input_bias, d_lambda}
  layer/macchiato_rglru/{x, d_out, out, d_x} and for each weight W of projections/{query_logits,
               key_logits, window_queries, window_keys, values}, output, mixer/{recurrence_gate,
               recurrence_bias, input_gate, input_bias, lambda}: W and d_W (same path with d_).

  lavo/<case>/{queries, keys, values, bases [H, r, d], relative_bias [H, 2w - 1], d_out, out,
               d_queries, d_keys, d_values, d_bases, d_relative_bias}
      case: causal, causal_local_only (o = F_local while the memory is empty), bidirectional;
  lavo/cross/{queries, source, bases, d_out, out, d_queries, d_source, d_bases}

  conv/<case>/{queries, keys, values, d_out, out, d_queries, d_keys, d_values} and
      conv/<case>/weights/{<field>_<i>, d_<field>_<i>} for field in conv_weight, conv_bias,
      level_query, level_key, level_value (i = 0 .. per level) and cross_query, cross_key,
      cross_value (i = 0); case: causal_l1, causal_l2, bidirectional_l2 (M = 2, default windows).

Usage: .venv-peers/bin/python tests/golden/make_gradient_golden.py
       (needs torch and numpy: bench/peers/setup_peers.sh makes that environment)
"""
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_linear_golden as linear_golden  # noqa: E402  (its numpy official code, its writer)

SEED = 20240622
torch.set_default_dtype(torch.float64)

LATTE = dict(B=2, T=9, H=2, L=5, Dv=6)
SOFTMAX = dict(B=2, T=7, H=2, Dk=5, Dv=6)
LINEAR = dict(B=2, T=6, T_CROSS=5, S_CROSS=9, H=2, Dk=8, Dv=6, LEAP_FACTOR=4)
MACCHIATO = dict(B=2, T=9, H=2, L=4, Dk=4, Dv=6, window=3)
MIXER = dict(B=2, T=7, C=5, K=3)
LAYER = dict(B=2, T=8, model_dim=6, H=2, L=3, Dk=2, Dv=4, window=3)
LAVO = dict(B=2, T=10, H=2, d=6, r=4, window=3, S_CROSS=7)
CONV = dict(B=2, T=9, H=2, Dk=3, Dv=4, M=2)
SPREAD = 1000.0


def f32(x):
    """float64 tensor holding float32 values."""
    return torch.as_tensor(np.asarray(x, dtype=np.float32).astype(np.float64))


def rotate_pairs(x, angle):
    """[..., D] with per-pair angles [..., D/2]: [x, y] -> [c x - s y, s x + c y]."""
    pairs = x.unflatten(-1, (-1, 2))
    c, s = torch.cos(angle), torch.sin(angle)
    first, second = pairs[..., 0], pairs[..., 1]
    return torch.stack([c * first - s * second, s * first + c * second], -1).flatten(-2)


def allowed(t, s, causal, left=None, right=None):
    """[t, s] mask: s <= t when causal; t - left <= s <= t + right with a window."""
    ti, si = torch.arange(t)[:, None], torch.arange(s)[None, :]
    mask = torch.ones(t, s, dtype=torch.bool)
    if causal:
        mask &= si <= ti
    if left is not None:
        mask &= (si >= ti - left) & (si <= ti + right)
    return mask


# --------------------------------------------------------------------- Latte --

def latte(q, k, v, causal, angles=None):
    """o_t = sum_s [sum_l p(l|t) p(s|l,t)] R^{t-s} v_s, explicit T x T."""
    b, t, h, latents = q.shape
    p_latent = torch.softmax(q, dim=-1)                                  # p(l|t)
    logits = k[:, None].expand(b, t, t, h, latents)                      # [b, t, s, h, l]
    mask = allowed(t, t, causal)[None, :, :, None, None]
    p_token = torch.softmax(logits.masked_fill(~mask, -math.inf), dim=2)  # p(s|l,t)
    weights = torch.einsum("bthl,btshl->btsh", p_latent, p_token)         # p(s|t)
    if angles is None:
        return torch.einsum("btsh,bshd->bthd", weights, v)
    distance = (torch.arange(t)[:, None] - torch.arange(t)[None, :]).to(v.dtype)  # t - s
    turned = rotate_pairs(v[:, None].expand(b, t, t, h, v.shape[-1]),
                          distance[None, :, :, None, None] * angles[None, None, None])
    return torch.einsum("btsh,btshd->bthd", weights, turned)


# ----------------------------------------------------------------- Macchiato --

def macchiato(q, k, wq, wk, v, causal, window, angles=None, rope=False, vapor_on_window=False):
    """o_t = sum_s [p(0|t) p0(s|t) R0^{t-s} + sum_{l>=1} p(l|t) p(s|l,t) R^{t-s}] v_s."""
    b, t, h, latents = k.shape
    p_all = torch.softmax(q, dim=-1)                                     # p(l|t), l = 0..L
    logits = k[:, None].expand(b, t, t, h, latents)                      # [b, t, s, h, l]
    mask = allowed(t, t, causal)[None, :, :, None, None]
    p_token = torch.softmax(logits.masked_fill(~mask, -math.inf), dim=2)  # p(s|l,t)
    latent = torch.einsum("bthl,btshl->btsh", p_all[..., 1:], p_token)
    if rope:
        key_dim = wq.shape[-1]
        theta = 10000.0 ** (-2.0 * torch.arange(key_dim // 2) / key_dim)
        turn = torch.arange(t).to(wq.dtype)[None, :, None, None] * theta
        wq, wk = rotate_pairs(wq, turn), rotate_pairs(wk, turn)
    scores = torch.einsum("bthd,bshd->btsh", wq, wk) / math.sqrt(wq.shape[-1])
    window_mask = allowed(t, t, causal, window, 0 if causal else window)[None, :, :, None]
    local = p_all[..., 0][:, :, None] * torch.softmax(scores.masked_fill(~window_mask, -math.inf), 2)

    def read(weights, rotated):
        if not rotated:
            return torch.einsum("btsh,bshd->bthd", weights, v)
        distance = (torch.arange(t)[:, None] - torch.arange(t)[None, :]).to(v.dtype)  # t - s
        turned = rotate_pairs(v[:, None].expand(b, t, t, h, v.shape[-1]),
                              distance[None, :, :, None, None] * angles[None, None, None])
        return torch.einsum("btsh,btshd->bthd", weights, turned)
    return read(latent, angles is not None) + read(local, angles is not None and vapor_on_window)


# -------------------------------------------------------------------- mixers --

def lavo(q, k, v, bases, bias, causal, window, local_only=False):
    """LAVO (paper 002) over [B, T, H, d]: local softmax with the relative bias,
    the orthogonal memory of the local outputs (complete earlier windows when
    causal), o = (F_local + F_global) / 2 (F_local alone / 2 or whole while empty)."""
    T, d = q.shape[1], q.shape[3]
    scale = 1.0 / math.sqrt(d)
    qh, kh, vh = (x.permute(0, 2, 1, 3) for x in (q, k, v))              # [B, H, T, d]
    t = torch.arange(T).reshape(T, 1)
    s = torch.arange(T).reshape(1, T)
    allowed = (s <= t) & (s > t - window) if causal else (s - t).abs() < window
    offsets = (s - t + window - 1).clamp(0, 2 * window - 2)              # index into P
    scores = scale * qh @ kh.transpose(-1, -2) + bias[:, offsets].unsqueeze(0)
    local = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1) @ vh
    projected = local @ bases.transpose(-1, -2).unsqueeze(0)             # [B, H, T, r]: B f_s
    if causal:
        n = (torch.arange(T) // window) * window                         # tokens in memory
        prefix = torch.cat([torch.zeros_like(projected[:, :, :1]), projected.cumsum(2)], dim=2)
        mean = prefix[:, :, n] / n.clamp(min=1).reshape(1, 1, T, 1).to(q.dtype)
        empty = (n == 0).reshape(1, 1, T, 1)
    else:
        mean = projected.mean(2, keepdim=True).expand_as(projected)
        empty = torch.zeros(1, 1, T, 1, dtype=torch.bool)
    global_ = lavo_read(qh, mean, bases, scale)
    out = torch.where(empty, local if local_only else local / 2, (local + global_) / 2)
    return out.permute(0, 2, 1, 3)


def lavo_read(qh, mean, bases, scale):
    """softmax_i(scale H_i (b_i . q)) weighted sum of H_i b_i; qh [B, H, T, d], mean [B, H, T, r]."""
    bq = qh @ bases.transpose(-1, -2).unsqueeze(0)                       # [B, H, T, r]
    p = torch.softmax(scale * mean * bq, dim=-1)
    return (p * mean) @ bases.unsqueeze(0)


def lavo_cross(q, source, bases):
    d = q.shape[3]
    qh, sh = q.permute(0, 2, 1, 3), source.permute(0, 2, 1, 3)
    mean = (sh @ bases.transpose(-1, -2).unsqueeze(0)).mean(2, keepdim=True)
    return lavo_read(qh, mean.expand(-1, -1, qh.shape[2], -1), bases, 1.0 / math.sqrt(d)).permute(0, 2, 1, 3)


def conv_compressed(q, k, v, weights, causal, M, L, left, right):
    """Convolutional-compression attention (paper 003 §4, DESIGN §3.5) over
    [B, T, H, *]: window attention, L convolutions (kernel = stride = M, with the
    level's own window attention between them), the block-causal cross read of
    the top level, o = y0 + cross. `weights` holds the lists conv_weight [H, M,
    Dv, Dv], conv_bias [H, Dv], level_query / level_key [H, Dk, Dv], level_value
    [H, Dv, Dv] and cross_query / cross_key [H, Dk, Dv], cross_value [H, Dv, Dv]."""
    B, T, H, Dk = q.shape
    Dv = v.shape[3]
    scale = 1.0 / math.sqrt(Dk)

    def window_attend(qh, kh, vh):  # [B, H, n, *]
        n = qh.shape[2]
        t, s = torch.arange(n).reshape(n, 1), torch.arange(n).reshape(1, n)
        allowed = (s >= t - left) & (s <= t + right) & ((s <= t) if causal else True)
        scores = scale * qh @ kh.transpose(-1, -2)
        return torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1) @ vh

    def project(x, w):  # x [B, H, n, in], w [H, out, in]
        return torch.einsum("bhni,hoi->bhno", x, w)

    qh, kh, vh = (x.permute(0, 2, 1, 3) for x in (q, k, v))
    y0 = window_attend(qh, kh, vh)
    y = y0
    for level in range(1, L + 1):
        n = y.shape[2] // M
        groups = y[:, :, :n * M].reshape(B, H, n, M, Dv)
        c = (torch.einsum("bhnid,hiod->bhno", groups, weights["conv_weight"][level - 1])
             + weights["conv_bias"][level - 1].reshape(1, H, 1, Dv))
        if level == L:
            break
        y = window_attend(project(c, weights["level_query"][level - 1]),
                          project(c, weights["level_key"][level - 1]),
                          project(c, weights["level_value"][level - 1]))
    n = c.shape[2]
    t, j = torch.arange(T).reshape(T, 1), torch.arange(n).reshape(1, n)
    visible = ((j + 1) * M ** L - 1 < t) if causal else torch.ones(T, n, dtype=torch.bool)
    scores = scale * project(y0, weights["cross_query"]) @ project(c, weights["cross_key"]).transpose(-1, -2)
    # A query that sees no compressed token reads zero (no NaN: masked, not -inf).
    p = torch.softmax(scores.masked_fill(~visible, -1e30), dim=-1) * visible
    return (y0 + p @ project(c, weights["cross_value"])).permute(0, 2, 1, 3)


def short_conv(x, kernel, bias):
    """y_t = b + sum_{i<K} w_i x_{t-i}, x_{s<0} = 0; x [B, T, C]."""
    y = bias.expand_as(x).clone()
    for i in range(kernel.shape[0]):
        y[:, i:] = y[:, i:] + kernel[i] * x[:, :x.shape[1] - i]
    return y


def rglru(x, w_a, b_a, w_x, b_x, lam, c=8.0):
    """Griffin's RG-LRU from h_{-1} = 0, y = h."""
    r, i = torch.sigmoid(x @ w_a + b_a), torch.sigmoid(x @ w_x + b_x)
    log_a = -c * r * torch.nn.functional.softplus(lam)
    a, multiplier = torch.exp(log_a), torch.sqrt(-torch.expm1(2 * log_a))
    h, ys = torch.zeros_like(x[:, 0]), []
    for t in range(x.shape[1]):
        h = a[:, t] * h + multiplier[:, t] * (i[:, t] * x[:, t])
        ys.append(h)
    return torch.stack(ys, 1)


# ------------------------------------------------------------------- softmax --

def softmax_attention(q, k, v, causal, left=None, right=None):
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = scale * torch.einsum("bthd,bshd->bths", q, k)
    mask = allowed(q.shape[1], k.shape[1], causal, left, right)[None, :, None, :]
    return torch.einsum("bths,bshd->bthd", torch.softmax(scores.masked_fill(~mask, -math.inf), -1), v)


# -------------------------------------------------------------------- linear --
# On the official code's [B * H, N, d] layout (make_linear_golden.to_heads).

def to_heads(x):
    b, n, h, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(b * h, n, d)


def from_heads(x, b, h):
    bh, n, d = x.shape
    return x.reshape(b, h, n, d).permute(0, 2, 1, 3)


def cosformer_left_product(q, k, v, causal, eps=1e-6):
    """CosformerAttention.left_product (make_linear_golden.cosformer_left_product) in torch."""
    tgt_len, src_len = q.shape[1], k.shape[1]
    q, k = torch.relu(q), torch.relu(k)
    m = max(src_len, tgt_len)
    index = math.pi / 2 * torch.arange(1, m + 1).reshape(1, -1, 1)
    q_ = torch.cat([q * torch.sin(index[:, :tgt_len, :] / m), q * torch.cos(index[:, :tgt_len, :] / m)], -1)
    k_ = torch.cat([k * torch.sin(index[:, :src_len, :] / m), k * torch.cos(index[:, :src_len, :] / m)], -1)
    weights = torch.bmm(q_, k_.transpose(1, 2))
    if causal:  # attn_mask == -inf above the diagonal -> 0
        weights = weights.masked_fill(~allowed(tgt_len, tgt_len, True)[None], 0.0)
    denom = torch.clamp_min(weights.sum(dim=-1, keepdim=True), eps)
    return torch.bmm(weights / denom, v)


def leap_module(x, w1, b1, w2, b2):
    """nn.Sequential(Linear(d, d // f), ReLU(), Linear(d // f, 1), Sigmoid())."""
    return torch.sigmoid(torch.relu(x @ w1.T + b1) @ w2[None].T + b2)


def leapformer_attn_train(q, k, v, query_proportion, key_proportion, causal):
    """leapformer_attn_train (make_linear_golden.leapformer_attn_train) in torch;
    `*_proportion(relu(x))` gives the proportions [B * H, N, 1]."""
    q, k = torch.relu(q), torch.relu(k)
    tgt, src = query_proportion(q), key_proportion(k)
    half_pi = math.pi / 2
    q_sin, q_cos = q * torch.sin(half_pi * tgt), q * torch.cos(half_pi * tgt)
    k_sin, k_cos = k * torch.sin(half_pi * src), k * torch.cos(half_pi * src)
    attn_weights = q_sin @ k_sin.transpose(1, 2) + q_cos @ k_cos.transpose(1, 2)
    if causal:
        future = ~allowed(q.shape[1], q.shape[1], True)
        attn_weights = attn_weights.masked_fill(future[None], 0.0)
    attn_probs = attn_weights @ v
    if causal:
        norm_sin = torch.cumsum(k_sin, dim=1).transpose(1, 2)
        norm_cos = torch.cumsum(k_cos, dim=1).transpose(1, 2)
    else:
        norm_sin = k_sin.sum(dim=1)[..., None]
        norm_cos = k_cos.sum(dim=1)[..., None]
    prob_norm = q_sin @ norm_sin + q_cos @ norm_cos
    if causal:
        prob_norm = torch.diagonal(prob_norm, dim1=1, dim2=2)[..., None]
    return attn_probs / torch.clamp_min(prob_norm, 0.1)


def elu_linear(q, k, v, causal, rope=False, eps=1e-6):
    """sum_s w_ts v_s / (sum_s w'_ts + eps), phi = elu + 1; under RoPE w_ts uses
    R^t phi(q_t) . R^s phi(k_s) and w'_ts the un-rotated phi(q_t) . phi(k_s)."""
    phi_q, phi_k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    mask = allowed(q.shape[1], k.shape[1], causal)[None]
    plain = (phi_q @ phi_k.transpose(1, 2)).masked_fill(~mask, 0.0)
    scores = plain
    if rope:
        features = q.shape[-1]
        theta = 10000.0 ** (-2.0 * torch.arange(features // 2) / features)
        rq = rotate_pairs(phi_q, torch.arange(q.shape[1])[:, None] * theta[None])
        rk = rotate_pairs(phi_k, torch.arange(k.shape[1])[:, None] * theta[None])
        scores = (rq @ rk.transpose(1, 2)).masked_fill(~mask, 0.0)
    return (scores @ v) / (plain.sum(dim=-1, keepdim=True) + eps)


# ------------------------------------------------------------------- output --

def gradients(function, d_out, inputs):
    """out, and the gradient of sum(d_out * out) with respect to each of `inputs`."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = function(*leaves)
    return out.detach(), torch.autograd.grad((d_out * out).sum(), leaves)


def main():
    rng = np.random.default_rng(SEED)
    arrays = []

    def normal(*shape, scale=1.0):
        return f32(rng.normal(0.0, scale, size=shape))

    def uniform(low, high, *shape):
        return f32(rng.uniform(low, high, size=shape))

    def add(prefix, **named):
        arrays.extend((f"{prefix}/{name}", value.numpy()) for name, value in named.items())

    # Latte.
    B, T, H, L, Dv = (LATTE[x] for x in ("B", "T", "H", "L", "Dv"))
    for name, causal, vapor, spread in (("causal/no_positional", True, False, False),
                                        ("causal/vapor", True, True, False),
                                        ("bidirectional/no_positional", False, False, False),
                                        ("bidirectional/vapor", False, True, False),
                                        ("causal/spread", True, False, True)):
        if spread:  # per-latent offsets in [-1000, 1000], noise, and a rising trend
            offsets, slopes = uniform(-SPREAD, SPREAD, B, 1, H, L), uniform(0, 3, B, 1, H, L)
            q = normal(B, T, H, L, scale=2.0)
            k = f32(offsets + slopes * torch.arange(T).reshape(1, T, 1, 1) + normal(B, T, H, L, scale=2.0))
        else:
            q, k = normal(B, T, H, L, scale=2.0), normal(B, T, H, L, scale=2.0)
        v, d_out = uniform(-1, 1, B, T, H, Dv), normal(B, T, H, Dv)
        inputs = [q, k, v]
        if vapor:
            inputs.append(uniform(0.0, math.pi, H, Dv // 2))
        out, grads = gradients(lambda *x, c=causal: latte(*x[:3], c, *x[3:]), d_out, inputs)
        add(f"latte/{name}", query_logits=q, key_logits=k, values=v, d_out=d_out, out=out,
            d_query_logits=grads[0], d_key_logits=grads[1], d_values=grads[2])
        if vapor:
            add(f"latte/{name}", angles=inputs[3], d_angles=grads[3])

    # Softmax attention.
    B, T, H, Dk, Dv = (SOFTMAX[x] for x in ("B", "T", "H", "Dk", "Dv"))
    for name, causal, window in (("causal", True, (None, None)), ("bidirectional", False, (None, None)),
                                 ("causal_window", True, (2, 0)), ("bidirectional_window", False, (2, 1))):
        q, k = normal(B, T, H, Dk, scale=1.5), normal(B, T, H, Dk, scale=1.5)
        v, d_out = uniform(-1, 1, B, T, H, Dv), normal(B, T, H, Dv)
        out, grads = gradients(lambda *x, c=causal, w=window: softmax_attention(*x, c, *w),
                               d_out, [q, k, v])
        add(f"softmax/{name}", queries=q, keys=k, values=v, d_out=d_out, out=out,
            d_queries=grads[0], d_keys=grads[1], d_values=grads[2])

    # Linear family.
    B, T, H, Dk, Dv = (LINEAR[x] for x in ("B", "T", "H", "Dk", "Dv"))
    Tc, Sc = LINEAR["T_CROSS"], LINEAR["S_CROSS"]
    shapes = {"self": (T, T), "cross": (Tc, Sc)}
    inputs = {}
    for side, (tq, tk) in shapes.items():
        inputs[side] = (normal(B, tq, H, Dk), normal(B, tk, H, Dk), normal(B, tk, H, Dv),
                        normal(B, tq, H, Dv))
        add(f"linear/{side}", queries=inputs[side][0], keys=inputs[side][1],
            values=inputs[side][2], d_out=inputs[side][3])
    hidden = Dk // LINEAR["LEAP_FACTOR"]
    modules = {side: [f32(m.w1), f32(m.b1), f32(m.w2.reshape(-1)), f32(m.b2)]
               for side, m in (("query", linear_golden.LeaPModule(rng, Dk, LINEAR["LEAP_FACTOR"])),
                               ("key", linear_golden.LeaPModule(rng, Dk, LINEAR["LEAP_FACTOR"])))}
    assert modules["query"][0].shape == (hidden, Dk)
    for side, (w1, b1, w2, b2) in modules.items():
        add(f"linear/leap/{side}", w1=w1, b1=b1, w2=w2, b2=b2)
    given = {"query": uniform(0.0, 1.0, B, T, H), "key": uniform(0.0, 1.0, B, T, H)}
    add("linear/leap_proportions", **given)

    def heads_call(core, b=B, h=H):
        """A [B*H, N, d] core as a function of [B, T, H, d] tensors."""
        return lambda q, k, v, *rest: from_heads(core(to_heads(q), to_heads(k), to_heads(v), *rest), b, h)

    def proportions_of(x):  # [B, T, H] -> [B * H, T, 1]
        return x.permute(0, 2, 1).reshape(B * H, -1, 1)

    cases = []
    for direction, causal in (("causal", True), ("bidirectional", False)):
        cases += [
            (f"cosformer/{direction}", "self", heads_call(lambda q, k, v, c=causal: cosformer_left_product(q, k, v, c)), []),
            (f"elu/{direction}", "self", heads_call(lambda q, k, v, c=causal: elu_linear(q, k, v, c)), []),
            (f"rope/{direction}", "self", heads_call(lambda q, k, v, c=causal: elu_linear(q, k, v, c, rope=True)), []),
            (f"leap_modules/{direction}", "self",
             heads_call(lambda q, k, v, *m, c=causal: leapformer_attn_train(
                 q, k, v, lambda x: leap_module(x, *m[:4]), lambda x: leap_module(x, *m[4:]), c)),
             modules["query"] + modules["key"]),
            (f"leap_proportions/{direction}", "self",
             heads_call(lambda q, k, v, pq, pk, c=causal: leapformer_attn_train(
                 q, k, v, lambda _: proportions_of(pq), lambda _: proportions_of(pk), c)),
             [given["query"], given["key"]]),
        ]
    cases += [("cosformer/cross", "cross", heads_call(lambda q, k, v: cosformer_left_product(q, k, v, False)), []),
              ("elu/cross", "cross", heads_call(lambda q, k, v: elu_linear(q, k, v, False)), [])]
    outputs = {}
    for name, side, function, extra in cases:
        q, k, v, d_out = inputs[side]
        out, grads = gradients(function, d_out, [q, k, v] + extra)
        outputs[name] = out
        add(f"linear/{name}", out=out, d_queries=grads[0], d_keys=grads[1], d_values=grads[2])
        if name.startswith("leap_modules"):
            for i, module in enumerate(("d_query_module", "d_key_module")):
                add(f"linear/{name}/{module}",
                    **dict(zip(("w1", "b1", "w2", "b2"), grads[3 + 4 * i: 7 + 4 * i])))
        if name.startswith("leap_proportions"):
            add(f"linear/{name}", d_query_proportions=grads[3], d_key_proportions=grads[4])

    check_against_numpy(inputs, modules, outputs)

    # Latte Macchiato (drawn last: the arrays above keep their values).
    B, T, H, L, Dk, Dv, window = (MACCHIATO[x] for x in ("B", "T", "H", "L", "Dk", "Dv", "window"))
    for name, causal, vapor, rope, vapor_on_window in (
            ("causal/plain", True, False, False, False),
            ("causal/vapor_rope", True, True, True, False),
            ("causal/vapor_all_states", True, True, False, True),
            ("bidirectional/plain", False, False, False, False),
            ("bidirectional/vapor_rope", False, True, True, False),
            ("bidirectional/vapor_all_states", False, True, False, True)):
        q, k = normal(B, T, H, L + 1, scale=2.0), normal(B, T, H, L, scale=2.0)
        wq, wk = normal(B, T, H, Dk, scale=1.5), normal(B, T, H, Dk, scale=1.5)
        v, d_out = uniform(-1, 1, B, T, H, Dv), normal(B, T, H, Dv)
        inputs = [q, k, wq, wk, v]
        if vapor:
            inputs.append(uniform(0.0, math.pi, H, Dv // 2))
        out, grads = gradients(
            lambda *x, c=causal, r=rope, a=vapor_on_window: macchiato(*x[:5], c, window, *x[5:], rope=r,
                                                                     vapor_on_window=a),
            d_out, inputs)
        add(f"macchiato/{name}", query_logits=q, key_logits=k, window_queries=wq, window_keys=wk,
            values=v, d_out=d_out, out=out, d_query_logits=grads[0], d_key_logits=grads[1],
            d_window_queries=grads[2], d_window_keys=grads[3], d_values=grads[4])
        if vapor:
            add(f"macchiato/{name}", angles=inputs[5], d_angles=grads[5])

    # Token mixers and a Latte-RGLRU-SWA layer (drawn after everything above).
    B, T, C, K = (MIXER[x] for x in ("B", "T", "C", "K"))
    x, d_y = normal(B, T, C), normal(B, T, C)
    conv = [normal(K, C, scale=0.6), normal(C, scale=0.1)]
    y, grads = gradients(short_conv, d_y, [x] + conv)
    add("mixer/short_conv", x=x, kernel=conv[0], bias=conv[1], d_y=d_y, y=y, d_x=grads[0],
        d_kernel=grads[1], d_bias=grads[2])
    names = ("recurrence_gate", "recurrence_bias", "input_gate", "input_bias", "lambda")

    def rglru_weights(channels):
        return [normal(channels, channels, scale=1 / math.sqrt(channels)), normal(channels, scale=0.5),
                normal(channels, channels, scale=1 / math.sqrt(channels)), normal(channels, scale=0.5),
                uniform(-4.0, 2.0, channels)]
    weights = rglru_weights(C)
    y, grads = gradients(rglru, d_y, [x] + weights)
    add("mixer/rglru", x=x, d_y=d_y, y=y, d_x=grads[0], **dict(zip(names, weights)),
        **{f"d_{n}": g for n, g in zip(names, grads[1:])})

    B, T, M, H, L, Dk, Dv, window = (LAYER[x] for x in ("B", "T", "model_dim", "H", "L", "Dk", "Dv", "window"))
    x, d_out = normal(B, T, M), normal(B, T, M)
    inputs_of = (("query_logits", L + 1, True), ("key_logits", L, True), ("window_queries", Dk, False),
                 ("window_keys", Dk, False), ("values", Dv, False))
    projections = [normal(M, H * width, scale=1 / math.sqrt(M)) for _, width, _ in inputs_of]
    output = normal(H * Dv, M, scale=1 / math.sqrt(H * Dv))
    mixer = rglru_weights(M)

    def layer(x, *weights):
        projection, w_o, mix = weights[:5], weights[5], weights[6:]
        y = rglru(x, *mix)
        a = [((y if from_mixer else x) @ w).unflatten(-1, (H, width))
             for (_, width, from_mixer), w in zip(inputs_of, projection)]
        o = macchiato(*a, True, window, rope=True)
        return o.flatten(-2) @ w_o
    out, grads = gradients(layer, d_out, [x] + projections + [output] + mixer)
    add("layer/macchiato_rglru", x=x, d_out=d_out, out=out, d_x=grads[0])
    for (name, _, _), w, g in zip(inputs_of, projections, grads[1:6]):
        add("layer/macchiato_rglru/projections", **{name: w, f"d_{name}": g})
    add("layer/macchiato_rglru", output=output, d_output=grads[6])
    add("layer/macchiato_rglru/mixer", **dict(zip(names, mixer)),
        **{f"d_{n}": g for n, g in zip(names, grads[7:])})

    # LAVO (drawn after everything above).
    B, T, H, d, r, window, S = (LAVO[x] for x in ("B", "T", "H", "d", "r", "window", "S_CROSS"))
    for name, causal, local_only in (("causal", True, False), ("causal_local_only", True, True),
                                     ("bidirectional", False, False)):
        q, k = normal(B, T, H, d, scale=1.5), normal(B, T, H, d, scale=1.5)
        v, d_out = uniform(-1, 1, B, T, H, d), normal(B, T, H, d)
        bases, bias = normal(H, r, d, scale=0.7), normal(H, 2 * window - 1)
        out, grads = gradients(lambda *x, c=causal, lo=local_only: lavo(*x, c, window, lo), d_out,
                               [q, k, v, bases, bias])
        add(f"lavo/{name}", queries=q, keys=k, values=v, bases=bases, relative_bias=bias,
            d_out=d_out, out=out, d_queries=grads[0], d_keys=grads[1], d_values=grads[2],
            d_bases=grads[3], d_relative_bias=grads[4])
    q, source, d_out = normal(B, T, H, d, scale=1.5), normal(B, S, H, d, scale=1.5), normal(B, T, H, d)
    bases = normal(H, r, d, scale=0.7)
    out, grads = gradients(lavo_cross, d_out, [q, source, bases])
    add("lavo/cross", queries=q, source=source, bases=bases, d_out=d_out, out=out,
        d_queries=grads[0], d_source=grads[1], d_bases=grads[2])

    # Convolutional compression (drawn after everything above).
    B, T, H, Dk, Dv, M = (CONV[x] for x in ("B", "T", "H", "Dk", "Dv", "M"))
    for name, causal, L in (("causal_l1", True, 1), ("causal_l2", True, 2), ("bidirectional_l2", False, 2)):
        left, right = M - 1, (0 if causal else M - 1)
        q, k = normal(B, T, H, Dk, scale=1.5), normal(B, T, H, Dk, scale=1.5)
        v, d_out = uniform(-1, 1, B, T, H, Dv), normal(B, T, H, Dv)
        lists = {"conv_weight": [normal(H, M, Dv, Dv, scale=1 / math.sqrt(M * Dv)) for _ in range(L)],
                 "conv_bias": [normal(H, Dv, scale=0.5) for _ in range(L)],
                 "level_query": [normal(H, Dk, Dv, scale=1 / math.sqrt(Dv)) for _ in range(L - 1)],
                 "level_key": [normal(H, Dk, Dv, scale=1 / math.sqrt(Dv)) for _ in range(L - 1)],
                 "level_value": [normal(H, Dv, Dv, scale=1 / math.sqrt(Dv)) for _ in range(L - 1)],
                 "cross_query": [normal(H, Dk, Dv, scale=1 / math.sqrt(Dv))],
                 "cross_key": [normal(H, Dk, Dv, scale=1 / math.sqrt(Dv))],
                 "cross_value": [normal(H, Dv, Dv, scale=1 / math.sqrt(Dv))]}
        names = [(field, i) for field, tensors in lists.items() for i in range(len(tensors))]
        flat = [lists[field][i] for field, i in names]

        def call(q, k, v, *ws, c=causal, levels=L, lo=left, hi=right, names=names):
            weights = {field: [] for field in lists}
            for (field, _), w in zip(names, ws):
                weights[field].append(w)
            return conv_compressed(q, k, v, {f: (w if f.startswith(("conv", "level")) else w[0])
                                             for f, w in weights.items()}, c, M, levels, lo, hi)
        out, grads = gradients(call, d_out, [q, k, v] + flat)
        add(f"conv/{name}", queries=q, keys=k, values=v, d_out=d_out, out=out, d_queries=grads[0],
            d_keys=grads[1], d_values=grads[2])
        for (field, i), w, g in zip(names, flat, grads[3:]):
            add(f"conv/{name}/weights", **{f"{field}_{i}": w, f"d_{field}_{i}": g})

    linear_golden.write_header(
        arrays, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gradient_golden.hpp"),
        generated_by=["// Generated by tests/golden/make_gradient_golden.py (PyTorch autograd, float64,",
                      "// over plain torch transcriptions of each definition; see that script). Do not edit."],
        namespace="latte::test::gradient_golden",
        constants=[f"// Latte: {LATTE}", f"// Softmax: {SOFTMAX}", f"// Linear: {LINEAR}",
                   f"// Macchiato: {MACCHIATO}", f"// Mixers: {MIXER}", f"// Layer: {LAYER}",
                   f"// LAVO: {LAVO}", f"// Conv compression: {CONV}"])


def check_against_numpy(inputs, modules, outputs):
    """The torch transcriptions of the official code give make_linear_golden's numpy values."""
    B, H = LINEAR["B"], LINEAR["H"]
    lg = linear_golden

    class Module:  # make_linear_golden.LeaPModule's call on given weights
        def __init__(self, w1, b1, w2, b2):
            self.w1, self.b1, self.w2, self.b2 = (x.numpy() for x in (w1, b1, w2.reshape(1, -1), b2))
        __call__ = lg.LeaPModule.__call__

    q_leap, k_leap = Module(*modules["query"]), Module(*modules["key"])
    for name, side, want in (
            ("cosformer/causal", "self", lambda q, k, v: lg.cosformer_left_product(q, k, v, True)),
            ("cosformer/bidirectional", "self", lambda q, k, v: lg.cosformer_left_product(q, k, v, False)),
            ("cosformer/cross", "cross", lambda q, k, v: lg.cosformer_left_product(q, k, v, False)),
            ("leap_modules/causal", "self", lambda q, k, v: lg.leapformer_attn_train(q, k, v, q_leap, k_leap, True)),
            ("leap_modules/bidirectional", "self",
             lambda q, k, v: lg.leapformer_attn_train(q, k, v, q_leap, k_leap, False))):
        q, k, v = (lg.to_heads(x.numpy()) for x in inputs[side][:3])
        expected = lg.from_heads(want(q, k, v), B, H)
        error = np.abs(outputs[name].numpy() - expected).max() / np.abs(expected).max()
        assert error < 1e-13, f"{name}: torch and numpy transcriptions differ by {error}"


if __name__ == "__main__":
    main()
