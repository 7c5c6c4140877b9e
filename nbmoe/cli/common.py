"""What the command-line tools share: model flags, opening a model, one-line errors."""
import argparse
import os
import sys
from contextlib import contextmanager

from rich.console import Console

from nbmoe.errors import NbmoeError

err_console = Console(stderr=True, highlight=False, soft_wrap=True)


def add_model_args(p, lists=False):
    p.add_argument("-m", "--model", default=None,
                   help="GGUF file (default: SmolLM2-135M upcycled to 8 experts, built on first use)")
    p.add_argument("-ub", "--ubatch-size", type=str if lists else int, default="512" if lists else 512,
                   help="micro-batch size for prompts" + (" (comma list)" if lists else ""))


def add_repack_arg(p, lists=False):
    """-rtr, as in llama.cpp / ik_llama.cpp (bench: a comma list of 0 / 1)."""
    if lists:
        p.add_argument("-rtr", "--run-time-repack", default="0",
                       help="repack RAM-resident Q4_0/Q4_1/Q8_0/Q4_K/IQ4_NL/IQ4_XS/MXFP4 matrices at load "
                            "(comma list of 0/1)")
    else:
        p.add_argument("-rtr", "--run-time-repack", action="store_true",
                       help="repack RAM-resident Q4_0/Q4_1/Q8_0/Q4_K/IQ4_NL/IQ4_XS/MXFP4 matrices at load "
                            "(faster CPU kernels)")


def add_flash_attn_arg(p, lists=False):
    """-fa, as llama.cpp names it (bench and sweep: a comma list, a run each)."""
    p.add_argument("-fa", "--flash-attn", default=None, type=str if lists else flash_attn_value,
                   help="flash attention for prompts: on, off or auto (also 1 / 0; default auto: the "
                        "flash kernels where a backend has one)" + (" (comma list)" if lists else ""))


def flash_attn_value(v):
    """-fa: on | off | auto (1 / 0 as llama-bench), as the engine names it."""
    from nbmoe.engine import flash_attn_mode
    from nbmoe.errors import NbmoeError
    try:
        return flash_attn_mode(v)
    except NbmoeError:
        raise argparse.ArgumentTypeError(f"expected on, off or auto (or 1, 0), got {v!r}") from None


def flash_attn_list(parser, text):
    """-fa's comma list (bench, sweep): [None] when not given (the engine's default)."""
    if text is None:
        return [None]
    try:
        values = [flash_attn_value(v.strip()) for v in str(text).split(",") if v.strip()]
    except argparse.ArgumentTypeError as e:
        parser.error(f"argument -fa/--flash-attn: {e}")
    if not values:
        parser.error(f"argument -fa/--flash-attn: expected on, off or auto (or 1, 0), got {text!r}")
    return values


def add_placement_args(p, lists=False):
    """-ngl -ot -op --cpu-moe --n-cpu-moe, as in llama.cpp (bench takes comma lists for -ngl)."""
    from nbmoe.model.graph import OPS
    p.add_argument("-ngl", "--n-gpu-layers", default="0" if lists else 0, type=str if lists else int,
                   help="layers on the GPU: the last N repeating layers and the output (99 = all)")
    p.add_argument("-ot", "--override-tensor", action="append", default=[],
                   help="REGEX=BUFTYPE (repeatable or comma-separated; first match wins), e.g. exps=CPU")
    p.add_argument("-op", "--offload-policy", default=None,
                   help="OP,0|1,... turn GPU offload of RAM weights on/off per op (-1 = all); "
                        f"ops: {', '.join(f'{i}={o}' for i, o in enumerate(OPS))}")
    p.add_argument("--cpu-moe", action="store_true", help="keep all expert tensors in RAM")
    p.add_argument("--n-cpu-moe", type=int, default=0, help="keep the experts of the first N layers in RAM")
    p.add_argument("-zce", "--zero-copy-experts", default="auto", type=zce_value if not lists else str,
                   help="of each generated token's chosen experts whose weights are in RAM, the GPU "
                        "that routed computes N, reading their weights in place over PCIe, while the "
                        "CPU computes the others (auto = from 3/8 of them, balanced while generating; 0 = off" +
                        ("; comma list)" if lists else ")"))
    p.add_argument("--ep", type=int, default=1, metavar="R",
                   help="expert parallelism: share each MoE layer's experts over the R ranks of "
                        "mpiexec -n R (rank 0 runs the rest; see README)")
    p.add_argument("--ep-gpu", action="store_true",
                   help="with --ep: every rank computes its share of the experts on its own GPU "
                        "(the GPU of its local rank on its host; rank 0's layers use that one too)")


def add_moe_args(p, lists=False):
    """-fmoe, -muge (as ik_llama.cpp) and --upload-all-experts (bench: comma lists of 0 / 1,
    shown as table columns when given)."""
    add_fused_moe_arg(p, lists)
    muge = ("at load, each MoE layer's up and gate experts become one tensor, merged where "
            "they live, so one product computes both")
    if lists:
        p.add_argument("-muge", "--merge-up-gate-experts", default=None,
                       help=muge + " (comma list of 0/1; default 0)")
        p.add_argument("--upload-all-experts", default=None,
                       help="1: an offloaded expert product uploads its whole tensor, not only the "
                            "experts the router chose (comma list of 0/1; default 0)")
    else:
        p.add_argument("-muge", "--merge-up-gate-experts", action="store_true", help=muge)
        p.add_argument("--upload-all-experts", action="store_true",
                       help="an offloaded expert product uploads its whole tensor, not only the "
                            "experts the router chose")


def add_fused_moe_arg(p, lists=False):
    """-fmoe, as ik_llama.cpp (bench: a comma list of 0 / 1)."""
    p.add_argument("-fmoe", "--fused-moe", default=None if lists else 1,
                   type=str if lists else int,
                   help="1: the experts' gate, up and activation as one op, MUL_MAT_ID_GLU (its own "
                        "-op switch; fused kernels for small batches); 0: three separate ops" +
                        (" (comma list; default 1)" if lists else " (default 1)"))


def add_cache_type_args(p, lists=False):
    """-ctk / -ctv, as in llama.cpp: the KV cache's types (bench: comma lists)."""
    from nbmoe.model.kv_cache import KV_TYPES
    for short, long, what in (("-ctk", "--cache-type-k", "keys"), ("-ctv", "--cache-type-v", "values")):
        p.add_argument(short, long, default=["f16"] if lists else "f16",
                       type=cache_types if lists else cache_type,
                       help=f"KV cache type of the {what}: {', '.join(KV_TYPES)}" +
                            (" (comma list)" if lists else ""))


def cache_type(v):
    """-ctk / -ctv: a KV cache type name."""
    from nbmoe.model.kv_cache import KV_TYPES
    if v not in KV_TYPES:
        raise argparse.ArgumentTypeError(f"unknown KV cache type {v!r}: choose one of {', '.join(KV_TYPES)}")
    return v


def cache_types(v):
    """-ctk / -ctv of the bench: a comma list of KV cache type names."""
    return [cache_type(x.strip()) for x in str(v).split(",") if x.strip()] or [cache_type(v)]


def add_engine_args(p, lists=False):
    """Every flag that shapes the engine a tool runs: -rtr -fa, placement, -fmoe -muge
    --upload-all-experts, -ctk -ctv (bench and sweep: comma lists)."""
    for add in (add_repack_arg, add_flash_attn_arg, add_placement_args, add_moe_args,
                add_cache_type_args):
        add(p, lists=lists)


def zce_value(v):
    """-zce: 'auto' or a count of experts."""
    if v == "auto":
        return v
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number, got {v!r}") from None


def placement_kwargs(args, n_gpu_layers=None, zero_copy_experts=None, flash_attn=None,
                     fused_moe=None, upload_all_experts=None, merge_up_gate=None):
    """The load() keywords of the placement flags, -fa, -fmoe, -muge and --upload-all-experts
    (the tools with lists pass the run's values; None: the flag's own, or the engine's
    default)."""
    fa = flash_attn if flash_attn is not None else getattr(args, "flash_attn", None)
    return dict(n_gpu_layers=args.n_gpu_layers if n_gpu_layers is None else n_gpu_layers,
                flash_attn=fa,
                fused_moe=bool(int(getattr(args, "fused_moe", 1) if fused_moe is None else fused_moe)),
                upload_all_experts=bool(int(getattr(args, "upload_all_experts", False)
                                            if upload_all_experts is None else upload_all_experts)),
                merge_up_gate=bool(int(getattr(args, "merge_up_gate_experts", False)
                                       if merge_up_gate is None else merge_up_gate)),
                override_tensors=args.override_tensor, offload_policy=args.offload_policy,
                cpu_moe=args.cpu_moe, n_cpu_moe=args.n_cpu_moe,
                zero_copy_experts=args.zero_copy_experts if zero_copy_experts is None else zero_copy_experts,
                expert_parallel=args.ep, ep_gpu=getattr(args, "ep_gpu", False))


def resolve_model(path):
    if path:
        return path
    from nbmoe.loader.default_model import default_model_path
    return default_model_path()


@contextmanager
def friendly_errors():
    """Print our own errors as one red line and exit non-zero, without a traceback."""
    try:
        yield
    except NbmoeError as e:
        err_console.print(f"[bold red]error:[/] {e}")
        sys.exit(1)
    except MemoryError as e:
        err_console.print(f"[bold red]error:[/] out of memory ({e or 'no detail'}): try a smaller -c or -ub")
        sys.exit(1)
    except BrokenPipeError:
        # the reader went away (`| head`): stop quietly; stdout to /dev/null so the final flush is silent
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)


@contextmanager
def mpi_ranks(args, threads=None):
    """--ep R under mpiexec: rank 0 runs the command's body; the other ranks serve their share
    of the experts here until rank 0 ends, then exit with its code (nbmoe.parallel)."""
    from nbmoe import parallel
    with friendly_errors():
        if args.ep < 1:
            raise NbmoeError(f"--ep must be 1 or more, got {args.ep}")
        comm = parallel.world(args.ep)
        path = resolve_model(args.model) if comm is not None else None
    with parallel.launch(comm, path, threads, args.override_tensor,
                         getattr(args, "ep_gpu", False)) as cluster:
        yield cluster


class _Bars:
    """The engine's long waits (nbmoe/progress.py) as rich bars, removed when each ends."""

    def __init__(self, bars):
        self.bars = bars

    def start(self, description, total):
        return self.bars.add_task(description, total=total, size=_gib(0, total))

    def advance(self, i, n):
        t = self.bars.tasks[self.bars.task_ids.index(i)]
        self.bars.update(i, advance=n, size=_gib(t.completed + n, t.total))

    def finish(self, i):
        self.bars.remove_task(i)


def _gib(done, total):
    return f"{done / 2**30:.1f}/{total / 2**30:.1f} GiB"


@contextmanager
def loading(message):
    """A spinner with `message` while a model loads, and a bar under it for each long wait
    (uploads to a GPU, -rtr, page-locking the experts)."""
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from nbmoe import progress
    bars = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    TextColumn("{task.fields[size]}"), TimeElapsedColumn(),
                    console=err_console, transient=True)
    with bars, progress.listening(_Bars(bars)):
        bars.add_task(message, total=None, size="")
        yield


def open_model(args, path, **extra):
    """The model of a chat or a server, from its flags (-c -t -ub -rtr -ctk -ctv, placement),
    with the loading spinner, and the cache's size when it is quantized."""
    from nbmoe.engine import load
    with loading(f"loading {path}"):
        llm = load(path, n_ctx=args.ctx_size, threads=args.threads, n_ubatch=args.ubatch_size,
                   repack=args.run_time_repack, cache_type_k=args.cache_type_k,
                   cache_type_v=args.cache_type_v, **placement_kwargs(args), **extra)
    if (llm.kv.type_k, llm.kv.type_v) != ("f16", "f16"):     # the memory a quantized cache saves
        err_console.print(llm.kv.summary())
    return llm


def warm_up(llm):
    """Compile (or load from the on-disk cache) the kernels of the paths a chat takes, a few
    tokens, one token and a prompt's batch (16 different tokens: its experts see many tokens
    and few), before the user waits on them, with a progress bar while compiling; the cache
    is left empty."""
    from nbmoe.cli.compile import compile_batches
    from nbmoe.compiling import CompileProgress, wait_ahead
    with CompileProgress(err_console, "warming up", llm, "chat", ahead=[16, 2]) as progress:
        compile_batches(llm, [1])
        wait_ahead(progress)        # a cold start: a second process compiled the prompts' paths
        compile_batches(llm, [2, 16])
