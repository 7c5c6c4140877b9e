"""Reading a layer's likely experts into the cores' caches while the GPU still routes it.

In hybrid generation (-ot exps=CPU with the router on a GPU) the CPU waits for each layer's
router, and the RAM sits idle meanwhile. The experts a layer chose for the last token are
likely chosen again, so each worker thread reads the rows it would compute for them first,
in the order it would compute them, until the GPU's flag says the router is done: the
expert product then finds its first items in the core's cache. A wrong guess costs nothing
but otherwise idle RAM time.

Items as matmul._mul_mat_id_vec shares them out for one token (fused.glu_id): the chosen
experts in id order, each cut into runs of `step` rows, item i = (expert i // n_runs, run
i % n_runs); work_queue gives worker w the items [w * n / W, (w + 1) * n / W) first.

    w, wu [E, rows, row_bytes] uint8: gate rows, up rows from up0 of each expert's block
    experts [A] int32: the last token's choice (any order, repeats allowed)
    flag [1] int32: set (non-zero) by the GPU once the router is done
"""
import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic

LINE = 64       # bytes a cache line: one load brings it in


@intrinsic
def load_acquire(typingctx, arr, i):
    """arr[i] as an atomic load: read from memory every time (the GPU writes it)."""
    def codegen(context, b, sig, args):
        a = context.make_array(sig.args[0])(context, b, args[0])
        return b.load_atomic(b.gep(a.data, [args[1]]), "acquire", sig.args[0].dtype.bitwidth // 8)
    return arr.dtype(arr, types.intp), codegen


@njit(cache=True, inline="always")
def _touch(rows):
    """A byte of each cache line of rows [R, row_bytes] (their sum: the loads stay)."""
    s = 0
    for r in range(rows.shape[0]):
        for j in range(0, rows.shape[1], LINE):
            s += rows[r, j]
    return s


@njit(parallel=True, cache=True)
def expert_rows_ahead(w, wu, up0, experts, M, step, flag, n_workers):
    """Each worker reads its first items' gate and up rows (see the module docstring) until
    flag[0] is set; returns [lines read, their bytes' sum] (returned: the loads stay)."""
    used = np.unique(experts)
    n_runs = (M + step - 1) // step
    n = used.shape[0] * n_runs
    read = np.zeros((n_workers, 2), np.int64)
    for worker in prange(n_workers):
        s, lines = 0, 0
        for item in range(worker * n // n_workers, (worker + 1) * n // n_workers):
            if load_acquire(flag, 0) != 0:
                break
            e, r0 = used[item // n_runs], item % n_runs * step
            r1 = min(M, r0 + step)
            s += _touch(w[e, r0:r1]) + _touch(wu[e, up0 + r0:up0 + r1])
            lines += 2 * (r1 - r0) * ((w.shape[2] + LINE - 1) // LINE)
        read[worker, 0], read[worker, 1] = lines, s
    return read.sum(axis=0)
