"""The forward pass of every supported architecture, written once as an op graph.

Legend: T tokens in the micro-batch, D model dim, H query heads, Hkv kv heads, Dh head dim,
F FFN width, E experts, A active experts, V vocabulary.
"""
import math

import numpy as np

from nbmoe.errors import NbmoeError
from nbmoe.model.graph import Graph


def build_graph(cfg, n_tokens, n_logits, output_weight, gpu_slots=None):
    """Graph for one micro-batch of `n_tokens`; logits for its last `n_logits` rows.
    gpu_slots[il]: of layer il's chosen experts, how many a GPU computes reading their weights
    from RAM (zero copy, see moe_ffn); None or 0: none."""
    T, D, H, Hkv, Dh = n_tokens, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim
    f, eps = cfg.flags, cfg.norm_eps
    g = Graph(T)
    g.add_node("GET_ROWS", "x", (T, D), ["tokens"], "token_embd.weight")                # [T, D]
    if f.embed_scale:
        g.add_node("SCALE", "x", (T, D), ["x"], s=math.sqrt(D))
    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        # attention: pre-norm, q/k/v projections, RoPE, causal attention over the KV cache
        g.add_node("RMS_NORM", "h", (T, D), ["x"], p + "attn_norm.weight", eps=eps)
        g.add_node("MUL_MAT", "q", (T, H, Dh), ["h"], p + "attn_q.weight")              # [T, H, Dh]
        g.add_node("MUL_MAT", "k", (T, Hkv, Dh), ["h"], p + "attn_k.weight")            # [T, Hkv, Dh]
        g.add_node("MUL_MAT", "v", (T, Hkv, Dh), ["h"], p + "attn_v.weight")
        if f.qk_norm:  # each head normalised on its own
            g.add_node("RMS_NORM", "q", (T, H, Dh), ["q"], p + "attn_q_norm.weight", eps=eps)
            g.add_node("RMS_NORM", "k", (T, Hkv, Dh), ["k"], p + "attn_k_norm.weight", eps=eps)
        base, pos_scale = cfg.layer_rope(il)
        rope = dict(n_rot=cfg.n_rot, base=base, scale=pos_scale, neox=f.rope_neox)
        g.add_node("ROPE", "q", (T, H, Dh), ["q", "pos"], **rope)
        g.add_node("ROPE", "k", (T, Hkv, Dh), ["k", "pos"], **rope)
        g.add_node("ATTN", "attn", (T, H, Dh), ["q", "k", "v", "pos"], layer=il,
                   scale=cfg.attn_scale, window=cfg.layer_window(il))
        g.add_node("MUL_MAT", "o", (T, D), ["attn"], p + "attn_output.weight")           # [T, D]
        if f.post_norms:
            g.add_node("RMS_NORM", "o", (T, D), ["o"], p + "post_attention_norm.weight", eps=eps)
        g.add_node("ADD", "x", (T, D), ["x", "o"])                                       # residual
        # feed-forward: pre-norm, then dense GLU or the MoE block
        g.add_node("RMS_NORM", "h", (T, D), ["x"], p + "ffn_norm.weight", eps=eps)
        if cfg.is_moe:
            moe_ffn(g, cfg, p, T, gpu_slots[il] if gpu_slots else 0)
        else:
            dense_ffn(g, cfg, p, T)
        if f.post_norms:
            g.add_node("RMS_NORM", "ffn_out", (T, D), ["ffn_out"], p + "post_ffw_norm.weight", eps=eps)
        g.add_node("ADD", "x", (T, D), ["x", "ffn_out"])                                 # residual
    # output: final norm of the rows whose logits are wanted, then the vocabulary projection
    if n_logits == 0:
        return g
    g.add_node("RMS_NORM", "out_h", (n_logits, D), ["x"], "output_norm.weight", eps=eps,
               src_rows=(T - n_logits, T))
    g.add_node("MUL_MAT", "logits", (n_logits, cfg.n_vocab), ["out_h"], output_weight)  # [n, V]
    return g


def dense_ffn(g, cfg, p, T):
    F = cfg.n_ff
    g.add_node("MUL_MAT", "ffn_gate", (T, F), ["h"], p + "ffn_gate.weight")              # [T, F]
    g.add_node("MUL_MAT", "ffn_up", (T, F), ["h"], p + "ffn_up.weight")
    g.add_node("GLU", "ffn_gate", (T, F), ["ffn_gate", "ffn_up"], act=cfg.flags.ffn_act)
    g.add_node("MUL_MAT", "ffn_out", (T, cfg.n_embd), ["ffn_gate"], p + "ffn_down.weight")


def moe_ffn(g, cfg, p, T, gpu_slots=0):
    """Router -> softmax -> top-k (-> renormalise) -> GLU experts -> weighted sum.

    gpu_slots = S > 0 (one-token batches, experts in RAM, router on a GPU; no post-FFN norm):
    the chosen experts in slots 0..S-1 are computed by the GPU, which reads their weights from
    RAM over PCIe (zero copy), while the CPU computes slots S..A-1. The GPU's nodes (params
    zero_copy) come first and add their weighted sum to the residual x themselves; the
    scheduler launches them without waiting for them, right after the copies the CPU's share
    needs, and the CPU's sum is added as usual."""
    E, A, F, D = cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, cfg.n_embd
    g.add_node("MUL_MAT", "router", (T, E), ["h"], p + "ffn_gate_inp.weight")            # [T, E]
    g.buffer("expert_ids", (T, A), np.int32)
    g.add_node("TOPK_MOE", "expert_weights", (T, A), ["router"], k=A,                     # [T, A]
               norm=cfg.moe_norm_topk, also_writes=("expert_ids",))
    S = max(0, min(int(gpu_slots), A - 1))
    if S:
        assert not cfg.flags.post_norms, "the GPU's share would skip the post-FFN norm"
        _experts(g, cfg, p, T, "zc_", "zc_out", (0, S), zero_copy=True)
        g.add_node("ADD", "x", (T, D), ["x", "zc_out"], zero_copy=True)
    _experts(g, cfg, p, T, "exp_", "ffn_out", (S, A) if S else None)


def _experts(g, cfg, p, T, name, out, slots, **params):
    """GLU experts and their weighted sum into `out` over the chosen-expert slots lo..hi-1
    (None: all of them)."""
    F, D = cfg.n_ff_exp, cfg.n_embd
    A = cfg.n_expert_used if slots is None else slots[1] - slots[0]
    if slots is not None:             # buffers are shared by the layers: one set per shape
        params["slots"] = slots
        name += f"{slots[0]}-{slots[1]}_"
    gate, up, down = name + "gate", name + "up", name + "down"
    g.add_node("MUL_MAT_ID", gate, (T, A, F), ["h", "expert_ids"], p + "ffn_gate_exps.weight", **params)
    g.add_node("MUL_MAT_ID", up, (T, A, F), ["h", "expert_ids"], p + "ffn_up_exps.weight", **params)
    g.add_node("GLU", gate, (T, A, F), [gate, up], act=cfg.flags.ffn_act, **params)
    g.add_node("MUL_MAT_ID", down, (T, A, D), [gate, "expert_ids"],                       # [T, A, D]
               p + "ffn_down_exps.weight", **params)
    g.add_node("MOE_COMBINE", out, (T, D), [down, "expert_weights"], **params)            # [T, D]


def expected_tensors(cfg, names):
    """(name, ggml ne) of every tensor the forward pass reads; `names` = tensors in the file."""
    D, H, Hkv, Dh, V = cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_vocab
    yield "token_embd.weight", (D, V)
    yield "output_norm.weight", (D,)
    if "output.weight" in names:
        yield "output.weight", (D, V)
    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        yield p + "attn_norm.weight", (D,)
        yield p + "attn_q.weight", (D, H * Dh)
        yield p + "attn_k.weight", (D, Hkv * Dh)
        yield p + "attn_v.weight", (D, Hkv * Dh)
        yield p + "attn_output.weight", (H * Dh, D)
        if cfg.flags.qk_norm:
            yield p + "attn_q_norm.weight", (Dh,)
            yield p + "attn_k_norm.weight", (Dh,)
        if cfg.flags.post_norms:
            yield p + "post_attention_norm.weight", (D,)
            yield p + "post_ffw_norm.weight", (D,)
        yield p + "ffn_norm.weight", (D,)
        if cfg.is_moe:
            E, F = cfg.n_expert, cfg.n_ff_exp
            yield p + "ffn_gate_inp.weight", (D, E)
            yield p + "ffn_gate_exps.weight", (D, F, E)
            yield p + "ffn_up_exps.weight", (D, F, E)
            yield p + "ffn_down_exps.weight", (F, D, E)
        else:
            yield p + "ffn_gate.weight", (D, cfg.n_ff)
            yield p + "ffn_up.weight", (D, cfg.n_ff)
            yield p + "ffn_down.weight", (cfg.n_ff, D)


def check_tensors(cfg, tensors, supported_type):
    """Every tensor the graph needs exists with the right shape and a type we can run."""
    if cfg.is_moe and not 0 < cfg.n_expert_used <= cfg.n_expert:
        raise NbmoeError(f"bad MoE metadata: expert_used_count={cfg.n_expert_used}, "
                         f"expert_count={cfg.n_expert}")
    for name, ne in expected_tensors(cfg, tensors):
        t = tensors.get(name)
        if t is None:
            raise NbmoeError(f"missing tensor {name} (architecture {cfg.arch})")
        if tuple(t.ne) != tuple(ne):
            raise NbmoeError(f"tensor {name} has shape {list(t.ne)}, expected {list(ne)}")
        if not supported_type(t.ggml_type):
            raise NbmoeError(f"tensor {name} has unsupported type {t.type_name}")
