"""The int8 tensor-core path (nbmoe/cuda/mma.py, matmul_mma.py) vs NumPy, under Numba's CUDA
simulator (NBMOE_REAL_GPU=1 runs it on the GPU, as test_cuda_kernels.py).

The primitive: random int8 matrices spread over the 32 lanes' registers by the PTX ISA's
fragment table (written out here a second time, from the ISA text), each lane's outputs vs
NumPy's integer product. The products: prompts (T > MMV_MAX_T) of a few block types of each
layout family (4- and 5-bit nibbles with an offset, Q8_0, a K-quant with a min, one with a
scale per 16 values, the 16-level table in super-blocks, MXFP4's byte-aligned blocks) vs
float64 NumPy over gguf-py's dequantized weights: tight against x rounded to 8 bits as the
kernel rounds it, within RTOL_X8 of the exact product. Tiles small enough for partial row,
token and K steps.
Run with -s for the table of max relative errors.
"""
import cuda_setup  # noqa: F401  (selects the simulator before numba.cuda loads; skips without it)
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from gguf import GGML_QUANT_SIZES  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from numba import cuda  # noqa: E402
from cuda_common import _simulator_speed  # noqa: E402,F401  (fixture)
from cuda_common import check_x8, dev, mul_mat_id_ref, poisoned, quantize, rnd  # noqa: E402
from test_cuda_kquants import weights  # noqa: E402

from nbmoe.cuda import matmul, matmul_mma, quants  # noqa: E402
from nbmoe.cuda.mma import mma_s8_16x8x16, mma_s8_16x8x32  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

NAMES = ["Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS", "MXFP4"]


@pytest.fixture
def tiles(monkeypatch):
    """2 warps of 16 x 16 (rows x tokens) in a 32 x 16 tile (8-slot tiles of an expert; wide
    ones: 16 slots over 2 warp columns, where a test asks for them), a K step of 2 blocks; the
    matrix-vector kernel up to T = 2 tokens."""
    monkeypatch.setattr(matmul, "MMA", True)
    monkeypatch.setattr(matmul, "INT8_DOT", True)
    monkeypatch.setattr(matmul, "MMV_MAX_T", 2)
    for k, v in dict(TM=32, TT=16, WM=2, WT=1, KB=2, ID_TILES=((0, (32, 8, 2, 1, 2)),)).items():
        monkeypatch.setattr(matmul_mma, k, v)


# ---------------------------------------------------------------- the primitive

def _pack(v):
    """4 int8 values -> one int32 register (value 0 in the low byte)."""
    return np.asarray(v, np.int8).view(np.int32)[0]


@cuda.jit
def _mma_kernel(out, regs, k16):
    lane = cuda.threadIdx.x
    r = regs[lane]
    if k16:
        d = mma_s8_16x8x16(r[0], r[1], r[4], r[6], r[7], r[8], r[9])
    else:
        d = mma_s8_16x8x32(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9])
    for i in range(4):
        out[lane, i] = d[i]


@pytest.mark.parametrize("K", [32, 16])
def test_mma_primitive(K):
    """D = A @ B + C for int8 A [16, K], B [K, 8] at the extremes (-128, 127) and random."""
    rng = np.random.default_rng(K)
    A = rng.integers(-128, 128, (16, K))
    B = rng.integers(-128, 128, (K, 8))
    A[0, :] = -128
    B[:, 0] = -128                               # the largest product, 32 * 2^14 (+ C)
    C = rng.integers(-2 ** 20, 2 ** 20, (16, 8))
    regs = np.zeros((32, 10), np.int32)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        k0, k1 = slice(4 * t, 4 * t + 4), slice(16 + 4 * t, 20 + 4 * t)
        regs[lane, 0], regs[lane, 1] = _pack(A[g, k0]), _pack(A[g + 8, k0])        # a0, a1: k 0..15
        regs[lane, 4] = _pack(B[k0, g])                                              # b0
        if K == 32:
            regs[lane, 2], regs[lane, 3] = _pack(A[g, k1]), _pack(A[g + 8, k1])    # a2, a3: k 16..31
            regs[lane, 5] = _pack(B[k1, g])                                          # b1
        regs[lane, 6:] = C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]
    out = poisoned((32, 4), np.int32)
    _mma_kernel[1, 32](out, dev(regs), K == 16)
    D = A @ B + C
    got = out.copy_to_host()
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        assert list(got[lane]) == [D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]], lane


# ---------------------------------------------------------------- products

def _weights(shape, name, seed, K):
    """(uint8 blocks, float64 values): gguf-py's quantizer where it has one, else random blocks."""
    if name in ("Q4_0", "Q8_0", "Q4_1", "Q5_0", "Q5_1"):
        return quantize(rnd(*shape, K, seed=seed), name)
    return weights(shape, name, seed, K)


def _k(name):
    return 256 if GGML_QUANT_SIZES[Q[name]][0] == 256 else 96   # 96: 3 blocks, a partial K step


@pytest.mark.parametrize("name,K", [("Q4_0", 448), ("Q6_K", 512)])
def test_mul_mat_mma_split_k(name, K, tiles, monkeypatch):
    """A grid of few blocks (4) on a GPU of 8 multiprocessors splits K over grid z: Q4_0 in 3
    splits of 6, 6 and 2 blocks of 32, Q6_K in 4; the parts are summed after, the bias added
    once."""
    monkeypatch.setattr(matmul_mma, "sm_count", lambda: 8)
    M, T = 37, 19
    w, wref = _weights((M,), name, seed=5, K=K)
    x, bias = rnd(T, K, seed=6), rnd(M, seed=7)
    out = poisoned((T, M))
    matmul.mul_mat(out, dev(w), dev(x), int(Q[name]), bias=dev(bias))
    check_x8(f"mma mul_mat split-K {name}", out.copy_to_host(), x, lambda x_: x_ @ wref.T + bias, True)


@pytest.mark.parametrize("name", NAMES)
def test_mul_mat_mma(name, tiles):
    """M = 37 rows (two row tiles, the second partial), T = 19 tokens (two token tiles)."""
    M, T, K = 37, 19, _k(name)
    assert quants.qtype_info(int(Q[name])).idec is not None
    w, wref = _weights((M,), name, seed=1, K=K)
    x = rnd(T, K, seed=2)
    out = poisoned((T, M))
    matmul.mul_mat(out, dev(w), dev(x), int(Q[name]))
    check_x8(f"mma mul_mat {name}", out.copy_to_host(), x, lambda x_: x_ @ wref.T, True)


@pytest.mark.parametrize("name,X,biased,wide", [("Q4_0", 1, False, False), ("Q4_K", 1, False, False),
                                                ("Q6_K", 2, False, False),
                                                ("MXFP4", 1, True, False), ("Q6_K", 2, False, True),
                                                ("MXFP4", 1, True, True)])
def test_mul_mat_id_mma(name, X, biased, wide, tiles, monkeypatch):
    """E = 4, A = 2, T = 11 tokens: expert 1 gets 9 pairs (a full and a partial 8-slot tile;
    wide: one partial 16-slot tile), expert 3 none; M = 20 rows (a partial row tile); biased:
    + the chosen expert's bias row."""
    E, M, A, T, K = 4, 20, 2, 11, _k(name)
    if wide:
        table = ((6, (16, 32, 1, 2, 4)), (5, (32, 16, 2, 2, 1)), (0, (32, 8, 2, 1, 2)))
        monkeypatch.setattr(matmul_mma, "ID_TILES", table)
        assert matmul_mma.id_tiles(T, E, A) == (32, 16, 2, 2, 1)   # 22 pairs over 4 experts: 5.5 each
    w, wref = _weights((E, M), name, seed=3, K=K)
    ids = np.array([[1, 0], [2, 1], [1, 0], [0, 1], [1, 2], [2, 1], [1, 0], [0, 2], [1, 2], [2, 1], [0, 2]],
                   np.int32)
    x = rnd(T, X, K, seed=4)
    bias = rnd(E, M, seed=5) if biased else np.zeros((E, M), np.float32)
    out = poisoned((T, A, M))
    matmul.mul_mat_id(out, dev(w), dev(x), dev(ids), int(Q[name]),
                      bias=dev(bias.ravel()) if biased else None)
    check_x8(f"mma mul_mat_id {name} X={X}", out.copy_to_host(), x,
             lambda x_: mul_mat_id_ref(wref, x_, ids) + bias[ids], True)


@pytest.mark.parametrize("name,act,biased,tile", [
    ("Q4_0", "silu", False, None), ("Q4_K", "gelu", False, None), ("Q6_K", "silu", False, None),
    ("MXFP4", "swiglu_oai", True, None),
    ("Q4_0", "silu", False, (32, 32, 1, 4, 1)),      # a thread's units 16 rows apart (as 128x64)
    ("Q4_K", "silu", True, (64, 32, 2, 4, 1))])      # 32 rows apart (as 128x128)
def test_mul_mat_id_mma_glu(name, act, biased, tile, tiles, monkeypatch):
    """A merged gate_up [E, 2F, K] (-muge) with the GLU applied by the product's kernel:
    out [T, A, F] = act(gate + bg, up + bu) of each pair, F = 20 features (a full and a partial
    half tile of 16, or one partial of 32); nothing is written to the [T, A, 2F] product."""
    if tile:
        monkeypatch.setattr(matmul_mma, "ID_TILES", ((0, tile),))
    _check_glu_product(name, act, biased)


def test_mma_glu_kernel_per_activation(tiles, monkeypatch):
    """Each activation compiles a kernel of its own: two of one type and tile in a row, each
    against its reference, and the plain expert product of that type and tile after them."""
    monkeypatch.setattr(matmul_mma, "ID_TILES", ((0, (32, 32, 1, 4, 1)),))   # the same warps either way
    for act in ("gelu", "silu"):
        _check_glu_product("Q8_0", act, False)
    test_mul_mat_id_mma("Q8_0", 1, False, False, None, None)


def _check_glu_product(name, act, biased):
    import naive
    from nbmoe.cuda import ops
    E, F, A, T, K = 4, 20, 2, 11, _k(name)
    w, wref = _weights((E, 2 * F), name, seed=8, K=K)
    ids = np.random.default_rng(9).integers(0, E, (T, A)).astype(np.int32)
    x = rnd(T, 1, K, seed=10)
    if act == "swiglu_oai":       # values about the clamp (+-7), not all beyond it (random MXFP4: ~1000)
        x *= np.float32(4.0 / np.abs(mul_mat_id_ref(wref, x, ids)).max())
    bias = rnd(E, 2 * F, seed=11) if biased else np.zeros((E, 2 * F), np.float32)
    code = {"silu": ops.ACT_SILU, "gelu": ops.ACT_GELU, "swiglu_oai": ops.ACT_SWIGLU_OAI}[act]
    ref_act = {"silu": naive.swiglu, "gelu": naive.geglu, "swiglu_oai": naive.swiglu_oai}[act]
    unused, out = poisoned((T, A, 2 * F)), poisoned((T, A, F))
    assert matmul.fuses_glu_id(int(Q[name]), T, K, 2 * F)
    matmul.mul_mat_id(unused, dev(w), dev(x), dev(ids), int(Q[name]),
                      bias=dev(bias.ravel()) if biased else None, glu=(out.reshape(T * A, F), code))

    def ref(x_):
        gu = mul_mat_id_ref(wref, x_, ids) + bias[ids]
        return ref_act(gu[..., :F], gu[..., F:])
    check_x8(f"mma mul_mat_id+GLU {name} {act}", out.copy_to_host(), x, ref, True)
    assert np.isnan(unused.copy_to_host()).all()


def test_x_ready_mma(tiles):
    """Two prompt products of one x: the second reuses the first's 8-bit x (x_ready)."""
    M, T, K = 16, 9, 64
    assert matmul.quantizes_x(int(Q["Q4_0"]), T, K)
    w1, _ = quantize(rnd(M, K, seed=5), "Q4_0")
    w2, _ = quantize(rnd(M, K, seed=6), "Q8_0")
    x = dev(rnd(T, K, seed=7))
    want, got = poisoned((T, M)), poisoned((T, M))
    matmul.mul_mat(want, dev(w2), x, int(Q["Q8_0"]))
    matmul.mul_mat(poisoned((T, M)), dev(w1), x, int(Q["Q4_0"]))
    matmul.mul_mat(got, dev(w2), x, int(Q["Q8_0"]), x_ready=True)
    assert np.array_equal(got.copy_to_host(), want.copy_to_host())


def test_grouped_reuses_the_last_grouping(tiles):
    """A MoE layer's gate, up and down share their ids: the second product reuses the first's
    grouping table (grouped=True, no grouping launch) and still equals the reference; the
    backend passes grouped only when the grouping bound last was of the same ids node."""
    from types import SimpleNamespace

    from nbmoe.backends.cuda import CUDABackend
    E, M, A, T, K = 4, 20, 2, 11, 64
    ids = np.random.default_rng(5).integers(0, E, (T, A)).astype(np.int32)
    x = rnd(T, 1, K, seed=6)
    for i, name in enumerate(("Q4_0", "Q8_0")):
        w, wref = _weights((E, M), name, seed=7 + i, K=K)
        out = poisoned((T, A, M))
        matmul.mul_mat_id(out, dev(w), dev(x), dev(ids), int(Q[name]), grouped=i > 0)
        check_x8(f"mma mul_mat_id {name} grouped={i > 0}", out.copy_to_host(), x,
                 lambda x_: mul_mat_id_ref(wref, x_, ids), True)
    be = object.__new__(CUDABackend)
    buf = {"ids0": ids, "ids1": ids}
    gate, up = (SimpleNamespace(srcs=("h", "ids0"), weight=f"blk.0.ffn_{k}_exps.weight")
                for k in ("gate", "up"))
    other = SimpleNamespace(srcs=("h", "ids1"), weight="blk.0.ffn_up_exps.weight")
    next_layer = SimpleNamespace(srcs=("h", "ids0"), weight="blk.1.ffn_gate_exps.weight")
    tile = matmul.id_tile(int(Q["Q4_0"]), K, T, E, A)
    assert tile and not be._grouped(gate, buf, ids, E, tile)
    assert be._grouped(up, buf, ids, E, tile)
    assert not be._grouped(other, buf, ids, E, tile)          # other ids
    assert not be._grouped(next_layer, buf, ids, E, tile)     # the next layer routes anew
    assert be._grouped(next_layer, buf, ids, E, tile)         # (its own up product reuses)
    assert not be._grouped(up, buf, ids[:, :1], E, tile)      # a share of the slots regroups
    assert not be._grouped(up, buf, ids, E, tile)
    assert not be._grouped(up, buf, ids, E, 0)                # matrix-vector: keeps the table
    assert be._grouped(up, buf, ids, E, tile)
