"""One row of the KV cache (Dh values of one position and kv head) written from / read into
float32, per cache type (model/kv_cache.py draws the layouts):
  f16   uint16 [Dh]           value = f16(bits)
  bf16  int16  [Dh]           value = f32 of (bits << 16)
  q8_0  uint8  [Dh/32 * 34]   per block b: bytes 34b, 34b+1 = d (f16, little-endian),
                              bytes 34b+2 .. 34b+33 = q int8; value 32b + i = d * q[i]
store_row / load_row pick the type's loop by the row's dtype when Numba compiles the caller,
so each caller holds one type's code (as specialize.py does per weight type); the loads are
inlined (Numba IR): a call per row would cost more than the row's conversion.
q8_0 quantizes as llama.cpp's quantize_row_q8_0_ref: d = max|x| / 127 (f32), q = round(x / d)
(half away from zero), d kept as f16.
"""
import math

import numpy as np
from numba import njit, types
from numba.extending import overload

from .half import bf16_to_f32, f16_to_f32, f32_to_f16

QK = 32        # values per q8_0 block
QB = 34        # bytes per q8_0 block


@njit(cache=True, error_model="numpy")
def store_f16(dst, src):
    for i in range(src.shape[0]):
        dst[i] = f32_to_f16(src[i])


@njit(cache=True, error_model="numpy")
def store_bf16(dst, src):
    """f32 -> bf16 rounded to nearest even (a NaN stays a quiet NaN), as llama.cpp's."""
    for i in range(src.shape[0]):
        u = np.float32(src[i]).view(np.uint32)
        if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
            b = (u >> np.uint32(16)) | np.uint32(64)
        else:
            b = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
        dst[i] = np.int16(np.uint16(b))


@njit(cache=True, error_model="numpy")
def store_q8_0(dst, src):
    for b in range(src.shape[0] // QK):
        x = src[b * QK:(b + 1) * QK]
        amax = np.float32(0.0)
        for i in range(QK):
            amax = max(amax, abs(x[i]))
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
        bits = f32_to_f16(np.float32(d))
        o = b * QB
        dst[o] = np.uint8(bits & np.uint16(0xFF))
        dst[o + 1] = np.uint8(bits >> np.uint16(8))
        for i in range(QK):
            v = x[i] * inv
            q = np.int32(math.floor(abs(v) + np.float32(0.5)))
            dst[o + 2 + i] = np.uint8((-q if v < 0 else q) & 0xFF)


@njit(inline="always")
def load_f16(dst, src):
    for i in range(dst.shape[0]):
        dst[i] = f16_to_f32(src[i])


@njit(inline="always")
def load_bf16(dst, src):
    for i in range(dst.shape[0]):
        dst[i] = bf16_to_f32(src[i])


@njit(inline="always")
def q8_scale(src, b):
    """d of block b of a q8_0 row, as float32."""
    o = b * QB
    return f16_to_f32(np.uint16(np.uint16(src[o]) | (np.uint16(src[o + 1]) << np.uint16(8))))


@njit(inline="always")
def load_q8_0(dst, src):
    for b in range(dst.shape[0] // QK):
        d = q8_scale(src, b)
        o = b * QB + 2
        for i in range(QK):
            dst[b * QK + i] = d * np.float32(np.int8(src[o + i]))


_STORE = {np.dtype(np.uint16): store_f16, np.dtype(np.int16): store_bf16, np.dtype(np.uint8): store_q8_0}
_LOAD = {np.dtype(np.uint16): load_f16, np.dtype(np.int16): load_bf16, np.dtype(np.uint8): load_q8_0}
_NB = {types.uint16: np.uint16, types.int16: np.int16, types.uint8: np.uint8}


def store_row(dst, src):
    """dst (a cache row of any type) = src [Dh] float32, quantized."""
    _STORE[dst.dtype](dst, src)


def load_row(dst, src):
    """dst [Dh] float32 = src (a cache row of any type), dequantized."""
    _LOAD[src.dtype](dst, src)


@overload(store_row, jit_options={"error_model": "numpy"})
def _store_row(dst, src):
    f = _STORE[np.dtype(_NB[dst.dtype])]
    return lambda dst, src: f(dst, src)


@overload(load_row, inline="always", jit_options={"error_model": "numpy"})
def _load_row(dst, src):
    f = _LOAD[np.dtype(_NB[src.dtype])]
    return lambda dst, src: f(dst, src)


@njit(cache=True, error_model="numpy")
def store_rows(dst, src):
    """Each row of dst [N, row] (any cache type) = the same row of src [N, Dh] float32."""
    for i in range(src.shape[0]):
        store_row(dst[i], src[i])
