"""Reading and writing KV cache rows on the GPU, per cache type (model/kv_cache.py draws the
layouts; the CPU's versions are cpu/kv_rows.py), for kernels where a warp holds one row:
lane l holds dims l, l + 32, ... (dim d = l + 32 c in its slot c).

  f16   uint16 [C, Hkv, Dh]          2 bytes a value
  bf16  int16  [C, Hkv, Dh]          value = f32 of (bits << 16)
  q8_0  uint8  [C, Hkv, Dh/32 * 34]  block c = dims 32c .. 32c+31 (one slot of the warp):
                                     bytes 34c, 34c+1 = d f16, 34c+2+l = q int8 of dim 32c+l

row_fns(Dh, kv_type) gives, as device functions compiled into the caller (one type's code):
  head_bytes            bytes of one (position, kv head) row
  dot(qv, cache, rb, lane)          this lane's part of q . row (row at byte offset rb)
  load(vals, i, cache, rb, lane)    vals[i + c] = the row's dim lane + 32c (0 past Dh)
  store(cache, cache16, j, g, c, lane, x)  dim lane + 32c of row (j, g) = x, quantized; all 32
                                    lanes call it for q8_0 (a warp max makes the block's d)
cache16 is write_view(cache): a float16 view (f16, q8_0's d) or the int16 cache itself (bf16).
q8_0 quantizes as the CPU does: d = max|x| / 127, q = round(x / d) halves away from zero.

pair_fn(kv_type) gives, for the flash kernel's tiles (flash.py), where a thread stages words:
  lane_off(w)                       byte offset in a row where word w's data starts (f16,
                                    bf16: the word itself; q8_0: its block)
  pair(cache, base, off, w)         dims 2w, 2w + 1 of the row at byte base + off - lane_off(w)
                                    as one word of two f16, the lower dim in the low half (f16:
                                    the bits; bf16: to f32 by a shift, rounded to f16; q8_0:
                                    d * q in f32, rounded to f16: d and one 16-bit load of 2 q)
"""
import math

import numpy as np
from numba import cuda

from . import SIM, as_f32, device_fn, ld_f16, ld_u8, ld_u16, ld_u32, shfl_xor
from .mma import pack_f16x2

f32 = np.float32
u32 = np.uint32
_fns = {}
_pairs = {}

if SIM:
    def f32_bits(x):
        return int(np.float32(x).view(np.uint32))
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, forceinline=True)
    def f32_bits(x):
        return np.uint32(libdevice.float_as_int(x))


def kv_type_of(cache):
    return {np.dtype(np.uint16): "f16", np.dtype(np.int16): "bf16",
            np.dtype(np.uint8): "q8_0"}[np.dtype(cache.dtype)]


def write_view(cache):
    """The view the store functions write 16-bit values through."""
    return cache if kv_type_of(cache) == "bf16" else cache.view(np.float16)


def row_fns(Dh, kv_type):
    key = (Dh, kv_type)
    if key in _fns:
        return _fns[key]
    DPL = (Dh + 31) // 32

    if kv_type == "f16":
        head_bytes = 2 * Dh

        @device_fn
        def dot(qv, cache, rb, lane):
            s = f32(0.0)
            for c in range(DPL):
                d = lane + 32 * c
                if d < Dh:
                    s += qv[c] * ld_f16(cache, rb, 2 * d)
            return s

        @device_fn
        def load(vals, i, cache, rb, lane):
            for c in range(DPL):
                d = lane + 32 * c
                vals[i + c] = ld_f16(cache, rb, 2 * d) if d < Dh else f32(0.0)

        @device_fn
        def store(cache, cache16, j, g, c, lane, x):
            cache16[j, g, lane + 32 * c] = np.float16(x)

    elif kv_type == "bf16":
        head_bytes = 2 * Dh

        @device_fn
        def dot(qv, cache, rb, lane):
            s = f32(0.0)
            for c in range(DPL):
                d = lane + 32 * c
                if d < Dh:
                    s += qv[c] * as_f32(ld_u16(cache, rb, 2 * d) << 16)
            return s

        @device_fn
        def load(vals, i, cache, rb, lane):
            for c in range(DPL):
                d = lane + 32 * c
                vals[i + c] = as_f32(ld_u16(cache, rb, 2 * d) << 16) if d < Dh else f32(0.0)

        @device_fn
        def store(cache, cache16, j, g, c, lane, x):
            u = f32_bits(x)                          # round to nearest even; NaN stays quiet
            if (u & 0x7FFFFFFF) > 0x7F800000:
                b = (u >> 16) | 64
            else:
                b = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
            b = b & 0xFFFF
            cache[j, g, lane + 32 * c] = np.int16(b - 65536 if b >= 32768 else b)

    elif kv_type == "q8_0":
        if Dh % 32:
            raise ValueError("a q8_0 KV cache needs a head dim that is a multiple of 32")
        head_bytes = Dh // 32 * 34

        @device_fn
        def q8(cache, rb, c, lane):
            q = ld_u8(cache, rb, 34 * c + 2 + lane)
            return ld_f16(cache, rb, 34 * c) * (f32(q) - f32(256.0) if q > 127 else f32(q))

        @device_fn
        def dot(qv, cache, rb, lane):
            s = f32(0.0)
            for c in range(DPL):
                s += qv[c] * q8(cache, rb, c, lane)
            return s

        @device_fn
        def load(vals, i, cache, rb, lane):
            for c in range(DPL):
                vals[i + c] = q8(cache, rb, c, lane)

        @device_fn
        def store(cache, cache16, j, g, c, lane, x):
            a = abs(x)
            for m in (16, 8, 4, 2, 1):
                a = max(a, shfl_xor(a, m))
            d = a / f32(127.0)
            inv = f32(1.0) / d if d > f32(0.0) else f32(0.0)
            v = x * inv
            q = np.int32(math.floor(abs(v) + f32(0.5)))
            q = -q if v < f32(0.0) else q
            cache[j, g, 34 * c + 2 + lane] = np.uint8(q & 255)
            if lane == 0:
                cache16[j, g, 17 * c] = np.float16(d)
    else:
        raise ValueError(f"unknown KV cache type {kv_type!r}")
    _fns[key] = head_bytes, dot, load, store
    return _fns[key]


def pair_fn(kv_type):
    if kv_type in _pairs:
        return _pairs[kv_type]
    if kv_type in ("f16", "bf16"):
        @device_fn
        def lane_off(w):
            return 4 * w

    elif kv_type == "q8_0":
        @device_fn
        def lane_off(w):
            return 34 * (w >> 4)                      # block w // 16 holds dims 2w, 2w + 1
    else:
        raise ValueError(f"unknown KV cache type {kv_type!r}")

    if kv_type == "f16":
        @device_fn
        def pair(cache, base, off, w):
            return ld_u32(cache, base, off)

    elif kv_type == "bf16":
        @device_fn
        def pair(cache, base, off, w):
            u = ld_u32(cache, base, off)
            return pack_f16x2(as_f32(u << u32(16)), as_f32(u & u32(0xFFFF0000)))

    else:
        @device_fn
        def pair(cache, base, off, w):
            d = ld_f16(cache, base, off)
            qq = ld_u16(cache, base, off + 2 + 2 * (w & 15))
            lo = qq & u32(255)
            hi = qq >> u32(8)
            return pack_f16x2(d * (f32(lo) - f32(256.0) if lo > 127 else f32(lo)),
                              d * (f32(hi) - f32(256.0) if hi > 127 else f32(hi)))
    _pairs[kv_type] = lane_off, pair
    return _pairs[kv_type]
