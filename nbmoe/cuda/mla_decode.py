"""One token's attention over MLA's latent cache (the absorbed form: model/forward.py's
mla_attention), all query heads of a block sharing each staged key.

MLA has one kv head: a cached row [latent R, k_pe Dr] (Dh = R + Dr = 576 for DeepSeek) is the
key of every query head and, whole, its value. The warp kernel (attention.py) has a warp per
head read every row on its own; here a block takes HB heads and one split of the keys:
    per chunk of KC keys (their f16 rows staged in shared memory once):
      S[h, k] = q[h] . K[k]                  two threads a (head, key), half of Dh each
      online softmax per head (one thread a head): m, l, P[h, k], the rescale factor
      O[h, d] = corr[h] O[h, d] + sum_k P[h, k] K[k, d]     16 threads a head, Dh / 16 dims each
and writes its unnormalised O and (m, l) for attention.merge_splits_kernel, as flash.decode's
splits do (always merged). Grid (P splits, H / HB); a split takes an equal share of the keys.
Shared memory: q (f32, scaled) HB x (Dh + 1) and KC key rows (f16) of Dh + 2: padded so that
the score threads' loads fall in different banks.
"""
import numpy as np
from numba import cuda

from . import expf, shfl_xor
from .attention import (MAX_SPLITS, MIN_SPLIT_KEYS, SPLIT_KEYS, _buffer, _sinks, active_splits,
                        merge_splits)
from .kv_rows import kv_type_of, write_view
from .x8 import unused_x8

f32 = np.float32
NEG_INF = f32(-np.inf)
NTH = 256           # threads a block
HB = 16             # query heads a block (DeepSeek's 16, or 128 in 8 blocks)
KC = 8              # keys a chunk (HB * KC * 2 = NTH score threads)
MAX_DH = 600        # shared memory: 4 HB (Dh + 1) + 2 KC (Dh + 2) bytes within 48 KiB

_kernels = {}


def used(q, k_cache, v_cache, window=0):
    """Whether attention() of q [T, H, Dh] takes this kernel: one token, one f16 kv head whose
    rows are keys and values both (MLA), no window, H a multiple of HB, Dh a multiple of 32
    (a chunk's values share out evenly over the threads) up to MAX_DH."""
    T, H, Dh = q.shape
    return (T == 1 and window == 0 and k_cache is v_cache and k_cache.shape[1] == 1
            and kv_type_of(k_cache) == "f16" and H % HB == 0 and Dh % 32 == 0 and Dh <= MAX_DH)


def _kernel(Dh):
    if Dh in _kernels:
        return _kernels[Dh]
    QS = Dh + 1
    KS = Dh + 2
    NO = Dh // 16                      # output dims a thread holds
    HALF = Dh // 2                     # (a multiple of 4: Dh % 16 == 0)
    NL = KC * Dh // NTH                # key values a thread stages a chunk

    @cuda.jit
    def mla_decode_kernel(part_acc, part_ml, q, cache, pos, scale, min_keys):
        tid = cuda.threadIdx.x
        p = cuda.blockIdx.x
        h0 = cuda.blockIdx.y * HB
        Qs = cuda.shared.array((HB, QS), f32)
        Ks = cuda.shared.array((KC, KS), np.float16)
        Ss = cuda.shared.array((HB, KC), f32)
        corr = cuda.shared.array(HB, f32)
        ml = cuda.shared.array((HB, 2), f32)
        hi = pos[0] + 1                                   # keys 0 .. pos0
        Pa = active_splits(hi, cuda.gridDim.x, min_keys)
        if p >= Pa:
            return
        span = (hi + Pa - 1) // Pa
        a = p * span
        b = min(hi, a + span)
        for i in range(tid, HB * Dh, NTH):               # q, scaled
            h = i // Dh
            Qs[h, i - h * Dh] = q[0, h0 + h, i - h * Dh] * scale
        if tid < HB:
            ml[tid, 0] = NEG_INF
            ml[tid, 1] = f32(0.0)
        acc = cuda.local.array(NO, f32)
        staged = cuda.local.array(NL, np.float16)
        for i in range(NO):
            acc[i] = f32(0.0)
        ph = tid // 16                                    # PV: this thread's head and dims
        pd = tid - ph * 16
        sp = tid >> 1                                     # scores: this thread's (head, key)
        sh = sp // KC
        sk = sp - sh * KC
        half = tid & 1
        for j0 in range(a, b, KC):
            cuda.syncthreads()                            # Ks, Ss: the last chunk is read
            for r in range(NL):                           # every load in flight, then the stores
                i = tid + NTH * r                         # (past b: row b - 1 again, P = 0)
                k = i // Dh
                staged[r] = cache[min(j0 + k, b - 1), 0, i - k * Dh]
            for r in range(NL):
                i = tid + NTH * r
                k = i // Dh
                Ks[k, i - k * Dh] = staged[r]
            cuda.syncthreads()
            s0 = s1 = s2 = s3 = f32(0.0)                  # four chains: loads overlap
            for d in range(half * HALF, half * HALF + HALF, 4):
                s0 += Qs[sh, d] * f32(Ks[sk, d])
                s1 += Qs[sh, d + 1] * f32(Ks[sk, d + 1])
                s2 += Qs[sh, d + 2] * f32(Ks[sk, d + 2])
                s3 += Qs[sh, d + 3] * f32(Ks[sk, d + 3])
            s = (s0 + s1) + (s2 + s3)
            s += shfl_xor(s, 1)
            if half == 0:
                Ss[sh, sk] = s if j0 + sk < b else NEG_INF
            cuda.syncthreads()
            if tid < HB:                                  # online softmax, head tid
                m_old = ml[tid, 0]
                m_new = m_old
                for k in range(KC):
                    m_new = max(m_new, Ss[tid, k])
                c = expf(m_old - m_new)                   # 0 on the first chunk (m_old = -inf)
                tot = ml[tid, 1] * c
                for k in range(KC):
                    e = expf(Ss[tid, k] - m_new) if Ss[tid, k] > NEG_INF else f32(0.0)
                    Ss[tid, k] = e
                    tot += e
                ml[tid, 0] = m_new
                ml[tid, 1] = tot
                corr[tid] = c
            cuda.syncthreads()
            c = corr[ph]
            for i in range(NO):
                acc[i] *= c
            for k in range(KC):                           # NO independent sums a key
                pk = Ss[ph, k]
                for i in range(NO):
                    acc[i] += pk * f32(Ks[k, pd + 16 * i])
        for i in range(NO):
            part_acc[p, 0, h0 + ph, pd + 16 * i] = acc[i]
        cuda.syncthreads()
        if tid < HB:
            part_ml[p, 0, h0 + tid, 0] = ml[tid, 0]
            part_ml[p, 0, h0 + tid, 1] = ml[tid, 1]

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
    _kernel(Dh)[(P, H // HB), NTH, stream](part_acc, part_ml, q, write_view(cache), pos, f32(scale),
                                           MIN_SPLIT_KEYS)
    merge_splits(out, part_acc, part_ml, P, pos, pos, 0, sinks, MIN_SPLIT_KEYS, xq, xds, quant, True,
                 stream)
