"""Mixture-of-Experts routing and combine on the GPU.

Letters: T tokens, E experts, A active (chosen) experts per token, D model dim.
Float arrays float32 device arrays, ids int32. Gating modes as in nbmoe/cpu/moe.py:
  0 softmax         weights = softmax(logits over all E) at the chosen experts
  1 sigmoid         weights = sigmoid(logits) at the chosen experts
  2 softmax_weight  weights = softmax over the A chosen logits only
Selection is the A largest logits (NaN ranks as -inf; ties -> lower expert index first).
"""
import numpy as np
from numba import cuda

from . import device_fn, expf, shfl_idx, shfl_xor, warp_sum

f32 = np.float32
i32 = np.int32
NEG_INF = f32(-np.inf)

GATING_SOFTMAX, GATING_SIGMOID, GATING_SOFTMAX_WEIGHT = 0, 1, 2

# Tokens (= warps) per routing block.
ROUTE_WARPS = 4
THREADS = 256

_kernels = {}


# ---------------------------------------------------------------- topk_route
# logits [T, E] -> ids [T, A] int32 (descending logit, ties -> lower index), weights [T, A].
# One warp per token: lane l holds logits l, l + 32, ... (EPL = E / 32 rounded up, a
# compile-time size). A rounds of a warp argmax: each lane offers its best logit not yet taken,
# a butterfly over (value, index) pairs picks the winner in every lane, lane a keeps round a's.
# Then lanes a < A compute their weight; the softmax denominator is a warp sum.

def topk_warp_fn(EPL):
    """topk_warp(ids, weights, logits, t, write, lane, lv, taken, norm, gating): one warp
    routes token t (row t of ids and weights written if `write`); lv float32 / taken int32
    [EPL]: the caller's local arrays (a device function cannot make them in the simulator)."""
    @device_fn
    def topk_warp(ids, weights, logits, t, write, lane, lv, taken, norm, gating):
        E = logits.shape[1]
        A = ids.shape[1]
        for c in range(EPL):
            e = lane + 32 * c
            v = logits[t, e] if e < E else NEG_INF
            lv[c] = v if v >= NEG_INF else NEG_INF    # NaN -> -inf
            taken[c] = 0 if e < E else 1
        my_v = NEG_INF
        my_i = i32(0)
        for k in range(A):
            bv = NEG_INF
            bi = i32(E + 32)                          # no candidate: loses to any real one
            for c in range(EPL):
                if taken[c] == 0 and (lv[c] > bv or bi == E + 32):
                    bv = lv[c]
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
        m0 = shfl_idx(my_v, 0)                    # the largest logit
        if gating == GATING_SOFTMAX:
            part = f32(0.0)
            for c in range(EPL):
                e = lane + 32 * c
                if e < E:
                    part += expf(logits[t, e] - m0)
            w = expf(my_v - m0) / warp_sum(part)
        elif gating == GATING_SIGMOID:
            w = f32(1.0) / (f32(1.0) + expf(-my_v))
        else:
            w = expf(my_v - m0)
        if norm or gating == GATING_SOFTMAX_WEIGHT:
            s = warp_sum(w if lane < A else f32(0.0))
            if s > f32(0.0):
                w = w / s
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
    def topk_route_kernel(ids, weights, logits, norm, gating):
        T = logits.shape[0]
        lane = cuda.threadIdx.x
        t = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y
        lv = cuda.local.array(EPL, f32)
        taken = cuda.local.array(EPL, i32)
        topk_warp(ids, weights, logits, min(t, T - 1), t < T, lane, lv, taken, norm, gating)

    _kernels[("route", EPL)] = topk_route_kernel
    return topk_route_kernel


def topk_route(ids, weights, logits, norm, gating=0, stream=0):
    """ids [T, A] int32, weights [T, A] <- the A best experts of logits [T, E] and their weights."""
    T, E = logits.shape
    A = ids.shape[1]
    if A > 32 or A > E:
        raise ValueError(f"topk_route: {A} experts per token of {E}: the kernel takes A <= min(32, E)")
    if T == 0:
        return
    w = min(ROUTE_WARPS, T)
    _route_kernel(experts_per_lane(E))[(T + w - 1) // w, (32, w), stream](ids, weights, logits, bool(norm), int(gating))


# ---------------------------------------------------------------- moe_combine
# out[t] = sum_a weights[t, a] * y[t, a] with y [T, A, D], summed in order a = 0 .. A-1 in
# float32 (as the CPU). out must not alias y. One thread per output value.

@cuda.jit
def moe_combine_kernel(out, y, weights):
    T, A, D = y.shape
    idx = cuda.grid(1)
    if idx < T * D:
        t = idx // D
        d = idx - t * D
        acc = weights[t, 0] * y[t, 0, d]
        for a in range(1, A):
            acc += weights[t, a] * y[t, a, d]
        out[t, d] = acc


def moe_combine(out, y, weights, stream=0):
    """out [T, D] = sum_a weights[t, a] * y[t, a] (y [T, A, D])."""
    n = out.size
    if n:
        moe_combine_kernel[(n + THREADS - 1) // THREADS, THREADS, stream](out, y, weights)
