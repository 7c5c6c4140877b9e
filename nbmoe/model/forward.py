"""The forward pass of every supported architecture, written once as an op graph.

Legend: T tokens in the micro-batch, D model dim, H query heads, Hkv kv heads, Dh head dim,
F FFN width, E experts, A active experts, V vocabulary; MLA: R kv_lora_rank, Rq q_lora_rank,
Dn / Dr the unroped / roped dims of a query head, Dv a value head.
"""
import math

import numpy as np

from nbmoe.errors import NbmoeError
from nbmoe.model.graph import Graph


def build_graph(cfg, n_tokens, n_logits, output_weight, fused_moe=True, merged=frozenset(),
                per_row=False, mla_expand=False):
    """Graph for one micro-batch of `n_tokens`; logits for its last `n_logits` rows.
    fused_moe (-fmoe): the experts' gate, up and GLU form one op, MUL_MAT_ID_GLU (moe_ffn).
    merged: the layers whose gate and up experts are one tensor, ffn_gate_up_exps (-muge).
    per_row: each row is the next token of its own sequence (Graph's kv_row); attention
    reads the row's sequence only. mla_expand: MLA attends in the expanded form (prompts)."""
    T, D = n_tokens, cfg.n_embd
    f, eps = cfg.flags, cfg.norm_eps
    g = Graph(T, per_row)
    g.add_node("GET_ROWS", "x", (T, D), ["tokens"], "token_embd.weight")                # [T, D]
    if f.embed_scale:
        g.add_node("SCALE", "x", (T, D), ["x"], s=math.sqrt(D))
    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        if cfg.is_mla:
            mla_attention(g, cfg, p, il, T, mla_expand)
        else:
            attention(g, cfg, p, il, T)
        # feed-forward: pre-norm, then dense GLU or the MoE block
        g.add_node("RMS_NORM", "h", (T, D), ["x"], p + f.ffn_norm + ".weight", eps=eps)
        if cfg.is_moe_layer(il):
            moe_ffn(g, cfg, p, T, fused_moe, il in merged)
        else:
            dense_ffn(g, cfg, p, T, cfg.n_ff, "", "ffn_out")
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


def _linear(g, cfg, p, role, out, shape, src):
    """out = src @ W^T (+ b where the file has blk.N.<role>.bias)."""
    g.add_node("MUL_MAT", out, shape, [src], p + role + ".weight")
    if cfg.has(role + ".bias"):
        g.add_node("ADD_BIAS", out, shape, [out], p + role + ".bias")


def _kv_rows(g):
    """ATTN's extra input in a per-row graph: each row's cache row (its sequence's start there
    is kv_row - pos)."""
    return ["kv_row"] if g.per_row else []


def attention(g, cfg, p, il, T):
    """x += o(attn(rope(norm(q)), rope(norm(k)), v)), q, k, v = attn_norm(x) @ Wq, Wk, Wv."""
    D, H, Hkv, Dh, f, eps = cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.flags, cfg.norm_eps
    g.add_node("RMS_NORM", "h", (T, D), ["x"], p + "attn_norm.weight", eps=eps)
    _linear(g, cfg, p, "attn_q", "q", (T, H, Dh), "h")                                  # [T, H, Dh]
    _linear(g, cfg, p, "attn_k", "k", (T, Hkv, Dh), "h")                                # [T, Hkv, Dh]
    _linear(g, cfg, p, "attn_v", "v", (T, Hkv, Dh), "h")
    if cfg.has("attn_q_norm.weight"):  # each head normalised on its own
        g.add_node("RMS_NORM", "q", (T, H, Dh), ["q"], p + "attn_q_norm.weight", eps=eps)
        g.add_node("RMS_NORM", "k", (T, Hkv, Dh), ["k"], p + "attn_k_norm.weight", eps=eps)
    rope = dict(n_rot=cfg.n_rot, freqs=cfg.rope_freqs(il), mscale=cfg.rope_mscale, neox=f.rope_neox)
    g.add_node("ROPE", "q", (T, H, Dh), ["q", "pos"], **rope)
    g.add_node("ROPE", "k", (T, Hkv, Dh), ["k", "pos"], **rope)
    sinks = p + "attn_sinks.weight" if cfg.has("attn_sinks.weight") else None
    g.add_node("ATTN", "attn", (T, H, Dh), ["q", "k", "v", "pos"] + _kv_rows(g), layer=il,
               scale=cfg.attn_scale, window=cfg.layer_window(il), sinks=sinks)
    _linear(g, cfg, p, "attn_output", "o", (T, D), "attn")                             # [T, D]
    if f.post_norms:
        g.add_node("RMS_NORM", "o", (T, D), ["o"], p + "post_attention_norm.weight", eps=eps)
    g.add_node("ADD", "x", (T, D), ["x", "o"])                                          # residual


def mla_attention(g, cfg, p, il, T, expand=False):
    """x += o(v_b(attn(q', kv))): multi-head latent attention with k_b absorbed into the query.
    A token's key is its normed latent [R] and a roped part [Dr], one kv head that the cache
    keeps (KVCache, R + Dr per token); head h's query is [q_nope_h @ k_b[h], rope(q_pe_h)], so
    q' . key = q_h . [k_b[h] latent, k_pe]. The same rows serve as values: the first R columns
    of the output (sum_j p_j latent_j) go through v_b[h]; its last Dr are not used.
    The head parts are column windows of one buffer (params cols: the columns of each src head
    an op reads, at: the first column of each out head it writes), so no op copies them.
    expand (prompt batches): ATTN gives every cached token its head's key [k_b[h]^T latent,
    k_pe] and value v_b[h] latent (params expand: loader/mla.py's attn_kv_b) and attends with
    the plain q [q_nope, rope(q_pe)]: Dn + Dr and Dv products a key, not R + Dr and R."""
    D, H, R, Dn, Dr, eps = cfg.n_embd, cfg.n_head, cfg.kv_lora_rank, cfg.qk_nope_dim, cfg.n_rot, cfg.norm_eps
    Dv, K = cfg.v_head_dim, cfg.kv_lora_rank + cfg.n_rot
    rope = dict(n_rot=Dr, freqs=cfg.rope_freqs(il), mscale=cfg.rope_mscale, neox=cfg.flags.rope_neox)
    g.add_node("RMS_NORM", "h", (T, D), ["x"], p + "attn_norm.weight", eps=eps)
    # q's first product and the token's cache row [latent, k_pe], both of h (one fused launch)
    if cfg.q_lora_rank:          # q through a low-rank bottleneck with its own norm
        g.add_node("MUL_MAT", "q_a", (T, cfg.q_lora_rank), ["h"], p + "attn_q_a.weight")
    else:
        g.add_node("MUL_MAT", "q", (T, H, Dn + Dr), ["h"], p + "attn_q.weight")          # [T, H, Dn+Dr]
    g.add_node("MUL_MAT", "kv", (T, 1, K), ["h"], p + "attn_kv_a_mqa.weight")            # [T, 1, R+Dr]
    if cfg.q_lora_rank:
        g.add_node("RMS_NORM", "q_a", (T, cfg.q_lora_rank), ["q_a"], p + "attn_q_a_norm.weight", eps=eps)
        g.add_node("MUL_MAT", "q", (T, H, Dn + Dr), ["q_a"], p + "attn_q_b.weight")      # [T, H, Dn+Dr]
    if expand:                   # q = [q_nope, rope(q_pe)], in place                      [T, H, Dn+Dr]
        g.add_node("ROPE", "q", (T, H, Dn + Dr), ["q", "pos"], **rope, cols=(Dn, Dn + Dr), at=Dn)
    else:                        # q' = [q_nope @ k_b, rope(q_pe)]                          [T, H, R+Dr]
        g.add_node("MUL_MAT_HEADS", "q_mla", (T, H, K), ["q"], p + "attn_k_b.weight", cols=(0, Dn), at=0)
        g.add_node("ROPE", "q_mla", (T, H, K), ["q", "pos", "q_mla"], **rope, cols=(Dn, Dn + Dr), at=R)
    # the token's cache row: [norm(latent), rope(k_pe)], in place
    g.add_node("RMS_NORM", "kv", (T, 1, K), ["kv"], p + "attn_kv_a_norm.weight", eps=eps, cols=(0, R), at=0)
    g.add_node("ROPE", "kv", (T, 1, K), ["kv", "pos"], **rope, cols=(R, K), at=R)
    if expand:                   # attention with each head's own keys and values           [T, H, Dv]
        g.add_node("ATTN", "attn_v", (T, H, Dv), ["q", "kv", "kv", "pos"], layer=il,
                   scale=cfg.attn_scale, window=0, sinks=None, expand=p + "attn_kv_b.weight")
    else:
        g.add_node("ATTN", "attn", (T, H, K), ["q_mla", "kv", "kv", "pos"] + _kv_rows(g), layer=il,
                   scale=cfg.attn_scale, window=0, sinks=None)
        g.add_node("MUL_MAT_HEADS", "attn_v", (T, H, Dv), ["attn"], p + "attn_v_b.weight",  # [T, H, Dv]
                   cols=(0, R), at=0)
    g.add_node("MUL_MAT", "o", (T, D), ["attn_v"], p + "attn_output.weight")             # [T, D]
    g.add_node("ADD", "x", (T, D), ["x", "o"])                                          # residual


def dense_ffn(g, cfg, p, T, F, suffix, out):
    """out = act(h @ Wg^T) * (h @ Wu^T) @ Wd^T over the tensors ffn_{gate,up,down}<suffix>."""
    gate = "ffn_gate" + suffix
    g.add_node("MUL_MAT", gate, (T, F), ["h"], p + f"ffn_gate{suffix}.weight")          # [T, F]
    g.add_node("MUL_MAT", "ffn_up" + suffix, (T, F), ["h"], p + f"ffn_up{suffix}.weight")
    g.add_node("GLU", gate, (T, F), [gate, "ffn_up" + suffix], act=cfg.flags.glu)
    g.add_node("MUL_MAT", out, (T, cfg.n_embd), [gate], p + f"ffn_down{suffix}.weight")


def moe_ffn(g, cfg, p, T, fused=True, merged=False):
    """Router -> gating -> top-k (-> renormalise, scale) -> GLU experts -> weighted sum
    [+ shared experts]. fused: the gate, up and GLU nodes are marked as one op,
    MUL_MAT_ID_GLU (params fused_op), which the backends bind as one fused kernel where they
    have it (fusion.py), the experts' biases (ADD_BIAS_ID after both products) included.
    merged (-muge, or a file that ships ffn_gate_up_exps): one product [T, A, 2F] makes each
    expert's gate and up halves, and the GLU reads the two halves of it."""
    E, A, D, F = cfg.n_expert, cfg.n_expert_used, cfg.n_embd, cfg.n_ff_exp
    _linear(g, cfg, p, "ffn_gate_inp", "router", (T, E), "h")                          # [T, E]
    g.buffer("expert_ids", (T, A), np.int32)
    select_bias = p + "exp_probs_b.bias" if cfg.has("exp_probs_b.bias") else None
    g.add_node("TOPK_MOE", "expert_weights", (T, A), ["router"], select_bias, k=A,     # [T, A]
               norm=cfg.moe_norm_topk, gating=cfg.gating, scale=cfg.routed_scale,
               groups=(cfg.n_group, cfg.topk_group), also_writes=("expert_ids",))

    def product(role, buf, shape, src):
        g.add_node("MUL_MAT_ID", buf, shape, [src, "expert_ids"], p + role + ".weight")
        return g.nodes[-1]

    def bias(role, buf, shape, has):    # out[t, a] += b[expert of slot a]
        if has:
            g.add_node("ADD_BIAS_ID", buf, shape, [buf, "expert_ids"], p + role + ".bias")
    if merged:
        glu = [product("ffn_gate_up_exps", "exp_gate_up", (T, A, 2 * F), "h")]          # [T, A, 2F]
        bias("ffn_gate_up_exps", "exp_gate_up", (T, A, 2 * F), any(
            cfg.has(r + ".bias") for r in ("ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps")))
        g.add_node("GLU", "exp_gate", (T, A, F), ["exp_gate_up"], act=cfg.flags.glu)  # [T, A, F]
        glu.append(g.nodes[-1])
    else:
        glu = [product("ffn_gate_exps", "exp_gate", (T, A, F), "h"),                  # [T, A, F]
               product("ffn_up_exps", "exp_up", (T, A, F), "h")]
        bias("ffn_gate_exps", "exp_gate", (T, A, F), cfg.has("ffn_gate_exps.bias"))
        bias("ffn_up_exps", "exp_up", (T, A, F), cfg.has("ffn_up_exps.bias"))
        g.add_node("GLU", "exp_gate", (T, A, F), ["exp_gate", "exp_up"], act=cfg.flags.glu)
        glu.append(g.nodes[-1])
    if fused:
        for n in glu:
            n.params["fused_op"] = "MUL_MAT_ID_GLU"
    product("ffn_down_exps", "exp_down", (T, A, D), "exp_gate")                         # [T, A, D]
    bias("ffn_down_exps", "exp_down", (T, A, D), cfg.has("ffn_down_exps.bias"))
    g.add_node("MOE_COMBINE", "ffn_out", (T, D), ["exp_down", "expert_weights"])         # [T, D]
    if cfg.n_shared_expert:
        dense_ffn(g, cfg, p, T, cfg.n_ff_shexp, "_shexp", "shexp_out")
        if cfg.has("ffn_gate_inp_shexp.weight"):          # out *= sigmoid(h @ w)
            g.add_node("MUL_MAT", "shexp_gate", (T, 1), ["h"], p + "ffn_gate_inp_shexp.weight")
            g.add_node("SIGMOID_MUL", "shexp_out", (T, D), ["shexp_out", "shexp_gate"])
        g.add_node("ADD", "ffn_out", (T, D), ["ffn_out", "shexp_out"])


def expected_tensors(cfg, names):
    """(name, ggml ne) of every tensor the forward pass reads; `names` = tensors in the file."""
    D, V = cfg.n_embd, cfg.n_vocab
    yield "token_embd.weight", (D, V)
    yield "output_norm.weight", (D,)
    if "output.weight" in names:
        yield "output.weight", (D, V)
    for il in range(cfg.n_layer):
        p = f"blk.{il}."

        def linear(role, ne):
            yield p + role + ".weight", ne
            if cfg.has(role + ".bias"):
                yield p + role + ".bias", ne[1:]
        yield p + "attn_norm.weight", (D,)
        if cfg.is_mla:
            yield from _mla_tensors(cfg, p)
        else:
            yield from _gqa_tensors(cfg, p, linear)
        if cfg.flags.post_norms:
            yield p + "post_attention_norm.weight", (D,)
            yield p + "post_ffw_norm.weight", (D,)
        yield p + cfg.flags.ffn_norm + ".weight", (D,)
        if cfg.is_moe_layer(il):
            E, F = cfg.n_expert, cfg.n_ff_exp
            yield from linear("ffn_gate_inp", (D, E))
            if cfg.has("exp_probs_b.bias"):
                yield p + "exp_probs_b.bias", (E,)
            if p + "ffn_gate_up_exps.weight" in names:     # shipped merged (llama.cpp's layout)
                yield from linear("ffn_gate_up_exps", (D, 2 * F, E))
            else:
                yield from linear("ffn_gate_exps", (D, F, E))
                yield from linear("ffn_up_exps", (D, F, E))
            yield from linear("ffn_down_exps", (F, D, E))
            if cfg.n_shared_expert:
                Fs = cfg.n_ff_shexp
                yield from ((p + f"ffn_{k}_shexp.weight", ne) for k, ne in
                            (("gate", (D, Fs)), ("up", (D, Fs)), ("down", (Fs, D))))
                if cfg.has("ffn_gate_inp_shexp.weight"):
                    yield p + "ffn_gate_inp_shexp.weight", (D,)
        else:
            yield p + "ffn_gate.weight", (D, cfg.n_ff)
            yield p + "ffn_up.weight", (D, cfg.n_ff)
            yield p + "ffn_down.weight", (cfg.n_ff, D)


def _gqa_tensors(cfg, p, linear):
    D, H, Hkv, Dh = cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim
    yield from linear("attn_q", (D, H * Dh))
    yield from linear("attn_k", (D, Hkv * Dh))
    yield from linear("attn_v", (D, Hkv * Dh))
    yield from linear("attn_output", (H * Dh, D))
    if cfg.has("attn_q_norm.weight"):
        yield p + "attn_q_norm.weight", (Dh,)
        yield p + "attn_k_norm.weight", (Dh,)
    if cfg.has("attn_sinks.weight"):
        yield p + "attn_sinks.weight", (H,)


def _mla_tensors(cfg, p):
    D, H, R, Rq, Dn, Dr, Dv = (cfg.n_embd, cfg.n_head, cfg.kv_lora_rank, cfg.q_lora_rank,
                               cfg.qk_nope_dim, cfg.n_rot, cfg.v_head_dim)
    if Rq:
        yield from ((p + "attn_q_a.weight", (D, Rq)), (p + "attn_q_a_norm.weight", (Rq,)),
                    (p + "attn_q_b.weight", (Rq, H * (Dn + Dr))))
    else:
        yield p + "attn_q.weight", (D, H * (Dn + Dr))
    yield from ((p + "attn_kv_a_mqa.weight", (D, R + Dr)), (p + "attn_kv_a_norm.weight", (R,)),
                (p + "attn_k_b.weight", (Dn, R, H)), (p + "attn_v_b.weight", (R, Dv, H)),
                (p + "attn_output.weight", (H * Dv, D)))


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
