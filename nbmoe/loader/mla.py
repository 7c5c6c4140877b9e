"""MLA's expansion matrix blk.N.attn_kv_b, made at load from the layer's attn_k_b and attn_v_b.

Prompt batches take MLA's expanded form (cpu/mla.py, model/forward.py): every cached latent
becomes its per-head key part and value by one product with
    attn_kv_b [H * (Dn + Dv), R]: head h's rows are k_b[h] transposed (Dn rows), then v_b[h] (Dv)
(the layout of the single attn_kv_b that older converters wrote). k_b [H, R, Dn] maps a query
part onto the latent (the absorbed form); its transpose maps a latent onto a key part.
The matrix is F32 where both parts are, else Q8_0 (a product the int8 kernels run), and lives
where the layer's cache does (with attn_kv_a_mqa): attention expands there. It is made on the
first read of its data.
"""
import numpy as np
from gguf import GGMLQuantizationType

from nbmoe.loader.gguf_file import TensorShape

KV_B = "attn_kv_b"
Q8_0_BLOCK, Q8_0_BYTES = 32, 34


class ExpansionTensor(TensorShape):
    """blk.N.attn_kv_b from the layer's k_b and v_b (TensorInfo's fields)."""

    def __init__(self, name, k_b, v_b):
        Dn, R, H = k_b.ne
        Dv = v_b.ne[1]
        self.name, self.k_b, self.v_b = name, k_b, v_b
        f32 = GGMLQuantizationType.F32
        self.ggml_type = f32 if (k_b.ggml_type, v_b.ggml_type) == (f32, f32) else GGMLQuantizationType.Q8_0
        self.ne = (R, H * (Dn + Dv))
        self.offset = None              # not in the file
        row_bytes = 4 * R if self.ggml_type == f32 else R // Q8_0_BLOCK * Q8_0_BYTES
        self.n_bytes = self.ne[1] * row_bytes
        self._data = None

    @property
    def data(self):
        if self._data is None:
            from nbmoe.cpu.kv_rows import store_rows
            from nbmoe.cpu.matmul import dequantize
            k_b = dequantize(self.k_b.data, int(self.k_b.ggml_type))      # [H, R, Dn]
            v_b = dequantize(self.v_b.data, int(self.v_b.ggml_type))      # [H, Dv, R]
            w = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)     # [H, Dn + Dv, R]
            w = np.ascontiguousarray(w.reshape(-1, w.shape[2]), np.float32)
            if self.ggml_type == GGMLQuantizationType.F32:
                self._data = w.view(np.uint8)
            else:
                self._data = np.empty((w.shape[0], self.n_bytes // w.shape[0]), np.uint8)
                store_rows(self._data, w)
            self._data.flags.writeable = False
        return self._data


def add_expansion_weights(cfg, weights, placement):
    """Add each MLA layer's attn_kv_b to weights and placement (both changed in place), placed
    with its attn_kv_a_mqa. A file that ships attn_kv_b is refused earlier (model/arch.py)."""
    if not cfg.is_mla or cfg.kv_lora_rank % Q8_0_BLOCK:
        return
    for il in range(cfg.n_layer):
        k_b, v_b = (f"blk.{il}.attn_{x}_b.weight" for x in "kv")
        name = f"blk.{il}.{KV_B}.weight"
        weights[name] = ExpansionTensor(name, weights[k_b], weights[v_b])
        placement[name] = placement[f"blk.{il}.attn_kv_a_mqa.weight"]
