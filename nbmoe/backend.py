"""Backends: a table from op type to a binder that turns a graph node into one call.

A backend is its kernel modules (matmul, ops, attention, moe: the CPU and CUDA versions have
the same signatures), a way to allocate activation buffers and a store of the weights that
live on it. Binding happens once per graph: every array view (reshape, row slice, weight
view) is made then, so running a node is one Python call into a compiled kernel. Per-token
state (the cache position) is read from `state` at call time.
"""
import numpy as np
from gguf import GGMLQuantizationType


def _rows2d(a):
    return a.reshape(a.shape[0], -1)


class Backend:
    name = "?"
    mm = ops = attn = moe = None        # kernel modules, set by subclasses
    positions_on_device = False         # attention takes the pos buffer, not state.pos0

    def __init__(self, tensors):
        self.tensors = tensors          # GGUF TensorInfo by name (host side)

    # -- what subclasses provide ----------------------------------------------------------
    def alloc(self, shape, dtype):
        raise NotImplementedError

    def weight(self, name):
        """(array [rows.., row_bytes] uint8 on this backend, qtype int)."""
        raise NotImplementedError

    def vector(self, name):
        """A 1-D weight (norm) as float32 on this backend."""
        raise NotImplementedError

    def supports_type(self, ggml_type):
        return self.mm.is_supported(int(ggml_type))

    def synchronize(self):
        pass

    # -- binders ---------------------------------------------------------------------------
    def bind(self, node, buf, state):
        return getattr(self, "bind_" + node.op.lower())(node, buf, state)

    def bind_get_rows(self, node, buf, state):
        (w, qtype), out, ids, mm = self.weight(node.weight), buf[node.out], buf[node.srcs[0]], self.mm
        return lambda: mm.get_rows(out, w, ids, qtype)

    def bind_rms_norm(self, node, buf, state):
        w = self.vector(node.weight)
        n = w.shape[0]
        x = buf[node.srcs[0]]
        if "src_rows" in node.params:
            lo, hi = node.params["src_rows"]
            x = x[lo:hi]
        x, out, eps, ops = x.reshape(-1, n), buf[node.out].reshape(-1, n), node.params["eps"], self.ops
        return lambda: ops.rms_norm(out, x, w, eps)

    def mul_mat_operands(self, node, buf):
        """(out [T, M], w [M, row_bytes], x [T, K], qtype) of a resident-weight MUL_MAT."""
        w, qtype = self.weight(node.weight)
        shape = tuple(w.shape)      # (device arrays of the simulator take no negative index)
        w = w.reshape(int(np.prod(shape[:-1])), shape[len(shape) - 1])
        return _rows2d(buf[node.out]), w, _rows2d(buf[node.srcs[0]]), qtype

    def mul_mat_id_operands(self, node, buf):
        """(out [T, A, M], w [E, M, row_bytes], x [T, X, K], ids [T, A], qtype) of MUL_MAT_ID."""
        w, qtype = self.weight(node.weight)
        out, x, ids = buf[node.out], buf[node.srcs[0]], buf[node.srcs[1]]
        if len(x.shape) == 2:
            x = x.reshape(x.shape[0], 1, x.shape[1])   # one input row shared by the chosen experts
        return out, w, x, ids, qtype

    def bind_mul_mat(self, node, buf, state):
        out, w, x, qtype = self.mul_mat_operands(node, buf)
        mm = self.mm
        return lambda: mm.mul_mat(out, w, x, qtype)

    def bind_mul_mat_id(self, node, buf, state):
        out, w, x, ids, qtype = self.mul_mat_id_operands(node, buf)
        mm = self.mm
        return lambda: mm.mul_mat_id(out, w, x, ids, qtype)

    def bind_rope(self, node, buf, state):
        x, pos, p, ops = buf[node.out], buf[node.srcs[1]], node.params, self.ops
        n_rot, base, neox, scale = p["n_rot"], p["base"], p["neox"], p["scale"]
        return lambda: ops.rope(x, pos, n_rot, base, neox, scale)

    def bind_attn(self, node, buf, state):
        out, q, k, v, pos = (buf[n] for n in (node.out,) + node.srcs)
        layer = node.params["layer"]
        kc, vc = state.kv.k[layer], state.kv.v[layer]
        scale, window, attn = node.params["scale"], node.params["window"], self.attn
        if self.positions_on_device:     # kernels read the position from the pos buffer
            def run():
                attn.store_kv(kc, vc, k, v, pos)
                attn.attention(out, q, kc, vc, pos, scale, window)
        else:
            def run():
                attn.store_kv(kc, vc, k, v, state.pos0)
                attn.attention(out, q, kc, vc, state.pos0, scale, window)
        return run

    def bind_add(self, node, buf, state):
        out, a, b = (_rows2d(buf[n]) for n in (node.out,) + node.srcs)
        ops = self.ops
        return lambda: ops.add(out, a, b)

    def bind_scale(self, node, buf, state):
        out, x, s, ops = buf[node.out], buf[node.srcs[0]], node.params["s"], self.ops
        return lambda: ops.scale(out, x, s)

    def bind_glu(self, node, buf, state):
        out, gate, up = (_rows2d(buf[n]) for n in (node.out,) + node.srcs)
        act = self.ops.swiglu if node.params["act"] == "silu" else self.ops.geglu
        return lambda: act(out, gate, up)

    def bind_topk_moe(self, node, buf, state):
        wts, ids, logits = buf[node.out], buf[node.params["also_writes"][0]], buf[node.srcs[0]]
        norm, moe = node.params["norm"], self.moe
        return lambda: moe.topk_route(ids, wts, logits, norm)

    def bind_moe_combine(self, node, buf, state):
        out, y, w, moe = buf[node.out], buf[node.srcs[0]], buf[node.srcs[1]], self.moe
        return lambda: moe.moe_combine(out, y, w)


class CPUBackend(Backend):
    name = "CPU"

    def __init__(self, tensors, repacked=None):
        super().__init__(tensors)
        from .cpu import attention, matmul, moe, ops
        self.mm, self.ops, self.attn, self.moe = matmul, ops, attention, moe
        self.repacked = repacked or {}  # name -> (array, repacked qtype): -rtr (repack.py)

    def alloc(self, shape, dtype):
        return np.zeros(shape, dtype)

    def copy_in(self, dst, src):
        """dst (here) <- src (a host array or another backend's device array)."""
        if isinstance(src, np.ndarray):
            np.copyto(dst, src)
        else:
            src.copy_to_host(dst)

    def weight(self, name):
        if name in self.repacked:
            return self.repacked[name]
        t = self.tensors[name]
        return t.data, int(t.ggml_type)

    def vector(self, name):
        t = self.tensors[name]
        if t.ggml_type == GGMLQuantizationType.F32:
            return t.data.view(np.float32).reshape(-1)
        return self.mm.dequantize(t.data.reshape(1, -1), int(t.ggml_type)).reshape(-1)
