"""Slow, obviously correct float64 NumPy references for the CPU kernels: the math, readable.

Letters: T tokens, D model dim, H query heads, Hkv kv heads, Dh head dim, C cache slots,
E experts, A active experts, N rows, F FFN width.
"""
import numpy as np


def rnd(*shape, seed=0, scale=1.0):
    """Fresh random float32 inputs: N(0, scale) from a seed."""
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def max_rel(got, ref):
    """Largest error relative to the largest reference magnitude."""
    ref = np.asarray(ref, np.float64)
    err = np.max(np.abs(np.asarray(got, np.float64) - ref))
    return float(err / max(np.max(np.abs(ref)), 1e-30))


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


def swiglu_oai(gate, up, alpha=1.702, limit=7.0):
    """gpt-oss: x = min(gate, limit), y = clamp(up, -limit, limit), x * sigmoid(alpha x) * (y + 1)."""
    x = np.minimum(gate.astype(np.float64), limit)
    y = np.clip(up.astype(np.float64), -limit, limit)
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-alpha * x)) * (y + 1.0)


def softmax(x, axis=-1):
    x = x.astype(np.float64)
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def f16_round(x):
    """What the cache holds: x rounded to float16, back as float64."""
    return x.astype(np.float16).astype(np.float64)


def bf16_round(x):
    """What a bf16 cache holds: x rounded to nearest even bf16 (top half of an f32), as float64."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    top = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    return (top << 16).astype(np.uint32).view(np.float32).astype(np.float64)


def q8_0_quantize(x):
    """x [..., Dh] float32 -> (d float16 [..., Dh/32], q int8 [..., Dh]) as llama.cpp's
    quantize_row_q8_0_ref: d = max|x| / 127 per 32 values, q = round(x / d), halves away from 0."""
    b = np.asarray(x, np.float32).reshape(x.shape[:-1] + (-1, 32))
    d = (np.abs(b).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    v = (b * inv).astype(np.float32)
    q = (np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))).astype(np.int8)
    return d[..., 0].astype(np.float16), q.reshape(x.shape)


def q8_0_round(x):
    """What a q8_0 cache holds: d * q of each 32-block, as float64."""
    d, q = q8_0_quantize(x)
    return (q.reshape(d.shape + (32,)) * d[..., None].astype(np.float64)).reshape(q.shape)


def kv_round(x, kv_type):
    """What a cache of kv_type ('f16', 'bf16', 'q8_0') holds for x, as float64."""
    return {"f16": f16_round, "bf16": bf16_round, "q8_0": q8_0_round}[kv_type](x)


def attention(q, k_all, v_all, pos0, scale, window=0, sinks=None):
    """Causal GQA attention. q [T, H, Dh]; k_all, v_all [n_ctx, Hkv, Dh] (float64, cache values).

    Token t (position pos0 + t) attends to positions j <= pos0 + t, and j > pos0 + t - window
    when window > 0. Query head h uses kv head h // (H // Hkv). sinks [H]: one more softmax
    term per head, logit sinks[h] (unscaled), value zero.
    """
    T, H, Dh = q.shape
    G = H // k_all.shape[1]
    out = np.zeros((T, H, v_all.shape[2]))      # values may be narrower (MLA expanded)
    for t in range(T):
        p = pos0 + t
        js = [j for j in range(p + 1) if window == 0 or j > p - window]
        for h in range(H):
            k, v = k_all[js, h // G], v_all[js, h // G]  # [n, Dh]
            s = scale * (k @ q[t, h].astype(np.float64))
            if sinks is not None:
                s = np.append(s, np.float64(sinks[h]))
            w = softmax(s)[:len(js)]
            out[t, h] = w @ v
    return out


def attention_rows(q, k_all, v_all, pos, rows, scale, window=0, sinks=None):
    """Row t of q [T, H, Dh] is one token of its own sequence, whose cache rows start at
    rows[t] - pos[t]: attention() of that sequence at position pos[t]."""
    return np.concatenate([attention(q[t:t + 1], k_all[rows[t] - pos[t]:], v_all[rows[t] - pos[t]:],
                                     pos[t], scale, window, sinks) for t in range(q.shape[0])])


def rows_case(C, H, Hkv, Dh):
    """Three sequences of one cache of C rows, at starts 0, C/3, 2C/3 and positions 5, 20, 0,
    the other rows random too (a row that read past its sequence would see them): (q, new k,
    new v, k_all, v_all with the new rows in, pos, rows)."""
    pos = np.array([5, 20, 0], np.int32)
    rows = pos + np.array([0, C // 3, 2 * C // 3], np.int32)
    k_all, v_all = rnd(C, Hkv, Dh, seed=3), rnd(C, Hkv, Dh, seed=4)
    k, v, q = rnd(3, Hkv, Dh, seed=5), rnd(3, Hkv, Dh, seed=6), rnd(3, H, Dh, seed=7, scale=2.0)
    k_new, v_new = k_all.copy(), v_all.copy()
    k_new[rows], v_new[rows] = k, v
    return q, k, v, k_all, v_all, k_new, v_new, pos, rows


def topk_route(logits, A, norm, gating=0, scale=1.0, bias=None, n_group=0, topk_group=0):
    """ids [T, A], weights [T, A], as llama.cpp's build_moe_ffn: probs = softmax over E (0),
    sigmoid (1) or the logits (2); the A largest probs + bias (ties: lower index first), among
    the topk_group best of n_group equal groups (a group scores its 2 best) when n_group > 1;
    weights = probs there (2: softmax over the chosen logits), / their sum (at least 2^-14)
    if norm, * scale."""
    T, E = logits.shape
    ids = np.zeros((T, A), np.int64)
    wts = np.zeros((T, A))
    for t in range(T):
        lg = logits[t].astype(np.float64)
        with np.errstate(over="ignore"):
            probs = softmax(lg) if gating == 0 else 1.0 / (1.0 + np.exp(-lg)) if gating == 1 else lg
        sel = probs + (0.0 if bias is None else bias.astype(np.float64))
        if n_group > 1:
            groups = sel.reshape(n_group, E // n_group)
            score = [np.sort(g)[::-1][:2].sum() for g in groups]
            kept = sorted(range(n_group), key=lambda j: (-score[j], j))[:topk_group]
            sel = np.where(np.isin(np.arange(E) // (E // n_group), kept), sel, -np.inf)
        order = sorted(range(E), key=lambda e: (-sel[e], e))[:A]
        ids[t] = order
        w = softmax(lg[order]) if gating == 2 else probs[order]
        if norm:
            w = w / max(w.sum(), 2.0 ** -14)
        wts[t] = w * scale
    return ids, wts


def moe_combine(y, weights):
    """out [T, D] = sum_a weights[t, a] * y[t, a]."""
    return np.einsum("ta,tad->td", weights.astype(np.float64), y.astype(np.float64))
