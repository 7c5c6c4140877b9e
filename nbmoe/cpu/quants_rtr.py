"""Run-time repacking (-rtr): Q4_0 / Q4_1 / Q8_0 / IQ4_NL / MXFP4 weights rewritten at load time
into groups of 16 rows interleaved block by block, and the integer matrix-vector kernel that
reads them (Q4_K: quants_rtr_k, IQ4_XS: quants_rtr_xs, dispatched from here).

Letters: M rows, K values per row, B = K / 32 blocks per row, G = M // 16 full groups of
16 rows; r = 0..15 a row of its group (= a 32-bit lane of a 512-bit register).

Why: the plain kernels (quants_int8) spend most of a Q4_0 block's cycles on gathering one
row's bytes into a register (nibble shuffles, per-block scale picks): compute-bound. Here one
512-bit load holds 4 values of each of 16 rows, x's 4 codes are broadcast to all 16 lanes,
and one vpdpbusd adds 4 products to each row's int32 lane: no shuffles and no horizontal
sums; the only unpacking is an AND (Q4: q & 0x0F, q & 0xF0). ik_llama.cpp's `-rtr` and its
_R4 / _R8 types rest on the same idea; this layout and code are our own.

Layout. A repacked tensor has the GGUF tensor's shape [..., M, row_bytes] and byte count:
group g (a block of 16 rows) takes the bytes of rows 16g..16g+15, rewritten as

  Q4_0, Q4_1:  qs [B][4][16][4]  then  scales [B][16] f16 d (Q4_1: [B][d 16 | m 16])
  IQ4_NL:      qs [B][4][16][4]  then  scales [B][16] f16 d
  MXFP4:       qs [B][4][16][4]  then  scales [B][16] u8 e (E8M0)
  Q8_0:        qs [B][8][16][4]  then  scales [B][16] f16 d

  qs of block b, 256 bytes (Q8_0: 512), as four (eight) 64-byte vectors k:
      byte  0   1   2   3    4   5   6   7   ...   60  61  62  63
      row   0   0   0   0    1   1   1   1   ...   15  15  15  15
      value 4k .. 4k+3       4k .. 4k+3            4k .. 4k+3
  Q4: the GGUF byte j of a row holds value j (low nibble) and j + 16 (high nibble), so vector
      k & 0x0F gives values 4k..4k+3 of every row and & 0xF0 values 16+4k..16+4k+3 (times 16).
  Q8: the signed codes stored + 128 (w ^ 0x80) so they are unsigned for vpdpbusd.
  IQ4_NL, MXFP4: the nibbles index a table of 16 levels (vpshufb on q & 0x0F, q >> 4 & 0x0F),
      stored + 128 / + 12 so they are unsigned (quants_iq4's tables).

Sizes: Q4_0, IQ4_NL 16 x 18 = 256 + 32, Q4_1 16 x 20 = 256 + 64, MXFP4 16 x 17 = 256 + 16,
Q8_0 16 x 34 = 512 + 32 bytes a block of a group: nothing grows, and with B even (K % 64 == 0)
every qs vector is 64-byte aligned when the tensor is. Rows past the last full group (M % 16) keep the GGUF layout and
go through the plain kernels (the "tail"). A repacked tensor has its own qtype id (R16
below), so every kernel that gets it knows its layout.

Equation (block b of row r; xq, xd, xs from quantize_x, sums = the block's sum of xq):
  Q4_0  d_r * xd_b * (sum_k q_rk xq_k - 8 sums_b)       Q8_0: -128 instead of -8
  Q4_1  d_r * xd_b * sum_k q_rk xq_k + m_r * xs_b
  IQ4_NL, MXFP4  d_r * xd_b * (sum_k (level(q_rk) + bias) xq_k - bias sums_b), bias 128 / 12
The -bias term starts the int32 lanes (xbb[b] = -bias * sums_b, from prepare_blocks or
block_biases), so each block is: 8 vpdpbusd (CHAINS chains), 1 shift + 3 adds, f16 -> f32
scales, 1 mul, 1 FMA (Q4_1 + 1 FMA; the table types + 4 shifts, 4 and, 8 vpshufb). Parallel
over groups of rows (the matmul drivers' work items hold whole groups).

Also here: `repack` (load time, parallel over groups), `dequant_row_r16` (the plain loop:
get_rows, mul_mat_plain, the tests' reference) and `dequant_rows_r16` (the BLAS path's tile
decoder in IR: a 64-byte vector of codes to 64 floats at a time, stored 4 per row; the table
types and the super-block ones by their plain loops).
"""
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from . import quants_rtr_k, quants_rtr_xs
from .quants import (FM, Q4_0, Q4_1, Q8_0, block32, dequant_rows, f32, lanes16, load_f16, store_lanes,
                     stream_rows)
from .quants_int8 import _dot4_init, dot_rows_i8
from .quants_iq4 import _IQ4_U8, _MXFP4_U8, IQ4_NL, IQ4_XS, KV_IQ4, KV_MXFP4, MXFP4, e8m0_half
from .quants_k import Q4_K
from .quants_rtr_k import Q4_K_R16, dequant_rows_q4_k_r16, dot_rows_q4_k_r16
from .quants_rtr_xs import IQ4_XS_R16, dequant_rows_iq4_xs_r16, dot_rows_iq4_xs_r16
from .simd import PREFETCH, load_at, lut, prefetch_lines, splat
from .specialize import ConstantArgs

GROUP = 16
u64 = np.uint64
# Independent int32 chains per block: each chain's vpdpbusd wait on each other (5 cycles
# each), so more chains keep the port busy.
CHAINS = 4
# The repacked layouts' qtype ids (not GGML types) and their GGUF originals (Q4_K: quants_rtr_k).
Q4_0_R16, Q4_1_R16, Q8_0_R16, IQ4_NL_R16, MXFP4_R16 = 1002, 1003, 1008, 1020, 1039
R16 = {Q4_0: Q4_0_R16, Q4_1: Q4_1_R16, Q8_0: Q8_0_R16, Q4_K: Q4_K_R16, IQ4_NL: IQ4_NL_R16, MXFP4: MXFP4_R16,
       IQ4_XS: IQ4_XS_R16}
BASE = {v: k for k, v in R16.items()}
R16_TYPES = tuple(BASE)

_I1, _I8, _I16, _I32, _I64, _F32 = (ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32),
                                    ir.IntType(64), ir.FloatType())


@njit(inline="always")
def layout(qt):
    """(GGUF block bytes, offset of qs in it, group qs bytes per block, group scale bytes per block)."""
    if qt == Q4_0 or qt == IQ4_NL:
        return 18, 2, 256, 32
    if qt == Q4_1:
        return 20, 4, 256, 64
    if qt == MXFP4:
        return 17, 1, 256, 16
    if qt == Q4_K or qt == IQ4_XS:     # (quants_rtr_k, quants_rtr_xs: size only)
        return 144 if qt == Q4_K else 136, 0, 0, 0
    return 34, 2, 512, 32


@njit(inline="always")
def level_bias(qt):
    """The offset of the repacked table types' stored levels (0 for the others)."""
    return 128 if qt == IQ4_NL or qt == IQ4_XS else 12 if qt == MXFP4 else 0


# ---------------------------------------------------------------- repack (load time)

@njit(parallel=True, cache=True, error_model="numpy")
def repack(out, w, qt):
    """out [E, M, row_bytes] <- w (GGUF bytes, same shape) in the layout above; tail rows copied."""
    E, M, rb = w.shape
    size, qo, qb, sb = layout(qt)
    B, G = rb // size, M // GROUP
    flat = out.reshape(E, M * rb)
    flip = np.uint8(0x80 if qt == Q8_0 else 0)
    src_flat = w.reshape(E, M * rb)
    for item in prange(E * G):
        e, g = item // G, item % G
        # unsigned indices: no negative-index fix-up, so LLVM merges the byte moves
        src = src_flat[e, g * GROUP * rb:(g + 1) * GROUP * rb]     # rows 16g.. as bytes
        dst = flat[e, g * GROUP * rb:(g + 1) * GROUP * rb]
        for b in range(B):                                          # written in order
            o, q, s = u64(b * size), u64(b * qb), u64(B * qb + b * sb)
            for k in range(qb // 64):
                for r in range(GROUP):
                    so, do = u64(r * rb) + o + u64(qo + 4 * k), q + u64(64 * k + 4 * r)
                    for i in range(4):
                        dst[do + u64(i)] = src[so + u64(i)] ^ flip
            for r in range(GROUP):
                if qt == MXFP4:                                                       # e
                    dst[s + u64(r)] = src[u64(r * rb) + o]
                    continue
                so, do = u64(r * rb) + o, s + u64(2 * r)
                dst[do], dst[do + u64(1)] = src[so], src[so + u64(1)]                     # d
                if qt == Q4_1:
                    dst[do + u64(32)], dst[do + u64(33)] = src[so + u64(2)], src[so + u64(3)]  # m
    for item in prange(E):
        out[item, G * GROUP:] = w[item, G * GROUP:]


def repack_tensor(w, qtype):
    """A repacked copy of GGUF weights w [..., M, row_bytes] of qtype (a key of R16),
    64-byte aligned, and its qtype id."""
    a = w.reshape((-1,) + w.shape[-2:])
    raw = np.empty(w.nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    out = raw[start:start + w.nbytes].reshape(a.shape)
    if int(qtype) == Q4_K:
        quants_rtr_k.repack_q4_k(out, a)
    elif int(qtype) == IQ4_XS:
        quants_rtr_xs.repack_iq4_xs(out, a)
    else:
        repack(out, a, int(qtype))
    return out.reshape(w.shape), R16[int(qtype)]


# ---------------------------------------------------------------- decode

@njit(inline="always")
def decode_block(qt, v, grp, B, b, r):
    """v [32] <- block b of row r of a group's bytes grp (base type qt), a value at a time."""
    size, qo, qb, sb = layout(qt)
    s = u64(B * qb + b * sb + 2 * r)
    d = e8m0_half(grp[u64(B * qb + b * sb + r)]) if qt == MXFP4 else load_f16(grp, s)
    m = load_f16(grp, s + u64(32)) if qt == Q4_1 else f32(0)
    for k in range(qb // 64):
        for i in range(4):
            q = grp[u64(b * qb + 64 * k + 4 * r + i)]
            if qt == IQ4_NL or qt == MXFP4:
                kv = KV_IQ4 if qt == IQ4_NL else KV_MXFP4
                v[4 * k + i] = d * kv[q & np.uint8(15)]
                v[16 + 4 * k + i] = d * kv[q >> np.uint8(4)]
            elif qt == Q8_0:
                v[4 * k + i] = d * f32(np.int32(q) - 128)
            elif qt == Q4_0:
                v[4 * k + i] = d * (f32(np.int32(q & np.uint8(15))) - f32(8))
                v[16 + 4 * k + i] = d * (f32(np.int32(q >> np.uint8(4))) - f32(8))
            else:
                v[4 * k + i] = d * f32(np.int32(q & np.uint8(15))) + m
                v[16 + 4 * k + i] = d * f32(np.int32(q >> np.uint8(4))) + m


@njit(inline="always")
def group_bytes(w, g):
    """The bytes of group g of w [M, row_bytes], as one 1-D array."""
    rb = w.shape[1]
    return w.reshape(w.shape[0] * rb)[g * GROUP * rb:(g + 1) * GROUP * rb]


def _emit_decode(context, b, sig, args, qt):
    """out[r, 32 blk:32 blk + 32] <- block blk of row r of the group at byte o, r < 16."""
    _, out, K, w, o, B, blk = args
    qb, sb = {Q4_0: (256, 32), Q4_1: (256, 64), Q8_0: (512, 32)}[qt]
    v16f, v64f, v64 = ir.VectorType(_F32, 16), ir.VectorType(_F32, 64), ir.VectorType(_I8, 64)
    half16 = ir.VectorType(ir.HalfType(), 16)

    def c(v):
        return ir.Constant(_I64, v)

    def load(ptr, off, ty):
        return b.load(b.bitcast(b.gep(ptr, [c(off)]), ty.as_pointer()), align=1)

    def per_row(v16):   # <64 x float>: lane j = v16[j // 4]
        return b.shuffle_vector(v16, v16, ir.Constant(ir.VectorType(_I32, 64), [j // 4 for j in range(64)]))

    wd = context.make_array(sig.args[3])(context, b, w).data
    qs = b.gep(wd, [b.add(o, b.mul(blk, c(qb)))])
    sc = b.gep(wd, [b.add(o, b.add(b.mul(B, c(qb)), b.mul(blk, c(sb))))])
    d = per_row(b.fpext(load(sc, 0, half16), v16f))
    m = per_row(b.fpext(load(sc, 32, half16), v16f)) if qt == Q4_1 else None
    od = context.make_array(sig.args[1])(context, b, out).data
    col = b.mul(blk, c(32))
    for k in range(qb // 64):
        q = load(qs, 64 * k, v64)
        if qt == Q8_0:   # stored w ^ 0x80: flip back, signed
            halves = [b.sitofp(b.xor(q, ir.Constant(v64, [-128] * 64)), v64f)]
        else:
            halves = [b.uitofp(b.and_(q, ir.Constant(v64, [15] * 64)), v64f),
                      b.uitofp(b.lshr(q, ir.Constant(v64, [4] * 64)), v64f)]
        for h, v in enumerate(halves):
            if qt == Q4_0:
                v = b.fsub(v, ir.Constant(v64f, [8.0] * 64))
            v = b.fmul(v, d)
            if m is not None:
                v = b.fadd(v, m)
            for r in range(GROUP):   # 4 values of row r
                piece = b.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 4), list(range(4 * r, 4 * r + 4))))
                at = b.add(b.add(b.mul(K, c(r)), col), c(16 * h + 4 * k))
                b.store(piece, b.bitcast(b.gep(od, [at]), ir.VectorType(_F32, 4).as_pointer()), align=4)


@intrinsic
def decode_group_block(typingctx, qt, out, K, w, o, B, blk):
    """out [16, K] (C-contiguous, rows of one group): columns 32 blk.. <- block blk of the
    group at byte o of w's data; B blocks per row; qt a compile-time constant."""
    if not isinstance(qt, types.IntegerLiteral):
        return None

    def codegen(context, builder, sig, args):
        _emit_decode(context, builder, sig, args, qt.literal_value)
        return context.get_dummy_value()
    return types.void(qt, out, K, w, o, B, blk), codegen


@njit(inline="always")
def decode_groups(qt, out, w):
    """out [R, K] <- w [R, row_bytes] (first row starts a group), a group-block per call."""
    size = layout(qt)[0]
    rb = w.strides[0]
    B, G = w.shape[1] // size, w.shape[0] // GROUP
    for g in range(G):
        for b in range(B):
            decode_group_block(qt, out[g * GROUP:(g + 1) * GROUP], out.shape[1], w, g * GROUP * rb, B, b)
    dequant_rows(qt, out[G * GROUP:], w[G * GROUP:])   # the tail keeps the GGUF layout


@njit(cache=True, error_model="numpy")
def _decode_q4_0(out, w):
    decode_groups(Q4_0, out, w)


@njit(cache=True, error_model="numpy")
def _decode_q4_1(out, w):
    decode_groups(Q4_1, out, w)


@njit(cache=True, error_model="numpy")
def _decode_q8_0(out, w):
    decode_groups(Q8_0, out, w)


@njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
def dequant_rows_r16(qtype, out, w):
    """out [R, K] <- repacked rows w [R, row_bytes] whose first row starts a group: the BLAS
    path's decoder (IR, a 64-byte vector at a time); dequant_row_r16 is the plain loop."""
    if qtype == Q4_0_R16:
        _decode_q4_0(out, w)
    elif qtype == Q4_1_R16:
        _decode_q4_1(out, w)
    elif qtype == Q8_0_R16:
        _decode_q8_0(out, w)
    elif qtype == Q4_K_R16:
        dequant_rows_q4_k_r16(out, w)
    elif qtype == IQ4_XS_R16:
        dequant_rows_iq4_xs_r16(out, w)
    else:                    # IQ4_NL, MXFP4: the plain loop, a row at a time
        for r in range(w.shape[0]):
            dequant_row_r16(qtype, out[r], w, r)


@njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
def dequant_row_r16(qtype, out, w, row):
    """out [K] <- row `row` of a whole repacked matrix w [M, row_bytes] (get_rows)."""
    qt = base_of(qtype)
    size = layout(qt)[0]
    B, g = w.shape[1] // size, row // GROUP
    if g < w.shape[0] // GROUP and qt == Q4_K:
        quants_rtr_k.decode_row(out, group_bytes(w, g), row % GROUP)
    elif g < w.shape[0] // GROUP and qt == IQ4_XS:
        quants_rtr_xs.decode_row(out, group_bytes(w, g), row % GROUP)
    elif g < w.shape[0] // GROUP:
        grp = group_bytes(w, g)
        for b in range(B):
            v = block32()
            decode_block(qt, v, grp, B, b, row % GROUP)
            for i in range(32):
                out[u64(b * 32 + i)] = v[i]
    else:
        dequant_rows(qt, out.reshape(1, out.shape[0]), w[row:row + 1])


@njit(inline="always")
def base_of(qtype):
    if qtype == Q4_0_R16 or qtype == Q4_1_R16 or qtype == Q8_0_R16:
        return Q4_0 if qtype == Q4_0_R16 else Q4_1 if qtype == Q4_1_R16 else Q8_0
    if qtype == Q4_K_R16 or qtype == IQ4_XS_R16:
        return Q4_K if qtype == Q4_K_R16 else IQ4_XS
    return IQ4_NL if qtype == IQ4_NL_R16 else MXFP4


@njit(inline="always")
def block_biases(xbb, xq, bias):
    """xbb [B] int32 <- -bias * (sum of xq over each 32-block): the table types' lane starts."""
    for b in range(xbb.shape[0]):
        s = np.int32(0)
        for i in range(32):
            s += np.int32(xq[32 * b + i])
        xbb[b] = -np.int32(bias) * s


# ---------------------------------------------------------------- the kernel

def _emit_group_block(context, b, sig, args, qt):
    """acc[0:16] += the 16 rows' dots of block `blk` of the group at byte o (see the top)."""
    _, acc, w, o, B, xq, xd, xs, xbb, blk = args
    qb, sb = {Q4_0: (256, 32), Q4_1: (256, 64), Q8_0: (512, 32), IQ4_NL: (256, 32), MXFP4: (256, 16)}[qt]

    def data(i):
        return context.make_array(sig.args[i])(context, b, args[i]).data

    def c(v):
        return ir.Constant(_I64, v)

    def load(ptr, off, ty):
        return load_at(b, ptr, off, ty)

    def vconst(ty, value):
        return ir.Constant(ty, [value] * ty.count)

    v64, v16i, v16f = ir.VectorType(_I8, 64), ir.VectorType(_I32, 16), ir.VectorType(_F32, 16)
    qs = b.gep(data(2), [b.add(o, b.mul(blk, c(qb)))])
    sc = b.gep(data(2), [b.add(o, b.add(b.mul(B, c(qb)), b.mul(blk, c(sb))))])
    x = b.gep(data(5), [b.mul(blk, c(32))])
    if PREFETCH:   # the qs stream, and the scale stream at the same distance in blocks
        prefetch_lines(b, [b.gep(qs, [c(PREFETCH + off)]) for off in range(0, qb, 64)]
                       + [b.gep(sc, [c(PREFETCH * sb // qb)])])

    def xword(k):   # x codes 4k..4k+3 of the block in all 16 lanes
        return b.bitcast(splat(b, load(x, 4 * k, _I32), 16), v64)

    zero = ir.Constant(v16i, None)
    init = zero if qt == Q4_1 else splat(b, b.load(b.gep(data(8), [blk])), 16)
    nc = CHAINS
    if qt == Q8_0:   # separate chains shorten the dependent vpdpbusd latency
        ch = [init] + [zero] * (nc - 1)
        for k in range(8):
            ch[k % nc] = _dot4_init(b, ch[k % nc], load(qs, 64 * k, v64), xword(k))
        while len(ch) > 1:
            ch = [b.add(ch[i], ch[i + 1]) for i in range(0, len(ch), 2)]
        dot = ch[0]
    elif qt in (IQ4_NL, MXFP4):   # levels + bias of the low nibbles (values 4k..), the high (16 + 4k..)
        table = _IQ4_U8 if qt == IQ4_NL else _MXFP4_U8
        ch = [init] + [zero] * (nc - 1)
        for k in range(4):
            q = load(qs, 64 * k, v64)
            hi4 = b.bitcast(b.lshr(b.bitcast(q, ir.VectorType(ir.IntType(16), 32)), vconst(ir.VectorType(
                ir.IntType(16), 32), 4)), v64)
            lo = lut(b, table, b.and_(q, vconst(v64, 0x0F)))
            hi = lut(b, table, b.and_(hi4, vconst(v64, 0x0F)))
            ch[(2 * k) % nc] = _dot4_init(b, ch[(2 * k) % nc], lo, xword(k))
            ch[(2 * k + 1) % nc] = _dot4_init(b, ch[(2 * k + 1) % nc], hi, xword(4 + k))
        while len(ch) > 1:
            ch = [b.add(ch[i], ch[i + 1]) for i in range(0, len(ch), 2)]
        dot = ch[0]
    else:            # low nibbles: values 4k.., high nibbles (x 16): values 16 + 4k..
        h = nc // 2
        lo, hi = [init] + [zero] * (h - 1), [zero] * h
        for k in range(4):
            q = load(qs, 64 * k, v64)
            lo[k % h] = _dot4_init(b, lo[k % h], b.and_(q, vconst(v64, 0x0F)), xword(k))
            hi[k % h] = _dot4_init(b, hi[k % h], b.and_(q, vconst(v64, -16)), xword(4 + k))   # 0xF0
        while len(lo) > 1:
            lo, hi = [b.add(lo[0], lo[1])] + lo[2:], [b.add(hi[0], hi[1])] + hi[2:]
        dot = b.add(lo[0], b.ashr(hi[0], vconst(v16i, 4)))
    half16 = ir.VectorType(ir.HalfType(), 16)
    if qt == MXFP4:  # 2^(e - 128) as quants_iq4.e8m0_half (a denormal for e < 2)
        e = b.zext(load(sc, 0, ir.VectorType(_I8, 16)), v16i)
        small = b.shl(vconst(v16i, 0x00200000), e)
        big = b.shl(b.sub(e, vconst(v16i, 1)), vconst(v16i, 23))
        d = b.bitcast(b.select(b.icmp_unsigned("<", e, vconst(v16i, 2)), small, big), v16f)
    else:
        d = b.fpext(load(sc, 0, half16), v16f)
    s = b.fmul(d, splat(b, b.load(b.gep(data(6), [blk])), 16))
    term = b.fmul(b.sitofp(dot, v16f), s, flags=("contract",))
    if qt == Q4_1:
        m = b.fpext(load(sc, 32, half16), v16f)
        term = b.fadd(term, b.fmul(m, splat(b, b.load(b.gep(data(7), [blk])), 16), flags=("contract",)),
                      flags=("contract",))
    ap = b.bitcast(data(1), v16f.as_pointer())
    b.store(b.fadd(b.load(ap, align=4), term, flags=("contract",)), ap, align=4)


@intrinsic
def acc_group(typingctx, qt, acc, w, o, B, xq, xd, xs, xbb, blk):
    """acc[0:16] += block blk of the 16 rows of the group at byte o of w's data, dotted with x;
    qt (Q4_0 / Q4_1 / Q8_0 / IQ4_NL / MXFP4) a compile-time constant; B blocks per row; x: xq [K],
    xd [B], xs [B] (Q4_1), xbb [B] int32 block biases (the others)."""
    if not isinstance(qt, types.IntegerLiteral):
        return None

    def codegen(context, builder, sig, args):
        _emit_group_block(context, builder, sig, args, qt.literal_value)
        return context.get_dummy_value()
    return types.void(qt, acc, w, o, B, xq, xd, xs, xbb, blk), codegen


@njit(inline="always")
def dot_groups(qt, out, w, xq, xd, xs, xb, xds):
    """out [R] <- repacked rows w [R, row_bytes] (first row starts a group) @ x; xb holds the
    plain kernel's x extras and then the block biases [B] (prepare_blocks)."""
    size = layout(qt)[0]
    rb = w.strides[0]
    B = w.shape[1] // size
    G = w.shape[0] // GROUP
    xbb = xb[xb.shape[0] - B:]
    gb = GROUP * rb                                  # bytes of a group
    H = stream_rows(G, gb)                           # groups in four streams, as rows_in_streams
    for g in range(H):
        a0, a1, a2, a3 = lanes16(), lanes16(), lanes16(), lanes16()
        for b in range(B):
            acc_group(qt, a0, w, g * gb, B, xq, xd, xs, xbb, b)
            acc_group(qt, a1, w, (g + H) * gb, B, xq, xd, xs, xbb, b)
            acc_group(qt, a2, w, (g + 2 * H) * gb, B, xq, xd, xs, xbb, b)
            acc_group(qt, a3, w, (g + 3 * H) * gb, B, xq, xd, xs, xbb, b)
        for i, a in enumerate((a0, a1, a2, a3)):
            store_lanes(out, (g + i * H) * GROUP, a)
    for g in range(4 * H, G):
        acc = lanes16()
        for b in range(B):
            acc_group(qt, acc, w, g * gb, B, xq, xd, xs, xbb, b)
        store_lanes(out, g * GROUP, acc)
    if w.shape[0] > G * GROUP:   # the tail keeps the GGUF layout (constant qt: its branch alone)
        dot_rows_i8(qt, out[G * GROUP:], w[G * GROUP:], xq, xd, xs, xb, xds)


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q4_0_r16(out, w, xq, xd, xs, xb, xds):
    dot_groups(Q4_0, out, w, xq, xd, xs, xb, xds)


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q4_1_r16(out, w, xq, xd, xs, xb, xds):
    dot_groups(Q4_1, out, w, xq, xd, xs, xb, xds)


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q8_0_r16(out, w, xq, xd, xs, xb, xds):
    dot_groups(Q8_0, out, w, xq, xd, xs, xb, xds)


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_iq4_nl_r16(out, w, xq, xd, xs, xb, xds):
    dot_groups(IQ4_NL, out, w, xq, xd, xs, xb, xds)


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_mxfp4_r16(out, w, xq, xd, xs, xb, xds):
    dot_groups(MXFP4, out, w, xq, xd, xs, xb, xds)


@njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
def dot_rows_r16(qtype, out, w, xq, xd, xs, xb, xds):
    """out [R] <- repacked rows w [R, row_bytes] (first row starts a group) @ x."""
    if qtype == Q4_0_R16:
        dot_rows_q4_0_r16(out, w, xq, xd, xs, xb, xds)
    elif qtype == Q4_1_R16:
        dot_rows_q4_1_r16(out, w, xq, xd, xs, xb, xds)
    elif qtype == Q8_0_R16:
        dot_rows_q8_0_r16(out, w, xq, xd, xs, xb, xds)
    elif qtype == Q4_K_R16:   # xds: quants_rtr_k.prepare_xk's x scales
        dot_rows_q4_k_r16(out, w, xq, xd, xs, xb, xds)
    elif qtype == IQ4_NL_R16:
        dot_rows_iq4_nl_r16(out, w, xq, xd, xs, xb, xds)
    elif qtype == MXFP4_R16:
        dot_rows_mxfp4_r16(out, w, xq, xd, xs, xb, xds)
    elif qtype == IQ4_XS_R16:   # xds: quants_rtr_xs.prepare_xk's x scales
        dot_rows_iq4_xs_r16(out, w, xq, xd, xs, xb, xds)
