"""tools/make_model.py --router-skew S: a router that almost never chooses a share S of each
MoE layer's experts, as trained routers send most tokens to some experts and few to others.

A random router spreads the tokens over all experts; to skew it, the rare experts (drawn per
layer) get scores far below the others', by the first of these the architecture has:
  select    a selection bias (exp_probs_b: glm4moe, DeepSeek-V3): minus SELECT_PULL, against
            sigmoid scores in 0..1; it moves the choice only, not the weights
  logit     a router bias (ffn_gate_inp.bias: gpt-oss): minus LOGIT_PULL on their logits
  residual  neither (qwen3moe, Mixtral, DeepSeek-V2-Lite): dimension 0 of the residual stream
            holds RESIDUAL_CONST for every token (the embedding's column 0; every matrix that
            adds to the stream gets a zero row 0), so the normed h that the router reads is
            positive there, and the rare experts' router rows weigh it by -ROW_PULL
"""
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

SELECT_PULL = 10.0
LOGIT_PULL = 30.0
RESIDUAL_CONST = 2.0
ROW_PULL = 32.0
# the matrices whose products are added to the residual stream
RESIDUAL_WRITERS = ("attn_output.weight", "ffn_down.weight", "ffn_down_exps.weight",
                    "ffn_down_shexp.weight")
EMBED_POOL = 1024        # distinct first blocks of the embedding's rows


class RouterSkew:
    def __init__(self, share, n_expert, n_used, shapes, seed, quantizers):
        """shapes: {tensor name: numpy shape} of the file; quantizers: make_model.QUANTIZERS."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"router skew must be between 0 and 1, got {share}")
        if not n_expert:
            raise ValueError("router skew needs a MoE model (n_expert > 0)")
        self.n_expert, self.quantizers, self.shapes = n_expert, quantizers, shapes
        self.n_rare = min(round(share * n_expert), n_expert - n_used)   # A experts stay choosable
        self.rng, self.rare = np.random.default_rng(seed + 7919), {}
        names = set(shapes)
        self.mode = ("select" if any(n.endswith("exp_probs_b.bias") for n in names) else
                     "logit" if any(n.endswith("ffn_gate_inp.bias") for n in names) else "residual")

    def rare_experts(self, layer):
        """The layer's rare experts (drawn on first use, in file order: the same bytes each run)."""
        if layer not in self.rare:
            self.rare[layer] = np.sort(self.rng.choice(self.n_expert, self.n_rare, replace=False))
        return self.rare[layer]

    def apply(self, name, data, type_name):
        """The tensor's data (floats, or quantized blocks [n, type size]) with the skew in."""
        parts = name.split(".", 2)
        role = parts[2] if parts[0] == "blk" else name
        rare = lambda: self.rare_experts(int(parts[1]))            # noqa: E731
        if self.mode == "select" and role == "exp_probs_b.bias":
            data[rare()] -= SELECT_PULL
        elif self.mode == "logit" and role == "ffn_gate_inp.bias":
            data[rare()] -= LOGIT_PULL
        elif self.mode == "residual":
            if role == "ffn_gate_inp.weight":                          # [E, D] F32
                data[rare(), 0] = -ROW_PULL
            elif role in RESIDUAL_WRITERS:
                self._blocks(data, type_name, name)[..., 0, :, :] = 0   # output row 0: zero
            elif name == "token_embd.weight":
                self._blocks(data, type_name, name)[0, :, 0, :] = self._first_blocks(
                    data, type_name)
        return data

    def _blocks(self, data, type_name, name):
        """data as [1 or E, rows, blocks per row, type size] (all-zero bytes decode to 0 in
        every ggml type: each block's scale is 0)."""
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
        rows, K = self.shapes[name][-2], self.shapes[name][-1]
        return data.reshape(-1, rows, K // block, size)

    def _first_blocks(self, data, type_name):
        """A first block for each embedding row: N(0, 1/sqrt(D)) values, the first RESIDUAL_CONST."""
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
        V, D = self.shapes["token_embd.weight"]
        x = (self.rng.standard_normal((EMBED_POOL, block)) / np.sqrt(D)).astype(np.float32)
        x[:, 0] = RESIDUAL_CONST
        pool = np.ascontiguousarray(self.quantizers[type_name](x)).view(np.uint8).reshape(EMBED_POOL, size)
        return pool[self.rng.integers(0, EMBED_POOL, V)]
