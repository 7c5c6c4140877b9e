"""Non-matmul CPU kernels in isolation: attention (prompt and decode) and the element-wise ops
of a layer at the shapes of SmolLM2-135M (H=9, Hkv=3, Dh=64, D=576, F=1536) and
Gemma-3-270m (H=4, Hkv=1, Dh=256, D=640, F=2048, sliding window 512).

    python tools/bench_ops.py -t 2                 # rich table
    python tools/bench_ops.py -t 1 --only attn -o json
    python tools/bench_ops.py -t 1 --clock thread    # CPU time: steadier on a shared machine

Attention FLOPs = 4 * T * (keys attended per query, summed over T) / T * H * Dh (two
products, a multiply and an add each). Times are the best of --reps calls (a shared machine).
"""
import argparse
import json
import time

import numba
import numpy as np

import nbmoe  # noqa: F401  (Numba settings before the kernels compile)
from nbmoe.cpu import attention as att
from nbmoe.cpu import ops

MODELS = {  # name: (H, Hkv, Dh, D, F, window)
    "smollm2": (9, 3, 64, 576, 1536, 0),
    "gemma3": (4, 1, 256, 640, 2048, 512),
}


CLOCK = time.perf_counter  # --clock thread: time.thread_time (only meaningful with -t 1)


def best_time(fn, reps):
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = CLOCK()
        fn()
        best = min(best, CLOCK() - t0)
    return best


def n_attended(T, pos0, window):
    """Keys attended, summed over the T queries."""
    p = pos0 + np.arange(T)
    n = p + 1 if window == 0 else np.minimum(p + 1, window)
    return int(n.sum())


def attn_case(H, Hkv, Dh, T, pos0, window, reps, rng):
    C = pos0 + T
    kc = rng.standard_normal((C, Hkv, Dh), dtype=np.float32).astype(np.float16).view(np.uint16)
    vc = rng.standard_normal((C, Hkv, Dh), dtype=np.float32).astype(np.float16).view(np.uint16)
    q = rng.standard_normal((T, H, Dh), dtype=np.float32)
    out = np.empty_like(q)
    scale = 1.0 / np.sqrt(Dh)
    s = best_time(lambda: att.attention(out, q, kc, vc, pos0, scale, window), reps)
    return s, 4.0 * n_attended(T, pos0, window) * H * Dh / s / 1e9


def elementwise_cases(H, Hkv, Dh, D, F, T, reps, rng):
    x = rng.standard_normal((T, D), dtype=np.float32)
    y = np.empty_like(x)
    w = rng.standard_normal(D, dtype=np.float32)
    qk = rng.standard_normal((T, H, Dh), dtype=np.float32)
    pos = np.arange(T, dtype=np.int32) + 100
    gu = rng.standard_normal((T, 2 * F), dtype=np.float32)
    h = np.empty((T, F), np.float32)
    return {
        "rms_norm": best_time(lambda: ops.rms_norm(y, x, w, 1e-6), reps),
        "add": best_time(lambda: ops.add(y, x, x), reps),
        "rope q": best_time(lambda: ops.rope(qk, pos, ops.rope_freqs(Dh, 10000.0), 1.0, False), reps),
        "swiglu": best_time(lambda: ops.swiglu(h, gu[:, :F], gu[:, F:]), reps),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-t", "--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--only", choices=["attn", "ops"], default=None)
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall",
                    help="wall time, or the calling thread's CPU time (with -t 1)")
    ap.add_argument("-o", "--output", choices=["table", "json"], default="table")
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.thread_time if args.clock == "thread" else time.perf_counter
    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    rows = []
    for name in args.models.split(","):
        H, Hkv, Dh, D, F, window = MODELS[name]
        if args.only in (None, "attn"):
            for T, pos0 in ((512, 0), (7, 100), (1, 63), (1, 190), (1, 1000)):
                s, gf = attn_case(H, Hkv, Dh, T, pos0, window, args.reps, rng)
                rows.append(dict(model=name, op="attention", T=T, pos0=pos0, us=s * 1e6,
                                 gflops=gf))
        if args.only in (None, "ops"):
            for op, s in elementwise_cases(H, Hkv, Dh, D, F, 512, args.reps, rng).items():
                rows.append(dict(model=name, op=op, T=512, pos0=0, us=s * 1e6, gflops=None))
    if args.output == "json":
        print(json.dumps(rows, indent=1))
        return
    from rich.console import Console
    from rich.table import Table
    tab = Table(title=f"CPU ops in isolation, {args.threads} threads, {args.clock} clock "
                      f"(best of {args.reps})")
    for c in ("model", "op", "T", "pos0", "us", "GFLOP/s"):
        tab.add_column(c, justify="right")
    for r in rows:
        gf = "" if r["gflops"] is None else f"{r['gflops']:.1f}"
        tab.add_row(r["model"], r["op"], str(r["T"]), str(r["pos0"]), f"{r['us']:.1f}", gf)
    Console().print(tab)


if __name__ == "__main__":
    main()
