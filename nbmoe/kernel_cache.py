"""Where Numba keeps nbmoe's compiled kernels: one folder per module, whatever the install path.

Numba files a cached function under a hash of its source file's folder, so a second copy of
the package (a `pip install .` beside an editable clone, two virtual environments) compiled
everything again into a folder of its own. This locator names the folder after the module
instead; Numba's own checks stay: the source's content hash and the function's bytecode.

Numba saves a function's index (signature -> data file) and then the data file, each
atomically but not the two together: two processes saving different signatures of one
function at once could leave the index naming the other's code. A cold start compiles in two
processes (compiling.py), so saves into the cache take a file lock.

A kernel loaded from the cache starts Numba's thread pool first if it is parallel, or if it
calls one compiled in the same process; one that calls a parallel kernel that process had
loaded from the cache does not know it needs the pool (Numba keeps that note with compiled
code only), and loading it first ended the process ("Symbol not found: allocate_sched").
So the pool starts before the first load.
"""
import fcntl
import functools
import os

from numba.core import caching, config


class ModuleLocator(caching.UserProvidedCacheLocator):
    """numba.config.CACHE_DIR/<module name> for nbmoe's functions (None for any other)."""

    def __init__(self, py_func, py_file):
        super().__init__(py_func, py_file)
        self._cache_path = os.path.join(config.CACHE_DIR, py_func.__module__)

    @classmethod
    def from_function(cls, py_func, py_file):
        if not str(getattr(py_func, "__module__", "")).startswith("nbmoe."):
            return None
        return super().from_function(py_func, py_file)


def _locked(save):
    @functools.wraps(save)
    def locked_save(self, key, data):
        with open(os.path.join(self._cache_path, ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)        # released when the file closes
            return save(self, key, data)
    locked_save.nbmoe_locked = True
    return locked_save


def _pool_first(load):
    @functools.wraps(load)
    def load_after_pool(self, key):
        from numba.np.ufunc.parallel import _launch_threads
        _launch_threads()                           # once a process (what Numba's reload runs)
        return load(self, key)
    load_after_pool.nbmoe_pool_first = True
    return load_after_pool


def install():
    """Put ModuleLocator first in Numba's list (before any kernel is decorated; a user's own
    NUMBA_CACHE_LOCATOR_CLASSES still wins), make saves take the lock and loads start the
    thread pool."""
    impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl     # (named so before 0.61)
    classes = impl._locator_classes
    if ModuleLocator not in classes:
        classes.insert(0, ModuleLocator)
    if not getattr(caching.IndexDataCacheFile.save, "nbmoe_locked", False):
        caching.IndexDataCacheFile.save = _locked(caching.IndexDataCacheFile.save)
    if not getattr(caching.IndexDataCacheFile.load, "nbmoe_pool_first", False):
        caching.IndexDataCacheFile.load = _pool_first(caching.IndexDataCacheFile.load)
