"""GGUF block layouts on the GPU: device functions that decode 8 values of a weight row.

Letters: R rows, K values in a row, B = K / 32 blocks in a row, u the unit (0..3) in a block.
Block layouts (little-endian, as nbmoe/cpu/quants.py):

  F32   1 value in 4 bytes, F16 / BF16  1 value in 2 bytes
  Q8_0  32 values in 34 bytes = d:f16 qs:32 int8                          v = d * q
  Q4_0  32 values in 18 bytes = d:f16 qs:16                               v = d * (q - 8)
  Q4_1  32 values in 20 bytes = d:f16 m:f16 qs:16                         v = d * q + m
  Q5_0  32 values in 22 bytes = d:f16 qh:4 qs:16                          v = d * (q - 16)
  Q5_1  32 values in 24 bytes = d:f16 m:f16 qh:4 qs:16                    v = d * q + m
    qs:16 holds 4 bits per value: byte j low nibble = value j, high nibble = value j + 16.
    qh:4 is one uint32: bit j = 5th bit (16s) of value j.
  K-quants Q2_K..Q6_K: quants_k.py; the 4-bit table types IQ4_NL, IQ4_XS, MXFP4: quants_iq4.py.

The unit of work is 8 values of one 32-value block (4 units a block): a thread decodes a unit
into registers and dots it with x. Nibble types ("split" layout) give unit u the values at
columns 32b + 4u + (0..3) and 32b + 16 + 4u + (0..3): one 32-bit word of qs. Q8_0 and the
float types ("linear") give columns 32b + 8u + (0..7). `unit_cols` returns the two starts.

Types of 256-value super-blocks (K-quants, IQ4_XS: quants_k.py, quants_iq4.py) keep this unit:
b still counts 32-value blocks of the row (x is quantized per 32 values, the tiled kernel steps
32 columns), so their decoders find super-block b >> 3 and its sub-block b & 7 themselves, and
u is a unit of that sub-block.

Every decoder is  dec(w, base, b, u, K) -> 8 float32: w the raw uint8 weights as given (any
shape, C-contiguous), base the byte offset of the row, K its values. Fields are read with the
ld_* loaders of nbmoe/cuda/__init__.py at byte offsets (scales f16 -> float32 in hardware);
quantized bytes 4 at a time (two 16-bit loads where the block size leaves them 2-aligned).
Float types read columns < K only (zeros past K): K need not be a multiple of 8 for them.

Bytes to floats: OR a byte into the mantissa of 2^23 (0x4B000000) and subtract 2^23 (+ the
block's offset 8, 16 or 128): two integer ops and one add, no int->float convert (I2F runs at
a quarter of the FMA rate and would bound the matrix-vector kernels).

Adding a type = a decoder (+ an integer-code decoder, see idec_*) + a TYPES entry (register).
"""
from collections import namedtuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import as_f32, device_fn, ld_f16, ld_f32, ld_u16, ld_u32, ld_u32_a2

F32 = int(GGMLQuantizationType.F32)
F16 = int(GGMLQuantizationType.F16)
BF16 = int(GGMLQuantizationType.BF16)
Q8_0 = int(GGMLQuantizationType.Q8_0)
Q4_0 = int(GGMLQuantizationType.Q4_0)
Q4_1 = int(GGMLQuantizationType.Q4_1)
Q5_0 = int(GGMLQuantizationType.Q5_0)
Q5_1 = int(GGMLQuantizationType.Q5_1)

f32 = np.float32
u32 = np.uint32
i32 = np.int32

MAGIC = u32(0x4B000000)          # float32 2^23: a byte ORed into its mantissa adds its value
LOW_NIBBLES = u32(0x0F0F0F0F)
SIGN_BYTES = u32(0x80808080)     # int8 -> uint8 + 128
F23 = f32(8388608.0)             # 2^23
F23_8 = f32(8388616.0)           # 2^23 + 8   (Q4_0 offset)
F23_16 = f32(8388624.0)          # 2^23 + 16  (Q5_0 offset)
F23_32 = f32(8388640.0)          # 2^23 + 32  (Q6_K offset, Q3_K and IQ4_XS scale offsets)
F23_128 = f32(8388736.0)         # 2^23 + 128 (Q8_0 sign)
ZERO = f32(0.0)


@device_fn
def byte_f32(word, k, bias):
    """Byte k (0..3) of a 32-bit word as float32, minus bias - 2^23."""
    return as_f32(MAGIC | ((word >> (8 * k)) & u32(0xFF))) - bias


@device_fn
def spread4(h):
    """Bits 0..3 of h to bit 4 of bytes 0..3 (a Q5 unit's high bits, as 16s of its 4 bytes)."""
    return ((((h & u32(15)) * u32(0x00204081)) & u32(0x01010101)) << u32(4))


@device_fn
def affine8(c0, c1, d, m, bias):
    """8 values d * (code - offset) - m from the bytes of c0 (values 0..3) and c1 (4..7), where
    bias = 2^23 + offset (as byte_f32). Fused into one FMA or not, a value rounds as gguf-py's:
    m is 0, or d * code is exact (an f16 times a 6-bit scale times a code of <= 5 bits)."""
    return (d * byte_f32(c0, 0, bias) - m, d * byte_f32(c0, 1, bias) - m,
            d * byte_f32(c0, 2, bias) - m, d * byte_f32(c0, 3, bias) - m,
            d * byte_f32(c1, 0, bias) - m, d * byte_f32(c1, 1, bias) - m,
            d * byte_f32(c1, 2, bias) - m, d * byte_f32(c1, 3, bias) - m)


@device_fn
def unit_cols(b, u, split):
    """First columns of unit u of block b: values 0..3 at i0.., values 4..7 at i1..."""
    if split:
        i0 = 32 * b + 4 * u
        return i0, i0 + 16
    i0 = 32 * b + 8 * u
    return i0, i0 + 4


# ---------------------------------------------------------------- block types

@device_fn
def dec_q4_0(w, base, b, u, K):
    o = 18 * b
    d = ld_f16(w, base, o)
    q = ld_u32_a2(w, base, o + 2 + 4 * u)
    lo = q & LOW_NIBBLES
    hi = (q >> u32(4)) & LOW_NIBBLES
    return (d * byte_f32(lo, 0, F23_8), d * byte_f32(lo, 1, F23_8),
            d * byte_f32(lo, 2, F23_8), d * byte_f32(lo, 3, F23_8),
            d * byte_f32(hi, 0, F23_8), d * byte_f32(hi, 1, F23_8),
            d * byte_f32(hi, 2, F23_8), d * byte_f32(hi, 3, F23_8))


@device_fn
def dec_q4_1(w, base, b, u, K):
    o = 20 * b
    d = ld_f16(w, base, o)
    m = ld_f16(w, base, o + 2)
    q = ld_u32(w, base, o + 4 + 4 * u)
    lo = q & LOW_NIBBLES
    hi = (q >> u32(4)) & LOW_NIBBLES
    return (d * byte_f32(lo, 0, F23) + m, d * byte_f32(lo, 1, F23) + m,
            d * byte_f32(lo, 2, F23) + m, d * byte_f32(lo, 3, F23) + m,
            d * byte_f32(hi, 0, F23) + m, d * byte_f32(hi, 1, F23) + m,
            d * byte_f32(hi, 2, F23) + m, d * byte_f32(hi, 3, F23) + m)


@device_fn
def q5_codes(qh, q, u):
    """A Q5 unit's low and high words of 5-bit codes: nibbles plus the qh bits as 16s."""
    lo = (q & LOW_NIBBLES) | spread4(qh >> u32(4 * u))
    hi = ((q >> u32(4)) & LOW_NIBBLES) | spread4(qh >> u32(16 + 4 * u))
    return lo, hi


@device_fn
def dec_q5_0(w, base, b, u, K):
    o = 22 * b
    d = ld_f16(w, base, o)
    lo, hi = q5_codes(ld_u32_a2(w, base, o + 2), ld_u32_a2(w, base, o + 6 + 4 * u), u)
    return (d * byte_f32(lo, 0, F23_16), d * byte_f32(lo, 1, F23_16),
            d * byte_f32(lo, 2, F23_16), d * byte_f32(lo, 3, F23_16),
            d * byte_f32(hi, 0, F23_16), d * byte_f32(hi, 1, F23_16),
            d * byte_f32(hi, 2, F23_16), d * byte_f32(hi, 3, F23_16))


@device_fn
def dec_q5_1(w, base, b, u, K):
    o = 24 * b
    d = ld_f16(w, base, o)
    m = ld_f16(w, base, o + 2)
    lo, hi = q5_codes(ld_u32(w, base, o + 4), ld_u32(w, base, o + 8 + 4 * u), u)
    return (d * byte_f32(lo, 0, F23) + m, d * byte_f32(lo, 1, F23) + m,
            d * byte_f32(lo, 2, F23) + m, d * byte_f32(lo, 3, F23) + m,
            d * byte_f32(hi, 0, F23) + m, d * byte_f32(hi, 1, F23) + m,
            d * byte_f32(hi, 2, F23) + m, d * byte_f32(hi, 3, F23) + m)


@device_fn
def dec_q8_0(w, base, b, u, K):
    o = 34 * b
    d = ld_f16(w, base, o)
    w0 = ld_u32_a2(w, base, o + 2 + 8 * u) ^ SIGN_BYTES
    w1 = ld_u32_a2(w, base, o + 6 + 8 * u) ^ SIGN_BYTES
    return (d * byte_f32(w0, 0, F23_128), d * byte_f32(w0, 1, F23_128),
            d * byte_f32(w0, 2, F23_128), d * byte_f32(w0, 3, F23_128),
            d * byte_f32(w1, 0, F23_128), d * byte_f32(w1, 1, F23_128),
            d * byte_f32(w1, 2, F23_128), d * byte_f32(w1, 3, F23_128))


# ---------------------------------------------------------------- block types, integer codes
# For the int8 path (x quantized to 8 bits per 32-block, x8.quantize_x): a unit's codes
# as two int32 words of 4 bytes each, laid out like x's int8 words (c0 for columns i0..,
# c1 for i1..), and the block's d and m / 4, with value = d * code + m. The kernel adds
#   d * xd * dp4a(codes, xq) + (m / 4) * xs      (xs = xd * sum of the block's x codes)
# and the four units of a block share the offset term between them exactly. d may differ
# between the units of a block (Q3_K, Q6_K: a scale per 16 values), m may not (Q2_K has a min
# per 16 values: no integer path). Nibbles and 5-bit codes are < 128, so the signed byte dot
# product takes them as they are; signed codes (Q3_K, Q6_K, table levels) go as int8 bytes.

@device_fn
def idec_q4_0(w, base, b, u):
    o = 18 * b
    d = ld_f16(w, base, o)
    q = ld_u32_a2(w, base, o + 2 + 4 * u)
    return i32(q & LOW_NIBBLES), i32((q >> u32(4)) & LOW_NIBBLES), d, d * f32(-2.0)


@device_fn
def idec_q4_1(w, base, b, u):
    o = 20 * b
    q = ld_u32(w, base, o + 4 + 4 * u)
    return (i32(q & LOW_NIBBLES), i32((q >> u32(4)) & LOW_NIBBLES),
            ld_f16(w, base, o), ld_f16(w, base, o + 2) * f32(0.25))


@device_fn
def idec_q5_0(w, base, b, u):
    o = 22 * b
    d = ld_f16(w, base, o)
    lo, hi = q5_codes(ld_u32_a2(w, base, o + 2), ld_u32_a2(w, base, o + 6 + 4 * u), u)
    return i32(lo), i32(hi), d, d * f32(-4.0)


@device_fn
def idec_q5_1(w, base, b, u):
    o = 24 * b
    lo, hi = q5_codes(ld_u32(w, base, o + 4), ld_u32(w, base, o + 8 + 4 * u), u)
    return i32(lo), i32(hi), ld_f16(w, base, o), ld_f16(w, base, o + 2) * f32(0.25)


@device_fn
def idec_q8_0(w, base, b, u):
    o = 34 * b
    return (i32(ld_u32_a2(w, base, o + 2 + 8 * u)), i32(ld_u32_a2(w, base, o + 6 + 8 * u)),
            ld_f16(w, base, o), ZERO)


# ---------------------------------------------------------------- float types (linear units)

@device_fn
def f16_at(w, base, i, K):
    return ld_f16(w, base, 2 * i) if i < K else ZERO


@device_fn
def dec_f16(w, base, b, u, K):
    i = 32 * b + 8 * u
    return (f16_at(w, base, i, K), f16_at(w, base, i + 1, K), f16_at(w, base, i + 2, K),
            f16_at(w, base, i + 3, K), f16_at(w, base, i + 4, K), f16_at(w, base, i + 5, K),
            f16_at(w, base, i + 6, K), f16_at(w, base, i + 7, K))


@device_fn
def bf16_at(w, base, i, K):
    return as_f32(ld_u16(w, base, 2 * i) << u32(16)) if i < K else ZERO


@device_fn
def dec_bf16(w, base, b, u, K):
    i = 32 * b + 8 * u
    return (bf16_at(w, base, i, K), bf16_at(w, base, i + 1, K), bf16_at(w, base, i + 2, K),
            bf16_at(w, base, i + 3, K), bf16_at(w, base, i + 4, K), bf16_at(w, base, i + 5, K),
            bf16_at(w, base, i + 6, K), bf16_at(w, base, i + 7, K))


@device_fn
def f32_at(w, base, i, K):
    return ld_f32(w, base, 4 * i) if i < K else ZERO


@device_fn
def dec_f32(w, base, b, u, K):
    i = 32 * b + 8 * u
    return (f32_at(w, base, i, K), f32_at(w, base, i + 1, K), f32_at(w, base, i + 2, K),
            f32_at(w, base, i + 3, K), f32_at(w, base, i + 4, K), f32_at(w, base, i + 5, K),
            f32_at(w, base, i + 6, K), f32_at(w, base, i + 7, K))


# ---------------------------------------------------------------- the table

# block: values per block; size: bytes per block; dec: the float decoder; split: unit layout;
# idec: the integer-code decoder (None: float path only).
QType = namedtuple("QType", "name block size dec split idec")

TYPES = {}


def register(types):
    """Add {qtype: QType} entries to TYPES, checked against gguf-py's block sizes."""
    assert all(GGML_QUANT_SIZES[GGMLQuantizationType(t)] == (v.block, v.size) for t, v in types.items())
    TYPES.update(types)


register({
    F32: QType("F32", 1, 4, dec_f32, False, None),
    F16: QType("F16", 1, 2, dec_f16, False, None),
    BF16: QType("BF16", 1, 2, dec_bf16, False, None),
    Q8_0: QType("Q8_0", 32, 34, dec_q8_0, False, idec_q8_0),
    Q4_0: QType("Q4_0", 32, 18, dec_q4_0, True, idec_q4_0),
    Q4_1: QType("Q4_1", 32, 20, dec_q4_1, True, idec_q4_1),
    Q5_0: QType("Q5_0", 32, 22, dec_q5_0, True, idec_q5_0),
    Q5_1: QType("Q5_1", 32, 24, dec_q5_1, True, idec_q5_1),
})
# + Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (quants_k.py) and IQ4_NL, IQ4_XS, MXFP4 (quants_iq4.py), which
# register themselves when imported (at the bottom of this file: they use the helpers above).


def qtype_info(qtype):
    try:
        return TYPES[int(qtype)]
    except KeyError:
        raise NotImplementedError(f"CUDA kernels do not decode GGUF type {int(qtype)} yet") from None


def is_supported(qtype):
    return int(qtype) in TYPES


def row_size(qtype, K):
    """Bytes of one row of K values of type qtype."""
    t = qtype_info(qtype)
    return K // t.block * t.size


def row_values(qtype, row_bytes):
    """Values K in one row of row_bytes bytes of type qtype."""
    t = qtype_info(qtype)
    return row_bytes // t.size * t.block


from . import quants_iq4, quants_k  # noqa: E402,F401  (register their types)
