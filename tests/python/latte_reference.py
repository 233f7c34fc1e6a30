"""Latte written out from its definition in NumPy float64, for the Python tests.

The explicit T x T attention matrix (paper 000 eqs. 5-8, VAPOR eq. 22), as
tests/oracles/latte_oracle.hpp builds it in C++, nothing shared with latte's
recurrences:

    p(l|t)   = softmax_l(q[t])
    p(s|l,t) = exp(k[s, l]) / sum_{s' in S(t)} exp(k[s', l]),  S(t) = {s <= t} or all s
    A[t, s]  = sum_l p(l|t) p(s|l,t)
    o[t]     = sum_s A[t, s] R^{t - s} v[s]        (R: VAPOR's rotation, or 1)
"""

import numpy as np


def rope_angles(heads, value_dim, base=10000.0):
    """VAPOR's default angles [H, Dv/2]: theta_i = base^(-2i/Dv), every head alike."""
    pairs = value_dim // 2
    theta = base ** (-2.0 * np.arange(pairs) / value_dim)
    return np.tile(theta, (heads, 1))


def attention_matrix(q, k, causal):
    """A[t, s] of one (batch, head): q, k [T, L]."""
    T = q.shape[0]
    p_latent = np.exp(q - q.max(axis=1, keepdims=True))
    p_latent /= p_latent.sum(axis=1, keepdims=True)
    weight = np.exp(k - k.max(axis=0, keepdims=True))  # a shift per latent cancels in each ratio
    A = np.zeros((T, T))
    for t in range(T):
        last = t + 1 if causal else T
        denominator = weight[:last].sum(axis=0)
        A[t, :last] = (p_latent[t] * weight[:last] / denominator).sum(axis=1)
    return A


def rotate(v, n, theta):
    """R^n v for one value row: pair i of v turned by n * theta[i]."""
    out = v.copy()
    pairs = len(theta)
    c, s = np.cos(n * theta), np.sin(n * theta)
    x, y = v[0:2 * pairs:2], v[1:2 * pairs:2]
    out[0:2 * pairs:2] = c * x - s * y
    out[1:2 * pairs:2] = s * x + c * y
    return out


def latte(q, k, v, causal=True, angles=None):
    """The Latte output [B, T, H, Dv] in float64; angles [H, Dv/2] for VAPOR."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    B, T, H, _ = q.shape
    out = np.zeros(v.shape)
    for b in range(B):
        for h in range(H):
            A = attention_matrix(q[b, :, h], k[b, :, h], causal)
            if angles is None:
                out[b, :, h] = A @ v[b, :, h]
                continue
            theta = np.asarray(angles, dtype=np.float64)[h]
            for t in range(T):
                out[b, t, h] = sum(A[t, s] * rotate(v[b, s, h], t - s, theta) for s in range(T))
    return out
