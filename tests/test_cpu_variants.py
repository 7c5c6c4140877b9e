"""CPU kernels of the architecture variants (gpt-oss, DeepSeek/GLM) vs the float64 references in
tests/naive.py: attention sinks, swiglu_oai, the general top-k routing, the bias and gate row
ops, and the fused GLU products and blocks with ACT_SWIGLU_OAI. Both drivers of each op run
directly (single-threaded and prange) whatever the size thresholds say.
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import naive
from naive import max_rel, rnd
from nbmoe.cpu import attention as att
from nbmoe.cpu import attention_flash as flash
from nbmoe.cpu import blocks, fused, matmul, moe, ops
from nbmoe.model.arch import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT

RTOL = 1e-5




def readonly(a):
    """As a GGUF's mmap'd vectors are (their Numba type)."""
    a = np.ascontiguousarray(a)
    a.flags.writeable = False
    return a


# ---------------------------------------------------------------- attention sinks

def _attn_case(T, H, Hkv, Dh, pos0, C, seed):
    kc, vc = np.zeros((C, Hkv, Dh), np.uint16), np.zeros((C, Hkv, Dh), np.uint16)
    k, v = rnd(pos0 + T, Hkv, Dh, seed=seed), rnd(pos0 + T, Hkv, Dh, seed=seed + 1)
    att.store_kv(kc, vc, k, v, 0)
    q = rnd(T, H, Dh, seed=seed + 2, scale=2.0)
    return q, kc, vc, naive.f16_round(k), naive.f16_round(v)


def _sinks(H, seed):
    """Around the scores' range: some heads' sink dominates, some barely counts."""
    s = rnd(H, seed=seed, scale=3.0)
    s[0], s[-1] = 30.0, -30.0
    return readonly(s)


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("Hkv", [1, 2])
@pytest.mark.parametrize("T", [1, 7, 40])
def test_attention_sinks(T, Hkv, window):
    H, Dh, pos0 = 6, 72, 41
    q, kc, vc, k_all, v_all = _attn_case(T, H, Hkv, Dh, pos0, 128, seed=T + Hkv)
    sinks = _sinks(H, seed=T)
    ref = naive.attention(q, k_all, v_all, pos0, 0.125, window, sinks)
    fns = [att._decode_seq, att._decode_split] if T == 1 else [flash.flash_seq, flash.flash_par]
    for fn in fns + [att.plain_attention]:
        out = np.full_like(q, np.nan)
        fn(out, q, kc, vc, pos0, 0.125, window, sinks)
        assert max_rel(out, ref) < RTOL, fn
    out = q.copy()
    att.attention(out, out, kc, vc, pos0, 0.125, window, sinks)    # out aliases q
    assert max_rel(out, ref) < RTOL
    plain = np.empty_like(q)                                       # a sink only shrinks rows
    att.attention(plain, q, kc, vc, pos0, 0.125, window)
    assert max_rel(plain, naive.attention(q, k_all, v_all, pos0, 0.125, window)) < RTOL
    assert not np.allclose(plain, out)


@pytest.mark.parametrize("T,window", [(1, 0), (1, 300), (40, 0), (40, 300)])
def test_attention_sinks_long_context(T, window):
    """~1000 keys: T = 1 merges several spans (the sink joins once, after the merge); T = 40
    visits many key tiles."""
    H, Hkv, Dh, pos0 = 6, 2, 64, 999
    q, kc, vc, k_all, v_all = _attn_case(T, H, Hkv, Dh, pos0, 1040, seed=5)
    q *= 3
    sinks = _sinks(H, seed=6)
    ref = naive.attention(q, k_all, v_all, pos0, 0.125, window, sinks)
    if T == 1 and window == 0:      # attention() itself takes the split path
        assert (pos0 + 1) * H * Dh >= att.SPLIT_MIN_WORK
    fns = (att._decode_split, att._decode_seq) if T == 1 else (flash.flash_par, flash.flash_seq)
    for fn in (att.attention,) + fns:
        out = np.empty_like(q)
        fn(out, q, kc, vc, pos0, 0.125, window, sinks)
        assert max_rel(out, ref) < RTOL, fn


def test_attention_sink_by_hand():
    """Position 0 sees one key: out = v * e^s / (e^s + e^sink); the sink is not scaled."""
    q, kc, vc, k_all, v_all = _attn_case(1, 2, 1, 16, 0, 4, seed=9)
    sinks = readonly(np.array([0.5, -2.0], np.float32))
    out = np.empty_like(q)
    att.attention(out, q, kc, vc, 0, 0.25, 0, sinks)
    s = 0.25 * (q[0].astype(np.float64) @ k_all[0, 0])              # [H]
    want = v_all[0, 0][None] * (np.exp(s) / (np.exp(s) + np.exp(sinks.astype(np.float64))))[:, None]
    np.testing.assert_allclose(out[0], want, rtol=1e-5, atol=1e-7)


def test_attention_sinks_wrong_size():
    q, kc, vc, _, _ = _attn_case(1, 4, 2, 16, 3, 8, seed=1)
    with pytest.raises(ValueError):
        att.attention(np.empty_like(q), q, kc, vc, 3, 0.25, 0, np.zeros(3, np.float32))


# ---------------------------------------------------------------- swiglu_oai

def test_swiglu_oai_constants():
    assert (ops._OAI_A, ops._OAI_L) == (np.float32(SWIGLU_OAI_ALPHA), np.float32(SWIGLU_OAI_LIMIT))
    assert (SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT) == (1.702, 7.0)


@pytest.mark.parametrize("N", [1, 5, 132])
def test_swiglu_oai(N):
    F = 301
    gate, up = rnd(N, F, seed=N, scale=6.0), rnd(N, F, seed=N + 1, scale=6.0)   # many beyond +-7
    gate[0, :8] = [-100.0, 100.0, 7.5, -7.5, 1e4, -1e4, 7.0, 6.99]
    up[0, :8] = [100.0, -100.0, -7.5, 7.5, 8.0, -8.0, 1e4, -1e4]
    ref = naive.swiglu_oai(gate, up)
    for fn in (ops.swiglu_oai, ops._swiglu_oai_seq, ops._swiglu_oai_par):
        out = np.full_like(gate, np.nan)
        fn(out, gate, up)
        assert np.all(np.isfinite(out))
        assert max_rel(out, ref) < RTOL
        g, u = gate.copy(), up.copy()      # in place, out = gate or out = up
        fn(g, g, up)
        fn(u, gate, u)
        assert max_rel(g, ref) < RTOL and max_rel(u, ref) < RTOL
    gu = np.concatenate([gate, up], axis=1)   # strided halves of a fused output
    out = np.empty_like(gate)
    ops.swiglu_oai(out, gu[:, :F], gu[:, F:])
    assert max_rel(out, ref) < RTOL


def test_swiglu_oai_by_hand():
    """gate 10 -> 7, up 10 -> 7: 7 * sigmoid(1.702 * 7) * 8; gate -10, up -10 -> -10 * s * -6."""
    gate = np.array([[10.0, -10.0, 1.0]], np.float32)
    up = np.array([[10.0, -10.0, 0.5]], np.float32)
    out = np.empty_like(gate)
    ops.swiglu_oai(out, gate, up)
    sig = lambda z: 1.0 / (1.0 + np.exp(-z))       # noqa: E731
    want = [7 * sig(1.702 * 7) * 8, -10 * sig(-17.02) * -6, 1 * sig(1.702) * 1.5]
    np.testing.assert_allclose(out[0], want, rtol=1e-6)


# ---------------------------------------------------------------- topk_route

def _route(fn, logits, A, norm, gating, scale, bias, n_group, topk_group):
    ids = np.full((logits.shape[0], A), -1, np.int32)
    w = np.full((logits.shape[0], A), np.nan, np.float32)
    fn(ids, w, logits, norm, gating, scale, ops.EMPTY if bias is None else bias, n_group, topk_group)
    return ids, w


@pytest.mark.parametrize("gating", [0, 1, 2])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("groups", [(0, 0), (8, 3)])
@pytest.mark.parametrize("T", [1, 70])
def test_topk_route_variants(T, groups, bias, norm, gating):
    E, A = 64, 6
    logits = rnd(T, E, seed=T + gating, scale=2.0)
    b = readonly(rnd(E, seed=3, scale=0.5)) if bias else None
    scale = 2.5
    ref_ids, ref_w = naive.topk_route(logits, A, norm, gating, scale, b, *groups)
    for fn in (moe.topk_route, moe._biased_seq, moe._biased_par):
        ids, w = _route(fn, logits, A, norm, gating, scale, b, *groups)
        assert np.array_equal(ids, ref_ids), fn
        assert max_rel(w, ref_w) < RTOL, fn
    if not bias and groups[0] == 0:       # the plain path too
        for fn in (moe._plain_seq, moe._plain_par):
            ids, w = np.empty((T, A), np.int32), np.empty((T, A), np.float32)
            fn(ids, w, logits, norm, gating, scale)
            assert np.array_equal(ids, ref_ids) and max_rel(w, ref_w) < RTOL, fn


def test_topk_route_defaults_are_the_plain_softmax():
    logits = rnd(3, 16, seed=2, scale=2.0)
    ids, w = np.empty((3, 4), np.int32), np.empty((3, 4), np.float32)
    moe.topk_route(ids, w, logits, True)
    ref_ids, ref_w = naive.topk_route(logits, 4, True)
    assert np.array_equal(ids, ref_ids) and max_rel(w, ref_w) < RTOL


def test_topk_route_groups_by_hand():
    """Groups score their two best experts: groups 2 (0.6 + 0.45) and 1 (0.5 + 0.5) beat
    group 0 (0.9 + 0), whose best expert is the best of all; then 0.6, and the tie at 0.5 goes
    to expert 2. Gating 2 scores the logits themselves."""
    logits = np.array([[0.9, 0.0, 0.5, 0.5, 0.6, 0.45, 0.1, 0.1]], np.float32)
    ids, w = _route(moe.topk_route, logits, 2, False, 2, 1.0, None, 4, 2)
    assert ids.tolist() == [[4, 2]]
    np.testing.assert_allclose(w[0], naive.softmax(np.array([0.6, 0.5])), rtol=1e-6)
    ids, _ = _route(moe.topk_route, logits, 2, False, 2, 1.0, None, 0, 0)       # no groups
    assert ids.tolist() == [[0, 4]]


def test_topk_route_bias_chooses_but_does_not_weigh():
    """The bias moves expert 3 into the top 2; its weight is still its sigmoid."""
    logits = np.array([[2.0, 1.0, 0.0, -1.0]], np.float32)
    bias = readonly(np.array([0.0, 0.0, 0.0, 1.0], np.float32))
    ids, w = _route(moe.topk_route, logits, 2, False, 1, 2.0, bias, 0, 0)
    assert ids.tolist() == [[3, 0]]
    sig = 1.0 / (1.0 + np.exp(-np.array([-1.0, 2.0])))
    np.testing.assert_allclose(w[0], 2.0 * sig, rtol=1e-6)
    ids, w = _route(moe.topk_route, logits, 2, True, 1, 2.0, bias, 0, 0)       # norm, then scale
    np.testing.assert_allclose(w[0], 2.0 * sig / sig.sum(), rtol=1e-6)


def test_topk_route_norm_floor():
    """Tiny sigmoid weights: the sum is clamped at 2^-14 (as llama.cpp), not divided out."""
    logits = np.array([[-20.0, -21.0, -30.0]], np.float32)
    ids, w = _route(moe.topk_route, logits, 2, True, 1, 1.0, None, 0, 0)
    sig = 1.0 / (1.0 + np.exp(20.0 + np.array([0.0, 1.0])))
    np.testing.assert_allclose(w[0], sig / 2.0 ** -14, rtol=1e-5)


def test_route_from_njit():
    """moe.route with a constant `plain` (as moe_block's) links one path; a bias on the plain
    path is refused."""
    from numba import njit

    @njit
    def plain(ids, w, logits, bias):
        moe.route(True, ids, w, logits, True, 0, 1.0, bias, 0, 0)

    logits = rnd(2, 16, seed=4)
    ids, w = np.empty((2, 3), np.int32), np.empty((2, 3), np.float32)
    plain(ids, w, logits, ops.EMPTY)
    ref_ids, ref_w = naive.topk_route(logits, 3, True)
    assert np.array_equal(ids, ref_ids) and max_rel(w, ref_w) < RTOL
    with pytest.raises(ValueError):
        plain(ids, w, logits, readonly(np.zeros(16, np.float32)))


def test_topk_route_bad_groups_raise():
    logits = rnd(1, 12, seed=1)
    for n_group, topk_group, A in [(5, 2, 2), (4, 0, 2), (4, 5, 2), (4, 1, 4)]:
        with pytest.raises(ValueError):
            _route(moe.topk_route, logits, A, True, 1, 1.0, None, n_group, topk_group)
    with pytest.raises(ValueError):
        _route(moe.topk_route, logits, 2, True, 1, 1.0, readonly(np.zeros(5, np.float32)), 0, 0)


# ---------------------------------------------------------------- add_bias, add_bias_id, sigmoid_mul

@pytest.mark.parametrize("T", [1, 5, 70])
def test_add_bias(T):
    M = 301
    x, b = rnd(T, M, seed=T), rnd(M, seed=99)
    ref = x + b                          # float32 sums, one rounding each: exact
    for fn in (ops.add_bias, ops._add_bias_seq, ops._add_bias_par):
        out = np.full_like(x, np.nan)
        fn(out, x, b)
        assert np.array_equal(out, ref)
        y = x.copy()
        fn(y, y, b)                      # in place
        assert np.array_equal(y, ref)


@pytest.mark.parametrize("T", [1, 5, 70])
def test_add_bias_id(T):
    E, A, M = 8, 3, 67
    x, b = rnd(T, A, M, seed=T), rnd(E, M, seed=7)
    ids = np.random.default_rng(T).integers(0, E, (T, A)).astype(np.int32)
    ref = x + b[ids]
    for fn in (ops.add_bias_id, ops._add_bias_id_seq, ops._add_bias_id_par):
        out = np.full_like(x, np.nan)
        fn(out, x, b, ids)
        assert np.array_equal(out, ref)
        y = x.copy()
        fn(y, y, b, ids)
        assert np.array_equal(y, ref)
    bad = ids.copy()
    bad[-1, -1] = E
    with pytest.raises(ValueError):
        ops.add_bias_id(np.empty_like(x), x, b, bad)


@pytest.mark.parametrize("T", [1, 5, 70])
def test_sigmoid_mul(T):
    M = 301
    x, g = rnd(T, M, seed=T), rnd(T, 1, seed=T + 1, scale=4.0)
    g[0, 0] = -100.0                      # sigmoid ~ 0
    ref = x.astype(np.float64) / (1.0 + np.exp(-g.astype(np.float64)))
    for fn in (ops.sigmoid_mul, ops._sigmoid_mul_seq, ops._sigmoid_mul_par):
        out = np.full_like(x, np.nan)
        fn(out, x, g)
        assert max_rel(out, ref) < RTOL
        y = x.copy()
        fn(y, y, g)
        assert max_rel(y, ref) < RTOL


# ---------------------------------------------------------------- fused GLU and blocks, swiglu_oai
# F32 weights (decoded exactly): the fused kernels vs the unfused nodes (mul_mat, the GLU op,
# topk_route, moe_combine) and vs float64.

QT = int(Q.F32)


def _w(*shape, seed):
    return readonly(rnd(*shape, seed=seed, scale=0.5).view(np.uint8).reshape(shape[:-1] + (-1,)))


def _f(w):
    return w.view(np.float32).astype(np.float64)


@pytest.mark.parametrize("T", [1, 3])
def test_fused_glu_swiglu_oai(T):
    F, D = 37, 64
    wg, wu, x = _w(F, D, seed=1), _w(F, D, seed=2), rnd(T, D, seed=3, scale=4.0)
    ref = naive.swiglu_oai(x @ _f(wg).T, x @ _f(wu).T)
    assert np.abs(x @ _f(wg).T).max() > 7                      # the clamp is reached
    g, u = np.empty((T, F), np.float32), np.empty((T, F), np.float32)
    matmul.mul_mat(g, wg, x, QT)
    matmul.mul_mat(u, wu, x, QT)
    ops.swiglu_oai(g, g, u)                                     # the unfused nodes
    out = np.full((T, F), np.nan, np.float32)
    step = matmul.item_rows(F, 2 * wg.shape[1], T, QT)
    fused.glu(out, wg, wu, x, QT, matmul._int8(QT), step, fused.ACT_SWIGLU_OAI)
    assert max_rel(out, ref) < RTOL
    assert max_rel(out, g) < 1e-6


@pytest.mark.parametrize("T,biased", [(1, False), (3, False), (3, True)])
def test_fused_glu_id_swiglu_oai(T, biased):
    """biased: gpt-oss's gate and up bias rows of the chosen experts, added before the GLU;
    then the down product with its bias and the weighted sum (down_combine)."""
    E, A, F, D = 5, 2, 37, 64
    wg, wu, x = _w(E, F, D, seed=4), _w(E, F, D, seed=5), rnd(T, 1, D, seed=6, scale=4.0)
    bg, bu = (readonly(rnd(E, F, seed=s, scale=2.0)) if biased else None for s in (7, 8))
    ids = np.array([[0, 3], [4, 0], [2, 1]][:T], np.int32)
    gf = np.einsum("tafd,td->taf", _f(wg)[ids], x[:, 0])             # [T, A, F]
    uf = np.einsum("tafd,td->taf", _f(wu)[ids], x[:, 0])
    if biased:
        gf, uf = gf + bg[ids], uf + bu[ids]
    ref = naive.swiglu_oai(gf, uf)
    g, u = np.empty((T, A, F), np.float32), np.empty((T, A, F), np.float32)
    matmul.mul_mat_id(g, wg, x, ids, QT)
    matmul.mul_mat_id(u, wu, x, ids, QT)
    if biased:                                                      # the unfused nodes
        ops.add_bias_id(g, g, bg, ids)
        ops.add_bias_id(u, u, bu, ids)
    ops.swiglu_oai(g.reshape(T * A, F), g.reshape(T * A, F), u.reshape(T * A, F))
    out = np.full((T, A, F), np.nan, np.float32)
    step = matmul.expert_item_rows(F, wg.shape[2], T, QT)
    fused.glu_id(out, wg, wu, x, ids, QT, matmul._int8(QT), step, fused.ACT_SWIGLU_OAI, bg, bu)
    assert max_rel(out, ref) < RTOL
    assert max_rel(out, g) < 1e-6
    if not biased:
        return
    wd, bd = _w(E, D, F, seed=9), readonly(rnd(E, D, seed=10))
    wts = rnd(T, A, seed=11)
    y = np.einsum("tadf,taf->tad", _f(wd)[ids], ref) + bd[ids]        # [T, A, D]
    want = np.einsum("ta,tad->td", wts, y)
    got = np.full((T, D), np.nan, np.float32)
    fused.down_combine(got, wd, out, ids, wts, fused.expert_bias(bd, E, D), QT, matmul._int8(QT),
                       matmul.expert_item_rows(D, A * wd.shape[2], T, QT), 2)
    assert max_rel(got, want) < RTOL
    yd, plain = np.empty((T, A, D), np.float32), np.empty((T, D), np.float32)
    matmul.mul_mat_id(yd, wd, out, ids, QT)
    ops.add_bias_id(yd, yd, bd, ids)
    moe.moe_combine(plain, yd, wts)
    assert np.array_equal(got, plain)


NO_NORM = readonly(np.zeros(0, np.float32))


def test_ffn_block_swiglu_oai():
    D, F, eps = 64, 37, 1e-5
    wg, wu, wd = _w(F, D, seed=7), _w(F, D, seed=8), _w(D, F, seed=9)
    nw = readonly(rnd(D, seed=10) + 2.0)
    x0 = rnd(1, D, seed=11, scale=2.0)
    h = naive.rms_norm(x0, nw, eps)
    ref = x0 + naive.swiglu_oai(h @ _f(wg).T, h @ _f(wu).T) @ _f(wd).T
    x, hb, g, f = x0.copy(), np.empty((1, D), np.float32), np.empty((1, F), np.float32), np.empty((1, D), np.float32)
    steps = (matmul.item_rows(F, 2 * wg.shape[1], 1, QT), matmul.item_rows(D, wd.shape[1], 1, QT))
    i8 = matmul._int8(QT)
    blocks.ffn_block(x, hb, g, f, eps, (nw, NO_NORM), wg, wu, wd, (QT, QT), (i8, i8), steps,
                     fused.ACT_SWIGLU_OAI)
    assert max_rel(x, ref) < RTOL


@pytest.mark.parametrize("gating,bias,groups,biased", [(0, False, (0, 0), False), (2, False, (0, 0), False),
                                                       (1, True, (4, 2), False), (2, False, (0, 0), True)])
def test_moe_block_routing_and_swiglu_oai(gating, bias, groups, biased):
    """The block's experts vs the unfused nodes: router product, topk_route with the variant's
    arguments, glu_id, down products and moe_combine. biased: gpt-oss's router, gate, up and
    down biases (blocks.moe_biases)."""
    D, F, E, A, eps = 64, 37, 8, 2, 1e-5
    wr, wg, wu, wd = _w(E, D, seed=12), _w(E, F, D, seed=13), _w(E, F, D, seed=14), _w(E, D, F, seed=15)
    nw = readonly(rnd(D, seed=16) + 2.0)
    b = readonly(rnd(E, seed=17, scale=0.3)) if bias else ops.EMPTY
    br, bg, bu, bd = (rnd(*shape, seed=19 + i) * biased for i, shape in enumerate(((E,), (E, F), (E, F), (E, D))))
    x0 = rnd(1, D, seed=18, scale=2.0)
    h = naive.rms_norm(x0, nw, eps)
    logits = (h @ _f(wr).T + br).astype(np.float32)
    ids_ref, w_ref = naive.topk_route(logits, A, True, gating, 1.5, b if bias else None, *groups)
    y = np.stack([naive.swiglu_oai(h[0] @ _f(wg)[e].T + bg[e], h[0] @ _f(wu)[e].T + bu[e]) @ _f(wd)[e].T
                  + bd[e] for e in ids_ref[0]])
    ref = x0 + (w_ref[0] @ y)[None]
    x = x0.copy()
    hb, logits, f = np.empty((1, D), np.float32), np.empty((1, E), np.float32), np.empty((1, D), np.float32)
    ids, wts, g = np.empty((1, A), np.int32), np.empty((1, A), np.float32), np.empty((1, A, F), np.float32)
    steps = (matmul.item_rows(E, wr.shape[1], 1, QT), matmul.expert_item_rows(F, wg.shape[2], 1, QT),
             matmul.expert_item_rows(D, A * wd.shape[2], 1, QT))
    i8 = matmul._int8(QT)
    biases = blocks.moe_biases(wg, wu, wd, *((br, bg, bu, bd) if biased else ()))
    blocks.moe_block(x, hb, logits, ids, wts, g, f, eps, (nw, NO_NORM), wr, wg, wu, wd, (QT, QT, QT),
                     (i8, i8, i8), steps, fused.ACT_SWIGLU_OAI, True, 2, gating, 1.5, b, *groups,
                     biases=biases)
    assert np.array_equal(ids, ids_ref)
    assert max_rel(x, ref) < RTOL


def test_attn_block_sinks():
    """The block (norm, q/k/v, rope, store, attention with sinks, o, add) vs its nodes unfused."""
    D, H, Hkv, Dh, C, eps, pos0 = 64, 4, 2, 16, 8, 1e-5, 3
    wq, wk, wv, wo = _w(H * Dh, D, seed=20), _w(Hkv * Dh, D, seed=21), _w(Hkv * Dh, D, seed=22), _w(D, H * Dh, seed=23)
    nw = readonly(rnd(D, seed=24) + 2.0)
    sinks = _sinks(H, seed=25)
    x0 = rnd(1, D, seed=26)
    kc0, vc0 = np.zeros((C, Hkv, Dh), np.uint16), np.zeros((C, Hkv, Dh), np.uint16)
    att.store_kv(kc0, vc0, rnd(pos0, Hkv, Dh, seed=27), rnd(pos0, Hkv, Dh, seed=28), 0)
    pos, scale, rope_p = np.array([pos0], np.int32), 0.25, (ops.rope_freqs(Dh, 10000.0), 1.0)
    # unfused
    h = np.empty((1, D), np.float32)
    ops.rms_norm(h, x0, nw, eps)
    q, k, v = (np.empty((1, n * Dh), np.float32) for n in (H, Hkv, Hkv))
    for out, w in ((q, wq), (k, wk), (v, wv)):
        matmul.mul_mat(out, w, h, QT)
    q, k, v = q.reshape(1, H, Dh), k.reshape(1, Hkv, Dh), v.reshape(1, Hkv, Dh)
    ops.rope(q, pos, rope_p[0], 1.0, True)
    ops.rope(k, pos, rope_p[0], 1.0, True)
    kc, vc = kc0.copy(), vc0.copy()
    att.store_kv(kc, vc, k, v, pos0)
    a = np.empty_like(q)
    att.attention(a, q, kc, vc, pos0, scale, 0, sinks)
    o = np.empty((1, D), np.float32)
    matmul.mul_mat(o, wo, a.reshape(1, H * Dh), QT)
    want = x0 + o
    # the block
    x, kb, vb = x0.copy(), kc0.copy(), vc0.copy()
    bufs = [np.empty(s, np.float32) for s in ((1, D), (1, H, Dh), (1, Hkv, Dh), (1, Hkv, Dh), (1, H, Dh), (1, D))]
    rows = np.array([H * Dh, Hkv * Dh, Hkv * Dh], np.int64)
    i8 = matmul._int8(QT)
    steps = (matmul.item_rows(rows.sum(), wq.shape[1], 1, QT),) * 3 + (matmul.item_rows(D, wo.shape[1], 1, QT),)
    blocks.attn_block(x, *bufs, pos, pos0, eps, (nw, NO_NORM, NO_NORM, NO_NORM), (matmul.NO_BIAS,) * 4, wq, wk, wv, wo,
                      (QT,) * 4, (i8,) * 4, steps, rows, rope_p, True, kb, vb, scale, 0, sinks)
    assert max_rel(x, want) < 1e-6
    assert np.array_equal(kb, kc)
