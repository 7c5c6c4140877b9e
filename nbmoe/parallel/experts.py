"""One rank's share of every MoE layer's experts, and the partial sums it computes.

Legend: T tokens, D model dim, A chosen experts per token, F expert FFN width, P the
(token, slot) pairs whose chosen expert is in this share, E_r the share's experts.

Rank r of R owns a contiguous run [lo, hi) of each MoE layer's experts: [r*E/R, (r+1)*E/R) in
the even split, all or none of a layer's where an `-ot ...=RANKn` rule places it
(placement.expert_ranks); their weights are views of the file's mapping, so a rank reads only
its share's pages. For a batch it gathers the pairs
whose expert it owns into rows of their own ([P, 1, D]: one chosen expert each) and runs them
through the CPU kernels the single-process engine uses for a batch of that many rows (the
fused gate/up/GLU and down/combine kernels for few rows, the grouped products otherwise);
a token's partial sum adds its pairs' weighted outputs in slot order (zeros for a token with
none of this share's experts).
"""
import hashlib

import numpy as np

from nbmoe.backends.cpu import GLU_KERNELS
from nbmoe.cpu.moe import sum_pairs
from nbmoe.sched.fusion import FUSED_SUPPORT
from nbmoe.sched.placement import expert_ranks, parse_overrides


def layout_of(cfg, n_ranks, override_tensors=()):
    """{MoE layer: [(lo, hi) of each rank]} for --ep n_ranks and the -ot rules (RANKn)."""
    rules = parse_overrides(override_tensors, None, n_ranks=n_ranks)
    moe = [il for il in range(cfg.n_layer) if cfg.is_moe_layer(il)]
    return expert_ranks(moe, cfg.n_expert, n_ranks, rules)


def index_hash(gguf):
    """A digest of the file's tensor index (names, types, shapes, offsets): ranks whose files
    differ in any of them would compute different experts."""
    h = hashlib.sha256()
    for name, t in sorted(gguf.tensors.items()):
        h.update(f"{name}:{int(t.ggml_type)}:{tuple(int(n) for n in t.ne)}:{t.offset};".encode())
    return h.hexdigest()


def is_expert_tensor(name):
    """A tensor whose rows are indexed by expert (the products' weights and biases)."""
    return "_exps." in name


class ExpertShare:
    """Experts spans[il] = (lo, hi) of each MoE layer il of `cfg`, read through `backend` (a
    CPUBackend: its weight() and vector(), so rank 0 and the others bind the same way)."""

    def __init__(self, cfg, backend, spans):
        self.cfg, self.backend, self.spans = cfg, backend, dict(spans)
        self.mm, self.fused, self.ops = backend.mm, backend.fused, backend.ops
        self.glu = getattr(self.ops, GLU_KERNELS[cfg.flags.glu])
        self.act = getattr(self.fused, "ACT_" + cfg.flags.glu.upper(), None)
        self.layers = {il: self._layer(il, lo, hi) for il, (lo, hi) in self.spans.items() if hi > lo}

    def _layer(self, il, lo, hi):
        """{role: (w [E_r, M, row_bytes], qtype, bias [E_r, M] or None)} of layer il."""
        out = {}
        for role in ("gate", "up", "down"):
            name = f"blk.{il}.ffn_{role}_exps"
            w, qtype = self.backend.weight(name + ".weight")
            bias = None
            if self.cfg.has(f"ffn_{role}_exps.bias"):
                bias = self.backend.vector(name + ".bias").reshape(w.shape[0], -1)[lo:hi]
            out[role] = (w[lo:hi], qtype, bias)
        return out

    @property
    def n_bytes(self):
        """Bytes of expert weights this share holds (all layers)."""
        return sum(w.nbytes for layer in self.layers.values() for w, _, _ in layer.values())

    def compute(self, out, il, h, ids, wts):
        """out [T, D] = sum over token t's slots a whose expert is in this share of
        wts[t, a] * expert(h[t]); h [T, D], ids [T, A] int32, wts [T, A]."""
        out[:] = 0
        lo, hi = self.spans.get(il, (0, 0))
        t, a = np.nonzero((ids >= lo) & (ids < hi))                   # [P] pairs, token order
        P = t.shape[0]
        if P == 0:
            return
        x = np.ascontiguousarray(h[t]).reshape(P, 1, -1)              # [P, 1, D]
        local = (ids[t, a] - lo).astype(np.int32).reshape(P, 1)        # [P, 1]
        w = np.ascontiguousarray(wts[t, a], dtype=np.float32).reshape(P, 1)
        y = self._experts(il, x, local, w)                            # [P, D] weighted
        first = np.flatnonzero(np.r_[True, t[1:] != t[:-1]])          # each token's first pair
        sum_pairs(out, y, t[first], np.append(first, P))

    def _experts(self, il, x, ids, w):
        """y [P, D] = w[p] * down(glu(gate x[p], up x[p])) through expert ids[p] (local)."""
        (wg, qg, bg), (wu, qu, bu), (wd, qd, bd) = (self.layers[il][r] for r in ("gate", "up", "down"))
        P, F, D, mm = x.shape[0], wg.shape[1], wd.shape[1], self.mm
        g = np.empty((P, 1, F), np.float32)
        fused = (P <= self.backend.max_vec_t and self.act is not None and qg == qu
                 and FUSED_SUPPORT["CPU"]["GLU"](_Glu(self.cfg)))
        if fused:      # as the CPU backend's expert_ffn group (biases included): one region
            steps = (mm.expert_item_rows(F, wg.shape[2], P, qg), mm.expert_item_rows(D, wd.shape[2], P, qd))
            y = np.empty((P, D), np.float32)
            self.fused.expert_ffn(y, g, wg, wu, wd, x, ids, w, (qg, qd), (mm._int8(qg), mm._int8(qd)),
                                  steps, self.act, bg, bu, bd)
            return y
        u = np.empty((P, 1, F), np.float32)
        self._product(g, wg, x, ids, qg, bg)
        self._product(u, wu, x, ids, qu, bu)
        self.glu(g.reshape(P, F), g.reshape(P, F), u.reshape(P, F))
        yd = np.empty((P, 1, D), np.float32)
        self._product(yd, wd, g, ids, qd, bd)
        y = np.empty((P, D), np.float32)
        self.backend.moe.moe_combine(y, yd, w)
        return y

    def _product(self, out, w, x, ids, qtype, bias):
        self.mm.mul_mat_id(out, w, x, ids, qtype)
        if bias is not None:
            self.ops.add_bias_id(out, out, bias, ids)


class _Glu:
    """A stand-in GLU node for fusion.FUSED_SUPPORT's test of the activation."""

    def __init__(self, cfg):
        self.params = {"act": cfg.flags.glu}
