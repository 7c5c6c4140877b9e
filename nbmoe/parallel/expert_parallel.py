"""Rank 0's side of expert parallelism: the CPU backend that hands each MoE layer's experts
to the ranks, and the Cluster that exchanges the messages (comm.py) with them.

Every expert tensor stays on rank 0's CPU in the placement (cause `--ep R`), so a layer's
expert nodes, from its first MUL_MAT_ID to its MOE_COMBINE, are one run on the CPU; the
backend binds each run as one step (cause `ep` in --explain) that
  1. sends the normed hidden states and the router's choices and weights to every rank,
  2. computes rank 0's own share meanwhile (experts.py),
  3. adds the ranks' partial sums to it as they come (each waited for at most
     config.EP_TIMEOUT seconds: a rank that does not answer is named, and the run ends).
Routing, the shared experts, attention and the rest bind and fuse as without --ep (only the
one-token moe_block, which would do the experts itself, is not formed).
"""
import re
import socket
import time
from collections import defaultdict

import numpy as np

from nbmoe import config
from nbmoe.backends.cpu import CPUBackend
from nbmoe.errors import NbmoeError
from nbmoe.parallel import cluster
from nbmoe.parallel import comm as msg
from nbmoe.parallel.experts import ExpertShare, index_hash, share_of
from nbmoe.sched.placement import EXPERT_TENSORS, Override


class Cluster:
    """Rank 0's link to the other ranks (under nbmoe.parallel.launch)."""

    def __init__(self, comm):
        self.comm, self.size, self.MPI = comm, comm.Get_size(), msg.mpi()
        self.lost = None          # a rank that stopped answering: close() aborts the run
        self._hellos = None
        self.outbox, self.replies = msg.Grow(), [np.empty(0, np.float32)] * self.size

    def hellos(self):
        """{rank: its HELLO} (rank 0 waits for them once, at the first model's load)."""
        if self._hellos is None:
            reqs, got = {r: self.comm.irecv(source=r, tag=msg.HELLO) for r in range(1, self.size)}, {}

            def arrived():
                for r, q in reqs.items():
                    if r not in got:
                        done, hello = q.test()
                        if done:
                            got[r] = hello
                return len(got) == len(reqs)
            if not msg.poll(arrived, config.EP_START_TIMEOUT):
                self.lost = min(set(reqs) - set(got))
                raise NbmoeError(f"rank {self.lost} did not report within {config.EP_START_TIMEOUT} s "
                                 "of the start (NBMOE_EP_START_TIMEOUT)")
            self._hellos = got
        return self._hellos

    def exchange(self, layer, h, ids, wts, out, local):
        """out [T, D] = local(out) + every rank's partial sum of this layer's experts for
        h [T, D], ids [T, A], wts [T, A]. Returns (seconds in local, seconds in all)."""
        (T, D), comm, MPI = h.shape, self.comm, self.MPI
        n = 1 + T * D
        for r in range(1, self.size):
            if self.replies[r].shape[0] < n:
                self.replies[r] = np.empty(n, np.float32)
        recvs = [comm.Irecv(self.replies[r][:n], source=r, tag=msg.SUM) for r in range(1, self.size)]
        work = msg.pack_work(self.outbox(msg.work_bytes(T, D, ids.shape[1])), msg.LAYER, layer,
                             h=h, ids=ids, wts=wts)
        sends = [comm.Isend([work, MPI.BYTE], dest=r, tag=msg.WORK) for r in range(1, self.size)]
        t0 = time.perf_counter()
        try:
            local(out)
        finally:            # (on an error too: the replies must not meet the next layer's receives)
            t1 = time.perf_counter()
            self._collect(layer, recvs, sends)
        for r in range(1, self.size):
            if self.replies[r][0] != 0:
                raise NbmoeError(f"rank {r}: {comm.recv(source=r, tag=msg.ERROR)}")
        for r in range(1, self.size):
            out += self.replies[r][1:n].reshape(T, D)
        return t1 - t0, time.perf_counter() - t0

    def _collect(self, layer, recvs, sends):
        """Wait for every rank's reply to `layer` (at most config.EP_TIMEOUT seconds each time
        it is waited for); a Ctrl-C meanwhile is raised once they are in."""
        pending, interrupted = set(range(1, self.size)), None

        def answered():
            for r in list(pending):
                if recvs[r - 1].Test():
                    pending.discard(r)
            return not pending
        while True:
            try:
                if not msg.poll(answered, config.EP_TIMEOUT):
                    self.lost = min(pending)
                    raise NbmoeError(f"rank {self.lost} sent no partial sums for layer {layer} within "
                                     f"{config.EP_TIMEOUT} s: it died, hangs or lost its link "
                                     "(NBMOE_EP_TIMEOUT)")
                break
            except KeyboardInterrupt as e:
                interrupted = e
        self.MPI.Request.Waitall(sends)
        if interrupted is not None:
            raise interrupted

    def close(self, code):
        """Stop every rank with exit code `code`; with a rank lost, abort the whole run."""
        if self.lost is None:
            stop = msg.pack_work(self.outbox(msg.work_bytes(0, 0, 0)), msg.STOP, code=code)
            sends = [self.comm.Isend([stop, self.MPI.BYTE], dest=r, tag=msg.WORK)
                     for r in range(1, self.size)]
            if msg.poll(lambda: self.MPI.Request.Testall(sends), config.EP_TIMEOUT):
                return
        self.comm.Abort(code or 1)


class ExpertParallel:
    """A model's experts over the ranks of the running Cluster (LLM's expert_parallel=R)."""

    def __init__(self, gguf, cfg, n_ranks):
        cl = cluster()
        if cl is None or cl.size != n_ranks:
            raise NbmoeError(f"--ep {n_ranks} runs under mpiexec -n {n_ranks}, through the nbmoe "
                             "commands or nbmoe.parallel.launch")
        if not cfg.is_moe:
            raise NbmoeError(f"--ep shares out a MoE model's experts; {cfg.arch} has none")
        if n_ranks > cfg.n_expert:
            raise NbmoeError(f"--ep {n_ranks}: more ranks than the {cfg.n_expert} experts of a layer")
        digest = index_hash(gguf)
        self.hosts, problems = {0: socket.gethostname()}, []
        for r, hello in sorted(cl.hellos().items()):
            self.hosts[r] = hello["host"]
            if hello["error"]:
                problems.append(f"rank {r} ({hello['host']}) cannot serve its experts: {hello['error']}")
            elif hello["digest"] != digest:
                problems.append(f"rank {r} ({hello['host']}) has a different model file: its tensor "
                                f"index differs from that of rank 0's {gguf.path}")
        if problems:
            raise NbmoeError("; ".join(problems))
        self.cluster, self.cfg, self.gguf, self.n_ranks = cl, cfg, gguf, n_ranks
        self.shares = [share_of(r, n_ranks, cfg.n_expert) for r in range(n_ranks)]
        self.share = None                      # rank 0's ExpertShare, made with its backend
        self.timed = defaultdict(float)        # layer -> seconds waiting on the ranks (--timings)

    def overrides(self):
        """Placement rules ahead of all others: every expert tensor on rank 0's CPU."""
        tag = f"--ep {self.n_ranks}"
        return [Override(EXPERT_TENSORS, re.compile(EXPERT_TENSORS), "CPU", tag)]

    def backend(self, weights, repacked, flash_attn="auto"):
        be = ExpertParallelBackend(weights, repacked, self, flash_attn)
        self.share = ExpertShare(self.cfg, be, *self.shares[0])
        return be

    def run(self, il, h, ids, wts, out):
        return self.cluster.exchange(il, h, ids, wts, out,
                                     lambda o: self.share.compute(o, il, h, ids, wts))

    def explain_lines(self):
        """Each rank's share and the bytes a token costs on the links (--explain)."""
        cfg, R = self.cfg, self.n_ranks
        moe = [il for il in range(cfg.n_layer) if cfg.is_moe_layer(il)]
        per_expert = sum(self.gguf.tensors[f"blk.{il}.ffn_{k}_exps.weight"].n_bytes
                         for il in moe for k in ("gate", "up", "down")) / cfg.n_expert
        lines = [f"expert parallelism over {R} MPI ranks (--ep {R}), {cfg.n_expert} experts "
                 f"per MoE layer ({len(moe)} layers):"]
        for r, (lo, hi) in enumerate(self.shares):
            lines.append(f"  rank {r} ({self.hosts.get(r, '?')}): experts {lo}-{hi - 1}, "
                         f"{per_expert * (hi - lo) / 2**20:.1f} MiB of expert weights")
        out, back = 4 * cfg.n_embd + 8 * cfg.n_expert_used, 4 * cfg.n_embd
        lines.append(f"  per token and MoE layer: {out} B to each other rank (normed x, choices, "
                     f"weights) and {back} B back (its partial sum): {(out + back) * (R - 1)} B "
                     f"through rank 0, {(out + back) * (R - 1) * len(moe) / 1024:.1f} KiB per token")
        return lines


class ExpertParallelBackend(CPUBackend):
    """Rank 0's CPU backend: as CPUBackend, each MoE layer's expert run bound as one exchange."""
    fuse_kinds = tuple(k for k in CPUBackend.fuse_kinds if k != "moe_block")

    def __init__(self, tensors, repacked, ep, flash_attn="auto"):
        super().__init__(tensors, repacked, flash_attn)
        self.ep = ep

    def prepare(self, graph):
        super().prepare(graph)
        for run in expert_runs(graph.nodes):
            for n in run:
                if n.backend != "CPU" or "slots" in n.params:
                    raise NbmoeError(f"--ep: {n.op} of {run[0].weight} is not on rank 0's CPU")
                n.cause = "ep"
                self._groups[id(n)] = ("expert_parallel", run)

    def _bind_expert_parallel(self, members, buf, state):
        gate, comb = members[0], members[-1]
        il = int(gate.weight.split(".")[1])
        h, ids, wts, out = buf[gate.srcs[0]], buf[gate.srcs[1]], buf[comb.srcs[1]], buf[comb.out]
        return [None] * (len(members) - 1) + [_Exchange(self.ep, il, h, ids, wts, out)]


def expert_runs(nodes):
    """Each MoE layer's expert nodes: from a MUL_MAT_ID of an expert tensor to the next
    MOE_COMBINE (forward.moe_ffn)."""
    runs, i = [], 0
    while i < len(nodes):
        n = nodes[i]
        if n.op == "MUL_MAT_ID" and n.weight and "_exps." in n.weight:
            j = next(k for k in range(i, len(nodes)) if nodes[k].op == "MOE_COMBINE")
            runs.append(nodes[i:j + 1])
            i = j + 1
        else:
            i += 1
    return runs


class _Exchange:
    """The step of one layer's experts; timed (--timings): rank 0's share on the CPU, and the
    wait beyond it for the other ranks' sums (sending, their experts, receiving)."""
    label = "MOE_EP"

    def __init__(self, ep, il, h, ids, wts, out):
        self.ep, self.il, self.args = ep, il, (h, ids, wts, out)

    def __call__(self):
        self.ep.run(self.il, *self.args)

    def run_timed(self, acc):
        local, total = self.ep.run(self.il, *self.args)
        acc[("CPU", "MOE_EP rank 0's experts")] += local
        acc[("MPI", "wait for the ranks' sums")] += total - local
        self.ep.timed[self.il] += total - local
