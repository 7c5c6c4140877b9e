"""Matrix-vector from memory through the engine's dispatcher (quants_int8.dot_rows_i8) against
the same type's kernel called directly, 4096x4096, the two alternated in one process:

    NBMOE_CACHE=/tmp/empty python tools/cache_ab.py --types Q4_K   # compiles: equal
    NBMOE_CACHE=/tmp/empty python tools/cache_ab.py --types Q4_K   # from the cache: slower
    NBMOE_CACHE=/tmp/empty python tools/cache_ab.py --types Q4_K --preload   # equal again

From the cache, dot_rows_i8 runs its own copy of dot_rows_q4_k_i8, compiled into it (the
same IR optimised twice), and `direct` (compiled in each run) calls the kernel's own code
(docs/kernels.md has the figures). --preload loads
the kernel's own code first (load_order.py), and dot_rows_i8 calls it, as in the run that
compiled them.
"""
import argparse
import sys
import time

import numba
import numpy as np
from gguf import GGMLQuantizationType
from numba import njit, prange

import nbmoe  # noqa: F401  (Numba settings before the kernels compile)
from nbmoe import load_order
from nbmoe.cpu import matmul, quants_iq4, quants_k_i8
from nbmoe.cpu import quants_int8 as qi
from nbmoe.cpu.membw import read_bandwidth
from nbmoe.cpu.quants import Q4_1, Q8_0
from nbmoe.cpu.quants_iq4 import MXFP4
from nbmoe.cpu.quants_k import Q4_K, Q6_K

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_kernels import copies, weights  # noqa: E402


@njit(parallel=True, error_model="numpy")
def through_dispatcher(out, w, xq, xd, xs, xb, xds, step, qt):
    """out <- w @ x in runs of `step` rows, each through dot_rows_i8 (as the engine calls it)."""
    for i in prange((w.shape[0] + step - 1) // step):
        r0, r1 = i * step, min(w.shape[0], (i + 1) * step)
        qi.dot_rows_i8(qt, out[r0:r1], w[r0:r1], xq, xd, xs, xb, xds)


@njit(inline="always")
def _kernel(qt, out, w, xq, xd, xs, xb, xds):
    """The per-type kernel that dot_rows_i8 reaches for qt (a literal after inlining)."""
    if qt == Q4_K:
        quants_k_i8.dot_rows_q4_k_i8(out, w, xb[:xq.shape[0] // 4].view(np.int8), xd, xs)
    elif qt == Q6_K:
        quants_k_i8.dot_rows_q6_k_i8(out, w, xq, xd, quants_k_i8.sums16(xq, xd))
    elif qt == MXFP4:
        quants_iq4.dot_rows_mxfp4_i8(out, w, xq, xd, xs, xb)
    elif qt == Q8_0:
        qi.dot_rows_q8_0(out, w, xq, xd, xb, xds)
    elif qt == Q4_1:
        qi.dot_rows_q4_1(out, w, xq, xd, xb, xds)


@njit(parallel=True, error_model="numpy")
def direct(out, w, xq, xd, xs, xb, xds, step, qt):
    for i in prange((w.shape[0] + step - 1) // step):
        r0, r1 = i * step, min(w.shape[0], (i + 1) * step)
        _kernel(qt, out[r0:r1], w[r0:r1], xq, xd, xs, xb, xds)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", default="Q4_K,Q6_K,MXFP4,Q8_0,Q4_1")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--copy-mb", type=float, default=1200, help="MB of weight copies walked through")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--preload", action="store_true", help="load_order.preload() first, as the engine does")
    a = p.parse_args(argv)
    numba.set_num_threads(a.threads)
    if a.preload:
        print(f"preloaded {load_order.preload()} kernels")
    rng = np.random.default_rng(0)
    cases = []
    for name in a.types.split(","):
        qt = int(GGMLQuantizationType[name])
        w0 = weights(rng, qt, 4096, 4096)
        ws = copies(w0, a.copy_mb)
        out = np.empty(4096, np.float32)
        _, xi = matmul._prepare_x(rng.standard_normal((1, 4096), dtype=np.float32), True, qt)
        args = tuple(v[0] for v in xi) + (matmul.item_rows(4096, w0.shape[1], 1, qt), qt)

        def walk(fn, ws=ws, out=out, args=args, n=w0.nbytes):
            t0 = time.perf_counter()
            for w in ws:
                fn(out, w, *args)
            return n * len(ws) / (time.perf_counter() - t0) / 1e9
        walk(through_dispatcher)
        walk(direct)
        cases.append((name, walk))
    bws, res = [], {}
    for r in range(a.rounds):
        bws.append(read_bandwidth(1 << 30, 3))
        for name, walk in cases:
            for label, fn in (("dispatcher", through_dispatcher), ("direct", direct))[::1 if r % 2 else -1]:
                res.setdefault((name, label), []).append(walk(fn))
    bw = float(np.median(bws))
    print(f"streaming read {bw:.1f} GB/s (median of {a.rounds}), {a.threads} threads, medians:")
    for name, _ in cases:
        d, s = np.median(res[(name, "dispatcher")]), np.median(res[(name, "direct")])
        print(f"{name:6s} through dot_rows_i8 {d:5.1f} GB/s ({d / bw:.0%})   direct {s:5.1f} GB/s ({s / bw:.0%})")


if __name__ == "__main__":
    main()
