"""Sweep the CUDA tiled-product tile sizes on the GPU machine: TFLOP/s of a prompt-sized
mul_mat and of an expert product per (TILE_M, TILE_T, TILE_RM, TILE_RT, TILE_T_ID), each
checked against the current default's output first.

    python tools/cuda_tile_sweep.py [--types Q4_0,Q8_0]
"""
import argparse
import itertools

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from cuda_matmul_bench import time_ms
from nbmoe.cuda import matmul as mm
from numba import cuda

CONFIGS = [(64, 64, 4, 4), (128, 128, 8, 8), (128, 64, 8, 4), (64, 128, 4, 8), (128, 64, 4, 4),
           (128, 128, 8, 4)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_0,Q8_0")
    ap.add_argument("--ids", default="32,64")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    M, K, T = 4096, 2048, 512
    E, A, F, TE = 128, 8, 768, 2048
    for name in a.types.split(","):
        qt = int(GGMLQuantizationType[name])
        w = np.ascontiguousarray(quantize(rng.standard_normal((M, K), dtype=np.float32), qt).view(np.uint8))
        we = np.tile(w[:F], (E, 1)).reshape(E, F, -1)
        dw, dwe = cuda.to_device(w), cuda.to_device(we)
        x = cuda.to_device(rng.standard_normal((T, K), dtype=np.float32))
        xe = cuda.to_device(rng.standard_normal((TE, 1, K), dtype=np.float32))
        ids = cuda.to_device(np.stack([rng.choice(E, A, replace=False) for _ in range(TE)]).astype(np.int32))
        out, oute = cuda.device_array((T, M), np.float32), cuda.device_array((TE, A, F), np.float32)
        ref = refe = None
        for (tm, tt, rm, rt), tid in itertools.product(CONFIGS, [int(v) for v in a.ids.split(",")]):
            if tt % rt or tid % rt or (tm // rm) * (max(tt, tid) // rt) > 1024:
                continue
            mm.TILE_M, mm.TILE_T, mm.TILE_RM, mm.TILE_RT, mm.TILE_T_ID = tm, tt, rm, rt, tid
            try:
                t = time_ms(lambda i: mm.mul_mat(out, dw, x, qt), 5)
                te = time_ms(lambda i: mm.mul_mat_id(oute, dwe, xe, ids, qt), 3)
            except Exception as e:   # too many registers / shared memory for this config
                print(f"{name} {tm}x{tt} r{rm}x{rt} id{tid}: {type(e).__name__}: {str(e)[:80]}")
                continue
            o, oe = out.copy_to_host(), oute.copy_to_host()
            if ref is None:
                ref, refe = o, oe
            err = max(np.abs(o - ref).max() / np.abs(ref).max(), np.abs(oe - refe).max() / np.abs(refe).max())
            print(f"{name} {tm}x{tt} r{rm}x{rt} id{tid}: mul_mat {2 * T * M * K / t / 1e9:6.1f} TFLOP/s"
                  f"  mul_mat_id {2 * TE * A * F * K / te / 1e9:6.1f} TFLOP/s  (max rel diff {err:.1e})",
                  flush=True)


if __name__ == "__main__":
    main()
