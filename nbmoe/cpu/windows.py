"""Ops on column windows of head buffers: the parts of MLA's query and key heads
(model/forward.py's mla_attention, params cols / at), on the CPU.

out, x: views [T, H, n] (or rows [N, n]) of wider C-contiguous float32 buffers, each head's
columns lo..lo+n-1, rows strided. The CPU kernels (ops.py, matmul.py) take contiguous rows, so
a window is copied into a contiguous array before the kernel and back after it: numpy copies
of a few KiB a token, made inside the node's one call (a GPU reads and writes the windows in
place: nbmoe/cuda/ops.py, matmul.py).
"""
import numpy as np


def rms_norm_rows(out, x, w, eps):
    """out [N, n] = x / sqrt(mean(x^2) + eps) * w, row by row; out may be x."""
    from nbmoe.cpu.ops import rms_norm
    y = x.copy()
    rms_norm(y, y, w, eps)
    out[...] = y


def rope_into(out, x, pos, freqs, mscale, neox):
    """out [T, H, n] = x rotated as ops.rope rotates in place; out may be x."""
    from nbmoe.cpu.ops import rope
    y = x.copy()
    rope(y, pos, freqs, mscale, neox)
    out[...] = y


def mul_mat_heads(out, w, x, ids, qtype):
    """out [T, H, M] = per-head products: matmul.mul_mat_id with head h's "expert" ids[t, h] = h."""
    from nbmoe.cpu.matmul import mul_mat_id
    if out.flags.c_contiguous:
        mul_mat_id(out, w, np.ascontiguousarray(x), ids, qtype)
        return
    y = np.empty(out.shape, np.float32)
    mul_mat_id(y, w, np.ascontiguousarray(x), ids, qtype)
    out[...] = y
