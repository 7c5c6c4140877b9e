"""The op graph of one micro-batch: nodes over named activation buffers and GGUF weights.

A graph is a flat list of nodes in execution order (a forward pass has no branches worth
reordering). Each node names its op, its output buffer, its input buffers and, for matrix
ops, the GGUF tensor it multiplies by. Buffers are named by role ("q", "ffn_up"...), not
by layer, so every layer reuses the same memory; the residual stream "x" is updated in place.
The scheduler later gives every node a backend and records why.
RMS_NORM, ROPE and MUL_MAT_HEADS may work on a column window of each head (params cols: the
columns of the src heads read, at: the first column of the out heads written; MLA's head parts).
"""
from dataclasses import dataclass, field

import numpy as np

# Op types, in the order `-op` numbers them.
OPS = (
    "GET_ROWS",      # embedding lookup
    "RMS_NORM",      # x / rms(x) * w, per row or per head
    "MUL_MAT",       # x @ W^T
    "MUL_MAT_ID",    # expert product: each token's rows through its chosen experts
    "ROPE",          # rotary position embedding, in place
    "ATTN",          # store k, v in the cache, then causal attention over it
    "ADD",           # a + b
    "SCALE",         # x * s
    "GLU",           # act(gate) * up
    "TOPK_MOE",      # router gating -> top-k -> renormalise, scale
    "MOE_COMBINE",   # weighted sum over the chosen experts
    "ADD_BIAS",      # x + b, b one row
    "ADD_BIAS_ID",   # x[t, a] + b[chosen expert of slot a]
    "SIGMOID_MUL",   # x * sigmoid(g), g one value a row (shared expert's gate)
    "MUL_MAT_HEADS", # out[t, h] = W[h] @ x[t, h]: one matrix per head (MLA's k_b, v_b)
    # act(x @ Wgate[e]^T) * (x @ Wup[e]^T): the experts' gate, up and GLU as one op (-fmoe 1).
    # Its three nodes carry params fused_op; -op and --explain see them as this op.
    "MUL_MAT_ID_GLU",
)
MATRIX_OPS = ("GET_ROWS", "MUL_MAT", "MUL_MAT_ID", "MUL_MAT_HEADS")


@dataclass
class Buffer:
    name: str
    shape: tuple
    dtype: type = np.float32


@dataclass
class Node:
    op: str
    out: str
    srcs: tuple
    weight: str | None = None       # GGUF tensor name
    params: dict = field(default_factory=dict)
    backend: str = "CPU"            # set by the scheduler
    cause: str = ""                 # why it runs there, for --explain

    @property
    def policy_op(self):
        """The op -op and --explain name it by: a fused op's (MUL_MAT_ID_GLU), else its own."""
        return self.params.get("fused_op", self.op)

    @property
    def outs(self):
        """Every buffer the node writes (TOPK_MOE also writes the chosen expert ids)."""
        return (self.out,) + tuple(self.params.get("also_writes", ()))

    def __repr__(self):
        w = f" w={self.weight}" if self.weight else ""
        return f"{self.op}({', '.join(self.srcs)}{w}) -> {self.out} @{self.backend}"


class Graph:
    """Builder and container: `g.mul_mat("h", "blk.0.attn_q.weight", out="q", shape=...)`."""

    def __init__(self, n_tokens, per_row=False):
        self.n_tokens = n_tokens
        self.buffers = {}
        self.nodes = []
        self.inputs = ("tokens", "pos")
        self.buffer("tokens", (n_tokens,), np.int32)
        self.buffer("pos", (n_tokens,), np.int32)
        # per_row: each row is another sequence's next token (several slots decoded as one
        # batch); kv_row[t] is its row in the whole cache, where its key and value go
        self.per_row = per_row
        if per_row:
            self.inputs += ("kv_row",)
            self.buffer("kv_row", (n_tokens,), np.int32)

    def buffer(self, name, shape, dtype=np.float32):
        shape = tuple(int(s) for s in shape)
        old = self.buffers.get(name)
        if old is None:
            self.buffers[name] = Buffer(name, shape, dtype)
        elif old.shape != shape or old.dtype != dtype:
            raise ValueError(f"buffer {name} reused with shape {shape}, had {old.shape}")
        return name

    def add_node(self, op, out, shape, srcs, weight=None, dtype=np.float32, **params):
        assert op in OPS, op
        self.buffer(out, shape, dtype)
        self.nodes.append(Node(op, out, tuple(srcs), weight, params))
        return out
