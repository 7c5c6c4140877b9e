"""Slow, obviously correct float64 NumPy references for the CPU kernels: the math, readable.

Letters: T tokens, D model dim, H query heads, Hkv kv heads, Dh head dim, C cache slots,
E experts, A active experts, N rows, F FFN width.
"""
import numpy as np


def rms_norm(x, w, eps):
    """x [..., n] / sqrt(mean(x^2) + eps) * w [n]."""
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w.astype(np.float64)


def rope(x, pos, n_rot, freq_base, neox, freq_scale=1.0):
    """x [T, H, Dh] rotated on its first n_rot dims, pair by pair, straight from the formula."""
    y = x.astype(np.float64).copy()
    half = n_rot // 2
    for t in range(x.shape[0]):
        for i in range(half):
            theta = pos[t] * freq_scale * freq_base ** (-2.0 * i / n_rot)
            c, s = np.cos(theta), np.sin(theta)
            i0, i1 = (i, i + half) if neox else (2 * i, 2 * i + 1)
            x0, x1 = y[t, :, i0].copy(), y[t, :, i1].copy()
            y[t, :, i0] = x0 * c - x1 * s
            y[t, :, i1] = x0 * s + x1 * c
    return y


def silu(g):
    with np.errstate(over="ignore"):  # exp(1e4) = inf -> silu = -0, as it should
        return g / (1.0 + np.exp(-g))


def gelu_tanh(g):
    return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3)))


def swiglu(gate, up):
    return silu(gate.astype(np.float64)) * up


def geglu(gate, up):
    return gelu_tanh(gate.astype(np.float64)) * up


def softmax(x, axis=-1):
    x = x.astype(np.float64)
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def f16_round(x):
    """What the cache holds: x rounded to float16, back as float64."""
    return x.astype(np.float16).astype(np.float64)


def attention(q, k_all, v_all, pos0, scale, window=0):
    """Causal GQA attention. q [T, H, Dh]; k_all, v_all [n_ctx, Hkv, Dh] (float64, cache values).

    Token t (position pos0 + t) attends to positions j <= pos0 + t, and j > pos0 + t - window
    when window > 0. Query head h uses kv head h // (H // Hkv).
    """
    T, H, Dh = q.shape
    G = H // k_all.shape[1]
    out = np.zeros((T, H, Dh))
    for t in range(T):
        p = pos0 + t
        js = [j for j in range(p + 1) if window == 0 or j > p - window]
        for h in range(H):
            k, v = k_all[js, h // G], v_all[js, h // G]  # [n, Dh]
            w = softmax(scale * (k @ q[t, h].astype(np.float64)))
            out[t, h] = w @ v
    return out


def topk_route(logits, A, norm, gating=0):
    """ids [T, A], weights [T, A]: the A largest logits (ties: lower index first) and their
    gate values (0 softmax over E, 1 sigmoid, 2 softmax over the chosen), renormalised if norm."""
    T, E = logits.shape
    ids = np.zeros((T, A), np.int64)
    wts = np.zeros((T, A))
    for t in range(T):
        lg = logits[t].astype(np.float64)
        order = sorted(range(E), key=lambda e: (-lg[e], e))[:A]
        ids[t] = order
        if gating == 0:
            w = softmax(lg)[order]
        elif gating == 1:
            w = 1.0 / (1.0 + np.exp(-lg[order]))
        else:
            w = softmax(lg[order])
        if norm or gating == 2:
            w = w / w.sum()
        wts[t] = w
    return ids, wts


def moe_combine(y, weights):
    """out [T, D] = sum_a weights[t, a] * y[t, a]."""
    return np.einsum("ta,tad->td", weights.astype(np.float64), y.astype(np.float64))
