"""CUDA kernels for the K-quants and the 4-bit table types (nbmoe/cuda/quants_k.py, quants_iq4.py)
vs gguf-py's dequantize + float64 NumPy, under Numba's CUDA simulator (as test_cuda_kernels.py,
with cuda_common's helpers and small tile sizes).

Weights are random bytes with sane scales (tools/ref_quant.random_blocks): every code and
sub-scale bit pattern, decoded by gguf-py for the reference. K = 512 (two super-blocks) for the
256-value types, 256 in the slower tiled kernels (the decoders are the same), 224 (7 blocks) for
the 32-value ones: MXFP4's 17-byte blocks then make odd row lengths, whose words only byte loads
can read. Run with -s for the table of max errors.
"""
import cuda_setup  # noqa: F401  (selects the simulator before numba.cuda loads; skips without it)
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from gguf import GGML_QUANT_SIZES  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from ref_quant import random_blocks  # noqa: E402
from cuda_common import _simulator_speed, small  # noqa: E402,F401  (fixtures)
from cuda_common import check, check_x8, dev, mul_mat_id_ref, poisoned, rnd  # noqa: E402

from nbmoe.cuda import matmul, quants  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

NAMES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4"]
# The tiled and expert kernels call the same decoders that the tests of every type above check
# (dequantize bit-exact, matrix-vector both paths); they run on one type of each layout family
# (K with mins, signed K, 16-level table, MXFP4's byte-aligned blocks): the simulator is slow.
LAYOUTS = ["Q4_K", "Q6_K", "IQ4_XS", "MXFP4"]


def k_for(name, supers=2):
    return 256 * supers if GGML_QUANT_SIZES[Q[name]][0] == 256 else 224


def weights(shape, name, seed, K):
    """Random blocks of type name: uint8 [*shape, row_bytes], and their float64 values [*shape, K]."""
    block = GGML_QUANT_SIZES[Q[name]][0]
    rng = np.random.default_rng(seed)
    w = random_blocks(rng, int(np.prod(shape)) * K // block, name).reshape(shape + (-1,))
    ref = gguf_dequantize(w, Q[name]).reshape(shape + (K,)).astype(np.float64)
    return w, ref


def has_int8(name):
    return quants.qtype_info(int(Q[name])).idec is not None


@pytest.mark.parametrize("name", NAMES)
def test_dequantize_get_rows(name, small):
    qt = int(Q[name])
    assert quants.is_supported(qt)
    w, ref = weights((5,), name, seed=1, K=k_for(name))
    assert quants.row_size(qt, k_for(name)) == w.shape[1]
    dw = dev(w)
    assert np.array_equal(matmul.dequantize(dw, qt).copy_to_host(), ref.astype(np.float32))   # exact
    ids = np.array([4, 0, 2, 2], np.int32)
    out = poisoned((4, k_for(name)))
    matmul.get_rows(out, dw, dev(ids), qt)
    assert np.array_equal(out.copy_to_host(), ref[ids].astype(np.float32))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("int8", [True, False])
def test_mul_mat_vec(name, int8, small, monkeypatch):
    """T = 1; M = 5 rows, 2 a block: a partial block."""
    if int8 and not has_int8(name):
        pytest.skip(f"{name} has no int8 path")
    monkeypatch.setattr(matmul, "INT8_DOT", int8)
    w, wref = weights((5,), name, seed=2, K=k_for(name))
    x = rnd(1, k_for(name), seed=3)
    out = poisoned((1, 5))
    matmul.mul_mat(out, dev(w), dev(x), int(Q[name]))
    check_x8(f"mul_mat vec {name}", out.copy_to_host(), x, lambda x_: x_ @ wref.T, int8)


@pytest.mark.parametrize("name", LAYOUTS)
def test_mul_mat_tiled(name, small):
    """T = 9 tokens (tiles of 8), M = 19 rows (tiles of 16): partial tiles both ways."""
    w, wref = weights((19,), name, seed=4, K=k_for(name, supers=1))
    x = rnd(9, k_for(name, supers=1), seed=5)
    out = poisoned((9, 19))
    matmul.mul_mat(out, dev(w), dev(x), int(Q[name]))
    check(f"mul_mat tiled {name}", out.copy_to_host(), x @ wref.T)


@pytest.mark.parametrize("name", LAYOUTS)
def test_mul_mat_id(name, small, monkeypatch):
    """Matrix-vector (T = 1, one x row per token; the int8 path where the type has one) and
    grouped by expert (T = 5 > MMV_MAX_T = 2, one x row per slot), E = 3, A = 2, M = 3."""
    monkeypatch.setattr(matmul, "MMV_MAX_T", 2)
    E, M, A, K = 3, 3, 2, k_for(name, supers=1)
    w, wref = weights((E, M), name, seed=6, K=K)
    dw = dev(w)
    for T, X, ids in ((1, 1, [[2, 0]]), (5, 2, [[1, 0], [2, 1], [1, 2], [0, 1], [1, 0]])):
        ids = np.array(ids, np.int32)
        x = rnd(T, X, K, seed=7 + T)
        out = poisoned((T, A, M))
        matmul.mul_mat_id(out, dw, dev(x), dev(ids), int(Q[name]))
        int8 = T <= 2 and matmul.INT8_DOT and has_int8(name)
        kind = "vec" if T <= 2 else "grouped"
        check_x8(f"mul_mat_id {kind} {name}", out.copy_to_host(), x,
                 lambda x_: mul_mat_id_ref(wref, x_, ids), int8)


def test_mxfp4_exponents(small):
    """MXFP4's E8M0 scale at its ends: 2^-128 and 2^-127 (denormal floats), up to 2^127, whose
    larger levels overflow to inf, all as gguf-py decodes them."""
    w = np.random.default_rng(8).integers(0, 256, (2, 8, 17), dtype=np.uint8)
    w[:, :, 0] = [0, 1, 2, 3, 127, 128, 254, 255]
    w = w.reshape(2, -1)
    with np.errstate(over="ignore"):
        ref = gguf_dequantize(w, Q.MXFP4).reshape(2, -1)
    assert np.isinf(ref).any() and (np.abs(ref[ref != 0]) < 1e-37).any()
    got = matmul.dequantize(dev(w), int(Q.MXFP4)).copy_to_host()
    assert np.array_equal(got, ref)
