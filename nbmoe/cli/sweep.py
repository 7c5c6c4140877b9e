"""Prompt and generation speed as the context fills (ik_llama.cpp's llama-sweep-bench).

    python -m nbmoe.sweep -c 2048 -ub 256 -n 16 --plot sweep.png
    python -m nbmoe.sweep -m model.gguf -c 16384 -ngl 99 -ot exps=CPU -fa on,off --plot fa.png
    python -m nbmoe.sweep -m model.gguf -c 8192 --label hybrid -o json > hybrid.json
    python -m nbmoe.sweep --plot-from hybrid.json cpu.json --plot both.png

For N_KV = 0, ub, 2 ub, ... while N_KV + ub + n fits the context (-c): TG, n one-token steps
after N_KV cached tokens (then taken off the cache again), and PP, one micro-batch of ub
tokens after the same N_KV, which fills the cache to the next depth. Token ids are random.
A comma list (-ngl, -ub, -rtr, -zce, -fa, -t) makes one run per combination; every run is a
table (or rows of -o json/csv, tagged by --label and the flags that vary) and a line in each
panel of --plot. --plot-from draws runs saved with -o json, from one file or several.
"""
import argparse
import json
import os
import time

import numpy as np
from rich.table import Table

from nbmoe.cli.checks import Parser, one_line_warnings
from nbmoe.cli.common import (add_engine_args, add_model_args, err_console, friendly_errors,
                              mpi_ranks, resolve_model)
from nbmoe.cli.measure import (configs, explain, int_list, load_config, model_facts, parse_lists,
                               print_json_csv, table_console)
from nbmoe.errors import NbmoeError

COLUMNS = ("PP", "TG", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s")
KEYS = ("pp", "tg", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg")     # of a row, as COLUMNS


def parse_args(argv=None):
    p = Parser(prog="python -m nbmoe.sweep", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, lists=True)
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context to fill, in tokens")
    p.add_argument("-n", "--n-gen", type=int, default=32, help="tokens generated at each depth")
    p.add_argument("-t", "--threads", type=int_list, default=None, help="threads (comma list; default: all cores)")
    p.add_argument("-o", "--output", choices=["md", "json", "csv"], default=None,
                   help="markdown, json or csv on stdout (default: a table)")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="draw S_PP and S_TG against N_KV, a line per run, into this PNG")
    p.add_argument("--label", default=None,
                   help="the run's name in json rows and on the plot (default: the model's name; "
                        "flags that vary are added)")
    p.add_argument("--plot-from", nargs="+", metavar="FILE.json", default=None,
                   help="measure nothing: draw --plot from the runs in these -o json files")
    p.add_argument("--explain", action="store_true",
                   help="print where every tensor lives, the schedule and the attention kernels")
    add_engine_args(p, lists=True)
    args = p.parse_args(argv)
    if args.plot_from is not None:
        if not args.plot:
            p.error("argument --plot-from: needs --plot FILE.png")
        return args
    parse_lists(p, args)
    if args.n_gen < 1:
        p.error(f"argument -n/--n-gen: must be at least 1, got {args.n_gen}")
    if args.ctx_size < max(args.ub_list) + args.n_gen:
        p.error(f"argument -c/--ctx-size: {args.ctx_size} leaves no depth to measure: it must hold "
                f"at least -ub + -n = {max(args.ub_list) + args.n_gen} tokens")
    return args


def sweep(llm, ub, n_gen, rng):
    """Yield (n_kv, t_pp, t_tg) for each depth (module docstring); the cache is used in place:
    cutting llm.tokens back to n_kv makes the next batch overwrite the rows past it."""
    llm.reset()
    for n_kv in range(0, llm.n_ctx - ub - n_gen + 1, ub):
        tok = int(rng.integers(0, llm.cfg.n_vocab))
        t0 = time.perf_counter()
        for _ in range(n_gen):
            llm._decode([tok], all_logits=False)
        t_tg = time.perf_counter() - t0
        del llm.tokens[n_kv:]
        ids = rng.integers(0, llm.cfg.n_vocab, ub).tolist()
        t0 = time.perf_counter()
        llm._decode(ids, all_logits=False)          # n_ubatch = ub: one micro-batch
        yield n_kv, time.perf_counter() - t0, t_tg


def warm_up(llm, ub, n_gen, message):
    """One micro-batch and n_gen tokens before timing: kernels compiled or loaded, CUDA graphs
    recorded (a run's second call) and the -zce share balanced, as at every later depth."""
    from nbmoe.compiling import CompileProgress, wait_ahead
    with CompileProgress(err_console, message, llm, "sweep", ahead=[1]) as progress:
        llm.reset()
        llm._decode(list(range(1, ub + 1)), all_logits=False)
        wait_ahead(progress)
        for _ in range(max(n_gen, 2)):
            llm._decode([1], all_logits=False)
    llm.reset()


def run_label(args, c, threads, llm):
    """--label (else the model file's name), plus the flags whose lists hold several values."""
    varying = [(f"-ngl {c['ngl']}", args.ngl_list), (f"-ub {c['ub']}", args.ub_list),
               (f"-rtr {int(c['rtr'])}", args.rtr_list), (f"-zce {c['zce']}", args.zce_list),
               (f"-fa {llm.flash_attn}", args.fa_list), (f"-fmoe {c['fmoe']}", args.fmoe_list),
               (f"-muge {c['muge']}", args.muge_list),
               (f"-ctk {c['ctk']}", args.cache_type_k), (f"-ctv {c['ctv']}", args.cache_type_v),
               (f"--upload-all-experts {c['uae']}", args.uae_list), (f"-t {threads}", args.threads or [])]
    base = args.label or os.path.splitext(os.path.basename(llm.path))[0]
    return " ".join([base] + [flag for flag, values in varying if len(values) > 1])


def main(argv=None):
    one_line_warnings()
    args = parse_args(argv)
    with mpi_ranks(args, (args.threads or [None])[0]), friendly_errors():
        if args.plot_from is not None:
            rows = read_runs(args.plot_from)
        else:
            rows = measure(args)
        show(rows, args.output)
        if args.plot:
            from nbmoe.cli.sweep_plot import plot_runs
            plot_runs(rows, args.plot)
            err_console.print(f"plot written to {args.plot}")


def measure(args):
    import numba

    from nbmoe.engine import default_threads
    path = resolve_model(args.model)
    rng = np.random.default_rng(0)
    rows, chatty = [], args.output is None
    for c in configs(args):
        llm = None      # the previous model's memory goes first
        llm = load_config(path, args, c, args.ctx_size, (args.threads or [default_threads()])[0],
                          quiet=not chatty)
        facts = model_facts(llm)
        if args.explain:
            explain(llm, c["ub"])
        for threads in args.threads or [llm.threads]:
            llm.threads = threads
            numba.set_num_threads(threads)
            label = run_label(args, c, threads, llm)
            warm_up(llm, c["ub"], args.n_gen, f"warming up {label}")
            for n_kv, t_pp, t_tg in sweep(llm, c["ub"], args.n_gen, rng):
                rows.append(dict(
                    label=label, model_filename=os.path.basename(path), model_type=facts["label"],
                    backends="CUDA" if len(llm.backends) > 1 else "CPU", n_ctx=llm.n_ctx,
                    n_ubatch=c["ub"], n_threads=threads, n_gpu_layers=c["ngl"],
                    tensor_buft_overrides=";".join(args.override_tensor) or "none",
                    repack=bool(llm.repacked), zero_copy_experts=llm.zce_share,
                    flash_attn=llm.flash_attn, pp=c["ub"], tg=args.n_gen, n_kv=n_kv,
                    t_pp=t_pp, speed_pp=c["ub"] / t_pp, t_tg=t_tg, speed_tg=args.n_gen / t_tg))
                if chatty:
                    err_console.print(f"  {label}: N_KV {n_kv}: {rows[-1]['speed_pp']:.1f} t/s pp, "
                                      f"{rows[-1]['speed_tg']:.2f} t/s tg")
    return rows


def read_runs(files):
    """The rows of -o json files, a list each; a label found in two files gets the file's name."""
    rows, seen = [], {}
    for f in files:
        try:
            with open(f) as fh:
                data = json.load(fh)
        except OSError as e:
            raise NbmoeError(f"cannot read {f}: {e.strerror or e}") from None
        except ValueError as e:
            raise NbmoeError(f"{f} is not JSON ({e})") from None
        if not isinstance(data, list) or not data or not all(
                isinstance(r, dict) and all(k in r for k in KEYS + ("label",)) for r in data):
            raise NbmoeError(f"{f} is not the output of `python -m nbmoe.sweep -o json` "
                             f"(a list of rows with {', '.join(('label',) + KEYS)})")
        for label in {r["label"] for r in data}:
            if seen.setdefault(label, f) != f:
                for r in data:
                    if r["label"] == label:
                        r["label"] = f"{label} ({os.path.basename(f)})"
        rows += data
    return rows


def show(rows, fmt):
    if not rows:
        raise NbmoeError("nothing measured")
    if fmt in ("json", "csv"):
        print_json_csv(rows, fmt)
        return
    for label in dict.fromkeys(r["label"] for r in rows):
        run = [r for r in rows if r["label"] == label]
        cells = [[str(r["pp"]), str(r["tg"]), str(r["n_kv"]), f"{r['t_pp']:.3f}",
                  f"{r['speed_pp']:.2f}", f"{r['t_tg']:.3f}", f"{r['speed_tg']:.2f}"] for r in run]
        about = f"{run[0]['model_type']}, {run[0]['backends']}, {run[0]['n_threads']} threads"
        if fmt == "md":
            print(f"\n{label}: {about}\n")
            print("| " + " | ".join(f"{c:>8}" for c in COLUMNS) + " |")
            print("|" + "|".join("-" * 9 + ":" for _ in COLUMNS) + "|")
            for row in cells:
                print("| " + " | ".join(f"{c:>8}" for c in row) + " |")
            continue
        table = Table(title=label, caption=about, title_justify="left", caption_justify="left")
        for col in COLUMNS:
            table.add_column(col, justify="right")
        for row in cells:
            table.add_row(*row)
        table_console().print(table)


if __name__ == "__main__":
    main()
