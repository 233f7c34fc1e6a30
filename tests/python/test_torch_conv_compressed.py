"""latte.torch's op for convolutional compression (torch.ops.latte.conv_compressed_attention):
the forward against the NumPy float64 definition of test_conv_compressed.py, torch.autograd.gradcheck
in float64 over the queries, keys, values and every weight (levels 1 and 2, causal and
bidirectional), torch.library.opcheck (schema, fakes, autograd registration),
torch.compile(fullgraph=True) equal to eager, bad input, and the nn.Module's parameters. Skipped,
saying why, where PyTorch is not installed."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the torch ops are not tested")

import latte  # noqa: E402
import latte.torch as lt  # noqa: E402
from test_conv_compressed import conv_compressed_definition  # noqa: E402
from test_torch import tensors  # noqa: E402

LISTS = ("conv_weight", "conv_bias", "level_query", "level_key", "level_value")
CROSS = ("cross_query", "cross_key", "cross_value")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One OpenMP thread (torch and latte share the runtime): gradcheck makes many tiny calls."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def weights(H, Dk, Dv, M, levels, seed, dtype=torch.float64):
    """Every weight as a leaf tensor, variance preserving (as test_conv_compressed draws them)."""
    shapes = {"conv_weight": [(H, M, Dv, Dv)] * levels, "conv_bias": [(H, Dv)] * levels,
              "level_query": [(H, Dk, Dv)] * (levels - 1), "level_key": [(H, Dk, Dv)] * (levels - 1),
              "level_value": [(H, Dv, Dv)] * (levels - 1),
              "cross_query": (H, Dk, Dv), "cross_key": (H, Dk, Dv), "cross_value": (H, Dv, Dv)}
    scales = {"conv_weight": (M * Dv) ** -0.5, "conv_bias": 0.5}
    generator = torch.Generator().manual_seed(seed)

    def draw(name, shape):
        scale = scales.get(name, Dv ** -0.5)
        return (scale * torch.randn(shape, dtype=dtype, generator=generator)).requires_grad_()

    return {name: [draw(name, s) for s in shape] if name in LISTS else draw(name, shape)
            for name, shape in shapes.items()}


def flat(w):
    return [t for name in LISTS for t in w[name]] + [w[name] for name in CROSS]


def unflat(tensors_, like):
    it = iter(tensors_)
    out = {name: [next(it) for _ in like[name]] for name in LISTS}
    out.update({name: next(it) for name in CROSS})
    return out


def as_numpy(w):
    return {name: [t.detach().numpy() for t in value] if name in LISTS else value.detach().numpy()
            for name, value in w.items()}


def resolved(window, M, causal):
    return (M - 1, 0 if causal else M - 1) if window is None else window


# (levels, causal, window (left, right) or None, scale, T)
CASES = [(1, True, None, None, 7), (1, False, (2, 1), 0.7, 7), (2, True, (3, 0), None, 10), (2, False, None, 0.9, 9)]


@pytest.mark.parametrize("levels,causal,window,scale,T", CASES)
def test_op_matches_the_definition_and_gradcheck_over_every_weight(levels, causal, window, scale, T):
    H, Dk, Dv, M = 2, 2, 3, 2
    q, k, v = tensors((1, T, H, Dk), (1, T, H, Dk), (1, T, H, Dv), seed=levels + 2 * causal)
    w = weights(H, Dk, Dv, M, levels, seed=7 + levels)
    sides = {} if window is None else {"window_left": window[0], "window_right": window[1]}

    def op(a, b, c, *flat_weights):
        return lt.conv_compressed_attention(a, b, c, **unflat(flat_weights, w), group_size=M, levels=levels,
                                            causal=causal, scale=scale, **sides)

    expected, glob = conv_compressed_definition(*(x.detach().numpy() for x in (q, k, v)), as_numpy(w), M, levels,
                                                causal, resolved(window, M, causal), scale)
    assert np.abs(glob).max() > 0.05 * np.abs(expected).max()  # the compressed path is exercised
    out = op(q, k, v, *flat(w))
    assert out.dtype == torch.float64 and out.shape == v.shape
    assert np.abs(out.detach().numpy() - expected).max() <= 1e-12 * np.abs(expected).max()
    assert torch.autograd.gradcheck(op, (q, k, v, *flat(w)), nondet_tol=1e-12)


def test_opcheck_and_gradients_in_each_weight_dtype():
    H, Dk, Dv, M, T = 2, 2, 3, 2, 9
    q, k, v = tensors((1, T, H, Dk), (1, T, H, Dk), (1, T, H, Dv), seed=3)
    w = weights(H, Dk, Dv, M, 2, seed=4, dtype=torch.float32)  # float32 weights, float64 sequence
    args = (q, k, v, *(w[name] for name in LISTS), *(w[name] for name in CROSS), M, 2, False, 1, 2, None)
    torch.library.opcheck(torch.ops.latte.conv_compressed_attention, args)
    out = lt.conv_compressed_attention(q, k, v, **w, group_size=M, causal=False, window_left=1, window_right=2)
    out.square().sum().backward()
    assert [x.grad.dtype for x in (q, k, v)] == [torch.float64] * 3
    for t in flat(w):
        assert t.grad is not None and t.grad.dtype == torch.float32 and t.grad.shape == t.shape
    d_out = torch.randn(out.shape, dtype=torch.float64)
    torch.library.opcheck(torch.ops.latte.conv_compressed_attention_backward, args[:11] + (d_out,) + args[11:],
                          test_utils=("test_schema", "test_faketensor"))


def test_compiled_module_equals_eager_forward_and_backward():
    H, Dk, Dv, M = 2, 3, 4, 2
    torch.manual_seed(1)
    module = lt.ConvCompressedAttention(H, Dk, Dv, M, levels=2, window_left=3)
    x = tensors((2, 13, H, Dk), (2, 13, H, Dk), (2, 13, H, Dv), dtype=torch.float32, seed=5)

    def loss(q, k, v):
        return module(q, k, v).square().sum()

    compiled_loss = torch.compile(loss, fullgraph=True, backend="aot_eager")(*x)
    compiled_loss.backward()
    compiled_grads = [t.grad.clone() for t in x] + [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    eager = [t.detach().clone().requires_grad_() for t in x]
    eager_loss = loss(*eager)
    eager_loss.backward()
    eager_grads = [t.grad for t in eager] + [p.grad for p in module.parameters()]
    torch.testing.assert_close(compiled_loss, eager_loss)
    assert len(compiled_grads) == len(eager_grads) == 3 + 2 + 2 + 3 + 3
    for compiled_grad, eager_grad in zip(compiled_grads, eager_grads):
        assert compiled_grad.dtype == torch.float32
        torch.testing.assert_close(compiled_grad, eager_grad)


@pytest.mark.parametrize("causal", [True, False])
def test_module_matches_the_definition_and_its_parameters_receive_gradients(causal):
    H, Dk, Dv, M, levels = 2, 3, 4, 2, 2
    torch.manual_seed(0)
    module = lt.ConvCompressedAttention(H, Dk, Dv, M, levels=levels, causal=causal, dtype=torch.float64)
    names = sorted(name for name, _ in module.named_parameters())
    assert names == sorted(["conv_weight.0", "conv_weight.1", "conv_bias.0", "conv_bias.1", "level_query.0",
                            "level_key.0", "level_value.0", "cross_query", "cross_key", "cross_value"])
    # nn.Linear's initialisation: uniform within 1 / sqrt(fan_in)
    assert module.conv_weight[1].abs().max() <= (M * Dv) ** -0.5 and module.cross_value.abs().max() <= Dv ** -0.5
    assert module.conv_bias[0].abs().max() > 0.5 * (M * Dv) ** -0.5  # random, not latte's zeros
    torch.manual_seed(0)
    again = lt.ConvCompressedAttention(H, Dk, Dv, M, levels=levels, causal=causal, dtype=torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), again.parameters()))  # seeded by torch
    q, k, v = tensors((1, 12, H, Dk), (1, 12, H, Dk), (1, 12, H, Dv), seed=6)
    out = module(q, k, v)
    expected, _ = conv_compressed_definition(*(x.detach().numpy() for x in (q, k, v)), as_numpy(module.weights), M,
                                             levels, causal, (M - 1, 0 if causal else M - 1))
    assert np.abs(out.detach().numpy() - expected).max() <= 1e-12 * np.abs(expected).max()
    out.square().sum().backward()
    for name, parameter in module.named_parameters():
        assert parameter.grad is not None and parameter.grad.shape == parameter.shape, name
        assert torch.isfinite(parameter.grad).all() and parameter.grad.abs().max() > 0, name


def test_bad_input_raises_latte_error_naming_the_argument():
    H, Dk, Dv, M = 2, 3, 4, 2
    q, k, v = tensors((1, 6, H, Dk), (1, 6, H, Dk), (1, 6, H, Dv))
    w = weights(H, Dk, Dv, M, 2, seed=0)

    def call(**changes):
        return lambda: lt.conv_compressed_attention(*changes.pop("x", (q, k, v)), **{**w, **changes}, group_size=M)

    cases = [
        ("keys", call(x=(q, k[..., :2], v))),
        ("values", call(x=(q, k, v.to(torch.float32)))),
        ("conv_weight", call(conv_weight=w["conv_weight"], levels=3)),
        ("conv_weight[1]", call(conv_weight=[w["conv_weight"][0], torch.zeros(H, M, Dv, Dk)])),
        ("level_query", call(level_query=None)),
        ("level_key", call(level_key=w["level_key"][0])),
        ("conv_bias[0]", call(conv_bias=[torch.zeros(H + 1, Dv), w["conv_bias"][1]])),
        ("cross_value", call(cross_value=w["cross_key"])),
        ("cross_query", call(cross_query=[w["cross_query"]])),
        ("dims.window_right", call(window_right=1)),
        ("dims.group_size", lambda: lt.ConvCompressedAttention(H, Dk, Dv, 0)),
    ]
    for argument, bad in cases:
        with pytest.raises(latte.Error) as error:
            bad()
        assert error.value.argument == argument, error.value


# --- training in chunks (initial_state / output_final_state) --------------------------------


def chunked(q, k, v, w, cuts, capacity, **options):
    """The op over the sequence in chunks, each continuing from the last's final state."""
    bounds, state, outs = [0, *cuts, q.shape[1]], None, []
    for lo, hi in zip(bounds, bounds[1:]):
        out, state = lt.conv_compressed_attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], **w, initial_state=state,
                                                  output_final_state=True, position=lo, context_capacity=capacity,
                                                  **options)
        outs.append(out)
    return torch.cat(outs, dim=1), state


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("levels,window_left", [(1, None), (2, 3)])
def test_chunks_under_autograd_equal_the_whole_sequence_and_the_definition(levels, window_left, dtype):
    H, Dk, Dv, M, T = 2, 2, 3, 2, 23
    q, k, v = tensors((2, T, H, Dk), (2, T, H, Dk), (2, T, H, Dv), dtype=dtype, seed=11 + levels)
    w = weights(H, Dk, Dv, M, levels, seed=13 + levels, dtype=dtype)
    options = {"group_size": M, "levels": levels, "window_left": window_left}
    leaves = [q, k, v, *flat(w)]
    weight = tensors((2, T, H, Dv), dtype=dtype, seed=15)[0].detach()
    whole = lt.conv_compressed_attention(q, k, v, **w, **options)
    expected = torch.autograd.grad((whole * weight).sum(), leaves)
    # chunks of 1, 2, 3, 5 and 12 tokens: inside a group, across groups and levels, past the window
    out, final = chunked(q, k, v, w, (3, 4, 6, 11), T, **options)
    got = torch.autograd.grad((out * weight).sum(), leaves)
    tolerance = {"rtol": 0, "atol": 2e-5 if dtype == torch.float32 else 1e-12}
    torch.testing.assert_close(out, whole, **tolerance)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g / e.abs().max(), e / e.abs().max(), **tolerance)
    as_float64 = as_numpy({n: [t.double() for t in x] if n in LISTS else x.double() for n, x in w.items()})
    reference, glob = conv_compressed_definition(*(x.detach().double().numpy() for x in (q, k, v)), as_float64, M,
                                                 levels, True,
                                                 resolved(None if window_left is None else (window_left, 0), M, True))
    assert np.abs(glob).max() > 0.05 * np.abs(reference).max()  # the compressed path is exercised
    assert np.abs(out.detach().double().numpy() - reference).max() <= 2 * tolerance["atol"] * np.abs(reference).max()
    ring = min((M - 1 if window_left is None else window_left) + 1, T)
    assert [tuple(f.shape) for f in final] == [(2, H, levels * ring, Dk), (2, H, levels * ring, Dv), (2, H, levels, Dv),
                                               (2, H, T // M ** levels, Dk), (2, H, T // M ** levels, Dv)]
    assert all(f.requires_grad for f in final)


@pytest.mark.parametrize("levels", [1, 2])
def test_state_op_gradcheck_with_the_final_state_in_the_loss(levels):
    H, Dk, Dv, M, T, capacity = 1, 2, 2, 2, 5, 16
    q, k, v = tensors((1, 4 + T, H, Dk), (1, 4 + T, H, Dk), (1, 4 + T, H, Dv), seed=17)
    w = weights(H, Dk, Dv, M, levels, seed=18)
    options = {"group_size": M, "levels": levels, "context_capacity": capacity}
    with torch.no_grad():  # a state at position 4 with every slot a token's, as its fields are saved
        _, start = lt.conv_compressed_attention(q[:, :4], k[:, :4], v[:, :4], **w, **options, output_final_state=True)
    start = [s.clone().requires_grad_() for s in start]
    q, k, v = (x[:, 4:].detach().clone().requires_grad_() for x in (q, k, v))

    def f(q, k, v, *rest):
        state, flat_weights = rest[:5], rest[5:]
        out, final = lt.conv_compressed_attention(q, k, v, **unflat(flat_weights, w), **options, initial_state=state,
                                                  output_final_state=True, position=4)
        return out, *final

    assert torch.autograd.gradcheck(f, (q, k, v, *start, *flat(w)), nondet_tol=1e-12)


def test_state_op_compiles_and_matches_its_fakes():
    H, Dk, Dv, M, T = 2, 2, 3, 2, 9
    q, k, v = tensors((1, T, H, Dk), (1, T, H, Dk), (1, T, H, Dv), dtype=torch.float32, seed=19)
    w = weights(H, Dk, Dv, M, 2, seed=20, dtype=torch.float32)

    def loss(q, k, v):
        out, (K, V, g, C, S) = lt.conv_compressed_attention(q, k, v, **w, group_size=M, levels=2,
                                                            output_final_state=True, context_capacity=20)
        return out.square().sum() + K.sum() + V.square().sum() + g.sum() + C.square().sum() + S.sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    expected = torch.autograd.grad(loss(q, k, v), (q, k, v))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    _, final = lt.conv_compressed_attention(q, k, v, **w, group_size=M, levels=2, output_final_state=True,
                                            context_capacity=20)
    weights_ = (*(w[name] for name in LISTS), *(w[name] for name in CROSS))
    for args in [(q, k, v, *weights_, *(None,) * 5, M, 2, None, None, 20, 0),
                 (q, k, v, *weights_, *(f.detach() for f in final), M, 2, None, None, 20, 9)]:
        torch.library.opcheck(torch.ops.latte.conv_compressed_attention_state, args)


def test_bad_states_raise_latte_error():
    H, Dk, Dv, M, T = 2, 2, 3, 2, 6
    q, k, v = tensors((1, T, H, Dk), (1, T, H, Dk), (1, T, H, Dv), seed=21)
    w = weights(H, Dk, Dv, M, 1, seed=22)
    _, final = lt.conv_compressed_attention(q, k, v, **w, group_size=M, output_final_state=True, context_capacity=12)

    def error_of(**options):
        with pytest.raises(latte.Error) as error:
            lt.conv_compressed_attention(q, k, v, **w, group_size=M, **options)
        return error.value.argument

    assert error_of(causal=False, output_final_state=True) == "initial_state"
    assert error_of(initial_state=final[:4], position=T, context_capacity=12) == "initial_state"
    # a capacity other than the state's: its compressed store has another size
    assert error_of(initial_state=final, position=T, context_capacity=20) == "fields.compressed_keys"
    with pytest.raises(latte.Error):  # past the capacity: 6 + 7 tokens do not fit in 12
        more = [torch.cat((x, x[:, :1]), dim=1) for x in (q, k, v)]
        lt.conv_compressed_attention(*more, **w, group_size=M, initial_state=final, position=T, context_capacity=12)
    assert error_of(position=3, output_final_state=True) == "position"  # a fresh state starts at 0
