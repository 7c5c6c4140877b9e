"""The messages of expert parallelism, over MPI (mpi4py), and waiting for them with a bound.

Legend: T tokens of the micro-batch, D model dim, A chosen experts per token, R ranks.

Per MoE layer and micro-batch (rank 0 <-> rank r, one message each way):
  WORK  0 -> r  header int64 [4] (command, layer, T, exit code) | h f32 [T, D] |
                ids int32 [T, A] | weights f32 [T, A]        (command LAYER or STOP)
  SUM   r -> 0  f32 [1 + T*D]: status (0 ok, 1 failed: an ERROR message went first) | the
                rank's partial sum [T, D]
  ERROR r -> 0  the cause of a failure, text (pickled)
  HELLO r -> 0  once, at start: {"digest", "error", "host", "share"} (pickled)
Rank 0 sends WORK to each rank itself rather than by a broadcast: a rank learns T from the
message's size, and waits for it without spinning; the sums come back one receive per rank
(rather than one reduce) so that rank 0 can name a rank whose answer does not come.
MPI's blocking waits spin a core, so every wait here polls, then sleeps between polls
(config.EP_SPIN_S, EP_PAUSE): a rank idles while a chat's user types.
"""
import os
import time

import numpy as np

from nbmoe import config
from nbmoe.errors import NbmoeError

WORK, SUM, ERROR, HELLO = 11, 12, 13, 14
LAYER, STOP = 1, 2
HEADER = 4                  # int64 values before a WORK message's arrays


def mpi():
    """mpi4py's MPI module (importing it starts MPI), or one line saying how to install it."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise NbmoeError("--ep needs mpi4py and an MPI library: pip install 'nbmoe[mpi]' "
                         "(mpich and mpi4py), then run mpiexec -n R python -m nbmoe ...") from None
    return MPI


def poll(test, timeout=None):
    """Call test() until it returns true: True, or False once `timeout` seconds passed."""
    clock = time.perf_counter
    t0 = clock()
    spin_until, pause = t0 + config.EP_SPIN_S, config.EP_PAUSE[0]
    while not test():
        now = clock()
        if timeout is not None and now - t0 > timeout:
            return False
        if now > spin_until:
            time.sleep(pause)
            pause = min(2 * pause, config.EP_PAUSE[1])
        else:
            os.sched_yield()        # spinning, but a rank sharing the core runs first
    return True


def work_bytes(T, D, A):
    return 8 * HEADER + 4 * T * (D + 2 * A)


def pack_work(buf, command, layer=0, code=0, h=None, ids=None, wts=None):
    """Write a WORK message into the uint8 buffer `buf`; returns its used prefix."""
    T, D = (0, 0) if h is None else h.shape
    A = 0 if ids is None else ids.shape[1]
    n = work_bytes(T, D, A)
    buf[:8 * HEADER].view(np.int64)[:] = (command, layer, T, code)
    if T:
        o = 8 * HEADER
        for arr in (h, ids, wts):
            k = arr.size * 4
            buf[o:o + k].view(arr.dtype).reshape(arr.shape)[:] = arr
            o += k
    return buf[:n]


def unpack_work(msg, D, A):
    """(command, layer, code, h [T, D], ids [T, A], wts [T, A]) views of a WORK message."""
    command, layer, T, code = (int(v) for v in msg[:8 * HEADER].view(np.int64))
    o = 8 * HEADER
    h = msg[o:o + 4 * T * D].view(np.float32).reshape(T, D)
    o += 4 * T * D
    ids = msg[o:o + 4 * T * A].view(np.int32).reshape(T, A)
    wts = msg[o + 4 * T * A:o + 8 * T * A].view(np.float32).reshape(T, A)
    return command, layer, code, h, ids, wts


class Grow:
    """A uint8 buffer that grows to the largest message asked for."""

    def __init__(self):
        self.buf = np.empty(0, np.uint8)

    def __call__(self, n):
        if self.buf.shape[0] < n:
            self.buf = np.empty(n, np.uint8)
        return self.buf
