"""A float64 NumPy forward pass for every architecture: slow, short, and the math on a page.

It shares nothing with the engine's kernels (weights are dequantized by gguf-py), so the
tests can hold the engine's logits against it. It reads only the fields of ModelConfig
(arch.py), as forward.py's graph does. It processes a whole sequence from position 0;
keys and values are rounded as the engine's KV cache holds them (KV_TYPES: f16 by default).
Legend: T tokens, D model dim, H / Hkv heads, Dh head dim, E experts, A active experts, F width.
"""
import numpy as np
from gguf import GGMLQuantizationType, dequantize

from nbmoe.model.arch import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, config_from_meta

KV_TYPES = ("f16", "f16")      # the cache's key and value types (-ctk, -ctv) the keys go through


def load(path):
    """(ModelConfig, tensors) of a GGUF file, without the engine."""
    from nbmoe.loader.gguf_file import GGUFFile
    f = GGUFFile(path)
    emb = f.tensors.get("token_embd.weight")
    return config_from_meta(f.meta, emb.ne[1] if emb is not None else None, f.tensors), f.tensors


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


def cache_round(x, kv_type):
    """x [..., n] as a cache of kv_type holds it: f16; bf16 (the top half of an f32, rounded to
    nearest even); q8_0 (per 32 values d = max|x| / 127 as f16, q = round(x / d) in int8)."""
    if kv_type == "f16":
        return np.asarray(x).astype(np.float16).astype(np.float64)
    x32 = np.asarray(x, np.float32)
    if kv_type == "bf16":
        u = x32.view(np.uint32).astype(np.uint64)
        top = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
        return (top << 16).astype(np.uint32).view(np.float32).astype(np.float64)
    b = x32.reshape(x32.shape[:-1] + (-1, 32))
    d = (np.abs(b).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    v = (b * inv).astype(np.float32)
    q = np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))
    return (q * d.astype(np.float16).astype(np.float64)).reshape(x32.shape)


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, freqs, neox, mscale=1.0):
    """x [T, heads, Dh]: rotate the first n_rot = 2 len(freqs) dims of each head by the angle
    pos * freqs[i] of pair i, cos and sin times mscale; the other dims pass unchanged."""
    x, n_rot = x.copy(), 2 * len(freqs)
    ang = pos[:, None] * freqs[None, :]                                # [T, n_rot/2]
    cos, sin = np.cos(ang)[:, None, :] * mscale, np.sin(ang)[:, None, :] * mscale
    if neox:   # pairs (i, i + n_rot/2)
        a, b = x[..., : n_rot // 2].copy(), x[..., n_rot // 2: n_rot].copy()
        x[..., : n_rot // 2], x[..., n_rot // 2: n_rot] = a * cos - b * sin, a * sin + b * cos
    else:      # pairs (2i, 2i+1)
        a, b = x[..., 0:n_rot:2].copy(), x[..., 1:n_rot:2].copy()
        x[..., 0:n_rot:2], x[..., 1:n_rot:2] = a * cos - b * sin, a * sin + b * cos
    return x


def attention(q, k, v, scale, window, sinks=None):
    """Causal grouped-query attention. q [T, H, Dh], k, v [T, Hkv, Dh] -> [T, H, Dh].
    window > 0: token i sees j only if i - j < window. sinks [H]: a raw logit per head that
    joins every softmax with a zero value (it only takes probability away)."""
    T, H, _ = q.shape
    group = H // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)   # [T, H, Dh]
    s = np.einsum("thd,shd->hts", q, k) * scale                      # [H, T, T]
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    visible = (j <= i) & ((window == 0) | (i - j < window))
    s = np.where(visible, s, -np.inf)
    m = s.max(-1, keepdims=True)
    if sinks is not None:
        m = np.maximum(m, sinks[:, None, None])
    p = np.exp(s - m)
    denom = p.sum(-1, keepdims=True)
    if sinks is not None:
        denom += np.exp(sinks[:, None, None] - m)
    return np.einsum("hts,shd->thd", p / denom, v)


def act(x, kind):
    if kind == "silu":
        return x / (1 + np.exp(-x))
    assert kind == "gelu", kind
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))  # gelu (tanh)


def glu(gate, up, kind):
    """act(gate) * up; swiglu_oai: gate clamped above, up clamped both ways, and up + 1."""
    if kind == "swiglu_oai":
        x, y = np.minimum(gate, SWIGLU_OAI_LIMIT), np.clip(up, -SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
        return x / (1 + np.exp(-SWIGLU_OAI_ALPHA * x)) * (y + 1)
    return act(gate, kind) * up


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def scores(logits, cfg, select_bias=None):
    """Router logits [T, E] -> (gating probabilities, the scores that choose) [T, E]."""
    probs = {"softmax": softmax, "sigmoid": lambda z: 1 / (1 + np.exp(-z)),
             "softmax_topk": lambda z: z}[cfg.gating](logits)
    return probs, probs if select_bias is None else probs + select_bias   # the bias only chooses


def route(logits, cfg, select_bias=None):
    """Router logits [T, E] -> (chosen experts [T, A], their weights [T, A])."""
    probs, choose = scores(logits, cfg, select_bias)                  # [T, E]
    if cfg.n_group > 1:   # keep the topk_group groups whose 2 best scores sum highest
        T, E = choose.shape
        g = choose.reshape(T, cfg.n_group, E // cfg.n_group)
        score = np.sort(g, -1)[..., -2:].sum(-1)                     # [T, n_group]
        best = np.argsort(-score, -1, kind="stable")[:, : cfg.topk_group]
        keep = np.zeros(score.shape, bool)
        np.put_along_axis(keep, best, True, -1)
        choose = np.where(keep[..., None], g, -np.inf).reshape(T, E)
    top = np.argsort(-choose, -1, kind="stable")[:, : cfg.n_expert_used]   # [T, A]
    w = np.take_along_axis(probs, top, -1)
    if cfg.gating == "softmax_topk":
        w = softmax(w)
    if cfg.moe_norm_topk:
        w = w / np.maximum(w.sum(-1, keepdims=True), 6.103515625e-5)
    return top, w * cfg.routed_scale


def dense_ffn(h, W, p, kind, suffix=""):
    """h [T, D] -> down(glu(gate h, up h))."""
    g, u = h @ W(p + f"ffn_gate{suffix}.weight").T, h @ W(p + f"ffn_up{suffix}.weight").T
    return glu(g, u, kind) @ W(p + f"ffn_down{suffix}.weight").T


def moe(h, W, B, p, cfg):
    """h [T, D] -> [T, D]: each token through its chosen experts, weighted, plus shared experts.
    B(role): the layer's optional bias (or 0)."""
    logits = h @ W(p + "ffn_gate_inp.weight").T + B("ffn_gate_inp.bias")      # [T, E]
    sel = W(p + "exp_probs_b.bias") if cfg.has("exp_probs_b.bias") else None
    top, wts = route(logits, cfg, sel)
    gate, up, down = (W(p + f"ffn_{n}_exps.weight") for n in ("gate", "up", "down"))
    bg, bu, bd = (B(f"ffn_{n}_exps.bias") for n in ("gate", "up", "down"))  # [E, F] / [E, D] or 0
    if gate is None:          # a shipped ffn_gate_up_exps [E, 2F, D]: gate rows, then up rows
        gu, bgu = W(p + "ffn_gate_up_exps.weight"), B("ffn_gate_up_exps.bias")
        F = gu.shape[1] // 2
        gate, up = gu[:, :F], gu[:, F:]
        if np.ndim(bgu):
            bg, bu = bgu[:, :F], bgu[:, F:]
    pick = lambda b, e: b[e] if np.ndim(b) else 0.0                           # noqa: E731
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        for e, w in zip(top[t], wts[t]):
            y = glu(gate[e] @ h[t] + pick(bg, e), up[e] @ h[t] + pick(bu, e), cfg.flags.glu)
            out[t] += w * (down[e] @ y + pick(bd, e))
    if cfg.n_shared_expert:
        s = dense_ffn(h, W, p, cfg.flags.glu, "_shexp")
        if cfg.has("ffn_gate_inp_shexp.weight"):
            s = s / (1 + np.exp(-(h @ W(p + "ffn_gate_inp_shexp.weight"))))[:, None]
        out += s
    return out


def gqa_attention(h, W, B, p, cfg, pos, il):
    """h [T, D] -> [T, H * Dh]: q, k, v products [+ biases, per-head norms], RoPE, attention."""
    T, H, Hkv, Dh, f, eps = len(h), cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.flags, cfg.norm_eps

    def linear(role, inp):
        return inp @ W(p + role + ".weight").T + B(role + ".bias")
    q = linear("attn_q", h).reshape(T, H, Dh)
    k = linear("attn_k", h).reshape(T, Hkv, Dh)
    v = linear("attn_v", h).reshape(T, Hkv, Dh)
    if cfg.has("attn_q_norm.weight"):
        q = rms_norm(q, W(p + "attn_q_norm.weight"), eps)
        k = rms_norm(k, W(p + "attn_k_norm.weight"), eps)
    freqs = cfg.rope_freqs(il)                    # per layer: local layers may differ
    q, k = (rope(z, pos, freqs, f.rope_neox, cfg.rope_mscale) for z in (q, k))
    k, v = cache_round(k, KV_TYPES[0]), cache_round(v, KV_TYPES[1])
    sinks = W(p + "attn_sinks.weight") if cfg.has("attn_sinks.weight") else None
    return attention(q, k, v, cfg.attn_scale, cfg.layer_window(il), sinks).reshape(T, H * Dh)


def mla_attention(h, W, p, cfg, pos, freqs):
    """Multi-head latent attention, expanded: h [T, D] -> [T, H * Dv].
    Letters: R kv_lora_rank, Dn / Dr the unroped / roped dims of a q or k head, Dv a v head.
    Each token keeps a latent [R] (normed) and a roped key part [Dr] shared by the heads (what
    the cache holds, in f16); head h's key is [k_b[h] latent, k_pe], its value v_b[h] latent."""
    T, H, R, Dn, Dr = len(h), cfg.n_head, cfg.kv_lora_rank, cfg.qk_nope_dim, cfg.n_rot
    eps, neox, ms = cfg.norm_eps, cfg.flags.rope_neox, cfg.rope_mscale
    if cfg.q_lora_rank:         # q through a low-rank bottleneck with its own norm
        q = rms_norm(h @ W(p + "attn_q_a.weight").T, W(p + "attn_q_a_norm.weight"), eps)
        q = q @ W(p + "attn_q_b.weight").T
    else:
        q = h @ W(p + "attn_q.weight").T
    q = q.reshape(T, H, Dn + Dr)
    q = np.concatenate([q[..., :Dn], rope(q[..., Dn:], pos, freqs, neox, ms)], -1)   # [T, H, Dn+Dr]
    kv = h @ W(p + "attn_kv_a_mqa.weight").T                                         # [T, R + Dr]
    latent = rms_norm(kv[:, :R], W(p + "attn_kv_a_norm.weight"), eps)               # [T, R]
    k_pe = rope(kv[:, None, R:], pos, freqs, neox, ms)                              # [T, 1, Dr]
    row = cache_round(np.concatenate([latent, k_pe[:, 0]], -1), KV_TYPES[0])     # the cache's row
    latent, k_pe = row[:, :R], row[:, None, R:]
    k_nope = np.einsum("tr,hrd->thd", latent, W(p + "attn_k_b.weight"))             # [T, H, Dn]
    k = np.concatenate([k_nope, np.repeat(k_pe, H, axis=1)], -1)                     # [T, H, Dn+Dr]
    v = np.einsum("tr,hdr->thd", latent, W(p + "attn_v_b.weight"))                  # [T, H, Dv]
    return attention(q, k, v, cfg.attn_scale, 0).reshape(T, H * cfg.v_head_dim)


def forward(cfg, tensors, tokens):
    """Logits [T, V] (float64) for `tokens` starting at position 0."""
    cache = {}

    def W(name):
        if name not in cache:     # (a merged file has no ffn_gate_exps / ffn_up_exps: None)
            cache[name] = weight(tensors, name) if name in tensors or "_exps." not in name else None
        return cache[name]

    f, eps = cfg.flags, cfg.norm_eps
    T = len(tokens)
    pos = np.arange(T, dtype=np.float64)
    x = W("token_embd.weight")[np.asarray(tokens)]                    # [T, D]
    if f.embed_scale:
        x = x * np.sqrt(cfg.n_embd)
    for il in range(cfg.n_layer):
        p = f"blk.{il}."

        def B(role):                      # the optional bias of `role`, else 0
            return W(p + role) if cfg.has(role) else 0.0

        def linear(role, inp):
            return inp @ W(p + role + ".weight").T + B(role + ".bias")
        h = rms_norm(x, W(p + "attn_norm.weight"), eps)
        if cfg.is_mla:
            a = mla_attention(h, W, p, cfg, pos, cfg.rope_freqs(il))
        else:
            a = gqa_attention(h, W, B, p, cfg, pos, il)
        o = linear("attn_output", a)
        if f.post_norms:
            o = rms_norm(o, W(p + "post_attention_norm.weight"), eps)
        x = x + o
        h = rms_norm(x, W(p + f.ffn_norm + ".weight"), eps)
        y = moe(h, W, B, p, cfg) if cfg.is_moe_layer(il) else dense_ffn(h, W, p, f.glu)
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
