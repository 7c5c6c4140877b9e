"""Fused decode products on the CPU: several graph nodes in one parallel region.

Each parallel region costs a fork and a join of the thread pool, and a decoding token of a MoE layer made five of them for the experts alone (gate, up, GLU,
down, combine), plus three for q, k, v. fusion.find_groups finds the same runs of nodes as
for the GPU, and the CPU backend binds them to these (matrix-vector path, T < BLAS_MIN_T):

  products      outs[j] = x @ W_j^T [+ b_j] for 2-3 weights of one type, x prepared once; the
                work items run over the rows of all of them (q, k, v with their biases)
  glu           out = act(x @ Wg^T) * (x @ Wu^T): an item computes both row runs, then the GLU
  glu_id        the same for each (token, chosen expert) pair, grouped by expert as mul_mat_id;
                the chosen expert's gate / up bias rows added before the GLU
  down_combine  out[t] = sum_a w[t, a] * (x[t, a] @ Wdown[ids[t, a]]^T [+ b[ids[t, a]]]): an
                item is a run of output rows; it dots every chosen expert's rows, adds its
                bias rows and sums in order a

Each product row is the one matmul's kernels compute (same x preparation, same row dots), so
the results equal the unfused nodes' (the bias adds, the GLU and the weighted sum in the same
order). Expert biases (gpt-oss's ADD_BIAS_ID nodes) are flat float32 arrays [E * rows an
expert]; a size-0 array (ops.EMPTY) is none.
act: ACT_SILU, ACT_GELU or ACT_SWIGLU_OAI (ops' row functions); glu is built per act, glu_id
takes it at run time (its kernel is mul_mat_id's, shared with the plain expert products).
"""
import numba
import numpy as np
from numba import njit, prange

from .matmul import (ACT_GELU, ACT_SILU, ACT_SWIGLU_OAI, NO_BIAS, _add_bias_rows, _dot_rows,  # noqa: F401
                     _expert_rows, _glu_rows, _group_by_expert, _mul_mat_id_vec, _prepare_x,
                     _prepare_x_row, _products, _products_kernel, _x_buffers)
from .ops import EMPTY, PAR_MIN_ELEMS
from .specialize import ConstantArgs, build, entry
from .work_queue import WORDS, counters, fetch_add, new_queue, next_item, wait_for


# ---------------------------------------------------------------- products
# matmul._products: ws, outs, biases tuples of 3 (a run of two repeats the second with 0 rows).

def products(outs, ws, x, qtype, int8, step, biases=None):
    """outs[j] [T, M_j] = x [T, K] @ dequant(ws[j])^T [+ biases[j] [M_j]] for 2 or 3 weights of
    one type; biases: None, or one per weight (matmul.NO_BIAS where it has none)."""
    products_step(outs, ws, x, qtype, int8, step, biases)()


def products_step(outs, ws, x, qtype, int8, step, biases=None):
    """products(...) as a plan's step: its tuples and row counts are made once, at binding."""
    rows = [w.shape[0] for w in ws]
    bs = list(biases) if biases is not None else [NO_BIAS] * len(ws)
    if len(ws) == 2:
        outs, ws, rows, bs = (outs[0], outs[1], outs[1]), (ws[0], ws[1], ws[1]), rows + [0], bs + [bs[1]]
    o, w, r, b = tuple(outs), tuple(ws), np.array(rows, np.int64), tuple(bs)
    kernel = build(_products_kernel, (int(qtype), bool(int8)))
    return lambda: kernel(o, w, x, step, r, b)


# ---------------------------------------------------------------- glu (dense)

def _glu_kernel(qtype, int8, act):
    """out [T, M] = act(x @ Wg^T) * (x @ Wu^T); items of `step` rows (act a constant: its
    GLU alone is compiled in)."""
    @njit(parallel=True, cache=True, error_model="numpy", pipeline_class=ConstantArgs)
    def glu(out, wg, wu, x, step):
        xsum, xi = _prepare_x(x, int8, qtype)
        M = wg.shape[0]
        for item in prange((M + step - 1) // step):
            r0, r1 = item * step, min(M, (item + 1) * step)
            g = np.empty(r1 - r0, np.float32)
            u = np.empty(r1 - r0, np.float32)
            for t in range(x.shape[0]):
                _dot_rows(qtype, g, wg[r0:r1], x, t, xsum, xi, int8)
                _dot_rows(qtype, u, wu[r0:r1], x, t, xsum, xi, int8)
                _glu_rows(out[t, r0:r1], g, u, act)
    return glu


glu = entry(_glu_kernel, "out, wg, wu, x, qtype, int8, step, act")


# ---------------------------------------------------------------- glu_id (experts)
# out [T, A, M]; x [T, X, K]; an item = (chosen expert, run of `step` rows) over its pairs;
# wg [E, M, row_bytes] and wu [E, M, row_bytes], or wg [E, 2M, row_bytes] merged (-muge:
# gate rows 0..M-1, up rows M..2M-1 of each expert's block) and wu None:
# matmul's expert kernel with its GLU (one parallel kernel for both: a cold start compiles
# the type dispatch in it once).

def glu_id(out, wg, wu, x, ids, qtype, int8, step, act, bg=EMPTY, bu=EMPTY):
    """out [T, A, F] = act(x @ Wg[e]^T + bg[e]) * (x @ Wu[e]^T + bu[e]), e = ids[t, a].
    wu None: wg is merged (-muge), expert e's gate rows then its up rows from up0 = F, and
    bg its merged bias [E, 2F] likewise (bu unused)."""
    wu, up0, bg, bu = _gate_up(wg, wu, bg, bu, out.shape[2])
    _mul_mat_id_vec(out, wg, x, ids, qtype, ids.size + 1, int8, step, wu, up0, act, bg, bu,
                    numba.get_num_threads())


def _gate_up(wg, wu, bg, bu, F):
    """(wu, up0, bg, bu) as the expert kernels take them: wu None (merged, -muge) reads the up
    rows from row F of wg and their bias from row F of bg; biases flat (expert_bias)."""
    up0 = 0
    if wu is None:
        wu, up0, bu = wg, F, bg
    return wu, up0, expert_bias(bg, wg.shape[0], wg.shape[1]), expert_bias(bu, wu.shape[0], wu.shape[1])


def expert_bias(b, E, M):
    """b [E, M] or flat [E * M] as the kernels take it (flat, read-only: one Numba type), or
    EMPTY for none; ValueError for another size."""
    if b is None or b.size == 0:
        return EMPTY
    if b.size != E * M:
        raise ValueError(f"expert bias of {b.size} values, expected {E} experts x {M}")
    b = np.ascontiguousarray(b, np.float32).reshape(-1)
    if b.flags.writeable:
        b = b.view()
        b.flags.writeable = False
    return b


# ---------------------------------------------------------------- glu_halves
# out [N, F] = act(gu[:, :F]) * gu[:, F:]: the GLU of a merged gate_up product (-muge) when it
# is not fused (-fmoe 0, batches past the matrix-vector kernels). gu [N, 2F] C-contiguous,
# each row's two halves contiguous too (so the row kernels vectorize as ops.swiglu's).
# Parallel over rows from PAR_MIN_ELEMS values.

@njit(cache=True, error_model="numpy")
def _glu_halves_seq(out, gu, act):
    F = out.shape[1]
    for r in range(out.shape[0]):
        _glu_rows(out[r], gu[r, :F], gu[r, F:], act)


@njit(parallel=True, cache=True, error_model="numpy")
def _glu_halves_par(out, gu, act):
    F = out.shape[1]
    for r in prange(out.shape[0]):
        _glu_rows(out[r], gu[r, :F], gu[r, F:], act)


def glu_halves(out, gu, act):
    """out [N, F] = act(gate half) * up half of gu [N, 2F]; act ACT_SILU / ACT_GELU /
    ACT_SWIGLU_OAI."""
    if gu.shape[1] != 2 * out.shape[1] or gu.shape[0] != out.shape[0]:
        raise ValueError(f"glu_halves: gu {gu.shape} is not out {out.shape} twice as wide")
    (_glu_halves_par if out.size >= PAR_MIN_ELEMS and out.shape[0] > 1 else _glu_halves_seq)(out, gu, act)


# ---------------------------------------------------------------- down_combine
# out [T, M] = sum_a wts[t, a] * (W[ids[t, a]] @ x[t, a] + b[ids[t, a]]) (x [T, A, K]; b flat
# [E * M] or size 0: none); an item = a run of `step` output rows for every token, the A
# expert rows dotted into y, the bias rows added, and summed in order a (as add_bias_id, then
# moe_combine: out = w0 * y0, then out += w_a * y_a). Items shared out over n_workers
# (numba.get_num_threads()) by work_queue, as the expert products'.

def _down_combine_kernel(qtype, int8):
    @njit(parallel=True, cache=True, error_model="numpy", pipeline_class=ConstantArgs)
    def down_combine(out, w, x, ids, wts, bias, step, n_workers):
        M = w.shape[1]
        T, A, K = x.shape
        xf = x.reshape(T * A, K)
        xsum, xi = _prepare_x(xf, int8, qtype)
        queue = new_queue((M + step - 1) // step, n_workers)
        for worker in prange(n_workers):
            item = next_item(queue, worker)
            while item >= 0:
                _down_rows(qtype, out, w, xf, xsum, xi, int8, ids, wts, bias, item * step,
                           min(M, (item + 1) * step))
                item = next_item(queue, worker)
    return down_combine


@njit(cache=True, error_model="numpy", inline="always")
def _down_rows(qtype, out, w, xf, xsum, xi, int8, ids, wts, bias, r0, r1):
    """down_combine's item: out[t, r0:r1] for every token t."""
    T, A = ids.shape
    sb = bias.shape[0] // w.shape[0]              # bias values an expert (0: none)
    y = np.empty(r1 - r0, np.float32)
    for t in range(T):
        o = out[t, r0:r1]
        for a in range(A):
            _dot_rows(qtype, y, w[ids[t, a], r0:r1], xf, t * A + a, xsum, xi, int8)
            if sb > 0:
                _add_bias_rows(y, bias, ids[t, a] * sb + r0)
            wa = wts[t, a]
            if a == 0:
                for i in range(r1 - r0):
                    o[i] = wa * y[i]
            else:
                for i in range(r1 - r0):
                    o[i] += wa * y[i]


down_combine = entry(_down_combine_kernel, "out, w, x, ids, wts, bias, qtype, int8, step, n_workers")


# ---------------------------------------------------------------- expert_ffn
# glu_id, then down_combine of its output, in one parallel region: three phases of work items,
# each begun when every item of the one before has run (work_queue.wait_for):
#   1. glu_id's items (expert, run of rows)  -> g [T, A, F]
#   2. each row of g prepared for the down product's dots (as _prepare_x, one row an item)
#   3. down_combine's items (runs of output rows) -> out [T, D]
# Same items, same dots, same order of sums as the two kernels: the same bits. What it saves
# is the second region's start: with threads that sleep between regions, waking them.

def _expert_ffn_kernel(qt_gu, int8_gu, qt_d, int8_d):
    @njit(parallel=True, cache=True, error_model="numpy", pipeline_class=ConstantArgs)
    def expert_ffn(out, g, wg, wu, up0, wd, x, ids, wts, bg, bu, bd, steps, act, n_workers):
        E, F, M = wg.shape[0], g.shape[2], wd.shape[1]
        T, X, K = x.shape
        A = ids.shape[1]
        order, start = _group_by_expert(ids, E)
        xf = x.reshape(T * X, K)
        xsum, xi = _prepare_x(xf, int8_gu, qt_gu)
        used, n_used = _chosen_experts(start)
        step_gu, step_d = steps
        n_runs = (F + step_gu - 1) // step_gu
        n1, n2 = n_used * n_runs, T * A
        gf = g.reshape(T * A, F)
        gsum, gi = _x_buffers(T * A, F, int8_d, qt_d)
        q1, q2 = new_queue(n1, n_workers), new_queue(n2, n_workers)
        q3 = new_queue((M + step_d - 1) // step_d, n_workers)
        done = counters(2)                       # items finished: phase 1, phase 2
        for worker in prange(n_workers):
            item = next_item(q1, worker)
            while item >= 0:
                e = used[item // n_runs]
                r0 = item % n_runs * step_gu
                _expert_rows(qt_gu, g, wg, xf, xsum, xi, int8_gu, order, start, A, X, e, r0,
                             min(F, r0 + step_gu), wu, up0, act, bg, bu)
                fetch_add(done, 0, 1)
                item = next_item(q1, worker)
            wait_for(done, 0, n1)
            item = next_item(q2, worker)
            while item >= 0:
                _prepare_x_row(gf, item, gsum, gi, int8_d, qt_d)
                fetch_add(done, WORDS, 1)
                item = next_item(q2, worker)
            wait_for(done, WORDS, n2)
            item = next_item(q3, worker)
            while item >= 0:
                _down_rows(qt_d, out, wd, gf, gsum, gi, int8_d, ids, wts, bd, item * step_d,
                           min(M, (item + 1) * step_d))
                item = next_item(q3, worker)
    return expert_ffn


@njit(cache=True)
def _chosen_experts(start):
    """The experts with pairs (start: _group_by_expert's offsets) and their count. A loop of
    its own: an array expression in a parallel kernel is a parallel loop, a fork and join more."""
    used = np.empty(start.shape[0] - 1, np.int64)
    n = 0
    for e in range(start.shape[0] - 1):
        if start[e + 1] > start[e]:
            used[n] = e
            n += 1
    return used, n


_expert_ffn = entry(_expert_ffn_kernel, "out, g, wg, wu, up0, wd, x, ids, wts, bg, bu, bd, steps, "
                    "act, n_workers, qt_gu, int8_gu, qt_d, int8_d")


def expert_ffn(out, g, wg, wu, wd, x, ids, wts, qtypes, int8s, steps, act, bg=EMPTY, bu=EMPTY,
               bd=EMPTY):
    """out [T, D] = down_combine(glu_id(x)) with g [T, A, F] the GLU's output (written too):
    the arguments of glu_id and down_combine, qtypes / int8s / steps per (gate-up, down)."""
    wu, up0, bg, bu = _gate_up(wg, wu, bg, bu, g.shape[2])
    bd = expert_bias(bd, wd.shape[0], wd.shape[1])
    _expert_ffn(out, g, wg, wu, up0, wd, x, ids, wts, bg, bu, bd, (int(steps[0]), int(steps[1])),
                act, numba.get_num_threads(), int(qtypes[0]), bool(int8s[0]), int(qtypes[1]),
                bool(int8s[1]))
