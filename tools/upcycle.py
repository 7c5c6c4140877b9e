"""Upcycle a dense llama/qwen3 GGUF into a MoE GGUF of identical experts (same function).

    python tools/upcycle.py SmolLM2-135M-Instruct.Q4_1.gguf smollm2-moe.gguf --experts 8 --active 2
"""
import argparse
import os
import sys
import time

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from nbmoe.errors import NbmoeError
from nbmoe.loader.upcycle import upcycle


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Turn a dense GGUF into a Mixtral-style MoE whose experts copy the dense FFN.",
        usage="python tools/upcycle.py SRC.gguf OUT.gguf --experts 8 --active 2")
    ap.add_argument("src", help="dense GGUF (llama or qwen3)")
    ap.add_argument("out", help="MoE GGUF to write")
    ap.add_argument("--experts", type=int, default=8, help="number of experts E (default: 8)")
    ap.add_argument("--active", type=int, default=2, help="experts used per token A (default: 2)")
    ap.add_argument("--seed", type=int, default=0, help="router random seed (default: 0)")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    columns = (TextColumn("upcycling"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    try:
        with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task("", total=None)
            upcycle(args.src, args.out, n_expert=args.experts, n_expert_used=args.active,
                    seed=args.seed,
                    progress=lambda done, total: bar.update(task, completed=done, total=total))
    except NbmoeError as e:
        sys.exit(f"upcycle: {e}")
    size = os.path.getsize(args.out)
    print(f"wrote {args.out}: {size / 1e6:.0f} MB, {args.experts} experts, {args.active} active, "
          f"in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
