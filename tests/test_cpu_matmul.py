"""CPU quantized matrix products vs gguf-py's dequantize + a float64 NumPy matmul.

Letters: T tokens, M weight rows, K values per row, E experts, A chosen experts, X input rows
per token (1 or A). Weights are quantized by gguf-py and made read-only, as the mmap'd GGUF
views are (a read-only array is a different Numba type: tests compile what production runs).
Odd M everywhere; T = 17 >= matmul.BLAS_MIN_T takes the batched path (gemm_i8 for the integer
types with INT8_DOT, else dequantize + BLAS), T = 1, 3 the matrix-vector path, run both ways:
integer dots (x rounded to 8-bit blocks: compared with the float64 product of the rounded x,
1e-5, and loosely with the exact one) and float dots.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import early
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from nbmoe.cpu import matmul
from nbmoe.cpu import quants_q4x
from nbmoe.cpu.quants_int8 import INT8_TYPES, prepare_blocks, quantize_x, x_extra_words

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
RTOL = 1e-5      # float32 sums of exactly decoded values
RTOL_X8 = 1.5e-2  # the int8 path vs the exact product: x's 8-bit rounding


def rnd(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def quantize(wf, name):
    """float32 [..., K] -> read-only uint8 [..., row_bytes] in GGUF type `name`."""
    w = np.ascontiguousarray(gguf_quantize(wf, Q[name]).view(np.uint8))
    w.flags.writeable = False
    return w


def ref_dequant(w, name, K):
    return gguf_dequantize(w, Q[name]).reshape(w.shape[:-1] + (K,)).astype(np.float64)


def max_rel(got, ref):
    """Largest error relative to the largest reference magnitude."""
    return float(np.max(np.abs(got.astype(np.float64) - ref)) / max(np.max(np.abs(ref)), 1e-30))


def x_rounded(x):
    """x [..., K] as the int8 path sees it: each 32-block rounded to int8 codes times a scale."""
    x2 = np.ascontiguousarray(x.reshape(-1, x.shape[-1]))
    out = np.empty(x2.shape)
    for n in range(x2.shape[0]):
        xq = np.empty(x2.shape[1], np.int8)
        xd, xs = (np.empty(x2.shape[1] // 32, np.float32) for _ in range(2))
        quantize_x(xq, xd, xs, x2[n])
        out[n] = (xq.reshape(-1, 32) * xd[:, None].astype(np.float64)).ravel()
    return out.reshape(x.shape)


def test_quantize_x():
    """Exact: d = max|x| / 127, codes rint(x / d), xs = d * (sum of the codes) in float32; 40
    blocks, so the vectorised division loop runs its full vectors and its tail."""
    B = 40
    x = rnd(B * 32, seed=11) * np.repeat(np.float32(10) ** np.linspace(-3, 3, B, dtype=np.float32), 32)
    x[32:64] = 0    # all-zero blocks: scale 0, codes 0
    x[-32:] = 0
    xq = np.empty(B * 32, np.int8)
    xd, xs = np.empty(B, np.float32), np.empty(B, np.float32)
    quantize_x(xq, xd, xs, x)
    d = np.abs(x.reshape(B, 32)).max(1) / np.float32(127)
    assert np.array_equal(xd, d)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    assert np.array_equal(xq, np.rint(x.reshape(B, 32) * inv[:, None]).ravel().astype(np.int8))
    assert np.array_equal(xs, d * xq.reshape(B, 32).sum(1).astype(np.float32))


def uses_int8(name, n_tokens):
    """Whether a product with n_tokens sharing the weights takes an integer-dot path
    (matrix-vector, or gemm_i8)."""
    return matmul.int8_path(int(Q[name]), n_tokens)


def k_for(name):
    return 40 if name in ("F32", "F16", "BF16") else 96  # float rows need no 32-blocks: a tail


# ---------------------------------------------------------------- sizes, dequantize, get_rows

@pytest.mark.parametrize("name", TYPES)
def test_sizes_and_dequantize(name):
    M, K = 13, k_for(name)
    w = quantize(rnd(M, K), name)
    assert matmul.is_supported(int(Q[name]))
    assert matmul.row_size(int(Q[name]), K) == w.shape[1]
    assert np.array_equal(matmul.dequantize(w, int(Q[name])), ref_dequant(w, name, K))


def test_unsupported():
    assert not matmul.is_supported(int(Q.TQ1_0))


@pytest.mark.parametrize("name", TYPES)
def test_get_rows(name):
    M, K = 11, k_for(name)
    w = quantize(rnd(M, K, seed=1), name)
    ids = np.array([3, 0, 10, 3, 7], np.int32)
    out = np.full((ids.shape[0], K), np.nan, np.float32)
    matmul.get_rows(out, w, ids, int(Q[name]))
    assert np.array_equal(out, ref_dequant(w, name, K)[ids])


# ---------------------------------------------------------------- mul_mat

@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("int8", [True, False])
def test_mul_mat(name, T, int8, monkeypatch):
    monkeypatch.setattr(matmul, "INT8_DOT", int8)
    M, K = 37, k_for(name)
    w = quantize(rnd(M, K, seed=2), name)
    x = rnd(T, K, seed=3)
    wd = ref_dequant(w, name, K)
    ref = x.astype(np.float64) @ wd.T
    out = np.full((T, M), np.nan, np.float32)
    matmul.mul_mat(out, w, x, int(Q[name]))
    if uses_int8(name, T):
        assert max_rel(out, x_rounded(x) @ wd.T) < RTOL
        assert max_rel(out, ref) < RTOL_X8
    else:
        assert max_rel(out, ref) < RTOL
    plain = np.full((T, M), np.nan, np.float32)
    matmul.mul_mat_plain(plain, w, x, int(Q[name]))
    assert max_rel(plain, ref) < RTOL


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0"])
def test_mul_mat_blas_tiles(name, monkeypatch):
    """Several row tiles (the last one short) instead of one."""
    M, K, T = 45, 64, matmul.BLAS_MIN_T
    monkeypatch.setattr(matmul, "GEMM_I8", False)
    monkeypatch.setattr(matmul, "TILE_BYTES", 16 * K * 4)
    w = quantize(rnd(M, K, seed=4), name)
    x = rnd(T, K, seed=5)
    out = np.full((T, M), np.nan, np.float32)
    matmul.mul_mat(out, w, x, int(Q[name]))
    assert max_rel(out, x.astype(np.float64) @ ref_dequant(w, name, K).T) < RTOL


@pytest.mark.parametrize("int8", [True, False])
def test_mul_mat_nan_propagates(int8, monkeypatch):
    monkeypatch.setattr(matmul, "INT8_DOT", int8)
    M, K = 5, 64
    w = quantize(rnd(M, K), "Q4_0")
    x = rnd(1, K)
    x[0, 40] = np.nan
    out = np.zeros((1, M), np.float32)
    matmul.mul_mat(out, w, x, int(Q.Q4_0))
    assert np.all(np.isnan(out))


# ---------------------------------------------------------------- mul_mat_id

def ref_mul_mat_id(w, name, x, ids, rounded=False):
    """Exact products; rounded: with x rounded to 8 bits for experts on the int8 path."""
    wd = ref_dequant(w, name, x.shape[-1])
    xr = x_rounded(x) if rounded and int(Q[name]) in INT8_TYPES else x.astype(np.float64)
    T, A = ids.shape
    count = np.bincount(ids.ravel(), minlength=w.shape[0])
    out = np.zeros((T, A, wd.shape[1]))
    for t in range(T):
        for a in range(A):
            e, xa = ids[t, a], a if x.shape[1] == A else 0
            n = count[e]                                   # tokens sharing expert e's weights
            out[t, a] = wd[e] @ (xr[t, xa] if uses_int8(name, n) else np.float64(x[t, xa]))
    return out


def expert_ids(T, A, E, seed):
    """Distinct experts per token, expert 0 chosen by every token, expert E-1 by none."""
    rng = np.random.default_rng(seed)
    ids = np.empty((T, A), np.int32)
    for t in range(T):
        ids[t] = np.concatenate([[0], 1 + rng.permutation(E - 2)[:A - 1]])
        rng.shuffle(ids[t])
    return ids


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("shared_x", [True, False])
def test_mul_mat_id(name, T, shared_x):
    E, A, M, K = 6, 3, 19, k_for(name)
    w = quantize(rnd(E, M, K, seed=6), name)
    x = rnd(T, 1 if shared_x else A, K, seed=7)
    ids = expert_ids(T, A, E, seed=T)
    out = np.full((T, A, M), np.nan, np.float32)
    matmul.mul_mat_id(out, w, x, ids, int(Q[name]))
    assert max_rel(out, ref_mul_mat_id(w, name, x, ids, rounded=True)) < RTOL
    assert max_rel(out, ref_mul_mat_id(w, name, x, ids)) < RTOL_X8


@pytest.mark.parametrize("T", [3, 17])
def test_mul_mat_id_float_dots(T, monkeypatch):
    monkeypatch.setattr(matmul, "INT8_DOT", False)
    E, A, M, K = 6, 3, 19, 64
    w = quantize(rnd(E, M, K, seed=6), "Q5_1")
    x = rnd(T, A, K, seed=7)
    ids = expert_ids(T, A, E, seed=T)
    out = np.full((T, A, M), np.nan, np.float32)
    matmul.mul_mat_id(out, w, x, ids, int(Q.Q5_1))
    assert max_rel(out, ref_mul_mat_id(w, "Q5_1", x, ids)) < RTOL


def test_mul_mat_id_repeated_expert_in_token():
    """The same expert twice in one token (not from top-k routing, but defined)."""
    E, A, M, K = 4, 2, 7, 64
    w = quantize(rnd(E, M, K, seed=8), "Q4_1")
    x = rnd(2, A, K, seed=9)
    ids = np.array([[2, 2], [1, 2]], np.int32)
    out = np.full((2, A, M), np.nan, np.float32)
    matmul.mul_mat_id(out, w, x, ids, int(Q.Q4_1))
    assert max_rel(out, ref_mul_mat_id(w, "Q4_1", x, ids, rounded=True)) < RTOL


# ---------------------------------------------------------------- Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 int8 kernels
# Two rows per step and 4 blocks per call, then a pair and a single block (quants_int8.dot_rows_b32):
# K = 224 is 4 + 2 + 1 blocks, 576 (SmolLM2) 16 + 2; odd M leaves a row alone; T = 1 takes one
# item a thread (matmul.item_rows), made finer here so several items run.

@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
@pytest.mark.parametrize("K", [224, 576])
@pytest.mark.parametrize("T", [1, 2])
def test_mul_mat_int8_blocks(name, K, T, monkeypatch):
    monkeypatch.setattr(matmul, "INT8_DOT", True)
    monkeypatch.setattr(matmul, "VEC_ITEMS_PER_THREAD", 4)
    monkeypatch.setattr(matmul, "SERIAL_MAX_BYTES", 0)   # items in a parallel region
    M = 41
    w = quantize(rnd(M, K, seed=12), name)
    x = rnd(T, K, seed=13)
    x[0, 5] = 40.0  # one large value: its block's scale differs from the rest
    wd = ref_dequant(w, name, K)
    out = np.full((T, M), np.nan, np.float32)
    matmul.mul_mat(out, w, x, int(Q[name]))
    assert max_rel(out, x_rounded(x) @ wd.T) < RTOL
    assert max_rel(out, x.astype(np.float64) @ wd.T) < RTOL_X8


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_mul_mat_id_int8_blocks(name, monkeypatch):
    monkeypatch.setattr(matmul, "INT8_DOT", True)
    monkeypatch.setattr(matmul, "VEC_ITEMS_PER_THREAD", 4)
    monkeypatch.setattr(matmul, "SERIAL_MAX_BYTES", 0)   # items in a parallel region
    E, A, M, K = 5, 2, 23, 224
    w = quantize(rnd(E, M, K, seed=14), name)
    x = rnd(1, A, K, seed=15)
    ids = np.array([[4, 1]], np.int32)
    out = np.full((1, A, M), np.nan, np.float32)
    matmul.mul_mat_id(out, w, x, ids, int(Q[name]))
    assert max_rel(out, ref_mul_mat_id(w, name, x, ids, rounded=True)) < RTOL


# quants_q4x (Q4_0 with AVX-512 BW + VNNI): rows of 18 B bytes read 64 at a time, x laid out
# under them. K = 32, 64, 96: rows shorter than one step (masked loads only); 288: two steps
# and a tail; 1024: nine whole steps; 768 (an expert's): six and a tail. Every row but the
# last reads its tail step on into the next row.

@pytest.mark.skipif(not quants_q4x.ENABLED, reason="needs AVX-512 BW and VNNI")
@pytest.mark.parametrize("K", [32, 64, 96, 288, 768, 1024])
def test_q4x_rows(K):
    M = 5
    w = quantize(rnd(M, K, seed=16), "Q4_0")
    x = rnd(K, seed=17)
    x[3] = -25.0                                  # one block with a larger scale
    xq, xd, xs = np.empty(K, np.int8), np.empty(K // 32, np.float32), np.empty(K // 32, np.float32)
    quantize_x(xq, xd, xs, x)
    xb = np.empty(x_extra_words(int(Q.Q4_0), K), np.int32)
    prepare_blocks(xb, np.empty(0, np.float32), xq, xd, xs, int(Q.Q4_0))
    out = np.full(M, np.nan, np.float32)
    quants_q4x.dot_rows_q4x(out, w, xb)
    assert max_rel(out, ref_dequant(w, "Q4_0", K) @ x_rounded(x)) < RTOL


def test_prepare_q4_k_order():
    """Q4_K's x in its code order (quants_k_i8's top): per 128 values the 32-value pieces
    0, 2, 1, 3, i.e. under qs bytes 64p.. first the low nibbles' values, then the high ones'."""
    K = 512
    xq = np.arange(K, dtype=np.int64).astype(np.int8)            # value i -> code i mod 256
    xb = np.zeros(x_extra_words(int(Q.Q4_K), K), np.int32)
    prepare_blocks(xb, np.empty(0, np.float32), xq, np.ones(K // 32, np.float32), np.ones(K // 32, np.float32),
                   int(Q.Q4_K))
    order = np.concatenate([128 * h + np.r_[0:32, 64:96, 32:64, 96:128] for h in range(K // 128)])
    assert np.array_equal(xb.view(np.int8)[:K], xq[order])


def test_item_rows(monkeypatch):
    monkeypatch.setattr(matmul, "VEC_ITEMS_PER_THREAD", 4)
    monkeypatch.setattr(matmul, "SERIAL_MAX_BYTES", 0)   # items in a parallel region
    assert matmul.item_rows(100, 360, 3) == matmul.ITEM_ROWS        # several tokens: L1-sized runs
    rows = matmul.item_rows(101, 360, 1)                # one token: 4 items a thread, rows even
    n = 4 * matmul.numba.get_num_threads()
    assert rows % 2 == 0 and rows - 2 < -(-101 // n) <= rows
    assert matmul.item_rows(3, 360, 1) == 2
    monkeypatch.setattr(matmul, "SERIAL_MAX_BYTES", 4000)
    assert matmul.item_rows(11, 360, 1) == 11                         # small: one item, no region
    assert matmul.item_rows(11, 360, 3) == matmul.ITEM_ROWS


@pytest.mark.parametrize("name", ["F32", "Q4_1", "Q8_0"])
def test_mat_vec_on_one_thread(name, monkeypatch):
    """A weight below SERIAL_MAX_BYTES: one item on the calling thread, the very sums of the
    parallel items (each row's dot is the same code)."""
    monkeypatch.setattr(matmul, "VEC_ITEMS_PER_THREAD", 4)
    M, K = 21, 96
    w, x = quantize(rnd(M, K, seed=31), name), rnd(1, K, seed=32)
    qt, int8 = int(Q[name]), matmul._int8(int(Q[name]))
    one, items = (np.full((1, M), np.nan, np.float32) for _ in range(2))
    matmul.mat_vec(one, w, x, qt, int8, matmul.item_rows(M, w.shape[1], 1, qt))
    monkeypatch.setattr(matmul, "SERIAL_MAX_BYTES", 0)
    step = matmul.item_rows(M, w.shape[1], 1, qt)
    assert step < M
    matmul.mat_vec(items, w, x, qt, int8, step)
    np.testing.assert_array_equal(one, items)
    assert max_rel(one, (x_rounded(x) if int8 else x.astype(np.float64)) @ ref_dequant(w, name, K).T) < RTOL


# Four streams (quants.stream_rows) need runs of >= 4 * STREAM_MIN_BYTES: rows of 4096
# values, enough of them for one item of four streams plus a tail (Q4_0: the masked last
# row), for every type with an integer matrix-vector kernel.
STREAM_TYPES = sorted(Q(t).name for t in INT8_TYPES)


@pytest.mark.parametrize("name", STREAM_TYPES)
def test_mat_vec_streams(name, monkeypatch):
    import ref_quant
    import ref_quant_iq
    from nbmoe.cpu.quants import STREAM_MIN_BYTES
    monkeypatch.setattr(matmul, "INT8_DOT", True)
    monkeypatch.setattr(matmul, "SERIAL_MAX_BYTES", 1 << 30)     # one item, on this thread
    K, rb = 4096, matmul.row_size(int(Q[name]), 4096)
    need = -(-4 * STREAM_MIN_BYTES // rb)                      # rows for four streams
    M = (need + 3) // 4 * 4 + 2                                # and a tail of two
    blocks = (ref_quant_iq if name in ref_quant_iq.NAMES else ref_quant).random_blocks
    n = M * K // matmul.TYPES[int(Q[name])][0]
    w = np.ascontiguousarray(blocks(np.random.default_rng(27), n, name).reshape(M, -1))
    w.flags.writeable = False
    assert (M - 1) * w.shape[1] >= 4 * STREAM_MIN_BYTES and matmul.item_rows(M, w.shape[1], 1) == M
    x = rnd(1, K, seed=28)
    out = np.full((1, M), np.nan, np.float32)
    matmul.mul_mat(out, w, x, int(Q[name]))
    assert max_rel(out, x_rounded(x) @ ref_dequant(w, name, K).T) < RTOL


@pytest.mark.parametrize("name", ["IQ4_NL", "MXFP4"])
def test_quads_without_vbmi(name):
    """The 4-block quads of IQ4_NL / MXFP4 gather their codes and scales with byte permutes
    where the CPU has AVX-512 VBMI; the body for the others (four 16-byte loads, the scales one
    at a time) is built here as its own intrinsic, so both run on a VBMI machine. K = 768:
    6 quads a row; M = 5 (one row alone after the stream loop's none)."""
    import ref_quant
    from numba import njit
    from nbmoe.cpu import quants_iq4 as q
    from nbmoe.cpu.quants import FM, rows_in_streams
    from nbmoe.cpu.simd import acc_intrinsic
    size, qs_at, scales, table = ((17, 1, q._mx_scales, q._MXFP4_U8) if name == "MXFP4"
                                  else (18, 2, q._nl_scales, q._IQ4_U8))
    acc = acc_intrinsic(q._blocks32_quad(size, qs_at, scales, table, vbmi=False), 128, 16, 4 * size)

    @njit(fastmath=FM)
    def dot_rows(out, w, xb, xd):
        xq4, xl = q.quads(xb, w.shape[1] // size * 32)
        rows_in_streams(acc, 4 * size, w.shape[1] // size // 4, out, w, xq4, xd, xl)
    M, K, qt = 5, 768, int(Q[name])
    w = np.ascontiguousarray(ref_quant.random_blocks(np.random.default_rng(31), M * K // 32, name).reshape(M, -1))
    x = rnd(K, seed=32)
    xq, xd, xs = np.empty(K, np.int8), np.empty(K // 32, np.float32), np.empty(K // 32, np.float32)
    quantize_x(xq, xd, xs, x)
    xb = np.empty(x_extra_words(qt, K), np.int32)
    prepare_blocks(xb, np.empty(0, np.float32), xq, xd, xs, qt)
    out = np.full(M, np.nan, np.float32)
    dot_rows(out, w, xb, xd)
    assert max_rel(out, ref_dequant(w, name, K) @ x_rounded(x[None])[0]) < RTOL


# ---------------------------------------------------------------- repacked layouts (-rtr)
# quants_rtr: groups of 16 interleaved rows; M = 37 is 2 groups and a 5-row tail in the GGUF
# layout; K = 224 is 7 blocks (odd: qs vectors not 64-byte aligned); IQ4_NL, MXFP4 and Q4_K
# (quants_rtr_k) from random valid blocks (every code and scale bit), Q4_K at K of real
# models, 768, 2048, 4096. The repacked
# kernels are compared with the plain int8 kernels (same x rounding: only the float summation
# order differs), with float64 over the rounded x, and with the exact product; T = 17 takes
# the batched path (gemm_i8, or decode + BLAS). VEC_ITEMS_PER_THREAD raised: T = 1 runs
# several items of whole groups.

RTR_TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "IQ4_NL", "MXFP4", "IQ4_XS"]
RTOL_RTR = 2e-6


def rtr_k(name):
    return 768 if name in ("Q4_K", "IQ4_XS") else 224


def rtr_weights(shape, name, K, seed):
    """Read-only GGUF weights [*shape, row_bytes] of a repackable type."""
    if name in ("Q4_0", "Q4_1", "Q8_0"):
        return quantize(rnd(*shape, K, seed=seed), name)
    from ref_quant import random_blocks
    n = int(np.prod(shape)) * K // matmul.TYPES[int(Q[name])][0]
    w = np.ascontiguousarray(random_blocks(np.random.default_rng(seed), n, name).reshape(shape + (-1,)))
    w.flags.writeable = False
    return w


def repacked(w, name):
    from nbmoe.cpu.quants_rtr import repack_tensor
    wr, qr = repack_tensor(w, int(Q[name]))
    wr.flags.writeable = False
    return wr, qr


@pytest.mark.parametrize("name", RTR_TYPES)
def test_repack_decodes_exactly(name):
    E, M, K = 2, 37, rtr_k(name)
    w = rtr_weights((E, M), name, K, seed=20)
    wr, qr = repacked(w, name)
    assert wr.shape == w.shape and qr != int(Q[name]) and matmul.row_size(qr, K) == w.shape[-1]
    assert np.array_equal(matmul.dequantize(wr, qr), ref_dequant(w, name, K))
    ids = np.array([0, 15, 16, 31, 32, 36, 17], np.int32)      # group starts / ends, the tail
    out = np.full((ids.shape[0], K), np.nan, np.float32)
    matmul.get_rows(out, wr[1], ids, qr)
    assert np.array_equal(out, ref_dequant(w[1], name, K)[ids])


@pytest.mark.parametrize("name, T, K", [(n, T, rtr_k(n)) for n in RTR_TYPES for T in (1, 2, 5, 17)]
                         + [("Q4_K", 1, 2048), ("Q4_K", 3, 4096), ("IQ4_XS", 1, 2048), ("IQ4_XS", 3, 4096)])
def test_mul_mat_rtr(name, T, K, monkeypatch):
    monkeypatch.setattr(matmul, "INT8_DOT", True)
    monkeypatch.setattr(matmul, "VEC_ITEMS_PER_THREAD", 4)
    monkeypatch.setattr(matmul, "SERIAL_MAX_BYTES", 0)   # items in a parallel region
    M = 37
    w = rtr_weights((M,), name, K, seed=21)
    wr, qr = repacked(w, name)
    x = rnd(T, K, seed=22)
    if name in ("Q4_0", "Q4_1", "Q8_0"):   # (random blocks: the outlier's coarse x alone exceeds RTOL_X8)
        x[0, 5] = 40.0
    wd = ref_dequant(w, name, K)
    got, plain = (np.full((T, M), np.nan, np.float32) for _ in range(2))
    matmul.mul_mat(got, wr, x, qr)
    matmul.mul_mat(plain, w, x, int(Q[name]))
    assert max_rel(got, plain.astype(np.float64)) < RTOL_RTR
    if matmul.int8_path(qr, T):
        assert max_rel(got, x_rounded(x) @ wd.T) < RTOL
        assert max_rel(got, x.astype(np.float64) @ wd.T) < RTOL_X8
    else:
        assert max_rel(got, x.astype(np.float64) @ wd.T) < RTOL
    ref_plain = np.full((T, M), np.nan, np.float32)
    matmul.mul_mat_plain(ref_plain, wr, x, qr)
    assert max_rel(ref_plain, x.astype(np.float64) @ wd.T) < RTOL


@pytest.mark.parametrize("name", RTR_TYPES)
def test_mul_mat_rtr_streams(name, monkeypatch):
    """One work item of 5 groups of 4096 values and a 5-row tail: groups 0-3 go side by
    side as four streams (quants.stream_rows), group 4 alone, the tail in the GGUF layout."""
    monkeypatch.setattr(matmul, "SERIAL_MAX_BYTES", 1 << 30)     # one item, on this thread
    M, K = 85, 4096
    w = rtr_weights((M,), name, K, seed=25)
    wr, qr = repacked(w, name)
    assert matmul.item_rows(M, w.shape[1], 1, qr) == M
    x = rnd(1, K, seed=26)
    got, plain = (np.full((1, M), np.nan, np.float32) for _ in range(2))
    matmul.mul_mat(got, wr, x, qr)
    matmul.mul_mat(plain, w, x, int(Q[name]))
    assert max_rel(got, plain.astype(np.float64)) < RTOL_RTR


@pytest.mark.parametrize("name", RTR_TYPES)
@pytest.mark.parametrize("T", [1, 5, 17])
def test_mul_mat_id_rtr(name, T, monkeypatch):
    monkeypatch.setattr(matmul, "INT8_DOT", True)
    monkeypatch.setattr(matmul, "VEC_ITEMS_PER_THREAD", 4)
    monkeypatch.setattr(matmul, "SERIAL_MAX_BYTES", 0)   # items in a parallel region
    E, A, M, K = 6, 3, 37, rtr_k(name)
    w = rtr_weights((E, M), name, K, seed=23)
    wr, qr = repacked(w, name)
    x = rnd(T, A, K, seed=24)
    ids = expert_ids(T, A, E, seed=T)
    got, plain = (np.full((T, A, M), np.nan, np.float32) for _ in range(2))
    matmul.mul_mat_id(got, wr, x, ids, qr)
    matmul.mul_mat_id(plain, w, x, ids, int(Q[name]))
    assert max_rel(got, plain.astype(np.float64)) < RTOL_RTR
    assert max_rel(got, ref_mul_mat_id(w, name, x, ids, rounded=True)) < RTOL


# One type per kernel family whose code changes without VNNI (each type compiles cold here,
# ~30 s): the dot4 of quants_int8 (plain Q4_0, which leaves quants_q4x for acc_blocks; the
# repacked kernels share that dot4) and simd.Emit.dot (Q4_K; the IQ types share it).
NO_VNNI_CODE = (
    "import sys, numpy as np, nbmoe\n"
    "from gguf import GGMLQuantizationType as Q\n"
    "from gguf.quants import dequantize\n"
    "from nbmoe.cpu import matmul, quants_int8, quants_q4x\n"
    "from nbmoe.cpu.quants_rtr import repack_tensor\n"
    "assert not quants_int8.HAS_VNNI and not quants_q4x.ENABLED\n"
    "assert not matmul.GEMM_I8 and not matmul.batched_int8(Q.Q4_0)\n"
    "assert not matmul.int8_path(Q.Q4_0, 17)\n"
    f"sys.path.insert(0, {TOOLS!r})\n"
    "from ref_quant import random_rows\n"
    "rng = np.random.default_rng(0)\n"
    "for name, K in (('Q4_0', 224), ('Q4_K', 512)):\n"
    "    w = np.ascontiguousarray(random_rows(rng, 37, K, name))\n"
    "    x = rng.standard_normal((2, K), dtype=np.float32)\n"
    "    out = np.empty((2, 37), np.float32)\n"
    "    matmul._mul_mat_vec_seq(out, w, x, int(Q[name]), True)\n"
    "    ref = x.astype(np.float64) @ dequantize(w, Q[name]).reshape(37, K).astype(np.float64).T\n"
    "    assert np.abs(out - ref).max() < 1.5e-2 * np.abs(ref).max(), name\n"
    "    if name == 'Q4_0':\n"
    "        wr, qr = repack_tensor(w, int(Q[name]))\n"
    "        rtr = np.empty((2, 37), np.float32)\n"
    "        matmul._mul_mat_vec_seq(rtr, wr, x, qr, True)\n"
    "        assert np.abs(rtr - out).max() < 2e-6 * np.abs(out).max(), 'rtr ' + name\n"
    "print('ok')\n")


@early(sys.executable, "-c", NO_VNNI_CODE, NBMOE_NO_VNNI="1", NUMBA_CACHE_DIR=None)
def test_without_vnni(early_process):
    """Without VNNI (NBMOE_NO_VNNI=1), in one fresh interpreter (its kernels compile cold; it
    starts when collected, conftest.early): the portable dot4 (widen, multiply, add pairs)
    gives the int8 sums, plain and repacked, and batched products leave gemm_i8 for
    dequantize + BLAS. The dots run through the one-item matrix-vector kernel: the parallel
    one would compile the same type dispatch again (~20 s)."""
    out, err = early_process.communicate(timeout=900)
    assert early_process.returncode == 0 and out.strip() == "ok", err[-2000:]
