"""RMS norm of q and k, RoPE, and the new k, v rows written to the cache: the attention
half's per-head work before the scores, one launch for T tokens (MLA's: mla_rope).

Decoding folds the same work into the attention launch (attention.rope_attention), built from
the same device functions (head_rope_fns), so both paths produce the same bits.
"""
import math

import numpy as np
from numba import cuda

from . import device_fn, device_id, warp_sum
from .ops import NORM_THREADS, _block_sum, constant, rope_pair
from .scratch import cached

f32 = np.float32


# ---------------------------------------------------------------- norm_rope_store
# Heads 0..H-1 are q[t], H..H+Hkv-1 k[t], then Hkv heads of v[t]; one warp per (token, head),
# grid (T, ceil((H + 2 Hkv) / warps)), lane l holding dims l, l + 32, ... (DPL of them):
#   q, k heads: [x <- x / sqrt(mean(x^2) + eps) * w (norm_q / norm_k)], then RoPE over the
#               first n_rot dims (the pair's partner read from shared memory), written back;
#   k, v heads: also written to row pos[t] of the f16 cache.
# As ops.rms_norm (one warp for a row of Dh <= 256: same sum order). The rotation's cos and
# sin come from a table [C, n_rot/2, 2] per (cache size, rope parameters), made once on the
# host by the CPU's rope_tables (angles in float64): float64 pow/cos/sin are slow on the GPU,
# and the table gives exactly the CPU's values.

def head_rope_fns(Dh):
    """(norm_weights, norm_to_shared, rope_coeffs, rope_from_shared): one head's row held by
    a warp, lane l holding dims l, l + 32, ... in vals[c] (0 past Dh). norm_weights: wv[c] =
    w[dim] (the norm's weights, read once, before they are needed); norm_to_shared: [vals <-
    vals / sqrt(mean(vals^2) + eps) * wv], then vals into the warp's shared row sh[wy];
    rope_coeffs: cs[c], sn[c] = the rotation table's cos and sin for the lane's dims at
    position p; rope_from_shared: RoPE of the first n_rot dims with them, each pair's partner
    read from sh[wy]. The caller syncs the block between the last two (a partner is another
    lane's value). Shared by norm_rope_store and attention's decode kernel (which computes q
    and the new keys itself), so both give the same bits; the loads are split from the
    arithmetic so that a caller can issue them all at once (each is a memory round trip)."""
    key = ("head_rope", Dh)
    if key in _head_rope:
        return _head_rope[key]
    DPL = (Dh + 31) // 32

    @device_fn
    def norm_weights(wv, w, lane, norm):
        for c in range(DPL):
            d = lane + 32 * c
            wv[c] = w[d] if norm and d < Dh else f32(0.0)

    @device_fn
    def norm_to_shared(vals, sh, wy, lane, wv, norm, eps):
        ss = f32(0.0)
        for c in range(DPL):
            ss += vals[c] * vals[c]
        ss = warp_sum(ss)
        if norm:
            scale = f32(1.0 / math.sqrt(float(ss) / Dh + eps))
            for c in range(DPL):
                if lane + 32 * c < Dh:
                    vals[c] = vals[c] * scale * wv[c]
        for c in range(DPL):
            sh[wy, lane + 32 * c] = vals[c]

    @device_fn
    def rope_coeffs(cs, sn, lane, n_rot, neox, rope, p):
        half = n_rot // 2
        for c in range(DPL):
            d = lane + 32 * c
            cs[c] = f32(1.0)
            sn[c] = f32(0.0)
            if d < n_rot:
                i = (d if d < half else d - half) if neox else d // 2
                cs[c] = rope[p, i, 0]
                sn[c] = rope[p, i, 1]

    @device_fn
    def rope_from_shared(vals, sh, wy, lane, n_rot, neox, cs, sn):
        half = n_rot // 2
        for c in range(DPL):
            d = lane + 32 * c
            if d < n_rot:
                if neox:
                    i = d if d < half else d - half
                    x0 = sh[wy, i]
                    x1 = sh[wy, i + half]
                    first = d < half
                else:
                    i = d // 2
                    x0 = sh[wy, 2 * i]
                    x1 = sh[wy, 2 * i + 1]
                    first = d % 2 == 0
                vals[c] = x0 * cs[c] - x1 * sn[c] if first else x0 * sn[c] + x1 * cs[c]
    _head_rope[key] = norm_weights, norm_to_shared, rope_coeffs, rope_from_shared
    return _head_rope[key]


_head_rope = {}


def _norm_rope_store_kernel(Dh, KT="f16", VT="f16"):
    DPL = (Dh + 31) // 32
    norm_weights, norm_to_shared, rope_coeffs, rope_from_shared = head_rope_fns(Dh)

    def build():
        from .kv_rows import row_fns
        store_k, store_v = row_fns(Dh, KT)[3], row_fns(Dh, VT)[3]

        @cuda.jit
        def norm_rope_store_kernel(q, k, v, k_cache, kc16, v_cache, vc16, pos, wq, wk, eps, do_norm,
                                   n_rot, neox, rope):
            sh = cuda.shared.array((8, 8 * 32), f32)     # a warp's head (Dh <= 256, 8 warps)
            H, Hkv = q.shape[1], k.shape[1]
            lane = cuda.threadIdx.x
            wy = cuda.threadIdx.y
            t = cuda.blockIdx.x
            hh = cuda.blockIdx.y * cuda.blockDim.y + wy
            kind = 0 if hh < H else (1 if hh < H + Hkv else 2)   # q, k, v head
            hx = min(hh, H + 2 * Hkv - 1)
            h = hx if kind == 0 else (hx - H if kind == 1 else hx - H - Hkv)
            vals = cuda.local.array(DPL, f32)
            wv = cuda.local.array(DPL, f32)
            cs = cuda.local.array(DPL, f32)
            sn = cuda.local.array(DPL, f32)
            for c in range(DPL):
                d = lane + 32 * c
                x = f32(0.0)
                if d < Dh:
                    x = q[t, h, d] if kind == 0 else (k[t, h, d] if kind == 1 else v[t, h, d])
                vals[c] = x
            norm_weights(wv, wq if kind == 0 else wk, lane, do_norm and kind < 2)
            rope_coeffs(cs, sn, lane, n_rot, neox, rope, pos[t])
            norm_to_shared(vals, sh, wy, lane, wv, do_norm and kind < 2, eps)
            cuda.syncthreads()
            if kind < 2:
                rope_from_shared(vals, sh, wy, lane, n_rot, neox, cs, sn)
            if hh < H + 2 * Hkv:             # (kind: the same for the whole warp)
                p = pos[t]
                for c in range(DPL):
                    d = lane + 32 * c
                    if d < Dh:
                        if kind == 0:
                            q[t, h, d] = vals[c]
                        elif kind == 1:
                            k[t, h, d] = vals[c]
                            store_k(k_cache, kc16, p, h, c, lane, vals[c])
                        else:
                            store_v(v_cache, vc16, p, h, c, lane, vals[c])
        return norm_rope_store_kernel
    return cached(("norm_rope_store", Dh, KT, VT), build)


ROPE_WARPS = 4
_rope_tables = {}


def rope_table(n_pos, freqs, mscale):
    """Device float32 [n_pos, n_rot/2, 2]: mscale * cos, sin of pos * freqs[i] for pos < n_pos,
    by the CPU's rope_tables; one per GPU and parameters, kept (graphs hold it)."""
    freqs = np.asarray(freqs, np.float64)
    key = (device_id(), n_pos, freqs.tobytes(), float(mscale))
    tab = _rope_tables.get(key)
    if tab is None:
        from nbmoe.cpu.ops import rope_tables
        cs = np.empty((n_pos, len(freqs)), f32)
        sn = np.empty((n_pos, len(freqs)), f32)
        rope_tables(cs, sn, np.arange(n_pos, dtype=np.int32), freqs, float(mscale))
        tab = _rope_tables[key] = cuda.to_device(np.ascontiguousarray(np.stack([cs, sn], axis=-1)))
    return tab


def norm_rope_store(q, k, v, k_cache, v_cache, pos, wq, wk, eps, freqs, mscale, neox, stream=0):
    """q [T, H, Dh], k, v [T, Hkv, Dh] (device): [per-head RMS norm with wq / wk (None: no
    norm)], RoPE of q and k in place, then k and v into cache rows pos[t] in the cache's
    type (kv_rows.py; pos a device int32 [T]). Dh <= 256."""
    from .kv_rows import kv_type_of, write_view
    T, H, Dh = q.shape
    Hkv = k.shape[1]
    if Dh > 256:
        raise ValueError("norm_rope_store: head dim above 256")
    do_norm = wq is not None
    if not do_norm:
        wq = wk = pos          # typed stand-ins, never read
    n = H + 2 * Hkv
    _norm_rope_store_kernel(Dh, kv_type_of(k_cache), kv_type_of(v_cache))[
        (T, (n + ROPE_WARPS - 1) // ROPE_WARPS), (32, ROPE_WARPS), stream](
        q, k, v, k_cache, write_view(k_cache), v_cache, write_view(v_cache), pos, wq, wk, float(eps),
        do_norm, 2 * len(freqs), bool(neox), rope_table(k_cache.shape[0], freqs, mscale))


# ---------------------------------------------------------------- mla_rope
# MLA's per-token work before the scores (model/forward.py's mla_attention), one launch; the
# operands are column windows of wider heads (views): qi, qo [T, H, Dr] (q_pe, q''s roped
# part), lat [T, 1, R], kpe [T, 1, Dr] (the cache row's latent and roped key part).
#   block b < T * H:  qo[t, h] = rope(qi[t, h]), (t, h) = divmod(b, H);
#   block T * H + t:  lat[t] <- lat[t] / sqrt(mean(lat[t]^2) + eps) * w, kpe[t] <- rope(kpe[t]).
# A thread per pair or latent column, strided: the math of ops.rope_kernel and rms_norm_kernel.

@cuda.jit
def mla_rope_kernel(qo, qi, lat, kpe, pos, w, eps, freqs, mscale, neox):
    sh = cuda.shared.array(32, f32)
    T, H = qi.shape[0], qi.shape[1]
    b, tid, nth = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
    half = freqs.shape[0]
    if b < T * H:
        t = b // H
        for i in range(tid, half, nth):
            rope_pair(qo, qi, t, b - t * H, i, pos, freqs, mscale, neox)
        return
    t = b - T * H
    n = lat.shape[2]
    ss = f32(0.0)
    for i in range(tid, n, nth):
        v = lat[t, 0, i]
        ss += v * v
    ss = _block_sum(ss, sh)
    scale = f32(1.0 / math.sqrt(float(ss) / n + eps))
    for i in range(tid, n, nth):
        lat[t, 0, i] = lat[t, 0, i] * scale * w[i]
    for i in range(tid, half, nth):
        rope_pair(kpe, kpe, t, 0, i, pos, freqs, mscale, neox)


def mla_rope(qo, qi, lat, kpe, pos, w, eps, freqs, mscale, neox, stream=0):
    """qo = rope(qi) (q_pe into q'), then the cache row in place: lat = rms_norm(lat) * w,
    kpe = rope(kpe); views [T, H, Dr], [T, H, Dr], [T, 1, R], [T, 1, Dr] (see above)."""
    T, H = qi.shape[0], qi.shape[1]
    if lat.shape[1] != 1 or kpe.shape[1] != 1 or qo.shape != qi.shape:
        raise ValueError(f"mla_rope: q' {qo.shape}, q {qi.shape}, cache row {lat.shape} + {kpe.shape}")
    nth = 32 * min(NORM_THREADS // 32, max(1, (lat.shape[2] + 255) // 256))
    if T:
        mla_rope_kernel[T * H + T, nth, stream](qo, qi, lat, kpe, pos, w, float(eps),
                                                constant(np.asarray(freqs, np.float64)),
                                                float(mscale), bool(neox))
