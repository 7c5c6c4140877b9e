"""work_queue: every item runs exactly once, own share first, then the other shares in turn;
the expert products give the same bits for any number of workers."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from numba import njit, prange

from nbmoe.cpu import fused, matmul
from nbmoe.cpu.work_queue import new_queue, next_item


@njit(parallel=True, cache=True)
def _claims(n_items, n_workers):
    """claims[w, i] = 1 where worker w ran item i."""
    queue = new_queue(n_items, n_workers)
    claims = np.zeros((n_workers, n_items), np.int64)
    for w in prange(n_workers):
        item = next_item(queue, w)
        while item >= 0:
            claims[w, item] += 1
            item = next_item(queue, w)
    return claims


@njit(cache=True)
def _sequence(n_items, n_workers, worker):
    """The items `worker` takes when it runs alone after the others took nothing."""
    queue = new_queue(n_items, n_workers)
    out = []
    item = next_item(queue, worker)
    while item >= 0:
        out.append(item)
        item = next_item(queue, worker)
    return out


@pytest.mark.parametrize("n_items,n_workers", [(0, 2), (1, 3), (7, 2), (64, 5), (5, 8)])
def test_every_item_runs_once(n_items, n_workers):
    claims = _claims(n_items, n_workers)
    assert (claims.sum(axis=0) == 1).all()


def test_own_share_first_then_the_next_shares():
    # 10 items over 3 workers: shares [0, 3), [3, 6), [6, 10)
    assert _sequence(10, 3, 1) == [3, 4, 5, 6, 7, 8, 9, 0, 1, 2]
    assert _sequence(10, 3, 2) == [6, 7, 8, 9, 0, 1, 2, 3, 4, 5]
    assert _sequence(4, 8, 0) == [0, 1, 2, 3]          # empty shares are passed over


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0"])
def test_expert_products_same_bits_for_any_worker_count(name):
    """glu_id's kernel (gate = up = w) and down_combine (down = w) at 1, 2, 3 and 16 workers:
    the same bits, and within int8 error of float64 over gguf-py's dequantization."""
    qt = int(GGMLQuantizationType[name])
    rng = np.random.default_rng(7)
    E, F, T, A = 6, 64, 2, 3                                 # w [E, F, F]: gate, up and down
    w = np.stack([quantize(rng.standard_normal((F, F), dtype=np.float32), qt) for _ in range(E)])
    w.flags.writeable = False        # as the mmap'd weights: the engine's compiled signature
    x = rng.standard_normal((T, 1, F), dtype=np.float32)
    ids = np.array([[0, 4, 5], [4, 1, 2]], np.int32)
    wts = rng.random((T, A), dtype=np.float32)
    int8 = matmul._int8(qt)
    results = []
    for n_workers in (1, 2, 3, 16):
        g = np.zeros((T, A, F), np.float32)
        matmul._mul_mat_id_vec(g, w, x, ids, qt, ids.size + 1, int8, 4, w, 0, matmul.ACT_SILU,
                               fused.EMPTY, fused.EMPTY, n_workers)
        out = np.zeros((T, F), np.float32)
        fused.down_combine(out, w, g, ids, wts, fused.EMPTY, qt, int8, 6, n_workers)
        results.append((g, out))
    for g, out in results[1:]:
        assert np.array_equal(g, results[0][0]) and np.array_equal(out, results[0][1])
    deq = dequantize(w, qt).astype(np.float64)              # [E, F, F]
    g, out = results[0]
    for t in range(T):
        y = np.zeros(F)
        for a in range(A):
            gate = deq[ids[t, a]] @ x[t, 0]
            ref = gate / (1 + np.exp(-gate)) * gate          # silu(gate) * up
            assert np.abs(g[t, a] - ref).max() <= 2e-2 * np.abs(ref).max()
            y += wts[t, a] * (deq[ids[t, a]] @ g[t, a].astype(np.float64))
        assert np.abs(out[t] - y).max() <= 2e-2 * np.abs(y).max()


def test_expert_items_per_thread_follow_the_thread_count(monkeypatch):
    """Finer expert items with many threads (balance), whole shares with few (long streams)."""
    for threads, per in ((2, 1), (8, matmul.EXPERT_ITEMS_PER_THREAD), (16, matmul.EXPERT_ITEMS_PER_THREAD)):
        monkeypatch.setattr(matmul.numba, "get_num_threads", lambda t=threads: t)
        assert matmul.expert_items_per_thread() == per
        rows = matmul.expert_item_rows(2048, 432, 1)              # Q4_0 768-wide expert rows
        assert rows == 2048 // (threads * per) == matmul.item_rows(2048, 432, 1, None, per)
