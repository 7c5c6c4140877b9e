"""Streaming read bandwidth: the limit every matrix-vector kernel is held against."""
import glob
import os
import time

import numpy as np
from numba import njit, prange


# x [N] float32, N divisible by n_chunks; each thread sums its own contiguous chunks.
# fastmath lets LLVM reorder the sum: it vectorizes the loop with several accumulators, so
# the loads, not the add chain, set the pace (an in-order sum reads at a fraction of the
# memory speed).
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


def last_level_cache_bytes():
    """The largest CPU cache's size from sysfs (0 where unknown)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = [0]
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        with open(path) as f:
            text = f.read().strip()
        if text[:-1].isdigit() and text[-1] in units:
            sizes.append(int(text[:-1]) * units[text[-1]])
    return max(sizes)


def default_read_bytes():
    """A buffer four times the last-level cache, at least 1 GiB, at most 1/8 of the RAM: best-of
    repeats over a buffer the cache partly holds measure the cache, not the memory."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(max(1 << 30, 4 * last_level_cache_bytes()), max(ram // 8, 1 << 28)))


def read_bandwidth(n_bytes=None, repeats=5):
    """Best-of-`repeats` GB/s for reading `n_bytes` once (default_read_bytes: far larger than
    the caches)."""
    n_bytes = n_bytes or default_read_bytes()
    x = np.ones(n_bytes // 4, np.float32)
    _sum_chunks(x, 256)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        _sum_chunks(x, 256)
        best = min(best, time.perf_counter() - t0)
    return x.nbytes / best / 1e9
