"""Decode states as arrays and their gradients, from NumPy (no torch): state.fields(),
attention.state_from_fields(...) and backward(..., initial_state=, d_final_state=) ending
in d_initial_state, for Latte and the linear family.

The references are the definitions in NumPy float64 continued from a state, by its
documented meaning (nothing shared with latte's recurrences). For one (sequence, head),
tokens j = 0.. of a chunk at absolute positions p + j:

  Latte (m, a, M the state's running_max, normaliser and memory, each sum field plus
  its low part; R VAPOR's rotation, or 1):
    A_l(i) = e^{m_l} a_l + sum_{j<=i} e^{k_jl}
    V_l(i) = e^{m_l} M_l + sum_{j<=i} e^{k_jl} R^{-(p+j)} v_j
    o_i    = R^{p+i} sum_l softmax(q_i)_l V_l(i) / A_l(i)
    final state: normaliser A(T-1) e^{-m_F}, memory V(T-1) e^{-m_F}, m_F its running_max
    (a reference at least the largest logit: the kernels may keep headroom above it)
  Linear (S, z the state's memory and normaliser, phi = elu + 1, N(D) = max(D, 0) + eps):
    o_i = phi(q_i)^T (S + sum_{j<=i} phi(k_j) v_j^T) / N(phi(q_i)^T (z + sum_{j<=i} phi(k_j)))
    final state: S + sum_j phi(k_j) v_j^T, z + sum_j phi(k_j)

A state's gradient is with respect to its sum fields, Latte's running_max held fixed:
the d_final term of the loss is <D, final field> with the final state's e^{-m_F} taken
at the unperturbed inputs.
"""

import numpy as np
import pytest

import latte
from gradient_check import directional_error, elementwise_gradient
from latte_reference import latte as latte_definition, rotate

RNG = np.random.default_rng(41)
EPS = 1e-6  # the linear normaliser's additive epsilon, passed explicitly


def relative_error(got, expected):
    return np.abs(np.asarray(got, np.float64) - expected).max() / max(np.abs(expected).max(), 1e-300)


def sums_of(fields, name):
    """A compensated sum as one value: its field plus its low part."""
    return fields[name].astype(np.float64) + fields[name + "_low"]


# --- the definitions continued from a state ------------------------------------


def latte_from_state(q, k, v, m, a, M, position=0, angles=None):
    """(out [B, T, H, Dv], final A [B, H, L], final V [B, H, L, Dv]) from a Latte state
    (m, a, M: [B, H, L], [B, H, L], [B, H, L, Dv]); A and V unscaled."""
    B, T, H, L = q.shape
    out = np.zeros(v.shape)
    A_final, V_final = np.zeros((B, H, L)), np.zeros(M.shape)
    for b in range(B):
        for h in range(H):
            theta = None if angles is None else angles[h]
            turn = (lambda x, n: x) if theta is None else (lambda x, n: rotate(x, n, theta))
            p_latent = np.exp(q[b, :, h] - q[b, :, h].max(axis=1, keepdims=True))
            p_latent /= p_latent.sum(axis=1, keepdims=True)
            carry = np.exp(m[b, h])
            A = carry * a[b, h]
            V = carry[:, None] * M[b, h]
            for i in range(T):
                w = np.exp(k[b, i, h])
                A = A + w
                V = V + w[:, None] * turn(v[b, i, h], -(position + i))[None, :]
                out[b, i, h] = turn((p_latent[i][:, None] * V / A[:, None]).sum(axis=0), position + i)
            A_final[b, h], V_final[b, h] = A, V
    return out, A_final, V_final


def elu_plus_one(x):
    return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


def linear_from_state(q, k, v, S, z):
    """(out, final S, final z) of linear attention (elu + 1, additive EPS) from (S, z)."""
    B, T, H, _ = q.shape
    out = np.zeros(v.shape)
    S_final, z_final = np.zeros(S.shape), np.zeros(z.shape)
    for b in range(B):
        for h in range(H):
            fq, fk = elu_plus_one(q[b, :, h]), elu_plus_one(k[b, :, h])
            for i in range(T):
                memory = S[b, h] + fk[:i + 1].T @ v[b, :i + 1, h]
                normaliser = z[b, h] + fk[:i + 1].sum(axis=0)
                out[b, i, h] = fq[i] @ memory / (max(fq[i] @ normaliser, 0.0) + EPS)
            S_final[b, h] = S[b, h] + fk.T @ v[b, :, h]
            z_final[b, h] = z[b, h] + fk.sum(axis=0)
    return out, S_final, z_final


# --- fields and state_from_fields --------------------------------------------------


def latte_inputs(B, T, H, L, Dv, dtype=np.float64):
    return (RNG.normal(0, 1.5, (B, T, H, L)).astype(dtype), RNG.normal(0, 1.5, (B, T, H, L)).astype(dtype),
            RNG.uniform(-1, 1, (B, T, H, Dv)).astype(dtype))


@pytest.mark.parametrize("vapor", [False, True])
def test_latte_fields_are_the_definitions_sums(vapor):
    B, T, H, L, Dv, first = 2, 13, 3, 4, 6, 7
    attention = latte.LatteAttention(H, L, Dv, vapor=vapor)
    q, k, v = latte_inputs(B, T, H, L, Dv)
    state = attention.make_state(B, first_position=first, dtype="float64")
    attention.forward(q, k, v, state=state)
    fields = state.fields()
    assert list(fields) == ["running_max", "normaliser", "memory", "normaliser_low", "memory_low"]
    assert fields["running_max"].shape == (B, H, L) and fields["memory"].shape == (B, H, L, Dv)
    assert fields["memory_low"].shape == (B, H, L, Dv) and fields["normaliser"].dtype == np.float64
    m = fields["running_max"]
    assert np.all(m >= k.max(axis=1)) and np.all(np.isfinite(m))
    fresh = np.full((B, H, L), -np.inf)
    _, A, V = latte_from_state(q, k, v, fresh, np.zeros((B, H, L)), np.zeros((B, H, L, Dv)), first,
                               attention.angles)
    assert relative_error(sums_of(fields, "normaliser"), A * np.exp(-m)) <= 1e-13
    assert relative_error(sums_of(fields, "memory"), V * np.exp(-m)[..., None]) <= 1e-13
    fields["memory"][...] = 0  # a copy: the state is untouched
    assert np.abs(state.fields()["memory"]).max() > 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("vapor", [False, True])
def test_a_latte_state_from_fields_continues_as_the_definition(dtype, vapor):
    B, T, H, L, Dv, position = 2, 9, 2, 3, 4, 11
    attention = latte.LatteAttention(H, L, Dv, vapor=vapor)
    q, k, v = latte_inputs(B, T, H, L, Dv, dtype)
    m = RNG.normal(0, 1, (B, H, L))
    a = RNG.uniform(0.5, 2, (B, H, L))
    M = RNG.uniform(-1, 1, (B, H, L, Dv))
    low = {"normaliser_low": RNG.uniform(-1, 1, (B, H, L)) * 1e-3, "memory_low": RNG.uniform(-1, 1, M.shape) * 1e-3}
    fields = {"running_max": m, "normaliser": a, "memory": M, **low}
    state = attention.state_from_fields({name: x.astype(dtype) for name, x in fields.items()}, position=position)
    assert state.position == position and state.batch == B and state.dtype == np.dtype(dtype).name
    for name, x in state.fields().items():
        np.testing.assert_array_equal(x, fields[name].astype(dtype))
    out = attention.forward(q, k, v, state=state)
    cast = {name: x.astype(dtype).astype(np.float64) for name, x in fields.items()}
    expected, A, V = latte_from_state(q, k, v, cast["running_max"], sums_of(cast, "normaliser"),
                                      sums_of(cast, "memory"), position, attention.angles)
    tolerance = 2e-5 if dtype == np.float32 else 1e-12
    assert relative_error(out, expected) <= tolerance
    final = state.fields()
    m_final = final["running_max"].astype(np.float64)
    assert np.all(m_final >= np.maximum(cast["running_max"], k.astype(np.float64).max(axis=1)))
    assert relative_error(sums_of(final, "normaliser"), A * np.exp(-m_final)) <= tolerance
    assert state.position == position + T


def test_linear_fields_and_state_from_fields_are_the_definitions():
    B, T, H, Dk, Dv = 2, 10, 2, 3, 4
    attention = latte.LinearAttention(H, Dk, Dv, normaliser=("additive", EPS))
    q, k, v = RNG.normal(0, 1, (B, T, H, Dk)), RNG.normal(0, 1, (B, T, H, Dk)), RNG.uniform(-1, 1, (B, T, H, Dv))
    state = attention.make_state(B, dtype="float64")
    attention.forward(q[:, :4], k[:, :4], v[:, :4], state=state)
    fields = state.fields()
    assert list(fields) == ["memory", "normaliser", "memory_low", "normaliser_low"]
    _, S, z = linear_from_state(q[:, :4], k[:, :4], v[:, :4], np.zeros((B, H, Dk, Dv)), np.zeros((B, H, Dk)))
    assert relative_error(sums_of(fields, "memory"), S) <= 1e-13
    assert relative_error(sums_of(fields, "normaliser"), z) <= 1e-13
    S0, z0 = RNG.uniform(-1, 1, (B, H, Dk, Dv)), RNG.uniform(0.5, 2, (B, H, Dk))
    built = attention.state_from_fields({"memory": S0, "normaliser": z0}, position=4)
    assert np.all(built.fields()["memory_low"] == 0)  # left out: a fresh state's
    expected, _, _ = linear_from_state(q[:, 4:], k[:, 4:], v[:, 4:], S0, z0)
    assert relative_error(attention.forward(q[:, 4:], k[:, 4:], v[:, 4:], state=built), expected) <= 1e-12


@pytest.mark.parametrize("make,shapes", [
    (lambda: latte.Lavo(2, 4, 3, 5).make_state(2, dtype="float64"),
     {"keys": (2, 2, 5, 4), "values": (2, 2, 5, 4), "window_sum": (2, 2, 3)}),
    (lambda: latte.LatteMacchiato(2, 3, 4, 6, window=3).make_state(2, dtype="float64"),
     {"memory": (2, 2, 3, 6), "window_keys": (2, 2, 4, 4), "window_values": (2, 2, 4, 6), "window_fill": (1,)}),
    (lambda: latte.SoftmaxAttention(2, 4, 6).make_state(2, capacity=8, dtype="float64"),
     {"keys": (2, 2, 8, 4), "values": (2, 2, 8, 6)}),
    (lambda: latte.CosFormer(2, 4, 6, length=50).make_state(2, dtype="float64"),
     {"memory": (2, 2, 8, 6), "normaliser": (2, 2, 8)})])
def test_every_familys_fields_cover_its_saved_state(make, shapes):
    state = make()
    fields = state.fields()
    assert all(x.dtype == np.float64 for x in fields.values())
    assert {name: fields[name].shape for name in shapes} == shapes
    saved = len(state.save())
    assert sum(x.size for x in fields.values()) * 8 < saved  # the data, without the header
    assert saved - sum(x.size for x in fields.values()) * 8 < 600


def error_of(call):
    with pytest.raises(latte.Error) as error:
        call()
    assert isinstance(error.value, ValueError)
    return error.value


def test_bad_fields_are_refused_by_name():
    attention = latte.LatteAttention(2, 3, 4)
    good = attention.make_state(1, dtype="float64").fields()
    assert error_of(lambda: attention.state_from_fields({**good, "memroy": good["memory"]})).argument == "fields.memroy"
    e = error_of(lambda: attention.state_from_fields({**good, "memory": good["memory"][..., :3]}))
    assert e.argument == "fields.memory" and "[1, 2, 3, 4]" in str(e) and "[1, 2, 3, 3]" in str(e)
    e = error_of(lambda: attention.state_from_fields({**good, "normaliser": good["normaliser"].astype(np.float32)}))
    assert e.argument == "fields.normaliser"
    assert error_of(lambda: attention.state_from_fields({**good, "memory": "zeros"})).argument == "fields.memory"
    assert error_of(lambda: attention.state_from_fields(
        {"memory": good["memory"].astype(np.int32)})).argument == "fields.memory"
    assert error_of(lambda: attention.state_from_fields({})).argument == "fields"
    assert error_of(lambda: attention.state_from_fields(good, position=-1)).argument
    cosformer = latte.CosFormer(1, 2, 2, length=8)
    fields = cosformer.make_state(1, dtype="float64").fields()
    assert error_of(lambda: cosformer.state_from_fields(fields, position=9)).argument in ("fields", "first_position")
    assert not hasattr(latte.SoftmaxAttention(1, 2, 2), "state_from_fields")


def test_bad_state_arguments_of_backward_are_refused_by_name():
    B, T, H, L, Dv = 1, 5, 2, 3, 4
    attention = latte.LatteAttention(H, L, Dv)
    q, k, v = latte_inputs(B, T, H, L, Dv)
    d_out = np.ones(v.shape)
    single = attention.make_state(B, dtype="float32")
    assert error_of(lambda: attention.backward(q, k, v, d_out, d_final_state=single)).argument == "d_final_state"
    other = latte.LatteAttention(H, L + 1, Dv).make_state(B, dtype="float64")
    assert error_of(lambda: attention.backward(q, k, v, d_out, d_final_state=other)).argument == "d_final_state"
    assert error_of(lambda: attention.backward(q, k, v, d_out, initial_state=other)).argument == "initial_state"
    fresh = attention.make_state(B, dtype="float64")  # running_max -inf where the final state's is finite
    # exec="reference": on exec::cpu the check throws inside an OpenMP region (std::terminate)
    e = error_of(lambda: attention.backward(q, k, v, d_out, d_final_state=fresh, exec="reference"))
    assert e.argument == "d_final_state" and "running_max" in str(e)
    bidirectional = latte.LatteAttention(H, L, Dv, causal=False)
    assert error_of(lambda: bidirectional.backward(q, k, v, d_out, d_final_state=fresh)).argument == "d_final_state"
    softmax = latte.SoftmaxAttention(H, L, Dv)
    cache = softmax.make_state(B, capacity=8, dtype="float64")
    assert error_of(lambda: softmax.backward(q, k, v, d_out, initial_state=cache)).argument == "initial_state"


# --- state gradients against central differences ---------------------------------


@pytest.mark.parametrize("vapor", [False, True])
@pytest.mark.parametrize("exec_", ["cpu", "reference"])
def test_latte_state_gradients_match_central_differences(vapor, exec_):
    B, T, H, L, Dv, position = 2, 6, 2, 3, 4, 5
    attention = latte.LatteAttention(H, L, Dv, vapor=vapor)
    angles = attention.angles
    q, k, v = latte_inputs(B, T, H, L, Dv)
    m = RNG.normal(0, 1, (B, H, L))
    fields = {"running_max": m, "normaliser": RNG.uniform(0.5, 2, (B, H, L)),
              "memory": RNG.uniform(-1, 1, (B, H, L, Dv)),
              "normaliser_low": RNG.uniform(-1, 1, (B, H, L)) * 1e-4,
              "memory_low": RNG.uniform(-1, 1, (B, H, L, Dv)) * 1e-4}
    initial = attention.state_from_fields(fields, position=position)
    final = initial.copy()
    attention.forward(q, k, v, state=final)
    d_out = RNG.uniform(-1, 1, v.shape)
    D_normaliser, D_memory = RNG.uniform(-1, 1, (B, H, L)), RNG.uniform(-1, 1, (B, H, L, Dv))
    d_final = attention.state_from_fields({"running_max": final.fields()["running_max"], "normaliser": D_normaliser,
                                           "memory": D_memory}, position=final.position)
    *gradients, d_initial = attention.backward(q, k, v, d_out, initial_state=initial, d_final_state=d_final,
                                               exec=exec_)
    assert isinstance(d_initial, latte.LatteState) and d_initial.position == position
    got = d_initial.fields()
    np.testing.assert_array_equal(got["running_max"], m)  # held fixed, copied from the initial state
    assert not got["normaliser_low"].any() and not got["memory_low"].any()
    scale = np.exp(-final.fields()["running_max"])  # e^{-m_F} at the unperturbed inputs

    def loss(x, a, M):
        out, A, V = latte_from_state(*x, m, a, M, position, angles)
        return (out * d_out).sum() + (A * scale * D_normaliser).sum() + (V * scale[..., None] * D_memory).sum()

    a, M = sums_of(fields, "normaliser"), sums_of(fields, "memory")
    for name, x in (("normaliser", a), ("memory", M)):
        expected = elementwise_gradient(lambda y: loss((q, k, v), *((y, M) if name == "normaliser" else (a, y))), x,
                                        step=1e-6)
        assert relative_error(got[name], expected) <= 1e-8, name
    # The inputs' gradients carry the d_final term too.
    directions = [RNG.normal(size=x.shape) for x in (q, k, v)]
    f = lambda t: loss([x + t * d for x, d in zip((q, k, v), directions)], a, M)  # noqa: E731
    assert directional_error(f, gradients[:3], directions) <= 1e-8


@pytest.mark.parametrize("exec_", ["cpu", "reference"])
def test_linear_state_gradients_match_central_differences(exec_):
    B, T, H, Dk, Dv = 2, 5, 2, 3, 2
    attention = latte.LinearAttention(H, Dk, Dv, normaliser=("additive", EPS))
    q, k, v = RNG.normal(0, 1, (B, T, H, Dk)), RNG.normal(0, 1, (B, T, H, Dk)), RNG.uniform(-1, 1, (B, T, H, Dv))
    S, z = RNG.uniform(-1, 1, (B, H, Dk, Dv)), RNG.uniform(0.5, 2, (B, H, Dk))
    S_low, z_low = RNG.uniform(-1, 1, S.shape) * 1e-4, RNG.uniform(-1, 1, z.shape) * 1e-4
    initial = attention.state_from_fields({"memory": S, "normaliser": z, "memory_low": S_low,
                                           "normaliser_low": z_low}, position=3)
    d_out = RNG.uniform(-1, 1, v.shape)
    DS, Dz = RNG.uniform(-1, 1, S.shape), RNG.uniform(-1, 1, z.shape)
    d_final = attention.state_from_fields({"memory": DS, "normaliser": Dz}, position=3 + T)
    *gradients, d_initial = attention.backward(q, k, v, d_out, initial_state=initial, d_final_state=d_final,
                                               exec=exec_)
    assert isinstance(d_initial, latte.LinearState) and d_initial.position == 3
    got = d_initial.fields()
    assert not got["memory_low"].any() and not got["normaliser_low"].any()

    def loss(x, S, z):
        out, S_final, z_final = linear_from_state(*x, S, z)
        return (out * d_out).sum() + (S_final * DS).sum() + (z_final * Dz).sum()

    S, z = S + S_low, z + z_low
    for name, x in (("memory", S), ("normaliser", z)):
        expected = elementwise_gradient(lambda y: loss((q, k, v), *((y, z) if name == "memory" else (S, y))), x,
                                        step=1e-6)
        assert relative_error(got[name], expected) <= 1e-8, name
    directions = [RNG.normal(size=x.shape) for x in (q, k, v)]
    f = lambda t: loss([x + t * d for x, d in zip((q, k, v), directions)], S, z)  # noqa: E731
    assert directional_error(f, gradients, directions) <= 1e-8


# --- training in chunks --------------------------------------------------------------


def leap_module(hidden, dim):
    return (RNG.normal(0, 0.5, (hidden, dim)), RNG.normal(0, 0.5, hidden), RNG.normal(0, 0.5, hidden), 0.1)


CHUNKED = {
    "latte": lambda: latte.LatteAttention(2, 4, 4),
    "latte_vapor": lambda: latte.LatteAttention(2, 4, 4, vapor=True),
    "linear": lambda: latte.LinearAttention(2, 4, 4),
    "linear_relu": lambda: latte.LinearAttention(2, 4, 4, feature_map="relu"),
    "linear_rope": lambda: latte.LinearAttention(2, 4, 4, rope=True),
    "cosformer": lambda: latte.CosFormer(2, 4, 4, length=64),
    "leapformer": lambda: latte.LeaPformer(2, 4, 4, query_module=leap_module(1, 4), key_module=leap_module(1, 4)),
}


def add_gradients(a, b):
    """Gradients summed element by element (LeaP modules' as tuples of arrays and floats)."""
    if isinstance(a, tuple):
        return tuple(add_gradients(x, y) for x, y in zip(a, b))
    return a + b


def assert_close(got, expected, tolerance):
    if isinstance(expected, tuple):
        for x, y in zip(got, expected):
            assert_close(x, y, tolerance)
        return
    assert np.abs(np.asarray(got) - expected).max() <= tolerance * max(np.abs(expected).max(), 1.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", CHUNKED)
def test_chunks_chained_through_state_gradients_equal_the_whole_sequence(name, dtype):
    attention = CHUNKED[name]()
    B, T, H, D, first, cuts = 2, 30, 2, 4, 3, (11, 19)
    q, k, v = (RNG.normal(0.3, 1, (B, T, H, D)).astype(dtype) for _ in range(3))
    d_out = RNG.uniform(-1, 1, v.shape).astype(dtype)
    dtype_name = np.dtype(dtype).name
    start = attention.make_state(B, first_position=first, dtype=dtype_name)
    # A d_final at the end: the gradient of <D, fields of the final state>.
    final = start.copy()
    attention.forward(q, k, v, state=final)
    d_end = attention.state_from_fields(
        {name: (RNG.uniform(-1, 1, x.shape).astype(dtype) if name in ("memory", "normaliser") else x)
         for name, x in final.fields().items() if not name.endswith("_low")}, position=final.position)
    *whole, d_start = attention.backward(q, k, v, d_out, initial_state=start, d_final_state=d_end)
    # Forward chunk by chunk, keeping the states between them; backward last chunk first.
    bounds = [0, *cuts, T]
    states = [start]
    for lo, hi in zip(bounds, bounds[1:]):
        states.append(states[-1].copy())
        attention.forward(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], state=states[-1])
    d_state, pieces = d_end, []
    for i in reversed(range(len(bounds) - 1)):
        lo, hi = bounds[i], bounds[i + 1]
        *gradients, d_state = attention.backward(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], d_out[:, lo:hi],
                                                 initial_state=states[i], d_final_state=d_state)
        pieces.insert(0, gradients)
    tolerance = 2e-5 if dtype == np.float32 else 1e-11
    for index in range(3):
        assert_close(np.concatenate([p[index] for p in pieces], axis=1), whole[index], tolerance)
    for index in range(3, len(whole)):  # learned parameters: summed over the chunks
        total = pieces[0][index]
        for p in pieces[1:]:
            total = add_gradients(total, p[index])
        assert_close(total, whole[index], tolerance)
    for field, expected in d_start.fields().items():
        if field == "running_max":  # the starting state's, copied
            np.testing.assert_array_equal(d_state.fields()[field], expected)
        else:
            assert_close(d_state.fields()[field], expected, tolerance)


def test_latte_chunked_whole_against_the_definition():
    """The whole-sequence side of the chunked test, from a fresh state at 0, is the definition's."""
    B, T, H, L, Dv = 1, 12, 2, 3, 4
    attention = latte.LatteAttention(H, L, Dv, vapor=True)
    q, k, v = latte_inputs(B, T, H, L, Dv)
    d_out = RNG.uniform(-1, 1, v.shape)
    *gradients, d_start = attention.backward(q, k, v, d_out, initial_state=attention.make_state(B, dtype="float64"))
    directions = [RNG.normal(size=x.shape) for x in (q, k, v)]

    def f(t):
        moved = [x + t * d for x, d in zip((q, k, v), directions)]
        return (latte_definition(*moved, True, attention.angles) * d_out).sum()

    assert directional_error(f, gradients[:3], directions) <= 1e-8
    assert np.isneginf(d_start.fields()["running_max"]).all()
