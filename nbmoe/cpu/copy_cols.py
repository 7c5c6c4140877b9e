"""Copy a range of columns of each head: the SLICE op, which splits and joins the parts of
MLA's query and key heads (model/forward.py's mla_attention).

out [T, Ho, Do], src [T, Hs, Ds] float32, C-contiguous (a 2-D buffer is one head):
    out[t, h, olo + i] = src[t, h if Hs > 1 else 0, slo + i],  i < n
(a one-head src is broadcast to every head of out). The other columns of out are left as they
are. Single-threaded: a copy of T * Ho * n values.
"""
from numba import njit


@njit(cache=True, error_model="numpy")
def copy_cols(out, src, olo, slo, n):
    """out[:, h, olo:olo+n] = src[:, h or 0, slo:slo+n] (see the module docstring)."""
    if olo < 0 or slo < 0 or olo + n > out.shape[2] or slo + n > src.shape[2]:
        raise ValueError("copy_cols: column range outside a head")
    if src.shape[0] != out.shape[0] or src.shape[1] not in (1, out.shape[1]):
        raise ValueError("copy_cols: src has other tokens or heads than out")
    one = src.shape[1] == 1
    for t in range(out.shape[0]):
        for h in range(out.shape[1]):
            s = src[t, 0 if one else h]
            o = out[t, h]
            for i in range(n):
                o[olo + i] = s[slo + i]
