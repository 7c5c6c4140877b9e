"""CUDA matrix products (nbmoe/cuda/matmul.py, matmul_tiled.py, x8.py) vs float64 references.

Runs under Numba's CUDA simulator when no GPU is asked for (NBMOE_REAL_GPU=1 runs it on the
GPU). The simulator runs every CUDA thread as a Python thread, so shapes are tiny and odd, and
the block / tile sizes are patched small (cuda_common.small) so that multi-block and
partial-tile paths run. Letters as in the kernels: T tokens, M rows, K values per row, E
experts, A chosen, X input rows per token. Every output is poisoned with NaN before the
launch. Run with -s to see the table of max relative errors at the end.
"""
from cuda_common import _simulator_speed, small  # noqa: F401  (fixtures; first: selects the simulator)
from cuda_common import (TYPES, Q, check, check_x8, dev, mul_mat_id_ref, poisoned, quantize,  # noqa: E402
                         rnd)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from nbmoe.cuda import matmul, moe, ops  # noqa: E402
from nbmoe.cuda.x8 import quantize_x  # noqa: E402

# numpy's overflow / invalid-cast warnings from the simulated kernels (inf and NaN inputs on purpose)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# ---------------------------------------------------------------- dequantize, get_rows

@pytest.mark.parametrize("name", TYPES)
def test_dequantize_get_rows(name, small):
    K = 61 if name in ("F32", "F16", "BF16") else 64       # float rows need not hold whole units
    w, ref = quantize(rnd(13, K, seed=1), name)
    dw = dev(w)
    got = matmul.dequantize(dw, int(Q[name])).copy_to_host()
    assert np.array_equal(got, ref.astype(np.float32)), name   # exact decode
    w3 = dev(w.reshape(1, 13, -1))                             # [E, M, row_bytes] keeps its shape
    assert matmul.dequantize(w3, int(Q[name])).shape == (1, 13, K)
    ids = np.array([12, 0, 5, 5], np.int32)
    out = poisoned((4, K))
    matmul.get_rows(out, dw, dev(ids), int(Q[name]))
    assert np.array_equal(out.copy_to_host(), ref[ids].astype(np.float32))


# ---------------------------------------------------------------- mul_mat

@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("int8", [True, False])
def test_mul_mat_vec(name, T, int8, small, monkeypatch):
    if int8 and name in ("F32", "F16", "BF16"):
        pytest.skip("float types have no int8 path")
    monkeypatch.setattr(matmul, "INT8_DOT", int8)
    M, K = 13, 64
    w, wref = quantize(rnd(M, K, seed=2), name)
    x = rnd(T, K, seed=3)
    out = poisoned((T, M))
    matmul.mul_mat(out, dev(w), dev(x), int(Q[name]))
    check_x8(f"mul_mat vec {name} T={T}", out.copy_to_host(), x, lambda x_: x_ @ wref.T, int8)


@pytest.mark.parametrize("name,int8", [("Q8_0", True), ("Q4_1", True), ("F32", False)])
@pytest.mark.parametrize("T", [1, 3])
def test_mul_mat_vec_split_k(name, int8, T, small, monkeypatch):
    """Split-K (S warps a row, partial sums added in a block): patched on for short rows."""
    monkeypatch.setattr(matmul, "INT8_DOT", int8)
    monkeypatch.setattr(matmul, "SPLIT_K_MIN_K", 32)
    M, K = 13, 128
    assert matmul._split_k(M, K) == min(matmul.SPLIT_K_MAX, matmul.MMV_WARPS) > 1
    w, wref = quantize(rnd(M, K, seed=12), name)
    x = rnd(T, K, seed=13)
    out = poisoned((T, M))
    matmul.mul_mat(out, dev(w), dev(x), int(Q[name]))
    check_x8(f"mul_mat vec split-K {name} T={T}", out.copy_to_host(), x, lambda x_: x_ @ wref.T, int8)


@pytest.mark.parametrize("name,upc", [("Q4_0", 2), ("Q8_0", 4), ("Q5_0", 1)])
def test_mmv_chunks_in_flight(name, upc, small, monkeypatch):
    """Rows of 17 blocks: several chunks a lane a step (V > 1), the step's last chunks past the
    row (not added); the fused gate/up and down kernels equal the separate launches bit for bit."""
    from nbmoe.cuda import fused, mmv_q8
    monkeypatch.setitem(mmv_q8.CHUNK_UNITS, int(Q[name]), upc)
    monkeypatch.setattr(matmul, "INT8_DOT", True)
    qt, E, M, K, A = int(Q[name]), 3, 3, 17 * 32, 2
    assert mmv_q8.chunks_in_flight(qt, K) == -(-17 * 4 // upc // 32) > 1 or upc == 4
    w, wref = quantize(rnd(E, M, K, seed=14), name)
    wu, wuref = quantize(rnd(E, M, K, seed=15), name)
    x = rnd(2, K, seed=16)
    out = poisoned((2, M))
    matmul.mul_mat(out, dev(w[0]), dev(x), qt)
    check_x8(f"mmv chunks {name} upc={upc}", out.copy_to_host(), x, lambda x_: x_ @ wref[0].T, True)
    ids, dw, dwu = dev(np.array([[2, 0]], np.int32)), dev(w), dev(wu)
    x1 = dev(x[:1].reshape(1, 1, K))
    g, u = poisoned((1, A, M)), poisoned((1, A, M))
    matmul.mul_mat_id(g, dw, x1, ids, qt)
    matmul.mul_mat_id(u, dwu, x1, ids, qt)
    check_x8(f"mmv chunks id {name} upc={upc}", g.copy_to_host(), x[:1].reshape(1, 1, K),
             lambda x_: mul_mat_id_ref(wref, x_, np.array([[2, 0]])), True)
    want = poisoned((A, M))
    ops.swiglu(want, g.reshape(A, M), u.reshape(A, M))
    got = poisoned((1, A, M))
    xq, xds = quantize_x(x1, 1, K, 0)
    fused.glu_id_q8(got, dw, dwu, xq, xds, ids, 1, qt, K, fused.ACT_SILU)
    assert np.array_equal(got.copy_to_host().reshape(A, M), want.copy_to_host())
    xa = dev(x.reshape(1, A, K))
    wts = dev(np.array([[0.75, -0.5]], np.float32))
    y, want = poisoned((1, A, M)), poisoned((1, M))
    matmul.mul_mat_id(y, dw, xa, ids, qt)
    moe.moe_combine(want, y, wts)
    got = poisoned((1, M))
    xq, xds = quantize_x(xa, A, K, 0)
    fused.down_combine_q8(got, dw, xq, xds, ids, wts, qt, K)
    assert np.array_equal(got.copy_to_host(), want.copy_to_host())


def test_quantize_x_nan(small):
    """A NaN in x makes its block's scale NaN: the outputs it touches are NaN, as on the CPU."""
    M, K = 5, 64
    w, wref = quantize(rnd(M, K, seed=2), "Q4_0")
    x = rnd(1, K, seed=3)
    x[0, 40] = np.nan
    out = poisoned((1, M))
    matmul.mul_mat(out, dev(w), dev(x), int(Q["Q4_0"]))
    assert np.isnan(out.copy_to_host()).all()


def test_x_ready_reuses_the_quantized_x(small):
    """Two products of one x: the second (x_ready) skips quantization and reads the first's
    xq, xds; equal to quantizing again. A product of another x in between would be wrong,
    which the backend rules out (backend_cuda._x_ready)."""
    M, K = 7, 64
    w1, _ = quantize(rnd(M, K, seed=8), "Q4_0")
    w2, _ = quantize(rnd(M, K, seed=9), "Q8_0")
    x = dev(rnd(2, K, seed=10))
    assert matmul.quantizes_x(int(Q["Q4_0"]), 2, K)
    want, got = poisoned((2, M)), poisoned((2, M))
    matmul.mul_mat(want, dev(w2), x, int(Q["Q8_0"]))
    matmul.mul_mat(poisoned((2, M)), dev(w1), x, int(Q["Q4_0"]))
    matmul.mul_mat(got, dev(w2), x, int(Q["Q8_0"]), x_ready=True)
    assert np.array_equal(got.copy_to_host(), want.copy_to_host())


def _check_mul_mat(label, w, wref, name, T, seed):
    """mul_mat of T random tokens (rnd seed `seed`) by w on the device, against x @ wref^T."""
    x = rnd(T, wref.shape[1], seed=seed)
    out = poisoned((T, wref.shape[0]))
    matmul.mul_mat(out, dev(w), dev(x), int(Q[name]))
    check(label, out.copy_to_host(), x @ wref.T)


@pytest.mark.parametrize("name", TYPES)
def test_mul_mat_tiled(name, small, monkeypatch):
    """T = 11 tokens, tiles of 16 rows x 8 tokens: partial row and token tiles, 2 k-steps."""
    monkeypatch.setattr(matmul, "MMV_MAX_T", 2)
    w, wref = quantize(rnd(37, 64, seed=4), name)
    _check_mul_mat(f"mul_mat tiled {name}", w, wref, name, 11, seed=5)


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_mul_mat_float_odd_K(name, small, monkeypatch):
    """Float rows of K = 61 values: the matrix-vector kernel at T = 1, and in token chunks at T = 5."""
    monkeypatch.setattr(matmul, "MMV_MAX_T", 2)
    w, wref = quantize(rnd(9, 61, seed=6), name)
    for T in (1, 5):
        _check_mul_mat(f"mul_mat odd K {name}", w, wref, name, T, seed=7 + T)


@pytest.mark.parametrize("name", ["F32", "BF16"])
def test_mul_mat_small_float_prompt(name, small, monkeypatch):
    """A float matrix of few rows (a router) at a prompt's T: the tiled kernel split over K
    (4 splits of one 32-block, partial row and token tiles), the parts summed in order."""
    monkeypatch.setattr(matmul, "MMV_MAX_T", 2)
    monkeypatch.setattr(matmul, "TILED_MIN_M", 16)
    monkeypatch.setattr(matmul, "SPLIT_TILE", (8, 4, 2, 2))
    monkeypatch.setattr(matmul, "SPLIT_MIN_BLOCKS", 1)
    w, wref = quantize(rnd(9, 128, seed=16), name)
    _check_mul_mat(f"mul_mat small float prompt {name}", w, wref, name, 11, seed=17)


# ---------------------------------------------------------------- mul_mat_id

@pytest.mark.parametrize("name,int8", [("F16", False), ("Q8_0", True), ("Q4_0", True), ("Q5_1", True),
                                       ("Q4_1", False)])
@pytest.mark.parametrize("X", [1, 2])
def test_mul_mat_id_vec(name, int8, X, small, monkeypatch):
    monkeypatch.setattr(matmul, "INT8_DOT", int8)
    E, M, K, A, T = 5, 11, 64, 2, 2
    w, wref = quantize(rnd(E, M, K, seed=8), name)
    x = rnd(T, X, K, seed=9)
    ids = np.array([[3, 0], [0, 4]], np.int32)
    out = poisoned((T, A, M))
    matmul.mul_mat_id(out, dev(w), dev(x), dev(ids), int(Q[name]))
    check_x8(f"mul_mat_id vec {name}", out.copy_to_host(), x, lambda x_: mul_mat_id_ref(wref, x_, ids), int8)


@pytest.mark.parametrize("name", ["F32", "Q8_0", "Q4_1", "Q5_0"])
@pytest.mark.parametrize("X", [1, 2])
def test_mul_mat_id_grouped(name, X, small, monkeypatch):
    """T = 7 tokens, A = 2: expert 1 gets 7 pairs (two tiles of 4), expert 3 none, the rest a few."""
    monkeypatch.setattr(matmul, "MMV_MAX_T", 2)
    E, M, K, A, T = 5, 19, 64, 2, 7
    w, wref = quantize(rnd(E, M, K, seed=10), name)
    x = rnd(T, X, K, seed=11)
    ids = np.array([[1, 0], [2, 1], [1, 4], [0, 1], [1, 2], [4, 1], [1, 0]], np.int32)
    out = poisoned((T, A, M))
    matmul.mul_mat_id(out, dev(w), dev(x), dev(ids), int(Q[name]))
    check(f"mul_mat_id grouped {name}", out.copy_to_host(), mul_mat_id_ref(wref, x, ids))


@pytest.mark.parametrize("E,TT", [(37, 4), (150, 3)])
def test_group_by_expert_table(E, TT):
    """The grouping's table against numpy: tiles in expert order, each expert's pairs in runs of
    at most TT from its offset (the prefix of the experts' counts), and `order` holding exactly
    each expert's pairs there. E = 150 gives each of the kernel's threads a run of experts."""
    from nbmoe.cuda.matmul_tiled import group_by_expert
    T, A = 50, 4
    ids = np.random.default_rng(21).integers(0, E, (T, A)).astype(np.int32)
    order, tiles, max_tiles = group_by_expert(dev(ids), E, TT, 0)
    order, tiles = order.copy_to_host()[:T * A], tiles.copy_to_host()
    cnt = np.bincount(ids.ravel(), minlength=E)
    want = [(e, s + f, min(TT, c - f)) for e, (s, c) in enumerate(zip(np.cumsum(cnt) - cnt, cnt))
            for f in range(0, c, TT)]
    assert tiles[0] == len(want) <= max_tiles
    assert [tuple(tiles[1 + 3 * k:4 + 3 * k]) for k in range(len(want))] == want
    start = np.cumsum(cnt) - cnt
    for e in range(E):
        got = np.sort(order[start[e]:start[e] + cnt[e]])
        assert np.array_equal(got, np.flatnonzero(ids.ravel() == e))


# ---------------------------------------------------------------- mul_mat_heads (MLA)

@pytest.mark.parametrize("name,T", [("Q8_0", 1), ("F32", 1), ("Q8_0", 3)])
def test_mul_mat_heads_windows(name, T, small, monkeypatch):
    """out[t, h, 5:5+M] = w[h] @ x[t, h, 8:8+K], x and out views of wider heads: the 8-bit
    matrix-vector path reads and writes the windows in place (Q8_0, T = 1), the float one
    reads a copy of x (F32), the prompt path copies both (Q8_0 past MMV_MAX_T); every column
    outside out's window untouched."""
    monkeypatch.setattr(matmul, "MMV_MAX_T", 2)
    H, M, K, W = 3, 11, 64, 80
    w, wref = quantize(rnd(H, M, K, seed=12), name)
    x = rnd(T, H, W, seed=13)
    ids = np.tile(np.arange(H, dtype=np.int32), (T, 1))
    out = poisoned((T, H, 20))
    matmul.mul_mat_heads(out[:, :, 5:5 + M], dev(w), dev(x)[:, :, 8:8 + K], dev(ids), int(Q[name]))
    got = out.copy_to_host()
    check_x8(f"mul_mat_heads {name} T={T}", got[:, :, 5:5 + M], x[:, :, 8:8 + K],
             lambda x_: mul_mat_id_ref(wref, x_, ids), name == "Q8_0" and T == 1)
    assert np.isnan(np.delete(got, np.s_[5:5 + M], 2)).all()
