"""What the command-line tools share: model flags, opening a model, one-line errors."""
import sys
from contextlib import contextmanager

from rich.console import Console

from .errors import NbmoeError

err_console = Console(stderr=True, highlight=False, soft_wrap=True)


def add_model_args(p):
    p.add_argument("-m", "--model", default=None,
                   help="GGUF file (default: SmolLM2-135M upcycled to 8 experts, built on first use)")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512, help="micro-batch size for prompts")


def resolve_model(path):
    if path:
        return path
    from .default_model import default_model_path
    return default_model_path()


@contextmanager
def friendly_errors():
    """Print our own errors as one red line and exit non-zero, without a traceback."""
    try:
        yield
    except NbmoeError as e:
        err_console.print(f"[bold red]error:[/] {e}")
        sys.exit(1)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)


def warm_up(llm):
    """Compile (or load from the on-disk cache) the kernels of both paths, single token and
    batched, before the user waits on them; the cache is left empty."""
    with err_console.status("compiling kernels (the first start only; later starts load them from cache)"):
        llm.eval([llm.tokenizer.bos_id or 0] * 2)
        llm.eval([llm.tokenizer.bos_id or 0])
        llm.reset()
