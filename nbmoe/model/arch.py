"""Architectures as data: one frozen config per model, filled from GGUF keys.

An architecture is a set of flags read by the one shared forward pass (forward.py) and the
float64 reference (reference.py); adding one means adding a row to ARCHITECTURES.
"""
import math
from dataclasses import dataclass

from nbmoe.errors import NbmoeError


@dataclass(frozen=True)
class ArchFlags:
    rope_neox: bool             # rotate pairs (i, i + n_rot/2) instead of (2i, 2i+1)
    qk_norm: bool               # RMS-norm each q and k head before RoPE (qwen3, gemma3)
    moe_norm_topk: bool         # renormalise the top-k router weights to sum to 1
    ffn_act: str = "silu"       # gate activation of the GLU feed-forward: silu | gelu
    post_norms: bool = False    # extra RMS norms after attention and after the FFN (gemma3)
    embed_scale: bool = False   # multiply embeddings by sqrt(n_embd) (gemma)
    swa_pattern: int = 0        # every swa_pattern-th layer is global, the others use the
                                # sliding window (gemma3: 5 local, 1 global)
    rope_base_swa: float = 0.0  # RoPE base of sliding-window layers (0 = same as global)


ARCHITECTURES = {
    "llama": ArchFlags(rope_neox=False, qk_norm=False, moe_norm_topk=True),
    "qwen3": ArchFlags(rope_neox=True, qk_norm=True, moe_norm_topk=True),
    "qwen3moe": ArchFlags(rope_neox=True, qk_norm=True, moe_norm_topk=True),
    "gemma3": ArchFlags(rope_neox=True, qk_norm=True, moe_norm_topk=False, ffn_act="gelu",
                        post_norms=True, embed_scale=True, swa_pattern=6, rope_base_swa=10000.0),
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
    rope_scale: float           # positions are multiplied by this (1 / linear scaling factor)
    n_rot: int                  # rotated dims per head
    norm_eps: float
    n_expert: int = 0           # E (0 = dense)
    n_expert_used: int = 0      # A
    n_ff_exp: int = 0           # F, width of one expert
    sliding_window: int = 0     # 0 = every layer global
    moe_norm_topk: bool = True

    @property
    def is_moe(self):
        return self.n_expert > 0

    @property
    def attn_scale(self):
        return 1.0 / math.sqrt(self.head_dim)

    def is_swa(self, il):
        """Does layer il attend through a sliding window?"""
        p = self.flags.swa_pattern
        return bool(p and self.sliding_window and il % p < p - 1)

    def layer_window(self, il):
        """Sliding-window size of layer il's attention (0 = sees the whole context)."""
        return self.sliding_window if self.is_swa(il) else 0

    def layer_rope(self, il):
        """(base, position scale) of layer il's RoPE: local layers have their own base."""
        if self.is_swa(il) and self.flags.rope_base_swa:
            return self.flags.rope_base_swa, 1.0
        return self.rope_base, self.rope_scale


def _get(meta, key, default=None, required=True):
    if key in meta:
        return meta[key]
    if required and default is None:
        raise NbmoeError(f"GGUF metadata is missing required key {key}")
    return default


def config_from_meta(meta, n_vocab_tensor=None):
    """Build the ModelConfig of a GGUF from its metadata dict."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise NbmoeError(f"unsupported architecture {arch!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
    flags = ARCHITECTURES[arch]
    a = arch + "."
    n_embd = int(_get(meta, a + "embedding_length"))
    n_head = int(_get(meta, a + "attention.head_count"))
    head_dim = int(meta.get(a + "attention.key_length", n_embd // n_head))
    n_vocab = meta.get(a + "vocab_size") or len(meta.get("tokenizer.ggml.tokens", ())) or n_vocab_tensor
    scaling = meta.get(a + "rope.scaling.type", "none")
    factor = float(meta.get(a + "rope.scaling.factor", 1.0) or 1.0)
    n_expert = int(meta.get(a + "expert_count", 0))
    return ModelConfig(
        arch=arch, flags=flags,
        n_layer=int(_get(meta, a + "block_count")),
        n_embd=n_embd, n_head=n_head,
        n_head_kv=int(meta.get(a + "attention.head_count_kv", n_head)),
        head_dim=head_dim,
        n_ff=int(meta.get(a + "feed_forward_length", 0)),
        n_vocab=int(n_vocab),
        n_ctx_train=int(meta.get(a + "context_length", 2048)),
        rope_base=float(meta.get(a + "rope.freq_base", 10000.0)),
        rope_scale=1.0 / factor if scaling == "linear" else 1.0,
        n_rot=int(meta.get(a + "rope.dimension_count", head_dim)),
        norm_eps=float(meta.get(a + "attention.layer_norm_rms_epsilon", 1e-5)),
        n_expert=n_expert,
        n_expert_used=int(meta.get(a + "expert_used_count", 0)),
        n_ff_exp=int(meta.get(a + "expert_feed_forward_length", meta.get(a + "feed_forward_length", 0))),
        sliding_window=int(meta.get(a + "attention.sliding_window", 0)),
        moe_norm_topk=bool(meta.get(a + "expert_weights_norm", flags.moe_norm_topk)),
    )
