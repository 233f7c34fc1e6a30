"""latte.LeaPformer from Python against its definition in NumPy float64:

    x = relu(q_t) (or relu(k_s));  P(x) = sigmoid(w2 . relu(w1 x + b1) + b2)
    w[t, s] = relu(q_t) . relu(k_s) cos(pi/2 (P_q(t) - P_k(s)))
    o_t = sum_{s allowed} w[t, s] v_s / max(sum_{s allowed} w[t, s], 0.1)   (clamp-min 0.1, the paper's code)

or with the proportions P_q, P_k given per call instead of the modules (paper
004 eq. 8), and as cross-attention (queries over keys / values of another
length S). Forward on both backends and dtypes, decode with a pickled state,
and backward along random directions including both modules' weights or the
given proportions.
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


def leap_definition(q, k, v, query_module, key_module, causal=True, minimum=0.1, given=None):
    """Self-attention, or (bidirectional) queries [B, T, H, Dk] over keys and values [B, S, H, *];
    given = (P_q [B, T, H], P_k [B, S, H]): those proportions instead of the modules'."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, H, _ = q.shape
    S = k.shape[1]
    allowed = np.tril(np.ones((T, S), bool)) if causal else np.ones((T, S), bool)
    out = np.zeros((B, T, H, v.shape[3]))
    for b in range(B):
        for h in range(H):
            fq, fk = np.maximum(q[b, :, h], 0.0), np.maximum(k[b, :, h], 0.0)
            if given is None:
                Pq, Pk = proportions(fq, query_module), proportions(fk, key_module)
            else:
                Pq, Pk = (np.asarray(P, np.float64)[b, :, h] for P in given)
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


def given_proportions(B, T, S, H, dtype):
    """P_q [B, T, H] and P_k [B, S, H] inside (0, 1), exact in `dtype`."""
    return [RNG.uniform(0.05, 0.95, (B, n, H)).astype(dtype) for n in (T, S)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("exec_", ["cpu", "reference"])
@pytest.mark.parametrize("with_modules", [False, True])
def test_given_proportions_forward_matches_the_definition(dtype, causal, exec_, with_modules):
    modules = {"query_module": module(2, 8), "key_module": module(2, 8)} if with_modules else {}
    attention = latte.LeaPformer(2, 8, 5, causal=causal, **modules)  # given proportions override modules
    for B, T in [(1, 1), (2, 27)]:
        x = inputs(B, T, 2, 8, 5, dtype)
        P = given_proportions(B, T, T, 2, dtype)
        got = attention.forward(*x, query_proportions=P[0], key_proportions=P[1], exec=exec_)
        assert relative_error(got, leap_definition(*x, None, None, causal, given=P)) <= TOLERANCE[dtype]


def test_given_proportions_decode_continues_the_sequence_and_pickles():
    B, T, H, Dk, Dv, prefill = 2, 31, 2, 8, 4, 9
    attention = latte.LeaPformer(H, Dk, Dv)
    x = inputs(B, T, H, Dk, Dv, np.float64)
    P = given_proportions(B, T, T, H, np.float64)
    state = attention.make_state(B, dtype="float64")
    rows = [attention.forward(*(a[:, :prefill] for a in x), query_proportions=P[0][:, :prefill],
                              key_proportions=P[1][:, :prefill], state=state)]
    for t in range(prefill, T):
        if t == 20:
            state = pickle.loads(pickle.dumps(state))
            attention = pickle.loads(pickle.dumps(attention))
        rows.append(attention.step(state, *(a[:, t] for a in x), query_proportions=P[0][:, t],
                                   key_proportions=P[1][:, t], exec="reference" if t % 2 else "cpu")[:, None])
    assert state.position == T
    assert relative_error(np.concatenate(rows, axis=1), leap_definition(*x, None, None, given=P)) <= 1e-12


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [True, False])
def test_given_proportions_backward_along_random_directions(dtype, causal):
    B, T, H, Dk, Dv = 2, 17, 2, 8, 5
    attention = latte.LeaPformer(H, Dk, Dv, causal=causal)
    x = inputs(B, T, H, Dk, Dv, dtype)
    P = given_proportions(B, T, T, H, dtype)
    d_out = RNG.uniform(-1, 1, x[2].shape).astype(dtype)
    gradients = attention.backward(*x, d_out, query_proportions=P[0], key_proportions=P[1])
    assert [g.shape for g in gradients] == [a.shape for a in x + P]
    point = [a.astype(np.float64) for a in x + P]
    directions = [RNG.normal(size=a.shape) for a in point]

    def f(t):
        q, k, v, Pq, Pk = (a + t * d for a, d in zip(point, directions))
        return (leap_definition(q, k, v, None, None, causal, given=(Pq, Pk)) * d_out).sum()

    assert directional_error(f, gradients, directions) <= GRADIENT_TOLERANCE[dtype]


def test_given_proportions_backward_continues_from_a_state():
    """A causal backward of the second chunk, from the state the first left: the gradient of the whole
    sequence's definition with respect to the second chunk's inputs and proportions."""
    B, T, H, Dk, Dv, first = 1, 20, 2, 8, 3, 8
    attention = latte.LeaPformer(H, Dk, Dv)
    x = inputs(B, T, H, Dk, Dv, np.float64)
    P = given_proportions(B, T, T, H, np.float64)
    state = attention.make_state(B, dtype="float64")
    attention.forward(*(a[:, :first] for a in x), query_proportions=P[0][:, :first],
                      key_proportions=P[1][:, :first], state=state)
    d_out = RNG.uniform(-1, 1, (B, T - first, H, Dv))
    gradients = attention.backward(*(a[:, first:] for a in x), d_out, query_proportions=P[0][:, first:],
                                   key_proportions=P[1][:, first:], initial_state=state)
    point = [a[:, first:] for a in x + P]
    directions = [RNG.normal(size=a.shape) for a in point]

    def f(t):
        q, k, v, Pq, Pk = (np.concatenate([a[:, :first], b + t * d], axis=1) for a, b, d in zip(x + P, point, directions))
        return (leap_definition(q, k, v, None, None, given=(Pq, Pk))[:, first:] * d_out).sum()

    assert directional_error(f, gradients, directions) <= 1e-8


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("exec_", ["cpu", "reference"])
@pytest.mark.parametrize("with_modules", [False, True])
def test_cross_attention_matches_the_definition(dtype, exec_, with_modules):
    qm, km = module(2, 8), module(2, 8)
    attention = latte.LeaPformer(2, 8, 5, causal=False, **({"query_module": qm, "key_module": km} if with_modules else {}))
    B, T, S = 2, 11, 23
    q = inputs(B, T, 2, 8, 5, dtype)[0]
    k, v = inputs(B, S, 2, 8, 5, dtype)[1:]
    P = None if with_modules else given_proportions(B, T, S, 2, dtype)
    given = {} if with_modules else {"query_proportions": P[0], "key_proportions": P[1]}
    expected = leap_definition(q, k, v, qm, km, causal=False, given=P)
    assert relative_error(attention.cross_forward(q, k, v, exec=exec_, **given), expected) <= TOLERANCE[dtype]
    d_out = RNG.uniform(-1, 1, (B, T, 2, 5)).astype(dtype)
    gradients = attention.cross_backward(q, k, v, d_out, exec=exec_, **given)
    if with_modules:  # (d_q, d_k, d_v, d_query_module, d_key_module): the modules' along their weights
        d_qm, d_km = gradients[3:]
        point = [a.astype(np.float64) for a in (q, k, v)] + list(qm[:3]) + [np.array(qm[3])] + list(km[:3]) + \
            [np.array(km[3])]
        gradients = list(gradients[:3]) + list(d_qm[:3]) + [np.array(d_qm[3])] + list(d_km[:3]) + [np.array(d_km[3])]

        def definition(p):
            return leap_definition(*p[:3], tuple(p[3:6]) + (float(p[6]),), tuple(p[7:10]) + (float(p[10]),), False)
    else:
        point = [a.astype(np.float64) for a in (q, k, v, *P)]

        def definition(p):
            return leap_definition(*p[:3], None, None, False, given=p[3:])
    assert [np.shape(g) for g in gradients] == [np.shape(a) for a in point]
    directions = [RNG.normal(size=np.shape(a)) for a in point]

    def f(t):
        return (definition([a + t * d for a, d in zip(point, directions)]) * d_out).sum()

    assert directional_error(f, gradients, directions) <= GRADIENT_TOLERANCE[dtype]


def test_given_proportions_bad_input_is_refused_by_name():
    attention = latte.LeaPformer(2, 8, 4)
    x = inputs(1, 6, 2, 8, 4, np.float32)
    P = given_proportions(1, 6, 6, 2, np.float32)

    def refused(argument, call):
        with pytest.raises(latte.Error) as error:
            call()
        assert error.value.argument == argument, error.value

    refused("proportions", lambda: attention.forward(*x))  # no modules: proportions in every call
    refused("key_proportions", lambda: attention.forward(*x, query_proportions=P[0]))
    refused("query_proportions", lambda: attention.backward(*x, x[2], key_proportions=P[1]))
    refused("query_proportions", lambda: attention.forward(*x, query_proportions=P[0] + 1, key_proportions=P[1]))
    refused("key_proportions", lambda: attention.forward(*x, query_proportions=P[0], key_proportions=P[1][:, :5]))
    refused("query_proportions", lambda: attention.forward(*x, query_proportions=P[0].astype(np.float64),
                                                           key_proportions=P[1]))
    refused("cross_forward", lambda: attention.cross_forward(*x, query_proportions=P[0], key_proportions=P[1]))
    state = attention.make_state(1)
    refused("key_proportions", lambda: attention.step(state, *(a[:, 0] for a in x), query_proportions=P[0][:, 0],
                                                      key_proportions=P[1]))
    with pytest.raises(latte.Error) as error:
        latte.LeaPformer(2, 8, 4, query_module=module(2, 8))
    assert error.value.argument == "key_module"
