"""Blocks of the grid IQ types for tests and test models: gguf-py can decode them, not make them.

    blocks = random_blocks(rng, n_blocks, "IQ2_XXS")   # uint8 [n_blocks, type_size], valid
    q = quantize(x, "IQ2_XXS")                          # float32 [..., K] -> uint8 [..., row_bytes]

Both fill each type's fields (f16 d, sub-block scales, grid indices, signs or IQ1 deltas) and
pack them with `pack`, the byte layout gguf-py's dequantize reads (drawn in
nbmoe/cpu/quants_iq.py). random_blocks draws every field at random, with d chosen so values
are O(1). quantize is a simple nearest-grid quantizer (not llama.cpp's search with importance
weights): per 8 (IQ3: 4) values, the grid row nearest to |x| / (d s) with x's signs (for the
7-bit-sign types the smallest value's sign is flipped when the count of minus signs is odd),
or for IQ1 the row nearest to x / (d s) - delta with the better delta sign.
"""
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

NAMES = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")

# name -> (gguf-py class, group size, sub-block scale group size, scale code bits, sign kind)
# sign kind: 7 = 7 stored bits + parity per 8 values, 8 = a bit per value, 0 = IQ1 delta
LAYOUT = {
    "IQ2_XXS": (gq.IQ2_XXS, 8, 32, 4, 7),
    "IQ2_XS": (gq.IQ2_XS, 8, 16, 4, 7),
    "IQ2_S": (gq.IQ2_S, 8, 16, 4, 8),
    "IQ3_XXS": (gq.IQ3_XXS, 4, 32, 4, 7),
    "IQ3_S": (gq.IQ3_S, 4, 32, 4, 8),
    "IQ1_S": (gq.IQ1_S, 8, 32, 3, 0),
    "IQ1_M": (gq.IQ1_M, 8, 16, 3, 0),
}


def grid(name):
    cls = LAYOUT[name][0]
    cls.init_grid()
    return cls.grid.reshape(cls.grid_shape).astype(np.float32)


def scale_of(name, sc):
    """Sub-block multiplier s (v = d * s * ...) of scale code sc."""
    if name in ("IQ2_XXS", "IQ2_XS", "IQ2_S"):
        return (0.5 + sc) * 0.25
    if name == "IQ3_XXS":
        return (0.5 + sc) * 0.5
    return 1.0 + 2.0 * sc  # IQ3_S, IQ1_S, IQ1_M


def _f16_bits(d):
    return np.asarray(d, np.float32).astype(np.float16).view(np.uint16).astype(np.uint32)


def _le(v, n):
    """uint32 array [..., m] -> its n low bytes each, little-endian: uint8 [..., m * n]."""
    v = np.asarray(v, np.uint32)
    return np.stack([(v >> (8 * i)) & 255 for i in range(n)], -1).reshape(v.shape[:-1] + (-1,)).astype(np.uint8)


def pack(name, d, sc, idx, signs):
    """Fields of n super-blocks -> uint8 [n, type_size].
    d [n] float, sc [n, S] scale codes (S = 256 / scale group), idx [n, G] grid indices
    (G = 256 / group size), signs: sign kind 7: [n, 32] 7-bit codes, kind 8: [n, 32] bytes
    (bit j = value 8i + j negative), IQ1: [n, G] bools (delta negative), IQ1_S: [n, 8]."""
    n = d.shape[0]
    sc, idx, signs = (np.asarray(a, np.uint32) for a in (sc, idx, signs))
    dh = _f16_bits(d)[:, None]
    if name == "IQ2_XXS":
        s7 = signs.reshape(n, 8, 4) << np.array([0, 7, 14, 21], np.uint32)
        aux = s7.sum(-1, dtype=np.uint32) | (sc << 28)
        parts = [_le(dh, 2), np.concatenate([idx.reshape(n, 8, 4), _le(aux[..., None], 4).reshape(n, 8, 4)], -1)
                 .reshape(n, 64)]
    elif name == "IQ2_XS":
        parts = [_le(dh, 2), _le(idx | (signs << 9), 2), _le(sc[:, 0::2] | (sc[:, 1::2] << 4), 1)]
    elif name == "IQ2_S":
        qh = ((idx >> 8).reshape(n, 8, 4) << np.array([0, 2, 4, 6], np.uint32)).sum(-1, dtype=np.uint32)
        parts = [_le(dh, 2), _le(idx & 255, 1), _le(signs, 1), _le(qh, 1), _le(sc[:, 0::2] | (sc[:, 1::2] << 4), 1)]
    elif name == "IQ3_XXS":
        s7 = signs.reshape(n, 8, 4) << np.array([0, 7, 14, 21], np.uint32)
        parts = [_le(dh, 2), _le(idx, 1), _le(s7.sum(-1, dtype=np.uint32) | (sc << 28), 4)]
    elif name == "IQ3_S":
        qh = ((idx >> 8).reshape(n, 8, 8) << np.arange(8, dtype=np.uint32)).sum(-1, dtype=np.uint32)
        parts = [_le(dh, 2), _le(idx & 255, 1), _le(qh, 1), _le(signs, 1), _le(sc[:, 0::2] | (sc[:, 1::2] << 4), 1)]
    elif name == "IQ1_S":
        hi = ((idx >> 8).reshape(n, 8, 4) << np.array([0, 3, 6, 9], np.uint32)).sum(-1, dtype=np.uint32)
        parts = [_le(dh, 2), _le(idx & 255, 1), _le(hi | (sc << 12) | (signs << 15), 2)]
    elif name == "IQ1_M":
        nib = (idx >> 8) | (signs << 3)
        s3 = (sc.reshape(n, 4, 4) << np.array([0, 3, 6, 9], np.uint32)).sum(-1, dtype=np.uint32)
        dnib = (dh >> np.array([0, 4, 8, 12], np.uint32)) & 15
        parts = [_le(idx & 255, 1), _le(nib[:, 0::2] | (nib[:, 1::2] << 4), 1), _le(s3 | (dnib << 12), 2)]
    else:
        raise ValueError(f"not a grid IQ type: {name}")
    out = np.ascontiguousarray(np.concatenate(parts, -1), np.uint8)
    assert out.shape[1] == GGML_QUANT_SIZES[GGMLQuantizationType[name]][1], name
    return out


def random_blocks(rng, n, name):
    """n valid super-blocks of type name with random fields, values O(1)."""
    cls, group, sgroup, sbits, kind = LAYOUT[name]
    n_rows = cls.grid_shape[0]
    typical = {"IQ2_XXS": 50, "IQ2_XS": 50, "IQ2_S": 50, "IQ3_XXS": 120, "IQ3_S": 120, "IQ1_S": 8, "IQ1_M": 8}
    d = rng.uniform(0.5, 1.5, n) / typical[name]
    sc = rng.integers(0, 1 << sbits, (n, 256 // sgroup))
    idx = rng.integers(0, n_rows, (n, 256 // group))
    if kind == 7:
        signs = rng.integers(0, 128, (n, 32))
    elif kind == 8:
        signs = rng.integers(0, 256, (n, 32))
    else:
        signs = rng.integers(0, 2, (n, 8 if name == "IQ1_S" else 32))
    return pack(name, d, sc, idx, signs)


# ---------------------------------------------------------------- nearest-grid quantizer

def _nearest(targets, g, chunk=8192):
    """Index of the grid row nearest to each target row, and the squared distance."""
    # |t - g|^2 - |t|^2 = [t, 1] . [-2 g, |g|^2]: one product per chunk
    targets = np.asarray(targets, np.float32)
    gt = np.concatenate([-2 * g, (g * g).sum(1, keepdims=True)], 1).T.astype(np.float32)
    idx = np.empty(targets.shape[0], np.int64)
    for i in range(0, targets.shape[0], chunk):
        t = targets[i:i + chunk]
        idx[i:i + chunk] = (np.concatenate([t, np.ones((t.shape[0], 1), np.float32)], 1) @ gt).argmin(1)
    err = ((targets - g[idx]) ** 2).sum(1)
    return idx, err


def _quantize_blocks(x, name):
    """float32 [n, 256] -> uint8 [n, type_size]."""
    _, group, sgroup, sbits, kind = LAYOUT[name]
    n = x.shape[0]
    g = grid(name)
    amax = np.abs(x).reshape(n, -1, sgroup).max(-1)                        # [n, S]
    gmax = 1.125 if kind == 0 else float(g.max())
    ideal = amax / gmax                                                    # wanted d * s
    d = (ideal.max(1) / scale_of(name, (1 << sbits) - 1)).astype(np.float16).astype(np.float32)
    dsafe = np.where(d > 0, d, 1.0)                                        # d = 0: all zero
    code = np.arange(1 << sbits)
    sc = np.abs(ideal[..., None] / dsafe[:, None, None] - scale_of(name, code)).argmin(-1)  # [n, S]
    ds = (dsafe[:, None] * scale_of(name, sc)).repeat(sgroup // group, 1)  # [n, G]
    xg = x.reshape(n, -1, group)                                           # [n, G, group]
    if kind == 0:  # IQ1: pick the delta sign (per 32 values for IQ1_S, per 8 for IQ1_M)
        t = xg / ds[..., None]
        cand = [_nearest((t - delta).reshape(-1, group), g) for delta in (0.125, -0.125)]
        err = np.stack([e.reshape(n, -1) for _, e in cand])                # [2, n, G]
        if name == "IQ1_S":
            err = err.reshape(2, n, 8, 4).sum(-1).repeat(4, -1)
        minus = err[1] < err[0]
        idx = np.where(minus, cand[1][0].reshape(n, -1), cand[0][0].reshape(n, -1))
        signs = minus[:, 0::4] if name == "IQ1_S" else minus
        return pack(name, d, sc, idx, signs)
    neg = xg < 0
    idx, _ = _nearest((np.abs(xg) / ds[..., None]).reshape(-1, group), g)
    neg = neg.reshape(n, 32, 8)
    if kind == 7:  # an even count of minus signs per 8: flip the smallest value's sign if odd
        odd = neg.sum(-1) % 2 == 1
        smallest = np.abs(x.reshape(n, 32, 8)).argmin(-1)
        neg[odd, smallest[odd]] ^= True
        signs = (neg[..., :7] << np.arange(7)).sum(-1)
    else:
        signs = (neg << np.arange(8)).sum(-1)
    return pack(name, d, sc, idx.reshape(n, -1), signs)


def quantize(x, name):
    """float32 [..., K] (K a multiple of 256) -> uint8 [..., K / 256 * type_size] of type name."""
    x = np.asarray(x, np.float32)
    blocks = _quantize_blocks(x.reshape(-1, 256), name)
    return blocks.reshape(x.shape[:-1] + (x.shape[-1] // 256 * blocks.shape[1],))
