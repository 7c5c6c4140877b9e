"""Integer block dot products: x quantized to 8 bits, weights kept as their integer codes.

The matrix-vector fast path for the block types (ggml's vec_dot_q4_0_q8_0 and friends),
used when matmul.INT8_DOT is on. Letters: K values in a row, B = K / 32 blocks, x the float32 activation row [K].

x is quantized once per token like a Q8_0 block (quantize_x): xq[k] = round(x[k] / xd[b]),
xd[b] = max|x in block b| / 127, and xs[b] = xd[b] * sum(xq in block b). A weight block with
integer codes q, scale d and offset m (v = d * q + m) then contributes
    sum_k v[k] * xq[k] * xd[b] = d * xd[b] * sum_k q[k] * xq[k] + m * xs[b]
and the integer sum is one u8 x s8 dot product of 32 bytes. Codes must be unsigned for that
instruction: nibbles (Q4_*) and 5-bit codes (Q5_*) already are, with the -8 / -16 of the
symmetric types folded into m = -8 d / -16 d; Q8_0's signed codes are stored + 128
(w ^ 0x80) and m = -128 d.

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (acc_blocks, dot_rows_b32), in LLVM IR written here (an
intrinsic; Numba cannot express vector code). These blocks are small (18-34 bytes), so the
per-block work decides their speed. A call takes 4 blocks (a pair, a single one at a row's
end) and two rows run side by side (their calls share the x loads and overlap):
  codes of blocks j, j + 1 -> one <64 x u8> (Q4 / Q5: [qs_j, qs_j, qs_j+1, qs_j+1] shifted by
  [0, 4, 0, 4] per 16 bytes, & 15; Q5: | 16 where bit k of [qh_j, qh_j+1] (a 64-bit mask) is
  set; Q8_0: xor 0x80) -> one 512-bit dot4, its 16 lanes started at xb, the x-side bias
  -8 / -16 / -128 * (sum of the lane's 4 xq) (Q4_0 / Q5_0 / Q8_0, lane_bias), so no
  per-block offset remains -> float lanes * [s_j] * 8 + [s_j+1] * 8, s = d * xd;
  Q4_1 / Q5_1 take their m * xs terms from the same f16 load as d ([d, m] * [xd, xs], xds).
A call adds one sum to acc (16 float lanes on the caller's stack, kept in a register; one
add per 4 blocks on the loop-carried chain); sum16 reduces it once per row.
dot4 is `vpdpbusd` (AVX-512 VNNI) where the CPU has it, else plain widen-multiply-add IR
that LLVM turns into pmaddwd + phaddd code (no faster than the float dots): same results.
Error vs float x: about 0.5-1% of the largest output (the 8-bit x), as in llama.cpp.

Q4_0 on CPUs with AVX-512 BW takes quants_q4x instead (the row read as it lies, x laid out
under it: less compute); its block kernel here stays for the others. The 4-bit table
types (quants_iq4) and Q4_K (quants_k_i8) also read x rearranged: prepare_blocks makes each
type's x extras once per call (x_extra_words sizes them).

Adding a 32-value block type = its unpack in _emit_blocks, block_bytes / lane_bias entries,
its dot_rows_<type>, a branch in dot_rows_i8 (larger blocks: simd.acc_intrinsic).
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import quants_iq4, quants_iq_i8, quants_k_i8, quants_q4x
from .quants_k import Q4_K
from .simd import HAS_VNNI, PREFETCH, prefetch_lines
from .specialize import ConstantArgs
from .quants import (FM, IQ4_TYPES, IQ_TYPES, K_TYPES, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, f32, lanes16, stream_rows,
                     sum16)

# The block types with an integer dot product here.
INT8_TYPES = (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) + K_TYPES + IQ4_TYPES  # the last two: quants_k_i8, quants_iq4
INT8_TYPES += IQ_TYPES  # the grid IQ types: quants_iq_i8

_I1, _I8, _I32, _I64, _F32 = ir.IntType(1), ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
_V16I8, _V32I8 = ir.VectorType(_I8, 16), ir.VectorType(_I8, 32)


# ---------------------------------------------------------------- Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (see the top)
# bytes per block, offset of qs, offset of qh (the 5th bits of Q5_*)
_BLOCK = {Q4_0: (18, 2, 0), Q4_1: (20, 4, 0), Q8_0: (34, 2, 0), Q5_0: (22, 6, 2), Q5_1: (24, 8, 4)}
_V16F, _V16I32, _V64I8 = ir.VectorType(_F32, 16), ir.VectorType(_I32, 16), ir.VectorType(_I8, 64)


def _vconst(ty, values):
    """A constant vector of ty's element type (byte values >= 128 written as negative)."""
    w = ty.element.width if isinstance(ty.element, ir.IntType) else 0
    return ir.Constant(ty, [v - (1 << w) if w and v >= 1 << (w - 1) else v for v in values])


def _pick(builder, v, idx):
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, len(idx)), list(idx)))


def _dot4_init(builder, init, codes, xq):
    """init + dot4(codes, xq): 16 or 8 int32 lanes (vpdpbusd adds to its first operand)."""
    n = codes.type.count
    v32 = ir.VectorType(_I32, n // 4)
    if HAS_VNNI:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v32, [v32] * 3),
                                            f"llvm.x86.avx512.vpdpbusd.{8 * n}")
        return builder.call(fn, [init, builder.bitcast(codes, v32), builder.bitcast(xq, v32)])
    p = builder.mul(builder.zext(codes, ir.VectorType(_I32, n)), builder.sext(xq, ir.VectorType(_I32, n)))
    for m in (n // 2, n // 4):
        p = builder.add(_pick(builder, p, range(0, 2 * m, 2)), _pick(builder, p, range(1, 2 * m, 2)))
    return builder.add(p, init)


def _emit_blocks(context, builder, sig, args, qt, n):
    """acc[0:16] += the dots of blocks b..b + n - 1 of one row (see acc_blocks)."""
    b = builder
    size, qs, qh = _BLOCK[qt]
    dm_word = qt == Q4_1 or qt == Q5_1                    # [d, m] f16 pair, v = d * q + m

    def data(i, offset=None, scale=1):
        base = context.make_array(sig.args[i])(context, b, args[i]).data
        return b.gep(base, [b.mul(offset, ir.Constant(offset.type, scale)) if scale != 1 else offset])

    def load(ptr, off, ty):
        p = b.gep(ptr, [ir.Constant(_I64, off)]) if off else ptr
        return b.load(b.bitcast(p, ty.as_pointer()), align=1)

    blk = args[9]
    row, xq = data(3, args[4]), data(5, blk, 32)
    if PREFETCH:
        prefetch_lines(b, [b.gep(row, [ir.Constant(_I64, off)])
                           for off in range(PREFETCH, PREFETCH + n * size, 64)])
    # per-block float scales s[j] = d_j * xd_j (and Q4_1 / Q5_1's m_j * xs_j, kept in odd lanes)
    terms = []
    half = ir.HalfType()
    if dm_word:
        dm = [load(row, j * size, _I32) for j in range(n)]           # [d, m] as one word
        v = ir.Constant(ir.VectorType(_I32, n), None)
        for j, w in enumerate(dm):
            v = b.insert_element(v, w, ir.Constant(_I32, j))
        dm = b.fpext(b.bitcast(v, ir.VectorType(half, 2 * n)), ir.VectorType(_F32, 2 * n))
        ps = b.fmul(dm, load(data(8, blk, 2), 0, ir.VectorType(_F32, 2 * n)))
        s = _pick(b, ps, range(0, 2 * n, 2))
        terms.append(b.select(_vconst(ir.VectorType(ir.IntType(1), 2 * n), [0, 1] * n), ps,
                              ir.Constant(ps.type, None)))
    else:
        v = ir.Constant(ir.VectorType(ir.IntType(16), n), None)
        for j in range(n):
            v = b.insert_element(v, load(row, j * size, ir.IntType(16)), ir.Constant(_I32, j))
        d = b.fpext(b.bitcast(v, ir.VectorType(half, n)), ir.VectorType(_F32, n))
        s = b.fmul(d, load(data(6, blk), 0, ir.VectorType(_F32, n)))
    xb = data(7, blk, 8)
    for j in range(0, n, 2):
        pair = j + 1 < n                                   # blocks j, j + 1: one 512-bit dot
        m = 64 if pair else 32
        if qt == Q8_0:
            q = load(row, j * size + qs, _V32I8)
            if pair:
                q = b.shuffle_vector(q, load(row, (j + 1) * size + qs, _V32I8),
                                     ir.Constant(ir.VectorType(_I32, 64), list(range(64))))
            codes = b.xor(q, _vconst(q.type, [0x80] * m))
        else:
            q0 = load(row, j * size + qs, _V16I8)
            q1 = load(row, (j + 1) * size + qs, _V16I8) if pair else q0
            idx = [*range(16), *range(16), *range(16, 32), *range(16, 32)][:m]
            q = b.shuffle_vector(q0, q1, ir.Constant(ir.VectorType(_I32, m), idx))
            w16 = b.bitcast(q, ir.VectorType(ir.IntType(16), m // 2))
            w16 = b.lshr(w16, _vconst(w16.type, ([0] * 8 + [4] * 8) * (m // 32)))
            codes = b.and_(b.bitcast(w16, q.type), _vconst(q.type, [15] * m))
            if qh:                                         # + 16 where bit k of qh is set
                h = load(row, j * size + qh, _I32)
                if pair:                                   # block j's bits 0..31, j + 1's 32..63
                    h = b.or_(b.zext(h, _I64), b.shl(b.zext(load(row, (j + 1) * size + qh, _I32), _I64),
                                                     ir.Constant(_I64, 32)))
                bits = b.bitcast(h, ir.VectorType(_I1, m))
                codes = b.or_(codes, b.select(bits, _vconst(q.type, [16] * m), ir.Constant(q.type, None)))
        lanes = ir.VectorType(_I32, m // 4)
        init = ir.Constant(lanes, None) if dm_word else load(xb, 8 * j, lanes)
        dot = b.sitofp(_dot4_init(b, init, codes, load(xq, 32 * j, ir.VectorType(_I8, m))),
                       ir.VectorType(_F32, m // 4))
        terms.append(b.fmul(dot, _pick(b, s, [j] * 8 + [j + 1] * 8 if pair else [j] * 8), flags=("contract",)))
    padded = []
    for t in terms:                                        # to 16 lanes
        k = t.type.count
        if k < 16:
            t = b.shuffle_vector(t, ir.Constant(t.type, None),
                                 ir.Constant(ir.VectorType(_I32, 16), list(range(k)) + [k] * (16 - k)))
        padded.append(t)
    while len(padded) > 1:                                 # a tree: products pair up into FMAs
        padded = [b.fadd(padded[i], padded[i + 1], flags=("contract",))
                  for i in range(0, len(padded) - 1, 2)] + padded[len(padded) // 2 * 2:]
    ap = b.bitcast(data(2, ir.Constant(_I64, 0)), _V16F.as_pointer())
    b.store(b.fadd(b.load(ap, align=4), padded[0], flags=("contract",)), ap, align=4)


@intrinsic
def acc_blocks(typingctx, qt, n, acc, w, o, xq, xd, xb, xds, b):
    """acc[0:16] += sum over j < n of block b + j (at byte o + j * size of w's data) . x, for
    qt in Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 and n in 1, 2, 4, both compile-time constants.
    x: xq [K], xd [B], xb [K / 4] (Q4_0, Q5_0, Q8_0) and xds [2B] (Q4_1, Q5_1) from prepare_blocks."""
    if not (isinstance(qt, types.IntegerLiteral) and isinstance(n, types.IntegerLiteral)):
        return None

    def codegen(context, builder, sig, args):
        _emit_blocks(context, builder, sig, args, qt.literal_value, n.literal_value)
        return context.get_dummy_value()
    return types.void(qt, n, acc, w, o, xq, xd, xb, xds, b), codegen


# ---------------------------------------------------------------- x -> 8-bit blocks

_ROUND = f32(12582912.0)
u64 = np.uint64


@njit(cache=True, error_model="numpy")
def quantize_x(xq, xd, xs, x):
    """x [K] -> xq [K] int8, xd [B] scales, xs [B] = xd * block sums of xq (see the top).
    max|x| is taken on the float bits (x & 0x7fffffff as int32: same order for |x|, and NaN
    patterns sort above inf, so a NaN sticks: xd = NaN, NaN in x gives NaN out): integer
    loops that LLVM vectorizes (the float compare-and-NaN-check loop stayed scalar)."""
    B = x.shape[0] // 32
    bits, top = x.view(np.int32), xd.view(np.int32)
    for b in range(B):
        m = np.int32(0)
        for i in range(32):
            m = max(m, bits[u64(32 * b + i)] & np.int32(0x7FFFFFFF))
        top[b] = m
    inv = xs                                   # xs holds 1 / xd until the block sums replace it
    for b in range(B):                         # the divisions, 16 blocks to a vector
        d = xd[b] / f32(127)                   # max|x| / 127
        inv[b] = f32(1) / d if d > 0 else f32(0)
        xd[b] = d
    for b in range(B):
        s = np.int32(0)
        for i in range(32):
            # rint by the 1.5 * 2^23 trick (exact, halves to even, |v| <= 127): vectorizes
            q = np.int32((x[u64(32 * b + i)] * inv[b] + _ROUND) - _ROUND)
            xq[u64(32 * b + i)] = q
            s = np.int32(s + q)                # int32 + int32 is int64 in Numba: keep 32-bit lanes
        xs[b] = xd[b] * f32(s)


@njit(inline="always")
def lane_bias(qt):
    """The offset of the stored codes of the symmetric acc_blocks types (v = d * (q - bias)),
    carried by prepare_blocks' lane biases xb; 0 for the others."""
    return 8 if qt == Q4_0 else 16 if qt == Q5_0 else 128 if qt == Q8_0 else 0


@njit(inline="always")
def q4x(qt):
    """Whether qt's matrix-vector takes quants_q4x (Q4_0 with AVX-512 BW + VNNI)."""
    return qt == Q4_0 and quants_q4x.ENABLED


@njit(inline="always")
def x_extra_words(qt, K):
    """int32 words of prepare_blocks' xb for rows of K values of type qt (before the block biases)."""
    if q4x(qt):
        return quants_q4x.REC * quants_q4x.steps(K // 32 * 18) // 4
    if qt in IQ4_TYPES:
        return K // 8 + K // 4               # quants_iq4.prepare_quads
    if qt == Q4_K:
        return K // 4                        # quants_k_i8.prepare_q4_k
    return K // 4 if lane_bias(qt) else 0


@njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
def prepare_blocks(xb, xds, xq, xd, xs, qtype):
    """The x extras of acc_blocks: xb [K / 4] int32 = -bias * (sum of xq[4k:4k + 4]) with the
    bias of the stored codes (Q4_0: 8, Q8_0: 128), where xb is longer followed by [B] block
    biases -bias * (sum of xq over the block) (quants_rtr); for Q4_0 with quants_q4x, the
    record of quants_q4x instead of the lane biases; xds [2B] = (xd, xs) pairs (Q4_1); for
    IQ4_NL / IQ4_XS / MXFP4 quants_iq4.prepare_quads' record; for Q4_K x in its code order
    (quants_k_i8.prepare_q4_k)."""
    if lane_bias(qtype):
        bias = np.int32(lane_bias(qtype))
        K, B = xq.shape[0], xd.shape[0]
        n = x_extra_words(qtype, K)
        if qtype == Q4_0 and q4x(qtype):      # (qtype first: a constant one prunes the branch)
            quants_q4x.prepare_q4x(xb[:n].view(np.uint8), xq, xd, B * 18)
        else:
            for k in range(n):
                xb[k] = -bias * (np.int32(xq[4 * k]) + np.int32(xq[4 * k + 1]) + np.int32(xq[4 * k + 2])
                                 + np.int32(xq[4 * k + 3]))
        for b in range(xb.shape[0] - n):   # the repacked kernels' block biases (quants_rtr)
            s = np.int32(0)
            for i in range(32):
                s += np.int32(xq[32 * b + i])
            xb[n + b] = -bias * s
    elif qtype == Q4_1 or qtype == Q5_1:
        for b in range(xd.shape[0]):
            xds[2 * b], xds[2 * b + 1] = xd[b], xs[b]
    elif qtype in IQ4_TYPES:
        quants_iq4.prepare_quads(xb, xq, np.int32(quants_iq4.quad_bias(qtype)))
    elif qtype == Q4_K:
        quants_k_i8.prepare_q4_k(xb[:xq.shape[0] // 4].view(np.int8), xq)


# ---------------------------------------------------------------- dot_rows per type
# out [R] <- dequant(w [R, row_bytes]) @ (xq * xd) [K], one row at a time.

@njit(inline="always")
def block_bytes(qt):
    """Bytes of one block of the acc_blocks types."""
    return 18 if qt == Q4_0 else 20 if qt == Q4_1 else 22 if qt == Q5_0 else 24 if qt == Q5_1 else 34


@njit(inline="always")
def _acc_row(qt, acc, w, o, xq, xd, xb, xds, b0, nb):
    """acc += blocks b0 .. nb - 1 of the row at byte o of w, 4, then 2, then 1 at a time."""
    size = block_bytes(qt)
    n4, n2 = b0 + (nb - b0) // 4 * 4, b0 + (nb - b0) // 2 * 2
    for b in range(b0, n4, 4):
        acc_blocks(qt, 4, acc, w, o + b * size, xq, xd, xb, xds, b)
    for b in range(n4, n2, 2):
        acc_blocks(qt, 2, acc, w, o + b * size, xq, xd, xb, xds, b)
    for b in range(n2, nb):
        acc_blocks(qt, 1, acc, w, o + b * size, xq, xd, xb, xds, b)


@njit(inline="always")
def dot_rows_b32(qt, out, w, xq, xd, xb, xds):
    """out [R] <- w [R, row_bytes] @ x for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 (qt a constant):
    rows in four streams (quants.rows_in_streams), 4 blocks per call side by side, then the
    last 1-3 blocks of each row; the rows left over one by one."""
    size = block_bytes(qt)
    nb, rs, R = w.shape[1] // size, w.strides[0], w.shape[0]
    n4 = nb // 4 * 4
    H = stream_rows(R, w.shape[1])
    for r in range(H):
        a0, a1, a2, a3 = lanes16(), lanes16(), lanes16(), lanes16()
        o0, o1, o2, o3 = r * rs, (r + H) * rs, (r + 2 * H) * rs, (r + 3 * H) * rs
        for b in range(0, n4, 4):
            acc_blocks(qt, 4, a0, w, o0 + b * size, xq, xd, xb, xds, b)
            acc_blocks(qt, 4, a1, w, o1 + b * size, xq, xd, xb, xds, b)
            acc_blocks(qt, 4, a2, w, o2 + b * size, xq, xd, xb, xds, b)
            acc_blocks(qt, 4, a3, w, o3 + b * size, xq, xd, xb, xds, b)
        _acc_row(qt, a0, w, o0, xq, xd, xb, xds, n4, nb)
        _acc_row(qt, a1, w, o1, xq, xd, xb, xds, n4, nb)
        _acc_row(qt, a2, w, o2, xq, xd, xb, xds, n4, nb)
        _acc_row(qt, a3, w, o3, xq, xd, xb, xds, n4, nb)
        out[r], out[r + H], out[r + 2 * H], out[r + 3 * H] = sum16(a0), sum16(a1), sum16(a2), sum16(a3)
    for r in range(4 * H, R):
        acc = lanes16()
        _acc_row(qt, acc, w, r * rs, xq, xd, xb, xds, 0, nb)
        out[r] = sum16(acc)


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q8_0(out, w, xq, xd, xb, xds):   # d:f16 qs:32 int8
    dot_rows_b32(Q8_0, out, w, xq, xd, xb, xds)


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q4_0(out, w, xq, xd, xb, xds):   # d:f16 qs:16
    dot_rows_b32(Q4_0, out, w, xq, xd, xb, xds)


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q4_1(out, w, xq, xd, xb, xds):   # d:f16 m:f16 qs:16
    dot_rows_b32(Q4_1, out, w, xq, xd, xb, xds)


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q5_0(out, w, xq, xd, xb, xds):   # d:f16 qh:4 qs:16
    dot_rows_b32(Q5_0, out, w, xq, xd, xb, xds)


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q5_1(out, w, xq, xd, xb, xds):   # d:f16 m:f16 qh:4 qs:16
    dot_rows_b32(Q5_1, out, w, xq, xd, xb, xds)


@njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
def dot_rows_i8(qtype, out, w, xq, xd, xs, xb, xds):
    """out [R] <- dequant(w [R, row_bytes]) @ x, x given as quantize_x's (xq, xd, xs) and
    prepare_blocks' (xb, xds)."""
    if qtype == Q4_0 and q4x(qtype):          # (qtype first: a constant one prunes the branch)
        quants_q4x.dot_rows_q4x(out, w, xb)
    elif qtype == Q4_0:
        dot_rows_q4_0(out, w, xq, xd, xb, xds)
    elif qtype == Q4_1:
        dot_rows_q4_1(out, w, xq, xd, xb, xds)
    elif qtype == Q8_0:
        dot_rows_q8_0(out, w, xq, xd, xb, xds)
    elif qtype == Q5_0:
        dot_rows_q5_0(out, w, xq, xd, xb, xds)
    elif qtype == Q5_1:
        dot_rows_q5_1(out, w, xq, xd, xb, xds)
    elif qtype in K_TYPES:
        quants_k_i8.dot_rows_k_i8(qtype, out, w, xq, xd, xs, xb)
    elif qtype in IQ4_TYPES:
        quants_iq4.dot_rows_iq4_i8(qtype, out, w, xq, xd, xs, xb)
    elif qtype in IQ_TYPES:
        quants_iq_i8.dot_rows_iq_i8(qtype, out, w, xq, xd, xs)
