"""A decoding MoE layer's CPU experts as two parallel regions (fused.glu_id, then
fused.down_combine) against one (fused.expert_ffn), alternated round by round in one process:

    python tools/expert_region_ab.py -t 16 [--experts 4,6] [--gap-us 80,0] [--rounds 9]

DeepSeek-V2-Lite's expert shapes (64 experts of 1408 x 2048, Q4_0 gate / up, Q5_0 down: the
same bytes as its Q4_K files' rows), A chosen at random per call; between calls the host spins
--gap-us microseconds, as it waits for a hybrid layer's GPU part while the team sleeps. Prints
the median microseconds a call and the expert bytes read a second, per form.
"""
import argparse
import time

import numba
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

import nbmoe  # noqa: F401  (Numba settings before the kernels compile)
from nbmoe.cpu import fused, matmul

E, D, F = 64, 2048, 1408
QG, QD = int(Q.Q4_0), int(Q.Q5_0)


def experts(rng, qtype, rows, cols):
    """E experts of one random quantized matrix (quantizing 64 in Python takes minutes)."""
    one = quantize(rng.standard_normal((rows, cols)).astype(np.float32), Q(qtype))
    return np.ascontiguousarray(np.broadcast_to(one, (E,) + one.shape))


def spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def compare(w, A, gap_s, rounds, calls, rng):
    wg, wu, wd = w
    x = rng.standard_normal((1, 1, D)).astype(np.float32)
    wts = rng.random((1, A)).astype(np.float32)
    i8 = (matmul._int8(QG), matmul._int8(QD))
    steps = (matmul.expert_item_rows(F, wg.shape[2], 1, QG),
             matmul.expert_item_rows(D, A * wd.shape[2], 1, QD))
    g, out = np.zeros((1, A, F), np.float32), np.zeros((1, D), np.float32)

    def two(ids):
        fused.glu_id(g, wg, wu, x, ids, QG, i8[0], steps[0], fused.ACT_SILU)
        fused.down_combine(out, wd, g, ids, wts, fused.EMPTY, QD, i8[1], steps[1], numba.get_num_threads())

    def one(ids):
        fused.expert_ffn(out, g, wg, wu, wd, x, ids, wts, (QG, QD), i8, steps, fused.ACT_SILU)

    forms = {"two regions": two, "one region": one}
    medians = {name: [] for name in forms}
    for r in range(rounds + 1):                       # round 0 compiles and warms, untimed
        for name in (list(forms) if r % 2 else list(forms)[::-1]):
            times = []
            for _ in range(calls):
                ids = rng.choice(E, A, replace=False).astype(np.int32)[None]
                t0 = time.perf_counter()
                forms[name](ids)
                times.append(time.perf_counter() - t0)
                spin(gap_s)
            if r:
                medians[name].append(np.median(times))
    mb = A * (wg[0].nbytes + wu[0].nbytes + wd[0].nbytes) / 1e6
    print(f"{A} experts, host spins {gap_s * 1e6:.0f} us between calls, {numba.get_num_threads()} "
          f"threads, {mb:.1f} MB a call")
    for name, m in medians.items():
        med = np.median(m)
        print(f"  {name:12s} {med * 1e6:7.0f} us  {mb / med / 1e3:6.1f} GB/s   rounds "
              f"{[round(v * 1e6) for v in m]}")
    return {name: float(np.median(m)) for name, m in medians.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-t", "--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    ap.add_argument("--experts", default="4,6", help="experts a call (the CPU's share of A)")
    ap.add_argument("--gap-us", default="80,0", help="host spin between calls, microseconds")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--calls", type=int, default=100, help="calls a round (its median counts)")
    a = ap.parse_args(argv)
    numba.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    w = (experts(rng, QG, F, D), experts(rng, QG, F, D), experts(rng, QD, D, F))
    return [compare(w, int(A), float(gap) * 1e-6, a.rounds, a.calls, rng)
            for A in a.experts.split(",") for gap in a.gap_us.split(",")]


if __name__ == "__main__":
    main()
