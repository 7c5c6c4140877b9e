"""Time one MoE layer's exchange of expert parallelism (--ep), as the engine does it, without
the experts: rank 0 sends every other rank the WORK message of T tokens (hidden states
[T, D] f32, choices and weights [T, A]) and waits for their partial sums [T, D] f32, through
the engine's own Cluster.post / wait (nbmoe/parallel); the ranks answer at once with zeros.

    mpiexec -n 2 python tools/ep_exchange.py [--dim 7168] [--active 8] [--tokens 1,8,512]

Prints per T: the bytes out and back per rank, the median round trip, and the bytes over
that time (both directions, all ranks) as GB/s. The T = 1 time is the exchange's latency.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nbmoe.parallel import comm as msg  # noqa: E402


def answer_zeros(comm, D, A):
    """A rank > 0: reply to each layer message with status 0 and zero sums, until STOP."""
    MPI = msg.mpi()
    status, inbox, reply = MPI.Status(), msg.Grow(), np.zeros(0, np.float32)
    while True:
        msg.poll(lambda: comm.Iprobe(source=0, tag=msg.WORK, status=status))
        n = status.Get_count(MPI.BYTE)
        buf = inbox(n)[:n]
        comm.Recv(buf, source=0, tag=msg.WORK)
        command, _, _, h, _, _ = msg.unpack_work(buf, D, A)
        if command == msg.STOP:
            return
        T = h.shape[0]
        if reply.shape[0] < 1 + T * D:
            reply = np.zeros(1 + T * D, np.float32)
        comm.Send(reply[:1 + T * D], dest=0, tag=msg.SUM)


def time_exchanges(cluster, D, A, T, reps, warm=5):
    """Seconds of each of `reps` round trips of a T-token layer to every other rank."""
    rng = np.random.default_rng(0)
    h = rng.standard_normal((T, D), dtype=np.float32)
    ids = rng.integers(0, 256, (T, A), dtype=np.int32)
    wts = rng.random((T, A), dtype=np.float32)
    out = np.zeros((T, D), np.float32)
    ranks = list(range(1, cluster.size))
    times = []
    for i in range(warm + reps):
        t0 = time.perf_counter()
        cluster.wait(cluster.post(0, h, ids, wts, ranks), out)
        if i >= warm:
            times.append(time.perf_counter() - t0)
    return np.array(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=7168, help="model dim D (default: DeepSeek-V3's 7168)")
    p.add_argument("--active", type=int, default=8, help="chosen experts per token A (default 8)")
    p.add_argument("--tokens", default="1,8,512", help="batch sizes T, comma list")
    p.add_argument("--reps", type=int, default=0, help="round trips per T (default: ~2 s worth)")
    args = p.parse_args()
    MPI = msg.mpi()
    comm = MPI.COMM_WORLD
    D, A = args.dim, args.active
    if comm.Get_rank() != 0:
        answer_zeros(comm, D, A)
        return
    if comm.Get_size() < 2:
        sys.exit("run it as mpiexec -n R python tools/ep_exchange.py (R >= 2)")
    from nbmoe.parallel.expert_parallel import Cluster
    cluster, R = Cluster(comm), comm.Get_size()
    print(f"{R} ranks ({MPI.Get_library_version().splitlines()[0].strip()}), D={D}, A={A}")
    print("| T | bytes out / rank | bytes back / rank | median us | p10-p90 us | GB/s (all bytes) |")
    print("|---:|---:|---:|---:|---:|---:|")
    try:
        for T in (int(t) for t in args.tokens.split(",")):
            reps = args.reps or max(20, int(2 / max(time_exchanges(cluster, D, A, T, 3).min(), 1e-5)))
            t = time_exchanges(cluster, D, A, T, min(reps, 5000))
            out_b, back_b = msg.work_bytes(T, D, A), 4 * (1 + T * D)
            med = float(np.median(t))
            print(f"| {T} | {out_b} | {back_b} | {med * 1e6:.1f} | {np.percentile(t, 10) * 1e6:.1f}-"
                  f"{np.percentile(t, 90) * 1e6:.1f} | {(out_b + back_b) * (R - 1) / med / 1e9:.2f} |",
                  flush=True)
    finally:
        cluster.close(0)


if __name__ == "__main__":
    main()
