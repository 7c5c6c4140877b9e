"""Streaming read bandwidth: the limit every matrix-vector kernel is held against."""
import time

import numpy as np
from numba import njit, prange


# x [N] float32, N divisible by n_chunks; each thread sums its own contiguous chunks.
# fastmath lets LLVM reorder the sum: it vectorizes the loop with several accumulators, so
# the loads, not the add chain, set the pace (an in-order sum reads at ~1/4 of the memory
# speed; the earlier 8 x uint64 version measured ~25% low on the 2-core VM).
@njit(parallel=True, cache=True, fastmath=True)
def _sum_chunks(x, n_chunks):
    chunk = x.size // n_chunks
    partial = np.zeros(n_chunks, np.float32)
    for c in prange(n_chunks):
        part = x[c * chunk:(c + 1) * chunk]      # a slice: unit stride, no index checks left
        s = np.float32(0.0)
        for i in range(part.shape[0]):
            s += part[i]
        partial[c] = s
    return partial.sum()


def read_bandwidth(n_bytes=1 << 29, repeats=5):
    """Best-of-`repeats` GB/s for reading `n_bytes` once (a buffer far larger than caches)."""
    x = np.ones(n_bytes // 4, np.float32)
    _sum_chunks(x, 256)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        _sum_chunks(x, 256)
        best = min(best, time.perf_counter() - t0)
    return x.nbytes / best / 1e9
