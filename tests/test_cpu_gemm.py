"""The batched integer product (nbmoe/cpu/gemm_i8.py) vs gguf-py's dequantize + float64 NumPy.

Letters as in test_cpu_matmul.py. Every type with an integer decoder (gemm_unpack), the
repacked -rtr layouts too: T = 10 (one group of 8 slots and a partial one), 33; M = 16 (one
panel), 37 (two and a padded one); K = 224 (7 blocks) for the 32-value types, 512 (two
super-blocks) for the others. Compared with the float64 product of x rounded to 8 bits as
the kernel rounds it (1e-5: only the float32 summation order differs) and with the exact
product (RTOL_X8). mul_mat_id: experts with many tokens (gemm_i8) beside experts with few
(matrix-vector). The fallbacks: GEMM_I8 off and no VNNI take dequantize + BLAS (exact).
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from ref_quant import random_blocks
from ref_quant_iq import NAMES as IQ_NAMES
from ref_quant_iq import random_blocks as iq_random_blocks
from test_cpu_matmul import (RTOL, RTOL_X8, max_rel, quantize, ref_dequant, ref_mul_mat_id,
                             repacked, rnd, x_rounded)

from nbmoe.cpu import gemm_i8, matmul

BLOCK_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4"]
SUPER_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", *IQ_NAMES]
RTR = ["Q4_0_R16", "Q4_1_R16", "Q8_0_R16", "Q4_K_R16", "IQ4_NL_R16", "MXFP4_R16", "IQ4_XS_R16"]

pytestmark = pytest.mark.skipif(not matmul.GEMM_I8, reason="gemm_i8 needs AVX-512 VNNI")


def weights(shape, name, seed):
    """Read-only weights [*shape, row_bytes] of type name (or repacked: name_R16) and the qtype."""
    base = name.removesuffix("_R16")
    K = 224 if base in BLOCK_TYPES else 512
    rng = np.random.default_rng(seed)
    if base not in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):      # random valid blocks
        n = int(np.prod(shape)) * K // matmul.TYPES[int(Q[base])][0]
        gen = iq_random_blocks if base in IQ_NAMES else random_blocks
        w = np.ascontiguousarray(gen(rng, n, base).reshape(shape + (-1,)))
        w.flags.writeable = False
    else:
        w = quantize(rng.standard_normal(shape + (K,), dtype=np.float32), base)
    if name.endswith("_R16"):
        wr, qr = repacked(w, base)
        return wr, qr, ref_dequant(w, base, K)
    return w, int(Q[base]), ref_dequant(w, base, K)


@pytest.mark.parametrize("name", BLOCK_TYPES + SUPER_TYPES + RTR)
@pytest.mark.parametrize("T, M", [(10, 16), (33, 37)])
def test_mul_mat(name, T, M):
    w, qt, wd = weights((M,), name, seed=T)
    x = rnd(T, wd.shape[1], seed=M)
    x[0, 5] = 40.0  # one large value: its block's scale differs from the rest
    out = np.full((T, M), np.nan, np.float32)
    matmul.mul_mat(out, w, x, qt)
    assert max_rel(out, x_rounded(x) @ wd.T) < RTOL
    assert max_rel(out[1:], x[1:].astype(np.float64) @ wd.T) < RTOL_X8   # token 0: coarse x


def test_token_runs(monkeypatch):
    """Few panels, many tokens: the slot groups split into runs (jobs) across the threads."""
    M, K, T = 16, 224, 100
    jobs = gemm_i8._jobs(13, 1, 2)
    assert jobs.shape[0] == 3 and jobs[0, 1] == 0 and jobs[-1, 2] == 13
    assert np.all(jobs[1:, 1] == jobs[:-1, 2])
    w = quantize(rnd(M, K, seed=1), "Q8_0")
    x = rnd(T, K, seed=2)
    out = np.full((T, M), np.nan, np.float32)
    matmul.mul_mat(out, w, x, int(Q.Q8_0))
    assert max_rel(out, x_rounded(x) @ ref_dequant(w, "Q8_0", K).T) < RTOL


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0_R16", "Q4_K_R16"])
@pytest.mark.parametrize("shared_x", [True, False])
@pytest.mark.parametrize("T", [40, 150])
def test_mul_mat_id(name, shared_x, T):
    """A = 3 of E = 6: expert 0 takes every token, 1, 2, 4 the rest (gemm_i8), 3 takes 3
    tokens (matrix-vector at T = 40; gemm_i8 too at T = 150, past VEC_FEW_MAX_ROWS rows of
    x), 5 none."""
    E, A, M = 6, 3, 37
    w, qt, wd = weights((E, M), name, seed=3)
    base = name.removesuffix("_R16")
    w_plain = weights((E, M), base, seed=3)[0]
    x = rnd(T, 1 if shared_x else A, wd.shape[-1], seed=4)
    rng = np.random.default_rng(5)
    ids = np.array([[0, *rng.permutation([1, 2, 4])[:2]] for _ in range(T)], np.int32)
    ids[:3, 2] = 3
    out = np.full((T, A, M), np.nan, np.float32)
    matmul.mul_mat_id(out, w, x, ids, qt)
    assert max_rel(out, ref_mul_mat_id(w_plain, base, x, ids, rounded=True)) < RTOL
    assert max_rel(out, ref_mul_mat_id(w_plain, base, x, ids)) < RTOL_X8


def test_nan_propagates():
    """A NaN in a token's x makes that token's outputs NaN, and only its."""
    w, qt, _ = weights((37,), "Q4_K", seed=8)
    x = rnd(10, 512, seed=9)
    x[3, 300] = np.nan
    out = np.zeros((10, 37), np.float32)
    matmul.mul_mat(out, w, x, qt)
    assert np.all(np.isnan(out[3])) and np.all(np.isfinite(np.delete(out, 3, 0)))


def test_gemm_off(monkeypatch):
    """NBMOE_GEMM_I8=0: dequantize + BLAS, exact."""
    monkeypatch.setattr(matmul, "GEMM_I8", False)
    w, qt, wd = weights((37,), "Q4_K", seed=6)
    x = rnd(17, 512, seed=7)
    out = np.full((17, 37), np.nan, np.float32)
    matmul.mul_mat(out, w, x, qt)
    assert max_rel(out, x.astype(np.float64) @ wd.T) < RTOL
