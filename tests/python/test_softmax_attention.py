"""latte.SoftmaxAttention from Python against scaled dot-product attention
written out in NumPy float64 (the explicit T x T matrix with its mask):

    allowed(t, s) = (not causal or s <= t) and (left is None or s >= t - left)
                    and (right is None or s <= t + right)
    o[t] = sum_s softmax_s(scale * q[t] . k[s] over allowed s) v[s]

forward on both backends and dtypes, with and without a window, decode
through the KV cache (pickled too), backward by central differences.
"""

import pickle

import numpy as np
import pytest

import latte
from gradient_check import directional_error

RNG = np.random.default_rng(7)
TOLERANCE = {np.float32: 2e-5, np.float64: 1e-12}
GRADIENT_TOLERANCE = {np.float32: 1e-4, np.float64: 1e-8}


def softmax_definition(q, k, v, causal, window=None, scale=None):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, H, Dk = q.shape
    scale = 1.0 / np.sqrt(Dk) if scale is None else scale
    left, right = window if window is not None else (None, None)
    t, s = np.arange(T)[:, None], np.arange(T)[None, :]
    allowed = np.ones((T, T), bool)
    if causal:
        allowed &= s <= t
    if left is not None:
        allowed &= s >= t - left
    if right is not None and not causal:
        allowed &= s <= t + right
    out = np.zeros(v.shape)
    for b in range(B):
        for h in range(H):
            logits = np.where(allowed, scale * q[b, :, h] @ k[b, :, h].T, -np.inf)
            weights = np.exp(logits - logits.max(axis=1, keepdims=True))
            out[b, :, h] = (weights / weights.sum(axis=1, keepdims=True)) @ v[b, :, h]
    return out


def relative_error(got, expected):
    return np.abs(np.asarray(got, np.float64) - expected).max() / max(np.abs(expected).max(), 1e-300)


def inputs(B, T, H, Dk, Dv, dtype):
    return (RNG.normal(0, 1, (B, T, H, Dk)).astype(dtype), RNG.normal(0, 1, (B, T, H, Dk)).astype(dtype),
            RNG.uniform(-1, 1, (B, T, H, Dv)).astype(dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, (3, 2), (0, 0)])
@pytest.mark.parametrize("exec_", ["cpu", "reference"])
def test_forward_matches_the_definition(dtype, causal, window, exec_):
    if causal and window is not None:
        window = (window[0], 0)  # a causal window has no right side (latte refuses one)
    for B, T, H, Dk, Dv in [(1, 1, 1, 1, 1), (2, 19, 3, 5, 6), (1, 140, 2, 16, 8)]:
        attention = latte.SoftmaxAttention(H, Dk, Dv, causal=causal, window=window)
        q, k, v = inputs(B, T, H, Dk, Dv, dtype)
        out = attention.forward(q, k, v, exec=exec_)
        assert relative_error(out, softmax_definition(q, k, v, causal, window)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("window", [None, (5, 0)])
def test_the_kv_cache_continues_the_sequence_and_pickles(window):
    B, T, H, Dk, Dv, prefill = 2, 30, 2, 4, 6, 12
    attention = latte.SoftmaxAttention(H, Dk, Dv, window=window, scale=0.7)
    q, k, v = inputs(B, T, H, Dk, Dv, np.float64)
    expected = softmax_definition(q, k, v, True, window, scale=0.7)
    cache = attention.make_state(B, capacity=0 if window else T, dtype="float64")
    rows = [attention.forward(q[:, :prefill], k[:, :prefill], v[:, :prefill], state=cache)]
    for t in range(prefill, T):
        if t == 20:
            cache = pickle.loads(pickle.dumps(cache))
        rows.append(attention.step(cache, q[:, t], k[:, t], v[:, t])[:, None])
    assert relative_error(np.concatenate(rows, axis=1), expected) <= 1e-12
    assert cache.position == T


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, (4, 0)), (False, (2, 3))])
def test_backward_along_random_directions(dtype, causal, window):
    B, T, H, Dk, Dv = 2, 21, 2, 5, 6
    attention = latte.SoftmaxAttention(H, Dk, Dv, causal=causal, window=window)
    q, k, v = inputs(B, T, H, Dk, Dv, dtype)
    d_out = RNG.uniform(-1, 1, v.shape).astype(dtype)
    gradients = attention.backward(q, k, v, d_out)
    assert len(gradients) == 3
    x = [a.astype(np.float64) for a in (q, k, v)]
    directions = [RNG.normal(size=a.shape) for a in x]

    def f(t):
        return (softmax_definition(*(a + t * d for a, d in zip(x, directions)), causal, window) * d_out).sum()

    assert directional_error(f, gradients, directions) <= GRADIENT_TOLERANCE[dtype]


def test_bad_input_is_refused_by_name():
    attention = latte.SoftmaxAttention(2, 4, 6)
    q, k, v = inputs(1, 8, 2, 4, 6, np.float32)
    with pytest.raises(latte.Error) as error:
        attention.forward(q, k[..., :3], v)
    assert error.value.argument == "keys"
    with pytest.raises(latte.Error) as error:
        latte.SoftmaxAttention(2, 4, 6, window=(3, 1))
    assert error.value.argument == "window.right"
    with pytest.raises(latte.Error) as error:
        attention.make_state(1)  # no window: the cache's capacity must be given
    assert error.value.argument == "capacity"
    with pytest.raises(latte.Error) as error:
        latte.SoftmaxAttention(2, 4, 6, causal=False).make_state(1, capacity=8)
    assert error.value.argument == "make_state"
