"""Backends: a table from op type to a binder that turns a graph node into one call.

A backend is its kernel modules (matmul, ops, attention, moe: the CPU and CUDA versions have
the same signatures), a way to allocate activation buffers and a store of the weights that
live on it. Binding happens once per graph: every array view (reshape, row slice, weight
view) is made then, so running a node is one Python call into a compiled kernel. Per-token
state (the cache position) is read from `state` at call time.
"""
import numba
import numpy as np
from gguf import GGMLQuantizationType

from nbmoe import config
from nbmoe.sched import fusion


def _rows2d(a):
    return a.reshape(a.shape[0], -1)


def _heads(a):
    """a [T, H, Dh], or a 2-D buffer [T, Dh] as one head."""
    return a if len(a.shape) == 3 else a.reshape(a.shape[0], 1, a.shape[1])


def _window(a, lo, n, rows=False):
    """Columns lo..lo+n-1 of every head of buffer a (a node's params cols / at: MLA's head
    parts) as a view [T, H, n], or (rows) [T * H, n]; the whole buffer if that is all of it."""
    Dh = a.shape[len(a.shape) - 1]
    a = a.reshape(a.size // Dh, Dh) if rows else _heads(a)
    return a if (lo, n) == (0, Dh) else a[:, lo:lo + n] if rows else a[:, :, lo:lo + n]


def chosen_slots(node, a):
    """a [T, A] (the chosen expert ids or weights) as the node reads it: columns lo..hi-1 for
    a node that computes only those chosen-expert slots (param `slots`: model.moe_ffn's split
    between a GPU and the CPU), all of them otherwise."""
    s = node.params.get("slots")
    return a if s is None else a[:, s[0]:s[1]]


def kv_types(state, layer):
    """(key type, value type) of the layer's cache (every slot's is the same)."""
    from nbmoe.model.kv_cache import kv_type_of
    return kv_type_of(state.kv.k[layer]), kv_type_of(state.kv.v[layer])


class Backend:
    name = "?"
    mm = ops = attn = moe = None        # kernel modules, set by subclasses
    positions_on_device = False         # attention takes the pos buffer, not state.pos0

    def __init__(self, tensors, flash_attn="auto"):
        self.tensors = tensors          # GGUF TensorInfo by name (host side)
        self.flash_attn = flash_attn    # -fa: "auto" | "on" | "off", read when ATTN binds
        self.attn_paths = {}            # (T, Dh) -> the attention kernel bound (--explain)
        self.no_flash = set()           # -fa on: head dims of prompts with no flash kernel
        self.mla_scratch = {}           # MLA's expanded keys and values (backends/mla.py)

    # -- what subclasses provide ----------------------------------------------------------
    def alloc(self, shape, dtype):
        raise NotImplementedError

    def weight(self, name):
        """(array [rows.., row_bytes] uint8 on this backend, qtype int)."""
        raise NotImplementedError

    def vector(self, name):
        """A 1-D weight (norm) as float32 on this backend."""
        raise NotImplementedError

    def supports_type(self, ggml_type):
        return self.mm.is_supported(int(ggml_type))

    def synchronize(self):
        pass

    # -- binders ---------------------------------------------------------------------------
    # Runs of nodes that one fused kernel does (fusion.find_groups) are found per plan, before
    # binding: the group's first node binds the whole group (`_bind_<kind>`, a step per
    # member, None where another member's step does the work).
    fuse_kinds = ()
    _groups = {}

    def vec_ok(self, node, n_tokens):
        """Whether this product runs on the matrix-vector path the fused kernels share."""
        return False

    def prepare(self, graph):
        """Called with a plan's graph (backends assigned) before its nodes are bound."""
        from nbmoe.sched.fusion import find_groups
        T = graph.n_tokens
        self._groups = (find_groups(graph.nodes, self.name, T, lambda n: self.vec_ok(n, T),
                                    self.max_vec_t, self.fuse_kinds, self._weight_type,
                                    self.route_ok)
                        if self.fuse_kinds else {})

    def route_ok(self, norm, router, topk):
        """Whether this backend binds RMS_NORM + router + TOPK_MOE as one (fusion's norm_route)."""
        return False

    def _weight_type(self, node):
        return self.weight(node.weight)[1] if node.weight else None

    def bind(self, node, buf, state):
        group = self._groups.get(id(node))
        if group is None:
            return getattr(self, "bind_" + node.op.lower())(node, buf, state)
        kind, members = group
        if node is members[0]:
            self._group_steps = getattr(self, "_bind_" + kind)(members, buf, state)
        step = self._group_steps[[id(n) for n in members].index(id(node))]
        return step if step is not None else _no_step

    def bind_get_rows(self, node, buf, state):
        (w, qtype), out, ids, mm = self.weight(node.weight), buf[node.out], buf[node.srcs[0]], self.mm
        return lambda: mm.get_rows(out, w, ids, qtype)

    def bind_rms_norm(self, node, buf, state):
        w = self.vector(node.weight)
        n = w.shape[0]
        if "cols" in node.params:    # a window of each head (MLA's latent in its cache row)
            lo, at, eps, ops = node.params["cols"][0], node.params["at"], node.params["eps"], self.ops
            x, out = _window(buf[node.srcs[0]], lo, n, True), _window(buf[node.out], at, n, True)
            return lambda: ops.rms_norm_rows(out, x, w, eps)
        x = buf[node.srcs[0]]
        if "src_rows" in node.params:
            lo, hi = node.params["src_rows"]
            x = x[lo:hi]
        x, out, eps, ops = x.reshape(-1, n), buf[node.out].reshape(-1, n), node.params["eps"], self.ops
        return lambda: ops.rms_norm(out, x, w, eps)

    def mul_mat_operands(self, node, buf):
        """(out [T, M], w [M, row_bytes], x [T, K], qtype) of a resident-weight MUL_MAT."""
        w, qtype = self.weight(node.weight)
        shape = tuple(w.shape)      # (device arrays of the simulator take no negative index)
        w = w.reshape(int(np.prod(shape[:-1])), shape[len(shape) - 1])
        return _rows2d(buf[node.out]), w, _rows2d(buf[node.srcs[0]]), qtype

    def mul_mat_id_operands(self, node, buf):
        """(out [T, A, M], w [E, M, row_bytes], x [T, X, K], ids [T, A], qtype) of MUL_MAT_ID."""
        w, qtype = self.weight(node.weight)
        out, x, ids = buf[node.out], buf[node.srcs[0]], chosen_slots(node, buf[node.srcs[1]])
        if len(x.shape) == 2:
            x = x.reshape(x.shape[0], 1, x.shape[1])   # one input row shared by the chosen experts
        return out, w, x, ids, qtype

    def bind_mul_mat(self, node, buf, state):
        out, w, x, qtype = self.mul_mat_operands(node, buf)
        mm = self.mm
        return lambda: mm.mul_mat(out, w, x, qtype)

    def bind_mul_mat_id(self, node, buf, state):
        out, w, x, ids, qtype = self.mul_mat_id_operands(node, buf)
        mm = self.mm
        return lambda: mm.mul_mat_id(out, w, x, ids, qtype)

    def bind_rope(self, node, buf, state):
        x, pos, p, ops = buf[node.out], buf[node.srcs[1]], node.params, self.ops
        freqs, mscale, neox = np.asarray(p["freqs"], np.float64), float(p["mscale"]), p["neox"]
        if "cols" in p:              # src's window into out's (MLA's roped query and key parts)
            (lo, hi), at = p["cols"], p["at"]
            src, out = _window(buf[node.srcs[0]], lo, hi - lo), _window(buf[node.out], at, hi - lo)
            return lambda: ops.rope_into(out, src, pos, freqs, mscale, neox)
        return lambda: ops.rope(x, pos, freqs, mscale, neox)

    def sinks(self, node):
        """The ATTN node's per-head sink logits, or None (kernels then take none)."""
        name = node.params.get("sinks")
        return self.vector(name) if name else None

    def use_flash(self, T, Dh, kv_types=("f16", "f16")):
        """-fa: whether ATTN of T tokens, head dim Dh over a cache of kv_types (key, value)
        binds the flash kernel. auto and on take it where the backend has one
        (attn.flash_used, the predicate its attention() follows too); on records a prompt
        shape without one."""
        fa = self.flash_attn != "off" and self.attn.flash_used(T, Dh, kv_types)
        if self.attn.decoding(T):
            # a backend whose attention has DECODE_FLASH takes it over long caches (by the cache)
            fa = self.flash_attn != "off" and T == 1 and getattr(self.attn, "DECODE_FLASH", False)
            self.attn_paths[(T, Dh)] = "one-token kernel" + (" (flash over long caches)" if fa else "")
        else:
            self.attn_paths[(T, Dh)] = "flash" if fa else "plain"
            if self.flash_attn == "on" and not fa:
                self.no_flash.add(Dh)
        return fa

    def bind_attn(self, node, buf, state):
        if "kv_row" in node.srcs:
            return self._bind_attn_rows(node, buf, state)
        if "expand" in node.params:     # MLA's expanded form (prompts)
            from nbmoe.backends.mla import bind_expanded_attn
            return bind_expanded_attn(self, node, buf, state)
        out, q, k, v, pos = (buf[n] for n in (node.out,) + node.srcs)
        layer = node.params["layer"]
        scale, window, attn = node.params["scale"], node.params["window"], self.attn
        extra = {} if self.sinks(node) is None else {"sinks": self.sinks(node)}
        extra["fa"] = self.use_flash(q.shape[0], q.shape[len(q.shape) - 1], kv_types(state, layer))
        # the cache arrays are looked up at run time: state.kv is the active slot's (engine.py)
        if self.positions_on_device:     # kernels read the position from the pos buffer
            def run():
                kc, vc = state.kv.k[layer], state.kv.v[layer]
                attn.store_kv(kc, vc, k, v, pos)
                attn.attention(out, q, kc, vc, pos, scale, window, **extra)
        else:
            def run():
                kc, vc = state.kv.k[layer], state.kv.v[layer]
                attn.store_kv(kc, vc, k, v, state.pos0)
                attn.attention(out, q, kc, vc, state.pos0, scale, window, **extra)
        return run

    def _bind_attn_rows(self, node, buf, state):
        """A per-row batch (several slots' next tokens): row t stores its key and value at
        cache row kv_row[t] and attends over its own slot's rows; state.kv is the whole cache."""
        out, q, k, v, pos, rows = (buf[n] for n in (node.out,) + node.srcs)
        layer, attn = node.params["layer"], self.attn
        scale, window = node.params["scale"], node.params["window"]
        sinks = self.sinks(node) if self.sinks(node) is not None else self.empty()

        def run():
            kc, vc = state.kv.k[layer], state.kv.v[layer]
            attn.store_kv_rows(kc, vc, k, v, rows)
            attn.attention_rows(out, q, kc, vc, pos, rows, scale, window, sinks)
        return run

    def bind_add(self, node, buf, state):
        out, a, b = (_rows2d(buf[n]) for n in (node.out,) + node.srcs)
        ops = self.ops
        return lambda: ops.add(out, a, b)

    def bind_scale(self, node, buf, state):
        out, x, s, ops = buf[node.out], buf[node.srcs[0]], node.params["s"], self.ops
        return lambda: ops.scale(out, x, s)

    def bind_glu(self, node, buf, state):
        if len(node.srcs) == 1:         # merged (-muge): [N, 2F] rows, the gate half then the up
            F = buf[node.out].shape[len(buf[node.out].shape) - 1]
            out, gu = buf[node.out].reshape(-1, F), buf[node.srcs[0]].reshape(-1, 2 * F)
            gate, up = gu[:, :F], gu[:, F:]
        else:
            out, gate, up = (_rows2d(buf[n]) for n in (node.out,) + node.srcs)
        act = getattr(self.ops, GLU_KERNELS[node.params["act"]])
        return lambda: act(out, gate, up)

    def empty(self):
        """A size-0 float32 array: an optional vector that is absent."""
        raise NotImplementedError

    def _route_args(self, topk):
        """(gating code, scale, selection bias or empty, n_group, topk_group) of a TOPK_MOE."""
        p = topk.params
        bias = self.vector(topk.weight) if topk.weight else self.empty()
        return (GATING_CODES[p.get("gating", "softmax")], float(p.get("scale", 1.0)), bias,
                *p.get("groups", (0, 0)))

    def bind_topk_moe(self, node, buf, state):
        wts, ids, logits = buf[node.out], buf[node.params["also_writes"][0]], buf[node.srcs[0]]
        norm, route, moe = node.params["norm"], self._route_args(node), self.moe
        return lambda: moe.topk_route(ids, wts, logits, norm, *route)

    def bind_moe_combine(self, node, buf, state):
        out, y, w, moe = buf[node.out], buf[node.srcs[0]], chosen_slots(node, buf[node.srcs[1]]), self.moe
        return lambda: moe.moe_combine(out, y, w)

    def bind_add_bias(self, node, buf, state):
        out, x, b, ops = _rows2d(buf[node.out]), _rows2d(buf[node.srcs[0]]), self.vector(node.weight), self.ops
        return lambda: ops.add_bias(out, x, b)

    def expert_bias(self, members, product):
        """The bias vector (flat [E * M]) of an expert product in a fused group, from the
        group's ADD_BIAS_ID member that adds to its output; self.empty() if it has none."""
        b = next((n for n in members if product is not None and n.op == "ADD_BIAS_ID"
                  and n.srcs[0] == product.out), None)
        return self.empty() if b is None else self.vector(b.weight)

    def bind_add_bias_id(self, node, buf, state):
        out, x = buf[node.out], buf[node.srcs[0]]
        ids, ops = chosen_slots(node, buf[node.srcs[1]]), self.ops
        b = self.vector(node.weight).reshape(-1, out.shape[2])          # [E, M]
        return lambda: ops.add_bias_id(out, x, b, ids)

    def constant(self, a):
        """A host array as this backend's kernels read it (a GPU: a device copy)."""
        return a

    def bind_mul_mat_heads(self, node, buf, state):
        # head h's rows through matrix h: an expert product whose "chosen expert" is the head;
        # x and out may be column windows (params cols, at: MLA's q_nope, q', attention's latent)
        w, qtype = self.weight(node.weight)                                  # [H, M, row_bytes]
        x, out, M = buf[node.srcs[0]], buf[node.out], int(self.tensors[node.weight].ne[1])
        (lo, hi), at = node.params.get("cols", (0, x.shape[len(x.shape) - 1])), node.params.get("at", 0)
        x, out = _window(x, lo, hi - lo), _window(out, at, M)
        ids = self.constant(np.tile(np.arange(x.shape[1], dtype=np.int32), (x.shape[0], 1)))
        mm = self.mm
        return lambda: mm.mul_mat_heads(out, w, x, ids, qtype)

    def bind_sigmoid_mul(self, node, buf, state):
        out, x, g = (_rows2d(buf[n]) for n in (node.out,) + node.srcs)
        ops = self.ops
        return lambda: ops.sigmoid_mul(out, x, g)


# The kernel of each GLU kind (model/arch.py GLU_KINDS) and the kernels' gating codes.
GLU_KERNELS = {"silu": "swiglu", "gelu": "geglu", "swiglu_oai": "swiglu_oai"}
GATING_CODES = {"softmax": 0, "sigmoid": 1, "softmax_topk": 2}


class CPUBackend(Backend):
    name = "CPU"
    fuse_kinds = ("products", "glu", "glu_id", "down_combine", "attn_block", "ffn_block",
                  "moe_block") + (fusion.CPU_KINDS if config.EXPERT_FFN else ())

    def __init__(self, tensors, repacked=None, flash_attn="auto"):
        super().__init__(tensors, flash_attn)
        from nbmoe.cpu import attention, blocks, fused, matmul, mla, moe, ops
        self.mm, self.ops, self.attn, self.moe, self.fused = matmul, ops, attention, moe, fused
        self.mla = mla
        self.blocks = blocks
        self.max_vec_t = matmul.BLAS_MIN_T - 1
        self.repacked = repacked or {}  # name -> (array, repacked qtype): -rtr (repack.py)

    def vec_ok(self, node, n_tokens):
        return n_tokens < self.mm.BLAS_MIN_T

    def bind_mul_mat(self, node, buf, state):
        return self.mm.mul_mat_step(*self.mul_mat_operands(node, buf))

    def bind_glu(self, node, buf, state):
        if len(node.srcs) > 1:
            return super().bind_glu(node, buf, state)
        # a merged gate_up's halves (-muge): one kernel over its contiguous rows
        F = buf[node.out].shape[-1]
        out, gu = buf[node.out].reshape(-1, F), buf[node.srcs[0]].reshape(-1, 2 * F)
        act, fused = _act(self.fused, node), self.fused
        return _labelled(lambda: fused.glu_halves(out, gu, act), "GLU")

    # -- fused groups (cpu/fused.py) ---------------------------------------------------------
    def _biases(self, members, products):
        """The bias of each product among a group's members (an ADD_BIAS of its output) as
        matmul._products takes it: a writeable float32 copy, or matmul.NO_BIAS."""
        by_out = {n.srcs[0]: n for n in members if n.op == "ADD_BIAS"}
        return tuple(np.array(self.vector(by_out[p.out].weight), np.float32)
                     if p.out in by_out else self.mm.NO_BIAS for p in products)

    def _bind_products(self, members, buf, state):
        products = [n for n in members if n.op == "MUL_MAT"]      # [with their ADD_BIAS]
        ops = [self.mul_mat_operands(n, buf) for n in products]
        outs, ws = [o[0] for o in ops], [o[1] for o in ops]
        x, qtype, mm, fused = ops[0][2], ops[0][3], self.mm, self.fused
        step = mm.item_rows(sum(w.shape[0] for w in ws), ws[0].shape[1], x.shape[0], qtype)
        int8, biases = mm._int8(qtype), self._biases(members, products)
        return [None] * (len(members) - 1) + [
            _labelled(fused.products_step(outs, ws, x, qtype, int8, step, biases), "MUL_MAT")]

    def _bind_glu(self, members, buf, state):
        gate, up, glu = members
        _, wg, x, qtype = self.mul_mat_operands(gate, buf)
        wu = self.mul_mat_operands(up, buf)[1]
        out, act, mm, fused = _rows2d(buf[glu.out]), _act(self.fused, glu), self.mm, self.fused
        step, int8 = mm.item_rows(wg.shape[0], 2 * wg.shape[1], x.shape[0], qtype), mm._int8(qtype)
        return [None, None, _labelled(lambda: fused.glu(out, wg, wu, x, qtype, int8, step, act),
                                      "MUL_MAT+GLU")]

    def _glu_id_operands(self, members, buf):
        """(out, wg, wu, x, ids, qtype, int8, step, act, bg, bu) of a glu_id group's kernel."""
        gate, up, glu = expert_glu(members)
        _, wg, x, ids, qtype = self.mul_mat_id_operands(gate, buf)
        # up None: a merged gate_up (-muge), the up rows after each expert's gate rows
        wu = self.mul_mat_id_operands(up, buf)[1] if up else None
        bg, bu = self.expert_bias(members, gate), self.expert_bias(members, up)
        out, mm = buf[glu.out], self.mm
        step = mm.expert_item_rows(out.shape[2], wg.shape[2], ids.shape[0], qtype)
        return out, wg, wu, x, ids, qtype, mm._int8(qtype), step, _act(self.fused, glu), bg, bu

    def _down_combine_operands(self, members, buf):
        """(out, w, x, ids, wts, bias, qtype, int8, step) of a down_combine group's kernel."""
        down, combine = members[0], members[-1]
        _, w, x, ids, qtype = self.mul_mat_id_operands(down, buf)
        out, wts, mm = buf[combine.out], chosen_slots(combine, buf[combine.srcs[1]]), self.mm
        bias = self.fused.expert_bias(self.expert_bias(members, down), w.shape[0], w.shape[1])
        step = mm.expert_item_rows(w.shape[1], ids.shape[1] * w.shape[2], ids.shape[0], qtype)
        return out, w, x, ids, wts, bias, qtype, mm._int8(qtype), step

    def _bind_glu_id(self, members, buf, state):
        args, fused = self._glu_id_operands(members, buf), self.fused
        return [None] * (len(members) - 1) + [_labelled(lambda: fused.glu_id(*args), "MUL_MAT_ID_GLU")]

    def _bind_down_combine(self, members, buf, state):
        args, fused = self._down_combine_operands(members, buf), self.fused
        threads = numba.get_num_threads          # workers: the threads at call time
        return [None] * (len(members) - 1) + [_labelled(
            lambda: fused.down_combine(*args, threads()), "MUL_MAT_ID+MOE_COMBINE")]

    def _bind_expert_ffn(self, members, buf, state):
        """glu_id, then down_combine of its output, in one parallel region (fused.expert_ffn)."""
        n = next(i for i, m in enumerate(members) if m.op == "GLU") + 1
        g, wg, wu, x, ids, qg, i8g, sg, act, bg, bu = self._glu_id_operands(members[:n], buf)
        out, wd, _, _, wts, bd, qd, i8d, sd = self._down_combine_operands(members[n:], buf)
        fused = self.fused
        step = _labelled(lambda: fused.expert_ffn(out, g, wg, wu, wd, x, ids, wts, (qg, qd), (i8g, i8d),
                                                  (sg, sd), act, bg, bu, bd), "EXPERT_FFN")
        return [None] * (len(members) - 1) + [step]

    # -- whole blocks, one token (cpu/blocks.py) ---------------------------------------------
    def _vec_product(self, node, buf, rows=None):
        """(w, qtype, int8, rows per item) of a one-token product; rows: the item size's base
        (all rows of a fused group), as mul_mat_step and _bind_products pick it."""
        _, w, _, qtype = self.mul_mat_operands(node, buf)
        step = self.mm.item_rows(rows or w.shape[0], w.shape[1], 1, qtype)
        return w, qtype, self.mm._int8(qtype), step

    def _norm_vectors(self, nodes):
        """The norm weights of a block's optional RMS_NORM nodes (an empty array if None)."""
        return tuple(self.vector(n.weight) if n is not None else _NO_NORM for n in nodes)

    def _bind_attn_block(self, members, buf, state):
        norm, products = members[0], [n for n in members if n.op == "MUL_MAT"]
        q, k, v, o = products
        att = next(n for n in members if n.op == "ATTN")
        rope = next(n for n in members if n.op == "ROPE")
        qk_norms = [n for n in members[1:members.index(rope)] if n.op == "RMS_NORM"]
        post = members[-2] if members[-2].op == "RMS_NORM" else None
        same_v = self.weight(v.weight)[1] == self.weight(q.weight)[1]
        rows = [self.weight(n.weight)[0].shape[0] for n in (q, k, v)]
        base = sum(rows) if same_v else rows[0] + rows[1]
        pq, pk = self._vec_product(q, buf, base), self._vec_product(k, buf, base)
        pv = self._vec_product(v, buf, base if same_v else None)
        po = self._vec_product(o, buf)
        rows = np.array(rows if same_v else rows[:2] + [0], np.int64)
        norms = (self.vector(norm.weight),) + self._norm_vectors(
            qk_norms or [None, None]) + self._norm_vectors([post])
        x, h, bq, bk, bv, ba, bo, pos = (buf[n] for n in (
            norm.srcs[0], norm.out, q.out, k.out, v.out, att.out, o.out, "pos"))
        ws = tuple(p[0] for p in (pq, pk, pv, po))
        qtypes, int8s, steps = (tuple(p[j] for p in (pq, pk, pv, po)) for j in (1, 2, 3))
        rp, layer = rope.params, att.params["layer"]
        rope_p, neox = (np.asarray(rp["freqs"], np.float64), float(rp["mscale"])), rp["neox"]
        eps, scale, window, blocks = norm.params["eps"], att.params["scale"], att.params["window"], self.blocks
        sinks = self.sinks(att) if self.sinks(att) is not None else self.empty()
        self.use_flash(1, bq.shape[-1])         # one token: the decode kernel (recorded for --explain)
        biases = self._biases(members, products)
        step = _labelled(lambda: blocks.attn_block(
            x, h, bq, bk, bv, ba, bo, pos, state.pos0, eps, norms, biases, *ws, qtypes, int8s, steps,
            rows, rope_p, neox, state.kv.k[layer], state.kv.v[layer], scale, window, sinks), "ATTN_BLOCK")
        # parallel regions, counted by tools/tg_overhead.py: q/k/v, [v], [o] (mat_vec: one item
        # runs without a region)
        step.regions = 1 + (0 if same_v else _region(pv)) + _region(po)
        return [None] * (len(members) - 1) + [step]

    def _bind_ffn_block(self, members, buf, state):
        norm, gate, up, glu, down = members[:5]
        post = members[5] if members[5].op == "RMS_NORM" else None
        pg, pd = self._vec_product(gate, buf), self._vec_product(down, buf)
        wu = self.mul_mat_operands(up, buf)[1]
        # gate and up share items of rows twice as long (as _bind_glu)
        step = self.mm.item_rows(pg[0].shape[0], 2 * pg[0].shape[1], 1, pg[1])
        norms = (self.vector(norm.weight),) + self._norm_vectors([post])
        x, h, g, f = (_rows2d(buf[n]) for n in (norm.srcs[0], norm.out, glu.out, down.out))
        qtypes, int8s, steps = (pg[1], pd[1]), (pg[2], pd[2]), (step, pd[3])
        eps, act, blocks, wg, wd = norm.params["eps"], _act(self.fused, glu), self.blocks, pg[0], pd[0]
        step = _labelled(lambda: blocks.ffn_block(
            x, h, g, f, eps, norms, wg, wu, wd, qtypes, int8s, steps, act), "FFN_BLOCK")
        step.regions = 1 + _region(pd)                  # gate/up/GLU, [down]
        return [None] * (len(members) - 1) + [step]

    def _bind_moe_block(self, members, buf, state):
        norm, router = members[:2]
        topk, comb = (next(n for n in members if n.op == op) for op in ("TOPK_MOE", "MOE_COMBINE"))
        rbias = members[2] if members[2].op == "ADD_BIAS" else None     # the router's bias
        gate, up, glu = expert_glu(members)                 # up None: -muge's merged gate_up
        down = members[next(i for i, n in enumerate(members) if n is glu) + 1]
        post = members[-2] if members[-2].op == "RMS_NORM" else None
        pr = self._vec_product(router, buf)
        _, wg, _, ids, qg = self.mul_mat_id_operands(gate, buf)
        wu = None if up is None else self.mul_mat_id_operands(up, buf)[1]
        _, wd, g, _, qd = self.mul_mat_id_operands(down, buf)
        biases = self.blocks.moe_biases(wg, wu, wd, self.vector(rbias.weight) if rbias else None,
                                        *(self.expert_bias(members, p) for p in (gate, up, down)))
        A, mm = ids.shape[1], self.mm
        # work items as the unfused glu_id and down_combine groups pick them
        steps = (pr[3], mm.expert_item_rows(g.shape[2], wg.shape[2], 1, qg),
                 mm.expert_item_rows(wd.shape[1], A * wd.shape[2], 1, qd))
        qtypes, int8s = (pr[1], qg, qd), (pr[2], mm._int8(qg), mm._int8(qd))
        norms = (self.vector(norm.weight),) + self._norm_vectors([post])
        x, h, logits, f = (_rows2d(buf[n]) for n in (norm.srcs[0], norm.out, router.out, comb.out))
        wts, wr = buf[topk.out], pr[0]
        eps, act, blocks, norm_topk = norm.params["eps"], _act(self.fused, glu), self.blocks, topk.params["norm"]
        threads = numba.get_num_threads
        route = self._route_args(topk)
        step = _labelled(lambda: blocks.moe_block(
            x, h, logits, ids, wts, g, f, eps, norms, wr, wg, wu, wd, qtypes, int8s, steps,
            act, norm_topk, threads(), *route, biases=biases), "MOE_BLOCK")
        step.regions = _region(pr) + 2                  # [router], experts' gate/up/GLU, down
        return [None] * (len(members) - 1) + [step]

    def alloc(self, shape, dtype):
        return np.zeros(shape, dtype)

    def empty(self):
        return self.ops.EMPTY

    def copy_in(self, dst, src):
        """dst (here) <- src (a host array or another backend's device array)."""
        if isinstance(src, np.ndarray):
            np.copyto(dst, src)
        else:
            src.copy_to_host(dst)

    def weight(self, name):
        if name in self.repacked:
            return self.repacked[name]
        t = self.tensors[name]
        return t.data, int(t.ggml_type)

    def vector(self, name):
        t = self.tensors[name]
        if t.ggml_type == GGMLQuantizationType.F32:
            return t.data.view(np.float32).reshape(-1)
        return self.mm.dequantize(t.data.reshape(1, -1), int(t.ggml_type)).reshape(-1)


_NO_NORM = np.zeros(0, np.float32)
_NO_NORM.flags.writeable = False     # typed like the GGUF's read-only norm vectors


def _region(product):
    """1 if a one-token product (w, qtype, int8, step) opens a parallel region (mat_vec: more
    than one work item)."""
    return int(product[3] < product[0].shape[0])


def _no_step():
    """The step of a group member whose work another member's step does (not run)."""


_no_step.skip = True


def _labelled(step, label):
    """A step with the op name --timings files it under."""
    step.label = label
    return step


def expert_glu(members):
    """(gate, up, GLU) of a fused group that holds the experts' gate and up products (up None:
    a merged gate_up, -muge), whatever its other members (biases, routing, down)."""
    glu = next(n for n in members if n.op == "GLU")
    prods = [n for n in members if n.op == "MUL_MAT_ID" and n.out in glu.srcs]
    return prods[0], (prods[1] if len(prods) == 2 else None), glu


def _act(fused, glu):
    """The fused kernels' activation code of a GLU node (fusion.FUSED_SUPPORT lets only the
    kinds they have reach them)."""
    return getattr(fused, "ACT_" + glu.params["act"].upper())
