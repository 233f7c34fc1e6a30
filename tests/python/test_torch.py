"""latte.torch: the torch.library ops against latte's own NumPy-tested calls and
against torch.autograd.gradcheck in float64 (central differences of the op
itself), under torch.compile(fullgraph=True), and the nn.Module wrappers.
Skipped, saying why, where PyTorch is not installed."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the torch ops are not tested")

import latte  # noqa: E402
import latte.torch as lt  # noqa: E402
from latte_reference import latte as latte_definition  # noqa: E402


def tensors(*shapes, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, dtype=dtype, generator=generator, requires_grad=True) for shape in shapes]


@pytest.mark.parametrize("causal", [True, False])
def test_latte_op_matches_the_definition_and_gradcheck(causal):
    q, k, v = tensors((2, 9, 2, 3), (2, 9, 2, 3), (2, 9, 2, 4))
    out = lt.latte_attention(q, k, v, causal=causal)
    expected = latte_definition(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), causal)
    assert np.abs(out.detach().numpy() - expected).max() <= 1e-12 * np.abs(expected).max()
    assert torch.autograd.gradcheck(lambda a, b, c: lt.latte_attention(a, b, c, causal=causal), (q, k, v))


@pytest.mark.parametrize("causal", [True, False])
def test_latte_op_with_learned_vapor_angles_gradcheck(causal):
    q, k, v, angles = tensors((1, 7, 2, 3), (1, 7, 2, 3), (1, 7, 2, 4), (2, 2))
    assert torch.autograd.gradcheck(lambda a, b, c, d: lt.latte_attention(a, b, c, causal=causal, angles=d),
                                    (q, k, v, angles))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("feature_map,rope", [("elu_plus_one", False), ("relu", False), ("elu_plus_one", True)])
def test_linear_op_gradcheck(causal, feature_map, rope):
    q, k, v = tensors((2, 8, 2, 4), (2, 8, 2, 4), (2, 8, 2, 3), seed=1)
    expected = latte.LinearAttention(2, 4, 3, causal=causal, feature_map=feature_map, rope=rope).forward(
        q.detach().numpy(), k.detach().numpy(), v.detach().numpy())
    out = lt.linear_attention(q, k, v, causal=causal, feature_map=feature_map, rope=rope)
    np.testing.assert_array_equal(out.detach().numpy(), expected)
    assert torch.autograd.gradcheck(
        lambda a, b, c: lt.linear_attention(a, b, c, causal=causal, feature_map=feature_map, rope=rope), (q, k, v))


def test_ops_compile_without_graph_breaks_forward_and_backward():
    q, k, v = tensors((1, 16, 2, 4), (1, 16, 2, 4), (1, 16, 2, 4), dtype=torch.float32)
    module = lt.LatteAttention(2, 4, 4, vapor=True)

    def loss(a, b, c):
        return module(a, b, c).square().sum() + lt.linear_attention(a, b, c).sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    compiled(q, k, v).backward()
    eager = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    module.angles.grad, angles_grad = None, module.angles.grad.clone()
    loss(*eager).backward()
    for compiled_input, eager_input in zip((q, k, v), eager):
        torch.testing.assert_close(compiled_input.grad, eager_input.grad)
    torch.testing.assert_close(module.angles.grad, angles_grad)


def test_strided_and_expanded_tensors():
    q, k, v = tensors((1, 12, 2, 3), (1, 12, 2, 3), (1, 12, 2, 4))
    out = lt.latte_attention(q[:, ::2], k[:, ::2], v[:, ::2])  # strided: read in place
    expected = lt.latte_attention(q[:, ::2].contiguous(), k[:, ::2].contiguous(), v[:, ::2].contiguous())
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.sum().backward()  # d_out is an expanded tensor of ones (stride 0)
    assert q.grad.shape == q.shape and torch.all(q.grad[:, 1::2] == 0)


def test_bad_input_raises_latte_error():
    q, k, v = tensors((1, 4, 2, 3), (1, 4, 2, 3), (1, 4, 2, 4))
    with pytest.raises(latte.Error) as error:
        lt.latte_attention(q, k, v[:, :3])
    assert error.value.argument == "values"
    with pytest.raises(latte.Error):
        lt.latte_attention(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16))
