"""Offloaded expert uploads (backends/expert_uploads.py) over several runs of one plan: each
product finds every expert its router chose byte for byte in its device copy, whatever the
upload held ahead, and the bytes uploaded follow the router's choices."""
import numpy as np
import pytest

from tests import cuda_setup  # noqa: F401  (the simulator unless NBMOE_REAL_GPU=1)

from nbmoe.backends import expert_uploads
from nbmoe.backends.cuda import CUDABackend

E, M, ROW = 8, 3, 16           # experts, rows an expert, bytes a row
LAYERS, T, A = 2, 4, 2          # three tensors a layer (gate, up, down) share a layer's ids


def run_plan(uploads, ids_dev, choices, hosts):
    """One run: per layer, write its ids (the router), then its three products check their
    device copy; returns the experts each product found."""
    found = []
    for i, host in enumerate(hosts):
        layer = i // 3
        if i % 3 == 0:
            ids_dev.copy_to_device(choices[layer])        # this layer's router ran
        dev = uploads.wait(i).copy_to_host()
        chosen = np.unique(choices[layer])
        assert np.array_equal(dev[chosen], host[chosen]), (i, chosen)
        uploads.done(i)
        found.append(chosen)
    return found


def mapped_tensors(be, rng):
    """Three random expert tensors a layer in page-locked host memory the GPU can read:
    (host arrays, their device views)."""
    pairs = [be.mapped_alloc((E, M, ROW), np.uint8) for _ in range(3 * LAYERS)]
    for host, _ in pairs:
        host[...] = rng.integers(0, 256, host.shape, dtype=np.uint8)
    return [h for h, _ in pairs], [v for _, v in pairs]


@pytest.mark.parametrize("start_whole", [False, True])
@pytest.mark.parametrize("by_kernel", [False, True])
def test_chosen_experts_arrive_in_place(monkeypatch, start_whole, by_kernel):
    monkeypatch.setattr(expert_uploads, "MAX_SLOTS", 4)     # 6 tensors through 4 slots: reused
    monkeypatch.setattr(expert_uploads, "RECENT_RUNS", 2)   # uploads hold two runs' choices
    be = CUDABackend("CUDA0", {}, [])
    rng = np.random.default_rng(1)
    hosts, views = mapped_tensors(be, rng)
    views = views if by_kernel else [None] * len(views)
    ids_dev = be.alloc((T, A), np.int32)
    uploads = expert_uploads.ExpertUploads(be)
    pairs = T * A if not start_whole else expert_uploads.START_WHOLE_PAIRS * E
    for i, (h, v) in enumerate(zip(hosts, views)):
        assert uploads.add(h, ids_dev, pairs, f"{i // 3}", v) == i
    assert uploads.n_slots == 4 and {t.runs for t in uploads.tensors} == {2}
    per_expert = M * ROW
    skewed = [rng.choice(4, (T, A)).astype(np.int32) for _ in range(LAYERS)]   # experts 0-3
    spread = [np.arange(T * A, dtype=np.int32).reshape(T, A) % E for _ in range(LAYERS)]

    def bytes_of(choices):
        before = uploads.settled().bytes
        run_plan(uploads, ids_dev, choices, hosts)
        return uploads.settled().bytes - before

    n_chosen = sum(3 * len(np.unique(c)) for c in skewed)
    assert bytes_of(skewed) == (3 * LAYERS * E if start_whole else n_chosen) * per_expert
    # the second run holds what each layer chose in the first, and adds what it missed
    shifted = [np.where(c == 0, 5, c).astype(np.int32) for c in skewed]    # expert 5 new
    missed = sum(3 * len(np.setdiff1d(np.unique(s), np.unique(c))) for s, c in zip(shifted, skewed))
    assert bytes_of(shifted) == (n_chosen + missed) * per_expert
    # the third holds what the last two runs chose
    both = sum(3 * len(np.union1d(s, c)) for s, c in zip(shifted, skewed))
    assert bytes_of(skewed) == both * per_expert
    # every expert chosen: the next run uploads whole tensors ahead, without completing them
    run_plan(uploads, ids_dev, spread, hosts)
    whole_before = uploads.whole
    assert bytes_of(spread) == 3 * LAYERS * E * per_expert
    assert uploads.whole - whole_before == 3 * LAYERS
    assert uploads.settled().last == E


def test_upload_all_never_reads_the_router():
    be = CUDABackend("CUDA0", {}, [])
    host = np.arange(E * M * ROW, dtype=np.uint8).reshape(E, M, ROW)
    ids_dev = be.alloc((T, A), np.int32)
    uploads = expert_uploads.ExpertUploads(be, upload_all=True)
    uploads.add(host, ids_dev, 1, "0")
    assert np.array_equal(uploads.wait(0).copy_to_host(), host)
    uploads.done(0)
    assert uploads.choices["0"].run == -1 and uploads.settled().bytes == host.nbytes


def test_id_runs():
    assert expert_uploads.id_runs(np.array([0, 1, 2, 5, 7, 8])) == [(0, 3), (5, 6), (7, 9)]
    assert expert_uploads.id_runs(np.array([], np.int64)) == []


def test_large_batches_remember_more_runs():
    be = CUDABackend("CUDA0", {}, [])
    host = np.zeros((E, M, ROW), np.uint8)
    uploads = expert_uploads.ExpertUploads(be)
    ids = be.alloc((T, A), np.int32)
    small = uploads.add(host, ids, expert_uploads.RECENT_MORE_PAIRS * E - 1, "0")
    large = uploads.add(host, ids, expert_uploads.RECENT_MORE_PAIRS * E, "1")
    assert uploads.tensors[small].runs == expert_uploads.RECENT_RUNS
    assert uploads.tensors[large].runs == expert_uploads.RECENT_RUNS_LARGE


def test_timeline_tool_times_each_tensor(capsys):
    """tools/expert_uploads_timeline.py: per run, an upload, a completion and an end for
    every tensor, and a report line a run (the simulator's clock gives no real times)."""
    from expert_uploads_timeline import Timeline
    tl = Timeline()
    uninstall = tl.install()
    try:
        be = CUDABackend("CUDA0", {}, [])
        rng = np.random.default_rng(2)
        hosts, views = mapped_tensors(be, rng)
        uploads = expert_uploads.ExpertUploads(be)
        ids_dev = be.alloc((T, A), np.int32)
        for i, (host, view) in enumerate(zip(hosts, views)):
            uploads.add(host, ids_dev, T * A, f"{i // 3}", view)
        choices = [rng.choice(E, (T, A)).astype(np.int32) for _ in range(LAYERS)]
        tl.on = True
        for _ in range(2):
            run_plan(uploads, ids_dev, choices, hosts)
        tl.report(1e9, 5e8)
    finally:
        uninstall()
    assert expert_uploads.ExpertUploads.wait.__name__ == "wait"
    assert len(tl.runs) == 2
    for r in tl.runs:
        assert sorted(r["up"]) == sorted(r["fill"]) == sorted(r["end"]) == list(range(3 * LAYERS))
    out = capsys.readouterr().out
    assert out.count("span ") == 3                         # two runs and the mean
    assert "0.50 GB uploaded ahead and 0.25 GB filled a micro-batch" in out


@pytest.mark.parametrize("expert_bytes", [200, 100, 50, 25])     # words of 8, 4, 2, 1 bytes
def test_fill_chosen_copies_chosen_experts_not_held(expert_bytes):
    """cuda/expert_fill.py alone: dst[e] becomes src[e] byte for byte for each expert chosen in
    ids and not held; every other expert keeps its bytes (NumPy's indexing as the reference).
    25 words an expert: more than the simulator's grid strides over, several times."""
    from numba import cuda
    from nbmoe.cuda import expert_fill
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, (6, expert_bytes), dtype=np.uint8)
    before = rng.integers(0, 256, (6, expert_bytes), dtype=np.uint8)
    ids = np.array([[0, 3], [3, 5], [1, 3]], np.int32)
    held = np.array([0, 1, 0, 0, 0, 0], np.int32)             # expert 1: chosen, but held
    dst = cuda.to_device(before)
    expert_fill.fill_chosen(dst, cuda.to_device(src), cuda.to_device(ids), cuda.to_device(held))
    want = before.copy()
    want[[0, 3, 5]] = src[[0, 3, 5]]
    assert np.array_equal(dst.copy_to_host(), want)
