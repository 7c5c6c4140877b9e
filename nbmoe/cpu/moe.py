"""Mixture-of-Experts routing and combine on CPU.

Letters: T tokens, E experts, A active (chosen) experts per token, D model dim, Gn expert
groups. All float arrays float32, C-contiguous; ids int32.

Routing (llama.cpp's build_moe_ffn), per token:
  probs   = softmax(logits over E) (gating 0: mixtral, qwen3-moe), sigmoid(logits) (1:
            deepseek-v3, glm4.5), or the logits themselves (2 softmax_weight: gpt-oss)
  choose  the A largest selection scores probs + bias (bias [E], optional); with groups
          (n_group > 1) experts form n_group equal groups of consecutive ids, a group scores
          the sum of its 2 best selection scores, and only the topk_group best groups' experts
          are candidates
  weights = probs at the chosen experts (gating 2: softmax over the A chosen logits),
            divided by their sum if norm (the sum clamped below at 2^-14, as llama.cpp), times scale
Ties rank the lower expert (or group) index first; NaN scores rank as -inf. Without bias and
groups every mode's score is monotone in the logit, so the logits are compared directly (the
plain path, route_plain; it also avoids ties that rounding creates among tiny probabilities).
The biased path (route_biased) is a separate kernel: models without bias or groups never
compile it.
"""
import numpy as np
from numba import njit, prange

from .ops import EMPTY, PAR_MIN_ELEMS, exp_f32
from .specialize import ConstantArgs

GATING_SOFTMAX, GATING_SIGMOID, GATING_SOFTMAX_WEIGHT = 0, 1, 2

# Tokens from which routing runs in parallel (a token's routing is ~E compares and exps).
ROUTE_PAR_MIN_T = 64
NORM_MIN_SUM = np.float32(6.103515625e-5)   # smallest normal f16: the renormalisation's floor


# ---------------------------------------------------------------- topk_route
# logits [T, E] -> ids [T, A] int32 (by descending score), weights [T, A] float32.
# Top-A by insertion into a sorted list of A (one pass over E). Parallel over tokens for prompts.

@njit(cache=True, error_model="numpy")
def _insert_top(ids, vals, e, v, n):
    """Insert score v of index e into the sorted top list ids, vals holding n entries (n < its
    length: appended; else it replaces the last if larger). Returns the new n."""
    A = ids.shape[0]
    if not v >= -np.inf:  # NaN
        v = np.float32(-np.inf)
    if n < A:
        k = n
        n += 1
    elif v > vals[A - 1]:
        k = A - 1
    else:
        return n
    while k > 0 and v > vals[k - 1]:  # strict: an equal value earlier stays ahead
        vals[k] = vals[k - 1]
        ids[k] = ids[k - 1]
        k -= 1
    vals[k] = v
    ids[k] = e
    return n


@njit(cache=True, error_model="numpy")
def _finish(wts, norm, scale):
    """wts /= max(sum, NORM_MIN_SUM) if norm; then wts *= scale."""
    if norm:
        tot = np.float32(0.0)
        for a in range(wts.shape[0]):
            tot += wts[a]
        inv = np.float32(1.0) / max(tot, NORM_MIN_SUM)
        for a in range(wts.shape[0]):
            wts[a] *= inv
    s = np.float32(scale)
    for a in range(wts.shape[0]):
        wts[a] *= s


@njit(cache=True, error_model="numpy")
def _softmax_chosen(wts):
    """wts [A] <- the softmax of the chosen logits wts [A]."""
    m = wts[0]
    for a in range(1, wts.shape[0]):
        m = max(m, wts[a])
    tot = np.float32(0.0)
    for a in range(wts.shape[0]):
        wts[a] = exp_f32(wts[a] - m)
        tot += wts[a]
    inv = np.float32(1.0) / tot
    for a in range(wts.shape[0]):
        wts[a] *= inv


@njit(cache=True, error_model="numpy")
def _route_token(ids, wts, logits, norm, gating, scale):
    """One token without bias or groups: ids [A], wts [A] <- the top-A of logits [E]; wts
    holds the logits meanwhile."""
    A, E = ids.shape[0], logits.shape[0]
    n = 0
    for e in range(E):
        n = _insert_top(ids, wts, e, logits[e], n)
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
        _softmax_chosen(wts)
    _finish(wts, norm, scale)


@njit(cache=True, error_model="numpy")
def _route_token_biased(ids, wts, logits, norm, gating, scale, bias, n_group, topk_group, p, sel):
    """One token with a selection bias and/or expert groups; p, sel [E]: scratch (probs and
    selection scores)."""
    A, E = ids.shape[0], logits.shape[0]
    if gating == GATING_SOFTMAX:
        m = np.float32(-np.inf)
        for e in range(E):
            m = max(m, logits[e])
        tot = 0.0
        for e in range(E):
            p[e] = exp_f32(logits[e] - m)
            tot += p[e]
        inv = np.float32(1.0 / tot)
        for e in range(E):
            p[e] *= inv
    elif gating == GATING_SIGMOID:
        for e in range(E):
            p[e] = np.float32(1.0) / (np.float32(1.0) + exp_f32(-logits[e]))
    else:
        for e in range(E):
            p[e] = logits[e]
    for e in range(E):
        sel[e] = p[e] + bias[e] if bias.shape[0] > 0 else p[e]
        if not sel[e] >= -np.inf:
            sel[e] = -np.inf
    if n_group > 1:
        Eg = E // n_group
        gids = np.empty(topk_group, np.int32)
        gvals = np.empty(topk_group, np.float32)
        ng = 0
        for j in range(n_group):
            b1 = b2 = np.float32(-np.inf)   # the group's two best scores
            for e in range(j * Eg, (j + 1) * Eg):
                if sel[e] > b1:
                    b1, b2 = sel[e], b1
                elif sel[e] > b2:
                    b2 = sel[e]
            ng = _insert_top(gids, gvals, j, b1 + b2 if Eg > 1 else b1, ng)
        for j in range(n_group):
            kept = False
            for i in range(topk_group):
                kept |= gids[i] == j
            if not kept:
                for e in range(j * Eg, (j + 1) * Eg):
                    sel[e] = -np.inf
    n = 0
    for e in range(E):
        n = _insert_top(ids, wts, e, sel[e], n)
    if gating == GATING_SOFTMAX_WEIGHT:
        for a in range(A):
            wts[a] = logits[ids[a]]
        _softmax_chosen(wts)
    else:
        for a in range(A):
            wts[a] = p[ids[a]]
    _finish(wts, norm, scale)


@njit(cache=True, error_model="numpy")
def _plain_seq(ids, weights, logits, norm, gating, scale):
    for t in range(logits.shape[0]):
        _route_token(ids[t], weights[t], logits[t], norm, gating, scale)


@njit(cache=True, error_model="numpy", parallel=True)
def _plain_par(ids, weights, logits, norm, gating, scale):
    for t in prange(logits.shape[0]):
        _route_token(ids[t], weights[t], logits[t], norm, gating, scale)


@njit(cache=True, error_model="numpy")
def _biased_seq(ids, weights, logits, norm, gating, scale, bias, n_group, topk_group):
    p, sel = np.empty(logits.shape[1], np.float32), np.empty(logits.shape[1], np.float32)
    for t in range(logits.shape[0]):
        _route_token_biased(ids[t], weights[t], logits[t], norm, gating, scale, bias, n_group,
                            topk_group, p, sel)


@njit(cache=True, error_model="numpy", parallel=True)
def _biased_par(ids, weights, logits, norm, gating, scale, bias, n_group, topk_group):
    for t in prange(logits.shape[0]):
        p, sel = np.empty(logits.shape[1], np.float32), np.empty(logits.shape[1], np.float32)
        _route_token_biased(ids[t], weights[t], logits[t], norm, gating, scale, bias, n_group,
                            topk_group, p, sel)


@njit(cache=True, error_model="numpy")
def route_plain(ids, weights, logits, norm, gating, scale):
    """topk_route without bias or groups (the common path: only this one is compiled)."""
    if ids.shape[1] > logits.shape[1]:
        raise ValueError("topk_route: more chosen experts than experts")
    if logits.shape[0] >= ROUTE_PAR_MIN_T:
        _plain_par(ids, weights, logits, norm, gating, scale)
    else:
        _plain_seq(ids, weights, logits, norm, gating, scale)


@njit(cache=True, error_model="numpy")
def route_biased(ids, weights, logits, norm, gating, scale, bias, n_group, topk_group):
    """topk_route with a selection bias and/or expert groups."""
    E, A = logits.shape[1], ids.shape[1]
    if A > E or bias.shape[0] not in (0, E):
        raise ValueError("topk_route: more chosen experts than experts, or a bias not of size E")
    if n_group > 1 and (E % n_group != 0 or topk_group < 1 or topk_group > n_group
                        or topk_group * (E // n_group) < A):
        raise ValueError("topk_route: the expert groups do not divide E or hold fewer than A experts")
    if logits.shape[0] >= ROUTE_PAR_MIN_T:
        _biased_par(ids, weights, logits, norm, gating, scale, bias, n_group, topk_group)
    else:
        _biased_seq(ids, weights, logits, norm, gating, scale, bias, n_group, topk_group)


def is_plain(bias, n_group):
    """Whether routing takes the plain path (no selection bias, no expert groups)."""
    return bias.shape[0] == 0 and n_group <= 1


@njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
def route(plain, ids, weights, logits, norm, gating, scale, bias, n_group, topk_group):
    """topk_route for @njit callers; plain (a constant: is_plain) picks the path, so that a
    caller compiles only its own."""
    if plain:
        if bias.shape[0] > 0 or n_group > 1:
            raise ValueError("topk_route: a bias or expert groups on the plain routing path")
        route_plain(ids, weights, logits, norm, gating, scale)
    else:
        route_biased(ids, weights, logits, norm, gating, scale, bias, n_group, topk_group)


def topk_route(ids, weights, logits, norm, gating=0, scale=1.0, bias=EMPTY, n_group=0, topk_group=0):
    """ids [T, A] int32, weights [T, A] <- the A best experts of logits [T, E] and their weights
    (see the module's docstring); bias [E] or EMPTY."""
    if is_plain(bias, n_group):
        route_plain(ids, weights, logits, norm, gating, scale)
    else:
        route_biased(ids, weights, logits, norm, gating, scale, bias, n_group, topk_group)


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


# ---------------------------------------------------------------- sum_pairs
# out[tok[s]] = sum of y[p] for p in [starts[s], starts[s + 1])   (--ep's partial sums)
# y [P, D] the weighted outputs of (token, expert) pairs in token order, one segment s per
# token that has pairs, summed in pair order in float32; other rows of out are left as they
# are. Parallel over segments (each writes its own row).

@njit(cache=True, error_model="numpy")
def _sum_segment(out, y, p0, p1):
    for i in range(out.shape[0]):
        out[i] = y[p0, i]
    for p in range(p0 + 1, p1):
        for i in range(out.shape[0]):
            out[i] += y[p, i]


@njit(cache=True, error_model="numpy", parallel=True)
def _sum_pairs_par(out, y, tok, starts):
    for s in prange(tok.shape[0]):
        _sum_segment(out[tok[s]], y, starts[s], starts[s + 1])


@njit(cache=True, error_model="numpy")
def _sum_pairs_seq(out, y, tok, starts):
    for s in range(tok.shape[0]):
        _sum_segment(out[tok[s]], y, starts[s], starts[s + 1])


def sum_pairs(out, y, tok, starts):
    """out[tok[s]] = y[starts[s]:starts[s + 1]].sum(0) (see above); tok, starts int64."""
    if y.size >= PAR_MIN_ELEMS and tok.shape[0] > 1:
        _sum_pairs_par(out, y, tok, starts)
    else:
        _sum_pairs_seq(out, y, tok, starts)
