"""Prompt products on int8 tensor cores: mul_mat and mul_mat_id for T > MMV_MAX_T tokens, for the
block types with an integer-code decoder (quants.py idec: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q3_K,
Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4), as llama.cpp's MMQ. matmul.py dispatches here when
matmul.MMA is on (and INT8_DOT: both are the int8 path), the type has an idec and K % 32 == 0.

Letters as in matmul.py: T tokens, M rows, K values per row, B = K / 32 blocks, E experts, A
chosen per token, X x rows per token, N = T * A pairs. The unit: 8 values of a block.

x is quantized once to 8 bits per 32-block (x8.quantize_x: xq int32 words of 4 codes,
xds (xd, xs = xd * sum of codes) per block), the weights' units decoded by idec to int8 codes
with value = d * code + m (Q4_0, Q5_0: codes q - 8, q - 16 and m = 0). Per 32-block b (or 16-value half h where the scale changes every
16 values: Q3_K, Q6_K, which have m = 0):

    out[t, r] = sum_b  d[r, b] * xd[t, b] * (codes[r, b] . xcodes[t, b])  +  m[r, b] * xs[t, b]
    (Q3_K, Q6_K:  sum_b  xd[t, b] * sum_h d[r, b, h] * (codes[r, b, h] . xcodes[t, b, h]))

The integer dot products of a 16-row x 8-token x 32-value piece are one mma.sync (mma.py);
the float scaling follows per block, so an int32 never sums more than 32 products.
"""
import numpy as np
from numba import cuda

from . import SIM, as_f32, device_fn, ld_f32, ld_i32, or_empty, st_f32, st_i32
from .ops import _glu
from .matmul_tiled import group_by_expert, sum_splits, tile_slots
from .mma import mma_s8_16x8x16, mma_s8_16x8x32
from .mmv_q8 import unit_words
from .quants import Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, SIGN_BYTES, qtype_info
from .quants_iq4 import IQ4_NL, IQ4_XS, MXFP4
from .quants_k import Q3_K, Q4_K, Q5_K, Q6_K
from .scratch import buffer, cached, sm_count
from .x8 import quantize_x

f32 = np.float32
i32 = np.int32
u32 = np.uint32

# Types whose d changes every 16 values (two k16 products a block; their m is 0); types with
# an offset m of their own (the others have m = 0: no offset term); types whose m is a fixed
# multiple of d, m = -o d, moved into the codes instead (q - o as int8: (q + 128 - o) ^ 0x80
# a byte; no offset term either).
PER16 = {Q3_K, Q6_K}
HAS_M = {Q4_1, Q5_1, Q4_K, Q5_K}
TO_SIGNED = {Q4_0: 0x78787878, Q5_0: 0x70707070}          # + 128 - 8, + 128 - 16 a byte
assert not PER16 & HAS_M and not (PER16 | HAS_M) & set(TO_SIGNED)
assert not {Q8_0, IQ4_NL, IQ4_XS, MXFP4} & HAS_M

# A block of mul_mat computes TM rows x TT tokens (mul_mat_id: ID_TILES below) with
# WM x WT warps, each a (TM / WM) x (TT / WT) piece of 16 x 8 mma tiles; it steps K by KB
# blocks of 32 (shared memory: (TM + TT) * (32 KB + 16) bytes + scales, <= 48 KB). The simulator
# keeps a few small warps (every thread is a Python thread there).
TM, TT, WM, WT, KB = (32, 16, 2, 1, 2) if SIM else (128, 64, 4, 2, 4)
# Dense products whose grid has fewer than SPLIT_FILL blocks an SM (the k and v products of a
# 512-token prompt: 32 blocks) split K over grid z, each split at least SPLIT_MIN_STEPS K
# steps: a block's K steps run one after another at about the same time a step however few
# blocks share its SM.
SPLIT_FILL, SPLIT_MIN_STEPS = 2, 2
# Blocks an SM should hold at once (launch bounds: ptxas keeps registers to 64K / (MIN_BLOCKS
# * threads), 128 at 256 threads; unbounded, some types took ~155 and ran one block an SM).
MIN_BLOCKS = 2
# mul_mat_id's tiles by the pairs an expert averages, p = T * A / E: the first row whose least p
# is met gives (TM, TT, WM, WT, blocks an SM). Slots that hold about all of an expert's pairs
# decode each weight unit into shared memory once (tools/cuda_mma_check.py --moe, docs/kernels.md).
ID_TILES = (((12, (32, 32, 2, 2, 1)), (0, (32, 16, 2, 1, 2))) if SIM else
            ((64, (128, 128, 4, 4, 1)), (0, (128, 64, 4, 2, 2))))

I2F_MAGIC = 0x4B400000           # float32 1.5 * 2^23: an int below 2^22 added to its mantissa
F_MAGIC = f32(12582912.0)


@device_fn
def i2f(c):
    """int32 c (|c| < 2^22; an mma over 32 int8 products is < 2^19) to float32 by an integer
    and a float add: I2F runs at a quarter of the FMA rate (16 a clock per SM on sm_80/90)."""
    return as_f32(u32(c + I2F_MAGIC)) - F_MAGIC


@device_fn
def glu_tile_row(q):
    """The tile row of feature q's gate row in a tile that applies the GLU: each 32 tile rows
    are 16 features' gate rows, then the same features' up rows (16 rows further)."""
    return ((q >> 4) << 5) + (q & 15)


@device_fn
def glu_feature(lr):
    """The feature of tile row lr (glu_tile_row inverted), and 1 if lr is its up row."""
    return ((lr >> 5) << 4) + (lr & 15), (lr >> 4) & 1


# ---------------------------------------------------------------- the kernel
# out[orow[j], r0 + i] = sum_k w[rbase + r0 + i, k] * x[xrow[j], k] over the tile's i < TM rows
# and j < TT token slots, with slots as in matmul_tiled.tiled_kernel (plain: token by * TT + j;
# gathered: pair order[first + j] = t * A + a of tile by of the expert table, x row
# t * X + (a or 0), out row p of out [T, A, M] seen as [T * A, M]).
#
# Block: NTH = 32 * WM * WT threads. Per K step of KB blocks (kb0 = step * KB):
#  1. all threads fill shared memory: thread tid decodes unit tid % 4 of block (tid % 4 KB) / 4
#     (8 codes = 2 words) of rows tid / (4 KB) + RSTEP i, scale slot tid % NS of rows tid / NS +
#     SCSTEP i (a block's scales once, not by each of its units), and loads x word
#     tid % 8 KB of slots tid / (8 KB) + JSTEP i: the same share every K step, addressed by byte
#     offsets fixed before the loop (recomputing it per element cost ~half the kernel's instructions)
#                    k-step words 0 .. 8 KB - 1 (+ 4 pad)           scales
#       wc [TM, S]   row i: codes of w row r0 + i, in k order       wd [KB or 2 KB, TM]  d
#                    (block kb = words 8 kb .. 8 kb + 7)            wm [KB, TM]          m
#       xc [TT, S]   slot j: x codes of x row xrow[j]               xd, xsum [KB, TT]    xd, xs
#     Row stride S = 8 KB + 4 words (= 4 mod 8): the fragment loads of a warp (rows g = 0..7,
#     words t = 0..3) hit banks (S g + t + const) mod 32: all different, no bank conflicts.
#  2. warp (wm, wt) = (warp % WM, warp // WM) owns rows wm * TM / WM + 16 i (i < MI) and slots
#     wt * TT / WT + 8 j (j < NJ): per block kb it loads the A fragments of its MI row tiles
#     and the B fragments of its NJ slot tiles (words 8 kb + t, 8 kb + 4 + t: mma.py's table),
#     runs MI * NJ mma and adds each int32 result, scaled, into its float32 accumulators:
#         acc[i, j, e] += d[row] * xd[slot] * D_e  (+ m[row] * xs[slot])
#     Lane (g, t) holds rows g, g + 8 and slots 2t, 2t + 1 of each tile (e = 0..3).
#  3. after the last step the lanes store their accumulators (rows < M, slots with a token).
# Warps whose slots hold no token (a partly filled tile) skip step 2 (a warp-uniform branch).
# glu (mul_mat_id of a merged gate_up [E, 2F, RB], -muge): block x takes features f0 + [0, TM/2)
# and its tile rows pair them (glu_tile_row): a warp's row tiles 2i and 2i + 1 are the gate and up
# rows of the same 16 features, so each lane holds both values of its outputs and stores
#     out[p, f] = act(gate[p, f] + bg, up[p, f] + bu)      (out [T, A, F], no [T, A, 2F] pass)
# (act fixed at compile time; every lane computes all its values, then stores the valid ones: a
# branch per value kept the activations' long-latency steps from overlapping)

def _mma_kernel(qtype, TM, TT, WM, WT, KB, gather, split_k=False, min_blocks=None, glu=None):
    t_ = qtype_info(qtype)
    idec, split = t_.idec, t_.split
    BSIZE, BVALS = t_.size, t_.block        # bytes and values of a GGUF block of the type
    per16, has_m = int(qtype) in PER16, int(qtype) in HAS_M
    signed = int(qtype) in TO_SIGNED
    shift = u32(TO_SIGNED.get(int(qtype), 0))
    assert not (per16 and split)           # per-16 scales need linear units (half = u // 2)
    NTH = 32 * WM * WT
    WR, WC = TM // WM, TT // WT            # a warp's rows and slots
    MI, NJ = WR // 16, WC // 8             # its mma tiles
    assert MI * 16 * WM == TM and NJ * 8 * WT == TT
    assert glu is None or (gather and not split_k and WR % 32 == 0)
    act, glu = (glu, True) if glu is not None else (0, False)
    KW = 8 * KB                            # words of a row in a K step
    S = KW + 4
    NS = 2 * KB if per16 else KB
    ACC = 4 * MI * NJ
    UQ = 4 * KB                            # units of a row in a K step
    RSTEP = NTH // UQ                      # rows apart of a thread's units
    NU = TM // RSTEP                       # units a thread decodes a K step
    JSTEP = NTH // KW                      # slots apart of a thread's x words
    NX = TT // JSTEP                       # x words a thread loads a K step
    SSTEP = NTH // KB                      # slots apart of a thread's x scales
    SPB = NS // KB                         # weight scales a block (2: one a 16-value half)
    SCSTEP = NTH // NS                     # rows apart of a thread's weight scales
    NSC = (TM + SCSTEP - 1) // SCSTEP      # weight scales a thread decodes a K step
    NSX = (TT + SSTEP - 1) // SSTEP
    min_blocks = min_blocks or MIN_BLOCKS
    assert NTH % UQ == 0 and TM % RSTEP == 0 and NTH % KW == 0 and TT % JSTEP == 0 and NTH % NS == 0
    # glu: a thread's units i < NU / 2 take the gate rows of features rr0 + RSTEP i, the others
    # the same features' up rows, so their weight rows stay RSTEP apart; a power of two RSTEP
    # keeps their tile rows glu_tile_row(rr0) + a constant each
    assert glu is None or (NU % 2 == 0 and RSTEP & (RSTEP - 1) == 0 and SCSTEP & (SCSTEP - 1) == 0)

    def build():
        @cuda.jit(**({} if SIM else dict(launch_bounds=(NTH, min_blocks))))
        def mul_mat_mma_kernel(out, w, xq, xds, RB, K, T, M, order, tiles, A, X, KC, bias):
            wc = cuda.shared.array((TM, S), i32)
            xc = cuda.shared.array((TT, S), i32)
            wd = cuda.shared.array((NS, TM), f32)
            wm = cuda.shared.array((KB, TM), f32)
            xd = cuda.shared.array((KB, TT), f32)
            xsum = cuda.shared.array((KB, TT), f32)
            xrow = cuda.shared.array(TT, i32)
            orow = cuda.shared.array(TT, i32)
            tid = cuda.threadIdx.x
            r0 = cuda.blockIdx.x * TM
            f0 = cuda.blockIdx.x * (TM // 2)         # glu: the block's first feature
            F = M >> 1
            if gather and cuda.blockIdx.y >= tiles[0]:
                return                               # the whole block: beyond the tile table
            rbase, nslots = tile_slots(xrow, orow, order, tiles, cuda.blockIdx.y, tid, NTH, TT, T,
                                       M, A, X, gather)
            lane = tid & 31
            warp = tid >> 5
            g = lane >> 2
            t4 = lane & 3
            rw = (warp % WM) * WR                    # the warp's first row and slot in the tile
            cw = (warp // WM) * WC
            wa = 4 * ((rw + g) * S + t4)             # byte offsets: wc row rw + g, word t4
            xa = 4 * ((cw + g) * S + t4)             # xc slot cw + g, word t4
            da = 4 * (rw + g)                        # wd, wm column rw + g
            sa = 4 * (cw + 2 * t4)                   # xd, xsum column cw + 2 t4
            acc = cuda.local.array(ACC, f32)
            bx0 = cuda.local.array(NJ, i32)          # B fragments of the warp's slot tiles
            bx1 = cuda.local.array(NJ, i32)
            sx0 = cuda.local.array(NJ, f32)          # xd of the lane's two slots of each tile
            sx1 = cuda.local.array(NJ, f32)
            mx0 = cuda.local.array(NJ, f32)          # xc of them (types with m)
            mx1 = cuda.local.array(NJ, f32)
            for i in range(ACC):
                acc[i] = f32(0.0)
            nb = K >> 5
            KQ = K >> 2                              # bytes of an x row in xds (2 floats a block)
            cuda.syncthreads()
            # step 1's share of each thread, the same every K step: unit uu of block kbu of
            # rows rr0 + RSTEP i (i < NU), x word xw of slots xj0 + JSTEP i (i < NX), and the
            # x scales of slots xsj0 + SSTEP i, block xsk
            kbu = (tid % UQ) >> 2
            uu = tid & 3
            rr0 = tid // UQ
            w0, w1 = unit_words(kbu, uu, split)
            wa0 = 4 * (rr0 * S + w0)                 # wc byte offsets of the thread's first row
            wa1 = 4 * (rr0 * S + w1)
            rfirst = (rbase + r0 + rr0) * RB         # weight byte offsets: the first row, the
            rlast = (rbase + M - 1) * RB             # tile's last, rows apart
            rstep = RSTEP * RB
            # and the scales' share: scale slot ss (block and 16-value half) of rows sr0 +
            # SCSTEP i, decoded once, not by each of the slot's units (a warp's lanes read a
            # few rows' blocks side by side, not 32 rows' lines)
            ss = tid % NS
            sr0 = tid // NS
            sb = ss // SPB                           # its block in the K step
            sunit = 2 * (ss % SPB)                   # unit 2 h: the codes go unused there
            sfirst = (rbase + r0 + sr0) * RB
            sstep = SCSTEP * RB
            fup = F * RB                             # glu: the up rows, F rows after the gate's
            if glu:                                  # gate rows of features f0 + rr0 + RSTEP i
                rfirst = (rbase + f0 + rr0) * RB
                rlast = (rbase + F - 1) * RB
                wa0 = 4 * (glu_tile_row(rr0) * S + w0)
                wa1 = 4 * (glu_tile_row(rr0) * S + w1)
                # scale rows sr0 + SCSTEP i: as SCSTEP is a power of two and sr0 < SCSTEP,
                # feature and half are those of sr0 plus those of SCSTEP i
                sq, sup = glu_feature(sr0)
                sfirst = (rbase + f0 + sq) * RB + sup * fup
            xw = tid % KW
            xj0 = tid // KW
            xsj0 = tid // KB
            xsk = tid % KB
            # the x rows of the thread's slots, read from shared memory once: re-read in the K
            # loop, each x load waited behind the shared store before it (they might alias)
            xrs = cuda.local.array(NX, i32)
            for i in range(NX):
                xrs[i] = ld_i32(xrow, 0, 4 * (xj0 + JSTEP * i))
            xss = cuda.local.array(NSX, i32)
            for i in range(NSX):
                xss[i] = ld_i32(xrow, 0, 4 * (xsj0 + SSTEP * i)) if xsj0 + SSTEP * i < TT else i32(-1)
            xv = cuda.local.array(NX, i32)
            kbs = cuda.blockIdx.z * KC if split_k else 0       # split-K: this block's blocks of K
            kbe = min(nb, kbs + KC)
            for kb0 in range(kbs, kbe, KB):
                nkb = min(KB, kbe - kb0)
                # 1. weight units -> codes and scales; x words and scales
                if kbu < nkb:
                    for i in range(NU):                  # the scales go unused: compiled out
                        if glu:
                            iq, up = i % (NU // 2), i // (NU // 2)
                            wrow = min(rfirst + rstep * iq, rlast) + up * fup
                            wo = 4 * S * (glu_tile_row(RSTEP * iq) + 16 * up)
                        else:
                            wrow, wo = min(rfirst + rstep * i, rlast), 4 * RSTEP * S * i
                        c0, c1, _, _ = idec(w, wrow, kb0 + kbu, uu)
                        if signed:
                            c0 = i32((u32(c0) + shift) ^ SIGN_BYTES)
                            c1 = i32((u32(c1) + shift) ^ SIGN_BYTES)
                        st_i32(wc, 0, wa0 + wo, c0)
                        st_i32(wc, 0, wa1 + wo, c1)
                for i in range(NSC):
                    sr = sr0 + SCSTEP * i
                    if sr < TM and sb < nkb:
                        if glu:
                            iq, up = glu_feature(SCSTEP * i)
                            srow = min(sfirst + RB * iq, rlast + sup * fup) + up * fup
                        else:
                            srow = min(sfirst + sstep * i, rlast)
                        _, _, d, m4 = idec(w, srow, kb0 + sb, sunit)
                        wd[ss, sr] = d
                        if has_m:                        # (never per16: asserted above)
                            wm[ss, sr] = f32(4.0) * m4   # idec: m / 4
                xok = (xw >> 3) < nkb
                for i in range(NX):                  # all loads first, then the stores
                    xv[i] = ld_i32(xq, xrs[i] * K, 4 * (8 * kb0 + xw)) if xrs[i] >= 0 and xok else i32(0)
                for i in range(NX):
                    st_i32(xc, 0, 4 * ((xj0 + JSTEP * i) * S + xw), xv[i])
                for i in range(NSX):
                    xsj = xsj0 + SSTEP * i
                    if xsj < TT:
                        xr = xss[i]
                        ok = xr >= 0 and xsk < nkb
                        xd[xsk, xsj] = ld_f32(xds, xr * KQ, 8 * (kb0 + xsk)) if ok else f32(0.0)
                        xsum[xsk, xsj] = ld_f32(xds, xr * KQ, 8 * (kb0 + xsk) + 4) if ok else f32(0.0)
                cuda.syncthreads()
                # 2. the warp's mma tiles, block by block (ld_* at a per-lane 64-bit base and
                # constant offsets: plain indexing cost ~8 64-bit integer ops a shared load)
                if cw < nslots:
                    for kb in range(nkb):
                        wk = wa + 32 * kb
                        xk = xa + 32 * kb
                        dk = da + (8 if per16 else 4) * TM * kb
                        mk = da + 4 * TM * kb
                        sk = sa + 4 * TT * kb
                        for j in range(NJ):
                            bx0[j] = ld_i32(xc, xk, 32 * S * j)
                            bx1[j] = ld_i32(xc, xk, 32 * S * j + 16)
                            sx0[j] = ld_f32(xd, sk, 32 * j)
                            sx1[j] = ld_f32(xd, sk, 32 * j + 4)
                            if has_m:
                                mx0[j] = ld_f32(xsum, sk, 32 * j)
                                mx1[j] = ld_f32(xsum, sk, 32 * j + 4)
                        for i in range(MI):
                            a0 = ld_i32(wc, wk, 64 * S * i)              # row g, k 4t..
                            a1 = ld_i32(wc, wk, 64 * S * i + 32 * S)     # row g + 8
                            a2 = ld_i32(wc, wk, 64 * S * i + 16)         # row g, k 16 + 4t..
                            a3 = ld_i32(wc, wk, 64 * S * i + 32 * S + 16)
                            if per16:
                                dl0 = ld_f32(wd, dk, 64 * i)
                                dl1 = ld_f32(wd, dk, 64 * i + 32)
                                dh0 = ld_f32(wd, dk, 64 * i + 4 * TM)
                                dh1 = ld_f32(wd, dk, 64 * i + 4 * TM + 32)
                                for j in range(NJ):
                                    o = 4 * (i * NJ + j)
                                    p0, p1, p2, p3 = mma_s8_16x8x16(a0, a1, bx0[j], 0, 0, 0, 0)
                                    h0, h1, h2, h3 = mma_s8_16x8x16(a2, a3, bx1[j], 0, 0, 0, 0)
                                    acc[o] += sx0[j] * (dl0 * i2f(p0) + dh0 * i2f(h0))
                                    acc[o + 1] += sx1[j] * (dl0 * i2f(p1) + dh0 * i2f(h1))
                                    acc[o + 2] += sx0[j] * (dl1 * i2f(p2) + dh1 * i2f(h2))
                                    acc[o + 3] += sx1[j] * (dl1 * i2f(p3) + dh1 * i2f(h3))
                            else:
                                d0 = ld_f32(wd, dk, 64 * i)
                                d1 = ld_f32(wd, dk, 64 * i + 32)
                                m0 = m1 = f32(0.0)
                                if has_m:
                                    m0 = ld_f32(wm, mk, 64 * i)
                                    m1 = ld_f32(wm, mk, 64 * i + 32)
                                for j in range(NJ):
                                    o = 4 * (i * NJ + j)
                                    p0, p1, p2, p3 = mma_s8_16x8x32(a0, a1, a2, a3, bx0[j], bx1[j], 0, 0, 0, 0)
                                    acc[o] += (d0 * sx0[j]) * i2f(p0)
                                    acc[o + 1] += (d0 * sx1[j]) * i2f(p1)
                                    acc[o + 2] += (d1 * sx0[j]) * i2f(p2)
                                    acc[o + 3] += (d1 * sx1[j]) * i2f(p3)
                                    if has_m:
                                        acc[o] += m0 * mx0[j]
                                        acc[o + 1] += m0 * mx1[j]
                                        acc[o + 2] += m1 * mx0[j]
                                        acc[o + 3] += m1 * mx1[j]
                cuda.syncthreads()
            # 3. store: lane (g, t4) has rows g, g + 8 and slots 2 t4, 2 t4 + 1 of each tile; out
            # [T, M] or [T, A, M] (C-contiguous) is rows of M: row orow[slot] (t, or p = t * A + a);
            # split-K: rows z * T + t of the parts [Z, T, M]. bias [M] or flat [E * M] (the
            # tile's expert's at rbase): added once (split-K: by the parts of z = 0)
            zt = cuda.blockIdx.z * T if split_k else 0
            biased = bias.shape[0] > 0 and zt == 0
            if glu:                  # row tiles 2i (gate) and 2i + 1 (up) of the same features
                for i in range(0, MI, 2):
                    for h in range(2):
                        fc = min(f0 + glu_feature(rw + 16 * i + g + 8 * h)[0], F - 1)
                        bg = bias[rbase + fc] if biased else f32(0.0)
                        bu = bias[rbase + F + fc] if biased else f32(0.0)
                        for j in range(NJ):
                            for e in range(2):
                                a = 4 * (i * NJ + j) + 2 * h + e
                                acc[a] = _glu(acc[a] + bg, acc[a + 4 * NJ] + bu, act)
                for i in range(0, MI, 2):
                    for h in range(2):
                        f = f0 + glu_feature(rw + 16 * i + g + 8 * h)[0]
                        for j in range(NJ):
                            for e in range(2):
                                o = orow[cw + 8 * j + 2 * t4 + e]
                                if o >= 0 and f < F:
                                    st_f32(out, o * F * 4, 4 * f, acc[4 * (i * NJ + j) + 2 * h + e])
                return
            for i in range(MI):
                for h in range(2):
                    r = r0 + rw + 16 * i + g + 8 * h
                    if r < M:
                        b = bias[rbase + r] if biased else f32(0.0)
                        for j in range(NJ):
                            for e in range(2):
                                o = orow[cw + 8 * j + 2 * t4 + e]
                                if o >= 0:
                                    st_f32(out, (zt + o) * M * 4, 4 * r, acc[4 * (i * NJ + j) + 2 * h + e] + b)
        return mul_mat_mma_kernel, NTH
    key = ("mma", int(qtype), TM, TT, WM, WT, KB, min_blocks, gather, split_k, act if glu else None)
    return cached(key, build)


# ---------------------------------------------------------------- launchers (matmul.py calls)

def mul_mat(out, w, x, qtype, RB, K, stream=0, x_ready=False, bias=None):
    """out [T, M] = x [T, K] @ dequant(w [M, RB])^T (+ bias [M]), x quantized to 8 bits (or
    x_ready). A grid of fewer than SPLIT_FILL blocks an SM splits K over grid z (parts summed
    in order after)."""
    T, M = out.shape
    xq, xds = quantize_x(x, T, K, stream, x_ready)
    d, bias = buffer("dummy", 4, np.int32), or_empty(bias)
    gm, gt = (M + TM - 1) // TM, (T + TT - 1) // TT
    nb = K // 32
    Z = min(SPLIT_FILL * sm_count() // (gm * gt), nb // (SPLIT_MIN_STEPS * KB))
    if Z < 2:
        kern, nth = _mma_kernel(qtype, TM, TT, WM, WT, KB, False)
        kern[(gm, gt), nth, stream](out, w, xq, xds, RB, K, T, M, d, d, 1, 1, nb, bias)
        return
    kc = -(-nb // (Z * KB)) * KB                 # blocks of K a split: whole K steps
    Z = -(-nb // kc)
    part = buffer("mma_split_k", Z * T * M, np.float32)
    kern, nth = _mma_kernel(qtype, TM, TT, WM, WT, KB, False, True)
    kern[(gm, gt, Z), nth, stream](part, w, xq, xds, RB, K, T, M, d, d, 1, 1, kc, bias)
    sum_splits(out, part, Z, stream)


def glu_warps_along_rows(tm, wm):
    """The warps along rows of a tile that applies the GLU: each warp's rows whole pairs of gate
    and up row tiles (32 rows)."""
    return min(wm, tm // 32)


def id_tiles(T, E, A):
    """(TM, TT, WM, WT, blocks an SM) of mul_mat_id's tiles for T tokens choosing A of E experts
    (ID_TILES' last row asks for 0 pairs)."""
    return next(tile for least, tile in ID_TILES if T * A >= least * E)


def mul_mat_id(out, w, x, ids, qtype, RB, K, stream=0, x_ready=False, grouped=False, bias=None,
               glu=None):
    """out [T, A, M] = dequant(w [E, M, RB][ids[t, a]]) @ x[t, a if X == A else 0] (+ the
    expert's row of bias, flat [E * M]), the pairs grouped by expert in id_tiles' tiles
    (matmul_tiled.group_by_expert). glu (glu_out [T * A, F], act): w is a merged gate_up
    (M = 2F) and the kernel writes act(gate, up) to glu_out instead of out."""
    E, M = w.shape[0], w.shape[1]
    T, X = x.shape[0], x.shape[1]
    A = ids.shape[1]
    xq, xds = quantize_x(x, T * X, K, stream, x_ready)
    tm, tt, wm, wt, min_blocks = id_tiles(T, E, A)
    order, tiles, n_tiles = group_by_expert(ids, E, tt, stream, grouped)
    act, gx = None, (M + tm - 1) // tm
    if glu is not None:
        out, act = glu
        wm = glu_warps_along_rows(tm, wm)
        gx = (M // 2 + tm // 2 - 1) // (tm // 2)
    kern, nth = _mma_kernel(qtype, tm, tt, wm, wt, KB, True, min_blocks=min_blocks, glu=act)
    kern[(gx, n_tiles), nth, stream](out, w, xq, xds, RB, K, T, M, order, tiles, A, X, K // 32,
                                     or_empty(bias))
