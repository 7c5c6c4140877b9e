"""Where a generated token's time goes on the CPU: node-by-node steps vs whole blocks
(nbmoe/cpu/blocks.py), A/B in one process, alternated run by run (a shared machine).

    taskset -c 0 python tools/tg_overhead.py -m model.gguf -t 1 -n 64 -r 5
    python tools/tg_overhead.py --tiny-like model.gguf -t 2     # fixed cost per token
    taskset -c 0 python tools/tg_overhead.py -m model.gguf -t 1 --clock thread   # CPU time

For each mode: steps per token (Python calls into compiled code), parallel regions per
token, median ms per token (-r runs of -n tokens from an empty cache, modes alternated), and
the per-step timings of one more run (--timings' table: the sum of the steps' own times and
the rest, the Python scheduling between them). --tiny-like writes a random model with the
given model's layer count and architecture but tiny widths (D 64, F 128, vocab ~300): its
kernels do almost no work, so its ms per token is the fixed cost per token (dispatch,
Python, parallel regions' fork and join).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import numba

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import nbmoe  # noqa: E402
from nbmoe.sched import fusion  # noqa: E402
from nbmoe.cli.common import resolve_model  # noqa: E402
from nbmoe.sched.scheduler import new_timing_table  # noqa: E402

MODES = {"nodes": False, "blocks": True}     # fusion.BLOCKS per mode


def regions(plan):
    """Parallel regions a token opens (short contexts: attention stays single-threaded)."""
    n = 0
    for step, (_, label) in zip(plan.steps, plan.labels):
        n += getattr(step, "regions", 1 if "MUL_MAT" in label else 0)
    return n


def tiny_like(path):
    """A tiny random model with the layer count and architecture of the GGUF at path."""
    from make_model import make_model
    llm = nbmoe.load(path, n_ctx=8)
    cfg = llm.cfg
    arch = cfg.arch if cfg.arch in ("llama", "qwen3", "qwen3moe") else "qwen3"
    out = os.path.join(tempfile.mkdtemp(), "tiny.gguf")
    moe = dict(n_expert=cfg.n_expert, n_expert_used=cfg.n_expert_used) if cfg.is_moe else {}
    if moe and arch == "qwen3":
        arch, moe["n_ff_exp"] = "qwen3moe", 128
    return make_model(out, arch, n_layer=cfg.n_layer, n_embd=64, n_head=4, n_head_kv=2,
                      head_dim=32 if arch != "llama" else None, n_ff=128,
                      default_type="Q4_1" if cfg.arch == "llama" else "Q8_0", **moe)


CLOCK = time.perf_counter   # --clock thread: time.thread_time


def run_tokens(llm, n):
    llm.reset()
    t0 = CLOCK()
    for _ in range(n):
        llm._decode([5], all_logits=False)
    return (CLOCK() - t0) / n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", help="GGUF file (default: the built-in default model)")
    ap.add_argument("--tiny-like", metavar="GGUF", help="measure a tiny model shaped like this one")
    ap.add_argument("-t", "--threads", type=int, default=2, help="threads (default: 2)")
    ap.add_argument("-n", "--n-gen", type=int, default=64, help="tokens per run (default: 64)")
    ap.add_argument("-r", "--repetitions", type=int, default=5, help="runs per mode (default: 5)")
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall",
                    help="thread: the main thread's CPU time, steadier on a shared machine (with -t 1 "
                         "all work runs on it; with -t 2 it leaves out the other thread's work)")
    args = ap.parse_args(argv)
    global CLOCK
    CLOCK = time.thread_time if args.clock == "thread" else time.perf_counter
    path = tiny_like(args.tiny_like) if args.tiny_like else resolve_model(args.model)
    llm = nbmoe.load(path, n_ctx=args.n_gen + 1, threads=args.threads)
    numba.set_num_threads(args.threads)
    plans = {}
    for mode, blocks in MODES.items():
        fusion.BLOCKS = blocks
        llm._plans.clear()
        plans[mode] = llm.plan(1, 1)
    times = {mode: [] for mode in MODES}
    for r in range(args.repetitions + 1):          # the first round warms up
        for mode in (MODES if r % 2 else reversed(MODES)):
            llm._plans[(1, 1, 0)] = plans[mode]
            t = run_tokens(llm, args.n_gen)
            if r:
                times[mode].append(t)
    print(f"{os.path.basename(path)}, {args.threads} threads, {args.n_gen} tokens x {args.repetitions}")
    print(f"{'mode':8} {'steps':>6} {'regions':>8} {'ms/token':>9} {'t/s':>7} "
          f"{'steps sum':>10} {'between':>8}   (medians; per-step timings of one run)")
    for mode, plan in plans.items():
        llm._plans[(1, 1, 0)] = plan
        acc = new_timing_table()
        llm.reset()
        t0 = time.perf_counter()
        for _ in range(args.n_gen):
            llm._decode([5], all_logits=False, timings=acc)
        wall = (time.perf_counter() - t0) / args.n_gen     # the step timings are wall-clock
        steps = sum(acc.values()) / args.n_gen
        med = statistics.median(times[mode])
        print(f"{mode:8} {len(plan.steps):6d} {regions(plan):8d} {med * 1e3:9.3f} {1 / med:7.1f} "
              f"{steps * 1e3:10.3f} {(wall - steps) * 1e3:8.3f}")
        print("         runs ms/token: " + " ".join(f"{t * 1e3:.2f}" for t in times[mode]))


if __name__ == "__main__":
    main()
