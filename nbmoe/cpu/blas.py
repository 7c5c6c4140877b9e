"""Keep numpy's BLAS to one thread: nbmoe's parallel work runs in Numba's threads.

The float products of prompts (F32 / F16 / BF16 weights such as every MoE router, and all
types on CPUs without VNNI) go through numpy's matmul, whose OpenBLAS starts a pool of its
own threads. After each product those threads spin for a while waiting for more work, on
the cores Numba's threads need, and slow every kernel after them (docs/kernels.md). So the
engine sets BLAS to one thread when it loads.

There is no numpy API for it: this finds the BLAS library numpy loaded (Linux: the shared
objects in /proc/self/maps) and calls its set-threads function through ctypes, under the
names OpenBLAS builds export (numpy's wheels prefix them with scipy_) or MKL's. Where none
is found it does nothing.
"""
import ctypes

SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
           "openblas_set_num_threads64_", "openblas_set_num_threads", "MKL_Set_Num_Threads")


def _loaded_blas_libraries():
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if ".so" in line}
    except OSError:
        return []
    return sorted(p for p in paths if "blas" in p.lower() or "mkl_rt" in p.lower())


def _functions(names):
    """Per loaded BLAS library, the first of `names` it exports (ctypes function)."""
    found = []
    for path in _loaded_blas_libraries():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        fn = next((getattr(lib, n) for n in names if hasattr(lib, n)), None)
        if fn is not None:
            found.append(fn)
    return found


def set_blas_threads(n):
    """Sets every loaded BLAS library's thread count to n; returns how many it set."""
    import numpy  # noqa: F401  (loads numpy's BLAS, if not yet)
    setters = _functions(SETTERS)
    for fn in setters:
        fn.argtypes, fn.restype = [ctypes.c_int], None
        fn(int(n))
    return len(setters)


def blas_threads():
    """The first loaded OpenBLAS library's thread count (None where there is none): tests."""
    getters = _functions(("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_",
                          "openblas_get_num_threads"))
    if not getters:
        return None
    getters[0].restype = ctypes.c_int
    return getters[0]()
