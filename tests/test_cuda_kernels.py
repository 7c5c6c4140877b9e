"""CUDA kernels (nbmoe/cuda) vs the float64 references: gguf-py's dequantize + NumPy, tests/naive.py.

Runs under Numba's CUDA simulator when no GPU is asked for (NBMOE_REAL_GPU=1 runs it on the
GPU). The simulator runs every CUDA thread as a Python thread, so shapes are tiny and odd, and
the block / tile sizes are patched small so that multi-block and partial-tile paths run.
Letters as in the kernels: T tokens, M rows, K values per row, E experts, A chosen, X input rows
per token, H / Hkv heads, Dh head dim. Every output is poisoned with NaN before the launch.
Run with -s to see the table of max relative errors at the end.
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

# numpy's overflow / invalid-cast warnings from the simulated kernels (inf and NaN inputs on purpose)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
RTOL = 1e-5
RTOL_X8 = 1.5e-2   # the int8 path vs the exact product: x's 8-bit rounding
ERRORS = {}   # test case -> max relative error, printed at the end


@pytest.fixture(scope="module", autouse=True)
def _simulator_speed():
    """The simulator's block manager polls its threads in a busy loop: a short GIL switch
    interval lets the simulated threads run (several times faster on 2 cores)."""
    old = sys.getswitchinterval()
    if nbcuda.SIM:
        sys.setswitchinterval(5e-6)
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
             lambda x_: _mul_mat_id_ref(wref, x_, np.array([[2, 0]])), True)
    want = poisoned((A, M))
    ops.swiglu(want, g.reshape(A, M), u.reshape(A, M))
    got = poisoned((1, A, M))
    xq, xds = matmul._quantize_x(x1, 1, K, 0)
    fused.glu_id_q8(got, dw, dwu, xq, xds, ids, 1, qt, K, fused.ACT_SILU)
    assert np.array_equal(got.copy_to_host().reshape(A, M), want.copy_to_host())
    xa = dev(x.reshape(1, A, K))
    wts = dev(np.array([[0.75, -0.5]], np.float32))
    y, want = poisoned((1, A, M)), poisoned((1, M))
    matmul.mul_mat_id(y, dw, xa, ids, qt)
    moe.moe_combine(want, y, wts)
    got = poisoned((1, M))
    xq, xds = matmul._quantize_x(xa, A, K, 0)
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
    """A float matrix of few rows (a router) at a prompt's T: matrix-vector over token chunks."""
    monkeypatch.setattr(matmul, "MMV_MAX_T", 2)
    monkeypatch.setattr(matmul, "TILED_MIN_M", 16)
    w, wref = quantize(rnd(9, 64, seed=16), name)
    _check_mul_mat(f"mul_mat small float prompt {name}", w, wref, name, 11, seed=17)


# ---------------------------------------------------------------- mul_mat_id

def _mul_mat_id_ref(wref, x, ids):
    T, A = ids.shape
    X = x.shape[1]
    return np.stack([np.stack([wref[ids[t, a]] @ x[t, a if X == A else 0] for a in range(A)])
                     for t in range(T)])


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
    check_x8(f"mul_mat_id vec {name}", out.copy_to_host(), x, lambda x_: _mul_mat_id_ref(wref, x_, ids), int8)


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
    check(f"mul_mat_id grouped {name}", out.copy_to_host(), _mul_mat_id_ref(wref, x, ids))


# ---------------------------------------------------------------- rms_norm, add, scale

@pytest.mark.parametrize("T,D", [(1, 67), (3, 300), (2, 1028)])
def test_rms_norm(T, D, small):
    x, w = rnd(T, D, seed=T, scale=3.0), rnd(D, seed=99)
    out = poisoned((T, D))
    ops.rms_norm(out, dev(x), dev(w), 1e-6)
    check("rms_norm", out.copy_to_host(), naive.rms_norm(x, w, 1e-6))


def test_rms_norm_fused_add_and_x8(small):
    """The fused form: x += add, out = norm(x), and out in 8 bits exactly as quantize_x
    writes it (rows of 288 = 9 blocks of 32: the last warp's lanes partly past the row)."""
    T, D = 2, 288
    x, a, w = rnd(T, D, seed=5), rnd(T, D, seed=6), rnd(D, seed=7)
    dx, out = dev(x), poisoned((T, D))
    xq, xds = matmul.x8_buffers(T, D)
    ops.rms_norm(out, dx, dev(w), 1e-6, add=dev(a), xq=xq, xds=xds)
    check("x += add", dx.copy_to_host(), x.astype(np.float64) + a)
    check("rms_norm(x + add)", out.copy_to_host(), naive.rms_norm(x + a, w, 1e-6))
    got_q, got_ds = xq.copy_to_host()[:T * D // 4], xds.copy_to_host()[:T * D // 16]
    matmul._quantize_x(out, T, D, 0)          # the same buffers, refilled by quantize_x
    assert np.array_equal(got_q, xq.copy_to_host()[:T * D // 4])
    assert np.array_equal(got_ds, xds.copy_to_host()[:T * D // 16])


def test_rms_norm_per_head_in_place(small):
    """QK-norm: x [T, H, Dh] normed head by head with w [Dh], in place."""
    x, w = rnd(3, 2, 40, seed=4), rnd(40, seed=1)
    dx = dev(x)
    ops.rms_norm(dx, dx, dev(w), 1e-5)
    check("rms_norm per head, in place", dx.copy_to_host(), naive.rms_norm(x, w, 1e-5))


def test_add_scale(small):
    a, b = rnd(3, 67, seed=1), rnd(3, 67, seed=2)
    da, db = dev(a), dev(b)
    out = poisoned(a.shape)
    ops.add(out, da, db)
    assert np.array_equal(out.copy_to_host(), a + b)
    ops.add(da, da, db)                    # in place
    assert np.array_equal(da.copy_to_host(), a + b)
    ops.scale(out, db, 0.37)
    assert np.array_equal(out.copy_to_host(), b * np.float32(0.37))


# ---------------------------------------------------------------- rope

@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("Dh,n_rot", [(16, 16), (40, 24)])
def test_rope(neox, Dh, n_rot, small):
    T, H = 3, 3
    x = rnd(T, H, Dh, seed=Dh)
    pos = (np.arange(T) * 3001 + 1234).astype(np.int32)   # up to ~1e4: angles need float64
    dx = dev(x)
    ops.rope(dx, dev(pos), n_rot, 10000.0, neox, 0.5)
    y = dx.copy_to_host()
    check("rope", y, naive.rope(x, pos, n_rot, 10000.0, neox, 0.5))
    assert np.array_equal(y[..., n_rot:], x[..., n_rot:])  # dims past n_rot untouched


# ---------------------------------------------------------------- swiglu, geglu

@pytest.mark.parametrize("act", ["swiglu", "geglu"])
def test_glu(act, small):
    N, F = 3, 45
    gate, up = rnd(N, F, seed=N, scale=4.0), rnd(N, F, seed=N + 1)
    gate[0, :4] = [-100.0, 100.0, -1e4, 1e4]
    ref = getattr(naive, act)(gate, up)
    out = poisoned((N, F))
    getattr(ops, act)(out, dev(gate), dev(up))
    check(act, out.copy_to_host(), ref)
    gu = dev(np.concatenate([gate, up], axis=1))        # strided halves of a fused [N, 2F]
    out = poisoned((N, F))
    getattr(ops, act)(out, gu[:, :F], gu[:, F:])
    check(act + " strided", out.copy_to_host(), ref)


# ---------------------------------------------------------------- KV cache + attention

def _attn_case(T, H, Hkv, Dh, pos0, C, seed=0):
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


def test_store_kv_rounds_to_nearest_f16(small):
    k = rnd(3, 2, 20, seed=5, scale=100.0)
    k[0, 0, :4] = [1e6, -1e-9, np.float32(1 + 2 ** -11), 3e-6]  # inf, tiny, a tie -> even, subnormal
    kc, vc = cuda.to_device(np.zeros((9, 2, 20), np.uint16)), cuda.to_device(np.zeros((9, 2, 20), np.uint16))
    att.store_kv(kc, vc, dev(k), dev(-k), 4)
    with np.errstate(over="ignore"):
        k16 = k.astype(np.float16)
    kh, vh = kc.copy_to_host(), vc.copy_to_host()
    assert np.array_equal(kh[4:7], k16.view(np.uint16))
    assert np.array_equal(vh[4:7], (-k16).view(np.uint16))
    assert not kh[:4].any() and not kh[7:].any()
    with pytest.raises(ValueError):
        att.store_kv(kc, vc, dev(k), dev(k), 7)


@pytest.mark.parametrize("window", [0, 4])
@pytest.mark.parametrize("T,Dh", [(3, 40), (1, 16)])
def test_attention(T, Dh, window, small):
    """GQA (4 query heads on 2 kv heads, 3 heads a block: the last block half empty), Dh = 40:
    lanes past Dh idle in the second 32-dim slice."""
    H, Hkv, pos0 = 4, 2, 6
    q, kc, vc, k_all, v_all = _attn_case(T, H, Hkv, Dh, pos0, C=12, seed=T * Dh)
    scale = 1.0 / np.sqrt(Dh)
    ref = naive.attention(q, k_all, v_all, pos0, scale, window)
    out = poisoned(q.shape)
    att.attention(out, dev(q), kc, vc, pos0, scale, window)
    check("attention", out.copy_to_host(), ref)
    dq = dev(q)
    att.attention(dq, dq, kc, vc, pos0, scale, window)     # in place: out aliases q
    check("attention in place", dq.copy_to_host(), ref)


@pytest.mark.parametrize("window,pos0,keys,most", [(0, 20, 4, 128), (9, 20, 4, 128), (0, 2, 4, 128),
                                                 (0, 15, 1, 5), (0, 2, 0, 128)])
def test_attention_split(window, pos0, keys, most, small, monkeypatch):
    """T = 1, a 24-slot cache, six splits in the grid, one in use per `keys` keys: at pos0 = 20
    all six (window 9: two) share the keys; at pos0 = 2 one split holds all 3 keys and writes
    the output itself (the merge does nothing); with at most 5 splits of 1 key, 16 keys go 4
    a split and the fifth finds none; keys = 0: all six splits work, three find no key. Empty
    splits must weigh 0 in the merge. The position comes from a device array, as in a
    replayed CUDA graph (the launch is the same for every position)."""
    monkeypatch.setattr(att, "SPLIT_KEYS", 4)          # the grid: 24 // 4 = 6 splits (at most `most`)
    monkeypatch.setattr(att, "MIN_SPLIT_KEYS", keys)
    monkeypatch.setattr(att, "MAX_SPLITS", most)
    H, Hkv, Dh = 2, 1, 32
    q, kc, vc, k_all, v_all = _attn_case(1, H, Hkv, Dh, pos0, C=24, seed=3)
    q *= 3  # peaked softmax, so the span maxima differ
    ref = naive.attention(q, k_all, v_all, pos0, 0.125, window)
    out = poisoned(q.shape)
    att.attention(out, dev(q), kc, vc, dev(np.array([pos0], np.int32)), 0.125, window)
    check("attention split", out.copy_to_host(), ref)


@pytest.mark.parametrize("pos0", [40, 44])
def test_attention_one_split_many_keys(pos0, small, monkeypatch):
    """T = 1, one split (no key splits in the grid) walking 41 / 45 keys: a whole tile of 32
    and a second one whose last batch of 8 (key_sums8) is partial; lanes past the keys must
    weigh 0."""
    monkeypatch.setattr(att, "SPLIT_KEYS", 64)         # cap 48 < 2 * 64: P = 1
    H, Hkv, Dh = 4, 2, 32
    q, kc, vc, k_all, v_all = _attn_case(1, H, Hkv, Dh, pos0, C=48, seed=pos0)
    q *= 2
    ref = naive.attention(q, k_all, v_all, pos0, 0.2, 0)
    out = poisoned(q.shape)
    att.attention(out, dev(q), kc, vc, pos0, 0.2)
    check("attention, 41-45 keys in one split", out.copy_to_host(), ref)


def test_attention_first_token_is_v(small):
    """At position 0 a token sees only itself: out = v (as stored in f16)."""
    q, kc, vc, k_all, v_all = _attn_case(1, 2, 1, 16, 0, C=4)
    out = poisoned(q.shape)
    att.attention(out, dev(q), kc, vc, 0, 0.25)
    assert np.array_equal(out.copy_to_host()[0], np.repeat(v_all[0], 2, axis=0).astype(np.float32))


# ---------------------------------------------------------------- MoE routing and combine

def test_topk_route_by_hand(small):
    """A router that prefers experts 0 and 2: logits [2, 0, 2 - ln 3, -1] for token 0."""
    logits = np.array([[2.0, 0.0, 2.0 - np.log(3.0), -1.0],
                       [0.0, 5.0, 0.0, 5.0]], np.float32)   # token 1: ties at 5 and at 0
    ids, w = poisoned((2, 2), np.int32), poisoned((2, 2))
    moe.topk_route(ids, w, dev(logits), True)
    assert ids.copy_to_host().tolist() == [[0, 2], [1, 3]]
    np.testing.assert_allclose(w.copy_to_host(), [[0.75, 0.25], [0.5, 0.5]], rtol=1e-6)


@pytest.mark.parametrize("gating,norm", [(0, False), (0, True), (1, True), (2, False)])
def test_topk_route(gating, norm, small):
    """E = 40 (two logits a lane), A = 3, 5 tokens (a partial block); a NaN and -inf logits."""
    T, E, A = 5, 40, 3
    logits = rnd(T, E, seed=gating, scale=2.0)
    logits[1, 7] = np.nan
    logits[2, :] = -np.inf
    logits[2, [5, 33]] = [1.0, 0.5]       # token 2: two finite logits, the third pick is -inf
    logits[3, 36] = logits[3, 4] = 9.0    # a tie across lanes: the lower index first
    ids, w = poisoned((T, A), np.int32), poisoned((T, A))
    moe.topk_route(ids, w, dev(logits), norm, gating)
    clean = np.where(np.isnan(logits), -np.inf, logits)
    ref_ids, ref_w = naive.topk_route(clean, A, norm, gating)
    assert np.array_equal(ids.copy_to_host(), ref_ids)
    rows = [0, 3, 4]   # rows with NaN / -inf logits follow the CPU's NaN propagation, not checked
    check(f"topk_route gating={gating}", w.copy_to_host()[rows], ref_w[rows])


def test_moe_combine(small):
    T, A, D = 3, 2, 67
    y, wts = rnd(T, A, D, seed=1), rnd(T, A, seed=2)
    out = poisoned((T, D))
    moe.moe_combine(out, dev(y), dev(wts))
    check("moe_combine", out.copy_to_host(), naive.moe_combine(y, wts))


# ---------------------------------------------------------------- decode fusions (one token)

@pytest.mark.parametrize("D,E,name", [(64, 40, "F32"), (288, 6, "F16")])
def test_norm_route(D, E, name, small):
    """norm + router + top-k in one launch (fused.norm_route; D = 288: rms_norm's word layout,
    E = 40: two logits a lane, 5 and 3 blocks of 8 warps with split-K S = 1, 2 on the small
    fixture's MMV_WARPS = 2): h, its 8-bit form, logits, ids and weights equal the separate
    launches bit for bit, and h, ids match the float64 reference. Run twice: the block
    counter is reset for the next launch; the second run also writes h, ids and weights to
    mirror arrays (as the scheduler's mapped host buffers), which get the same bits, and sets
    the host's flag (signal)."""
    from nbmoe.cuda import fused
    A = 3
    x, wn = rnd(1, D, seed=D, scale=2.0), rnd(D, seed=E)
    wr, wref = quantize(rnd(E, D, seed=7), name)
    assert fused.route_supported(int(Q[name]), D, E, A)
    dx, dwn, dwr = dev(x), dev(wn), dev(wr)
    h_want, lg_want = poisoned((1, D)), poisoned((1, E))
    ids_want, w_want = poisoned((1, A), np.int32), poisoned((1, A))
    ops.rms_norm(h_want, dx, dwn, 1e-6)
    matmul.mul_mat(lg_want, dwr, h_want, int(Q[name]))
    moe.topk_route(ids_want, w_want, lg_want, True)
    xq, xds = matmul._quantize_x(h_want, 1, D, 0)
    q_want, ds_want = xq.copy_to_host()[:D // 4], xds.copy_to_host()[:D // 16]
    for run in range(2):
        xq, xds = matmul.x8_buffers(1, D)
        xq.copy_to_device(np.full(xq.shape, -7, np.int32))
        h, lg = poisoned((1, D)), poisoned((1, E))
        ids, w = poisoned((1, A), np.int32), poisoned((1, A))
        mirror = (poisoned((1, D)), poisoned((1, A), np.int32), poisoned((1, A))) if run else None
        signal = dev(np.zeros(1, np.int32)) if run else None
        fused.norm_route(h, xq, xds, dx, dwn, 1e-6, dwr, int(Q[name]), lg, ids, w, True,
                         mirror=mirror, signal=signal)
        if run:
            assert signal.copy_to_host()[0] == 1
        for got, want in ((h, h_want), (lg, lg_want), (ids, ids_want), (w, w_want)) + tuple(
                zip(mirror or (), (h_want, ids_want, w_want))):
            assert np.array_equal(got.copy_to_host(), want.copy_to_host())
        assert np.array_equal(xq.copy_to_host()[:D // 4], q_want)
        assert np.array_equal(xds.copy_to_host()[:D // 16], ds_want)
    href = naive.rms_norm(x, wn, 1e-6)
    check("norm_route h", h.copy_to_host(), href)
    ref_ids, _ = naive.topk_route(href @ wref.T, A, True, 0)
    assert np.array_equal(ids.copy_to_host(), ref_ids)


@pytest.mark.parametrize("pos0,keys", [(0, 4), (2, 4), (20, 4), (5, 0)])
def test_attention_x8_output(pos0, keys, small, monkeypatch):
    """Attention writing its output in 8 bits too (for the output projection): the codes and
    scales quantize_x gives the output, from the attention kernel (one split in use at
    pos0 = 0 and 2) and from the merge (six splits at pos0 = 20 and at keys = 0)."""
    monkeypatch.setattr(att, "SPLIT_KEYS", 4)
    monkeypatch.setattr(att, "MIN_SPLIT_KEYS", keys)
    H, Hkv, Dh = 2, 1, 64
    q, kc, vc, k_all, v_all = _attn_case(1, H, Hkv, Dh, pos0, C=24, seed=pos0)
    out = poisoned(q.shape)
    xq, xds = matmul.x8_buffers(1, H * Dh)
    att.attention(out, dev(q), kc, vc, dev(np.array([pos0], np.int32)), 0.125, xq=xq, xds=xds)
    got_q, got_ds = xq.copy_to_host()[:H * Dh // 4], xds.copy_to_host()[:H * Dh // 16]
    check("attention (x8 form)", out.copy_to_host(),
          naive.attention(q, k_all, v_all, pos0, 0.125, 0))
    matmul._quantize_x(out, 1, H * Dh, 0)
    assert np.array_equal(got_q, xq.copy_to_host()[:H * Dh // 4])
    assert np.array_equal(got_ds, xds.copy_to_host()[:H * Dh // 16])


_GPU_ONLY = pytest.mark.skipif(cuda_setup.SIM, reason="CI time: real GPU only")


@pytest.mark.parametrize("T,pos0,window,neox,n_rot,norm,keys", [
    (2, 9, 0, False, 16, False, 4),      # two tokens, three splits: token 1 sees token 0's key
    (1, 12, 5, True, 32, True, 0),       # a window; every split works, some find no key
    pytest.param(1, 2, 0, True, 16, True, 4, marks=_GPU_ONLY),    # one split writes out itself
    pytest.param(2, 12, 5, True, 32, True, 0, marks=_GPU_ONLY),
])
def test_rope_attention_equals_the_two_launches(T, pos0, window, neox, n_rot, norm, keys,
                                                small, monkeypatch):
    """Decoding attention doing norm_rope_store's work itself (q and the new keys normed and
    rotated per block, the new k, v rows written to the cache by the blocks whose span holds
    them): the same output, cache and 8-bit output as norm_rope_store + attention, bit for bit."""
    from nbmoe.cuda import fused
    monkeypatch.setattr(att, "SPLIT_KEYS", 4)
    monkeypatch.setattr(att, "MIN_SPLIT_KEYS", keys)
    H, Hkv, Dh, C = 4, 2, 32, 16         # one block of 4 warps over both kv heads
    q0, k0, v0 = (rnd(T, n, Dh, seed=s, scale=2.0) for s, n in ((1, H), (2, Hkv), (3, Hkv)))
    wq, wk = (dev(rnd(Dh, seed=s) + 1) if norm else None for s in (4, 5))
    pos = dev(np.arange(pos0, pos0 + T, dtype=np.int32))
    outs = []
    for fused_launch in (False, True):
        q, k, v = dev(q0), dev(k0), dev(v0)
        kc = cuda.to_device(np.zeros((C, Hkv, Dh), np.uint16))
        vc = cuda.to_device(np.zeros((C, Hkv, Dh), np.uint16))
        att.store_kv(kc, vc, dev(rnd(pos0, Hkv, Dh, seed=6)), dev(rnd(pos0, Hkv, Dh, seed=7)), 0)
        out = poisoned((T, H, Dh))
        xq, xds = matmul.x8_buffers(T, H * Dh)
        if fused_launch:
            att.rope_attention(out, q, k, v, kc, vc, pos, wq, wk, 1e-6, n_rot, 10000.0, neox,
                               1.0, 0.125, window, xq=xq, xds=xds)
        else:
            fused.norm_rope_store(q, k, v, kc, vc, pos, wq, wk, 1e-6, n_rot, 10000.0, neox)
            att.attention(out, q, kc, vc, pos, 0.125, window, xq=xq, xds=xds)
        outs.append([a.copy_to_host() for a in (out, kc, vc)] +
                    [xq.copy_to_host()[:T * H * Dh // 4], xds.copy_to_host()[:T * H * Dh // 16]])
    for name, a, b in zip(("out", "k cache", "v cache", "xq", "xds"), *outs):
        assert np.array_equal(a, b), name


def test_products_accumulate_into_the_residual(small, monkeypatch):
    """out += W x (mul_mat accumulate: the o projection onto the residual stream, split-K and
    not) and x += the experts' weighted sum (down_combine_q8 accumulate): equal to the product
    followed by an add, bit for bit."""
    from nbmoe.cuda import fused
    monkeypatch.setattr(matmul, "INT8_DOT", True)
    for M, K, name in ((7, 64, "Q8_0"), (3, 1024, "Q4_0"), (5, 61, "F16")):
        w, _ = quantize(rnd(M, K, seed=M), name)
        x, res = dev(rnd(1, K, seed=K)), rnd(1, M, seed=3)
        y, acc = poisoned((1, M)), dev(res)
        matmul.mul_mat(y, dev(w), x, int(Q[name]))
        matmul.mul_mat(acc, dev(w), x, int(Q[name]), accumulate=True)
        assert np.array_equal(acc.copy_to_host(), res + y.copy_to_host()), name
    E, M, K, A = 3, 5, 64, 2
    w, _ = quantize(rnd(E, M, K, seed=1), "Q4_0")
    ids, wts, xa = dev(np.array([[2, 0]], np.int32)), dev(np.array([[0.6, 0.4]], np.float32)), dev(rnd(1, A, K, seed=2))
    xq, xds = matmul._quantize_x(xa, A, K, 0)
    y = poisoned((1, M))
    fused.down_combine_q8(y, dev(w), xq, xds, ids, wts, int(Q["Q4_0"]), K)
    res = rnd(1, M, seed=4)
    acc = dev(res)
    fused.down_combine_q8(acc, dev(w), xq, xds, ids, wts, int(Q["Q4_0"]), K, accumulate=True)
    assert np.array_equal(acc.copy_to_host(), res + y.copy_to_host())
