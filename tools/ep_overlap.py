"""What computing the shared expert while the ranks compute theirs gains (--ep, config.EP_OVERLAP):
one load, then rounds of generation alternating overlap on and off (plans rebuilt each time),
so that both see the same machine load. Prints the median t/s of each and the paired ratio.

    mpiexec -n 2 python tools/ep_overlap.py -m model.gguf [-ot "exps=RANK1"] [-n 32] [--rounds 8] [-t 1]
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", required=True)
    p.add_argument("-ot", "--override-tensor", action="append", default=[])
    p.add_argument("-n", type=int, default=32, help="tokens generated a round")
    p.add_argument("-p", type=int, default=0, help="also time a prompt of P tokens a round")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("-t", "--threads", type=int, default=1)
    args = p.parse_args()
    from mpi4py import MPI
    from nbmoe import config, parallel
    from nbmoe.cli.common import friendly_errors
    from nbmoe.engine import load
    R = MPI.COMM_WORLD.Get_size()
    comm = parallel.world(R)
    with parallel.launch(comm, args.model, args.threads, args.override_tensor), friendly_errors():
        llm = load(args.model, n_ctx=args.n + args.p + 8, threads=args.threads, expert_parallel=R,
                   override_tensors=args.override_tensor)
        rng = np.random.default_rng(0)
        rates = {True: [], False: [], "pp": {True: [], False: []}}
        for i in range(args.rounds + 1):            # round 0 warms both plans up
            for on in (True, False) if i % 2 else (False, True):
                config.EP_OVERLAP = on
                llm._plans.clear()
                llm.reset()
                prompt = [int(t) for t in rng.integers(0, llm.cfg.n_vocab, max(args.p, 1))]
                t0 = time.perf_counter()
                llm.eval(prompt)
                t1 = time.perf_counter()
                tok = prompt[-1]
                for _ in range(args.n):
                    tok = int(np.argmax(llm.eval([tok])[-1]))
                t2 = time.perf_counter()
                if i:
                    rates[on].append(args.n / (t2 - t1))
                    rates["pp"][on].append(len(prompt) / (t1 - t0))
        on, off = np.array(rates[True]), np.array(rates[False])
        print(f"--ep {R} {' '.join('-ot ' + o for o in args.override_tensor)}: tg{args.n} overlap "
              f"{np.median(on):.2f} t/s, without {np.median(off):.2f} t/s, paired ratio median "
              f"{np.median(on / off):.3f} (min {np.min(on / off):.3f}, max {np.max(on / off):.3f}, "
              f"{args.rounds} rounds)")
        if args.p:
            a, b = np.array(rates["pp"][True]), np.array(rates["pp"][False])
            print(f"  pp{args.p}: overlap {np.median(a):.1f} t/s, without {np.median(b):.1f} t/s, "
                  f"paired ratio median {np.median(a / b):.3f}")


if __name__ == "__main__":
    main()
