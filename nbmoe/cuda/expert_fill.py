"""Completing an offloaded expert tensor's device copy, on the GPU, from RAM read in place.

An upload ahead of the router holds some experts of a tensor (backends/expert_uploads.py);
once the router has chosen, this kernel copies the chosen experts it lacks from the GGUF
file's mapping, which the GPU reads over PCIe (page-locked and mapped: cuda/host_memory.py).
No host wait for the router: the launch is queued like the products after it.
"""
import numpy as np
from numba import cuda

from . import SIM

# Blocks per expert column of the grid and threads a block: enough loads in flight to keep
# PCIe busy (the simulator runs a thread per thread: a small grid there).
FILL_BLOCKS, FILL_THREADS = (1, 4) if SIM else (16, 256)

_kernels = {}


# ---------------------------------------------------------------- fill_chosen
# dst, src [E, W] words (an expert's bytes, as the widest unsigned words that divide them),
# ids [T * A] int32, held [E] int32. Grid (FILL_BLOCKS, E): the blocks of column e leave at
# once if held[e]; else they look for e among the ids (a shared flag, set by any thread that
# finds it) and, when chosen, copy its W words, block b taking words b*FILL_THREADS + j, strided by
# FILL_BLOCKS*FILL_THREADS.

def _fill_chosen(dst, src, ids, held):
    e = cuda.blockIdx.y
    if held[e] != 0:
        return
    tid = cuda.threadIdx.x
    chosen = cuda.shared.array(1, np.int32)
    if tid == 0:
        chosen[0] = 0
    cuda.syncthreads()
    for i in range(tid, ids.shape[0], cuda.blockDim.x):
        if ids[i] == e:
            chosen[0] = 1
    cuda.syncthreads()
    if chosen[0] == 0:
        return
    step = cuda.gridDim.x * cuda.blockDim.x
    for w in range(cuda.blockIdx.x * cuda.blockDim.x + tid, dst.shape[1], step):
        dst[e, w] = src[e, w]


def _words(a, n_bytes):
    """a ([E, ...] uint8, contiguous) as [E, n_bytes / size] of the widest word that fits."""
    for dtype in (np.uint64, np.uint32, np.uint16, np.uint8):
        size = np.dtype(dtype).itemsize
        if n_bytes % size == 0:
            return a.reshape(a.shape[0], n_bytes).view(dtype)


def fill_operands(dst, src, ids):
    """The kernel's operands for dst, src and ids (made once a tensor: device array views
    cost the host tens of microseconds each)."""
    n_bytes = dst.size // dst.shape[0]
    return _words(dst, n_bytes), _words(src, n_bytes), ids.reshape(ids.size)


def fill_chosen(dst, src, ids, held, stream=0, operands=None):
    """dst[e] <- src[e] for each expert e chosen in ids ([T, A]) with held[e] == 0.
    dst: device [E, ...] uint8; src: the same shape, host memory mapped for the GPU;
    operands: fill_operands(dst, src, ids), if made before."""
    k = _kernels.get("fill")
    if k is None:
        k = _kernels["fill"] = cuda.jit(_fill_chosen)
    d, s, i = operands or fill_operands(dst, src, ids)
    k[(FILL_BLOCKS, dst.shape[0]), FILL_THREADS, stream](d, s, i, held)
