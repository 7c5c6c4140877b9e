"""Decode kernels open one parallel region a call. Inside a Numba parallel kernel, a slice
assignment, an array expression or np.zeros outside the prange is a parallel loop of its own:
a fork and join more (one a head, in a loop over heads). Each kernel is compiled afresh here
(the disk cache keeps no diagnostics) and Numba's own listing counts its regions."""
import contextlib
import io
import re

import numba
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from nbmoe.cpu import attention, fused, matmul
from nbmoe.cpu.specialize import ConstantArgs, build


def regions(py_func, *args, **options):
    kernel = numba.njit(parallel=True, error_model="numpy", **options)(py_func)
    kernel(*args)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        kernel.parallel_diagnostics(level=1)
    listing = text.getvalue()
    loops = set(re.findall(r"\| #(\d+)\s*$", listing, re.M))      # every parallel loop found
    serial = set(re.findall(r"\+--(\d+) \(serial\)", listing))     # run inside another one
    return len(loops - serial)


def test_split_decode_attention_is_one_region():
    rng = np.random.default_rng(0)
    H, Hkv, Dh, C = 8, 2, 64, 512
    q = rng.standard_normal((1, H, Dh)).astype(np.float32)
    cache = rng.standard_normal((C, Hkv, Dh)).astype(np.float16).view(np.uint16)
    out = np.empty((1, H, Dh), np.float32)
    assert regions(attention._decode_split.py_func, out, q, cache, cache, 400, 0.1, 0, attention.EMPTY) == 1


def test_expert_ffn_is_one_region():
    rng = np.random.default_rng(0)
    E, A, D, F = 4, 2, 64, 32
    w = np.stack([quantize(rng.standard_normal((F, D)).astype(np.float32), Q.Q8_0) for _ in range(E)])
    wd = np.stack([quantize(rng.standard_normal((D, F)).astype(np.float32), Q.Q8_0) for _ in range(E)])
    qt = int(Q.Q8_0)
    i8 = matmul._int8(qt)
    kernel = build(fused._expert_ffn_kernel, (qt, i8, qt, i8))
    x = rng.standard_normal((1, 1, D)).astype(np.float32)
    args = (np.zeros((1, D), np.float32), np.zeros((1, A, F), np.float32), w, w, 0, wd, x,
            np.array([[0, 2]], np.int32), np.ones((1, A), np.float32), fused.EMPTY, fused.EMPTY,
            fused.EMPTY, (16, 16), fused.ACT_SILU, 2)
    assert regions(kernel.py_func, *args, pipeline_class=ConstantArgs) == 1
