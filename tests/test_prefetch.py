"""cpu/prefetch.py: the rows each worker reads ahead are the ones it computes first."""
import numpy as np

from nbmoe.cpu.prefetch import LINE, expert_rows_ahead


def test_reads_each_workers_items_until_the_flag():
    E, F, row_bytes, step, W = 6, 40, 200, 16, 3
    rng = np.random.default_rng(0)
    w = rng.integers(0, 256, (E, 2 * F, row_bytes), dtype=np.uint8)     # gate rows, then up rows
    experts = np.array([4, 1, 4], np.int32)                             # a repeat: one expert
    lines, total = expert_rows_ahead(w, w, F, experts, F, step, np.zeros(1, np.int32), W)
    # items (expert, run of rows) for experts 1, 4 in id order: 3 runs each, all shared out
    want = sum(int(w[e, r0:min(F, r0 + step), ::LINE].astype(np.int64).sum()
                   + w[e, F + r0:F + min(F, r0 + step), ::LINE].astype(np.int64).sum())
               for e in (1, 4) for r0 in range(0, F, step))
    assert total == want
    assert lines == 2 * 2 * F * -(-row_bytes // LINE)
    assert list(expert_rows_ahead(w, w, F, experts, F, step, np.ones(1, np.int32), W)) == [0, 0]
