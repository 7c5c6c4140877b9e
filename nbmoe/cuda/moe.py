"""Mixture-of-Experts routing and combine on the GPU.

Letters: T tokens, E experts, A active (chosen) experts per token, D model dim, NG expert
groups. Float arrays float32 device arrays, ids int32. Routing as llama.cpp's build_moe_ffn:
  probs   = softmax(logits over E) | sigmoid(logits) | logits      gating 0 | 1 | 2
  scores  = probs + bias (the selection bias, DeepSeek-V3's exp_probs_b; only to choose)
  groups  (NG > 1): E / NG consecutive experts a group, a group's score the sum of its two best
          scores; only the topk_group best groups' experts can be chosen
  ids     = the A best scores (NaN logits rank as -inf; ties -> lower index first)
  weights = probs at ids (gating 2: softmax over the A chosen logits); if norm: / their sum;
            then * scale (the routed scaling factor)
Without bias or groups the scores are compared as logits (monotone in every gating), which
keeps the choice free of the ties that rounding makes among tiny probabilities.
"""
import numpy as np
from numba import cuda

from . import device_fn, expf, or_empty, shfl_idx, shfl_xor, warp_max, warp_sum
from .ops import THREADS, rows_grid

f32 = np.float32
i32 = np.int32
NEG_INF = f32(-np.inf)

GATING_SOFTMAX, GATING_SIGMOID, GATING_SOFTMAX_WEIGHT = 0, 1, 2
MAX_GROUPS = 32                     # a group's score lives on one lane

# Tokens (= warps) per routing block.
ROUTE_WARPS = 4

_kernels = {}


# ---------------------------------------------------------------- topk_route
# logits [T, E] -> ids [T, A] int32, weights [T, A]. One warp per token: lane l holds experts
# l, l + 32, ... (EPL = E / 32 rounded up, a compile-time size): lv their logits, sv their
# selection scores. Groups: per group a butterfly over (best, second best) pairs gives every
# lane the group's score, kept by lane g; topk_group rounds of a warp argmax over the lanes
# choose the groups (a bit mask), experts outside them score -inf. Then A rounds of a warp
# argmax over (score, index): each lane offers its best expert not yet taken, the butterfly
# picks the winner in every lane, lane a keeps round a's. Lanes a < A compute their weight;
# the softmax denominator and the norm are warp sums.

def topk_warp_fn(EPL):
    """topk_warp(ids, weights, logits, t, write, lane, lv, sv, taken, norm, gating, scale, bias,
    n_group, topk_group): one warp routes token t (row t of ids and weights written if
    `write`); lv, sv float32 / taken int32 [EPL]: the caller's local arrays (a device function
    cannot make them in the simulator); bias [E] or EMPTY; n_group 0: no groups."""
    @device_fn
    def topk_warp(ids, weights, logits, t, write, lane, lv, sv, taken, norm, gating, scale, bias,
                  n_group, topk_group):
        E = logits.shape[1]
        A = ids.shape[1]
        mx = NEG_INF
        for c in range(EPL):
            e = lane + 32 * c
            v = logits[t, e] if e < E else NEG_INF
            v = v if v >= NEG_INF else NEG_INF      # NaN -> -inf
            lv[c] = v
            mx = max(mx, v)
            taken[c] = 0 if e < E else 1
        m0 = warp_max(mx)                           # the largest logit
        den = f32(1.0)
        if gating == GATING_SOFTMAX:
            part = f32(0.0)
            for c in range(EPL):
                if lane + 32 * c < E:
                    part += expf(lv[c] - m0)
            den = warp_sum(part)
        has_bias = bias.shape[0] > 0
        scored = has_bias or n_group > 0            # else: choose by the logits themselves
        for c in range(EPL):
            e = lane + 32 * c
            v = lv[c]
            if scored and e < E:
                if gating == GATING_SOFTMAX:
                    v = expf(v - m0) / den
                elif gating == GATING_SIGMOID:
                    v = f32(1.0) / (f32(1.0) + expf(-v))
                if has_bias:
                    v += bias[e]
            sv[c] = v
        if n_group > 0:
            gs = E // n_group
            g_score = NEG_INF                       # lane g: group g's score
            for g in range(n_group):
                b1 = NEG_INF
                b2 = NEG_INF
                for c in range(EPL):
                    e = lane + 32 * c
                    if e < E and e // gs == g:
                        v = sv[c]
                        if v > b1:
                            b2 = b1
                            b1 = v
                        elif v > b2:
                            b2 = v
                for m in (16, 8, 4, 2, 1):          # merge the partner's (best, second)
                    o1 = shfl_xor(b1, m)
                    o2 = shfl_xor(b2, m)
                    if o1 > b1:
                        b2 = max(b1, o2)
                        b1 = o1
                    else:
                        b2 = max(b2, o1)
                if lane == g:
                    g_score = b1 + b2
            g_taken = lane >= n_group
            mask = 0
            for k in range(topk_group):
                bv = NEG_INF if g_taken else g_score
                bi = i32(64) if g_taken else i32(lane)
                for m in (16, 8, 4, 2, 1):
                    ov = shfl_xor(bv, m)
                    oi = shfl_xor(bi, m)
                    if ov > bv or (ov == bv and oi < bi):
                        bv = ov
                        bi = oi
                mask |= 1 << bi
                if bi == lane:
                    g_taken = True
            for c in range(EPL):
                e = lane + 32 * c
                if e < E and ((mask >> (e // gs)) & 1) == 0:
                    sv[c] = NEG_INF
        my_v = NEG_INF
        my_i = i32(0)
        for k in range(A):
            bv = NEG_INF
            bi = i32(E + 32)                          # no candidate: loses to any real one
            for c in range(EPL):
                if taken[c] == 0 and (sv[c] > bv or bi == E + 32):
                    bv = sv[c]
                    bi = i32(lane + 32 * c)
            for m in (16, 8, 4, 2, 1):
                ov = shfl_xor(bv, m)
                oi = shfl_xor(bi, m)
                if ov > bv or (ov == bv and oi < bi):
                    bv = ov
                    bi = oi
            if lane == k:
                my_v = bv
                my_i = bi
            if bi % 32 == lane:
                taken[bi // 32] = 1
        lg = my_v                                     # the chosen expert's logit
        if scored:                                    # my_v is a score: fetch the logit
            lg = NEG_INF
            for c in range(EPL):
                x = shfl_idx(lv[c], my_i % 32)
                if lane < A and c == my_i // 32:
                    lg = x
        if gating == GATING_SOFTMAX:
            w = expf(lg - m0) / den
        elif gating == GATING_SIGMOID:
            w = f32(1.0) / (f32(1.0) + expf(-lg))
        else:
            w = expf(lg - warp_max(lg))               # softmax over the chosen logits
        if norm or gating == GATING_SOFTMAX_WEIGHT:
            s = warp_sum(w if lane < A else f32(0.0))
            if s > f32(0.0):
                w = w / s
        w = w * scale
        if lane < A and write:
            ids[t, lane] = my_i
            weights[t, lane] = w
    return topk_warp


def experts_per_lane(E):
    """EPL: logits a lane holds (E / 32 rounded up to a power of two)."""
    epl = 1
    while 32 * epl < E:
        epl *= 2
    return epl


def _route_kernel(EPL):
    k_ = _kernels.get(("route", EPL))
    if k_ is not None:
        return k_
    topk_warp = topk_warp_fn(EPL)

    @cuda.jit
    def topk_route_kernel(ids, weights, logits, norm, gating, scale, bias, n_group, topk_group):
        T = logits.shape[0]
        lane = cuda.threadIdx.x
        t = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y
        lv = cuda.local.array(EPL, f32)
        sv = cuda.local.array(EPL, f32)
        taken = cuda.local.array(EPL, i32)
        topk_warp(ids, weights, logits, min(t, T - 1), t < T, lane, lv, sv, taken, norm, gating,
                  scale, bias, n_group, topk_group)

    _kernels[("route", EPL)] = topk_route_kernel
    return topk_route_kernel


def route_args(E, A, gating=0, scale=1.0, bias=None, n_group=0, topk_group=0, who="topk_route"):
    """The routing variant as the kernels take it, (gating, scale, bias, n_group, topk_group),
    after checking it: A <= min(32, E); bias [E] or none; n_group <= 1 means no groups, else
    E splits into n_group <= MAX_GROUPS groups of >= 2 and topk_group of them hold >= A."""
    bias = or_empty(bias)
    if A > 32 or A > E:
        raise ValueError(f"{who}: {A} experts per token of {E}: the kernel takes A <= min(32, E)")
    if gating not in (GATING_SOFTMAX, GATING_SIGMOID, GATING_SOFTMAX_WEIGHT):
        raise ValueError(f"{who}: unknown gating {gating} (0 softmax, 1 sigmoid, 2 softmax_weight)")
    if bias.size not in (0, E) or bias.dtype != np.float32:
        raise ValueError(f"{who}: the selection bias must be float32 [{E}] or empty")
    n_group = int(n_group) if n_group > 1 else 0
    if n_group:
        gs = E // n_group
        if n_group > MAX_GROUPS or E % n_group or gs < 2 or not 1 <= topk_group <= n_group \
                or A > topk_group * gs:
            raise ValueError(f"{who}: {E} experts in {n_group} groups, {topk_group} groups kept, "
                             f"{A} chosen: need n_group <= {MAX_GROUPS} equal groups of >= 2 "
                             "experts, 1 <= topk_group <= n_group, A <= topk_group * E / n_group")
    return int(gating), f32(scale), bias, n_group, int(topk_group) if n_group else 0


def topk_route(ids, weights, logits, norm, gating=0, scale=1.0, bias=None, n_group=0,
               topk_group=0, stream=0):
    """ids [T, A] int32, weights [T, A] <- the A best experts of logits [T, E] and their
    weights (see the module's doc); bias: float32 [E] device array or None / EMPTY."""
    T, E = logits.shape
    args = route_args(E, ids.shape[1], gating, scale, bias, n_group, topk_group)
    if T == 0:
        return
    w = min(ROUTE_WARPS, T)
    _route_kernel(experts_per_lane(E))[(T + w - 1) // w, (32, w), stream](
        ids, weights, logits, bool(norm), *args)


# ---------------------------------------------------------------- moe_combine
# out[t] = sum_a weights[t, a] * y[t, a] with y [T, A, D], summed in order a = 0 .. A-1 in
# float32 (as the CPU). out must not alias y. A thread per column d, over tokens (rows_grid).

@cuda.jit
def moe_combine_kernel(out, y, weights):
    T, A, D = y.shape
    d = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if d < D:
        t = cuda.blockIdx.y
        while t < T:
            acc = weights[t, 0] * y[t, 0, d]
            for a in range(1, A):
                acc += weights[t, a] * y[t, a, d]
            out[t, d] = acc
            t += cuda.gridDim.y


def moe_combine(out, y, weights, stream=0):
    """out [T, D] = sum_a weights[t, a] * y[t, a] (y [T, A, D])."""
    if out.size:
        moe_combine_kernel[rows_grid(*out.shape), THREADS, stream](out, y, weights)
