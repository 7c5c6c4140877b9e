"""Matrix-vector with the weights in L2, one thread: plain vs repacked (-rtr), runs alternated.

    python tools/bench_rtr_l2.py --types Q4_K,IQ4_XS,MXFP4 --shapes 256x768,64x4096

What the kernel itself costs, memory out of the way: each case is one weight matrix of a few
hundred KB (it stays in L2), called through matmul.mul_mat_step (x's quantization and extras
included) on the calling thread, timed by the thread's CPU time (other processes on the core
do not count), best of --reps rounds of 20 calls, plain and repacked alternating within each
round. GB/s = weight bytes / time.
"""
import argparse
import sys
import time

import numba
import numpy as np
from gguf import GGMLQuantizationType

import nbmoe  # noqa: F401  (Numba settings before the kernels compile)
from nbmoe.cpu import matmul
from nbmoe.cpu.quants_rtr import R16, repack_tensor


def weights(rng, qt, M, K):
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from ref_quant import random_blocks
    name = GGMLQuantizationType(qt).name
    w = np.ascontiguousarray(random_blocks(rng, M * K // matmul.TYPES[qt][0], name).reshape(M, -1))
    w.flags.writeable = False
    return w


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", default="Q4_K", help="comma-separated GGUF types with an -rtr layout")
    p.add_argument("--shapes", default="512x768,128x4096", help="MxK list (a few hundred KB: L2)")
    p.add_argument("--reps", type=int, default=15, help="rounds (the best is kept)")
    a = p.parse_args(argv)
    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    for name in a.types.split(","):
        qt = int(GGMLQuantizationType[name])
        for shape in a.shapes.split(","):
            M, K = (int(v) for v in shape.split("x"))
            w = weights(rng, qt, M, K)
            wr, qr = repack_tensor(w, qt)
            wr.flags.writeable = False
            x = rng.standard_normal((1, K), dtype=np.float32)
            outs = [np.empty((1, M), np.float32) for _ in range(2)]
            steps = [matmul.mul_mat_step(outs[0], w, x, qt), matmul.mul_mat_step(outs[1], wr, x, qr)]
            for s in steps:
                s()
            diff = float(np.abs(outs[0] - outs[1]).max() / np.abs(outs[0]).max())
            best = [float("inf")] * 2
            for _ in range(a.reps):
                for i, s in enumerate(steps):
                    t0 = time.thread_time_ns()
                    for _ in range(20):
                        s()
                    best[i] = min(best[i], (time.thread_time_ns() - t0) / 20)
            gbs = [w.nbytes / t for t in best]
            print(f"{name:7s} {M}x{K} ({w.nbytes / 1e3:.0f} KB)  plain {gbs[0]:5.1f} GB/s  rtr {gbs[1]:5.1f} GB/s"
                  f"  x{best[0] / best[1]:.2f}  (max rel diff {diff:.1e})")


if __name__ == "__main__":
    main()
