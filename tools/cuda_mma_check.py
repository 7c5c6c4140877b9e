"""Check and time the int8 tensor-core prompt products (nbmoe/cuda/matmul_mma.py) on a GPU against
the float tiled kernel, one line per case:

    PYTHONUNBUFFERED=1 python tools/cuda_mma_check.py [--types Q4_0,Q8_0] [--tiles 128x64x4x2x4,...]

Cases: mul_mat T=512 x (M=4096, K=2048) and mul_mat_id 2048 tokens x 8 of 128 experts (M=768,
K=2048), random blocks with sane scales. Two errors (max |diff| / max |float path|): with x as
given (the int8 path rounds x to 8 bits: ~1e-2 and below), and with x already on the 8-bit
grid (both paths then multiply the same values: ~1e-6, anything large is a wrong fragment or
scale). TFLOP/s = 2 T M K / time, time the median of CUDA-event-timed calls after a warm-up
(the int8 path's time includes quantizing x). --tiles adds mma tile configurations
TMxTTxWMxWTxKB[xMIN_BLOCKS] (rows x tokens per block, warps along rows x tokens, K step in
32-blocks, blocks an SM must fit by registers), e.g. --types Q4_0,Q4_K --tiles
64x128x2x4x4,128x128x4x2x2x1,64x64x2x2x4x4 (each adds two compiles a type: a few seconds).
Exits 1 when a check fails.
"""
import argparse
import os
import sys
import time

import numpy as np

import nbmoe.cuda  # noqa: F401  (defines np.row_stack before numba.cuda is imported)
from numba import cuda  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gguf import GGMLQuantizationType as Q  # noqa: E402
from ref_quant import random_rows  # noqa: E402

from nbmoe.cuda import matmul as mm  # noqa: E402
from nbmoe.cuda import matmul_mma  # noqa: E402
from cuda_matmul_bench import time_ms  # noqa: E402

TOL_X8 = 2e-2       # vs the float path, x as given (8-bit rounding of x)
TOL_GRID = 1e-4     # vs the float path, x on the 8-bit grid


def on_grid(x):
    """x [..., K] moved onto its 8-bit grid: codes rint(x / d) times d = max|x| / 127 per 32-block."""
    xb = x.reshape(-1, 32)
    d = (np.abs(xb).max(axis=1) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    return (np.rint(xb * inv[:, None]) * d[:, None]).astype(np.float32).reshape(x.shape)


def rel(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def main():
    ap = argparse.ArgumentParser(description="int8 tensor-core products vs the float tiled kernel")
    ap.add_argument("--types", default="Q4_0,Q8_0,Q4_K,Q6_K,IQ4_XS,MXFP4", help="GGUF types")
    ap.add_argument("--tiles", default="", help="extra mma tiles TMxTTxWMxWTxKB, comma-separated")
    ap.add_argument("-n", type=int, default=5, help="timed calls per case")
    ap.add_argument("--shape", default="512,4096,2048", help="mul_mat T,M,K")
    ap.add_argument("--moe", default="2048,128,8,768,2048", help="mul_mat_id tokens,E,A,M,K")
    a = ap.parse_args()
    t_start = time.time()
    name = getattr(cuda.get_current_device(), "name", "CUDA simulator")
    keys = ("TM", "TT", "WM", "WT", "KB", "MIN_BLOCKS")
    default = tuple(getattr(matmul_mma, k) for k in keys)
    print(f"{name.decode() if isinstance(name, bytes) else name}: default mma tile {'x'.join(map(str, default))}"
          f" (mul_mat_id: {matmul_mma.ID_TILES} by least pairs an expert)", flush=True)
    configs = [default] + [tuple(int(v) for v in c.split("x")) + default[5:][len(c.split("x")) - 5:]
                           for c in a.tiles.split(",") if c]
    id_tiles = matmul_mma.ID_TILES
    rng = np.random.default_rng(0)
    T, M, K = (int(v) for v in a.shape.split(","))
    TE, E, A, F, KE = (int(v) for v in a.moe.split(","))
    x = rng.standard_normal((T, K), dtype=np.float32)
    xe = rng.standard_normal((TE, 1, KE), dtype=np.float32)
    dx, dxg = cuda.to_device(x), cuda.to_device(on_grid(x))
    dxe, dxeg = cuda.to_device(xe), cuda.to_device(on_grid(xe))
    ids = cuda.to_device(np.stack([rng.choice(E, A, replace=False) for _ in range(TE)]).astype(np.int32))
    out = cuda.device_array((T, M), np.float32)
    oute = cuda.device_array((TE, A, F), np.float32)
    failed = 0
    for name in a.types.split(","):
        qt = int(Q[name])
        dw = cuda.to_device(random_rows(rng, M, K, name))
        dwe = cuda.to_device(random_rows(rng, E * F, KE, name).reshape(E, F, -1))
        cases = (("mul_mat   ", 2 * T * M * K, lambda xx: mm.mul_mat(out, dw, xx, qt), dx, dxg, out),
                 ("mul_mat_id", 2 * TE * A * F * KE, lambda xx: mm.mul_mat_id(oute, dwe, xx, ids, qt), dxe, dxeg, oute))
        for label, flops, run, xin, xgrid, o in cases:
            name_ = f"{name:6s} {label}"
            mm.MMA = False
            run(xin)
            ref = o.copy_to_host()
            run(xgrid)
            ref_g = o.copy_to_host()
            t_f = time_ms(lambda i: run(xin), a.n)
            mm.MMA = True
            for cfg in configs:
                for k, v in zip(keys, cfg):
                    setattr(matmul_mma, k, v)
                matmul_mma.ID_TILES = id_tiles if cfg == default else ((0, cfg[:4] + cfg[5:]),)
                try:
                    run(xin)
                    got = o.copy_to_host()
                    run(xgrid)
                    got_g = o.copy_to_host()
                    t_m = time_ms(lambda i: run(xin), a.n)
                except Exception as e:        # a tile configuration over the register / shared memory limits
                    print(f"{name_} tile {'x'.join(map(str, cfg))}: {type(e).__name__}: {str(e)[:100]}",
                          flush=True)
                    failed += cfg == default
                    continue
                e_x, e_g = rel(got, ref), rel(got_g, ref_g)
                ok = e_x < TOL_X8 and e_g < TOL_GRID and not np.isnan(got).any()
                failed += not ok
                print(f"{name_} tile {'x'.join(map(str, cfg)):13s} err {e_x:.1e} (8-bit grid {e_g:.1e})"
                      f" {'ok' if ok else 'FAILED'}  float {flops / t_f / 1e9:6.1f} TFLOP/s {t_f:7.3f} ms"
                      f"  mma {flops / t_m / 1e9:6.1f} TFLOP/s {t_m:7.3f} ms  x{t_f / t_m:.1f}", flush=True)
            for k, v in zip(keys, default):
                setattr(matmul_mma, k, v)
            matmul_mma.ID_TILES = id_tiles
        dw = dwe = None
    print(f"{'FAILED: ' + str(failed) + ' checks' if failed else 'all checks ok'} ({time.time() - t_start:.0f} s)",
          flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
