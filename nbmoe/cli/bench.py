"""llama-bench for nbmoe: prompt processing (pp) and token generation (tg) throughput.

    python -m nbmoe.bench                       # default model, pp512 and tg128
    python -m nbmoe.bench -m model.gguf -p 512,1024 -n 128 -t 1,2 -r 3 -o json
    python -m nbmoe.bench -m model.gguf -t 2 -rtr 0,1     # without and with run-time repacking

Each test runs once to warm up, then -r times from an empty cache; t/s is mean ± std over
the repetitions. For tg the table also shows the weight bytes the CPU reads from RAM per token
(active experts only) turned into GB/s, next to the streaming read bandwidth measured in this
run; with a GPU, a second column counts all weights, wherever they are read.
"""
import argparse
import csv
import io
import json
import os
import platform
import sys
import time
from collections import defaultdict
from datetime import datetime, timezone

import numpy as np
from gguf import LlamaFileType
from rich.console import Console
from rich.table import Table

from nbmoe.cli.checks import Parser, check_threads, check_values, int_list_arg, one_line_warnings
from nbmoe.cli.common import (add_cache_type_args, add_model_args, add_placement_args, add_repack_arg,
                         err_console, friendly_errors, placement_kwargs, resolve_model, zce_value)


def int_list(s):
    try:
        return [int(v) for v in str(s).split(",") if v.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {s!r}") from None


def parse_args(argv=None):
    p = Parser(prog="python -m nbmoe.bench", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, lists=True)
    p.add_argument("-p", "--n-prompt", type=int_list, default=[512], help="prompt lengths (comma list)")
    p.add_argument("-n", "--n-gen", type=int_list, default=[128], help="tokens to generate (comma list)")
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
    add_repack_arg(p, lists=True)
    add_placement_args(p, lists=True)
    add_cache_type_args(p, lists=True)
    args = p.parse_args(argv)
    lists = {dest: int_list_arg(p, dest, getattr(args, dest))
             for dest in ("n_gpu_layers", "ubatch_size", "run_time_repack")}
    try:
        lists["zero_copy_experts"] = [zce_value(v.strip()) for v in str(args.zero_copy_experts).split(",")
                                      if v.strip()]
    except argparse.ArgumentTypeError as e:
        p.error(f"argument -zce/--zero-copy-experts: {e}")
    check_values(p, {**vars(args), **lists})
    args.threads = check_threads(p, args.threads)
    if not any(args.n_prompt + args.n_gen):
        p.error("nothing to run: every -p and -n is 0")
    args.ngl_list, args.ub_list, args.zce_list = (lists["n_gpu_layers"], lists["ubatch_size"],
                                                  lists["zero_copy_experts"])
    args.rtr_list = [bool(v) for v in lists["run_time_repack"]]
    return args


def model_facts(llm):
    """Size, parameter count and weight bytes read per generated token (active experts)."""
    cfg = llm.cfg         # a NextN block is neither loaded nor read (as llama.cpp without MTP)
    tensors = {n: t for n, t in llm.file.tensors.items() if cfg.runs_tensor(n)}
    size = sum(t.n_bytes for t in tensors.values())
    n_params = sum(int(np.prod(t.ne)) for t in tensors.values())
    per_token = ram_per_token = 0.0
    for name, t in tensors.items():
        if name.endswith("_exps.weight"):
            n = t.n_bytes * cfg.n_expert_used / cfg.n_expert
        elif name == "token_embd.weight" and "output.weight" in tensors:
            n = t.n_bytes / cfg.n_vocab        # one row looked up
        else:
            n = t.n_bytes
        per_token += n
        if llm.placement[name][0] == "CPU":   # generation never offloads: read from RAM
            ram_per_token += n
    ftype = file_type_name(llm.file.meta, tensors)
    experts = f"{cfg.n_expert}x" if cfg.is_moe else ""
    label = f"{cfg.arch} {experts}{human(n_params)} {ftype}"
    return dict(size=size, n_params=n_params, bytes_per_token=per_token,
                ram_bytes_per_token=ram_per_token, label=label)


def file_type_name(meta, tensors):
    """llama.cpp's name for the file's main quantization (general.file_type), e.g. Q4_1."""
    try:
        return LlamaFileType(int(meta["general.file_type"])).name.removeprefix("MOSTLY_")
    except (KeyError, ValueError):
        by_type = defaultdict(int)
        for t in tensors.values():
            by_type[t.type_name] += t.n_bytes
        return max(by_type, key=by_type.get)


def human(n):
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}" if n < 10 * div else f"{n / div:.0f}{unit}"
    return str(n)


def run_pp(llm, n_prompt, n_batch, rng):
    ids = rng.integers(0, llm.cfg.n_vocab, n_prompt).tolist()
    llm.reset()
    t0 = time.perf_counter()
    for s in range(0, n_prompt, n_batch):
        llm._decode(ids[s:s + n_batch], all_logits=False)
    return time.perf_counter() - t0


def run_tg(llm, n_gen, rng):
    llm.reset()
    tok = int(rng.integers(0, llm.cfg.n_vocab))
    t0 = time.perf_counter()
    for _ in range(n_gen):
        llm._decode([tok], all_logits=False)
    return time.perf_counter() - t0


def run_test(llm, kind, n, args, rng):
    fn = (lambda: run_pp(llm, n, args.batch_size, rng)) if kind == "pp" else (lambda: run_tg(llm, n, rng))
    fn()  # warm-up
    return [fn() for _ in range(args.repetitions)]


def main(argv=None):
    one_line_warnings()
    args = parse_args(argv)
    with friendly_errors():
        import numba

        from nbmoe.compiling import CompileProgress, wait_ahead
        from nbmoe.cpu.membw import read_bandwidth
        from nbmoe.engine import default_threads, load
        path = resolve_model(args.model)
        threads_list = args.threads or [default_threads()]
        need = max([1] + args.n_prompt + args.n_gen)
        rng = np.random.default_rng(0)
        rows, bw = [], {}
        llm = None
        for ngl, ub, rtr, zce, ctk, ctv in [(g, u, r, z, k, v) for g in args.ngl_list for u in args.ub_list
                                            for r in args.rtr_list for z in args.zce_list
                                            for k in args.cache_type_k for v in args.cache_type_v]:
            llm = None      # the previous model's memory (and repacked copies) go first
            llm = load(path, n_ctx=need, threads=threads_list[0], n_ubatch=ub, repack=rtr,
                       cache_type_k=ctk, cache_type_v=ctv, **placement_kwargs(args, ngl, zce))
            facts = model_facts(llm)
            if args.output == "md":
                err_console.print(f"  {llm.kv.summary()}")
            if llm.repack_stats and args.output == "md":
                s = llm.repack_stats
                err_console.print(f"  -rtr: {s['tensors']} tensors, {s['bytes'] / 2**20:.1f} MiB "
                                  f"repacked in {s['seconds']:.2f} s")
            if args.explain:
                explain(llm, ub)
            for threads in threads_list:
                llm.threads = threads
                numba.set_num_threads(threads)
                if not args.no_bandwidth and threads not in bw:
                    bw[threads] = read_bandwidth()
                for kind, n in tests(args):
                    # a cold start: a second process compiles generation's kernels during pp
                    ahead = [1] if kind == "pp" and any(k == "tg" for k, _ in tests(args)) else []
                    with CompileProgress(err_console, f"{kind}{n}, ngl {ngl}, ubatch {ub}, {threads} threads",
                                         llm, f"bench {kind}", ahead) as progress:
                        if kind == "tg":
                            wait_ahead(progress)
                        times = run_test(llm, kind, n, args, rng)
                    rows.append(make_row(llm, path, facts, args, threads, kind, n, times,
                                         bw.get(threads), ngl, ub))
                    if args.output == "md":
                        err_console.print(f"  {kind}{n} ngl={ngl} ub={ub} rtr={int(rtr)} "
                                          f"zce={rows[-1]['zero_copy_experts']} t={threads}: "
                                          f"{rows[-1]['avg_ts']:.2f} t/s")
                    if args.timings:
                        show_timings(llm, kind, n, args.batch_size, rng)
        print_rows(rows, args.output, facts)


def tests(args):
    return [("pp", n) for n in args.n_prompt if n > 0] + [("tg", n) for n in args.n_gen if n > 0]


def explain(llm, ubatch):
    from nbmoe.sched.explain import legend, placement_table, schedule_table, unfused_lines
    console = Console(stderr=True, width=200)
    console.print(placement_table(llm.placement))
    console.print(schedule_table(llm, sorted({1, ubatch})))
    console.print(legend())
    for line in unfused_lines(llm, sorted({1, ubatch})):
        console.print(line, highlight=False)
    if llm.cfg.n_nextn:
        n, il = llm.cfg.n_nextn, llm.cfg.n_layer
        console.print(f"{n} NextN layer{'s' * (n > 1)} not run (blk.{il}"
                      f"{f'..{il + n - 1}' if n > 1 else ''}: the file's draft head)", highlight=False)


def show_timings(llm, kind, n, n_batch, rng):
    """Run the test once more with every step timed (GPU steps waited for); print the
    breakdown per token. Decoding with CUDA graphs: a second table times each graph whole."""
    _timed_run(llm, kind, n, n_batch, rng, False)
    if kind == "tg" and len(llm.backends) > 1:
        _timed_run(llm, kind, n, n_batch, rng, True)


def _timed_run(llm, kind, n, n_batch, rng, whole_graphs):
    from nbmoe.sched.explain import timings_table
    from nbmoe.sched.scheduler import new_timing_table
    llm.reset()
    acc = new_timing_table(whole_graphs)
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


def make_row(llm, path, facts, args, threads, kind, n, times, bw, ngl, ub):
    ts = np.array([n / t for t in times])
    gpus = [b for b in llm.backends if b != "CPU"]
    return dict(
        build_commit="nbmoe", build_number=0, cpu_info=platform.processor() or platform.machine(),
        gpu_info=gpu_info() if gpus else "", backends="CUDA" if gpus else "CPU",
        model_filename=os.path.basename(path), model_type=facts["label"],
        model_size=facts["size"], model_n_params=facts["n_params"], n_batch=args.batch_size,
        n_ubatch=ub, n_threads=threads, type_k=llm.kv.type_k, type_v=llm.kv.type_v, n_gpu_layers=ngl,
        repack=bool(llm.repacked), repack_seconds=llm.repack_stats["seconds"] if llm.repack_stats else 0.0,
        tensor_buft_overrides=";".join(args.override_tensor) or "none",
        zero_copy_experts=llm.zce_share,         # (-zce auto: the share at the test's end)
        n_prompt=n if kind == "pp" else 0, n_gen=n if kind == "tg" else 0,
        test_time=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        avg_ns=int(np.mean(times) * 1e9), stddev_ns=int(np.std(times) * 1e9),
        avg_ts=float(ts.mean()), stddev_ts=float(ts.std()),
        samples_ns=[int(t * 1e9) for t in times], samples_ts=ts.tolist(),
        bytes_per_token=facts["bytes_per_token"], ram_bytes_per_token=facts["ram_bytes_per_token"],
        read_bw_gbs=bw,
        weight_gbs=float(ts.mean() * facts["bytes_per_token"] / 1e9) if kind == "tg" else None,
        ram_weight_gbs=float(ts.mean() * facts["ram_bytes_per_token"] / 1e9) if kind == "tg" else None,
    )


def gpu_info():
    from numba import cuda
    try:
        return ", ".join(str(g.name.decode() if isinstance(g.name, bytes) else g.name) for g in cuda.gpus)
    except Exception:
        return "CUDA"


def print_rows(rows, fmt, facts):
    if fmt == "json":
        print(json.dumps(rows, indent=2))
        return
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=[k for k in rows[0] if not k.startswith("samples")])
        w.writeheader()
        for r in rows:
            w.writerow({k: v for k, v in r.items() if not k.startswith("samples")})
        print(buf.getvalue(), end="")
        return
    table = Table(title="nbmoe bench", title_justify="left")
    show_gpu = any(r["n_gpu_layers"] or r["tensor_buft_overrides"] != "none" for r in rows)
    show_rtr = any(r["repack"] for r in rows)      # llama-bench shows a column once it varies
    show_zce = any(r["zero_copy_experts"] for r in rows)
    show_kv = any((r["type_k"], r["type_v"]) != ("f16", "f16") for r in rows)
    cols = ["model", "size", "params", "backend", "threads"] + (["ngl", "ot"] if show_gpu else []) + [
        "n_ubatch"] + (["type_k", "type_v"] if show_kv else []) + (["rtr"] if show_rtr else []) + (
        ["zce"] if show_zce else []) + [
        "test", "t/s", "RAM GB/s (of read bw)"] + (["GB/s all weights"] if show_gpu else [])
    for col in cols:
        table.add_column(col, justify="left" if col in ("model", "backend", "test", "ot") else "right")
    for r in rows:
        test = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
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
                      *([str(r["zero_copy_experts"])] if show_zce else []), test,
                      f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}", gbs, *all_gbs)
    console = Console()
    if not console.is_terminal:   # piped: do not wrap the table at 80 columns
        console = Console(width=200)
    console.print(table)
    print(f"weights read per generated token: {facts['bytes_per_token'] / 2**20:.1f} MiB "
          f"(active experts only), {facts['ram_bytes_per_token'] / 2**20:.1f} MiB of them from RAM",
          file=sys.stdout)


if __name__ == "__main__":
    main()
