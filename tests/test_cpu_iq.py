"""The grid IQ types (IQ2_XXS ... IQ1_M) on CPU vs gguf-py's dequantize + float64 NumPy.

Letters as in test_cpu_matmul.py. gguf-py cannot quantize these types: weights are random
valid blocks (tools/ref_quant_iq.random_blocks: every field random, d sane), read-only as the
mmap'd GGUF views are. Odd M; K = 512 (two super-blocks); T = 1, 3 take the matrix-vector
path (float dots, or integer dots where the type has them and INT8_DOT is on), T = 17 the
dequantize + BLAS path.
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from ref_quant_iq import NAMES, quantize, random_blocks
from test_cpu_matmul import RTOL, RTOL_X8, expert_ids, max_rel, rnd, uses_int8, x_rounded

from nbmoe.cpu import matmul

K = 512


def weights(shape, name, seed=0):
    """Random valid blocks of type name: uint8 [*shape, K / 256 * type_size], read-only."""
    n = int(np.prod(shape)) * (K // 256)
    w = random_blocks(np.random.default_rng(seed), n, name).reshape(shape + (-1,))
    w.flags.writeable = False
    return w


def ref_dequant(w, name):
    return gguf_dequantize(w, Q[name]).reshape(w.shape[:-1] + (K,)).astype(np.float64)


@pytest.mark.parametrize("name", NAMES)
def test_sizes_dequantize_get_rows(name):
    qt = int(Q[name])
    w = weights((13,), name)
    assert matmul.is_supported(qt) and matmul.row_size(qt, K) == w.shape[1]
    wd = ref_dequant(w, name)
    assert np.array_equal(matmul.dequantize(w, qt), wd)
    ids = np.array([3, 0, 12, 3, 7], np.int32)
    out = np.full((ids.shape[0], K), np.nan, np.float32)
    matmul.get_rows(out, w, ids, qt)
    assert np.array_equal(out, wd[ids])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("int8", [True, False])
def test_mul_mat(name, T, int8, monkeypatch):
    monkeypatch.setattr(matmul, "INT8_DOT", int8)
    qt = int(Q[name])
    w = weights((37,), name, seed=2)
    x = rnd(T, K, seed=3)
    wd = ref_dequant(w, name)
    out = np.full((T, 37), np.nan, np.float32)
    matmul.mul_mat(out, w, x, qt)
    if uses_int8(name, T):
        assert max_rel(out, x_rounded(x) @ wd.T) < RTOL
        assert max_rel(out, x.astype(np.float64) @ wd.T) < RTOL_X8
    else:
        assert max_rel(out, x.astype(np.float64) @ wd.T) < RTOL
    if T == 3 and not int8:
        plain = np.full((T, 37), np.nan, np.float32)
        matmul.mul_mat_plain(plain, w, x, qt)
        assert max_rel(plain, x.astype(np.float64) @ wd.T) < RTOL


def ref_mul_mat_id(w, name, x, ids):
    """Per (t, a): expert ids[t, a]'s exact rows @ x, with x rounded to 8 bits where the
    product takes an integer-dot path (matmul.int8_path of the tokens sharing the expert)."""
    wd = ref_dequant(w, name)
    xr = x_rounded(x)
    T, A = ids.shape
    count = np.bincount(ids.ravel(), minlength=w.shape[0])
    out = np.zeros((T, A, wd.shape[1]))
    for t in range(T):
        for a in range(A):
            e, xa = ids[t, a], a if x.shape[1] == A else 0
            n = count[e]
            out[t, a] = wd[e] @ (xr[t, xa] if uses_int8(name, n) else np.float64(x[t, xa]))
    return out


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("T", [1, 3, 17])
def test_mul_mat_id(name, T):
    """Expert 0 chosen by every token, expert E-1 by none, token 0 names one expert twice."""
    E, A, M = 6, 3, 19
    w = weights((E, M), name, seed=6)
    x = rnd(T, A, K, seed=7)
    ids = expert_ids(T, A, E, seed=T)
    ids[0, 1:] = ids[0, 1]
    out = np.full((T, A, M), np.nan, np.float32)
    matmul.mul_mat_id(out, w, x, ids, int(Q[name]))
    assert max_rel(out, ref_mul_mat_id(w, name, x, ids)) < RTOL


@pytest.mark.parametrize("name", NAMES)
def test_ref_quantizer(name):
    """tools/ref_quant_iq.quantize: valid blocks close to x; an all-zero block stays zero."""
    x = rnd(4, K, seed=5)
    x[1, :256] = 0
    q = quantize(x, name)
    assert q.shape == (4, matmul.row_size(int(Q[name]), K))
    xd = gguf_dequantize(q, Q[name]).reshape(4, K)
    assert np.all(xd[1, :256] == 0)
    min_corr = 0.8 if name.startswith("IQ1") else 0.9
    assert np.corrcoef(xd[[0, 2, 3]].ravel(), x[[0, 2, 3]].ravel())[0, 1] > min_corr


@pytest.mark.parametrize("int8", [True, False])
@pytest.mark.parametrize("name", ["IQ2_XXS", "IQ1_M"])
def test_nan_propagates(name, int8, monkeypatch):
    monkeypatch.setattr(matmul, "INT8_DOT", int8)
    w = weights((5,), name)
    x = rnd(1, K)
    x[0, 300] = np.nan
    out = np.zeros((1, 5), np.float32)
    matmul.mul_mat(out, w, x, int(Q[name]))
    assert np.all(np.isnan(out))
