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

Per block, in LLVM IR written here (an intrinsic; Numba cannot express vector code):
  <32 x u8> codes  <- unpack the block's bytes (nibbles / nibbles + 5th bits / xor 0x80)
  <8 x i32> lanes  =  dot4(codes, xq block)     lane i = sum of bytes 4i..4i+3 products
  acc[0:8]        +=  float(lanes) * (d * xd[b])
dot4 is one `vpdpbusd` (AVX-512 VNNI) where the CPU has it, else plain widen-multiply-add IR
that LLVM turns into pmaddwd + phaddd code (no faster than the float dots): same results. acc lives in a stack
array (lanes8) that LLVM keeps in a register; sum8 reduces it once per row.
Error vs float x: about 0.5-1% of the largest output (the 8-bit x), as in llama.cpp.

Adding a block type = an unpack in IR (or reuse acc_q4 / acc_q5 / acc_q8), its
dot_rows_<type>, a branch in dot_rows_i8.
"""
import os

import llvmlite.binding as llb
import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import quants_iq4, quants_iq_i8, quants_k_i8
from .simd import PREFETCH
from .quants import FM, IQ4_TYPES, IQ_TYPES, K_TYPES, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, f32, lane_sum, load_f16, stack_f32

_FEATURES = llb.get_host_cpu_features()
# NBMOE_NO_VNNI=1 forces the generic dot4 (use a separate NUMBA_CACHE_DIR: Numba's cache
# key does not see this choice).
HAS_VNNI = bool(_FEATURES.get("avx512vnni") and _FEATURES.get("avx512vl")) and not os.environ.get("NBMOE_NO_VNNI")

# The block types with an integer dot product here.
INT8_TYPES = (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) + K_TYPES + IQ4_TYPES  # the last two: quants_k_i8, quants_iq4
INT8_TYPES += IQ_TYPES  # the grid IQ types: quants_iq_i8

_I8, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
_V16I8, _V32I8 = ir.VectorType(_I8, 16), ir.VectorType(_I8, 32)
_V8I32, _V8F = ir.VectorType(_I32, 8), ir.VectorType(_F32, 8)


def _vec_ptr(context, builder, aryty, ary, offset, vty):
    """Pointer to a vty at element `offset` of a 1-D array."""
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.bitcast(builder.gep(data, [offset]), vty.as_pointer())


def _dot4(builder, codes, xq):
    """<8 x i32>: lane i = sum over k < 4 of codes[4i + k] (unsigned) * xq[4i + k] (signed)."""
    if HAS_VNNI:
        fnty = ir.FunctionType(_V8I32, [_V8I32] * 3)
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx512.vpdpbusd.256")
        return builder.call(fn, [ir.Constant(_V8I32, None), builder.bitcast(codes, _V8I32),
                                 builder.bitcast(xq, _V8I32)])
    v32 = ir.VectorType(_I32, 32)
    p = builder.mul(builder.zext(codes, v32), builder.sext(xq, v32))

    def pair_sums(v, n):  # [v0 + v1, v2 + v3, ...]: the shape of pmaddwd's pairwise add
        even = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(0, 2 * n, 2))))
        odd = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(1, 2 * n, 2))))
        return builder.add(even, odd)
    return pair_sums(pair_sums(p, 16), 8)


def _prefetch(context, builder, sig, row, o):
    """Ask for the cache line simd.PREFETCH bytes past row[o]: the hardware prefetchers alone
    leave these loops waiting on memory (see simd.py). A prefetch past the end never faults."""
    off = builder.add(builder.sext(o, _I64) if o.type != _I64 else o, ir.Constant(_I64, PREFETCH))
    ptr = _vec_ptr(context, builder, sig.args[1], row, off, _I8)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
        ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]), "llvm.prefetch.p0")
    builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])


def _block_acc(context, builder, sig, args, codes):
    """acc[0:8] += float(dot4(codes, xq[ox:ox + 32])) * s; args = (acc, row, o, xq, ox, s, ...)."""
    acc, xq, ox, s = args[0], args[3], args[4], args[5]
    if PREFETCH:
        _prefetch(context, builder, sig, args[1], args[2])
    x = builder.load(_vec_ptr(context, builder, sig.args[3], xq, ox, _V32I8), align=1)
    ap = _vec_ptr(context, builder, sig.args[0], acc, ir.Constant(_I64, 0), _V8F)
    sv = builder.insert_element(ir.Constant(_V8F, None), s, ir.Constant(_I32, 0))
    sv = builder.shuffle_vector(sv, sv, ir.Constant(_V8I32, None))
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8F, [_V8F] * 3), "llvm.fma.v8f32")
    lanes = builder.sitofp(_dot4(builder, codes, x), _V8F)
    builder.store(builder.call(fma, [lanes, sv, builder.load(ap, align=4)]), ap, align=4)
    return context.get_dummy_value()


def _nibbles(context, builder, sig, row, o):
    """<32 x u8>: the low nibbles of row[o:o + 16], then the high nibbles (= values 0..31)."""
    qs = builder.load(_vec_ptr(context, builder, sig.args[1], row, o, _V16I8), align=1)
    lo = builder.and_(qs, ir.Constant(_V16I8, [15] * 16))
    hi = builder.lshr(qs, ir.Constant(_V16I8, [4] * 16))
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))


@intrinsic
def acc_q8(typingctx, acc, row, o, xq, ox, s):
    """acc[0:8] += s * dot4(row[o:o + 32] ^ 0x80, xq[ox:ox + 32]): Q8_0 codes + 128."""
    def codegen(context, builder, sig, args):
        q = builder.load(_vec_ptr(context, builder, sig.args[1], args[1], args[2], _V32I8), align=1)
        return _block_acc(context, builder, sig, args, builder.xor(q, ir.Constant(_V32I8, [0x80] * 32)))
    return types.void(acc, row, o, xq, ox, s), codegen


@intrinsic
def acc_q4(typingctx, acc, row, o, xq, ox, s):
    """acc[0:8] += s * dot4(nibbles of row[o:o + 16], xq[ox:ox + 32]): Q4_0 / Q4_1 codes."""
    def codegen(context, builder, sig, args):
        return _block_acc(context, builder, sig, args, _nibbles(context, builder, sig, args[1], args[2]))
    return types.void(acc, row, o, xq, ox, s), codegen


@intrinsic
def acc_q5(typingctx, acc, row, o, xq, ox, s, oh):
    """As acc_q4, plus 16 where bit k of the uint32 at row[oh:oh + 4] is set: Q5_0 / Q5_1."""
    def codegen(context, builder, sig, args):
        codes = _nibbles(context, builder, sig, args[1], args[2])
        qh = builder.load(_vec_ptr(context, builder, sig.args[1], args[1], args[6], _I32), align=1)
        bits = builder.zext(builder.bitcast(qh, ir.VectorType(ir.IntType(1), 32)), _V32I8)
        codes = builder.or_(codes, builder.shl(bits, ir.Constant(_V32I8, [4] * 32)))
        return _block_acc(context, builder, sig, args, codes)
    return types.void(acc, row, o, xq, ox, s, oh), codegen


sum8 = lane_sum(8)
_stack_f32x8 = stack_f32(8)


@njit(inline="always")
def lanes8():
    """8 zeroed float32 lane accumulators on the caller's stack."""
    acc = carray(_stack_f32x8(), 8)
    for j in range(8):
        acc[j] = 0
    return acc


# ---------------------------------------------------------------- x -> 8-bit blocks

@njit(cache=True, error_model="numpy")
def quantize_x(xq, xd, xs, x):
    """x [K] -> xq [K] int8, xd [B] scales, xs [B] = xd * block sums of xq (see the top)."""
    for b in range(x.shape[0] // 32):
        amax = f32(0)
        for i in range(32):
            a = abs(x[b * 32 + i])
            if a > amax or a != a:  # a NaN sticks: xd = NaN, so NaN in x gives NaN out
                amax = a
        d = amax / f32(127)
        inv = f32(1) / d if d > 0 else f32(0)
        s = np.int32(0)
        for i in range(32):
            q = np.int32(np.rint(x[b * 32 + i] * inv))
            xq[b * 32 + i] = q
            s += q
        xd[b] = d
        xs[b] = d * f32(s)


# ---------------------------------------------------------------- dot_rows per type
# out [R] <- dequant(w [R, row_bytes]) @ (xq * xd) [K], one row at a time.

@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q8_0(out, w, xq, xd, xs):        # d:f16 qs:32 int8
    for r in range(w.shape[0]):
        row, acc, off = w[r], lanes8(), f32(0)
        for b in range(row.shape[0] // 34):
            d = load_f16(row, b * 34)
            acc_q8(acc, row, b * 34 + 2, xq, b * 32, d * xd[b])
            off += d * xs[b]
        out[r] = sum8(acc) - f32(128) * off


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q4_0(out, w, xq, xd, xs):        # d:f16 qs:16
    for r in range(w.shape[0]):
        row, acc, off = w[r], lanes8(), f32(0)
        for b in range(row.shape[0] // 18):
            d = load_f16(row, b * 18)
            acc_q4(acc, row, b * 18 + 2, xq, b * 32, d * xd[b])
            off += d * xs[b]
        out[r] = sum8(acc) - f32(8) * off


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q4_1(out, w, xq, xd, xs):        # d:f16 m:f16 qs:16
    for r in range(w.shape[0]):
        row, acc, off = w[r], lanes8(), f32(0)
        for b in range(row.shape[0] // 20):
            acc_q4(acc, row, b * 20 + 4, xq, b * 32, load_f16(row, b * 20) * xd[b])
            off += load_f16(row, b * 20 + 2) * xs[b]
        out[r] = sum8(acc) + off


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q5_0(out, w, xq, xd, xs):        # d:f16 qh:4 qs:16
    for r in range(w.shape[0]):
        row, acc, off = w[r], lanes8(), f32(0)
        for b in range(row.shape[0] // 22):
            d = load_f16(row, b * 22)
            acc_q5(acc, row, b * 22 + 6, xq, b * 32, d * xd[b], b * 22 + 2)
            off += d * xs[b]
        out[r] = sum8(acc) - f32(16) * off


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q5_1(out, w, xq, xd, xs):        # d:f16 m:f16 qh:4 qs:16
    for r in range(w.shape[0]):
        row, acc, off = w[r], lanes8(), f32(0)
        for b in range(row.shape[0] // 24):
            acc_q5(acc, row, b * 24 + 8, xq, b * 32, load_f16(row, b * 24) * xd[b], b * 24 + 4)
            off += load_f16(row, b * 24 + 2) * xs[b]
        out[r] = sum8(acc) + off


@njit(cache=True, error_model="numpy")
def dot_rows_i8(qtype, out, w, xq, xd, xs):
    """out [R] <- dequant(w [R, row_bytes]) @ x, x given as quantize_x's (xq, xd, xs)."""
    if qtype == Q4_0:
        dot_rows_q4_0(out, w, xq, xd, xs)
    elif qtype == Q4_1:
        dot_rows_q4_1(out, w, xq, xd, xs)
    elif qtype == Q8_0:
        dot_rows_q8_0(out, w, xq, xd, xs)
    elif qtype == Q5_0:
        dot_rows_q5_0(out, w, xq, xd, xs)
    elif qtype == Q5_1:
        dot_rows_q5_1(out, w, xq, xd, xs)
    elif qtype in K_TYPES:
        quants_k_i8.dot_rows_k_i8(qtype, out, w, xq, xd, xs)
    elif qtype in IQ4_TYPES:
        quants_iq4.dot_rows_iq4_i8(qtype, out, w, xq, xd, xs)
    elif qtype in IQ_TYPES:
        quants_iq_i8.dot_rows_iq_i8(qtype, out, w, xq, xd, xs)
