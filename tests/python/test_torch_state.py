"""latte.torch's training in chunks (flash-linear-attention's initial_state / output_final_state)
for the Latte, linear-attention, Latte Macchiato and LAVO ops: torch.autograd.gradcheck in float64 with respect to the
inputs and the initial state's tensors under a loss that uses the final state (dh0 and dht),
the outputs against the NumPy definitions continued from a state, chunks chained under
autograd against the whole sequence, torch.compile(fullgraph=True) and the fake impls
(torch.library.opcheck). Skipped, saying why, where PyTorch is not installed."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the torch ops are not tested")

import latte  # noqa: E402
import latte.torch as lt  # noqa: E402
from latte_reference import latte as latte_definition  # noqa: E402
from test_latte_macchiato import macchiato_definition  # noqa: E402
from test_lavo import lavo_definition  # noqa: E402
from test_state_gradients import EPS, latte_from_state, linear_from_state  # noqa: E402


def tensors(*shapes, dtype=torch.float64, seed=0, grad=True):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, dtype=dtype, generator=generator, requires_grad=grad) for shape in shapes]


def latte_state(B, H, L, Dv, seed=1):
    """(running_max, normaliser, memory): running_max without a gradient (held fixed)."""
    generator = torch.Generator().manual_seed(seed)
    running_max = torch.randn(B, H, L, dtype=torch.float64, generator=generator)
    normaliser = (torch.rand(B, H, L, dtype=torch.float64, generator=generator) + 0.5).requires_grad_()
    memory = torch.randn(B, H, L, Dv, dtype=torch.float64, generator=generator).requires_grad_()
    return running_max, normaliser, memory


def linear_state(B, H, Dk, Dv, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, Dk, Dv, dtype=torch.float64, generator=generator).requires_grad_(),
            (torch.rand(B, H, Dk, dtype=torch.float64, generator=generator) + 0.5).requires_grad_())


def numpy(*xs):
    return [x.detach().numpy() for x in xs]


@pytest.mark.parametrize("vapor", [False, True])
def test_latte_state_op_matches_the_definition(vapor):
    B, T, H, L, Dv, position = 2, 7, 2, 3, 4, 6
    q, k, v = tensors((B, T, H, L), (B, T, H, L), (B, T, H, Dv))
    angles = torch.from_numpy(latte.LatteAttention(H, L, Dv, vapor=True).angles) if vapor else None
    state = latte_state(B, H, L, Dv)
    out, (m, a, M) = lt.latte_attention(q, k, v, angles=angles, initial_state=state, output_final_state=True,
                                        position=position)
    expected, A, V = latte_from_state(*numpy(q, k, v, *state), position, None if angles is None else angles.numpy())
    m_final = m.numpy()  # the final state's reference: at least every logit seen
    np.testing.assert_allclose(out.detach().numpy(), expected, rtol=0, atol=1e-12 * np.abs(expected).max())
    assert np.all(m_final >= np.maximum(state[0].numpy(), k.detach().numpy().max(axis=1)))
    np.testing.assert_allclose(a.detach().numpy(), A * np.exp(-m_final), rtol=1e-12)
    np.testing.assert_allclose(M.detach().numpy(), V * np.exp(-m_final)[..., None], rtol=0,
                               atol=1e-12 * np.abs(V).max())
    assert not m.requires_grad and a.requires_grad and M.requires_grad


@pytest.mark.parametrize("feature_map,rope", [("elu_plus_one", False), ("relu", False), ("elu_plus_one", True)])
def test_linear_state_op_gradcheck_with_the_final_state_in_the_loss(feature_map, rope):
    B, T, H, Dk, Dv = 2, 6, 2, 4, 3
    q, k, v = tensors((B, T, H, Dk), (B, T, H, Dk), (B, T, H, Dv), seed=3)
    S, z = linear_state(B, H, Dk, Dv)

    def f(q, k, v, S, z):
        out, (S_final, z_final) = lt.linear_attention(q, k, v, feature_map=feature_map, rope=rope,
                                                      initial_state=(S, z), output_final_state=True, position=5)
        return out, S_final, z_final

    assert torch.autograd.gradcheck(f, (q, k, v, S, z))


def test_linear_state_op_matches_the_definition():
    B, T, H, Dk, Dv = 2, 6, 2, 4, 3
    q, k, v = tensors((B, T, H, Dk), (B, T, H, Dk), (B, T, H, Dv), seed=4)
    S, z = linear_state(B, H, Dk, Dv)
    out, (S_final, z_final) = lt.linear_attention(q, k, v, initial_state=(S, z), output_final_state=True)
    # the op's default normaliser is latte's (additive EPS), which linear_from_state transcribes
    expected, S_expected, z_expected = linear_from_state(*numpy(q, k, v, S, z))
    np.testing.assert_allclose(out.detach().numpy(), expected, rtol=0, atol=1e-12 * np.abs(expected).max())
    np.testing.assert_allclose(S_final.detach().numpy(), S_expected, rtol=0, atol=1e-12 * np.abs(S_expected).max())
    np.testing.assert_allclose(z_final.detach().numpy(), z_expected, rtol=1e-12)
    assert EPS == 1e-6


@pytest.mark.parametrize("vapor", [False, True])
def test_latte_state_op_gradcheck_with_the_final_state_in_the_loss(vapor):
    B, T, H, L, Dv = 1, 6, 2, 3, 4
    q, k, v = tensors((B, T, H, L), (B, T, H, L), (B, T, H, Dv), seed=5)
    angles = tensors((H, Dv // 2), seed=6)[0] if vapor else None
    running_max, normaliser, memory = latte_state(B, H, L, Dv)

    def f(q, k, v, normaliser, memory, *angles):
        out, (m, a, M) = lt.latte_attention(q, k, v, angles=angles[0] if angles else None,
                                            initial_state=(running_max, normaliser, memory),
                                            output_final_state=True, position=3)
        scale = torch.exp(m)  # the final state's meaning: its sums times exp(running_max)
        return out, a * scale, M * scale[..., None]

    assert torch.autograd.gradcheck(f, (q, k, v, normaliser, memory, *([angles] if vapor else [])))


def test_the_initial_running_max_gets_no_gradient():
    B, T, H, L, Dv = 1, 4, 1, 2, 2
    q, k, v = tensors((B, T, H, L), (B, T, H, L), (B, T, H, Dv))
    running_max, normaliser, memory = latte_state(B, H, L, Dv)
    running_max.requires_grad_()
    out = lt.latte_attention(q, k, v, initial_state=(running_max, normaliser, memory))
    out.sum().backward()
    assert running_max.grad is None and normaliser.grad is not None and memory.grad is not None


def chained(op, inputs, cuts, **options):
    """The op over the sequence in chunks, each continuing from the last's final state."""
    bounds, state, outs = [0, *cuts, inputs[0].shape[1]], None, []
    for lo, hi in zip(bounds, bounds[1:]):
        out, state = op(*(x[:, lo:hi] for x in inputs), initial_state=state, output_final_state=True, position=lo,
                        **options)
        outs.append(out)
    return torch.cat(outs, dim=1), state


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mechanism", ["latte", "latte_vapor", "linear", "linear_rope"])
def test_chunks_under_autograd_equal_the_whole_sequence(mechanism, dtype):
    B, T, H, D = 2, 29, 2, 4
    q, k, v = tensors((B, T, H, D), (B, T, H, D), (B, T, H, D), dtype=dtype, seed=7)
    weight = tensors((B, T, H, D), dtype=dtype, seed=8, grad=False)[0]
    if mechanism.startswith("latte"):
        angles = tensors((H, D // 2), dtype=dtype, seed=9)[0] if mechanism == "latte_vapor" else None
        op, options, parameters = lt.latte_attention, {"angles": angles}, [angles] if angles is not None else []
    else:
        op, options, parameters = lt.linear_attention, {"rope": mechanism == "linear_rope"}, []
    leaves = [q, k, v, *parameters]
    whole = op(q, k, v, **options)
    expected = torch.autograd.grad((whole * weight).sum(), leaves)
    out, final = chained(op, (q, k, v), (10, 11, 23), **options)
    got = torch.autograd.grad((out * weight).sum(), leaves)
    tolerance = {"rtol": 0, "atol": 2e-5 if dtype == torch.float32 else 1e-12}
    torch.testing.assert_close(out, whole, **tolerance)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g / e.abs().max(), e / e.abs().max(), **tolerance)
    if mechanism.startswith("latte"):  # and against the definition, not latte itself
        definition = latte_definition(*numpy(q, k, v), True, None if angles is None else angles.detach().numpy())
        assert np.abs(out.detach().numpy() - definition).max() <= 2 * tolerance["atol"] * np.abs(definition).max()
        assert len(final) == 3 and not final[0].requires_grad


def test_modules_train_in_chunks():
    B, T, H, L, Dv = 1, 12, 2, 3, 4
    q, k, v = tensors((B, T, H, L), (B, T, H, L), (B, T, H, Dv), seed=10)
    module = lt.LatteAttention(H, L, Dv, vapor=True, dtype=torch.float64)
    whole = module(q, k, v)
    out, state = chained(module, (q, k, v), (5,))
    torch.testing.assert_close(out, whole, rtol=0, atol=1e-12)
    out.square().sum().backward()
    angles_grad, module.angles.grad = module.angles.grad.clone(), None
    whole.square().sum().backward()
    torch.testing.assert_close(angles_grad, module.angles.grad, rtol=1e-10, atol=0)
    linear = lt.LinearAttention()
    out, (S, z) = linear(q, k, v, output_final_state=True)
    assert S.shape == (B, H, L, Dv) and z.shape == (B, H, L)
    torch.testing.assert_close(out, linear(q, k, v), rtol=0, atol=0)


def test_state_ops_compile_without_graph_breaks():
    B, T, H, D = 1, 12, 2, 4
    q, k, v = tensors((B, T, H, D), (B, T, H, D), (B, T, H, D), dtype=torch.float32, seed=11)
    running_max, normaliser, memory = (x.detach().float().requires_grad_(x.requires_grad)
                                       for x in latte_state(B, H, D, D))
    S, z = (x.detach().float().requires_grad_() for x in linear_state(B, H, D, D))

    def loss(q, k, v, normaliser, memory, S, z):
        out, (m, a, M) = lt.latte_attention(q, k, v, initial_state=(running_max, normaliser, memory),
                                            output_final_state=True, position=4)
        out2, (S_final, z_final) = lt.linear_attention(q, k, v, initial_state=(S, z), output_final_state=True)
        return out.square().sum() + a.sum() + M.sum() + out2.sum() + S_final.square().sum() + z_final.sum()

    leaves = (q, k, v, normaliser, memory, S, z)
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(*leaves), leaves)
    expected = torch.autograd.grad(loss(*leaves), leaves)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_fake_impls_match_the_ops():
    B, T, H, D, Dv = 2, 5, 2, 4, 3
    q, k, v = tensors((B, T, H, D), (B, T, H, D), (B, T, H, Dv), seed=12)
    running_max, normaliser, memory = latte_state(B, H, D, Dv)
    S, z = linear_state(B, H, D, Dv)
    angles = tensors((H, Dv // 2), seed=13)[0]
    for op, args in [(torch.ops.latte.latte_attention_state, (q, k, v, None, running_max, normaliser, memory, 2)),
                     (torch.ops.latte.latte_attention_state, (q, k, v, angles, None, None, None, 0)),
                     (torch.ops.latte.linear_attention_state, (q, k, v, S, z, "elu_plus_one", False, 1)),
                     (torch.ops.latte.linear_attention_state, (q, k, v, None, None, "elu_plus_one", True, 0))]:
        torch.library.opcheck(op, args)


def test_bad_states_raise_latte_error():
    q, k, v = tensors((1, 4, 2, 3), (1, 4, 2, 3), (1, 4, 2, 4))
    running_max, normaliser, memory = latte_state(1, 2, 3, 4)
    with pytest.raises(latte.Error) as error:
        lt.latte_attention(q, k, v, causal=False, output_final_state=True)
    assert error.value.argument == "initial_state"
    with pytest.raises(latte.Error) as error:
        lt.latte_attention(q, k, v, initial_state=(normaliser, memory))
    assert error.value.argument == "initial_state"
    with pytest.raises(latte.Error) as error:
        lt.latte_attention(q, k, v, initial_state=(running_max, normaliser, memory[..., :3]))
    assert error.value.argument == "fields.memory"
    with pytest.raises(latte.Error) as error:
        lt.linear_attention(q, k, v, initial_state=(normaliser, memory))  # (z, S) for (S, z)
    assert error.value.argument == "fields.memory"


# --- Latte Macchiato and LAVO -------------------------------------------------


def macchiato_case(dtype, rich, seed, B=2, T=23, H=2, L=3, Dk=4, Dv=4, w=3):
    """(op, inputs, options, parameters, the definition's output): Macchiato with a window of w,
    and with `rich` RoPE on the window and VAPOR by learned angles on every state."""
    inputs = tensors((B, T, H, L + 1), (B, T, H, L), (B, T, H, Dk), (B, T, H, Dk), (B, T, H, Dv), dtype=dtype,
                     seed=seed)
    angles = tensors((H, Dv // 2), dtype=dtype, seed=seed + 1)[0] if rich else None
    options = dict(window=w, rope=rich, vapor_scope="all_states" if rich else "latent_states", angles=angles)

    def definition():
        return macchiato_definition(*numpy(*inputs), w, vapor=rich, rope=rich, all_states=rich,
                                    angles=angles.detach().numpy() if rich else None)
    return lt.latte_macchiato, inputs, options, [angles] if rich else [], definition


def lavo_case(dtype, seed, B=2, T=23, H=2, d=4, r=3, w=4):
    """The same for LAVO with a learned relative bias and learned bases."""
    inputs = tensors((B, T, H, d), (B, T, H, d), (B, T, H, d), dtype=dtype, seed=seed)
    bias = tensors((H, 2 * w - 1), dtype=dtype, seed=seed + 1)[0]
    basis = torch.from_numpy(latte.Lavo(H, d, r, w).basis).to(dtype).requires_grad_()
    options = dict(bases=r, window=w, relative_bias=bias, basis=basis)

    def definition():
        return lavo_definition(*numpy(*inputs), basis.detach().numpy(), bias.detach().numpy(), w)
    return lt.lavo, inputs, options, [bias, basis], definition


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mechanism", ["macchiato", "macchiato_rope_vapor", "lavo"])
def test_macchiato_and_lavo_chunks_under_autograd_equal_the_whole_sequence(mechanism, dtype):
    case = (lavo_case(dtype, seed=30) if mechanism == "lavo"
            else macchiato_case(dtype, mechanism != "macchiato", seed=31))
    op, inputs, options, parameters, definition = case
    T = inputs[0].shape[1]
    weight = tensors(tuple(op(*inputs, **options).shape), dtype=dtype, seed=32, grad=False)[0]
    leaves = [*inputs, *parameters]
    whole = op(*inputs, **options)
    expected = torch.autograd.grad((whole * weight).sum(), leaves)
    # chunks of 1, 2, 5 and 9 tokens: shorter and longer than the window and the ring
    out, final = chained(op, inputs, (5, 6, 8, 13), **options)
    got = torch.autograd.grad((out * weight).sum(), leaves)
    tolerance = {"rtol": 0, "atol": 2e-5 if dtype == torch.float32 else 1e-12}
    torch.testing.assert_close(out, whole, **tolerance)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g / e.abs().max(), e / e.abs().max(), **tolerance)
    reference = definition()  # and the chunks against the definition, not latte itself
    assert np.abs(out.detach().numpy() - reference).max() <= 2 * tolerance["atol"] * np.abs(reference).max()
    if mechanism == "lavo":
        assert len(final) == 4 and all(f.requires_grad for f in final)
    else:  # running_max and window_fill held fixed; the ring full after T > w + 1 tokens
        assert len(final) == 6 and not final[0].requires_grad and not final[5].requires_grad
        assert final[5].item() == options["window"] + 1 and final[3].shape[2] == options["window"] + 1
    assert T == 23


# (position, window): a full ring, and one with slots that hold no token before and after the chunk
# (the op returns them 0: the state is a function of its tokens, whose gradient latte's backward gives)
@pytest.mark.parametrize("position,w", [(4, 2), (1, 7)])
def test_macchiato_state_op_gradcheck_with_the_final_state_in_the_loss(position, w):
    B, T, H, L, Dk, Dv = 1, 5, 1, 2, 2, 2
    _, inputs, options, parameters, _ = macchiato_case(torch.float64, True, seed=33, B=B, T=T, H=H, L=L, Dk=Dk,
                                                       Dv=Dv, w=w)
    generator = torch.Generator().manual_seed(34)
    running_max = torch.randn(B, H, L, dtype=torch.float64, generator=generator)
    normaliser = (torch.rand(B, H, L, dtype=torch.float64, generator=generator) + 0.5).requires_grad_()
    memory, ring_keys, ring_values = (torch.randn(*shape, dtype=torch.float64, generator=generator).requires_grad_()
                                      for shape in ((B, H, L, Dv), (B, H, w + 1, Dk), (B, H, w + 1, Dv)))
    fill = torch.tensor([float(min(w + 1, position))], dtype=torch.float64)  # the slots that hold tokens

    def f(q, k, wq, wk, v, normaliser, memory, ring_keys, ring_values, angles):
        out, (m, a, M, K, V, n) = lt.latte_macchiato(
            q, k, wq, wk, v, **{**options, "angles": angles},
            initial_state=(running_max, normaliser, memory, ring_keys, ring_values, fill), output_final_state=True,
            position=position)
        scale = torch.exp(m)  # the final carry's meaning: its sums times exp(running_max)
        return out, a * scale, M * scale[..., None], K, V

    assert torch.autograd.gradcheck(f, (*inputs, normaliser, memory, ring_keys, ring_values, *parameters))


def test_macchiato_chunks_from_a_fresh_state_at_a_later_position():
    # token s sits in ring slot s % (w + 1): from position 5 the first tokens fill slots 5, 6, ...,
    # which the ring's clearing of slots that hold no token must leave alone
    _, inputs, options, _, _ = macchiato_case(torch.float64, True, seed=41, B=1, T=6, H=1, L=2, Dk=2, Dv=2, w=7)
    whole = lt.latte_macchiato(*inputs, **options, position=5)
    first, state = lt.latte_macchiato(*(x[:, :2] for x in inputs), **options, output_final_state=True, position=5)
    rest = lt.latte_macchiato(*(x[:, 2:] for x in inputs), **options, initial_state=state, position=7)
    torch.testing.assert_close(torch.cat([first, rest], 1), whole, rtol=0, atol=1e-12)
    held = state[3].abs().sum(dim=-1)[0, 0]  # slots 5 and 6 hold tokens 5 and 6, the others none
    assert held[5] > 0 and held[6] > 0 and held.count_nonzero() == 2


@pytest.mark.parametrize("position,w", [(4, 3), (1, 9)])
def test_lavo_state_op_gradcheck_with_the_final_state_in_the_loss(position, w):
    B, T, H, d, r = 1, 7, 1, 2, 2
    _, inputs, options, parameters, _ = lavo_case(torch.float64, seed=35, B=B, T=T, H=H, d=d, r=r, w=w)
    state = tensors((B, H, w, d), (B, H, w, d), (B, H, r), (B, H, r), seed=36)

    def f(q, k, v, bias, basis, *state):
        out, final = lt.lavo(q, k, v, **{**options, "relative_bias": bias, "basis": basis}, initial_state=state,
                             output_final_state=True, position=position)
        return out, *final

    assert torch.autograd.gradcheck(f, (*inputs, *parameters, *state))


def test_macchiato_and_lavo_state_ops_compile_and_match_their_fakes():
    _, (q, k, wq, wk, v), options, _, _ = macchiato_case(torch.float32, False, seed=37, B=1, T=9)
    _, (lq, lk, lv), lavo_options, (bias, basis), _ = lavo_case(torch.float32, seed=38, B=1, T=9)

    def loss(q, k, wq, wk, v, lq, lk, lv, bias):
        out, (m, a, M, K, V, n) = lt.latte_macchiato(q, k, wq, wk, v, **options, output_final_state=True,
                                                     position=3)
        out2, (K2, V2, s, S) = lt.lavo(lq, lk, lv, **{**lavo_options, "relative_bias": bias},
                                       output_final_state=True, position=2)
        return out.square().sum() + M.sum() + K.square().sum() + out2.square().sum() + s.sum() + S.square().sum()

    leaves = (q, k, wq, wk, v, lq, lk, lv, bias)
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(*leaves), leaves)
    expected = torch.autograd.grad(loss(*leaves), leaves)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    _, final = lt.latte_macchiato(q, k, wq, wk, v, **options, output_final_state=True)
    _, lavo_final = lt.lavo(lq, lk, lv, **lavo_options, output_final_state=True)
    macchiato_options = (options["window"], False, False, "latent_states", None)
    for op, args in [
            (torch.ops.latte.latte_macchiato_state, (q, k, wq, wk, v, None, *(None,) * 6, *macchiato_options, 0)),
            (torch.ops.latte.latte_macchiato_state, (q, k, wq, wk, v, None, *final, *macchiato_options, 9)),
            (torch.ops.latte.lavo_state, (lq, lk, lv, bias, basis, *(None,) * 4, 3, 4, 0, None, "zero", 0)),
            (torch.ops.latte.lavo_state, (lq, lk, lv, None, None, *lavo_final, 3, 4, 0, None, "zero", 9))]:
        torch.library.opcheck(op, args)


def test_bad_macchiato_and_lavo_states_raise_latte_error():
    _, (q, k, wq, wk, v), options, _, _ = macchiato_case(torch.float64, False, seed=39, B=1, T=4)
    _, final = lt.latte_macchiato(q, k, wq, wk, v, **options, output_final_state=True)
    with pytest.raises(latte.Error) as error:
        lt.latte_macchiato(q, k, wq, wk, v, **options, causal=False, output_final_state=True)
    assert error.value.argument == "initial_state"
    with pytest.raises(latte.Error) as error:
        lt.latte_macchiato(q, k, wq, wk, v, **options, initial_state=final[:5])
    assert error.value.argument == "initial_state"
    with pytest.raises(latte.Error) as error:  # 4 ring slots hold tokens at position 4, not 5
        lt.latte_macchiato(q, k, wq, wk, v, **options, initial_state=(*final[:5], final[5] + 1), position=4)
    assert error.value.argument.startswith("fields")
    with pytest.raises(latte.Error) as error:
        lt.latte_macchiato(q, k, wq, wk, v, **options, initial_state=(*final[:3], final[3][:, :, :2], *final[4:]),
                           position=4)
    assert error.value.argument == "fields.window_keys"
    _, (lq, lk, lv), lavo_options, _, _ = lavo_case(torch.float64, seed=40, B=1, T=4)
    _, lavo_final = lt.lavo(lq, lk, lv, **lavo_options, output_final_state=True)
    with pytest.raises(latte.Error) as error:
        lt.lavo(lq, lk, lv, **lavo_options, initial_state=lavo_final[::-1], position=4)  # reversed: shapes differ
    assert error.value.argument.startswith("fields.")
