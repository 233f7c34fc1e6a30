"""latte.LatteMacchiato from Python against its definition in NumPy float64
(the explicit T x T matrices, as tests/oracles/macchiato_oracle.hpp builds them):

    p(l|t)       = softmax_l(q[t]) over l = 0..L
    p0(s|t)      = softmax_s(c q'_t . R^{s-t} k'_s) over the window W(t)     (RoPE: R; else 1)
    p(s|l,t)     = softmax_s(k[s, l-1]) over S(t)                             l = 1..L
    o_t          = sum_s p(0|t) p0(s|t) V0(t, s) + sum_{l>=1} p(l|t) p(s|l,t) R^{t-s} v_s

W(t) = {t-w <= s <= t} causal or {|t-s| <= w}; S(t) = {s <= t} or all s; VAPOR
rotates the latent part's values (and the window's too with vapor_scope="all_states").
"""

import pickle

import numpy as np
import pytest

import latte
from gradient_check import directional_error
from latte_reference import rope_angles, rotate

RNG = np.random.default_rng(13)
TOLERANCE = {np.float32: 2e-5, np.float64: 1e-12}
GRADIENT_TOLERANCE = {np.float32: 1e-4, np.float64: 1e-8}


def softmax(x, axis):
    finite = np.where(np.isfinite(x), x, -np.inf)
    e = np.exp(finite - finite.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def macchiato_definition(q, k, wq, wk, v, window, causal=True, vapor=False, rope=False, all_states=False,
                         scale=None, angles=None):
    q, k, wq, wk, v = (np.asarray(x, np.float64) for x in (q, k, wq, wk, v))
    B, T, H, _ = q.shape
    Dk, Dv = wq.shape[3], v.shape[3]
    c = 1.0 / np.sqrt(Dk) if scale is None else scale
    vapor_theta = (rope_angles(H, Dv) if angles is None else angles) if vapor else None
    rope_theta = rope_angles(H, Dk)[0] if rope else None
    t_idx, s_idx = np.arange(T)[:, None], np.arange(T)[None, :]
    in_window = (s_idx <= t_idx) & (s_idx >= t_idx - window) if causal else np.abs(t_idx - s_idx) <= window
    in_past = s_idx <= t_idx if causal else np.ones((T, T), bool)
    out = np.zeros(v.shape)
    for b in range(B):
        for h in range(H):
            p = softmax(q[b, :, h], axis=1)  # [T, L + 1]
            if rope:
                pos = np.arange(T, dtype=np.float64)
                rq = np.stack([rotate(wq[b, t, h], t, rope_theta) for t in range(T)])
                rk = np.stack([rotate(wk[b, s, h], s, rope_theta) for s in range(T)])
                scores = c * rq @ rk.T
            else:
                scores = c * wq[b, :, h] @ wk[b, :, h].T
            p0 = softmax(np.where(in_window, scores, -np.inf), axis=1)
            latent = np.zeros((T, T))
            for l in range(1, q.shape[3]):
                column = np.where(in_past, k[b, :, h, l - 1][None, :], -np.inf)
                latent += p[:, l:l + 1] * softmax(column, axis=1)
            local = p[:, 0:1] * p0
            for t in range(T):
                for s in range(T):
                    moved = rotate(v[b, s, h], t - s, vapor_theta[h]) if vapor else v[b, s, h]
                    out[b, t, h] += latent[t, s] * moved
                    out[b, t, h] += local[t, s] * (moved if all_states else v[b, s, h])
    return out


def relative_error(got, expected):
    return np.abs(np.asarray(got, np.float64) - expected).max() / max(np.abs(expected).max(), 1e-300)


def inputs(B, T, H, L, Dk, Dv, dtype):
    return [RNG.normal(0, 1.5, shape).astype(dtype) for shape in
            [(B, T, H, L + 1), (B, T, H, L), (B, T, H, Dk), (B, T, H, Dk)]] + \
        [RNG.uniform(-1, 1, (B, T, H, Dv)).astype(dtype)]


VARIANTS = [(False, False, False), (True, False, False), (False, True, False), (True, True, False),
            (True, True, True)]  # (vapor, rope, all_states)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("vapor,rope,all_states", VARIANTS)
@pytest.mark.parametrize("exec_", ["cpu", "reference"])
def test_forward_matches_the_definition(dtype, causal, vapor, rope, all_states, exec_):
    for B, T, H, L, Dk, Dv, w in [(1, 1, 1, 1, 2, 2, 1), (2, 17, 2, 3, 4, 6, 3), (1, 40, 1, 4, 6, 4, 40)]:
        attention = latte.LatteMacchiato(H, L, Dk, Dv, w, causal=causal, vapor=vapor, rope=rope,
                                         vapor_scope="all_states" if all_states else "latent_states")
        x = inputs(B, T, H, L, Dk, Dv, dtype)
        expected = macchiato_definition(*x, w, causal, vapor, rope, all_states)
        assert relative_error(attention.forward(*x, exec=exec_), expected) <= TOLERANCE[dtype]


def test_decode_continues_the_sequence_and_pickles():
    B, T, H, L, Dk, Dv, w, prefill = 2, 30, 2, 3, 4, 6, 5, 11
    attention = latte.LatteMacchiato(H, L, Dk, Dv, w, vapor=True, rope=True)
    x = inputs(B, T, H, L, Dk, Dv, np.float64)
    expected = macchiato_definition(*x, w, True, True, True)
    state = attention.make_state(B, dtype="float64")
    rows = [attention.forward(*(a[:, :prefill] for a in x), state=state)]
    for t in range(prefill, T):
        if t == 20:
            state = pickle.loads(pickle.dumps(state))
        rows.append(attention.step(state, *(a[:, t] for a in x))[:, None])
    assert relative_error(np.concatenate(rows, axis=1), expected) <= 1e-12


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("vapor,rope,all_states", [(False, False, False), (True, True, False), (True, False, True)])
def test_backward_along_random_directions(dtype, causal, vapor, rope, all_states):
    B, T, H, L, Dk, Dv, w = 1, 14, 2, 3, 4, 4, 3
    attention = latte.LatteMacchiato(H, L, Dk, Dv, w, causal=causal, vapor=vapor, rope=rope,
                                     vapor_scope="all_states" if all_states else "latent_states")
    x = inputs(B, T, H, L, Dk, Dv, dtype)
    d_out = RNG.uniform(-1, 1, x[4].shape).astype(dtype)
    gradients = attention.backward(*x, d_out)
    assert len(gradients) == (6 if vapor else 5)
    x64 = [a.astype(np.float64) for a in x] + ([rope_angles(H, Dv)] if vapor else [])  # VAPOR's default angles
    directions = [RNG.normal(size=a.shape) for a in x64]

    def f(t):
        moved = [a + t * d for a, d in zip(x64, directions)]
        return (macchiato_definition(*moved[:5], w, causal, vapor, rope, all_states,
                                     angles=moved[5] if vapor else None) * d_out).sum()

    assert directional_error(f, gradients, directions) <= GRADIENT_TOLERANCE[dtype]


def test_bad_input_is_refused_by_name():
    attention = latte.LatteMacchiato(2, 3, 4, 6, 2)
    x = inputs(1, 5, 2, 3, 4, 6, np.float32)
    with pytest.raises(latte.Error) as error:
        attention.forward(x[1], *x[1:])  # L columns where L + 1 are expected
    assert error.value.argument == "query_logits"
    with pytest.raises(latte.Error) as error:
        latte.LatteMacchiato(2, 3, 4, 6, 0)
    assert error.value.argument == "dims.window"
    with pytest.raises(latte.Error) as error:
        latte.LatteMacchiato(2, 3, 4, 6, 2, vapor_scope="everything")
    assert error.value.argument == "vapor_scope"
