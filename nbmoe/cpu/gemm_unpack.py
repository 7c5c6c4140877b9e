"""Weight panels for gemm_i8: 16 rows of a matrix unpacked to 8-bit codes and float scales.

Panel (gemm_i8 draws it): P [K/4][16] uint32, word (k, r) = the 4 codes of values 4k..4k+3
of row r, each byte c + 128 with c the signed integer code; S, O [K/G][16] float32 with
value = S * c + O over each group of G values (G = group_size(qtype): 32, or 16 where the
scale changes every 16 values). O is written only for HAS_M types (a float offset per group).
Rows past the matrix's end are zero codes (byte 128) with S = O = 0.

Codes, per type (block layouts: quants.py, quants_k.py, quants_iq4.py, quants_iq.py):
  Q4_0 q - 8   Q5_0 q - 16   Q8_0 q     Q4_1, Q5_1 q (+ O = m)
  Q2_K, Q4_K, Q5_K q (S = d sc, O = -dmin m)   Q3_K q - 4, Q6_K q - 32 (S = d sc, per 16)
  IQ4_NL, IQ4_XS, MXFP4  the table level of q
  grid IQ types  grid value * sign (IQ1: 8 (grid + delta), S = d s / 8)
Signed codes to c + 128 a word at a time: + 0x78787878 turns nibbles q into q - 8 + 128.

Work is scalar, a 32-bit word (4 codes) at a time, row by row; a panel is unpacked once per
work item and then used by every slot group of the item (gemm_i8), so it is a small share.
"""
import numpy as np
from numba import njit

from .quants import IQ4_TYPES, IQ_TYPES, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, block32, f32, load_f16, load_u32, u8
from .quants_iq import (IQ1_M, IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS, _iq1_m_d, _iq1_m_sub, _iq1_s_sub,
                        _iq2_s_sub, _iq2_xs_sub, _iq2_xxs_sub, _iq3_s_sub, _iq3_xxs_sub)
from .quants_iq4 import IQ4_NL, IQ4_XS, KV_IQ4, KV_MXFP4, MXFP4, e8m0_half, xs_scale
from .quants_k import Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, k_scale_min, q3_scale
from .quants_rtr import GROUP, Q4_1_R16, R16_TYPES, base_of

u32 = np.uint32
LO = u32(0x0F0F0F0F)
BIAS = u32(0x80808080)

# Types whose scale changes every 16 values; types with a float offset per group.
PER16 = (Q2_K, Q3_K, Q6_K, IQ2_XS, IQ2_S, IQ1_M)
HAS_M = (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K, Q4_1_R16)


@njit(inline="always")
def group_size(qtype):
    return 16 if qtype in PER16 else 32


@njit(inline="always")
def has_m(qtype):
    return qtype in HAS_M


@njit(inline="always")
def _put(P, r, k, word):
    """Word k (values 4k..4k+3) of panel row r."""
    P[16 * k + r] = word


@njit(inline="always")
def _spread4(h):
    """Bits 0..3 of h to bit 4 of bytes 0..3 (the 5th bits of 4 Q5 codes, as 16s)."""
    return (((h & u32(1)) << u32(4)) | ((h & u32(2)) << u32(11))
            | ((h & u32(4)) << u32(18)) | ((h & u32(8)) << u32(25)))


# ---------------------------------------------------------------- 32-value blocks

@njit(cache=True, error_model="numpy")
def _q4(P, S, O, w, r0, nr, qt):        # Q4_0  d:f16 qs:16 / Q4_1  d:f16 m:f16 qs:16
    size, qo = (18, 2) if qt == Q4_0 else (20, 4)
    add = u32(0x78787878) if qt == Q4_0 else BIAS
    for r in range(nr):
        row = w[r0 + r]
        for j in range(row.shape[0] // size):
            o = j * size
            S[16 * j + r] = load_f16(row, o)
            if qt == Q4_1:
                O[16 * j + r] = load_f16(row, o + 2)
            for k in range(4):
                q = load_u32(row, o + qo + 4 * k)
                _put(P, r, 8 * j + k, (q & LO) + add)
                _put(P, r, 8 * j + 4 + k, ((q >> u32(4)) & LO) + add)


@njit(cache=True, error_model="numpy")
def _q5(P, S, O, w, r0, nr, qt):        # Q5_0  d:f16 qh:4 qs:16 / Q5_1  d:f16 m:f16 qh:4 qs:16
    size, ho = (22, 2) if qt == Q5_0 else (24, 4)
    add = u32(0x70707070) if qt == Q5_0 else BIAS
    for r in range(nr):
        row = w[r0 + r]
        for j in range(row.shape[0] // size):
            o = j * size
            S[16 * j + r] = load_f16(row, o)
            if qt == Q5_1:
                O[16 * j + r] = load_f16(row, o + 2)
            qh = load_u32(row, o + ho)
            for k in range(4):
                q = load_u32(row, o + ho + 4 + 4 * k)
                _put(P, r, 8 * j + k, ((q & LO) | _spread4(qh >> u32(4 * k))) + add)
                _put(P, r, 8 * j + 4 + k, (((q >> u32(4)) & LO) | _spread4(qh >> u32(16 + 4 * k))) + add)


@njit(cache=True, error_model="numpy")
def _q8_0(P, S, O, w, r0, nr):          # d:f16 qs:32 int8
    for r in range(nr):
        row = w[r0 + r]
        for j in range(row.shape[0] // 34):
            S[16 * j + r] = load_f16(row, j * 34)
            for k in range(8):
                _put(P, r, 8 * j + k, load_u32(row, j * 34 + 2 + 4 * k) ^ BIAS)


@njit(inline="always")
def _levels(kv, q):
    """The 4 nibbles q (one a byte) as their table levels kv[q] + 128, one a byte."""
    out = u32(0)
    for i in range(4):
        out |= u32(np.int32(kv[(q >> u32(8 * i)) & u32(15)]) + 128) << u32(8 * i)
    return out


@njit(cache=True, error_model="numpy")
def _iq4(P, S, O, w, r0, nr, qt):       # IQ4_NL d:f16 qs:16 / MXFP4 e:u8 qs:16 / IQ4_XS (super-blocks)
    kv = KV_MXFP4 if qt == MXFP4 else KV_IQ4
    for r in range(nr):
        row = w[r0 + r]
        if qt == IQ4_XS:
            for sb in range(row.shape[0] // 136):
                d = load_f16(row, sb * 136)
                for i in range(8):
                    j, q0 = 8 * sb + i, sb * 136 + 8 + 16 * i
                    S[16 * j + r] = d * xs_scale(row, sb * 136, i)
                    for k in range(4):
                        q = load_u32(row, q0 + 4 * k)
                        _put(P, r, 8 * j + k, _levels(kv, q & LO))
                        _put(P, r, 8 * j + 4 + k, _levels(kv, (q >> u32(4)) & LO))
        else:
            size, qo = (17, 1) if qt == MXFP4 else (18, 2)
            for j in range(row.shape[0] // size):
                S[16 * j + r] = e8m0_half(row[j * 17]) if qt == MXFP4 else load_f16(row, j * 18)
                for k in range(4):
                    q = load_u32(row, j * size + qo + 4 * k)
                    _put(P, r, 8 * j + k, _levels(kv, q & LO))
                    _put(P, r, 8 * j + 4 + k, _levels(kv, (q >> u32(4)) & LO))


# ---------------------------------------------------------------- K-quants (256-value super-blocks)
# Sub-block p (values 32p..32p + 31, h = p // 4): layouts and bit positions in quants_k.py.

@njit(cache=True, error_model="numpy")
def _q45_k(P, S, O, w, r0, nr, qt):     # Q4_K d dmin scales:12 qs:128 / Q5_K ... qh:32 qs:128
    size, qo = (144, 16) if qt == Q4_K else (176, 48)
    for r in range(nr):
        row = w[r0 + r]
        for sb in range(row.shape[0] // size):
            o = sb * size
            d, dmin = load_f16(row, o), load_f16(row, o + 2)
            for p in range(8):
                j = 8 * sb + p
                sc, m = k_scale_min(row, o + 4, p)
                S[16 * j + r], O[16 * j + r] = d * sc, -dmin * m
                for k in range(8):
                    q = (load_u32(row, o + qo + 32 * (p // 2) + 4 * k) >> u32(4 * (p % 2))) & LO
                    if qt == Q5_K:
                        q |= ((load_u32(row, o + 16 + 4 * k) >> u32(p)) & u32(0x01010101)) << u32(4)
                    _put(P, r, 8 * j + k, q | BIAS)


@njit(cache=True, error_model="numpy")
def _q6_k(P, S, O, w, r0, nr):          # ql:128 qh:64 scales:16 int8 d:f16
    for r in range(nr):
        row = w[r0 + r]
        for sb in range(row.shape[0] // 210):
            o = sb * 210
            d = load_f16(row, o + 208)
            for p in range(8):
                h, j = p // 4, 8 * sb + p
                for t in range(2):
                    S[16 * (2 * j + t) + r] = d * f32(np.int8(row[o + 192 + 2 * p + t]))
                for k in range(8):
                    lo = (load_u32(row, o + 64 * h + 32 * (p % 2) + 4 * k) >> u32(4 * ((p % 4) // 2))) & LO
                    hi = (load_u32(row, o + 128 + 32 * h + 4 * k) >> u32(2 * (p % 4))) & u32(0x03030303)
                    _put(P, r, 8 * j + k, (lo | (hi << u32(4))) + u32(0x60606060))


@njit(cache=True, error_model="numpy")
def _q23_k(P, S, O, w, r0, nr, qt):     # Q2_K scales:16 qs:64 d dmin / Q3_K hmask:32 qs:64 scales:12 d
    size, qo = (84, 16) if qt == Q2_K else (110, 32)
    for r in range(nr):
        row = w[r0 + r]
        for sb in range(row.shape[0] // size):
            o = sb * size
            for p in range(8):
                h, j = p // 4, 8 * sb + p
                for t in range(2):
                    g = 16 * (2 * j + t) + r
                    if qt == Q2_K:
                        sc = row[o + 2 * p + t]
                        S[g] = load_f16(row, o + 80) * f32(sc & u8(15))
                        O[g] = -load_f16(row, o + 82) * f32(sc >> u8(4))
                    else:
                        S[g] = load_f16(row, o + 108) * q3_scale(row, o + 96, 2 * p + t)
                for k in range(8):
                    q = (load_u32(row, o + qo + 32 * h + 4 * k) >> u32(2 * (p % 4))) & u32(0x03030303)
                    if qt == Q2_K:
                        _put(P, r, 8 * j + k, q | BIAS)
                    else:   # q - 4 + 4 * hbit + 128
                        hb = ((load_u32(row, o + 4 * k) >> u32(p)) & u32(0x01010101)) << u32(2)
                        _put(P, r, 8 * j + k, (q | hb) + u32(0x7C7C7C7C))


# ---------------------------------------------------------------- grid IQ types
# quants_iq's sub-block decoders give the 32 values without d * s as integer-valued floats
# (IQ1: grid + delta, times 8 an integer) and s (or s of each 16 values).

@njit(inline="always")
def _put_values(P, r, j, v, mult):
    """Words of sub-block j of row r <- the 32 floats v times mult, as codes + 128."""
    for k in range(8):
        word = u32(0)
        for i in range(4):
            word |= u32(np.int32(v[4 * k + i] * mult) + 128) << u32(8 * i)
        _put(P, r, 8 * j + k, word)


@njit(cache=True, error_model="numpy")
def _iq(P, S, O, w, r0, nr, qt):
    size = (66 if qt == IQ2_XXS else 74 if qt == IQ2_XS else 82 if qt == IQ2_S else 98 if qt == IQ3_XXS
            else 110 if qt == IQ3_S else 50 if qt == IQ1_S else 56)
    mult = f32(8) if qt == IQ1_S or qt == IQ1_M else f32(1)
    for r in range(nr):
        row = w[r0 + r]
        for sb in range(row.shape[0] // size):
            o = sb * size
            d = (_iq1_m_d(row, o) if qt == IQ1_M else load_f16(row, o)) / mult
            for ib in range(8):
                j, v = 8 * sb + ib, block32()
                s0 = s1 = f32(0)
                if qt == IQ2_XXS:
                    s0 = _iq2_xxs_sub(v, row, o + 2 + 8 * ib)
                elif qt == IQ2_XS:
                    s0, s1 = _iq2_xs_sub(v, row, o + 2 + 8 * ib, row[o + 66 + ib])
                elif qt == IQ2_S:
                    s0, s1 = _iq2_s_sub(v, row, o, ib)
                elif qt == IQ3_XXS:
                    s0 = _iq3_xxs_sub(v, row, o, ib)
                elif qt == IQ3_S:
                    s0 = _iq3_s_sub(v, row, o, ib)
                elif qt == IQ1_S:
                    s0 = _iq1_s_sub(v, row, o, ib)
                else:
                    s0, s1 = _iq1_m_sub(v, row, o, ib)
                if qt == IQ2_XS or qt == IQ2_S or qt == IQ1_M:
                    S[16 * (2 * j) + r], S[16 * (2 * j + 1) + r] = d * s0, d * s1
                else:
                    S[16 * j + r] = d * s0
                _put_values(P, r, j, v, mult)


# ---------------------------------------------------------------- repacked (-rtr) groups
# quants_rtr's layout of 16 rows: qs [B][4 or 8][16][4] then scales [B][16] f16 (Q4_1: d 16 |
# m 16): the codes already lie as the panel's words; a panel = a group (the tail rows past the
# last group keep the GGUF layout and take the base type's unpack).

@njit(cache=True, error_model="numpy")
def _r16(P, S, O, w, r0, qt):
    rb = w.shape[1]
    flat = w.reshape(w.shape[0] * rb)
    grp = flat[r0 * rb:(r0 + GROUP) * rb]
    size = 18 if qt == Q4_0 else 20 if qt == Q4_1 else 34
    qb, sb = (512, 32) if qt == Q8_0 else (256, 64 if qt == Q4_1 else 32)
    B = rb // size
    add = u32(0x78787878) if qt == Q4_0 else BIAS
    for b in range(B):
        sc = B * qb + b * sb
        for r in range(16):
            S[16 * b + r] = load_f16(grp, sc + 2 * r)
            if qt == Q4_1:
                O[16 * b + r] = load_f16(grp, sc + 32 + 2 * r)
        for k in range(qb // 64):
            for r in range(16):
                q = load_u32(grp, b * qb + 64 * k + 4 * r)
                if qt == Q8_0:
                    _put(P, r, 8 * b + k, q)
                else:
                    _put(P, r, 8 * b + k, (q & LO) + add)
                    _put(P, r, 8 * b + 4 + k, ((q >> u32(4)) & LO) + add)


# ---------------------------------------------------------------- dispatch

@njit(inline="always")
def unpack_base(qtype, P, S, O, w, r0, nr):
    if qtype == Q4_0 or qtype == Q4_1:
        _q4(P, S, O, w, r0, nr, qtype)
    elif qtype == Q8_0:
        _q8_0(P, S, O, w, r0, nr)


@njit(cache=True, error_model="numpy")
def unpack(qtype, P, S, O, w, r0, nr):
    """The panel (P, S, O) <- rows r0..r0 + nr - 1 of w [M, row_bytes] (nr <= 16), padded;
    repacked (R16) w: r0 a multiple of 16."""
    if qtype == Q4_0 or qtype == Q4_1:
        _q4(P, S, O, w, r0, nr, qtype)
    elif qtype == Q8_0:
        _q8_0(P, S, O, w, r0, nr)
    elif qtype == Q5_0 or qtype == Q5_1:
        _q5(P, S, O, w, r0, nr, qtype)
    elif qtype == Q4_K or qtype == Q5_K:
        _q45_k(P, S, O, w, r0, nr, qtype)
    elif qtype == Q6_K:
        _q6_k(P, S, O, w, r0, nr)
    elif qtype == Q2_K or qtype == Q3_K:
        _q23_k(P, S, O, w, r0, nr, qtype)
    elif qtype in IQ4_TYPES:
        _iq4(P, S, O, w, r0, nr, qtype)
    elif qtype in IQ_TYPES:
        _iq(P, S, O, w, r0, nr, qtype)
    elif qtype in R16_TYPES:
        if nr == GROUP:
            _r16(P, S, O, w, r0, base_of(qtype))
        else:    # the tail rows, in the GGUF layout
            unpack_base(base_of(qtype), P, S, O, w, r0, nr)
    for r in range(nr, 16):
        for k in range(P.shape[0] // 16):
            P[16 * k + r] = BIAS
        for g in range(S.shape[0] // 16):
            S[16 * g + r] = 0
            O[16 * g + r] = 0
