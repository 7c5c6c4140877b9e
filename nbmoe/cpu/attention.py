"""KV cache store and causal grouped-query attention over the KV cache, on CPU.

Letters: T tokens in the micro-batch, H query heads, Hkv kv heads, G = H // Hkv query heads per
kv head, Dh head dim, C cache slots (context length), n keys attended by one query, R = G
rounded up to RB (the query rows a decode block computes together).

Cache layout, per layer: k_cache, v_cache [C, Hkv, row] of the cache's type (f16: uint16 [C, Hkv,
Dh] bit patterns; bf16, q8_0: kv_rows.py); the row of one (position, kv head) is contiguous, and
a whole position too. f16 is read by the loops below; the other types' rows are dequantized
into float32 one key at a time (kv_rows.load_row) and used as f16's are.
Token t of the batch sits at position pos0 + t.

Sinks (gpt-oss): sinks [H] float32, or a size-0 array for none. Head h's softmax then has one
more term, a key of logit sinks[h] (not scaled) and value zero:
    out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sinks[h] - m)),
    m = max(max_j s_j, sinks[h]).
It changes only the final normalisation, done once per row (attention_flash.sink_norm).

Prompts (T > 1) go to the tiled kernel in attention_flash.py (flash attention, -fa on / auto),
or with -fa off to plain_attention here: each token's scores over all its keys, one softmax,
then P @ V, as the decode kernel does for one token. Generation (T = 1) always takes the decode
kernel, which reads the cache directly (each key and value is used G times only, too few to
pay for a float32 copy).
"""
import numpy as np
from numba import carray, njit, prange

from . import attention_flash as flash
from numba.core import types
from numba.extending import overload

from .half import f16_to_f32
from .kv_rows import load_row, q8_scale, store_row
from .ops import EMPTY, FM, exp_f32, row_max
from .quants import FM as FM_DOT
from .quants import stack_f32

# T=1: split the keys over threads (flash-decoding) once n * H * Dh reaches this; below it the
# single-threaded loop beats a parallel region's start and end barriers (a busy machine's).
SPLIT_MIN_WORK = 1 << 18
# Split path: spans of at least SPLIT_MIN_KEYS keys, at most SPLIT_MAX_SPANS of them (the
# thread count cannot be read in cached code, so prange deals the spans out to the threads).
SPLIT_MIN_KEYS = 128
SPLIT_MAX_SPANS = 32
# T>1: query tiles in parallel once T * n * H * Dh reaches this.
PAR_MIN_WORK = 1 << 16

RB = 4   # decode: query rows per block (G is padded to a multiple)
IC = 16  # decode: head dims per P @ V micro-tile
_acc_pv = stack_f32(RB * IC)


# ---------------------------------------------------------------- store_kv
# k, v [T, Hkv, Dh] float32 -> k_cache, v_cache rows pos0 .. pos0+T-1 in the cache's type
# (f16: rounded to nearest even). Single-threaded: T * Hkv * Dh values, a copy.

@njit(cache=True, error_model="numpy")
def store_kv(k_cache, v_cache, k, v, pos0):
    """Write k, v [T, Hkv, Dh] into cache rows pos0 .. pos0 + T - 1."""
    if pos0 < 0 or pos0 + k.shape[0] > k_cache.shape[0]:
        raise ValueError("store_kv: rows pos0 .. pos0 + T - 1 are outside the KV cache")
    for t in range(k.shape[0]):
        for g in range(k.shape[1]):
            store_row(k_cache[pos0 + t, g], k[t, g])
            store_row(v_cache[pos0 + t, g], v[t, g])


# Per-row batches (several sequences' next tokens, model/graph.py's per_row): row t's key and
# value go to cache row rows[t], and its sequence's rows start at rows[t] - pos[t].

@njit(cache=True, error_model="numpy")
def store_kv_rows(k_cache, v_cache, k, v, rows):
    """Write k, v [T, Hkv, Dh] into cache rows rows[t]."""
    for t in range(k.shape[0]):
        if rows[t] < 0 or rows[t] >= k_cache.shape[0]:
            raise ValueError("store_kv_rows: a row is outside the KV cache")
        for g in range(k.shape[1]):
            store_row(k_cache[rows[t], g], k[t, g])
            store_row(v_cache[rows[t], g], v[t, g])


# ---------------------------------------------------------------- decode (T = 1)
# out[0, h] = softmax_j(scale * q[0, h] . k[j, g]) @ v[j, g]   with g = h // G, over keys
# j in [lo, hi) = [max(0, pos0 + 1 - window) if window else 0, pos0 + 1).
# One block: the G query rows of kv head g (qp [R, Dh], scaled; rows G.. are zero) against a
# span of keys, reading the f16 cache directly:
#   scores: s[a, j] = qp[a] . k_j, 4 rows x 2 keys per pass over Dh (8 dot products sharing
#           each converted key value; LLVM vectorizes the 8 sums over Dh);
#   P @ V:  acc[a] = sum_j s[a, j] v_j, 4 rows x 16 dims of accumulators in registers,
#           one broadcast of s[a, j] against each converted 16-value slice of v_j.
# Parallel (long contexts): spans of keys x kv heads, merged by their maxima afterwards.

@njit(cache=True, error_model="numpy", fastmath=FM)
def _decode_scores(s, qp, k_cache, g, lo, n):
    """s[a, j] = qp[a] . k_cache[lo + j, g] for a < R, j < n."""
    Dh = qp.shape[1]
    for a0 in range(0, qp.shape[0], RB):
        q0, q1, q2, q3 = qp[a0], qp[a0 + 1], qp[a0 + 2], qp[a0 + 3]
        for j0 in range(0, n, 2):
            j1 = min(j0 + 1, n - 1)  # odd n: the last pass computes key n-1 twice
            kx, ky = k_cache[lo + j0, g], k_cache[lo + j1, g]
            x0 = x1 = x2 = x3 = y0 = y1 = y2 = y3 = np.float32(0.0)
            for d in range(Dh):
                x = f16_to_f32(kx[d])
                y = f16_to_f32(ky[d])
                x0 += q0[d] * x
                x1 += q1[d] * x
                x2 += q2[d] * x
                x3 += q3[d] * x
                y0 += q0[d] * y
                y1 += q1[d] * y
                y2 += q2[d] * y
                y3 += q3[d] * y
            s[a0, j0], s[a0 + 1, j0], s[a0 + 2, j0], s[a0 + 3, j0] = x0, x1, x2, x3
            s[a0, j1], s[a0 + 1, j1], s[a0 + 2, j1], s[a0 + 3, j1] = y0, y1, y2, y3


@njit(cache=True, error_model="numpy", fastmath=FM_DOT)
def _decode_pv(acc, p, v_cache, g, lo, n):
    """acc[a] = sum_{j < n} p[a, j] * v_cache[lo + j, g] for a < R."""
    Dh = acc.shape[1]
    for a0 in range(0, p.shape[0], RB):
        for i0 in range(0, Dh - IC + 1, IC):
            o = carray(_acc_pv(), RB * IC)
            for x in range(RB * IC):
                o[x] = 0.0
            for j in range(n):
                vr = v_cache[lo + j, g, i0:i0 + IC]
                for c in range(IC):
                    x = f16_to_f32(vr[c])
                    for a in range(RB):
                        o[a * IC + c] += p[a0 + a, j] * x
            for a in range(RB):
                for c in range(IC):
                    acc[a0 + a, i0 + c] = o[a * IC + c]
        for i in range(Dh // IC * IC, Dh):  # a head dim that is not a multiple of IC
            for a in range(RB):
                t = np.float32(0.0)
                for j in range(n):
                    t += p[a0 + a, j] * f16_to_f32(v_cache[lo + j, g, i])
                acc[a0 + a, i] = t


# bf16: each key / value row converted to float32 once (kx, vr [Dh]), then the same sums as
# f16's (scores: 4 rows x 2 keys; P @ V: a row's Dh sums, vectorized).

@njit(cache=True, error_model="numpy", fastmath=FM)
def _decode_scores_rows(s, qp, k_cache, g, lo, n):
    """_decode_scores of a bf16 cache (or any type load_row reads)."""
    Dh = qp.shape[1]
    kx, ky = np.empty(Dh, np.float32), np.empty(Dh, np.float32)
    for j0 in range(0, n, 2):
        j1 = min(j0 + 1, n - 1)
        load_row(kx, k_cache[lo + j0, g])
        load_row(ky, k_cache[lo + j1, g])
        for a0 in range(0, qp.shape[0], RB):
            q0, q1, q2, q3 = qp[a0], qp[a0 + 1], qp[a0 + 2], qp[a0 + 3]
            x0 = x1 = x2 = x3 = y0 = y1 = y2 = y3 = np.float32(0.0)
            for d in range(Dh):
                x, y = kx[d], ky[d]
                x0 += q0[d] * x
                x1 += q1[d] * x
                x2 += q2[d] * x
                x3 += q3[d] * x
                y0 += q0[d] * y
                y1 += q1[d] * y
                y2 += q2[d] * y
                y3 += q3[d] * y
            s[a0, j0], s[a0 + 1, j0], s[a0 + 2, j0], s[a0 + 3, j0] = x0, x1, x2, x3
            s[a0, j1], s[a0 + 1, j1], s[a0 + 2, j1], s[a0 + 3, j1] = y0, y1, y2, y3


@njit(cache=True, error_model="numpy", fastmath=FM_DOT)
def _decode_pv_rows(acc, p, v_cache, g, lo, n):
    """_decode_pv of a bf16 cache (or any type load_row reads)."""
    R, Dh = acc.shape
    vr = np.empty(Dh, np.float32)
    acc[:] = 0.0
    for j in range(n):
        load_row(vr, v_cache[lo + j, g])
        for a in range(R):
            pa, o = p[a, j], acc[a]
            for i in range(Dh):
                o[i] += pa * vr[i]


# q8_0 keys: s[a, j] = sum_b d_jb * (qp[a, 32b:32b+32] . q_jb), the int8 sums per block in
# registers (4 rows x 2 keys), scaled once per block; rows are block_q8_0 bytes (kv_rows.py).

@njit(cache=True, error_model="numpy", fastmath=FM)
def _decode_scores_q8(s, qp, k_cache, g, lo, n):
    """_decode_scores of a q8_0 cache."""
    nb = qp.shape[1] // 32
    for j0 in range(0, n, 2):
        j1 = min(j0 + 1, n - 1)
        kx, ky = k_cache[lo + j0, g], k_cache[lo + j1, g]
        for a0 in range(0, qp.shape[0], RB):
            x0 = x1 = x2 = x3 = y0 = y1 = y2 = y3 = np.float32(0.0)
            for b in range(nb):
                dx, dy = q8_scale(kx, b), q8_scale(ky, b)
                cx, cy = kx[34 * b + 2:34 * b + 34], ky[34 * b + 2:34 * b + 34]
                q0, q1 = qp[a0, 32 * b:32 * b + 32], qp[a0 + 1, 32 * b:32 * b + 32]
                q2, q3 = qp[a0 + 2, 32 * b:32 * b + 32], qp[a0 + 3, 32 * b:32 * b + 32]
                u0 = u1 = u2 = u3 = w0 = w1 = w2 = w3 = np.float32(0.0)
                for i in range(32):
                    x = np.float32(np.int8(cx[i]))
                    y = np.float32(np.int8(cy[i]))
                    u0 += q0[i] * x
                    u1 += q1[i] * x
                    u2 += q2[i] * x
                    u3 += q3[i] * x
                    w0 += q0[i] * y
                    w1 += q1[i] * y
                    w2 += q2[i] * y
                    w3 += q3[i] * y
                x0 += dx * u0
                x1 += dx * u1
                x2 += dx * u2
                x3 += dx * u3
                y0 += dy * w0
                y1 += dy * w1
                y2 += dy * w2
                y3 += dy * w3
            s[a0, j0], s[a0 + 1, j0], s[a0 + 2, j0], s[a0 + 3, j0] = x0, x1, x2, x3
            s[a0, j1], s[a0 + 1, j1], s[a0 + 2, j1], s[a0 + 3, j1] = y0, y1, y2, y3


# q8_0 values: as f16's P @ V (4 rows x 16 dims of accumulators), each 16-value slice of v_j
# converted as d_jb * q (a slice lies in one 32-block: Dh is a multiple of 32).

@njit(cache=True, error_model="numpy", fastmath=FM_DOT)
def _decode_pv_q8(acc, p, v_cache, g, lo, n):
    """_decode_pv of a q8_0 cache."""
    Dh = acc.shape[1]
    for a0 in range(0, p.shape[0], RB):
        for i0 in range(0, Dh, IC):
            o = carray(_acc_pv(), RB * IC)
            for x in range(RB * IC):
                o[x] = 0.0
            b, at = i0 // 32, 34 * (i0 // 32) + 2 + i0 % 32
            for j in range(n):
                vr = v_cache[lo + j, g]
                d, cq = q8_scale(vr, b), v_cache[lo + j, g, at:at + IC]
                for c in range(IC):
                    x = d * np.float32(np.int8(cq[c]))
                    for a in range(RB):
                        o[a * IC + c] += p[a0 + a, j] * x
            for a in range(RB):
                for c in range(IC):
                    acc[a0 + a, i0 + c] = o[a * IC + c]


def decode_scores(s, qp, k_cache, g, lo, n):
    """s[a, j] = qp[a] . k_j over the cache's type (the loop is picked when compiling)."""


def decode_pv(acc, p, v_cache, g, lo, n):
    """acc[a] = sum_j p[a, j] v_j over the cache's type (the loop is picked when compiling)."""


@overload(decode_scores, jit_options={"error_model": "numpy"})
def _decode_scores_of(s, qp, k_cache, g, lo, n):
    f = {types.uint16: _decode_scores, types.uint8: _decode_scores_q8}.get(k_cache.dtype, _decode_scores_rows)
    return lambda s, qp, k_cache, g, lo, n: f(s, qp, k_cache, g, lo, n)


@overload(decode_pv, jit_options={"error_model": "numpy"})
def _decode_pv_of(acc, p, v_cache, g, lo, n):
    f = {types.uint16: _decode_pv, types.uint8: _decode_pv_q8}.get(v_cache.dtype, _decode_pv_rows)
    return lambda acc, p, v_cache, g, lo, n: f(acc, p, v_cache, g, lo, n)


@njit(cache=True, error_model="numpy", fastmath=FM)
def _decode_span(acc, ml, qp, G, k_cache, v_cache, g, lo, hi, s):
    """Attention of qp [R, Dh] over keys lo .. hi-1 of kv head g, unnormalised.

    Writes acc [R, Dh] = sum_j exp(s_j - m) v_j and ml [R, 2] = (m, sum_j exp(s_j - m)) for
    the first G rows, with s_j = qp . k_j and m = max_j s_j. Scratch: s [R, >= hi - lo].
    """
    n = hi - lo
    decode_scores(s, qp, k_cache, g, lo, n)
    for a in range(G):  # rows G.. keep their zero scores; their acc is never read
        row = s[a, :n]
        m = row_max(row)
        tot = np.float32(0.0)
        for j in range(n):
            e = exp_f32(row[j] - m)
            row[j] = e
            tot += e
        ml[a, 0] = m
        ml[a, 1] = tot
    decode_pv(acc, s, v_cache, g, lo, n)


@njit(cache=True, error_model="numpy")
def _key_range(pos0, window):
    """Keys [lo, hi) that the query at position pos0 attends to."""
    hi = pos0 + 1
    lo = max(0, hi - window) if window > 0 else 0
    return lo, hi


@njit(cache=True, error_model="numpy")
def _load_q(qp, q, g, G, scale, t=0):
    """qp[:G] = scale * token t's query rows of kv head g (rows G.. stay as they are: zero)."""
    s = np.float32(scale)
    for a in range(G):
        src = q[t, g * G + a]
        for i in range(qp.shape[1]):
            qp[a, i] = src[i] * s


@njit(cache=True, error_model="numpy", fastmath=FM)
def _decode_seq(out, q, k_cache, v_cache, pos0, scale, window, sinks):
    """T == 1, one kv head after another."""
    H, Dh = q.shape[1], q.shape[2]
    Hkv = k_cache.shape[1]
    G = H // Hkv
    R = (G + RB - 1) // RB * RB
    lo, hi = _key_range(pos0, window)
    qp = np.zeros((R, Dh), np.float32)
    s = np.empty((R, hi - lo), np.float32)
    acc = np.empty((R, Dh), np.float32)
    ml = np.empty((R, 2), np.float32)
    for g in range(Hkv):
        _load_q(qp, q, g, G, scale)
        _decode_span(acc, ml, qp, G, k_cache, v_cache, g, lo, hi, s)
        for a in range(G):
            inv = flash.sink_norm(ml[a, 0], ml[a, 1], sinks, g * G + a)
            o = out[0, g * G + a]
            for i in range(Dh):
                o[i] = acc[a, i] * inv


@njit(cache=True, error_model="numpy", parallel=True)
def _decode_split(out, q, k_cache, v_cache, pos0, scale, window, sinks):
    """T == 1: keys split into P spans of >= SPLIT_MIN_KEYS; the (span, kv head) tasks run in
    parallel and their partial results are merged by their maxima:
        out[h] = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p,   M = max_p m_p
    (a sink: one more term exp(sinks[h] - M) in the denominator, and in M).
    """
    H, Dh = q.shape[1], q.shape[2]
    Hkv = k_cache.shape[1]
    G = H // Hkv
    R = (G + RB - 1) // RB * RB
    lo, hi = _key_range(pos0, window)
    n = hi - lo
    P = max(1, min(SPLIT_MAX_SPANS, n // SPLIT_MIN_KEYS))
    span = (n + P - 1) // P
    acc = np.empty((P, Hkv, R, Dh), np.float32)
    ml = np.empty((P, Hkv, R, 2), np.float32)
    for task in prange(P * Hkv):
        p, g = task // Hkv, task % Hkv
        a, b = lo + p * span, min(hi, lo + (p + 1) * span)
        qp = np.zeros((R, Dh), np.float32)
        s = np.empty((R, span), np.float32)
        _load_q(qp, q, g, G, scale)
        _decode_span(acc[p, g], ml[p, g], qp, G, k_cache, v_cache, g, a, b, s)
    for h in range(H):
        g, r = h // G, h % G
        m = ml[0, g, r, 0]
        for p in range(1, P):
            m = max(m, ml[p, g, r, 0])
        if sinks.shape[0] > 0:
            m = max(m, sinks[h])
        o = out[0, h]
        for i in range(Dh):     # a loop: a slice assignment here would be a parallel region a head
            o[i] = 0.0
        tot = np.float32(0.0)
        for p in range(P):
            f = exp_f32(ml[p, g, r, 0] - m)
            tot += f * ml[p, g, r, 1]
            for i in range(Dh):
                o[i] += f * acc[p, g, r, i]
        if sinks.shape[0] > 0:
            tot += exp_f32(sinks[h] - m)
        inv = np.float32(1.0) / tot
        for i in range(Dh):
            o[i] *= inv


# ---------------------------------------------------------------- attention

def attention(out, q, k_cache, v_cache, pos0, scale, window=0, sinks=EMPTY, fa=True):
    """Causal GQA attention of q [T, H, Dh] over the cache (any type); out [T, H, Dv] may alias
    q (Dv: the value rows' width, Dh but for MLA's expanded form, which takes the flash kernel).

    out[t, h] = softmax_j(scale * q[t, h] . k[j, h // G]) @ v[j, h // G] over the keys
    j <= pos0 + t, and j > pos0 + t - window when window > 0 (its `window` most recent
    positions, itself included). The cache must already hold rows 0 .. pos0 + T - 1
    (store_kv first). sinks [H]: see the module's docstring (EMPTY: none). One token and a
    batch are separate kernels: each compiles alone. fa: a batch takes the tiled (flash)
    kernel, else plain_attention (-fa off).
    """
    if sinks.shape[0] not in (0, q.shape[1]):
        raise ValueError(f"attention: {sinks.shape[0]} sinks for {q.shape[1]} heads")
    if out.shape[2] != q.shape[2] and (q.shape[0] == 1 or not fa):
        raise ValueError("attention: values narrower than keys (MLA expanded) need the flash kernel")
    if q.shape[0] == 1:
        decode_attention(out, q, k_cache, v_cache, pos0, scale, window, sinks)
    elif fa:
        batch_attention(out, q, k_cache, v_cache, pos0, scale, window, sinks)
    else:
        plain_attention(out, q, k_cache, v_cache, pos0, scale, window, sinks)


def flash_used(T, Dh, kv_types=("f16", "f16"), Dv=None):
    """Whether a batch has a flash kernel here: every prompt batch (T > 1), any Dh (and value
    width Dv) and cache type."""
    return T > 1


def decoding(T):
    """Whether a batch takes the one-token decode kernel, whatever -fa says."""
    return T == 1


@njit(inline="always")
def _keys(T, pos0, window, k_cache):
    if pos0 < 0 or pos0 + T > k_cache.shape[0]:
        raise ValueError("attention: positions pos0 .. pos0 + T - 1 are outside the KV cache")
    return pos0 + 1 if window == 0 else min(pos0 + 1, window)


@njit(cache=True, error_model="numpy")
def decode_attention(out, q, k_cache, v_cache, pos0, scale, window, sinks):
    """attention() of one token (T = 1); sinks [H] or size 0 (none)."""
    H, Dh = q.shape[1], q.shape[2]
    n = _keys(1, pos0, window, k_cache)
    if n * H * Dh >= SPLIT_MIN_WORK and n >= 2 * SPLIT_MIN_KEYS:
        _decode_split(out, q, k_cache, v_cache, pos0, scale, window, sinks)
    else:
        _decode_seq(out, q, k_cache, v_cache, pos0, scale, window, sinks)


@njit(cache=True, error_model="numpy")
def attention_rows(out, q, k_cache, v_cache, pos, rows, scale, window, sinks):
    """Row t of q [T, H, Dh] is one token of its own sequence, at position pos[t], stored at
    cache row rows[t]: decode_attention over that sequence's rows rows[t] - pos[t] ..
    rows[t] (store_kv_rows first); out may alias q."""
    for t in range(q.shape[0]):
        start = rows[t] - pos[t]
        if start < 0 or rows[t] >= k_cache.shape[0]:
            raise ValueError("attention_rows: a row's keys are outside the KV cache")
        decode_attention(out[t:t + 1], q[t:t + 1], k_cache[start:], v_cache[start:], pos[t],
                         scale, window, sinks)


@njit(cache=True, error_model="numpy")
def batch_attention(out, q, k_cache, v_cache, pos0, scale, window, sinks):
    """attention() of T > 1 tokens (prompts); sinks [H] or size 0 (none)."""
    T, H, Dh = q.shape
    n = _keys(T, pos0, window, k_cache)
    if T * n * H * Dh >= PAR_MIN_WORK:
        flash.flash_par(out, q, k_cache, v_cache, pos0, scale, window, sinks)
    else:
        flash.flash_seq(out, q, k_cache, v_cache, pos0, scale, window, sinks)


# ---------------------------------------------------------------- plain (-fa off)
# out[t, h] as decode's _decode_span computes it for one token at position pos0 + t: the
# scores of all its keys in a row s [R, n], one softmax, then P @ V. Parallel over the
# (token, kv head) pairs, each with its own scratch.

@njit(cache=True, error_model="numpy", parallel=True)
def plain_attention(out, q, k_cache, v_cache, pos0, scale, window, sinks):
    """attention() of T tokens without tiling (-fa off); sinks [H] or size 0 (none)."""
    T, H, Dh = q.shape
    _keys(T, pos0, window, k_cache)
    Hkv = k_cache.shape[1]
    G = H // Hkv
    R = (G + RB - 1) // RB * RB
    for task in prange(T * Hkv):
        t, g = task // Hkv, task % Hkv
        lo, hi = _key_range(pos0 + t, window)
        qp = np.zeros((R, Dh), np.float32)
        s = np.empty((R, hi - lo), np.float32)
        acc = np.empty((R, Dh), np.float32)
        ml = np.empty((R, 2), np.float32)
        _load_q(qp, q, g, G, scale, t)      # before out's rows: out may alias q
        _decode_span(acc, ml, qp, G, k_cache, v_cache, g, lo, hi, s)
        for a in range(G):
            inv = flash.sink_norm(ml[a, 0], ml[a, 1], sinks, g * G + a)
            o = out[t, g * G + a]
            for i in range(Dh):
                o[i] = acc[a, i] * inv
