"""KV cache store and causal grouped-query attention over the KV cache, on the GPU.

Letters: T tokens in the micro-batch, H query heads, Hkv kv heads, G = H // Hkv query heads per
kv head, Dh head dim, C cache slots, n keys attended by one query, P key splits.

Cache layout, per layer (as on the CPU): k_cache, v_cache [C, Hkv, row] device arrays of the
cache's type (f16: uint16 [C, Hkv, Dh] bit patterns; bf16, q8_0: kv_rows.py), read and written
by kv_rows' functions of that type (f16: ld_f16, f16 -> float32 in hardware; stores through a
float16 view). The kernels are built per (key type, value type). Token t of the batch sits at position pos[t] = pos[0] + t, where
pos is the graph's int32 positions buffer on the device: the kernels read the position there,
not from a launch argument, so a captured CUDA graph replays unchanged for every token.
"""
import numpy as np
from numba import cuda

from . import (SIM, device_fn, device_id, expf, flash, or_empty, shfl_idx, shfl_xor, warp_max,
               warp_sum)
from .kv_rows import kv_type_of, row_fns, write_view
from .x8 import quantize_lane, unused_x8

f32 = np.float32
NEG_INF = f32(-np.inf)

# Query heads (= warps) per attention block: consecutive heads share a kv head, so their
# K / V rows are read from L1 once.
HEADS_PER_BLOCK = 4
# Key splits (flash-decoding) when T <= SPLIT_MAX_T: one per SPLIT_KEYS slots of the cache's
# capacity, at most MAX_SPLITS of them, merged by a second kernel. A warp walks its keys one
# after the other (latency-bound), so many short spans keep more warps busy.
SPLIT_MAX_T = 2
# Prompts (T > SPLIT_MAX_T) on f16 tensor cores (flash.py, any cache type) when Dh allows
# (flash.supported) and attention()'s fa is on (-fa auto / on); else the warp-per-query kernel.
SPLIT_KEYS = 16
MAX_SPLITS = 128
# One token over a cache of flash.DECODE_MIN_CACHE slots or more: flash.decode (-fa auto / on).
DECODE_FLASH = True
# Keys a split takes at least while the cache holds few (see active_splits); 0: every split
# of the grid works.
MIN_SPLIT_KEYS = 4

_kernels = {}
_scratch = {}


# ---------------------------------------------------------------- store_kv
# k, v [T, Hkv, Dh] float32 -> cache rows pos[t] in the cache's type (f16: round to nearest
# even). One thread per value; 32 consecutive threads hold a 32-block (q8_0: Dh % 32 == 0).

def _store_kv_kernel(Dh, KT, VT):
    key = ("store", Dh, KT, VT)
    if key in _kernels:
        return _kernels[key]
    store_k, store_v = row_fns(Dh, KT)[3], row_fns(Dh, VT)[3]

    @cuda.jit
    def store_kv_kernel(k_cache, k16, v_cache, v16, k, v, pos):
        Hkv = k.shape[1]
        idx = cuda.grid(1)
        if idx < k.shape[0] * Hkv * Dh:
            t = idx // (Hkv * Dh)
            rem = idx - t * Hkv * Dh
            g = rem // Dh
            d = rem - g * Dh
            store_k(k_cache, k16, pos[t], g, d // 32, d % 32, k[t, g, d])
            store_v(v_cache, v16, pos[t], g, d // 32, d % 32, v[t, g, d])
    _kernels[key] = store_kv_kernel
    return store_kv_kernel


def positions(pos, T):
    """pos as a device int32 array [T]: a device array as it is, an int pos0 -> pos0 + arange(T)
    (uploaded: for tests and one-off calls; the engine passes its device positions buffer)."""
    if isinstance(pos, (int, np.integer)):
        if pos < 0:
            raise ValueError("attention: negative position")
        return cuda.to_device(np.arange(pos, pos + T, dtype=np.int32))
    return pos


def store_kv(k_cache, v_cache, k, v, pos, stream=0):
    """Write k, v [T, Hkv, Dh] into cache rows pos[t] (pos: device int32 [T] or an int
    pos0 for rows pos0 .. pos0 + T - 1). The caller keeps positions inside the cache."""
    T = k.shape[0]
    if isinstance(pos, (int, np.integer)) and pos + T > k_cache.shape[0]:
        raise ValueError("store_kv: rows pos0 .. pos0 + T - 1 are outside the KV cache")
    n = T * k.shape[1] * k.shape[2]
    if n:
        _store_kv_kernel(k.shape[2], kv_type_of(k_cache), kv_type_of(v_cache))[(n + 255) // 256, 256, stream](
            k_cache, write_view(k_cache), v_cache, write_view(v_cache), k, v, positions(pos, T))


# ---------------------------------------------------------------- attention
# Splits in use for a query that sees n keys: one per min_keys keys, at most the P the grid
# has (P follows the cache's capacity, fixed for a CUDA graph, while the keys grow token by
# token): at a 4096-slot cache (P = 128) and 20 keys, 5 splits work and the merge reads 5
# partial results, not 128. min_keys = 0: all P splits share the keys.

@device_fn
def key_range(pos, rows, t, window):
    """The cache rows [lo, hi) that query t sees: its sequence's (which starts at row
    rows[t] - pos[t]) up to its own row rows[t]. A batch of one sequence passes pos as rows."""
    hi = rows[t] + 1
    lo = hi - pos[t] - 1
    return (max(lo, hi - window) if window > 0 else lo), hi


@device_fn
def active_splits(n, P, min_keys):
    if min_keys == 0:
        return P
    return min(P, max(1, (n + min_keys - 1) // min_keys))


# out[t, h] = softmax_j(scale * q[t, h] . k[j, g]) @ v[j, g],  g = h // G, over keys j with
# j <= pos0 + t and (window == 0 or j > pos0 + t - window).
# One warp per (token, query head), HEADS_PER_BLOCK heads a block, grid (T, H / heads, P).
# Lane l holds dims l, l + 32, ... (DPL = ceil(Dh / 32) of them) of q (pre-scaled) and of the
# output accumulator. Keys in tiles of 32: a score per key summed over the warp from coalesced
# row loads (key_sums8, 8 keys at a time; lane jj keeps key jj's), then an online-softmax step
# per tile (max, rescale, one exp per lane), then the tile's values weighted by each key's p
# (broadcast by a shuffle). Keys go
# KU at a time: their rows' loads first, then the sums (or products), so a warp waits for
# memory once per KU keys, not once per key (decoding has one warp per head in the grid).
# A warp walks its keys one after the other: latency-bound; prompts go to flash.py (query tiles
# sharing K / V tiles in shared memory, tensor cores) where it can. Split p of the Pa in use takes
# an equal share of the token's keys and writes (acc, max, sum) for the merge kernel; with
# Pa == 1 it writes out. A sink (sinks[h]: a logit whose value row is 0) joins once, where the
# output is made: here when Pa == 1, else in the merge.
# Heads past H work on head H - 1 with q = 0 and do not write: every lane reaches every shuffle.
# out may alias q: a warp reads its q row before it writes the same row.
# quant (Dh a multiple of 32): out is also written in 8 bits (xq, xds as x8.quantize_x,
# rows of H * Dh) for the output projection: lane l's value of dims 32c .. 32c + 31 is dim
# 32c + l, so a warp quantizes a 32-block with quantize_lane (the merge kernel likewise).

# ROPE (decoding, T <= SPLIT_MAX_T): q, k, v arrive as the products wrote them, and the
# kernel does norm_rope.norm_rope_store's work itself, with its device functions (same bits): each
# warp norms and rotates its head's q; a block whose key span holds a new position (pos[t2],
# t2 < T) norms and rotates that key (each warp its kv head's), writes it and its value to
# the f16 cache (the block's first warp of each kv head), and syncs before reading the span.
# Blocks with the same new key in their span write the same bits; no block reads a new
# position that another block writes. One launch less a layer.
KU = 8                              # (key_sums8 sums exactly 8)
ROPE_HEADS = 8                      # rows of the shared scratch: warps a block (HEADS_PER_BLOCK)


# The scores of a batch of 8 keys: each lane holds its part of every key's dot (sc[u], its
# dims of q . k_u); the warp must add each over its 32 lanes. Eight warp sums take 8 x 5
# shuffles in a chain. Transposed, each shuffle carries a different key's part: over lane bit
# 2 a lane keeps keys 0-3 or 4-7 (by its bit) and sends the other four to its partner (4
# shuffles), over bit 1 two of those (2), over bit 0 one (1); then the lane's one key is
# summed over bits 3 and 4 (2): 9 shuffles, and lane L holds key (L % 8)'s whole score.
#   after bit 2: r_i = key 4 b2 + i      (lanes L, L ^ 4 added)
#   after bit 1: q_i = key 4 b2 + 2 b1 + i
#   after bit 0: s   = key L % 8         (8 lanes added), then + over L ^ 8, L ^ 16

@device_fn
def key_sums8(sc, lane):
    """Lane L: the warp sum of sc[L % 8] (sc: 8 values a lane)."""
    b = (lane >> 2) & 1
    r0 = (sc[4] if b else sc[0]) + shfl_xor(sc[0] if b else sc[4], 4)
    r1 = (sc[5] if b else sc[1]) + shfl_xor(sc[1] if b else sc[5], 4)
    r2 = (sc[6] if b else sc[2]) + shfl_xor(sc[2] if b else sc[6], 4)
    r3 = (sc[7] if b else sc[3]) + shfl_xor(sc[3] if b else sc[7], 4)
    b = (lane >> 1) & 1
    q0 = (r2 if b else r0) + shfl_xor(r0 if b else r2, 2)
    q1 = (r3 if b else r1) + shfl_xor(r1 if b else r3, 2)
    b = lane & 1
    v = (q1 if b else q0) + shfl_xor(q0 if b else q1, 1)
    v += shfl_xor(v, 8)
    return v + shfl_xor(v, 16)


def _attention_kernel(Dh, ROPE=False, KT="f16", VT="f16"):
    DPL = (Dh + 31) // 32
    KV = KU * DPL                   # (local array sizes must be plain constants)
    k_ = _kernels.get(("attn", Dh, ROPE, KT, VT))
    if k_ is not None:
        return k_
    from .norm_rope import head_rope_fns
    norm_weights, norm_to_shared, rope_coeffs, rope_from_shared = head_rope_fns(Dh)
    NEW = SPLIT_MAX_T * DPL         # the batch's new key and value rows, a lane's dims
    # q_dot: this lane's part of q . (the key row at byte offset rb): dims lane, lane + 32, ...;
    # v_row: vals[i + c] = dim lane + 32 c of the value row at byte offset rb (0 past Dh)
    KB, q_dot, _, store_k = row_fns(Dh, KT)
    VB, _, v_row, store_v = row_fns(Dh, VT)

    @cuda.jit
    def attention_kernel(out, part_acc, part_ml, q, k_cache, v_cache, pos, rows, scale, window, sinks,
                         min_keys, xq, xds, quant, k, v, kc16, vc16, wq, wk, eps, do_norm,
                         n_rot, neox, rope):
        H = q.shape[1]
        Hkv = k_cache.shape[1]
        G = H // Hkv
        P = cuda.gridDim.z
        lane = cuda.threadIdx.x
        t = cuda.blockIdx.x
        h = cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y
        hh = min(h, H - 1)
        g = hh // G
        p = cuda.blockIdx.z
        lo, hi = key_range(pos, rows, t, window)
        Pa = active_splits(hi - lo, P, min_keys)
        if p >= Pa:
            return                                 # the whole block: its split has no keys
        span = (hi - lo + Pa - 1) // Pa
        a = lo + p * span
        b = min(hi, a + span)
        krow, vrow = Hkv * KB, Hkv * VB            # bytes of one cache position
        qv = cuda.local.array(DPL, f32)
        acc = cuda.local.array(DPL, f32)
        if ROPE:
            sh = cuda.shared.array((ROPE_HEADS, 8 * 32), f32)
            wy = cuda.threadIdx.y
            vals = cuda.local.array(DPL, f32)
            kn = cuda.local.array(NEW, f32)
            vn = cuda.local.array(NEW, f32)
            wqv = cuda.local.array(DPL, f32)
            wkv = cuda.local.array(DPL, f32)
            cs = cuda.local.array(DPL, f32)
            sn = cuda.local.array(DPL, f32)
            # every load of the prologue first (q, the new keys and values in this span, the
            # norms' weights, the rotation at pos[t]): one memory round trip, not one a step
            pt = pos[t]                            # the position cs, sn hold
            for c in range(DPL):
                d = lane + 32 * c
                vals[c] = q[t, hh, d] if d < Dh else f32(0.0)
            for t2 in range(q.shape[0]):
                j = pos[t2]
                for c in range(DPL):
                    d = lane + 32 * c
                    inside = a <= j and j < b and d < Dh
                    kn[t2 * DPL + c] = k[t2, g, d] if inside else f32(0.0)
                    vn[t2 * DPL + c] = v[t2, g, d] if inside else f32(0.0)
            norm_weights(wqv, wq, lane, do_norm)
            norm_weights(wkv, wk, lane, do_norm)
            rope_coeffs(cs, sn, lane, n_rot, neox, rope, pt)
            norm_to_shared(vals, sh, wy, lane, wqv, do_norm, eps)
            cuda.syncthreads()
            rope_from_shared(vals, sh, wy, lane, n_rot, neox, cs, sn)
            for c in range(DPL):
                d = lane + 32 * c
                qv[c] = vals[c] * scale if d < Dh and h < H else f32(0.0)
                acc[c] = f32(0.0)
            for t2 in range(q.shape[0]):           # the batch's new keys inside [a, b)
                j = pos[t2]
                if a <= j and j < b:               # the same for the whole block
                    cuda.syncthreads()             # sh: the rows above are read
                    for c in range(DPL):
                        vals[c] = kn[t2 * DPL + c]
                    norm_to_shared(vals, sh, wy, lane, wkv, do_norm, eps)
                    if j != pt:                    # (the batch's other token: its own angles)
                        rope_coeffs(cs, sn, lane, n_rot, neox, rope, j)
                        pt = j
                    cuda.syncthreads()
                    rope_from_shared(vals, sh, wy, lane, n_rot, neox, cs, sn)
                    if h < H and (wy == 0 or h % G == 0):   # the block's first warp of kv head g
                        for c in range(DPL):
                            if lane + 32 * c < Dh:
                                store_k(k_cache, kc16, j, g, c, lane, vals[c])
                                store_v(v_cache, vc16, j, g, c, lane, vn[t2 * DPL + c])
            cuda.syncthreads()                     # the new rows, seen by the whole block
        else:
            for c in range(DPL):
                d = lane + 32 * c
                qv[c] = q[t, hh, d] * scale if d < Dh and h < H else f32(0.0)
                acc[c] = f32(0.0)
        m = NEG_INF
        tot = f32(0.0)
        for j0 in range(a, b, 32):
            nk = min(32, b - j0)
            kb = (j0 * Hkv + g) * KB               # byte offset of key j0's row
            vb = (j0 * Hkv + g) * VB               # and of its value row
            s_mine = NEG_INF                       # lane jj: the score of key j0 + jj
            for j1 in range(0, nk, KU):            # KU keys' loads in flight, then their sums
                sc = cuda.local.array(KU, f32)
                for u in range(KU):
                    sc[u] = q_dot(qv, k_cache, kb + min(j1 + u, nk - 1) * krow, lane)
                s = key_sums8(sc, lane)            # key j1 + lane % 8's (j1: a multiple of 8)
                if j1 <= lane and lane < j1 + KU and lane < nk:
                    s_mine = s
            m_new = max(m, warp_max(s_mine))
            pj = expf(s_mine - m_new)              # 0 for lanes past the tile
            corr = expf(m - m_new)                 # 0 on the first tile (m = -inf)
            tot = tot * corr + warp_sum(pj)
            for c in range(DPL):
                acc[c] *= corr
            for j1 in range(0, nk, KU):            # keys past the tile weigh p = 0
                pv = cuda.local.array(KU, f32)
                vals = cuda.local.array(KV, f32)
                for u in range(KU):
                    pv[u] = shfl_idx(pj, j1 + u)
                    v_row(vals, u * DPL, v_cache, vb + min(j1 + u, nk - 1) * vrow, lane)
                for u in range(KU):
                    for c in range(DPL):
                        acc[c] += pv[u] * vals[u * DPL + c]
            m = m_new
        if h < H:
            if Pa == 1:                            # the only split: the final output
                if sinks.shape[0] > 0:             # the sink: one more logit, value 0
                    sk = sinks[h]
                    m_new = max(m, sk)
                    corr = expf(m - m_new)
                    tot = tot * corr + expf(sk - m_new)
                    for c in range(DPL):
                        acc[c] *= corr
                inv = f32(1.0) / tot
                for c in range(DPL):
                    d = lane + 32 * c
                    if d < Dh:
                        out[t, h, d] = acc[c] * inv
                    if quant:
                        quantize_lane(xq, xds, ((t * H + h) * Dh) // 32 + c, True, acc[c] * inv, lane)
            else:
                for c in range(DPL):
                    d = lane + 32 * c
                    if d < Dh:
                        part_acc[p, t, h, d] = acc[c]
                if lane == 0:
                    part_ml[p, t, h, 0] = m
                    part_ml[p, t, h, 1] = tot

    _kernels[("attn", Dh, ROPE, KT, VT)] = attention_kernel
    return attention_kernel


# Merge of the Pa splits in use: out[t, h] = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p,
# M = max m_p. A split that got no keys (possible at the end of a long cache) has m = -inf,
# l = 0 and weighs 0. With one split in use there is nothing to do (unless `always`:
# flash.decode's splits never write out). A sink (sinks[h], when given) joins here, once:
# M = max(M, sink), den += exp(sink - M).
# A block per (token, head, 32 dims), MERGE_WARPS warps: the weights f_p = exp(m_p - M) go to
# shared memory, then warp w sums the splits p = w, w + W, ... (lane l: dim 32 blockIdx.y + l),
# four loads in flight, and warp 0 adds the warps' sums.
MERGE_WARPS = 2 if SIM else 8       # the simulator runs each thread as a Python thread


@cuda.jit
def merge_splits_kernel(out, part_acc, part_ml, P, pos, rows, window, sinks, min_keys, xq, xds, quant,
                        always):
    T, H, Dh = out.shape
    t = cuda.blockIdx.x // H
    h = cuda.blockIdx.x - t * H
    lane = cuda.threadIdx.x
    wy = cuda.threadIdx.y
    tid = wy * 32 + lane
    NTH = 32 * MERGE_WARPS
    lo, hi = key_range(pos, rows, t, window)
    Pa = active_splits(hi - lo, P, min_keys)
    if Pa == 1 and not always:
        return                                     # attention wrote out itself
    fs = cuda.shared.array(MAX_SPLITS, f32)
    red = cuda.shared.array(MERGE_WARPS, f32)
    sums = cuda.shared.array((MERGE_WARPS, 32), f32)
    mx = NEG_INF
    for p in range(tid, Pa, NTH):
        mx = max(mx, part_ml[p, t, h, 0])
    mx = warp_max(mx)
    if lane == 0:
        red[wy] = mx
    cuda.syncthreads()
    M = red[0]
    for w in range(1, MERGE_WARPS):
        M = max(M, red[w])
    sink = sinks.shape[0] > 0
    if sink:
        M = max(M, sinks[h])
    cuda.syncthreads()
    dn = f32(0.0)
    for p in range(tid, Pa, NTH):
        f = expf(part_ml[p, t, h, 0] - M)
        fs[p] = f
        dn += f * part_ml[p, t, h, 1]
    dn = warp_sum(dn)
    if lane == 0:
        red[wy] = dn
    cuda.syncthreads()
    d = cuda.blockIdx.y * 32 + lane
    dd = min(d, Dh - 1)
    n0 = n1 = n2 = n3 = f32(0.0)
    p = wy
    while p + 3 * MERGE_WARPS < Pa:
        a0 = part_acc[p, t, h, dd]
        a1 = part_acc[p + MERGE_WARPS, t, h, dd]
        a2 = part_acc[p + 2 * MERGE_WARPS, t, h, dd]
        a3 = part_acc[p + 3 * MERGE_WARPS, t, h, dd]
        n0 += fs[p] * a0
        n1 += fs[p + MERGE_WARPS] * a1
        n2 += fs[p + 2 * MERGE_WARPS] * a2
        n3 += fs[p + 3 * MERGE_WARPS] * a3
        p += 4 * MERGE_WARPS
    while p < Pa:
        n0 += fs[p] * part_acc[p, t, h, dd]
        p += MERGE_WARPS
    sums[wy, lane] = (n0 + n1) + (n2 + n3)
    cuda.syncthreads()
    if wy == 0:
        num = f32(0.0)
        den = f32(0.0)
        for w in range(MERGE_WARPS):
            num += sums[w, lane]
            den += red[w]
        if sink:
            den += expf(sinks[h] - M)
        v = num / den
        if d < Dh:
            out[t, h, d] = v
        if quant:                                  # the warp: one 32-block of out (Dh % 32 == 0)
            quantize_lane(xq, xds, ((t * H + h) * Dh) // 32 + cuda.blockIdx.y, True, v, lane)


def merge_splits(out, part_acc, part_ml, P, pos, rows, window, sinks, min_keys, xq, xds, quant, always,
                 stream=0):
    """Launch merge_splits_kernel over out [T, H, Dh]."""
    T, H, Dh = out.shape
    merge_splits_kernel[(T * H, (Dh + 31) // 32), (32, MERGE_WARPS), stream](
        out, part_acc, part_ml, P, pos, rows, window, sinks, min_keys, xq, xds, quant, always)


def _buffer(name, shape):
    """A float32 device buffer of this shape, reused across calls (one stream at a time); the
    shaped view is cached too (slicing and reshaping a device array costs tens of us)."""
    key = (device_id(), name, shape)
    v = _scratch.get(key)
    if v is None:
        v = _scratch[key] = cuda.device_array(shape, np.float32)
    return v


def attention(out, q, k_cache, v_cache, pos, scale, window=0, stream=0, xq=None, xds=None,
              sinks=None, fa=True):
    """Causal GQA attention of q [T, H, Dh] over the cache (any type); out [T, H, Dv] may alias
    q (Dv: the value rows' width, Dh but for MLA's expanded form, which takes the flash kernel).

    pos: the tokens' positions, device int32 [T] with pos[t] = pos[0] + t (or an int pos0).
    The cache must already hold rows 0 .. pos[T-1] (store_kv first). window > 0 limits each
    query to its `window` most recent positions (itself included). The number of key splits
    follows the cache's capacity, not the current length, so the launch is the same for every
    token (a CUDA graph can replay it); splits past the current keys find none and weigh 0.
    xq, xds (x8.x8_buffers of T rows of H * Dh; Dh % 32 == 0, T <= SPLIT_MAX_T): out is
    also written there in 8 bits.
    sinks: float32 [H] device array or None / EMPTY (cuda.empty()): head h's softmax gets one
    more logit, sinks[h] (not scaled), whose value is 0 (gpt-oss):
      out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sinks[h] - m)).
    fa: a prompt batch takes flash.py's kernel where flash_used(T, Dh, the cache's types)
    (-fa off: never).
    """
    T, H, Dh = q.shape
    sinks = _sinks(sinks, H)
    if T == 0:
        return
    C = k_cache.shape[0]
    if isinstance(pos, (int, np.integer)) and pos + T > C:
        raise ValueError("attention: positions pos0 .. pos0 + T - 1 are outside the KV cache")
    types = (kv_type_of(k_cache), kv_type_of(v_cache))
    if out.shape[2] != Dh and not (fa and flash_used(T, Dh, types, out.shape[2])):
        raise ValueError("attention: values narrower than keys (MLA expanded) need the flash kernel")
    if fa and flash_used(T, Dh, types, out.shape[2]):
        flash.attention(out, q, k_cache, v_cache, positions(pos, T), scale, window, stream, sinks)
        return
    from . import mla_decode
    if mla_decode.used(q, k_cache, v_cache, window):       # MLA's one token: heads share the rows
        mla_decode.attention(out, q, k_cache, positions(pos, T), scale, stream, xq, xds, sinks)
        return
    if fa and flash_decodes(q, k_cache, v_cache):
        _flash_decode(out, q, k_cache, v_cache, positions(pos, T), scale, window, stream, xq, xds, sinks)
        return
    _launch(out, q, k_cache, v_cache, positions(pos, T), scale, window, stream, xq, xds, None,
            sinks)


# Per-row batches (several sequences' next tokens, model/graph.py's per_row): row t's key
# and value go to cache row rows[t] (store_kv with rows for positions), and it attends over
# its sequence's rows rows[t] - pos[t] .. rows[t] with the decoding kernel (key splits).

def store_kv_rows(k_cache, v_cache, k, v, rows, stream=0):
    """Write k, v [T, Hkv, Dh] into cache rows rows[t] (device int32 [T])."""
    store_kv(k_cache, v_cache, k, v, rows, stream)


def attention_rows(out, q, k_cache, v_cache, pos, rows, scale, window, sinks, stream=0):
    """Row t of q [T, H, Dh] is one token of its own sequence at position pos[t], stored at
    cache row rows[t] (pos, rows: device int32 [T]); attention over that sequence's rows."""
    if q.shape[0]:
        _launch(out, q, k_cache, v_cache, pos, scale, window, stream, None, None, None,
                _sinks(sinks, q.shape[1]), rows=rows)


def flash_used(T, Dh, kv_types=("f16", "f16"), Dv=None):
    """Whether a batch of T tokens with head dim Dh (values: Dv, default Dh) over a cache of
    these (key, value) types has a flash kernel (flash.py): prompts only (decoding has its
    key-split kernel), the widths flash.supported allows."""
    return T > SPLIT_MAX_T and flash.supported(Dh, kv_types, Dv)


def flash_decodes(q, k_cache, v_cache):
    """Whether attention() of q over this cache takes flash.decode (one token, a long cache)."""
    return flash.decode_used(q.shape[0], q.shape[2], (kv_type_of(k_cache), kv_type_of(v_cache)),
                             k_cache.shape[0])


def _flash_decode(out, q, k_cache, v_cache, pos, scale, window, stream, xq, xds, sinks):
    T, H, Dh = q.shape
    P = flash.decode_splits(k_cache.shape[0], window)
    quant = xq is not None
    if not quant:
        xq, xds = unused_x8()
    part_acc = _buffer("acc", (MAX_SPLITS, T, H, Dh))
    part_ml = _buffer("ml", (MAX_SPLITS, T, H, 2))
    flash.decode(part_acc, part_ml, P, q, k_cache, v_cache, pos, scale, window, stream, sinks)
    merge_splits(out, part_acc, part_ml, P, pos, pos, int(window), sinks, flash.DECODE_SPLIT_KEYS, xq, xds,
                 quant, True, stream)


def decoding(T):
    """Whether a batch takes the decoding kernel (key splits), whatever -fa says."""
    return T <= SPLIT_MAX_T


def _sinks(sinks, H):
    """sinks as a device array (EMPTY for None), checked: H values or none."""
    sinks = or_empty(sinks)
    if sinks.size not in (0, H) or sinks.dtype != np.float32:
        raise ValueError(f"attention: sinks must be float32 [{H}] (one per query head) or empty")
    return sinks


def rope_supported(T, Dh):
    """Whether rope_attention takes this batch: decoding (T <= SPLIT_MAX_T), Dh <= 256."""
    return T <= SPLIT_MAX_T and Dh <= 256


def rope_attention(out, q, k, v, k_cache, v_cache, pos, wq, wk, eps, freqs, mscale, neox,
                   scale, window=0, stream=0, xq=None, xds=None, sinks=None):
    """norm_rope.norm_rope_store(q, k, v, ...) then attention(out, q, ...) in one launch (see
    ROPE above): q [T, H, Dh], k, v [T, Hkv, Dh] as the products wrote them (q and k are not
    written back), wq / wk the per-head norms (None: none); pos a device int32 [T]; sinks
    as attention's."""
    T, H, Dh = q.shape
    if not rope_supported(T, Dh):
        raise ValueError("rope_attention: T <= SPLIT_MAX_T and Dh <= 256 only")
    from .norm_rope import rope_table
    pos = positions(pos, T)
    do_norm = wq is not None
    if not do_norm:
        wq = wk = _buffer("no_norm", (1,))                    # typed stand-ins, never read
    rope = (k, v, write_view(k_cache), write_view(v_cache), wq, wk, float(eps),
            do_norm, 2 * len(freqs), bool(neox), rope_table(k_cache.shape[0], freqs, mscale))
    _launch(out, q, k_cache, v_cache, pos, scale, window, stream, xq, xds, rope, _sinks(sinks, H))


def _launch(out, q, k_cache, v_cache, pos, scale, window, stream, xq, xds, rope, sinks, rows=None):
    T, H, Dh = q.shape
    C = k_cache.shape[0]
    cap = C if window == 0 else min(C, window)                # most keys a query can see
    P = 1
    if (T <= SPLIT_MAX_T or rows is not None) and cap >= 2 * SPLIT_KEYS:
        P = min(MAX_SPLITS, cap // SPLIT_KEYS)
    hb = min(HEADS_PER_BLOCK, H)
    grid = (T, (H + hb - 1) // hb, P)
    kern = _attention_kernel(Dh, rope is not None, kv_type_of(k_cache), kv_type_of(v_cache))
    quant = xq is not None
    if quant and (Dh % 32 or T > SPLIT_MAX_T):
        raise ValueError("attention: 8-bit output needs Dh % 32 == 0 and T <= SPLIT_MAX_T")
    if not quant:
        xq, xds = unused_x8()
    if rope is None:
        rope = (q, q) + _no_rope()
    if P == 1:
        part_acc = part_ml = _buffer("dummy", (1, 1, 1, 2))
    else:
        part_acc = _buffer("acc", (MAX_SPLITS, T, H, Dh))     # splits p < P used
        part_ml = _buffer("ml", (MAX_SPLITS, T, H, 2))
    rows = pos if rows is None else rows
    kern[grid, (32, hb), stream](out, part_acc, part_ml, q, k_cache, v_cache, pos, rows, f32(scale),
                                 int(window), sinks, MIN_SPLIT_KEYS, xq, xds, quant, *rope)
    if P > 1:
        merge_splits(out, part_acc, part_ml, P, pos, rows, int(window), sinks, MIN_SPLIT_KEYS, xq, xds, quant,
                     False, stream)


def _no_rope():
    """Typed stand-ins for the kernel's ROPE arguments after k, v (q stands in for those):
    never read when ROPE is off."""
    key = (device_id(), "no_rope")
    r = _scratch.get(key)
    if r is None:
        h = cuda.device_array((1, 1, 1), np.float16)
        w = _buffer("no_norm", (1,))
        r = _scratch[key] = (h, h, w, w, 0.0, False, 0, False,
                             cuda.device_array((1, 1, 2), np.float32))
    return r
