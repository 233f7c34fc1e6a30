"""latte.torch's ops for softmax attention, cosFormer, LeaPformer, Latte Macchiato and LAVO:
the forward against each mechanism's NumPy float64 definition (imported from that mechanism's
own test module), torch.autograd.gradcheck in float64 (central differences of the op itself)
over every differentiable input, learned parameters included, torch.compile(fullgraph=True)
equal to eager, bad input, and the nn.Module wrappers' parameters. Skipped, saying why, where
PyTorch is not installed."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the torch ops are not tested")

import latte  # noqa: E402
import latte.torch as lt  # noqa: E402
from latte_reference import rope_angles  # noqa: E402
from test_latte_macchiato import macchiato_definition  # noqa: E402
from test_lavo import lavo_definition  # noqa: E402
from test_leapformer import leap_definition  # noqa: E402
from test_linear_attention import linear_definition  # noqa: E402
from test_softmax_attention import softmax_definition  # noqa: E402
from test_torch import tensors  # noqa: E402


def binding_takes_macchiato_angles():
    try:
        latte.LatteMacchiato(1, 1, 2, 2, 1, vapor=True, angles=np.zeros((1, 1)))
        return True
    except TypeError:
        return False


ANGLES = binding_takes_macchiato_angles()
NEEDS_ANGLES = pytest.mark.skipif(not ANGLES, reason="latte.LatteMacchiato (python/src/latte_macchiato.cpp) "
                                                     "takes no angles in this build")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One OpenMP thread (torch and latte share the runtime) while these run: gradcheck makes thousands
    of tiny calls, each of which otherwise waits on a second spinning thread of a busy small machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def gradcheck(op, inputs):
    """torch.autograd.gradcheck, allowing 1e-12 between two backward calls on the same inputs: latte's
    Eigen paths (bidirectional linear family, LAVO) vary in the last bits from call to call."""
    return torch.autograd.gradcheck(op, inputs, nondet_tol=1e-12)


def numpy(*xs):
    return [x.detach().numpy() for x in xs]


def assert_matches(out, expected):
    assert np.abs(out.detach().numpy() - expected).max() <= 1e-12 * np.abs(expected).max()


def scaled(scale, *shapes, seed):
    """Leaf float64 tensors of N(0, scale^2) entries."""
    return [(scale * t).detach().requires_grad_() for t in tensors(*shapes, seed=seed)]


def leap_module(hidden, dim, seed):
    """(w1, b1, w2, b2) as float64 tensors, b2 a scalar."""
    w1, b1, w2, b2 = scaled(0.5, (hidden, dim), (hidden,), (hidden,), (1,), seed=seed)
    return [w1, b1, w2, b2.detach().reshape(()).requires_grad_()]


def leap_numpy(module):
    return tuple(numpy(*module))[:3] + (float(module[3].detach()),)


@pytest.mark.parametrize("causal,window", [(True, None), (True, (2, 0)), (False, None), (False, (1, 2))])
def test_softmax_op_matches_the_definition_and_gradcheck(causal, window):
    q, k, v = tensors((1, 7, 2, 3), (1, 7, 2, 3), (1, 7, 2, 4))

    def op(a, b, c):
        return lt.softmax_attention(a, b, c, causal=causal, window=window, scale=0.8)

    assert_matches(op(q, k, v), softmax_definition(*numpy(q, k, v), causal, window, scale=0.8))
    assert gradcheck(op, (q, k, v))


@pytest.mark.parametrize("causal,length", [(True, None), (False, None), (True, 12)])
def test_cosformer_op_matches_the_definition_and_gradcheck(causal, length):
    q, k, v = tensors((1, 7, 2, 3), (1, 7, 2, 3), (1, 7, 2, 4), seed=1)

    def op(a, b, c):
        return lt.cosformer(a, b, c, causal=causal, length=length)

    expected = linear_definition(*numpy(q, k, v), causal, "relu", ("clamp_min", 1e-6), cosformer_length=length or 7)
    assert_matches(op(q, k, v), expected)
    assert gradcheck(op, (q, k, v))


@pytest.mark.parametrize("causal", [True, False])
def test_leapformer_op_with_learned_modules_gradcheck(causal):
    q, k, v = tensors((1, 6, 2, 4), (1, 6, 2, 4), (1, 6, 2, 3), seed=2)
    query_module, key_module = leap_module(2, 4, seed=3), leap_module(2, 4, seed=5)

    def op(a, b, c, *weights):
        return lt.leapformer(a, b, c, weights[:4], weights[4:], causal=causal)

    expected = leap_definition(*numpy(q, k, v), leap_numpy(query_module), leap_numpy(key_module), causal)
    assert_matches(op(q, k, v, *query_module, *key_module), expected)
    assert gradcheck(op, (q, k, v, *query_module, *key_module))


def two_stream_case(mechanism, seed, T=13):
    """(op(q, k, v, *weights, **state options), leaves q, k, v (and LeaPformer's modules' weights),
    the NumPy definition of the whole sequence)."""
    q, k, v = tensors((2, T, 2, 4), (2, T, 2, 4), (2, T, 2, 3), seed=seed)
    if mechanism == "cosformer":  # M = T: the last chunk's final state sits at position M
        def op(a, b, c, **options):
            return lt.cosformer(a, b, c, length=T, **options)
        return op, [q, k, v], lambda: linear_definition(*numpy(q, k, v), True, "relu", ("clamp_min", 1e-6),
                                                       cosformer_length=T)
    query_module, key_module = leap_module(2, 4, seed=seed + 1), leap_module(2, 4, seed=seed + 2)

    def op(a, b, c, *weights, **options):
        return lt.leapformer(a, b, c, weights[:4], weights[4:], **options)
    return op, [q, k, v, *query_module, *key_module], \
        lambda: leap_definition(*numpy(q, k, v), leap_numpy(query_module), leap_numpy(key_module), True)


@pytest.mark.parametrize("mechanism", ["cosformer", "leapformer"])
def test_cosformer_and_leapformer_train_in_chunks(mechanism):
    op, leaves, definition = two_stream_case(mechanism, seed=20)
    q, k, v, *weights = leaves
    weight = tensors(tuple(v.shape), seed=23)[0].detach()
    whole = op(q, k, v, *weights)
    expected = torch.autograd.grad((whole * weight).sum(), leaves)
    outs, state = [], None
    for lo, hi in ((0, 1), (1, 5), (5, 13)):  # chunks of 1, 4 and 8 tokens
        out, state = op(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], *weights, initial_state=state,
                        output_final_state=True, position=lo)
        outs.append(out)
    out = torch.cat(outs, 1)
    got = torch.autograd.grad((out * weight).sum(), leaves)
    assert_matches(out, definition())
    torch.testing.assert_close(out, whole, rtol=0, atol=1e-12)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12 * e.abs().max().item())
    assert [tuple(f.shape) for f in state] == [(2, 2, 8, 3), (2, 2, 8)]
    with pytest.raises(latte.Error) as error:
        op(q, k, v, *weights, causal=False, output_final_state=True)
    assert error.value.argument == "initial_state"


@pytest.mark.parametrize("mechanism", ["cosformer", "leapformer"])
def test_cosformer_and_leapformer_state_ops_gradcheck_with_the_final_state_in_the_loss(mechanism):
    op, leaves, _ = two_stream_case(mechanism, seed=30, T=9)
    q, k, v, *weights = leaves
    with torch.no_grad():
        _, start = op(q[:, :4], k[:, :4], v[:, :4], *weights, output_final_state=True)
    start = [s.clone().requires_grad_() for s in start]
    q, k, v = (x[:, 4:].detach().clone().requires_grad_() for x in (q, k, v))

    def f(q, k, v, memory, normaliser, *weights):
        out, final = op(q, k, v, *weights, initial_state=(memory, normaliser), output_final_state=True, position=4)
        return out, *final

    assert gradcheck(f, (q, k, v, *start, *weights))
    compiled = torch.compile(lambda *x: f(*x)[0].square().sum() + f(*x)[1].sum(), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v, *start, *weights), f(q, k, v, *start, *weights)[0].square().sum() +
                               f(q, k, v, *start, *weights)[1].sum())


def macchiato_inputs(seed, T=6, H=2, L=2, Dk=4, Dv=4):
    return scaled(1.5, (1, T, H, L + 1), (1, T, H, L), (1, T, H, Dk), (1, T, H, Dk), seed=seed) + \
        tensors((1, T, H, Dv), seed=seed + 1)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("vapor,rope,all_states", [(False, False, False), (True, True, False), (True, False, True)])
def test_latte_macchiato_op_matches_the_definition_and_gradcheck(causal, vapor, rope, all_states):
    x = macchiato_inputs(seed=6)
    scope = "all_states" if all_states else "latent_states"

    def op(*inputs):
        return lt.latte_macchiato(*inputs, window=2, causal=causal, vapor=vapor, rope=rope, vapor_scope=scope,
                                  scale=0.9)

    assert_matches(op(*x), macchiato_definition(*numpy(*x), 2, causal, vapor, rope, all_states, scale=0.9))
    assert gradcheck(op, x)


@NEEDS_ANGLES
@pytest.mark.parametrize("causal,all_states", [(True, False), (False, True)])
def test_latte_macchiato_op_with_learned_angles_gradcheck(causal, all_states):
    x = macchiato_inputs(seed=8)
    angles = scaled(0.3, (2, 2), seed=9)[0]
    scope = "all_states" if all_states else "latent_states"

    def op(*inputs):
        return lt.latte_macchiato(*inputs[:5], window=2, causal=causal, rope=True, vapor_scope=scope, angles=inputs[5])

    expected = macchiato_definition(*numpy(*x), 2, causal, True, True, all_states, angles=angles.detach().numpy())
    assert_matches(op(*x, angles), expected)
    assert gradcheck(op, (*x, angles))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("learn_basis", [True, False])
def test_lavo_op_with_learned_bias_and_bases_gradcheck(causal, learn_basis):
    H, d, r, w = 2, 4, 2, 3
    q, k, v = tensors((1, 9, H, d), (1, 9, H, d), (1, 9, H, d), seed=10)
    bias = scaled(0.5, (H, 2 * w - 1), seed=11)[0]
    basis = scaled(0.7, (H, r, d), seed=12)[0] if learn_basis else None  # any bases: no orthonormality needed

    def op(a, b, c, p, *given_basis):
        return lt.lavo(a, b, c, bases=r, window=w, relative_bias=p, basis=given_basis[0] if given_basis else None,
                       basis_seed=5, causal=causal)

    used_basis = basis.detach().numpy() if learn_basis else latte.Lavo(H, d, r, w, basis_seed=5).basis
    inputs = (q, k, v, bias) + ((basis,) if learn_basis else ())
    assert_matches(op(*inputs), lavo_definition(*numpy(q, k, v), used_basis, bias.detach().numpy(), w, causal))
    assert gradcheck(op, inputs)


def test_new_ops_compile_without_graph_breaks_forward_and_backward():
    H, D = 2, 4
    softmax, cosformer, leap = lt.SoftmaxAttention(window=(3, 0)), lt.CosFormer(), lt.LeaPformer(D, leap_factor=2)
    macchiato = lt.LatteMacchiato(H, D, 2, vapor=True, rope=True, learn_angles=ANGLES)
    lavo = lt.Lavo(H, D, 2, 4, learn_basis=True)
    modules = torch.nn.ModuleList([softmax, cosformer, leap, macchiato, lavo])
    x = tensors((1, 12, H, D), (1, 12, H, D), (1, 12, H, D), (1, 12, H, 3), (1, 12, H, 2), dtype=torch.float32)

    def loss(q, k, v, query_logits, key_logits):
        total = macchiato(query_logits, key_logits, q, k, v).square().sum()
        for module in (softmax, cosformer, leap, lavo):
            total = total + module(q, k, v).square().sum()
        return total

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    compiled_loss = compiled(*x)
    compiled_loss.backward()
    compiled_grads = [t.grad.clone() for t in x] + [p.grad.clone() for p in modules.parameters()]
    modules.zero_grad()
    eager = [t.detach().clone().requires_grad_() for t in x]
    eager_loss = loss(*eager)
    eager_loss.backward()
    eager_grads = [t.grad for t in eager] + [p.grad for p in modules.parameters()]
    torch.testing.assert_close(compiled_loss, eager_loss)
    assert len(compiled_grads) == len(eager_grads) == 5 + 8 + 2 + (1 if ANGLES else 0)
    for compiled_grad, eager_grad in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(compiled_grad, eager_grad)


def test_modules_match_the_definitions_and_their_parameters_receive_gradients():
    q, k, v = tensors((1, 8, 2, 4), (1, 8, 2, 4), (1, 8, 2, 4), seed=13)
    torch.manual_seed(0)  # the modules' initial weights: some LeaP units active
    x = macchiato_inputs(seed=14)
    leap = lt.LeaPformer(4, leap_factor=2, dtype=torch.float64)
    lavo = lt.Lavo(2, 4, 2, 3, learn_basis=True, dtype=torch.float64)
    macchiato = lt.LatteMacchiato(2, 4, 2, vapor=True, learn_angles=ANGLES, dtype=torch.float64)
    # nn.Linear's initialisation: uniform within 1 / sqrt(fan_in)
    assert leap.query_module.w1.abs().max() <= 0.5 and leap.key_module.w2.abs().max() <= 2 ** -0.5
    outputs = [
        (leap(q, k, v), leap_definition(*numpy(q, k, v), leap_numpy(leap.query_module.weights),
                                        leap_numpy(leap.key_module.weights))),
        (lavo(q, k, v), lavo_definition(*numpy(q, k, v), lavo.basis.detach().numpy(), np.zeros((2, 5)), 3)),
        (macchiato(*x), macchiato_definition(*numpy(*x), 2, True, True, angles=rope_angles(2, 4))),
    ]
    for out, expected in outputs:
        assert_matches(out, expected)
        out.square().sum().backward()
    parameters = list(leap.named_parameters()) + list(lavo.named_parameters()) + list(macchiato.named_parameters())
    assert len(parameters) == 8 + 2 + (1 if ANGLES else 0)
    for name, parameter in parameters:
        assert parameter.grad is not None and parameter.grad.shape == parameter.shape, name
        assert torch.isfinite(parameter.grad).all() and parameter.grad.abs().max() > 0, name


def test_bad_input_raises_latte_error_naming_the_argument():
    q, k, v = tensors((1, 5, 2, 4), (1, 5, 2, 4), (1, 5, 2, 4))
    module = leap_module(2, 4, seed=0)
    cases = [
        ("keys", lambda: lt.softmax_attention(q, k[..., :3], v)),
        ("window.right", lambda: lt.softmax_attention(q, k, v, window=(2, 1))),
        ("values", lambda: lt.cosformer(q, k, v[:, :4])),
        ("query_module", lambda: lt.leapformer(q, k, v, module[:3], module)),
        ("key_module.w1", lambda: lt.leapformer(q, k, v, module, leap_module(1, 4, seed=0))),
        ("query_logits", lambda: lt.latte_macchiato(k, k, q, k, v, window=2)),
        ("dims.window", lambda: lt.latte_macchiato(*macchiato_inputs(seed=0), window=0)),
        ("relative_bias", lambda: lt.lavo(q, k, v, bases=2, window=3, relative_bias=torch.zeros(2, 4))),
        ("basis", lambda: lt.lavo(q, k, v, bases=2, window=3, basis=torch.zeros(2, 3, 4))),
        ("empty_memory", lambda: lt.lavo(q, k, v, bases=2, window=3, empty_memory="global_only")),
    ]
    if not ANGLES:
        cases.append(("angles", lambda: lt.latte_macchiato(*macchiato_inputs(seed=0), window=2,
                                                           angles=torch.zeros(2, 2))))
    for argument, call in cases:
        with pytest.raises(latte.Error) as error:
            call()
        assert error.value.argument == argument
