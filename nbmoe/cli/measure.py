"""What the bench and the sweep share: their comma-list flags, a model loaded per
configuration, the model's facts, --explain, and rows written as json or csv."""
import argparse
import csv
import io
import itertools
import json
from collections import defaultdict

import numpy as np
from gguf import LlamaFileType
from rich.console import Console

from nbmoe.cli.checks import check_threads, check_values, int_list_arg
from nbmoe.cli.common import err_console, flash_attn_list, loading, placement_kwargs, zce_value


def int_list(s):
    try:
        return [int(v) for v in str(s).split(",") if v.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {s!r}") from None


def parse_lists(p, args):
    """The comma lists of -ngl -ub -rtr -zce -fa -fmoe -muge --upload-all-experts (and -t)
    checked, as args.<name>_list; one line and exit 2 for a bad value."""
    # -fmoe / -muge / --upload-all-experts: a table column only when given (as llama-bench's)
    args.show_fmoe, args.show_uae = args.fused_moe is not None, args.upload_all_experts is not None
    args.show_muge = args.merge_up_gate_experts is not None
    args.fused_moe = "1" if args.fused_moe is None else args.fused_moe
    args.upload_all_experts = "0" if args.upload_all_experts is None else args.upload_all_experts
    args.merge_up_gate_experts = args.merge_up_gate_experts or "0"
    lists = {dest: int_list_arg(p, dest, getattr(args, dest))
             for dest in ("n_gpu_layers", "ubatch_size", "run_time_repack", "fused_moe",
                          "upload_all_experts", "merge_up_gate_experts")}
    try:
        lists["zero_copy_experts"] = [zce_value(v.strip()) for v in str(args.zero_copy_experts).split(",")
                                      if v.strip()]
    except argparse.ArgumentTypeError as e:
        p.error(f"argument -zce/--zero-copy-experts: {e}")
    check_values(p, {**vars(args), **lists})
    args.threads = check_threads(p, args.threads)
    args.ngl_list, args.ub_list, args.zce_list = (lists["n_gpu_layers"], lists["ubatch_size"],
                                                  lists["zero_copy_experts"])
    args.rtr_list = [bool(v) for v in lists["run_time_repack"]]
    args.fa_list = flash_attn_list(p, args.flash_attn)
    args.fmoe_list, args.uae_list = lists["fused_moe"], lists["upload_all_experts"]
    args.muge_list = lists["merge_up_gate_experts"]


def configs(args):
    """Every combination of the lists, one model load each: dicts of ngl, ub, rtr, zce, fa,
    fmoe, muge, uae, ctk, ctv."""
    keys = ("ngl", "ub", "rtr", "zce", "fa", "fmoe", "muge", "uae", "ctk", "ctv")
    return [dict(zip(keys, c)) for c in itertools.product(
        args.ngl_list, args.ub_list, args.rtr_list, args.zce_list, args.fa_list, args.fmoe_list,
        args.muge_list, args.uae_list, args.cache_type_k, args.cache_type_v)]


def load_config(path, args, c, n_ctx, threads, quiet=False):
    """Open the model for configuration c (configs()); -rtr's work is told unless quiet."""
    from nbmoe.engine import load
    with loading(f"loading {path}"):
        llm = load(path, n_ctx=n_ctx, threads=threads, n_ubatch=c["ub"], repack=c["rtr"],
                   cache_type_k=c["ctk"], cache_type_v=c["ctv"],
                   **placement_kwargs(args, c["ngl"], c["zce"], c["fa"], c["fmoe"], c["uae"], c["muge"]))
    if not quiet:
        err_console.print(f"  {llm.kv.summary()}")
    if llm.repack_stats and not quiet:
        s = llm.repack_stats
        err_console.print(f"  -rtr: {s['tensors']} tensors, {s['bytes'] / 2**20:.1f} MiB "
                          f"repacked in {s['seconds']:.2f} s")
    return llm


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
        if llm.buffer_of(name) == "CPU":      # generation never offloads: read from RAM
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


def gpu_info():
    from numba import cuda
    try:
        return ", ".join(str(g.name.decode() if isinstance(g.name, bytes) else g.name) for g in cuda.gpus)
    except Exception:
        return "CUDA"


def explain(llm, ubatch):
    """--explain: tensor placement, the schedule of one token and of a micro-batch, and the
    attention kernel each backend bound (-fa)."""
    from nbmoe.sched.explain import legend, placement_table, schedule_table, unfused_lines
    ubatch = min(ubatch, llm.n_ctx)        # a micro-batch never outgrows the context
    console = Console(stderr=True, width=200)
    console.print(placement_table(llm.placement))
    console.print(schedule_table(llm, sorted({1, ubatch})))
    console.print(legend())
    for line in unfused_lines(llm, sorted({1, ubatch})):
        console.print(line, highlight=False)
    for line in llm.explain_lines():
        console.print(line, highlight=False)
    for line in llm.ep.explain_lines() if llm.ep else ():
        console.print(line, highlight=False)
    for line in attention_lines(llm):
        console.print(line, highlight=False)
    if llm.cfg.is_mla:
        c = llm.cfg
        expanded = c.n_head * (c.qk_nope_dim + c.n_rot + c.v_head_dim)
        console.print(f"MLA: the cache keeps {c.kv_lora_rank} latent + {c.n_rot} roped key values "
                      f"per token and layer ({c.head_dim * 2} bytes; expanded keys and values would "
                      f"be {expanded * 2}); queries absorb attn_k_b and outputs attn_v_b at every "
                      "batch size", highlight=False)
    if llm.cfg.n_nextn:
        n, il = llm.cfg.n_nextn, llm.cfg.n_layer
        console.print(f"{n} NextN layer{'s' * (n > 1)} not run (blk.{il}"
                      f"{f'..{il + n - 1}' if n > 1 else ''}: the file's draft head)", highlight=False)


def attention_lines(llm):
    """The attention kernel each backend bound per batch size (after its plans were made)."""
    lines = []
    kv = (llm.kv.type_k, llm.kv.type_v)
    flags = f"-fa {llm.flash_attn}" + (f", -ctk {kv[0]} -ctv {kv[1]}" if kv != ("f16", "f16") else "")
    for name, be in llm.backends.items():
        paths = ", ".join(f"{t} token{'s' * (t > 1)}: {k}" for (t, dh), k in sorted(be.attn_paths.items()))
        if paths:
            lines.append(f"attention on {name} ({flags}): {paths}")
        if be.no_flash:
            lines.append(f"  -fa on: no flash kernel on {name} for head dim "
                         f"{', '.join(map(str, sorted(be.no_flash)))}: plain kernel")
    return lines


def table_console():
    """stdout for a table; piped, 200 columns wide (no wrapping at 80)."""
    console = Console()
    return console if console.is_terminal else Console(width=200)


def print_json_csv(rows, fmt):
    """rows (dicts) as a JSON list, or as CSV without the per-sample columns."""
    if fmt == "json":
        print(json.dumps(rows, indent=2))
        return
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=[k for k in rows[0] if not k.startswith("samples")])
    w.writeheader()
    for r in rows:
        w.writerow({k: v for k, v in r.items() if not k.startswith("samples")})
    print(buf.getvalue(), end="")
