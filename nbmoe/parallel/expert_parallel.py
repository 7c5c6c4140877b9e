"""Rank 0's side of expert parallelism: the CPU backend that hands each MoE layer's experts
to the ranks, and the Cluster that exchanges the messages (comm.py) with them.

Every expert tensor stays on rank 0's CPU in the placement (cause `--ep R`), so a layer's
expert nodes, from its first MUL_MAT_ID to its MOE_COMBINE, are one run on the CPU; the
backend binds each run as two steps (cause `ep` in --explain):
  1. send the normed hidden states and the router's choices and weights to every rank that
     holds some of the layer's experts;
     (the layer's shared expert runs here, while the ranks compute: overlap_shared)
  2. compute rank 0's own share (experts.py), then add the ranks' partial sums to it (each
     waited for at most config.EP_TIMEOUT seconds: a rank that does not answer is named,
     and the run ends).
Routing, the shared experts, attention and the rest bind and fuse as without --ep (only the
one-token moe_block, which would do the experts itself, is not formed).
"""
import re
import socket
import sys
import time
from collections import defaultdict

import numpy as np

from nbmoe import config
from nbmoe.backends.cpu import CPUBackend, _no_step
from nbmoe.errors import NbmoeError
from nbmoe.parallel import cluster
from nbmoe.parallel import comm as msg
from nbmoe.parallel.experts import ExpertShare, index_hash, layout_of
from nbmoe.sched.placement import EXPERT_TENSORS, Override


class Cluster:
    """Rank 0's link to the other ranks (under nbmoe.parallel.launch)."""

    def __init__(self, comm):
        self.comm, self.size, self.MPI = comm, comm.Get_size(), msg.mpi()
        self.lost = None          # a rank that stopped answering: close() aborts the run
        self._hellos = None
        self.pending = None       # the exchange posted and not yet waited for
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

    def post(self, layer, h, ids, wts, ranks):
        """Send layer's h [T, D], ids [T, A], wts [T, A] to `ranks` and post the receives of
        their partial sums; wait() adds them. Returns what wait() takes."""
        if self.pending is not None:      # a step between post and wait raised: drain it
            pending, self.pending = self.pending, None
            self._collect(*pending[:3])
        (T, D), comm, MPI = h.shape, self.comm, self.MPI
        n = 1 + T * D
        for r in ranks:
            if self.replies[r].shape[0] < n:
                self.replies[r] = np.empty(n, np.float32)
        recvs = {r: comm.Irecv(self.replies[r][:n], source=r, tag=msg.SUM) for r in ranks}
        sends = []
        if ranks:
            work = msg.pack_work(self.outbox(msg.work_bytes(T, D, ids.shape[1])), msg.LAYER, layer,
                                 h=h, ids=ids, wts=wts)
            sends = [comm.Isend([work, MPI.BYTE], dest=r, tag=msg.WORK) for r in ranks]
        self.pending = (layer, recvs, sends, T, D)
        return self.pending

    def wait(self, pending, out):
        """out [T, D] += the partial sums of the ranks `pending` (from post) waits for."""
        self.pending = None
        layer, recvs, sends, T, D = pending
        self._collect(layer, recvs, sends)
        for r in recvs:
            if self.replies[r][0] != 0:
                raise NbmoeError(f"rank {r}: {self.comm.recv(source=r, tag=msg.ERROR)}")
        for r in recvs:
            out += self.replies[r][1:1 + T * D].reshape(T, D)

    def _collect(self, layer, recvs, sends):
        """Wait for every reply to `layer` ({rank: its receive}; at most config.EP_TIMEOUT
        seconds each time it is waited for); a Ctrl-C meanwhile is raised once they are in."""
        pending, interrupted = set(recvs), None

        def answered():
            for r in list(pending):
                if recvs[r].Test():
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
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(config.EP_ABORT_GRACE_S)     # the error line reaches mpiexec's output first
        self.comm.Abort(code or 1)


class ExpertParallel:
    """A model's experts over the ranks of the running Cluster (LLM's expert_parallel=R);
    override_tensors: the -ot rules, whose RANKn ones place whole layers' experts."""

    def __init__(self, gguf, cfg, n_ranks, override_tensors=(), gpu=False):
        cl = cluster()
        if cl is None or cl.size != n_ranks:
            raise NbmoeError(f"--ep {n_ranks} runs under mpiexec -n {n_ranks}, through the nbmoe "
                             "commands or nbmoe.parallel.launch")
        if not cfg.is_moe:
            raise NbmoeError(f"--ep shares out a MoE model's experts; {cfg.arch} has none")
        if n_ranks > cfg.n_expert:
            raise NbmoeError(f"--ep {n_ranks}: more ranks than the {cfg.n_expert} experts of a layer")
        self.layout = layout_of(cfg, n_ranks, override_tensors)     # {layer: [(lo, hi) per rank]}
        digest = index_hash(gguf)
        self.hosts, problems = {0: socket.gethostname()}, []
        self.devices = {0: None}               # rank -> its GPU (--ep-gpu) or None
        if gpu:
            from nbmoe.parallel.gpu_share import local_device
            self.devices[0] = local_device(cl.comm)
        for r, hello in sorted(cl.hellos().items()):
            self.hosts[r], self.devices[r] = hello["host"], hello.get("device")
            if hello["error"]:
                problems.append(f"rank {r} ({hello['host']}) cannot serve its experts: {hello['error']}")
            elif hello["digest"] != digest:
                problems.append(f"rank {r} ({hello['host']}) has a different model file: its tensor "
                                f"index differs from that of rank 0's {gguf.path}")
            elif hello["share"] != {il: spans[r] for il, spans in self.layout.items()}:
                problems.append(f"rank {r} ({hello['host']}) holds other experts than rank 0 gives "
                                "it: its -ot RANKn rules differ from rank 0's")
        if problems:
            raise NbmoeError("; ".join(problems))
        self.cluster, self.cfg, self.gguf, self.n_ranks = cl, cfg, gguf, n_ranks
        # per layer, the ranks > 0 that hold some of its experts (the others get no message)
        self.peers = {il: [r for r in range(1, n_ranks) if spans[r][1] > spans[r][0]]
                      for il, spans in self.layout.items()}
        self.share = None                      # rank 0's ExpertShare, made with its backend
        self.timed = defaultdict(float)        # layer -> seconds waiting on the ranks (--timings)

    def overrides(self):
        """Placement rules ahead of all others: every expert tensor on rank 0's CPU."""
        tag = f"--ep {self.n_ranks}"
        return [Override(EXPERT_TENSORS, re.compile(EXPERT_TENSORS), "CPU", tag)]

    def backend(self, weights, repacked, flash_attn="auto"):
        be = ExpertParallelBackend(weights, repacked, self, flash_attn)
        spans = {il: spans[0] for il, spans in self.layout.items()}
        if self.devices[0] is not None:
            from nbmoe.parallel.gpu_share import GPUExpertShare
            self.share = GPUExpertShare(self.cfg, be, spans, self.devices[0])
        else:
            self.share = ExpertShare(self.cfg, be, spans)
        return be

    def send(self, il, h, ids, wts):
        """Layer il's experts to the ranks that hold some of them (they start computing)."""
        return self.cluster.post(il, h, ids, wts, self.peers[il])

    def finish(self, pending, il, h, ids, wts, out):
        """out [T, D] = rank 0's share of layer il's experts + the other ranks' sums.
        Returns (seconds of rank 0's share, seconds waiting for the others)."""
        t0 = time.perf_counter()
        self.share.compute(out, il, h, ids, wts)
        t1 = time.perf_counter()
        self.cluster.wait(pending, out)
        return t1 - t0, time.perf_counter() - t1

    def explain_lines(self):
        """Each rank's share and the bytes a token costs on the links (--explain)."""
        cfg, R, layout = self.cfg, self.n_ranks, self.layout
        per_expert = {il: sum(self.gguf.tensors[f"blk.{il}.ffn_{k}_exps.weight"].n_bytes
                              for k in ("gate", "up", "down")) / cfg.n_expert for il in layout}
        lines = [f"expert parallelism over {R} MPI ranks (--ep {R}), {cfg.n_expert} experts "
                 f"per MoE layer ({len(layout)} layers):"]
        for r in range(R):
            runs = {}           # (lo, hi) -> the layers where rank r holds experts lo..hi-1
            for il, spans in layout.items():
                runs.setdefault(spans[r], []).append(il)
            held = [f"experts {lo}-{hi - 1} of {_layers(ils)}" for (lo, hi), ils in runs.items() if hi > lo]
            mib = sum(per_expert[il] * (spans[r][1] - spans[r][0]) for il, spans in layout.items()) / 2**20
            where = "" if self.devices.get(r) is None else f", on GPU {self.devices[r]}"
            lines.append(f"  rank {r} ({self.hosts.get(r, '?')}{where}): {'; '.join(held) or 'no experts'}, "
                         f"{mib:.1f} MiB of expert weights")
        out, back = 4 * cfg.n_embd + 8 * cfg.n_expert_used, 4 * cfg.n_embd
        msgs = sum(len(p) for p in self.peers.values())
        lines.append(f"  per token and MoE layer: {out} B to each other rank that holds some of its "
                     f"experts (normed x, choices, weights) and {back} B back (its partial sum): "
                     f"{(out + back) * msgs / 1024:.1f} KiB per token through rank 0")
        return lines


def _layers(ils):
    """'layer 3' / 'layers 0-9, 12' for sorted layer indices."""
    parts, i = [], 0
    while i < len(ils):
        j = i
        while j + 1 < len(ils) and ils[j + 1] == ils[j] + 1:
            j += 1
        parts.append(str(ils[i]) if i == j else f"{ils[i]}-{ils[j]}")
        i = j + 1
    return ("layer " if len(ils) == 1 else "layers ") + ", ".join(parts)


class ExpertParallelBackend(CPUBackend):
    """Rank 0's CPU backend: as CPUBackend, each MoE layer's expert run bound as an exchange:
    its first node sends, its MOE_COMBINE computes rank 0's share and waits for the others.
    The shared expert's nodes are moved between the two (config.EP_OVERLAP), so rank 0
    computes them while the other ranks compute their experts."""
    fuse_kinds = tuple(k for k in CPUBackend.fuse_kinds if k != "moe_block")

    def __init__(self, tensors, repacked, ep, flash_attn="auto"):
        super().__init__(tensors, repacked, flash_attn)
        self.ep = ep

    def prepare(self, graph):
        runs = expert_runs(graph.nodes)
        if config.EP_OVERLAP:
            graph.nodes[:] = overlap_shared(graph.nodes, runs)
        super().prepare(graph)
        for run in runs:
            for n in run:
                if n.backend != "CPU" or "slots" in n.params:
                    raise NbmoeError(f"--ep: {n.op} of {run[0].weight} is not on rank 0's CPU")
                n.cause = "ep"
                self._groups[id(n)] = ("expert_parallel", run)

    def bind(self, node, buf, state):
        group = self._groups.get(id(node))
        if group is None or group[0] != "expert_parallel":
            return super().bind(node, buf, state)
        # (the shared expert's groups bind between this run's members: its steps kept apart)
        members = group[1]
        if node is members[0]:
            self._ep_steps = self._bind_expert_parallel(members, buf, state)
        step = self._ep_steps[[id(n) for n in members].index(id(node))]
        return step if step is not None else _no_step

    def _bind_expert_parallel(self, members, buf, state):
        gate, comb = members[0], members[-1]
        il = int(gate.weight.split(".")[1])
        h, ids, wts, out = buf[gate.srcs[0]], buf[gate.srcs[1]], buf[comb.srcs[1]], buf[comb.out]
        send = _Send(self.ep, il, h, ids, wts)
        return [send] + [None] * (len(members) - 2) + [_Finish(self.ep, send, out)]


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


def overlap_shared(nodes, runs):
    """The nodes, with each layer's shared expert (the nodes after its MOE_COMBINE up to the
    ADD of shexp_out, forward.moe_ffn) moved before that MOE_COMBINE."""
    out, pos = list(nodes), {id(n): i for i, n in enumerate(nodes)}
    for run in reversed(runs):
        j = pos[id(run[-1])]
        k = next((i for i in range(j + 1, len(nodes)) if nodes[i].op == "ADD"
                  and list(nodes[i].srcs) == [run[-1].out, "shexp_out"]), None)
        if k is not None:
            out[j:k] = nodes[j + 1:k] + [nodes[j]]
    return out


class _Send:
    """The step that sends a layer's experts to the ranks (--timings: MOE_EP send)."""
    label = "MOE_EP send"

    def __init__(self, ep, il, h, ids, wts):
        self.ep, self.il, self.args, self.pending = ep, il, (h, ids, wts), None

    def __call__(self):
        self.pending = self.ep.send(self.il, *self.args)


class _Finish:
    """The step that computes rank 0's share of a layer's experts and adds the other ranks'
    sums; timed (--timings): rank 0's share on the CPU, and the wait beyond it for the others
    (their experts, the messages)."""
    label = "MOE_EP"

    def __init__(self, ep, send, out):
        self.ep, self.send, self.out = ep, send, out

    def __call__(self):
        self.ep.finish(self.send.pending, self.send.il, *self.send.args, self.out)

    def run_timed(self, acc):
        local, wait = self.ep.finish(self.send.pending, self.send.il, *self.send.args, self.out)
        acc[("CPU", "MOE_EP rank 0's experts")] += local
        acc[("MPI", "wait for the ranks' sums")] += wait
        self.ep.timed[self.send.il] += wait
