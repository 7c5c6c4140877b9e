"""llama-bench for nbmoe: prompt processing (pp) and token generation (tg) throughput.

    python -m nbmoe.bench                       # default model, pp512 and tg128
    python -m nbmoe.bench -m model.gguf -p 512,1024 -n 128 -t 1,2 -r 3 -o json
    python -m nbmoe.bench -m model.gguf -t 2 -rtr 0,1     # without and with run-time repacking
    python -m nbmoe.bench -m model.gguf -p 0 -n 128 -d 0,8192  # tg128 on an empty and an 8k cache

Each test runs once to warm up (a prompt twice: its CUDA graphs record on the second run),
then -r times from an empty cache (or one filled with -d tokens first, untimed); t/s is mean ± std over the repetitions. For tg the table
also shows the weight bytes the CPU reads from RAM per token (active experts only) turned into
GB/s, next to the streaming read bandwidth measured right after the test; with a GPU, a second
column counts all weights, wherever they are read.
"""
import argparse
import contextlib
import gc
import os
import platform
import sys
import time
from datetime import datetime, timezone

import numpy as np
from rich.console import Console
from rich.table import Table

from nbmoe.cli.checks import Parser, one_line_warnings
from nbmoe.cli.common import (add_engine_args, add_model_args, err_console, friendly_errors,
                              mpi_ranks, resolve_model)
from nbmoe.cli.measure import (configs, explain, gpu_info, human, int_list, load_config, model_facts,
                               parse_lists, print_json_csv, table_console)


def parse_args(argv=None):
    p = Parser(prog="python -m nbmoe.bench", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, lists=True)
    p.add_argument("-p", "--n-prompt", type=int_list, default=[512], help="prompt lengths (comma list)")
    p.add_argument("-n", "--n-gen", type=int_list, default=[128], help="tokens to generate (comma list)")
    p.add_argument("-d", "--n-depth", type=int_list, default=[0],
                   help="tokens in the cache before each test (comma list)")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="repetitions of each test")
    p.add_argument("-t", "--threads", type=int_list, default=None, help="threads (comma list; default: all cores)")
    p.add_argument("-b", "--batch-size", type=int, default=2048, help="logical batch (tokens per eval call)")
    p.add_argument("-o", "--output", choices=["md", "json", "csv"], default="md", help="output format")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the memory bandwidth measurement")
    p.add_argument("--explain", action="store_true",
                   help="print where every tensor lives and the schedule (splits, copies, causes)")
    p.add_argument("--timings", action="store_true",
                   help="print the time per op type, copies and overhead of each test "
                        "(per token; GPU steps are waited for; in recorded CUDA graphs each op is timed by CUDA events)")
    add_engine_args(p, lists=True)
    args = p.parse_args(argv)
    parse_lists(p, args)
    if not any(args.n_prompt + args.n_gen):
        p.error("nothing to run: every -p and -n is 0")
    return args


def fill_cache(llm, depth, n_batch, rng):
    """Empty the cache, then decode `depth` random tokens into it (untimed)."""
    llm.reset()
    ids = rng.integers(0, llm.cfg.n_vocab, depth).tolist()
    for s in range(0, depth, n_batch):
        llm._decode(ids[s:s + n_batch], all_logits=False)


def run_pp(llm, n_prompt, n_batch, rng, depth=0):
    ids = rng.integers(0, llm.cfg.n_vocab, n_prompt).tolist()
    fill_cache(llm, depth, n_batch, rng)
    t0 = time.perf_counter()
    for s in range(0, n_prompt, n_batch):
        llm._decode(ids[s:s + n_batch], all_logits=False)
    return time.perf_counter() - t0


def run_tg(llm, n_gen, rng, n_batch=2048, depth=0):
    fill_cache(llm, depth, n_batch, rng)
    tok = int(rng.integers(0, llm.cfg.n_vocab))
    t0 = time.perf_counter()
    for _ in range(n_gen):
        llm._decode([tok], all_logits=False)
    return time.perf_counter() - t0


def run_test(llm, kind, n, args, rng, depth=0, progress=None):
    from nbmoe.compiling import wait_ahead
    if kind == "pp":
        fn = lambda: run_pp(llm, n, args.batch_size, rng, depth)     # noqa: E731
    else:
        fn = lambda: run_tg(llm, n, rng, args.batch_size, depth)     # noqa: E731
        wait_ahead(progress)    # the helper compiles generation's kernels: load them, not again
    fn()  # warm-up
    if kind == "pp":
        fn()  # a prompt plan's second run records its CUDA graphs (the timed runs replay them)
    # timed runs start once a cold start's helper has ended: beside it, prompts on two cores
    # timed 46% slower
    wait_ahead(progress)
    # as timeit does: no cycle collection inside a timed run (a loaded model's ~300k objects
    # take the collector 0.1-0.4 s a full pass, which would land in a random repetition)
    gc.collect()
    gc.disable()
    try:
        with profiled(llm):
            return [fn() for _ in range(args.repetitions)]
    finally:
        gc.enable()


@contextlib.contextmanager
def profiled(llm):
    """With config.PROFILE_TIMED and a GPU: the CUDA profiler's range around the timed runs."""
    from nbmoe import config
    cuda = None
    if config.PROFILE_TIMED and any(b != "CPU" for b in llm.backends):
        from numba import cuda     # (not imported for a CPU-only model: ~0.3 s)
    if not hasattr(cuda, "profile_start"):      # none wanted, or Numba's CUDA simulator (no profiler)
        yield
        return
    cuda.synchronize()
    cuda.profile_start()
    try:
        yield
    finally:
        cuda.synchronize()
        cuda.profile_stop()


def main(argv=None):
    one_line_warnings()
    args = parse_args(argv)
    with mpi_ranks(args, (args.threads or [None])[0]), friendly_errors():
        import numba

        from nbmoe.compiling import CompileProgress
        from nbmoe.cpu.membw import read_bandwidth
        from nbmoe.engine import default_threads
        path = resolve_model(args.model)
        threads_list = args.threads or [default_threads()]
        need = max(args.n_depth) + max([1] + args.n_prompt + args.n_gen)
        rng = np.random.default_rng(0)
        rows = []
        llm = None
        for c in configs(args):
            ngl, ub, rtr = c["ngl"], c["ub"], c["rtr"]
            llm = None      # the previous model's memory (and repacked copies) go first, and
            gc.collect()    # now: its reference cycles freed inside a timed test would slow it
            llm = load_config(path, args, c, need, threads_list[0], quiet=args.output != "md")
            facts = model_facts(llm)
            if args.explain:
                explain(llm, ub)
            for threads in threads_list:
                llm.threads = threads
                numba.set_num_threads(threads)
                for kind, n, depth in tests(args):
                    # a cold start: a second process compiles generation's kernels during pp
                    ahead = [1] if kind == "pp" and any(k == "tg" for k, _, _ in tests(args)) else []
                    with CompileProgress(err_console, f"{kind}{n}, ngl {ngl}, ubatch {ub}, {threads} threads",
                                         llm, f"bench {kind}", ahead) as progress:
                        times = run_test(llm, kind, n, args, rng, depth, progress)
                    # the RAM's speed drifts on shared hosts: read it right after the test it rates
                    bw = read_bandwidth() if kind == "tg" and not args.no_bandwidth else None
                    rows.append(make_row(llm, path, facts, args, threads, kind, n, times,
                                         bw, ngl, ub, depth))
                    if args.output == "md":
                        err_console.print(f"  {test_name(rows[-1])} ngl={ngl} ub={ub} rtr={int(rtr)} "
                                          f"zce={rows[-1]['zero_copy_experts']} fa={llm.flash_attn} "
                                          f"fmoe={c['fmoe']} muge={c['muge']} uae={c['uae']} "
                                          f"t={threads}: {rows[-1]['avg_ts']:.2f} t/s")
                    if args.timings:
                        show_timings(llm, kind, n, args.batch_size, rng, depth)
        print_rows(rows, args.output, facts, args)


def tests(args):
    """(kind, n, depth) of every test, in llama-bench's order: the depths innermost."""
    return [(k, n, d) for k, ns in (("pp", args.n_prompt), ("tg", args.n_gen))
            for n in ns if n > 0 for d in args.n_depth]


def test_name(row):
    """llama-bench's test column: pp512, tg128, tg128 @ d8192."""
    name = f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"
    return name + (f" @ d{row['n_depth']}" if row["n_depth"] else "")


def show_timings(llm, kind, n, n_batch, rng, depth=0):
    """Run the test once more with every step timed (GPU steps waited for); print the
    breakdown per token. Decoding with CUDA graphs: a second table times each graph whole."""
    _timed_run(llm, kind, n, n_batch, rng, False, depth)
    if kind == "tg" and len(llm.backends) > 1:
        _timed_run(llm, kind, n, n_batch, rng, True, depth)


def _timed_run(llm, kind, n, n_batch, rng, whole_graphs, depth):
    from nbmoe.sched.explain import timings_table
    from nbmoe.sched.scheduler import new_timing_table
    fill_cache(llm, depth, n_batch, rng)
    acc = new_timing_table(whole_graphs)
    if llm.ep:
        llm.ep.timed.clear()
    t0 = time.perf_counter()
    if kind == "pp":
        ids = rng.integers(0, llm.cfg.n_vocab, n).tolist()
        for s in range(0, n, n_batch):
            llm._decode(ids[s:s + n_batch], all_logits=False, timings=acc)
    else:
        tok = int(rng.integers(0, llm.cfg.n_vocab))
        for _ in range(n):
            llm._decode([tok], all_logits=False, timings=acc)
    table = timings_table(acc, time.perf_counter() - t0, n)
    table.title = (f"{kind}{n}{', CUDA graphs timed whole' if whole_graphs else ''}: "
                   + (table.title or ""))
    Console(stderr=True, width=200).print(table)
    if llm.ep:      # --ep: the wait for the other ranks, per MoE layer
        per = {il: sec / n * 1e3 for il, sec in sorted(llm.ep.timed.items())}
        Console(stderr=True, width=200).print(
            "MPI wait per MoE layer (ms/token): " + ", ".join(f"blk.{il} {ms:.3f}" for il, ms in per.items()),
            highlight=False)


def make_row(llm, path, facts, args, threads, kind, n, times, bw, ngl, ub, depth=0):
    ts = np.array([n / t for t in times])
    gpus = [b for b in llm.backends if b != "CPU"]
    return dict(
        build_commit="nbmoe", build_number=0, cpu_info=platform.processor() or platform.machine(),
        gpu_info=gpu_info() if gpus else "", backends="CUDA" if gpus else "CPU",
        model_filename=os.path.basename(path), model_type=facts["label"],
        model_size=facts["size"], model_n_params=facts["n_params"], n_batch=args.batch_size,
        n_ubatch=ub, n_threads=threads, type_k=llm.kv.type_k, type_v=llm.kv.type_v, n_gpu_layers=ngl,
        flash_attn=llm.flash_attn, flash_attn_given=args.flash_attn is not None,
        repack=bool(llm.repacked), repack_seconds=llm.repack_stats["seconds"] if llm.repack_stats else 0.0,
        tensor_buft_overrides=";".join(args.override_tensor) or "none",
        zero_copy_experts=llm.zce_share,         # (-zce auto: the share at the test's end)
        fused_moe=int(llm.fused_moe), upload_all_experts=int(llm.upload_all_experts),
        merge_up_gate=int(llm.merge_up_gate),
        n_prompt=n if kind == "pp" else 0, n_gen=n if kind == "tg" else 0, n_depth=depth,
        test_time=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        avg_ns=int(np.mean(times) * 1e9), stddev_ns=int(np.std(times) * 1e9),
        avg_ts=float(ts.mean()), stddev_ts=float(ts.std()),
        samples_ns=[int(t * 1e9) for t in times], samples_ts=ts.tolist(),
        bytes_per_token=facts["bytes_per_token"], ram_bytes_per_token=facts["ram_bytes_per_token"],
        read_bw_gbs=bw,
        weight_gbs=float(ts.mean() * facts["bytes_per_token"] / 1e9) if kind == "tg" else None,
        ram_weight_gbs=float(ts.mean() * facts["ram_bytes_per_token"] / 1e9) if kind == "tg" else None,
    )


def print_rows(rows, fmt, facts, args=None):
    if fmt in ("json", "csv"):
        print_json_csv(rows, fmt)
        return
    table = Table(title="nbmoe bench", title_justify="left")
    show_gpu = any(r["n_gpu_layers"] or r["tensor_buft_overrides"] != "none" for r in rows)
    show_rtr = any(r["repack"] for r in rows)      # llama-bench shows a column once it varies
    show_zce = any(r["zero_copy_experts"] for r in rows)
    show_fa = any(r["flash_attn_given"] for r in rows)        # -fa given: its column
    show_fmoe, show_uae = getattr(args, "show_fmoe", False), getattr(args, "show_uae", False)
    show_muge = getattr(args, "show_muge", False)
    show_kv = any((r["type_k"], r["type_v"]) != ("f16", "f16") for r in rows)
    cols = ["model", "size", "params", "backend", "threads"] + (["ngl", "ot"] if show_gpu else []) + [
        "n_ubatch"] + (["type_k", "type_v"] if show_kv else []) + (["rtr"] if show_rtr else []) + (
        ["zce"] if show_zce else []) + (["fa"] if show_fa else []) + (["fmoe"] if show_fmoe else []) + (
        ["muge"] if show_muge else []) + (["uae"] if show_uae else []) + [
        "test", "t/s", "RAM GB/s (of read bw)"] + (["GB/s all weights"] if show_gpu else [])
    for col in cols:
        table.add_column(col, justify="left" if col in ("model", "backend", "test", "ot") else "right")
    for r in rows:
        test = test_name(r)
        gbs, all_gbs = "", []
        if r["ram_weight_gbs"]:       # weights read from RAM by the CPU, vs the CPU's bandwidth
            gbs = f"{r['ram_weight_gbs']:.1f}"
            if r["read_bw_gbs"]:
                gbs += f" ({r['ram_weight_gbs'] / r['read_bw_gbs']:.0%} of {r['read_bw_gbs']:.1f})"
        if show_gpu:
            all_gbs = [f"{r['weight_gbs']:.1f}" if r["weight_gbs"] is not None else ""]
        gpu = [str(r["n_gpu_layers"]), r["tensor_buft_overrides"]] if show_gpu else []
        table.add_row(r["model_type"], f"{r['model_size'] / 2**20:.1f} MiB", human(r["model_n_params"]),
                      r["backends"], str(r["n_threads"]), *gpu, str(r["n_ubatch"]),
                      *([r["type_k"], r["type_v"]] if show_kv else []),
                      *([str(int(r["repack"]))] if show_rtr else []),
                      *([str(r["zero_copy_experts"])] if show_zce else []),
                      *([r["flash_attn"]] if show_fa else []),
                      *([str(r["fused_moe"])] if show_fmoe else []),
                      *([str(r["merge_up_gate"])] if show_muge else []),
                      *([str(r["upload_all_experts"])] if show_uae else []), test,
                      f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}", gbs, *all_gbs)
    table_console().print(table)
    print(f"weights read per generated token: {facts['bytes_per_token'] / 2**20:.1f} MiB "
          f"(active experts only), {facts['ram_bytes_per_token'] / 2**20:.1f} MiB of them from RAM",
          file=sys.stdout)


if __name__ == "__main__":
    main()
