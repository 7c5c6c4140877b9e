"""Q4_0 matrix-vector on the GGUF layout, with x laid out like the weight row's bytes.

Letters: K values in a row, B = K / 32 blocks, RB = 18 B bytes a row, S = ceil(RB / 64)
steps of 64 bytes, L = a 32-bit lane (4 bytes) of a step. x as quantize_x gives it: xq [K]
int8 codes, xd [B] scales (quants_int8).

Why: the block-at-a-time kernel (quants_int8.acc_blocks) spends most of its cycles on
gathering each block's 16 bytes into a register twice (broadcast, insert, variable shift)
and its f16 scale (4 word inserts a 4 blocks, a permute a pair): compute-bound. Here the weight row is read as it lies, 64 bytes at a time, and x is
rearranged instead, once per call, so that its codes sit under the nibbles they multiply:

  row bytes    0  1 | 2 ............ 17 | 18 19 | 20 ........... 35 | 36 37 | ...
               d_0  | qs_0 [16]        | d_1   | qs_1             | d_2   |
  xlo[p]       0  0 | xq[0] .. xq[15]  | 0  0  | xq[32] .. xq[47]  | 0  0  |   (low nibbles)
  xhi[p]       0  0 | xq[16] .. xq[31] | 0  0  | xq[48] .. xq[63]  | 0  0  |   (high nibbles)

  step t = bytes 64t .. 64t + 63 of the row (the last one masked at the row's end):
      lanes = dot4(W >> 4 & 15, xhi) + dot4(W & 15, xlo) + bias      (two vpdpbusd, int32 x 16)
  where the d bytes meet zeros of x. 18 = 2 mod 4, so a 4-byte lane holds codes of exactly
  one block (a d sits between two blocks' codes): lane L's block b(L) sets its float scale
      acc[L] += float(lanes[L]) * d_b(L) * xd_b(L)
  d_b(L) comes from the row itself: one vpermi2w picks, per lane, the f16 word of its block's d
  out of [the previous 64 bytes | these 64 bytes] (a block's d lies at most 17 bytes before
  its codes), and vcvtph2ps makes 16 floats. bias[L] = -8 * (sum of the lane's xlo + xhi)
  carries Q4_0's v = d (q - 8).

Per step: 2 loads of W, 5 of the x record, 2 and + 1 shift, 2 vpdpbusd, vpermi2w,
vcvtph2ps, cvtdq2ps, 1 mul, 1 FMA for 3.56 blocks. A row's last step reads on into the next row (x is 0 there); only
the last row of w takes masked loads.

The x record (REC * S bytes, built by prepare_q4x; K-dependent only through RB): six sections,
each an entry per step t, at byte offsets
   0: xlo [S][64] int8        64 S: xhi [S][64] int8        128 S: bias [S][16] int32
   192 S: xdl [S][16] f32 (xd_b(L), 0 past the row)
   256 S: didx [S][32] int16 (the word of d_b(L) in [prev | this]; words 16.. unused)
   320 S: masks [S][2] u64 (bytes of the step inside the row, of the previous 64 bytes)
Parallelized by the caller (matmul) over runs of rows.
"""
import llvmlite.binding as llb
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .quants import FM, lanes16, stream_rows, sum16

u64 = np.uint64
from .simd import HAS_VNNI, PREFETCH, copy16, prefetch_lines

_FEATURES = llb.get_host_cpu_features()
# vpermi2w is AVX-512 BW; without VNNI the integer dots are off for plain Q4_0 anyway
# (quants_int8 then keeps its block kernel for the -rtr tail rows).
ENABLED = HAS_VNNI and bool(_FEATURES.get("avx512bw"))

STEP, REC = 64, 336
SIZE = 18          # bytes of a Q4_0 block

_I1, _I8, _I16, _I32, _I64, _F32 = (ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32),
                                    ir.IntType(64), ir.FloatType())


@njit(inline="always")
def steps(row_bytes):
    return (row_bytes + STEP - 1) // STEP


# ---------------------------------------------------------------- x record (per call)

@njit(cache=True, error_model="numpy")
def prepare_q4x(xr, xq, xd, row_bytes):
    """xr [REC * S] uint8 <- the x record above for rows of row_bytes bytes. Unsigned
    indices (u64): no negative-index fix-ups, so LLVM vectorizes the copies."""
    S, B, RB = u64((row_bytes + STEP - 1) // STEP), u64(row_bytes // SIZE), u64(row_bytes)
    if xr.shape[0] < REC * S or xq.shape[0] < 32 * B:
        raise ValueError("prepare_q4x: record or x too short")
    xr[:] = 0
    lo, hi = xr[:64 * S].view(np.int8), xr[64 * S:128 * S].view(np.int8)
    bias, xdl = xr[128 * S:192 * S].view(np.int32), xr[192 * S:256 * S].view(np.float32)
    didx, mask = xr[256 * S:320 * S].view(np.int16), xr[320 * S:336 * S].view(np.uint64)
    for b in range(B):                                  # codes under their nibbles
        copy16(lo, SIZE * b + 2, xq, 32 * b)
        copy16(hi, SIZE * b + 2, xq, 32 * b + 16)
    for L in range((RB + u64(3)) // u64(4)):             # lanes in the row
        s = np.int32(0)
        for i in range(u64(4)):
            s += np.int32(lo[u64(4) * L + i]) + np.int32(hi[u64(4) * L + i])
        bias[L] = -8 * s
    for b in range(B):                                  # the lanes holding block b's codes
        for L in range((u64(SIZE) * b + u64(2)) // u64(4), (u64(SIZE) * b + u64(17)) // u64(4) + u64(1)):
            xdl[L] = xd[b]
            # the d's word in [previous 64 bytes | this step's]: 32 + (d's byte - step start) / 2
            didx[L + L // u64(16) * u64(16)] = np.int16(u64(SIZE // 2) * b + u64(32) - L // u64(16) * u64(32))
    for t in range(S):
        n = min(u64(STEP), RB - u64(STEP) * t)         # bytes of the step in the row
        mask[u64(2) * t] = np.uint64(0xFFFFFFFFFFFFFFFF) if n == u64(STEP) else (u64(1) << n) - u64(1)
        mask[u64(2) * t + u64(1)] = np.uint64(0xFFFFFFFFFFFFFFFF) if t > u64(0) else mask[0]
        for L in range(u64(16) - (n + u64(3)) // u64(4)):      # lanes past the row: any real d, times 0
            didx[u64(32) * t + u64(16) - u64(1) - L] = didx[u64(32) * t]


# ---------------------------------------------------------------- the step (IR)

def _emit_step(context, b, sig, args, masked):
    """acc += step t of the row at byte o (see the top); masked: the loads keep to the
    record's byte masks (a row's last step, when the row is not whole steps)."""
    acc, w, o, xr, t, S = args

    def data(i):                         # as a byte pointer
        ptr = context.make_array(sig.args[i])(context, b, args[i]).data
        return b.bitcast(ptr, _I8.as_pointer())

    def c(v, ty=_I64):
        return ir.Constant(ty, v)

    def vconst(ty, value):
        return ir.Constant(ty, [value] * ty.count)

    def load(ptr, off, ty, align=1):
        p = b.gep(ptr, [off if isinstance(off, ir.Value) else c(off)])
        return b.load(b.bitcast(p, ty.as_pointer()), align=align)

    v64, v16i, v16f, v32w = (ir.VectorType(_I8, 64), ir.VectorType(_I32, 16), ir.VectorType(_F32, 16),
                             ir.VectorType(_I16, 32))
    off = b.mul(t, c(STEP))
    prev_off = b.select(b.icmp_signed(">", t, c(0)), b.sub(off, c(STEP)), c(0))
    row = b.gep(data(1), [o])
    xr = data(3)

    def rec(part, size):                 # step t's entry of section `part` (entries of `size` bytes)
        return b.gep(xr, [b.add(b.mul(S, c(64 * part)), b.mul(t, c(size)))])
    if PREFETCH:
        prefetch_lines(b, [b.gep(row, [b.add(off, c(PREFETCH))])])
    if masked:
        mload = cgutils.get_or_insert_function(b.module, ir.FunctionType(
            v64, [v64.as_pointer(), _I32, ir.VectorType(_I1, 64), v64]), "llvm.masked.load.v64i8.p0")

        def get(at, mask_off):
            m = b.bitcast(load(rec(5, 16), mask_off, _I64, 8), ir.VectorType(_I1, 64))
            return b.call(mload, [b.bitcast(b.gep(row, [at]), v64.as_pointer()), c(1, _I32), m,
                                  ir.Constant(v64, None)])
        W, P = get(off, 0), get(prev_off, 8)
    else:
        W, P = load(row, off, v64), load(row, prev_off, v64)
    # integer lanes: bias + dot4(high nibbles, xhi) + dot4(low nibbles, xlo)
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(v16i, [v16i] * 3), "llvm.x86.avx512.vpdpbusd.512")
    w16 = b.bitcast(W, v32w)
    hi = b.and_(b.bitcast(b.lshr(w16, vconst(v32w, 4)), v64), vconst(v64, 15))
    lo = b.and_(W, vconst(v64, 15))
    lanes = b.call(fn, [load(rec(2, 64), 0, v16i), b.bitcast(hi, v16i), load(rec(1, 64), 0, v16i)])
    lanes = b.call(fn, [lanes, b.bitcast(lo, v16i), load(rec(0, 64), 0, v16i)])
    # per-lane d: the word didx[L] of [P | W]
    perm = cgutils.get_or_insert_function(b.module, ir.FunctionType(v32w, [v32w] * 3),
                                          "llvm.x86.avx512.vpermi2var.hi.512")
    dw = b.call(perm, [b.bitcast(P, v32w), load(rec(4, 64), 0, v32w), w16])
    dw = b.shuffle_vector(dw, dw, ir.Constant(ir.VectorType(_I32, 16), list(range(16))))
    d = b.fpext(b.bitcast(dw, ir.VectorType(ir.HalfType(), 16)), v16f)
    s = b.fmul(d, load(rec(3, 64), 0, v16f), flags=("contract",))
    ap = b.bitcast(data(0), v16f.as_pointer())
    term = b.fmul(b.sitofp(lanes, v16f), s, flags=("contract",))
    b.store(b.fadd(b.load(ap, align=4), term, flags=("contract",)), ap, align=4)


def _step_intrinsic(masked):
    @intrinsic
    def acc_step(typingctx, acc, w, o, xr, t, S):
        """acc[0:16] += step t of the row at byte o of w's data, dotted with the x record xr."""
        def codegen(context, builder, sig, args):
            _emit_step(context, builder, sig, args, masked)
            return context.get_dummy_value()
        return types.void(acc, w, o, xr, t, S), codegen
    return acc_step


acc_step, acc_step_masked = _step_intrinsic(False), _step_intrinsic(True)


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q4x(out, w, xr):
    """out [R] <- Q4_0 rows w [R, RB] @ x, x as prepare_q4x's record xr (any dtype: bytes).
    Four rows a quarter of the matrix apart go side by side (quants.stream_rows: four
    streams from memory). A row's last step reads on into the next row (there x is 0);
    only the last row's is masked, to stay inside w, so that row stays out of the streams."""
    R, S, rs = w.shape[0], (w.shape[1] + STEP - 1) // STEP, w.strides[0]
    full = w.shape[1] // STEP                       # steps wholly inside the row
    H = stream_rows(R - 1, w.shape[1])
    for r in range(H):
        a0, a1, a2, a3 = lanes16(), lanes16(), lanes16(), lanes16()
        o0, o1, o2, o3 = r * rs, (r + H) * rs, (r + 2 * H) * rs, (r + 3 * H) * rs
        for t in range(S):
            acc_step(a0, w, o0, xr, t, S)
            acc_step(a1, w, o1, xr, t, S)
            acc_step(a2, w, o2, xr, t, S)
            acc_step(a3, w, o3, xr, t, S)
        out[r], out[r + H], out[r + 2 * H], out[r + 3 * H] = sum16(a0), sum16(a1), sum16(a2), sum16(a3)
    for r in range(4 * H, R - 1):
        acc = lanes16()
        for t in range(S):
            acc_step(acc, w, r * rs, xr, t, S)
        out[r] = sum16(acc)
    for r in range(max(R - 1, 0), R):
        acc = lanes16()
        for t in range(full):
            acc_step(acc, w, r * rs, xr, t, S)
        if S > full:
            acc_step_masked(acc, w, r * rs, xr, full, S)
        out[r] = sum16(acc)
