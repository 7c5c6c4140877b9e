"""x rounded to 8 bits per 32-block for the integer dot products (dp4a, int8 tensor cores).

Format (as the CPU's quants_int8.quantize_x): x [N, K] (any shape of N rows of K, C-contiguous)
-> flat buffers xq int32 [N * K / 4] (4 int8 codes a word, little-endian) and xds float32
[N * K / 16], (d, s) per 32-block: d = max|x| / 127, code = rint(x / d), s = d * sum of codes.
quantize_x_kernel: one thread per word, the 8 lanes of a block reduce by shuffles; threads
past the end work on the last word and do not write (every lane reaches the shuffles).
quantize_word and quantize_lane let a kernel that produces x (a norm, attention) write it in
8 bits as well, so the next product skips this launch.
"""
import numpy as np
from numba import cuda

from . import device_fn, device_id, ld_f32, rintf, shfl_idx, shfl_xor
from .scratch import buffer

f32 = np.float32
i32 = np.int32
u32 = np.uint32


@cuda.jit
def quantize_x_kernel(xq, xds, x, n_words):
    idx = cuda.grid(1)
    i = min(idx, n_words - 1)
    quantize_word(xq, xds, idx, idx < n_words, ld_f32(x, 0, 16 * i), ld_f32(x, 0, 16 * i + 4),
                  ld_f32(x, 0, 16 * i + 8), ld_f32(x, 0, 16 * i + 12))


@device_fn
def quantize_word(xq, xds, idx, write, x0, x1, x2, x3):
    """Word idx of xq from its 4 values; lanes idx % 8 == 0..7 of one 32-block are 8
    consecutive lanes of a warp (all of them call this), and lane 0 of them writes xds."""
    a = max(max(abs(x0), abs(x1)), max(abs(x2), abs(x3)))
    if x0 != x0 or x1 != x1 or x2 != x2 or x3 != x3:
        a = x0 + x1 + x2 + x3                      # NaN sticks: d = NaN, so the output is NaN
    for m in (4, 2, 1):
        o = shfl_xor(a, m)
        if o > a or o != o:
            a = o
    d = a / f32(127.0)
    inv = f32(1.0) / d if d > f32(0.0) else f32(0.0)
    q0 = i32(rintf(x0 * inv))
    q1 = i32(rintf(x1 * inv))
    q2 = i32(rintf(x2 * inv))
    q3 = i32(rintf(x3 * inv))
    sq = q0 + q1 + q2 + q3
    for m in (4, 2, 1):
        sq += shfl_xor(sq, m)
    if write:
        xq[idx] = _word(q0, q1, q2, q3)
        if idx % 8 == 0:
            xds[idx // 4] = d
            xds[idx // 4 + 1] = d * f32(sq)


@device_fn
def _word(q0, q1, q2, q3):
    """Four 8-bit codes in one int32 word, little-endian."""
    return i32(u32(q0 & 0xFF) | (u32(q1 & 0xFF) << u32(8)) | (u32(q2 & 0xFF) << u32(16))
               | (u32(q3 & 0xFF) << u32(24)))


@device_fn
def quantize_lane(xq, xds, blk, write, v, lane):
    """32-block blk of x from one value a lane (lane l holds value 32 blk + l; all 32 lanes
    call this): the codes and (d, s) quantize_word gives the same block. Lanes 0..7 gather the
    codes of lanes 4l..4l+3 into word 8 blk + l."""
    a = abs(v)
    if v != v:
        a = v                                      # NaN sticks, as in quantize_word
    for m in (16, 8, 4, 2, 1):
        o = shfl_xor(a, m)
        if o > a or o != o:
            a = o
    d = a / f32(127.0)
    inv = f32(1.0) / d if d > f32(0.0) else f32(0.0)
    q = i32(rintf(v * inv))
    sq = q
    for m in (16, 8, 4, 2, 1):
        sq += shfl_xor(sq, m)
    src = 4 * (lane & 7)
    c0 = shfl_idx(q, src)
    c1 = shfl_idx(q, src + 1)
    c2 = shfl_idx(q, src + 2)
    c3 = shfl_idx(q, src + 3)
    if write and lane < 8:
        xq[8 * blk + lane] = _word(c0, c1, c2, c3)
        if lane == 0:
            xds[2 * blk] = d
            xds[2 * blk + 1] = d * f32(sq)


_x8_stand_ins = {}


def unused_x8():
    """Stand-ins for unused 8-bit output buffers (kernels are typed on them), per GPU."""
    key = device_id()
    if key not in _x8_stand_ins:
        _x8_stand_ins[key] = (cuda.device_array(1, np.int32), cuda.device_array(1, np.float32))
    return _x8_stand_ins[key]


def quantize_x(x, n_rows, K, stream=0, ready=False):
    """x (n_rows rows of K) -> (xq, xds) in reused flat device buffers (one stream at a time).
    ready: the buffers already hold this x (the previous product quantized the same input)."""
    n = n_rows * K // 4
    xq, xds = x8_buffers(n_rows, K)
    if not ready:
        quantize_x_kernel[(n + 127) // 128, 128, stream](xq, xds, x, n)
    return xq, xds


# A view x [T, X, K] of any strides (columns of wider heads: MLA's q_nope, attention's latent),
# K a multiple of 32, so a word never crosses a row: the same words as quantize_x of a copy.
@cuda.jit
def quantize_x_view_kernel(xq, xds, x, n_words):
    idx = cuda.grid(1)
    i = min(idx, n_words - 1)
    X, K = x.shape[1], x.shape[2]
    n = 4 * i // K                   # row n = t * X + h, column c
    c = 4 * i - n * K
    t = n // X
    h = n - t * X
    quantize_word(xq, xds, idx, idx < n_words, x[t, h, c], x[t, h, c + 1], x[t, h, c + 2], x[t, h, c + 3])


def quantize_x_view(x, stream=0):
    """x [T, X, K] (a view; K % 32 == 0) -> (xq, xds) in the buffers quantize_x fills."""
    T, X, K = x.shape
    n = T * X * K // 4
    xq, xds = x8_buffers(T * X, K)
    if n:
        quantize_x_view_kernel[(n + 127) // 128, 128, stream](xq, xds, x, n)
    return xq, xds


def x8_buffers(n_rows, K):
    """The (xq, xds) buffers the next product reads when it gets x_ready=True (a fused
    producer, such as ops.rms_norm(..., xq=, xds=), writes x there in 8 bits)."""
    n = n_rows * K // 4
    return buffer("xq", n, np.int32), buffer("xds", n // 4, np.float32)
