"""The grid ("i-quant") types on CPU: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M.

Letters as in quants.py: R rows, K values in a row, x the float32 activation row [K].

A super-block holds 256 values as 8 sub-blocks of 32. Values come in groups of 8 (4 for the
IQ3 types) that are one row of a fixed codebook, the grid, picked by an index of 8-11 bits:
    v = d * s * grid[index][j] * sign[j]     (IQ2, IQ3: grid values > 0, a sign bit per value)
    v = d * s * (grid[index][j] + delta)     (IQ1: grid values -1, 0, 1; delta = +-1/8)
with d the super-block's f16 scale and s a small integer scale per 32 (or 16) values.
The IQ2_XXS / IQ2_XS / IQ3_XXS signs are 7 bits per 8 values: the 8th makes the count of
minus signs even (KSIGNS[i] = i | parity(i) << 7).
Byte layouts (little-endian, from gguf-py's quants.py), per 256 values:

  IQ2_XXS  66 bytes = d:f16 qs:64      per 32 values 8 bytes: 4 grid indices u8, then a u32 of
                                       4 x 7 sign bits | scale:4 << 28    s = (0.5 + sc) / 4
  IQ2_XS   74 bytes = d:f16 qs:64 scales:8     per 8 values a u16: grid index:9 | signs:7 << 9;
                                       a scale nibble per 16 values      s = (0.5 + sc) / 4
  IQ2_S    82 bytes = d:f16 qs:32 signs:32 qh:8 scales:8   index = qs byte | 2 bits of qh << 8
                                       (4 per qh byte); a sign bit per value; s as IQ2_XS
  IQ3_XXS  98 bytes = d:f16 qs:64 scales:32    per 4 values a grid index u8; per 32 values a
                                       u32 of 4 x 7 sign bits | scale:4 << 28   s = (0.5 + sc) / 2
  IQ3_S   110 bytes = d:f16 qs:64 qh:8 signs:32 scales:4   index = qs byte | 1 bit of qh << 8;
                                       a sign bit per value; a nibble per 32 values  s = 1 + 2 sc
  IQ1_S    50 bytes = d:f16 qs:32 qh:16   per 32 values a u16 qh: 4 x 3 high index bits |
                                       sc:3 << 12 | delta sign << 15;     s = 2 sc + 1
  IQ1_M    56 bytes = qs:32 qh:16 scales:8   a qh nibble per index: 3 high index bits | delta
                                       sign << 3; scales: 4 u16, each 4 x 3-bit sc (per 16
                                       values, s = 2 sc + 1), their top nibbles form d.

Grids are gguf-py's tables, unpacked at import into uint8 [N, 8] (or [N, 4]) arrays that the
kernels read as constants (IQ1's as grid + 1, i.e. 0, 1, 2). Per type, as in quants.py:
  dequant_rows_<t>(out, w)         plain loops, exact vs gguf-py (every product is exact in f32)
  dot_rows_<t>(out, w, x, xsum)    float dots: 16 lane accumulators, lane j takes values j
                                   and j + 16 of each sub-block (scaled per half where s is
                                   per 16 values), reduced once per row.
Both decode a sub-block into a 32-float stack array first (_<t>_sub: values without d and s,
returning s), so the decode is written once per type. Signs multiply by a row of SIGNS (a
float +-1 table) rather than 8 bit tests, which became slow mask-building code.
The integer dots against 8-bit x (the default matrix-vector path on VNNI CPUs, faster than
these float dots) are in quants_iq_i8.py.
"""
import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from numba import njit

from .half import f16_to_f32
from .quants import FM, IQ_TYPES, block32, f32, lanes16, load_f16, load_u32, sum16
from .specialize import ConstantArgs

IQ2_XXS = int(GGMLQuantizationType.IQ2_XXS)
IQ2_XS = int(GGMLQuantizationType.IQ2_XS)
IQ2_S = int(GGMLQuantizationType.IQ2_S)
IQ3_XXS = int(GGMLQuantizationType.IQ3_XXS)
IQ3_S = int(GGMLQuantizationType.IQ3_S)
IQ1_S = int(GGMLQuantizationType.IQ1_S)
IQ1_M = int(GGMLQuantizationType.IQ1_M)
assert IQ_TYPES == (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M)

u32 = np.uint32


def _grid(cls, add=0):
    """gguf-py's grid of quant class cls as uint8 [N, 8 or 4] (+ add)."""
    cls.init_grid()
    return np.ascontiguousarray(cls.grid.reshape(cls.grid_shape) + add).astype(np.uint8)


IQ2XXS_GRID = _grid(gguf_quants.IQ2_XXS)   # [256, 8]  values 8, 25, 43
IQ2XS_GRID = _grid(gguf_quants.IQ2_XS)     # [512, 8]
IQ2S_GRID = _grid(gguf_quants.IQ2_S)       # [1024, 8]
IQ3XXS_GRID = _grid(gguf_quants.IQ3_XXS)   # [256, 4]  values 4, 12, ..., 62
IQ3S_GRID = _grid(gguf_quants.IQ3_S)       # [512, 4]  values 1, 3, ..., 15
IQ1_GRID = _grid(gguf_quants.IQ1_S, 1)     # [2048, 8] values -1, 0, 1 stored + 1
KSIGNS = np.frombuffer(gguf_quants.IQ2_XXS.ksigns, np.uint8).copy()  # [128] 7 sign bits -> 8
# [256, 8] float32: SIGNS[s, j] = -1 where bit j of s is set, else 1 (an 8 KB table: one
# vector load and a multiply per 8 values instead of 8 bit tests)
SIGNS = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, -1, 1).astype(np.float32)
IQ1_DELTA = f32(0.125)


# ---------------------------------------------------------------- sub-block decoders
# v[0:32] <- the sub-block's values without d * s; they return s (or s of each 16 values).

@njit(inline="always")
def put_signed(v, i, grid, idx, signs, n):
    """v[i:i + n] = grid row idx, negated where bit j of signs is set (bits 0..n-1 used)."""
    for j in range(n):
        v[i + j] = f32(grid[idx, j]) * SIGNS[signs & u32(255), j]


@njit(inline="always")
def put_delta(v, i, idx, minus):
    """v[i:i + 8] = IQ1 grid row idx + delta (-delta where minus)."""
    delta = -IQ1_DELTA if minus else IQ1_DELTA
    for j in range(8):
        v[i + j] = (f32(IQ1_GRID[idx, j]) - f32(1)) + delta


@njit(inline="always")
def _iq2_xxs_sub(v, row, q):
    """Sub-block bytes row[q:q + 8]: 4 indices, u32 signs | scale."""
    aux = load_u32(row, q + 4)
    for g in range(4):
        put_signed(v, 8 * g, IQ2XXS_GRID, row[q + g], u32(KSIGNS[(aux >> u32(7 * g)) & u32(127)]), 8)
    return (f32(0.5) + f32(aux >> u32(28))) * f32(0.25)


@njit(inline="always")
def _iq2_xs_sub(v, row, q, sc):
    """Sub-block u16s at row[q:q + 8], scale byte sc (low nibble: first 16 values)."""
    for g in range(4):
        qs = u32(row[q + 2 * g]) | (u32(row[q + 2 * g + 1]) << u32(8))
        put_signed(v, 8 * g, IQ2XS_GRID, qs & u32(511), u32(KSIGNS[qs >> u32(9)]), 8)
    return (f32(0.5) + f32(sc & 15)) * f32(0.25), (f32(0.5) + f32(sc >> 4)) * f32(0.25)


@njit(inline="always")
def _iq2_s_sub(v, row, o, ib):
    """Sub-block ib of the IQ2_S super-block at row[o:o + 82]."""
    qh = u32(row[o + 66 + ib])
    for g in range(4):
        idx = u32(row[o + 2 + 4 * ib + g]) | (((qh >> u32(2 * g)) & u32(3)) << u32(8))
        put_signed(v, 8 * g, IQ2S_GRID, idx, u32(row[o + 34 + 4 * ib + g]), 8)
    sc = row[o + 74 + ib]
    return (f32(0.5) + f32(sc & 15)) * f32(0.25), (f32(0.5) + f32(sc >> 4)) * f32(0.25)


@njit(inline="always")
def _iq3_xxs_sub(v, row, o, ib):
    """Sub-block ib of the IQ3_XXS super-block at row[o:o + 98]."""
    aux = load_u32(row, o + 66 + 4 * ib)
    q = o + 2 + 8 * ib
    for g in range(4):
        signs = u32(KSIGNS[(aux >> u32(7 * g)) & u32(127)])
        put_signed(v, 8 * g, IQ3XXS_GRID, row[q + 2 * g], signs, 4)
        put_signed(v, 8 * g + 4, IQ3XXS_GRID, row[q + 2 * g + 1], signs >> u32(4), 4)
    return (f32(0.5) + f32(aux >> u32(28))) * f32(0.5)


@njit(inline="always")
def _iq3_s_sub(v, row, o, ib):
    """Sub-block ib of the IQ3_S super-block at row[o:o + 110]."""
    qh = u32(row[o + 66 + ib])
    for g in range(4):
        signs = u32(row[o + 74 + 4 * ib + g])
        for h in range(2):
            k = 2 * g + h
            idx = u32(row[o + 2 + 8 * ib + k]) | (((qh >> u32(k)) & u32(1)) << u32(8))
            put_signed(v, 4 * k, IQ3S_GRID, idx, signs >> u32(4 * h), 4)
    return f32(1 + 2 * ((row[o + 106 + ib // 2] >> (4 * (ib % 2))) & 15))


@njit(inline="always")
def _iq1_s_sub(v, row, o, ib):
    """Sub-block ib of the IQ1_S super-block at row[o:o + 50]."""
    qh = u32(row[o + 34 + 2 * ib]) | (u32(row[o + 35 + 2 * ib]) << u32(8))
    for g in range(4):
        idx = u32(row[o + 2 + 4 * ib + g]) | (((qh >> u32(3 * g)) & u32(7)) << u32(8))
        put_delta(v, 8 * g, idx, qh & u32(0x8000))
    return f32(2 * ((qh >> u32(12)) & u32(7)) + 1)


@njit(inline="always")
def _iq1_m_d(row, o):
    """IQ1_M's f16 d, kept in the top nibbles of its 4 scale u16s."""
    bits = u32(0)
    for i in range(4):
        bits |= (u32(row[o + 49 + 2 * i]) >> u32(4)) << u32(4 * i)
    return f16_to_f32(np.uint16(bits))


@njit(inline="always")
def _iq1_m_sub(v, row, o, ib):
    """Sub-block ib of the IQ1_M super-block at row[o:o + 56]."""
    for g in range(4):
        h = u32(row[o + 32 + 2 * ib + g // 2]) >> u32(4 * (g % 2))
        idx = u32(row[o + 4 * ib + g]) | ((h & u32(7)) << u32(8))
        put_delta(v, 8 * g, idx, h & u32(8))
    sc = u32(row[o + 48 + 2 * (ib // 2)]) | (u32(row[o + 49 + 2 * (ib // 2)]) << u32(8))
    sc >>= u32(6 * (ib % 2))
    return f32(2 * (sc & u32(7)) + 1), f32(2 * ((sc >> u32(3)) & u32(7)) + 1)


# ---------------------------------------------------------------- rows: decode, float dot
# dequant: out[r, 256 b + 32 ib + i] = d * s * v[i].   dot: out[r] = sum over the row of
# d * s * v[i] * x[.]; lane j of acc takes values j and j + 16 of every sub-block.

# ---------------- IQ2_XXS  66 bytes = d:f16 qs:64; per 32 values: 4 grid indices u8 | u32 4 x 7 signs, scale << 28

@njit(cache=True, error_model="numpy")
def dequant_rows_iq2_xxs(out, w):
    for r in range(w.shape[0]):
        row = w[r]
        for b in range(row.shape[0] // 66):
            d = load_f16(row, b * 66)
            for ib in range(8):
                v = block32()
                ds = d * _iq2_xxs_sub(v, row, b * 66 + 2 + 8 * ib)
                for i in range(32):
                    out[r, b * 256 + ib * 32 + i] = ds * v[i]


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_iq2_xxs(out, w, x, xsum):
    for r in range(w.shape[0]):
        row, acc = w[r], lanes16()
        for b in range(row.shape[0] // 66):
            d = load_f16(row, b * 66)
            for ib in range(8):
                v = block32()
                ds = d * _iq2_xxs_sub(v, row, b * 66 + 2 + 8 * ib)
                ox = b * 256 + ib * 32
                for j in range(16):
                    acc[j] += ds * (v[j] * x[ox + j] + v[j + 16] * x[ox + 16 + j])
        out[r] = sum16(acc)


# ---------------- IQ2_XS  74 bytes = d:f16 qs:64 (u16: index:9 | signs:7 << 9) scales:8 (nibble per 16)

@njit(cache=True, error_model="numpy")
def dequant_rows_iq2_xs(out, w):
    for r in range(w.shape[0]):
        row = w[r]
        for b in range(row.shape[0] // 74):
            d = load_f16(row, b * 74)
            for ib in range(8):
                v = block32()
                s0, s1 = _iq2_xs_sub(v, row, b * 74 + 2 + 8 * ib, row[b * 74 + 66 + ib])
                for i in range(16):
                    out[r, b * 256 + ib * 32 + i] = (d * s0) * v[i]
                    out[r, b * 256 + ib * 32 + 16 + i] = (d * s1) * v[16 + i]


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_iq2_xs(out, w, x, xsum):
    for r in range(w.shape[0]):
        row, acc = w[r], lanes16()
        for b in range(row.shape[0] // 74):
            d = load_f16(row, b * 74)
            for ib in range(8):
                v = block32()
                s0, s1 = _iq2_xs_sub(v, row, b * 74 + 2 + 8 * ib, row[b * 74 + 66 + ib])
                d0, d1, ox = d * s0, d * s1, b * 256 + ib * 32
                for j in range(16):
                    acc[j] += d0 * v[j] * x[ox + j] + d1 * v[j + 16] * x[ox + 16 + j]
        out[r] = sum16(acc)


# ---------------- IQ2_S  82 bytes = d:f16 qs:32 signs:32 qh:8 (2 index bits each) scales:8

@njit(cache=True, error_model="numpy")
def dequant_rows_iq2_s(out, w):
    for r in range(w.shape[0]):
        row = w[r]
        for b in range(row.shape[0] // 82):
            d = load_f16(row, b * 82)
            for ib in range(8):
                v = block32()
                s0, s1 = _iq2_s_sub(v, row, b * 82, ib)
                for i in range(16):
                    out[r, b * 256 + ib * 32 + i] = (d * s0) * v[i]
                    out[r, b * 256 + ib * 32 + 16 + i] = (d * s1) * v[16 + i]


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_iq2_s(out, w, x, xsum):
    for r in range(w.shape[0]):
        row, acc = w[r], lanes16()
        for b in range(row.shape[0] // 82):
            d = load_f16(row, b * 82)
            for ib in range(8):
                v = block32()
                s0, s1 = _iq2_s_sub(v, row, b * 82, ib)
                d0, d1, ox = d * s0, d * s1, b * 256 + ib * 32
                for j in range(16):
                    acc[j] += d0 * v[j] * x[ox + j] + d1 * v[j + 16] * x[ox + 16 + j]
        out[r] = sum16(acc)


# ---------------- IQ3_XXS  98 bytes = d:f16 qs:64 (index per 4 values) scales:32 (u32 per 32)

@njit(cache=True, error_model="numpy")
def dequant_rows_iq3_xxs(out, w):
    for r in range(w.shape[0]):
        row = w[r]
        for b in range(row.shape[0] // 98):
            d = load_f16(row, b * 98)
            for ib in range(8):
                v = block32()
                ds = d * _iq3_xxs_sub(v, row, b * 98, ib)
                for i in range(32):
                    out[r, b * 256 + ib * 32 + i] = ds * v[i]


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_iq3_xxs(out, w, x, xsum):
    for r in range(w.shape[0]):
        row, acc = w[r], lanes16()
        for b in range(row.shape[0] // 98):
            d = load_f16(row, b * 98)
            for ib in range(8):
                v = block32()
                ds = d * _iq3_xxs_sub(v, row, b * 98, ib)
                ox = b * 256 + ib * 32
                for j in range(16):
                    acc[j] += ds * (v[j] * x[ox + j] + v[j + 16] * x[ox + 16 + j])
        out[r] = sum16(acc)


# ---------------- IQ3_S  110 bytes = d:f16 qs:64 qh:8 (9th index bits) signs:32 scales:4

@njit(cache=True, error_model="numpy")
def dequant_rows_iq3_s(out, w):
    for r in range(w.shape[0]):
        row = w[r]
        for b in range(row.shape[0] // 110):
            d = load_f16(row, b * 110)
            for ib in range(8):
                v = block32()
                ds = d * _iq3_s_sub(v, row, b * 110, ib)
                for i in range(32):
                    out[r, b * 256 + ib * 32 + i] = ds * v[i]


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_iq3_s(out, w, x, xsum):
    for r in range(w.shape[0]):
        row, acc = w[r], lanes16()
        for b in range(row.shape[0] // 110):
            d = load_f16(row, b * 110)
            for ib in range(8):
                v = block32()
                ds = d * _iq3_s_sub(v, row, b * 110, ib)
                ox = b * 256 + ib * 32
                for j in range(16):
                    acc[j] += ds * (v[j] * x[ox + j] + v[j + 16] * x[ox + 16 + j])
        out[r] = sum16(acc)


# ---------------- IQ1_S  50 bytes = d:f16 qs:32 qh:16 (u16 per 32: 4 x 3 index bits, sc:3, delta sign)

@njit(cache=True, error_model="numpy")
def dequant_rows_iq1_s(out, w):
    for r in range(w.shape[0]):
        row = w[r]
        for b in range(row.shape[0] // 50):
            d = load_f16(row, b * 50)
            for ib in range(8):
                v = block32()
                ds = d * _iq1_s_sub(v, row, b * 50, ib)
                for i in range(32):
                    out[r, b * 256 + ib * 32 + i] = ds * v[i]


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_iq1_s(out, w, x, xsum):
    for r in range(w.shape[0]):
        row, acc = w[r], lanes16()
        for b in range(row.shape[0] // 50):
            d = load_f16(row, b * 50)
            for ib in range(8):
                v = block32()
                ds = d * _iq1_s_sub(v, row, b * 50, ib)
                ox = b * 256 + ib * 32
                for j in range(16):
                    acc[j] += ds * (v[j] * x[ox + j] + v[j + 16] * x[ox + 16 + j])
        out[r] = sum16(acc)


# ---------------- IQ1_M  56 bytes = qs:32 qh:16 (nibble per index: 3 bits | delta sign) scales:8 (+ d)

@njit(cache=True, error_model="numpy")
def dequant_rows_iq1_m(out, w):
    for r in range(w.shape[0]):
        row = w[r]
        for b in range(row.shape[0] // 56):
            d = _iq1_m_d(row, b * 56)
            for ib in range(8):
                v = block32()
                s0, s1 = _iq1_m_sub(v, row, b * 56, ib)
                for i in range(16):
                    out[r, b * 256 + ib * 32 + i] = (d * s0) * v[i]
                    out[r, b * 256 + ib * 32 + 16 + i] = (d * s1) * v[16 + i]


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_iq1_m(out, w, x, xsum):
    for r in range(w.shape[0]):
        row, acc = w[r], lanes16()
        for b in range(row.shape[0] // 56):
            d = _iq1_m_d(row, b * 56)
            for ib in range(8):
                v = block32()
                s0, s1 = _iq1_m_sub(v, row, b * 56, ib)
                d0, d1, ox = d * s0, d * s1, b * 256 + ib * 32
                for j in range(16):
                    acc[j] += d0 * v[j] * x[ox + j] + d1 * v[j + 16] * x[ox + 16 + j]
        out[r] = sum16(acc)


# ---------------------------------------------------------------- dispatch (quants.py calls these)

@njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
def dequant_rows_iq(qtype, out, w):
    if qtype == IQ2_XXS:
        dequant_rows_iq2_xxs(out, w)
    elif qtype == IQ2_XS:
        dequant_rows_iq2_xs(out, w)
    elif qtype == IQ2_S:
        dequant_rows_iq2_s(out, w)
    elif qtype == IQ3_XXS:
        dequant_rows_iq3_xxs(out, w)
    elif qtype == IQ3_S:
        dequant_rows_iq3_s(out, w)
    elif qtype == IQ1_S:
        dequant_rows_iq1_s(out, w)
    elif qtype == IQ1_M:
        dequant_rows_iq1_m(out, w)


@njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
def dot_rows_iq(qtype, out, w, x, xsum):
    if qtype == IQ2_XXS:
        dot_rows_iq2_xxs(out, w, x, xsum)
    elif qtype == IQ2_XS:
        dot_rows_iq2_xs(out, w, x, xsum)
    elif qtype == IQ2_S:
        dot_rows_iq2_s(out, w, x, xsum)
    elif qtype == IQ3_XXS:
        dot_rows_iq3_xxs(out, w, x, xsum)
    elif qtype == IQ3_S:
        dot_rows_iq3_s(out, w, x, xsum)
    elif qtype == IQ1_S:
        dot_rows_iq1_s(out, w, x, xsum)
    elif qtype == IQ1_M:
        dot_rows_iq1_m(out, w, x, xsum)
