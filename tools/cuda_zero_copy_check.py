"""How fast the GPU's expert kernels read weights that stay in RAM (-zce), on this machine.

    python tools/cuda_zero_copy_check.py [--experts 128 --rows 768 --cols 2048]

Random Q4_0 expert tensors of Qwen3-30B-A3B's shape (gate / up [E, F, D], down [E, D, F]) are
written to a file, mapped read-only and page-locked in place (nbmoe/cuda/host_memory.py, as
the engine does), and also copied to device memory. For 1, 3 and 8 random experts the fused
gate/up/GLU and down + sum kernels run on each copy: first checked bit-identical, then timed
by CUDA events with the launches queued behind a spinning kernel (device time only, no
launch gaps). Prints microseconds and GB/s of weights per kernel.
"""
import argparse
import mmap
import os
import sys
import tempfile

import numpy as np

import nbmoe.cuda  # noqa: F401  (numpy shim before numba.cuda)


def q4_0_bytes(rng, shape):
    """Random Q4_0 blocks (18 bytes: f16 d, 16 bytes of nibbles) with a sane scale."""
    a = rng.integers(0, 256, size=shape, dtype=np.uint8)
    a.reshape(-1, 18)[:, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return a


def main(argv=None):
    from numba import cuda

    from nbmoe.cuda import fused, host_memory
    from nbmoe.cuda.quants import Q4_0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--rows", type=int, default=768, help="F, an expert's hidden width")
    ap.add_argument("--cols", type=int, default=2048, help="D, the model width")
    ap.add_argument("--chosen", default="1,3,8", help="chosen experts a token (comma list)")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--spin", type=int, default=4_000_000,
                    help="iterations of the kernel that keeps the GPU busy while launches queue")
    a = ap.parse_args(argv)
    E, F, D = a.experts, a.rows, a.cols
    rng = np.random.default_rng(0)
    host = [q4_0_bytes(rng, (E, F, D // 32 * 18)), q4_0_bytes(rng, (E, F, D // 32 * 18)),
            q4_0_bytes(rng, (E, D, F // 32 * 18))]
    fd, path = tempfile.mkstemp(suffix=".bin")
    with os.fdopen(fd, "wb") as f:
        for h in host:
            f.write(h.tobytes())
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    os.unlink(path)
    views, off = [], 0
    for h in host:
        views.append(np.frombuffer(m, np.uint8, h.size, off).reshape(h.shape))
        off += h.nbytes
    host_memory.register_span(views)
    ram = [host_memory.device_view(v) for v in views]
    dev = [cuda.to_device(h) for h in host]
    xq_g = cuda.to_device(rng.integers(-64, 64, D // 4, dtype=np.int32))
    xds_g = cuda.to_device(rng.random(D // 16, np.float32) * 0.01)
    xq_d = cuda.to_device(rng.integers(-64, 64, 8 * F // 4, dtype=np.int32))
    xds_d = cuda.to_device(rng.random(8 * F // 16, np.float32) * 0.01)
    out_g, out_d = cuda.device_array((1, 8, F), np.float32), cuda.device_array((1, D), np.float32)

    @cuda.jit
    def spin(x, n):
        v = x[0]
        for _ in range(n):
            v = v * np.float32(0.999999) + np.float32(1e-7)
        x[0] = v
    spin_buf = cuda.device_array(1, np.float32)

    def glu(w, ids):
        fused.glu_id_q8(out_g[:, :ids.shape[1]], w[0], w[1], xq_g, xds_g, ids, 1, Q4_0, D, fused.ACT_SILU)

    def down(w, ids, wts):
        fused.down_combine_q8(out_d, w[2], xq_d, xds_d, ids, wts, Q4_0, F)

    ids = cuda.to_device(np.array([[E // 2, E - 1, 0]], np.int32))
    wts = cuda.to_device(np.full((1, 3), 0.3, np.float32))
    results = []
    for w in (dev, ram):
        glu(w, ids)
        down(w, ids, wts)
        results.append((out_g[:, :3].copy_to_host(), out_d.copy_to_host()))
    same = all(np.array_equal(x, y) for x, y in zip(*results))
    print(f"RAM-resident weights read in place: {'bit-identical' if same else 'DIFFERENT'} to device copies")
    print(f"{'weights':8s} {'experts':>7s} {'gate/up/GLU us':>15s} {'GB/s':>6s} {'down+sum us':>12s} {'GB/s':>6s}")
    for A in [int(v) for v in a.chosen.split(",")]:
        idss = [cuda.to_device(rng.choice(E, A, replace=False).astype(np.int32)[None]) for _ in range(a.reps)]
        wts = cuda.to_device(np.full((1, A), 0.1, np.float32))
        for name, w in (("device", dev), ("RAM", ram)):
            row = []
            for kernel, nbytes in ((lambda i: glu(w, idss[i]), A * 2 * host[0][0].nbytes),
                                   (lambda i: down(w, idss[i], wts), A * host[2][0].nbytes)):
                kernel(0)                                # compiled and warm before timing
                cuda.synchronize()
                evs = [(cuda.event(), cuda.event()) for _ in range(a.reps)]
                spin[1, 1](spin_buf, a.spin)             # the GPU busy while the launches queue
                for i, (e0, e1) in enumerate(evs):
                    e0.record()
                    kernel(i)
                    e1.record()
                evs[-1][1].synchronize()
                us = float(np.median([e0.elapsed_time(e1) * 1e3 for e0, e1 in evs]))
                row += [us, nbytes / max(us, 1e-9) / 1e3]
            print(f"{name:8s} {A:7d} {row[0]:15.1f} {row[1]:6.1f} {row[2]:12.1f} {row[3]:6.1f}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
