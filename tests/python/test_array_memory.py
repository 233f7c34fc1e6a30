"""The memory latte's outputs come in (python/src/array_memory.hpp): outputs of 4 MiB and more
reuse freed blocks of a similar size, which hold whatever the previous array left. A kernel
that counted on fresh (zeroed) memory would go wrong only then, so every mechanism's forward
and backward run twice at a size whose arrays are cached: the second time into the first
call's blocks, filled with NaN in between, and must give the first call's results bit for
bit. The first call's own correctness is the other test files' (explicit T x T definitions)."""
import numpy as np
import pytest

import latte
import latte._latte as native

RNG = np.random.default_rng(2611)
# [B, T, H, D] in float64 with D = 64: 1 x 1024 x 8 x 64 x 8 bytes = 4 MiB, a cached size.
B, T, H, D = 1, 1024, 8, 64


def leap_module(hidden=D // 4):
    return (RNG.normal(0, 0.5, (hidden, D)), RNG.normal(0, 0.5, hidden), RNG.normal(0, 0.5, hidden),
            float(RNG.normal(0, 0.5)))


# name: (the attention, the last axes of its inputs)
MECHANISMS = {
    "latte_causal": (lambda: latte.LatteAttention(H, D, D), [D] * 3),
    "latte_bidirectional": (lambda: latte.LatteAttention(H, D, D, causal=False), [D] * 3),
    "linear": (lambda: latte.LinearAttention(H, D, D), [D] * 3),
    "softmax": (lambda: latte.SoftmaxAttention(H, D, D, causal=True, window=(64, 0)), [D] * 3),
    "cosformer": (lambda: latte.CosFormer(H, D, D, causal=False), [D] * 3),
    "leapformer": (lambda: latte.LeaPformer(H, D, D, query_module=leap_module(), key_module=leap_module()), [D] * 3),
    # query logits: L latents + 1 (the local one)
    "macchiato": (lambda: latte.LatteMacchiato(H, D - 1, D, D, 3), [D, D - 1, D, D, D]),
    "lavo": (lambda: latte.Lavo(H, D, 16, 4), [D] * 3),
    "conv_compressed": (lambda: latte.ConvCompressedAttention(H, D, D, 2), [D] * 3),
}


def addresses(arrays):
    return {native._data_address(a) for a in arrays if isinstance(a, np.ndarray) and a.nbytes >= 4 << 20}


def flat(results):
    """Every array of a forward's or backward's results (dicts of weight gradients included)."""
    if isinstance(results, np.ndarray):
        return [results]
    if isinstance(results, float):  # a scalar weight's gradient
        return []
    if isinstance(results, dict):
        results = results.values()
    return [array for r in results for array in flat(r)]


@pytest.mark.parametrize("name", MECHANISMS)
def test_outputs_written_into_reused_blocks_are_exact(name):
    make, widths = MECHANISMS[name]
    attention = make()
    x = [RNG.normal(0, 0.5, (B, T, H, width)) for width in widths]
    latte.empty_array_cache()
    assert latte.array_cache_info()["limit"] >= 64 << 20
    for call in ("forward", "backward"):
        args = x + ([RNG.uniform(-1, 1, (B, T, H, D))] if call == "backward" else [])
        first = flat(getattr(attention, call)(*args))
        expected = [a.copy() for a in first]
        used = addresses(first)
        for array in first:
            array.fill(np.nan)
        del array, first
        assert latte.array_cache_info()["cached_bytes"] >= len(used) * (4 << 20)
        again = flat(getattr(attention, call)(*args))
        assert used and addresses(again) == used, "the second call did not reuse the first one's blocks"
        for e, g in zip(expected, again, strict=True):
            np.testing.assert_array_equal(g, e)
        del again


def test_the_cache_holds_no_more_than_its_limit_and_empties():
    attention = latte.LinearAttention(H, D, D)
    x = [RNG.normal(0, 0.5, (B, T, H, D)) for _ in range(3)]
    latte.empty_array_cache()
    assert latte.array_cache_info()["cached_bytes"] == 0
    try:
        latte.set_array_cache_limit(9 << 20)  # two 4 MiB blocks, not three
        gradients = attention.backward(*x, x[0])
        del gradients
        assert latte.array_cache_info() == {"cached_bytes": 8 << 20, "limit": 9 << 20}
        latte.set_array_cache_limit(0)
        assert latte.array_cache_info()["cached_bytes"] == 0
        out = attention.forward(*x)
        del out
        assert latte.array_cache_info()["cached_bytes"] == 0
    finally:
        latte.set_array_cache_limit(1 << 30)
    out = attention.forward(*x)
    del out
    assert latte.array_cache_info()["cached_bytes"] == 4 << 20
    latte.empty_array_cache()
    assert latte.array_cache_info() == {"cached_bytes": 0, "limit": 1 << 30}


@pytest.mark.parametrize("name", MECHANISMS)
def test_empty_sequences_give_empty_outputs_and_gradients(name):
    """T = 0: NumPy gives an empty array strides of 0, which latte's views would refuse for
    the last axis; an empty array addresses nothing, so any strides are accepted."""
    make, widths = MECHANISMS[name]
    attention = make()
    for source in (np.zeros, np.empty):
        x = [source((2, 0, H, width)) for width in widths]
        assert x[0].strides == (0, 0, 0, 0)
        out = attention.forward(*x)
        assert out.shape == (2, 0, H, D)
        gradients = flat(attention.backward(*x, np.zeros((2, 0, H, D))))
        for g, given in zip(gradients, x):
            assert g.shape == given.shape
