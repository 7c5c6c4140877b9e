"""Compile a model's kernels into the cache ahead of its first use.

    python -m nbmoe.compile                    # the default model, as the chat and bench use it
    python -m nbmoe.compile -m model.gguf -rtr
    python -m nbmoe.compile -ctk f16,q8_0 -ctv f16,q8_0 -fmoe 0

The first run of a model compiles the kernels its weight types need (about a minute on two
cores) and keeps them in the cache; after this command (once per install, e.g. in a container
build) the first chat or bench starts at once. --batches chooses the paths: 1 (generating),
2 (short prompts), 16 (prompts: batched products, experts of many and of few tokens). The
attention kernels are compiled per KV cache type: -ctk / -ctv (comma lists, as the bench's: every
combination) name the types to compile for; -fmoe 0 compiles the unfused expert ops. The chat
and the bench also run it themselves, as a second process, at a cold start.
"""
import argparse
import itertools

from nbmoe.cli.checks import Parser, check_values
from nbmoe.cli.common import (add_cache_type_args, add_flash_attn_arg, add_fused_moe_arg, add_model_args,
                              add_repack_arg, err_console, friendly_errors, resolve_model)


def parse_args(argv=None):
    p = Parser(prog="python -m nbmoe.compile", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_repack_arg(p)
    add_flash_attn_arg(p)
    add_fused_moe_arg(p)
    add_cache_type_args(p, lists=True)
    p.add_argument("-t", "--threads", type=int, default=None, help="threads (default: all cores)")
    p.add_argument("--batches", default="1,2,16", help="batch sizes to compile for (comma list)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    args = p.parse_args(argv)
    try:
        args.batch_list = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        p.error(f"argument --batches: expected a comma list of numbers, got {args.batches!r}")
    if not args.batch_list or min(args.batch_list) < 1:
        p.error("argument --batches: batch sizes must be at least 1")
    check_values(p, vars(args))
    return args


def compile_batches(llm, batches):
    """Run one batch of each size through llm from an empty cache (distinct token ids, so that
    a MoE's experts get many tokens and few), then empty it again."""
    for n in batches:
        llm.reset()
        llm._decode([llm.tokenizer.bos_id or 0] * n if n <= 2 else list(range(1, n + 1)), all_logits=False)
    llm.reset()


def main(argv=None):
    args = parse_args(argv)
    with friendly_errors():
        from nbmoe.compiling import CompileProgress
        from nbmoe.engine import load
        path = resolve_model(args.model)
        for ctk, ctv in itertools.product(args.cache_type_k, args.cache_type_v):
            llm = load(path, n_ctx=max(args.batch_list) + 1, threads=args.threads, n_ubatch=args.ubatch_size,
                       repack=args.run_time_repack, flash_attn=args.flash_attn,
                       fused_moe=bool(args.fused_moe), cache_type_k=ctk, cache_type_v=ctv)
            if args.quiet:
                compile_batches(llm, args.batch_list)
                continue
            kv = f", KV cache {ctk}/{ctv}" if (ctk, ctv) != ("f16", "f16") else ""
            with CompileProgress(err_console, f"compiling for batches of {args.batches} tokens{kv}", llm,
                                 f"compile {args.batches}"):
                compile_batches(llm, args.batch_list)


if __name__ == "__main__":
    main()
