"""The ATTN step of MLA's expanded form (model/forward.py's mla_attention, params expand), the
same on every backend: store the batch's cache rows, give every cached token its per-head key
and value (the backend's mla kernels and one product with attn_kv_b, loader/mla.py), attend.

The cached tokens' count, pos0 + T, changes from batch to batch, so the step sizes its work on
the host at each call and is never recorded into a CUDA graph (step.eager). Its scratch arrays
(the latents, the product, the keys and values: f16 bits, as a cache) hold the whole cache and
are shared by the layers of a backend.
"""
import numpy as np


def _scratch(be, C, H, R, Dn, Dk, Dv):
    key = (C, H, R, Dn, Dk, Dv)
    if key not in be.mla_scratch:
        be.mla_scratch[key] = (be.alloc((C, R), np.float32), be.alloc((C, H * (Dn + Dv)), np.float32),
                               be.alloc((C, H, Dk), np.uint16), be.alloc((C, H, Dv), np.uint16))
    return be.mla_scratch[key]


def bind_expanded_attn(be, node, buf, state):
    """The step of an ATTN node with params expand: out [T, H, Dv] from q [T, H, Dn + Dr] and
    the batch's cache rows kv [T, 1, R + Dr]."""
    out, q, kv, _, pos = (buf[n] for n in (node.out,) + node.srcs)
    layer, scale = node.params["layer"], node.params["scale"]
    w, qtype = be.weight(node.params["expand"])                   # [H (Dn + Dv), R]
    T, H, Dk = q.shape
    Dv = out.shape[2]
    Dn = w.shape[0] // H - Dv
    K = kv.shape[2]                                               # the cache row: [latent, k_pe]
    R = K - (Dk - Dn)
    C = state.kv.k[layer].shape[0]
    lat, prod, keys, values = _scratch(be, C, H, R, Dn, Dk, Dv)
    be.attn_paths[(T, Dk)] = f"flash, MLA expanded (keys {Dk}, values {Dv} wide)"   # --explain
    attn, mm, mla = be.attn, be.mm, be.mla
    on_device = be.positions_on_device

    def run():
        kc = state.kv.k[layer]
        p = pos if on_device else state.pos0
        attn.store_kv(kc, kc, kv, kv, p)
        n = state.pos0 + T
        mla.latents(lat[:n], kc[:n], K)
        mm.mul_mat(prod[:n], w, lat[:n], qtype)
        mla.expand(keys[:n], values[:n], prod[:n], kc[:n], K)
        attn.attention(out, q, keys, values, p, scale, 0, fa=True)
    run.eager = True
    return run
