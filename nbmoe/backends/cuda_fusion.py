"""The CUDA backend's binders that save launches (mixed into CUDABackend, backends/cuda.py).

Binding follows run order, and a node's closure reads a small dict (`cell`) at run time, so
the node bound next may still change what it does (a recorded graph sees the result):
  ADD x = x + y, then RMS_NORM of x: one rms_norm(add=y) launch, the norm's step is empty;
  RMS_NORM or attention, then an 8-bit product of its output: the norm (attention) also
  writes the 8-bit x;
  products of the same input in a row (q, k, v; gate, up): one quantization of x; the
  experts' gate / up after norm_route, which writes their 8-bit x;
  a prompt's expert products that share their ids: one grouping by expert (_grouped);
  a product, then the ADD_BIAS (ADD_BIAS_ID) of its output (after its twins of the same
  input): the product's kernel adds the bias (matmul.fuses_bias[_id]), the bias's step is
  empty (_biasable);
  a prompt's merged gate_up product (-muge) [and its bias], then the GLU of its halves: the
  product's kernel applies the GLU and writes the GLU's output (matmul.fuses_glu_id), the
  GLU's step is empty (_gluable).
The input is unchanged in between: any writer would have been bound in between, and a copy
into it would mean it was not valid here before. `_last` describes the node bound last on
this GPU, with its buffer table (so nothing fuses across plans): ("add", node, buf, cell),
("writer", (id(buf), out), cell, rows, n) or ("x8", (id(buf), x), rows, K).
Longer runs (fusion.find_groups, see Backend.prepare) bind as one group on nbmoe/cuda/fused.py's
kernels: the members after the first carry the record of the node before the group (or the
one the group's binder leaves).
"""
import numpy as np

from nbmoe.backends.cpu import _act, _labelled, _rows2d, _window, chosen_slots, expert_glu, kv_types
from nbmoe.sched import fusion


class FusionBinders:
    fuse_kinds = fusion.KINDS + fusion.ADD_KINDS
    _last = None

    def vec_ok(self, node, n_tokens):
        t = self.tensors[node.weight]
        return self.mm.quantizes_x(int(t.ggml_type), n_tokens, int(t.ne[0]))

    def bind(self, node, buf, state):
        self.activate()
        self._prev, self._last = self._last, None
        if self._biasable is None or node.op not in ("MUL_MAT", "MUL_MAT_ID", "ADD_BIAS", "ADD_BIAS_ID"):
            self._biasable = {}
        if node.op not in ("ADD_BIAS_ID", "GLU"):
            self._gluable = None
        group = self._groups.get(id(node))
        if group is not None and node is not group[1][0]:
            self._last = self._prev
        return super().bind(node, buf, state)

    def bind_add(self, node, buf, state):
        out, a, b = (_rows2d(buf[n]) for n in (node.out,) + node.srcs)
        ops, cell = self.ops, {}
        if node.out == node.srcs[0]:
            self._last = ("add", node, buf, cell)

        def run():
            fused = cell.get("norm")
            if fused is None:
                ops.add(out, a, b)
            else:
                fused()
        return run

    def bind_rms_norm(self, node, buf, state):
        if "cols" in node.params:          # a window of each head: the plain kernel
            return super().bind_rms_norm(node, buf, state)
        w, eps, ops, x8, cell = self.vector(node.weight), node.params["eps"], self.ops, self.x8, {}
        n = w.shape[0]
        x, out = buf[node.srcs[0]], buf[node.out]
        add = None
        prev = self._prev
        if ("src_rows" not in node.params and prev and prev[0] == "add" and prev[2] is buf
                and prev[1].out == node.srcs[0] and x.size // x.shape[0] == n):
            add = buf[prev[1].srcs[1]]
        elif "src_rows" in node.params:
            lo, hi = node.params["src_rows"]
            x = x[lo:hi]
        rows = x.size // n
        self._last = ("writer", (id(buf), node.out), cell, rows, n)

        def norm():
            xq, xds = x8.x8_buffers(rows, n) if cell.get("x8") else (None, None)
            ops.rms_norm(out, x, w, eps, add=add, xq=xq, xds=xds)
        if add is None:
            return norm
        prev[3]["norm"] = norm                 # the ADD's step runs the fused launch
        return lambda: None

    def _x_ready(self, node, buf, qtype, rows, K):
        """Whether x (rows of K) is already in the 8-bit buffers when this product runs."""
        key = (id(buf), node.srcs[0])
        if not self.mm.quantizes_x(qtype, rows, K):
            return False
        self._last = ("x8", key, rows, K)
        prev = self._prev
        if prev and prev[0] == "x8" and prev[1:] == (key, rows, K):
            return True                        # the product before quantized this x
        if prev and prev[0] == "writer" and prev[1] == key and prev[3:] == (rows, K) and K % 32 == 0:
            prev[2]["x8"] = True               # the norm (attention) writes x in 8 bits too
            return True
        return False

    def _resident_mul_mat(self, node, buf):
        out, w, x, qtype = self.mul_mat_operands(node, buf)
        mm, cell = self.mm, {}
        ready = self._x_ready(node, buf, qtype, x.shape[0], x.shape[1])
        if mm.fuses_bias(qtype, x.shape[0], x.shape[1]):
            self._biasable[(id(buf), node.out)] = (node, cell)
        return lambda: mm.mul_mat(out, w, x, qtype, x_ready=ready, bias=cell.get("bias"))

    def _resident_mul_mat_id(self, node, buf):
        out, w, x, ids, qtype = self.mul_mat_id_operands(node, buf)
        mm, cell = self.mm, {}
        ready = self._x_ready(node, buf, qtype, x.shape[0] * x.shape[1], x.shape[2])
        tile = mm.id_tile(qtype, x.shape[2], x.shape[0], w.shape[0], ids.shape[1])
        grouped = self._grouped(node, buf, ids, w.shape[0], tile)
        if mm.fuses_bias_id(qtype, x.shape[0], x.shape[2]):
            self._biasable[(id(buf), node.out)] = (node, cell)
        self.glu_cell(node, buf, qtype, x.shape[0], x.shape[2], w.shape[1], cell)
        return lambda: mm.mul_mat_id(out, w, x, ids, qtype, x_ready=ready, grouped=grouped,
                                     bias=cell.get("bias"), glu=cell.get("glu"))

    # A merged gate_up product bound last (and only its bias since): ((id(buf), output), cell).
    _gluable = None

    def glu_cell(self, node, buf, qtype, T, K, M, cell):
        """Offer the GLU of this expert product's halves to its kernel (bind_glu decides)."""
        if self.mm.fuses_glu_id(qtype, T, K, M):
            self._gluable = ((id(buf), node.out), cell)

    def bind_glu(self, node, buf, state):
        found, self._gluable = self._gluable, None
        if (found is None or len(node.srcs) != 1 or found[0] != (id(buf), node.srcs[0])
                or not fusion.supported(node, "CUDA")):
            return super().bind_glu(node, buf, state)
        F = buf[node.out].shape[len(buf[node.out].shape) - 1]
        found[1]["glu"] = (buf[node.out].reshape(-1, F), _act(self.fused, node))
        return lambda: None

    # A product's bias, bound after it (and its twins of the same input) while only products
    # and biases were bound in between: (id(buf), output) -> (product node, its step's cell).
    _biasable = None

    def _fused_bias(self, node, buf):
        """An empty step when the product that wrote node's input adds node's bias itself."""
        found = self._biasable.pop((id(buf), node.out), None)
        if found is None or node.srcs[0] != node.out or found[0].srcs[1:] != node.srcs[1:]:
            return None
        found[1]["bias"] = self.vector(node.weight)
        self._last = self._prev          # the x8 record goes on to the next twin product
        return lambda: None

    def bind_add_bias(self, node, buf, state):
        return self._fused_bias(node, buf) or super().bind_add_bias(node, buf, state)

    def bind_add_bias_id(self, node, buf, state):
        return self._fused_bias(node, buf) or super().bind_add_bias_id(node, buf, state)

    # A prompt's expert products group their (token, expert) pairs by expert first (a kernel
    # launch, matmul_tiled.group_by_expert); a MoE layer's gate, up and down products share their
    # ids, and steps run in the order they are bound, so a product of the same layer whose ids,
    # experts and tile are those of the grouping bound last on this GPU reuses its table (the
    # next layer routes anew: its ids differ). Anything else that groups (an offloaded product)
    # is bound in between and resets the record.
    _grouping = None

    def _grouped(self, node, buf, ids, E, tile):
        if not tile:
            return False                       # matrix-vector: no grouping, the table stays
        whole = tuple(ids.shape) == tuple(buf[node.srcs[1]].shape)
        layer = (node.weight or "").split(".")[1] if (node.weight or "").startswith("blk.") else None
        key = (id(buf), node.srcs[1], E, tile, layer) if whole else None
        same = key is not None and key == self._grouping
        self._grouping = key
        return same

    # -- fused groups (fusion.py): a list of steps, one per member (None: nothing to run) ------
    def _x8(self, node, buf, qtype, x):
        """A closure giving the 8-bit (xq, xds) of x (rows of K) for this product, quantizing
        it unless the node bound before already provides it (see _x_ready)."""
        rows, K = int(np.prod(x.shape[:-1])), x.shape[len(x.shape) - 1]
        ready, x8 = self._x_ready(node, buf, qtype, rows, K), self.x8
        return lambda: x8.quantize_x(x, rows, K, ready=ready)

    def _biases(self, members, products):
        """The bias vector of each product among a group's members (an ADD_BIAS of its
        output), or the empty array (none), looked up once, at binding."""
        by_out = {n.srcs[0]: n for n in members if n.op == "ADD_BIAS"}
        return [self.vector(by_out[p.out].weight) if p.out in by_out else self.empty() for p in products]

    def _bind_products(self, members, buf, state):
        products = [n for n in members if n.op == "MUL_MAT"]      # [with their ADD_BIAS]
        ops = [self.mul_mat_operands(n, buf) for n in products]
        outs, ws = [o[0] for o in ops], [o[1] for o in ops]
        x, qtype = ops[0][2], ops[0][3]
        x8, fused, K = self._x8(members[0], buf, qtype, x), self.fused, x.shape[1]
        biases = self._biases(members, products)

        def run():
            xq, xds = x8()
            fused.products_q8(outs, ws, xq, xds, qtype, K, biases=biases)
        return [None] * (len(members) - 1) + [_labelled(run, "MUL_MAT")]

    def _bind_glu(self, members, buf, state):
        gate, up, glu = members
        _, wg, x, qtype = self.mul_mat_operands(gate, buf)
        wu = self.mul_mat_operands(up, buf)[1]
        out, act, K = _rows2d(buf[glu.out]), _act(self.fused, glu), x.shape[1]
        x8, fused = self._x8(gate, buf, qtype, x), self.fused

        def run():
            xq, xds = x8()
            fused.glu_q8(out, wg, wu, xq, xds, qtype, K, act)
        return [None, None, _labelled(run, "MUL_MAT+GLU")]

    def _bind_glu_id(self, members, buf, state):
        gate, up, glu = expert_glu(members)
        _, wg, x, ids, qtype = self.mul_mat_id_operands(gate, buf)
        # up None: a merged gate_up (-muge), the up rows after each expert's gate rows
        wu = self.mul_mat_id_operands(up, buf)[1] if up else None
        bg, bu = self.expert_bias(members, gate), self.expert_bias(members, up)
        out, act, X, K = buf[glu.out], _act(self.fused, glu), x.shape[1], x.shape[2]
        x8, fused = self._x8(gate, buf, qtype, x), self.fused

        def run():
            xq, xds = x8()
            fused.glu_id_q8(out, wg, wu, xq, xds, ids, X, qtype, K, act, bg=bg, bu=bu)
        return [None] * (len(members) - 1) + [_labelled(run, "MUL_MAT_ID_GLU")]

    def _bind_down_combine(self, members, buf, state):
        down = members[0]
        combine = next(n for n in members if n.op == "MOE_COMBINE")
        _, w, x, ids, qtype = self.mul_mat_id_operands(down, buf)
        out, wts, K = buf[combine.out], chosen_slots(combine, buf[combine.srcs[1]]), x.shape[2]
        bias = self.expert_bias(members, down)
        add = members[-1].op == "ADD"            # down_combine_add: x += the weighted sum
        if add:
            out = buf[members[-1].out]
        x8, fused = self._x8(down, buf, qtype, x), self.fused

        def run():
            xq, xds = x8()
            fused.down_combine_q8(out, w, xq, xds, ids, wts, qtype, K, accumulate=add, bias=bias)
        return [None] * (len(members) - 1) + [_labelled(
            run, "MUL_MAT_ID+MOE_COMBINE+ADD" if add else "MUL_MAT_ID+MOE_COMBINE")]

    _bind_down_combine_add = _bind_down_combine

    def _bind_product_add(self, members, buf, state):
        """x += x_in @ W^T [+ b]: the product accumulates into the residual stream (no ADD_BIAS
        or ADD launch)."""
        product, add = members[0], members[-1]
        _, w, x, qtype = self.mul_mat_operands(product, buf)
        out, mm, bias = _rows2d(buf[add.out]), self.mm, self._biases(members, [product])[0]
        ready = self._x_ready(product, buf, qtype, x.shape[0], x.shape[1])
        self._last = None
        return [None] * (len(members) - 1) + [_labelled(
            lambda: mm.mul_mat(out, w, x, qtype, x_ready=ready, accumulate=True, bias=bias),
            "MUL_MAT+ADD")]

    def route_ok(self, norm, router, topk):
        if router.weight not in self.resident:
            return False
        t = self.tensors[router.weight]
        return self.fused.route_supported(int(t.ggml_type), int(t.ne[0]), int(t.ne[1]),
                                          int(topk.params["k"]))

    def _bind_norm_route(self, members, buf, state):
        norm, router, topk = members[0], members[1], members[-1]
        route = _route_args(self, topk)
        if len(members) == 4:                  # the router's bias
            route["logit_bias"] = self.vector(members[2].weight)
        wn, eps = self.vector(norm.weight), norm.params["eps"]
        x, h = _rows2d(buf[norm.srcs[0]]), _rows2d(buf[norm.out])
        wr, wtype = self.weight(router.weight)
        logits = _rows2d(buf[router.out])
        wts, ids = buf[topk.out], buf[topk.params["also_writes"][0]]
        D, x8 = x.shape[1], self.x8
        flag, fused = topk.params["norm"], self.fused
        self._last = ("x8", (id(buf), norm.out), 1, D)   # the experts' products: h in 8 bits
        # what the CPU reads next (hybrid): also written to its mapped host buffers (a buffer
        # that is not mirrored gets its device copy written twice over: the same bits)
        mirrors = getattr(buf, "mirrors", {})
        writes = ((norm.out, h), (topk.params["also_writes"][0], ids), (topk.out, wts))
        names = [n for n, _ in writes if n in mirrors]
        mirror = tuple(_rows2d(mirrors.get(n, a)) for n, a in writes) if names else None

        signal = {"flag": None}               # graph_run sets it if this step ends a graph

        def run():
            xq, xds = x8.x8_buffers(1, D)     # (at run time: the buffers grow while binding)
            fused.norm_route(h, xq, xds, x, wn, eps, wr, wtype, logits, ids, wts, flag, mirror=mirror,
                             signal=signal["flag"], **route)
        run.mirrors = names
        if mirror is not None:                # the CPU reads these next: it may wait for a flag
            run.signal = signal
        return [None] * (len(members) - 1) + [_labelled(run, "RMS_NORM+MUL_MAT+TOPK_MOE")]

    def _bind_mla_rope(self, members, buf, state):
        rq, norm, rk = members
        (qlo, qhi), nlo, klo = rq.params["cols"], norm.params["cols"][0], rk.params["cols"][0]
        Dr, R = qhi - qlo, norm.params["cols"][1] - nlo
        qi, qo = _window(buf[rq.srcs[0]], qlo, Dr), _window(buf[rq.out], rq.params["at"], Dr)
        lat, kpe = _window(buf[norm.out], nlo, R), _window(buf[rk.out], klo, Dr)
        w, eps, pos, p = self.vector(norm.weight), norm.params["eps"], buf[rq.srcs[1]], rq.params
        norm_rope = self.norm_rope

        def run():
            norm_rope.mla_rope(qo, qi, lat, kpe, pos, w, eps, p["freqs"], p["mscale"], p["neox"])
        return [None, None, _labelled(run, "ROPE+RMS_NORM+ROPE")]

    def _bind_rope_attn(self, members, buf, state):
        attn_node, rope = members[-1], members[-2]
        out, q, k, v, pos = (buf[n] for n in (attn_node.out,) + attn_node.srcs)
        norms = members[:-3]
        wq, wk = (self.vector(n.weight) for n in norms) if norms else (None, None)
        eps = norms[0].params["eps"] if norms else 0.0
        layer = attn_node.params["layer"]
        kv = lambda: (state.kv.k[layer], state.kv.v[layer])    # the active slot's, at run time
        p, a = rope.params, attn_node.params
        attn, norm_rope, x8, cell = self.attn, self.norm_rope, self.x8, {}
        sinks = self.sinks(attn_node)
        T, H, Dh = q.shape
        if Dh % 32 == 0 and T <= attn.SPLIT_MAX_T:    # the o product may take out in 8 bits
            self._last = ("writer", (id(buf), attn_node.out), cell, T, H * Dh)

        fa = self.use_flash(T, Dh, kv_types(state, layer))
        if attn.rope_supported(T, Dh):    # one launch (decoding), or two over a long cache
            def rope_attention():
                kc, vc = kv()
                xq, xds = x8.x8_buffers(T, H * Dh) if cell.get("x8") else (None, None)
                if fa and attn.flash_decodes(q, kc, vc):
                    norm_rope.norm_rope_store(q, k, v, kc, vc, pos, wq, wk, eps, p["freqs"], p["mscale"],
                                              p["neox"])
                    attn.attention(out, q, kc, vc, pos, a["scale"], a["window"], xq=xq, xds=xds,
                                   sinks=sinks, fa=True)
                    return
                attn.rope_attention(out, q, k, v, kc, vc, pos, wq, wk, eps, p["freqs"],
                                    p["mscale"], p["neox"], a["scale"], a["window"], xq=xq, xds=xds,
                                    sinks=sinks)
            return [None] * (len(members) - 1) + [_labelled(rope_attention, "QK_NORM+ROPE+ATTN")]

        def norm_rope_store():
            kc, vc = kv()
            norm_rope.norm_rope_store(q, k, v, kc, vc, pos, wq, wk, eps, p["freqs"], p["mscale"], p["neox"])

        def attention():
            kc, vc = kv()
            xq, xds = x8.x8_buffers(T, H * Dh) if cell.get("x8") else (None, None)
            attn.attention(out, q, kc, vc, pos, a["scale"], a["window"], xq=xq, xds=xds, sinks=sinks,
                           fa=fa)
        return ([None] * (len(members) - 2) + [_labelled(norm_rope_store, "QK_NORM+ROPE+KV_STORE")]
                + [_labelled(attention, "ATTN")])


def _route_args(backend, topk):
    """TOPK_MOE's variant as norm_route's keywords."""
    return dict(zip(("gating", "scale", "bias", "n_group", "topk_group"), backend._route_args(topk)))
