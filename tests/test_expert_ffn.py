"""fused.expert_ffn: a MoE layer's experts (gate / up / GLU, then down and the weighted sum) in
one parallel region of three phases. The same bits as glu_id then down_combine, for any number
of workers (more than the threads too: a waiting worker never waits for itself), and the
float64 math of the layer within the 8-bit path's rounding."""
import numba
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from nbmoe.cpu import fused, matmul
from nbmoe.cpu.work_queue import counters, fetch_add, new_queue, next_item, wait_for

E, A, D, F = 6, 3, 128, 96
QG, QD = Q.Q4_0, Q.Q5_0


def _weights(rng, qt, rows, cols):
    return np.stack([quantize(rng.standard_normal((rows, cols)).astype(np.float32), qt) for _ in range(E)])


def _reference(x, wg, wu, wd, ids, wts, bg, bu, bd):
    """float64: out[t] = sum_a wts * (Wd[e] @ (silu(Wg[e] x + bg) * (Wu[e] x + bu)) + bd)."""
    g64, u64, d64 = (dequantize(w, qt).astype(np.float64) for w, qt in ((wg, QG), (wu, QG), (wd, QD)))
    out = np.zeros((x.shape[0], D))
    for t in range(x.shape[0]):
        for a, e in enumerate(ids[t]):
            gate = g64[e] @ x[t, 0] + bg[e]
            h = gate / (1 + np.exp(-gate)) * (u64[e] @ x[t, 0] + bu[e])
            out[t] += wts[t, a] * (d64[e] @ h + bd[e])
    return out


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("form", ["plain", "biased", "merged"])
def test_expert_ffn_is_the_two_kernels(T, form):
    rng = np.random.default_rng(T)
    wg, wu, wd = _weights(rng, QG, F, D), _weights(rng, QG, F, D), _weights(rng, QD, D, F)
    x = rng.standard_normal((T, 1, D)).astype(np.float32)
    ids = np.stack([rng.choice(E, A, replace=False) for _ in range(T)]).astype(np.int32)
    wts = rng.random((T, A)).astype(np.float32)
    zero = np.zeros((E, 1), np.float32)
    bg, bu, bd = ((rng.standard_normal((E, n)).astype(np.float32) for n in (F, F, D)) if form == "biased"
                  else (zero, zero, zero))
    up, b_up = wu, bu
    if form == "merged":                     # -muge: each expert's gate rows, then its up rows
        up, b_up = None, None
        wg = np.concatenate([wg, wu], axis=1)
    qg, qd = int(QG), int(QD)
    i8g, i8d = matmul._int8(qg), matmul._int8(qd)
    sg, sd = 16, 32                          # items of 16 / 32 rows: several a phase
    biases = dict(bg=bg if form == "biased" else None, bu=b_up if form == "biased" else None)

    g0, want = np.zeros((T, A, F), np.float32), np.zeros((T, D), np.float32)
    fused.glu_id(g0, wg, up, x, ids, qg, i8g, sg, fused.ACT_SILU, **biases)
    fused.down_combine(want, wd, g0, ids, wts, fused.expert_bias(bd if form == "biased" else None, E, D),
                       qd, i8d, sd, numba.get_num_threads())
    g, got = np.zeros_like(g0), np.zeros_like(want)
    fused.expert_ffn(got, g, wg, up, wd, x, ids, wts, (qg, qd), (i8g, i8d), (sg, sd), fused.ACT_SILU,
                     bd=bd if form == "biased" else None, **biases)
    assert np.array_equal(g, g0) and np.array_equal(got, want)

    if form == "biased":
        wu_, up0, bu_ = wu, 0, fused.expert_bias(bu, E, F)
        for workers in (1, 5):               # 5 workers on fewer threads: a thread runs several
            w_out = np.zeros_like(want)
            fused._expert_ffn(w_out, np.zeros_like(g0), wg, wu_, up0, wd, x, ids, wts,
                              fused.expert_bias(bg, E, F), bu_, fused.expert_bias(bd, E, D), (sg, sd),
                              fused.ACT_SILU, workers, qg, i8g, qd, i8d)
            assert np.array_equal(w_out, want), workers

    split = wg[:, :F], wg[:, F:]
    ref = _reference(x.astype(np.float64), *((split[0], split[1]) if form == "merged" else (wg, wu)), wd,
                     ids, wts, *((bg, bu, bd) if form == "biased" else (zero, zero, zero)))
    tol = 2e-2 if i8g or i8d else 1e-4       # the 8-bit path rounds x and the GLU's output
    assert np.abs(got - ref).max() <= tol * np.abs(ref).max()


@numba.njit(parallel=True)
def _phases(n_workers, n1):
    """Phase 1's items write marks; after wait_for each worker counts them all."""
    done, queue = counters(1), new_queue(n1, n_workers)
    marks = np.zeros(n1, np.int64)
    seen = np.zeros(n_workers, np.int64)
    for w in numba.prange(n_workers):
        item = next_item(queue, w)
        while item >= 0:
            marks[item] = 1
            fetch_add(done, 0, 1)
            item = next_item(queue, w)
        wait_for(done, 0, n1)
        for i in range(n1):
            seen[w] += marks[i]
    return seen


@pytest.mark.parametrize("n_workers", [1, 2, 7])
def test_wait_for_orders_the_phases(n_workers):
    assert (_phases(n_workers, 1000) == 1000).all()
