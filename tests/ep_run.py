"""Started by test_expert_parallel.py under mpiexec: rank 0 saves the logits of a prompt and
of two tokens generated after it, with the experts over every rank (--ep).

    mpiexec -n 2 python tests/ep_run.py model.gguf out.npy
"""
import sys

import numpy as np

PROMPT = [1, 5, 9, 2, 7, 3, 11, 4, 8, 6, 10, 12]      # 12 tokens: the ranks' batched path too


def logits(llm):
    """[len(PROMPT) + 2, V]: the prompt's logits, then those of two greedy tokens."""
    rows = [llm.eval(PROMPT)]
    for _ in range(2):
        rows.append(llm.eval([int(np.argmax(rows[-1][-1]))]))
    return np.concatenate(rows)


def main():
    from nbmoe import parallel
    from nbmoe.cli.common import friendly_errors
    from nbmoe.engine import load
    path, out = sys.argv[1], sys.argv[2]
    comm = parallel.world(int(sys.argv[3]) if len(sys.argv) > 3 else None)
    n_ranks = comm.Get_size()
    with parallel.launch(comm, path, threads=1), friendly_errors():
        np.save(out, logits(load(path, n_ctx=32, threads=1, expert_parallel=n_ranks)))


if __name__ == "__main__":
    main()
