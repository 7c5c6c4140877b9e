"""load_order.py: a compiling process records its kernels, callees first; a later process
loads them from the cache in that order, compiling nothing."""
import os
import pickle
import subprocess
import sys

from nbmoe import load_order
from nbmoe.cpu.quants_k import Q4_K

COMPILE = """
import numpy as np, nbmoe
from nbmoe.cpu import matmul
from nbmoe.cpu.quants_k import Q4_K
matmul._products((np.zeros((1, 1), np.float32),) * 3, (np.zeros((1, 144), np.uint8),) * 3,
                 np.ones((1, 256), np.float32), Q4_K, True, 1, np.array([1, 0, 0]), (matmul.NO_BIAS,) * 3)
"""

PRELOAD = """
import nbmoe
from nbmoe import load_order
from nbmoe.cpu import matmul, quants_int8
from nbmoe.cpu.quants_k import Q4_K
from nbmoe.cpu.specialize import build
n = load_order.preload()
prepare_x = build(matmul._prepare_x_kernel, (True, Q4_K))
print(n, len(quants_int8.quantize_x.stats.cache_hits), len(quants_int8.quantize_x.stats.cache_misses),
      len(prepare_x.stats.cache_hits), len(prepare_x.stats.cache_misses))
"""


def _run(code, cache):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


def test_callees_are_recorded_first_and_preloaded_from_the_cache(tmp_path):
    _run(COMPILE, tmp_path)
    names = [q for m, q, _ in load_order.entries(str(tmp_path / "callees.pkl"))]
    # the products kernel for Q4_K (called from Python: not recorded) calls _prepare_x's
    # kernel (recorded as its factory and constants), which calls quantize_x and
    # prepare_blocks, which calls prepare_q4_k: callees' compiles end before their callers'
    prepare_x = names.index(("_prepare_x_kernel", (True, Q4_K)))
    assert names.index("quantize_x") < prepare_x
    assert names.index("prepare_q4_k") < names.index("prepare_blocks") < prepare_x
    n, hits, misses, caller_hits, caller_misses = map(int, _run(PRELOAD, tmp_path).split())
    assert n == len(names)
    # the callees came from the cache, compiling nothing (the kernel of _prepare_x too)
    assert (hits, misses, caller_hits, caller_misses) == (1, 0, 1, 0)


def test_a_damaged_record_ends_the_list(tmp_path):
    path = tmp_path / "callees.pkl"
    good = ("nbmoe.cpu.quants_int8", "quantize_x", ())
    path.write_bytes(pickle.dumps(good) + pickle.dumps(good)[:7])
    assert list(load_order.entries(str(path))) == [good]
    path.write_bytes(b"not a pickle")
    assert list(load_order.entries(str(path))) == []
    assert list(load_order.entries(str(tmp_path / "missing.pkl"))) == []


def test_the_recorder_keeps_callees_only_and_never_fails_a_compile(tmp_path, monkeypatch):
    """Entries: cached CPU kernels compiled inside another compile; an argument type that does
    not pickle is passed over quietly (the listener runs inside Numba's compile)."""
    import types as pytypes

    import numba
    from numba.core import event
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))

    class FunctionCache:
        pass

    def fake(module, args, **opts):
        disp = pytypes.SimpleNamespace(py_func=pytypes.SimpleNamespace(__module__=module, __qualname__="k"),
                                       _cache=FunctionCache(), targetoptions=opts)
        return event.Event("numba:compile", event.EventStatus.END, data=dict(dispatcher=disp, args=args))

    rec = load_order._Recorder()
    rec.on_start(None)                                  # a caller's compile
    for module, args, opts in (("nbmoe.cpu.a", (lambda: 0,), {}),      # does not pickle
                               ("nbmoe.cpu.b", (numba.int64,), {"parallel": True}),
                               ("nbmoe.cpu.c", (numba.int64,), {"inline": "always"}),
                               ("elsewhere", (numba.int64,), {}),
                               ("nbmoe.cpu.d", (numba.float32[:],), {})):
        rec.on_start(None)                              # a callee's compile inside it
        rec.on_end(fake(module, args, **opts))
    rec.on_end(fake("nbmoe.cpu.e", (numba.int64,)))    # the caller: compiled from Python
    assert list(load_order.entries()) == [("nbmoe.cpu.d", "k", (numba.float32[:],))]
