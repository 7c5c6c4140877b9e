"""The ATTN step of MLA's expanded form (model/forward.py's mla_attention, params expand), the
same on every backend: store the batch's cache rows, give every cached token its per-head key
and value (the backend's mla kernels and one product with attn_kv_b, loader/mla.py), attend.

Two steps, so that a batch's launches can be recorded into a CUDA graph:
  the tokens cached before the batch (pos0 of them, a count the host knows at each call and a
  recording would freeze) get their keys and values in a step launched as it runs, before
  the graph's part (`step.before`; nothing when the batch starts its sequence);
  the batch's own rows (T, fixed, found on the device from its positions) and the attention
  are the node's step, recorded like any other.
Their scratch arrays (the latents, the product, the keys and values: f16 bits, as a cache)
hold the whole cache and are shared by the layers of a backend.
"""
import numpy as np


def _scratch(be, key, shapes):
    if key not in be.mla_scratch:
        be.mla_scratch[key] = tuple(be.alloc(shape, dtype) for shape, dtype in shapes)
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
    f32, f16 = np.float32, np.uint16
    lat, prod, keys, values = _scratch(be, ("cache", C, H, R, Dn, Dk, Dv), [
        ((C, R), f32), ((C, H * (Dn + Dv)), f32), ((C, H, Dk), f16), ((C, H, Dv), f16)])
    lat_b, prod_b = _scratch(be, ("batch", T, H, R, Dn, Dv), [((T, R), f32), ((T, H * (Dn + Dv)), f32)])
    be.attn_paths[(T, Dk)] = f"flash, MLA expanded (keys {Dk}, values {Dv} wide)"   # --explain
    attn, mm, mla = be.attn, be.mm, be.mla
    on_device = be.positions_on_device

    def cached_before():
        n = state.pos0
        if n:
            kc = state.kv.k[layer]
            mla.latents(lat[:n], kc, K)
            mm.mul_mat(prod[:n], w, lat[:n], qtype)
            mla.expand(keys, values, prod[:n], kc, K)

    def run():
        kc = state.kv.k[layer]
        p = pos if on_device else state.pos0          # the batch's rows start at p (p[0])
        attn.store_kv(kc, kc, kv, kv, p)
        mla.latents(lat_b, kc, K, p)
        mm.mul_mat(prod_b, w, lat_b, qtype)
        mla.expand(keys, values, prod_b, kc, K, p)
        attn.attention(out, q, keys, values, p, scale, 0, fa=True)
    run.before = cached_before
    return run
