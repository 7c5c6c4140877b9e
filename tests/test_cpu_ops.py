"""CPU non-matmul kernels vs the float64 references in tests/naive.py.

Every public entry point is tested, and the single-threaded and prange drivers are each called
directly, so both paths run whatever the size thresholds say. Odd sizes on purpose.
"""
import numpy as np
import pytest

import naive
from naive import max_rel, rnd
from nbmoe.cpu import attention as att
from nbmoe.cpu import attention_flash as flash
from nbmoe.cpu import moe, ops

RTOL = 1e-5  # float32 paths, relative to the largest reference value




# ---------------------------------------------------------------- exp_f32

def test_exp_f32():
    x = np.linspace(-87, 88, 20001).astype(np.float32)
    got = np.array([ops.exp_f32(v) for v in x], np.float64)
    ref = np.exp(x.astype(np.float64))
    assert np.max(np.abs(got - ref) / ref) < 4e-7
    assert np.isnan(ops.exp_f32(np.float32(np.nan)))
    assert 0 < ops.exp_f32(np.float32(-np.inf)) < 1e-37  # clamped, not 0


# ---------------------------------------------------------------- rms_norm, add, scale

@pytest.mark.parametrize("T", [1, 5, 33])
@pytest.mark.parametrize("fn", ["public", "seq", "par"])
def test_rms_norm(T, fn):
    D = 67
    x, w = rnd(T, D, seed=T, scale=3.0), rnd(D, seed=99)
    out = np.empty_like(x)
    if fn == "public":
        ops.rms_norm(out, x, w, 1e-6)
    else:
        getattr(ops, f"_rms_norm_{fn}")(out, x, w, 1e-6)
    assert max_rel(out, naive.rms_norm(x, w, 1e-6)) < RTOL


@pytest.mark.parametrize("Dh", [16, 64, 80])
def test_rms_norm_per_head_in_place(Dh):
    """QK-norm: x [T, H, Dh] normed head by head with w [Dh], in place."""
    x, w = rnd(5, 6, Dh, seed=Dh), rnd(Dh, seed=1)
    ref = naive.rms_norm(x, w, 1e-6)
    ops.rms_norm(x, x, w, 1e-6)
    assert max_rel(x, ref) < RTOL


@pytest.mark.parametrize("n", [67, 5 * 67, 1 << 16])
def test_add_scale(n):
    a, b = rnd(n, seed=1), rnd(n, seed=2)
    out = np.empty_like(a)
    ops.add(out, a, b)
    assert np.array_equal(out, a + b)
    ref = a + b
    ops.add(a, a, b)  # in place
    assert np.array_equal(a, ref)
    ops.scale(out, b, 0.37)
    assert np.array_equal(out, b * np.float32(0.37))
    ops._add_par(out, a, b)
    assert np.array_equal(out, a + b)
    ops._scale_par(out, b, np.float32(2.5))
    assert np.array_equal(out, b * np.float32(2.5))


# ---------------------------------------------------------------- rope

@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("Dh,n_rot", [(16, 16), (64, 64), (80, 32)])
@pytest.mark.parametrize("T", [1, 5, 33])
def test_rope(neox, Dh, n_rot, T):
    H = 6
    x = rnd(T, H, Dh, seed=T + Dh)
    pos = (np.arange(T) * 3001 + 1234).astype(np.int32)  # up to ~1e5: angles need float64
    ref = naive.rope(x, pos, n_rot, 10000.0, neox, 0.5)
    y = x.copy()
    ops.rope(y, pos, ops.rope_freqs(n_rot, 10000.0, 0.5), 1.0, neox)
    assert max_rel(y, ref) < RTOL
    assert np.array_equal(y[..., n_rot:], x[..., n_rot:])  # dims past n_rot untouched
    cs, sn = np.empty((T, n_rot // 2), np.float32), np.empty((T, n_rot // 2), np.float32)
    ops.rope_tables(cs, sn, pos, ops.rope_freqs(n_rot, 10000.0, 0.5))
    for fn in (ops.rope_apply, ops._rope_seq, ops._rope_par):
        y = x.copy()
        fn(y, cs, sn, neox)
        assert max_rel(y, ref) < RTOL
    y = x.copy()
    ops.rope(y, pos, ops.rope_freqs(n_rot, 10000.0), 1.0, neox)
    assert max_rel(y, naive.rope(x, pos, n_rot, 10000.0, neox)) < RTOL


def test_rope_tables_consecutive_positions():
    """Runs of consecutive positions take the rotation recurrence (re-anchored every
    ROPE_ANCHOR rows and at the jump to 5); positions near 1e5, where errors would show."""
    pos = np.concatenate([np.arange(99000, 99150), np.arange(5, 12)]).astype(np.int32)
    T, n_rot = pos.shape[0], 64
    cs, sn = np.empty((T, n_rot // 2), np.float32), np.empty((T, n_rot // 2), np.float32)
    ops.rope_tables(cs, sn, pos, ops.rope_freqs(n_rot, 10000.0, 0.5))
    theta = pos[:, None] * 0.5 * 10000.0 ** (-2.0 * np.arange(n_rot // 2) / n_rot)
    assert np.max(np.abs(cs - np.cos(theta))) < 1e-7
    assert np.max(np.abs(sn - np.sin(theta))) < 1e-7


def test_sincos_f64():
    x = np.concatenate([np.linspace(-10, 10, 2001), np.linspace(0, 1.5e6, 2001)])
    got = np.array([ops.sincos_f64(v) for v in x])
    assert np.max(np.abs(got[:, 0] - np.sin(x))) < 1e-15
    assert np.max(np.abs(got[:, 1] - np.cos(x))) < 1e-15


def test_rope_pairs_by_hand():
    """Position 1, one pair per mode: dim pair rotated by exactly theta_0 = 1 rad."""
    x = np.zeros((1, 1, 4), np.float32)
    x[0, 0] = [1, 2, 3, 4]
    c, s = np.cos(1.0), np.sin(1.0)
    y = x.copy()
    ops.rope(y, np.array([1], np.int32), ops.rope_freqs(2, 10000.0), 1.0, False)  # normal: pair (0, 1)
    np.testing.assert_allclose(y[0, 0], [c - 2 * s, s + 2 * c, 3, 4], rtol=1e-6)
    y = x.copy()
    ops.rope(y, np.array([1], np.int32), ops.rope_freqs(4, 10000.0), 1.0, True)  # neox: pairs (0, 2), (1, 3)
    c1, s1 = np.cos(10000.0 ** -0.5), np.sin(10000.0 ** -0.5)  # pair (1, 3): theta_1 = base^(-2/4)
    np.testing.assert_allclose(y[0, 0], [c - 3 * s, 2 * c1 - 4 * s1, s + 3 * c, 2 * s1 + 4 * c1],
                               rtol=1e-6)


# ---------------------------------------------------------------- swiglu, geglu, softmax_rows

@pytest.mark.parametrize("N", [1, 5, 33 * 4])
@pytest.mark.parametrize("act", ["swiglu", "geglu"])
def test_glu(N, act):
    F = 301
    gate, up = rnd(N, F, seed=N, scale=4.0), rnd(N, F, seed=N + 1)
    gate[0, :4] = [-100.0, 100.0, -1e4, 1e4]
    ref = getattr(naive, act)(gate, up)
    for fn in (getattr(ops, act), getattr(ops, f"_{act}_seq"), getattr(ops, f"_{act}_par")):
        out = np.empty_like(gate)
        fn(out, gate, up)
        assert np.all(np.isfinite(out))
        assert max_rel(out, ref) < RTOL
    # strided views: gate and up as the halves of a fused [N, 2F] matmul output
    gu = np.concatenate([gate, up], axis=1)
    out = np.empty_like(gate)
    getattr(ops, act)(out, gu[:, :F], gu[:, F:])
    assert max_rel(out, ref) < RTOL
    # in place, as the graph's GLU writes (out = gate; out = up): the two-array loops
    for fn in (getattr(ops, act), getattr(ops, f"_{act}_seq"), getattr(ops, f"_{act}_par")):
        g, u = gate.copy(), up.copy()
        fn(g, g, up)
        fn(u, gate, u)
        assert max_rel(g, ref) < RTOL and max_rel(u, ref) < RTOL


@pytest.mark.parametrize("N,V", [(1, 67), (3, 1001), (4, 20000)])
def test_softmax_rows(N, V):
    x = rnd(N, V, seed=V, scale=5.0)
    x[0, 0] = 1e4  # huge logit: no overflow
    ref = naive.softmax(x)
    for fn in (ops.softmax_rows, ops._softmax_seq, ops._softmax_par):
        y = x.copy()
        fn(y)
        assert np.all(np.isfinite(y))
        assert np.max(np.abs(y - ref)) < 1e-6
        np.testing.assert_allclose(y.sum(axis=1), 1.0, rtol=1e-5)


# ---------------------------------------------------------------- KV cache + attention

def _attn_case(T, H, Hkv, Dh, pos0, C=160, seed=0):
    """A cache holding pos0 earlier positions plus the batch's k, v (stored by store_kv)."""
    k_cache = np.zeros((C, Hkv, Dh), np.uint16)
    v_cache = np.zeros((C, Hkv, Dh), np.uint16)
    k_old, v_old = rnd(pos0, Hkv, Dh, seed=seed), rnd(pos0, Hkv, Dh, seed=seed + 1)
    att.store_kv(k_cache, v_cache, k_old, v_old, 0)
    q = rnd(T, H, Dh, seed=seed + 2, scale=2.0)
    k, v = rnd(T, Hkv, Dh, seed=seed + 3), rnd(T, Hkv, Dh, seed=seed + 4)
    att.store_kv(k_cache, v_cache, k, v, pos0)
    k_all = naive.f16_round(np.concatenate([k_old, k]))
    v_all = naive.f16_round(np.concatenate([v_old, v]))
    return q, k_cache, v_cache, k_all, v_all


def test_store_kv_rounds_to_nearest_f16():
    k = rnd(3, 2, 80, seed=5, scale=100.0)
    k[0, 0, :3] = [1e6, -1e-9, np.float32(1 + 2 ** -11)]  # overflow -> inf, tiny, a tie -> even
    kc, vc = np.zeros((9, 2, 80), np.uint16), np.zeros((9, 2, 80), np.uint16)
    att.store_kv(kc, vc, k, -k, 4)
    with np.errstate(over="ignore"):
        k16 = k.astype(np.float16)
    assert np.array_equal(kc[4:7], k16.view(np.uint16))
    assert np.array_equal(vc[4:7], (-k16).view(np.uint16))
    assert not kc[:4].any() and not kc[7:].any()


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("Hkv", [1, 2, 6])
@pytest.mark.parametrize("Dh", [16, 64, 72, 256])
@pytest.mark.parametrize("T", [1, 7, 40])
def test_attention(T, Dh, Hkv, window):
    """G = 6, 3, 1 query heads per kv head (decode pads to 8 and 4 rows); T = 40 is three query
    tiles, the last one partial, over two key tiles; Dh = 72 leaves a P @ V remainder."""
    H, pos0 = 6, 41
    q, kc, vc, k_all, v_all = _attn_case(T, H, Hkv, Dh, pos0, seed=T * Dh + Hkv)
    scale = 1.0 / np.sqrt(Dh)
    ref = naive.attention(q, k_all, v_all, pos0, scale, window)
    fns = [att.attention, att.plain_attention]      # plain: -fa off's batch kernel
    fns += [att._decode_seq, att._decode_split] if T == 1 else [flash.flash_seq, flash.flash_par]
    for fn in fns:
        out = np.full_like(q, np.nan)
        fn(out, q, kc, vc, pos0, scale, window, ops.EMPTY)
        assert max_rel(out, ref) < RTOL, fn
    out = q.copy()
    att.attention(out, out, kc, vc, pos0, scale, window)  # in place: out aliases q
    assert max_rel(out, ref) < RTOL
    out = q.copy()
    att.attention(out, out, kc, vc, pos0, scale, window, ops.EMPTY, False)   # -fa off, in place
    assert max_rel(out, ref) < RTOL


@pytest.mark.parametrize("T,window", [(1, 0), (1, 300), (40, 300)])
def test_attention_long_context(T, window):
    """Over ~1000 cached positions: T=1 splits the keys into several spans; T=40 visits 17
    key tiles, or with the window only the last 6 of them."""
    H, Hkv, Dh, pos0 = 6, 2, 64, 999
    q, kc, vc, k_all, v_all = _attn_case(T, H, Hkv, Dh, pos0, C=1040, seed=3)
    q *= 3  # peaked softmax, so the span and tile maxima differ
    ref = naive.attention(q, k_all, v_all, pos0, 0.125, window)
    fns = (att._decode_split, att._decode_seq) if T == 1 else (flash.flash_par, att.plain_attention)
    for fn in (att.attention,) + fns:
        out = np.empty_like(q)
        fn(out, q, kc, vc, pos0, 0.125, window, ops.EMPTY)
        assert max_rel(out, ref) < RTOL


@pytest.mark.parametrize("T", [7, 40])
def test_attention_values_narrower_than_keys(T):
    """MLA's expanded form: keys of 48, values of 32 (one kv head a query head), flash only."""
    H, Dk, Dv, pos0 = 4, 48, 32, 30
    q, kc, _, k_all, _ = _attn_case(T, H, H, Dk, pos0, seed=T)
    vc = np.zeros((160, H, Dv), np.uint16)
    v = rnd(pos0 + T, H, Dv, seed=T + 9)
    att.store_kv(vc, vc, v, v, 0)
    ref = naive.attention(q, k_all, naive.f16_round(v), pos0, 0.2, 0)
    for fn in (att.attention, flash.flash_seq, flash.flash_par):
        out = np.full((T, H, Dv), np.nan, np.float32)
        fn(out, q, kc, vc, pos0, 0.2, 0, ops.EMPTY)
        assert max_rel(out, ref) < RTOL, fn
    with pytest.raises(ValueError, match="flash"):
        att.attention(np.empty((T, H, Dv), np.float32), q, kc, vc, pos0, 0.2, 0, ops.EMPTY, False)


@pytest.mark.parametrize("ctype", ["f16", "q8_0"])
def test_mla_latents_and_expand(ctype):
    """cpu/mla.py: the latents of cache rows [latent R, k_pe Dr], and each head's key [kv's Dn
    columns, k_pe] and value (kv's next Dv) as f16, from a product's rows kv [n, H (Dn + Dv)]."""
    from nbmoe.cpu import mla
    from nbmoe.cpu.kv_rows import load_row, store_rows
    n, R, Dr, H, Dn, Dv = 9, 64, 32, 3, 16, 8
    rows = rnd(n, R + Dr, seed=1)
    cache = np.zeros((12, 1, R + Dr) if ctype == "f16" else (12, 1, (R + Dr) // 32 * 34),
                     np.uint16 if ctype == "f16" else np.uint8)
    store_rows(cache[:n, 0], rows)
    stored = np.empty_like(rows)
    for j in range(n):
        load_row(stored[j], cache[j, 0])
    lat = np.empty((n, R), np.float32)
    mla.latents(lat, cache[:n], R + Dr)
    assert np.array_equal(lat, stored[:, :R])
    kv = rnd(n, H * (Dn + Dv), seed=2)
    keys, values = np.empty((n, H, Dn + Dr), np.uint16), np.empty((n, H, Dv), np.uint16)
    mla.expand(keys, values, kv, cache[:n], R + Dr)
    heads = kv.reshape(n, H, Dn + Dv)
    want_k = np.concatenate([heads[:, :, :Dn], np.repeat(stored[:, None, R:], H, 1)], -1)
    assert np.array_equal(keys.view(np.float16), want_k.astype(np.float16))
    assert np.array_equal(values.view(np.float16), heads[:, :, Dn:].astype(np.float16))
    # rows from `first` (a batch's own rows after the tokens cached before it)
    first, m = 3, 4
    lat2 = np.empty((m, R), np.float32)
    mla.latents(lat2, cache, R + Dr, first)
    assert np.array_equal(lat2, stored[first:first + m, :R])
    keys2, values2 = np.zeros((12, H, Dn + Dr), np.uint16), np.zeros((12, H, Dv), np.uint16)
    mla.expand(keys2, values2, kv[first:first + m], cache, R + Dr, first)
    assert np.array_equal(keys2[first:first + m], keys[first:first + m]) and not keys2[:first].any()
    assert np.array_equal(values2[first:first + m], values[first:first + m]) and not values2[first + m:].any()


def test_cache_overflow_raises():
    kc = np.zeros((8, 2, 16), np.uint16)
    k = np.zeros((3, 2, 16), np.float32)
    with pytest.raises(ValueError):
        att.store_kv(kc, kc, k, k, 6)
    with pytest.raises(ValueError):
        q = np.zeros((3, 4, 16), np.float32)
        att.attention(np.empty_like(q), q, kc, kc, 6, 0.25)


def test_attention_first_token_is_v():
    """At position 0 a token sees only itself: out = v (as stored in f16)."""
    q, kc, vc, k_all, v_all = _attn_case(1, 4, 2, 16, 0, C=4)
    out = np.empty_like(q)
    att.attention(out, q, kc, vc, 0, 0.25)
    assert np.array_equal(out[0], np.repeat(v_all[0], 2, axis=0).astype(np.float32))


# ---------------------------------------------------------------- MoE routing and combine

def test_topk_route_by_hand():
    """A router that prefers experts 0 and 2: logits [2, 0, 2 - ln 3, -1] for token 0."""
    logits = np.array([[2.0, 0.0, 2.0 - np.log(3.0), -1.0],
                       [0.0, 5.0, 0.0, 5.0]], np.float32)   # token 1: ties at 5 and at 0
    ids = np.empty((2, 2), np.int32)
    w = np.empty((2, 2), np.float32)
    moe.topk_route(ids, w, logits, True)
    assert ids.tolist() == [[0, 2], [1, 3]]
    # token 0: probs of experts 0 and 2 are in ratio 3 : 1 -> renormalised 0.75, 0.25
    np.testing.assert_allclose(w, [[0.75, 0.25], [0.5, 0.5]], rtol=1e-6)
    moe.topk_route(ids, w, logits, False)
    p0 = np.exp(logits[0].astype(np.float64)) / np.exp(logits[0].astype(np.float64)).sum()
    np.testing.assert_allclose(w[0], p0[[0, 2]], rtol=1e-6)
    ids3 = np.empty((2, 3), np.int32)
    w3 = np.empty((2, 3), np.float32)
    moe.topk_route(ids3, w3, logits, False)
    assert ids3.tolist() == [[0, 2, 1], [1, 3, 0]]  # ties -> lower index first


@pytest.mark.parametrize("gating", [0, 1, 2])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("T,E,A", [(1, 8, 2), (5, 67, 6), (70, 128, 8)])
def test_topk_route(T, E, A, norm, gating):
    logits = rnd(T, E, seed=E + A, scale=3.0)
    ref_ids, ref_w = naive.topk_route(logits, A, norm, gating)
    for fn in (moe.topk_route, moe._plain_seq, moe._plain_par, moe._biased_seq, moe._biased_par):
        ids = np.empty((T, A), np.int32)
        w = np.empty((T, A), np.float32)
        args = (ids, w, logits, norm, gating, 1.0)
        fn(*args) if "plain" in fn.__name__ else fn(*args, ops.EMPTY, 0, 0)   # both paths
        assert np.array_equal(ids, ref_ids)
        assert max_rel(w, ref_w) < RTOL


@pytest.mark.parametrize("gating", [0, 1, 2])
def test_topk_route_large_logits(gating):
    logits = np.array([[1e4, -1e4, 9990.0, 0.0, -np.inf, 1e4 - 1]], np.float32)
    ids = np.empty((1, 3), np.int32)
    w = np.empty((1, 3), np.float32)
    moe.topk_route(ids, w, logits, True, gating)
    assert ids.tolist() == [[0, 5, 2]]
    assert np.all(np.isfinite(w))
    _, ref_w = naive.topk_route(logits, 3, True, gating)
    np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-30)


def test_topk_route_nan_ranks_last():
    logits = np.array([[np.nan, 1.0, np.nan, 2.0]], np.float32)
    ids = np.empty((1, 2), np.int32)
    w = np.empty((1, 2), np.float32)
    moe.topk_route(ids, w, logits, True, 1)
    assert ids.tolist() == [[3, 1]]


def test_moe_block_by_hand():
    """Identity experts scaled by e + 1, a router preferring experts 0 and 2 3:1 -> out = 1.5 x."""
    x = rnd(1, 7, seed=4)
    logits = np.array([[2.0, 0.0, 2.0 - np.log(3.0), -1.0]], np.float32)
    ids = np.empty((1, 2), np.int32)
    w = np.empty((1, 2), np.float32)
    moe.topk_route(ids, w, logits, True)
    y = np.stack([x[0] * (e + 1) for e in ids[0]])[None]  # [T, A, D]
    out = np.empty_like(x)
    moe.moe_combine(out, y, w)
    np.testing.assert_allclose(out, 1.5 * x, rtol=1e-6)  # 0.75 * 1 + 0.25 * 3


@pytest.mark.parametrize("T,A,D", [(1, 2, 67), (5, 6, 67), (33, 8, 300)])
def test_moe_combine(T, A, D):
    y, w = rnd(T, A, D, seed=T), rnd(T, A, seed=T + 1)
    ref = naive.moe_combine(y, w)
    for fn in (moe.moe_combine, moe._combine_seq, moe._combine_par):
        out = np.empty((T, D), np.float32)
        fn(out, y, w)
        assert max_rel(out, ref) < RTOL


@pytest.mark.parametrize("T", [1, 37])
def test_sum_pairs(T):
    """--ep's partial sums: each token's pairs (0 to 3 of them, in token order) summed; rows
    of tokens without pairs are left as they were."""
    rng = np.random.default_rng(T)
    counts = rng.integers(0, 4, T)
    counts[0] = 2
    tok = np.repeat(np.arange(T), counts)                    # [P] the token of each pair
    y = rng.standard_normal((tok.shape[0], 48)).astype(np.float32)
    have = np.flatnonzero(counts)
    ref = np.full((T, 48), 7.0)
    for t in have:
        ref[t] = y[tok == t].astype(np.float64).sum(0)
    starts = np.append(np.searchsorted(tok, have), tok.shape[0])
    for fn in (moe.sum_pairs, moe._sum_pairs_seq, moe._sum_pairs_par):
        out = np.full((T, 48), 7.0, np.float32)
        fn(out, y, have, starts)
        assert max_rel(out, ref) < RTOL


# ---------------------------------------------------------------- column windows of heads

def test_windows_of_heads():
    """MLA's head parts (cpu/windows.py): rms_norm of a window of each head in place, rope of
    one window into another buffer's, a per-head product from a window into a window (F32
    weights); every column outside the windows untouched."""
    from nbmoe.cpu import matmul
    T, H, W, n = 3, 2, 40, 16
    kv, wn = rnd(T, 1, W, seed=1, scale=2.0), rnd(24, seed=2)
    row = kv.copy()
    ops.rms_norm_rows(row.reshape(T, W)[:, 4:28], row.reshape(T, W)[:, 4:28], wn, 1e-6)
    assert max_rel(row[:, :, 4:28], naive.rms_norm(kv[:, :, 4:28], wn, 1e-6)) < RTOL
    assert np.array_equal(row[:, :, :4], kv[:, :, :4]) and np.array_equal(row[:, :, 28:], kv[:, :, 28:])
    q, out = rnd(T, H, W, seed=3), rnd(T, H, W, seed=4)
    pos = np.array([0, 7, 4000], np.int32)
    got = out.copy()
    ops.rope_into(got[:, :, 20:20 + n], q[:, :, 24:24 + n], pos, ops.rope_freqs(n, 10000.0), 1.0, True)
    assert max_rel(got[:, :, 20:20 + n], naive.rope(q[:, :, 24:24 + n], pos, n, 10000.0, True)) < RTOL
    assert np.array_equal(np.delete(got, np.s_[20:20 + n], 2), np.delete(out, np.s_[20:20 + n], 2))
    M, K = 9, 24
    w = rnd(H, M, K, seed=5)
    ids = np.tile(np.arange(H, dtype=np.int32), (T, 1))
    got = out.copy()
    matmul.mul_mat_heads(got[:, :, 3:3 + M], w.view(np.uint8), q[:, :, 8:8 + K], ids, 0)   # 0: F32
    ref = np.einsum("hmk,thk->thm", w.astype(np.float64), q[:, :, 8:8 + K].astype(np.float64))
    assert max_rel(got[:, :, 3:3 + M], ref) < RTOL
    assert np.array_equal(np.delete(got, np.s_[3:3 + M], 2), np.delete(out, np.s_[3:3 + M], 2))
