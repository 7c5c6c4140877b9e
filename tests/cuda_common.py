"""Shared by the CUDA kernel tests: fixtures, device helpers, float64 references, error table.

Import this before anything imports numba.cuda (it imports cuda_setup, which selects the
simulator). Test modules import the fixtures they use (`_simulator_speed`, `small`) by name.
"""
import sys

import cuda_setup  # noqa: F401  (selects the simulator before numba.cuda loads; skips without it)
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from numba import cuda  # noqa: E402

import nbmoe.cuda as nbcuda  # noqa: E402

from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

import naive  # noqa: E402
from nbmoe.cuda import attention as att  # noqa: E402
from nbmoe.cuda import matmul, moe, ops  # noqa: E402

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
RTOL = 1e-5
RTOL_X8 = 1.5e-2   # the int8 path vs the exact product: x's 8-bit rounding
ERRORS = {}   # test case -> max relative error, printed at the end


@pytest.fixture(scope="module", autouse=True)
def _simulator_speed():
    """The simulator's block manager polls its threads in a busy loop, which holds the GIL
    for a whole switch interval (5 ms by default) while a simulated thread waits for it; at
    1 ms the threads run sooner, and fewer forced switches than at 5 us leave more CPU to the
    other test worker (test_cuda_ops.py, 2 cores beside other work: 29-33 s and 31-37 s of
    CPU at 1 ms, 38-42 s and 50-56 s of CPU at 5 us)."""
    old = sys.getswitchinterval()
    if nbcuda.SIM:
        sys.setswitchinterval(1e-3)
    yield
    sys.setswitchinterval(old)
    if ERRORS:
        print("\nmax relative errors (CUDA %s):" % ("simulator" if nbcuda.SIM else "GPU"))
        for k, v in sorted(ERRORS.items()):
            print(f"  {k:40s} {v:.2e}")


@pytest.fixture
def small(monkeypatch):
    """Block and tile sizes small enough for multi-block and partial-tile paths at tiny shapes."""
    monkeypatch.setattr(matmul, "MMV_WARPS", 2)
    monkeypatch.setattr(matmul, "MMA", False)     # the float tiled kernel (test_cuda_mma.py: the int8 one)
    monkeypatch.setattr(matmul, "TILE_M", 16)
    monkeypatch.setattr(matmul, "TILE_T", 8)
    monkeypatch.setattr(matmul, "TILE_T_ID", 4)
    monkeypatch.setattr(matmul, "TILE_RM", 2)
    monkeypatch.setattr(matmul, "TILE_RT", 2)
    monkeypatch.setattr(matmul, "TILED_MIN_M", 1)
    monkeypatch.setattr(matmul, "ROWS_THREADS", 32)
    monkeypatch.setattr(ops, "THREADS", 64)
    monkeypatch.setattr(ops, "NORM_THREADS", 64)
    monkeypatch.setattr(att, "HEADS_PER_BLOCK", 3)
    monkeypatch.setattr(moe, "ROUTE_WARPS", 2)
    monkeypatch.setattr(moe, "THREADS", 64)


def rnd(*shape, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def dev(a):
    return cuda.to_device(np.ascontiguousarray(a))


def poisoned(shape, dtype=np.float32):
    return cuda.to_device(np.full(shape, np.nan if dtype == np.float32 else -7, dtype))


def check(name, got, ref, rtol=RTOL):
    """Record and assert the largest error relative to the largest reference magnitude."""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape
    assert not np.isnan(got).any(), f"{name}: NaN (unwritten output?)"
    err = float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))
    ERRORS[name] = max(err, ERRORS.get(name, 0.0))
    assert err < rtol, f"{name}: max relative error {err:.2e}"


def quantize(wf, name):
    """float32 [..., K] -> uint8 [..., row_bytes] in GGUF type `name`, and its float64 values."""
    w = np.ascontiguousarray(gguf_quantize(wf, Q[name]).view(np.uint8))
    ref = gguf_dequantize(w, Q[name]).reshape(wf.shape).astype(np.float64)
    return w, ref


def x_rounded(x):
    """x [..., K] as the int8 path sees it: each 32-block's codes rint(x / d) times d = max|x| / 127."""
    xb = x.reshape(-1, 32)
    d = (np.abs(xb).max(axis=1) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    return (np.rint(xb * inv[:, None]) * d[:, None].astype(np.float64)).reshape(x.shape)


def check_x8(name, got, x, ref_of, int8):
    """The int8 path: tight against the product with x rounded as it rounds x, loose against the
    exact product (x's 8-bit rounding); the float path: tight against the exact product."""
    if int8:
        check(name + " int8", got, ref_of(x_rounded(x)))
        check(name + " int8 vs exact", got, ref_of(x), rtol=RTOL_X8)
    else:
        check(name, got, ref_of(x))


def mul_mat_id_ref(wref, x, ids):
    T, A = ids.shape
    X = x.shape[1]
    return np.stack([np.stack([wref[ids[t, a]] @ x[t, a if X == A else 0] for a in range(A)])
                     for t in range(T)])


def attn_case(T, H, Hkv, Dh, pos0, C, seed=0):
    """A device cache holding pos0 earlier positions plus the batch's k, v (stored by store_kv)."""
    kc = cuda.to_device(np.zeros((C, Hkv, Dh), np.uint16))
    vc = cuda.to_device(np.zeros((C, Hkv, Dh), np.uint16))
    k_old, v_old = rnd(pos0, Hkv, Dh, seed=seed), rnd(pos0, Hkv, Dh, seed=seed + 1)
    if pos0:
        att.store_kv(kc, vc, dev(k_old), dev(v_old), 0)
    q = rnd(T, H, Dh, seed=seed + 2, scale=2.0)
    k, v = rnd(T, Hkv, Dh, seed=seed + 3), rnd(T, Hkv, Dh, seed=seed + 4)
    att.store_kv(kc, vc, dev(k), dev(v), pos0)
    k_all = naive.f16_round(np.concatenate([k_old, k]))
    v_all = naive.f16_round(np.concatenate([v_old, v]))
    return q, kc, vc, k_all, v_all
