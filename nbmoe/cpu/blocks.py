"""Decoding a whole block of a layer in one compiled call (CPU, one token).

Letters: D model dim, H heads, Hkv kv heads, Dh head dim, F FFN width, C cache slots.

Bound node by node, a SmolLM2-135M token is 333 Python steps (393 for the upcycled MoE),
each a lambda and a Numba dispatch. These functions run the nodes of one block
(fusion.find_groups: kind attn_block, ffn_block or moe_block) in sequence inside one @njit
function, calling the kernels those nodes bind to (rms_norm, the fused products, rope,
store_kv + attention, topk_route, add), so the results are bit-identical to the unfused
steps; a token is then 63 steps. They are serial glue: the products inside open their own
parallel regions (q/k/v, o; gate/up/GLU, down: 2 + 2 a layer; a MoE router is small enough
to run on the calling thread, matmul.SERIAL_MAX_BYTES), and the small row ops between them
run on the calling thread, as they do unfused at T = 1.

Products are given as (weight [M, row_bytes] uint8, qtype, int8 path, rows per work item),
as matmul's matrix-vector kernels take them; a block is built per tuple of qtypes and int8
paths (specialize.py). Absent optional norms and biases are empty arrays.
"""
from numba import njit

from nbmoe import config

from . import attention as attn
from . import moe, ops
from .fused import _expert_ffn, down_combine, expert_bias, glu
from .matmul import _add_bias_rows, _mul_mat_id_vec, _products, mat_vec
from .ops import EMPTY
from .specialize import ConstantArgs, entry


@njit(cache=True, error_model="numpy")
def _norm_if(x, w, eps):
    """RMS-norm x [1, ...] in place by w, unless w is empty (the architecture has no such norm)."""
    if w.shape[0] > 0:
        ops.rms_norm(x, x, w, eps)


@njit(cache=True, error_model="numpy")
def _bias_if(x, b):
    """x [1, M] += b in place (ops.add_bias), unless b is empty (the product has no bias)."""
    if b.shape[0] > 0:
        ops.add_bias(x, x, b)


def _attn_block_kernel(qtypes, int8s):
    """x [1, D] += post_norm(attn(rope(norm(q)), rope(norm(k)), v) @ Wo^T + bo), with
    q, k, v = attn_norm(x) @ Wq^T + bq, Wk^T + bk, Wv^T + bv.

    h [1, D], q / att [1, H, Dh], k / v [1, Hkv, Dh], o [1, D]: the graph's buffers.
    norms = (attn_norm, q_norm, k_norm, post_attention_norm); biases = (bq, bk, bv, bo),
    writeable float32 (matmul._products' type), size 0 where a product has none; qtypes,
    int8s, steps: per product q, k, v, o; rows [3] = rows of q, k, v (v's 0 when v has
    another type than q and k, and then runs on its own); rope_p = (freqs [n_rot/2] float64,
    mscale); sinks [H] attention sinks or a size-0 array (none).
    """
    qt_qk, qt_v, qt_o = qtypes[0], qtypes[2], qtypes[3]
    i8_qk, i8_v, i8_o = int8s[0], int8s[2], int8s[3]

    @njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
    def attn_block(x, h, q, k, v, att, o, pos, pos0, eps, norms, biases, wq, wk, wv, wo, steps,
                   rows, rope_p, neox, kc, vc, scale, window, sinks):
        attn_norm, q_norm, k_norm, post_norm = norms
        bq, bk, bv, bo = biases
        ops.rms_norm(h, x, attn_norm, eps)                               # [1, D]
        q2, k2, v2 = q.reshape(1, q.size), k.reshape(1, k.size), v.reshape(1, v.size)
        _products((q2, k2, v2), (wq, wk, wv), h, qt_qk, i8_qk, steps[0], rows, (bq, bk, bv))
        if rows[2] == 0:     # v of another type: its own product
            mat_vec(v2, wv, h, qt_v, i8_v, steps[2])
            _bias_if(v2, bv)
        _norm_if(q, q_norm, eps)                                         # per head [1, H, Dh]
        _norm_if(k, k_norm, eps)
        freqs, mscale = rope_p
        ops.rope(q, pos, freqs, mscale, neox)
        ops.rope(k, pos, freqs, mscale, neox)
        attn.store_kv(kc, vc, k, v, pos0)
        attn.decode_attention(att, q, kc, vc, pos0, scale, window, sinks)  # [1, H, Dh]
        mat_vec(o, wo, att.reshape(1, att.size), qt_o, i8_o, steps[3])   # [1, D]
        _bias_if(o, bo)
        _norm_if(o, post_norm, eps)
        ops.add(x, x, o)
    return attn_block


attn_block = entry(_attn_block_kernel, "x, h, q, k, v, att, o, pos, pos0, eps, norms, biases, wq, "
                   "wk, wv, wo, qtypes, int8s, steps, rows, rope_p, neox, kc, vc, scale, window, sinks")


def _ffn_block_kernel(qtypes, int8s, act):
    """x [1, D] += post_norm(act(h @ Wg^T) * (h @ Wu^T) @ Wd^T), h = ffn_norm(x).

    h [1, D], g [1, F], f [1, D]: the graph's buffers; norms = (ffn_norm, post_ffw_norm);
    qtypes, int8s, steps: per product gate/up (one type), down; act: fused.ACT_* (a constant,
    as fused.glu's).
    """
    qt_gu, qt_d = qtypes
    i8_gu, i8_d = int8s

    @njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
    def ffn_block(x, h, g, f, eps, norms, wg, wu, wd, steps):
        ffn_norm, post_norm = norms
        ops.rms_norm(h, x, ffn_norm, eps)                                 # [1, D]
        glu(g, wg, wu, h, qt_gu, i8_gu, steps[0], act)                   # [1, F]
        mat_vec(f, wd, g, qt_d, i8_d, steps[1])                          # [1, D]
        _norm_if(f, post_norm, eps)
        ops.add(x, x, f)
    return ffn_block


ffn_block = entry(_ffn_block_kernel, "x, h, g, f, eps, norms, wg, wu, wd, qtypes, int8s, steps, act")


def _moe_block_kernel(qtypes, int8s, plain_route):
    """x [1, D] += post_norm(sum_a wts[a] * (act(h @ Wg[e_a]^T + bg[e_a]) * (h @ Wu[e_a]^T +
    bu[e_a])) @ Wd[e_a]^T + bd[e_a]), h = ffn_norm(x), e_a and wts = the routing of the
    router's logits h @ Wr^T + br (moe.route: norm_topk, gating, scale, bias, n_group,
    topk_group).

    h [1, D], logits [1, E], ids / wts [1, A], g [1, A, F], f [1, D]: the graph's buffers;
    wu's up rows start at row up0 of each expert (wu is wg, up0 = F: merged, -muge);
    norms = (ffn_norm, post_ffw_norm); biases = (br [E], bg, bu, bd: flat [E * rows an
    expert], bu read from up0 as wu), a size-0 array where there is none; qtypes, int8s,
    steps: per product router, gate/up (one type), down; n_workers: the expert products'
    (numba.get_num_threads()); plain_route (moe.is_plain): the routing path compiled in.
    """
    qt_r, qt_gu, qt_d = qtypes
    i8_r, i8_gu, i8_d = int8s
    one_region = config.EXPERT_FFN

    @njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
    def moe_block(x, h, logits, ids, wts, g, f, eps, norms, biases, wr, wg, wu, up0, wd, steps,
                  act, norm_topk, n_workers, gating, scale, bias, n_group, topk_group):
        ffn_norm, post_norm = norms
        br, bg, bu, bd = biases
        ops.rms_norm(h, x, ffn_norm, eps)                                 # [1, D]
        mat_vec(logits, wr, h, qt_r, i8_r, steps[0])                     # [1, E]
        if br.shape[0] > 0:
            _add_bias_rows(logits[0], br, 0)
        moe.route(plain_route, ids, wts, logits, norm_topk, gating, scale, bias, n_group,
                  topk_group)                                             # [1, A]
        h3 = h.reshape(1, 1, h.shape[1])
        if one_region:                     # gate/up/GLU, down and sum: fused.expert_ffn
            _expert_ffn(f, g, wg, wu, up0, wd, h3, ids, wts, bg, bu, bd, (steps[1], steps[2]),
                        act, n_workers, qt_gu, i8_gu, qt_d, i8_d)                 # [1, D]
        else:                              # fused.glu_id, then fused.down_combine
            _mul_mat_id_vec(g, wg, h3, ids, qt_gu, ids.size + 1, i8_gu, steps[1], wu, up0, act,
                            bg, bu, n_workers)
            down_combine(f, wd, g, ids, wts, bd, qt_d, i8_d, steps[2], n_workers)    # [1, D]
        _norm_if(f, post_norm, eps)
        ops.add(x, x, f)
    return moe_block


_moe_block = entry(_moe_block_kernel, "x, h, logits, ids, wts, g, f, eps, norms, biases, wr, wg, "
                   "wu, up0, wd, qtypes, int8s, steps, act, norm_topk, n_workers, gating, scale, "
                   "bias, n_group, topk_group, plain_route")


NO_BIASES = (EMPTY,) * 4


def moe_block(x, h, logits, ids, wts, g, f, eps, norms, wr, wg, wu, wd, qtypes, int8s, steps, act,
              norm_topk, n_workers, gating, scale, bias, n_group, topk_group, biases=NO_BIASES):
    """wu None: wg is merged (-muge), each expert's gate rows then its F up rows. biases:
    moe_biases(...) (none: NO_BIASES)."""
    wu, up0 = (wg, g.shape[2]) if wu is None else (wu, 0)
    _moe_block(x, h, logits, ids, wts, g, f, eps, norms, biases, wr, wg, wu, up0, wd, qtypes,
               int8s, steps, act, norm_topk, n_workers, gating, scale, bias, n_group, topk_group,
               moe.is_plain(bias, n_group))


def moe_biases(wg, wu, wd, router=None, gate=None, up=None, down=None):
    """moe_block's biases: the router's [E] and the experts' gate, up, down ([E, rows] or
    flat), each None where absent, checked and made flat and read-only (fused.expert_bias).
    wu None: merged (-muge), gate the merged [E, 2F] bias, its up half read from row F."""
    E = wg.shape[0]
    if wu is None:
        wu, up = wg, gate
    return (expert_bias(router, 1, E), expert_bias(gate, E, wg.shape[1]),
            expert_bias(up, E, wu.shape[1]), expert_bias(down, E, wd.shape[1]))


moe_block.__doc__ = _moe_block_kernel.__doc__ + "\n    " + moe_block.__doc__
