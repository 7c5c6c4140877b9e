"""The CPU's share of a prompt's offloaded expert products (experts in RAM, GPU computing).

With the experts in RAM (`-ot exps=CPU`), a prompt batch large enough for the offload policy
uploads every expert tensor to the GPU (backend_cuda.PrefetchChain), and the uploads set the
pace: Qwen3-30B's experts are 16.3 GB a batch, 0.30 s over a PCIe 5 x16 link (55.3 GB/s
measured, tools/cuda_upload_check.py), ~6900 tokens/s at ubatch 2048 however fast the GPU
computes, while the CPU idles. Here the CPU takes experts 0..k-1 of each such layer:

  GPU  uploads only experts k..E-1 of the gate, up and down tensors (one contiguous slice
       each) and leaves the pairs of lower experts out of its products (mul_mat_id(first=k));
  CPU  copies x and the chosen ids down once the router ran (a side stream), computes its
       pairs' gate, up, GLU and down products from RAM while the GPU works, and sends their
       down rows up; moe.set_rows puts them in the slots the GPU left, before the layer's
       MOE_COMBINE, which then sums every slot as before.

The GPU's products are queued before the CPU starts (the down product's step runs the CPU's
part after queueing the GPU's), so both work at once. k adapts from layer to layer: when the
CPU's part is done before the GPU's down product, the link is the slower side and k grows by
one; otherwise it shrinks by one. It starts at E / 16 and carries over between batches.

NBMOE_CPU_SHARE: `auto` (default), a number (that many experts a layer on the CPU, fixed),
or 0 (off: every expert uploaded).
"""
import os
import time
from collections import Counter

import numpy as np

MODE = os.environ.get("NBMOE_CPU_SHARE", "auto")


class Layer:
    """One MoE layer's gate, up and down products (graph nodes), split between GPU and CPU."""

    def __init__(self, share, gate, up, down, act):
        self.share, self.gate, self.up, self.down = share, gate, up, down
        self.act = 0 if act == "silu" else 1          # cpu/moe.glu_pairs' code
        self.k = 0                                    # experts on the CPU in this run

    def begin(self, E):
        """The layer's first upload of a run is being queued: fix its k."""
        self.k = self.share.next_k(E)
        return self.k


def find_layers(nodes, buffers, backend, whole_upload):
    """{id(node): (role, Layer)} for the gate, up and down MUL_MAT_ID nodes of each MoE layer
    on `backend` whose three products upload their experts whole (`whole_upload(node)`): a GLU
    of gate and up (one x row a token, one ids) feeding down. buffers: shapes by name."""
    if MODE == "0":
        return {}
    found, share, last = {}, None, {}         # last: the node that wrote each buffer so far
    at = {id(n): j for j, n in enumerate(nodes)}
    for i, glu in enumerate(nodes):
        if glu.op == "GLU" and glu.backend == backend and len(glu.srcs) == 2:
            gate, up = (last.get(s) for s in glu.srcs)
            down = next((n for n in nodes[i + 1:] if n.op == "MUL_MAT_ID" and n.srcs[0] == glu.out), None)
            trio = (gate, up, down)
            if (all(n is not None and n.op == "MUL_MAT_ID" and "slots" not in n.params
                    and whole_upload(n) for n in trio)
                    and gate.srcs == up.srcs and down.srcs[1] == gate.srcs[1]
                    and len(buffers[gate.srcs[0]].shape) == 2):
                share = share or ExpertShare()
                layer = Layer(share, gate, up, down, glu.params["act"])
                layer.first = gate if at[id(gate)] < at[id(up)] else up      # runs first
                for role, n in zip(("gate", "up", "down"), trio):
                    found[id(n)] = (role, layer)
        for out in glu.outs:
            last[out] = glu
    return found


class ExpertShare:
    """The host side of one plan's split layers: the controller's k, host buffers, the side
    stream the small copies take (the upload stream is busy with expert tensors)."""

    k_auto = {}          # E -> k for the next layer, shared by plans (carries over batches)

    def __init__(self):
        self.backend = None
        self.host = {}
        self.seconds = Counter()       # host time by phase: fetch, wait, cpu, send

    def next_k(self, E):
        if MODE != "auto":
            return max(0, min(int(MODE), E - 1))
        return self.k_auto.setdefault(E, max(1, E // 16))

    def _adapt(self, E, k, gpu_done):
        if MODE == "auto":
            self.k_auto[E] = max(0, min(E - 1, k + (-1 if gpu_done else 1)))

    def _array(self, key, shape, dtype, pinned=False):
        """A host array of at least this shape's size, kept for the next layer (pinned: for
        the GPU's asynchronous copies)."""
        n = int(np.prod(shape))
        a = self.host.get(key)
        if a is None or a.size < n:
            n = max(n, int(1.25 * a.size) if a is not None else n)
            a = self.backend._pinned((n,), dtype) if pinned else np.empty(n, dtype)
            self.host[key] = a
        return a[:int(np.prod(shape))].reshape(shape)

    def _device(self, key, shape, dtype):
        """_array's twin on the GPU."""
        n = int(np.prod(shape))
        a = self.host.get(("dev", key))
        if a is None or a.size < n:
            n_new = max(n, int(1.25 * a.size) if a is not None else n)
            a = self.host[("dev", key)] = self.backend.alloc((n_new,), dtype)
        return a[:n].reshape(shape)

    def fetch(self, backend, x, ids):
        """Queue x [T, K] and ids [T, A] (device arrays the compute stream is writing) down to
        the host on the side stream, after what the compute stream has queued so far."""
        t0 = time.perf_counter()
        if self.backend is None:
            cuda = backend.cuda
            self.backend, self.side = backend, cuda.stream()
            self.ready, self.fetched, self.sent = cuda.event(), cuda.event(), cuda.event()
            self.gpu_part = cuda.event()
            self.sent.record(self.side)
        self.x = self._array("x", x.shape, np.float32, pinned=True)
        self.ids = self._array("ids", ids.shape, np.int32, pinned=True)
        self.ready.record(backend.stream)
        self.ready.wait(self.side)
        x.copy_to_host(self.x, stream=self.side)
        ids.copy_to_host(self.ids, stream=self.side)
        self.fetched.record(self.side)
        self.seconds["fetch"] += time.perf_counter() - t0

    def compute(self, layer, weights, y):
        """After the GPU's down product of `layer` is queued: the CPU's pairs (experts below
        layer.k) from x and ids fetched, their down rows sent up into y [T, A, D] (device)."""
        from .cpu import matmul, moe
        be = self.backend
        t0 = time.perf_counter()
        self.gpu_part.record(be.stream)
        self.fetched.synchronize()
        t1 = time.perf_counter()
        (wg, qg), (wu, qu), (wd, qd) = weights
        k, E = layer.k, wg.shape[0]
        T, A = self.ids.shape
        ids = self._array("ids_cpu", (T, A), np.int32)
        np.copyto(ids, np.where(self.ids < k, self.ids, -1))
        pairs = np.flatnonzero(ids.reshape(-1) >= 0)
        P = len(pairs)
        if P:
            F, K, D = wg.shape[1], self.x.shape[-1], y.shape[2]
            x = self.x.reshape(T, 1, K)
            g = self._array("g", (T, A, F), np.float32)
            u = self._array("u", (T, A, F), np.float32)
            matmul.mul_mat_id(g, wg[:k], x, ids, qg)
            matmul.mul_mat_id(u, wu[:k], x, ids, qu)
            h = self._array("h", (P, F), np.float32)
            moe.glu_pairs(h, g.reshape(T * A, F), u.reshape(T * A, F), pairs, layer.act)
            self.sent.synchronize()                      # the last layer's rows have left
            rows = self._array("rows", (P,), np.int32, pinned=True)
            rows[:] = pairs
            out = self._array("y", (P, D), np.float32, pinned=True)
            matmul.mul_mat_id(out.reshape(P, 1, D), wd[:k], h.reshape(P, 1, F),
                              ids.reshape(-1)[pairs].reshape(P, 1), qd)
        gpu_done = getattr(self.gpu_part, "query", lambda: True)()   # (the simulator has none)
        t2 = time.perf_counter()
        if P:
            rows_d, out_d = self._device("rows", (P,), np.int32), self._device("y", (P, D), np.float32)
            rows_d.copy_to_device(rows, stream=self.side)
            out_d.copy_to_device(out, stream=self.side)
            self.sent.record(self.side)
            self.sent.wait(be.stream)
            be.moe.set_rows(y.reshape(T * A, D), rows_d, out_d)
            be.cpu_share_pairs += P
        self._adapt(E, k, gpu_done)
        t3 = time.perf_counter()
        self.seconds.update(wait=t1 - t0, cpu=t2 - t1, send=t3 - t2)
