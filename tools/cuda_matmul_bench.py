"""Benchmark of the CUDA matrix products (nbmoe/cuda/matmul.py) on a GPU.

T = 1 and 4: GB/s of weight bytes read (active experts only for mul_mat_id) next to a
device-to-device copy measured in the same run; T = 512: TFLOP/s. Weights are cycled through
copies larger than the L2, so every matrix-vector call reads from memory.

    python tools/cuda_matmul_bench.py --types Q4_0,Q8_0 --mmv-warps 2,4,8
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nbmoe.cuda  # noqa: E402,F401  (defines np.row_stack before numba.cuda is imported)
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import quantize  # noqa: E402
from numba import cuda  # noqa: E402

from nbmoe.cuda import matmul as mm  # noqa: E402


def time_ms(fn, n):
    """Median time of fn(i) in ms over n calls, by CUDA events around each call (after a warm-up)."""
    fn(0)
    cuda.synchronize()
    times = []
    for i in range(n):
        e0, e1 = cuda.event(), cuda.event()
        e0.record()
        fn(i)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return float(np.median(times))


def main(argv=None):
    p = argparse.ArgumentParser(description="CUDA mul_mat benchmark. Example: --types Q4_0,Q8_0")
    p.add_argument("--types", default="F16,Q8_0,Q4_0,Q4_1,Q5_0,Q5_1", help="comma-separated GGUF types")
    p.add_argument("--shapes", default="131072x4096,16384x16384", help="MxK list for T=1, 4 (large: device-bound)")
    p.add_argument("--gemm", default="4096x4096", help="MxK list for T=512")
    p.add_argument("--moe", default="64x8x8192x4096,128x8x768x2048", help="ExAxMxK list for mul_mat_id")
    p.add_argument("--mmv-warps", default=str(mm.MMV_WARPS), help="MMV_WARPS values to try")
    p.add_argument("-n", type=int, default=10, help="calls per timing")
    p.add_argument("--copy-mb", type=int, default=1024, help="size of the bandwidth reference copy")
    a = p.parse_args(argv)
    big = cuda.device_array(a.copy_mb << 18, np.float32)
    big2 = cuda.device_array(a.copy_mb << 18, np.float32)
    ms = time_ms(lambda i: big2.copy_to_device(big), 5)
    bw = 2 * big.nbytes / ms / 1e6
    big = big2 = None  # free the 2 GB
    print(f"device copy {bw:.0f} GB/s (read + write)")
    rng = np.random.default_rng(0)

    def weights(shape, qt):
        wf = rng.standard_normal((min(shape[-2], 4096),) + shape[-1:], dtype=np.float32)
        w = np.ascontiguousarray(quantize(wf, qt).view(np.uint8))       # tiled up: quantizing is slow
        reps = int(np.prod(shape[:-1])) // w.shape[0]
        return np.tile(w, (reps, 1)).reshape(shape[:-1] + (-1,))

    def per_call(fn, n):
        """ms per call of n back-to-back calls (device time once it exceeds the launch cost)."""
        return time_ms(lambda i: [fn(j) for j in range(n)], 3) / n

    x1 = cuda.to_device(np.ones((1, 64), np.float32))
    o1 = cuda.device_array((1, 64), np.float32)
    w1 = cuda.to_device(weights((64, 64), 2))
    mm.mul_mat(o1, w1, x1, 2)
    cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(100 * a.n):
        mm.mul_mat(o1, w1, x1, 2)
    cuda.synchronize()
    print(f"host time of one mul_mat launch: {(time.perf_counter() - t0) * 1e4 / a.n:.1f} us")
    for name in a.types.split(","):
        qt = int(GGMLQuantizationType[name])
        for shape in a.shapes.split(","):
            M, K = (int(v) for v in shape.split("x"))
            dw = cuda.to_device(weights((M, K), qt))
            nbytes = dw.nbytes
            for T in (1, 4):
                x = cuda.to_device(rng.standard_normal((T, K), dtype=np.float32))
                out = cuda.device_array((T, M), np.float32)
                for warps in (int(v) for v in a.mmv_warps.split(",")):
                    mm.MMV_WARPS = warps
                    t = per_call(lambda i: mm.mul_mat(out, dw, x, qt), a.n)
                    gbs = nbytes / t / 1e6
                    print(f"  {name:5s} T={T} warps={warps} {M:6d}x{K:<5d} {t * 1e3:8.1f} us {gbs:6.0f} GB/s"
                          f"  ({gbs / bw:.2f} of copy)")
            dw = None
        for shape in a.gemm.split(","):
            M, K = (int(v) for v in shape.split("x"))
            dw = cuda.to_device(weights((M, K), qt))
            x = cuda.to_device(rng.standard_normal((512, K), dtype=np.float32))
            out = cuda.device_array((512, M), np.float32)
            t = per_call(lambda i: mm.mul_mat(out, dw, x, qt), 3)
            print(f"  {name:5s} T=512 {M:6d}x{K:<5d} {t * 1e3:8.1f} us {2 * 512 * M * K / t / 1e9:6.1f} TFLOP/s")
        for case in a.moe.split(","):
            E, A, M, K = (int(v) for v in case.split("x"))
            dw = cuda.to_device(weights((E, M, K), qt))
            for T in (1, 512):
                ids = np.stack([rng.choice(E, A, replace=False) for _ in range(T)]).astype(np.int32)
                x = cuda.to_device(rng.standard_normal((T, 1, K), dtype=np.float32))
                out = cuda.device_array((T, A, M), np.float32)
                dids = cuda.to_device(ids)
                t = per_call(lambda i: mm.mul_mat_id(out, dw, x, dids, qt), a.n if T == 1 else 3)
                gbs = len(np.unique(ids)) * dw.nbytes / E / t / 1e6
                print(f"  {name:5s} id T={T:<3d} E{E} A{A} {M}x{K} {t * 1e3:8.1f} us {gbs:6.0f} GB/s of used"
                      f" experts {2 * T * A * M * K / t / 1e9:6.1f} TFLOP/s")
            dw = None


if __name__ == "__main__":
    main()
