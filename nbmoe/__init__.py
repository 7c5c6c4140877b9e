"""nbmoe: Mixture-of-Experts GGUF inference in plain Python compiled by Numba."""
import glob
import hashlib
import os

import numba

# Numba keeps LLVM's SLP vectorizer off by default; the block dot products need it to use
# SIMD (docs/kernels.md). It must be set before the first kernel compiles.
if "NUMBA_SLP_VECTORIZE" not in os.environ:
    numba.config.SLP_VECTORIZE = 1

# Threads that wait for the next parallel region sleep instead of polling, which on a busy machine
# takes the core from the thread they wait for. Read when Numba first runs in parallel.
from nbmoe import config as _config  # noqa: E402

if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = _config.OMP_WAIT_POLICY
if not {"NUMBA_THREADING_LAYER", "NUMBA_THREADING_LAYER_PRIORITY"} & set(os.environ):
    numba.config.THREADING_LAYER_PRIORITY = list(_config.THREADING_LAYERS)


def _kernel_cache_dir():
    """Numba checks only a cached function's own file, so an edited helper module (a block
    decoder called by matmul) would leave stale machine code in use; nor does its key see
    compile flags (NUMBA_OPT included). So the on-disk cache lives in a folder named by a hash
    of every kernel source and those flags: any change starts a fresh one."""
    from nbmoe.config import KERNEL_KEY, cache_dir
    here = os.path.dirname(__file__)
    flags = f"slp={numba.config.SLP_VECTORIZE} opt={numba.config.OPT}"
    h = hashlib.sha1(f"{numba.__version__} {flags} {KERNEL_KEY}".encode())
    # load_order.py too: its record of which kernels compiled must describe this cache
    for path in sorted(glob.glob(os.path.join(here, "cpu", "*.py"))) + [os.path.join(here, "load_order.py")]:
        with open(path, "rb") as f:
            h.update(f.read())
    return os.path.join(cache_dir(), "kernels", h.hexdigest()[:16])


if "NUMBA_CACHE_DIR" not in os.environ:
    numba.config.CACHE_DIR = _kernel_cache_dir()
    from nbmoe import kernel_cache  # noqa: E402

    kernel_cache.install()      # one cache for every install path of the same sources

from nbmoe import load_order  # noqa: E402

load_order.record()     # which kernels compile, for load_order.preload in later processes

from nbmoe.errors import NbmoeError  # noqa: E402

__all__ = ["LLM", "load", "NbmoeError"]
__version__ = "0.1.0"


def __getattr__(name):
    # The engine is imported on first use, so `import nbmoe.cpu.ops` stays light.
    if name in ("LLM", "load"):
        from nbmoe import engine
        return getattr(engine, name)
    raise AttributeError(name)
