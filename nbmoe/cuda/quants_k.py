"""K-quants on the GPU: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K decoders (float values and integer codes).

Letters and the unit as in quants.py. A super-block holds 256 values in 8 sub-blocks j of 32
values; the kernels count 32-value blocks b, so a decoder reads sub-block j = b & 7 of
super-block b >> 3. Block layouts (little-endian, as nbmoe/cpu/quants_k.py and gguf-py):

  Q2_K  256 values in  84 bytes = scales:16 qs:64 d:f16 dmin:f16
        scales byte g = sc | m << 4 (16-value group g)       v = d * sc * q - dmin * m, q 0..3
  Q3_K  256 values in 110 bytes = hmask:32 qs:64 scales:12 d:f16
        group g's 6-bit scale: low 4 bits = nibble g // 8 of byte g % 8, top 2 bits = bits
        2 (g // 4) of byte 8 + g % 4                   v = d * (sc - 32) * (q - 4), q 0..7
        (q = 2 bits of qs | the hmask bit << 2)
  Q4_K  256 values in 144 bytes = d:f16 dmin:f16 scales:12 qs:128
        sub-block j's 6-bit sc, m: j < 4 the low 6 bits of bytes j, j + 4; j >= 4 the low /
        high nibble of byte j + 4 and the top 2 bits of bytes j - 4, j       v = d * sc * q - dmin * m
  Q5_K  256 values in 176 bytes = d:f16 dmin:f16 scales:12 (as Q4_K) qh:32 qs:128
                                                       q 0..31: qs nibble | qh bit << 4
  Q6_K  256 values in 210 bytes = ql:128 qh:64 scales:16 int8 d:f16
                                                       v = d * sc * (q - 32), q 0..63
Where the codes of value l (< 32) of sub-block j lie, h = j // 4:
  2-bit codes (Q2_K, Q3_K)  bits 2 (j % 4) of qs[32 h + l]
  hmask (Q3_K), qh (Q5_K)   bit j of byte l
  nibbles (Q4_K, Q5_K)      nibble j % 2 (0 low, 1 high) of qs[32 (j // 2) + l]
  Q6_K                      low 4 bits: nibble (j % 4) // 2 of ql[64 h + 32 (j % 2) + l],
                            top 2 bits: bits 2 (j % 4) of qh[32 h + l]
Every field of 8 consecutive values lies in 8 consecutive bytes, the same bits of each: so the
units are "linear" (values 8u..8u + 7 of the sub-block) and a unit's codes are two 32-bit
words shifted and masked (4 codes a word, one a byte, as x's int8 words). Q2_K, Q3_K and Q6_K
scale groups of 16 values: units 2t and 2t + 1 of a sub-block have group 2j + t.

Each type has one `<type>_unit(w, base, b, u)` -> (c0, c1, d, m): the codes and the affine
terms of the unit, value = d * (code - offset) - m; dec_* turns it into floats (affine8),
idec_* into the int8 path's codes (quants.py). Q3_K and Q6_K codes go signed (offset taken off
in each byte: (c + 128 - offset) ^ 0x80); Q2_K has no idec: its min changes every 16 values,
and the int8 path's offset term is per 32-value block.
"""
import numpy as np
from gguf import GGMLQuantizationType

from . import device_fn, ld_f16, ld_u8, ld_u32, ld_u32_a2, ld_u32x2
from .quants import F23, F23_32, F23_128, LOW_NIBBLES, SIGN_BYTES, ZERO, QType, affine8, byte_f32, register

Q2_K = int(GGMLQuantizationType.Q2_K)
Q3_K = int(GGMLQuantizationType.Q3_K)
Q4_K = int(GGMLQuantizationType.Q4_K)
Q5_K = int(GGMLQuantizationType.Q5_K)
Q6_K = int(GGMLQuantizationType.Q6_K)

f32 = np.float32
u32 = np.uint32
i32 = np.int32

LOW_BITS = u32(0x01010101)
LOW_CRUMBS = u32(0x03030303)     # the low 2 bits of each byte
F23_4 = f32(8388612.0)           # 2^23 + 4   (Q3_K offset)
Q3_SIGNED = u32(0x7C7C7C7C)      # + 124 a byte, then ^ 0x80: q - 4 as int8
Q6_SIGNED = u32(0x60606060)      # + 96 a byte, then ^ 0x80: q - 32 as int8


# ---------------------------------------------------------------- fields, scales

@device_fn
def field8(w, base, o, sh, mask):
    """The same bit field of 8 consecutive bytes at o (4-aligned) as two words (bytes 0..3,
    4..7): (word >> sh) & mask."""
    return (ld_u32(w, base, o) >> sh) & mask, (ld_u32(w, base, o + 4) >> sh) & mask


@device_fn
def field8_a8(w, base, o, sh, mask):
    """field8 at an 8-aligned o (blocks of 144 and 176 bytes): one 64-bit load."""
    lo, hi = ld_u32x2(w, base, o)
    return (lo >> sh) & mask, (hi >> sh) & mask


@device_fn
def field8_a2(w, base, o, sh, mask):
    """field8 at a 2-aligned o (blocks of 110 and 210 bytes)."""
    return (ld_u32_a2(w, base, o) >> sh) & mask, (ld_u32_a2(w, base, o + 4) >> sh) & mask


@device_fn
def k_scale_min(w, base, o, j):
    """Q4_K / Q5_K sub-block j's 6-bit scale and min as float32, from the 12 bytes at o.
    All three bytes are loaded whatever j: the lanes of a warp hold sub-blocks 0..7, and the
    branch then holds a few integer ops and no loads."""
    a = ld_u8(w, base, o + (j & 3))
    c = ld_u8(w, base, o + 4 + (j & 3))
    e = ld_u8(w, base, o + 8 + (j & 3))
    if j < 4:
        return byte_f32(a & u32(63), 0, F23), byte_f32(c & u32(63), 0, F23)
    return (byte_f32((e & u32(15)) | ((a >> u32(6)) << u32(4)), 0, F23),
            byte_f32((e >> u32(4)) | ((c >> u32(6)) << u32(4)), 0, F23))


# ---------------------------------------------------------------- units
# (c0, c1, d, m) of unit u of 32-value block b: see the top of the file.

@device_fn
def q2_k_unit(w, base, b, u):
    o = 84 * (b >> 3)
    j = b & 7
    s = ld_u8(w, base, o + 2 * j + (u >> 1))          # group 2j + u // 2: sc | m << 4
    c0, c1 = field8(w, base, o + 16 + 32 * (j >> 2) + 8 * u, u32(2 * (j & 3)), LOW_CRUMBS)
    return (c0, c1, ld_f16(w, base, o + 80) * byte_f32(s & u32(15), 0, F23),
            ld_f16(w, base, o + 82) * byte_f32(s >> u32(4), 0, F23))


@device_fn
def q3_k_unit(w, base, b, u):
    o = 110 * (b >> 3)
    j = b & 7
    g = 2 * j + (u >> 1)
    lo = (ld_u8(w, base, o + 96 + (g & 7)) >> u32(4 * (g >> 3))) & u32(15)
    hi = (ld_u8(w, base, o + 104 + (g & 3)) >> u32(2 * (g >> 2))) & u32(3)
    q0, q1 = field8_a2(w, base, o + 32 + 32 * (j >> 2) + 8 * u, u32(2 * (j & 3)), LOW_CRUMBS)
    h0, h1 = field8_a2(w, base, o + 8 * u, u32(j), LOW_BITS)
    return (q0 | (h0 << u32(2)), q1 | (h1 << u32(2)),
            ld_f16(w, base, o + 108) * byte_f32(lo | (hi << u32(4)), 0, F23_32), ZERO)


@device_fn
def q4_k_unit(w, base, b, u):
    o = 144 * (b >> 3)
    j = b & 7
    sc, m = k_scale_min(w, base, o + 4, j)
    c0, c1 = field8_a8(w, base, o + 16 + 32 * (j >> 1) + 8 * u, u32(4 * (j & 1)), LOW_NIBBLES)
    return c0, c1, ld_f16(w, base, o) * sc, ld_f16(w, base, o + 2) * m


@device_fn
def q5_k_unit(w, base, b, u):
    o = 176 * (b >> 3)
    j = b & 7
    sc, m = k_scale_min(w, base, o + 4, j)
    q0, q1 = field8_a8(w, base, o + 48 + 32 * (j >> 1) + 8 * u, u32(4 * (j & 1)), LOW_NIBBLES)
    h0, h1 = field8_a8(w, base, o + 16 + 8 * u, u32(j), LOW_BITS)
    return q0 | (h0 << u32(4)), q1 | (h1 << u32(4)), ld_f16(w, base, o) * sc, ld_f16(w, base, o + 2) * m


@device_fn
def q6_k_unit(w, base, b, u):
    o = 210 * (b >> 3)
    j = b & 7
    sc = ld_u8(w, base, o + 192 + 2 * j + (u >> 1)) ^ u32(0x80)      # int8 scale + 128
    ql = o + 64 * (j >> 2) + 32 * (j & 1) + 8 * u
    q0, q1 = field8_a2(w, base, ql, u32(4 * ((j >> 1) & 1)), LOW_NIBBLES)
    h0, h1 = field8_a2(w, base, o + 128 + 32 * (j >> 2) + 8 * u, u32(2 * (j & 3)), LOW_CRUMBS)
    return q0 | (h0 << u32(4)), q1 | (h1 << u32(4)), ld_f16(w, base, o + 208) * byte_f32(sc, 0, F23_128), ZERO


# ---------------------------------------------------------------- float decoders

@device_fn
def dec_q2_k(w, base, b, u, K):
    c0, c1, d, m = q2_k_unit(w, base, b, u)
    return affine8(c0, c1, d, m, F23)


@device_fn
def dec_q3_k(w, base, b, u, K):
    c0, c1, d, m = q3_k_unit(w, base, b, u)
    return affine8(c0, c1, d, m, F23_4)


@device_fn
def dec_q4_k(w, base, b, u, K):
    c0, c1, d, m = q4_k_unit(w, base, b, u)
    return affine8(c0, c1, d, m, F23)


@device_fn
def dec_q5_k(w, base, b, u, K):
    c0, c1, d, m = q5_k_unit(w, base, b, u)
    return affine8(c0, c1, d, m, F23)


@device_fn
def dec_q6_k(w, base, b, u, K):
    c0, c1, d, m = q6_k_unit(w, base, b, u)
    return affine8(c0, c1, d, m, F23_32)


# ---------------------------------------------------------------- integer codes (quants.py)

@device_fn
def idec_q3_k(w, base, b, u):
    c0, c1, d, m = q3_k_unit(w, base, b, u)
    return i32((c0 + Q3_SIGNED) ^ SIGN_BYTES), i32((c1 + Q3_SIGNED) ^ SIGN_BYTES), d, ZERO


@device_fn
def idec_q4_k(w, base, b, u):
    c0, c1, d, m = q4_k_unit(w, base, b, u)
    return i32(c0), i32(c1), d, m * f32(-0.25)


@device_fn
def idec_q5_k(w, base, b, u):
    c0, c1, d, m = q5_k_unit(w, base, b, u)
    return i32(c0), i32(c1), d, m * f32(-0.25)


@device_fn
def idec_q6_k(w, base, b, u):
    c0, c1, d, m = q6_k_unit(w, base, b, u)
    return i32((c0 + Q6_SIGNED) ^ SIGN_BYTES), i32((c1 + Q6_SIGNED) ^ SIGN_BYTES), d, ZERO


register({
    Q2_K: QType("Q2_K", 256, 84, dec_q2_k, False, None),
    Q3_K: QType("Q3_K", 256, 110, dec_q3_k, False, idec_q3_k),
    Q4_K: QType("Q4_K", 256, 144, dec_q4_k, False, idec_q4_k),
    Q5_K: QType("Q5_K", 256, 176, dec_q5_k, False, idec_q5_k),
    Q6_K: QType("Q6_K", 256, 210, dec_q6_k, False, idec_q6_k),
})
