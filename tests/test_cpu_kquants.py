"""K-quants (Q2_K..Q6_K) and the 4-bit table types (IQ4_NL, IQ4_XS, MXFP4) on CPU vs
gguf-py's dequantize + float64 NumPy.

Letters as in test_cpu_matmul.py. Weights come two ways, read-only as the mmap'd GGUF views:
"quant": tools/ref_quant's quantizers of N(0, 1) values (gguf-py's for MXFP4), and "random":
random bytes with sane scales (tools/ref_quant.random_blocks), every code and sub-scale bit
pattern. Odd M; K = 512 (two super-blocks) or 224 for the 32-value types (7 blocks: the
integer dots take 4 blocks at a time, then the last 3 one by one). T = 1, 3: matrix-vector (float dots, or integer dots
with INT8_DOT), T = 17: dequantize + BLAS. Both INT8_DOT settings.
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from ref_quant import QUANTIZERS, random_blocks
from ref_quant import quantize as ref_quantize
from test_cpu_matmul import RTOL, RTOL_X8, expert_ids, max_rel, ref_mul_mat_id, rnd, uses_int8, x_rounded

from nbmoe.cpu import matmul

NAMES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4"]
SOURCES = ["quant", "random"]


def k_for(name):
    return 224 if name in ("IQ4_NL", "MXFP4") else 512


def weights(shape, name, source, seed=0):
    """uint8 [*shape, row_bytes] of type name, read-only."""
    K = k_for(name)
    rng = np.random.default_rng(seed)
    if source == "random":
        n = int(np.prod(shape)) * K // matmul.TYPES[int(Q[name])][0]
        w = random_blocks(rng, n, name).reshape(shape + (-1,))
    elif name == "MXFP4":
        w = gguf_quantize(rng.standard_normal(shape + (K,), dtype=np.float32), Q.MXFP4)
    else:
        w = ref_quantize(rng.standard_normal(shape + (K,), dtype=np.float32), name)
    w = np.ascontiguousarray(w)
    w.flags.writeable = False
    return w


def ref_dequant(w, name):
    return gguf_dequantize(w, Q[name]).reshape(w.shape[:-1] + (k_for(name),)).astype(np.float64)


# ---------------------------------------------------------------- reference quantizers

# rms error / rms of N(0, 1) values (llama.cpp's search-based quantizers do ~15% better)
MAX_ERR = {"Q2_K": 0.36, "Q3_K": 0.17, "Q4_K": 0.085, "Q5_K": 0.042, "Q6_K": 0.021,
           "IQ4_NL": 0.087, "IQ4_XS": 0.087}


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_ref_quantizer(name):
    """Valid blocks close to x; an all-zero super-block stays zero; shapes as gguf-py's."""
    x = rnd(3, 1024, seed=5)
    x[1, :256] = 0
    q = ref_quantize(x, name)
    assert q.dtype == np.uint8 and q.shape == (3, matmul.row_size(int(Q[name]), 1024))
    y = gguf_dequantize(q, Q[name]).reshape(3, 1024)
    assert np.all(y[1, :256] == 0)
    keep = np.ones(x.shape, bool)
    keep[1, :256] = False
    assert np.sqrt(np.mean((y - x)[keep] ** 2)) < MAX_ERR[name]


# ---------------------------------------------------------------- sizes, dequantize, get_rows

@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("source", SOURCES)
def test_sizes_dequantize_get_rows(name, source):
    qt, K = int(Q[name]), k_for(name)
    w = weights((13,), name, source)
    assert matmul.is_supported(qt) and matmul.row_size(qt, K) == w.shape[1]
    wd = ref_dequant(w, name)
    assert np.array_equal(matmul.dequantize(w, qt), wd)
    ids = np.array([3, 0, 12, 3, 7], np.int32)
    out = np.full((ids.shape[0], K), np.nan, np.float32)
    matmul.get_rows(out, w, ids, qt)
    assert np.array_equal(out, wd[ids])


# ---------------------------------------------------------------- mul_mat

@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("int8", [True, False])
def test_mul_mat(name, source, T, int8, monkeypatch):
    monkeypatch.setattr(matmul, "INT8_DOT", int8)
    qt, M = int(Q[name]), 37
    w = weights((M,), name, source, seed=2)
    x = rnd(T, k_for(name), seed=3)
    wd = ref_dequant(w, name)
    ref = x.astype(np.float64) @ wd.T
    out = np.full((T, M), np.nan, np.float32)
    matmul.mul_mat(out, w, x, qt)
    if uses_int8(name, T):
        assert max_rel(out, x_rounded(x) @ wd.T) < RTOL
        assert max_rel(out, ref) < RTOL_X8
    else:
        assert max_rel(out, ref) < RTOL
    if T == 3 and not int8:
        plain = np.full((T, M), np.nan, np.float32)
        matmul.mul_mat_plain(plain, w, x, qt)
        assert max_rel(plain, ref) < RTOL


@pytest.mark.parametrize("int8", [True, False])
@pytest.mark.parametrize("name", ["Q4_K", "IQ4_NL"])
def test_mul_mat_nan_propagates(name, int8, monkeypatch):
    monkeypatch.setattr(matmul, "INT8_DOT", int8)
    w = weights((5,), name, "quant")
    x = rnd(1, k_for(name))
    x[0, 40] = np.nan
    out = np.zeros((1, 5), np.float32)
    matmul.mul_mat(out, w, x, int(Q[name]))
    assert np.all(np.isnan(out))


# ---------------------------------------------------------------- mul_mat_id

@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("int8", [True, False])
def test_mul_mat_id(name, T, int8, monkeypatch):
    """Expert 0 chosen by every token, expert E-1 by none, token 0 names one expert twice."""
    monkeypatch.setattr(matmul, "INT8_DOT", int8)
    E, A, M = 6, 3, 19
    w = weights((E, M), name, "random" if T == 3 else "quant", seed=6)
    x = rnd(T, A, k_for(name), seed=7)
    ids = expert_ids(T, A, E, seed=T)
    ids[0, 1:] = ids[0, 1]
    out = np.full((T, A, M), np.nan, np.float32)
    matmul.mul_mat_id(out, w, x, ids, int(Q[name]))
    assert max_rel(out, ref_mul_mat_id(w, name, x, ids, rounded=True)) < RTOL
    assert max_rel(out, ref_mul_mat_id(w, name, x, ids)) < RTOL_X8
