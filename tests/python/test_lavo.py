"""latte.Lavo from Python against LAVO's definition in NumPy float64, per query
(as tests/oracles/lavo_oracle.hpp forms it; nothing shared with latte):

    local:  A[t, s] = softmax over allowed s of (scale q_t . k_s + P[s - t + w - 1]),
            allowed = t - w < s <= t (causal) or |s - t| < w;  F_local(t) = sum_s A[t, s] v_s
    global: y_s = B F_local(s); M(t) = {s < floor(t / w) w} (causal) or every s;
            H = mean of y over M(t) (0 when empty); X~[i] = H_i B[i]
            F_global(t) = sum_i softmax_i(scale X~[i] . q_t) X~[i]
    o_t = (F_local + F_global) / 2, or F_local when M(t) is empty under "local_only".
    cross (paper 002 §3.4): y_s = B source_s over every source token, o_t = F_global(t) (0 when Ts = 0).
"""

import pickle

import numpy as np
import pytest

import latte
from gradient_check import directional_error

RNG = np.random.default_rng(17)
TOLERANCE = {np.float32: 2e-5, np.float64: 1e-12}
GRADIENT_TOLERANCE = {np.float32: 1e-4, np.float64: 1e-8}


def lavo_definition(q, k, v, basis, bias, window, causal=True, scale=None, empty_memory="zero"):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B_, T, H, d = q.shape
    w = window
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    t_idx, s_idx = np.arange(T)[:, None], np.arange(T)[None, :]
    allowed = ((s_idx <= t_idx) & (s_idx > t_idx - w)) if causal else (np.abs(s_idx - t_idx) < w)
    out = np.zeros(v.shape)
    for b in range(B_):
        for h in range(H):
            logits = scale * q[b, :, h] @ k[b, :, h].T + bias[h][np.clip(s_idx - t_idx + w - 1, 0, 2 * w - 2)]
            logits = np.where(allowed, logits, -np.inf)
            A = np.exp(logits - logits.max(axis=1, keepdims=True))
            A /= A.sum(axis=1, keepdims=True)
            local = A @ v[b, :, h]
            y = local @ basis[h].T  # [T, r]
            for t in range(T):
                members = np.arange((t // w) * w) if causal else np.arange(T)
                if len(members) == 0:
                    out[b, t, h] = local[t] if empty_memory == "local_only" else local[t] / 2
                    continue
                X = y[members].mean(axis=0)[:, None] * basis[h]  # [r, d]
                scores = scale * X @ q[b, t, h]
                p = np.exp(scores - scores.max())
                p /= p.sum()
                out[b, t, h] = (local[t] + p @ X) / 2
    return out


def lavo_cross_definition(q, source, basis, scale=None):
    q, source = (np.asarray(x, np.float64) for x in (q, source))
    B_, Tq, H, d = q.shape
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    out = np.zeros(q.shape)
    for b in range(B_):
        for h in range(H):
            if source.shape[1] == 0:
                continue
            X = (source[b, :, h] @ basis[h].T).mean(axis=0)[:, None] * basis[h]  # [r, d]
            for t in range(Tq):
                scores = scale * X @ q[b, t, h]
                p = np.exp(scores - scores.max())
                out[b, t, h] = p @ X / p.sum()
    return out


def relative_error(got, expected):
    return np.abs(np.asarray(got, np.float64) - expected).max() / max(np.abs(expected).max(), 1e-300)


def inputs(B, T, H, d, dtype):
    return [RNG.normal(0, 1, (B, T, H, d)).astype(dtype) for _ in range(2)] + \
        [RNG.uniform(-1, 1, (B, T, H, d)).astype(dtype)]


def rounded(x, dtype):
    return np.asarray(x, np.float64).astype(dtype).astype(np.float64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("empty_memory", ["zero", "local_only"])
@pytest.mark.parametrize("exec_", ["cpu", "reference"])
def test_forward_matches_the_definition(dtype, causal, empty_memory, exec_):
    for B, T, H, d, r, w in [(1, 1, 1, 2, 1, 1), (2, 23, 2, 6, 3, 4), (1, 70, 1, 8, 8, 16)]:
        bias = RNG.normal(0, 0.5, (H, 2 * w - 1))
        # The kernel computes in the inputs' dtype: give it parameters that are exact there.
        bias = rounded(bias, dtype)
        attention = latte.Lavo(H, d, r, w, causal=causal, relative_bias=bias, basis_seed=5, empty_memory=empty_memory)
        basis = rounded(attention.basis, dtype)
        attention = latte.Lavo(H, d, r, w, causal=causal, relative_bias=bias, basis=basis, empty_memory=empty_memory)
        np.testing.assert_array_equal(attention.relative_bias, bias)
        x = inputs(B, T, H, d, dtype)
        expected = lavo_definition(*x, basis, bias, w, causal, empty_memory=empty_memory)
        assert relative_error(attention.forward(*x, exec=exec_), expected) <= TOLERANCE[dtype]


def test_decode_continues_the_sequence_and_pickles():
    B, T, H, d, r, w, prefill = 2, 37, 2, 4, 2, 5, 12
    attention = latte.Lavo(H, d, r, w, relative_bias=RNG.normal(0, 0.5, (H, 2 * w - 1)))
    x = inputs(B, T, H, d, np.float64)
    expected = lavo_definition(*x, attention.basis, attention.relative_bias, w)
    state = attention.make_state(B, dtype="float64")
    rows = [attention.forward(*(a[:, :prefill] for a in x), state=state)]
    for t in range(prefill, T):
        if t == 23:
            state = pickle.loads(pickle.dumps(state))
        rows.append(attention.step(state, *(a[:, t] for a in x))[:, None])
    assert relative_error(np.concatenate(rows, axis=1), expected) <= 1e-12


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [True, False])
def test_backward_along_random_directions_with_the_bias_and_bases(dtype, causal):
    B, T, H, d, r, w = 2, 19, 2, 5, 3, 4
    bias = rounded(RNG.normal(0, 0.5, (H, 2 * w - 1)), dtype)
    basis = rounded(RNG.normal(0, 0.7, (H, r, d)), dtype)  # any bases: the gradient needs no orthonormality
    attention = latte.Lavo(H, d, r, w, causal=causal, relative_bias=bias, basis=basis)
    x = inputs(B, T, H, d, dtype)
    d_out = RNG.uniform(-1, 1, x[2].shape).astype(dtype)
    gradients = attention.backward(*x, d_out)
    assert [g.shape for g in gradients[3:]] == [bias.shape, basis.shape]
    point = [a.astype(np.float64) for a in x] + [bias, basis]
    directions = [RNG.normal(size=a.shape) for a in point]

    def f(t):
        q, k, v, P, Bm = (a + t * dd for a, dd in zip(point, directions))
        return (lavo_definition(q, k, v, Bm, P, w, causal) * d_out).sum()

    assert directional_error(f, gradients, directions) <= GRADIENT_TOLERANCE[dtype]


def test_bad_input_is_refused_by_name():
    with pytest.raises(latte.Error) as error:
        latte.Lavo(2, 4, 2, 3, relative_bias=np.zeros((2, 4)))
    assert error.value.argument == "relative_bias"
    with pytest.raises(latte.Error) as error:
        latte.Lavo(2, 4, 2, 3, basis=np.zeros((2, 3, 4)))
    assert error.value.argument == "basis"
    with pytest.raises(latte.Error) as error:
        latte.Lavo(2, 4, 5, 3)  # r > d
    assert "bases" in error.value.argument
    with pytest.raises(latte.Error) as error:
        latte.Lavo(2, 4, 2, 3, empty_memory="global_only")
    assert error.value.argument == "empty_memory"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("exec_", ["cpu", "reference"])
def test_cross_attention_matches_the_definition(dtype, causal, exec_):
    B, H, d, r, w = 2, 2, 5, 3, 4
    basis = rounded(RNG.normal(0, 0.7, (H, r, d)), dtype)
    attention = latte.Lavo(H, d, r, w, causal=causal, basis=basis)
    for Tq, Ts in [(1, 1), (9, 26), (17, 3), (4, 0)]:
        q = inputs(B, Tq, H, d, dtype)[0]
        source = inputs(B, max(Ts, 1), H, d, dtype)[2][:, :Ts]  # Ts = 0: a slice (NumPy's empty arrays have strides 0)
        out = np.full(q.shape, np.nan, dtype)
        assert attention.cross_forward(q, source, out, exec=exec_) is out
        if Ts == 0:  # an empty memory reads zero
            assert not out.any()
        else:
            assert relative_error(out, lavo_cross_definition(q, source, basis)) <= TOLERANCE[dtype]
    q, source = inputs(B, 9, H, d, dtype)[0], inputs(B, 26, H, d, dtype)[2]
    d_out = RNG.uniform(-1, 1, q.shape).astype(dtype)
    gradients = attention.cross_backward(q, source, d_out, exec=exec_)
    assert [g.shape for g in gradients] == [q.shape, source.shape, basis.shape]
    point = [q.astype(np.float64), source.astype(np.float64), basis]
    directions = [RNG.normal(size=a.shape) for a in point]

    def f(t):
        return (lavo_cross_definition(*(a + t * dd for a, dd in zip(point, directions))) * d_out).sum()

    assert directional_error(f, gradients, directions) <= GRADIENT_TOLERANCE[dtype]


def test_cross_attention_bad_input_is_refused_by_name():
    attention = latte.Lavo(2, 4, 2, 3)
    q, source = inputs(1, 5, 2, 4, np.float32)[0], inputs(1, 7, 2, 4, np.float32)[2]
    for argument, call in [("source", lambda: attention.cross_forward(q, source[..., :3])),
                           ("source", lambda: attention.cross_forward(q, source.astype(np.float64))),
                           ("out", lambda: attention.cross_forward(q, source, np.zeros((1, 7, 2, 4), np.float32))),
                           ("d_out", lambda: attention.cross_backward(q, source, source)),
                           ("exec", lambda: attention.cross_forward(q, source, exec="gpu"))]:
        with pytest.raises(latte.Error) as error:
            call()
        assert error.value.argument == argument
