"""MLA's expanded form for prompt batches on the GPU: the same two steps as cpu/mla.py (its
docstring has the math), over an f16 cache [C, 1, R + Dr] (the engine expands over f16
caches only). One thread per value; both are copies beside the product between them.

The rows start at `first`: an int, or the batch's device positions (their first one), so
that a batch's own rows are found on the device and its launches can be recorded into a
CUDA graph (backends/mla.py).
"""
import numpy as np
from numba import cuda

from . import device_id
from .kv_rows import write_view
from .ops import THREADS, _blocks

f32 = np.float32
_first_rows = {}       # (GPU, int) -> a device int32 [1] holding it


def _first(first):
    """first as a device int32 array whose element 0 is the first row."""
    if isinstance(first, (int, np.integer)):
        key = (device_id(), int(first))
        if key not in _first_rows:
            _first_rows[key] = cuda.to_device(np.array([first], np.int32))
        return _first_rows[key]
    return first


@cuda.jit
def latents_kernel(lat, cache, first):
    n, R = lat.shape
    i = cuda.grid(1)
    if i < n * R:
        j = i // R
        lat[j, i - j * R] = f32(cache[first[0] + j, 0, i - j * R])


def latents(lat, cache, K, first=0, stream=0):
    """lat [n, R] float32 = the latents of cache rows first .. first + n - 1 (K = R + Dr a row)."""
    n = lat.shape[0] * lat.shape[1]
    if n:
        latents_kernel[_blocks(n, THREADS), THREADS, stream](lat, write_view(cache), _first(first))


@cuda.jit
def expand_kernel(keys, values, kv, cache, R, first):
    n = kv.shape[0]
    H, Dk = keys.shape[1], keys.shape[2]
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
    row = first[0] + j
    if e < Dn:
        keys[row, h, e] = kv[j, h * W + e]
    elif e < Dk:
        keys[row, h, e] = cache[row, 0, R + e - Dn]
    else:
        values[row, h, e - Dk] = kv[j, h * W + Dn + e - Dk]


def expand(keys, values, kv, cache, K, first=0, stream=0):
    """Rows first .. first + n - 1 of keys [C, H, Dn + Dr] and values [C, H, Dv] (f16 bits)
    from kv [n, H (Dn + Dv)] float32 (the product) and the k_pe of the same cache rows (their
    last Dr of K values)."""
    n, (_, H, Dk) = kv.shape[0], keys.shape
    R = K - (Dk - (kv.shape[1] // H - values.shape[2]))
    total = n * H * (Dk + values.shape[2])
    if total:
        expand_kernel[_blocks(total, THREADS), THREADS, stream](
            write_view(keys), write_view(values), kv, write_view(cache), R, _first(first))
