"""Load the kernels that other kernels call before their callers, as the compiling process did.

When Numba compiles a kernel that calls another (matmul._products -> dot_rows_i8 ->
dot_rows_q4_k_i8), it links the callee's optimised IR into the caller and compiles it again
there, so the caller's machine code holds its own copy of the callee. Numba loads the callee
first, and in the process that compiles, the caller's calls go to that earlier definition,
the callee's own machine code. A later process that loads the caller from the disk cache has
no such definition and runs the caller's copy: the same IR, optimised twice, and placed
differently. For Q4_K that copy is the slower one (docs/kernels.md).

So every process that compiles records the callees it compiles (module, name, signature; in
the order the compiles end, callees before their callers) in a file beside Numba's cache, and
preload() loads them from the cache, in that order, before anything runs (milliseconds a
kernel); one whose cache entry went missing is compiled again. A kernel built for constants
(cpu/specialize.py) is named by its factory and those constants.
"""
import importlib
import os
import pickle

import numba
from numba.core import event

_FILE = "callees.pkl"
# what unpickling a damaged or outdated record can raise
_BAD_RECORD = (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError, IndexError,
               KeyError, TypeError, ValueError)
_preloaded = False


def _path():
    return os.path.join(numba.config.CACHE_DIR or ".", _FILE)


class _Recorder(event.Listener):
    """Appends (module, qualname, argument types) of each CPU kernel this process compiles
    inside another kernel's compile (a callee) and caches on disk. Left out: kernels compiled
    from Python (a callee that was compiled so first, then loaded from the cache by its caller,
    fires no event and keeps running from the caller's copy), parallel kernels (outermost
    callers) and inline="always" ones (no code of their own)."""

    def __init__(self):
        self.depth = 0      # compiles nest: a caller's typing compiles its callees

    def on_start(self, ev):
        self.depth += 1

    def on_end(self, ev):
        self.depth -= 1
        disp = ev.data["dispatcher"]
        fn = getattr(disp, "py_func", None)
        opts = getattr(disp, "targetoptions", {})
        if (self.depth == 0 or fn is None or not str(fn.__module__).startswith("nbmoe.cpu.")
                or type(getattr(disp, "_cache", None)).__name__ in ("NullCache", "NoneType")
                or opts.get("parallel") or opts.get("inline") == "always"):
            return
        origin = getattr(disp, "nbmoe_origin", None)       # (module, factory, constants)
        name = (origin[1], origin[2]) if origin else fn.__qualname__
        entry = (fn.__module__ if not origin else origin[0], name, tuple(ev.data["args"]))
        try:    # an argument type that does not pickle back (none known) is left out, and a
            data = pickle.dumps(entry)      # failure here must not fail the compile
            pickle.loads(data)
        except Exception:
            return
        try:
            os.makedirs(os.path.dirname(_path()), exist_ok=True)
            with open(_path(), "ab") as f:
                f.write(data)
        except OSError:     # a read-only cache: the kernels still run, from their copies
            pass


def record():
    """Start recording (nbmoe/__init__ calls it before any kernel compiles)."""
    event.register("numba:compile", _Recorder())


def entries(path=None):
    """The recorded (module, qualname or (factory, constants), argument types), oldest first;
    a damaged tail ends it."""
    try:
        with open(path or _path(), "rb") as f:
            while True:
                yield pickle.load(f)
    except _BAD_RECORD:
        return


def preload():
    """Load every recorded kernel from the cache, in recorded order (once a process; kernels
    since renamed or removed are passed over). Returns how many it loaded."""
    global _preloaded
    if _preloaded:
        return 0
    _preloaded = True
    n = 0
    from nbmoe.cpu.specialize import build
    for module, name, args in entries():
        try:
            obj = importlib.import_module(module)
        except ImportError:
            continue
        factory, key = name if isinstance(name, tuple) else (name, None)
        for part in factory.split("."):
            obj = getattr(obj, part, None)
        if key is not None and callable(obj):
            obj = build(obj, key)
        if hasattr(obj, "compile"):
            obj.compile(args)
            n += 1
    return n
