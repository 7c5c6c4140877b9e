"""MLA's expanded form for prompt batches on the GPU: the same two steps as cpu/mla.py (its
docstring has the math), over an f16 cache [C, 1, R + Dr] (the engine expands over f16
caches only). One thread per value; both are copies beside the product between them.
"""
import numpy as np
from numba import cuda

from .kv_rows import write_view
from .ops import THREADS, _blocks

f32 = np.float32


@cuda.jit
def latents_kernel(lat, cache):
    n, R = lat.shape
    i = cuda.grid(1)
    if i < n * R:
        j = i // R
        lat[j, i - j * R] = f32(cache[j, 0, i - j * R])


def latents(lat, cache, K, stream=0):
    """lat [n, R] float32 = the latents of cache rows 0 .. n - 1 (K = R + Dr a row)."""
    n = lat.shape[0] * lat.shape[1]
    if n:
        latents_kernel[_blocks(n, THREADS), THREADS, stream](lat, write_view(cache))


@cuda.jit
def expand_kernel(keys, values, kv, cache, R):
    n, H, Dk = keys.shape
    Dv = values.shape[2]
    W = kv.shape[1] // H                # Dn + Dv
    Dn = W - Dv
    i = cuda.grid(1)
    if i >= n * H * (Dk + Dv):
        return
    j = i // (H * (Dk + Dv))
    r = i - j * H * (Dk + Dv)
    h = r // (Dk + Dv)
    e = r - h * (Dk + Dv)
    if e < Dn:
        keys[j, h, e] = kv[j, h * W + e]
    elif e < Dk:
        keys[j, h, e] = cache[j, 0, R + e - Dn]
    else:
        values[j, h, e - Dk] = kv[j, h * W + Dn + e - Dk]


def expand(keys, values, kv, cache, K, stream=0):
    """keys [n, H, Dn + Dr], values [n, H, Dv] (f16 bits) from kv [n, H (Dn + Dv)] float32 (the
    product) and the k_pe of cache rows 0 .. n - 1 (their last Dr of K values)."""
    n, H, Dk = keys.shape
    R = K - (Dk - (kv.shape[1] // H - values.shape[2]))
    total = n * H * (Dk + values.shape[2])
    if total:
        expand_kernel[_blocks(total, THREADS), THREADS, stream](
            write_view(keys), write_view(values), kv, write_view(cache), R)
