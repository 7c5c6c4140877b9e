"""-zce auto: the GPU's share of each generated token's chosen experts, balanced as it runs.

A MoE layer's GPU share (S experts whose weights the GPU reads from RAM over PCIe) and its
CPU share (the other A - S) run at the same time, and the next layer waits for the slower.
Which S balances them depends on the machine and moves with the RAM bandwidth the CPU gets.
So every EVERY-th generated token is measured: per layer, the GPU share's device time (CUDA
events around its graph) and the CPU share's host time (scheduler._LaunchAhead), and
ShareBalancer moves S by one when two measured tokens in a row ask for the same move:
  down  when the GPU share is the slower (by more than SLACK: noise), as the layer waits for
        it (the GPU's time grows with each expert, the CPU's hardly moves);
  up    when the GPU would still finish first with one expert more (its time there as
        last measured, or scaled by experts; the CPU's taken as it is now, see update).
The CPU share's speed swings with the RAM bandwidth the machine gets, so the share follows
it (tests/test_zero_copy.py replays recorded traces).
S = 0 (the CPU computes all) has no GPU share to measure: it is final.
A move also measures what it cost the CPU: the CPU share's time on the first measured token
after it over its time on the last one before it. For RATIO_TTL measured tokens the balancer
then makes that move again only if it expects the layer to get faster, GPU and CPU share
times both predicted: without that memory the share can oscillate (3 -> 2 -> 3) each time
its GPU share runs a little behind. Past RATIO_TTL the ratio is forgotten (the RAM's speed
drifts), and the move is explored again.
"""
import numpy as np

from nbmoe.model.graph import Node

EVERY = 8          # generated tokens between two measured ones
SAMPLE = 4         # of a measured token, every SAMPLE-th layer is timed
SLACK = 1.02       # the GPU share may take this much longer than the CPU's before S drops
RATIO_TTL = 32     # measured tokens a move's CPU time ratio is trusted (256 generated)


class ShareBalancer:
    def __init__(self, share, n_used):
        self.share, self.n_used, self.tokens, self.pending = share, n_used, 0, 0
        self.history = []            # (share, GPU seconds, CPU seconds) per measured token
        self.gpu_at = {}             # share -> its GPU share's last measured seconds
        self.cpu_ratio = {}          # (S, S2) -> (CPU time at S2 / at S, measured token number)
        self.moved = None            # (share, CPU seconds) of the last token before a move

    def due(self):
        """Whether to measure this generated token."""
        self.tokens += 1
        return self.share > 0 and self.tokens % EVERY == 0

    def update(self, gpu_s, cpu_s):
        """A measured token's per-layer GPU and CPU share times (medians) -> the share to use.
        A move needs two measured tokens in a row that ask for it (one can be an outlier)."""
        S, A = self.share, self.n_used
        self.history.append((S, gpu_s, cpu_s))
        self.gpu_at[S] = gpu_s
        n = len(self.history)
        if self.moved is not None:              # the first token after a move: its CPU ratio
            S0, cpu0 = self.moved
            self.cpu_ratio[(S0, S)] = (cpu_s / cpu0, n)
            self.moved = None

        def pays(S2, gpu2):
            """Whether moving to S2 is expected to shorten the layer (the GPU share there
            taking gpu2); with no recent ratio for that move: yes, explore it."""
            r = self.cpu_ratio.get((S, S2))
            if r is None or n - r[1] > RATIO_TTL:
                return True
            return SLACK * max(gpu2, cpu_s * r[0]) < max(gpu_s, cpu_s)
        # the GPU share with one expert more or less: as last measured there, else scaled by
        # experts; the CPU share's time, short of a ratio, as it is now (its fixed costs and
        # the RAM's swings dominate)
        gpu_up = self.gpu_at.get(S + 1, gpu_s * (S + 1) / S)
        gpu_down = self.gpu_at.get(S - 1, gpu_s * (S - 1) / S)
        want = 0
        if gpu_s > SLACK * cpu_s and pays(S - 1, gpu_down):
            want = -1
        elif S < A - 1 and SLACK * gpu_up < cpu_s and pays(S + 1, gpu_up):
            want = 1
        if want and want == self.pending:
            self.moved = (S, cpu_s)
            self.share, want = S + want, 0
        self.pending = want
        return self.share


def sampled_layers(plan):
    """The _LaunchAhead steps (one a shared layer) timed on a measured token: every
    SAMPLE-th, so that the events cost little (the last one needs a next layer)."""
    steps = plan.launch_ahead
    return steps[:-1][::SAMPLE] or steps[:1]


def measured_times(steps):
    """(GPU, CPU) share seconds of a layer, medians over `steps`, after a run with their
    `measure` set (and their cpu_share_seconds cleared before)."""
    gpu = [s.gpu_share_seconds() for s in steps]
    cpu = [s.cpu_share_seconds for s in steps if s.cpu_share_seconds is not None]
    return float(np.median(gpu)), float(np.median(cpu)) if cpu else float("inf")


# ---------------------------------------------------------------- the graph's split

def split_expert_slots(graph, slots, shared=()):
    """Rewrite one-token MoE layers for -zce: slots[il] = S > 0 splits layer il's chosen experts
    into a GPU share (slots 0..S-1: the GPU reads their weights from RAM in place) and the CPU's
    (S..A-1). The GPU's nodes (params zero_copy, slots) come first and add their weighted sum to
    the residual x themselves; the scheduler launches them without waiting for them, right after
    the copies the CPU's share needs, and the CPU's sum goes on to the layer's output as before.
    The experts' nodes run from a layer's first MUL_MAT_ID to the MOE_COMBINE into ffn_out.
    shared: the layers whose shared experts (weights on the routing GPU) join the GPU's share:
    they read only the normed x, so the GPU computes them while the CPU computes the routed
    experts, and adds them to x itself instead of to the CPU's sum."""
    nodes, out, i = graph.nodes, [], 0
    while i < len(nodes):
        n = nodes[i]
        il = int(n.weight.split(".")[1]) if n.op == "MUL_MAT_ID" and n.weight else None
        S = slots[il] if il is not None else 0
        if il is None or not (S or il in shared):
            out.append(n)
            i += 1
            continue
        j = next(k for k in range(i, len(nodes)) if nodes[k].op == "MOE_COMBINE")
        run, A = nodes[i:j + 1], graph.buffers["expert_ids"].shape[1]
        if S:
            out += _share(graph, run, "zc_", "zc_out", (0, S))
            out.append(Node("ADD", "x", ("x", "zc_out"), params={"zero_copy": True}))
        end = _shared_experts_end(nodes, j) if il in shared else None
        if end is not None:
            out += [Node(m.op, m.out, m.srcs, m.weight, {**m.params, "zero_copy": True})
                    for m in nodes[j + 1:end]]
            out.append(Node("ADD", "x", ("x", "shexp_out"), params={"zero_copy": True}))
        out += _share(graph, run, "exp_", run[-1].out, (S, A)) if S else run
        i = j + 1 if end is None else end + 1
    graph.nodes[:] = out
    return graph


def _shared_experts_end(nodes, j):
    """The index of the ADD ffn_out += shexp_out that ends the shared experts' nodes after a
    layer's MOE_COMBINE at nodes[j] (model.moe_ffn), None if the layer has none."""
    for k in range(j + 1, len(nodes)):
        n = nodes[k]
        if n.op == "ADD":
            return k if n.out == "ffn_out" and n.srcs == ("ffn_out", "shexp_out") else None
        if n.weight is not None and "_shexp." not in n.weight:
            return None
    return None


def _share(graph, run, prefix, out, slots):
    """The experts' nodes `run` over the chosen-expert slots lo..hi-1, on buffers of their own
    (named by the slots: a layer's buffers are shared by all layers, one set per shape); the
    GPU's share (prefix zc_) is marked zero_copy."""
    lo, hi = slots
    names = {b: f"{prefix}{lo}-{hi}_{b.split('_', 1)[1]}" for n in run for b in n.outs
             if b.startswith("exp_")}
    names[run[-1].out] = out
    for old, new in names.items():
        shape = list(graph.buffers[old].shape)
        if len(shape) == 3:                  # [T, A, F]: A becomes the share's slots
            shape[1] = hi - lo
        graph.buffer(new, shape, graph.buffers[old].dtype)
    return [Node(n.op, names.get(n.out, n.out), tuple(names.get(s, s) for s in n.srcs), n.weight,
                 {**n.params, "slots": slots, **({"zero_copy": True} if prefix == "zc_" else {})})
            for n in run]
