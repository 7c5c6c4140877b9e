"""Element-wise and row-wise ops of a transformer layer on the GPU: norms, rope, activations, adds.

Letters: T tokens in the micro-batch, D model dim, H heads, Dh head dim, N rows, F FFN width.
All activations are float32 device arrays (C-contiguous unless said); one launch per op, on
the given stream. Same math and argument order as nbmoe/cpu/ops.py.
"""
import math

import numpy as np
from numba import cuda

from . import SIM, device_fn, expf, warp_sum
from nbmoe.model.arch import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT

from .x8 import quantize_word, unused_x8

f32 = np.float32

# Threads of element-wise kernels.
THREADS = 256
# Threads per row of rms_norm at most (a row of n values gets ~n / 8 threads, rounded to warps).
NORM_THREADS = 256


def _blocks(n, threads):
    return (n + threads - 1) // threads


def rows_grid(N, F):
    """Grid of an element-wise kernel over N rows of F: x over a row's columns (THREADS a
    block), y over rows, strided past the grid's 65535: no division per element (with one
    flat index, the 64-bit idx // F took a GLU element from ~64 instructions to ~100)."""
    return _blocks(F, THREADS), min(N, 65535)


# ---------------------------------------------------------------- rms_norm
# out[N, n] = x / sqrt(mean(x^2) + eps) * w, row by row: [T, D] with w [D], or [T, H, Dh] with
# w [Dh] (QK-norm). One block per row: each thread sums squares over a strided slice, warps
# reduce by shuffles, then every thread adds the warps' sums in order (deterministic).
# out may be x: each thread rereads and rewrites only its own elements.
# Fused forms, which save launches in decoding (backend_cuda decides when):
#   add:   x <- x + add first (the residual sum, written back to x), then the norm of it;
#   xq, xds: out also in 8 bits for the next product (x8.quantize_word's format): after a
#          barrier, thread j of the block quantizes words j, j + blockDim, ... of the row.

def _block_sum(v, sh):
    """Sum of v over the block (blockDim.x a multiple of 32), in every thread; sh: shared [32]."""
    v = warp_sum(v)
    tid = cuda.threadIdx.x
    if tid % 32 == 0:
        sh[tid // 32] = v
    cuda.syncthreads()
    tot = f32(0.0)
    for i in range(cuda.blockDim.x // 32):
        tot += sh[i]
    return tot


_block_sum = cuda.jit(device=True)(_block_sum) if SIM else cuda.jit(device=True, forceinline=True)(_block_sum)


@cuda.jit
def rms_norm_kernel(out, x, w, eps, add, do_add, xq, xds, do_quant):
    sh = cuda.shared.array(32, f32)
    r = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    n = x.shape[1]
    ss = f32(0.0)
    for i in range(tid, n, cuda.blockDim.x):
        v = x[r, i]
        if do_add:
            v += add[r, i]
            x[r, i] = v
        ss += v * v
    ss = _block_sum(ss, sh)
    scale = f32(1.0 / math.sqrt(float(ss) / n + eps))
    for i in range(tid, n, cuda.blockDim.x):
        out[r, i] = x[r, i] * scale * w[i]
    if do_quant:
        cuda.syncthreads()                  # the row's outputs, written by all threads
        nw = n // 4
        for j0 in range(0, nw, cuda.blockDim.x):
            j = j0 + tid
            jj = min(j, nw - 1)             # lanes past the row: the last word, not written
            quantize_word(xq, xds, r * nw + j, j < nw, out[r, 4 * jj], out[r, 4 * jj + 1],
                          out[r, 4 * jj + 2], out[r, 4 * jj + 3])


# Rows of more than WORDS_MIN_N values (the model-width norms of decoding, latency-bound: one
# block a row): each thread keeps its words of 4 consecutive values in registers from the
# load to the 8-bit output, so the row is read once and there is no second barrier
# (rms_norm_kernel rereads x and out from memory). Word j of the row belongs to thread
# j % blockDim, so the 8 words of a 32-block sit on 8 consecutive lanes, as quantize_word
# wants. Per-head rows (QK-norm, Dh values) keep rms_norm_kernel, whose sum order
# norm_rope.norm_rope_store repeats.
WORDS_MIN_N = 256


def _rms_norm_words_kernel(WPT):
    VALS = 4 * WPT                  # (local array sizes must be plain constants)

    def build():
        @cuda.jit
        def rms_norm_words_kernel(out, x, w, eps, add, do_add, xq, xds, do_quant):
            sh = cuda.shared.array(32, f32)
            r = cuda.blockIdx.x
            tid = cuda.threadIdx.x
            nth = cuda.blockDim.x
            n = x.shape[1]
            nw = n // 4
            vals = cuda.local.array(VALS, f32)
            # every load before any store: the compiler cannot tell x from add, and a store to
            # x between two loads of add would wait for the first (add may be mapped host
            # memory, the CPU experts' sum: a PCIe round trip each)
            for k in range(WPT):
                j = tid + k * nth
                for i in range(4):
                    vals[4 * k + i] = x[r, 4 * j + i] if j < nw else f32(0.0)
            if do_add:
                for k in range(WPT):
                    j = tid + k * nth
                    for i in range(4):
                        if j < nw:
                            vals[4 * k + i] += add[r, 4 * j + i]
                for k in range(WPT):
                    j = tid + k * nth
                    for i in range(4):
                        if j < nw:
                            x[r, 4 * j + i] = vals[4 * k + i]
            ss = f32(0.0)
            for k in range(4 * WPT):
                ss += vals[k] * vals[k]
            ss = _block_sum(ss, sh)
            scale = f32(1.0 / math.sqrt(float(ss) / n + eps))
            for k in range(WPT):
                j = tid + k * nth
                for i in range(4):
                    if j < nw:
                        o = vals[4 * k + i] * scale * w[4 * j + i]
                        out[r, 4 * j + i] = o
                        vals[4 * k + i] = o
            if do_quant:
                for k in range(WPT):
                    if k * nth < nw:               # the same for the whole block
                        j = tid + k * nth
                        quantize_word(xq, xds, r * nw + j, j < nw, vals[4 * k], vals[4 * k + 1],
                                      vals[4 * k + 2], vals[4 * k + 3])
        return rms_norm_words_kernel
    key = ("rms_words", WPT)
    if key not in _kernels:
        _kernels[key] = build()
    return _kernels[key]


_kernels = {}


def rms_norm(out, x, w, eps, stream=0, add=None, xq=None, xds=None):
    """out = x / sqrt(mean(x^2) + eps) * w over the last w.shape[0] values; out may be x.
    add: first x += add (x then holds the sum). xq, xds (x8.x8_buffers; rows of a
    multiple of 32): out is also written in 8 bits there."""
    n = w.shape[0]
    x2 = x.reshape(x.size // n, n)
    o2 = out.reshape(out.size // n, n)
    warps = min(NORM_THREADS // 32, max(1, (n + 255) // 256))
    a2 = x2 if add is None else add.reshape(x2.shape)
    quant = xq is not None
    if quant and n % 32:
        raise ValueError("rms_norm: 8-bit output needs rows of a multiple of 32 values")
    if not quant:
        xq, xds = unused_x8()
    if not x2.shape[0]:
        return
    if n > WORDS_MIN_N and n % 4 == 0:
        nth = 32 * min(NORM_THREADS // 32, (n // 4 + 31) // 32)
        wpt = 1
        while wpt * nth < n // 4:
            wpt *= 2
        _rms_norm_words_kernel(wpt)[x2.shape[0], nth, stream](o2, x2, w, float(eps), a2,
                                                              add is not None, xq, xds, quant)
        return
    rms_norm_kernel[x2.shape[0], 32 * warps, stream](o2, x2, w, float(eps), a2, add is not None,
                                                     xq, xds, quant)


def rms_norm_rows(out, x, w, eps, stream=0):
    """rms_norm of each row of x [N, n] into out; the rows may be strided (column windows of
    wider heads: MLA's latent in its cache row), which rms_norm's kernels index as they are."""
    rms_norm(out, x, w, eps, stream)


# ---------------------------------------------------------------- add, scale
# out = a + b, out = x * s element-wise over flat arrays; out may alias an input.

@cuda.jit
def add_kernel(out, a, b):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = a[i] + b[i]


@cuda.jit
def scale_kernel(out, x, s):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = x[i] * s


def add(out, a, b, stream=0):
    """out = a + b element-wise (same shapes, C-contiguous); out may alias a or b."""
    n = out.size
    if n:
        add_kernel[_blocks(n, THREADS), THREADS, stream](out.reshape(n), a.reshape(n), b.reshape(n))


def scale(out, x, s, stream=0):
    """out = x * s element-wise (C-contiguous); out may alias x."""
    n = out.size
    if n:
        scale_kernel[_blocks(n, THREADS), THREADS, stream](out.reshape(n), x.reshape(n), f32(s))


# ---------------------------------------------------------------- rope
# x[T, H, Dh] in place, or out = rope(x) (rope_into: column windows of wider heads, views);
# pos[T] int32. Pair (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos) with
#   theta_i = pos * freqs[i],  i < n_rot / 2  (freqs: cpu/ops.py rope_freqs, or YaRN's),
# cos and sin times mscale; normal mode pairs dims (2i, 2i+1), NeoX mode (i, i + n_rot/2).
# The angle, cos and sin in float64 (positions reach 1e5, where a float32 angle is off by
# ~1e-2 rad), as on the CPU. One thread per (token, head, pair).

@cuda.jit
def rope_kernel(out, x, pos, freqs, mscale, neox):
    half = freqs.shape[0]
    H = x.shape[1]
    idx = cuda.grid(1)
    if idx >= x.shape[0] * H * half:
        return
    t = idx // (H * half)
    rem = idx - t * H * half
    h = rem // half
    rope_pair(out, x, t, h, rem - h * half, pos, freqs, mscale, neox)


@device_fn
def rope_pair(out, x, t, h, i, pos, freqs, mscale, neox):
    """Pair i of head h of token t: out[t, h] <- its rotation of x[t, h] (out may be x)."""
    half = freqs.shape[0]
    theta = float(pos[t]) * freqs[i]
    c = f32(mscale * math.cos(theta))
    s = f32(mscale * math.sin(theta))
    if neox:
        i0 = i
        i1 = i + half
    else:
        i0 = 2 * i
        i1 = 2 * i + 1
    x0 = x[t, h, i0]
    x1 = x[t, h, i1]
    out[t, h, i0] = x0 * c - x1 * s
    out[t, h, i1] = x0 * s + x1 * c


_constants = {}


def constant(a):
    """A host array's copy on the current GPU, made once per content (graphs hold it)."""
    from . import device_id
    a = np.ascontiguousarray(a)
    key = (device_id(), a.dtype.str, a.shape, a.tobytes())
    d = _constants.get(key)
    if d is None:
        d = _constants[key] = cuda.to_device(a)
    return d


def rope(x, pos, freqs, mscale, neox, stream=0):
    """Rotate the first 2 * len(freqs) dims of each head of x [T, H, Dh] in place (pos [T]
    int32) by the angles pos * freqs[i] (freqs: host float64), cos and sin times mscale."""
    rope_into(x, x, pos, freqs, mscale, neox, stream)


def rope_into(out, x, pos, freqs, mscale, neox, stream=0):
    """out [T, H, n] = x rotated as rope rotates in place; out may be x (views of wider heads:
    MLA's roped query and key parts)."""
    n = x.shape[0] * x.shape[1] * len(freqs)
    if n:
        rope_kernel[_blocks(n, THREADS), THREADS, stream](
            out, x, pos, constant(np.asarray(freqs, np.float64)), float(mscale), bool(neox))


# ---------------------------------------------------------------- GLUs: swiglu, geglu, swiglu_oai
# out[N, F] = act(gate) * up; gate / up may be row-strided views (halves of a fused [N, 2F]).
#   silu(g)      = g / (1 + exp(-g))
#   gelu_tanh(g) = g / (1 + exp(-2 sqrt(2/pi) (g + 0.044715 g^3)))
#   swiglu_oai   = x * sigmoid(alpha x) * (y + 1),  x = min(gate, limit),  y = clamp(up, -limit,
#                  limit) (gpt-oss; ggml's swiglu_oai: both halves in one)
# out may alias gate or up. A thread per column, over rows (rows_grid).

_GELU_K = f32(2.0 * math.sqrt(2.0 / math.pi))
_GELU_C = f32(0.044715)
_OAI_ALPHA = f32(SWIGLU_OAI_ALPHA)
_OAI_LIMIT = f32(SWIGLU_OAI_LIMIT)
ACT_SILU, ACT_GELU, ACT_SWIGLU_OAI = 0, 1, 2     # the GLU kinds (swiglu, geglu, swiglu_oai)


@device_fn
def _silu(g):
    return g / (f32(1.0) + expf(-g))


@device_fn
def _gelu(g):
    return g / (f32(1.0) + expf(-(_GELU_K * (g + _GELU_C * g * g * g))))


@device_fn
def _swiglu_oai(g, u):
    x = min(g, _OAI_LIMIT)
    y = min(max(u, -_OAI_LIMIT), _OAI_LIMIT)
    return x / (f32(1.0) + expf(-(_OAI_ALPHA * x))) * (y + f32(1.0))


@device_fn
def _glu(g, u, act):
    """The GLU of one gate / up pair: act(g) * u, or gpt-oss's clamped form of both."""
    if act == ACT_SWIGLU_OAI:
        return _swiglu_oai(g, u)
    return (_silu(g) if act == ACT_SILU else _gelu(g)) * u


@cuda.jit
def glu_kernel(out, gate, up, act):
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if c < out.shape[1]:
        r = cuda.blockIdx.y
        while r < out.shape[0]:                 # (a range's trip count divides)
            out[r, c] = _glu(gate[r, c], up[r, c], act)
            r += cuda.gridDim.y


def _glu_rows(out, gate, up, act, stream):
    if out.size:
        glu_kernel[rows_grid(*out.shape), THREADS, stream](out, gate, up, act)


def swiglu(out, gate, up, stream=0):
    """out[N, F] = silu(gate) * up; out may alias gate or up."""
    _glu_rows(out, gate, up, ACT_SILU, stream)


def geglu(out, gate, up, stream=0):
    """out[N, F] = gelu_tanh(gate) * up (gemma); out may alias gate or up."""
    _glu_rows(out, gate, up, ACT_GELU, stream)


def swiglu_oai(out, gate, up, stream=0):
    """out[N, F] = gpt-oss's clamped SwiGLU of gate and up; out may alias gate or up."""
    _glu_rows(out, gate, up, ACT_SWIGLU_OAI, stream)


# ---------------------------------------------------------------- biases, gated rows
# add_bias     out[T, M] = x + b[M]                   (q/k/v/o, router biases)
# add_bias_id  out[T, A, M] = x + b[ids[t, a], M]     (experts' biases, b [E, M])
# sigmoid_mul  out[T, M] = x * sigmoid(g[t, 0])       (a gated row, g [T, 1])
# out may alias x (each thread reads then writes its own element). A thread per column m, over
# tokens t (rows_grid).

@cuda.jit
def add_bias_kernel(out, x, b):
    m = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if m < out.shape[1]:
        t = cuda.blockIdx.y
        while t < out.shape[0]:
            out[t, m] = x[t, m] + b[m]
            t += cuda.gridDim.y


@cuda.jit
def add_bias_id_kernel(out, x, b, ids):
    m = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if m < out.shape[2]:
        t = cuda.blockIdx.y
        while t < out.shape[0]:
            for a in range(out.shape[1]):
                out[t, a, m] = x[t, a, m] + b[ids[t, a], m]
            t += cuda.gridDim.y


@cuda.jit
def sigmoid_mul_kernel(out, x, g):
    m = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if m < out.shape[1]:
        t = cuda.blockIdx.y
        while t < out.shape[0]:
            out[t, m] = x[t, m] * (f32(1.0) / (f32(1.0) + expf(-g[t, 0])))
            t += cuda.gridDim.y


# ---------------------------------------------------------------- copy_cols
# out[t, h, olo + i] = src[t, h if Hs > 1 else 0, slo + i], i < n; out [T, Ho, Do], src
# [T, Hs, Ds], either a view: column windows for the kernels that read rows contiguously
# (matmul.mul_mat_heads). One thread per copied value.

@cuda.jit
def copy_cols_kernel(out, src, olo, slo, n):
    Ho = out.shape[1]
    idx = cuda.grid(1)
    if idx < out.shape[0] * Ho * n:
        th = idx // n
        i = idx - th * n
        t = th // Ho
        h = th - t * Ho
        out[t, h, olo + i] = src[t, h if src.shape[1] > 1 else 0, slo + i]


def copy_cols(out, src, olo, slo, n, stream=0):
    """out[:, h, olo:olo+n] = src[:, h or 0, slo:slo+n]; a one-head src goes to every head."""
    if olo < 0 or slo < 0 or olo + n > out.shape[2] or slo + n > src.shape[2] or (
            src.shape[0] != out.shape[0] or src.shape[1] not in (1, out.shape[1])):
        raise ValueError(f"copy_cols: out {out.shape}[{olo}:{olo + n}], src {src.shape}[{slo}:{slo + n}]")
    total = out.shape[0] * out.shape[1] * n
    if total:
        copy_cols_kernel[_blocks(total, THREADS), THREADS, stream](out, src, olo, slo, n)


def add_bias(out, x, b, stream=0):
    """out [T, M] = x + b (b [M]); out may alias x."""
    if b.shape != (out.shape[1],) or x.shape != out.shape:
        raise ValueError(f"add_bias: x {x.shape}, b {b.shape}, out {out.shape}: want [T, M], [M]")
    if out.size:
        add_bias_kernel[rows_grid(*out.shape), THREADS, stream](out, x, b)


def add_bias_id(out, x, b, ids, stream=0):
    """out [T, A, M] = x + b[ids[t, a]] (b [E, M], ids [T, A] int32); out may alias x."""
    if x.shape != out.shape or ids.shape != out.shape[:2] or b.shape[1:] != out.shape[2:]:
        raise ValueError(f"add_bias_id: x {x.shape}, b {b.shape}, ids {ids.shape}, out {out.shape}:"
                         " want [T, A, M], [E, M], [T, A]")
    if out.size:
        add_bias_id_kernel[rows_grid(out.shape[0], out.shape[2]), THREADS, stream](out, x, b, ids)


def sigmoid_mul(out, x, g, stream=0):
    """out [T, M] = x * sigmoid(g[t, 0]) (g [T, 1]); out may alias x."""
    if x.shape != out.shape or g.shape != (out.shape[0], 1):
        raise ValueError(f"sigmoid_mul: x {x.shape}, g {g.shape}, out {out.shape}: want [T, M], [T, 1]")
    if out.size:
        sigmoid_mul_kernel[rows_grid(*out.shape), THREADS, stream](out, x, g)
