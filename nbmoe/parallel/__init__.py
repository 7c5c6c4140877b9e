"""Expert parallelism over MPI: `mpiexec -n R python -m nbmoe.bench -m model.gguf --ep R`.

Rank 0 runs the command: everything that is not an expert (attention, dense and shared
weights, the KV cache, the sampler, its GPUs and placement flags) and its own share of the
experts. Every other rank maps the same GGUF, keeps a contiguous share of each MoE layer's
experts and computes their partial sums for each layer rank 0 sends it (worker.py).
  comm.py             the messages and bounded waits (mpi4py)
  experts.py          a rank's expert share and its partial sums (the CPU kernels)
  gpu_share.py        the same on the rank's GPU (--ep-gpu)
  worker.py           the loop of the ranks > 0
  expert_parallel.py  rank 0's side: the CPU backend that sends each layer's experts out

    comm = world(R)                       # None when R <= 1
    with launch(comm, path, threads, ot):  # ranks > 0 serve here and exit
        llm = nbmoe.load(path, expert_parallel=R, override_tensors=ot)
"""
import sys
from contextlib import contextmanager

from nbmoe.errors import NbmoeError

_cluster = None     # rank 0's Cluster while launch() runs


def world(n_ranks):
    """MPI's world communicator for --ep n_ranks (None for 1): it must hold n_ranks ranks."""
    if n_ranks is None or n_ranks <= 1:
        return None
    from nbmoe.parallel.comm import mpi
    MPI = mpi()
    comm = MPI.COMM_WORLD
    if comm.Get_size() != n_ranks:
        if comm.Get_rank() != 0:
            sys.exit(1)           # rank 0 says why
        raise NbmoeError(f"--ep {n_ranks} needs {n_ranks} MPI ranks, this run has "
                         f"{comm.Get_size()}: start it as mpiexec -n {n_ranks} python -m nbmoe ...")
    return comm


def cluster():
    """Rank 0's Cluster under launch(), else None."""
    return _cluster


@contextmanager
def launch(comm, path, threads=None, override_tensors=(), gpu=False):
    """On rank 0: run the body, then stop the other ranks with its exit code (or end the run
    at once if one is lost). On the others: serve experts until rank 0 stops them, then exit.
    override_tensors: the -ot rules rank 0 loads with (their RANKn rules place experts);
    gpu: the ranks compute their shares on their GPUs (--ep-gpu)."""
    global _cluster
    if comm is None:
        yield None
        return
    from nbmoe.parallel.expert_parallel import Cluster
    if comm.Get_rank() != 0:
        from nbmoe.parallel.worker import serve
        sys.exit(serve(comm, path, threads, override_tensors, gpu))
    _cluster = Cluster(comm)
    code = 1
    try:
        yield _cluster
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
        raise
    except KeyboardInterrupt:
        code = 130
        raise
    finally:
        _cluster.close(code)
        _cluster = None
