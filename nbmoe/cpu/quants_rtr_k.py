"""Run-time repacking (-rtr) of Q4_K: 16 rows interleaved super-block by super-block, and the
integer matrix-vector kernel that reads them (the Q4_0 / Q4_1 / Q8_0 ones: quants_rtr.py).

Letters: M rows, K values per row, SB = K / 256 super-blocks per row, G = M // 16 full groups
of 16 rows; r = 0..15 a row of its group (= a 32-bit lane of a 512-bit register); j = 0..7 a
sub-block of 32 values (= one x-block of quantize_x: xq, xd [K / 32], xs = xd * block sums).

Why: the plain Q4_K kernel (quants_k_i8) spends most of a super-block's vector instructions
on unpacking one row (variable 16-bit shifts, a permute for the scales).
Here, as in quants_rtr, one 512-bit load holds 4 codes of each of 16 rows, x's 4 codes are
broadcast, and one vpdpbusd adds 4 products to every row's lane; the 6-bit scales and mins
of 16 rows unpack together, one AND and one conversion each (their bit position is folded
into x's scales, once per call).

Layout. Same shape and bytes as the GGUF tensor: group g (rows 16g..16g+15) is SB records of
2304 = 16 x 144 bytes, record b (super-block b of the 16 rows):

  byte    0: d    [16] f16                     row r's d
         32: dmin [16] f16
         64: W    [3][16] u32                  row r's 16 six-bit fields in 3 words:
                 W0 = sc0 | sc1 << 6 | sc2 << 12 | sc3 << 18 | sc4 << 24 | m7[0:2] << 30
                 W1 = sc5 | sc6 << 6 | sc7 << 12 | m0 << 18  | m1 << 24  | m7[2:4] << 30
                 W2 = m2  | m3 << 6  | m4 << 12  | m5 << 18  | m6 << 24  | m7[4:6] << 30
        256: qs   [4][8][16][4]                chunk c, word k, row r, byte i = byte 4k + i of
                                               the GGUF chunk c (32 bytes) of row r:
      byte of a qs vector  0  1  2  3 |  4  5  6  7 | ... | 60 61 62 63
      row                  0  0  0  0 |  1  1  1  1 | ... | 15 15 15 15
      low nibbles: values 64c + 4k .. + 3 (sub-block 2c), high: 64c + 32 + 4k .. (2c + 1)

Equation (row r, super-block b, sub-block j; value = d sc_j q - dmin m_j):
  out[r] = sum_b  d * sum_j float(dot_j) * sc_j * xd_j  -  dmin * sum_j m_j * xs_j
  dot_j  = sum over the sub-block's 32 values of q * xq   (int32: 8 vpdpbusd on one chain;
           odd j read q & 0xF0 = 16 q, their x scale carries the 1/16)
A field is taken as float(W & (63 << p)) = 2^p * field (exact): xk, prepared once per call,
holds xd_j 2^-p (1/16 for odd j) and xs_j 2^-p per super-block ([SB][8 + 8] f32); m7 is
assembled from its three crumbs. Per record: 32 loads, 64 and, 64 vpdpbusd, 15 and + 16
conversions for the fields, 8 conversions + 8 mul + 16 FMA, 2 vcvtph2ps + 2 FMA.
Rows past the last full group keep the GGUF layout (the plain kernels). Parallel over groups
of rows (the matmul drivers' work items hold whole groups).

Also here: `repack_q4_k` (load time), `dequant_rows_q4_k_r16` (plain loops: get_rows,
mul_mat_plain, the BLAS path's tile decoder) and `unpack_q4_k_r16` (gemm_unpack's panels:
a group is a panel, each record 8 panel records).
"""
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from .quants import FM, block32, f32, groups_in_streams, load_f16, load_u32, u8
from .quants_int8 import _dot4_init, dot_rows_i8
from .quants_k import Q4_K, dequant_rows_q4_k, k_scale_min
from .simd import F32, I8, I32, I64, arg_data, const, group_record, load_at, splat, vec, x_word16

GROUP = 16
Q4_K_R16 = 1012
SIZE, REC, HEAD = 144, 2304, 256      # bytes: GGUF super-block, group record, record head
u32, u64 = np.uint32, np.uint64
# (word, bit) of sc0..sc7 and m0..m6 in W (m7: bits 30, 31 of W0, W1, W2)
SC_AT = ((0, 0), (0, 6), (0, 12), (0, 18), (0, 24), (1, 0), (1, 6), (1, 12))
M_AT = ((1, 18), (1, 24), (2, 0), (2, 6), (2, 12), (2, 18), (2, 24))


# ---------------------------------------------------------------- repack (load time)

@njit(inline="always")
def _pack_fields(sc, m):
    """sc [8], m [8] six-bit ints -> (W0, W1, W2) as drawn at the top."""
    w0 = sc[0] | sc[1] << 6 | sc[2] << 12 | sc[3] << 18 | sc[4] << 24 | (m[7] & 3) << 30
    w1 = sc[5] | sc[6] << 6 | sc[7] << 12 | m[0] << 18 | m[1] << 24 | (m[7] >> 2 & 3) << 30
    w2 = m[2] | m[3] << 6 | m[4] << 12 | m[5] << 18 | m[6] << 24 | (m[7] >> 4) << 30
    return u32(w0), u32(w1), u32(w2)


@njit(parallel=True, cache=True, error_model="numpy")
def repack_q4_k(out, w):
    """out [E, M, row_bytes] <- w (GGUF Q4_K bytes, same shape) in the layout above; tail rows copied."""
    E, M, rb = w.shape
    SB, G = rb // SIZE, M // GROUP
    flat, src_flat = out.reshape(E, M * rb), w.reshape(E, M * rb)
    for item in prange(E * G):
        e, g = item // G, item % G
        src = src_flat[e, g * GROUP * rb:(g + 1) * GROUP * rb]     # rows 16g.. as bytes
        dst = flat[e, g * GROUP * rb:(g + 1) * GROUP * rb]
        sc, m = np.empty(8, np.int64), np.empty(8, np.int64)
        for b in range(SB):
            rec = u64(b * REC)
            for r in range(GROUP):
                so = u64(r * rb + b * SIZE)
                for i in range(2):
                    dst[rec + u64(2 * r + i)] = src[so + u64(i)]                 # d
                    dst[rec + u64(32 + 2 * r + i)] = src[so + u64(2 + i)]        # dmin
                for j in range(8):
                    s, mm = k_scale_min(src, r * rb + b * SIZE + 4, j)
                    sc[j], m[j] = np.int64(s), np.int64(mm)
                ws = _pack_fields(sc, m)
                for k in range(3):
                    for i in range(4):
                        dst[rec + u64(64 + 64 * k + 4 * r + i)] = u8(ws[k] >> u32(8 * i))
                for c in range(4):
                    for k in range(8):
                        do = rec + u64(HEAD + 64 * (8 * c + k) + 4 * r)
                        for i in range(4):
                            dst[do + u64(i)] = src[so + u64(16 + 32 * c + 4 * k + i)]
    for item in prange(E):
        out[item, G * GROUP:] = w[item, G * GROUP:]


# ---------------------------------------------------------------- decode (plain loops)

@njit(inline="always")
def fields(grp, rec, r, j):
    """(sc_j, m_j) of row r in the record at byte rec of a group's bytes grp, as float32."""
    w0 = load_u32(grp, rec + u64(64 + 4 * r))
    w1 = load_u32(grp, rec + u64(128 + 4 * r))
    w2 = load_u32(grp, rec + u64(192 + 4 * r))
    sc = w0 >> u32(6 * j) if j < 5 else w1 >> u32(6 * (j - 5))
    if j < 2:
        m = w1 >> u32(18 + 6 * j)
    elif j < 7:
        m = w2 >> u32(6 * (j - 2))
    else:
        m = (w0 >> u32(30)) | (w1 >> u32(30)) << u32(2) | (w2 >> u32(30)) << u32(4)
    return f32(sc & u32(63)), f32(m & u32(63))


@njit(inline="always")
def decode_row(out, grp, r):
    """out [K] <- row r of a group's bytes grp (v = d sc q - dmin m, as quants_k's decoder)."""
    for b in range(out.shape[0] // 256):
        rec = u64(b * REC)
        d, dmin = load_f16(grp, rec + u64(2 * r)), load_f16(grp, rec + u64(32 + 2 * r))
        for j in range(8):                            # sub-block j: nibble j % 2 of chunk j // 2
            sc, m = fields(grp, rec, r, j)
            dl, ml = d * sc, dmin * m
            v = block32()
            for k in range(8):
                for i in range(4):
                    q = grp[rec + u64(HEAD + 64 * (8 * (j // 2) + k) + 4 * r + i)]
                    v[4 * k + i] = dl * f32((q >> u8(4 * (j % 2))) & u8(15)) - ml
            for i in range(32):
                out[u64(256 * b + 32 * j + i)] = v[i]


@njit(cache=True, error_model="numpy")
def dequant_rows_q4_k_r16(out, w):
    """out [R, K] <- repacked rows w [R, row_bytes] whose first row starts a group."""
    rb = w.shape[1]
    G = w.shape[0] // GROUP
    flat = w.reshape(w.shape[0] * rb)
    for g in range(G):
        grp = flat[g * GROUP * rb:(g + 1) * GROUP * rb]
        for r in range(GROUP):
            decode_row(out[g * GROUP + r], grp, r)
    if w.shape[0] > G * GROUP:   # the tail keeps the GGUF layout
        dequant_rows_q4_k(out[G * GROUP:], w[G * GROUP:])


# ---------------------------------------------------------------- x extras

# 2^-bit of each sub-block's sc (odd ones also 1/16: their codes are read as 16 q) and m
XD_SCALE = tuple(2.0 ** -(bit + 4 * (j % 2)) for j, (_, bit) in enumerate(SC_AT))
XS_SCALE = tuple(2.0 ** -bit for _, bit in M_AT) + (1.0,)


@njit(inline="always")
def prepare_xk(xk, xd, xs):
    """xk [SB][16] f32 <- per super-block xd_j 2^-bit (1/16 for odd j), then xs_j 2^-bit (see the top)."""
    for b in range(xd.shape[0] // 8):
        for j in range(8):
            xk[16 * b + j] = xd[8 * b + j] * f32(XD_SCALE[j])
            xk[16 * b + 8 + j] = xs[8 * b + j] * f32(XS_SCALE[j])


# ---------------------------------------------------------------- the kernel (IR)

def _emit_record(context, b, sig, args):
    """acc[0:16] += the 16 rows' dots of super-block sb of the group at byte o (see the top)."""
    acc, w, o, xq, xk, sb = args

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
    xk_ = b.gep(data(4), [b.mul(sb, c(16))])
    v16f, v64 = vec(F32, 16), vec(I8, 64)
    half16 = vec(ir.HalfType(), 16)
    d, dmin = b.fpext(load(rec, 0, half16), v16f), b.fpext(load(rec, 32, half16), v16f)
    W = [load(rec, 64 + 64 * k, vec(I32, 16)) for k in range(3)]

    def field(word, bit):   # float(W & (63 << bit)) = 2^bit * field, exact
        return b.uitofp(b.and_(W[word], k32(63 << bit)), v16f)
    top = [b.lshr(W[k], k32(30 - 2 * k)) for k in range(3)]       # m7's crumbs at bits 0, 2, 4
    m7 = b.or_(top[0], b.or_(b.and_(top[1], k32(12)), b.and_(top[2], k32(48))))
    sc = [field(*at) for at in SC_AT]
    m = [field(*at) for at in M_AT] + [b.uitofp(m7, v16f)]

    def xword(v):           # x codes v..v + 3 of the super-block in all 16 lanes
        return x_word16(b, x, v)
    dots = [ir.Constant(vec(I32, 16), None)] * 8
    for ch in range(4):
        for k in range(8):
            q = load(rec, HEAD + 64 * (8 * ch + k), v64)
            dots[2 * ch] = _dot4_init(b, dots[2 * ch], b.and_(q, const(I8, [0x0F] * 64)), xword(64 * ch + 4 * k))
            dots[2 * ch + 1] = _dot4_init(b, dots[2 * ch + 1], b.and_(q, const(I8, [0xF0] * 64)),
                                          xword(64 * ch + 32 + 4 * k))

    def tree(ts):           # products pair up into FMAs (contract)
        while len(ts) > 1:
            pairs = [b.fadd(ts[i], ts[i + 1], flags=("contract",)) for i in range(0, len(ts) - 1, 2)]
            ts = pairs + ts[len(ts) // 2 * 2:]
        return ts[0]

    def xs(j):
        return splat(b, b.load(b.gep(xk_, [c(j)])), 16)
    sd = tree([b.fmul(b.fmul(b.sitofp(dots[j], v16f), sc[j], flags=("contract",)), xs(j), flags=("contract",))
               for j in range(8)])
    sm = tree([b.fmul(m[j], xs(8 + j), flags=("contract",)) for j in range(8)])
    term = b.fsub(b.fmul(d, sd, flags=("contract",)), b.fmul(dmin, sm, flags=("contract",)), flags=("contract",))
    ap = b.bitcast(data(0), v16f.as_pointer())
    b.store(b.fadd(b.load(ap, align=4), term, flags=("contract",)), ap, align=4)


@intrinsic
def acc_record(typingctx, acc, w, o, xq, xk, sb):
    """acc[0:16] += super-block sb of the 16 rows of the group at byte o of w's data, dotted
    with x: xq [K] codes, xk [SB * 16] (prepare_xk)."""
    def codegen(context, builder, sig, args):
        _emit_record(context, builder, sig, args)
        return context.get_dummy_value()
    return types.void(acc, w, o, xq, xk, sb), codegen


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_q4_k_r16(out, w, xq, xd, xs, xb, xk):
    """out [R] <- repacked rows w [R, row_bytes] (first row starts a group) @ x; xk from prepare_xk."""
    SB, G = w.shape[1] // SIZE, w.shape[0] // GROUP
    groups_in_streams(acc_record, SB, out, w, G, (xq, xk))   # groups of GROUP = 16 rows
    if w.shape[0] > G * GROUP:   # the tail keeps the GGUF layout
        dot_rows_i8(Q4_K, out[G * GROUP:], w[G * GROUP:], xq, xd, xs, xb, xk)
