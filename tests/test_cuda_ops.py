"""CUDA norms, rope, activations, KV cache and attention, MoE routing (nbmoe/cuda/ops.py,
attention.py, moe.py) vs tests/naive.py, under the simulator as test_cuda_kernels.py.

Letters: T tokens, H / Hkv heads, Dh head dim, E experts, A chosen.
"""
from cuda_common import _simulator_speed, small  # noqa: F401  (fixtures; first: selects the simulator)
from cuda_common import att, attn_case, check, dev, poisoned, rnd  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from numba import cuda  # noqa: E402

import naive  # noqa: E402
from nbmoe.cuda import moe, ops  # noqa: E402
from nbmoe.cuda.x8 import quantize_x, x8_buffers  # noqa: E402
from nbmoe.cpu.ops import rope_freqs  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


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
    xq, xds = x8_buffers(T, D)
    ops.rms_norm(out, dx, dev(w), 1e-6, add=dev(a), xq=xq, xds=xds)
    check("x += add", dx.copy_to_host(), x.astype(np.float64) + a)
    check("rms_norm(x + add)", out.copy_to_host(), naive.rms_norm(x + a, w, 1e-6))
    got_q, got_ds = xq.copy_to_host()[:T * D // 4], xds.copy_to_host()[:T * D // 16]
    quantize_x(out, T, D, 0)          # the same buffers, refilled by quantize_x
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
    ops.rope(dx, dev(pos), rope_freqs(n_rot, 10000.0, 0.5), 1.0, neox)
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
    q, kc, vc, k_all, v_all = attn_case(T, H, Hkv, Dh, pos0, C=12, seed=T * Dh)
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
    q, kc, vc, k_all, v_all = attn_case(1, H, Hkv, Dh, pos0, C=24, seed=3)
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
    q, kc, vc, k_all, v_all = attn_case(1, H, Hkv, Dh, pos0, C=48, seed=pos0)
    q *= 2
    ref = naive.attention(q, k_all, v_all, pos0, 0.2, 0)
    out = poisoned(q.shape)
    att.attention(out, dev(q), kc, vc, pos0, 0.2)
    check("attention, 41-45 keys in one split", out.copy_to_host(), ref)


def test_attention_first_token_is_v(small):
    """At position 0 a token sees only itself: out = v (as stored in f16)."""
    q, kc, vc, k_all, v_all = attn_case(1, 2, 1, 16, 0, C=4)
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


# ---------------------------------------------------------------- column windows of heads

def test_windows_of_heads(small):
    """MLA's head parts as views of wider heads: rms_norm_rows of a window in place (a cache
    row's latent), rope_into from q's window into another buffer's (q_pe into q'), in place on
    a window (k_pe); every column outside the windows untouched."""
    T, H, W, n = 3, 2, 40, 16
    kv, wn = rnd(T, 1, W, seed=1, scale=2.0), rnd(20, seed=2)
    d = dev(kv)
    rows = d.reshape(T, W)[:, 4:24]
    ops.rms_norm_rows(rows, rows, dev(wn), 1e-6)
    pos = np.array([0, 7, 4000], np.int32)
    ops.rope_into(d[:, :, 24:24 + n], d[:, :, 24:24 + n], dev(pos), rope_freqs(n, 10000.0), 1.0, False)
    got = d.copy_to_host()
    check("rms_norm_rows window", got[:, :, 4:24], naive.rms_norm(kv[:, :, 4:24], wn, 1e-6))
    check("rope in place window", got[:, :, 24:], naive.rope(kv[:, :, 24:], pos, n, 10000.0, False))
    assert np.array_equal(got[:, :, :4], kv[:, :, :4])
    q, out = rnd(T, H, W, seed=3), rnd(T, H, W, seed=4)
    d = dev(out)
    ops.rope_into(d[:, :, 20:20 + n], dev(q)[:, :, 24:24 + n], dev(pos), rope_freqs(n, 10000.0), 1.0, True)
    got = d.copy_to_host()
    check("rope_into window", got[:, :, 20:20 + n], naive.rope(q[:, :, 24:24 + n], pos, n, 10000.0, True))
    assert np.array_equal(np.delete(got, np.s_[20:20 + n], 2), np.delete(out, np.s_[20:20 + n], 2))


@pytest.mark.parametrize("neox", [False, True])
def test_mla_rope(neox, small):
    """norm_rope.mla_rope, one launch: q''s roped part from q's window, the cache row's latent
    normed and its key part roped in place; columns outside the windows untouched."""
    from nbmoe.cuda.norm_rope import mla_rope
    T, H, Dn, Dr, R = 2, 3, 8, 8, 40
    q, qm, kv, w = rnd(T, H, Dn + Dr, seed=1), rnd(T, H, R + Dr, seed=2), rnd(T, 1, R + Dr, seed=3), rnd(R, seed=4)
    pos = np.array([5, 3000], np.int32)
    dq, dqm, dkv = dev(q), dev(qm), dev(kv)
    mla_rope(dqm[:, :, R:], dq[:, :, Dn:], dkv[:, :, :R], dkv[:, :, R:], dev(pos), dev(w), 1e-6,
             rope_freqs(Dr, 10000.0), 1.0, neox)
    got_qm, got_kv = dqm.copy_to_host(), dkv.copy_to_host()
    check("mla_rope q'", got_qm[:, :, R:], naive.rope(q[:, :, Dn:], pos, Dr, 10000.0, neox))
    check("mla_rope latent", got_kv[:, :, :R], naive.rms_norm(kv[:, :, :R], w, 1e-6))
    check("mla_rope k_pe", got_kv[:, :, R:], naive.rope(kv[:, :, R:], pos, Dr, 10000.0, neox))
    assert np.array_equal(got_qm[:, :, :R], qm[:, :, :R]) and np.array_equal(dq.copy_to_host(), q)
