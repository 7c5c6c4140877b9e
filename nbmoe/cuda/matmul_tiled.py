"""The tiled prompt product in float32, and the grouping of mul_mat_id's pairs by expert.

tiled_kernel: out[orow[j], r0 + i] = sum_k dequant(w)[rbase + r0 + i, k] * x[xrow[j], k] over
the tile's i < TM rows and j < TT token slots. Plain: tile (bx, by), slot j = token by * TT + j.
Gathered (mul_mat_id): tile by = (expert, first pair, pairs) of `tiles` (flat: tiles[0] the
count, then 3 ints a tile), slot j = pair order[first + j] = t * A + a,
xrow = t * X + (a if X == A else 0), output out[t, a].
Per 32-value step a block decodes TM rows' block into shared memory (one unit a thread) next
to TT slots' x. Block: (TM / RM) * (TT / RT) threads; thread (tr, tc) owns rows
tr + i * TM / RM (i < RM), so a warp reads 32 different shared-memory rows of stride 33 (no
bank conflicts), and slots tc * RT + j (one value a warp: a broadcast). K % 32 == 0.
Split-K (split_k): block z takes the 32-blocks z * KC .. z * KC + KC - 1 of K and writes its
sums to part [Z, T, M] (flat) instead; sum_splits_kernel adds the Z parts in order (the same
result every run). For matrices of few rows (an F32 router), whose row tiles alone leave most
of the GPU idle.

group_by_expert_kernel: ids [T, A] -> order [N] (pair indices t * A + a grouped by expert;
the order within an expert is whatever the atomics gave, no result depends on it) and tiles
int32: tiles[0] the number n of tiles, then n triples (expert, first index into order,
pairs <= TT). One block: a shared-memory histogram by atomics; each thread sums the pairs and
tiles of a run of experts, a scan over the threads gives each run its first pair and tile,
and the thread writes its experts' offsets and tiles; then the scatter.
"""
import numpy as np
from numba import cuda

from . import SIM, device_fn, ld_f32
from .quants import qtype_info, unit_cols
from .scratch import buffer, cached

f32 = np.float32
i32 = np.int32

# Experts the grouping kernel handles (shared-memory counters), and its threads (one block).
MAX_E = 1024
GROUP_THREADS = 64 if SIM else 256


@device_fn
def tile_slots(xrow, orow, order, tiles, by, tid, nth, TT, T, M, A, X, gather):
    """The token slots of tile row `by` (the block's threads tid of nth fill them): xrow[j] the
    x row of slot j, orow[j] its output row (t, or the pair p = t * A + a), -1 past the tile's
    slots. Returns (rbase, slots): the first weight row of the tile's expert (0 when plain)
    and its slots. Gathered: the tile (expert, first pair, pairs) of `tiles`, the caller
    having checked by < tiles[0]."""
    if gather:
        k3 = 3 * by + 1
        first = tiles[k3 + 1]
        cnt = tiles[k3 + 2]
        for j in range(tid, TT, nth):
            if j < cnt:
                p = order[first + j]
                t = p // A
                xrow[j] = t * X + (p - t * A if X == A else 0)
                orow[j] = p
            else:
                xrow[j] = -1
                orow[j] = -1
        return tiles[k3] * M, cnt
    for j in range(tid, TT, nth):
        t = by * TT + j
        xrow[j] = t if t < T else -1
        orow[j] = xrow[j]
    return 0, min(TT, T - by * TT)


@device_fn
def _store_token(out, o, A, r, v):
    out[o, r] = v


@device_fn
def _store_pair(out, p, A, r, v):
    t = p // A
    out[t, p - t * A, r] = v


def tiled_kernel(qtype, TM, TT, RM, RT, gather, split_k=False):
    t_ = qtype_info(qtype)
    dec, split = t_.dec, t_.split
    SR = TM // RM              # threads along rows
    NTH = SR * (TT // RT)      # threads in the block
    ACC = RM * RT              # (local and shared array shapes must be plain constants)
    NXW = max(1, TT * 32 // NTH)   # x values a thread loads a K block
    # Re-read from shared memory after each shared store, a thread's x row indices make its x
    # loads wait one behind the other; in registers the loads go out together, but for the
    # large tiles (16 each) that took 128-153 registers to 216-237.
    X_IN_REGS = NTH % 32 == 0 and NXW * NTH == TT * 32 and NXW <= 8
    WS, XS = (TM, 33), (TT, 33)
    store = _store_pair if gather else _store_token

    def build():
        @cuda.jit
        def mul_mat_tiled_kernel(out, w, x, RB, K, T, M, order, tiles, A, X, KC):
            ws = cuda.shared.array(WS, f32)          # decoded weights, padded against bank conflicts
            xs = cuda.shared.array(XS, f32)
            xrow = cuda.shared.array(TT, i32)
            orow = cuda.shared.array(TT, i32)
            tid = cuda.threadIdx.x
            r0 = cuda.blockIdx.x * TM
            if gather and cuda.blockIdx.y >= tiles[0]:
                return                               # the whole block: beyond the tile table
            rbase, _ = tile_slots(xrow, orow, order, tiles, cuda.blockIdx.y, tid, NTH, TT, T, M,
                                  A, X, gather)
            tr = tid % SR
            tc = tid // SR
            acc = cuda.local.array(ACC, f32)
            a = cuda.local.array(RM, f32)
            for i in range(ACC):
                acc[i] = f32(0.0)
            cuda.syncthreads()
            # the x rows of the thread's slots in registers for the whole K loop (X_IN_REGS)
            xrs = cuda.local.array(NXW, i32)
            for i in range(NXW):
                xrs[i] = xrow[(tid + i * NTH) // 32] if X_IN_REGS else i32(0)
            kb0 = cuda.blockIdx.z * KC if split_k else 0
            for kb in range(kb0, min(K // 32, kb0 + KC)):
                for n in range(tid, TM * 4, NTH):     # decode: one unit a thread
                    rr = n // 4
                    u = n - 4 * rr
                    base = (rbase + min(r0 + rr, M - 1)) * RB
                    v0, v1, v2, v3, v4, v5, v6, v7 = dec(w, base, kb, u, K)
                    i0, i1 = unit_cols(0, u, split)
                    ws[rr, i0] = v0
                    ws[rr, i0 + 1] = v1
                    ws[rr, i0 + 2] = v2
                    ws[rr, i0 + 3] = v3
                    ws[rr, i1] = v4
                    ws[rr, i1 + 1] = v5
                    ws[rr, i1 + 2] = v6
                    ws[rr, i1 + 3] = v7
                if X_IN_REGS:                         # x: coalesced 32-float rows
                    for i in range(NXW):
                        xr = xrs[i]
                        xs[(tid + i * NTH) // 32, tid % 32] = (ld_f32(x, xr * K * 4, 4 * (kb * 32 + tid % 32))
                                                               if xr >= 0 else f32(0.0))
                else:
                    for n in range(tid, TT * 32, NTH):
                        j = n // 32
                        kj = n - 32 * j
                        xr = xrow[j]
                        xs[j, kj] = ld_f32(x, xr * K * 4, 4 * (kb * 32 + kj)) if xr >= 0 else f32(0.0)
                cuda.syncthreads()
                for kk in range(32):
                    for i in range(RM):
                        a[i] = ws[tr + i * SR, kk]
                    for j in range(RT):
                        bj = xs[tc * RT + j, kk]
                        for i in range(RM):
                            acc[i * RT + j] += a[i] * bj
                cuda.syncthreads()
            for j in range(RT):
                o = orow[tc * RT + j]
                if o >= 0:
                    for i in range(RM):
                        r = r0 + tr + i * SR
                        if r < M:
                            if split_k:
                                out[(cuda.blockIdx.z * T + o) * M + r] = acc[i * RT + j]
                            else:
                                store(out, o, A, r, acc[i * RT + j])
        return mul_mat_tiled_kernel, NTH
    return cached(("tiled", int(qtype), TM, TT, RM, RT, gather, split_k), build)


@cuda.jit
def sum_splits_kernel(out, part, Z):
    """out [T, M] = sum over z < Z of part [Z, T, M] (flat), in z order."""
    T, M = out.shape
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < T * M:
        t = i // M
        v = part[i]
        for z in range(1, Z):
            v += part[z * T * M + i]
        out[t, i - t * M] = v


def sum_splits(out, part, Z, stream):
    """Launch sum_splits_kernel: out [T, M] = the Z parts of a split-K product, in order."""
    T, M = out.shape
    sum_splits_kernel[(T * M + 255) // 256, 256, stream](out, part, Z)


def _group_kernel():
    def build():
        @cuda.jit
        def group_by_expert_kernel(ids, E, TT, order, tiles):
            cnt = cuda.shared.array(MAX_E, i32)
            fill = cuda.shared.array(MAX_E, i32)
            sc = cuda.shared.array(GROUP_THREADS, i32)       # per thread: pairs, then their offset
            st = cuda.shared.array(GROUP_THREADS, i32)       # per thread: tiles, then their offset
            tid = cuda.threadIdx.x
            A = ids.shape[1]
            N = ids.shape[0] * A
            for e in range(tid, E, GROUP_THREADS):
                cnt[e] = 0
            cuda.syncthreads()
            for p in range(tid, N, GROUP_THREADS):
                t = p // A
                cuda.atomic.add(cnt, ids[t, p - t * A], 1)
            cuda.syncthreads()
            # thread tid owns experts e0 .. e1 - 1: their pairs and tiles, scanned over the threads
            ch = (E + GROUP_THREADS - 1) // GROUP_THREADS
            e0 = min(E, tid * ch)
            e1 = min(E, e0 + ch)
            c = 0
            k = 0
            for e in range(e0, e1):
                c += cnt[e]
                k += (cnt[e] + TT - 1) // TT
            sc[tid] = c
            st[tid] = k
            cuda.syncthreads()
            d = 1
            while d < GROUP_THREADS:                           # inclusive scan (Hillis-Steele)
                a = sc[tid - d] if tid >= d else 0
                b = st[tid - d] if tid >= d else 0
                cuda.syncthreads()
                sc[tid] += a
                st[tid] += b
                cuda.syncthreads()
                d *= 2
            start = sc[tid] - c                                # exclusive: this thread's first pair
            k = st[tid] - k                                    # and first tile
            for e in range(e0, e1):
                fill[e] = start
                n = cnt[e]
                for f in range(0, n, TT):
                    tiles[3 * k + 1] = e
                    tiles[3 * k + 2] = start + f
                    tiles[3 * k + 3] = min(TT, n - f)
                    k += 1
                start += n
            if tid == GROUP_THREADS - 1:
                tiles[0] = st[tid]
            cuda.syncthreads()
            for p in range(tid, N, GROUP_THREADS):
                t = p // A
                slot = cuda.atomic.add(fill, ids[t, p - t * A], 1)
                order[slot] = p
        return group_by_expert_kernel
    return cached(("group", GROUP_THREADS), build)


def group_by_expert(ids, E, TT, stream, grouped=False):
    """(order, tiles, max_tiles): the pairs of ids [T, A] grouped by expert in tiles of <= TT
    (group_by_expert_kernel); max_tiles bounds the table's length (the grid's y size).
    grouped: the last grouping on this GPU was of these ids, E and TT (the gate, up and down
    products of a MoE layer share their ids): its table is reused, no launch."""
    if E > MAX_E:
        raise ValueError(f"mul_mat_id: {E} experts, the CUDA grouping handles at most {MAX_E}")
    N = ids.shape[0] * ids.shape[1]
    max_tiles = N // TT + min(E, N)       # every used expert adds at most one partial tile
    order = buffer("order", N, np.int32)
    tiles = buffer("tiles", 1 + 3 * max_tiles, np.int32)
    if not grouped:
        _group_kernel()[1, GROUP_THREADS, stream](ids, E, TT, order, tiles)
    return order, tiles, max_tiles
