"""cpu/specialize.py: kernels built per weight type; dispatch functions pruned to the branch
of a constant qtype, so that a cold start compiles only the model's types."""
import os
import subprocess
import sys

import numpy as np
import pytest
from numba import njit
from numba.core.errors import TypingError

from nbmoe.cpu.specialize import ConstantArgs, build, entry


def _scale_kernel(k):
    @njit
    def scale(out, x):
        for i in range(x.shape[0]):
            out[i] = k * x[i]
    return scale


scale = entry(_scale_kernel, "out, x, k")
TWO_THREE = (2, 3)


def test_entry_builds_one_kernel_per_constant_from_python_and_from_njit():
    x, out = np.arange(4, dtype=np.float32), np.zeros(4, np.float32)
    scale(out, x, 3)
    assert list(out) == [0, 3, 6, 9]
    assert build(_scale_kernel, (3,)) is build(_scale_kernel, (np.int64(3),))   # same key
    assert build(_scale_kernel, (3,)).nbmoe_origin[1:] == ("_scale_kernel", (3,))

    K = 2

    @njit
    def caller(out, x):
        scale(out, x, K)          # a closure constant: the kernel for 2 is linked

    caller(out, x)
    assert list(out) == [0, 2, 4, 6]

    @njit
    def runtime(out, x, k):
        scale(out, x, k)          # a run-time value: no kernel to link

    with pytest.raises(TypingError):
        runtime(out, x, 2)


def test_constant_args_compile_the_branch_of_the_constant_alone():
    @njit
    def a():
        return 1

    @njit
    def b():
        return 2

    @njit
    def c():
        return 3

    @njit(pipeline_class=ConstantArgs)
    def pick(q):
        r = q                     # a copy of the constant prunes too
        if r == 1:
            return a()
        elif r in TWO_THREE:      # (a module's tuple, as the type groups in quants.py)
            return b()
        return c()

    @njit
    def two():
        return pick(2)

    assert two() == 2
    assert b.signatures and not a.signatures and not c.signatures
    assert pick(1) == 1 and pick(7) == 3          # a run-time value: every branch, as before


SPECIALIZED = """
import numpy as np
from numba.core import event
import nbmoe
from nbmoe.cpu import matmul
from nbmoe.cpu.quants import Q8_0
names = []
class L(event.Listener):
    def on_start(self, ev): pass
    def on_end(self, ev): names.append(ev.data["dispatcher"].py_func.__name__)
event.register("numba:compile", L())
w = np.zeros((4, 34 * 2), np.uint8)
out = np.zeros((4, 64), np.float32)
matmul.dequantize(w, Q8_0)
print(" ".join(names))
"""


def test_a_kernel_compiles_its_own_types_decoder_only(tmp_path):
    env = dict(os.environ, NBMOE_CACHE=str(tmp_path))
    env.pop("NUMBA_CACHE_DIR", None)
    names = subprocess.run([sys.executable, "-c", SPECIALIZED], env=env, capture_output=True, text=True,
                           check=True).stdout.split()
    decoders = [n for n in names if n.startswith("dequant_rows_")]
    assert decoders == ["dequant_rows_q8_0"], names
