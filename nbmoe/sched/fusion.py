"""Runs of graph nodes that a GPU backend binds to one fused kernel (decoding's launch count).

find_groups walks a plan's nodes (backends already assigned) and returns, per node id, the
group it belongs to: (kind, [nodes]). A group is a run of consecutive nodes on one GPU whose
intermediate results nobody else reads; kinds (nbmoe/cuda/fused.py has the kernels):

  products      2-3 MUL_MAT of one input, weights of one type (q, k, v),         T = 1
                each [ADD_BIAS of its output] (gpt-oss, glm4moe)
  glu           MUL_MAT gate, MUL_MAT up (one input), GLU of the two              T = 1
  glu_id        MUL_MAT_ID gate, MUL_MAT_ID up (one input, one ids), [ADD_BIAS_ID   T <= 8
                of each], GLU (the op MUL_MAT_ID_GLU: only nodes marked fused_op, i.e.
                -fmoe 1); or, merged (-muge), MUL_MAT_ID gate_up, [ADD_BIAS_ID], GLU of
                its two halves
  down_combine  MUL_MAT_ID down, [ADD_BIAS_ID], MOE_COMBINE of its output         T <= 8
  down_combine_add  the same, then the residual ADD x = x + combined             T <= 8
  expert_ffn    a glu_id group, then the down_combine of its output (one parallel  T <= 8
                region on the CPU: the second region's fork and join saved)
  product_add   MUL_MAT, [ADD_BIAS], then the residual ADD x = x + its output    T <= 8
                (o, down)
  norm_route    RMS_NORM x -> h, the router MUL_MAT of h, [ADD_BIAS], TOPK_MOE     T = 1
                (route_ok(norm, router, topk): the backend's kernel takes them)
  rope_attn     [RMS_NORM q, RMS_NORM k], ROPE q, ROPE k, ATTN of those q, k      any T
  mla_rope      MLA's ROPE of a window of q into one of q_mla, RMS_NORM and ROPE   any T
                of two windows of the cache row in place (the one kind taking windows)
  attn_block    a layer's attention half: RMS_NORM, q/k/v products, [q/k norms],    T = 1
                ROPE q, k, ATTN, o product, [post norm], residual ADD (CPU); each
                product [with its ADD_BIAS]
  ffn_block     a dense layer's FFN half: RMS_NORM, gate, up, GLU, down,            T = 1
                [post norm], residual ADD (CPU)
  moe_block     a MoE layer's FFN half: RMS_NORM, router, [ADD_BIAS], TOPK_MOE,     T = 1
                the glu_id and down_combine nodes, [post norm], residual ADD (CPU)
The experts' biases (ADD_BIAS_ID, gpt-oss) are members of their product's group: its kernel
adds the chosen expert's bias rows (gate / up before the GLU, down before the weighted sum).

Products need weights on their backend (cause `wgt`; or `zc`: RAM that the GPU reads in
place) on the matrix-vector path the fused kernels share (`vec_ok(node)`; on the GPU, with
x in 8 bits). The GPU fuses every kind
(nbmoe/cuda/fused.py), the CPU the products (nbmoe/cpu/fused.py) and, for one token, whole
blocks (nbmoe/cpu/blocks.py: a compiled call per block instead of a Python step per node).
"""

# Off: every node binds on its own; BLOCKS off: the per-node groups only (tests, tools/tg_overhead.py).
ENABLED = True
BLOCKS = True
KINDS = ("products", "glu", "glu_id", "down_combine", "rope_attn")
# Kinds a backend offers beyond KINDS (the CUDA backend's; see backend_cuda.fuse_kinds).
ADD_KINDS = ("down_combine_add", "product_add", "norm_route", "mla_rope")
CPU_KINDS = ("expert_ffn",)      # the CPU backend's
BLOCK_KINDS = ("attn_block", "ffn_block", "moe_block")

# The variants the fused kernels compute, per backend kind and op: every member of a group must
# pass its op's test, else the group is not formed and its nodes run on the plain path (each
# op's own kernel, which runs every variant). Ops not listed pass; an op no group takes is
# listed as False so that --explain names it.
# The biases of these products the groups above add themselves (products, product_add,
# attn_block: q, k, v, o); the router's, norm_route's on CUDA.
ATTN_BIASES = ("attn_q", "attn_k", "attn_v", "attn_output")


def _bias_of(node, roles):
    """Whether an ADD_BIAS node adds the bias of one of these roles (blk.N.<role>.bias)."""
    return node.weight.rsplit(".", 2)[-2] in roles


FUSED_SUPPORT = {
    "CPU": {"GLU": lambda n: n.params["act"] in ("silu", "gelu", "swiglu_oai"),
            "ADD_BIAS": lambda n: _bias_of(n, ATTN_BIASES + ("ffn_gate_inp",)),   # moe_block: router
            "ADD_BIAS_ID": lambda n: True,     # in glu_id, down_combine, moe_block
            "SIGMOID_MUL": lambda n: False},
    "CUDA": {"GLU": lambda n: n.params["act"] in ("silu", "gelu", "swiglu_oai"),
             "TOPK_MOE": lambda n: n.params.get("groups", (0, 0))[0] <= 32,
             "ADD_BIAS": lambda n: _bias_of(n, ATTN_BIASES + ("ffn_gate_inp",)),   # norm_route: router
             "ADD_BIAS_ID": lambda n: True,    # in glu_id, down_combine[_add]
             "SIGMOID_MUL": lambda n: False},
}


def supported(node, backend):
    """Does backend's fused kernels compute this node's variant?"""
    test = FUSED_SUPPORT["CPU" if backend == "CPU" else "CUDA"].get(node.op)
    return test is None or test(node)


def find_groups(nodes, backend, n_tokens, vec_ok, max_t, kinds=KINDS, wtype=lambda node: None,
                route_ok=lambda norm, router, topk: False):
    """{id(node): (kind, members)} for the nodes of `backend`. vec_ok(node): the node's
    product runs on the fused kernels' path; max_t: the matrix-vector kernels' token limit;
    wtype(node): its weight's type as the backend stores it (the products of one group share
    it: a fused kernel takes one type); route_ok: whether a norm_route group can take these."""
    groups, i = {}, 0
    blocks = BLOCKS and n_tokens == 1 and any(k in kinds for k in BLOCK_KINDS)
    while ENABLED and i < len(nodes):
        found = _match_block(nodes, i, backend, vec_ok, wtype) if blocks else None
        if found is None:
            found = _match(nodes, i, backend, n_tokens, vec_ok, max_t, wtype, kinds, route_ok)
        if (found is None or found[0] not in kinds
                or not all(supported(n, backend) for n in found[1])
                or found[0] != "mla_rope" and any("cols" in n.params for n in found[1])):
            i += 1
            continue
        kind, members = found
        for n in members:
            groups[id(n)] = (kind, members)
        i += len(members)
    return groups


def unfused(nodes, backend):
    """The nodes of `backend` whose variant no fused kernel of it computes (--explain)."""
    return [n for n in nodes if n.backend == backend and not supported(n, backend)]


def _product(node, op, backend, vec_ok):
    return (node is not None and node.op == op and node.backend == backend
            and node.cause in ("wgt", "zc") and vec_ok(node))


def _with_biases(nodes, j, prods):
    """prods followed by the ADD_BIAS_ID nodes from nodes[j] on that add an expert bias to one
    of their outputs in place (with their ids), each at most once."""
    run, left = list(prods), {p.out: p for p in prods}
    while j < len(nodes) and left:
        n = nodes[j]
        p = left.get(n.srcs[0]) if n.op == "ADD_BIAS_ID" else None
        if p is None or n.backend != p.backend or n.srcs != (p.out, p.srcs[1]) or n.out != p.out:
            break
        run.append(n)
        del left[p.out]
        j += 1
    return run


def _match(nodes, i, backend, T, vec_ok, max_t, wtype, kinds=KINDS, route_ok=None):
    def at(j):
        return nodes[i + j] if i + j < len(nodes) else None

    def twin(a, b, op):       # b: a product of a's input with a weight of a's type
        return (b is not None and _product(b, op, backend, vec_ok) and b.srcs == a.srcs
                and wtype(b) == wtype(a))

    def residual_add(n, y):   # n: ADD x = x + y on this backend
        return (n is not None and n.op == "ADD" and n.backend == backend and len(n.srcs) == 2
                and n.srcs[1] == y and n.out == n.srcs[0] != y)

    def biased(j):            # [product at(j)] + [its ADD_BIAS, if next]
        n = at(j + 1)
        return [at(j)] + ([n] if n is not None and _adds_bias(n, at(j), backend) else [])

    n0, n1, n2 = at(0), at(1), at(2)
    if n0 is None or n0.backend != backend:
        return None
    # [the router's bias between the product and the routing]
    bias = n2 if n2 is not None and n2.op == "ADD_BIAS" and n2.srcs == (n1.out,) == (n2.out,) else None
    route = at(3) if bias else n2
    if ("norm_route" in kinds and T == 1 and route is not None and n0.op == "RMS_NORM"
            and "src_rows" not in n0.params and n1.op == "MUL_MAT" and n1.srcs == (n0.out,)
            and route.op == "TOPK_MOE" and route.srcs == (n1.out,) and n1.cause == "wgt"
            and all(n.backend == backend for n in (n1, route) + ((bias,) if bias else ()))
            and route_ok(n0, n1, route)):
        return "norm_route", [n0, n1] + ([bias] if bias else []) + [route]
    # gate, up, GLU (dense)
    if (T == 1 and n2 is not None and _product(n0, "MUL_MAT", backend, vec_ok)
            and twin(n0, n1, "MUL_MAT") and n2.op == "GLU" and n2.backend == backend
            and n2.srcs == (n0.out, n1.out)):
        return "glu", [n0, n1, n2]
    # the experts' gate and up (or a merged gate_up, -muge), [their biases], GLU
    if (T <= max_t and _product(n0, "MUL_MAT_ID", backend, vec_ok)
            and n0.params.get("fused_op") == "MUL_MAT_ID_GLU"):
        prods = [n0, n1] if twin(n0, n1, "MUL_MAT_ID") else [n0]
        run = _with_biases(nodes, i + len(prods), prods)
        glu = at(len(run))
        if (glu is not None and glu.op == "GLU" and glu.backend == backend
                and glu.srcs == tuple(p.out for p in prods)):
            run = run + [glu]
            down = at(len(run))
            if ("expert_ffn" in kinds and down is not None and down.srcs == (glu.out, n0.srcs[1])
                    and _product(down, "MUL_MAT_ID", backend, vec_ok)):
                tail = _down_combine(nodes, i + len(run), backend)
                if tail is not None:
                    return "expert_ffn", run + tail
            return "glu_id", run
    # products of one input, each [with its bias]
    if T == 1 and _product(n0, "MUL_MAT", backend, vec_ok):
        run, n = biased(0), 1
        while n < 3 and twin(n0, at(len(run)), "MUL_MAT"):
            run, n = run + biased(len(run)), n + 1
        if n >= 2:
            return "products", run
    # expert down product [and its bias], the weighted sum [and the residual add]
    if T <= max_t and _product(n0, "MUL_MAT_ID", backend, vec_ok):
        run = _down_combine(nodes, i, backend)
        if run is not None:
            if "down_combine_add" in kinds and residual_add(at(len(run)), run[-1].out):
                return "down_combine_add", run + [at(len(run))]
            return "down_combine", run
    # a product [and its bias] added to the residual stream (attention output, dense FFN down)
    if "product_add" in kinds and T <= max_t and _product(n0, "MUL_MAT", backend, vec_ok):
        run = biased(0)
        if residual_add(at(len(run)), n0.out):
            return "product_add", run + [at(len(run))]
    if "mla_rope" in kinds and _is_mla_rope(nodes[i:i + 3], backend):
        return "mla_rope", nodes[i:i + 3]
    return _match_rope_attn(nodes, i, backend)


def _down_combine(nodes, i, backend):
    """The expert down product at nodes[i], [its bias], and the MOE_COMBINE of its output on
    backend, or None."""
    run = _with_biases(nodes, i + 1, [nodes[i]])
    j = i + len(run)
    comb = nodes[j] if j < len(nodes) else None
    if (comb is not None and comb.op == "MOE_COMBINE" and comb.backend == backend
            and comb.srcs[0] == nodes[i].out):
        return run + [comb]
    return None


def _is_mla_rope(run, backend):
    """ROPE of a window of q into one of q_mla, RMS_NORM and ROPE of two windows of the
    cache row in place (forward.py's mla_attention), with one rotation, on backend."""
    if len(run) != 3 or any(n.backend != backend or "cols" not in n.params for n in run):
        return False
    rq, norm, rk = run
    in_place = all(n.srcs[0] == n.out and n.params["cols"][0] == n.params["at"] for n in (norm, rk))
    p, pk = rq.params, rk.params
    return ((rq.op, norm.op, rk.op) == ("ROPE", "RMS_NORM", "ROPE") and in_place
            and rq.srcs[0] != rq.out and norm.out == rk.out and rq.srcs[1] == rk.srcs[1]
            and p["freqs"] is pk["freqs"] and (p["mscale"], p["neox"]) == (pk["mscale"], pk["neox"]))


def _adds_bias(n, product, backend):
    """n: ADD_BIAS of product's output into itself, on backend."""
    return (n.op == "ADD_BIAS" and n.backend == backend and n.srcs == (product.out,)
            and n.out == product.out)


def _match_rope_attn(nodes, i, backend):
    run = []
    for j in range(i, min(i + 5, len(nodes))):
        run.append(nodes[j])
        if nodes[j].op == "ATTN":
            break
    attn = run[-1]
    # (per-row ATTN: the fused kernels write the key at its position, not at its own kv_row)
    if attn.op != "ATTN" or "kv_row" in attn.srcs or any(n.backend != backend for n in run):
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


# ---------------------------------------------------------------- whole blocks (T = 1)

def _match_block(nodes, i, backend, vec_ok, wtype):
    """attn_block or ffn_block starting at nodes[i] (forward.py's layer, node for node), or None."""
    run = nodes[i:i + 16]
    if (not run or run[0].op != "RMS_NORM" or run[0].backend != backend
            or "src_rows" in run[0].params):
        return None
    if any(n.backend != backend for n in run):
        run = run[:next(j for j, n in enumerate(run) if n.backend != backend)]
    for match in (_attn_block, _ffn_block, _moe_block):
        n = match(run, lambda node, op="MUL_MAT": _product(node, op, backend, vec_ok), wtype)
        if n:
            return match.__name__[1:], run[:n]
    return None


class _Walk:
    """Reads a run of nodes front to back: take(op, srcs, out) returns the next node if it
    matches (srcs / out None: any), else None and the walk is spoiled."""

    def __init__(self, run):
        self.run, self.i, self.ok = run, 0, True

    def peek(self):
        return self.run[self.i] if self.ok and self.i < len(self.run) else None

    def take(self, op, srcs=None, out=None):
        n = self.peek()
        if n is None or n.op != op or (srcs is not None and n.srcs != tuple(srcs)) or (
                out is not None and n.out != out):
            self.ok = False
            return None
        self.i += 1
        return n

    def product(self, srcs):
        """take("MUL_MAT", srcs), and its ADD_BIAS into its output if that comes next."""
        p = self.take("MUL_MAT", srcs)
        n = self.peek()
        if p is not None and n is not None and _adds_bias(n, p, n.backend):
            self.i += 1
        return p

    def norm_in_place(self, buf):
        """An optional RMS_NORM of buf into itself (qk norms, gemma's post norms)."""
        return self.maybe("RMS_NORM", (buf,), buf)

    def maybe(self, op, srcs, out):
        """The next node if it is this optional one (an in-place norm or bias), else None
        (the walk goes on)."""
        n = self.peek()
        if n is not None and n.op == op and n.srcs == tuple(srcs) and n.out == out:
            self.i += 1
            return n
        return None

    def expert_biases(self, prods):
        """The optional ADD_BIAS_ID of each expert product in prods, in the graph's order."""
        run = _with_biases(self.run, self.i, prods) if self.ok else prods
        self.i += len(run) - len(prods)


def _attn_block(run, product, wtype):
    """Nodes in an attn_block at the front of run (0 if none): RMS_NORM x -> h; q, k, v of h,
    each [+ bias]; [RMS_NORM q, k]; ROPE q, k; ATTN; o of attn [+ bias]; [RMS_NORM o];
    ADD x = x + o."""
    w = _Walk(run)
    norm = w.take("RMS_NORM")
    x, h = norm.srcs[0], norm.out
    q, k, v = (w.product((h,)) for _ in range(3))
    if not w.ok or not all(product(p) for p in (q, k, v)) or wtype(q) != wtype(k):
        return 0
    qn = w.norm_in_place(q.out)
    kn = w.norm_in_place(k.out) if qn else None
    if bool(qn) != bool(kn):
        return 0
    rq = w.take("ROPE", (q.out, "pos"), q.out)
    rk = w.take("ROPE", (k.out, "pos"), k.out)
    at = w.take("ATTN", (q.out, k.out, v.out, "pos"))
    o = w.product((at.out,)) if at else None
    if not w.ok or not product(o) or rq.params != rk.params:
        return 0
    w.norm_in_place(o.out)
    w.take("ADD", (x, o.out), x)
    return w.i if w.ok and _same_eps(run[:w.i]) else 0


def _ffn_block(run, product, wtype):
    """Nodes in an ffn_block at the front of run (0 if none): RMS_NORM x -> h; gate, up of h
    (one type); GLU; down; [RMS_NORM down]; ADD x = x + down."""
    w = _Walk(run)
    norm = w.take("RMS_NORM")
    x, h = norm.srcs[0], norm.out
    gate, up = w.take("MUL_MAT", (h,)), w.take("MUL_MAT", (h,))
    glu = w.take("GLU", (gate.out, up.out), gate.out) if w.ok else None
    down = w.take("MUL_MAT", (glu.out,)) if w.ok else None
    if not w.ok or not all(product(p) for p in (gate, up, down)) or wtype(gate) != wtype(up):
        return 0
    w.norm_in_place(down.out)
    w.take("ADD", (x, down.out), x)
    return w.i if w.ok and _same_eps(run[:w.i]) else 0


def _moe_block(run, product, wtype):
    """Nodes in a moe_block at the front of run (0 if none): RMS_NORM x -> h; router of h;
    TOPK_MOE; expert gate, up of h (one type), GLU, or (-muge) gate_up of h, GLU of its halves;
    expert down; MOE_COMBINE; [RMS_NORM]; ADD x = x + combined."""
    w = _Walk(run)
    norm = w.take("RMS_NORM")
    x, h = norm.srcs[0], norm.out
    router = w.take("MUL_MAT", (h,))
    if w.ok:
        w.maybe("ADD_BIAS", (router.out,), router.out)                   # the router's bias
    topk = w.take("TOPK_MOE", (router.out,)) if w.ok else None
    ids = topk.params["also_writes"][0] if w.ok else None
    gate = w.take("MUL_MAT_ID", (h, ids))
    nxt = w.peek()
    if nxt is not None and nxt.op == "MUL_MAT_ID" and nxt.srcs == (h, ids):
        up = w.take("MUL_MAT_ID")
        w.expert_biases([gate, up])
        glu = w.take("GLU", (gate.out, up.out), gate.out) if w.ok else None
    else:                                                                   # merged
        w.expert_biases([gate] if w.ok else [])
        up, glu = gate, w.take("GLU", (gate.out,) if w.ok else None)
    down = w.take("MUL_MAT_ID", (glu.out, ids)) if w.ok else None
    if w.ok:
        w.expert_biases([down])
    comb = w.take("MOE_COMBINE", (down.out, topk.out)) if w.ok else None
    if (not w.ok or not product(router) or not all(product(p, "MUL_MAT_ID") for p in (gate, up, down))
            or wtype(gate) != wtype(up) or "slots" in gate.params   # the kernel takes all slots
            or gate.params.get("fused_op") != "MUL_MAT_ID_GLU"):     # -fmoe 0: three ops
        return 0
    w.norm_in_place(comb.out)
    w.take("ADD", (x, comb.out), x)
    return w.i if w.ok and _same_eps(run[:w.i]) else 0


def _same_eps(nodes):
    """The block kernels take one eps for all their norms (a model's norm_eps)."""
    return len({n.params["eps"] for n in nodes if n.op == "RMS_NORM"}) == 1
