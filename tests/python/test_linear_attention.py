"""latte.LinearAttention and latte.CosFormer from Python against the linear
family written out in NumPy float64 (the explicit T x T scores, as
tests/oracles/linear_oracle.hpp builds them in C++; nothing shared with latte):

    w[t, s]  = phi(q_t) . R^{s-t} phi(k_s) * sigma[t, s],  sigma = cos(pi/2 (P_t - P_s)) or 1
    w'[t, s] = phi(q_t) . phi(k_s) * sigma[t, s]          (RoPE's un-rotated denominator; else w)
    o_t      = sum_{s allowed} w[t, s] v_s / N(sum_{s allowed} w'[t, s])
    N(D)     = max(D, 0) + eps (additive) or max(D, c) (clamp_min)

with P = (i + 1) / M for cosFormer (M = T by default).
"""

import pickle

import numpy as np
import pytest

import latte
from gradient_check import directional_error

RNG = np.random.default_rng(11)
TOLERANCE = {np.float32: 2e-5, np.float64: 1e-12}
GRADIENT_TOLERANCE = {np.float32: 1e-4, np.float64: 1e-8}
FEATURE_MAPS = {
    "elu_plus_one": lambda x: np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0))),
    "relu": lambda x: np.maximum(x, 0.0),
    "identity": lambda x: x,
}


def rotate_rows(x, positions, base):
    """Rows x[i] turned pair by pair by positions[i] * theta_j, theta_j = base^(-2j/F)."""
    F = x.shape[-1]
    pairs = F // 2
    theta = base ** (-2.0 * np.arange(pairs) / F)
    angle = positions[:, None] * theta[None, :]
    c, s = np.cos(angle), np.sin(angle)
    out = x.copy()
    a, b = x[:, 0:2 * pairs:2], x[:, 1:2 * pairs:2]
    out[:, 0:2 * pairs:2] = c * a - s * b
    out[:, 1:2 * pairs:2] = s * a + c * b
    return out


def linear_definition(q, k, v, causal, feature_map="elu_plus_one", normaliser=("additive", 1e-6), rope=False,
                      cosformer_length=None, first_position=0, base=10000.0):
    """Self-attention (S = T) or, bidirectional, cross-attention: queries [B, T, H, Dk] at positions
    0..T-1 over keys [B, S, H, Dk] and values [B, S, H, Dv] at positions 0..S-1 (plus first_position)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    phi = FEATURE_MAPS[feature_map]
    B, T, H, _ = q.shape
    S = k.shape[1]
    query_positions = first_position + np.arange(T, dtype=np.float64)
    key_positions = first_position + np.arange(S, dtype=np.float64)
    allowed = np.tril(np.ones((T, S), bool)) if causal else np.ones((T, S), bool)
    sigma = np.ones((T, S))
    if cosformer_length is not None:
        Pq, Pk = (query_positions + 1) / cosformer_length, (key_positions + 1) / cosformer_length
        sigma = np.cos(np.pi / 2 * (Pq[:, None] - Pk[None, :]))
    kind, value = normaliser
    out = np.zeros((B, T, H, v.shape[3]))
    for b in range(B):
        for h in range(H):
            fq, fk = phi(q[b, :, h]), phi(k[b, :, h])
            plain = (fq @ fk.T) * sigma
            w = (rotate_rows(fq, query_positions, base) @ rotate_rows(fk, key_positions, base).T) * sigma \
                if rope else plain
            w, plain = np.where(allowed, w, 0.0), np.where(allowed, plain, 0.0)
            D = plain.sum(axis=1)
            N = np.maximum(D, 0.0) + value if kind == "additive" else np.maximum(D, value)
            out[b, :, h] = (w @ v[b, :, h]) / N[:, None]
    return out


def relative_error(got, expected):
    return np.abs(np.asarray(got, np.float64) - expected).max() / max(np.abs(expected).max(), 1e-300)


def inputs(B, T, H, Dk, Dv, dtype, positive=False):
    q, k = RNG.normal(0, 1, (B, T, H, Dk)), RNG.normal(0, 1, (B, T, H, Dk))
    if positive:  # identity features: keep every denominator well away from the normaliser's kink
        q, k = np.abs(q) + 0.1, np.abs(k) + 0.1
    return q.astype(dtype), k.astype(dtype), RNG.uniform(-1, 1, (B, T, H, Dv)).astype(dtype)


LINEAR_CASES = [("elu_plus_one", False, None), ("relu", False, ("additive", 1e-3)), ("identity", False, None),
                ("elu_plus_one", True, None), ("elu_plus_one", False, ("clamp_min", 0.5))]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("feature_map,rope,normaliser", LINEAR_CASES)
@pytest.mark.parametrize("exec_", ["cpu", "reference"])
def test_linear_forward_matches_the_definition(dtype, causal, feature_map, rope, normaliser, exec_):
    for B, T, H, Dk, Dv in [(1, 1, 1, 2, 1), (2, 19, 3, 6, 5), (1, 150, 2, 16, 8)]:
        attention = latte.LinearAttention(H, Dk, Dv, causal=causal, feature_map=feature_map, normaliser=normaliser,
                                          rope=rope)
        q, k, v = inputs(B, T, H, Dk, Dv, dtype, positive=feature_map == "identity")
        expected = linear_definition(q, k, v, causal, feature_map, normaliser or ("additive", 1e-6), rope)
        assert relative_error(attention.forward(q, k, v, exec=exec_), expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("exec_", ["cpu", "reference"])
def test_cosformer_forward_matches_the_definition(dtype, causal, exec_):
    for B, T, H, Dk, Dv, length in [(1, 1, 1, 2, 1, None), (2, 23, 2, 6, 5, None), (1, 90, 2, 8, 8, 200)]:
        attention = latte.CosFormer(H, Dk, Dv, causal=causal, length=length)
        q, k, v = inputs(B, T, H, Dk, Dv, dtype)
        expected = linear_definition(q, k, v, causal, "relu", ("clamp_min", 1e-6), cosformer_length=length or T)
        assert relative_error(attention.forward(q, k, v, exec=exec_), expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize("make", [lambda: latte.LinearAttention(2, 6, 4, rope=True),
                                  lambda: latte.LinearAttention(2, 6, 4, feature_map="relu"),
                                  lambda: latte.CosFormer(2, 6, 4, length=64)])
def test_decode_continues_the_sequence_and_pickles(make):
    attention = make()
    B, T, prefill, first = 2, 40, 17, 5
    q, k, v = inputs(B, T, 2, 6, 4, np.float64)
    whole_state = attention.make_state(B, first_position=first, dtype="float64")
    expected = attention.forward(q, k, v, state=whole_state)
    state = attention.make_state(B, first_position=first, dtype="float64")
    rows = [attention.forward(q[:, :prefill], k[:, :prefill], v[:, :prefill], state=state)]
    for t in range(prefill, T):
        if t == 30:
            state = pickle.loads(pickle.dumps(state))
        rows.append(attention.step(state, q[:, t], k[:, t], v[:, t])[:, None])
    assert state.position == first + T
    assert relative_error(np.concatenate(rows, axis=1), expected) <= 1e-12
    # and the whole from position `first` against the definition
    is_cos = isinstance(attention, latte.CosFormer)
    definition = linear_definition(q, k, v, True, "relu" if is_cos or attention.feature_map == "relu" else "elu_plus_one",
                                   ("clamp_min", 1e-6) if is_cos else ("additive", 1e-6),
                                   rope=not is_cos and attention.feature_map == "elu_plus_one",
                                   cosformer_length=64 if is_cos else None, first_position=first)
    assert relative_error(expected, definition) <= 1e-12


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("make,definition", [
    (lambda c: latte.LinearAttention(2, 5, 6, causal=c), lambda *a: linear_definition(*a)),
    (lambda c: latte.LinearAttention(2, 6, 6, causal=c, rope=True), lambda *a: linear_definition(*a, rope=True)),
    (lambda c: latte.CosFormer(2, 5, 6, causal=c),
     lambda q, k, v, c: linear_definition(q, k, v, c, "relu", ("clamp_min", 1e-6), cosformer_length=q.shape[1])),
])
@pytest.mark.parametrize("causal", [True, False])
def test_backward_along_random_directions(dtype, make, definition, causal):
    attention = make(causal)
    q, k, v = inputs(2, 21, 2, 6 if "rope" in attention.kind() else 5, 6, dtype)
    d_out = RNG.uniform(-1, 1, v.shape).astype(dtype)
    gradients = attention.backward(q, k, v, d_out)
    x = [a.astype(np.float64) for a in (q, k, v)]
    directions = [RNG.normal(size=a.shape) for a in x]

    def f(t):
        return (definition(*(a + t * d for a, d in zip(x, directions)), causal) * d_out).sum()

    assert directional_error(f, gradients, directions) <= GRADIENT_TOLERANCE[dtype]


CROSS_CASES = [
    (lambda: latte.LinearAttention(2, 5, 4, causal=False), lambda q, k, v: linear_definition(q, k, v, False)),
    (lambda: latte.LinearAttention(2, 5, 4, causal=False, feature_map="relu", normaliser=("clamp_min", 0.5)),
     lambda q, k, v: linear_definition(q, k, v, False, "relu", ("clamp_min", 0.5))),
    (lambda: latte.LinearAttention(2, 6, 4, causal=False, rope=True),
     lambda q, k, v: linear_definition(q, k, v, False, rope=True)),
    # cosFormer's M defaults to max(S, T) in cross-attention
    (lambda: latte.CosFormer(2, 5, 4, causal=False),
     lambda q, k, v: linear_definition(q, k, v, False, "relu", ("clamp_min", 1e-6),
                                       cosformer_length=max(q.shape[1], k.shape[1]))),
]


def cross_inputs(B, T, S, H, Dk, Dv, dtype):
    """queries [B, T, H, Dk]; keys [B, S, H, Dk] and values [B, S, H, Dv]."""
    return (inputs(B, T, H, Dk, Dv, dtype)[0],) + inputs(B, S, H, Dk, Dv, dtype)[1:]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("exec_", ["cpu", "reference"])
@pytest.mark.parametrize("make,definition", CROSS_CASES)
def test_cross_attention_forward_and_backward_match_the_definition(dtype, exec_, make, definition):
    attention = make()
    Dk = 6 if "rope" in attention.kind() else 5
    for B, T, S in [(1, 1, 1), (2, 13, 29), (1, 31, 7)]:
        q, k, v = cross_inputs(B, T, S, 2, Dk, 4, dtype)
        out = np.full((B, T, 2, 4), np.nan, dtype)
        assert attention.cross_forward(q, k, v, out, exec=exec_) is out
        assert relative_error(out, definition(q, k, v)) <= TOLERANCE[dtype]
    d_out = RNG.uniform(-1, 1, (B, T, 2, 4)).astype(dtype)
    gradients = attention.cross_backward(q, k, v, d_out, exec=exec_)
    assert [g.shape for g in gradients] == [q.shape, k.shape, v.shape]
    x = [a.astype(np.float64) for a in (q, k, v)]
    directions = [RNG.normal(size=a.shape) for a in x]

    def f(t):
        return (definition(*(a + t * d for a, d in zip(x, directions))) * d_out).sum()

    assert directional_error(f, gradients, directions) <= GRADIENT_TOLERANCE[dtype]


def test_cross_attention_bad_input_is_refused_by_name():
    q, k, v = cross_inputs(1, 5, 8, 2, 4, 3, np.float32)
    for causal in (latte.LinearAttention(2, 4, 3), latte.CosFormer(2, 4, 3)):
        with pytest.raises(latte.Error) as error:
            causal.cross_forward(q, k, v)
        assert error.value.argument == "cross_forward"
        with pytest.raises(latte.Error) as error:
            causal.cross_backward(q, k, v, np.zeros((1, 5, 2, 3), np.float32))
        assert error.value.argument == "cross_forward"
    attention = latte.LinearAttention(2, 4, 3, causal=False)
    with pytest.raises(latte.Error) as error:
        attention.cross_forward(q, k, v[:, :7])
    assert error.value.argument == "values"
    with pytest.raises(latte.Error) as error:
        attention.cross_forward(q, k.astype(np.float64), v)
    assert error.value.argument == "keys"
    with pytest.raises(latte.Error) as error:
        attention.cross_backward(q, k, v, np.zeros((1, 8, 2, 3), np.float32))
    assert error.value.argument == "d_out"
    with pytest.raises(latte.Error) as error:
        attention.cross_forward(q, k, v, np.zeros((1, 8, 2, 3), np.float32))  # [B, S, ...], not [B, T, ...]
    assert error.value.argument == "out"


def test_bad_input_is_refused_by_name():
    with pytest.raises(latte.Error) as error:
        latte.LinearAttention(2, 4, 4, feature_map="softplus")
    assert error.value.argument == "feature_map"
    with pytest.raises(latte.Error) as error:
        latte.LinearAttention(2, 4, 4, feature_map="relu", rope=True)
    assert error.value.argument == "feature_map"
    with pytest.raises(latte.Error) as error:
        latte.LinearAttention(2, 4, 4, normaliser=("max", 1.0))
    assert error.value.argument == "normaliser"
    with pytest.raises(latte.Error) as error:
        latte.CosFormer(2, 4, 4).make_state(1)  # decode needs the length M
    assert error.value.argument == "length"
