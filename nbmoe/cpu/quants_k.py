"""K-quants on CPU: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K decode and float dots (integer dots: quants_k_i8.py).

Letters as in quants.py: R rows, K values in a row, x the float32 activation row [K], xsum
[K / 32] its 32-block sums; SB = K / 256 super-blocks per row. A super-block holds 256
values in 8 sub-blocks of 32 (Q4_K, Q5_K: a scale and a min each) or 16 groups of 16
(Q2_K, Q3_K, Q6_K: a scale each). Block layouts (little-endian, from gguf-py's quants.py):

  Q2_K  256 values in  84 bytes = scales:16 qs:64 d:f16 dmin:f16
        scales byte g = sc | m << 4 (group g)            v = d * sc * q - dmin * m, q 0..3
  Q3_K  256 values in 110 bytes = hmask:32 qs:64 scales:12 d:f16
        16 6-bit scales: low 4 bits in bytes 0..7 (g < 8 low nibble, else high nibble of
        byte g - 8), top 2 bits at bit 2 (g // 4) of byte 8 + g % 4   v = d * (sc - 32) * q,
        q = (2 low bits) - 4 (0 if the hmask bit is set), -4..3
  Q4_K  256 values in 144 bytes = d:f16 dmin:f16 scales:12 qs:128
        8 x (6-bit sc, 6-bit m): j < 4: sc = s[j] & 63, m = s[j + 4] & 63; j >= 4: low 4 bits
        in s[j + 4] (sc low nibble, m high), top 2 bits in the top bits of s[j - 4] (sc), s[j] (m)
                                                          v = d * sc * q - dmin * m, q 0..15
  Q5_K  256 values in 176 bytes = d:f16 dmin:f16 scales:12 (as Q4_K) qh:32 qs:128
                                                          q 0..31, 5th bit from qh
  Q6_K  256 values in 210 bytes = ql:128 qh:64 scales:16 int8 d:f16
                                                          v = d * sc * (q - 32), q 0..63
Bit positions of value i (i < 256; h = i // 128, l = i % 32):
  2-bit codes (Q2_K, Q3_K qs)   bits 2 * ((i % 128) // 32) of qs[32 h + l]
  hmask (Q3_K), qh (Q5_K)       bit i // 32 of byte l
  nibbles (Q4_K, Q5_K qs)       byte 32 (i // 64) + l: low nibble if i % 64 < 32, else high
  Q6_K                          low 4 bits: nibble (i % 128) // 64 of ql[64 h + i % 64];
                                top 2 bits: bits 2 * ((i % 128) // 32) of qh[32 h + l]

Per type (as in quants.py):
  dequant_rows_<type>(out, w)           plain loops, exact vs gguf-py
  dot_rows_<type>(out, w, x, xsum)      float dots, 16 lane accumulators; 128 values at a
                                        time where 4 runs of 32 share their bytes, so that
                                        every shift is a constant
"""
import numpy as np
from gguf import GGMLQuantizationType
from numba import njit

from .quants import FM, block32, f32, lanes16, load_f16, sum16, u8
from .specialize import ConstantArgs

Q2_K = int(GGMLQuantizationType.Q2_K)
Q3_K = int(GGMLQuantizationType.Q3_K)
Q4_K = int(GGMLQuantizationType.Q4_K)
Q5_K = int(GGMLQuantizationType.Q5_K)
Q6_K = int(GGMLQuantizationType.Q6_K)


# ---------------------------------------------------------------- scale decoding (njit)

@njit(inline="always")
def k_scale_min(row, o, j):
    """Q4_K / Q5_K sub-block j's 6-bit (scale, min) as float32, from the 12 bytes at row[o:]."""
    if j < 4:
        return f32(row[o + j] & u8(63)), f32(row[o + j + 4] & u8(63))
    sc = (row[o + j + 4] & u8(15)) | ((row[o + j - 4] >> u8(6)) << u8(4))
    m = (row[o + j + 4] >> u8(4)) | ((row[o + j] >> u8(6)) << u8(4))
    return f32(sc), f32(m)


@njit(inline="always")
def q3_scale(row, o, g):
    """Q3_K group g's signed 6-bit scale as float32, from the 12 bytes at row[o:]."""
    lo = (row[o + g % 8] >> u8(4 * (g // 8))) & u8(15)
    hi = (row[o + 8 + g % 4] >> u8(2 * (g // 4))) & u8(3)
    return f32(np.int32(lo | (hi << u8(4))) - 32)


# ---------------------------------------------------------------- dequantize (plain loops)
# One 32-value piece at a time into a stack block (loads before stores, as in quants.py).

@njit(cache=True, error_model="numpy")
def dequant_rows_q2_k(out, w):
    for r in range(w.shape[0]):
        row = w[r]
        for b in range(row.shape[0] // 84):
            o = b * 84
            d, dmin = load_f16(row, o + 80), load_f16(row, o + 82)
            for p in range(8):                        # 32 values = groups 2p, 2p + 1
                h, s = p // 4, p % 4
                v = block32()
                for t in range(2):
                    sc = row[o + 2 * p + t]
                    dl, ml = d * f32(sc & u8(15)), dmin * f32(sc >> u8(4))
                    for j in range(16):
                        q = (row[o + 16 + 32 * h + 16 * t + j] >> u8(2 * s)) & u8(3)
                        v[16 * t + j] = dl * f32(q) - ml
                for i in range(32):
                    out[r, b * 256 + 32 * p + i] = v[i]


@njit(cache=True, error_model="numpy")
def dequant_rows_q3_k(out, w):
    for r in range(w.shape[0]):
        row = w[r]
        for b in range(row.shape[0] // 110):
            o = b * 110
            d = load_f16(row, o + 108)
            for p in range(8):
                h, s = p // 4, p % 4
                v = block32()
                for t in range(2):
                    dl = d * q3_scale(row, o + 96, 2 * p + t)
                    for j in range(16):
                        l = 16 * t + j
                        q = np.int32((row[o + 32 + 32 * h + l] >> u8(2 * s)) & u8(3))
                        hbit = (row[o + l] >> u8(p)) & u8(1)
                        v[l] = dl * f32(q - (0 if hbit else 4))
                for i in range(32):
                    out[r, b * 256 + 32 * p + i] = v[i]


@njit(cache=True, error_model="numpy")
def dequant_rows_q4_k(out, w):
    for r in range(w.shape[0]):
        row = w[r]
        for b in range(row.shape[0] // 144):
            o = b * 144
            d, dmin = load_f16(row, o), load_f16(row, o + 2)
            for p in range(8):                        # sub-block p: nibble p % 2 of bytes 32 (p // 2)..
                sc, m = k_scale_min(row, o + 4, p)
                dl, ml = d * sc, dmin * m
                v = block32()
                for l in range(32):
                    q = (row[o + 16 + 32 * (p // 2) + l] >> u8(4 * (p % 2))) & u8(15)
                    v[l] = dl * f32(q) - ml
                for i in range(32):
                    out[r, b * 256 + 32 * p + i] = v[i]


@njit(cache=True, error_model="numpy")
def dequant_rows_q5_k(out, w):
    for r in range(w.shape[0]):
        row = w[r]
        for b in range(row.shape[0] // 176):
            o = b * 176
            d, dmin = load_f16(row, o), load_f16(row, o + 2)
            for p in range(8):
                sc, m = k_scale_min(row, o + 4, p)
                dl, ml = d * sc, dmin * m
                v = block32()
                for l in range(32):
                    q = (row[o + 48 + 32 * (p // 2) + l] >> u8(4 * (p % 2))) & u8(15)
                    q |= ((row[o + 16 + l] >> u8(p)) & u8(1)) << u8(4)
                    v[l] = dl * f32(q) - ml
                for i in range(32):
                    out[r, b * 256 + 32 * p + i] = v[i]


@njit(cache=True, error_model="numpy")
def dequant_rows_q6_k(out, w):
    for r in range(w.shape[0]):
        row = w[r]
        for b in range(row.shape[0] // 210):
            o = b * 210
            d = load_f16(row, o + 208)
            for p in range(8):                        # values 32p..: half h, nibble k, bits 2 (p % 4)
                h, k = p // 4, (p % 4) // 2
                v = block32()
                for t in range(2):
                    dl = d * f32(np.int8(row[o + 192 + 2 * p + t]))
                    for j in range(16):
                        l = 16 * t + j
                        lo = (row[o + 64 * h + 32 * (p % 2) + l] >> u8(4 * k)) & u8(15)
                        hi = (row[o + 128 + 32 * h + l] >> u8(2 * (p % 4))) & u8(3)
                        v[l] = dl * f32(np.int32(lo | (hi << u8(4))) - 32)
                for i in range(32):
                    out[r, b * 256 + 32 * p + i] = v[i]


# ---------------------------------------------------------------- float dots
# 16 lane accumulators (quants.py): lane j takes values j and j + 16 of each 32 values.

@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q2_k(out, w, x, xsum):
    for r in range(w.shape[0]):
        row, acc = w[r], lanes16()
        for b in range(row.shape[0] // 84):
            o = b * 84
            d, dmin = load_f16(row, o + 80), load_f16(row, o + 82)
            for h in range(2):                        # 128 values: 4 runs of 32 share the qs bytes
                for t in range(2):                    # the first or second 16 of each run
                    g, q, xo = o + 8 * h + t, o + 16 + 32 * h + 16 * t, b * 256 + 128 * h + 16 * t
                    d0, m0 = d * f32(row[g] & u8(15)), dmin * f32(row[g] >> u8(4))
                    d1, m1 = d * f32(row[g + 2] & u8(15)), dmin * f32(row[g + 2] >> u8(4))
                    d2, m2 = d * f32(row[g + 4] & u8(15)), dmin * f32(row[g + 4] >> u8(4))
                    d3, m3 = d * f32(row[g + 6] & u8(15)), dmin * f32(row[g + 6] >> u8(4))
                    for j in range(16):
                        c = row[q + j]
                        acc[j] += ((d0 * f32(c & u8(3)) - m0) * x[xo + j]
                                   + (d1 * f32((c >> u8(2)) & u8(3)) - m1) * x[xo + 32 + j]
                                   + (d2 * f32((c >> u8(4)) & u8(3)) - m2) * x[xo + 64 + j]
                                   + (d3 * f32(c >> u8(6)) - m3) * x[xo + 96 + j])
        out[r] = sum16(acc)


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q3_k(out, w, x, xsum):
    for r in range(w.shape[0]):
        row, acc = w[r], lanes16()
        for b in range(row.shape[0] // 110):
            o = b * 110
            d = load_f16(row, o + 108)
            for h in range(2):                        # as Q2_K; the hmask bits of run s are 4h + s
                for t in range(2):
                    g, q, xo = 8 * h + t, o + 32 + 32 * h + 16 * t, b * 256 + 128 * h + 16 * t
                    d0, d1 = d * q3_scale(row, o + 96, g), d * q3_scale(row, o + 96, g + 2)
                    d2, d3 = d * q3_scale(row, o + 96, g + 4), d * q3_scale(row, o + 96, g + 6)
                    for j in range(16):
                        c, m = row[q + j], row[o + 16 * t + j] >> u8(4 * h)
                        q0 = f32((c & u8(3)) | ((m & u8(1)) << u8(2))) - f32(4)
                        q1 = f32(((c >> u8(2)) & u8(3)) | ((m & u8(2)) << u8(1))) - f32(4)
                        q2 = f32(((c >> u8(4)) & u8(3)) | (m & u8(4))) - f32(4)
                        q3 = f32((c >> u8(6)) | ((m & u8(8)) >> u8(1))) - f32(4)
                        acc[j] += (d0 * q0 * x[xo + j] + d1 * q1 * x[xo + 32 + j]
                                   + d2 * q2 * x[xo + 64 + j] + d3 * q3 * x[xo + 96 + j])
        out[r] = sum16(acc)


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q4_k(out, w, x, xsum):
    for r in range(w.shape[0]):
        row, acc, off = w[r], lanes16(), f32(0)
        for b in range(row.shape[0] // 144):
            o = b * 144
            d, dmin = load_f16(row, o), load_f16(row, o + 2)
            for c in range(4):                        # 64 values: sub-blocks 2c (low), 2c + 1 (high)
                s0, m0 = k_scale_min(row, o + 4, 2 * c)
                s1, m1 = k_scale_min(row, o + 4, 2 * c + 1)
                d0, d1, q, xo = d * s0, d * s1, o + 16 + 32 * c, b * 256 + 64 * c
                for j in range(16):
                    a, e = row[q + j], row[q + 16 + j]
                    acc[j] += (d0 * (f32(a & u8(15)) * x[xo + j] + f32(e & u8(15)) * x[xo + 16 + j])
                               + d1 * (f32(a >> u8(4)) * x[xo + 32 + j] + f32(e >> u8(4)) * x[xo + 48 + j]))
                off += dmin * (m0 * xsum[8 * b + 2 * c] + m1 * xsum[8 * b + 2 * c + 1])
        out[r] = sum16(acc) - off


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q5_k(out, w, x, xsum):
    for r in range(w.shape[0]):
        row, acc, off = w[r], lanes16(), f32(0)
        for b in range(row.shape[0] // 176):
            o = b * 176
            d, dmin = load_f16(row, o), load_f16(row, o + 2)
            for c in range(4):
                s0, m0 = k_scale_min(row, o + 4, 2 * c)
                s1, m1 = k_scale_min(row, o + 4, 2 * c + 1)
                d0, d1, q, xo = d * s0, d * s1, o + 48 + 32 * c, b * 256 + 64 * c
                b0, b1 = u8(1 << (2 * c)), u8(2 << (2 * c))
                for j in range(16):
                    a, e, ha, he = row[q + j], row[q + 16 + j], row[o + 16 + j], row[o + 32 + j]
                    a0 = f32(a & u8(15)) + (f32(16) if ha & b0 else f32(0))
                    e0 = f32(e & u8(15)) + (f32(16) if he & b0 else f32(0))
                    a1 = f32(a >> u8(4)) + (f32(16) if ha & b1 else f32(0))
                    e1 = f32(e >> u8(4)) + (f32(16) if he & b1 else f32(0))
                    acc[j] += (d0 * (a0 * x[xo + j] + e0 * x[xo + 16 + j])
                               + d1 * (a1 * x[xo + 32 + j] + e1 * x[xo + 48 + j]))
                off += dmin * (m0 * xsum[8 * b + 2 * c] + m1 * xsum[8 * b + 2 * c + 1])
        out[r] = sum16(acc) - off


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q6_k(out, w, x, xsum):
    for r in range(w.shape[0]):
        row, acc = w[r], lanes16()
        for b in range(row.shape[0] // 210):
            o = b * 210
            d = load_f16(row, o + 208)
            for h in range(2):                        # 128 values: runs s = 0..3 of 32 share ql / qh bytes
                for t in range(2):
                    ql, qh, sc = o + 64 * h + 16 * t, o + 128 + 32 * h + 16 * t, o + 192 + 8 * h + t
                    xo = b * 256 + 128 * h + 16 * t
                    d0, d1 = d * f32(np.int8(row[sc])), d * f32(np.int8(row[sc + 2]))
                    d2, d3 = d * f32(np.int8(row[sc + 4])), d * f32(np.int8(row[sc + 6]))
                    for j in range(16):
                        a, c, e = row[ql + j], row[ql + 32 + j], row[qh + j]
                        q0 = f32((a & u8(15)) | ((e & u8(3)) << u8(4))) - f32(32)
                        q1 = f32((c & u8(15)) | ((e & u8(12)) << u8(2))) - f32(32)
                        q2 = f32((a >> u8(4)) | (e & u8(48))) - f32(32)
                        q3 = f32((c >> u8(4)) | ((e >> u8(6)) << u8(4))) - f32(32)
                        acc[j] += (d0 * q0 * x[xo + j] + d1 * q1 * x[xo + 32 + j]
                                   + d2 * q2 * x[xo + 64 + j] + d3 * q3 * x[xo + 96 + j])
        out[r] = sum16(acc)


# ---------------------------------------------------------------- dispatch (from quants.py, quants_int8.py)

@njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
def dequant_rows_k(qtype, out, w):
    if qtype == Q4_K:
        dequant_rows_q4_k(out, w)
    elif qtype == Q6_K:
        dequant_rows_q6_k(out, w)
    elif qtype == Q5_K:
        dequant_rows_q5_k(out, w)
    elif qtype == Q3_K:
        dequant_rows_q3_k(out, w)
    elif qtype == Q2_K:
        dequant_rows_q2_k(out, w)


@njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
def dot_rows_k(qtype, out, w, x, xsum):
    if qtype == Q4_K:
        dot_rows_q4_k(out, w, x, xsum)
    elif qtype == Q6_K:
        dot_rows_q6_k(out, w, x, xsum)
    elif qtype == Q5_K:
        dot_rows_q5_k(out, w, x, xsum)
    elif qtype == Q3_K:
        dot_rows_q3_k(out, w, x, xsum)
    elif qtype == Q2_K:
        dot_rows_q2_k(out, w, x, xsum)
