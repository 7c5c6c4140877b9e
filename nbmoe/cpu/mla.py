"""MLA's expanded form for prompt batches (model/forward.py's mla_attention), on CPU.

The cache keeps one row per token: [latent (R), k_pe (Dr)] (model/kv_cache.py). For a batch of
many tokens it is cheaper to give every cached token its full per-head key and value once,
and attend with them, than to attend over the R-wide latent with the absorbed query:
    kv[j] = W @ latent[j]                       W: attn_kv_b [H * (Dn + Dv), R] (a product)
    key[j, h]   = [kv[j, h, :Dn], k_pe[j]]      [Dn + Dr]
    value[j, h] = kv[j, h, Dn:]                 [Dv]
latents() makes the product's input, expand() its output's heads into f16 key and value
arrays that the flash kernel reads as it reads a cache.
"""
import numpy as np
from numba import njit, prange

from .half import f32_to_f16
from .kv_rows import load_row


@njit(cache=True, error_model="numpy", parallel=True)
def latents(lat, cache, K, first=0):
    """lat [n, R] float32 = the latents of cache rows first .. first + n - 1 (cache [C, 1, row]
    of K = R + Dr values, any type)."""
    n, R = lat.shape
    for j in prange(n):
        row = np.empty(K, np.float32)
        load_row(row, cache[first + j, 0])
        lat[j, :] = row[:R]


@njit(cache=True, error_model="numpy", parallel=True)
def expand(kexp, vexp, kv, cache, K, first=0):
    """Rows first .. first + n - 1 of kexp [C, H, Dn + Dr] and vexp [C, H, Dv] (f16 bits) from
    kv [n, H * (Dn + Dv)] float32 (the product) and the k_pe of the same cache rows (their
    last Dr of K values)."""
    n = kv.shape[0]
    H, Dk = kexp.shape[1], kexp.shape[2]
    Dv = vexp.shape[2]
    Dn = kv.shape[1] // H - Dv
    R = K - (Dk - Dn)
    for j in prange(n):
        row = np.empty(K, np.float32)
        load_row(row, cache[first + j, 0])
        for h in range(H):
            src = kv[j, h * (Dn + Dv):(h + 1) * (Dn + Dv)]
            for d in range(Dn):
                kexp[first + j, h, d] = f32_to_f16(src[d])
            for d in range(Dk - Dn):
                kexp[first + j, h, Dn + d] = f32_to_f16(row[R + d])
            for d in range(Dv):
                vexp[first + j, h, d] = f32_to_f16(src[Dn + d])
