"""Reference quantizers in NumPy for the GGUF types gguf-py can decode but not encode:
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS.

Simple ones (no error search as llama.cpp's make_qkx / importance weights): per group
min-max or abs-max scales, the super-block scale chosen so the largest group scale fits, then
nearest codes. Correct bit layouts, checked by decoding with gguf.quants.dequantize (tests).
Each quantizer maps float32 [..., K] (K a multiple of the block) to uint8 [..., row_bytes],
the contract of tools/make_model.py's QUANTIZERS and gguf.quants.quantize.

Letters: N blocks, G groups per block (16 or 32 values each, as the type has scales).
"""
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import IQ4_NL as _IQ4_NL

KV_IQ4 = np.array(_IQ4_NL.kvalues, np.float32)  # the 16 non-linear IQ4 levels


def _f16(v):
    """f16-rounded scale as float32 and its 2 bytes [N, 2]."""
    h = np.asarray(v, np.float32).astype(np.float16)
    return h.astype(np.float32), h.reshape(-1, 1).view(np.uint8)


def _div(a, b):
    """a / b, 0 where b == 0 (all-zero groups)."""
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, np.float32), where=b != 0)


def _blocks(x, block):
    x = np.asarray(x, np.float32)
    assert x.shape[-1] % block == 0, f"row of {x.shape[-1]} values is not a multiple of {block}"
    return x.reshape(-1, block)


def _asym(g, nq, nscale):
    """Groups g [N, G, n] -> (d, dmin f16 [N], sc, m [N, G] in 0..nscale, q [N, G, n] in 0..nq)
    with v = d * sc * q - dmin * m: min-max per group, the minimum clipped to <= 0."""
    lo = np.minimum(g.min(-1), 0)
    scale, mins = (g.max(-1) - lo) / nq, -lo
    d, db = _f16(scale.max(-1) / nscale)
    dmin, mb = _f16(mins.max(-1) / nscale)
    sc = np.clip(np.rint(_div(scale, d[:, None])), 0, nscale)
    m = np.clip(np.rint(_div(mins, dmin[:, None])), 0, nscale)
    q = np.rint(_div(g + (dmin[:, None] * m)[..., None], (d[:, None] * sc)[..., None]))
    return db, mb, sc.astype(np.uint8), m.astype(np.uint8), np.clip(q, 0, nq).astype(np.uint8)


def _sym(g, qmin, qmax, smax):
    """Groups g [N, G, n] -> (d f16 bytes, sc [N, G] in -smax-1..smax, q in qmin..qmax) with
    v = d * sc * q: the group's largest-magnitude value maps to qmin (the longer side)."""
    big = np.take_along_axis(g, np.abs(g).argmax(-1)[..., None], -1)[..., 0]
    scale = big / qmin
    d, db = _f16(np.abs(scale).max(-1) / smax)
    sc = np.clip(np.rint(_div(scale, d[:, None])), -smax - 1, smax)
    q = np.clip(np.rint(_div(g, (d[:, None] * sc)[..., None])), qmin, qmax)
    return db, sc.astype(np.int32), q.astype(np.int32)


def _bits(q, shifts):
    """Pack q [N, len(shifts), n] small codes into bytes [N, n]: sum of q[:, i] << shifts[i]."""
    out = np.zeros((q.shape[0], q.shape[2]), np.uint8)
    for i, s in enumerate(shifts):
        out |= (q[:, i].astype(np.uint8) << np.uint8(s))
    return out


def _crumbs(q):
    """2-bit codes of 256 values [N, 256] -> qs [N, 64]: value 128h + 32s + l in bits 2s of
    byte 32h + l (Q2_K, Q3_K)."""
    q = q.reshape(-1, 2, 4, 32)
    return np.concatenate([_bits(q[:, h], (0, 2, 4, 6)) for h in range(2)], -1)


def _k_scales(sc, m):
    """6-bit scales and mins [N, 8] -> the 12 packed bytes of Q4_K / Q5_K."""
    lo = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    mid = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return np.concatenate([lo, mid, hi], -1).astype(np.uint8)


def quantize_q2_k(x):
    """Q2_K: 256 values in 84 bytes = scales:16 (sc | m << 4) qs:64 d:f16 dmin:f16."""
    g = _blocks(x, 256).reshape(-1, 16, 16)
    db, mb, sc, m, q = _asym(g, 3, 15)
    return np.concatenate([sc | (m << 4), _crumbs(q.reshape(-1, 256)), db, mb], -1)


def quantize_q3_k(x):
    """Q3_K: 256 values in 110 bytes = hmask:32 qs:64 scales:12 (16 x 6-bit, -32) d:f16."""
    g = _blocks(x, 256).reshape(-1, 16, 16)
    db, sc, q = _sym(g, -4, 3, 31)
    u = (q + 4).reshape(-1, 256).astype(np.uint8)                    # 0..7 = low 2 bits + 4 * hbit
    hmask = _bits((u >> 2).reshape(-1, 8, 32), range(8))
    s = (sc + 32).astype(np.uint8)
    lo = (s[:, :8] & 15) | ((s[:, 8:] & 15) << 4)
    hi = _bits((s >> 4).reshape(-1, 4, 4), (0, 2, 4, 6))
    return np.concatenate([hmask, _crumbs(u & 3), lo, hi, db], -1)


def quantize_q4_k(x):
    """Q4_K: 256 values in 144 bytes = d:f16 dmin:f16 scales:12 qs:128."""
    g = _blocks(x, 256).reshape(-1, 8, 32)
    db, mb, sc, m, q = _asym(g, 15, 63)
    qs = q.reshape(-1, 4, 2, 32)
    qs = (qs[:, :, 0] | (qs[:, :, 1] << 4)).reshape(-1, 128)        # byte 32c + l: values 64c + l, +32
    return np.concatenate([db, mb, _k_scales(sc, m), qs], -1)


def quantize_q5_k(x):
    """Q5_K: 256 values in 176 bytes = d:f16 dmin:f16 scales:12 qh:32 qs:128."""
    g = _blocks(x, 256).reshape(-1, 8, 32)
    db, mb, sc, m, q = _asym(g, 31, 63)
    qh = _bits((q >> 4).reshape(-1, 8, 32), range(8))                 # bit i of byte l: value 32i + l
    qs = (q & 15).reshape(-1, 4, 2, 32)
    qs = (qs[:, :, 0] | (qs[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([db, mb, _k_scales(sc, m), qh, qs], -1)


def quantize_q6_k(x):
    """Q6_K: 256 values in 210 bytes = ql:128 qh:64 scales:16 int8 d:f16."""
    g = _blocks(x, 256).reshape(-1, 16, 16)
    db, sc, q = _sym(g, -32, 31, 127)
    u = (q + 32).reshape(-1, 2, 128).astype(np.uint8)                 # 0..63, two halves of 128
    ql = np.concatenate([(u[:, h, :64] & 15) | ((u[:, h, 64:] & 15) << 4) for h in range(2)], -1)
    qh = np.concatenate([_bits((u[:, h] >> 4).reshape(-1, 4, 32), (0, 2, 4, 6)) for h in range(2)], -1)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), db], -1)


def _nearest_iq4(v):
    """Index of the nearest IQ4 level to each of v (in units of the group scale)."""
    return np.abs(v[..., None] - KV_IQ4).argmin(-1).astype(np.uint8)


def quantize_iq4_nl(x):
    """IQ4_NL: 32 values in 18 bytes = d:f16 qs:16 (byte j: value j | value j + 16 << 4)."""
    g = _blocks(x, 32)
    big = np.take_along_axis(g, np.abs(g).argmax(-1)[:, None], -1)[:, 0]
    d, db = _f16(big / KV_IQ4[0])
    i = _nearest_iq4(_div(g, d[:, None]))
    return np.concatenate([db, i[:, :16] | (i[:, 16:] << 4)], -1)


def quantize_iq4_xs(x):
    """IQ4_XS: 256 values in 136 bytes = d:f16 scales_h:u16 scales_l:4 qs:128."""
    g = _blocks(x, 256).reshape(-1, 8, 32)
    big = np.take_along_axis(g, np.abs(g).argmax(-1)[..., None], -1)[..., 0]
    scale = big / KV_IQ4[0]
    d, db = _f16(np.abs(scale).max(-1) / 31)
    ls = np.clip(np.rint(_div(scale, d[:, None])), -32, 31).astype(np.int32)
    i = _nearest_iq4(_div(g, (d[:, None] * ls)[..., None]))            # [N, 8, 32]
    u = (ls + 32).astype(np.uint16)
    sh = np.zeros(u.shape[0], np.uint16)
    for j in range(8):
        sh |= (u[:, j] >> 4) << np.uint16(2 * j)
    sl = ((u[:, 0::2] & 15) | ((u[:, 1::2] & 15) << 4)).astype(np.uint8)
    qs = (i[:, :, :16] | (i[:, :, 16:] << 4)).reshape(-1, 128)
    return np.concatenate([db, sh.reshape(-1, 1).view(np.uint8), sl, qs], -1)


QUANTIZERS = {"Q2_K": quantize_q2_k, "Q3_K": quantize_q3_k, "Q4_K": quantize_q4_k,
              "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k, "IQ4_NL": quantize_iq4_nl,
              "IQ4_XS": quantize_iq4_xs}


# Byte offsets of each type's f16 scales (d, dmin) within its block, for random_blocks.
F16_SCALES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
              "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
              "IQ4_NL": (0,), "IQ4_XS": (0,), "MXFP4": ()}


def random_blocks(rng, n, type_name):
    """n blocks [n, type_size] of random bytes with sane scales: f16 fields in 0.002..0.02
    (random codes and sub-scales make values up to ~10), MXFP4's exponent byte 2**-8..2**4."""
    size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][1]
    q = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for o in F16_SCALES[type_name]:
        q[:, o:o + 2] = rng.uniform(0.002, 0.02, n).astype(np.float16).reshape(-1, 1).view(np.uint8)
    if type_name == "MXFP4":
        q[:, 0] = rng.integers(120, 133, n)
    return q


def random_rows(rng, rows, K, type_name):
    """uint8 [rows, row_bytes]: rows of K values in random_blocks."""
    block = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0]
    return random_blocks(rng, rows * K // block, type_name).reshape(rows, -1)


def quantize(x, type_name):
    """float32 [..., K] -> uint8 [..., row_bytes] of GGUF type type_name (as gguf.quants.quantize)."""
    x = np.asarray(x, np.float32)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    q = QUANTIZERS[type_name](x)
    return np.ascontiguousarray(q).reshape(x.shape[:-1] + (x.shape[-1] // block * size,))


if __name__ == "__main__":  # round-trip error of each type on N(0, 1) values
    from gguf.quants import dequantize
    x = np.random.default_rng(0).standard_normal((64, 4096), dtype=np.float32)
    for name in QUANTIZERS:
        y = dequantize(quantize(x, name), GGMLQuantizationType[name])
        print(f"{name:7s} rms error / rms {np.sqrt(np.mean((y - x) ** 2)):.4f}")
