"""CUDA decode fusions (nbmoe/cuda/fused.py, attention.rope_attention, products that add into
the residual): each equals the separate launches bit for bit, under the simulator as
test_cuda_kernels.py.
"""
from cuda_common import _simulator_speed, small  # noqa: F401  (fixtures; first: selects the simulator)
from cuda_common import Q, att, attn_case, check, dev, poisoned, quantize, rnd  # noqa: E402
import cuda_setup  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from numba import cuda  # noqa: E402

import naive  # noqa: E402
from nbmoe.cuda import matmul, moe, ops  # noqa: E402
from nbmoe.cuda.x8 import quantize_x, x8_buffers  # noqa: E402
from nbmoe.cpu.ops import rope_freqs  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


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
    xq, xds = quantize_x(h_want, 1, D, 0)
    q_want, ds_want = xq.copy_to_host()[:D // 4], xds.copy_to_host()[:D // 16]
    for run in range(2):
        xq, xds = x8_buffers(1, D)
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
    q, kc, vc, k_all, v_all = attn_case(1, H, Hkv, Dh, pos0, C=24, seed=pos0)
    out = poisoned(q.shape)
    xq, xds = x8_buffers(1, H * Dh)
    att.attention(out, dev(q), kc, vc, dev(np.array([pos0], np.int32)), 0.125, xq=xq, xds=xds)
    got_q, got_ds = xq.copy_to_host()[:H * Dh // 4], xds.copy_to_host()[:H * Dh // 16]
    check("attention (x8 form)", out.copy_to_host(),
          naive.attention(q, k_all, v_all, pos0, 0.125, 0))
    quantize_x(out, 1, H * Dh, 0)
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
    from nbmoe.cuda import norm_rope
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
        xq, xds = x8_buffers(T, H * Dh)
        if fused_launch:
            att.rope_attention(out, q, k, v, kc, vc, pos, wq, wk, 1e-6, rope_freqs(n_rot, 10000.0),
                               1.0, neox, 0.125, window, xq=xq, xds=xds)
        else:
            norm_rope.norm_rope_store(q, k, v, kc, vc, pos, wq, wk, 1e-6, rope_freqs(n_rot, 10000.0), 1.0, neox)
            att.attention(out, q, kc, vc, pos, 0.125, window, xq=xq, xds=xds)
        outs.append([a.copy_to_host() for a in (out, kc, vc)] +
                    [xq.copy_to_host()[:T * H * Dh // 4], xds.copy_to_host()[:T * H * Dh // 16]])
    for name, a, b in zip(("out", "k cache", "v cache", "xq", "xds"), *outs):
        assert np.array_equal(a, b), name


def test_products_accumulate_into_the_residual(small, monkeypatch):
    """out += W x [+ b] (mul_mat accumulate [with a bias]: the o projection onto the residual
    stream, split-K and not) and x += the experts' weighted sum (down_combine_q8 accumulate):
    equal to the product followed by [the bias's add and] an add, bit for bit."""
    from nbmoe.cuda import fused
    monkeypatch.setattr(matmul, "INT8_DOT", True)
    for M, K, name in ((7, 64, "Q8_0"), (3, 1024, "Q4_0"), (5, 61, "F16")):
        w, _ = quantize(rnd(M, K, seed=M), name)
        x, res = dev(rnd(1, K, seed=K)), rnd(1, M, seed=3)
        y, acc = poisoned((1, M)), dev(res)
        matmul.mul_mat(y, dev(w), x, int(Q[name]))
        matmul.mul_mat(acc, dev(w), x, int(Q[name]), accumulate=True)
        assert np.array_equal(acc.copy_to_host(), res + y.copy_to_host()), name
        b, acc = rnd(M, seed=5), dev(res)
        matmul.mul_mat(acc, dev(w), x, int(Q[name]), accumulate=True, bias=dev(b))
        assert np.array_equal(acc.copy_to_host(), res + (y.copy_to_host() + b)), name
    E, M, K, A = 3, 5, 64, 2
    w, _ = quantize(rnd(E, M, K, seed=1), "Q4_0")
    ids, wts, xa = dev(np.array([[2, 0]], np.int32)), dev(np.array([[0.6, 0.4]], np.float32)), dev(rnd(1, A, K, seed=2))
    xq, xds = quantize_x(xa, A, K, 0)
    y = poisoned((1, M))
    fused.down_combine_q8(y, dev(w), xq, xds, ids, wts, int(Q["Q4_0"]), K)
    res = rnd(1, M, seed=4)
    acc = dev(res)
    fused.down_combine_q8(acc, dev(w), xq, xds, ids, wts, int(Q["Q4_0"]), K, accumulate=True)
    assert np.array_equal(acc.copy_to_host(), res + y.copy_to_host())
