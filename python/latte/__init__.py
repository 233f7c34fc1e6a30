"""latte: linear-time attention kernels (header-only C++20) from Python.

Arrays are NumPy arrays or anything that speaks DLPack / the buffer protocol
on the CPU (PyTorch tensors included), float32 or float64, read in place:
nothing is copied, and the GIL is released while a kernel runs. Bad input
raises latte.Error, a ValueError whose ``argument`` names the argument at fault.
New outputs of 4 MiB or more reuse freed outputs' memory (at most 1 GiB held:
``set_array_cache_limit``, ``empty_array_cache``, ``array_cache_info``).
``kernel_seconds()`` totals the time spent inside the C++ kernels, so that a
call's wall time minus its growth is what the Python side added.

    import numpy as np, latte
    attention = latte.LatteAttention(heads=4, latents=16, value_dim=32)
    q = np.random.randn(1, 128, 4, 16).astype(np.float32)   # [B, T, H, L]
    k = np.random.randn(1, 128, 4, 16).astype(np.float32)
    v = np.random.randn(1, 128, 4, 32).astype(np.float32)   # [B, T, H, Dv]
    out = attention.forward(q, k, v)                          # [B, T, H, Dv]
"""

from ._latte import (ConvCompressedAttention, ConvCompressedState, CosFormer, CosFormerState, Error,
                     KVCache, LatteAttention, LatteMacchiato, LatteState, Lavo, LavoState, LeaPformer,
                     LeaPformerState, LinearAttention, LinearState, MacchiatoState, SoftmaxAttention,
                     __version__, array_cache_info, build_info, empty_array_cache, kernel_seconds,
                     set_array_cache_limit)

__all__ = ["ConvCompressedAttention", "ConvCompressedState", "CosFormer", "CosFormerState", "Error",
           "KVCache", "LatteAttention", "LatteMacchiato", "LatteState", "Lavo", "LavoState", "LeaPformer",
           "LeaPformerState", "LinearAttention", "LinearState", "MacchiatoState", "SoftmaxAttention",
           "__version__", "array_cache_info", "build_info", "empty_array_cache", "kernel_seconds", "set_array_cache_limit"]
