"""A rank's expert share computed on its own GPU (--ep-gpu), with nbmoe's CUDA kernels.

Legend: P the (token, slot) pairs whose chosen expert is in the share, D model dim, F expert
FFN width, E_r the share's experts.

A rank takes the GPU of its local rank (its place among the ranks of its host, modulo the
host's GPUs): on a host with G GPUs, G ranks use one GPU each, as CUDA_VISIBLE_DEVICES set
per local rank would. The share's weights are uploaded once, at start ([E_r, M, row_bytes]
per matrix, the layout of the file's rows); per layer the gathered pairs go up ([P, 1, D],
ids [P, 1], weights [P, 1]) and their weighted outputs [P, D] come down. The gathering and
the per-token sums are ExpertShare's (experts.py), so both devices answer alike. A single
token (generation) instead goes up as x [1, 1, D] with its pairs [1, A] (padded with weight 0)
and comes down summed, each layer one recorded CUDA graph: numba's launches would cost more
host time than the products take.
"""
import os

import numpy as np

from nbmoe.backends.cpu import GLU_KERNELS
from nbmoe.backends.cuda import select_gpu
from nbmoe.errors import NbmoeError
from nbmoe.parallel.experts import ExpertShare


# The launchers' variables for a rank's place among its host's ranks (MPICH's Hydra, Open MPI,
# Slurm). Read rather than asked of MPI: a collective call would hang ranks whose rank 0
# failed before making it.
LOCAL_RANK_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")


def local_device(comm):
    """The GPU index of this rank: its rank among its host's ranks (the launcher's variable,
    else its world rank), modulo the host's GPUs."""
    try:
        import nbmoe.cuda as nbcuda
        from numba import cuda
    except ImportError as e:
        raise NbmoeError(f"--ep-gpu needs numba's CUDA support ({e})") from None
    if not nbcuda.is_available():
        raise NbmoeError("--ep-gpu: this host has no usable CUDA GPU")
    local = next((int(os.environ[v]) for v in LOCAL_RANK_VARS if os.environ.get(v, "").isdigit()),
                 comm.Get_rank())
    return local % max(1, len(cuda.gpus))


class GPUExpertShare(ExpertShare):
    """ExpertShare whose experts run on GPU `device`."""

    def __init__(self, cfg, backend, spans, device):
        super().__init__(cfg, backend, spans)
        import nbmoe.cuda  # noqa: F401  (its numpy shim before numba.cuda)
        from numba import cuda
        from nbmoe.cuda import matmul, moe, ops
        from nbmoe.cuda.quants import is_supported
        from nbmoe.cuda import graphs
        self.cuda, self.cmm, self.cmoe, self.cops, self.graphs = cuda, matmul, moe, ops, graphs
        self.device, self._decode = device, None
        select_gpu(device)
        self.cglu = getattr(ops, GLU_KERNELS[cfg.flags.glu])
        self.gpu = {}
        for il, layer in self.layers.items():
            self.gpu[il] = {}
            for role, (w, qtype, bias) in layer.items():
                if not is_supported(qtype):
                    raise NbmoeError(f"--ep-gpu: blk.{il}.ffn_{role}_exps has a type the CUDA "
                                     "kernels do not support")
                self.gpu[il][role] = (cuda.to_device(np.ascontiguousarray(w)), qtype,
                                      None if bias is None else cuda.to_device(np.ascontiguousarray(bias)))

    @property
    def n_bytes_gpu(self):
        return sum(w.nbytes for layer in self.gpu.values() for w, _, _ in layer.values())

    def compute(self, out, il, h, ids, wts):
        """As ExpertShare.compute; one token (generation) replays a recorded graph per layer."""
        if h.shape[0] != 1:
            return super().compute(out, il, h, ids, wts)
        lo, hi = self.spans.get(il, (0, 0))
        mine = np.flatnonzero((ids[0] >= lo) & (ids[0] < hi))
        if mine.size == 0:
            out[:] = 0
            return
        d = self._decode or self._decode_buffers()
        n = mine.size
        # the pairs, then copies of the first with weight 0 (its weights are in L2 by then):
        # fixed shapes, so one graph serves every token
        d["hx"][0, 0] = h[0]
        d["hids"][0, :n] = ids[0, mine] - lo
        d["hids"][0, n:] = d["hids"][0, 0]
        d["hw"][0, :n] = wts[0, mine]
        d["hw"][0, n:] = 0
        run = d["runs"].get(il)
        if run is None:
            run = d["runs"][il] = self.graphs.GraphRun([lambda: self._decode_steps(il, d)], d["stream"])
        select_gpu(self.device)
        run()
        out[0] = d["hy"][0]

    def _decode_buffers(self):
        """Pinned host and device buffers of a one-token layer ([1, A] pairs), and its stream."""
        cuda, cfg = self.cuda, self.cfg
        A, D = cfg.n_expert_used, cfg.n_embd
        F = next(iter(self.gpu.values()))["gate"][0].shape[1]
        select_gpu(self.device)
        d = {"stream": cuda.stream(), "runs": {},
             "hx": cuda.pinned_array((1, 1, D), np.float32), "hids": cuda.pinned_array((1, A), np.int32),
             "hw": cuda.pinned_array((1, A), np.float32), "hy": cuda.pinned_array((1, D), np.float32)}
        for name, shape, dtype in (("x", (1, 1, D), np.float32), ("ids", (1, A), np.int32),
                                   ("w", (1, A), np.float32), ("g", (1, A, F), np.float32),
                                   ("u", (1, A, F), np.float32), ("yd", (1, A, D), np.float32),
                                   ("y", (1, D), np.float32)):
            d[name] = cuda.device_array(shape, dtype)
        self._decode = d
        return d

    def _decode_steps(self, il, d):
        s = d["stream"]
        for name in ("x", "ids", "w"):
            d[name].copy_to_device(d["h" + name], stream=s)
        self._launch(il, d["x"], d["ids"], d["w"], d["g"], d["u"], d["yd"], d["y"], s)
        d["y"].copy_to_host(d["hy"], stream=s)

    def _experts(self, il, x, ids, w):
        """y [P, D] = w[p] * down(glu(gate x[p], up x[p])) through expert ids[p] (local), on the GPU."""
        cuda = self.cuda
        P, D = x.shape[0], self.cfg.n_embd
        F = self.gpu[il]["gate"][0].shape[1]
        select_gpu(self.device)
        g, u = (cuda.device_array((P, 1, F), np.float32) for _ in range(2))       # [P, 1, F]
        yd, y = cuda.device_array((P, 1, D), np.float32), cuda.device_array((P, D), np.float32)
        self._launch(il, cuda.to_device(x), cuda.to_device(ids), cuda.to_device(w), g, u, yd, y, 0)
        return y.copy_to_host()

    def _launch(self, il, x, ids, w, g, u, yd, y, stream):
        """y [T, D] = sum_a w[t, a] * down(glu(gate x, up x)) through experts ids [T, A] (local):
        x [T, 1, D], g and u [T, A, F], yd [T, A, D] on the GPU."""
        mm, ops = self.cmm, self.cops
        (wg, qg, bg), (wu, qu, bu), (wd, qd, bd) = (self.gpu[il][r] for r in ("gate", "up", "down"))
        N, F = ids.size, wg.shape[1]
        mm.mul_mat_id(g, wg, x, ids, qg, stream)
        mm.mul_mat_id(u, wu, x, ids, qu, stream)
        for out, b in ((g, bg), (u, bu)):
            if b is not None:
                ops.add_bias_id(out, out, b, ids, stream)
        self.cglu(g.reshape(N, F), g.reshape(N, F), u.reshape(N, F), stream)
        mm.mul_mat_id(yd, wd, g, ids, qd, stream)
        if bd is not None:
            ops.add_bias_id(yd, yd, bd, ids, stream)
        self.cmoe.moe_combine(y, yd, w, stream)
