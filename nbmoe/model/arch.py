"""Architectures as data: a family is a row of ArchFlags, a model is a ModelConfig read from GGUF keys.

The one forward pass (forward.py) and the float64 reference (reference.py) read only these
fields; adding a family means adding a row to ARCHITECTURES (and, for a new kind of math, a
field here, a branch in both passes and a kernel). Optional tensors (biases, sinks, the
selection bias) are found in the file: a row says which ones a family may have.
"""
import math
from dataclasses import dataclass, field

import numpy as np

from nbmoe.errors import NbmoeError

GLU_KINDS = ("silu", "gelu", "swiglu_oai")      # act(gate) * up; swiglu_oai: gpt-oss's clamped form
SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0
GATINGS = ("softmax", "sigmoid", "softmax_topk")  # softmax_topk: softmax over the chosen k logits
GGUF_GATING = {1: "softmax", 2: "sigmoid", 3: "softmax_topk"}    # {arch}.expert_gating_func

# Per-layer tensors a family may or may not have, by role (the name after "blk.N.").
OPTIONAL_ROLES = (
    "attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias",
    "attn_q_norm.weight", "attn_k_norm.weight",
    "attn_sinks.weight",                              # per-head logit joining each softmax
    "ffn_gate_inp.bias", "ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias",
    "ffn_gate_up_exps.bias",                          # a shipped merged gate / up's (-muge)
    "exp_probs_b.bias",                               # added to the router's scores to choose only
    "ffn_gate_inp_shexp.weight",                      # sigmoid gate of the shared expert
)


@dataclass(frozen=True)
class ArchFlags:
    rope_neox: bool             # rotate pairs (i, i + n_rot/2) instead of (2i, 2i+1)
    qk_norm: bool               # RMS-norm each q and k head before RoPE (required; else if present)
    moe_norm_topk: bool         # renormalise the top-k router weights (default of expert_weights_norm)
    glu: str = "silu"           # GLU_KINDS
    gating: str = "softmax"     # GATINGS (default of expert_gating_func)
    post_norms: bool = False    # extra RMS norms after attention and after the FFN (gemma3)
    embed_scale: bool = False   # multiply embeddings by sqrt(n_embd) (gemma)
    swa_pattern: int = 0        # every swa_pattern-th layer is global, the others use the
                                # sliding window (gemma3: 5 local, 1 global; gpt-oss: alternate)
    rope_base_swa: float = 0.0  # RoPE base of sliding-window layers (0 = same as global)
    ffn_norm: str = "ffn_norm"  # the FFN's pre-norm tensor role (gpt-oss: post_attention_norm)
    optional: tuple = ()        # OPTIONAL_ROLES this family may have
    skip_nextn: bool = False    # the last nextn_predict_layers blocks are a draft head: not run
    mla: bool = False           # multi-head latent attention (deepseek2): see ModelConfig's MLA fields

    def __post_init__(self):
        assert self.glu in GLU_KINDS and self.gating in GATINGS
        assert set(self.optional) <= set(OPTIONAL_ROLES)


_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias")
ARCHITECTURES = {
    "llama": ArchFlags(rope_neox=False, qk_norm=False, moe_norm_topk=True),
    "qwen3": ArchFlags(rope_neox=True, qk_norm=True, moe_norm_topk=True),
    "qwen3moe": ArchFlags(rope_neox=True, qk_norm=True, moe_norm_topk=True),
    "gemma3": ArchFlags(rope_neox=True, qk_norm=True, moe_norm_topk=False, glu="gelu",
                        post_norms=True, embed_scale=True, swa_pattern=6, rope_base_swa=10000.0),
    "gpt-oss": ArchFlags(rope_neox=True, qk_norm=False, moe_norm_topk=False, glu="swiglu_oai",
                         gating="softmax_topk", swa_pattern=2, ffn_norm="post_attention_norm",
                         optional=_BIASES + ("attn_sinks.weight", "ffn_gate_inp.bias",
                                             "ffn_gate_exps.bias", "ffn_up_exps.bias",
                                             "ffn_gate_up_exps.bias", "ffn_down_exps.bias")),
    # GLM-4.5 / 4.5-Air: q/k/v biases, q/k norms on the 355B only, sigmoid routing with a
    # selection bias, one shared expert, dense leading layers, half the head rotated, and a
    # NextN (MTP) block after the last layer, kept in the file but not run
    "glm4moe": ArchFlags(rope_neox=True, qk_norm=False, moe_norm_topk=False, gating="sigmoid",
                         ffn_norm="post_attention_norm", skip_nextn=True,
                         optional=_BIASES[:3] + ("attn_q_norm.weight", "attn_k_norm.weight",
                                                 "exp_probs_b.bias")),
    "deepseek2": ArchFlags(rope_neox=False, qk_norm=False, moe_norm_topk=False, mla=True,
                           optional=("exp_probs_b.bias",)),
}


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    flags: ArchFlags
    n_layer: int
    n_embd: int                 # D
    n_head: int                 # H
    n_head_kv: int              # Hkv
    head_dim: int               # Dh (keys and values)
    n_ff: int                   # dense FFN width
    n_vocab: int
    n_ctx_train: int
    rope_base: float
    rope_scale: float           # positions are multiplied by this (1 / the scaling factor)
    n_rot: int                  # rotated dims per head (partial RoPE: fewer than head_dim)
    norm_eps: float
    n_expert: int = 0           # E (0 = dense)
    n_expert_used: int = 0      # A
    n_ff_exp: int = 0           # F, width of one expert
    sliding_window: int = 0     # 0 = every layer global
    swa_layers: tuple = ()      # per-layer sliding-window flags from the file (else swa_pattern)
    moe_norm_topk: bool = True
    gating: str = "softmax"     # GATINGS
    routed_scale: float = 1.0   # the chosen experts' weights are multiplied by this
    n_group: int = 0            # experts in n_group groups: choose within the topk_group best
    topk_group: int = 0         #   groups (a group's score: the sum of its 2 best)
    n_leading_dense: int = 0    # the first layers have a dense FFN instead of experts
    n_shared_expert: int = 0    # shared experts (one GLU of width n_ff_shexp) beside the routed ones
    n_ff_shexp: int = 0
    yarn: tuple = ()            # (ext_factor, n_ctx_orig, beta_fast, beta_slow): YaRN RoPE
    rope_mscale: float = 1.0    # cos and sin are multiplied by this (YaRN's attention factor)
    present: frozenset = field(default_factory=frozenset)   # OPTIONAL_ROLES in the file
    n_nextn: int = 0            # blocks after the last layer that are not run (skip_nextn)
    # MLA (deepseek2): keys and values come from a per-token latent of kv_lora_rank values
    # (plus qk_rope_dim = n_rot roped values shared by the heads); head_dim is then the cache's
    # width kv_lora_rank + n_rot (one kv head), a query head has qk_nope_dim + n_rot values
    kv_lora_rank: int = 0       # 0 = no MLA
    q_lora_rank: int = 0        # 0 = q straight from attn_q (V2-Lite)
    qk_nope_dim: int = 0
    v_head_dim: int = 0
    yarn_log_mul: float = 0.0   # YaRN's mscale_all_dim: the kq scale grows by (1 + 0.1 m ln s)^2
    attn_mscale: float = 1.0    #   that factor's square root, as read

    @property
    def is_moe(self):
        return self.n_expert > 0

    def is_moe_layer(self, il):
        return self.n_expert > 0 and il >= self.n_leading_dense

    def runs_tensor(self, name):
        """Is `name` outside the blocks that are not run (a NextN block's tensors)?"""
        if not self.n_nextn or not name.startswith("blk."):
            return True
        return int(name.split(".", 2)[1]) < self.n_layer

    def has(self, role):
        """Does every layer that has this part carry the optional tensor `role`?"""
        return role in self.present or (self.flags.qk_norm and role in ("attn_q_norm.weight",
                                                                          "attn_k_norm.weight"))

    @property
    def is_mla(self):
        return self.kv_lora_rank > 0

    @property
    def attn_scale(self):
        if self.is_mla:     # the expanded key's width, times YaRN's mscale squared
            return self.attn_mscale ** 2 / math.sqrt(self.qk_nope_dim + self.n_rot)
        return 1.0 / math.sqrt(self.head_dim)

    def is_swa(self, il):
        """Does layer il attend through a sliding window?"""
        if not self.sliding_window:
            return False
        if self.swa_layers:
            return bool(self.swa_layers[il])
        p = self.flags.swa_pattern
        return bool(p and il % p < p - 1)

    def layer_window(self, il):
        """Sliding-window size of layer il's attention (0 = sees the whole context)."""
        return self.sliding_window if self.is_swa(il) else 0

    def layer_rope(self, il):
        """(base, position scale) of layer il's RoPE: local layers may have their own base."""
        if self.is_swa(il) and self.flags.rope_base_swa:
            return self.flags.rope_base_swa, 1.0
        return self.rope_base, self.rope_scale

    def rope_freqs(self, il):
        """Layer il's angle per position of each rotated pair i < n_rot / 2 (float64): base^(-2i/n_rot),
        times the position scale; with YaRN, the scaled and unscaled angles are mixed by a ramp
        over i, which keeps high-frequency pairs unscaled."""
        base, scale = self.layer_rope(il)
        theta = base ** (-np.arange(0, self.n_rot, 2, dtype=np.float64) / self.n_rot)
        if not self.yarn or scale == 1.0:
            return theta * scale
        ext, n_ctx_orig, beta_fast, beta_slow = self.yarn

        def corr_dim(n_turns):       # the pair that turns n_turns times over n_ctx_orig positions
            return self.n_rot * math.log(n_ctx_orig / (n_turns * 2 * math.pi)) / (2 * math.log(base))
        lo = max(0.0, math.floor(corr_dim(beta_fast)))
        hi = min(self.n_rot - 1.0, math.ceil(corr_dim(beta_slow)))
        i = np.arange(self.n_rot // 2, dtype=np.float64)
        mix = (1 - np.clip((i - lo) / max(0.001, hi - lo), 0, 1)) * ext
        return theta * scale * (1 - mix) + theta * mix


def _get(meta, key, default=None, required=True):
    if key in meta:
        return meta[key]
    if required and default is None:
        raise NbmoeError(f"GGUF metadata is missing required key {key}")
    return default


def _choice(meta, key, value, allowed):
    if value not in allowed:
        raise NbmoeError(f"unsupported {key} = {value!r}; nbmoe runs {', '.join(map(str, allowed))}")
    return value


def config_from_meta(meta, n_vocab_tensor=None, tensor_names=()):
    """Build the ModelConfig of a GGUF from its metadata dict (and tensor names, for the
    optional tensors)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise NbmoeError(f"unsupported architecture {arch!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
    flags = ARCHITECTURES[arch]
    a = arch + "."
    n_embd = int(_get(meta, a + "embedding_length"))
    n_head = int(_get(meta, a + "attention.head_count"))
    head_dim = int(meta.get(a + "attention.key_length", n_embd // n_head))
    n_vocab = meta.get(a + "vocab_size") or len(meta.get("tokenizer.ggml.tokens", ())) or n_vocab_tensor
    n_layer = int(_get(meta, a + "block_count"))
    n_nextn = int(meta.get(a + "nextn_predict_layers", 0)) if flags.skip_nextn else 0
    if not 0 <= n_nextn < n_layer:
        raise NbmoeError(f"bad {a}nextn_predict_layers = {n_nextn} with {a}block_count = {n_layer}")
    n_layer -= n_nextn
    sections = meta.get(a + "rope.dimension_sections")
    if sections is not None and len(sections) > 1 and min(sections[:2]) > 0:  # multimodal RoPE
        raise NbmoeError(f"unsupported {a}rope.dimension_sections = {list(sections)}; "
                         "nbmoe runs text models with one RoPE section")
    # llama.cpp reads a missing scaling type as linear: a bare factor scales positions
    scaling = _choice(meta, a + "rope.scaling.type", meta.get(a + "rope.scaling.type") or "linear",
                      ("none", "linear", "yarn"))
    factor = float(meta.get(a + "rope.scaling.factor", 1.0) or 1.0)
    yarn, mscale = (), float(meta.get(a + "rope.scaling.attn_factor", 1.0))
    # deepseek2 stores 0.1 * mscale_all_dim (llama.cpp divides it back out)
    log_mul = float(meta.get(a + "rope.scaling.yarn_log_multiplier", 0.0)) / 0.1 if flags.mla else 0.0
    if scaling == "yarn" and factor > 1.0:
        yarn = (float(meta.get(a + "rope.scaling.yarn_ext_factor", 1.0)),
                float(meta.get(a + "rope.scaling.original_context_length",
                               meta.get(a + "context_length", 2048))),
                float(meta.get(a + "rope.scaling.yarn_beta_fast", 32.0)),
                float(meta.get(a + "rope.scaling.yarn_beta_slow", 1.0)))
        if yarn[0] and not log_mul:   # with deepseek2's multiplier cos and sin keep their size
            mscale *= 1.0 + 0.1 * math.log(factor)
    # MLA's kq scale: llama.cpp's attention factor before its YaRN adjustment, times the multiplier's
    log_s = math.log(factor) if scaling in ("linear", "yarn") else 0.0
    attn_mscale = (mscale if yarn and yarn[0] else mscale * (1.0 + 0.1 * log_s)) * (1.0 + 0.1 * log_mul * log_s)
    n_expert = int(meta.get(a + "expert_count", 0))
    gating = meta.get(a + "expert_gating_func")
    gating = (flags.gating if gating is None else
              _choice(meta, a + "expert_gating_func", GGUF_GATING.get(int(gating), int(gating)), GATINGS))
    n_ff_exp = _per_layer_same(meta, a + "expert_feed_forward_length",
                               meta.get(a + "feed_forward_length", 0))
    n_shared = int(meta.get(a + "expert_shared_count", 0))
    swa_layers = meta.get(a + "attention.sliding_window_pattern")
    if isinstance(swa_layers, (list, tuple)):          # one flag per layer
        swa_layers = tuple(bool(v) for v in swa_layers)
    elif swa_layers is not None:                       # a period n: layer il is global if il % n == n-1
        n = int(swa_layers)
        swa_layers = tuple(n == 0 or il % n < n - 1 for il in range(n_layer))
    else:
        swa_layers = ()
    roles = {n.split(".", 2)[2] for n in tensor_names if n.startswith("blk.") and n.count(".") >= 2}
    mla = _mla_fields(meta, a, n_head, head_dim, tensor_names) if flags.mla else {}
    return ModelConfig(
        arch=arch, flags=flags,
        n_layer=n_layer,
        n_embd=n_embd, n_head=n_head,
        n_head_kv=int(meta.get(a + "attention.head_count_kv", n_head)),
        head_dim=head_dim,
        n_ff=int(meta.get(a + "feed_forward_length", 0)),
        n_vocab=int(n_vocab),
        n_ctx_train=int(meta.get(a + "context_length", 2048)),
        rope_base=float(meta.get(a + "rope.freq_base", 10000.0)),
        rope_scale=1.0 / factor if scaling in ("linear", "yarn") else 1.0,
        n_rot=int(meta.get(a + "rope.dimension_count", head_dim)),
        norm_eps=float(meta.get(a + "attention.layer_norm_rms_epsilon", 1e-5)),
        n_expert=n_expert,
        n_expert_used=int(meta.get(a + "expert_used_count", 0)),
        n_ff_exp=n_ff_exp,
        sliding_window=int(meta.get(a + "attention.sliding_window", 0)),
        swa_layers=swa_layers,
        moe_norm_topk=bool(meta.get(a + "expert_weights_norm", flags.moe_norm_topk)),
        gating=gating,
        routed_scale=float(meta.get(a + "expert_weights_scale", 0.0) or 1.0),
        n_group=int(meta.get(a + "expert_group_count", 0)),
        topk_group=int(meta.get(a + "expert_group_used_count", 0)),
        n_leading_dense=int(meta.get(a + "leading_dense_block_count", 0)),
        n_shared_expert=n_shared,
        n_ff_shexp=int(meta.get(a + "expert_shared_feed_forward_length", n_ff_exp * n_shared)),
        yarn=yarn,
        rope_mscale=mscale,
        present=frozenset(r for r in flags.optional if r in roles),
        n_nextn=n_nextn,
        yarn_log_mul=log_mul,
        attn_mscale=attn_mscale,
        **mla,
    )


def _per_layer_same(meta, key, default):
    """A key that may be one value per layer (llama.cpp's get_key_or_arr): nbmoe needs one."""
    v = meta.get(key, default)
    if isinstance(v, (list, tuple)):
        if len(set(v)) != 1:
            raise NbmoeError(f"unsupported {key} = {list(v)}: nbmoe needs one value for every layer")
        v = v[0]
    return int(v)


def _mla_fields(meta, a, n_head, head_dim, tensor_names):
    """The MLA fields of a deepseek2 file, in the layout llama.cpp writes now: split attn_k_b /
    attn_v_b, key_length = kv_lora_rank + rope dims (one kv head), key_length_mla = the expanded
    query / key head (loader/mla.py reads older files as such first)."""
    old = next((n for n in tensor_names if n.endswith(".attn_kv_b.weight")), None)
    if old is not None and not any(n.endswith(".attn_k_b.weight") for n in tensor_names):
        raise NbmoeError(f"unsupported MLA layout: {old} beside split-layout metadata ({a}attention."
                         "key_length_mla); a file has attn_kv_b or attn_k_b / attn_v_b")
    rank = int(_get(meta, a + "attention.kv_lora_rank"))
    k_mla = int(_get(meta, a + "attention.key_length_mla"))
    v_mla = int(_get(meta, a + "attention.value_length_mla"))
    n_rot = int(meta.get(a + "rope.dimension_count", 0))
    n_kv = int(meta.get(a + "attention.head_count_kv", 1))
    v_len = int(meta.get(a + "attention.value_length", rank))
    if n_kv != 1 or head_dim != rank + n_rot or v_len != rank or not 0 < n_rot < k_mla:
        raise NbmoeError(f"unsupported MLA layout: {a}attention.key_length = {head_dim}, value_length "
                         f"= {v_len}, head_count_kv = {n_kv} (nbmoe reads kv_lora_rank + rope dims "
                         f"= {rank} + {n_rot}, kv_lora_rank and 1)")
    return dict(kv_lora_rank=rank, q_lora_rank=int(meta.get(a + "attention.q_lora_rank", 0)),
                qk_nope_dim=k_mla - n_rot, v_head_dim=v_mla)
