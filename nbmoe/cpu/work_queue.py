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

A region with phases (the experts' gate / up, then their down products, which read all of
the first phase's output) counts each finished item and waits for the count between phases
(wait_for): a worker that waits has found every item of the phase taken, and a taken item is
being run, so the wait ends whatever the assignment of workers to threads.

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
import platform

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from nbmoe import config

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


@njit(cache=True)
def counters(n):
    """n zeroed counters for fetch_add / wait_for, a cache line each (made outside the parallel
    kernel: there np.zeros would be a parallel loop of its own, a fork and join more)."""
    return np.zeros(n * WORDS, np.int64)


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


_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


@intrinsic
def load_acquire(typingctx, arr, i):
    """arr[i] read as an atomic load (acquire): a loop that polls it reads memory each time,
    without taking the line from the writers as a read-modify-write would (int64 arrays)."""
    def codegen(context, b, sig, args):
        a = context.make_array(sig.args[0])(context, b, args[0])
        v = b.load_atomic(b.gep(a.data, [args[1]]), "acquire", 8)
        return v
    return types.int64(arr, types.int64), codegen


@intrinsic
def _pause(typingctx):
    """The spin-wait hint (x86 PAUSE: the core yields to its sibling thread); nothing elsewhere."""
    def codegen(context, b, sig, args):
        if _X86:
            fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            b.call(fn, [])
        return context.get_dummy_value()
    return types.none(), codegen


@intrinsic
def _usleep(typingctx, us):
    """libc's usleep(us): the core goes idle, so the scheduler can bring a waiting thread there."""
    def codegen(context, b, sig, args):
        fn = cgutils.get_or_insert_function(
            b.module, ir.FunctionType(ir.IntType(32), [ir.IntType(32)]), "usleep")
        return b.call(fn, [b.trunc(args[0], ir.IntType(32))])
    return types.int32(us), codegen


@njit(cache=True)
def wait_for(counter, i, n):
    """Until counter[i] (advanced by fetch_add) reaches n: polls, then sleeps between looks,
    so that a waiter does not hold a core that a descheduled worker needs."""
    polls = 0
    while load_acquire(counter, i) < n:
        if polls < config.PHASE_POLLS:
            _pause()
            polls += 1
        else:
            _usleep(20)
