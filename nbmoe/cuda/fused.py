"""Fused decode kernels: several graph nodes in one launch, for T <= matmul.MMV_MAX_T tokens.

Decoding is launch-bound on the GPU: a 48-layer MoE token is ~1000 small kernels, and even
replayed as a CUDA graph each costs a few microseconds. backend_cuda.find_groups spots these
runs of nodes in a plan and binds each run to one of the kernels below, which compute the same
values in the same order as the separate kernels (bit-identical results; tests check that):

  products_q8      q, k, v = x @ Wq^T [+ bq], x @ Wk^T [+ bk], x @ Wv^T [+ bv]: one
                   matrix-vector launch over the rows of up to three weights of one type
                   sharing the 8-bit x, each row's bias added to its dot
  glu_q8           act(x @ Wgate^T) * (x @ Wup^T): both rows dotted by one warp, the GLU
                   applied before the write (dense FFN)
  glu_id_q8        the same per (token, chosen expert) pair (MoE FFN gate / up / GLU), the
                   chosen expert's gate / up bias rows added before the GLU
  down_combine_q8  sum_a w[t, a] * (x[t, a] @ Wdown[ids[t, a]]^T [+ b[ids[t, a]]]): the down
                   product of every chosen expert of a token, its bias rows and the weighted
                   sum, no [T, A, D] round trip
  norm_route       RMS norm of the residual, the router product and the top-k: a MoE
                   layer's routing in one launch (the last block to finish routes)

(The per-head norm, RoPE and cache store of q, k, v is norm_rope.py.)

Letters as in matmul.py: T tokens, M rows, K values a row, A chosen experts, X input rows
per token (1 or A), RB bytes a weight row; x is in 8 bits (xq words, xds (d, s) per block).
Matrix-vector grids as matmul's: block (32, MMV_WARPS), a warp per weight row, the lanes over
the row's chunks by mmv_q8.row_dot_fn (V chunks of 1 to 4 units in flight a lane, the same sum
order as matmul's kernels), the lanes' sums added by warp shuffles.
"""
import math

import numpy as np
from numba import cuda

from . import device_fn, device_id, empty, or_empty, warp_sum
from .matmul import MMV_WARPS, _split_k, dot8, pair_row, quantizes_x
from .mmv_q8 import chunk_units, chunks_in_flight, row_dot_fn
from .moe import MAX_GROUPS, experts_per_lane, route_args, topk_warp_fn
from .ops import ACT_GELU, ACT_SILU, ACT_SWIGLU_OAI, NORM_THREADS, WORDS_MIN_N, _block_sum, _glu  # noqa: F401
from .quants import qtype_info, unit_cols
from .scratch import cached
from .x8 import quantize_word

f32 = np.float32
i32 = np.int32


def _check_act(act):
    if act not in (ACT_SILU, ACT_GELU, ACT_SWIGLU_OAI):
        raise ValueError(f"glu: unknown activation {act} (0 silu, 1 gelu, 2 swiglu_oai)")


# ---------------------------------------------------------------- products_q8
# Rows r of the concatenation [W0; W1; W2] (M0 + M1 + M2 rows, one type, one K): row r < M0 is
# row r of W0 into out0 (+ b0[r], as ops.add_bias after it; b0 of size 0: no bias), and so on.
# Grid (ceil((M0 + M1 + M2) / warps), T): block row y = token. Up to three weights: q, k, v (a
# run of two passes W1 again with M2 = 0). One token (T = 1): matmul's kernel shares each
# weight load among up to 8 tokens, this one does not.

def _products_kernel(qtype, V):
    row_dot = row_dot_fn(qtype, V)

    def build():
        @cuda.jit
        def products_q8_kernel(out0, out1, out2, w0, w1, w2, b0, b1, b2, xq, xds, M0, M1, M2, RB, K):
            lane = cuda.threadIdx.x
            r = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y
            t = cuda.blockIdx.y
            rr = min(r, M0 + M1 + M2 - 1)
            w, out, b, rw = w0, out0, b0, rr
            if rr >= M0 + M1:
                w, out, b, rw = w2, out2, b2, rr - M0 - M1
            elif rr >= M0:
                w, out, b, rw = w1, out1, b1, rr - M0
            acc = cuda.local.array(1, f32)
            isum = cuda.local.array(1, i32)
            acc[0] = f32(0.0)
            row_dot(acc, isum, w, w, rw * RB, xq, xds, t, t, K, lane, 0)
            tot = warp_sum(acc[0])
            if lane == 0 and r < M0 + M1 + M2:
                out[t, rw] = tot + b[rw] if b.shape[0] > 0 else tot
        return products_q8_kernel
    return cached(("products_q8", int(qtype), V, chunk_units(qtype)), build)


def products_q8(outs, ws, xq, xds, qtype, K, stream=0, biases=None):
    """outs[j] [T, M_j] = x @ dequant(ws[j])^T [+ biases[j] [M_j]] for 2 or 3 weights of one
    type (x in 8 bits); biases: None, or one per weight (None or size 0 where it has none)."""
    T = outs[0].shape[0]
    Ms = [w.shape[0] for w in ws]
    bs = [or_empty(b) for b in biases] if biases is not None else [empty()] * len(ws)
    if any(b.shape[0] not in (0, M) for b, M in zip(bs, Ms)):
        raise ValueError(f"products_q8: biases {[b.shape for b in bs]} for weights of {Ms} rows")
    if len(ws) == 2:
        outs, ws, Ms, bs = list(outs) + [outs[1]], list(ws) + [ws[1]], Ms + [0], bs + [bs[1]]
    rows = sum(Ms)
    _products_kernel(qtype, chunks_in_flight(qtype, K))[((rows + MMV_WARPS - 1) // MMV_WARPS, T), (32, MMV_WARPS), stream](
        outs[0], outs[1], outs[2], ws[0], ws[1], ws[2], bs[0], bs[1], bs[2], xq, xds, Ms[0], Ms[1],
        Ms[2], ws[0].shape[1], K)


# ---------------------------------------------------------------- glu_q8, glu_id_q8
# out[t, r] = act(Wgate[r] . x[t]) * (Wup[r] . x[t]); grid (ceil(M / warps), T), for T = 1
# (as products_q8).
# Expert form: out[t, a, r] with the rows of expert ids[t, a] and x row t * X + (a or 0);
# grid (ceil(M / warps), T * A), block row y = pair t * A + a. An expert's matrix has ME rows:
# M, or 2M for a merged gate_up (-muge: [E, 2M, RB], gate rows first), whose wu is then the
# same bytes seen from row M on, so one byte offset reaches both rows. The expert biases
# (gpt-oss) bg, bu [E * ME] (size 0: none) are laid out as the rows, a merged one's bu the
# same values seen from M on; added to the dots before the GLU (as add_bias_id).

def _glu_kernel(qtype, experts, V):
    row_dot = row_dot_fn(qtype, V, NW=2)     # gate and up rows: both rows' loads in flight

    def build():
        if experts:
            @cuda.jit
            def glu_id_q8_kernel(out, wg, wu, xq, xds, ids, X, RB, K, act, ME, bg, bu):
                M = out.shape[2]
                A = ids.shape[1]
                lane = cuda.threadIdx.x
                r = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y
                t, a, _, xr = pair_row(ids, cuda.blockIdx.y, r, M, A, X, RB)
                base = (ids[t, a] * ME + min(r, M - 1)) * RB
                acc = cuda.local.array(2, f32)
                isum = cuda.local.array(1, i32)
                acc[0] = f32(0.0)
                acc[1] = f32(0.0)
                row_dot(acc, isum, wg, wu, base, xq, xds, xr, xr, K, lane, 0)
                g = warp_sum(acc[0])
                u = warp_sum(acc[1])
                if lane == 0 and r < M:
                    if bg.shape[0] > 0:
                        g += bg[ids[t, a] * ME + r]
                    if bu.shape[0] > 0:
                        u += bu[ids[t, a] * ME + r]
                    out[t, a, r] = _glu(g, u, act)
            return glu_id_q8_kernel

        @cuda.jit
        def glu_q8_kernel(out, wg, wu, xq, xds, RB, K, act):
            M = out.shape[1]
            lane = cuda.threadIdx.x
            r = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y
            t = cuda.blockIdx.y
            base = min(r, M - 1) * RB
            acc = cuda.local.array(2, f32)
            isum = cuda.local.array(1, i32)
            acc[0] = f32(0.0)
            acc[1] = f32(0.0)
            row_dot(acc, isum, wg, wu, base, xq, xds, t, t, K, lane, 0)
            g = warp_sum(acc[0])
            u = warp_sum(acc[1])
            if lane == 0 and r < M:
                out[t, r] = _glu(g, u, act)
        return glu_q8_kernel
    return cached(("glu_q8", int(qtype), experts, V, chunk_units(qtype)), build)


def glu_q8(out, wg, wu, xq, xds, qtype, K, act, stream=0):
    """out [T, M] = act(x @ Wg^T) * (x @ Wu^T), x [T, K] in 8 bits; act ACT_SILU / ACT_GELU
    (ACT_SWIGLU_OAI: ops.swiglu_oai of the two products)."""
    T, M = out.shape
    _check_act(act)
    _glu_kernel(qtype, False, chunks_in_flight(qtype, K))[((M + MMV_WARPS - 1) // MMV_WARPS, T), (32, MMV_WARPS), stream](
        out, wg, wu, xq, xds, wg.shape[1], K, act)


def glu_id_q8(out, wg, wu, xq, xds, ids, X, qtype, K, act, stream=0, bg=None, bu=None):
    """out [T, A, M] = act(x @ Wg[e]^T + bg[e]) * (x @ Wu[e]^T + bu[e]), e = ids[t, a]
    (weights [E, M, RB], biases float32 [E * M] or None); wu None: wg [E, 2M, RB] is merged
    (-muge), each expert's M gate rows then its M up rows, and bg its merged bias [E * 2M]."""
    T, A, M = out.shape
    _check_act(act)
    E, RB, ME = wg.shape[0], wg.shape[2], wg.shape[1]
    bg, bu = _expert_bias(bg, E * ME), _expert_bias(bu, E * ME)
    if wu is None:
        wu = wg.reshape(E * ME * RB)[M * RB:]
        bu = bg[M:] if bg.shape[0] else bg
    _glu_kernel(qtype, True, chunks_in_flight(qtype, K))[((M + MMV_WARPS - 1) // MMV_WARPS, T * A), (32, MMV_WARPS), stream](
        out, wg, wu, xq, xds, ids, X, RB, K, act, ME, bg, bu)


def _expert_bias(b, n):
    """An expert bias as the kernels take it: flat float32 [n] (E * rows), or EMPTY (None)."""
    b = or_empty(b)
    if b.size not in (0, n) or b.dtype != np.float32:
        raise ValueError(f"expert bias: {b.size} values of {b.dtype}, expected float32 [{n}] or none")
    return b.reshape(b.size) if len(b.shape) != 1 else b


# ---------------------------------------------------------------- down_combine_q8
# out[t, r] = sum_a wts[t, a] * (W[ids[t, a]][r] . x[t * A + a]), the sum in order a = 0..A-1
# of warp-summed dots [+ the expert's bias row, b [E * M]] (as mul_mat_id [, add_bias_id]
# then moe_combine). Grid (M, T), block (32, A): warp a dots expert a's row (all A rows in
# flight at once: a warp walking the A experts in turn was latency-bound), the block's first
# thread adds the A results from shared memory.

def _down_combine_kernel(qtype, V, ACC):
    row_dot = row_dot_fn(qtype, V)

    def build():
        @cuda.jit
        def down_combine_q8_kernel(out, w, xq, xds, ids, wts, RB, K, bias):
            ys = cuda.shared.array(32, f32)
            M = out.shape[1]
            A = ids.shape[1]
            lane = cuda.threadIdx.x
            a = cuda.threadIdx.y
            r = cuda.blockIdx.x
            t = cuda.blockIdx.y
            acc = cuda.local.array(1, f32)
            isum = cuda.local.array(1, i32)
            acc[0] = f32(0.0)
            res = out[t, r] if ACC else f32(0.0)   # loaded early: off the critical path
            row_dot(acc, isum, w, w, (ids[t, a] * M + r) * RB, xq, xds, t * A + a, t * A + a, K, lane, 0)
            y = warp_sum(acc[0])
            if lane == 0:
                ys[a] = y + bias[ids[t, a] * M + r] if bias.shape[0] > 0 else y
            cuda.syncthreads()
            if lane == 0 and a == 0:
                acc = wts[t, 0] * ys[0]
                for q in range(1, A):
                    acc += wts[t, q] * ys[q]
                out[t, r] = acc + res if ACC else acc
        return down_combine_q8_kernel
    return cached(("down_combine_q8", int(qtype), V, ACC, chunk_units(qtype)), build)


def down_combine_q8(out, w, xq, xds, ids, wts, qtype, K, stream=0, accumulate=False, bias=None):
    """out [T, M] = sum_a wts[t, a] * (dequant(w[ids[t, a]]) @ x[t, a] + bias[ids[t, a]])
    (x [T, A, K] in 8 bits; bias float32 [E * M] or None); A <= 32. accumulate: out += that
    sum (the residual add fused in)."""
    T, M = out.shape
    A = ids.shape[1]
    if A > 32:
        raise ValueError("down_combine_q8: more than 32 chosen experts")
    bias = _expert_bias(bias, w.shape[0] * M)
    _down_combine_kernel(qtype, chunks_in_flight(qtype, K), bool(accumulate))[(M, T), (32, A), stream](
        out, w, xq, xds, ids, wts, w.shape[2], K, bias)


# ---------------------------------------------------------------- norm_route
# One token's MoE routing in one launch (T = 1), for a router of a float type (the path
# matmul takes for it, mul_mat_vec_kernel):
#   h = x / sqrt(mean(x^2) + eps) * wn,  logits = h @ Wr^T [+ b],  ids, weights = top-k of logits
#   (moe.topk_route, any of its variants),
# and h also in 8 bits (xq, xds) for the experts' products. Grid: ceil(E / (8 / S)) blocks of
# 256 threads = 8 warps, S warps an expert row (matmul._split_k's S). Each block computes the
# norm itself into shared memory (x is a few KB, re-read from L2 by every block), then its
# warps dot their router rows with h there; block 0 also writes h and its 8-bit form. A lane
# loads its first PF units of the router row, x and the norm's weights before the norm (they
# do not depend on it: one memory round trip instead of three). Each
# block then counts itself done on an atomic counter, after a memory fence that makes its
# logits visible to the other blocks; the block that counts last routes on one warp
# (moe.topk_warp), writes what the CPU reads next to its mapped host buffers (mirror; h from
# its own shared memory), [fences them to the host and sets the host's flag (signal)] and
# resets the counter for the next launch (CUDA graph replays). No block reads the logits
# before they are all written, so no SM holds a stale copy of them.
# Sum orders: the norm's is ops.rms_norm_words' (nth threads, word j = tid + k * nth, warps
# added in order; the warps past nth add zeros), the dot's mul_mat_vec_kernel's, the top-k's
# topk_route's: the separate launches' results, bit for bit.
ROUTE_THREADS = 256
ROUTE_MAX_D = 8192            # h in shared memory (32 KB)
PF = 2                        # router units a lane loads before the norm (Qwen3: all of its 2)


def _norm_route_kernel(wtype, WORDS, WPT, S, EPL):
    t_ = qtype_info(wtype)
    dec, split, tail = t_.dec, t_.split, t_.block == 1
    topk_warp = topk_warp_fn(EPL)
    VALS = 4 * WPT if WORDS else 8
    PRE = 8 * PF                              # (local array sizes must be plain constants)
    RPB = (ROUTE_THREADS // 32) // S          # router rows a block

    def build():
        @cuda.jit
        def norm_route_kernel(h, xq, xds, x, wn, eps, nth, wr, RB, logits, ids, weights,
                              counter, norm, gating, w_scale, bias, n_group, topk_group, lbias,
                              h_host, ids_host, weights_host, mirror, flag, signal):
            hs = cuda.shared.array(ROUTE_MAX_D, f32)
            sh = cuda.shared.array(32, f32)
            part = cuda.shared.array(8, f32)
            last = cuda.shared.array(1, i32)
            tid = cuda.threadIdx.x
            lane = tid % 32
            wy = tid // 32
            n = x.shape[1]
            nw = n // 4
            vals = cuda.local.array(VALS, f32)
            wv = cuda.local.array(VALS, f32)
            # loads first, all in flight together: x and the norm's weights, and this warp's
            # first PF units of its router row (they do not depend on the norm)
            E = logits.shape[1]
            r = cuda.blockIdx.x * RPB + wy // S
            sl = wy % S
            base = min(r, E - 1) * RB
            nu = (n + 7) // 8                      # 8-value units of a router row
            u0 = lane + 32 * sl
            pre = cuda.local.array(PRE, f32)
            for qq in range(PF):
                u = min(u0 + qq * 32 * S, nu - 1)  # (past the row: a unit not used)
                v0, v1, v2, v3, v4, v5, v6, v7 = dec(wr, base, u >> 2, u & 3, n)
                pre[8 * qq] = v0
                pre[8 * qq + 1] = v1
                pre[8 * qq + 2] = v2
                pre[8 * qq + 3] = v3
                pre[8 * qq + 4] = v4
                pre[8 * qq + 5] = v5
                pre[8 * qq + 6] = v6
                pre[8 * qq + 7] = v7
            # the norm: rms_norm_words' layout (WORDS) or rms_norm_kernel's (rows <= 256 values:
            # one warp, thread tid holding values tid, tid + 32, ...)
            if WORDS:
                for k in range(WPT):
                    j = tid + k * nth
                    for i in range(4):
                        inside = tid < nth and j < nw
                        vals[4 * k + i] = x[0, 4 * j + i] if inside else f32(0.0)
                        wv[4 * k + i] = wn[4 * j + i] if inside else f32(0.0)
            else:
                for k in range(8):
                    inside = tid < 32 and tid + 32 * k < n
                    vals[k] = x[0, tid + 32 * k] if inside else f32(0.0)
                    wv[k] = wn[tid + 32 * k] if inside else f32(0.0)
            ss = f32(0.0)
            for k in range(VALS):
                ss += vals[k] * vals[k]
            ss = _block_sum(ss, sh)
            scale = f32(1.0 / math.sqrt(float(ss) / n + eps))
            if WORDS:
                for k in range(WPT):
                    j = tid + k * nth
                    for i in range(4):
                        if tid < nth and j < nw:
                            hs[4 * j + i] = vals[4 * k + i] * scale * wv[4 * k + i]
            else:
                for k in range(8):
                    if tid < 32 and tid + 32 * k < n:
                        hs[tid + 32 * k] = vals[k] * scale * wv[k]
            cuda.syncthreads()                     # h complete in shared memory
            if cuda.blockIdx.x == 0:               # h and its 8-bit form to global memory
                for i in range(tid, n, ROUTE_THREADS):
                    h[0, i] = hs[i]
                for j0 in range(0, nw, ROUTE_THREADS):
                    j = min(j0 + tid, nw - 1)      # lanes past the row: the last word, not written
                    quantize_word(xq, xds, j, j0 + tid < nw, hs[4 * j], hs[4 * j + 1],
                                  hs[4 * j + 2], hs[4 * j + 3])
            acc = f32(0.0)
            for qq in range(PF):                   # the prefetched units, in the loop's order
                u = u0 + qq * 32 * S
                if u < nu:
                    i0, i1 = unit_cols(u >> 2, u & 3, split)
                    acc += dot8(pre[8 * qq], pre[8 * qq + 1], pre[8 * qq + 2], pre[8 * qq + 3],
                                pre[8 * qq + 4], pre[8 * qq + 5], pre[8 * qq + 6], pre[8 * qq + 7],
                                hs, 0, i0, i1, n, tail)
            for u in range(u0 + PF * 32 * S, nu, 32 * S):
                b = u >> 2
                uu = u & 3
                v0, v1, v2, v3, v4, v5, v6, v7 = dec(wr, base, b, uu, n)
                i0, i1 = unit_cols(b, uu, split)
                acc += dot8(v0, v1, v2, v3, v4, v5, v6, v7, hs, 0, i0, i1, n, tail)
            tot = warp_sum(acc)
            if S == 1:
                if lane == 0 and r < E:
                    logits[0, r] = tot + lbias[r] if lbias.shape[0] > 0 else tot
            else:
                if lane == 0:
                    part[wy] = tot
                cuda.syncthreads()
                if sl == 0 and lane == 0 and r < E:
                    tot = part[wy]
                    for q in range(1, S):
                        tot += part[wy + q]
                    logits[0, r] = tot + lbias[r] if lbias.shape[0] > 0 else tot
            cuda.threadfence()                     # this block's logits, seen by all
            cuda.syncthreads()
            if tid == 0:
                last[0] = 1 if cuda.atomic.add(counter, 0, 1) == cuda.gridDim.x - 1 else 0
            cuda.syncthreads()
            if last[0] == 1:
                if wy == 0:
                    lv = cuda.local.array(EPL, f32)
                    sv = cuda.local.array(EPL, f32)
                    taken = cuda.local.array(EPL, i32)
                    topk_warp(ids, weights, logits, 0, True, lane, lv, sv, taken, norm, gating,
                              w_scale, bias, n_group, topk_group)
                    if mirror and lane < ids.shape[1]:    # this lane's own writes, read back
                        ids_host[0, lane] = ids[0, lane]
                        weights_host[0, lane] = weights[0, lane]
                if mirror:                         # (every block holds all of h)
                    for i in range(tid, n, ROUTE_THREADS):
                        h_host[0, i] = hs[i]
                if signal:                         # all of the above seen by the host, then the flag
                    cuda.threadfence_system()
                    cuda.syncthreads()
                    if tid == 0:
                        flag[0] = 1
                if tid == 0:
                    counter[0] = 0
        return norm_route_kernel
    return cached(("norm_route", int(wtype), WORDS, WPT, S, EPL), build)


_counters = {}


def norm_route(h, xq, xds, x, wn, eps, wr, wtype, logits, ids, weights, norm, stream=0,
               mirror=None, signal=None, gating=0, scale=1.0, bias=None, n_group=0,
               topk_group=0, logit_bias=None):
    """One token: h [1, D] = rms_norm(x [1, D]) * wn, also in 8 bits into (xq, xds)
    (x8.x8_buffers(1, D)); logits [1, E] = h @ dequant(wr [E, row_bytes])^T (a float
    type) [+ logit_bias [E], the router's bias]; ids [1, A], weights [1, A] =
    moe.topk_route(logits, norm, gating, scale, bias, n_group, topk_group).
    mirror: (h, ids, weights) arrays of the same shapes (mapped host memory for the CPU, see
    scheduler.mirror_candidates) that get the same values too. signal: an int32 [1] array in
    mapped host memory set to 1 once ids, weights and the mirrors are visible to the host (the
    host waits for that instead of the stream: graphs.GraphRun's flag)."""
    D, E = x.shape[1], logits.shape[1]
    if x.shape[0] != 1 or D % 32 or D > ROUTE_MAX_D or ids.shape[1] > min(32, E):
        raise ValueError("norm_route: one token, D % 32 == 0, D <= ROUTE_MAX_D, A <= min(32, E)")
    words = D > WORDS_MIN_N                                     # as ops.rms_norm
    nth = 32 * min(NORM_THREADS // 32, (D // 4 + 31) // 32)
    wpt = 1
    while wpt * nth < D // 4:
        wpt *= 2
    route = route_args(E, ids.shape[1], gating, scale, bias, n_group, topk_group, "norm_route")
    lbias = or_empty(logit_bias)
    if lbias.size not in (0, E):
        raise ValueError(f"norm_route: the router bias must be [{E}] or empty")
    S = _split_k(E, D)
    key = device_id()
    if key not in _counters:
        _counters[key] = cuda.to_device(np.zeros(1, np.int32))
    rpb = (ROUTE_THREADS // 32) // S
    _norm_route_kernel(wtype, words, wpt, S, experts_per_lane(E))[(E + rpb - 1) // rpb, ROUTE_THREADS, stream](
        h, xq, xds, x, wn, float(eps), nth, wr, wr.shape[1], logits, ids, weights,
        _counters[key], bool(norm), *route, lbias, *(mirror or (h, ids, weights)), mirror is not None,
        _counters[key] if signal is None else signal, signal is not None)


def route_supported(wtype, D, E, A):
    """Whether norm_route takes a router of this type and these sizes (float types only:
    the other types' routers take matmul's 8-bit path, which norm_route does not repeat)."""
    return not quantizes_x(wtype, 1, D) and D % 32 == 0 and D <= ROUTE_MAX_D and A <= min(32, E)


def route_supports(gating, has_bias, n_group):
    """Whether norm_route takes this routing variant: every gating (0 softmax, 1 sigmoid,
    2 softmax over the chosen), with or without a selection bias, up to MAX_GROUPS expert
    groups (the sizes are route_supported's and moe.route_args' to check)."""
    return gating in (0, 1, 2) and n_group <= MAX_GROUPS
