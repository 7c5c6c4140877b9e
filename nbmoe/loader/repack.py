"""-rtr: repack the CPU's Q4_0 / Q4_1 / Q8_0 / IQ4_NL / MXFP4 / Q4_K / IQ4_XS matrices at load time
(llama.cpp / ik_llama.cpp's run-time repacking), into the 16-row interleaved layouts of
cpu/quants_rtr.py, cpu/quants_rtr_k.py and cpu/quants_rtr_xs.py.

Which tensors: those placed in RAM (buffer type CPU), of those types, with at least 16 rows
per matrix, that the graph only multiplies by (MUL_MAT / MUL_MAT_ID). Not repacked: tensors
on a GPU (their copy there is what runs), and the embedding matrix, which GET_ROWS reads a row
at a time (a tied output layer gets a repacked copy of its own under `output.weight`). Weights
that a GPU offloads for large batches are uploaded from the GGUF bytes, as without -rtr.

The copies live in anonymous memory; the mmap'd pages they were made from are dropped
(madvise DONTNEED: the kernel may reclaim them, and re-reads the file if they are touched again).
"""
import time

from nbmoe import progress
from nbmoe.cpu.quants_rtr import GROUP, R16, repack_tensor
from nbmoe.memory import check_memory

GET_ROWS_WEIGHTS = ("token_embd.weight",)


def repackable(name, t, buftype):
    # a merged gate / up (-muge) only where its up half starts a group of 16 rows
    halves = "_gate_up_exps." not in name or (t.ne[1] // 2) % GROUP == 0
    return (buftype == "CPU" and int(t.ggml_type) in R16 and name not in GET_ROWS_WEIGHTS
            and len(t.ne) >= 2 and t.ne[1] >= GROUP and halves)


def repack_weights(gguf, weights, placement):
    """({name: (repacked array, qtype)}, stats) for the repackable tensors of `weights`."""
    t0 = time.perf_counter()
    names = [n for n, t in weights.items() if repackable(n, t, placement[n][0])]
    check_memory(sum(weights[n].n_bytes for n in names), "the repacked weights (-rtr)")
    out = {}
    shared = {id(weights[n]) for n in GET_ROWS_WEIGHTS if n in weights}
    with progress.task("repacking for the CPU (-rtr)", sum(weights[n].n_bytes for n in names)) as advance:
        for name in names:
            t = weights[name]
            arr, qtype = repack_tensor(t.data, t.ggml_type)
            arr.flags.writeable = False   # typed as the GGUF's read-only weights: no second compile
            out[name] = arr, qtype
            # a tied embedding's pages stay (GET_ROWS reads them); a merge (-muge) has none
            if id(t) not in shared and t.offset is not None:
                gguf.drop_pages(t.offset, t.n_bytes)
            advance(t.n_bytes)
    return out, dict(tensors=len(out), bytes=sum(a.nbytes for a, _ in out.values()),
                     seconds=time.perf_counter() - t0)
