"""MLA's matrices that a file lacks, made at load from those it has (deepseek2).

Two layouts of a layer's key / value up-projection:
  split (llama.cpp's current files)  attn_k_b [H, R, Dn], attn_v_b [H, Dv, R]; key_length =
                                     R + Dr, one kv head, key_length_mla = Dn + Dr
  kv_b (older files)                 attn_kv_b [H (Dn + Dv), R]: head h's Dn key rows, then
                                     its Dv value rows; key_length = Dn + Dr, H kv heads
The engine reads both parts: decoding absorbs k_b into the query and v_b after attention;
prompt batches take MLA's expanded form (cpu/mla.py), one product of the cached latents with
attn_kv_b, whose key rows are k_b[h] transposed. So a split file gets attn_kv_b made from its
parts (add_expansion_weights), and an older file gets its k_b and v_b made from attn_kv_b and
its metadata read as a split file's (upgrade_kv_b_layout).
A made matrix is Q8_0 where a source is quantized (the int8 kernels' type; a quantized k_b is
quantized a second time, transposed), else F32; computed on the first read of its data.
"""
import numpy as np
from gguf import GGMLQuantizationType

from nbmoe.loader.gguf_file import TensorShape

Q8_0_BLOCK, Q8_0_BYTES = 32, 34
F32, Q8_0 = GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0


class MadeTensor(TensorShape):
    """A matrix made from file tensors (TensorInfo's fields): `make()` returns its float32
    values [..., ne[0]], stored in Q8_0 if a source is quantized and its rows are whole Q8_0
    blocks, else F32."""

    def __init__(self, name, ne, sources, make):
        self.name, self.ne, self.make = name, tuple(ne), make
        whole_blocks = ne[0] % Q8_0_BLOCK == 0
        self.ggml_type = Q8_0 if whole_blocks and any(s.ggml_type != F32 for s in sources) else F32
        self.offset = None              # not in the file
        row_bytes = 4 * ne[0] if self.ggml_type == F32 else ne[0] // Q8_0_BLOCK * Q8_0_BYTES
        self.n_bytes = int(np.prod(ne[1:])) * row_bytes
        self._data = None

    @property
    def data(self):
        if self._data is None:
            from nbmoe.cpu.kv_rows import store_rows
            w = np.ascontiguousarray(self.make(), np.float32)
            rows = w.reshape(-1, self.ne[0])
            if self.ggml_type == F32:
                data = rows.view(np.uint8)
            else:
                data = np.empty((rows.shape[0], self.n_bytes // rows.shape[0]), np.uint8)
                store_rows(data, rows)
            self._data = data.reshape(tuple(reversed(self.ne[1:])) + (data.shape[1],))
            self._data.flags.writeable = False
        return self._data


def _values(t):
    from nbmoe.cpu.matmul import dequantize
    return dequantize(t.data, int(t.ggml_type))


def add_expansion_weights(cfg, weights, placement):
    """Give each MLA layer an attn_kv_b in weights and placement (both changed in place), made
    from k_b and v_b unless the file has it, placed with attn_kv_a_mqa: where the layer's cache
    lives and its attention runs."""
    if not cfg.is_mla:
        return
    for il in range(cfg.n_layer):
        name = f"blk.{il}.attn_kv_b.weight"
        if name not in weights:
            k_b, v_b = (weights[f"blk.{il}.attn_{x}_b.weight"] for x in "kv")
            Dn, R, H = k_b.ne
            make = (lambda k_b=k_b, v_b=v_b: np.concatenate(                     # [H, Dn + Dv, R]
                [_values(k_b).transpose(0, 2, 1), _values(v_b)], axis=1))
            weights[name] = MadeTensor(name, (R, H * (Dn + v_b.ne[1])), (k_b, v_b), make)
        placement[name] = placement[f"blk.{il}.attn_kv_a_mqa.weight"]


def upgrade_kv_b_layout(meta, tensors):
    """An older deepseek2 file (one attn_kv_b a layer): add its layers' attn_k_b and attn_v_b
    to tensors and rewrite meta's attention lengths as a split file has them (both changed
    in place). Other files are left as they are."""
    a = meta.get("general.architecture", "") + "."
    kv_bs = [n for n in tensors if n.endswith(".attn_kv_b.weight")]
    if a != "deepseek2." or not kv_bs or any(n.endswith(".attn_k_b.weight") for n in tensors):
        return
    R = int(meta[a + "attention.kv_lora_rank"])
    Dr = int(meta.get(a + "rope.dimension_count", 0))
    H = int(meta[a + "attention.head_count"])
    Dk, Dv = int(meta[a + "attention.key_length"]), int(meta[a + "attention.value_length"])
    Dn = Dk - Dr
    for name in kv_bs:
        kv_b, p = tensors[name], name[:-len("attn_kv_b.weight")]
        heads = (lambda kv_b=kv_b: _values(kv_b).reshape(H, Dn + Dv, R))
        tensors[p + "attn_k_b.weight"] = MadeTensor(p + "attn_k_b.weight", (Dn, R, H), (kv_b,),
                                                    lambda h=heads: h()[:, :Dn].transpose(0, 2, 1))
        tensors[p + "attn_v_b.weight"] = MadeTensor(p + "attn_v_b.weight", (R, Dv, H), (kv_b,),
                                                    lambda h=heads: h()[:, Dn:])
    meta.update({a + "attention.key_length_mla": Dk, a + "attention.value_length_mla": Dv,
                 a + "attention.key_length": R + Dr, a + "attention.value_length": R,
                 a + "attention.head_count_kv": 1})
