"""What the engine decided and what it costs: `--explain` and `--timings` tables.

explain: where every class of tensor lives and why (blk.N. collapsed into layer ranges),
then, for a generated token and for a prompt micro-batch, the schedule: splits, copies and
bytes copied per micro-batch, and how many nodes run where for which cause.
timings: per backend, the time of each op type, copies and Python scheduling overhead (what
the wall clock saw beyond the steps) as shares of a token's time, like ik_llama.cpp's op
timing breakdown.
"""
import re
from collections import Counter, defaultdict

from rich.table import Table

CAUSES = {"wgt": "weight lives there", "off": "offloaded: RAM weight, large batch",
          "kv": "attention where its KV cache lives",
          "inp": "where most of its input bytes are", "def": "graph input",
          "zc": "GPU share of a token's experts (RAM weights read in place, -zce) and its "
                "shared experts, beside the CPU's",
          "ep": "a MoE layer's experts, shared over the MPI ranks (--ep)"}


def _ranges(nums):
    nums, out = sorted(nums), []
    for n in nums:
        if out and n == out[-1][1] + 1:
            out[-1][1] = n
        else:
            out.append([n, n])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)


def placement_table(placement):
    groups = defaultdict(list)
    for name, (buftype, cause) in placement.items():
        m = re.match(r"^blk\.(\d+)\.(.*)$", name)
        key = (m.group(2) if m else name, buftype, cause)
        groups[key].append(int(m.group(1)) if m else None)
    t = Table(title="tensor placement", title_justify="left")
    for col in ("tensor", "layers", "buffer", "cause"):
        t.add_column(col)
    for (name, buftype, cause), layers in sorted(groups.items(), key=lambda kv: (kv[0][0], min(x or 0 for x in kv[1]))):
        t.add_row(name, _ranges([x for x in layers if x is not None]) if layers[0] is not None else "",
                  buftype, cause)
    return t


def schedule_table(llm, batches):
    t = Table(title="schedule per micro-batch", title_justify="left")
    for col in ("batch", "splits", "copies", "MiB copied", "nodes by backend and cause"):
        t.add_column(col, justify="right" if col != "nodes by backend and cause" else "left")
    for n in batches:
        plan = llm.plan(n, 1)
        count = Counter((node.backend, node.cause) for node in plan.graph.nodes)
        offl = Counter(op for op, _ in {_op_instance(node) for node in plan.graph.nodes
                                         if node.cause == "off"})
        nodes = ", ".join(f"{b}/{c}: {k}" for (b, c), k in sorted(count.items()))
        if offl:
            nodes += " | offloaded: " + ", ".join(f"{op} x{k}" for op, k in sorted(offl.items()))
        fused = Counter((b, c) for _, b, c in {(_op_instance(n)[1], n.backend, n.cause)
                                               for n in plan.graph.nodes
                                               if n.policy_op != n.op and n.weight})
        if fused:
            nodes += " | MUL_MAT_ID_GLU: " + ", ".join(f"{b}/{c} x{k}" for (b, c), k in sorted(fused.items()))
        zc = [node for node in plan.graph.nodes if node.cause == "zc" and node.op == "MUL_MAT_ID"]
        if zc:
            nodes += (f" | GPU reads in place: {len({n.weight for n in zc})} expert tensors, "
                      f"{zc[0].params['slots'][1]} of each token's experts")
        mapped = sum(c.mapped for c in plan.copies)
        t.add_row(str(n), str(len(plan.splits)),
                  f"{len(plan.copies)}" + (f" ({mapped} mapped)" if mapped else ""),
                  f"{plan.copy_bytes / 2**20:.2f}", nodes)
    return t


def _op_instance(node):
    """(op name, what tells its instances apart): a fused op's nodes (MUL_MAT_ID_GLU: gate and
    up) count once per layer, any other node once per weight."""
    if node.policy_op != node.op:
        return node.policy_op, node.weight.split(".")[1] if node.weight else None
    return node.op, node.weight


def unfused_lines(llm, batches):
    """One line per batch size and backend naming the node variants that no fused kernel of
    that backend computes (they run on the plain path: fusion.FUSED_SUPPORT)."""
    from nbmoe.sched.fusion import unfused
    lines = []
    for n in batches:
        nodes = llm.plan(n, 1).graph.nodes
        for backend in sorted({node.backend for node in nodes}):
            count = Counter(_variant(node) for node in unfused(nodes, backend))
            if count:
                lines.append(f"unfused (batch {n}, {backend}): " +
                             ", ".join(f"{v} x{k}" for v, k in sorted(count.items())))
    return lines


def _variant(node):
    p = node.params
    if node.op == "GLU":
        return f"GLU {p['act']}"
    if node.op == "ATTN":
        return "ATTN with sinks"
    if node.op in ("ADD_BIAS", "ADD_BIAS_ID"):
        return f"{node.op} ({node.weight.split('.', 2)[-1]})"
    if node.op == "TOPK_MOE":
        return f"TOPK_MOE {p.get('gating')}" + (" + selection bias" if node.weight else "") + (
            f" groups {p['groups'][0]}/{p['groups'][1]}" if p.get("groups", (0, 0))[0] else "")
    return node.op


def legend():
    return "causes: " + "; ".join(f"{k} = {v}" for k, v in CAUSES.items())


def timings_table(acc, wall, n_tokens):
    """acc[(backend, op)] seconds over n_tokens runs; wall = their total wall-clock time."""
    t = Table(title=f"time per token ({n_tokens} tokens, {wall / n_tokens * 1e3:.2f} ms each)",
              title_justify="left")
    for col in ("backend", "op", "ms/token", "share"):
        t.add_column(col, justify="left" if col in ("backend", "op") else "right")
    for (backend, op), sec in sorted(acc.items(), key=lambda kv: -kv[1]):
        t.add_row(backend, op, f"{sec / n_tokens * 1e3:.3f}", f"{sec / wall:.1%}")
    overhead = wall - sum(acc.values())
    t.add_row("-", "Python scheduling / other", f"{overhead / n_tokens * 1e3:.3f}", f"{overhead / wall:.1%}")
    return t
