"""Mixture-of-Experts routing and combine on CPU.

Letters: T tokens, E experts, A active (chosen) experts per token, D model dim.
All float arrays float32, C-contiguous; ids int32.

Gating modes (the `gating` argument; an architecture's config field):
  0 softmax         weights = softmax(logits over all E) at the chosen experts (mixtral, qwen3-moe)
  1 sigmoid         weights = sigmoid(logits) at the chosen experts (deepseek-v3 style, no bias)
  2 softmax_weight  weights = softmax over the A chosen logits only (gpt-oss)
Selection is always the A largest logits: each mode's score is monotone in the logit, and
comparing logits avoids ties that rounding would create among tiny probabilities.
"""
import numpy as np
from numba import njit, prange

from .ops import PAR_MIN_ELEMS, exp_f32

GATING_SOFTMAX, GATING_SIGMOID, GATING_SOFTMAX_WEIGHT = 0, 1, 2

# Tokens from which routing runs in parallel (a token's routing is ~E compares and exps).
ROUTE_PAR_MIN_T = 64


# ---------------------------------------------------------------- topk_route
# logits [T, E] -> ids [T, A] int32 (descending logit, ties -> lower expert index first),
# weights [T, A] float32 per the gating mode, renormalised to sum 1 when norm is True.
# Top-A by insertion into a sorted list of A (one pass over E); NaN logits rank as -inf.
# Parallel over tokens for prompts.

@njit(cache=True, error_model="numpy")
def _route_token(ids, wts, logits, norm, gating):
    """One token: ids [A], wts [A] <- the top-A of logits [E]; wts holds the logits meanwhile."""
    A, E = ids.shape[0], logits.shape[0]
    n = 0
    for e in range(E):
        v = logits[e]
        if not v >= -np.inf:  # NaN
            v = np.float32(-np.inf)
        if n < A:
            k = n
            n += 1
        elif v > wts[A - 1]:
            k = A - 1
        else:
            continue
        while k > 0 and v > wts[k - 1]:  # strict: an equal value earlier in E stays ahead
            wts[k] = wts[k - 1]
            ids[k] = ids[k - 1]
            k -= 1
        wts[k] = v
        ids[k] = e
    m = wts[0]  # the largest logit
    if gating == GATING_SOFTMAX:
        tot = 0.0
        for e in range(E):
            tot += exp_f32(logits[e] - m)
        inv = np.float32(1.0 / tot)
        for a in range(A):
            wts[a] = exp_f32(wts[a] - m) * inv
    elif gating == GATING_SIGMOID:
        for a in range(A):
            wts[a] = np.float32(1.0) / (np.float32(1.0) + exp_f32(-wts[a]))
    else:
        for a in range(A):
            wts[a] = exp_f32(wts[a] - m)
    if norm or gating == GATING_SOFTMAX_WEIGHT:
        tot = 0.0
        for a in range(A):
            tot += wts[a]
        if tot > 0.0:
            inv = np.float32(1.0 / tot)
            for a in range(A):
                wts[a] *= inv


@njit(cache=True, error_model="numpy")
def _route_seq(ids, weights, logits, norm, gating):
    for t in range(logits.shape[0]):
        _route_token(ids[t], weights[t], logits[t], norm, gating)


@njit(cache=True, error_model="numpy", parallel=True)
def _route_par(ids, weights, logits, norm, gating):
    for t in prange(logits.shape[0]):
        _route_token(ids[t], weights[t], logits[t], norm, gating)


@njit(cache=True, error_model="numpy")
def topk_route(ids, weights, logits, norm, gating=0):
    """ids [T, A] int32, weights [T, A] <- the A best experts of logits [T, E] and their weights."""
    if logits.shape[0] >= ROUTE_PAR_MIN_T:
        _route_par(ids, weights, logits, norm, gating)
    else:
        _route_seq(ids, weights, logits, norm, gating)


# ---------------------------------------------------------------- moe_combine
# out[t] = sum_a weights[t, a] * y[t, a]   with y [T, A, D] the chosen experts' outputs,
# summed in order a = 0 .. A-1 in float32. out must not alias y. Parallel over tokens.

@njit(cache=True, error_model="numpy")
def _combine_token(out, y, w):
    """out [D] = sum_a w[a] * y[a] for y [A, D]."""
    wa = w[0]
    ya = y[0]
    for i in range(out.shape[0]):
        out[i] = wa * ya[i]
    for a in range(1, y.shape[0]):
        wa = w[a]
        ya = y[a]
        for i in range(out.shape[0]):
            out[i] += wa * ya[i]


@njit(cache=True, error_model="numpy")
def _combine_seq(out, y, weights):
    for t in range(out.shape[0]):
        _combine_token(out[t], y[t], weights[t])


@njit(cache=True, error_model="numpy", parallel=True)
def _combine_par(out, y, weights):
    for t in prange(out.shape[0]):
        _combine_token(out[t], y[t], weights[t])


@njit(cache=True, error_model="numpy")
def moe_combine(out, y, weights):
    """out [T, D] = sum_a weights[t, a] * y[t, a] (y [T, A, D])."""
    if y.size >= PAR_MIN_ELEMS and out.shape[0] > 1:
        _combine_par(out, y, weights)
    else:
        _combine_seq(out, y, weights)
