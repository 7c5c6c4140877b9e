"""-zce auto's share balancer (zero_copy.py): the decisions on given GPU / CPU share times.
(The engine measures those times on a real GPU: tests/test_hybrid.py.)"""
from nbmoe.sched.zero_copy import EVERY, RATIO_TTL, ShareBalancer


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
    assert twice(b, 150e-6, 190e-6) == 2     # at 3 the GPU took 200: still slower than 190
    assert twice(b, 150e-6, 250e-6) == 3     # the CPU slowed down: 3 (200 there) fits again
    assert twice(b, 150e-6, 160e-6) == 3     # near balance: stay
    assert twice(b, 150e-6, 148e-6) == 3     # within the 2% slack: stay
    assert b.update(205e-6, 195e-6) == 3     # an outlier among 230 us CPU shares: stay
    assert b.update(205e-6, 230e-6) == 3
    assert twice(b, 204e-6, 191e-6) == 3     # the CPU took 1.27x as long at 2 (190 / 150): stay
    assert twice(ShareBalancer(3, 8), 204e-6, 191e-6) == 2   # the same times, no memory: 2


def test_remembers_what_a_move_cost():
    """A move's CPU time ratio (first token after it / last before it) keeps the balancer
    from a move that would slow the layer, for RATIO_TTL measured tokens (times recorded on
    an H200 machine: the CPU share took 1.14x as long with one expert more)."""
    b = ShareBalancer(3, 8)
    assert twice(b, 209e-6, 204e-6) == 2     # the GPU share is the slower: explore 2
    assert twice(b, 143e-6, 233e-6) == 3     # the CPU there: 233 vs 204, slower; back to 3
    # 209 at 3 against ~1.14 x 198 at 2: 3 stays, until the ratio is forgotten and 2 is
    # explored again (measured tokens 36 and 37 ask for it)
    shares = [twice(b, 209e-6, 198e-6) for _ in range(RATIO_TTL // 2 + 1)]
    assert set(shares[:-1]) == {3} and shares[-1] == 2


def test_bounds():
    top = ShareBalancer(7, 8)
    assert twice(top, 1e-6, 1.0) == 7         # at most A - 1: the CPU keeps a share
    low = ShareBalancer(1, 8)
    assert twice(low, 300e-6, 100e-6) == 0   # the GPU is slower even with one expert
    assert not any(low.due() for _ in range(4 * EVERY))   # nothing left to measure


# Per measured token (GPU share us, CPU share us a layer) at each share, as tools/zce_sweep.py
# printed them in four runs on H200 machines (Qwen3-30B-A3B shape, 8 of 128 experts, 16
# threads), the share whose fixed runs were the fastest there (same sweep, alternated rounds),
# and the least share of the replayed tokens the balancer must spend there.
TRACES = {
    "C": (2, 0.9, {3: [(204, 191), (204, 195), (204, 198), (202, 190), (211, 190)],
              2: [(147, 184), (145, 197), (144, 182), (145, 184), (146, 191), (143, 179)]}),
    "D": (3, 0.9, {3: [(207, 247), (208, 237), (210, 251), (199, 215), (200, 223), (201, 227),
                  (207, 251), (200, 230), (204, 227), (213, 248), (201, 226), (202, 223), (205, 195)],
              2: [(151, 237), (142, 227), (146, 222)]}),
    "F": (3, 0.9, {3: [(209, 192), (221, 204), (209, 222), (203, 210), (209, 198), (205, 233),
                  (210, 214), (204, 211), (208, 225), (200, 224), (211, 228), (212, 217),
                  (226, 244), (227, 237)],
              2: [(143, 233), (146, 238)]}),
    "E": (3, 0.6, {3: [(202, 211), (206, 216), (204, 215), (199, 205), (203, 207), (191, 195),
                  (194, 199), (192, 198), (202, 185), (198, 169)],
              2: [(138, 224), (141, 239), (144, 201), (147, 213), (145, 201), (149, 202)]}),
}


def test_replayed_traces_settle_on_their_best_share():
    """Replaying each run's measurements (cycled), the balancer spends most tokens at the
    run's best share; on E the CPU share sped up late in the trace (185, 169 us at 3), and
    the share follows it down and back up."""
    for run, (best, most, trace) in TRACES.items():
        b, seen, at = ShareBalancer(3, 8), {s: 0 for s in trace}, []
        for _ in range(60):
            S = b.share
            if S not in trace:                     # never measured there: scale by experts
                g, c = trace[3][0][0] * S / 3, trace[3][0][1]
            else:
                g, c = trace[S][seen[S] % len(trace[S])]
                seen[S] += 1
            at.append(S)
            b.update(g * 1e-6, c * 1e-6)
        assert at.count(best) >= most * len(at), (run, at)
