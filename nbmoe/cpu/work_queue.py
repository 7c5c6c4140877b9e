"""Work items shared out as threads become free: each worker runs its own contiguous share,
then takes the items left in other workers' shares.

prange hands worker w the items [w * n / W, (w + 1) * n / W) and nothing else, so a parallel
region lasts as long as its slowest thread (with 16 threads, a quarter of an expert call's
time: docs/kernels.md). Here worker w still starts on its own share, front to back (its reads
stay one stream for the hardware prefetchers), and when that is done it takes items from the
fronts of the other shares, one at a time. Each share's next item is a counter that workers
advance with an atomic add, so an item is run exactly once whoever takes it.

    queue [W * 8] int64: queue[8 w] = share w's next item, queue[8 w + 1] = its end,
    queue[8 w + 2] = how many shares past its own worker w has moved on (written by w alone)
    (eight words per worker: each counter on a cache line of its own, so the counters that
    threads advance do not bounce a shared line between cores)

Usage (W = numba.get_num_threads(), passed in from Python: called inside a kernel it makes
the kernel uncacheable, as Numba embeds a pointer for it; prange gives each worker index to
one thread, and with any other assignment every item still runs once):

    queue = new_queue(n_items, W)
    for w in prange(W):
        item = next_item(queue, w)
        while item >= 0:
            ...                                   # run the item
            item = next_item(queue, w)
"""
import numpy as np
from numba import njit, types
from numba.extending import intrinsic

WORDS = 8   # int64 words per worker: 64 bytes


@intrinsic
def fetch_add(typingctx, arr, i, v):
    """arr[i] += v as one atomic read-modify-write; returns arr[i] before the add (int64
    arrays only)."""
    def codegen(context, b, sig, args):
        a = context.make_array(sig.args[0])(context, b, args[0])
        return b.atomic_rmw("add", b.gep(a.data, [args[1]]), args[2], "seq_cst")
    return types.int64(arr, types.int64, types.int64), codegen


@njit(cache=True)
def new_queue(n_items, n_workers):
    """The counters for n_items split into n_workers contiguous shares (prange's split)."""
    queue = np.zeros(n_workers * WORDS, np.int64)
    for w in range(n_workers):
        queue[w * WORDS] = w * n_items // n_workers
        queue[w * WORDS + 1] = (w + 1) * n_items // n_workers
    return queue


@njit(cache=True, inline="always")
def next_item(queue, worker):
    """The next item for `worker`: from its own share while any is left, then from the
    shares after it in turn (it stays on a share until that is done); -1 when all are done."""
    n_workers = queue.shape[0] // WORDS
    for k in range(queue[worker * WORDS + 2], n_workers):
        s = worker + k
        if s >= n_workers:
            s -= n_workers
        item = fetch_add(queue, s * WORDS, 1)
        if item < queue[s * WORDS + 1]:
            queue[worker * WORDS + 2] = k
            return item
    queue[worker * WORDS + 2] = n_workers
    return -1
