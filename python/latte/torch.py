"""latte's mechanisms as PyTorch ops with autograd, and torch.nn modules.

The ops are ``torch.library.custom_op`` s (``torch.ops.latte.*``) whose
gradients come from latte's C++ backward (``register_autograd``) and whose
shapes are known without running them (``register_fake``), so they work under
``torch.compile`` without graph breaks. Tensors are CPU float32 / float64 in
``[B, T, H, D]`` layout; they are read in place (DLPack), outputs and gradients
are NumPy arrays latte allocated, handed to torch without a copy. A tensor
whose last dimension is not contiguous (an expanded gradient) is made
contiguous first: latte's views need a unit last stride.

    import torch, latte.torch as lt
    q = torch.randn(1, 128, 4, 16, requires_grad=True)       # [B, T, H, L]
    k = torch.randn(1, 128, 4, 16, requires_grad=True)
    v = torch.randn(1, 128, 4, 32, requires_grad=True)       # [B, T, H, Dv]
    out = lt.latte_attention(q, k, v, causal=True)            # [B, T, H, Dv]
    out.square().sum().backward()
"""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np
import torch

from . import _latte

__all__ = ["latte_attention", "linear_attention", "LatteAttention", "LinearAttention"]


def _array(tensor: torch.Tensor) -> torch.Tensor:
    """What latte reads: a detached CPU tensor whose last stride is 1."""
    if tensor.device.type != "cpu":
        error = _latte.Error(f"latte runs on the CPU from Python: expected a CPU tensor, given one on {tensor.device}")
        error.argument = "device"
        raise error
    tensor = tensor.detach()
    if tensor.dim() > 0 and tensor.stride(-1) != 1 and tensor.shape[-1] != 1:
        tensor = tensor.contiguous()
    return tensor


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array)


# --- Latte ------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _cached_latte(heads: int, latents: int, value_dim: int, causal: bool) -> _latte.LatteAttention:
    return _latte.LatteAttention(heads, latents, value_dim, causal=causal)


def _latte_for(query_logits, values, causal, angles):
    heads, latents, value_dim = query_logits.shape[2], query_logits.shape[3], values.shape[3]
    if angles is None:
        return _cached_latte(heads, latents, value_dim, causal)
    return _latte.LatteAttention(heads, latents, value_dim, causal=causal, vapor=True,
                                 angles=_array(angles).to(torch.float64).numpy())


@torch.library.custom_op("latte::latte_attention", mutates_args=(), device_types="cpu")
def _latte_attention_op(query_logits: torch.Tensor, key_logits: torch.Tensor, values: torch.Tensor,
                        causal: bool, angles: Optional[torch.Tensor]) -> torch.Tensor:
    attention = _latte_for(query_logits, values, causal, angles)
    return _tensor(attention.forward(_array(query_logits), _array(key_logits), _array(values)))


@_latte_attention_op.register_fake
def _(query_logits, key_logits, values, causal, angles):
    return values.new_empty(values.shape)


def _latte_setup(ctx, inputs, output):
    query_logits, key_logits, values, causal, angles = inputs
    ctx.save_for_backward(query_logits, key_logits, values, angles)
    ctx.causal = causal


@torch.library.custom_op("latte::latte_attention_backward", mutates_args=(), device_types="cpu")
def _latte_attention_backward_op(query_logits: torch.Tensor, key_logits: torch.Tensor, values: torch.Tensor,
                                 d_out: torch.Tensor, causal: bool, angles: Optional[torch.Tensor]
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    attention = _latte_for(query_logits, values, causal, angles)
    gradients = attention.backward(_array(query_logits), _array(key_logits), _array(values), _array(d_out))
    d_angles = _tensor(gradients[3]).to(angles.dtype) if angles is not None else values.new_empty(0)
    return _tensor(gradients[0]), _tensor(gradients[1]), _tensor(gradients[2]), d_angles


@_latte_attention_backward_op.register_fake
def _(query_logits, key_logits, values, d_out, causal, angles):
    d_angles = angles.new_empty(angles.shape) if angles is not None else values.new_empty(0)
    return (query_logits.new_empty(query_logits.shape), key_logits.new_empty(key_logits.shape),
            values.new_empty(values.shape), d_angles)


def _latte_backward(ctx, d_out):
    query_logits, key_logits, values, angles = ctx.saved_tensors
    d_q, d_k, d_v, d_angles = _latte_attention_backward_op(query_logits, key_logits, values, d_out, ctx.causal,
                                                           angles)
    return d_q, d_k, d_v, None, d_angles if angles is not None else None


_latte_attention_op.register_autograd(_latte_backward, setup_context=_latte_setup)


def latte_attention(query_logits: torch.Tensor, key_logits: torch.Tensor, values: torch.Tensor, *,
                    causal: bool = True, angles: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Latte attention (``torch.ops.latte.latte_attention``): ``[B, T, H, L]`` latent logits of the
    queries and keys, ``[B, T, H, Dv]`` values -> ``[B, T, H, Dv]``. ``angles`` ``[H, Dv/2]`` turns
    VAPOR on (and receives a gradient when it requires one)."""
    return _latte_attention_op(query_logits, key_logits, values, causal, angles)


# --- linear attention --------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _cached_linear(heads: int, key_dim: int, value_dim: int, causal: bool, feature_map: str,
            rope: bool) -> _latte.LinearAttention:
    return _latte.LinearAttention(heads, key_dim, value_dim, causal=causal, feature_map=feature_map, rope=rope)


def _linear_for(queries, values, causal, feature_map, rope):
    return _cached_linear(queries.shape[2], queries.shape[3], values.shape[3], causal, feature_map, rope)


@torch.library.custom_op("latte::linear_attention", mutates_args=(), device_types="cpu")
def _linear_attention_op(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, causal: bool,
                         feature_map: str, rope: bool) -> torch.Tensor:
    attention = _linear_for(queries, values, causal, feature_map, rope)
    return _tensor(attention.forward(_array(queries), _array(keys), _array(values)))


@_linear_attention_op.register_fake
def _(queries, keys, values, causal, feature_map, rope):
    return values.new_empty(values.shape)


def _linear_setup(ctx, inputs, output):
    queries, keys, values, causal, feature_map, rope = inputs
    ctx.save_for_backward(queries, keys, values)
    ctx.options = (causal, feature_map, rope)


@torch.library.custom_op("latte::linear_attention_backward", mutates_args=(), device_types="cpu")
def _linear_attention_backward_op(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                  d_out: torch.Tensor, causal: bool, feature_map: str, rope: bool
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    attention = _linear_for(queries, values, causal, feature_map, rope)
    gradients = attention.backward(_array(queries), _array(keys), _array(values), _array(d_out))
    return _tensor(gradients[0]), _tensor(gradients[1]), _tensor(gradients[2])


@_linear_attention_backward_op.register_fake
def _(queries, keys, values, d_out, causal, feature_map, rope):
    return queries.new_empty(queries.shape), keys.new_empty(keys.shape), values.new_empty(values.shape)


def _linear_backward(ctx, d_out):
    queries, keys, values = ctx.saved_tensors
    d_q, d_k, d_v = _linear_attention_backward_op(queries, keys, values, d_out, *ctx.options)
    return d_q, d_k, d_v, None, None, None


_linear_attention_op.register_autograd(_linear_backward, setup_context=_linear_setup)


def linear_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, causal: bool = True,
                     feature_map: str = "elu_plus_one", rope: bool = False) -> torch.Tensor:
    """Linear attention (``torch.ops.latte.linear_attention``): ``[B, T, H, Dk]`` queries and keys,
    ``[B, T, H, Dv]`` values -> ``[B, T, H, Dv]``; feature_map "elu_plus_one", "relu" or "identity";
    ``rope`` rotates phi(q), phi(k) (elu + 1)."""
    return _linear_attention_op(queries, keys, values, causal, feature_map, rope)


# --- modules -----------------------------------------------------------------


class LatteAttention(torch.nn.Module):
    """Latte attention as a module: ``forward(query_logits, key_logits, values)`` -> ``[B, T, H, Dv]``.
    With ``vapor=True`` the VAPOR angles ``[H, Dv/2]`` are a parameter (RoPE schedule at first),
    learned unless ``learn_angles=False``."""

    def __init__(self, heads: int, latents: int, value_dim: int, *, causal: bool = True, vapor: bool = False,
                 learn_angles: bool = True, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.heads, self.latents, self.value_dim, self.causal = heads, latents, value_dim, causal
        if vapor:
            initial = _latte.LatteAttention(heads, latents, value_dim, vapor=True).angles
            self.angles = torch.nn.Parameter(torch.from_numpy(initial).to(dtype), requires_grad=learn_angles)
        else:
            self.register_parameter("angles", None)

    def forward(self, query_logits: torch.Tensor, key_logits: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return latte_attention(query_logits, key_logits, values, causal=self.causal, angles=self.angles)


class LinearAttention(torch.nn.Module):
    """Linear attention as a module: ``forward(queries, keys, values)`` -> ``[B, T, H, Dv]``."""

    def __init__(self, *, causal: bool = True, feature_map: str = "elu_plus_one", rope: bool = False):
        super().__init__()
        self.causal, self.feature_map, self.rope = causal, feature_map, rope

    def forward(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return linear_attention(queries, keys, values, causal=self.causal, feature_map=self.feature_map,
                                rope=self.rope)
