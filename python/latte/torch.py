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

import atexit
import functools
from typing import Optional

import numpy as np
import torch

from . import _latte

__all__ = ["latte_attention", "linear_attention", "LatteAttention", "LinearAttention",
           "softmax_attention", "cosformer", "leapformer", "latte_macchiato", "lavo",
           "SoftmaxAttention", "CosFormer", "LeaPModule", "LeaPformer", "LatteMacchiato", "Lavo",
           "conv_compressed_attention", "ConvCompressedAttention"]


def _array(tensor: torch.Tensor):
    """What latte reads: a NumPy view of a detached CPU tensor whose last stride is 1 (the same memory;
    nanobind reads a NumPy array through the buffer protocol in C, a tensor through its Python
    __dlpack__: 25-50 us per call less at T = 4K, where the kernel has evicted the caches)."""
    if tensor.device.type != "cpu":
        error = _latte.Error(f"latte runs on the CPU from Python: expected a CPU tensor, given one on {tensor.device}")
        error.argument = "device"
        raise error
    tensor = tensor.detach()
    if tensor.dim() > 0 and tensor.stride(-1) != 1 and tensor.shape[-1] != 1:
        tensor = tensor.contiguous()
    # another dtype stays a tensor, which latte refuses by name (NumPy has no bfloat16)
    return tensor.numpy() if tensor.dtype in (torch.float32, torch.float64) else tensor


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array)


@functools.lru_cache(maxsize=64)
def _cached_mechanism(cls, *args, **options):
    """A latte mechanism object built once per class and arguments (for those without tensor parameters)."""
    return cls(*args, **options)


# The cached objects go before the interpreter tears the module down (nanobind
# would otherwise report them as leaked instances at exit).
atexit.register(_cached_mechanism.cache_clear)


# --- Latte ------------------------------------------------------------------


def _latte_for(query_logits, values, causal, angles):
    heads, latents, value_dim = query_logits.shape[2], query_logits.shape[3], values.shape[3]
    if angles is None:
        return _cached_mechanism(_latte.LatteAttention, heads, latents, value_dim, causal=causal)
    return _latte.LatteAttention(heads, latents, value_dim, causal=causal, vapor=True,
                                 angles=_float64(angles))


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


# Training in chunks, flash-linear-attention's contract (initial_state / dh0, output_final_state /
# dht): a state crosses the op boundary as tensors of some of its fields, in the state's field
# order. latte keeps each sum as a compensated pair (the field and its *_low part); here a pair
# is folded into one value (field + low part), so a chunk boundary costs one rounding.

_LATTE_STATE = ("running_max", "normaliser", "memory")


def _state_from(attention, names, tensors, like, position):
    """The latte state at `position` whose fields `names` are `tensors` (the others, low parts
    included, a fresh state's); a fresh state of `like`'s batch and dtype when all are None."""
    if all(t is None for t in tensors):
        return attention.make_state(like.shape[0], first_position=position,
                                    dtype=str(like.dtype).removeprefix("torch."))
    return attention.state_from_fields({n: _array(t) for n, t in zip(names, tensors) if t is not None},
                                       position=position)


# The compensated low part of a state's sum field, where it is not named <field>_low.
_LOW_PARTS = {"memory_sum": "memory_compensation"}


def _fields_of(state, names):
    """Fields `names` of a latte state as tensors, each with its low part folded in."""
    fields = state.fields()
    low = {n: _LOW_PARTS.get(n, n + "_low") for n in names}
    return [_tensor(fields[n] + fields[low[n]] if low[n] in fields else fields[n]) for n in names]


def _state_forward(attention, inputs, fields, initial, position):
    """attention.forward over `inputs` continued from the state whose `fields` are `initial`:
    (out, *the final state's fields)."""
    state = _state_from(attention, fields, initial, inputs[0], position)
    out = attention.forward(*map(_array, inputs), state=state)
    return (_tensor(out), *_fields_of(state, fields))


@torch.library.custom_op("latte::latte_attention_state", mutates_args=(), device_types="cpu")
def _latte_state_op(query_logits: torch.Tensor, key_logits: torch.Tensor, values: torch.Tensor,
                    angles: Optional[torch.Tensor], running_max: Optional[torch.Tensor],
                    normaliser: Optional[torch.Tensor], memory: Optional[torch.Tensor], position: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal Latte from a state (fresh when its tensors are None): out and the final state's fields."""
    attention = _latte_for(query_logits, values, True, angles)
    return _state_forward(attention, (query_logits, key_logits, values), _LATTE_STATE,
                          (running_max, normaliser, memory), position)


@_latte_state_op.register_fake
def _(query_logits, key_logits, values, angles, running_max, normaliser, memory, position):
    B, _, H, L = query_logits.shape
    return (values.new_empty(values.shape), values.new_empty(B, H, L), values.new_empty(B, H, L),
            values.new_empty(B, H, L, values.shape[3]))


def _latte_state_setup(ctx, inputs, output):
    *tensors, position = inputs
    ctx.save_for_backward(*tensors, output[1])
    ctx.position = position
    ctx.mark_non_differentiable(output[1])  # the running maximum: held fixed


@torch.library.custom_op("latte::latte_attention_state_backward", mutates_args=(), device_types="cpu")
def _latte_state_backward_op(query_logits: torch.Tensor, key_logits: torch.Tensor, values: torch.Tensor,
                             angles: Optional[torch.Tensor], running_max: Optional[torch.Tensor],
                             normaliser: Optional[torch.Tensor], memory: Optional[torch.Tensor], position: int,
                             d_out: torch.Tensor, final_running_max: torch.Tensor, d_normaliser: torch.Tensor,
                             d_memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                              torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d_query_logits, d_key_logits, d_values, d_angles or empty, d_normaliser, d_memory of the initial state)."""
    attention = _latte_for(query_logits, values, True, angles)
    initial = _state_from(attention, _LATTE_STATE, (running_max, normaliser, memory), query_logits, position)
    d_final = _state_from(attention, _LATTE_STATE, (final_running_max, d_normaliser, d_memory), query_logits,
                          position + query_logits.shape[1])
    *gradients, d_initial = attention.backward(_array(query_logits), _array(key_logits), _array(values),
                                               _array(d_out), initial_state=initial, d_final_state=d_final)
    d_angles = _tensor(gradients[3]).to(angles.dtype) if angles is not None else values.new_empty(0)
    return (*map(_tensor, gradients[:3]), d_angles, *_fields_of(d_initial, _LATTE_STATE[1:]))


@_latte_state_backward_op.register_fake
def _(query_logits, key_logits, values, angles, running_max, normaliser, memory, position, d_out,
      final_running_max, d_normaliser, d_memory):
    d_angles = angles.new_empty(angles.shape) if angles is not None else values.new_empty(0)
    return (query_logits.new_empty(query_logits.shape), key_logits.new_empty(key_logits.shape),
            values.new_empty(values.shape), d_angles, d_normaliser.new_empty(d_normaliser.shape),
            d_memory.new_empty(d_memory.shape))


def _latte_state_backward(ctx, d_out, _, d_normaliser, d_memory):
    query_logits, key_logits, values, angles, running_max, normaliser, memory, final_running_max = ctx.saved_tensors
    B, _, H, L = query_logits.shape
    d_out = torch.zeros_like(values) if d_out is None else d_out
    d_normaliser = final_running_max.new_zeros(B, H, L) if d_normaliser is None else d_normaliser
    d_memory = values.new_zeros(B, H, L, values.shape[3]) if d_memory is None else d_memory
    d_q, d_k, d_v, d_angles, d_normaliser0, d_memory0 = _latte_state_backward_op(
        query_logits, key_logits, values, angles, running_max, normaliser, memory, ctx.position, d_out,
        final_running_max, d_normaliser, d_memory)
    return (d_q, d_k, d_v, None if angles is None else d_angles, None,
            None if normaliser is None else d_normaliser0, None if memory is None else d_memory0, None)


_latte_state_op.register_autograd(_latte_state_backward, setup_context=_latte_state_setup)


def _require_state(causal, initial_state, fields):
    """Refuses a state where there is none (bidirectional) or one of another length than `fields`."""
    if not causal:
        raise _error("initial_state", "a bidirectional attention has no state (causal=True has)")
    if initial_state is not None and len(initial_state) != len(fields):
        raise _error("initial_state", f"expected a tuple ({', '.join(fields)}), given {len(initial_state)} tensors")


def latte_attention(query_logits: torch.Tensor, key_logits: torch.Tensor, values: torch.Tensor, *,
                    causal: bool = True, angles: Optional[torch.Tensor] = None,
                    initial_state: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
                    output_final_state: bool = False, position: int = 0):
    """Latte attention (``torch.ops.latte.latte_attention``): ``[B, T, H, L]`` latent logits of the
    queries and keys, ``[B, T, H, Dv]`` values -> ``[B, T, H, Dv]``. ``angles`` ``[H, Dv/2]`` turns
    VAPOR on (and receives a gradient when it requires one).

    Training in chunks (causal; flash-linear-attention's ``initial_state`` / ``output_final_state``,
    ``torch.ops.latte.latte_attention_state``): a state is the tuple ``(running_max [B, H, L],
    normaliser [B, H, L], memory [B, H, L, Dv])`` of ``latte.LatteState.fields()``: per latent the
    running maximum m of the key logits seen and the normaliser and memory sums stored scaled by
    exp(-m), each compensated pair folded into one value (one rounding per chunk boundary). The
    sequence continues from ``initial_state`` (None: a fresh state), its first token at absolute
    position ``position`` (the state's; VAPOR rotates by it). With ``output_final_state=True`` the
    result is ``(out, final_state)``, final_state the same tuple after the last token (position + T),
    the next chunk's initial_state. Gradients flow into the initial state's normaliser and memory
    (dh0) and from the final state's (dht), with respect to the stored numbers, running_max held
    fixed: it gets no gradient, and the final running_max is not differentiable. Chained chunks are
    exact; a loss on a final state itself should read it through normaliser * exp(running_max) and
    memory * exp(running_max) (its meaning), since the stored numbers also move with running_max."""
    if initial_state is None and not output_final_state:
        return _latte_attention_op(query_logits, key_logits, values, causal, angles)
    _require_state(causal, initial_state, _LATTE_STATE)
    out, *final = _latte_state_op(query_logits, key_logits, values, angles, *(initial_state or (None,) * 3),
                                  position)
    return (out, tuple(final)) if output_final_state else out


# --- linear attention --------------------------------------------------------


def _linear_for(queries, values, causal, feature_map, rope):
    return _cached_mechanism(_latte.LinearAttention, queries.shape[2], queries.shape[3], values.shape[3],
                             causal=causal, feature_map=feature_map, rope=rope)


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


_LINEAR_STATE = ("memory", "normaliser")


@torch.library.custom_op("latte::linear_attention_state", mutates_args=(), device_types="cpu")
def _linear_state_op(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, memory: Optional[torch.Tensor],
                     normaliser: Optional[torch.Tensor], feature_map: str, rope: bool, position: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal linear attention from a state (fresh when its tensors are None): out and the final (S, z)."""
    attention = _linear_for(queries, values, True, feature_map, rope)
    return _state_forward(attention, (queries, keys, values), _LINEAR_STATE, (memory, normaliser), position)


@_linear_state_op.register_fake
def _(queries, keys, values, memory, normaliser, feature_map, rope, position):
    B, _, H, Dk = queries.shape
    return values.new_empty(values.shape), values.new_empty(B, H, Dk, values.shape[3]), values.new_empty(B, H, Dk)


def _linear_state_setup(ctx, inputs, output):
    *tensors, feature_map, rope, position = inputs
    ctx.save_for_backward(*tensors)
    ctx.options = (feature_map, rope, position)


@torch.library.custom_op("latte::linear_attention_state_backward", mutates_args=(), device_types="cpu")
def _linear_state_backward_op(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                              memory: Optional[torch.Tensor], normaliser: Optional[torch.Tensor], feature_map: str,
                              rope: bool, position: int, d_out: torch.Tensor, d_memory: torch.Tensor,
                              d_normaliser: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d_queries, d_keys, d_values, d_memory, d_normaliser of the initial state)."""
    attention = _linear_for(queries, values, True, feature_map, rope)
    initial = _state_from(attention, _LINEAR_STATE, (memory, normaliser), queries, position)
    d_final = _state_from(attention, _LINEAR_STATE, (d_memory, d_normaliser), queries, position + queries.shape[1])
    *gradients, d_initial = attention.backward(_array(queries), _array(keys), _array(values), _array(d_out),
                                               initial_state=initial, d_final_state=d_final)
    return (*map(_tensor, gradients), *_fields_of(d_initial, _LINEAR_STATE))


@_linear_state_backward_op.register_fake
def _(queries, keys, values, memory, normaliser, feature_map, rope, position, d_out, d_memory, d_normaliser):
    return (queries.new_empty(queries.shape), keys.new_empty(keys.shape), values.new_empty(values.shape),
            d_memory.new_empty(d_memory.shape), d_normaliser.new_empty(d_normaliser.shape))


def _linear_state_backward(ctx, d_out, d_memory, d_normaliser):
    queries, keys, values, memory, normaliser = ctx.saved_tensors
    B, _, H, Dk = queries.shape
    d_out = torch.zeros_like(values) if d_out is None else d_out
    d_memory = values.new_zeros(B, H, Dk, values.shape[3]) if d_memory is None else d_memory
    d_normaliser = values.new_zeros(B, H, Dk) if d_normaliser is None else d_normaliser
    d_q, d_k, d_v, d_memory0, d_normaliser0 = _linear_state_backward_op(
        queries, keys, values, memory, normaliser, *ctx.options, d_out, d_memory, d_normaliser)
    return (d_q, d_k, d_v, None if memory is None else d_memory0, None if normaliser is None else d_normaliser0,
            None, None, None)


_linear_state_op.register_autograd(_linear_state_backward, setup_context=_linear_state_setup)


def linear_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, causal: bool = True,
                     feature_map: str = "elu_plus_one", rope: bool = False,
                     initial_state: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                     output_final_state: bool = False, position: int = 0):
    """Linear attention (``torch.ops.latte.linear_attention``): ``[B, T, H, Dk]`` queries and keys,
    ``[B, T, H, Dv]`` values -> ``[B, T, H, Dv]``; feature_map "elu_plus_one", "relu" or "identity";
    ``rope`` rotates phi(q), phi(k) (elu + 1).

    Training in chunks (causal; flash-linear-attention's ``initial_state`` / ``output_final_state``,
    ``torch.ops.latte.linear_attention_state``): a state is the tuple ``(memory [B, H, Dk, Dv],
    normaliser [B, H, Dk])`` of ``latte.LinearState.fields()``: S = sum phi(k) v^T (fla's state
    [B, H, K, V]) and z = sum phi(k), the normaliser fla's linear attention does not keep; each
    compensated pair folded into one value (one rounding per chunk boundary). The sequence continues
    from ``initial_state`` (None: zeros), its first token at absolute position ``position`` (RoPE
    rotates by it). With ``output_final_state=True`` the result is ``(out, final_state)``, the same
    tuple after the last token. Gradients flow into both tensors of the initial state (dh0) and
    from both of the final state (dht)."""
    if initial_state is None and not output_final_state:
        return _linear_attention_op(queries, keys, values, causal, feature_map, rope)
    _require_state(causal, initial_state, _LINEAR_STATE)
    out, *final = _linear_state_op(queries, keys, values, *(initial_state or (None, None)), feature_map, rope,
                                   position)
    return (out, tuple(final)) if output_final_state else out


# --- the other mechanisms: shared glue ---------------------------------------
#
# Each op below takes its tensor inputs first (the sequence inputs, then the learned
# parameters, None where not given), then its options; its backward op returns one
# gradient per tensor input (an empty tensor for one given as None).


def _error(argument: str, message: str) -> _latte.Error:
    """latte.Error naming `argument`, for what only the torch glue sees."""
    error = _latte.Error(f"latte: argument '{argument}': {message}")
    error.argument = argument
    return error


def _float64(tensor: Optional[torch.Tensor]) -> Optional[np.ndarray]:
    """A learned parameter as latte's constructors take it: float64 NumPy (None stays None)."""
    return None if tensor is None else _array(tensor.to(torch.float64))


def _forward(attention, *inputs: torch.Tensor) -> torch.Tensor:
    return _tensor(attention.forward(*map(_array, inputs)))


def _backward(attention, inputs, d_out: torch.Tensor, tensors) -> list[torch.Tensor]:
    """attention.backward(*inputs, d_out) as one gradient per tensor input of the op (`tensors`), with
    that input's dtype and shape (nested tuples, a LeaP module's (d_w1, d_b1, d_w2, d_b2), flattened in
    order); an empty tensor for an input given as None."""
    return _flat_gradients(attention.backward(*map(_array, inputs), _array(d_out)), tensors, d_out)


def _flat_gradients(result, tensors, d_out: torch.Tensor) -> list[torch.Tensor]:
    """A backward's result, nested tuples flattened in order, as one gradient per tensor input
    (`tensors`), with that input's dtype and shape; an empty tensor for an input given as None."""
    flat = [g for item in result for g in (item if isinstance(item, tuple) else (item,))]
    return [d_out.new_empty(0) if t is None else torch.as_tensor(flat[i]).to(t.dtype).reshape(t.shape)
            for i, t in enumerate(tensors)]


def _register(op, backward_op, tensors: int, values: int = 2) -> None:
    """The fakes of `op` (an output shaped as its argument `values`) and of `backward_op` (gradients
    shaped as the tensor inputs), and `op`'s autograd through `backward_op(*tensor inputs, d_out,
    *options)`; `tensors`: how many leading arguments of `op` are tensors."""
    op.register_fake(lambda *args: args[values].new_empty(args[values].shape))
    backward_op.register_fake(lambda *args: [args[tensors].new_empty(0) if t is None else t.new_empty(t.shape)
                                             for t in args[:tensors]])

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:tensors])
        ctx.options = inputs[tensors:]

    def backward(ctx, d_out):
        saved = ctx.saved_tensors
        gradients = backward_op(*saved, d_out, *ctx.options)
        return tuple(None if t is None else g for t, g in zip(saved, gradients)) + (None,) * len(ctx.options)

    op.register_autograd(backward, setup_context=setup_context)


# Training in chunks for the other causal mechanisms (Latte Macchiato, LAVO), with the contract of
# latte_attention's: an op `*_state` takes the plain op's tensor inputs, then the initial state's
# fields (all None: a fresh state at `position`), then the options, `position` last, and returns
# the output and the final state's fields (compensated pairs folded). Fields named `fixed` (Latte
# Macchiato's running_max, held fixed as Latte's, and its ring's fill count) carry no gradient.
# Its backward op takes (*tensor inputs, *initial fields, d_out, *the final state's fixed fields,
# *the gradients of its other fields, *options) and returns one gradient per tensor input, then
# one per initial field that is not fixed (empty tensors for inputs given as None).


def _state_backward(attention, inputs, tensors, fields, fixed, initial, d_out, final_fixed, d_final, position):
    """The state op's backward: `_backward`'s gradients of `tensors`, then the initial state's
    gradient in its fields that are not `fixed`. The final state's gradient is a state at the
    sequence's end whose fixed fields are the final state's and the others `d_final`."""
    start = _state_from(attention, fields, initial, inputs[0], position)
    fixed_values, free_values = iter(final_fixed), iter(d_final)
    d_fields = [next(fixed_values) if n in fixed else next(free_values) for n in fields]
    end = attention.state_from_fields({n: _array(t) for n, t in zip(fields, d_fields)},
                                      position=position + inputs[0].shape[1])
    *result, d_initial = attention.backward(*map(_array, inputs), _array(d_out), initial_state=start,
                                            d_final_state=end)
    d_start = d_initial.fields()  # a gradient state's low parts: 0 or their sum's gradient, not added
    return _flat_gradients(result, tensors, d_out) + [_tensor(d_start[n]) for n in fields if n not in fixed]


def _register_state(op, backward_op, tensors: int, fields, fixed, field_shapes, values: int = 2) -> None:
    """The fakes and autograd of a state op and its backward op (the layout above); `tensors`: how
    many leading arguments are tensor inputs; `field_shapes(*op arguments)`: the state's field shapes."""
    S = len(fields)
    free = [i for i, n in enumerate(fields) if n not in fixed]
    kept = [i for i, n in enumerate(fields) if n in fixed]

    def fake(*args):
        like = args[values]
        return (like.new_empty(like.shape), *(like.new_empty(shape) for shape in field_shapes(*args)))

    def backward_fake(*args):
        like = args[tensors + S]  # d_out
        given = list(args[:tensors]) + [args[tensors + i] for i in free]
        return [like.new_empty(0) if t is None else t.new_empty(t.shape) for t in given]

    op.register_fake(fake)
    backward_op.register_fake(backward_fake)

    def setup_context(ctx, inputs, output):
        final_fixed = [output[1 + i] for i in kept]
        ctx.save_for_backward(*inputs[:tensors + S], *final_fixed)
        ctx.options = inputs[tensors + S:]
        ctx.shapes = [o.shape for o in output]
        ctx.mark_non_differentiable(*final_fixed)

    def backward(ctx, d_out, *d_final):
        saved = ctx.saved_tensors
        given, final_fixed = saved[:tensors + S], saved[tensors + S:]
        zeros = functools.partial(given[values].new_zeros)
        d_out = zeros(ctx.shapes[0]) if d_out is None else d_out
        d_free = [zeros(ctx.shapes[1 + i]) if d_final[i] is None else d_final[i] for i in free]
        gradients = backward_op(*given, d_out, *final_fixed, *d_free, *ctx.options)
        d_fields = [None] * S
        for j, i in enumerate(free):
            d_fields[i] = None if given[tensors + i] is None else gradients[tensors + j]
        d_tensors = [None if t is None else g for t, g in zip(given[:tensors], gradients)]
        return (*d_tensors, *d_fields) + (None,) * len(ctx.options)

    op.register_autograd(backward, setup_context=setup_context)


# --- softmax attention -------------------------------------------------------


def _softmax_for(queries, values, causal, window, scale):
    return _cached_mechanism(_latte.SoftmaxAttention, queries.shape[2], queries.shape[3], values.shape[3],
                             causal=causal, window=None if window is None else tuple(window), scale=scale)


@torch.library.custom_op("latte::softmax_attention", mutates_args=(), device_types="cpu")
def _softmax_attention_op(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, causal: bool,
                          window: Optional[list[int]], scale: Optional[float]) -> torch.Tensor:
    return _forward(_softmax_for(queries, values, causal, window, scale), queries, keys, values)


@torch.library.custom_op("latte::softmax_attention_backward", mutates_args=(), device_types="cpu")
def _softmax_attention_backward_op(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                   d_out: torch.Tensor, causal: bool, window: Optional[list[int]],
                                   scale: Optional[float]) -> list[torch.Tensor]:
    inputs = (queries, keys, values)
    return _backward(_softmax_for(queries, values, causal, window, scale), inputs, d_out, inputs)


_register(_softmax_attention_op, _softmax_attention_backward_op, tensors=3)


def softmax_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, causal: bool = True,
                      window: Optional[tuple[int, int]] = None, scale: Optional[float] = None) -> torch.Tensor:
    """Exact scaled dot-product attention, latte's baseline (``torch.ops.latte.softmax_attention``):
    ``[B, T, H, Dk]`` queries and keys, ``[B, T, H, Dv]`` values -> ``[B, T, H, Dv]``. ``window``
    ``(left, right)`` keeps the keys ``t - left <= s <= t + right`` (FlashAttention's count; right 0
    when causal); ``scale`` defaults to ``1 / sqrt(Dk)``."""
    return _softmax_attention_op(queries, keys, values, causal, None if window is None else list(window),
                                 None if scale is None else float(scale))


# --- cosFormer ---------------------------------------------------------------


def _cosformer_for(queries, values, causal, length):
    return _cached_mechanism(_latte.CosFormer, queries.shape[2], queries.shape[3], values.shape[3], causal=causal,
                             length=length)


@torch.library.custom_op("latte::cosformer", mutates_args=(), device_types="cpu")
def _cosformer_op(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, causal: bool,
                  length: Optional[int]) -> torch.Tensor:
    return _forward(_cosformer_for(queries, values, causal, length), queries, keys, values)


@torch.library.custom_op("latte::cosformer_backward", mutates_args=(), device_types="cpu")
def _cosformer_backward_op(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, d_out: torch.Tensor,
                           causal: bool, length: Optional[int]) -> list[torch.Tensor]:
    inputs = (queries, keys, values)
    return _backward(_cosformer_for(queries, values, causal, length), inputs, d_out, inputs)


_register(_cosformer_op, _cosformer_backward_op, tensors=3)


# Training in chunks for cosFormer and LeaPformer: the linear family's state, (memory, normaliser),
# here with both re-weighting streams (cos and sin) stacked along the feature axis: [B, H, 2 Dk, Dv]
# and [B, H, 2 Dk].


def _two_stream_state_shapes(queries, keys, values, *rest):
    B, _, H, Dk = queries.shape
    return (B, H, 2 * Dk, values.shape[3]), (B, H, 2 * Dk)


@torch.library.custom_op("latte::cosformer_state", mutates_args=(), device_types="cpu")
def _cosformer_state_op(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        memory: Optional[torch.Tensor], normaliser: Optional[torch.Tensor], length: int,
                        position: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal cosFormer from a state (fresh when its tensors are None): out and the final state's fields."""
    attention = _cosformer_for(queries, values, True, length)
    return _state_forward(attention, (queries, keys, values), _LINEAR_STATE, (memory, normaliser), position)


@torch.library.custom_op("latte::cosformer_state_backward", mutates_args=(), device_types="cpu")
def _cosformer_state_backward_op(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                 memory: Optional[torch.Tensor], normaliser: Optional[torch.Tensor],
                                 d_out: torch.Tensor, d_memory: torch.Tensor, d_normaliser: torch.Tensor, length: int,
                                 position: int) -> list[torch.Tensor]:
    attention = _cosformer_for(queries, values, True, length)
    inputs = (queries, keys, values)
    return _state_backward(attention, inputs, inputs, _LINEAR_STATE, (), (memory, normaliser), d_out, (),
                           (d_memory, d_normaliser), position)


_register_state(_cosformer_state_op, _cosformer_state_backward_op, tensors=3, fields=_LINEAR_STATE, fixed=(),
                field_shapes=_two_stream_state_shapes)


def cosformer(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, causal: bool = True,
              length: Optional[int] = None, initial_state: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
              output_final_state: bool = False, position: int = 0):
    """cosFormer (``torch.ops.latte.cosformer``): linear attention with ReLU features re-weighted by
    ``cos(pi/2 (P_q - P_k))``, ``P = (i + 1) / M``; ``[B, T, H, Dk]`` queries and keys, ``[B, T, H, Dv]``
    values -> ``[B, T, H, Dv]``. ``length`` M defaults to T.

    Training in chunks (causal; ``torch.ops.latte.cosformer_state``), as ``linear_attention``: a state
    is ``(memory [B, H, 2 Dk, Dv], normaliser [B, H, 2 Dk])`` of ``latte.CosFormerState.fields()``,
    the cos and sin streams stacked. ``length`` M then belongs to the whole sequence: give it on
    every chunk (its default there is this chunk's end, position + T)."""
    if initial_state is None and not output_final_state:
        return _cosformer_op(queries, keys, values, causal, length)
    _require_state(causal, initial_state, _LINEAR_STATE)
    out, *final = _cosformer_state_op(queries, keys, values, *(initial_state or (None, None)),
                                      position + queries.shape[1] if length is None else length, position)
    return (out, tuple(final)) if output_final_state else out


# --- LeaPformer --------------------------------------------------------------


def _leapformer_for(queries, values, query_module, key_module, causal):
    hidden = query_module[0].shape[0]
    modules = [tuple(_float64(w) for w in module[:3]) + (float(module[3]),) for module in (query_module, key_module)]
    return _latte.LeaPformer(queries.shape[2], queries.shape[3], values.shape[3], query_module=modules[0],
                             key_module=modules[1], causal=causal,
                             leap_factor=queries.shape[3] // hidden if hidden else 0)


@torch.library.custom_op("latte::leapformer", mutates_args=(), device_types="cpu")
def _leapformer_op(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_w1: torch.Tensor,
                   query_b1: torch.Tensor, query_w2: torch.Tensor, query_b2: torch.Tensor, key_w1: torch.Tensor,
                   key_b1: torch.Tensor, key_w2: torch.Tensor, key_b2: torch.Tensor, causal: bool) -> torch.Tensor:
    attention = _leapformer_for(queries, values, (query_w1, query_b1, query_w2, query_b2),
                                (key_w1, key_b1, key_w2, key_b2), causal)
    return _forward(attention, queries, keys, values)


@torch.library.custom_op("latte::leapformer_backward", mutates_args=(), device_types="cpu")
def _leapformer_backward_op(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_w1: torch.Tensor,
                            query_b1: torch.Tensor, query_w2: torch.Tensor, query_b2: torch.Tensor,
                            key_w1: torch.Tensor, key_b1: torch.Tensor, key_w2: torch.Tensor, key_b2: torch.Tensor,
                            d_out: torch.Tensor, causal: bool) -> list[torch.Tensor]:
    query_module, key_module = (query_w1, query_b1, query_w2, query_b2), (key_w1, key_b1, key_w2, key_b2)
    attention = _leapformer_for(queries, values, query_module, key_module, causal)
    return _backward(attention, (queries, keys, values), d_out, (queries, keys, values) + query_module + key_module)


_register(_leapformer_op, _leapformer_backward_op, tensors=11)


@torch.library.custom_op("latte::leapformer_state", mutates_args=(), device_types="cpu")
def _leapformer_state_op(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_w1: torch.Tensor,
                         query_b1: torch.Tensor, query_w2: torch.Tensor, query_b2: torch.Tensor,
                         key_w1: torch.Tensor, key_b1: torch.Tensor, key_w2: torch.Tensor, key_b2: torch.Tensor,
                         memory: Optional[torch.Tensor], normaliser: Optional[torch.Tensor], position: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal LeaPformer from a state (fresh when its tensors are None): out and the final state's fields."""
    attention = _leapformer_for(queries, values, (query_w1, query_b1, query_w2, query_b2),
                                (key_w1, key_b1, key_w2, key_b2), True)
    return _state_forward(attention, (queries, keys, values), _LINEAR_STATE, (memory, normaliser), position)


@torch.library.custom_op("latte::leapformer_state_backward", mutates_args=(), device_types="cpu")
def _leapformer_state_backward_op(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                  query_w1: torch.Tensor, query_b1: torch.Tensor, query_w2: torch.Tensor,
                                  query_b2: torch.Tensor, key_w1: torch.Tensor, key_b1: torch.Tensor,
                                  key_w2: torch.Tensor, key_b2: torch.Tensor, memory: Optional[torch.Tensor],
                                  normaliser: Optional[torch.Tensor], d_out: torch.Tensor, d_memory: torch.Tensor,
                                  d_normaliser: torch.Tensor, position: int) -> list[torch.Tensor]:
    query_module, key_module = (query_w1, query_b1, query_w2, query_b2), (key_w1, key_b1, key_w2, key_b2)
    attention = _leapformer_for(queries, values, query_module, key_module, True)
    inputs = (queries, keys, values)
    return _state_backward(attention, inputs, inputs + query_module + key_module, _LINEAR_STATE, (),
                           (memory, normaliser), d_out, (), (d_memory, d_normaliser), position)


_register_state(_leapformer_state_op, _leapformer_state_backward_op, tensors=11, fields=_LINEAR_STATE, fixed=(),
                field_shapes=_two_stream_state_shapes)


def leapformer(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_module, key_module, *,
               causal: bool = True, initial_state: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
               output_final_state: bool = False, position: int = 0):
    """LeaPformer (``torch.ops.latte.leapformer``): cosFormer's re-weighting with proportions
    ``P = sigmoid(w2 . relu(w1 relu(x) + b1) + b2)`` from two LeaP modules, on the ReLU features of the
    queries and of the keys; ``[B, T, H, Dk]`` queries and keys, ``[B, T, H, Dv]`` values ->
    ``[B, T, H, Dv]``. Each module is ``(w1 [hidden, Dk], b1 [hidden], w2 [hidden], b2 [])`` of tensors
    (hidden = Dk / leap_factor, a divisor of Dk), differentiable like the inputs.

    Training in chunks (causal; ``torch.ops.latte.leapformer_state``), as ``linear_attention``: a
    state is ``(memory [B, H, 2 Dk, Dv], normaliser [B, H, 2 Dk])`` of
    ``latte.LeaPformerState.fields()``, the cos and sin streams stacked along the feature axis."""
    for name, module in (("query_module", query_module), ("key_module", key_module)):
        if len(module) != 4:
            raise _error(name, f"weights: expected (w1, b1, w2, b2), given {len(module)} items")
    query_module, key_module = ((*module[:3], torch.as_tensor(module[3], dtype=module[0].dtype))
                                for module in (query_module, key_module))
    if initial_state is None and not output_final_state:
        return _leapformer_op(queries, keys, values, *query_module, *key_module, causal)
    _require_state(causal, initial_state, _LINEAR_STATE)
    out, *final = _leapformer_state_op(queries, keys, values, *query_module, *key_module,
                                       *(initial_state or (None, None)), position)
    return (out, tuple(final)) if output_final_state else out


# --- Latte Macchiato ---------------------------------------------------------


def _macchiato_for(key_logits, window_queries, values, angles, window, causal, vapor, rope, vapor_scope, scale):
    dims = (key_logits.shape[2], key_logits.shape[3], window_queries.shape[3], values.shape[3], window)
    options = dict(causal=causal, vapor=vapor, rope=rope, vapor_scope=vapor_scope, scale=scale)
    if angles is None:
        return _cached_mechanism(_latte.LatteMacchiato, *dims, **options)
    try:
        return _latte.LatteMacchiato(*dims, **options, angles=_float64(angles))
    except TypeError:  # a binding without `angles`
        raise _error("angles", "this build's latte.LatteMacchiato takes no angles (python/src/latte_macchiato.cpp): "
                               "VAPOR keeps its RoPE schedule; leave angles None") from None


@torch.library.custom_op("latte::latte_macchiato", mutates_args=(), device_types="cpu")
def _latte_macchiato_op(query_logits: torch.Tensor, key_logits: torch.Tensor, window_queries: torch.Tensor,
                        window_keys: torch.Tensor, values: torch.Tensor, angles: Optional[torch.Tensor], window: int,
                        causal: bool, vapor: bool, rope: bool, vapor_scope: str,
                        scale: Optional[float]) -> torch.Tensor:
    attention = _macchiato_for(key_logits, window_queries, values, angles, window, causal, vapor, rope, vapor_scope,
                               scale)
    return _forward(attention, query_logits, key_logits, window_queries, window_keys, values)


@torch.library.custom_op("latte::latte_macchiato_backward", mutates_args=(), device_types="cpu")
def _latte_macchiato_backward_op(query_logits: torch.Tensor, key_logits: torch.Tensor, window_queries: torch.Tensor,
                                 window_keys: torch.Tensor, values: torch.Tensor, angles: Optional[torch.Tensor],
                                 d_out: torch.Tensor, window: int, causal: bool, vapor: bool, rope: bool,
                                 vapor_scope: str, scale: Optional[float]) -> list[torch.Tensor]:
    attention = _macchiato_for(key_logits, window_queries, values, angles, window, causal, vapor, rope, vapor_scope,
                               scale)
    inputs = (query_logits, key_logits, window_queries, window_keys, values)
    return _backward(attention, inputs, d_out, inputs + (angles,))


_register(_latte_macchiato_op, _latte_macchiato_backward_op, tensors=6, values=4)

_MACCHIATO_STATE = ("running_max", "normaliser", "memory", "window_keys", "window_values", "window_fill")
_MACCHIATO_FIXED = ("running_max", "window_fill")


@torch.library.custom_op("latte::latte_macchiato_state", mutates_args=(), device_types="cpu")
def _macchiato_state_op(query_logits: torch.Tensor, key_logits: torch.Tensor, window_queries: torch.Tensor,
                        window_keys: torch.Tensor, values: torch.Tensor, angles: Optional[torch.Tensor],
                        running_max: Optional[torch.Tensor], normaliser: Optional[torch.Tensor],
                        memory: Optional[torch.Tensor], ring_keys: Optional[torch.Tensor],
                        ring_values: Optional[torch.Tensor], window_fill: Optional[torch.Tensor], window: int,
                        vapor: bool, rope: bool, vapor_scope: str, scale: Optional[float], position: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                   torch.Tensor]:
    """Causal Latte Macchiato from a state (fresh when its tensors are None): out and the final state's fields,
    the ring's slots that hold no token (past window_fill) set to 0: latte reads none of them and its backward
    gives them no gradient, so the state returned is a function of its tokens alone."""
    attention = _macchiato_for(key_logits, window_queries, values, angles, window, True, vapor, rope, vapor_scope,
                               scale)
    out, *final = _state_forward(attention, (query_logits, key_logits, window_queries, window_keys, values),
                                 _MACCHIATO_STATE, (running_max, normaliser, memory, ring_keys, ring_values,
                                                    window_fill), position)
    ring, fill, end = final[3].shape[2], int(final[5].item()), position + query_logits.shape[1]
    if fill < ring:  # token s sits in slot s % ring: the last `fill` tokens' slots hold tokens
        empty = torch.ones(ring, dtype=torch.bool)
        empty[[(end - 1 - j) % ring for j in range(fill)]] = False
        final[3][:, :, empty] = 0
        final[4][:, :, empty] = 0
    return (out, *final)


@torch.library.custom_op("latte::latte_macchiato_state_backward", mutates_args=(), device_types="cpu")
def _macchiato_state_backward_op(query_logits: torch.Tensor, key_logits: torch.Tensor, window_queries: torch.Tensor,
                                 window_keys: torch.Tensor, values: torch.Tensor, angles: Optional[torch.Tensor],
                                 running_max: Optional[torch.Tensor], normaliser: Optional[torch.Tensor],
                                 memory: Optional[torch.Tensor], ring_keys: Optional[torch.Tensor],
                                 ring_values: Optional[torch.Tensor], window_fill: Optional[torch.Tensor],
                                 d_out: torch.Tensor, final_running_max: torch.Tensor, final_window_fill: torch.Tensor,
                                 d_normaliser: torch.Tensor, d_memory: torch.Tensor, d_ring_keys: torch.Tensor,
                                 d_ring_values: torch.Tensor, window: int, vapor: bool, rope: bool, vapor_scope: str,
                                 scale: Optional[float], position: int) -> list[torch.Tensor]:
    attention = _macchiato_for(key_logits, window_queries, values, angles, window, True, vapor, rope, vapor_scope,
                               scale)
    inputs = (query_logits, key_logits, window_queries, window_keys, values)
    return _state_backward(attention, inputs, inputs + (angles,), _MACCHIATO_STATE, _MACCHIATO_FIXED,
                           (running_max, normaliser, memory, ring_keys, ring_values, window_fill), d_out,
                           (final_running_max, final_window_fill), (d_normaliser, d_memory, d_ring_keys, d_ring_values),
                           position)


def _macchiato_state_shapes(query_logits, key_logits, window_queries, window_keys, values, angles, *fields_options):
    B, _, H, L = key_logits.shape
    ring = fields_options[6] + 1  # window + 1 slots
    return ((B, H, L), (B, H, L), (B, H, L, values.shape[3]), (B, H, ring, window_queries.shape[3]),
            (B, H, ring, values.shape[3]), (1,))


_register_state(_macchiato_state_op, _macchiato_state_backward_op, tensors=6, fields=_MACCHIATO_STATE,
                fixed=_MACCHIATO_FIXED, field_shapes=_macchiato_state_shapes, values=4)


def latte_macchiato(query_logits: torch.Tensor, key_logits: torch.Tensor, window_queries: torch.Tensor,
                    window_keys: torch.Tensor, values: torch.Tensor, *, window: int, causal: bool = True,
                    vapor: bool = False, rope: bool = False, vapor_scope: str = "latent_states",
                    scale: Optional[float] = None, angles: Optional[torch.Tensor] = None,
                    initial_state: Optional[tuple[torch.Tensor, ...]] = None, output_final_state: bool = False,
                    position: int = 0):
    """Latte Macchiato (``torch.ops.latte.latte_macchiato``): one softmax over L + 1 states per query,
    state 0 a sliding-window softmax (``window`` w tokens each side allowed) over ``window_queries`` /
    ``window_keys`` ``[B, T, H, Dk]`` (``rope`` rotates them; ``scale`` defaults to ``1 / sqrt(Dk)``),
    states 1..L Latte's latent states; ``query_logits`` ``[B, T, H, L + 1]``, ``key_logits``
    ``[B, T, H, L]``, ``values`` ``[B, T, H, Dv]`` -> ``[B, T, H, Dv]``. ``vapor`` rotates the latent
    states' values (``vapor_scope="all_states"``: the window's too) by the RoPE schedule, or by
    ``angles`` ``[H, Dv/2]`` (which turn VAPOR on and receive a gradient when they require one).

    Training in chunks (causal; ``torch.ops.latte.latte_macchiato_state``), as ``latte_attention``
    describes: a state is the tuple ``(running_max [B, H, L], normaliser [B, H, L], memory
    [B, H, L, Dv], window_keys [B, H, w + 1, Dk], window_values [B, H, w + 1, Dv], window_fill [1])``
    of ``latte.MacchiatoState.fields()``: Latte's carry (sums stored scaled by exp(-running_max),
    compensated pairs folded), the ring of the window's last w + 1 keys and values (token s in slot
    s % (w + 1), as the window reads them: rotated under RoPE) and how many slots hold tokens. The
    sequence continues from ``initial_state`` (None: a fresh state) at absolute position ``position``;
    ``output_final_state=True`` returns ``(out, final_state)``. Gradients flow into the initial
    normaliser, memory and ring and from the final state's; running_max is held fixed and
    window_fill is a count: neither gets a gradient nor is the final one differentiable."""
    scale = None if scale is None else float(scale)
    vapor = vapor or angles is not None
    if initial_state is None and not output_final_state:
        return _latte_macchiato_op(query_logits, key_logits, window_queries, window_keys, values, angles, window,
                                   causal, vapor, rope, vapor_scope, scale)
    _require_state(causal, initial_state, _MACCHIATO_STATE)
    out, *final = _macchiato_state_op(query_logits, key_logits, window_queries, window_keys, values, angles,
                                      *(initial_state or (None,) * len(_MACCHIATO_STATE)), window, vapor, rope,
                                      vapor_scope, scale, position)
    return (out, tuple(final)) if output_final_state else out


# --- LAVO --------------------------------------------------------------------


def _lavo_for(queries, relative_bias, basis, bases, window, causal, basis_seed, scale, empty_memory):
    dims = (queries.shape[2], queries.shape[3], bases, window)
    options = dict(causal=causal, basis_seed=basis_seed, scale=scale, empty_memory=empty_memory)
    if relative_bias is None and basis is None:
        return _cached_mechanism(_latte.Lavo, *dims, **options)
    return _latte.Lavo(*dims, **options, relative_bias=_float64(relative_bias), basis=_float64(basis))


@torch.library.custom_op("latte::lavo", mutates_args=(), device_types="cpu")
def _lavo_op(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, relative_bias: Optional[torch.Tensor],
             basis: Optional[torch.Tensor], bases: int, window: int, causal: bool, basis_seed: int,
             scale: Optional[float], empty_memory: str) -> torch.Tensor:
    attention = _lavo_for(queries, relative_bias, basis, bases, window, causal, basis_seed, scale, empty_memory)
    return _forward(attention, queries, keys, values)


@torch.library.custom_op("latte::lavo_backward", mutates_args=(), device_types="cpu")
def _lavo_backward_op(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      relative_bias: Optional[torch.Tensor], basis: Optional[torch.Tensor], d_out: torch.Tensor,
                      bases: int, window: int, causal: bool, basis_seed: int, scale: Optional[float],
                      empty_memory: str) -> list[torch.Tensor]:
    attention = _lavo_for(queries, relative_bias, basis, bases, window, causal, basis_seed, scale, empty_memory)
    return _backward(attention, (queries, keys, values), d_out, (queries, keys, values, relative_bias, basis))


_register(_lavo_op, _lavo_backward_op, tensors=5)

_LAVO_STATE = ("keys", "values", "window_sum", "memory_sum")


@torch.library.custom_op("latte::lavo_state", mutates_args=(), device_types="cpu")
def _lavo_state_op(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   relative_bias: Optional[torch.Tensor], basis: Optional[torch.Tensor],
                   ring_keys: Optional[torch.Tensor], ring_values: Optional[torch.Tensor],
                   window_sum: Optional[torch.Tensor], memory_sum: Optional[torch.Tensor], bases: int, window: int,
                   basis_seed: int, scale: Optional[float], empty_memory: str, position: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal LAVO from a state (fresh when its tensors are None): out and the final state's fields."""
    attention = _lavo_for(queries, relative_bias, basis, bases, window, True, basis_seed, scale, empty_memory)
    return _state_forward(attention, (queries, keys, values), _LAVO_STATE,
                          (ring_keys, ring_values, window_sum, memory_sum), position)


@torch.library.custom_op("latte::lavo_state_backward", mutates_args=(), device_types="cpu")
def _lavo_state_backward_op(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                            relative_bias: Optional[torch.Tensor], basis: Optional[torch.Tensor],
                            ring_keys: Optional[torch.Tensor], ring_values: Optional[torch.Tensor],
                            window_sum: Optional[torch.Tensor], memory_sum: Optional[torch.Tensor],
                            d_out: torch.Tensor, d_ring_keys: torch.Tensor, d_ring_values: torch.Tensor,
                            d_window_sum: torch.Tensor, d_memory_sum: torch.Tensor, bases: int, window: int,
                            basis_seed: int, scale: Optional[float], empty_memory: str,
                            position: int) -> list[torch.Tensor]:
    attention = _lavo_for(queries, relative_bias, basis, bases, window, True, basis_seed, scale, empty_memory)
    return _state_backward(attention, (queries, keys, values), (queries, keys, values, relative_bias, basis),
                           _LAVO_STATE, (), (ring_keys, ring_values, window_sum, memory_sum), d_out, (),
                           (d_ring_keys, d_ring_values, d_window_sum, d_memory_sum), position)


def _lavo_state_shapes(queries, keys, values, relative_bias, basis, *fields_options):
    B, _, H, d = queries.shape
    bases, window = fields_options[4], fields_options[5]
    return (B, H, window, d), (B, H, window, d), (B, H, bases), (B, H, bases)


_register_state(_lavo_state_op, _lavo_state_backward_op, tensors=5, fields=_LAVO_STATE, fixed=(),
                field_shapes=_lavo_state_shapes)


def lavo(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, bases: int, window: int,
         relative_bias: Optional[torch.Tensor] = None, basis: Optional[torch.Tensor] = None, basis_seed: int = 0,
         causal: bool = True, scale: Optional[float] = None, empty_memory: str = "zero",
         initial_state: Optional[tuple[torch.Tensor, ...]] = None, output_final_state: bool = False,
         position: int = 0):
    """LAVO (``torch.ops.latte.lavo``): a local softmax over the last ``window`` w tokens with a relative
    bias P ``[H, 2w - 1]`` (zeros when None), and an orthogonal memory of the older ones read through
    ``bases`` r bases B ``[H, r, d]`` per head (``basis``; when None, orthonormal from ``basis_seed``);
    queries, keys, values ``[B, T, H, d]`` -> ``[B, T, H, d]``. P and B given receive gradients when
    they require them. ``empty_memory``: "zero" or "local_only".

    Training in chunks (causal; ``torch.ops.latte.lavo_state``), as ``latte_attention`` describes: a
    state is the tuple ``(keys [B, H, w, d], values [B, H, w, d], window_sum [B, H, r], memory_sum
    [B, H, r])`` of ``latte.LavoState.fields()``: the ring of the last w keys and values (token s in
    slot s % w), the bases' projections summed over the current, incomplete window and over all
    complete ones (memory_compensation folded into memory_sum). The sequence continues from
    ``initial_state`` (None: a fresh state) at absolute position ``position`` (window borders are
    counted from 0); ``output_final_state=True`` returns ``(out, final_state)``; gradients flow into
    every field of the initial state and from the final state's."""
    scale = None if scale is None else float(scale)
    if initial_state is None and not output_final_state:
        return _lavo_op(queries, keys, values, relative_bias, basis, bases, window, causal, basis_seed, scale,
                        empty_memory)
    _require_state(causal, initial_state, _LAVO_STATE)
    out, *final = _lavo_state_op(queries, keys, values, relative_bias, basis,
                                 *(initial_state or (None,) * len(_LAVO_STATE)), bases, window, basis_seed, scale,
                                 empty_memory, position)
    return (out, tuple(final)) if output_final_state else out


# --- convolutional compression -----------------------------------------------
#
# The op takes the weights as ConvCompressedAttention names them: five per-level lists
# (conv_weight, conv_bias: `levels` tensors each; level_query, level_key, level_value:
# levels - 1 each), then the three cross projections; its backward op returns the
# gradients flat (d_queries, d_keys, d_values, then every weight in that order).

_CONV_LISTS = ("conv_weight", "conv_bias", "level_query", "level_key", "level_value")
_CONV_CROSS = ("cross_query", "cross_key", "cross_value")


def _conv_compressed_for(queries, values, lists, cross, group_size, levels, causal, window_left, window_right,
                         scale):
    weights = {name: [_float64(w) for w in tensors] for name, tensors in zip(_CONV_LISTS, lists)}
    weights.update({name: _float64(w) for name, w in zip(_CONV_CROSS, cross)})
    return _latte.ConvCompressedAttention(queries.shape[2], queries.shape[3], values.shape[3], group_size,
                                          levels=levels, causal=causal, window_left=window_left,
                                          window_right=window_right, scale=scale, **weights)


@torch.library.custom_op("latte::conv_compressed_attention", mutates_args=(), device_types="cpu")
def _conv_compressed_op(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        conv_weight: list[torch.Tensor], conv_bias: list[torch.Tensor],
                        level_query: list[torch.Tensor], level_key: list[torch.Tensor],
                        level_value: list[torch.Tensor], cross_query: torch.Tensor, cross_key: torch.Tensor,
                        cross_value: torch.Tensor, group_size: int, levels: int, causal: bool,
                        window_left: Optional[int], window_right: Optional[int],
                        scale: Optional[float]) -> torch.Tensor:
    attention = _conv_compressed_for(queries, values, (conv_weight, conv_bias, level_query, level_key, level_value),
                                     (cross_query, cross_key, cross_value), group_size, levels, causal, window_left,
                                     window_right, scale)
    return _forward(attention, queries, keys, values)


@_conv_compressed_op.register_fake
def _(queries, keys, values, *args):
    return values.new_empty(values.shape)


@torch.library.custom_op("latte::conv_compressed_attention_backward", mutates_args=(), device_types="cpu")
def _conv_compressed_backward_op(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                 conv_weight: list[torch.Tensor], conv_bias: list[torch.Tensor],
                                 level_query: list[torch.Tensor], level_key: list[torch.Tensor],
                                 level_value: list[torch.Tensor], cross_query: torch.Tensor, cross_key: torch.Tensor,
                                 cross_value: torch.Tensor, d_out: torch.Tensor, group_size: int, levels: int,
                                 causal: bool, window_left: Optional[int], window_right: Optional[int],
                                 scale: Optional[float]) -> list[torch.Tensor]:
    """[d_queries, d_keys, d_values, then one gradient per weight: the lists' entries in order, then the
    cross projections], each weight's in that weight's dtype."""
    lists, cross = (conv_weight, conv_bias, level_query, level_key, level_value), (cross_query, cross_key, cross_value)
    attention = _conv_compressed_for(queries, values, lists, cross, group_size, levels, causal, window_left,
                                     window_right, scale)
    *d_inputs, d_params = attention.backward(_array(queries), _array(keys), _array(values), _array(d_out))
    weights = [w for tensors in lists for w in tensors] + list(cross)
    d_weights = [g for name in _CONV_LISTS for g in d_params[name]] + [d_params[name] for name in _CONV_CROSS]
    return [_tensor(g) for g in d_inputs] + [_tensor(g).to(w.dtype) for g, w in zip(d_weights, weights)]


@_conv_compressed_backward_op.register_fake
def _(queries, keys, values, conv_weight, conv_bias, level_query, level_key, level_value, cross_query, cross_key,
      cross_value, d_out, *options):
    weights = [*conv_weight, *conv_bias, *level_query, *level_key, *level_value, cross_query, cross_key, cross_value]
    return [t.new_empty(t.shape) for t in (queries, keys, values, *weights)]


def _conv_save(ctx, inputs, end):
    """Saves q, k, v, the five lists' entries (flattened; their lengths in ctx.lengths) and the
    tensors that follow them up to input `end`; the rest are ctx.options."""
    queries, keys, values, *lists = inputs[:8]
    ctx.lengths = [len(tensors) for tensors in lists]
    ctx.save_for_backward(queries, keys, values, *(w for tensors in lists for w in tensors), *inputs[8:end])
    ctx.options = inputs[end:]


def _conv_compressed_setup(ctx, inputs, output):
    _conv_save(ctx, inputs, 11)  # then the three cross projections


def _conv_lists(flat, lengths):
    """[q, k, v, *the lists' entries, *rest] -> [q, k, v, list, ..., list, *rest], the lists `lengths` long."""
    items, at = list(flat[:3]), 3
    for length in lengths:
        items.append(list(flat[at:at + length]))
        at += length
    return items + list(flat[at:])


def _conv_compressed_backward(ctx, d_out):
    gradients = _conv_lists(
        _conv_compressed_backward_op(*_conv_lists(ctx.saved_tensors, ctx.lengths), d_out, *ctx.options), ctx.lengths)
    return (*gradients, *(None,) * len(ctx.options))


_conv_compressed_op.register_autograd(_conv_compressed_backward, setup_context=_conv_compressed_setup)


# Training in chunks (causal), with latte_attention's contract: the state crosses the op boundary
# as its five fields (every level's window ring, the open groups' partial sums, the compressed
# store), all differentiable. Their shapes follow from the state's context capacity (the tokens it
# can hold), an option of the op: the compressed store has room for capacity // M^levels tokens.

_CONV_STATE = ("window_keys", "window_values", "group_sums", "compressed_keys", "compressed_values")


def _conv_state_shapes(queries, values, group_size, levels, window_left, context_capacity):
    """The five fields' shapes (latte.ConvCompressedState.fields())."""
    B, _, H, Dk = queries.shape
    Dv = values.shape[3]
    ring = levels * min((group_size - 1 if window_left is None else window_left) + 1, context_capacity)
    stored = context_capacity // group_size ** levels
    return (B, H, ring, Dk), (B, H, ring, Dv), (B, H, levels, Dv), (B, H, stored, Dk), (B, H, stored, Dv)


def _conv_slots_cleared(fields, group_size, levels, position):
    """A state's fields at `position` with every slot that holds no token set to 0: a ring's slots
    past the tokens its level has, the sum of a level's group that has no token yet, the compressed
    store past its tokens. latte reads none of them (what they hold depends on the calls that made
    the state); cleared, the state is a function of its tokens alone, whose gradient latte's
    backward gives (0 for those slots)."""
    window_keys, window_values, group_sums, compressed_keys, compressed_values = fields
    R = window_keys.shape[2] // levels
    for level in range(levels):
        tokens = position // group_size ** level  # level `level`'s tokens so far
        if tokens < R:
            window_keys[:, :, level * R + tokens:(level + 1) * R] = 0
            window_values[:, :, level * R + tokens:(level + 1) * R] = 0
        if tokens % group_size == 0:  # the open group of this level's tokens is empty
            group_sums[:, :, level] = 0
    stored = position // group_size ** levels
    compressed_keys[:, :, stored:] = 0
    compressed_values[:, :, stored:] = 0
    return fields


def _conv_state_from(attention, initial, like, position, context_capacity):
    """The state at `position` whose fields are `initial` (a fresh one, at position 0, when all are None)."""
    if all(t is None for t in initial):
        if position != 0:
            raise _error("position", f"a fresh convolutional-compression state starts at 0, given {position} "
                                     "(pass the previous chunk's final state as initial_state)")
        return attention.make_state(like.shape[0], context_capacity, dtype=str(like.dtype).removeprefix("torch."))
    return attention.state_from_fields({n: _array(t) for n, t in zip(_CONV_STATE, initial) if t is not None},
                                       position=position, context_capacity=context_capacity)


@torch.library.custom_op("latte::conv_compressed_attention_state", mutates_args=(), device_types="cpu")
def _conv_compressed_state_op(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                              conv_weight: list[torch.Tensor], conv_bias: list[torch.Tensor],
                              level_query: list[torch.Tensor], level_key: list[torch.Tensor],
                              level_value: list[torch.Tensor], cross_query: torch.Tensor, cross_key: torch.Tensor,
                              cross_value: torch.Tensor, window_keys: Optional[torch.Tensor],
                              window_values: Optional[torch.Tensor], group_sums: Optional[torch.Tensor],
                              compressed_keys: Optional[torch.Tensor], compressed_values: Optional[torch.Tensor],
                              group_size: int, levels: int, window_left: Optional[int], scale: Optional[float],
                              context_capacity: int, position: int
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                         torch.Tensor]:
    """Causal convolutional compression from a state (fresh when its tensors are None): out and the
    final state's fields."""
    lists, cross = (conv_weight, conv_bias, level_query, level_key, level_value), (cross_query, cross_key, cross_value)
    attention = _conv_compressed_for(queries, values, lists, cross, group_size, levels, True, window_left, None, scale)
    state = _conv_state_from(attention, (window_keys, window_values, group_sums, compressed_keys, compressed_values),
                             queries, position, context_capacity)
    out = attention.forward(_array(queries), _array(keys), _array(values), state=state)
    return (_tensor(out), *_conv_slots_cleared(_fields_of(state, _CONV_STATE), group_size, levels,
                                               position + queries.shape[1]))


@_conv_compressed_state_op.register_fake
def _(queries, keys, values, conv_weight, conv_bias, level_query, level_key, level_value, cross_query, cross_key,
      cross_value, window_keys, window_values, group_sums, compressed_keys, compressed_values, group_size, levels,
      window_left, scale, context_capacity, position):
    shapes = _conv_state_shapes(queries, values, group_size, levels, window_left, context_capacity)
    return (values.new_empty(values.shape), *(values.new_empty(shape) for shape in shapes))


@torch.library.custom_op("latte::conv_compressed_attention_state_backward", mutates_args=(), device_types="cpu")
def _conv_compressed_state_backward_op(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                       conv_weight: list[torch.Tensor], conv_bias: list[torch.Tensor],
                                       level_query: list[torch.Tensor], level_key: list[torch.Tensor],
                                       level_value: list[torch.Tensor], cross_query: torch.Tensor,
                                       cross_key: torch.Tensor, cross_value: torch.Tensor,
                                       window_keys: Optional[torch.Tensor], window_values: Optional[torch.Tensor],
                                       group_sums: Optional[torch.Tensor], compressed_keys: Optional[torch.Tensor],
                                       compressed_values: Optional[torch.Tensor], d_out: torch.Tensor,
                                       d_window_keys: torch.Tensor, d_window_values: torch.Tensor,
                                       d_group_sums: torch.Tensor, d_compressed_keys: torch.Tensor,
                                       d_compressed_values: torch.Tensor, group_size: int, levels: int,
                                       window_left: Optional[int], scale: Optional[float], context_capacity: int,
                                       position: int) -> list[torch.Tensor]:
    """[d_queries, d_keys, d_values, every weight's gradient (as the plain backward op), then the
    initial state's five fields' (an empty tensor for a field given as None)]."""
    lists, cross = (conv_weight, conv_bias, level_query, level_key, level_value), (cross_query, cross_key, cross_value)
    attention = _conv_compressed_for(queries, values, lists, cross, group_size, levels, True, window_left, None, scale)
    initial = (window_keys, window_values, group_sums, compressed_keys, compressed_values)
    start = _conv_state_from(attention, initial, queries, position, context_capacity)
    d_final = (d_window_keys, d_window_values, d_group_sums, d_compressed_keys, d_compressed_values)
    end = attention.state_from_fields({n: _array(t) for n, t in zip(_CONV_STATE, d_final)},
                                      position=position + queries.shape[1], context_capacity=context_capacity)
    *d_inputs, d_params, d_initial = attention.backward(_array(queries), _array(keys), _array(values), _array(d_out),
                                                        initial_state=start, d_final_state=end)
    weights = [w for tensors in lists for w in tensors] + list(cross)
    d_weights = [g for name in _CONV_LISTS for g in d_params[name]] + [d_params[name] for name in _CONV_CROSS]
    d_start = d_initial.fields()
    return ([_tensor(g) for g in d_inputs] + [_tensor(g).to(w.dtype) for g, w in zip(d_weights, weights)] +
            [d_out.new_empty(0) if t is None else _tensor(d_start[n]) for n, t in zip(_CONV_STATE, initial)])


@_conv_compressed_state_backward_op.register_fake
def _(queries, keys, values, conv_weight, conv_bias, level_query, level_key, level_value, cross_query, cross_key,
      cross_value, window_keys, window_values, group_sums, compressed_keys, compressed_values, d_out, *rest):
    weights = [*conv_weight, *conv_bias, *level_query, *level_key, *level_value, cross_query, cross_key, cross_value]
    initial = (window_keys, window_values, group_sums, compressed_keys, compressed_values)
    return ([t.new_empty(t.shape) for t in (queries, keys, values, *weights)] +
            [d_out.new_empty(0) if t is None else t.new_empty(t.shape) for t in initial])


def _conv_compressed_state_setup(ctx, inputs, output):
    _conv_save(ctx, inputs, 16)  # then the cross projections and the initial state's five fields
    ctx.shapes = [o.shape for o in output]


def _conv_compressed_state_backward(ctx, d_out, *d_final):
    saved = ctx.saved_tensors
    given, initial = saved[:-5], saved[-5:]
    zeros = given[2].new_zeros
    d_out = zeros(ctx.shapes[0]) if d_out is None else d_out
    d_final = [zeros(shape) if d is None else d for d, shape in zip(d_final, ctx.shapes[1:])]
    gradients = _conv_lists(_conv_compressed_state_backward_op(*_conv_lists(given, ctx.lengths), *initial, d_out,
                                                               *d_final, *ctx.options), ctx.lengths)
    d_initial = [None if t is None else g for t, g in zip(initial, gradients[-5:])]
    return (*gradients[:-5], *d_initial, *(None,) * len(ctx.options))


_conv_compressed_state_op.register_autograd(_conv_compressed_state_backward, setup_context=_conv_compressed_state_setup)


def conv_compressed_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *,
                              conv_weight: list[torch.Tensor], conv_bias: list[torch.Tensor],
                              cross_query: torch.Tensor, cross_key: torch.Tensor, cross_value: torch.Tensor,
                              level_query: Optional[list[torch.Tensor]] = None,
                              level_key: Optional[list[torch.Tensor]] = None,
                              level_value: Optional[list[torch.Tensor]] = None, group_size: int,
                              levels: Optional[int] = None, causal: bool = True, window_left: Optional[int] = None,
                              window_right: Optional[int] = None, scale: Optional[float] = None,
                              initial_state: Optional[tuple[torch.Tensor, ...]] = None,
                              output_final_state: bool = False, position: int = 0,
                              context_capacity: Optional[int] = None):
    """Convolutional compression (``torch.ops.latte.conv_compressed_attention``; paper 003, as
    ``latte.ConvCompressedAttention``): a sliding-window softmax y0 (``window_left`` /
    ``window_right`` tokens each side, defaults M - 1 and 0 causal / M - 1 bidirectional) plus a
    global softmax over the tokens of ``levels`` L convolutional compressions of group_size M;
    ``[B, T, H, Dk]`` queries and keys, ``[B, T, H, Dv]`` values -> ``[B, T, H, Dv]``. The weights,
    every one differentiable: ``conv_weight`` (L tensors ``[H, M, Dv, Dv]``, [i, out, in]),
    ``conv_bias`` (L ``[H, Dv]``), ``level_query`` / ``level_key`` (L - 1 ``[H, Dk, Dv]``, None: no
    tensors) and ``level_value`` (L - 1 ``[H, Dv, Dv]``), ``cross_query`` / ``cross_key``
    ``[H, Dk, Dv]`` and ``cross_value`` ``[H, Dv, Dv]``. ``levels`` defaults to len(conv_weight);
    ``scale`` to ``1 / sqrt(Dk)``. Gradients come back in each weight's dtype.

    Training in chunks (causal; ``torch.ops.latte.conv_compressed_attention_state``), as
    ``latte_attention`` describes: a state is the tuple ``(window_keys [B, H, L*R, Dk], window_values
    [B, H, L*R, Dv], group_sums [B, H, L, Dv], compressed_keys [B, H, S, Dk], compressed_values
    [B, H, S, Dv])`` of ``latte.ConvCompressedState.fields()``: every level's ring of its last R =
    min(window_left + 1, context_capacity) keys and values, the open groups' partial convolution
    sums and the store of the top-level compressed tokens' keys and values, room for S =
    context_capacity // M^L of them. ``context_capacity`` (default: position + T, this chunk's end)
    is the tokens the state can hold and fixes those shapes: training in chunks, give it the whole
    sequence's length on every chunk. The sequence continues from ``initial_state`` (None: a fresh
    state, at position 0) at absolute position ``position``; ``output_final_state=True`` returns
    ``(out, final_state)``. Gradients flow into every field of the initial state and from every
    field of the final one; the final state's slots that hold no token are 0."""
    lists = {"conv_weight": conv_weight, "conv_bias": conv_bias,
             **{name: [] if given is None else given for name, given in
                (("level_query", level_query), ("level_key", level_key), ("level_value", level_value))}}
    for name, tensors in lists.items():
        if not isinstance(tensors, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise _error(name, f"expected a list of tensors (one per level), given {type(tensors).__name__}")
    cross = {"cross_query": cross_query, "cross_key": cross_key, "cross_value": cross_value}
    for name, tensor in cross.items():
        if not isinstance(tensor, torch.Tensor):
            raise _error(name, f"expected a tensor, given {type(tensor).__name__}")
    for name, tensor in (("queries", queries), ("values", values)):
        if tensor.dim() != 4:
            raise _error(name, f"expected a [B, T, H, D] tensor, given {tensor.dim()} dimensions")
    levels = len(conv_weight) if levels is None else levels
    scale = None if scale is None else float(scale)
    if initial_state is None and not output_final_state:
        return _conv_compressed_op(queries, keys, values, *map(list, lists.values()), *cross.values(), group_size,
                                   levels, causal, window_left, window_right, scale)
    _require_state(causal, initial_state, _CONV_STATE)
    capacity = position + queries.shape[1] if context_capacity is None else int(context_capacity)
    out, *final = _conv_compressed_state_op(queries, keys, values, *map(list, lists.values()), *cross.values(),
                                            *(initial_state or (None,) * len(_CONV_STATE)), group_size, levels,
                                            window_left, scale, capacity, position)
    return (out, tuple(final)) if output_final_state else out


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

    def forward(self, query_logits: torch.Tensor, key_logits: torch.Tensor, values: torch.Tensor, *,
                initial_state: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
                output_final_state: bool = False, position: int = 0):
        """``[B, T, H, Dv]``, or ``(out, final_state)`` with ``output_final_state``: training in
        chunks as ``latte_attention`` describes."""
        return latte_attention(query_logits, key_logits, values, causal=self.causal, angles=self.angles,
                               initial_state=initial_state, output_final_state=output_final_state, position=position)


class LinearAttention(torch.nn.Module):
    """Linear attention as a module: ``forward(queries, keys, values)`` -> ``[B, T, H, Dv]``."""

    def __init__(self, *, causal: bool = True, feature_map: str = "elu_plus_one", rope: bool = False):
        super().__init__()
        self.causal, self.feature_map, self.rope = causal, feature_map, rope

    def forward(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *,
                initial_state: Optional[tuple[torch.Tensor, torch.Tensor]] = None, output_final_state: bool = False,
                position: int = 0):
        """``[B, T, H, Dv]``, or ``(out, final_state)`` with ``output_final_state``: training in
        chunks as ``linear_attention`` describes."""
        return linear_attention(queries, keys, values, causal=self.causal, feature_map=self.feature_map,
                                rope=self.rope, initial_state=initial_state, output_final_state=output_final_state,
                                position=position)


class SoftmaxAttention(torch.nn.Module):
    """Exact softmax attention as a module: ``forward(queries, keys, values)`` -> ``[B, T, H, Dv]``."""

    def __init__(self, *, causal: bool = True, window: Optional[tuple[int, int]] = None,
                 scale: Optional[float] = None):
        super().__init__()
        self.causal, self.window, self.scale = causal, window, scale

    def forward(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return softmax_attention(queries, keys, values, causal=self.causal, window=self.window, scale=self.scale)


class CosFormer(torch.nn.Module):
    """cosFormer as a module: ``forward(queries, keys, values)`` -> ``[B, T, H, Dv]``."""

    def __init__(self, *, causal: bool = True, length: Optional[int] = None):
        super().__init__()
        self.causal, self.length = causal, length

    def forward(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *,
                initial_state: Optional[tuple[torch.Tensor, torch.Tensor]] = None, output_final_state: bool = False,
                position: int = 0):
        """``cosformer`` with this module's options (its chunked-training arguments too)."""
        return cosformer(queries, keys, values, causal=self.causal, length=self.length, initial_state=initial_state,
                         output_final_state=output_final_state, position=position)


class LeaPModule(torch.nn.Module):
    """A LeaP module's weights as parameters: ``w1 [hidden, D]``, ``b1 [hidden]``, ``w2 [hidden]``,
    ``b2 []``, initialised as ``torch.nn.Linear(D, hidden)`` and ``torch.nn.Linear(hidden, 1)``
    initialise theirs (uniform within +-1/sqrt(fan_in)). ``weights`` is the tuple the ops take."""

    def __init__(self, dim: int, hidden: int, *, dtype: torch.dtype = torch.float32):
        super().__init__()

        def uniform(fan_in, *shape):
            bound = fan_in ** -0.5
            return torch.nn.Parameter(torch.empty(shape, dtype=dtype).uniform_(-bound, bound))

        self.w1, self.b1, self.w2, self.b2 = uniform(dim, hidden, dim), uniform(dim, hidden), uniform(hidden, hidden), \
            uniform(hidden)

    @property
    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.w1, self.b1, self.w2, self.b2


class LeaPformer(torch.nn.Module):
    """LeaPformer as a module: ``forward(queries, keys, values)`` -> ``[B, T, H, Dv]``, with the two
    LeaP modules ``query_module``, ``key_module`` (hidden = key_dim // leap_factor units) learned."""

    def __init__(self, key_dim: int, *, leap_factor: int = 4, causal: bool = True,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.causal = causal
        self.query_module = LeaPModule(key_dim, key_dim // leap_factor, dtype=dtype)
        self.key_module = LeaPModule(key_dim, key_dim // leap_factor, dtype=dtype)

    def forward(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *,
                initial_state: Optional[tuple[torch.Tensor, torch.Tensor]] = None, output_final_state: bool = False,
                position: int = 0):
        """``leapformer`` with this module's weights (its chunked-training arguments too)."""
        return leapformer(queries, keys, values, self.query_module.weights, self.key_module.weights,
                          causal=self.causal, initial_state=initial_state, output_final_state=output_final_state,
                          position=position)


class LatteMacchiato(torch.nn.Module):
    """Latte Macchiato as a module: ``forward(query_logits, key_logits, window_queries, window_keys,
    values)`` -> ``[B, T, H, Dv]``. With ``vapor=True`` and ``learn_angles`` the VAPOR angles
    ``[H, Dv/2]`` are a parameter (RoPE schedule at first); without ``learn_angles`` VAPOR keeps the
    RoPE schedule."""

    def __init__(self, heads: int, value_dim: int, window: int, *, causal: bool = True, vapor: bool = False,
                 rope: bool = False, vapor_scope: str = "latent_states", scale: Optional[float] = None,
                 learn_angles: bool = True, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.window, self.causal, self.vapor, self.rope, self.vapor_scope, self.scale = \
            window, causal, vapor, rope, vapor_scope, scale
        if vapor and learn_angles:
            initial = _latte.LatteAttention(heads, 1, value_dim, vapor=True).angles  # the same RoPE schedule
            self.angles = torch.nn.Parameter(torch.from_numpy(initial).to(dtype))
        else:
            self.register_parameter("angles", None)

    def forward(self, query_logits: torch.Tensor, key_logits: torch.Tensor, window_queries: torch.Tensor,
                window_keys: torch.Tensor, values: torch.Tensor, *,
                initial_state: Optional[tuple[torch.Tensor, ...]] = None, output_final_state: bool = False,
                position: int = 0):
        """``[B, T, H, Dv]``, or ``(out, final_state)`` with ``output_final_state``: training in
        chunks as ``latte_macchiato`` describes."""
        return latte_macchiato(query_logits, key_logits, window_queries, window_keys, values, window=self.window,
                               causal=self.causal, vapor=self.vapor, rope=self.rope, vapor_scope=self.vapor_scope,
                               scale=self.scale, angles=self.angles, initial_state=initial_state,
                               output_final_state=output_final_state, position=position)


class Lavo(torch.nn.Module):
    """LAVO as a module: ``forward(queries, keys, values)`` -> ``[B, T, H, d]``. The relative bias
    ``[H, 2w - 1]`` is a parameter (zeros at first, as latte starts it); the bases ``[H, r, d]`` are
    orthonormal from ``basis_seed``, and a parameter starting there with ``learn_basis=True``."""

    def __init__(self, heads: int, dim: int, bases: int, window: int, *, causal: bool = True, basis_seed: int = 0,
                 learn_basis: bool = False, scale: Optional[float] = None, empty_memory: str = "zero",
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.bases, self.window, self.causal, self.basis_seed, self.scale, self.empty_memory = \
            bases, window, causal, basis_seed, scale, empty_memory
        self.relative_bias = torch.nn.Parameter(torch.zeros(heads, 2 * window - 1, dtype=dtype))
        if learn_basis:
            initial = _latte.Lavo(heads, dim, bases, window, basis_seed=basis_seed).basis
            self.basis = torch.nn.Parameter(torch.from_numpy(initial).to(dtype))
        else:
            self.register_parameter("basis", None)

    def forward(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *,
                initial_state: Optional[tuple[torch.Tensor, ...]] = None, output_final_state: bool = False,
                position: int = 0):
        """``[B, T, H, d]``, or ``(out, final_state)`` with ``output_final_state``: training in
        chunks as ``lavo`` describes."""
        return lavo(queries, keys, values, bases=self.bases, window=self.window, relative_bias=self.relative_bias,
                    basis=self.basis, basis_seed=self.basis_seed, causal=self.causal, scale=self.scale,
                    empty_memory=self.empty_memory, initial_state=initial_state,
                    output_final_state=output_final_state, position=position)


class ConvCompressedAttention(torch.nn.Module):
    """Convolutional compression as a module: ``forward(queries, keys, values)`` -> ``[B, T, H, Dv]``
    (training in chunks: ``initial_state``, ``output_final_state``, ``position``, ``context_capacity``
    as ``conv_compressed_attention`` takes them), every weight a parameter (the lists ``conv_weight``, ``conv_bias``, ``level_query``,
    ``level_key``, ``level_value`` ParameterLists; ``cross_query``, ``cross_key``, ``cross_value``).
    latte starts them at zero (the global part then reads zero); here they start random, seeded by
    torch's RNG, as ``torch.nn.Linear`` initialises its weight and bias: uniform within
    +-1/sqrt(fan_in), fan_in = M Dv for a convolution and its bias (M tokens of Dv values each),
    Dv for a projection. ``weights`` is the dict of keyword arguments the op takes."""

    def __init__(self, heads: int, key_dim: int, value_dim: int, group_size: int, *, levels: int = 1,
                 causal: bool = True, window_left: Optional[int] = None, window_right: Optional[int] = None,
                 scale: Optional[float] = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        # latte checks the dimensions (a bad one raises latte.Error naming it) and resolves the window.
        checked = _latte.ConvCompressedAttention(heads, key_dim, value_dim, group_size, levels=levels, causal=causal,
                                                 window_left=window_left, window_right=window_right, scale=scale)
        self.group_size, self.levels, self.causal, self.scale = group_size, levels, causal, scale
        self.window_left, self.window_right = checked.window

        def uniform(fan_in, *shape):
            bound = fan_in ** -0.5
            return torch.nn.Parameter(torch.empty(shape, dtype=dtype).uniform_(-bound, bound))

        H, Dk, Dv, M = heads, key_dim, value_dim, group_size
        self.conv_weight = torch.nn.ParameterList([uniform(M * Dv, H, M, Dv, Dv) for _ in range(levels)])
        self.conv_bias = torch.nn.ParameterList([uniform(M * Dv, H, Dv) for _ in range(levels)])
        self.level_query = torch.nn.ParameterList([uniform(Dv, H, Dk, Dv) for _ in range(levels - 1)])
        self.level_key = torch.nn.ParameterList([uniform(Dv, H, Dk, Dv) for _ in range(levels - 1)])
        self.level_value = torch.nn.ParameterList([uniform(Dv, H, Dv, Dv) for _ in range(levels - 1)])
        self.cross_query, self.cross_key, self.cross_value = \
            uniform(Dv, H, Dk, Dv), uniform(Dv, H, Dk, Dv), uniform(Dv, H, Dv, Dv)

    @property
    def weights(self) -> dict:
        """The weights as ``conv_compressed_attention`` takes them (lists of the ParameterLists' entries)."""
        return {**{name: list(getattr(self, name)) for name in _CONV_LISTS},
                **{name: getattr(self, name) for name in _CONV_CROSS}}

    def forward(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *,
                initial_state: Optional[tuple[torch.Tensor, ...]] = None, output_final_state: bool = False,
                position: int = 0, context_capacity: Optional[int] = None):
        """``conv_compressed_attention`` with this module's weights (its chunked-training arguments too)."""
        return conv_compressed_attention(queries, keys, values, **self.weights, group_size=self.group_size,
                                         levels=self.levels, causal=self.causal, window_left=self.window_left,
                                         window_right=self.window_right, scale=self.scale,
                                         initial_state=initial_state, output_final_state=output_final_state,
                                         position=position, context_capacity=context_capacity)
