"""Copying offloaded experts' bytes on the GPU, from RAM read in place.

An upload of an offloaded expert tensor (backends/expert_uploads.py) holds the experts its
layer chose lately: copy_held brings them up on the upload stream, one launch a tensor
however scattered they are (not a driver call a run of consecutive experts). Once the router has chosen, fill_chosen copies the
chosen experts the upload lacks, queued like the products after it, so the host never
waits for the router. Both read the GGUF file's mapping over PCIe (page-locked and mapped:
cuda/host_memory.py).
"""
import numpy as np
from numba import cuda

from . import SIM, device_fn

# fill_chosen: blocks per expert column of the grid and threads a block; copy_held: blocks in
# all. Enough loads in flight to keep PCIe busy (the simulator runs a thread per thread).
FILL_BLOCKS, FILL_THREADS = (1, 4) if SIM else (16, 256)
HELD_BLOCKS = 2 if SIM else 64
# Experts a tensor may have for copy_held (its mask sits in shared memory).
MAX_EXPERTS = 1024

# ---------------------------------------------------------------- copy_words
# dst[e, w] = src[e, w] for w = first, first + step, ...: four loads in flight a thread
# (each crosses PCIe, ~microseconds), then their four stores.

@device_fn
def copy_words(dst, src, e, first, step):
    n = dst.shape[1]
    w = first
    while w + 3 * step < n:
        a, b = src[e, w], src[e, w + step]
        c, d = src[e, w + 2 * step], src[e, w + 3 * step]
        dst[e, w], dst[e, w + step] = a, b
        dst[e, w + 2 * step], dst[e, w + 3 * step] = c, d
        w += 4 * step
    while w < n:
        dst[e, w] = src[e, w]
        w += step


# ---------------------------------------------------------------- fill_chosen
# dst, src [E, W] words (an expert's bytes, as the widest unsigned words that divide them),
# ids [T * A] int32, held [E] int32. Grid (FILL_BLOCKS, E): the blocks of column e leave at
# once if held[e]; else they look for e among the ids (a shared flag, set by any thread that
# finds it) and, when chosen, copy its W words, block b taking words b*FILL_THREADS + j, strided by
# FILL_BLOCKS*FILL_THREADS.

@cuda.jit
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
    copy_words(dst, src, e, cuda.blockIdx.x * cuda.blockDim.x + tid, cuda.gridDim.x * cuda.blockDim.x)


# ---------------------------------------------------------------- copy_held
# dst, src [E, W] words as above, held [E] int32 (host memory: read once a block into shared
# memory). Grid (HELD_BLOCKS,): every block walks the held experts in order, block b taking
# words b*FILL_THREADS + j of each, strided by HELD_BLOCKS*FILL_THREADS.

@cuda.jit
def _copy_held(dst, src, held):
    tid = cuda.threadIdx.x
    mask = cuda.shared.array(MAX_EXPERTS, np.int32)
    for e in range(tid, held.shape[0], cuda.blockDim.x):
        mask[e] = held[e]
    cuda.syncthreads()
    first, step = cuda.blockIdx.x * cuda.blockDim.x + tid, cuda.gridDim.x * cuda.blockDim.x
    for e in range(held.shape[0]):
        if mask[e] != 0:
            copy_words(dst, src, e, first, step)


def _words(a, n_bytes):
    """a ([E, ...] uint8, contiguous) as [E, n_bytes / size] of the widest word that fits."""
    for dtype in (np.uint64, np.uint32, np.uint16, np.uint8):
        size = np.dtype(dtype).itemsize
        if n_bytes % size == 0:
            return a.reshape(a.shape[0], n_bytes).view(dtype)


def fill_chosen(dst, src, ids, held, stream=0):
    """dst[e] <- src[e] for each expert e chosen in ids ([T, A]) with held[e] == 0.
    dst: device [E, ...] uint8; src: the same shape, host memory mapped for the GPU."""
    E, n_bytes = dst.shape[0], dst.size // dst.shape[0]
    _fill_chosen[(FILL_BLOCKS, E), FILL_THREADS, stream](
        _words(dst, n_bytes), _words(src, n_bytes), ids.reshape(ids.size), held)


def copy_held(dst, src, held, stream=0):
    """dst[e] <- src[e] for each expert e with held[e] != 0 (held: [E] int32, mapped host
    memory; E <= MAX_EXPERTS). dst, src as fill_chosen's."""
    E, n_bytes = dst.shape[0], dst.size // dst.shape[0]
    if E > MAX_EXPERTS:
        raise ValueError(f"copy_held: {E} experts, at most {MAX_EXPERTS}")
    _copy_held[HELD_BLOCKS, FILL_THREADS, stream](
        _words(dst, n_bytes), _words(src, n_bytes), held)
