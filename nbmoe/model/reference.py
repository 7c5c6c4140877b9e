"""A float64 NumPy forward pass for every architecture: slow, short, and the math on a page.

It shares nothing with the engine's kernels (weights are dequantized by gguf-py), so the
tests can hold the engine's logits against it. It processes a whole sequence from
position 0 with a plain causal mask; keys and values are rounded through float16 as the
engine's f16 KV cache does.
Legend: T tokens, D model dim, H / Hkv heads, Dh head dim, E experts, A active experts.
"""
import numpy as np
from gguf import GGMLQuantizationType, dequantize


def weight(tensors, name):
    """Dequantized float64 weight in numpy order ([rows, K] for matrices)."""
    t = tensors[name]
    if t.ggml_type == GGMLQuantizationType.F32:
        w = t.data.view(np.float32)
    elif t.ggml_type == GGMLQuantizationType.F16:
        w = t.data.view(np.float16)
    else:
        w = dequantize(t.data, t.ggml_type)
    return np.asarray(w, np.float64).reshape(t.shape)


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, n_rot, base, scale, neox):
    """x [T, heads, Dh]: rotate the first n_rot dims of each head by angle pos * theta_i."""
    x = x.copy()
    theta = base ** (-np.arange(0, n_rot, 2) / n_rot)                 # [n_rot/2]
    ang = (pos[:, None] * scale) * theta[None, :]                      # [T, n_rot/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    if neox:   # pairs (i, i + n_rot/2)
        a, b = x[..., : n_rot // 2].copy(), x[..., n_rot // 2: n_rot].copy()
        x[..., : n_rot // 2], x[..., n_rot // 2: n_rot] = a * cos - b * sin, a * sin + b * cos
    else:      # pairs (2i, 2i+1)
        a, b = x[..., 0:n_rot:2].copy(), x[..., 1:n_rot:2].copy()
        x[..., 0:n_rot:2], x[..., 1:n_rot:2] = a * cos - b * sin, a * sin + b * cos
    return x


def attention(q, k, v, scale, window):
    """Causal grouped-query attention. q [T, H, Dh], k, v [T, Hkv, Dh] -> [T, H, Dh]."""
    T, H, _ = q.shape
    group = H // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)   # [T, H, Dh]
    s = np.einsum("thd,shd->hts", q, k) * scale                      # [H, T, T]
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    visible = (j <= i) & ((window == 0) | (j > i - window))
    s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", p, v)


def act(x, kind):
    if kind == "silu":
        return x / (1 + np.exp(-x))
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))  # gelu (tanh)


def moe(x, W, p, cfg):
    """x [T, D] -> [T, D]: each token through its top-A experts, weighted by router probs."""
    logits = x @ W(p + "ffn_gate_inp.weight").T                     # [T, E]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, : cfg.n_expert_used]   # [T, A]
    wts = np.take_along_axis(probs, top, -1)                         # [T, A]
    if cfg.moe_norm_topk:
        wts /= wts.sum(-1, keepdims=True)
    gate, up, down = (W(p + f"ffn_{n}_exps.weight") for n in ("gate", "up", "down"))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(top[t], wts[t]):
            h = act(gate[e] @ x[t], cfg.flags.glu) * (up[e] @ x[t])
            out[t] += w * (down[e] @ h)
    return out


def forward(cfg, tensors, tokens):
    """Logits [T, V] (float64) for `tokens` starting at position 0."""
    cache = {}

    def W(name):
        if name not in cache:
            cache[name] = weight(tensors, name)
        return cache[name]

    f, eps = cfg.flags, cfg.norm_eps
    T, H, Hkv, Dh = len(tokens), cfg.n_head, cfg.n_head_kv, cfg.head_dim
    pos = np.arange(T, dtype=np.float64)
    x = W("token_embd.weight")[np.asarray(tokens)]                    # [T, D]
    if f.embed_scale:
        x = x * np.sqrt(cfg.n_embd)
    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        h = rms_norm(x, W(p + "attn_norm.weight"), eps)
        q = (h @ W(p + "attn_q.weight").T).reshape(T, H, Dh)
        k = (h @ W(p + "attn_k.weight").T).reshape(T, Hkv, Dh)
        v = (h @ W(p + "attn_v.weight").T).reshape(T, Hkv, Dh)
        if f.qk_norm:
            q, k = rms_norm(q, W(p + "attn_q_norm.weight"), eps), rms_norm(k, W(p + "attn_k_norm.weight"), eps)
        base, pos_scale = cfg.layer_rope(il)          # sliding-window layers have their own
        q = rope(q, pos, cfg.n_rot, base, pos_scale, f.rope_neox)
        k = rope(k, pos, cfg.n_rot, base, pos_scale, f.rope_neox)
        k, v = k.astype(np.float16).astype(np.float64), v.astype(np.float16).astype(np.float64)
        a = attention(q, k, v, cfg.attn_scale, cfg.layer_window(il)).reshape(T, H * Dh)
        o = a @ W(p + "attn_output.weight").T
        if f.post_norms:
            o = rms_norm(o, W(p + "post_attention_norm.weight"), eps)
        x = x + o
        h = rms_norm(x, W(p + "ffn_norm.weight"), eps)
        if cfg.is_moe:
            y = moe(h, W, p, cfg)
        else:
            y = act(h @ W(p + "ffn_gate.weight").T, f.glu) * (h @ W(p + "ffn_up.weight").T)
            y = y @ W(p + "ffn_down.weight").T
        if f.post_norms:
            y = rms_norm(y, W(p + "post_ffw_norm.weight"), eps)
        x = x + y
    x = rms_norm(x, W("output_norm.weight"), eps)
    out = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    return x @ W(out).T


def greedy(cfg, tensors, tokens, n):
    """n greedy tokens after `tokens`, recomputing the whole sequence each step."""
    seq = list(tokens)
    for _ in range(n):
        seq.append(int(np.argmax(forward(cfg, tensors, seq)[-1])))
    return seq[len(tokens):]
