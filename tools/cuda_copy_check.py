"""What a hybrid decode layer's small host <-> GPU copies cost inside a CUDA graph.

    python tools/cuda_copy_check.py [--reps 2000]

Each case is a CUDA graph (recorded as nbmoe records decode steps) replayed --reps times,
each replay followed by a stream synchronisation, timed by the host: a tiny kernel alone,
then with 8 KB copies added (pinned host <-> device: one H2D, three D2H as a hybrid layer
makes), with the three D2H copies merged into one, and with the kernel writing its output
straight into mapped host memory instead of a copy. Prints microseconds per replay.
"""
import argparse
import time

import numpy as np

if not hasattr(np, "row_stack"):      # numba-cuda 0.30 with numpy >= 2.5
    np.row_stack = np.vstack

from numba import cuda  # noqa: E402

from nbmoe.cuda.graphs import GraphRun  # noqa: E402


@cuda.jit
def touch(out, x):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = x[i] + np.float32(1.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2000)
    a = ap.parse_args()
    n = 2048                                    # 8 KB of float32: one model-width row
    stream = cuda.stream()
    d_x, d_out = cuda.to_device(np.ones(n, np.float32)), cuda.device_array(n, np.float32)
    d_parts = [cuda.device_array(n, np.float32) for _ in range(3)]
    d_three = cuda.device_array(3 * n, np.float32)
    h_in = cuda.pinned_array(n, np.float32)
    h_parts = [cuda.pinned_array(n, np.float32) for _ in range(3)]
    h_three = cuda.pinned_array(3 * n, np.float32)
    mapped = cuda.mapped_array(n, np.float32)
    h_in[:] = 1.0
    grid = ((n + 255) // 256, 256, stream)

    def kernel():
        touch[grid](d_out, d_x)

    def h2d():
        d_x.copy_to_device(h_in, stream=stream)

    def d2h_three():
        for d, h in zip(d_parts, h_parts):
            d.copy_to_host(h, stream=stream)

    def d2h_merged():
        d_three.copy_to_host(h_three, stream=stream)

    def kernel_to_mapped():
        touch[grid](mapped, d_x)

    cases = [
        ("kernel", [kernel]),
        ("kernel x 4", [kernel] * 4),
        ("kernel + 1 H2D", [h2d, kernel]),
        ("kernel + 3 D2H", [kernel, d2h_three]),
        ("kernel + 1 D2H (3 merged)", [kernel, d2h_merged]),
        ("H2D + kernel + 3 D2H", [h2d, kernel, d2h_three]),
        ("kernel writing mapped host memory", [kernel_to_mapped]),
    ]
    print(f"{'case':40s} {'us / replay + sync':>18s}")
    for name, steps in cases:
        run = GraphRun(steps, stream)
        for _ in range(3):                       # plain, then record, then replay
            run()
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(a.reps):
                run()
            best = min(best, (time.perf_counter() - t0) / a.reps)
        print(f"{name:40s} {best * 1e6:18.2f}")
    assert np.allclose(mapped, 2.0)


if __name__ == "__main__":
    main()
