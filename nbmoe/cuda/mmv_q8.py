"""Matrix-vector products with x in 8 bits (decoding, T <= matmul.MMV_MAX_T): the row dot
shared by matmul's int8 matrix-vector kernels and the fused decode kernels (fused.py).

Letters as in matmul.py: T tokens, M rows, K values a row, RB bytes a row, B = K / 32 blocks,
NT tokens sharing a weight load, S warps a row (split-K). x is in 8 bits per 32-block
(x8.quantize_x): xq int32 words of 4 codes, xds (d, s) float32 per block, so that
    w[r] . x[t] = sum over blocks b of  xd_b * d_b * (codes_b . xcodes_b) + m_b * xs_b
with each block's integer dot product exact (dp4a) and one scale multiply per chunk.

The chunk: what a lane takes per step, UPC consecutive units (8 values each, quants.py) of one
block, CHUNK_UNITS[type] (1 where a block's scale d changes between its units, Q3_K, Q6_K, ...):
    Q4_0 (18 B block = d:f16 qs:16), UPC 2: half a block, 8 bytes of qs = 16 values
    Q8_0 (34 B block = d:f16 qs:32), UPC 2: half a block, 16 bytes of qs = 16 values
    MXFP4 (17 B block = e:u8 qs:16), UPC 4: the whole block, 32 values
A row is nch = B * 4 / UPC chunks. Lane l of warp slice sl (0..S-1) takes chunks
    c = l + 32 * (j + V * (sl + S * i)),   j = 0..V-1 in one step (unrolled), i = 0, 1, ...
so each load instruction of a step reads consecutive chunks across the warp (coalesced), and
a lane has V chunks' loads in flight at once (the first kernels, one unit a step, waited a
DRAM round trip per unit: latency-bound at 0.5-0.9 TB/s). V = chunks / (32 S) rounded up, at
most MMV_CHUNKS; chunks past the row (the last step) decode the last chunk again (in bounds,
no branch around the loads) and are not added.
Per lane the sums run in chunk order, then the warp adds its lanes by a butterfly (warp_sum):
every kernel built on row_dot (matmul's and fused.py's) sums a row in the same order, so the
fused kernels give bit-identical results to the separate launches they replace.
"""
import numpy as np

from . import device_fn, dp4a, ld_f32, ld_i32
from .quants import Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, qtype_info
from .quants_iq4 import MXFP4

f32 = np.float32

# Units (8 values) a lane takes per chunk, per type: 1, 2 or 4 (a whole 32-block). Types whose
# scale d is one per 32-block may take more than 1 (their units' integer sums are added first).
# MXFP4 takes whole blocks: its 17-byte blocks are read a byte at a time, so a lane's chunk
# should hold many loads at once (gpt-oss-20b decode 320 -> 374 t/s against 1 unit a chunk).
CHUNK_UNITS = {Q8_0: 2, Q4_0: 2, Q4_1: 2, Q5_0: 2, Q5_1: 2, MXFP4: 4}
FOLD_TYPES = (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4)    # decoders that use block b only as its offset
# Chunks a lane has in flight per row and step, at most (<= 8; tools/cuda_mmv_check.py sweeps it).
MMV_CHUNKS = 4


def chunk_units(qtype):
    return CHUNK_UNITS.get(int(qtype), 1)


def chunks_in_flight(qtype, K, S=1):
    """V of a row of K values read by S warps: enough chunks a lane for one step, <= MMV_CHUNKS."""
    nch = (K // 32) * (4 // chunk_units(qtype))
    return max(1, min(MMV_CHUNKS, -(-nch // (32 * S))))


def row_dot_fn(qtype, V, NT=1, S=1, NW=1):
    """row_dot(acc, isum, w0, w1, base, xq, xds, xr0, xlast, K, lane, sl): adds this lane's share
    of (row at byte offset base of w0) . (x rows min(xr0 + t, xlast), t < NT) to acc[t], and
    with NW == 2 that of the row at the same offset of w1 to acc[NT + t] (gate and up rows:
    both rows' loads in flight together). acc float32 [NW * NT], isum int32 [NT]: the caller's
    local arrays (a device function cannot make them in the simulator)."""
    t_ = qtype_info(qtype)
    idec, split = t_.idec, t_.split
    UPC = chunk_units(qtype)
    CPB = 4 // UPC                         # chunks a block
    CSH = {1: 0, 2: 1, 4: 2}[CPB]
    FUPC = f32(UPC)
    FOLD, SIZE = int(qtype) in FOLD_TYPES, t_.size
    USTR, X1 = (4, 16) if split else (8, 4)   # bytes of x codes a unit, offset of its 2nd word
    assert 1 <= V <= 8 and NW in (1, 2)

    @device_fn
    def chunk_dot(acc, isum, k0, w, base, xq, xds, xr0, xlast, b, u0, K, valid):
        # Block b's offset goes into the 64-bit bases once (FOLD types: their decoders use b only
        # as size * b), so the chunk's loads are at constant offsets (no 64-bit add a load).
        wb, bb = (base + SIZE * b, 0) if FOLD else (base, b)
        for t in range(NT):
            isum[t] = 0
        d = f32(0.0)
        m4 = f32(0.0)
        for k in range(UPC):              # the block's units: one scale, integer sums added
            c0, c1, d, m4 = idec(w, wb, bb, u0 + k)
            for t in range(NT):
                qb = min(xr0 + t, xlast) * K + 32 * b + USTR * u0   # x codes of unit u0 in xq
                isum[t] = dp4a(c0, ld_i32(xq, qb, USTR * k),
                               dp4a(c1, ld_i32(xq, qb, USTR * k + X1), isum[t]))
        for t in range(NT):
            db = min(xr0 + t, xlast) * (K // 4) + 8 * b             # block b's (xd, xs) in xds
            v = ld_f32(xds, db, 0) * (d * f32(isum[t])) + (m4 * FUPC) * ld_f32(xds, db, 4)
            if valid:
                acc[k0 + t] += v

    @device_fn
    def chunk(acc, isum, w0, w1, base, xq, xds, xr0, xlast, c, nch, K):
        cc = min(c, nch - 1)
        b = cc >> CSH
        u0 = (cc & (CPB - 1)) * UPC
        chunk_dot(acc, isum, 0, w0, base, xq, xds, xr0, xlast, b, u0, K, c < nch)
        if NW == 2:
            chunk_dot(acc, isum, NT, w1, base, xq, xds, xr0, xlast, b, u0, K, c < nch)

    @device_fn
    def row_dot(acc, isum, w0, w1, base, xq, xds, xr0, xlast, K, lane, sl):
        nch = (K >> 5) * CPB
        for c0 in range(lane + 32 * V * sl, nch, 32 * V * S):
            # the V chunks of a step, unrolled by hand (NVVM keeps a range(V) loop a loop)
            chunk(acc, isum, w0, w1, base, xq, xds, xr0, xlast, c0, nch, K)
            if V > 1:
                chunk(acc, isum, w0, w1, base, xq, xds, xr0, xlast, c0 + 32, nch, K)
            if V > 2:
                chunk(acc, isum, w0, w1, base, xq, xds, xr0, xlast, c0 + 64, nch, K)
            if V > 3:
                chunk(acc, isum, w0, w1, base, xq, xds, xr0, xlast, c0 + 96, nch, K)
            if V > 4:
                chunk(acc, isum, w0, w1, base, xq, xds, xr0, xlast, c0 + 128, nch, K)
            if V > 5:
                chunk(acc, isum, w0, w1, base, xq, xds, xr0, xlast, c0 + 160, nch, K)
            if V > 6:
                chunk(acc, isum, w0, w1, base, xq, xds, xr0, xlast, c0 + 192, nch, K)
            if V > 7:
                chunk(acc, isum, w0, w1, base, xq, xds, xr0, xlast, c0 + 224, nch, K)
    return row_dot


@device_fn
def unit_words(b, u, split):
    """Word indices in xq of the x columns of unit u of block b (quants.unit_cols; row_dot has
    them as byte offsets: 32 b + USTR u and + X1)."""
    if split:
        return 8 * b + u, 8 * b + 4 + u
    return 8 * b + 2 * u, 8 * b + 2 * u + 1
