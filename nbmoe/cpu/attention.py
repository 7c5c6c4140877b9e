"""KV cache store and causal grouped-query attention over an f16 cache, on CPU.

Letters: T tokens in the micro-batch, H query heads, Hkv kv heads, G = H // Hkv query heads per
kv head, Dh head dim, C cache slots (context length), n keys attended by one query.

Cache layout, per layer: k_cache, v_cache uint16 [C, Hkv, Dh] holding f16 bit patterns; the Dh
values of one (position, kv head) are contiguous, and a whole position row (Hkv * Dh) too.
Token t of the batch sits at position pos0 + t.
"""
import numpy as np
from numba import njit, prange

from .half import f16_to_f32, f32_to_f16
from .ops import FM, exp_f32, row_max

# T=1: split the keys over threads (flash-decoding) once n * H * Dh reaches this; below it the
# single-threaded loop is faster than a parallel region's start and end barrier.
SPLIT_MIN_WORK = 1 << 18
# T>1: tasks of (token pair, kv head) in parallel once T * n * H * Dh reaches this.
PAR_MIN_WORK = 1 << 16
# Split path: spans of at least SPLIT_MIN_KEYS keys, at most SPLIT_MAX_SPANS of them (the
# thread count cannot be read in cached code, so prange deals the spans out to the threads).
SPLIT_MIN_KEYS = 128
SPLIT_MAX_SPANS = 32


# ---------------------------------------------------------------- store_kv
# k, v [T, Hkv, Dh] float32 -> k_cache, v_cache [C, Hkv, Dh] f16 rows pos0 .. pos0+T-1,
# rounded to nearest even. Single-threaded: T * Hkv * Dh values, a copy.

@njit(cache=True, error_model="numpy")
def store_kv(k_cache, v_cache, k, v, pos0):
    """Write k, v [T, Hkv, Dh] as f16 into cache rows pos0 .. pos0 + T - 1."""
    if pos0 < 0 or pos0 + k.shape[0] > k_cache.shape[0]:
        raise ValueError("store_kv: rows pos0 .. pos0 + T - 1 are outside the KV cache")
    for t in range(k.shape[0]):
        for g in range(k.shape[1]):
            kd, vd = k_cache[pos0 + t, g], v_cache[pos0 + t, g]
            ks, vs = k[t, g], v[t, g]
            for i in range(kd.shape[0]):
                kd[i] = f32_to_f16(ks[i])
                vd[i] = f32_to_f16(vs[i])


# ---------------------------------------------------------------- attention
# out[T, H, Dh] = softmax_j(scale * q[t, h] . k[j, g]) @ v[j, g]   with g = h // G,
# over keys j with j <= pos0 + t and (window == 0 or j > pos0 + t - window).
# Softmax in float32 with max subtraction. The worker below handles the G query heads of one
# kv head together, so each f16 key / value row is converted once and used G times.
# Parallel: T>1 over (token pair, kv head) tasks; T=1 over spans of keys, merged afterwards.

@njit(cache=True, error_model="numpy", fastmath=FM)
def _attend_span(acc, ml, qg, k_cache, v_cache, g, lo, hi, scale, s, kv):
    """Attention of the G query vectors qg [G, Dh] over keys lo .. hi-1 of kv head g, unnormalised.

    Writes acc [G, Dh] = sum_j exp(s_j - m) v_j and ml [G, 2] = (m, sum_j exp(s_j - m)), with
    s_j = scale * q . k_j and m = max_j s_j. Scratch: s [G, >= hi - lo], kv [Dh] float32.
    acc may alias qg: every read of qg comes before the first write of acc.
    """
    G, Dh = qg.shape[0], qg.shape[1]
    n = hi - lo
    sc = np.float32(scale)
    # scores s[a, j] = scale * q_a . k_j
    for j in range(n):
        krow = k_cache[lo + j, g]
        for i in range(Dh):
            kv[i] = f16_to_f32(krow[i])
        for a in range(G):
            q = qg[a]
            d = np.float32(0.0)
            for i in range(Dh):
                d += q[i] * kv[i]
            s[a, j] = d * sc
    # s[a, j] <- exp(s[a, j] - m_a)
    for a in range(G):
        m = row_max(s[a, :n])
        tot = np.float32(0.0)
        for j in range(n):
            e = exp_f32(s[a, j] - m)
            s[a, j] = e
            tot += e
        ml[a, 0] = m
        ml[a, 1] = tot
    # acc[a] = sum_j s[a, j] * v_j
    acc[:, :] = 0.0
    for j in range(n):
        vrow = v_cache[lo + j, g]
        for i in range(Dh):
            kv[i] = f16_to_f32(vrow[i])
        for a in range(G):
            p = s[a, j]
            o = acc[a]
            for i in range(Dh):
                o[i] += p * kv[i]


@njit(cache=True, error_model="numpy")
def _key_range(pos0, t, window):
    """Keys [lo, hi) that token t (at position pos0 + t) attends to."""
    hi = pos0 + t + 1
    lo = max(0, hi - window) if window > 0 else 0
    return lo, hi


@njit(cache=True, error_model="numpy", fastmath=FM)
def _finish(out_g, ml):
    """out_g [G, Dh] /= the softmax denominators ml[:, 1]."""
    for a in range(out_g.shape[0]):
        inv = np.float32(1.0) / ml[a, 1]
        o = out_g[a]
        for i in range(o.shape[0]):
            o[i] *= inv


@njit(cache=True, error_model="numpy")
def _attention_seq(out, q, k_cache, v_cache, pos0, scale, window):
    """Plain loop over tokens and kv heads."""
    T, H, Dh = q.shape
    Hkv = k_cache.shape[1]
    G = H // Hkv
    s = np.empty((G, pos0 + T), np.float32)
    kv = np.empty(Dh, np.float32)
    ml = np.empty((G, 2), np.float32)
    for t in range(T):
        lo, hi = _key_range(pos0, t, window)
        for g in range(Hkv):
            out_g = out[t, g * G:(g + 1) * G]
            _attend_span(out_g, ml, q[t, g * G:(g + 1) * G], k_cache, v_cache, g, lo, hi,
                         scale, s, kv)
            _finish(out_g, ml)


@njit(cache=True, error_model="numpy", parallel=True)
def _attention_par(out, q, k_cache, v_cache, pos0, scale, window):
    """T > 1: one task per (token pair, kv head). Token i is paired with token T-1-i, so every
    task has the same number of keys and prange's equal static chunks balance the causal
    triangle whatever the thread count."""
    T, H, Dh = q.shape
    Hkv = k_cache.shape[1]
    G = H // Hkv
    n_pair = (T + 1) // 2
    for task in prange(n_pair * Hkv):
        i, g = task // Hkv, task % Hkv
        s = np.empty((G, pos0 + T), np.float32)
        kv = np.empty(Dh, np.float32)
        ml = np.empty((G, 2), np.float32)
        for r in range(1 if 2 * i + 1 == T else 2):
            t = i if r == 0 else T - 1 - i
            lo, hi = _key_range(pos0, t, window)
            out_g = out[t, g * G:(g + 1) * G]
            _attend_span(out_g, ml, q[t, g * G:(g + 1) * G], k_cache, v_cache, g, lo, hi,
                         scale, s, kv)
            _finish(out_g, ml)


@njit(cache=True, error_model="numpy", parallel=True)
def _attention_split(out, q, k_cache, v_cache, pos0, scale, window):
    """T == 1: keys split into P spans of >= SPLIT_MIN_KEYS, processed in parallel; the partial
    results are merged by their maxima:
        out[h] = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p,   M = max_p m_p.
    """
    H, Dh = q.shape[1], q.shape[2]
    Hkv = k_cache.shape[1]
    G = H // Hkv
    lo, hi = _key_range(pos0, 0, window)
    n = hi - lo
    P = max(1, min(SPLIT_MAX_SPANS, n // SPLIT_MIN_KEYS))
    span = (n + P - 1) // P
    acc = np.empty((P, H, Dh), np.float32)
    ml = np.empty((P, H, 2), np.float32)
    for p in prange(P):
        a, b = lo + p * span, min(hi, lo + (p + 1) * span)
        s = np.empty((G, span), np.float32)
        kv = np.empty(Dh, np.float32)
        for g in range(Hkv):
            _attend_span(acc[p, g * G:(g + 1) * G], ml[p, g * G:(g + 1) * G],
                         q[0, g * G:(g + 1) * G], k_cache, v_cache, g, a, b, scale, s, kv)
    for h in range(H):
        m = ml[0, h, 0]
        for p in range(1, P):
            m = max(m, ml[p, h, 0])
        o = out[0, h]
        o[:] = 0.0
        tot = np.float32(0.0)
        for p in range(P):
            f = exp_f32(ml[p, h, 0] - m)
            tot += f * ml[p, h, 1]
            for i in range(Dh):
                o[i] += f * acc[p, h, i]
        inv = np.float32(1.0) / tot
        for i in range(Dh):
            o[i] *= inv


@njit(cache=True, error_model="numpy")
def attention(out, q, k_cache, v_cache, pos0, scale, window=0):
    """Causal GQA attention of q [T, H, Dh] over the f16 cache; out [T, H, Dh] may alias q.

    The cache must already hold rows 0 .. pos0 + T - 1 (store_kv first). window > 0 limits
    each query to its `window` most recent positions (itself included).
    """
    T, H, Dh = q.shape
    if pos0 < 0 or pos0 + T > k_cache.shape[0]:
        raise ValueError("attention: positions pos0 .. pos0 + T - 1 are outside the KV cache")
    n = pos0 + 1 if window == 0 else min(pos0 + 1, window)
    if T == 1:
        if n * H * Dh >= SPLIT_MIN_WORK and n >= 2 * SPLIT_MIN_KEYS:
            _attention_split(out, q, k_cache, v_cache, pos0, scale, window)
        else:
            _attention_seq(out, q, k_cache, v_cache, pos0, scale, window)
    elif T * n * H * Dh >= PAR_MIN_WORK:
        _attention_par(out, q, k_cache, v_cache, pos0, scale, window)
    else:
        _attention_seq(out, q, k_cache, v_cache, pos0, scale, window)
