"""A rank's expert share computed on its own GPU (--ep-gpu), with nbmoe's CUDA kernels.

Legend: P the (token, slot) pairs whose chosen expert is in the share, D model dim, F expert
FFN width, E_r the share's experts.

A rank takes the GPU of its local rank (its place among the ranks of its host, modulo the
host's GPUs): on a host with G GPUs, G ranks use one GPU each, as CUDA_VISIBLE_DEVICES set
per local rank would. The share's weights are uploaded once, at start ([E_r, M, row_bytes]
per matrix, the layout of the file's rows); per layer the gathered pairs go up ([P, 1, D],
ids [P, 1], weights [P, 1]) and their weighted outputs [P, D] come down. The gathering and
the per-token sums are ExpertShare's (experts.py), so both devices answer alike.
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
        self.cuda, self.cmm, self.cmoe, self.cops = cuda, matmul, moe, ops
        self.device = device
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

    def _experts(self, il, x, ids, w):
        """y [P, D] = w[p] * down(glu(gate x[p], up x[p])) through expert ids[p] (local), on the GPU."""
        cuda, mm = self.cuda, self.cmm
        (wg, qg, bg), (wu, qu, bu), (wd, qd, bd) = (self.gpu[il][r] for r in ("gate", "up", "down"))
        P, F, D = x.shape[0], wg.shape[1], wd.shape[1]
        select_gpu(self.device)
        dx, dids, dw = cuda.to_device(x), cuda.to_device(ids), cuda.to_device(w)
        g = cuda.device_array((P, 1, F), np.float32)                 # [P, 1, F]
        u = cuda.device_array((P, 1, F), np.float32)
        mm.mul_mat_id(g, wg, dx, dids, qg)
        mm.mul_mat_id(u, wu, dx, dids, qu)
        for out, b in ((g, bg), (u, bu)):
            if b is not None:
                self.cops.add_bias_id(out, out, b, dids)
        self.cglu(g.reshape(P, F), g.reshape(P, F), u.reshape(P, F))
        yd = cuda.device_array((P, 1, D), np.float32)                # [P, 1, D]
        mm.mul_mat_id(yd, wd, g, dids, qd)
        if bd is not None:
            self.cops.add_bias_id(yd, yd, bd, dids)
        y = cuda.device_array((P, D), np.float32)
        self.cmoe.moe_combine(y, yd, dw)
        return y.copy_to_host()
