"""4-bit lookup types on CPU: IQ4_NL, IQ4_XS, MXFP4 decode, float dots and integer dots.

Letters as in quants.py (R rows, K values in a row, x [K], xsum [K / 32]). The codes are
4-bit indices into a table of 16 signed levels. Block layouts (from gguf-py's quants.py):

  IQ4_NL  32 values in 18 bytes = d:f16 qs:16                     v = d * KV_IQ4[q]
  MXFP4   32 values in 17 bytes = e:u8 (E8M0 exponent) qs:16      v = 2**(e - 128) * KV_MXFP4[q]
    qs:16: byte j low nibble = value j, high nibble = value j + 16 (as Q4_0).
  IQ4_XS  256 values in 136 bytes = d:f16 scales_h:u16 scales_l:4 qs:128
    8 sub-blocks of 32: 6-bit scale ls_j = (nibble j of scales_l) | (bits 2j of scales_h) << 4,
    v = d * (ls_j - 32) * KV_IQ4[q]; sub-block j's qs are bytes 16j..16j+15, nibbles as above.
KV_MXFP4 holds the E2M1 values doubled (hence the 2**(e - 128) = half of 2**(e - 127)).

Integer dots (quants_k_i8.py and simd.py describe the scheme): the levels fit in int8, so the
codes of a block become bytes by one `vpshufb` table lookup, stored + a bias (unsigned for
vpdpbusd: + 128 for IQ4, + 12 for MXFP4) with bias * the x sum taken off per block, as
quants_int8's Q8_0. Four blocks (IQ4_XS: four sub-blocks) share one 512-bit register of codes
and one integer accumulator, x rearranged to meet them ("4 blocks per vector" below); the
last 1-3 blocks of a row of the 32-value types go one at a time.
"""
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import IQ4_NL as _IQ4_NL
from gguf.quants import MXFP4 as _MXFP4
from llvmlite import ir
from numba import njit

from .quants import FM, block32, f32, lanes16, load_f16, rows_in_streams, sum16, u8, u32

u64 = np.uint64
from .simd import F32, HAS_VBMI, I16, I32, acc_intrinsic, const, copy16, vec
from .specialize import ConstantArgs

IQ4_NL = int(GGMLQuantizationType.IQ4_NL)
IQ4_XS = int(GGMLQuantizationType.IQ4_XS)
MXFP4 = int(GGMLQuantizationType.MXFP4)

KV_IQ4 = np.array(_IQ4_NL.kvalues, np.float32)
KV_MXFP4 = np.array(_MXFP4.kvalues, np.float32)


@njit(inline="always")
def e8m0_half(e):
    """float32 2**(e - 128) for an E8M0 byte (a denormal for e < 2, as ggml computes it)."""
    bits = u32(0x00200000) << u32(e) if e < 2 else u32(e - 1) << u32(23)
    return u32(bits).view(np.float32)


@njit(inline="always")
def xs_scale(row, o, j):
    """IQ4_XS sub-block j's signed scale ls_j - 32 as float32 (block at row[o:])."""
    lo = (row[o + 4 + j // 2] >> u8(4 * (j % 2))) & u8(15)
    hi = (u32(row[o + 2]) | (u32(row[o + 3]) << u32(8))) >> u32(2 * j) & u32(3)
    return f32(np.int32(lo) | np.int32(hi << u32(4))) - f32(32)


# ---------------------------------------------------------------- dequantize (plain loops)

@njit(cache=True, error_model="numpy")
def dequant_rows_iq4_nl(out, w):
    for r in range(w.shape[0]):
        row = w[r]
        for b in range(row.shape[0] // 18):
            d = load_f16(row, b * 18)
            v = block32()
            for j in range(16):
                q = row[b * 18 + 2 + j]
                v[j] = d * KV_IQ4[q & u8(15)]
                v[j + 16] = d * KV_IQ4[q >> u8(4)]
            for i in range(32):
                out[r, b * 32 + i] = v[i]


@njit(cache=True, error_model="numpy")
def dequant_rows_mxfp4(out, w):
    for r in range(w.shape[0]):
        row = w[r]
        for b in range(row.shape[0] // 17):
            d = e8m0_half(row[b * 17])
            v = block32()
            for j in range(16):
                q = row[b * 17 + 1 + j]
                v[j] = d * KV_MXFP4[q & u8(15)]
                v[j + 16] = d * KV_MXFP4[q >> u8(4)]
            for i in range(32):
                out[r, b * 32 + i] = v[i]


@njit(cache=True, error_model="numpy")
def dequant_rows_iq4_xs(out, w):
    for r in range(w.shape[0]):
        row = w[r]
        for b in range(row.shape[0] // 136):
            o = b * 136
            d = load_f16(row, o)
            for j in range(8):
                dl = d * xs_scale(row, o, j)
                v = block32()
                for l in range(16):
                    q = row[o + 8 + 16 * j + l]
                    v[l] = dl * KV_IQ4[q & u8(15)]
                    v[l + 16] = dl * KV_IQ4[q >> u8(4)]
                for i in range(32):
                    out[r, b * 256 + 32 * j + i] = v[i]


# ---------------------------------------------------------------- float dots

@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_iq4_nl(out, w, x, xsum):
    for r in range(w.shape[0]):
        row, acc = w[r], lanes16()
        for b in range(row.shape[0] // 18):
            o, ox = b * 18, b * 32
            d = load_f16(row, o)
            for j in range(16):
                q = row[o + 2 + j]
                acc[j] += d * (KV_IQ4[q & u8(15)] * x[ox + j] + KV_IQ4[q >> u8(4)] * x[ox + 16 + j])
        out[r] = sum16(acc)


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_mxfp4(out, w, x, xsum):
    for r in range(w.shape[0]):
        row, acc = w[r], lanes16()
        for b in range(row.shape[0] // 17):
            o, ox = b * 17, b * 32
            d = e8m0_half(row[o])
            for j in range(16):
                q = row[o + 1 + j]
                acc[j] += d * (KV_MXFP4[q & u8(15)] * x[ox + j] + KV_MXFP4[q >> u8(4)] * x[ox + 16 + j])
        out[r] = sum16(acc)


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_iq4_xs(out, w, x, xsum):
    for r in range(w.shape[0]):
        row, acc = w[r], lanes16()
        for b in range(row.shape[0] // 136):
            o = b * 136
            d = load_f16(row, o)
            for j in range(8):
                dl, ox = d * xs_scale(row, o, j), b * 256 + 32 * j
                for l in range(16):
                    q = row[o + 8 + 16 * j + l]
                    acc[l] += dl * (KV_IQ4[q & u8(15)] * x[ox + l] + KV_IQ4[q >> u8(4)] * x[ox + 16 + l])
        out[r] = sum16(acc)


# ---------------------------------------------------------------- integer dots (IR bodies)
# Codes are level + bias (unsigned); each block takes bias * d * xs[b] off. The bias is the
# smallest that makes every level >= 0: a larger one loses float32 digits to cancellation.

_IQ4_U8 = [v + 128 for v in _IQ4_NL.kvalues]
_MXFP4_U8 = [v + 12 for v in _MXFP4.kvalues]


def _nl_scales(e, size, n, head=None):
    """<n x float>: the f16 d of n IQ4_NL blocks (picked out of head, the first 64 bytes of
    the blocks, where given)."""
    if head is None:
        h = e.pack(*[e.word(i * size, 16) for i in range(n)])
    else:
        h = e.pick(e.b.bitcast(head, vec(I16, 32)), [i * size // 2 for i in range(n)])
    return e.b.fpext(e.b.bitcast(h, vec(ir.HalfType(), n)), vec(F32, n))


def _mx_scales(e, size, n, head=None):
    """<n x float>: e8m0_half of the exponent bytes of n MXFP4 blocks (as _nl_scales)."""
    b = e.b
    x = e.pack(*[e.word(i * size, 8) for i in range(n)]) if head is None else e.pick(head, [i * size for i in range(n)])
    x = b.zext(x, vec(I32, n))
    small = b.shl(const(I32, [0x00200000] * n), x)
    big = b.shl(b.sub(x, const(I32, [1] * n)), const(I32, [23] * n))
    return b.bitcast(b.select(b.icmp_unsigned("<", x, const(I32, [2] * n)), small, big), vec(F32, n))


def _block32(size, qs_at, scales, table, bias):
    """Body for one 32-value block of `size` bytes, qs at qs_at: a row's last 1-3 blocks
    after its quads (below). The 16 code bytes go in twice (a 256-bit dot against x in its
    own order), shifted per 16-bit lane to their low and high nibbles."""
    def body(e):
        d = scales(e, size, 1)
        e.add(e.mul(d, e.xs(1), e.fconst(-bias, 1)))
        q = e.bytes(qs_at, 16)
        codes = e.band(e.shr16(e.cat(q, q), [0] * 8 + [4] * 8), 15)
        e.acc_dot(e.lut(table, codes), e.xq(0, 32), e.mul(d, e.xd(1)), [0] * 8)
    return body


acc_iq4_nl1 = acc_intrinsic(_block32(18, 2, _nl_scales, _IQ4_U8, 128), 32, 1, 18)
acc_mxfp41 = acc_intrinsic(_block32(17, 1, _mx_scales, _MXFP4_U8, 12), 32, 1, 17)


# ---------------------------------------------------------------- integer dots, 4 blocks per vector
# Gathering each block's 16 code bytes twice into a register (broadcast, insert, shift per
# 16-bit lane, as _block32) to meet x in its natural order costs. Here one register holds the
# code bytes of 4 blocks (IQ4_XS: 4 sub-blocks, one 64-byte load; the 32-value types: 4 pieces),
# and x is rearranged once per call (prepare_quads) to meet them:
#   codes  [qs_0 | qs_1 | qs_2 | qs_3]  (16 bytes each: byte i = values i (low), 16 + i (high))
#   xq4    [x_0[0:16] | x_1[0:16] | x_2[0:16] | x_3[0:16] | x_0[16:32] | ... | x_3[16:32]]
#   lanes = init + dot4(codes & 15 -> level, xq4[0:64]) + dot4(codes >> 4 -> level, xq4[64:128])
# so lanes 4j..4j + 3 hold block j's whole dot: one float conversion and one FMA with the
# scales [s_0 x 4 | s_1 x 4 | s_2 x 4 | s_3 x 4] per 4 blocks; init = -bias * (the lane's 8 x
# codes), from prepare_quads, takes the level bias off (no float term per block).

def _quad(e, q, table, at, s):
    """acc += float(lanes) * s for the codes q [64 bytes of 4 blocks], x at xq4[at:at + 128]
    and lane biases xs[at / 8:]; s: <16 x float> per-lane scales."""
    lo, hi = e.lut(table, e.band(q, 15)), e.lut(table, e.band(e.shr(q, 4), 15))
    lanes = e.dot(hi, e.xq(at + 64), e.dot(lo, e.xq(at), e.xsi(16, at // 8)))
    e.add(e.mul(e.tofloat(lanes), s))


def _quad4(e, i):
    return [4 * i + j // 4 for j in range(16)]


def _quad_bytes(e, size, qs_at, vbmi):
    """(<64 x i8> the 16 code bytes of 4 consecutive blocks side by side, the blocks' first 64
    bytes or None). With AVX-512 VBMI two 64-byte loads (bytes 0.. and 4 size - 64..) and one
    two-source byte permute (vpermt2b) gather the codes, and the scales come out of the first
    load by one more permute: 30 -> 23 instructions a quad (MXFP4). Without it: four 16-byte
    loads put together, the scales one byte / word at a time."""
    if not vbmi:
        return e.cat(*[e.bytes(j * size + qs_at, 16) for j in range(4)]), None
    tail = 4 * size - 64                              # block 3's codes lie past byte 64
    idx = [j * size + qs_at + i if j < 3 else 64 + 3 * size + qs_at + i - tail for j in range(4) for i in range(16)]
    head = e.bytes(0, 64)
    return e.b.shuffle_vector(head, e.bytes(tail, 64), const(I32, idx)), head


def _blocks32_quad(size, qs_at, scales, table, vbmi=HAS_VBMI):
    """Body for 4 consecutive 32-value blocks of `size` bytes, qs at qs_at (xq4 layout)."""
    def body(e):
        q, head = _quad_bytes(e, size, qs_at, vbmi)
        s = e.mul(scales(e, size, 4, head), e.xd(4))
        _quad(e, q, table, 0, e.pick(s, _quad4(e, 0)))
    return body


def _iq4_xs_quad(e):
    b = e.b
    lo = b.lshr(e.splat(e.word(4), 8), const(I32, range(0, 32, 4)))
    hi = b.lshr(e.splat(b.zext(e.word(2, 16), I32), 8), const(I32, range(0, 16, 2)))
    ls = b.or_(e.band(lo, 15), e.shl(e.band(hi, 3), 4))
    s = e.mul(e.splat(e.f16(0), 8), b.fsub(e.tofloat(ls), e.fconst(32, 8)), e.xd(8))
    for h in range(2):                                # sub-blocks 4h..4h + 3: one 64-byte load
        _quad(e, e.bytes(8 + 64 * h, 64), _IQ4_U8, 128 * h, e.pick(s, _quad4(e, h)))


acc_iq4_nl_quad = acc_intrinsic(_blocks32_quad(18, 2, _nl_scales, _IQ4_U8), 128, 16, 72)
acc_mxfp4_quad = acc_intrinsic(_blocks32_quad(17, 1, _mx_scales, _MXFP4_U8), 128, 16, 68)
acc_iq4_xs_quad = acc_intrinsic(_iq4_xs_quad, 256, 32, 136)


@njit(inline="always")
def quad_bias(qtype):
    """The offset of the stored levels (+ 128 for IQ4, + 12 for MXFP4: unsigned for vpdpbusd)."""
    return 12 if qtype == MXFP4 else 128


@njit(cache=True, error_model="numpy")
def prepare_quads(xb, xq, bias):
    """xb [K / 8 + K / 4] int32 <- lane biases [K / 8] (-bias * the sum of each lane's 8 x
    codes), then xq4 [K] int8 (the layout above; values past the last whole 128 as in xq)."""
    K = xq.shape[0]
    G, n = u64(K // 128), u64(K // 8)
    x4 = xb[n:n + u64(K // 4)].view(np.int8)
    for g in range(G):
        for j in range(u64(4)):
            copy16(x4, u64(128) * g + u64(16) * j, xq, u64(128) * g + u64(32) * j)
            copy16(x4, u64(128) * g + u64(64) + u64(16) * j, xq, u64(128) * g + u64(32) * j + u64(16))
    for i in range(G * u64(128), u64(K)):
        x4[i] = xq[i]
    for L in range(G * u64(16)):                     # lane L: xq4 bytes 4l.., 64 + 4l.. of its 128
        o = L // u64(16) * u64(128) + L % u64(16) * u64(4)
        s = np.int32(0)
        for i in range(u64(4)):
            s += np.int32(x4[o + i]) + np.int32(x4[o + u64(64) + i])
        xb[L] = -bias * s


# ---------------------------------------------------------------- integer dots (rows)
# The 32-value types: 4 blocks per call, the last 1-3 blocks of each row one at a time in
# loops of their own (a branch in the row loop costs a refcount pair per row).

@njit(inline="always")
def quads(xb, K):
    """prepare_quads' xq4 and lane biases in xb."""
    return xb[K // 8:K // 8 + K // 4].view(np.int8), xb


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_iq4_nl_i8(out, w, xq, xd, xs, xb):
    nb = w.shape[1] // 18
    xq4, xl = quads(xb, 32 * nb)
    rows_in_streams(acc_iq4_nl_quad, 4 * 18, nb // 4, out, w, xq4, xd, xl)
    for b in range(nb // 4 * 4, nb):
        for r in range(w.shape[0]):
            row, acc = w[r], lanes16()
            acc_iq4_nl1(acc, row, b * 18, xq, xd, xs, b)
            out[r] += sum16(acc)


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_mxfp4_i8(out, w, xq, xd, xs, xb):
    nb = w.shape[1] // 17
    xq4, xl = quads(xb, 32 * nb)
    rows_in_streams(acc_mxfp4_quad, 4 * 17, nb // 4, out, w, xq4, xd, xl)
    for b in range(nb // 4 * 4, nb):
        for r in range(w.shape[0]):
            row, acc = w[r], lanes16()
            acc_mxfp41(acc, row, b * 17, xq, xd, xs, b)
            out[r] += sum16(acc)


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_iq4_xs_i8(out, w, xq, xd, xs, xb):
    xq4, xl = quads(xb, w.shape[1] // 136 * 256)
    rows_in_streams(acc_iq4_xs_quad, 136, w.shape[1] // 136, out, w, xq4, xd, xl)


# ---------------------------------------------------------------- dispatch (from quants.py, quants_int8.py)

@njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
def dequant_rows_iq4(qtype, out, w):
    if qtype == IQ4_XS:
        dequant_rows_iq4_xs(out, w)
    elif qtype == MXFP4:
        dequant_rows_mxfp4(out, w)
    elif qtype == IQ4_NL:
        dequant_rows_iq4_nl(out, w)


@njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
def dot_rows_iq4(qtype, out, w, x, xsum):
    if qtype == IQ4_XS:
        dot_rows_iq4_xs(out, w, x, xsum)
    elif qtype == MXFP4:
        dot_rows_mxfp4(out, w, x, xsum)
    elif qtype == IQ4_NL:
        dot_rows_iq4_nl(out, w, x, xsum)


@njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
def dot_rows_iq4_i8(qtype, out, w, xq, xd, xs, xb):
    """xb: prepare_quads' record."""
    if qtype == IQ4_XS:
        dot_rows_iq4_xs_i8(out, w, xq, xd, xs, xb)
    elif qtype == MXFP4:
        dot_rows_mxfp4_i8(out, w, xq, xd, xs, xb)
    elif qtype == IQ4_NL:
        dot_rows_iq4_nl_i8(out, w, xq, xd, xs, xb)
