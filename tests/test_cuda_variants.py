"""CUDA kernels of the model variants (issue 27: gpt-oss, DeepSeek, GLM): attention sinks (decode
split and not, flash, rope_attention), gpt-oss's clamped SwiGLU (ops and the fused GLU kernels),
routing variants (gating, selection bias, expert groups, scale; topk_route and norm_route),
and the bias ops; against float64 references, under the simulator as test_cuda_kernels.py.

Letters: T tokens, H / Hkv heads, Dh head dim, E experts, A chosen, M row width.
"""
from cuda_common import _simulator_speed, small  # noqa: F401  (fixtures; first: selects the simulator)
from cuda_common import Q, att, attn_case, check, dev, poisoned, quantize, rnd, x_rounded  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from numba import cuda  # noqa: E402

import naive  # noqa: E402
from nbmoe.cuda import empty, flash, fused, matmul, moe, norm_rope, ops  # noqa: E402
from nbmoe.cuda.x8 import quantize_x, x8_buffers  # noqa: E402
from nbmoe.cpu.ops import rope_freqs  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

RTOL_F16 = 4e-3    # flash: f16 q and P vs the float64 reference


# ---------------------------------------------------------------- attention sinks

SINKS = np.array([0.5, 30.0, -1.0, -np.inf], np.float32)  # 30: the sink outweighs every key


@pytest.mark.parametrize("window,pos0,keys", [(0, 20, 4), (9, 20, 4), (0, 2, 4), (0, 15, 0)])
def test_attention_sinks_split(window, pos0, keys, small, monkeypatch):
    """T = 1 on a 24-slot cache, six key splits in the grid: merged (pos0 = 20, window 9: two in
    use; keys = 0: all six, some empty), or one split in use that writes out itself (pos0 = 2).
    The sink must count once, not once a split."""
    monkeypatch.setattr(att, "SPLIT_KEYS", 4)
    monkeypatch.setattr(att, "MIN_SPLIT_KEYS", keys)
    H, Hkv, Dh = 4, 2, 32
    q, kc, vc, k_all, v_all = attn_case(1, H, Hkv, Dh, pos0, C=24, seed=pos0 + window)
    q *= 3
    ref = naive.attention(q, k_all, v_all, pos0, 0.125, window, SINKS)
    out = poisoned(q.shape)
    xq, xds = x8_buffers(1, H * Dh)                  # the 8-bit output too (kernel or merge)
    att.attention(out, dev(q), kc, vc, dev(np.array([pos0], np.int32)), 0.125, window,
                  xq=xq, xds=xds, sinks=dev(SINKS))
    check("attention sinks, split", out.copy_to_host(), ref)
    got_q, got_ds = xq.copy_to_host()[:H * Dh // 4], xds.copy_to_host()[:H * Dh // 16]
    quantize_x(out, 1, H * Dh, 0)
    assert np.array_equal(got_q, xq.copy_to_host()[:H * Dh // 4])
    assert np.array_equal(got_ds, xds.copy_to_host()[:H * Dh // 16])
    # without sinks (EMPTY): unchanged
    att.attention(out, dev(q), kc, vc, pos0, 0.125, window, sinks=empty())
    check("attention, EMPTY sinks", out.copy_to_host(), naive.attention(q, k_all, v_all, pos0, 0.125, window))


@pytest.mark.parametrize("window", [0, 4])
def test_attention_sinks_no_split(window, small):
    """T = 3 (a prompt, Dh = 40: the warp-per-query kernel, no key splits), GQA, in place."""
    T, H, Hkv, Dh, pos0 = 3, 4, 2, 40, 6
    assert not flash.supported(Dh)
    q, kc, vc, k_all, v_all = attn_case(T, H, Hkv, Dh, pos0, C=12, seed=window)
    sinks = np.array([1.0, -0.5, 20.0, 0.0], np.float32)
    ref = naive.attention(q, k_all, v_all, pos0, 1 / np.sqrt(Dh), window, sinks)
    dq = dev(q)
    att.attention(dq, dq, kc, vc, pos0, 1 / np.sqrt(Dh), window, sinks=dev(sinks))
    check("attention sinks, one split", dq.copy_to_host(), ref)


@pytest.mark.parametrize("T,H,Hkv,Dh,pos0,window", [(20, 4, 2, 32, 5, 0), (13, 3, 1, 16, 0, 7)])
def test_flash_attention_sinks(T, H, Hkv, Dh, pos0, window):
    assert T > att.SPLIT_MAX_T and flash.supported(Dh)
    q, kc, vc, k_all, v_all = attn_case(T, H, Hkv, Dh, pos0, C=pos0 + T + 3, seed=T)
    sinks = np.array([2.0, 25.0, -3.0, 0.5][:H], np.float32)
    scale = 1.0 / np.sqrt(Dh)
    ref = naive.attention(q, k_all, v_all, pos0, scale, window, sinks)
    out = poisoned(q.shape)
    att.attention(out, dev(q), kc, vc, pos0, scale, window, sinks=dev(sinks))
    check(f"flash sinks T={T} H={H}/{Hkv}", out.copy_to_host(), ref, RTOL_F16)


@pytest.mark.parametrize("T,pos0,window,keys", [(2, 9, 0, 4), (1, 12, 5, 0), (1, 2, 0, 4)])
def test_rope_attention_sinks(T, pos0, window, keys, small, monkeypatch):
    """rope_attention with sinks equals norm_rope_store + attention with sinks, bit for bit."""
    monkeypatch.setattr(att, "SPLIT_KEYS", 4)
    monkeypatch.setattr(att, "MIN_SPLIT_KEYS", keys)
    H, Hkv, Dh, C = 4, 2, 32, 16
    q0, k0, v0 = (rnd(T, n, Dh, seed=s, scale=2.0) for s, n in ((1, H), (2, Hkv), (3, Hkv)))
    pos = dev(np.arange(pos0, pos0 + T, dtype=np.int32))
    sinks = dev(np.array([1.5, -2.0, 12.0, 0.0], np.float32))
    outs = []
    for fused_launch in (False, True):
        q, k, v = dev(q0), dev(k0), dev(v0)
        kc = cuda.to_device(np.zeros((C, Hkv, Dh), np.uint16))
        vc = cuda.to_device(np.zeros((C, Hkv, Dh), np.uint16))
        att.store_kv(kc, vc, dev(rnd(pos0, Hkv, Dh, seed=6)), dev(rnd(pos0, Hkv, Dh, seed=7)), 0)
        out = poisoned((T, H, Dh))
        if fused_launch:
            att.rope_attention(out, q, k, v, kc, vc, pos, None, None, 1e-6, rope_freqs(16, 10000.0),
                               1.0, True, 0.125, window, sinks=sinks)
        else:
            norm_rope.norm_rope_store(q, k, v, kc, vc, pos, None, None, 1e-6, rope_freqs(16, 10000.0), 1.0, True)
            att.attention(out, q, kc, vc, pos, 0.125, window, sinks=sinks)
            k_all = naive.f16_round(kc.copy_to_host().view(np.float16)[:pos0 + T].astype(np.float32))
            v_all = naive.f16_round(vc.copy_to_host().view(np.float16)[:pos0 + T].astype(np.float32))
            check("attention sinks after norm_rope_store", out.copy_to_host(), naive.attention(
                q.copy_to_host(), k_all, v_all, pos0, 0.125, window, sinks.copy_to_host()))
        outs.append([a.copy_to_host() for a in (out, kc, vc)])
    for name, a, b in zip(("out", "k cache", "v cache"), *outs):
        assert np.array_equal(a, b), name


def test_sinks_must_match_the_heads(small):
    q, kc, vc, _, _ = attn_case(1, 4, 2, 16, 0, C=4)
    with pytest.raises(ValueError, match="sinks"):
        att.attention(poisoned(q.shape), dev(q), kc, vc, 0, 0.25, sinks=dev(np.zeros(3, np.float32)))


# ---------------------------------------------------------------- swiglu_oai

def test_swiglu_oai(small):
    """Past the clamps: gate above 7 (capped), up beyond +-7 (clamped), far negative gate (0);
    strided halves of a fused [N, 2F], and in place."""
    N, F = 3, 45
    gate, up = rnd(N, F, seed=1, scale=6.0), rnd(N, F, seed=2, scale=6.0)
    gate[0, :6] = [7.5, 100.0, -100.0, -1e4, 6.99, -7.5]
    up[1, :6] = [-7.5, 7.5, -100.0, 1e4, -1.0, 6.99]
    ref = naive.swiglu_oai(gate, up)
    out = poisoned((N, F))
    ops.swiglu_oai(out, dev(gate), dev(up))
    check("swiglu_oai", out.copy_to_host(), ref)
    gu = dev(np.concatenate([gate, up], axis=1))
    out = poisoned((N, F))
    ops.swiglu_oai(out, gu[:, :F], gu[:, F:])
    check("swiglu_oai strided", out.copy_to_host(), ref)
    dg = dev(gate)
    ops.swiglu_oai(dg, dg, dev(up))
    check("swiglu_oai in place", dg.copy_to_host(), ref)


@pytest.mark.parametrize("act,name", [(fused.ACT_SWIGLU_OAI, "Q8_0"), (fused.ACT_SILU, "Q8_0"),
                                      (fused.ACT_SWIGLU_OAI, "MXFP4")])
def test_fused_glu_act(act, name, small, monkeypatch):
    """glu_q8 / glu_id_q8 with gpt-oss's activation (and its MXFP4 experts, whole blocks a
    chunk): equal to the two products and ops.swiglu_oai bit for bit (products reach beyond
    +-7), and to the float64 reference."""
    monkeypatch.setattr(matmul, "INT8_DOT", True)
    qt, E, M, K, A = int(Q[name]), 3, 5, 96, 2
    w, wref = quantize(rnd(E, M, K, seed=3), name)
    wu, wuref = quantize(rnd(E, M, K, seed=4), name)
    x = rnd(1, K, seed=5, scale=1.5)
    dw, dwu, dx = dev(w), dev(wu), dev(x)
    glu = ops.swiglu_oai if act == fused.ACT_SWIGLU_OAI else ops.swiglu
    ref_glu = naive.swiglu_oai if act == fused.ACT_SWIGLU_OAI else naive.swiglu
    xr = x_rounded(x)
    # dense: expert 1's weights
    g, u, want = poisoned((1, M)), poisoned((1, M)), poisoned((1, M))
    matmul.mul_mat(g, dev(w[1]), dx, qt)
    matmul.mul_mat(u, dev(wu[1]), dx, qt)
    assert np.abs(g.copy_to_host()).max() > 7 or act != fused.ACT_SWIGLU_OAI
    glu(want, g, u)
    got = poisoned((1, M))
    xq, xds = quantize_x(dx, 1, K, 0)
    fused.glu_q8(got, dev(w[1]), dev(wu[1]), xq, xds, qt, K, act)
    assert np.array_equal(got.copy_to_host(), want.copy_to_host())
    check(f"glu_q8 act={act}", got.copy_to_host(), ref_glu(xr @ wref[1].T, xr @ wuref[1].T), 1e-4)
    # experts 2 and 0 of one token
    ids = dev(np.array([[2, 0]], np.int32))
    x1 = dev(x.reshape(1, 1, K))
    g, u, want = poisoned((1, A, M)), poisoned((1, A, M)), poisoned((A, M))
    matmul.mul_mat_id(g, dw, x1, ids, qt)
    matmul.mul_mat_id(u, dwu, x1, ids, qt)
    glu(want, g.reshape(A, M), u.reshape(A, M))
    got = poisoned((1, A, M))
    xq, xds = quantize_x(x1, 1, K, 0)
    fused.glu_id_q8(got, dw, dwu, xq, xds, ids, 1, qt, K, act)
    assert np.array_equal(got.copy_to_host().reshape(A, M), want.copy_to_host())
    ref = np.stack([ref_glu(xr[0] @ wref[e].T, xr[0] @ wuref[e].T) for e in (2, 0)])
    check(f"glu_id_q8 act={act}", got.copy_to_host().reshape(A, M), ref, 1e-4)
    with pytest.raises(ValueError, match="activation"):
        fused.glu_q8(got.reshape(A, M), dev(w[1]), dev(wu[1]), xq, xds, qt, K, 7)


@pytest.mark.parametrize("merged", [False, True])
def test_fused_expert_biases(merged, small, monkeypatch):
    """gpt-oss's expert biases in the fused kernels: glu_id_q8 adds the chosen expert's gate /
    up bias rows before the GLU (merged, -muge: one [E, 2M] bias, gate half then up half),
    down_combine_q8 the down bias rows before the weighted sum (and the residual add): bit
    for bit the products, add_bias_id, swiglu_oai and moe_combine; and the float64 math."""
    monkeypatch.setattr(matmul, "INT8_DOT", True)
    qt, E, M, K, A, T, D = int(Q["Q8_0"]), 4, 5, 64, 2, 2, 3
    w, wref = quantize(rnd(E, 2 * M, K, seed=1), "Q8_0")        # each expert: gate rows, up rows
    b = rnd(E, 2 * M, seed=2, scale=2.0)
    x = rnd(T, 1, K, seed=3, scale=1.5)
    ids = dev(np.array([[3, 0], [1, 3]], np.int32))
    hids = ids.copy_to_host()
    xr = x_rounded(x)
    want = [np.stack([naive.swiglu_oai(wref[e, :M] @ xr[t, 0] + b[e, :M], wref[e, M:] @ xr[t, 0] + b[e, M:])
                      for e in hids[t]]) for t in range(T)]
    # unfused: the two products, their biases, the GLU
    halves = [dev(np.ascontiguousarray(a)) for a in (w[:, :M], w[:, M:], b[:, :M], b[:, M:])]
    g, u = poisoned((T, A, M)), poisoned((T, A, M))
    for out, wh, bh in ((g, halves[0], halves[2]), (u, halves[1], halves[3])):
        matmul.mul_mat_id(out, wh, dev(x), ids, qt)
        ops.add_bias_id(out, out, bh, ids)
    ops.swiglu_oai(g.reshape(T * A, M), g.reshape(T * A, M), u.reshape(T * A, M))
    got = poisoned((T, A, M))
    xq, xds = quantize_x(dev(x), T, K, 0)
    if merged:
        fused.glu_id_q8(got, dev(w), None, xq, xds, ids, 1, qt, K, fused.ACT_SWIGLU_OAI, bg=dev(b.reshape(-1)))
    else:
        fused.glu_id_q8(got, halves[0], halves[1], xq, xds, ids, 1, qt, K, fused.ACT_SWIGLU_OAI,
                        bg=halves[2], bu=halves[3])
    assert np.array_equal(got.copy_to_host(), g.copy_to_host())
    check(f"glu_id_q8 biases merged={merged}", got.copy_to_host(), np.stack(want), 1e-4)
    if merged:
        return
    # down: x [T, A, K] per pair, bias [E, D], the weighted sum and the residual
    wd, wdref = quantize(rnd(E, D, K, seed=4), "Q8_0")
    bd, xa, wts, res = rnd(E, D, seed=5), rnd(T, A, K, seed=6), rnd(T, A, seed=7), rnd(T, D, seed=8)
    xar = x_rounded(xa)
    ref = np.stack([sum(wts[t, a] * (wdref[hids[t, a]] @ xar[t, a] + bd[hids[t, a]]) for a in range(A))
                    for t in range(T)])
    y, plain = poisoned((T, A, D)), poisoned((T, D))
    matmul.mul_mat_id(y, dev(wd), dev(xa), ids, qt)
    ops.add_bias_id(y, y, dev(bd), ids)
    moe.moe_combine(plain, y, dev(wts))
    xq, xds = quantize_x(dev(xa), T * A, K, 0)
    got, acc = poisoned((T, D)), dev(res)
    fused.down_combine_q8(got, dev(wd), xq, xds, ids, dev(wts), qt, K, bias=dev(bd.reshape(-1)))
    fused.down_combine_q8(acc, dev(wd), xq, xds, ids, dev(wts), qt, K, accumulate=True, bias=dev(bd))
    assert np.array_equal(got.copy_to_host(), plain.copy_to_host())
    assert np.array_equal(acc.copy_to_host(), res + plain.copy_to_host())
    check("down_combine_q8 biases", got.copy_to_host(), ref, 1e-4)
    with pytest.raises(ValueError, match="expert bias"):
        fused.down_combine_q8(got, dev(wd), xq, xds, ids, dev(wts), qt, K, bias=dev(bd[:2]))


# ---------------------------------------------------------------- routing variants

def test_topk_route_groups_by_hand(small):
    """Groups of 2: group 0 holds the best expert (5) but scores 5 - 5 = 0; groups 1 (2 + 2)
    and 2 (1.5 + 1.5) are kept, and the top 2 are experts 2, 3 (a tie: lower index first).
    Gating 2 (the scores are the logits): weights = softmax of the chosen logits = 1/2, 1/2."""
    logits = np.array([[5.0, -5.0, 2.0, 2.0, 1.5, 1.5, 0.0, 0.0]], np.float32)
    ids, w = poisoned((1, 2), np.int32), poisoned((1, 2))
    moe.topk_route(ids, w, dev(logits), False, 2, n_group=4, topk_group=2)
    assert ids.copy_to_host().tolist() == [[2, 3]]
    np.testing.assert_allclose(w.copy_to_host(), [[0.5, 0.5]], rtol=1e-6)
    moe.topk_route(ids, w, dev(logits), False, 2)           # no groups: experts 0 and 2
    assert ids.copy_to_host().tolist() == [[0, 2]]


def test_topk_route_bias_by_hand(small):
    """Sigmoid gating: a bias of +1 on expert 3 chooses it over expert 1, but its weight is its
    unbiased sigmoid; scale 2.5 after the norm."""
    logits = np.array([[0.0, 1.0, 2.0, 0.5]], np.float32)
    bias = np.array([0.0, 0.0, 0.0, 1.0], np.float32)
    ids, w = poisoned((1, 2), np.int32), poisoned((1, 2))
    moe.topk_route(ids, w, dev(logits), True, 1, scale=2.5, bias=dev(bias))
    assert ids.copy_to_host().tolist() == [[3, 2]]
    s = 1 / (1 + np.exp(-np.array([0.5, 2.0])))
    np.testing.assert_allclose(w.copy_to_host()[0], 2.5 * s / s.sum(), rtol=1e-6)


@pytest.mark.parametrize("gating", [0, 1, 2])
@pytest.mark.parametrize("norm,scale,with_bias,groups", [
    (True, 1.0, False, (0, 0)),
    (False, 2.5, True, (0, 0)),
    (True, 0.7, True, (4, 2)),      # 4 groups of 10, 2 kept (DeepSeek-V3's form, smaller)
    (False, 1.0, False, (8, 3)),    # 8 groups of 5 without bias: scores are the probs
])
def test_topk_route_variants(gating, norm, scale, with_bias, groups, small):
    """E = 40 (two experts a lane, groups across lanes), A = 4, 5 tokens (a partial block)."""
    T, E, A = 5, 40, 4
    n_group, topk_group = groups
    logits = rnd(T, E, seed=10 + gating, scale=2.0)
    bias = rnd(E, seed=20, scale=0.3 if gating != 2 else 2.0) if with_bias else None
    ids, w = poisoned((T, A), np.int32), poisoned((T, A))
    moe.topk_route(ids, w, dev(logits), norm, gating, scale,
                   dev(bias) if with_bias else empty(), n_group, topk_group)
    ref_ids, ref_w = naive.topk_route(logits, A, norm, gating, scale, bias, n_group, topk_group)
    assert np.array_equal(ids.copy_to_host(), ref_ids)
    check(f"topk_route gating={gating} bias={with_bias} groups={n_group}", w.copy_to_host(), ref_w)


def test_route_args_reject_bad_variants():
    with pytest.raises(ValueError, match="groups"):
        moe.route_args(40, 4, n_group=3, topk_group=1)        # 40 experts do not split in 3
    with pytest.raises(ValueError, match="groups"):
        moe.route_args(40, 8, n_group=8, topk_group=1)        # 1 group of 5 holds < 8
    with pytest.raises(ValueError, match="gating"):
        moe.route_args(40, 4, gating=3)
    assert moe.route_args(40, 4, n_group=1)[3] == 0           # one group: no groups
    assert fused.route_supports(1, True, 8) and not fused.route_supports(4, False, 0)


def test_norm_route_variants(small):
    """norm_route with sigmoid gating, a selection bias, 4 groups (2 kept), a scale and the
    router's own bias equals rms_norm, mul_mat, add_bias, topk_route bit for bit."""
    D, E, A = 64, 40, 3
    x, wn = rnd(1, D, seed=1, scale=2.0), rnd(D, seed=2)
    wr, _ = quantize(rnd(E, D, seed=3, scale=0.1), "F32")    # logits ~ 1: sigmoid not saturated
    rb, sb = rnd(E, seed=4), rnd(E, seed=5, scale=0.2)
    args = dict(gating=1, scale=2.5, bias=dev(sb), n_group=4, topk_group=2)
    dx, dwn, dwr, drb = dev(x), dev(wn), dev(wr), dev(rb)
    h_want, lg_want = poisoned((1, D)), poisoned((1, E))
    ids_want, w_want = poisoned((1, A), np.int32), poisoned((1, A))
    ops.rms_norm(h_want, dx, dwn, 1e-6)
    matmul.mul_mat(lg_want, dwr, h_want, int(Q["F32"]))
    ops.add_bias(lg_want, lg_want, drb)
    moe.topk_route(ids_want, w_want, lg_want, True, **args)
    xq, xds = x8_buffers(1, D)
    h, lg = poisoned((1, D)), poisoned((1, E))
    ids, w = poisoned((1, A), np.int32), poisoned((1, A))
    fused.norm_route(h, xq, xds, dx, dwn, 1e-6, dwr, int(Q["F32"]), lg, ids, w, True,
                     logit_bias=drb, **args)
    for got, want in ((h, h_want), (lg, lg_want), (ids, ids_want), (w, w_want)):
        assert np.array_equal(got.copy_to_host(), want.copy_to_host())
    ref_ids, ref_w = naive.topk_route(lg_want.copy_to_host(), A, True, 1, 2.5, sb, 4, 2)
    assert np.array_equal(ids.copy_to_host(), ref_ids)
    check("norm_route variants", w.copy_to_host(), ref_w)


# ---------------------------------------------------------------- bias ops

def test_add_bias(small):
    T, M = 3, 67
    x, b = rnd(T, M, seed=1), rnd(M, seed=2)
    out = poisoned((T, M))
    ops.add_bias(out, dev(x), dev(b))
    check("add_bias", out.copy_to_host(), x.astype(np.float64) + b, 1e-7)
    dx = dev(x)
    ops.add_bias(dx, dx, dev(b))                     # in place
    assert np.array_equal(dx.copy_to_host(), x + b)
    with pytest.raises(ValueError):
        ops.add_bias(out, dev(x), dev(rnd(M + 1)))


def test_add_bias_id(small):
    T, A, M, E = 3, 2, 37, 5
    x, b = rnd(T, A, M, seed=3), rnd(E, M, seed=4)
    ids = np.array([[4, 0], [1, 4], [2, 3]], np.int32)
    ref = x.astype(np.float64) + b[ids]
    out = poisoned((T, A, M))
    ops.add_bias_id(out, dev(x), dev(b), dev(ids))
    check("add_bias_id", out.copy_to_host(), ref, 1e-7)
    dx = dev(x)
    ops.add_bias_id(dx, dx, dev(b), dev(ids))        # in place
    assert np.array_equal(dx.copy_to_host(), x + b[ids])


def test_sigmoid_mul(small):
    T, M = 4, 45
    x, g = rnd(T, M, seed=5), rnd(T, 1, seed=6, scale=3.0)
    g[3, 0] = -200.0                                 # sigmoid 0: the row vanishes
    ref = x.astype(np.float64) / (1 + np.exp(-g.astype(np.float64)))
    out = poisoned((T, M))
    ops.sigmoid_mul(out, dev(x), dev(g))
    check("sigmoid_mul", out.copy_to_host(), ref)
    dx = dev(x)
    ops.sigmoid_mul(dx, dx, dev(g))                  # in place
    check("sigmoid_mul in place", dx.copy_to_host(), ref)
