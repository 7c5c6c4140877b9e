"""kernel_cache.py: one kernel cache for every install path of the same sources, saves that
two compiling processes cannot mix up, and kernels that load in any order."""
import os
import shutil
import subprocess
import sys

import nbmoe

ADD = """
import numpy as np
from nbmoe.cpu import ops
ops.add(np.zeros((1, 4), np.float32), np.ones((1, 4), np.float32), np.ones((1, 4), np.float32))
print(ops.__file__, len(ops.add.stats.cache_hits), len(ops.add.stats.cache_misses))
"""


def _env(cache, **extra):
    env = dict(os.environ, NBMOE_CACHE=str(cache), **extra)
    env.pop("NUMBA_CACHE_DIR", None)
    return env


def _run(code, root, cache):
    out = subprocess.run([sys.executable, "-c", code], env=_env(cache, PYTHONPATH=str(root)),
                         capture_output=True, text=True, check=True, cwd=str(root))
    return out.stdout.split()


def test_two_install_paths_share_one_cache(tmp_path):
    src = os.path.dirname(nbmoe.__file__)
    for copy in ("a", "b"):
        shutil.copytree(src, tmp_path / copy / "nbmoe", ignore=shutil.ignore_patterns("__pycache__"))
    file_a, hits_a, misses_a = _run(ADD, tmp_path / "a", tmp_path / "cache")
    file_b, hits_b, misses_b = _run(ADD, tmp_path / "b", tmp_path / "cache")
    assert file_a.startswith(str(tmp_path / "a")) and file_b.startswith(str(tmp_path / "b"))
    assert (hits_a, misses_a) == ("0", "1")       # compiled by the first copy ...
    assert (hits_b, misses_b) == ("1", "0")       # ... loaded by the second


ADD_ND = """
import sys
import numpy as np
from nbmoe.cpu import ops
for nd in sys.argv[1:]:                 # one signature of ops.add per number of dimensions
    a = np.ones((2,) * int(nd), np.float32)
    ops.add(np.empty_like(a), a, a)
print(len(ops.add.stats.cache_hits), len(ops.add.stats.cache_misses))
"""


def test_processes_compiling_one_function_at_once_keep_each_others_entries(tmp_path):
    """Two processes compile two signatures of one function (one index file) at the same
    time; a third loads both from the cache."""
    procs = [subprocess.Popen([sys.executable, "-c", ADD_ND, nd], env=_env(tmp_path), stdout=subprocess.PIPE,
                              text=True) for nd in ("2", "3")]
    assert [p.communicate()[0].split() for p in procs] == [["0", "1"], ["0", "1"]]
    out = subprocess.run([sys.executable, "-c", ADD_ND, "2", "3"], env=_env(tmp_path), capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["2", "0"]


PAR_FIRST = """
import numpy as np
from nbmoe.cpu import ops
a = np.ones(1 << 20, np.float32)
ops._add_par(a, a, a)                   # a parallel kernel: compiled, or loaded from the cache
"""
CALLER = PAR_FIRST + """
ops.add(a, a, a)                        # compiled here, calling the one loaded above
"""
CALLER_FIRST = """
import numpy as np
from nbmoe.cpu import ops
a = np.ones(1 << 20, np.float32)
ops.add(a, a, a)
print(a[0], len(ops.add.stats.cache_hits))
"""


def test_a_kernel_calling_a_cached_parallel_one_loads_first_in_a_process(tmp_path):
    """ops.add compiled in a process that loaded its parallel callee from the cache, then
    loaded before anything else by the next process (which ended on an LLVM error)."""
    for code in (PAR_FIRST, CALLER):
        subprocess.run([sys.executable, "-c", code], env=_env(tmp_path), check=True, capture_output=True)
    r = subprocess.run([sys.executable, "-c", CALLER_FIRST], env=_env(tmp_path), capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.split() == ["2.0", "1"], r.stderr
