"""Run-time repacking (-rtr) of IQ4_XS: 16 rows interleaved super-block by super-block (as
quants_rtr_k does for Q4_K), and the integer matrix-vector kernel that reads them.

Letters as in quants_rtr_k: SB = K / 256 super-blocks per row, r = 0..15 a row of its group
(a 32-bit lane), j = 0..7 a sub-block of 32 values (one x-block: xq, xd, xs of quantize_x).

Layout. Same shape and bytes as the GGUF tensor (IQ4_XS: d:f16 scales_h:u16 scales_l:4
qs:128, v = d (ls_j - 32) KV_IQ4[q]): group g is SB records of 2176 = 16 x 136 bytes,
record b (super-block b of the 16 rows):

  byte    0: d  [16] f16
         32: L  [16] u32   row r's ls0 | ls1 << 6 | ls2 << 12 | ls3 << 18 | ls4 << 24 | ls7[0:2] << 30
         96: H  [16] u16   row r's ls5 | ls6 << 6 | ls7[2:6] << 12
        128: qs [8][4][16][4]   sub-block j, word k, row r, byte i = GGUF qs byte 16 j + 4 k + i
      byte of a qs vector  0  1  2  3 |  4  5  6  7 | ... | 60 61 62 63
      row                  0  0  0  0 |  1  1  1  1 | ... | 15 15 15 15
      low nibbles: values 32j + 4k .. + 3, high nibbles: 32j + 16 + 4k .. + 3

Equation (row r, super-block b): out[r] = sum_b d * sum_j float(dot_j) * (ls_j - 32) * xd_j,
  dot_j = sum over the sub-block of (KV_IQ4[q] + 128) * xq - 128 * (sum of xq)
two vpdpbusd chains per sub-block (low, high nibbles), one started at the block bias -128 * sum
(xb's tail, as quants_rtr's IQ4_NL), the levels + 128 by vpshufb. A scale is taken as
float(field << bit) - 32 * 2^bit (exact); xk [K / 32] = xd_j 2^-bit (prepare_xk).
Per record: 32 loads, 32 shifts, 64 and, 64 vpshufb, 64 vpdpbusd; 8 and + 9 conversions +
8 subtractions for the scales, 8 conversions, 8 mul, 8 FMA, 1 vcvtph2ps + 1 FMA.
Rows past the last full group keep the GGUF layout (the plain kernels).
"""
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from .quants import FM, block32, f32, groups_in_streams, load_f16, u8
from .quants_int8 import _dot4_init, dot_rows_i8
from .quants_iq4 import _IQ4_U8, IQ4_XS, KV_IQ4, dequant_rows_iq4_xs
from .simd import (F32, I8, I16, I32, I64, arg_data, const, group_record, load_at, lut, splat, vec,
                   x_word16)

GROUP = 16
IQ4_XS_R16 = 1023
SIZE, REC, HEAD = 136, 2176, 128      # bytes: GGUF super-block, group record, record head
u16, u32, u64 = np.uint16, np.uint32, np.uint64
# (word, bit) of ls0..ls6: word 0 = L, 1 = H (ls7: bits 30, 31 of L, 12..15 of H)
LS_AT = ((0, 0), (0, 6), (0, 12), (0, 18), (0, 24), (1, 0), (1, 6))
XD_SCALE = tuple(2.0 ** -bit for _, bit in LS_AT) + (1.0,)


# ---------------------------------------------------------------- repack (load time)

@njit(inline="always")
def ls_of(src, o, j):
    """IQ4_XS sub-block j's unsigned 6-bit scale (block at src[o:])."""
    lo = (u32(src[o + u64(4 + j // 2)]) >> u32(4 * (j % 2))) & u32(15)
    hi = ((u32(src[o + u64(2)]) | (u32(src[o + u64(3)]) << u32(8))) >> u32(2 * j)) & u32(3)
    return lo | hi << u32(4)


@njit(parallel=True, cache=True, error_model="numpy")
def repack_iq4_xs(out, w):
    """out [E, M, row_bytes] <- w (GGUF IQ4_XS bytes, same shape) in the layout above; tail rows copied."""
    E, M, rb = w.shape
    SB, G = rb // SIZE, M // GROUP
    flat, src_flat = out.reshape(E, M * rb), w.reshape(E, M * rb)
    for item in prange(E * G):
        e, g = item // G, item % G
        src = src_flat[e, g * GROUP * rb:(g + 1) * GROUP * rb]     # rows 16g.. as bytes
        dst = flat[e, g * GROUP * rb:(g + 1) * GROUP * rb]
        for b in range(SB):
            rec = u64(b * REC)
            for r in range(GROUP):
                so = u64(r * rb + b * SIZE)
                dst[rec + u64(2 * r)], dst[rec + u64(2 * r + 1)] = src[so], src[so + u64(1)]   # d
                ls7 = ls_of(src, so, 7)
                lw = (ls_of(src, so, 0) | ls_of(src, so, 1) << u32(6) | ls_of(src, so, 2) << u32(12)
                      | ls_of(src, so, 3) << u32(18) | ls_of(src, so, 4) << u32(24) | (ls7 & u32(3)) << u32(30))
                hw = ls_of(src, so, 5) | ls_of(src, so, 6) << u32(6) | (ls7 >> u32(2)) << u32(12)
                for i in range(4):
                    dst[rec + u64(32 + 4 * r + i)] = u8(lw >> u32(8 * i))
                for i in range(2):
                    dst[rec + u64(96 + 2 * r + i)] = u8(hw >> u32(8 * i))
                for j in range(8):
                    for k in range(4):
                        do = rec + u64(HEAD + 64 * (4 * j + k) + 4 * r)
                        for i in range(4):
                            dst[do + u64(i)] = src[so + u64(8 + 16 * j + 4 * k + i)]
    for item in prange(E):
        out[item, G * GROUP:] = w[item, G * GROUP:]


# ---------------------------------------------------------------- decode (plain loops)

@njit(inline="always")
def scale(grp, rec, r, j):
    """ls_j - 32 of row r in the record at byte rec of a group's bytes grp, as float32."""
    lw = u32(grp[rec + u64(32 + 4 * r)]) | u32(grp[rec + u64(33 + 4 * r)]) << u32(8) | \
        u32(grp[rec + u64(34 + 4 * r)]) << u32(16) | u32(grp[rec + u64(35 + 4 * r)]) << u32(24)
    hw = u32(grp[rec + u64(96 + 2 * r)]) | u32(grp[rec + u64(97 + 2 * r)]) << u32(8)
    if j < 5:
        ls = lw >> u32(6 * j)
    elif j < 7:
        ls = hw >> u32(6 * (j - 5))
    else:
        ls = lw >> u32(30) | (hw >> u32(12)) << u32(2)
    return f32(np.int32(ls & u32(63)) - 32)


@njit(inline="always")
def decode_row(out, grp, r):
    """out [K] <- row r of a group's bytes grp (as quants_iq4's decoder)."""
    for b in range(out.shape[0] // 256):
        rec = u64(b * REC)
        d = load_f16(grp, rec + u64(2 * r))
        for j in range(8):
            dl = d * scale(grp, rec, r, j)
            v = block32()
            for k in range(4):
                for i in range(4):
                    q = grp[rec + u64(HEAD + 64 * (4 * j + k) + 4 * r + i)]
                    v[4 * k + i] = dl * KV_IQ4[q & u8(15)]
                    v[16 + 4 * k + i] = dl * KV_IQ4[q >> u8(4)]
            for i in range(32):
                out[u64(256 * b + 32 * j + i)] = v[i]


@njit(cache=True, error_model="numpy")
def dequant_rows_iq4_xs_r16(out, w):
    """out [R, K] <- repacked rows w [R, row_bytes] whose first row starts a group."""
    rb = w.shape[1]
    G = w.shape[0] // GROUP
    flat = w.reshape(w.shape[0] * rb)
    for g in range(G):
        grp = flat[g * GROUP * rb:(g + 1) * GROUP * rb]
        for r in range(GROUP):
            decode_row(out[g * GROUP + r], grp, r)
    if w.shape[0] > G * GROUP:   # the tail keeps the GGUF layout
        dequant_rows_iq4_xs(out[G * GROUP:], w[G * GROUP:])


# ---------------------------------------------------------------- x extras

@njit(inline="always")
def prepare_xk(xk, xd):
    """xk [K / 32] f32 <- xd_j 2^-bit of sub-block j's scale field (see the top)."""
    for b in range(xd.shape[0]):
        xk[b] = xd[b] * f32(XD_SCALE[b % 8])


# ---------------------------------------------------------------- the kernel (IR)

def _emit_record(context, b, sig, args):
    """acc[0:16] += the 16 rows' dots of super-block sb of the group at byte o (see the top)."""
    acc, w, o, xq, xk, xbb, sb = args

    def data(i):
        return arg_data(context, b, sig, args, i)

    def c(v):
        return ir.Constant(I64, v)

    def load(ptr, off, ty):
        return load_at(b, ptr, off, ty)

    def k32(v):
        return const(I32, [v] * 16)

    rec = group_record(b, data(1), o, sb, REC, prefetch=True)
    x = b.gep(data(3), [b.mul(sb, c(256))])
    xk_ = b.gep(data(4), [b.mul(sb, c(8))])
    bias = b.gep(data(5), [b.mul(sb, c(8))])
    v16f, v64 = vec(F32, 16), vec(I8, 64)
    d = b.fpext(load(rec, 0, vec(ir.HalfType(), 16)), v16f)
    W = [load(rec, 32, vec(I32, 16)), b.zext(load(rec, 96, vec(I16, 16)), vec(I32, 16))]

    def signed_scale(v, bit):     # float(ls << bit) - 32 * 2^bit = (ls - 32) 2^bit, exact
        return b.fsub(b.uitofp(v, v16f), const(F32, [32.0 * 2 ** bit] * 16))
    ls = [signed_scale(b.and_(W[word], k32(63 << bit)), bit) for word, bit in LS_AT]
    ls.append(signed_scale(b.or_(b.lshr(W[0], k32(30)), b.and_(b.lshr(W[1], k32(10)), k32(60))), 0))

    def xword(v):           # x codes v..v + 3 of the super-block in all 16 lanes
        return x_word16(b, x, v)
    low = const(I8, [0x0F] * 64)
    terms = []
    for j in range(8):     # two chains a sub-block (low, high nibbles): shorter dependency chains
        lo, hi = splat(b, b.load(b.gep(bias, [c(j)])), 16), ir.Constant(vec(I32, 16), None)
        for k in range(4):
            q = load(rec, HEAD + 64 * (4 * j + k), v64)
            q4 = b.bitcast(b.lshr(b.bitcast(q, vec(I16, 32)), const(I16, [4] * 32)), v64)
            lo = _dot4_init(b, lo, lut(b, _IQ4_U8, b.and_(q, low)), xword(32 * j + 4 * k))
            hi = _dot4_init(b, hi, lut(b, _IQ4_U8, b.and_(q4, low)), xword(32 * j + 16 + 4 * k))
        dot = b.add(lo, hi)
        xs = splat(b, b.load(b.gep(xk_, [c(j)])), 16)
        terms.append(b.fmul(b.fmul(b.sitofp(dot, v16f), ls[j], flags=("contract",)), xs, flags=("contract",)))
    while len(terms) > 1:   # products pair up into FMAs (contract)
        terms = [b.fadd(terms[i], terms[i + 1], flags=("contract",)) for i in range(0, len(terms), 2)]
    ap = b.bitcast(data(0), v16f.as_pointer())
    b.store(b.fadd(b.load(ap, align=4), b.fmul(d, terms[0], flags=("contract",)), flags=("contract",)),
            ap, align=4)


@intrinsic
def acc_record(typingctx, acc, w, o, xq, xk, xbb, sb):
    """acc[0:16] += super-block sb of the 16 rows of the group at byte o of w's data, dotted
    with x: xq [K] codes, xk [K / 32] (prepare_xk), xbb [K / 32] block biases."""
    def codegen(context, builder, sig, args):
        _emit_record(context, builder, sig, args)
        return context.get_dummy_value()
    return types.void(acc, w, o, xq, xk, xbb, sb), codegen


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_iq4_xs_r16(out, w, xq, xd, xs, xb, xk):
    """out [R] <- repacked rows w [R, row_bytes] (first row starts a group) @ x; xb: the plain
    kernel's x record, then the block biases [K / 32]; xk from prepare_xk."""
    SB, G = w.shape[1] // SIZE, w.shape[0] // GROUP
    xbb = xb[xb.shape[0] - 8 * SB:]
    groups_in_streams(acc_record, SB, out, w, G, (xq, xk, xbb))   # groups of GROUP = 16 rows
    if w.shape[0] > G * GROUP:   # the tail keeps the GGUF layout
        dot_rows_i8(IQ4_XS, out[G * GROUP:], w[G * GROUP:], xq, xd, xs, xb, xk)
