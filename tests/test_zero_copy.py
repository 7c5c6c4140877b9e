"""-zce auto's share balancer (zero_copy.py): the decisions on given GPU / CPU share times.
(The engine measures those times on a real GPU: tests/test_hybrid.py.)"""
from nbmoe.zero_copy import EVERY, ShareBalancer


def test_measures_every_few_tokens():
    b = ShareBalancer(3, 8)
    assert [b.due() for _ in range(2 * EVERY)].count(True) == 2


def twice(b, gpu_s, cpu_s):
    b.update(gpu_s, cpu_s)
    return b.update(gpu_s, cpu_s)


def test_moves_the_share_towards_balance():
    b = ShareBalancer(3, 8)
    assert b.update(200e-6, 150e-6) == 3     # the GPU share is the slower: once may be noise
    assert b.update(200e-6, 150e-6) == 2     # twice in a row: give one back
    assert twice(b, 100e-6, 200e-6) == 3     # 2 -> 3 keeps the GPU faster (150 < 200 * 5/6)
    assert twice(b, 150e-6, 160e-6) == 3     # near balance: stay
    assert twice(b, 150e-6, 148e-6) == 3     # within the 2% slack: stay
    assert b.update(205e-6, 195e-6) == 3     # an outlier among 230 us CPU shares (H200): stay
    assert b.update(205e-6, 230e-6) == 3
    assert twice(b, 204e-6, 191e-6) == 2     # measured on another H200 lend: 3 -> 2


def test_bounds():
    top = ShareBalancer(7, 8)
    assert twice(top, 1e-6, 1.0) == 7         # at most A - 1: the CPU keeps a share
    low = ShareBalancer(1, 8)
    assert twice(low, 300e-6, 100e-6) == 0   # the GPU is slower even with one expert
    assert not any(low.due() for _ in range(4 * EVERY))   # nothing left to measure
