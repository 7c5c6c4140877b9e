"""Weight panels for gemm_i8: 16 rows of a matrix unpacked to 8-bit codes and float scales.

Panel (gemm_i8 draws it): P uint32, a record of panel_words(G) words per 32 values (x-block):
codes [8][16] words, word (k, r) = the 4 codes of values 4k..4k+3 of row r, each byte c + 128
with c the signed integer code; then S [n][16] and O [n][16] float32 with value = S * c + O
over each group of G values (G = group_size(qtype): 32, or 16 where the scale changes every
16 values; n = 32 / G). O is written only for HAS_M types (a float offset per group). Rows past
the matrix's end are zero codes (byte 128) with S = O = 0.

Codes, per type (block layouts: quants.py, quants_k.py, quants_iq4.py, quants_iq.py):
  Q4_0 q - 8   Q5_0 q - 16   Q8_0 q     Q4_1, Q5_1 q (+ O = m)
  Q2_K, Q4_K, Q5_K q (S = d sc, O = -dmin m)   Q3_K q - 4, Q6_K q - 32 (S = d sc, per 16)
  IQ4_NL, IQ4_XS, MXFP4  the table level of q (vpshufb)
  grid IQ types  grid value * sign (IQ1: 8 (grid + delta), S = d s / 8)
Signed codes to c + 128 a word at a time: + 0x78787878 turns nibbles q into q - 8 + 128.

How: one intrinsic call per block (32 or 256 values) of the 16 rows, in LLVM IR. A 32-bit
word of a block holds 4 codes of one row; Rows.words loads 1-4 words of each of the 16 rows
and transposes them (16 x 4 -> 4 x 16: a vpermd per 4 rows, then 128-bit lane shuffles) so
that lane r of a <16 x i32> is row r: the bit fiddling of a type is then the scalar word
code of ggml / the CUDA integer decoders (cuda/quants*.py idec), 16 rows at a time, and every
result is one panel vector (vector gathers are microcoded, several times slower).
Repacked -rtr groups already hold a panel's words side by side: plain vector loads. The grid
IQ types go a row at a time through quants_iq's sub-block decoders (floats to bytes), slower.
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .quants import IQ_TYPES, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, block32, f32, load_f16
from .quants_iq import (IQ1_M, IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS, _iq1_m_d, _iq1_m_sub, _iq1_s_sub,
                        _iq2_s_sub, _iq2_xs_sub, _iq2_xxs_sub, _iq3_s_sub, _iq3_xxs_sub)
from .quants_iq4 import IQ4_NL, IQ4_XS, KV_IQ4, KV_MXFP4, MXFP4
from .quants_k import Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
from .quants_rtr import GROUP, Q4_1_R16, R16_TYPES, base_of
from .quants_rtr_k import HEAD, M_AT, Q4_K_R16, REC, SC_AT
from . import quants_rtr_xs as xs16
from .simd import F32, I32, Rows, arg_data, group_record, load_at, vec
from .specialize import ConstantArgs

u32 = np.uint32
LO, BIAS = 0x0F0F0F0F, 0x80808080

# Types whose scale changes every 16 values; types with a float offset per group.
PER16 = (Q2_K, Q3_K, Q6_K, IQ2_XS, IQ2_S, IQ1_M)
HAS_M = (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K, Q4_1_R16, Q4_K_R16)


@njit(inline="always")
def group_size(qtype):
    return 16 if qtype in PER16 else 32


@njit(inline="always")
def has_m(qtype):
    return qtype in HAS_M


def record_words(G):
    """uint32 words of a panel record (32 values of 16 rows): codes, S, O."""
    return 128 + 2 * 16 * (32 // G)


@njit(inline="always")
def panel_words(G):
    return 128 + 2 * 16 * (32 // G)


# ---------------------------------------------------------------- IR bodies, one per type
# Byte offsets within the block; layouts in quants.py, quants_k.py, quants_iq4.py.

def _nibble_pairs(e, ws, kbase, codes):
    """Words ws of 4 + 4 nibbles (low: values 4k.., high: 16 + 4k..) -> panel vectors."""
    for k, q in enumerate(ws):
        e.put(kbase + k, codes(e.and_(q, LO), k, 0))
        e.put(kbase + 4 + k, codes(e.bits(q, 4, LO), k, 1))


def _q4_0(e):                                   # d:f16 qs:16
    e.scale(0, e.half(0))
    _nibble_pairs(e, e.words(2, 4), 0, lambda q, k, h: e.add(q, 0x78787878))


def _q4_1(e):                                   # d:f16 m:f16 qs:16
    e.scale(0, e.half(0), e.half(2))
    _nibble_pairs(e, e.words(4, 4), 0, lambda q, k, h: e.or_(q, BIAS))


def _spread4(e, h):
    """Bits 0..3 of h to bit 4 of bytes 0..3 (4 codes' 5th bits, as 16s)."""
    return e.or_(e.shl(e.and_(h, 1), 4), e.shl(e.and_(h, 2), 11), e.shl(e.and_(h, 4), 18), e.shl(e.and_(h, 8), 25))


def _q5(e, m):                                  # d:f16 (m:f16) qh:4 qs:16
    o = 4 if m else 2
    e.scale(0, e.half(0), e.half(2) if m else None)
    qh = e.words(o, 1)[0]
    _nibble_pairs(e, e.words(o + 4, 4), 0, lambda q, k, h: e.add(e.or_(q, _spread4(e, e.shr(qh, 16 * h + 4 * k))),
                                                                BIAS if m else 0x70707070))


def _q8_0(e):                                   # d:f16 qs:32
    e.scale(0, e.half(0))
    for h in range(2):
        for k, q in enumerate(e.words(2 + 16 * h, 4)):
            e.put(4 * h + k, e.b.xor(q, e.k(BIAS)))


def _iq4_nl(e, mx):                             # IQ4_NL d:f16 qs:16 / MXFP4 e:u8 qs:16
    if mx:                                      # 2**(e - 128) as quants_iq4.e8m0_half
        x = e.byte(0)
        small = e.b.icmp_unsigned("<", x, e.k(2))
        bits = e.b.select(small, e.b.shl(e.k(0x00200000), x), e.shl(e.b.sub(x, e.k(1)), 23))
        e.scale(0, e.b.bitcast(bits, vec(F32, 16)))
    else:
        e.scale(0, e.half(0))
    table = KV_MXFP4 if mx else KV_IQ4
    _nibble_pairs(e, e.words(1 if mx else 2, 4), 0, lambda q, k, h: e.lut(q, table))


def _iq4_xs(e):                                 # d:f16 scales_h:u16 scales_l:4 qs:128
    d, sh, sl = e.half(0), e.shr(e.words(0, 1)[0], 16), e.words(4, 1)[0]
    for i in range(8):
        ls = e.or_(e.bits(sl, 4 * i, 15), e.shl(e.bits(sh, 2 * i, 3), 4))
        e.scale(i, e.b.fmul(d, e.float(e.add(ls, -32))))
        _nibble_pairs(e, e.words(8 + 16 * i, 4), 8 * i, lambda q, k, h: e.lut(q, KV_IQ4))


def _k_scales(e, d, dmin):
    """Q4_K / Q5_K: sub-block j's (d sc_j, -dmin m_j) from the 12 scale bytes at 4."""
    s0, s1, s2 = e.words(4, 3)
    out = []
    for j in range(8):
        if j < 4:
            sc, m = e.bits(s0, 8 * j, 63), e.bits(s1, 8 * j, 63)
        else:
            b2, t = e.shr(s2, 8 * (j - 4)), 8 * (j - 4) + 6
            sc = e.or_(e.and_(b2, 15), e.shl(e.bits(s0, t, 3), 4))
            m = e.or_(e.bits(b2, 4, 15), e.shl(e.bits(s1, t, 3), 4))
        out.append((e.b.fmul(d, e.float(sc)), e.b.fmul(dmin, e.float(m))))
    return out


def _q45_k(e, five):                            # d dmin scales:12 (qh:32) qs:128
    d, dmin = e.half(0), e.b.fneg(e.half(2))
    for j, (s, o) in enumerate(_k_scales(e, d, dmin)):
        e.scale(j, s, o)
    qh = e.words(16, 4) + e.words(32, 4) if five else None
    for c in range(4):                          # sub-blocks 2c (low nibbles), 2c + 1 (high)
        ws = e.words((48 if five else 16) + 32 * c, 4) + e.words((64 if five else 32) + 32 * c, 4)
        for k, q in enumerate(ws):
            for h in range(2):
                code = e.bits(q, 4 * h, LO)
                if five:
                    code = e.or_(code, e.shl(e.bits(qh[k], 2 * c + h, 0x01010101), 4))
                e.put(8 * (2 * c + h) + k, e.or_(code, BIAS))


def _q6_k(e):                                   # ql:128 qh:64 scales:16 int8 d:f16
    d = e.half(208)
    for i, w in enumerate(e.words(192, 4)):     # group 4i + n: byte n, signed
        for n in range(4):
            sc = e.b.ashr(e.shl(w, 24 - 8 * n), e.k(24))
            e.scale(4 * i + n, e.b.fmul(d, e.float(sc)))
    for h in range(2):
        qh = e.words(128 + 32 * h, 4) + e.words(144 + 32 * h, 4)
        for half in range(2):                   # sub-blocks 4h + half (low nibbles), 4h + 2 + half
            ql = e.words(64 * h + 32 * half, 4) + e.words(64 * h + 32 * half + 16, 4)
            for n in range(2):
                p = 4 * h + 2 * n + half
                for k in range(8):
                    code = e.or_(e.bits(ql[k], 4 * n, LO), e.shl(e.bits(qh[k], 2 * (p % 4), 0x03030303), 4))
                    e.put(8 * p + k, e.add(code, 0x60606060))


def _q23_k(e, three):                           # Q2_K scales:16 qs:64 d dmin / Q3_K hmask:32 qs:64 scales:12 d
    if three:
        d = e.half(108)
        sw = e.words(96, 3)
        for g in range(16):                     # low 4 bits: nibble g // 8 of byte g % 8; top 2: byte 8 + g % 4
            lo = e.bits(sw[g % 8 // 4], 8 * (g % 4) + 4 * (g // 8), 15)
            hi = e.bits(sw[2], 8 * (g % 4) + 2 * (g // 4), 3)
            e.scale(g, e.b.fmul(d, e.float(e.add(e.or_(lo, e.shl(hi, 4)), -32))))
        hm = e.words(0, 4) + e.words(16, 4)
    else:
        d, dmin = e.half(80), e.b.fneg(e.half(82))
        for i, w in enumerate(e.words(0, 4)):
            for n in range(4):
                e.scale(4 * i + n, e.b.fmul(d, e.float(e.bits(w, 8 * n, 15))),
                        e.b.fmul(dmin, e.float(e.bits(w, 8 * n + 4, 15))))
    qo = 32 if three else 16
    for h in range(2):
        qs = e.words(qo + 32 * h, 4) + e.words(qo + 32 * h + 16, 4)
        for s in range(4):
            p = 4 * h + s
            for k in range(8):
                q = e.bits(qs[k], 2 * s, 0x03030303)
                if three:                       # q - 4 + 4 * hmask bit + 128
                    e.put(8 * p + k, e.add(e.or_(q, e.shl(e.bits(hm[k], p, 0x01010101), 2)), 0x7C7C7C7C))
                else:
                    e.put(8 * p + k, e.or_(q, BIAS))


# qtype -> (body, block bytes, block values)
BODIES = {
    Q4_0: (_q4_0, 18, 32), Q4_1: (_q4_1, 20, 32), Q5_0: (lambda e: _q5(e, False), 22, 32),
    Q5_1: (lambda e: _q5(e, True), 24, 32), Q8_0: (_q8_0, 34, 32),
    IQ4_NL: (lambda e: _iq4_nl(e, False), 18, 32), MXFP4: (lambda e: _iq4_nl(e, True), 17, 32),
    IQ4_XS: (_iq4_xs, 136, 256), Q4_K: (lambda e: _q45_k(e, False), 144, 256),
    Q5_K: (lambda e: _q45_k(e, True), 176, 256), Q6_K: (_q6_k, 210, 256),
    Q2_K: (lambda e: _q23_k(e, False), 84, 256), Q3_K: (lambda e: _q23_k(e, True), 110, 256),
}


@intrinsic
def unpack_block(typingctx, qt, P, w, roff, blk):
    """Block blk of the 16 rows at byte offsets roff [16] of w's data into the panel P;
    qt a compile-time constant (a type of BODIES)."""
    if not isinstance(qt, types.IntegerLiteral):
        return None
    body, size, values = BODIES[qt.literal_value]
    G = 16 if qt.literal_value in PER16 else 32

    def codegen(context, b, sig, args):
        body(Rows(context, b, sig, args, size, values, G, record_words(G)))
        return context.get_dummy_value()
    return types.void(qt, P, w, roff, blk), codegen


@intrinsic
def unpack_r16(typingctx, qt, P, w, o, B, blk):
    """Block blk of the repacked group at byte o of w's data (quants_rtr: qs [B][4 or 8][16][4]
    then scales [B][16] f16, Q4_1 [B][d 16 | m 16], MXFP4 [B][16] u8) into the panel P; qt the
    base type, constant."""
    if not isinstance(qt, types.IntegerLiteral):
        return None
    base = qt.literal_value
    qb, sb = (512, 32) if base == Q8_0 else (256, 64 if base == Q4_1 else 16 if base == MXFP4 else 32)

    def codegen(context, b, sig, args):
        _, P, w, o, B, blk = args
        e = Rows.__new__(Rows)
        e.b, c = b, Rows.c

        def data(i):
            return context.make_array(sig.args[i])(context, b, args[i]).data
        e.P, e.n, e.PW = b.gep(data(1), [b.mul(blk, c(record_words(32)))]), 1, record_words(32)
        qs = b.gep(data(2), [b.add(o, b.mul(blk, c(qb)))])
        sc = b.gep(data(2), [b.add(o, b.add(b.mul(B, c(qb)), b.mul(blk, c(sb))))])

        def load(p, off, ty):
            return b.load(b.bitcast(b.gep(p, [c(off)]), ty.as_pointer()), align=1)

        def halfs(off):
            return b.fpext(load(sc, off, vec(ir.HalfType(), 16)), vec(F32, 16))
        if base == MXFP4:                        # 2^(e - 128) as _iq4_nl
            x = b.zext(load(sc, 0, vec(ir.IntType(8), 16)), vec(I32, 16))
            small = b.icmp_unsigned("<", x, e.k(2))
            bits = b.select(small, b.shl(e.k(0x00200000), x), e.shl(b.sub(x, e.k(1)), 23))
            e.scale(0, b.bitcast(bits, vec(F32, 16)))
        else:
            e.scale(0, halfs(0), halfs(32) if base == Q4_1 else None)
        if base == Q8_0:                         # stored w ^ 0x80 already
            for k in range(8):
                e.put(k, load(qs, 64 * k, vec(I32, 16)))
        elif base in (IQ4_NL, MXFP4):
            table = KV_MXFP4 if base == MXFP4 else KV_IQ4
            _nibble_pairs(e, [load(qs, 64 * k, vec(I32, 16)) for k in range(4)], 0,
                          lambda q, k, h: e.lut(q, table))
        else:
            _nibble_pairs(e, [load(qs, 64 * k, vec(I32, 16)) for k in range(4)], 0,
                          lambda q, k, h: e.add(q, 0x78787878) if base == Q4_0 else e.or_(q, BIAS))
        return context.get_dummy_value()
    return types.void(qt, P, w, o, B, blk), codegen


@intrinsic
def unpack_k_r16(typingctx, P, w, o, sb):
    """Super-block sb of the repacked Q4_K group at byte o of w's data (quants_rtr_k: head
    d [16] f16, dmin [16] f16, W [3][16] u32; qs [4][8][16][4]) into the panel's 8 records."""
    def codegen(context, b, sig, args):
        P, w, o, sb = args
        e = Rows.__new__(Rows)
        e.b, c, PW = b, Rows.c, record_words(32)

        e.P, e.n, e.PW = b.gep(arg_data(context, b, sig, args, 0), [b.mul(sb, c(8 * PW))]), 1, PW
        rec = group_record(b, arg_data(context, b, sig, args, 1), o, sb, REC)

        def load(off, ty):
            return load_at(b, rec, off, ty)
        d, dmin = (b.fpext(load(off, vec(ir.HalfType(), 16)), vec(F32, 16)) for off in (0, 32))
        W = [load(64 + 64 * k, vec(I32, 16)) for k in range(3)]
        m7 = e.or_(e.shr(W[0], 30), e.and_(e.shr(W[1], 28), 12), e.and_(e.shr(W[2], 26), 48))
        ms = [e.bits(W[k], bit, 63) for k, bit in M_AT] + [m7]
        for j, (k, bit) in enumerate(SC_AT):
            e.scale(j, b.fmul(d, e.float(e.bits(W[k], bit, 63))), b.fneg(b.fmul(dmin, e.float(ms[j]))))
        for ch in range(4):                      # sub-blocks 2 ch (low nibbles), 2 ch + 1 (high)
            for k in range(8):
                q = load(HEAD + 64 * (8 * ch + k), vec(I32, 16))
                e.put(8 * 2 * ch + k, e.or_(e.and_(q, LO), BIAS))
                e.put(8 * (2 * ch + 1) + k, e.or_(e.bits(q, 4, LO), BIAS))
        return context.get_dummy_value()
    return types.void(P, w, o, sb), codegen


@intrinsic
def unpack_xs_r16(typingctx, P, w, o, sb):
    """Super-block sb of the repacked IQ4_XS group at byte o of w's data (quants_rtr_xs: head
    d [16] f16, L [16] u32, H [16] u16; qs [8][4][16][4]) into the panel's 8 records."""
    def codegen(context, b, sig, args):
        P, w, o, sb = args
        e = Rows.__new__(Rows)
        e.b, c, PW = b, Rows.c, record_words(32)

        e.P, e.n, e.PW = b.gep(arg_data(context, b, sig, args, 0), [b.mul(sb, c(8 * PW))]), 1, PW
        rec = group_record(b, arg_data(context, b, sig, args, 1), o, sb, xs16.REC)

        def load(off, ty):
            return load_at(b, rec, off, ty)
        d = b.fpext(load(0, vec(ir.HalfType(), 16)), vec(F32, 16))
        W = [load(32, vec(I32, 16)), b.zext(load(96, vec(ir.IntType(16), 16)), vec(I32, 16))]
        ls = [e.bits(W[k], bit, 63) for k, bit in xs16.LS_AT] + [e.or_(e.shr(W[0], 30), e.and_(e.shr(W[1], 10), 60))]
        for j in range(8):
            e.scale(j, b.fmul(d, e.float(e.add(ls[j], -32))))
            for k in range(4):
                q = load(xs16.HEAD + 64 * (4 * j + k), vec(I32, 16))
                e.put(8 * j + k, e.lut(e.and_(q, LO), KV_IQ4))
                e.put(8 * j + 4 + k, e.lut(e.bits(q, 4, LO), KV_IQ4))
        return context.get_dummy_value()
    return types.void(P, w, o, sb), codegen


# ---------------------------------------------------------------- grid IQ types
# quants_iq's sub-block decoders give the 32 values without d * s as integer-valued floats
# (IQ1: grid + delta, times 8 an integer) and s (or s of each 16 values).

@njit(inline="always")
def _put_values(P, o, r, v, mult):
    """Words of row r of the record at word o <- the 32 floats v times mult, as codes + 128."""
    for k in range(8):
        word = u32(0)
        for i in range(4):
            word |= u32(np.int32(v[4 * k + i] * mult) + 128) << u32(8 * i)
        P[o + 16 * k + r] = word


@njit(cache=True, error_model="numpy")
def _iq(P, w, r0, nr, qt):
    size = (66 if qt == IQ2_XXS else 74 if qt == IQ2_XS else 82 if qt == IQ2_S else 98 if qt == IQ3_XXS
            else 110 if qt == IQ3_S else 50 if qt == IQ1_S else 56)
    mult = f32(8) if qt == IQ1_S or qt == IQ1_M else f32(1)
    per16 = qt == IQ2_XS or qt == IQ2_S or qt == IQ1_M
    PW = panel_words(16 if per16 else 32)
    S = P.view(np.float32)
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
                if per16:
                    S[j * PW + 128 + r], S[j * PW + 144 + r] = d * s0, d * s1
                else:
                    S[j * PW + 128 + r] = d * s0
                _put_values(P, j * PW, r, v, mult)


# ---------------------------------------------------------------- dispatch

@njit(inline="always")
def _blocks(qt, P, w, roff):
    size = 18 if qt == Q4_0 or qt == IQ4_NL else 20 if qt == Q4_1 else 22 if qt == Q5_0 else \
        24 if qt == Q5_1 else 34 if qt == Q8_0 else 17 if qt == MXFP4 else 136 if qt == IQ4_XS else \
        144 if qt == Q4_K else 176 if qt == Q5_K else 210 if qt == Q6_K else 84 if qt == Q2_K else 110
    for blk in range(w.shape[1] // size):
        unpack_block(qt, P, w, roff, blk)


@njit(inline="always")
def _r16(qt, P, w, r0):
    size = 18 if qt == Q4_0 or qt == IQ4_NL else 20 if qt == Q4_1 else 17 if qt == MXFP4 else 34
    B = w.shape[1] // size
    for blk in range(B):
        unpack_r16(qt, P, w, r0 * w.shape[1], B, blk)


@njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
def unpack(qtype, P, w, r0, nr):
    """The panel P <- rows r0..r0 + nr - 1 of w [M, row_bytes] (nr <= 16), padded; repacked
    (R16) w: r0 a multiple of 16."""
    roff = np.empty(16, np.int64)
    for r in range(16):                          # rows past nr: copies of the last, zeroed below
        roff[r] = (r0 + min(r, nr - 1)) * w.shape[1]
    qt = base_of(qtype) if qtype in R16_TYPES else qtype
    if qtype in R16_TYPES and nr == GROUP:
        if qt == Q4_K:
            for sb in range(w.shape[1] // 144):
                unpack_k_r16(P, w, r0 * w.shape[1], sb)
        elif qt == IQ4_XS:
            for sb in range(w.shape[1] // 136):
                unpack_xs_r16(P, w, r0 * w.shape[1], sb)
        elif qt == Q4_0:
            _r16(Q4_0, P, w, r0)
        elif qt == Q4_1:
            _r16(Q4_1, P, w, r0)
        elif qt == IQ4_NL:
            _r16(IQ4_NL, P, w, r0)
        elif qt == MXFP4:
            _r16(MXFP4, P, w, r0)
        else:
            _r16(Q8_0, P, w, r0)
    elif qt == Q4_0:                             # (R16: the tail rows keep the GGUF layout)
        _blocks(Q4_0, P, w, roff)
    elif qt == Q4_1:
        _blocks(Q4_1, P, w, roff)
    elif qt == Q8_0:
        _blocks(Q8_0, P, w, roff)
    elif qt == Q5_0:
        _blocks(Q5_0, P, w, roff)
    elif qt == Q5_1:
        _blocks(Q5_1, P, w, roff)
    elif qt == Q4_K:
        _blocks(Q4_K, P, w, roff)
    elif qt == Q5_K:
        _blocks(Q5_K, P, w, roff)
    elif qt == Q6_K:
        _blocks(Q6_K, P, w, roff)
    elif qt == Q2_K:
        _blocks(Q2_K, P, w, roff)
    elif qt == Q3_K:
        _blocks(Q3_K, P, w, roff)
    elif qt == IQ4_NL:
        _blocks(IQ4_NL, P, w, roff)
    elif qt == IQ4_XS:
        _blocks(IQ4_XS, P, w, roff)
    elif qt == MXFP4:
        _blocks(MXFP4, P, w, roff)
    elif qt in IQ_TYPES:
        _iq(P, w, r0, nr, qt)
    PW = panel_words(group_size(qtype))
    for j in range(P.shape[0] // PW):
        for r in range(nr, 16):
            for k in range(8):
                P[j * PW + 16 * k + r] = BIAS
            for g in range(128 + r, PW, 16):     # S, O
                P[j * PW + g] = 0
