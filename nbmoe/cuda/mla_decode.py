"""One token's attention over MLA's latent cache (the absorbed form: model/forward.py's
mla_attention) on f16 tensor cores (mma.sync m16n8k16, mma.py), 16 query heads a block.

MLA has one kv head: a cached row [latent R, k_pe Dr] (Dh = R + Dr = 576 for DeepSeek) is the
key of every query head and, whole, its value. So the 16 heads of a block are the 16 rows of
one m16 tile, and attention is two small matrix products a step of BK keys:
    S [16, BK] = Q [16, Dh] @ K^T        (k = dims: each of W warps takes Dh / W of them,
                                          the W partial S are summed in shared memory)
    P = exp(S - m), online softmax       (every warp the same rows, the same sums)
    O [16, Dh] += P [16, BK] @ K         (n = dims: each warp owns Dh / W of O)
W = warps(Dh): 12 for DeepSeek's 576 (3 k-steps and 3 pairs of n-tiles a warp); fewer
warps would hold more of Q and O in registers and keep fewer loads in flight.
Grid (P splits, H / 16); a split takes an equal share of the keys and writes its unnormalised
O and (m, l) for attention.merge_splits_kernel, as flash.decode's splits do (always merged).

    shared memory, 32-bit words of 2 f16 (the lower dim in the low half):
      Ks   [BK, SK]        key row jj: its Dh / 2 words       SK = Dh / 2 + 4
      Sred [W, 8, 32]      warp w's partial S, register e of lane l at [w, e, l]
      Ssum [8, 32]         their sum, the whole S, in the same order
    SK is 4 mod 32: a warp's fragment loads (S: 8 keys x 4 words; P K: 4 keys x 8 words)
    hit 32 different banks.

    lane (g, t) of warp w:
      Q fragments qa[4 i + r]: k-step w DKW + i of rows g, g + 8 (heads h0 + g, h0 + g + 8)
      S n-tile j (keys 8 j ..): s[4 j + e], e = (row g | g + 8) x (key 2t | 2t + 1)
      O: dims in pairs of n-tiles, 16 dims a pair; in pair J the even tile's column n is dim
         16 J + 2 n and the odd tile's 16 J + 2 n + 1, so one word of a key row (dims
         16 J + 2 g, + 1) feeds both tiles' B fragments (keys 2t, 2t + 1 of column g):
           o[8 jj + 4 e + c]: pair J = w NPW + jj, tile e, c = (row g | g + 8) x (n 2t | 2t + 1)
The next step's rows are loaded into registers before this step's P K, so their latency
hides behind the products.
"""
import numpy as np
from numba import cuda

from . import device_fn, ld_u32, shfl_xor
from .attention import MAX_SPLITS, MIN_SPLIT_KEYS, SPLIT_KEYS, _buffer, _sinks, active_splits, merge_splits
from .flash import online_softmax, p_fragment
from .kv_rows import kv_type_of, write_view
from .mma import mma_f16_16x8x16, pack_f16x2
from .x8 import unused_x8

f32 = np.float32
u32 = np.uint32
NEG_INF = f32(-np.inf)
HB = 16             # query heads a block: one m16 tile
BK = 16             # keys a step
MAX_DH = 576        # registers a lane: Q Dh / (4 W) words, O Dh / (2 W) floats (W = warps(Dh))

_kernels = {}


def used(q, k_cache, v_cache, window=0):
    """Whether attention() of q [T, H, Dh] takes this kernel: one token, one f16 kv head whose
    rows are keys and values both (MLA), no window, H a multiple of HB, Dh a multiple of 64
    (whole k-steps and pairs of n-tiles a warp) up to MAX_DH."""
    T, H, Dh = q.shape
    return (T == 1 and window == 0 and k_cache is v_cache and k_cache.shape[1] == 1
            and kv_type_of(k_cache) == "f16" and H % HB == 0 and Dh % 64 == 0 and Dh <= MAX_DH)


def warps(Dh):
    """Warps a block: the most (up to 12) that share Dh's k-steps (Dh / 16) evenly and its
    rows' words of a step evenly (staging)."""
    return next(w for w in (12, 8, 6, 4) if (Dh // 16) % w == 0 and (BK * Dh // 2) % (32 * w) == 0)


def _kernel(Dh):
    if Dh in _kernels:
        return _kernels[Dh]
    WARPS = warps(Dh)
    NTH = 32 * WARPS
    DW = Dh // 2                   # words of a row
    SK = DW + 4
    DKW = Dh // 16 // WARPS        # S: k-steps a warp
    NPW = DKW                      # O: pairs of n-tiles a warp
    NS = BK // 2                   # S registers a lane (BK / 8 n-tiles)
    NO = 8 * NPW
    NW = BK * DW // NTH            # row words a thread stages a step
    NQ = 4 * DKW                   # (a local array's shape: a constant, not an expression)
    KS = BK * SK

    @device_fn
    def load_rows(st, cache, j, b, tid):
        """st = this thread's words of cache rows j .. j + BK - 1 (0 past row b - 1)."""
        for r in range(NW):
            i = tid + NTH * r
            key = i // DW
            st[r] = ld_u32(cache, (j + key) * 2 * Dh, 4 * (i - key * DW)) if j + key < b else u32(0)

    @cuda.jit
    def mla_decode_kernel(part_acc, part_ml, q, cache, pos, scale, min_keys):
        tid = cuda.threadIdx.x
        lane = tid & 31
        w = tid >> 5
        g = lane >> 2
        t4 = lane & 3
        p = cuda.blockIdx.x
        h0 = cuda.blockIdx.y * HB
        Ks = cuda.shared.array(KS, u32)
        Sred = cuda.shared.array((WARPS, NS, 32), f32)
        Ssum = cuda.shared.array((NS, 32), f32)
        hi = pos[0] + 1                                   # keys 0 .. pos0
        Pa = active_splits(hi, cuda.gridDim.x, min_keys)
        if p >= Pa:
            return
        a = (p * hi) // Pa
        b = ((p + 1) * hi) // Pa

        qa = cuda.local.array(NQ, u32)               # Q fragments, scaled, f16
        for i in range(DKW):
            d = 16 * (w * DKW + i) + 2 * t4
            for r in range(4):
                h = h0 + g + 8 * (r & 1)
                dd = d + 8 * (r >> 1)
                qa[4 * i + r] = pack_f16x2(q[0, h, dd] * scale, q[0, h, dd + 1] * scale)
        o = cuda.local.array(NO, f32)
        for i in range(NO):
            o[i] = f32(0.0)
        s = cuda.local.array(NS, f32)
        st = cuda.local.array(NW, u32)
        m_a = NEG_INF
        m_b = NEG_INF
        l_a = f32(0.0)
        l_b = f32(0.0)
        load_rows(st, cache, a, b, tid)                   # the first step's rows

        for j0 in range(a, b, BK):
            cuda.syncthreads()                            # Ks, Sred: the last step is read
            for r in range(NW):
                i = tid + NTH * r
                key = i // DW
                Ks[key * SK + i - key * DW] = st[r]
            cuda.syncthreads()
            # 1. this warp's Dh / W dims: partial S of the BK keys
            for j in range(BK // 8):
                c0 = c1 = c2 = c3 = f32(0.0)
                for i in range(DKW):
                    off = (8 * j + g) * SK + 8 * (w * DKW + i) + t4
                    c0, c1, c2, c3 = mma_f16_16x8x16(qa[4 * i], qa[4 * i + 1], qa[4 * i + 2], qa[4 * i + 3],
                                                     Ks[off], Ks[off + 4], c0, c1, c2, c3)
                Sred[w, 4 * j, lane] = c0
                Sred[w, 4 * j + 1, lane] = c1
                Sred[w, 4 * j + 2, lane] = c2
                Sred[w, 4 * j + 3, lane] = c3
            cuda.syncthreads()
            load_rows(st, cache, j0 + BK, b, tid)         # 2. the next step's rows, in flight
            for i in range(tid, NS * 32, NTH):           # 3. whole S, masked
                e = i >> 5
                x = f32(0.0)
                for v in range(WARPS):
                    x += Sred[v, e, i & 31]
                key = j0 + 8 * (e >> 2) + 2 * (i & 3) + (e & 1)
                Ssum[e, i & 31] = x if key < b else NEG_INF
            cuda.syncthreads()
            for e in range(NS):
                s[e] = Ssum[e, lane]
            m_a, m_b, l_a, l_b = online_softmax(s, NS // 4, o, NO, m_a, m_b, l_a, l_b)
            # 4. O += P K over this warp's dim pairs, a k-step (16 keys) at a time
            for kc in range(BK // 16):
                p0, p1, p2, p3 = p_fragment(s, kc)
                r0 = (16 * kc + 2 * t4) * SK + g          # keys 2t, 2t + 1, 2t + 8, 2t + 9
                for jj in range(NPW):
                    off = r0 + 8 * (w * NPW + jj)
                    k0 = Ks[off]
                    k1 = Ks[off + SK]
                    k8 = Ks[off + 8 * SK]
                    k9 = Ks[off + 9 * SK]
                    i = 8 * jj
                    o[i], o[i + 1], o[i + 2], o[i + 3] = mma_f16_16x8x16(
                        p0, p1, p2, p3, (k0 & u32(0xFFFF)) | (k1 << u32(16)),
                        (k8 & u32(0xFFFF)) | (k9 << u32(16)), o[i], o[i + 1], o[i + 2], o[i + 3])
                    o[i + 4], o[i + 5], o[i + 6], o[i + 7] = mma_f16_16x8x16(
                        p0, p1, p2, p3, (k0 >> u32(16)) | (k1 & u32(0xFFFF0000)),
                        (k8 >> u32(16)) | (k9 & u32(0xFFFF0000)), o[i + 4], o[i + 5], o[i + 6], o[i + 7])

        # 5. the split's O, m and l (l summed over a row's 4 lanes) for the merge
        for jj in range(NPW):
            d = 16 * (w * NPW + jj) + 4 * t4
            for e in range(2):
                i = 8 * jj + 4 * e
                part_acc[p, 0, h0 + g, d + e] = o[i]
                part_acc[p, 0, h0 + g, d + 2 + e] = o[i + 1]
                part_acc[p, 0, h0 + g + 8, d + e] = o[i + 2]
                part_acc[p, 0, h0 + g + 8, d + 2 + e] = o[i + 3]
        l_a += shfl_xor(l_a, 1)
        l_a += shfl_xor(l_a, 2)
        l_b += shfl_xor(l_b, 1)
        l_b += shfl_xor(l_b, 2)
        if w == 0 and t4 == 0:
            part_ml[p, 0, h0 + g, 0] = m_a
            part_ml[p, 0, h0 + g, 1] = l_a
            part_ml[p, 0, h0 + g + 8, 0] = m_b
            part_ml[p, 0, h0 + g + 8, 1] = l_b

    _kernels[Dh] = mla_decode_kernel
    return mla_decode_kernel


def attention(out, q, cache, pos, scale, stream=0, xq=None, xds=None, sinks=None):
    """out [1, H, Dh] = one token's attention over MLA's latent cache [C, 1, Dh] (f16, keys and
    values both), pos a device int32 [1]; used(q, cache, cache) must hold. xq, xds: out also in
    8 bits (attention.attention's); sinks: a device array (EMPTY: none)."""
    T, H, Dh = q.shape
    P = max(1, min(MAX_SPLITS, cache.shape[0] // SPLIT_KEYS))
    sinks = _sinks(sinks, H)
    quant = xq is not None
    if not quant:
        xq, xds = unused_x8()
    part_acc = _buffer("acc", (MAX_SPLITS, T, H, Dh))
    part_ml = _buffer("ml", (MAX_SPLITS, T, H, 2))
    _kernel(Dh)[(P, H // HB), 32 * warps(Dh), stream](part_acc, part_ml, q, write_view(cache), pos, f32(scale),
                                           MIN_SPLIT_KEYS)
    merge_splits(out, part_acc, part_ml, P, pos, pos, 0, sinks, MIN_SPLIT_KEYS, xq, xds, quant, True,
                 stream)
