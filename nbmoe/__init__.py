"""nbmoe: Mixture-of-Experts GGUF inference in plain Python compiled by Numba."""
import glob
import hashlib
import os

import numba

# Numba keeps LLVM's SLP vectorizer off by default; the block dot products need it to use
# SIMD (docs/kernels.md). It must be set before the first kernel compiles.
if "NUMBA_SLP_VECTORIZE" not in os.environ:
    numba.config.SLP_VECTORIZE = 1

from nbmoe import config as _config  # noqa: E402


def omp_wait_settings(environ, cpus, load):
    """libgomp's wait settings for a machine of `cpus` CPUs at 1-minute `load`: sleep at once,
    or, where config.SPIN_POLLS asks for it, a short poll on an idle machine with cores to spare
    (waking a sleeping team took over half of a 16-thread expert product's time); none where
    the user set either variable."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return {}
    if _config.SPIN_POLLS > 0 and cpus >= _config.SPIN_MIN_CPUS and load < _config.SPIN_MAX_LOAD * cpus:
        return {"GOMP_SPINCOUNT": str(_config.SPIN_POLLS)}
    return {"OMP_WAIT_POLICY": _config.OMP_WAIT_POLICY}


def _load():
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):    # no load average: treat the machine as busy
        return float("inf")


# Read by libgomp when Numba first runs in parallel.
_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
os.environ.update(omp_wait_settings(os.environ, _cpus, _load()))
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
