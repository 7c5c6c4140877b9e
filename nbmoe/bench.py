"""llama-bench for nbmoe: prompt processing (pp) and token generation (tg) throughput.

    python -m nbmoe.bench                       # default model, pp512 and tg128
    python -m nbmoe.bench -m model.gguf -p 512,1024 -n 128 -t 1,2 -r 3 -o json

Each test runs once to warm up, then -r times from an empty cache; t/s is mean ± std over
the repetitions. For tg the table also shows the weight bytes read per token (active
experts only) turned into GB/s, next to the streaming read bandwidth measured in this run.
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

from .cli_common import add_model_args, friendly_errors, resolve_model, err_console


def int_list(s):
    return [int(v) for v in str(s).split(",") if v.strip() != ""]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m nbmoe.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("-p", "--n-prompt", type=int_list, default=[512], help="prompt lengths (comma list)")
    p.add_argument("-n", "--n-gen", type=int_list, default=[128], help="tokens to generate (comma list)")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="repetitions of each test")
    p.add_argument("-t", "--threads", type=int_list, default=None, help="threads (comma list; default: all cores)")
    p.add_argument("-b", "--batch-size", type=int, default=2048, help="logical batch (tokens per eval call)")
    p.add_argument("-o", "--output", choices=["md", "json", "csv"], default="md", help="output format")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the memory bandwidth measurement")
    args = p.parse_args(argv)
    args.ubatch_list = [args.ubatch_size]
    return args


def model_facts(llm):
    """Size, parameter count and weight bytes read per generated token (active experts)."""
    cfg, tensors = llm.cfg, llm.file.tensors
    size = sum(t.n_bytes for t in tensors.values())
    n_params = sum(int(np.prod(t.ne)) for t in tensors.values())
    per_token = 0.0
    for name, t in tensors.items():
        if name.endswith("_exps.weight"):
            per_token += t.n_bytes * cfg.n_expert_used / cfg.n_expert
        elif name == "token_embd.weight" and llm.output_weight != name:
            per_token += t.n_bytes / cfg.n_vocab        # one row looked up
        else:
            per_token += t.n_bytes
    ftype = file_type_name(llm.file.meta, tensors)
    experts = f"{cfg.n_expert}x" if cfg.is_moe else ""
    label = f"{cfg.arch} {experts}{human(n_params)} {ftype}"
    return dict(size=size, n_params=n_params, bytes_per_token=per_token, label=label)


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
    args = parse_args(argv)
    with friendly_errors():
        import numba

        from .cpu.membw import read_bandwidth
        from .engine import default_threads, load
        path = resolve_model(args.model)
        threads_list = args.threads or [default_threads()]
        need = max([1] + args.n_prompt + args.n_gen)
        llm = load(path, n_ctx=need, threads=threads_list[0], n_ubatch=args.ubatch_size)
        facts = model_facts(llm)
        rng = np.random.default_rng(0)
        rows = []
        for threads in threads_list:
            llm.threads = threads
            numba.set_num_threads(threads)
            bw = None if args.no_bandwidth else read_bandwidth()
            tests = [("pp", n) for n in args.n_prompt if n > 0] + [("tg", n) for n in args.n_gen if n > 0]
            for kind, n in tests:
                with err_console.status(f"{kind}{n}, {threads} threads"):
                    times = run_test(llm, kind, n, args, rng)
                rows.append(make_row(llm, path, facts, args, threads, kind, n, times, bw))
                if args.output == "md":
                    err_console.print(f"  {kind}{n} t={threads}: {rows[-1]['avg_ts']:.2f} t/s")
        print_rows(rows, args.output, facts)


def make_row(llm, path, facts, args, threads, kind, n, times, bw):
    ts = np.array([n / t for t in times])
    return dict(
        build_commit="nbmoe", build_number=0, cpu_info=platform.processor() or platform.machine(),
        gpu_info="", backends="CPU", model_filename=os.path.basename(path), model_type=facts["label"],
        model_size=facts["size"], model_n_params=facts["n_params"], n_batch=args.batch_size,
        n_ubatch=args.ubatch_size, n_threads=threads, type_k="f16", type_v="f16", n_gpu_layers=0,
        n_prompt=n if kind == "pp" else 0, n_gen=n if kind == "tg" else 0,
        test_time=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        avg_ns=int(np.mean(times) * 1e9), stddev_ns=int(np.std(times) * 1e9),
        avg_ts=float(ts.mean()), stddev_ts=float(ts.std()),
        samples_ns=[int(t * 1e9) for t in times], samples_ts=ts.tolist(),
        bytes_per_token=facts["bytes_per_token"], read_bw_gbs=bw,
        weight_gbs=float(ts.mean() * facts["bytes_per_token"] / 1e9) if kind == "tg" else None,
    )


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
    for col in ("model", "size", "params", "backend", "threads", "n_ubatch", "test", "t/s", "GB/s (of read bw)"):
        table.add_column(col, justify="left" if col in ("model", "backend", "test") else "right")
    for r in rows:
        test = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
        gbs = ""
        if r["weight_gbs"] is not None:
            gbs = f"{r['weight_gbs']:.1f}"
            if r["read_bw_gbs"]:
                gbs += f" ({r['weight_gbs'] / r['read_bw_gbs']:.0%} of {r['read_bw_gbs']:.1f})"
        table.add_row(r["model_type"], f"{r['model_size'] / 2**20:.1f} MiB", human(r["model_n_params"]),
                      r["backends"], str(r["n_threads"]), str(r["n_ubatch"]), test,
                      f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}", gbs)
    console = Console()
    if not console.is_terminal:   # piped: do not wrap the table at 80 columns
        console = Console(width=200)
    console.print(table)
    print(f"weights read per generated token: {facts['bytes_per_token'] / 2**20:.1f} MiB "
          f"(active experts only)", file=sys.stdout)


if __name__ == "__main__":
    main()
