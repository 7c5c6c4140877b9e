"""4-bit table types on the GPU: IQ4_NL, IQ4_XS, MXFP4 decoders (float values and integer codes).

Letters and the unit as in quants.py. The codes are 4-bit indices into a table of 16 int8
levels. Block layouts (little-endian, as nbmoe/cpu/quants_iq4.py and gguf-py):

  IQ4_NL  32 values in 18 bytes = d:f16 qs:16                        v = d * KV_IQ4[q]
  MXFP4   32 values in 17 bytes = e:u8 (E8M0 exponent) qs:16         v = 2^(e - 128) * KV_MXFP4[q]
  IQ4_XS  256 values in 136 bytes = d:f16 scales_h:u16 scales_l:4 qs:128
          sub-block j (32 values): ls = nibble j % 2 of scales_l[j // 2] | bits 2j, 2j + 1 of
          scales_h << 4, v = d * (ls - 32) * KV_IQ4[q]; its codes are qs[16j..16j + 15]
    qs:16 (each 32 values): byte l low nibble = value l, high nibble = value l + 16: "split"
    units, as Q4_0. KV_MXFP4 holds the E2M1 values doubled (hence 2^(e - 128), half the scale).
IQ4_XS's sub-block j is 32-value block b of the row, super-block b >> 3, j = b & 7 (quants.py).
MXFP4's 17-byte blocks leave no alignment: its words are read a byte at a time.

Codes to levels without a memory lookup: the 16 levels are 4 words t0..t3 (4 bytes each), and
PRMT (byte permute: any 4 of the 8 bytes of two words, picked by 4 3-bit selectors) looks up 4
codes at once: once in (t1:t0) for levels 0..7, once in (t3:t2) for 8..15, and a third PRMT
takes each byte from the one or the other by the code's bit 3. The levels come out as int8
bytes: the integer path's codes as they are (m = 0), the float path's via byte_f32 (+ 128).
"""
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import IQ4_NL as _IQ4_NL
from gguf.quants import MXFP4 as _MXFP4
from numba import cuda

from . import SIM, as_f32, device_fn, ld_f16, ld_u8, ld_u16, ld_u32, ld_u32_a2
from .quants import F23_32, F23_128, LOW_NIBBLES, SIGN_BYTES, ZERO, QType, affine8, byte_f32, register

IQ4_NL = int(GGMLQuantizationType.IQ4_NL)
IQ4_XS = int(GGMLQuantizationType.IQ4_XS)
MXFP4 = int(GGMLQuantizationType.MXFP4)

u32 = np.uint32
i32 = np.int32

# The tables as 4 little-endian words of 4 int8 levels each (level k: byte k % 4 of word k // 4).
IQ4_T0, IQ4_T1, IQ4_T2, IQ4_T3 = (u32(v) for v in np.array(_IQ4_NL.kvalues, np.int8).view(np.uint32))
MX_T0, MX_T1, MX_T2, MX_T3 = (u32(v) for v in np.array(_MXFP4.kvalues, np.int8).view(np.uint32))


# ---------------------------------------------------------------- byte permute
# prmt(x, y, s): byte k of the result = byte (nibble k of s) & 7 of the 8 bytes y:x (x low).
if SIM:
    def prmt(x, y, s):
        v = (int(y) << 32) | int(x)
        r = 0
        for k in range(4):
            r |= ((v >> (8 * ((int(s) >> (4 * k)) & 7))) & 0xFF) << (8 * k)
        return u32(r)
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, forceinline=True)
    def prmt(x, y, s):
        return u32(libdevice.byte_perm(i32(x), i32(y), i32(s)))


@device_fn
def levels4(c, t0, t1, t2, t3):
    """The table levels of the 4 codes (0..15) in the bytes of c, as a word of 4 int8 bytes."""
    s = c | (c >> u32(4))
    s = (s & u32(0xFF)) | ((s >> u32(8)) & u32(0xFF00))         # code k in nibble k
    lo = prmt(t0, t1, s & u32(0x7777))
    hi = prmt(t2, t3, s & u32(0x7777))
    return prmt(lo, hi, u32(0x3210) | ((s & u32(0x8888)) >> u32(1)))   # bit 3 set: byte k + 4


@device_fn
def iq4_levels(q):
    """A word of qs (split unit) -> the levels of its low nibbles (c0) and high nibbles (c1)."""
    return (levels4(q & LOW_NIBBLES, IQ4_T0, IQ4_T1, IQ4_T2, IQ4_T3),
            levels4((q >> u32(4)) & LOW_NIBBLES, IQ4_T0, IQ4_T1, IQ4_T2, IQ4_T3))


@device_fn
def e8m0_half(e):
    """float32 2^(e - 128) of an E8M0 byte (a denormal for e < 2, as gguf-py computes it)."""
    return as_f32(u32(0x00200000) << e if e < u32(2) else (e - u32(1)) << u32(23))


# ---------------------------------------------------------------- units
# (c0, c1, d): unit u's levels as two words of int8 bytes (split columns) and its scale.

@device_fn
def iq4_nl_unit(w, base, b, u):
    o = 18 * b
    c0, c1 = iq4_levels(ld_u32_a2(w, base, o + 2 + 4 * u))
    return c0, c1, ld_f16(w, base, o)


@device_fn
def iq4_xs_unit(w, base, b, u):
    o = 136 * (b >> 3)
    j = b & 7
    lo = (ld_u8(w, base, o + 4 + (j >> 1)) >> u32(4 * (j & 1))) & u32(15)
    hi = (ld_u16(w, base, o + 2) >> u32(2 * j)) & u32(3)
    c0, c1 = iq4_levels(ld_u32(w, base, o + 8 + 16 * j + 4 * u))
    return c0, c1, ld_f16(w, base, o) * byte_f32(lo | (hi << u32(4)), 0, F23_32)


@device_fn
def mxfp4_unit(w, base, b, u):
    o = 17 * b
    p = o + 1 + 4 * u                                 # no alignment: a byte at a time
    q = (ld_u8(w, base, p) | (ld_u8(w, base, p + 1) << u32(8)) | (ld_u8(w, base, p + 2) << u32(16))
         | (ld_u8(w, base, p + 3) << u32(24)))
    return (levels4(q & LOW_NIBBLES, MX_T0, MX_T1, MX_T2, MX_T3),
            levels4((q >> u32(4)) & LOW_NIBBLES, MX_T0, MX_T1, MX_T2, MX_T3), e8m0_half(ld_u8(w, base, o)))


# ---------------------------------------------------------------- decoders

@device_fn
def dec_iq4_nl(w, base, b, u, K):
    c0, c1, d = iq4_nl_unit(w, base, b, u)
    return affine8(c0 ^ SIGN_BYTES, c1 ^ SIGN_BYTES, d, ZERO, F23_128)


@device_fn
def dec_iq4_xs(w, base, b, u, K):
    c0, c1, d = iq4_xs_unit(w, base, b, u)
    return affine8(c0 ^ SIGN_BYTES, c1 ^ SIGN_BYTES, d, ZERO, F23_128)


@device_fn
def dec_mxfp4(w, base, b, u, K):
    c0, c1, d = mxfp4_unit(w, base, b, u)
    return affine8(c0 ^ SIGN_BYTES, c1 ^ SIGN_BYTES, d, ZERO, F23_128)


@device_fn
def idec_iq4_nl(w, base, b, u):
    c0, c1, d = iq4_nl_unit(w, base, b, u)
    return i32(c0), i32(c1), d, ZERO


@device_fn
def idec_iq4_xs(w, base, b, u):
    c0, c1, d = iq4_xs_unit(w, base, b, u)
    return i32(c0), i32(c1), d, ZERO


@device_fn
def idec_mxfp4(w, base, b, u):
    c0, c1, d = mxfp4_unit(w, base, b, u)
    return i32(c0), i32(c1), d, ZERO


register({
    IQ4_NL: QType("IQ4_NL", 32, 18, dec_iq4_nl, True, idec_iq4_nl),
    IQ4_XS: QType("IQ4_XS", 256, 136, dec_iq4_xs, True, idec_iq4_xs),
    MXFP4: QType("MXFP4", 32, 17, dec_mxfp4, True, idec_mxfp4),
})
