"""Tiled (flash) causal attention for prompt batches (T > 1) over the KV cache, on CPU.

Letters: T tokens, H query heads, Hkv kv heads, G = H // Hkv, Dh head dim (as in attention.py;
Dv the value heads' width, out's last axis: Dh except in MLA's expanded form, Dh 192, Dv 128);
BQ tokens per query tile, M = BQ * G query rows of a tile, Mp = M rounded up to MC; BK keys
per key tile.

A task is one query tile (BQ tokens x the G query heads of kv head g: M rows, row m is token
t0 + m // G, head g * G + m % G) against the key tiles it can see. Per key tile:
  1. convert its k, v rows from the cache's type (f16, bf16, q8_0: kv_rows.py) to float32
     once (Kc, Vc [BK, Dh]), used by all M rows;
  2. St[j, m] = Kc[j] . Qt[:, m]  (Qt [Dh, Mp] = scale * q, transposed: rows across vector
     lanes, so the micro-kernel broadcasts one key value against 16 rows, 4 keys x 16 rows of
     accumulators in registers); masked entries (causal, window, padding keys) -> -inf;
  3. online softmax, vectorized over rows: m_new = max(m_run, max_j St), alpha = exp(m_run -
     m_new), P = exp(St - m_new), l_run = alpha * l_run + sum_j P;
  4. O[m] = alpha[m] * O[m] + sum_j P[j, m] Vc[j]  (4 rows x 16 dims of accumulators).
At the end out[t, h] = O[m] / l_run[m], with a sink's term added to l_run (attention.py's
docstring). Key tiles past the last token's position are never visited, nor those before
the first token's window. Parallel over (query tile pair, kv head): tile i is paired with
tile nq-1-i so every task does the same causal work.
The micro-kernels keep their accumulators in stack arrays (quants.stack_f32) whose loops
unroll fully, so LLVM promotes them to registers: JR * MC and MR * IC are 64 floats, 8 ymm.
"""
import numpy as np
from numba import carray, njit, prange

from .kv_rows import load_row
from .ops import FM, _maxnum, exp_f32
from .quants import FM as FM_DOT
from .quants import stack_f32

BQ = 16     # tokens per query tile
BK = 64     # keys per key tile
MC = 16     # query rows per QK micro-tile (two ymm vectors of lanes)
JR = 4      # keys per QK micro-tile
MR = 4      # query rows per PV micro-tile
IC = 16     # head dims per PV micro-tile
NINF = np.float32(-np.inf)

_acc_qk = stack_f32(JR * MC)
_acc_pv = stack_f32(MR * IC)
_row_max = stack_f32(MC)


# ---------------------------------------------------------------- micro-kernels
# St [BK, Mp], Qt [Dh, Mp], Kc [BK, Dh], Vc [BK, Dv], O [Mp, Dv], all float32, C-contiguous.

@njit(cache=True, error_model="numpy", fastmath=FM_DOT)
def _scores(St, mx, Qt, Kc, Mp, nkp, Dh):
    """St[j, m] = Kc[j] . Qt[:, m] and mx[m] = max_j St[j, m], for j < nkp (a multiple of JR)."""
    for m0 in range(0, Mp, MC):
        rmax = carray(_row_max(), MC)
        for c in range(MC):
            rmax[c] = NINF
        for j0 in range(0, nkp, JR):
            acc = carray(_acc_qk(), JR * MC)
            for x in range(JR * MC):
                acc[x] = 0.0
            for d in range(Dh):
                qt = Qt[d, m0:m0 + MC]
                for r in range(JR):
                    kv = Kc[j0 + r, d]
                    for c in range(MC):
                        acc[r * MC + c] += kv * qt[c]
            for r in range(JR):
                st = St[j0 + r, m0:m0 + MC]
                for c in range(MC):
                    v = acc[r * MC + c]
                    st[c] = v
                    rmax[c] = _maxnum(rmax[c], v)
        mt = mx[m0:m0 + MC]
        for c in range(MC):
            mt[c] = rmax[c]


@njit(cache=True, error_model="numpy")
def _mask(St, mx, lo, hi, k0, nk, Mp):
    """St[j, m] = -inf where key k0 + j is outside [lo[m], hi[m]); mx = the max of the rest.
    A separate pass: only the tiles on a mask edge need it."""
    for m in range(Mp):
        mx[m] = NINF
    for j in range(nk):
        kj = np.int32(k0 + j)
        for m in range(Mp):
            s = St[j, m] if (kj >= lo[m]) & (kj < hi[m]) else NINF
            St[j, m] = s
            mx[m] = _maxnum(mx[m], s)


@njit(cache=True, error_model="numpy", fastmath=FM)
def _softmax_step(St, stats, Mp, nk):
    """Online softmax over St[:nk, :Mp] in place (scores -> probabilities). stats [5, Mp]:
    running max, running sum, alpha (out), tile max (in; scratch), tile sum (scratch)."""
    m_run, l_run, alpha, mx, ls = stats[0], stats[1], stats[2], stats[3], stats[4]
    for m in range(Mp):
        mn = _maxnum(m_run[m], mx[m])
        mu = mn if mn > NINF else np.float32(0.0)  # no key seen yet: alpha scales zeros
        alpha[m] = exp_f32(m_run[m] - mu)
        m_run[m] = mn
        mx[m] = mu
        ls[m] = 0.0
    for j in range(nk):
        for m in range(Mp):
            s = St[j, m]
            e = exp_f32(s - mx[m])
            e = e if s > NINF else np.float32(0.0)  # exp_f32(-inf) is 1.6e-38, not 0
            St[j, m] = e
            ls[m] += e
    for m in range(Mp):
        l_run[m] = l_run[m] * alpha[m] + ls[m]


@njit(cache=True, error_model="numpy", fastmath=FM_DOT)
def _pv(O, P, Vc, alpha, Mp, nk, Dh):
    """O[m] = alpha[m] * O[m] + sum_{j < nk} P[j, m] * Vc[j] for m < Mp (a multiple of MR)."""
    for m0 in range(0, Mp, MR):
        for i0 in range(0, Dh - IC + 1, IC):
            acc = carray(_acc_pv(), MR * IC)
            for r in range(MR):
                a = alpha[m0 + r]
                for c in range(IC):
                    acc[r * IC + c] = O[m0 + r, i0 + c] * a
            for j in range(nk):
                for r in range(MR):
                    p = P[j, m0 + r]
                    for c in range(IC):
                        acc[r * IC + c] += p * Vc[j, i0 + c]
            for r in range(MR):
                for c in range(IC):
                    O[m0 + r, i0 + c] = acc[r * IC + c]
        for i in range(Dh // IC * IC, Dh):  # a head dim that is not a multiple of IC
            for r in range(MR):
                o = O[m0 + r, i] * alpha[m0 + r]
                for j in range(nk):
                    o += P[j, m0 + r] * Vc[j, i]
                O[m0 + r, i] = o


@njit(cache=True, error_model="numpy")
def sink_norm(m, l, sinks, h):
    """The factor that normalises a row of running max m and sum l: 1 / l, or with head h's
    sink (sinks of size > 0) f / (l f + exp(sinks[h] - m')), m' = max(m, sinks[h]),
    f = exp(m - m') (the row's terms rescaled to m')."""
    if sinks.shape[0] == 0:
        return np.float32(1.0) / l
    s = sinks[h]
    mn = _maxnum(m, s)
    f = exp_f32(m - mn)
    return f / (l * f + exp_f32(s - mn))


# ---------------------------------------------------------------- one query tile

@njit(cache=True, error_model="numpy", fastmath=FM)
def _query_tile(out, q, k_cache, v_cache, pos0, scale, window, sinks, t0, t1, g, sc):
    """out[t0:t1, heads of kv head g] for one query tile; sc: the task's scratch (_scratch)."""
    Qt, Kc, Vc, St, O, stats, lo, hi = sc
    Hkv, Dh, Dv = k_cache.shape[1], q.shape[2], out.shape[2]
    G = q.shape[1] // Hkv
    M = (t1 - t0) * G
    Mp = (M + MC - 1) // MC * MC
    s = np.float32(scale)
    for m in range(Mp):
        if m < M:
            p = pos0 + t0 + m // G
            src = q[t0 + m // G, g * G + m % G]
            for i in range(Dh):
                Qt[i, m] = src[i] * s
            lo[m] = max(0, p + 1 - window) if window > 0 else 0
            hi[m] = p + 1
        else:  # padding row: no key
            for i in range(Dh):
                Qt[i, m] = 0.0
            lo[m] = 1
            hi[m] = 0
        for i in range(Dv):
            O[m, i] = 0.0
        stats[0, m] = NINF
        stats[1, m] = 0.0
    k_lo = max(0, pos0 + t0 + 1 - window) if window > 0 else 0  # first token's first key
    k_hi = pos0 + t1                                             # past the last token
    lo_last = max(0, pos0 + t1 - window) if window > 0 else 0    # last token's first key
    for k0 in range(k_lo, k_hi, BK):
        nk = min(BK, k_hi - k0)
        nkp = (nk + JR - 1) // JR * JR
        for j in range(nk):
            load_row(Kc[j], k_cache[k0 + j, g])
            load_row(Vc[j], v_cache[k0 + j, g])
        for j in range(nk, nkp):
            for i in range(Dh):
                Kc[j, i] = 0.0
        _scores(St, stats[3], Qt, Kc, Mp, nkp, Dh)
        if k0 + nk > pos0 + t0 + 1 or k0 < lo_last or nkp > nk:
            _mask(St, stats[3], lo, hi, k0, nk, Mp)
        _softmax_step(St, stats, Mp, nk)
        _pv(O, St, Vc, stats[2], Mp, nk, Dv)
    for m in range(M):
        h = g * G + m % G
        inv = sink_norm(stats[0, m], stats[1, m], sinks, h)
        dst = out[t0 + m // G, h]
        for i in range(Dv):
            dst[i] = O[m, i] * inv


@njit(cache=True, error_model="numpy")
def _scratch(G, Dh, Dv):
    """A task's float32 tiles Qt, Kc, Vc, St, O, stats and int32 key bounds lo, hi."""
    Mp = (BQ * G + MC - 1) // MC * MC
    return (np.empty((Dh, Mp), np.float32), np.empty((BK, Dh), np.float32),
            np.empty((BK, Dv), np.float32), np.empty((BK, Mp), np.float32),
            np.empty((Mp, Dv), np.float32), np.empty((5, Mp), np.float32),
            np.empty(Mp, np.int32), np.empty(Mp, np.int32))


# ---------------------------------------------------------------- drivers
# q [T, H, Dh], out [T, H, Dv] float32 (out may alias q: a tile reads its q rows first);
# k_cache, v_cache [C, Hkv, row] (any cache type) holding rows 0 .. pos0 + T - 1; sinks [H] or size 0.

@njit(cache=True, error_model="numpy")
def flash_seq(out, q, k_cache, v_cache, pos0, scale, window, sinks):
    """Query tiles and kv heads one after another."""
    T, H, Dh = q.shape
    Hkv = k_cache.shape[1]
    sc = _scratch(H // Hkv, Dh, out.shape[2])
    for t0 in range(0, T, BQ):
        for g in range(Hkv):
            _query_tile(out, q, k_cache, v_cache, pos0, scale, window, sinks, t0, min(T, t0 + BQ), g, sc)


@njit(cache=True, error_model="numpy", parallel=True)
def flash_par(out, q, k_cache, v_cache, pos0, scale, window, sinks):
    """One task per (query tile pair, kv head): tiles i and nq-1-i together, so prange's equal
    static chunks balance the causal triangle whatever the thread count."""
    T, H, Dh = q.shape
    Hkv = k_cache.shape[1]
    nq = (T + BQ - 1) // BQ
    n_pair = (nq + 1) // 2
    for task in prange(n_pair * Hkv):
        i, g = task // Hkv, task % Hkv
        sc = _scratch(H // Hkv, Dh, out.shape[2])
        for r in range(1 if 2 * i + 1 == nq else 2):
            t0 = (i if r == 0 else nq - 1 - i) * BQ
            _query_tile(out, q, k_cache, v_cache, pos0, scale, window, sinks, t0, min(T, t0 + BQ), g, sc)
