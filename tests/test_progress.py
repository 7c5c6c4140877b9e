"""The long waits of loading report their progress (nbmoe/progress.py): each task's steps add
up to its total, which is the bytes it handles."""
import mmap

import cuda_setup  # noqa: F401  (selects the simulator before numba.cuda loads)
import numpy as np

import nbmoe
from nbmoe import progress

MOE = dict(arch="qwen3moe", n_layer=1, n_embd=32, n_head=2, n_head_kv=1, head_dim=32, n_ff=64,
           n_expert=4, n_expert_used=2, n_ff_exp=32)


class Record:
    def __init__(self):
        self.tasks = {}

    def start(self, description, total):
        self.tasks[description] = [total, 0, False]
        return description

    def advance(self, i, n):
        self.tasks[i][1] += n

    def finish(self, i):
        self.tasks[i][2] = True


def test_repack_reports_its_bytes(tiny_model):
    path = tiny_model(**MOE, default_type="Q4_0")
    with progress.listening(Record()) as rec:
        llm = nbmoe.load(path, n_ctx=16, threads=1, repack=True)
    total, done, finished = rec.tasks["repacking for the CPU (-rtr)"]
    assert finished and done == total == sum(llm.weights[n].n_bytes for n in llm.repacked)
    assert total > 0


def test_upload_reports_its_bytes(tiny_model):
    path = tiny_model(**MOE, default_type="Q8_0")
    with progress.listening(Record()) as rec:
        llm = nbmoe.load(path, n_ctx=16, threads=1, n_gpu_layers=99)
    total, done, finished = rec.tasks["uploading weights to CUDA0"]
    on_gpu = [n for n, (b, _) in llm.placement.items() if b == "CUDA0"]
    assert finished and done == total == sum(llm.weights[n].n_bytes for n in on_gpu)


def test_read_in_covers_the_span(tmp_path, monkeypatch):
    """Reading pages in before page-locking them: every byte of the span is counted, in steps."""
    from nbmoe.cuda import host_memory
    monkeypatch.setattr(host_memory, "READ_IN_STEP", 3 * mmap.PAGESIZE)
    f = tmp_path / "span.bin"
    f.write_bytes(np.arange(10 * mmap.PAGESIZE, dtype=np.uint8).tobytes())
    with open(f, "rb") as fh, progress.listening(Record()) as rec:
        m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        base = np.frombuffer(m, np.uint8).ctypes.data
        host_memory._read_in(m, base + mmap.PAGESIZE, base + 9 * mmap.PAGESIZE)
    (total, done, finished), = rec.tasks.values()
    assert finished and done == total == 8 * mmap.PAGESIZE


def test_nobody_listening_costs_nothing():
    with progress.task("a wait", 10) as advance:
        advance(10)
    assert progress.chunks(10, 4) == [(0, 4), (4, 8), (8, 10)]


def test_merge_reports_its_bytes(tiny_model):
    """-muge: the experts merged in RAM (with -ngl 99 -ot exps=CPU: the GPU's merge is its
    upload); their bytes, the merged tensors'."""
    path = tiny_model(**MOE, default_type="Q8_0")
    with progress.listening(Record()) as rec:
        llm = nbmoe.load(path, n_ctx=16, threads=1, n_gpu_layers=99, override_tensors=["exps=CPU"],
                         merge_up_gate=True)
    total, done, finished = rec.tasks["merging up and gate experts (-muge)"]
    assert finished and done == total == llm.weights["blk.0.ffn_gate_up_exps.weight"].n_bytes
