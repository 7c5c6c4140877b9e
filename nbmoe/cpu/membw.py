"""Streaming read bandwidth: the limit every matrix-vector kernel is held against."""
import time

import numpy as np
from numba import njit, prange


# x [N] uint64, N divisible by n_chunks; each thread sums its own contiguous chunks
# (8-wide lane accumulators so LLVM keeps several loads in flight), then the partial
# sums are added. Bytes read / time = bandwidth.
@njit(parallel=True, cache=True)
def _sum_chunks(x, n_chunks):
    chunk = x.size // n_chunks
    partial = np.zeros(n_chunks, np.uint64)
    for c in prange(n_chunks):
        part = x[c * chunk:(c + 1) * chunk]
        acc = np.zeros(8, np.uint64)
        for i in range(0, chunk - 7, 8):
            for j in range(8):
                acc[j] += part[i + j]
        partial[c] = acc.sum()
    return partial.sum()


def read_bandwidth(n_bytes=1 << 29, repeats=5):
    """Best-of-`repeats` GB/s for reading `n_bytes` once (a buffer far larger than caches)."""
    x = np.ones(n_bytes // 8, np.uint64)
    _sum_chunks(x, 256)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        _sum_chunks(x, 256)
        best = min(best, time.perf_counter() - t0)
    return x.nbytes / best / 1e9
