"""latte.ConvCompressedAttention from Python against paper 003's definition in
NumPy float64, every attention an explicit matrix (as tests/oracles/
conv_compressed_oracle.hpp forms it; nothing shared with latte):

    level 0:  y0 = softmax_s(scale q_t . k_s) v over window(t, s)
    level l:  c_l[j] = b_l + sum_{i<M} W_l[i] y_{l-1}[jM + i] over the complete groups j
              y_l = window attention over (Wq_l c_l, Wk_l c_l, Wv_l c_l)        (l < L)
    cross:    global_t = softmax_j(scale (Wq_x y0_t) . (Wk_x c_L[j])) (Wv_x c_L[j])
              over visible(t, j)
    out       = y0 + global
    window(t, s)  = t - left <= s <= t + right (and s <= t when causal)
    visible(t, j) = every j, or (causal) (j + 1) M^L - 1 < t
A query with no allowed key reads zero.
"""

import pickle

import numpy as np
import pytest

import latte
import latte._latte as native
from gradient_check import directional_error

RNG = np.random.default_rng(29)
TOLERANCE = {np.float32: 2e-5, np.float64: 1e-12}
GRADIENT_TOLERANCE = {np.float32: 1e-4, np.float64: 1e-8}
LEVEL_FIELDS = ["conv_weight", "conv_bias", "level_query", "level_key", "level_value"]


def attend(q, k, v, scale, allowed):
    """The explicit attention matrix softmax(scale q k^T) over `allowed` [n_q, n_k], applied to v."""
    scores = np.where(allowed, scale * q @ k.T, -np.inf)
    A = np.zeros(allowed.shape)
    rows = allowed.any(axis=1)
    if not rows.any():
        return A @ v
    A[rows] = np.exp(scores[rows] - scores[rows].max(axis=1, keepdims=True))
    A[rows] /= A[rows].sum(axis=1, keepdims=True)
    return A @ v


def compress(y, weight, bias, M):
    """c[j] = b + sum_i W[i] y[jM + i] for the complete groups of y; weight [M, Dv, Dv] ([i, out, in])."""
    groups = len(y) // M
    return np.einsum("jid,iod->jo", y[:groups * M].reshape(groups, M, y.shape[1]), weight) + bias


def conv_compressed_definition(q, k, v, params, M, levels, causal, window, scale=None):
    """The output [B, T, H, Dv] and its global (cross) part, float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, H, Dk = q.shape
    scale = 1.0 / np.sqrt(Dk) if scale is None else scale
    left, right = window

    def in_window(n):
        t, s = np.arange(n)[:, None], np.arange(n)[None, :]
        return (s >= t - left) & (s <= t + right) & ((s <= t) if causal else True)

    out, glob = np.zeros(v.shape), np.zeros(v.shape)
    for b in range(B):
        for h in range(H):
            y0 = attend(q[b, :, h], k[b, :, h], v[b, :, h], scale, in_window(T))
            y = y0
            for level in range(levels):
                c = compress(y, params["conv_weight"][level][h], params["conv_bias"][level][h], M)
                if level + 1 == levels:
                    break
                y = attend(c @ params["level_query"][level][h].T, c @ params["level_key"][level][h].T,
                           c @ params["level_value"][level][h].T, scale, in_window(len(c)))
            t, j = np.arange(T)[:, None], np.arange(len(c))[None, :]
            visible = ((j + 1) * M ** levels - 1 < t) if causal else np.ones((T, len(c)), bool)
            glob[b, :, h] = attend(y0 @ params["cross_query"][h].T, c @ params["cross_key"][h].T,
                                   c @ params["cross_value"][h].T, scale, visible)
            out[b, :, h] = y0 + glob[b, :, h]
    return out, glob


def random_params(H, Dk, Dv, M, levels, dtype=np.float64):
    """Variance-preserving random weights (as the C++ tests draw them), exact in `dtype`."""
    def draw(stddev, *shape):
        return RNG.normal(0, stddev, shape).astype(dtype).astype(np.float64)
    s = 1 / np.sqrt(Dv)
    return {"conv_weight": [draw(1 / np.sqrt(M * Dv), H, M, Dv, Dv) for _ in range(levels)],
            "conv_bias": [draw(0.5, H, Dv) for _ in range(levels)],
            "level_query": [draw(s, H, Dk, Dv) for _ in range(levels - 1)],
            "level_key": [draw(s, H, Dk, Dv) for _ in range(levels - 1)],
            "level_value": [draw(s, H, Dv, Dv) for _ in range(levels - 1)],
            "cross_query": draw(s, H, Dk, Dv), "cross_key": draw(s, H, Dk, Dv), "cross_value": draw(s, H, Dv, Dv)}


def flat(params):
    """Every weight array of a params dict, in one fixed order."""
    return [w for f in LEVEL_FIELDS for w in params[f]] + [params[f] for f in ("cross_query", "cross_key", "cross_value")]


def unflat(arrays, like):
    it = iter(arrays)
    out = {f: [next(it) for _ in like[f]] for f in LEVEL_FIELDS}
    out.update({f: next(it) for f in ("cross_query", "cross_key", "cross_value")})
    return out


def relative_error(got, expected):
    return np.abs(np.asarray(got, np.float64) - expected).max() / max(np.abs(expected).max(), 1e-300)


def inputs(B, T, H, Dk, Dv, dtype):
    return [RNG.normal(0, 1, (B, T, H, Dk)).astype(dtype) for _ in range(2)] + \
        [RNG.uniform(-1, 1, (B, T, H, Dv)).astype(dtype)]


# (B, T, H, Dk, Dv, M, levels, window (left, right) or None, scale)
CASES = [(1, 1, 1, 2, 3, 1, 1, None, None), (2, 29, 2, 5, 4, 3, 1, None, None), (1, 40, 1, 4, 6, 2, 2, None, 0.37),
         (2, 33, 2, 3, 5, 3, 2, (5, 2), None), (1, 45, 2, 4, 3, 2, 3, (1, 3), None), (1, 7, 1, 3, 2, 8, 1, (0, 0), None)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("exec_", ["cpu", "reference"])
def test_forward_matches_the_definition(dtype, causal, exec_):
    with_cross = 0
    for B, T, H, Dk, Dv, M, L, window, scale in CASES:
        params = random_params(H, Dk, Dv, M, L, dtype)
        sides = {} if window is None else {"window_left": window[0], "window_right": 0 if causal else window[1]}
        attention = latte.ConvCompressedAttention(H, Dk, Dv, M, levels=L, causal=causal, scale=scale, **sides,
                                                  **params)
        resolved = (M - 1, 0 if causal else M - 1) if window is None else (sides["window_left"], sides["window_right"])
        assert attention.window == resolved and attention.levels == L and attention.group_size == M
        x = inputs(B, T, H, Dk, Dv, dtype)
        expected, glob = conv_compressed_definition(*x, params, M, L, causal, resolved, scale)
        with_cross += np.abs(glob).max() > 0.05 * np.abs(expected).max()
        assert relative_error(attention.forward(*x, exec=exec_), expected) <= TOLERANCE[dtype], (B, T, M, L)
    assert with_cross >= 4  # the compressed path is exercised, not only the window


def test_weights_round_trip_and_default_to_zero():
    H, Dk, Dv, M, L = 2, 3, 4, 2, 2
    params = random_params(H, Dk, Dv, M, L)
    params["cross_value"] = np.asfortranarray(params["cross_value"])  # any strides: copied by value
    params["conv_weight"][1] = params["conv_weight"][1].transpose(0, 1, 3, 2).copy().transpose(0, 1, 3, 2)
    attention = latte.ConvCompressedAttention(H, Dk, Dv, M, levels=L, **params)
    for got, given in zip(flat(attention.params), flat(params)):
        np.testing.assert_array_equal(got, given)
    zero = latte.ConvCompressedAttention(H, Dk, Dv, M, levels=L, cross_key=params["cross_key"]).params
    assert [len(zero[f]) for f in LEVEL_FIELDS] == [L, L, L - 1, L - 1, L - 1]
    np.testing.assert_array_equal(zero["cross_key"], params["cross_key"])
    assert all(not w.any() for w in flat(zero) if w is not zero["cross_key"])
    # Only the window (y0) is left when every weight is zero: the cross part reads zero values.
    x = inputs(1, 9, H, Dk, Dv, np.float64)
    expected, _ = conv_compressed_definition(*x, latte.ConvCompressedAttention(H, Dk, Dv, M).params, M, 1, True,
                                             (M - 1, 0))
    assert relative_error(latte.ConvCompressedAttention(H, Dk, Dv, M).forward(*x), expected) <= 1e-12


@pytest.mark.parametrize("exec_", ["cpu", "reference"])
@pytest.mark.parametrize("levels", [1, 2])
def test_decode_continues_the_sequence_and_pickles(exec_, levels):
    B, T, H, Dk, Dv, M, prefill = 2, 30, 2, 3, 4, 2, 11
    params = random_params(H, Dk, Dv, M, levels)
    attention = latte.ConvCompressedAttention(H, Dk, Dv, M, levels=levels, window_left=3, **params)
    x = inputs(B, T, H, Dk, Dv, np.float64)
    expected, _ = conv_compressed_definition(*x, params, M, levels, True, (3, 0))
    state = attention.make_state(B, T + 2, dtype="float64")
    rows = [attention.forward(*(a[:, :prefill] for a in x), state=state, exec=exec_)]
    for t in range(prefill, T):
        if t == 17:
            state = pickle.loads(pickle.dumps(state))
        if t == 23:
            state = attention.load_state(state.save(), dtype="float64")
        rows.append(attention.step(state, *(a[:, t] for a in x), exec=exec_)[:, None])
    assert state.position == T and state.batch == B
    assert relative_error(np.concatenate(rows, axis=1), expected) <= 1e-12
    restored = pickle.loads(pickle.dumps(attention))
    assert relative_error(restored.forward(*x), expected) <= 1e-12


def test_state_from_fields_rebuilds_a_state_of_the_capacity_given():
    B, T, H, Dk, Dv, M = 2, 13, 2, 3, 4, 2
    params = random_params(H, Dk, Dv, M, 2)
    attention = latte.ConvCompressedAttention(H, Dk, Dv, M, levels=2, window_left=3, **params)
    x = inputs(B, T, H, Dk, Dv, np.float64)
    expected, _ = conv_compressed_definition(*x, params, M, 2, True, (3, 0))
    state = attention.make_state(B, T + 3, dtype="float64")
    first = attention.forward(*(a[:, :7] for a in x), state=state)
    rebuilt = attention.state_from_fields(state.fields(), position=7, context_capacity=T + 3)
    assert rebuilt.position == 7 and rebuilt.save() == state.save()
    rest = attention.forward(*(a[:, 7:] for a in x), state=rebuilt)
    assert relative_error(np.concatenate([first, rest], axis=1), expected) <= 1e-12

    def refused(argument, call):
        with pytest.raises(latte.Error) as error:
            call()
        assert error.value.argument == argument, error.value

    fields = state.fields()
    refused("context_capacity", lambda: attention.state_from_fields(fields, position=7))
    refused("position", lambda: attention.state_from_fields(fields, position=T + 4, context_capacity=T + 3))
    refused("fields.compressed_keys", lambda: attention.state_from_fields(fields, position=7, context_capacity=40))
    with pytest.raises(TypeError):  # a state with no capacity takes none
        latte.Lavo(H, Dk, 2, 3).state_from_fields({}, position=0, context_capacity=8)


def test_strided_inputs_are_read_in_place_and_out_is_written():
    H, Dk, Dv, M = 2, 4, 3, 3
    params = random_params(H, Dk, Dv, M, 1, np.float32)
    attention = latte.ConvCompressedAttention(H, Dk, Dv, M, causal=False, **params)
    wide = RNG.normal(size=(1, 20, H, 2 * Dk + Dv)).astype(np.float32)
    q, k, v = wide[..., :Dk], wide[..., Dk:2 * Dk], wide[..., 2 * Dk:]
    assert native._data_address(k) == k.ctypes.data
    out = np.full((1, 20, H, Dv), np.nan, np.float32)
    assert attention.forward(q, k, v, out) is out
    expected, _ = conv_compressed_definition(q, k, v, params, M, 1, False, (M - 1, M - 1))
    assert relative_error(out, expected) <= TOLERANCE[np.float32]
    assert attention.kind("float64") == "ConvCompressedAttention<bidirectional>/float64"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("levels", [1, 2])
def test_backward_along_random_directions_with_every_weight(dtype, causal, levels):
    B, T, H, Dk, Dv, M = 2, 21, 2, 3, 4, 2
    params = random_params(H, Dk, Dv, M, levels, dtype)
    window = (2, 0 if causal else 1)
    attention = latte.ConvCompressedAttention(H, Dk, Dv, M, levels=levels, causal=causal, window_left=window[0],
                                              window_right=window[1], **params)
    x = inputs(B, T, H, Dk, Dv, dtype)
    d_out = RNG.uniform(-1, 1, x[2].shape).astype(dtype)
    *d_inputs, d_params = attention.backward(*x, d_out)
    assert sorted(d_params) == sorted(params)
    assert [g.shape for g in flat(d_params)] == [w.shape for w in flat(params)]
    assert all(g.dtype == np.float64 for g in flat(d_params))
    point = [a.astype(np.float64) for a in x] + flat(params)
    directions = [RNG.normal(size=a.shape) for a in point]

    def f(t):
        q, k, v, *weights = (a + t * dd for a, dd in zip(point, directions))
        out, _ = conv_compressed_definition(q, k, v, unflat(weights, params), M, levels, causal, window)
        return (out * d_out).sum()

    assert directional_error(f, d_inputs + flat(d_params), directions) <= GRADIENT_TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("exec_", ["cpu", "reference"])
def test_chunks_chained_through_state_gradients_match_the_definition(dtype, levels, exec_):
    """Training in chunks: forwards chunk by chunk from a fresh state, then backwards last
    chunk first, each with the state it started from and the next chunk's d_initial_state as
    its d_final_state; the pieces are the whole sequence's gradient, checked along random
    directions of the definition (every weight too)."""
    B, T, H, Dk, Dv, M = 2, 23, 2, 3, 4, 2
    params = random_params(H, Dk, Dv, M, levels, dtype)
    attention = latte.ConvCompressedAttention(H, Dk, Dv, M, levels=levels, window_left=3, **params)
    x = inputs(B, T, H, Dk, Dv, dtype)
    d_out = RNG.uniform(-1, 1, x[2].shape).astype(dtype)
    bounds = [0, 5, 6, 15, T]  # groups of both levels open at every cut
    states = [attention.make_state(B, T, dtype=np.dtype(dtype).name)]
    for lo, hi in zip(bounds, bounds[1:]):
        states.append(states[-1].copy())
        attention.forward(*(a[:, lo:hi] for a in x), state=states[-1], exec=exec_)
    d_state, pieces = None, []
    for i in reversed(range(len(bounds) - 1)):
        lo, hi = bounds[i], bounds[i + 1]
        *gradients, d_state = attention.backward(*(a[:, lo:hi] for a in x), d_out[:, lo:hi],
                                                 initial_state=states[i], d_final_state=d_state, exec=exec_)
        assert d_state.position == lo
        pieces.insert(0, gradients)
    d_inputs = [np.concatenate([p[i] for p in pieces], axis=1) for i in range(3)]
    d_params = [sum(arrays) for arrays in zip(*(flat(p[3]) for p in pieces))]
    point = [a.astype(np.float64) for a in x] + flat(params)
    directions = [RNG.normal(size=a.shape) for a in point]

    def f(t):
        q, k, v, *weights = (a + t * dd for a, dd in zip(point, directions))
        out, _ = conv_compressed_definition(q, k, v, unflat(weights, params), M, levels, True, (3, 0))
        return (out * d_out).sum()

    assert directional_error(f, d_inputs + d_params, directions) <= GRADIENT_TOLERANCE[dtype]
    fields = d_state.fields()  # the fresh state's gradient: nothing lives in it
    assert all(np.all(a == 0) for a in fields.values())


def test_bad_input_is_refused_by_name():
    H, Dk, Dv, M = 2, 3, 4, 2
    params = random_params(H, Dk, Dv, M, 2)

    def refused(argument, call):
        with pytest.raises(latte.Error) as error:
            call()
        assert error.value.argument == argument, error.value

    make = latte.ConvCompressedAttention
    refused("conv_weight[1]", lambda: make(H, Dk, Dv, M, levels=2,
                                           conv_weight=[params["conv_weight"][0], np.zeros((H, M, Dv, Dk))]))
    refused("conv_weight", lambda: make(H, Dk, Dv, M, levels=2, conv_weight=params["conv_weight"][:1]))
    refused("level_query", lambda: make(H, Dk, Dv, M, levels=1, level_query=params["level_query"]))
    refused("cross_key", lambda: make(H, Dk, Dv, M, cross_key=params["cross_key"].astype(np.float32)))
    refused("cross_value", lambda: make(H, Dk, Dv, M, cross_value=params["cross_key"]))
    refused("cross_values", lambda: make(H, Dk, Dv, M, cross_values=params["cross_value"]))
    refused("params.cross_query", lambda: make(H, Dk, Dv, M, cross_query=np.full((H, Dk, Dv), np.inf)))
    refused("dims.group_size", lambda: make(H, Dk, Dv, 0))
    refused("dims.window_right", lambda: make(H, Dk, Dv, M, window_right=1))
    causal, bidirectional = make(H, Dk, Dv, M, levels=2, **params), make(H, Dk, Dv, M, causal=False)
    refused("make_state", lambda: bidirectional.make_state(1, 8))
    x = inputs(1, 6, H, Dk, Dv, np.float32)
    refused("keys", lambda: causal.forward(x[0], x[1].astype(np.float64), x[2]))
    refused("values", lambda: causal.forward(x[0], x[1], x[2][..., :2]))
    refused("exec", lambda: causal.forward(*x, exec="cuda"))
    state = causal.make_state(1, 6)
    causal.forward(*x, state=state)
    refused("state", lambda: causal.step(state, *(a[:, 0] for a in x)))  # past context_capacity
    refused("d_out", lambda: causal.backward(*x, x[2].astype(np.float64)))
