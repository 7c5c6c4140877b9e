"""The ranks other than 0: open the file, map their expert share, then compute each layer's
partial sums until rank 0 says stop (comm.py has the messages).

A failure at start (the file cannot be opened, a bad model) goes to rank 0 in the HELLO; one
while computing goes as an ERROR message: rank 0 prints it naming the rank, and all ranks exit.
Ctrl-C (mpiexec sends it to every rank) is rank 0's to handle: it stops the others.
"""
import os
import signal
import socket

import numba
import numpy as np

from nbmoe.errors import NbmoeError
from nbmoe.parallel import comm as msg
from nbmoe.parallel.experts import ExpertShare, index_hash, layout_of

# Tests only: "RANK:N" makes rank RANK exit when its N-th layer message arrives (a lost rank).
_TEST_EXIT = os.environ.get("NBMOE_TEST_EP_EXIT", "")


def open_share(path, rank, n_ranks, override_tensors=(), device=None):
    """(file digest, ExpertShare) of this rank, whose experts the even split and the -ot
    RANKn rules give it, on GPU `device` if not None; raises on a file it cannot use."""
    from nbmoe.backends.cpu import CPUBackend
    from nbmoe.cpu import matmul
    from nbmoe.loader.gguf_file import GGUFFile
    from nbmoe.model.arch import config_from_meta
    from nbmoe.model.forward import check_tensors
    gguf = GGUFFile(path)
    emb = gguf.tensors.get("token_embd.weight")
    cfg = config_from_meta(gguf.meta, emb.ne[1] if emb is not None else None, gguf.tensors)
    check_tensors(cfg, gguf.tensors, matmul.is_supported)
    spans = {il: shares[rank] for il, shares in layout_of(cfg, n_ranks, override_tensors).items()}
    if device is not None:
        from nbmoe.parallel.gpu_share import GPUExpertShare
        return index_hash(gguf), GPUExpertShare(cfg, CPUBackend(gguf.tensors), spans, device)
    return index_hash(gguf), ExpertShare(cfg, CPUBackend(gguf.tensors), spans)


def warm_up(share):
    """Run the share's kernels once for one token and for a prompt's batch, so that a cold
    start compiles them before rank 0 waits on this rank (its wait is bounded)."""
    D, A = share.cfg.n_embd, share.cfg.n_expert_used
    il = next(iter(share.layers), None)
    if il is None:                  # -ot RANKn rules left this rank no experts
        return
    for T in (1, 16):
        ids = np.full((T, A), share.spans[il][0], np.int32)
        ids[:, 1:] = -1
        share.compute(np.empty((T, D), np.float32), il, np.ones((T, D), np.float32), ids,
                      np.ones((T, A), np.float32))


def serve(comm, path, threads, override_tensors=(), gpu=False):
    """The loop of a rank > 0; returns the exit code rank 0 sends with STOP."""
    from nbmoe.load_order import preload
    MPI = msg.mpi()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank, hello = comm.Get_rank(), {"host": socket.gethostname(), "error": None, "device": None}
    try:
        if threads:
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        preload()
        if gpu:
            from nbmoe.parallel.gpu_share import local_device
            hello["device"] = local_device(comm)
        digest, share = open_share(path, rank, comm.Get_size(), override_tensors, hello["device"])
        warm_up(share)
        hello.update(digest=digest, share=share.spans)
    except Exception as e:        # reported by rank 0, which then stops every rank
        hello["error"], share = str(e) if isinstance(e, NbmoeError) else f"{type(e).__name__}: {e}", None
    comm.send(hello, dest=0, tag=msg.HELLO)
    status, inbox, reply = MPI.Status(), msg.Grow(), np.empty(0, np.float32)
    exit_after = int(_TEST_EXIT.split(":")[1]) if _TEST_EXIT.split(":")[0] == str(rank) else 0
    n_layers = 0
    while True:
        msg.poll(lambda: comm.Iprobe(source=0, tag=msg.WORK, status=status))
        n = status.Get_count(MPI.BYTE)
        buf = inbox(n)[:n]
        comm.Recv(buf, source=0, tag=msg.WORK)
        D, A = (share.cfg.n_embd, share.cfg.n_expert_used) if share else (0, 0)
        command, layer, code, h, ids, wts = msg.unpack_work(buf, D, A)
        if command == msg.STOP:
            return code
        n_layers += 1
        if n_layers == exit_after:
            os._exit(1)
        T = h.shape[0]
        if reply.shape[0] < 1 + T * D:
            reply = np.empty(1 + T * D, np.float32)
        out = reply[1:1 + T * D].reshape(T, D)
        try:
            share.compute(out, layer, h, ids, wts)
            reply[0] = 0
        except Exception as e:
            comm.send(f"{type(e).__name__}: {e}", dest=0, tag=msg.ERROR)
            reply[0] = 1
        comm.Send(reply[:1 + T * D], dest=0, tag=msg.SUM)
