"""latte.LatteAttention from Python against Latte's definition in NumPy float64
(latte_reference.py: the explicit T x T matrix, nothing shared with latte).

Forward on both backends, float32 and float64, causal and bidirectional, with
and without VAPOR; decode (prefill + step) and its pickled state; backward
against central differences of the definition (every element on small shapes,
random directions on larger ones, VAPOR's angles included); zero copies, the
GIL released, and bad input refused with latte.Error naming the argument.
"""

import copy
import pickle
import threading
import time

import numpy as np
import pytest

import latte
import latte._latte as native
from gradient_check import directional_error, elementwise_gradient
from latte_reference import latte as latte_definition, rope_angles

RNG = np.random.default_rng(2026)
TOLERANCE = {np.float32: 2e-5, np.float64: 1e-12}  # tests/tolerances.hpp: relative, normwise
GRADIENT_TOLERANCE = {np.float32: 1e-4, np.float64: 1e-8}


def relative_error(got, expected):
    scale = np.abs(expected).max()
    return np.abs(np.asarray(got, np.float64) - expected).max() / (scale if scale > 0 else 1.0)


def inputs(B, T, H, L, Dv, dtype, key_scale=2.0):
    q = RNG.normal(0, 2.0, (B, T, H, L)).astype(dtype)
    k = RNG.normal(0, key_scale, (B, T, H, L)).astype(dtype)
    v = RNG.uniform(-1, 1, (B, T, H, Dv)).astype(dtype)
    return q, k, v


def angles_of(attention):
    return attention.angles if attention.vapor else None


CONFIGURATIONS = [(causal, vapor) for causal in (True, False) for vapor in (False, True)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal,vapor", CONFIGURATIONS)
@pytest.mark.parametrize("exec_", ["cpu", "reference"])
def test_forward_matches_the_definition(dtype, causal, vapor, exec_):
    for B, T, H, L, Dv in [(1, 1, 1, 1, 1), (2, 17, 3, 5, 6), (1, 70, 2, 8, 16), (1, 130, 1, 3, 5)]:
        attention = latte.LatteAttention(H, L, Dv, causal=causal, vapor=vapor)
        q, k, v = inputs(B, T, H, L, Dv, dtype)
        out = attention.forward(q, k, v, exec=exec_)
        assert out.dtype == dtype and out.shape == (B, T, H, Dv)
        expected = latte_definition(q, k, v, causal, angles_of(attention))
        assert relative_error(out, expected) <= TOLERANCE[dtype], (B, T, H, L, Dv)


def test_vapor_angles_given_are_used():
    H, Dv = 2, 6
    angles = RNG.uniform(0.2, 1.4, (H, Dv // 2))
    attention = latte.LatteAttention(H, 4, Dv, vapor=True, angles=angles)
    np.testing.assert_array_equal(attention.angles, angles)
    q, k, v = inputs(1, 20, H, 4, Dv, np.float64)
    expected = latte_definition(q, k, v, True, angles)
    assert relative_error(attention.forward(q, k, v), expected) <= 1e-12
    np.testing.assert_allclose(latte.LatteAttention(H, 4, Dv, vapor=True).angles, rope_angles(H, Dv))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("vapor", [False, True])
def test_prefill_then_steps_continue_the_sequence(dtype, vapor):
    B, T, H, L, Dv, prefill = 2, 40, 2, 6, 8, 25
    attention = latte.LatteAttention(H, L, Dv, vapor=vapor)
    q, k, v = inputs(B, T, H, L, Dv, dtype)
    expected = latte_definition(q, k, v, True, angles_of(attention))
    state = attention.make_state(B, dtype=np.dtype(dtype).name)
    first = attention.forward(q[:, :prefill], k[:, :prefill], v[:, :prefill], state=state)
    assert state.position == prefill and state.batch == B
    rows = [first] + [attention.step(state, q[:, t], k[:, t], v[:, t])[:, None] for t in range(prefill, T)]
    assert relative_error(np.concatenate(rows, axis=1), expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_pickled_state_continues_bit_for_bit(dtype):
    B, H, L, Dv = 2, 3, 4, 6
    attention = latte.LatteAttention(H, L, Dv, vapor=True)
    q, k, v = inputs(B, 30, H, L, Dv, dtype)
    state = attention.make_state(B, first_position=1000, dtype=np.dtype(dtype).name)
    attention.forward(q[:, :20], k[:, :20], v[:, :20], state=state)
    restored = pickle.loads(pickle.dumps(state))
    twin = copy.deepcopy(state)
    loaded = attention.load_state(state.save(), dtype=np.dtype(dtype).name)
    assert restored.position == 1020 and loaded.position == 1020 and restored.dtype == np.dtype(dtype).name
    for t in range(20, 30):
        a = attention.step(state, q[:, t], k[:, t], v[:, t])
        for other in (restored, twin, loaded):
            np.testing.assert_array_equal(attention.step(other, q[:, t], k[:, t], v[:, t]), a)


def test_a_corrupted_saved_state_is_refused():
    attention = latte.LatteAttention(1, 2, 2)
    data = bytearray(attention.make_state(1).save())
    data[-1] ^= 1
    with pytest.raises(latte.Error) as error:
        attention.load_state(bytes(data))
    assert error.value.argument == "bytes"
    with pytest.raises(latte.Error):  # another attention's sizes
        latte.LatteAttention(1, 3, 2).load_state(attention.make_state(1).save())


# --- gradients -------------------------------------------------------------


@pytest.mark.parametrize("causal,vapor", CONFIGURATIONS)
@pytest.mark.parametrize("exec_", ["cpu", "reference"])
def test_backward_every_element_matches_central_differences(causal, vapor, exec_):
    B, T, H, L, Dv = 1, 6, 2, 3, 4
    attention = latte.LatteAttention(H, L, Dv, causal=causal, vapor=vapor)
    q, k, v = inputs(B, T, H, L, Dv, np.float64)
    d_out = RNG.uniform(-1, 1, v.shape)
    angles = angles_of(attention)
    gradients = attention.backward(q, k, v, d_out, exec=exec_)
    assert len(gradients) == (4 if vapor else 3)
    arguments = [q, k, v] + ([angles] if vapor else [])

    def loss_at(index, value):
        args = list(arguments)
        args[index] = value
        return (latte_definition(args[0], args[1], args[2], causal, args[3] if vapor else None) * d_out).sum()

    for index, (x, gradient) in enumerate(zip(arguments, gradients)):
        expected = elementwise_gradient(lambda y: loss_at(index, y), x)
        assert relative_error(gradient, expected) <= GRADIENT_TOLERANCE[np.float64], index


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal,vapor", CONFIGURATIONS)
def test_backward_along_random_directions(dtype, causal, vapor):
    B, T, H, L, Dv = 2, 33, 2, 5, 6
    attention = latte.LatteAttention(H, L, Dv, causal=causal, vapor=vapor)
    q, k, v = inputs(B, T, H, L, Dv, dtype)
    d_out = RNG.uniform(-1, 1, v.shape).astype(dtype)
    angles = angles_of(attention)
    gradients = attention.backward(q, k, v, d_out)
    x = [a.astype(np.float64) for a in (q, k, v)] + ([angles] if vapor else [])
    directions = [RNG.normal(size=a.shape) for a in x]

    def f(t):
        moved = [a + t * d for a, d in zip(x, directions)]
        return (latte_definition(*moved[:3], causal, moved[3] if vapor else None) * d_out).sum()

    assert directional_error(f, gradients, directions) <= GRADIENT_TOLERANCE[dtype]


def test_backward_from_an_initial_state_equals_the_whole_sequence():
    B, T, H, L, Dv, cut = 1, 24, 2, 4, 6, 9
    attention = latte.LatteAttention(H, L, Dv, vapor=True)
    q, k, v = inputs(B, T, H, L, Dv, np.float64)
    d_out = RNG.uniform(-1, 1, v.shape)
    whole = attention.backward(q, k, v, d_out)
    state = attention.make_state(B, dtype="float64")
    attention.forward(q[:, :cut], k[:, :cut], v[:, :cut], state=state)
    second = attention.backward(q[:, cut:], k[:, cut:], v[:, cut:], d_out[:, cut:], initial_state=state)
    # The second chunk's gradients with respect to its own inputs are the whole
    # sequence's there (what flows back into the first chunk goes through the
    # state's gradient, not returned here).
    for g_whole, g_chunk in zip(whole[:3], second[:3]):
        assert relative_error(g_chunk, g_whole[:, cut:]) <= 1e-12


# --- zero copies, the GIL, bad input ---------------------------------------


def test_inputs_are_read_in_place_and_out_is_written_in_place():
    attention = latte.LatteAttention(2, 4, 8)
    q, k, v = inputs(1, 64, 2, 4, 8, np.float32)
    for array in (q, k, v, q[:, ::2], v.transpose(0, 2, 1, 3).copy().transpose(0, 2, 1, 3)):
        assert native._data_address(array) == array.ctypes.data
    out = np.empty((1, 64, 2, 8), np.float32)
    assert attention.forward(q, k, v, out) is out
    # Strided inputs (every other token; values [B, H, T, Dv] in memory) read in place.
    strided_v = v.transpose(0, 2, 1, 3).copy().transpose(0, 2, 1, 3)
    got = attention.forward(q[:, ::2], k[:, ::2], strided_v[:, ::2])
    np.testing.assert_array_equal(
        got, attention.forward(np.ascontiguousarray(q[:, ::2]), np.ascontiguousarray(k[:, ::2]),
                               np.ascontiguousarray(v[:, ::2])))


def test_the_gil_is_released_while_a_kernel_runs():
    attention = latte.LatteAttention(8, 64, 64)
    q, k, v = inputs(1, 4096, 8, 64, 64, np.float32)
    done = threading.Event()
    ticks = 0

    def run():
        for _ in range(3):
            attention.forward(q, k, v, exec="reference")
        done.set()

    worker = threading.Thread(target=run)
    started = time.perf_counter()
    worker.start()
    while not done.is_set():
        ticks += 1
        time.sleep(0.001)
    worker.join()
    elapsed = time.perf_counter() - started
    # With the GIL held this thread would not run between the calls' start and end.
    assert ticks >= 0.25 * elapsed / 0.001 and elapsed > 0.05, (ticks, elapsed)


def test_kernel_seconds_counts_the_kernels_time_inside_each_call():
    # The C++ time of a call (latte.kernel_seconds()'s growth) is most of a long call's wall time
    # and never more than it.
    attention = latte.LatteAttention(8, 64, 64)
    q, k, v = inputs(1, 2048, 8, 64, 64, np.float32)
    for _ in range(2):
        before, started = latte.kernel_seconds(), time.perf_counter()
        attention.forward(q, k, v, exec="reference")
        wall, kernel = time.perf_counter() - started, latte.kernel_seconds() - before
        assert 0.5 * wall < kernel <= wall, (kernel, wall)


def error_of(call):
    with pytest.raises(latte.Error) as error:
        call()
    assert isinstance(error.value, ValueError)
    return error.value


def test_bad_input_is_refused_by_name():
    attention = latte.LatteAttention(2, 4, 6)
    q, k, v = inputs(1, 8, 2, 4, 6, np.float32)
    assert error_of(lambda: attention.forward(q.astype(np.int32), k, v)).argument == "query_logits"
    assert error_of(lambda: attention.forward(q, k.astype(np.float64), v)).argument == "key_logits"
    assert error_of(lambda: attention.forward(q, k, v[0])).argument == "values"
    assert error_of(lambda: attention.forward(q, k, v[:, :7])).argument == "values"
    read_only = np.empty((1, 8, 2, 6), np.float32)
    read_only.flags.writeable = False
    e = error_of(lambda: attention.forward(q, k, v, read_only))
    assert e.argument == "out" and "read-only" in str(e)
    assert error_of(lambda: attention.forward(q, k, v, np.empty((1, 8, 2, 5), np.float32))).argument == "out"
    assert error_of(lambda: attention.forward(q, k, v, exec="cuda")).argument == "exec"
    assert error_of(lambda: latte.LatteAttention(0, 4, 6)).argument == "dims.heads"
    assert error_of(lambda: latte.LatteAttention(2, 4, 6, angles=np.ones((2, 3)))).argument == "angles"
    assert error_of(lambda: latte.LatteAttention(2, 4, 6, vapor=True, angles=np.ones((2, 2)))).argument == "angles"
    bidirectional = latte.LatteAttention(2, 4, 6, causal=False)
    assert error_of(lambda: bidirectional.make_state(1)).argument == "make_state"
    state = attention.make_state(1, dtype="float64")
    assert error_of(lambda: attention.forward(q, k, v, state=state)).argument == "state"
    assert error_of(lambda: attention.step(attention.make_state(2), q[:, 0], k[:, 0], v[:, 0])).argument
    assert error_of(lambda: attention.make_state(1, dtype="float16")).argument == "dtype"
    message = str(error_of(lambda: attention.forward(q, k, v[:, :7])))
    assert "7" in message and "8" in message  # expected and given extents
