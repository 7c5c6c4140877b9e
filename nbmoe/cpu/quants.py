"""GGUF block layouts on CPU: decode rows to float32, and rows' dot products with x.

Letters: R rows, K values in a row, B blocks in a row (K / 32 for the block types), x the
float32 activation row [K], xsum [B] its sums over each 32-value block (the matrix-vector
driver computes them once per token: they carry the block offsets m and -8 / -16).

A weight row is a C-contiguous uint8 array of row_bytes = B * type_size bytes, straight from
the GGUF mmap. f16 scales travel as uint16 bits (Numba CPU has no float16; see half.py).
Block layouts (little-endian, from gguf-py's quants.py):

  F32   1 value in 4 bytes, F16 / BF16  1 value in 2 bytes
  Q8_0  32 values in 34 bytes = d:f16 qs:32 int8                          v = d * q
  Q4_0  32 values in 18 bytes = d:f16 qs:16                               v = d * (q - 8)
  Q4_1  32 values in 20 bytes = d:f16 m:f16 qs:16                         v = d * q + m
  Q5_0  32 values in 22 bytes = d:f16 qh:4 qs:16                          v = d * (q - 16)
  Q5_1  32 values in 24 bytes = d:f16 m:f16 qh:4 qs:16                    v = d * q + m
    qs:16 holds 4 bits per value: byte j low nibble = value j, high nibble = value j + 16.
    qh:4 is one uint32: bit j = 5th bit (16s) of value j.

Two functions per type, each over a run of R rows (one call per run, not per row: a call
with array arguments costs an atomic refcount pair and ~20 argument words):
  dequant_rows_<type>(out, w)          out [R, K] <- w [R, row_bytes]. Plain loops: the
                                       reference (tested against gguf-py), and the prompt
                                       path's tile decoder. A block is decoded into a stack
                                       array first, so that all its loads precede the stores
                                       to out (LLVM cannot prove they do not alias) and SLP
                                       vectorizes it.
  dot_rows_<type>(out, w, x, xsum)     out [R] <- dequant(w) @ x, float dots (the float types'
                                       matrix-vector path; block types use quants_int8).
Each dot keeps 16 float32 lane accumulators in a stack array (lane j takes values j and
j + 16 of every block), reduced once per row by a vector reduction: LLVM keeps the lanes in
one register and vectorizes the block body (a heap scratch array is read and written every
block and stays scalar, and a reduction written in Python makes SLP split the lanes).
Per-block offsets (m, -8 d, -16 d) multiply xsum[b] once per block instead of touching every
value. Needs NUMBA_SLP_VECTORIZE=1 (nbmoe/__init__.py): without it these loops stay scalar.

Adding a type = its two functions + a branch in `dequant_rows` and `dot_rows` + a TYPES
entry (+ an integer dot in quants_int8.py where the type has integer codes).
"""
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .half import bf16_to_f32, f16_to_f32
from .specialize import ConstantArgs

F32 = int(GGMLQuantizationType.F32)
F16 = int(GGMLQuantizationType.F16)
BF16 = int(GGMLQuantizationType.BF16)
Q8_0 = int(GGMLQuantizationType.Q8_0)
Q4_0 = int(GGMLQuantizationType.Q4_0)
Q4_1 = int(GGMLQuantizationType.Q4_1)
Q5_0 = int(GGMLQuantizationType.Q5_0)
Q5_1 = int(GGMLQuantizationType.Q5_1)

# qtype -> (values per block, bytes per block), for the types these kernels decode.
TYPES = {t: GGML_QUANT_SIZES[GGMLQuantizationType(t)] for t in (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)}
# The grid IQ types, decoded in quants_iq.py (imported at the bottom: it uses the helpers here).
IQ_TYPES = tuple(int(GGMLQuantizationType[n]) for n in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"))
TYPES.update({t: GGML_QUANT_SIZES[GGMLQuantizationType(t)] for t in IQ_TYPES})
# The K-quants (quants_k.py) and the 4-bit table types (quants_iq4.py), imported at the bottom too.
K_TYPES = tuple(int(GGMLQuantizationType[n]) for n in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"))
IQ4_TYPES = tuple(int(GGMLQuantizationType[n]) for n in ("IQ4_NL", "IQ4_XS", "MXFP4"))
TYPES.update({t: GGML_QUANT_SIZES[GGMLQuantizationType(t)] for t in K_TYPES + IQ4_TYPES})

# Licences for the dot loops: no reassociation, which lets LLVM re-merge the 16 lane
# accumulators into one long chain (KERNEL_NOTES point 5); nnan/ninf are not taken either
# (a NaN in x must still come out as NaN).
FM = {"nsz", "arcp", "contract", "afn"}

f32 = np.float32
u8 = np.uint8
u32 = np.uint32


def stack_f32(n):
    """An intrinsic returning a pointer to n float32 in the calling function's stack frame:
    an alloca, which LLVM promotes to vector registers once the lane loops are unrolled."""
    @intrinsic
    def stack(typingctx):
        def codegen(context, builder, signature, args):
            return cgutils.alloca_once(builder, context.get_value_type(types.float32),
                                       size=context.get_constant(types.intp, n))
        return types.CPointer(types.float32)(), codegen
    return stack


_stack_f32x16 = stack_f32(16)
_stack_f32x32 = stack_f32(32)


@njit(inline="always")
def lanes16():
    """16 zeroed float32 lane accumulators on the caller's stack (inlined: the memory lives
    as long as the calling function's frame)."""
    acc = carray(_stack_f32x16(), 16)
    for j in range(16):
        acc[j] = 0
    return acc


# Matrix-vector kernels walk four rows a quarter of their run apart side by side, not one
# row after another: one core keeps more cache-line misses in flight on four sequential
# streams than on one (docs/kernels.md). Short streams lose: each starts cold (no prefetch
# ahead yet), so a run of rows splits only when each stream gets STREAM_MIN_BYTES.
STREAM_MIN_BYTES = 24 << 10


@njit(inline="always")
def stream_rows(R, row_bytes):
    """Rows per stream for R rows of row_bytes bytes: rows r, r + H, r + 2H, r + 3H (r < H)
    go side by side; rows 4H .. R - 1 are left for a one-row loop (all of them when the
    streams would be shorter than STREAM_MIN_BYTES)."""
    if R * row_bytes < 4 * STREAM_MIN_BYTES:
        return 0
    return R // 4


@njit(inline="always")
def rows_in_streams(acc_block, size, n, out, w, xa, xb, xc):
    """out [R] <- rows of w [R, row_bytes] @ x, where acc_block(acc, w, o, xa, xb, xc, i)
    adds unit i (the n units of `size` bytes that open each row) of the row at byte o of w
    to the lanes acc; rows in four streams (stream_rows). Rows are byte offsets into w,
    not views (a view costs an atomic refcount pair)."""
    R, rs = w.shape[0], w.strides[0]
    H = stream_rows(R, w.shape[1])
    for r in range(H):
        a0, a1, a2, a3 = lanes16(), lanes16(), lanes16(), lanes16()
        o0, o1, o2, o3 = r * rs, (r + H) * rs, (r + 2 * H) * rs, (r + 3 * H) * rs
        for i in range(n):
            acc_block(a0, w, o0 + i * size, xa, xb, xc, i)
            acc_block(a1, w, o1 + i * size, xa, xb, xc, i)
            acc_block(a2, w, o2 + i * size, xa, xb, xc, i)
            acc_block(a3, w, o3 + i * size, xa, xb, xc, i)
        out[r], out[r + H], out[r + 2 * H], out[r + 3 * H] = sum16(a0), sum16(a1), sum16(a2), sum16(a3)
    for r in range(4 * H, R):
        acc, o = lanes16(), r * rs
        for i in range(n):
            acc_block(acc, w, o + i * size, xa, xb, xc, i)
        out[r] = sum16(acc)


@njit(inline="always")
def store_lanes(out, r, acc):
    """out[r:r + 16] = the 16 lanes of acc (a repacked group's 16 row dots)."""
    for j in range(16):
        out[r + j] = acc[j]


@njit(inline="always")
def groups_in_streams(acc_unit, n, out, w, G, xargs):
    """out [16 G] <- the lanes of G repacked groups of 16 rows (group g at byte 16 g of w's rows),
    each after acc_unit(acc, w, o, *xargs, i) for its n units i (the intrinsic finds unit i
    of the group at byte o); groups in four streams, as rows_in_streams."""
    gb = 16 * w.strides[0]                           # bytes of a group
    H = stream_rows(G, gb)
    for g in range(H):
        a0, a1, a2, a3 = lanes16(), lanes16(), lanes16(), lanes16()
        for i in range(n):
            acc_unit(a0, w, g * gb, *xargs, i)
            acc_unit(a1, w, (g + H) * gb, *xargs, i)
            acc_unit(a2, w, (g + 2 * H) * gb, *xargs, i)
            acc_unit(a3, w, (g + 3 * H) * gb, *xargs, i)
        for k, a in enumerate((a0, a1, a2, a3)):
            store_lanes(out, (g + k * H) * 16, a)
    for g in range(4 * H, G):
        acc = lanes16()
        for i in range(n):
            acc_unit(acc, w, g * gb, *xargs, i)
        store_lanes(out, g * 16, acc)


@njit(inline="always")
def block32():
    """32 float32 on the caller's stack: a decoded block, so that all loads of a block's
    bytes come before the stores to the output (which LLVM cannot prove are elsewhere)."""
    return carray(_stack_f32x32(), 32)


def lane_sum(n):
    """An intrinsic: acc[0] + ... + acc[n-1] of a stack lane array as one vector reduction
    (a log-depth tree). Written in Python, the sum either stays an (n-1)-add serial chain
    at the end of every row or makes SLP split the lanes into small vectors in the hot loop."""
    @intrinsic
    def lsum(typingctx, acc):
        if acc != types.Array(types.float32, 1, "C"):
            return None

        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            vty = ir.VectorType(ir.FloatType(), n)
            vec = builder.load(builder.bitcast(data, vty.as_pointer()), align=4)
            fnty = ir.FunctionType(ir.FloatType(), [ir.FloatType(), vty])
            fn = cgutils.get_or_insert_function(builder.module, fnty, f"llvm.vector.reduce.fadd.v{n}f32")
            return builder.call(fn, [ir.Constant(ir.FloatType(), -0.0), vec], fastmath=("reassoc",))
        return types.float32(acc), codegen
    return lsum


sum16 = lane_sum(16)


@njit(inline="always")
def load_f16(b, i):
    """The f16 at byte offset i of uint8 array b, as float32."""
    return f16_to_f32(np.uint16(u32(b[i]) | (u32(b[i + 1]) << u32(8))))


@njit(inline="always")
def load_u32(b, i):
    return u32(u32(b[i]) | (u32(b[i + 1]) << u32(8)) | (u32(b[i + 2]) << u32(16)) | (u32(b[i + 3]) << u32(24)))


# ---------------------------------------------------------------- float types

@njit(cache=True, error_model="numpy")
def dequant_rows_f32(out, w):
    for r in range(w.shape[0]):
        v = w[r].view(np.float32)
        for k in range(out.shape[1]):
            out[r, k] = v[k]


@njit(cache=True, error_model="numpy")
def dequant_rows_f16(out, w):
    for r in range(w.shape[0]):
        v = w[r].view(np.uint16)
        for k in range(out.shape[1]):
            out[r, k] = f16_to_f32(v[k])


@njit(cache=True, error_model="numpy")
def dequant_rows_bf16(out, w):
    for r in range(w.shape[0]):
        v = w[r].view(np.uint16)
        for k in range(out.shape[1]):
            out[r, k] = bf16_to_f32(v[k])


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_f32(out, w, x, xsum):
    K = x.shape[0]
    for r in range(w.shape[0]):
        v = w[r].view(np.float32)
        acc = lanes16()
        for b in range(K // 16):
            for j in range(16):
                acc[j] += v[b * 16 + j] * x[b * 16 + j]
        s = sum16(acc)
        for k in range(K // 16 * 16, K):
            s += v[k] * x[k]
        out[r] = s


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_f16(out, w, x, xsum):
    K = x.shape[0]
    for r in range(w.shape[0]):
        v = w[r].view(np.uint16)
        acc = lanes16()
        for b in range(K // 16):
            for j in range(16):
                acc[j] += f16_to_f32(v[b * 16 + j]) * x[b * 16 + j]
        s = sum16(acc)
        for k in range(K // 16 * 16, K):
            s += f16_to_f32(v[k]) * x[k]
        out[r] = s


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_bf16(out, w, x, xsum):
    K = x.shape[0]
    for r in range(w.shape[0]):
        v = w[r].view(np.uint16)
        acc = lanes16()
        for b in range(K // 16):
            for j in range(16):
                acc[j] += bf16_to_f32(v[b * 16 + j]) * x[b * 16 + j]
        s = sum16(acc)
        for k in range(K // 16 * 16, K):
            s += bf16_to_f32(v[k]) * x[k]
        out[r] = s


# ---------------------------------------------------------------- Q8_0: d:f16 qs:32 int8

@njit(cache=True, error_model="numpy")
def dequant_rows_q8_0(out, w):
    for r in range(w.shape[0]):
        row = w[r]
        for b in range(row.shape[0] // 34):
            d = load_f16(row, b * 34)
            v = block32()
            for i in range(32):
                v[i] = d * f32(np.int8(row[b * 34 + 2 + i]))
            for i in range(32):
                out[r, b * 32 + i] = v[i]


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q8_0(out, w, x, xsum):
    for r in range(w.shape[0]):
        row = w[r]
        acc = lanes16()
        for b in range(row.shape[0] // 34):
            o, ox = b * 34, b * 32
            d = load_f16(row, o)
            for j in range(16):
                lo = f32(np.int8(row[o + 2 + j]))
                hi = f32(np.int8(row[o + 18 + j]))
                acc[j] += d * (lo * x[ox + j] + hi * x[ox + 16 + j])
        out[r] = sum16(acc)


# ---------------------------------------------------------------- Q4_0: d:f16 qs:16

@njit(cache=True, error_model="numpy")
def dequant_rows_q4_0(out, w):
    for r in range(w.shape[0]):
        row = w[r]
        for b in range(row.shape[0] // 18):
            d = load_f16(row, b * 18)
            v = block32()
            for j in range(16):
                q = row[b * 18 + 2 + j]
                v[j] = d * (f32(np.int32(q & u8(15))) - f32(8))
                v[j + 16] = d * (f32(np.int32(q >> u8(4))) - f32(8))
            for i in range(32):
                out[r, b * 32 + i] = v[i]


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q4_0(out, w, x, xsum):
    for r in range(w.shape[0]):
        row = w[r]
        acc = lanes16()
        off = f32(0)
        for b in range(row.shape[0] // 18):
            o, ox = b * 18, b * 32
            d = load_f16(row, o)
            for j in range(16):
                q = row[o + 2 + j]
                acc[j] += d * (f32(q & u8(15)) * x[ox + j] + f32(q >> u8(4)) * x[ox + 16 + j])
            off += d * xsum[b]
        out[r] = sum16(acc) - f32(8) * off


# ---------------------------------------------------------------- Q4_1: d:f16 m:f16 qs:16

@njit(cache=True, error_model="numpy")
def dequant_rows_q4_1(out, w):
    for r in range(w.shape[0]):
        row = w[r]
        for b in range(row.shape[0] // 20):
            d = load_f16(row, b * 20)
            m = load_f16(row, b * 20 + 2)
            v = block32()
            for j in range(16):
                q = row[b * 20 + 4 + j]
                v[j] = d * f32(np.int32(q & u8(15))) + m
                v[j + 16] = d * f32(np.int32(q >> u8(4))) + m
            for i in range(32):
                out[r, b * 32 + i] = v[i]


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q4_1(out, w, x, xsum):
    for r in range(w.shape[0]):
        row = w[r]
        acc = lanes16()
        off = f32(0)
        for b in range(row.shape[0] // 20):
            o, ox = b * 20, b * 32
            d = load_f16(row, o)
            for j in range(16):
                q = row[o + 4 + j]
                acc[j] += d * (f32(q & u8(15)) * x[ox + j] + f32(q >> u8(4)) * x[ox + 16 + j])
            off += load_f16(row, o + 2) * xsum[b]
        out[r] = sum16(acc) + off


# ---------------------------------------------------------------- Q5_0: d:f16 qh:4 qs:16

@njit(inline="always")
def q5_pair(qs_byte, qh, j):
    """Values j and j + 16 of a Q5 block as float32 (0..31): the nibbles of qs byte j plus
    16 where qh has bit j / j + 16 (a test and select per lane, no 64-bit shifts)."""
    lo = f32(np.int32(qs_byte & u8(15))) + (f32(16) if qh & u32(1 << j) else f32(0))
    hi = f32(np.int32(qs_byte >> u8(4))) + (f32(16) if qh & u32(1 << (j + 16)) else f32(0))
    return lo, hi


@njit(cache=True, error_model="numpy")
def dequant_rows_q5_0(out, w):
    for r in range(w.shape[0]):
        row = w[r]
        for b in range(row.shape[0] // 22):
            d = load_f16(row, b * 22)
            qh = load_u32(row, b * 22 + 2)
            v = block32()
            for j in range(16):
                lo, hi = q5_pair(row[b * 22 + 6 + j], qh, j)
                v[j] = d * (lo - f32(16))
                v[j + 16] = d * (hi - f32(16))
            for i in range(32):
                out[r, b * 32 + i] = v[i]


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q5_0(out, w, x, xsum):
    for r in range(w.shape[0]):
        row = w[r]
        acc = lanes16()
        off = f32(0)
        for b in range(row.shape[0] // 22):
            o, ox = b * 22, b * 32
            d = load_f16(row, o)
            qh = load_u32(row, o + 2)
            for j in range(16):
                lo, hi = q5_pair(row[o + 6 + j], qh, j)
                acc[j] += d * (lo * x[ox + j] + hi * x[ox + 16 + j])
            off += d * xsum[b]
        out[r] = sum16(acc) - f32(16) * off


# ---------------------------------------------------------------- Q5_1: d:f16 m:f16 qh:4 qs:16

@njit(cache=True, error_model="numpy")
def dequant_rows_q5_1(out, w):
    for r in range(w.shape[0]):
        row = w[r]
        for b in range(row.shape[0] // 24):
            d = load_f16(row, b * 24)
            m = load_f16(row, b * 24 + 2)
            qh = load_u32(row, b * 24 + 4)
            v = block32()
            for j in range(16):
                lo, hi = q5_pair(row[b * 24 + 8 + j], qh, j)
                v[j] = d * lo + m
                v[j + 16] = d * hi + m
            for i in range(32):
                out[r, b * 32 + i] = v[i]


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q5_1(out, w, x, xsum):
    for r in range(w.shape[0]):
        row = w[r]
        acc = lanes16()
        off = f32(0)
        for b in range(row.shape[0] // 24):
            o, ox = b * 24, b * 32
            d = load_f16(row, o)
            qh = load_u32(row, o + 4)
            for j in range(16):
                lo, hi = q5_pair(row[o + 8 + j], qh, j)
                acc[j] += d * (lo * x[ox + j] + hi * x[ox + 16 + j])
            off += load_f16(row, o + 2) * xsum[b]
        out[r] = sum16(acc) + off


# ---------------------------------------------------------------- dispatch on qtype
# One branch per type, taken once per call on a run of rows (a call per row would cost an
# atomic refcount pair and ~20 argument words each: as much as decoding a 576-value row).
# A constant qtype compiles that type's branch alone (specialize.ConstantArgs), a run-time one every branch.

@njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
def dequant_rows(qtype, out, w):
    """out [R, K] float32 <- the values of weight rows w [R, row_bytes]."""
    if qtype == Q4_0:
        dequant_rows_q4_0(out, w)
    elif qtype == Q4_1:
        dequant_rows_q4_1(out, w)
    elif qtype == Q8_0:
        dequant_rows_q8_0(out, w)
    elif qtype == Q5_0:
        dequant_rows_q5_0(out, w)
    elif qtype == Q5_1:
        dequant_rows_q5_1(out, w)
    elif qtype == F16:
        dequant_rows_f16(out, w)
    elif qtype == BF16:
        dequant_rows_bf16(out, w)
    elif qtype == F32:
        dequant_rows_f32(out, w)
    elif qtype in IQ_TYPES:
        quants_iq.dequant_rows_iq(qtype, out, w)
    elif qtype in K_TYPES:
        quants_k.dequant_rows_k(qtype, out, w)
    elif qtype in IQ4_TYPES:
        quants_iq4.dequant_rows_iq4(qtype, out, w)


@njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
def dot_rows(qtype, out, w, x, xsum):
    """out [R] <- dequant(w [R, row_bytes]) @ x [K]; xsum [K // 32] holds x's block sums."""
    if qtype == Q4_0:
        dot_rows_q4_0(out, w, x, xsum)
    elif qtype == Q4_1:
        dot_rows_q4_1(out, w, x, xsum)
    elif qtype == Q8_0:
        dot_rows_q8_0(out, w, x, xsum)
    elif qtype == Q5_0:
        dot_rows_q5_0(out, w, x, xsum)
    elif qtype == Q5_1:
        dot_rows_q5_1(out, w, x, xsum)
    elif qtype == F16:
        dot_rows_f16(out, w, x, xsum)
    elif qtype == BF16:
        dot_rows_bf16(out, w, x, xsum)
    elif qtype == F32:
        dot_rows_f32(out, w, x, xsum)
    elif qtype in IQ_TYPES:
        quants_iq.dot_rows_iq(qtype, out, w, x, xsum)
    elif qtype in K_TYPES:
        quants_k.dot_rows_k(qtype, out, w, x, xsum)
    elif qtype in IQ4_TYPES:
        quants_iq4.dot_rows_iq4(qtype, out, w, x, xsum)


# Last: quants_iq imports the helpers above (a plain import, so either module may load first).
from . import quants_iq  # noqa: E402
from . import quants_iq4, quants_k  # noqa: E402
