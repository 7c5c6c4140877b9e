"""load_order.py: a compiling process records its kernels, callees first; a later process
loads them from the cache in that order, compiling nothing."""
import os
import pickle
import subprocess
import sys

from nbmoe import load_order

COMPILE = """
import numpy as np, nbmoe
from nbmoe.cpu import matmul
from nbmoe.cpu.quants import Q8_0
matmul._prepare_x(np.ones((1, 64), np.float32), True, Q8_0)
"""

PRELOAD = """
import nbmoe
from nbmoe import load_order
from nbmoe.cpu import matmul, quants_int8
n = load_order.preload()
print(n, len(quants_int8.quantize_x.stats.cache_hits), len(quants_int8.quantize_x.stats.cache_misses),
      len(matmul._prepare_x.stats.cache_hits), len(matmul._prepare_x.stats.cache_misses))
"""


def _run(code, cache):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


def test_callees_are_recorded_first_and_preloaded_from_the_cache(tmp_path):
    _run(COMPILE, tmp_path)
    names = [q for m, q, _ in load_order.entries(str(tmp_path / "callees.pkl"))]
    # _prepare_x (called from Python: not recorded) calls quantize_x and prepare_blocks, which
    # calls prepare_q4_k / prepare_quads: callees' compiles end before their callers'
    assert "_prepare_x" not in names and "quantize_x" in names
    assert names.index("prepare_q4_k") < names.index("prepare_blocks")
    assert names.index("prepare_quads") < names.index("prepare_blocks")
    n, hits, misses, caller_hits, caller_misses = map(int, _run(PRELOAD, tmp_path).split())
    assert n == len(names)
    # the callees came from the cache, compiling nothing; the caller is left for its first call
    assert (hits, misses, caller_hits, caller_misses) == (1, 0, 0, 0)


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
