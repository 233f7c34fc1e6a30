"""latte.LeaPformer from Python against its definition in NumPy float64:

    x = relu(q_t) (or relu(k_s));  P(x) = sigmoid(w2 . relu(w1 x + b1) + b2)
    w[t, s] = relu(q_t) . relu(k_s) cos(pi/2 (P_q(t) - P_k(s)))
    o_t = sum_{s allowed} w[t, s] v_s / max(sum_{s allowed} w[t, s], 0.1)   (clamp-min 0.1, the paper's code)

forward on both backends and dtypes, decode with a pickled state, and backward
along random directions including both modules' weights.
"""

import pickle

import numpy as np
import pytest

import latte
from gradient_check import directional_error

RNG = np.random.default_rng(19)
TOLERANCE = {np.float32: 2e-5, np.float64: 1e-12}
GRADIENT_TOLERANCE = {np.float32: 1e-4, np.float64: 1e-8}


def module(hidden, dim, scale=0.5):
    return (RNG.normal(0, scale, (hidden, dim)), RNG.normal(0, scale, hidden), RNG.normal(0, scale, hidden),
            float(RNG.normal(0, scale)))


def proportions(x, weights):
    w1, b1, w2, b2 = weights
    return 1.0 / (1.0 + np.exp(-(np.maximum(x @ w1.T + b1, 0.0) @ w2 + b2)))


def leap_definition(q, k, v, query_module, key_module, causal=True, minimum=0.1):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, H, _ = q.shape
    allowed = np.tril(np.ones((T, T), bool)) if causal else np.ones((T, T), bool)
    out = np.zeros(v.shape)
    for b in range(B):
        for h in range(H):
            fq, fk = np.maximum(q[b, :, h], 0.0), np.maximum(k[b, :, h], 0.0)
            Pq, Pk = proportions(fq, query_module), proportions(fk, key_module)
            w = np.where(allowed, (fq @ fk.T) * np.cos(np.pi / 2 * (Pq[:, None] - Pk[None, :])), 0.0)
            out[b, :, h] = (w @ v[b, :, h]) / np.maximum(w.sum(axis=1), minimum)[:, None]
    return out


def relative_error(got, expected):
    return np.abs(np.asarray(got, np.float64) - expected).max() / max(np.abs(expected).max(), 1e-300)


def inputs(B, T, H, Dk, Dv, dtype):
    return [RNG.normal(0.3, 1, (B, T, H, Dk)).astype(dtype) for _ in range(2)] + \
        [RNG.uniform(-1, 1, (B, T, H, Dv)).astype(dtype)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("exec_", ["cpu", "reference"])
def test_forward_matches_the_definition(dtype, causal, exec_):
    for B, T, H, Dk, Dv, factor in [(1, 1, 1, 4, 1, 4), (2, 21, 2, 8, 5, 4), (1, 90, 2, 6, 6, 2)]:
        qm, km = module(Dk // factor, Dk), module(Dk // factor, Dk)
        attention = latte.LeaPformer(H, Dk, Dv, query_module=qm, key_module=km, causal=causal, leap_factor=factor)
        x = inputs(B, T, H, Dk, Dv, dtype)
        assert relative_error(attention.forward(*x, exec=exec_), leap_definition(*x, qm, km, causal)) \
            <= TOLERANCE[dtype]


def test_decode_continues_the_sequence_and_pickles():
    B, T, H, Dk, Dv, prefill = 2, 33, 2, 8, 4, 10
    qm, km = module(2, Dk), module(2, Dk)
    attention = latte.LeaPformer(H, Dk, Dv, query_module=qm, key_module=km)
    x = inputs(B, T, H, Dk, Dv, np.float64)
    state = attention.make_state(B, dtype="float64")
    rows = [attention.forward(*(a[:, :prefill] for a in x), state=state)]
    for t in range(prefill, T):
        if t == 21:
            state = pickle.loads(pickle.dumps(state))
            attention = pickle.loads(pickle.dumps(attention))
        rows.append(attention.step(state, *(a[:, t] for a in x))[:, None])
    assert relative_error(np.concatenate(rows, axis=1), leap_definition(*x, qm, km)) <= 1e-12


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [True, False])
def test_backward_along_random_directions_with_the_modules(dtype, causal):
    B, T, H, Dk, Dv = 2, 17, 2, 8, 5
    qm, km = module(2, Dk), module(2, Dk)
    attention = latte.LeaPformer(H, Dk, Dv, query_module=qm, key_module=km, causal=causal)
    x = inputs(B, T, H, Dk, Dv, dtype)
    d_out = RNG.uniform(-1, 1, x[2].shape).astype(dtype)
    d_q, d_k, d_v, d_qm, d_km = attention.backward(*x, d_out)
    point = [a.astype(np.float64) for a in x] + list(qm[:3]) + [np.array(qm[3])] + list(km[:3]) + [np.array(km[3])]
    got_gradients = [d_q, d_k, d_v] + list(d_qm[:3]) + [np.array(d_qm[3])] + list(d_km[:3]) + [np.array(d_km[3])]
    directions = [RNG.normal(size=np.shape(a)) for a in point]

    def f(t):
        p = [a + t * d for a, d in zip(point, directions)]
        return (leap_definition(p[0], p[1], p[2], tuple(p[3:6]) + (float(p[6]),), tuple(p[7:10]) + (float(p[10]),),
                                causal) * d_out).sum()

    assert directional_error(f, got_gradients, directions) <= GRADIENT_TOLERANCE[dtype]


def test_bad_modules_are_refused_by_name():
    qm = module(2, 8)
    with pytest.raises(latte.Error) as error:
        latte.LeaPformer(2, 8, 4, query_module=qm, key_module=module(3, 8))  # hidden 3, expected 8 / 4
    assert error.value.argument.startswith("key_module")
    with pytest.raises(latte.Error) as error:
        latte.LeaPformer(2, 8, 4, query_module=qm[:3], key_module=qm)
    assert error.value.argument == "query_module"
    with pytest.raises(latte.Error) as error:
        latte.LeaPformer(2, 8, 4, query_module=(qm[0].astype(np.float32),) + qm[1:], key_module=qm)
    assert error.value.argument == "query_module.w1"
