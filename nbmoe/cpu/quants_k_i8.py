"""Integer dots of the K-quants (Q2_K..Q6_K) against the 8-bit x of quants_int8.quantize_x.

Layouts: quants_k.py. Letters: K values in a row, SB = K / 256 super-blocks; x given as xq [K]
int8 codes, xd [K / 32] scales, xs [K / 32] = xd * block sums of xq (quants_int8).

One super-block per intrinsic call, written in LLVM IR with simd.Emit. A super-block is 8
x-blocks. 64 codes (unsigned) and 64 bytes of xq make one u8 x s8 dot (vpdpbusd, 512 bits) of
16 int32 lanes; lane k covers values 4k..4k+3, so lanes 8s.. belong to sub-block s and lanes
4g.. to group g of 16: per-lane float scales s = d * sc * xd apply a 64-value product's
scales with one FMA, no horizontal sums:
    out[r] = sum over lanes of float(dot(codes, xq)) * s[lane]  + offsets
Offsets (the Q2_K / Q4_K / Q5_K mins, the -4 / -32 of the Q3_K / Q6_K codes, stored + 4 / + 32
to make them unsigned) multiply sums of x: xs for 32-groups, xs16 (per-16 sums, made once per
call by sums16) for 16-groups, as ggml's q8_K bsums. Codes are unpacked from one broadcast
load shifted per 16-bit lane by two counts (vpsrlvw), e.g. a Q5_K chunk's low nibbles in the
first 32 bytes and high nibbles in the last 32. Q4_K instead reads its 128 code bytes as they
lie, 64 at a time, and meets x rearranged once per call (prepare_q4_k):

  qs bytes 64p .. 64p + 63 (p = 0, 1): byte i holds values 128p + 64(i // 32) + i % 32 (low
  nibble) and the same + 32 (high nibble), so per 256 values
      xk = [x 0:32 | x 64:96 | x 32:64 | x 96:128 | x 128:160 | x 192:224 | x 160:192 | x 224:256]
  lanes of dot(low nibbles, xk[128p:]): 0-7 sub-block 4p, 8-15 sub-block 4p + 2;
  of dot(high nibbles, xk[128p + 64:]): 4p + 1, 4p + 3.

That saves the broadcasts and variable shifts (one and, one shift, one and per 64 bytes), and
its four products go into acc one FMA each (simd.Emit.finish chain). Each call prefetches
simd.PREFETCH bytes ahead.
Parallelized by the caller (matmul) over runs of rows.
"""
import numpy as np
from llvmlite import ir
from numba import carray, njit

from .quants import FM, f32, rows_in_streams, stack_f32
from .quants_k import Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
from .simd import F32, I8, I32, acc_intrinsic, const, copy16, vec
from .specialize import ConstantArgs

u64 = np.uint64


# ---------------------------------------------------------------- IR bodies
# e: a simd.Emit for super-block b of a row. s: per-sub-block or per-group float scales
# d * sc * xd; GROUPS(c): lane -> 16-group for the 64 values 64c.. (lane k: values 4k..4k+3).

def _groups(c):
    return [4 * c + k // 4 for k in range(16)]


def _subs(c):
    return [2 * c] * 8 + [2 * c + 1] * 8


def _words(e, *ws):
    """i32 scalars -> the <4n x i8> vector of their bytes."""
    return e.b.bitcast(e.pack(*ws), ir.VectorType(ir.IntType(8), 4 * len(ws)))


def _k_head(e):
    """Q4_K / Q5_K: d, dmin and the 12 scale bytes (one 16-byte load) -> <16 x float>:
    lane j < 8 the scale d * sc_j * xd_j of sub-block j, lane 8 + j its min term
    -dmin * m_j * xs_j. The 6-bit unpack as ggml's, on 32-bit lanes [d|dmin, a, m, h]."""
    b = e.b

    def c(*v):
        return const(I32, v if len(v) == 4 else v * 4)
    v = b.bitcast(e.bytes(0, 16), vec(I32, 4))
    lo = b.and_(v, c(0x3F3F3F3F))                                     # lanes 1, 2: sc 0..3, m 0..3
    top = b.and_(b.lshr(e.pick(v, [3, 3, 3, 3]), c(0, 0, 4, 0)), c(0x0F0F0F0F))
    hi = b.or_(top, b.and_(b.lshr(v, c(2)), c(0x30303030)))           # lanes 1, 2: sc 4..7, m 4..7
    scm = b.bitcast(b.shuffle_vector(lo, hi, const(I32, [1, 5, 2, 6])), vec(I8, 16))
    dd = b.fpext(b.bitcast(e.pick(v, [0]), vec(ir.HalfType(), 2)), vec(F32, 2))
    sign = const(F32, [1.0] * 8 + [-1.0] * 8)
    return e.mul(e.pick(dd, [0] * 8 + [1] * 8), sign, e.tofloat(scm, signed=False), e.cat(e.xd(8), e.xs(8)))


def _nibbles64(e, off):
    """<64 x i8>: the low nibbles of the 32 bytes at off, then their high nibbles."""
    q = e.bytes(off, 32)
    return e.band(e.shr16(e.cat(q, q), [0] * 16 + [4] * 16), 15)


def _xd16(e):
    """<16 x float>: the x scale of each 16-group of the super-block."""
    return e.pick(e.xd(8), [g // 2 for g in range(16)])


def _twice(e, off):
    """<64 x i8>: the 32 bytes at off, twice (one broadcast load); shr16 / shl16 by
    [a] * 16 + [b] * 16 then take different bits from each copy."""
    q = e.bytes(off, 32)
    return e.cat(q, q)


def _q2_k(e):
    sb = e.bytes(0, 16)
    d, dmin = e.splat(e.f16(80), 16), e.splat(e.f16(82), 16)
    s = e.mul(d, e.tofloat(e.band(sb, 15), signed=False), _xd16(e))
    e.add(e.b.fneg(e.mul(dmin, e.tofloat(e.shr(sb, 4), signed=False), e.xs(16))))
    for h in range(2):
        qs = _twice(e, 16 + 32 * h)
        for k in range(2):                            # bits 4k of the 32 bytes, then bits 4k + 2
            codes = e.band(e.shr16(qs, [4 * k] * 16 + [4 * k + 2] * 16), 3)
            e.acc_dot(codes, e.xq(128 * h + 64 * k), s, _groups(2 * h + k))


def _q3_k(e):
    b, c = e.b, lambda v: ir.Constant(I32, v)
    lo, mid, top = e.word(96), e.word(100), e.word(104)

    def word(low, shift_low, shift_top):  # 4 scales: low nibbles | top crumbs << 4
        nib = b.and_(b.lshr(low, c(shift_low)), c(0x0F0F0F0F))
        return b.or_(nib, b.shl(b.and_(b.lshr(top, c(shift_top)), c(0x03030303)), c(4)))
    sc = _words(e, word(lo, 0, 0), word(mid, 0, 2), word(lo, 4, 4), word(mid, 4, 6))
    sc = e.b.fsub(e.tofloat(sc, signed=False), e.fconst(32, 16))
    ds = e.mul(e.splat(e.f16(108), 16), sc)
    s = e.mul(ds, _xd16(e))
    e.add(e.mul(ds, e.xs(16), e.fconst(-4, 16)))   # codes are q + 4
    hm = _twice(e, 0)
    for h in range(2):
        qs = _twice(e, 32 + 32 * h)
        for k in range(2):
            bit = 4 * h + 2 * k                       # the hmask bits of these 64 values: bit, bit + 1
            low = e.band(e.shr16(qs, [4 * k] * 16 + [4 * k + 2] * 16), 3)
            high = e.shl(e.band(e.shr16(hm, [bit] * 16 + [bit + 1] * 16), 1), 2)
            e.acc_dot(e.b.or_(low, high), e.xq(128 * h + 64 * k), s, _groups(2 * h + k))


def _q4_k(e):
    """e.xq: prepare_q4_k's xk (see the top)."""
    s = _k_head(e)
    e.add(e.keep(s, [0] * 8 + [1] * 8))                              # the mins
    for p in range(2):
        lo, hi = e.nibbles(e.bytes(16 + 64 * p, 64))
        e.acc_dot(lo, e.xq(128 * p), s, [4 * p] * 8 + [4 * p + 2] * 8)
        e.acc_dot(hi, e.xq(128 * p + 64), s, [4 * p + 1] * 8 + [4 * p + 3] * 8)


def _q5_k(e):
    s = _k_head(e)
    e.add(e.keep(s, [0] * 8 + [1] * 8))
    qh = e.bytes(16, 32)
    for c in range(4):
        top = e.cat(e.flag(qh, 1 << (2 * c), 16), e.flag(qh, 2 << (2 * c), 16))
        e.acc_dot(e.b.or_(_nibbles64(e, 48 + 32 * c), top), e.xq(64 * c), s, _subs(c))


def _q6_k(e):
    ds = e.mul(e.splat(e.f16(208), 16), e.tofloat(e.bytes(192, 16)))
    s = e.mul(ds, _xd16(e))
    e.add(e.mul(ds, e.xs(16), e.fconst(-32, 16)))  # codes are q + 32
    for h in range(2):
        ql = e.nibbles(e.bytes(64 * h, 64))
        qh = _twice(e, 128 + 32 * h)                  # top bits: 0-1 and 2-3 (k = 0), 4-5 and 6-7
        tops = (e.band(e.shl16(qh, [4] * 16 + [2] * 16), 0x30), e.band(e.shr16(qh, [0] * 16 + [2] * 16), 0x30))
        for k in range(2):
            e.acc_dot(e.b.or_(ql[k], tops[k]), e.xq(128 * h + 64 * k), s, _groups(2 * h + k))


acc_q2_k = acc_intrinsic(_q2_k, 256, 16, 84)
acc_q3_k = acc_intrinsic(_q3_k, 256, 16, 110)
acc_q4_k = acc_intrinsic(_q4_k, 256, 8, 144, chain=True)
acc_q5_k = acc_intrinsic(_q5_k, 256, 8, 176)
acc_q6_k = acc_intrinsic(_q6_k, 256, 16, 210)


# ---------------------------------------------------------------- rows

@njit(cache=True, error_model="numpy")
def prepare_q4_k(xk, xq):
    """xk [K] int8 <- xq in the Q4_K code order (the top): per 128 values, the 32-value
    pieces 0, 2, 1, 3."""
    for h in range(u64(xq.shape[0] // 128)):
        for piece in range(u64(4)):
            src = u64(128) * h + u64(32) * (piece // u64(2) + u64(2) * (piece % u64(2)))
            dst = u64(128) * h + u64(32) * piece
            copy16(xk, dst, xq, src)
            copy16(xk, dst + u64(16), xq, src + u64(16))


_stack_f32x1024 = stack_f32(1024)


@njit(inline="always")
def sums16(xq, xd):
    """xs16 [K / 16] = xd * (sum of xq over each 16 values): the 16-groups' x sums. On the
    caller's stack up to K = 16384 (a heap array per call costs as much as 20 rows of 768)."""
    n = xq.shape[0] // 16
    out = carray(_stack_f32x1024(), 1024)[:n] if n <= 1024 else np.empty(n, np.float32)
    for g in range(n):
        s = np.int32(0)
        for i in range(16):
            s += np.int32(xq[16 * g + i])
        out[g] = xd[g // 2] * f32(s)
    return out


@njit(inline="always")
def superblock_bytes(qt):
    return 144 if qt == Q4_K else 210 if qt == Q6_K else 176 if qt == Q5_K else 110 if qt == Q3_K else 84


@njit(inline="always")
def dot_rows_k(qt, out, w, xq, xd, xs):
    """out [R] <- w [R, row_bytes] @ x for K-quant qt (a constant), rows in four streams
    (quants.rows_in_streams); each row's super-blocks form one chain of dependent adds, so
    the four rows side by side also overlap four chains."""
    size = superblock_bytes(qt)
    nb = w.shape[1] // size
    if qt == Q4_K:
        rows_in_streams(acc_q4_k, size, nb, out, w, xq, xd, xs)
    elif qt == Q6_K:
        rows_in_streams(acc_q6_k, size, nb, out, w, xq, xd, xs)
    elif qt == Q5_K:
        rows_in_streams(acc_q5_k, size, nb, out, w, xq, xd, xs)
    elif qt == Q3_K:
        rows_in_streams(acc_q3_k, size, nb, out, w, xq, xd, xs)
    else:
        rows_in_streams(acc_q2_k, size, nb, out, w, xq, xd, xs)


# xs: the 32-groups' sums (Q4_K, Q5_K: per sub-block mins) or the 16-groups' (sums16)
@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q2_k_i8(out, w, xq, xd, xs):
    dot_rows_k(Q2_K, out, w, xq, xd, sums16(xq, xd))


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q3_k_i8(out, w, xq, xd, xs):
    dot_rows_k(Q3_K, out, w, xq, xd, sums16(xq, xd))


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q4_k_i8(out, w, xk, xd, xs):
    """xk: prepare_q4_k's x."""
    dot_rows_k(Q4_K, out, w, xk, xd, xs)


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q5_k_i8(out, w, xq, xd, xs):
    dot_rows_k(Q5_K, out, w, xq, xd, xs)


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q6_k_i8(out, w, xq, xd, xs):
    dot_rows_k(Q6_K, out, w, xq, xd, sums16(xq, xd))


# ---------------------------------------------------------------- dispatch (from quants_int8.py)

@njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
def dot_rows_k_i8(qtype, out, w, xq, xd, xs, xb):
    """xb: prepare_blocks' x extras (Q4_K: prepare_q4_k's xk as int32 words)."""
    if qtype == Q4_K:
        dot_rows_q4_k_i8(out, w, xb[:xq.shape[0] // 4].view(np.int8), xd, xs)
    elif qtype == Q6_K:
        dot_rows_q6_k_i8(out, w, xq, xd, xs)
    elif qtype == Q5_K:
        dot_rows_q5_k_i8(out, w, xq, xd, xs)
    elif qtype == Q3_K:
        dot_rows_q3_k_i8(out, w, xq, xd, xs)
    elif qtype == Q2_K:
        dot_rows_q2_k_i8(out, w, xq, xd, xs)
