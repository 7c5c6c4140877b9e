"""Flash attention on f16 tensor cores (nbmoe/cuda/flash.py) and its mma primitive, under Numba's
CUDA simulator (NBMOE_REAL_GPU=1 runs it on the GPU, as test_cuda_kernels.py).

The primitive: random f16 matrices spread over the 32 lanes' registers by the PTX ISA's fragment
table for mma.m16n8k16 .f16 (written out here a second time, from the ISA text), each lane's
four float32 results vs NumPy. The kernel: prompts through attention.attention (T > SPLIT_MAX_T)
vs the float64 reference of tests/naive.py, with earlier cache rows (pos0 > 0), a window, GQA,
partial query tiles and key tiles (the simulator's tiles: 2 warps = 32 query rows, 16 keys).
q * scale and P are rounded to f16 in the kernel: errors ~1e-3 of the output's magnitude.
Run with -s for the table of max relative errors.
"""
import cuda_setup  # noqa: F401  (selects the simulator before numba.cuda loads; skips without it)
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from numba import cuda  # noqa: E402
from cuda_common import _simulator_speed  # noqa: E402,F401  (fixture)
from cuda_common import attn_case, check, dev, poisoned  # noqa: E402

import naive  # noqa: E402
from nbmoe.cuda import attention as att  # noqa: E402
from nbmoe.cuda import flash  # noqa: E402
from nbmoe.cuda.mma import mma_f16_16x8x16, pack_f16x2  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

RTOL_F16 = 4e-3    # f16 q and P vs the float64 reference


# ---------------------------------------------------------------- the primitive

@cuda.jit
def _mma_kernel(out, regs, c):
    lane = cuda.threadIdx.x
    r = regs[lane]
    d = mma_f16_16x8x16(r[0], r[1], r[2], r[3], r[4], r[5], c[lane, 0], c[lane, 1], c[lane, 2], c[lane, 3])
    for i in range(4):
        out[lane, i] = d[i]


@cuda.jit
def _pack_kernel(out, x):
    i = cuda.threadIdx.x
    out[i] = pack_f16x2(x[2 * i], x[2 * i + 1])


def _word(lo, hi):
    """Two f16 values -> one register (lo in the low half)."""
    return np.array([lo, hi], np.float16).view(np.uint32)[0]


def test_mma_f16_primitive():
    """D = A @ B + C with A, B on the f16 grid: the products are exact, so float32 accuracy."""
    rng = np.random.default_rng(7)
    A = rng.standard_normal((16, 16)).astype(np.float16)
    B = rng.standard_normal((16, 8)).astype(np.float16)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    regs = np.zeros((32, 6), np.uint32)
    c = np.zeros((32, 4), np.float32)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        k = 2 * t
        regs[lane, 0] = _word(A[g, k], A[g, k + 1])              # a0: row g,     k 2t, 2t+1
        regs[lane, 1] = _word(A[g + 8, k], A[g + 8, k + 1])      # a1: row g + 8
        regs[lane, 2] = _word(A[g, k + 8], A[g, k + 9])          # a2: row g,     k 8 + 2t, ..
        regs[lane, 3] = _word(A[g + 8, k + 8], A[g + 8, k + 9])  # a3: row g + 8
        regs[lane, 4] = _word(B[k, g], B[k + 1, g])              # b0: col g, k 2t, 2t+1
        regs[lane, 5] = _word(B[k + 8, g], B[k + 9, g])          # b1: col g, k 8 + 2t, ..
        c[lane] = C[g, k], C[g, k + 1], C[g + 8, k], C[g + 8, k + 1]
    out = cuda.to_device(np.zeros((32, 4), np.float32))
    _mma_kernel[1, 32](out, dev(regs.view(np.int32)), dev(c))
    D = A.astype(np.float64) @ B.astype(np.float64) + C
    got = out.copy_to_host()
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        ref = [D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]]
        np.testing.assert_allclose(got[lane], ref, rtol=1e-5, atol=1e-5)


def test_pack_f16x2_rounds_to_nearest_even():
    x = np.array([1.0, -2.5, 1 + 2 ** -11, 1 + 3 * 2 ** -11, 1e6, 3e-6, 0.1, -0.0], np.float32)
    out = cuda.to_device(np.zeros(4, np.uint32))
    _pack_kernel[1, 4](out, dev(x))
    with np.errstate(over="ignore"):
        assert np.array_equal(out.copy_to_host(), x.astype(np.float16).view(np.uint32))


# ---------------------------------------------------------------- the kernel

@pytest.mark.parametrize("T,H,Hkv,Dh,pos0,window", [
    (20, 4, 2, 32, 5, 0),      # G = 2: 40 rows a kv head (a full and a partial tile), 25 keys
    (20, 4, 2, 32, 5, 7),      # a window shorter than a key tile: steps skipped per warp
    (13, 3, 1, 16, 0, 0),      # G = 3 (rows of a token across warps), no earlier rows
    (40, 2, 2, 16, 3, 0),      # G = 1: a warp skips the key steps past its tokens
])
def test_flash_attention(T, H, Hkv, Dh, pos0, window):
    assert T > att.SPLIT_MAX_T and flash.supported(Dh)
    q, kc, vc, k_all, v_all = attn_case(T, H, Hkv, Dh, pos0, C=pos0 + T + 3, seed=T + Dh + window)
    for c in (kc, vc):                               # NaN in the unused cache rows: never read
        h = c.copy_to_host()
        h[pos0 + T:] = 0x7E00
        c.copy_to_device(h)
    scale = 1.0 / np.sqrt(Dh)
    ref = naive.attention(q, k_all, v_all, pos0, scale, window)
    out = poisoned(q.shape)
    att.attention(out, dev(q), kc, vc, pos0, scale, window)
    check(f"flash T={T} H={H}/{Hkv} Dh={Dh} pos0={pos0} w={window}", out.copy_to_host(), ref, RTOL_F16)
    if window:
        dq = dev(q)
        att.attention(dq, dq, kc, vc, dev(np.arange(pos0, pos0 + T, dtype=np.int32)), scale, window)
        check("flash in place", dq.copy_to_host(), ref, RTOL_F16)   # out aliases q


@pytest.mark.parametrize("T,H,Dh,Dv,pos0", [
    (20, 2, 192, 128, 5),      # DeepSeek's expanded MLA heads: keys staged word by word
    (9, 4, 48, 32, 30),        # the tiny test models' (two key steps)
])
def test_flash_values_narrower_than_keys(T, H, Dh, Dv, pos0):
    """MLA's expanded form (cuda/mla.py): f16 keys [C, H, Dh] and values [C, H, Dv], one kv
    head a query head, out [T, H, Dv]."""
    assert flash.supported(Dh, ("f16", "f16"), Dv) and not flash.supported(Dh)
    C = pos0 + T + 2
    q = naive.rnd(T, H, Dh, seed=T, scale=2.0)
    k = np.random.default_rng(T + 1).standard_normal((C, H, Dh)).astype(np.float16)
    v = np.random.default_rng(T + 2).standard_normal((C, H, Dv)).astype(np.float16)
    ref = naive.attention(q, k.astype(np.float64), v.astype(np.float64), pos0, 0.1, 0)
    out = poisoned((T, H, Dv))
    att.attention(out, dev(q), dev(k.view(np.uint16)), dev(v.view(np.uint16)),
                  dev(np.arange(pos0, pos0 + T, dtype=np.int32)), 0.1, 0)
    check(f"flash T={T} H={H} Dh={Dh} Dv={Dv}", out.copy_to_host(), ref, RTOL_F16)
    with pytest.raises(ValueError, match="flash"):
        att.attention(poisoned((T, H, Dv)), dev(q), dev(k.view(np.uint16)), dev(v.view(np.uint16)),
                      pos0, 0.1, 0, fa=False)


def test_mla_latents_and_expand():
    """cuda/mla.py, as tests/test_cpu_ops.py checks cpu/mla.py: the latents of f16 cache rows
    [latent R, k_pe Dr], and each head's f16 key [kv's Dn columns, k_pe] and value."""
    from nbmoe.cuda import mla
    n, R, Dr, H, Dn, Dv = 5, 32, 16, 2, 16, 8
    rows = naive.rnd(n, 1, R + Dr, seed=1).astype(np.float16)
    lat = cuda.device_array((n, R), np.float32)
    mla.latents(lat, dev(rows.view(np.uint16)), R + Dr)
    assert np.array_equal(lat.copy_to_host(), rows[:, 0, :R].astype(np.float32))
    kv = naive.rnd(n, H * (Dn + Dv), seed=2)
    keys, values = cuda.device_array((n, H, Dn + Dr), np.uint16), cuda.device_array((n, H, Dv), np.uint16)
    mla.expand(keys, values, dev(kv), dev(rows.view(np.uint16)), R + Dr)
    heads = kv.reshape(n, H, Dn + Dv)
    want_k = np.concatenate([heads[:, :, :Dn], np.repeat(rows[:, :, R:].astype(np.float32), H, 1)], -1)
    assert np.array_equal(keys.copy_to_host().view(np.float16), want_k.astype(np.float16))
    assert np.array_equal(values.copy_to_host().view(np.float16), heads[:, :, Dn:].astype(np.float16))
    # rows from the first of a batch's device positions (what a recorded graph reads)
    pos = dev(np.array([2, 3, 4], np.int32))
    lat2 = cuda.device_array((3, R), np.float32)
    mla.latents(lat2, dev(rows.view(np.uint16)), R + Dr, pos)
    assert np.array_equal(lat2.copy_to_host(), rows[2:, 0, :R].astype(np.float32))
    keys2, values2 = dev(np.zeros((n, H, Dn + Dr), np.uint16)), dev(np.zeros((n, H, Dv), np.uint16))
    mla.expand(keys2, values2, dev(kv[2:]), dev(rows.view(np.uint16)), R + Dr, pos)
    k2, v2 = keys2.copy_to_host(), values2.copy_to_host()
    assert np.array_equal(k2[2:], keys.copy_to_host()[2:]) and not k2[:2].any()
    assert np.array_equal(v2[2:], values.copy_to_host()[2:]) and not v2[:2].any()


@pytest.mark.parametrize("pos0,H,Dh,splits,warps", [
    (2, 16, 64, 128, None),    # 4 warps; fewer keys than the 4 splits of a 64-slot cache
    (40, 16, 128, 2, 4),       # two k-steps and dim pairs a warp, two steps a split
    (20, 16, 192, 2, None),    # 12 warps (DeepSeek's 576 takes 12)
])
def test_mla_decode(pos0, H, Dh, splits, warps, monkeypatch):
    """cuda/mla_decode.py: one token's heads over MLA's one f16 kv head whose rows are keys
    and values both, keys split over the grid and merged; out and its 8-bit copy."""
    from nbmoe.cuda import mla_decode, x8
    monkeypatch.setattr(mla_decode, "MAX_SPLITS", splits)
    monkeypatch.setattr(mla_decode, "_kernels", {})
    if warps:
        monkeypatch.setattr(mla_decode, "warps", lambda Dh: warps)
    assert mla_decode.warps(576) == 12 or warps
    C = 64
    rng = np.random.default_rng(pos0)
    rows = rng.standard_normal((C, 1, Dh)).astype(np.float16)
    rows[pos0 + 1:] = np.float16(np.nan)                 # past the token: never weighed in
    cache = dev(rows.view(np.uint16))
    q = naive.rnd(1, H, Dh, seed=pos0, scale=2.0)
    assert mla_decode.used(q, cache, cache) and not mla_decode.used(q, cache, dev(rows.view(np.uint16)))
    k = rows[:pos0 + 1].astype(np.float64)
    ref = naive.attention(q, k, k, pos0, 0.3)
    out = poisoned(q.shape)
    xq, xds = x8.x8_buffers(1, H * Dh)
    att.attention(out, dev(q), cache, cache, dev(np.array([pos0], np.int32)), 0.3, xq=xq, xds=xds)
    got = out.copy_to_host()
    check(f"mla decode pos0={pos0}", got, ref, RTOL_F16)
    codes = xq.copy_to_host()[:H * Dh // 4].view(np.int8).reshape(-1, 32).astype(np.float64)
    d = xds.copy_to_host()[:H * Dh // 16].reshape(-1, 2)[:, :1]
    assert np.all(np.abs(codes * d - got.reshape(-1, 32)) <= d * 0.5 + 1e-7)


@pytest.mark.parametrize("pos0,window,sink", [
    (40, 0, False),     # 41 keys over 3 splits of a 64-slot cache (P = 4), uneven shares
    (40, 9, True),      # a window: one split, written through the merge; sinks added there
    (3, 0, False),      # fewer keys than a split takes
])
def test_flash_decode_splits(pos0, window, sink, monkeypatch):
    """One token over a long cache: flash.decode's key splits and the merge (the simulator's
    tile of 16 keys a split) vs the float64 reference, out and its 8-bit copy."""
    from nbmoe.cuda import x8
    monkeypatch.setattr(flash, "DECODE_MIN_CACHE", 32)
    monkeypatch.setattr(flash, "DECODE_SPLIT_KEYS", 16)
    T, H, Hkv, Dh, C = 1, 4, 2, 32, 64
    q, kc, vc, k_all, v_all = attn_case(T, H, Hkv, Dh, pos0, C=C, seed=pos0 + window)
    assert att.flash_decodes(q, kc, vc)
    sinks = np.linspace(-1.0, 1.5, H).astype(np.float32) if sink else None
    ref = naive.attention(q, k_all, v_all, pos0, 1.0 / np.sqrt(Dh), window, sinks)
    out = poisoned(q.shape)
    xq, xds = x8.x8_buffers(T, H * Dh)
    att.attention(out, dev(q), kc, vc, dev(np.array([pos0], np.int32)), 1.0 / np.sqrt(Dh), window,
                  xq=xq, xds=xds, sinks=None if sinks is None else dev(sinks))
    got = out.copy_to_host()
    check(f"flash decode pos0={pos0} w={window} sink={sink}", got, ref, RTOL_F16)
    n = T * H * Dh
    codes = xq.copy_to_host()[:n // 4].view(np.int8).reshape(-1, 32).astype(np.float64)
    d = xds.copy_to_host()[:n // 16].reshape(-1, 2)[:, :1]
    assert np.all(np.abs(codes * d - got.reshape(-1, 32)) <= d * 0.5 + 1e-7)   # out, rounded to 8 bits
