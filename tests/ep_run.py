r"""Started by test_expert_parallel.py under mpiexec: rank 0 saves the logits of a prompt and
of two tokens generated after it, with the experts over every rank (--ep).

    mpiexec -n 2 python tests/ep_run.py model.gguf out.npy 2 [-ot rule]

With an -ot rule (e.g. blk\.1\.ffn_.*_exps=RANK1) it also writes --explain's lines on the
ranks' shares to out.npy.txt.
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
    n_ranks, ot = comm.Get_size(), sys.argv[4:]
    with parallel.launch(comm, path, 1, ot), friendly_errors():
        llm = load(path, n_ctx=32, threads=1, expert_parallel=n_ranks, override_tensors=ot)
        np.save(out, logits(llm))
        if ot:
            with open(out + ".txt", "w") as f:
                f.write("\n".join(llm.ep.explain_lines()))


if __name__ == "__main__":
    main()
