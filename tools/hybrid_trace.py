"""Where a decode token's wall time goes, step by step, as the host sees it.

    python tools/hybrid_trace.py -m model.gguf -ngl 99 -ot exps=CPU -t 16 [-n 32]

Runs a short prompt, warms the decode plan (its CUDA graphs get recorded), then decodes -n
tokens with every step of the plan wrapped by a host clock. Each recorded CUDA graph is also
split into: the host's launch call, the device time between two events around it, and the
rest of the wait (the stream synchronisation's latency after the device finished). Prints one
row per step kind: calls a token, host microseconds a token and a call. --busy-us N swaps the
CPU steps (with -ot exps=CPU: the expert products) for N-microsecond spins, to price the GPU
side and the turn-taking free of the RAM bandwidth's swings.
"""
import argparse
import sys
import time
from collections import defaultdict

import numpy as np


def trace(llm, n_tokens, busy_us=0.0):
    plan = llm.plan(1, 1)
    acc, count = defaultdict(float), defaultdict(int)
    clock = time.perf_counter
    wrapped = []
    for (backend, what), step in zip(plan.labels, plan.steps):
        key = f"{backend} {what}"
        if what == "GRAPH" and getattr(step, "exec", None) is not None:
            wrapped.append(_graph_step(step, key, acc, count))
            continue

        if busy_us and backend == "CPU" and what != "GET_ROWS":
            step = _busy(busy_us * 1e-6)

        def timed(step=step, key=key):
            t0 = clock()
            step()
            acc[key] += clock() - t0
            count[key] += 1
        wrapped.append(timed)
    saved, plan.steps = plan.steps, wrapped
    token = llm.tokens[-1]
    t0 = clock()
    try:
        for _ in range(n_tokens):
            llm.eval([token])
    finally:
        plan.steps = saved
    wall = clock() - t0
    return wall / n_tokens, {k: (count[k] / n_tokens, acc[k] / n_tokens) for k in acc}


def _busy(seconds):
    """A CPU step that spins for a fixed time instead of computing (--busy-us)."""
    def step():
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    return step


def _graph_step(run, key, acc, count):
    from numba import cuda
    e0, e1 = cuda.event(), cuda.event()
    clock = time.perf_counter

    def step():
        t0 = clock()
        e0.record(run.stream)
        ta = clock()
        run._drv.cuGraphLaunch(run.exec, run._hstream)
        tb = clock()
        e1.record(run.stream)
        t1 = clock()
        acc[key + " launch (cuGraphLaunch alone)"] += tb - ta
        count[key + " launch (cuGraphLaunch alone)"] += 1
        run.stream.synchronize()
        t2 = clock()
        dev = e0.elapsed_time(e1) / 1e3
        acc[key + " launch"] += t1 - t0
        acc[key + " device"] += dev
        acc[key + " wait-after"] += max(0.0, (t2 - t1) - (dev - (t1 - t0)))
        acc[key] += t2 - t0
        count[key] += 1
        for part in ("launch", "device", "wait-after"):
            count[f"{key} {part}"] += 1
    return step


def main(argv=None):
    import nbmoe
    from nbmoe.cli.common import add_placement_args, add_repack_arg, placement_kwargs
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("-n", type=int, default=32, help="decode tokens traced")
    ap.add_argument("-c", "--ctx-size", type=int, default=512, help="KV cache slots")
    ap.add_argument("--busy-us", type=float, default=0.0,
                    help="replace each CPU step (but GET_ROWS) by a spin of this many "
                         "microseconds: the token's time is then the GPU segments and the "
                         "turn-taking alone, free of the RAM bandwidth's swings (the outputs "
                         "are garbage)")
    add_placement_args(ap)
    add_repack_arg(ap)
    a = ap.parse_args(argv)
    llm = nbmoe.load(a.model, n_ctx=a.ctx_size, threads=a.threads, repack=a.run_time_repack,
                      **placement_kwargs(a))
    ids = list(np.random.default_rng(0).integers(1, min(1000, llm.cfg.n_vocab), 16))
    llm.eval(ids)
    for _ in range(4):                      # compile, then record the graphs
        llm.eval([ids[-1]])
    per_token, rows = trace(llm, a.n, a.busy_us)
    print(f"token: {per_token * 1e6:9.1f} us ({1 / per_token:.1f} t/s)")
    print(f"{'step':42s} {'calls':>6s} {'us/token':>10s} {'us/call':>9s} {'share':>6s}")
    for k, (calls, secs) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        print(f"{k:42s} {calls:6.0f} {secs * 1e6:10.1f} {secs * 1e6 / max(calls, 1):9.2f} "
              f"{secs / per_token:6.1%}")


if __name__ == "__main__":
    sys.exit(main())
