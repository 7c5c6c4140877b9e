"""Runs of graph nodes that a GPU backend binds to one fused kernel (decoding's launch count).

find_groups walks a plan's nodes (backends already assigned) and returns, per node id, the
group it belongs to: (kind, [nodes]). A group is a run of consecutive nodes on one GPU whose
intermediate results nobody else reads; kinds (nbmoe/cuda/fused.py has the kernels):

  products      2-3 MUL_MAT of one input, weights of one type (q, k, v)          T = 1
  glu           MUL_MAT gate, MUL_MAT up (one input), GLU of the two              T = 1
  glu_id        MUL_MAT_ID gate, MUL_MAT_ID up (one input, one ids), GLU          T <= 8
  down_combine  MUL_MAT_ID down, MOE_COMBINE of its output                       T <= 8
  rope_attn     [RMS_NORM q, RMS_NORM k], ROPE q, ROPE k, ATTN of those q, k      any T

Products need resident weights (cause `wgt`) on the matrix-vector path the fused kernels
share (`vec_ok(node)`; on the GPU, with x in 8 bits). The GPU fuses every kind
(nbmoe/cuda/fused.py), the CPU the products (nbmoe/cpu/fused.py).
"""
import os

# NBMOE_NO_FUSE=1 binds every node on its own (for A/B timings and debugging).
ENABLED = os.environ.get("NBMOE_NO_FUSE", "") != "1"
KINDS = ("products", "glu", "glu_id", "down_combine", "rope_attn")


def find_groups(nodes, backend, n_tokens, vec_ok, max_t, kinds=KINDS, wtype=lambda node: None):
    """{id(node): (kind, members)} for the nodes of `backend`. vec_ok(node): the node's
    product runs on the fused kernels' path; max_t: the matrix-vector kernels' token limit;
    wtype(node): its weight's type as the backend stores it (the products of one group share
    it: a fused kernel takes one type)."""
    groups, i = {}, 0
    while ENABLED and i < len(nodes):
        found = _match(nodes, i, backend, n_tokens, vec_ok, max_t, wtype)
        if found is None or found[0] not in kinds:
            i += 1
            continue
        kind, members = found
        for n in members:
            groups[id(n)] = (kind, members)
        i += len(members)
    return groups


def _product(node, op, backend, vec_ok):
    return (node.op == op and node.backend == backend and node.cause == "wgt" and vec_ok(node))


def _match(nodes, i, backend, T, vec_ok, max_t, wtype):
    def at(j):
        return nodes[i + j] if i + j < len(nodes) else None

    def twin(a, b, op):       # b: a product of a's input with a weight of a's type
        return (b is not None and _product(b, op, backend, vec_ok) and b.srcs == a.srcs
                and wtype(b) == wtype(a))

    n0, n1, n2 = at(0), at(1), at(2)
    if n0 is None or n0.backend != backend:
        return None
    # gate, up, GLU (dense or experts)
    for op, kind, ok_t in (("MUL_MAT", "glu", T == 1), ("MUL_MAT_ID", "glu_id", T <= max_t)):
        if (ok_t and n2 is not None and _product(n0, op, backend, vec_ok) and twin(n0, n1, op)
                and n2.op == "GLU" and n2.backend == backend and n2.srcs == (n0.out, n1.out)):
            return kind, [n0, n1, n2]
    # products of one input
    if T == 1 and _product(n0, "MUL_MAT", backend, vec_ok):
        run = [n0]
        while len(run) < 3 and twin(n0, at(len(run)), "MUL_MAT"):
            run.append(at(len(run)))
        if len(run) >= 2:
            return "products", run
    # expert down product and the weighted sum
    if (T <= max_t and n1 is not None and _product(n0, "MUL_MAT_ID", backend, vec_ok)
            and n1.op == "MOE_COMBINE" and n1.backend == backend and n1.srcs[0] == n0.out):
        return "down_combine", [n0, n1]
    return _match_rope_attn(nodes, i, backend)


def _match_rope_attn(nodes, i, backend):
    run = []
    for j in range(i, min(i + 5, len(nodes))):
        run.append(nodes[j])
        if nodes[j].op == "ATTN":
            break
    attn = run[-1]
    if attn.op != "ATTN" or any(n.backend != backend for n in run):
        return None
    q, k = attn.srcs[0], attn.srcs[1]
    head = run[:-1]
    norms = [n for n in head if n.op == "RMS_NORM"]
    ropes = [n for n in head if n.op == "ROPE"]
    if (len(ropes) != 2 or [n.out for n in ropes] != [q, k] or len(norms) not in (0, 2)
            or len(norms) + len(ropes) != len(head) or head[:len(norms)] != norms or ropes[0].params != ropes[1].params):
        return None
    if norms and [(n.srcs[0], n.out) for n in norms] != [(q, q), (k, k)]:
        return None
    return "rope_attn", run
