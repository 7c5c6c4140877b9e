"""The CPU backend: a table from op type to a binder that turns a graph node into a call.

Binding happens once per graph: every array view (reshapes, row slices, weight views) is
made then, so running a node is one Python call into a compiled kernel with positional
arguments. Per-token state that changes between runs (the cache position) is read from
`state` at call time.
"""
import numpy as np
from gguf import GGMLQuantizationType

from .cpu import attention, matmul, moe, ops


def _rows2d(a):
    return a.reshape(a.shape[0], -1)


def _vector_f32(info):
    """A 1-D weight (norm) as float32, whatever its stored type."""
    if info.ggml_type == GGMLQuantizationType.F32:
        return info.data.view(np.float32).reshape(-1)
    return matmul.dequantize(info.data.reshape(1, -1), int(info.ggml_type)).reshape(-1)


def bind_get_rows(node, buf, weights, state):
    w = weights[node.weight]
    out, ids, data, qtype = buf[node.out], buf[node.srcs[0]], w.data, int(w.ggml_type)
    return lambda: matmul.get_rows(out, data, ids, qtype)


def bind_rms_norm(node, buf, weights, state):
    w = _vector_f32(weights[node.weight])
    n = w.shape[0]
    x = buf[node.srcs[0]]
    if "src_rows" in node.params:
        lo, hi = node.params["src_rows"]
        x = x[lo:hi]
    x, out, eps = x.reshape(-1, n), buf[node.out].reshape(-1, n), node.params["eps"]
    return lambda: ops.rms_norm(out, x, w, eps)


def bind_mul_mat(node, buf, weights, state):
    w = weights[node.weight]
    out, x = _rows2d(buf[node.out]), _rows2d(buf[node.srcs[0]])
    data, qtype = w.data.reshape(w.data.shape[0], -1) if w.data.ndim > 2 else w.data, int(w.ggml_type)
    if data.ndim == 1:
        data = data.reshape(1, -1)
    return lambda: matmul.mul_mat(out, data, x, qtype)


def bind_mul_mat_id(node, buf, weights, state):
    w = weights[node.weight]
    out, x, ids = buf[node.out], buf[node.srcs[0]], buf[node.srcs[1]]
    if x.ndim == 2:
        x = x.reshape(x.shape[0], 1, x.shape[1])   # one input row shared by all chosen experts
    data, qtype = w.data, int(w.ggml_type)
    return lambda: matmul.mul_mat_id(out, data, x, ids, qtype)


def bind_rope(node, buf, weights, state):
    x, pos, p = buf[node.out], buf[node.srcs[1]], node.params
    n_rot, base, neox, scale = p["n_rot"], p["base"], p["neox"], p["scale"]
    return lambda: ops.rope(x, pos, n_rot, base, neox, scale)


def bind_attn(node, buf, weights, state):
    out, q, k, v = (buf[n] for n in (node.out,) + node.srcs)
    kc, vc = state.kv.k[node.params["layer"]], state.kv.v[node.params["layer"]]
    scale, window = node.params["scale"], node.params["window"]

    def run():
        attention.store_kv(kc, vc, k, v, state.pos0)
        attention.attention(out, q, kc, vc, state.pos0, scale, window)
    return run


def bind_add(node, buf, weights, state):
    out, a, b = _rows2d(buf[node.out]), _rows2d(buf[node.srcs[0]]), _rows2d(buf[node.srcs[1]])
    return lambda: ops.add(out, a, b)


def bind_scale(node, buf, weights, state):
    out, x, s = buf[node.out], buf[node.srcs[0]], node.params["s"]
    return lambda: ops.scale(out, x, s)


def bind_glu(node, buf, weights, state):
    out, gate, up = (_rows2d(buf[n]) for n in (node.out,) + node.srcs)
    act = ops.swiglu if node.params["act"] == "silu" else ops.geglu
    return lambda: act(out, gate, up)


def bind_topk_moe(node, buf, weights, state):
    weights_out, ids, logits = buf[node.out], buf[node.params["also_writes"][0]], buf[node.srcs[0]]
    norm = node.params["norm"]
    return lambda: moe.topk_route(ids, weights_out, logits, norm)


def bind_moe_combine(node, buf, weights, state):
    out, y, w = buf[node.out], buf[node.srcs[0]], buf[node.srcs[1]]
    return lambda: moe.moe_combine(out, y, w)


class CPUBackend:
    name = "CPU"
    binders = {
        "GET_ROWS": bind_get_rows, "RMS_NORM": bind_rms_norm, "MUL_MAT": bind_mul_mat,
        "MUL_MAT_ID": bind_mul_mat_id, "ROPE": bind_rope, "ATTN": bind_attn, "ADD": bind_add,
        "SCALE": bind_scale, "GLU": bind_glu, "TOPK_MOE": bind_topk_moe,
        "MOE_COMBINE": bind_moe_combine,
    }

    def supports_type(self, ggml_type):
        return matmul.is_supported(int(ggml_type))

    def alloc(self, buffer):
        return np.zeros(buffer.shape, buffer.dtype)

    def bind(self, node, buf, weights, state):
        return self.binders[node.op](node, buf, weights, state)
