"""Element-wise and row-wise ops of a transformer layer on CPU: norms, rope, activations, adds.

Letters: T tokens in the micro-batch, D model dim, H heads, Dh head dim, N rows, F FFN width.
All activations are float32 and C-contiguous.

Each op has a plain single-threaded @njit driver (`_<op>_seq`), a prange driver (`_<op>_par`)
for prompt batches, and a public @njit entry point that picks one by size. Callers (Python or
other @njit code) pay one Numba dispatch and no Python-side checks: T=1 decode calls this
~300 times a token. The thresholds are module constants, frozen into the cached machine
code: after changing one, delete nbmoe/cpu/__pycache__. error_model="numpy" everywhere: no
ZeroDivisionError checks, whose branches would stop loops from vectorizing.
"""
import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from nbmoe.model.arch import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT

# Elements of work below which the single-threaded path wins: a parallel region costs
# microseconds, and on a busy machine can wait a scheduler tick at its end barrier.
PAR_MIN_ELEMS = 1 << 15

# "None" for an optional vector (attention sinks, a router's selection bias): size 0, and
# read-only so that it has the Numba type of the GGUF's (mmap) vectors: one compile for both.
EMPTY = np.zeros(0, np.float32)
EMPTY.flags.writeable = False

# Floating-point licences for loops with reductions: reassociation lets LLVM split a sum over
# vector lanes. No nnan/ninf, so NaN and inf still behave (softmax max-subtraction uses -inf).
FM = {"nsz", "arcp", "contract", "reassoc"}

_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693145751953125)  # ln 2 split so that k * _LN2_HI is exact (Cody-Waite)
_LN2_LO = np.float32(1.4286068203094172e-06)
_ROUND = np.float32(12582912.0)  # 1.5 * 2^23: adding it rounds a float32 below 2^22 to an integer


@njit(cache=True, error_model="numpy", fastmath={"contract"})
def exp_f32(x):
    """exp(x) for float32, relative error < 2e-7, in plain arithmetic so loops vectorize.

    libm expf is a scalar call LLVM cannot vectorize (no SVML). exp(x) = 2^k * exp(r) with
    k = round(x / ln2), |r| <= ln2/2, exp(r) by its degree-6 Taylor polynomial (truncation error
    r^7/7! < 1.3e-7). x is clamped to [-87, 88] so 2^k stays a normal float: exp(-inf) gives
    ~1.6e-38 rather than 0. NaN propagates. Compiled without reassociation, which would fold
    the rounding trick and the split ln 2 away.
    """
    if x < np.float32(-87.0):
        x = np.float32(-87.0)
    if x > np.float32(88.0):
        x = np.float32(88.0)
    kf = (x * _LOG2E + _ROUND) - _ROUND  # round to nearest integer without a libm call
    r = x - kf * _LN2_HI
    r = r - kf * _LN2_LO
    p = np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    two_k = np.int32((np.int32(kf) + np.int32(127)) << np.int32(23)).view(np.float32)
    return p * two_k


# ---------------------------------------------------------------- rms_norm
# out[N, Dn] = x / sqrt(mean(x^2) + eps) * w, row by row. Rows are contiguous.
# Called on [T, D] with w[D] (layer norms) or on [T, H, Dh] with w[Dh] (QK-norm: each head
# normed separately). The sum of squares is accumulated in float64. Parallel over rows.

@njit(cache=True, error_model="numpy", fastmath=FM)
def _rms_norm_row(out, x, w, eps):
    n = x.shape[0]
    ss = 0.0
    for i in range(n):
        v = np.float64(x[i])
        ss += v * v
    r = np.float32(1.0 / math.sqrt(ss / n + eps))
    if out.ctypes.data == x.ctypes.data:    # in place: two arrays, or the loop stays scalar
        for i in range(n):                  # (see swiglu below)
            out[i] = out[i] * r * w[i]
    else:
        for i in range(n):
            out[i] = x[i] * r * w[i]


@njit(cache=True, error_model="numpy", fastmath=FM)
def _rms_norm_seq(out, x, w, eps):
    for r in range(x.shape[0]):
        _rms_norm_row(out[r], x[r], w, eps)


@njit(cache=True, error_model="numpy", fastmath=FM, parallel=True)
def _rms_norm_par(out, x, w, eps):
    for r in prange(x.shape[0]):
        _rms_norm_row(out[r], x[r], w, eps)


@njit(cache=True, error_model="numpy")
def rms_norm(out, x, w, eps):
    """out = x / sqrt(mean(x^2) + eps) * w over the last w.shape[0] values; out may be x.

    x, out: any shape whose size is a multiple of Dn = w.shape[0], C-contiguous float32.
    """
    n = w.shape[0]
    x2 = x.reshape(x.size // n, n)  # [N, Dn]
    out2 = out.reshape(out.size // n, n)
    if x.size >= PAR_MIN_ELEMS and x2.shape[0] > 1:
        _rms_norm_par(out2, x2, w, eps)
    else:
        _rms_norm_seq(out2, x2, w, eps)


# ---------------------------------------------------------------- add, scale
# out = a + b and out = x * s element-wise over flat C-contiguous arrays of equal size.
# out may alias an input. Parallel over elements.

@njit(cache=True, error_model="numpy")
def _add_seq(out, a, b):
    for i in range(out.shape[0]):
        out[i] = a[i] + b[i]


@njit(cache=True, error_model="numpy", parallel=True)
def _add_par(out, a, b):
    for i in prange(out.shape[0]):
        out[i] = a[i] + b[i]


@njit(cache=True, error_model="numpy")
def add(out, a, b):
    """out = a + b element-wise (same shapes, C-contiguous); out may alias a or b."""
    o1, a1, b1 = out.reshape(out.size), a.reshape(a.size), b.reshape(b.size)
    if out.size >= PAR_MIN_ELEMS:
        _add_par(o1, a1, b1)
    else:
        _add_seq(o1, a1, b1)


@njit(cache=True, error_model="numpy")
def _scale_seq(out, x, s):
    for i in range(out.shape[0]):
        out[i] = x[i] * s


@njit(cache=True, error_model="numpy", parallel=True)
def _scale_par(out, x, s):
    for i in prange(out.shape[0]):
        out[i] = x[i] * s


@njit(cache=True, error_model="numpy")
def scale(out, x, s):
    """out = x * s element-wise (C-contiguous); out may alias x."""
    s32 = np.float32(s)
    o1, x1 = out.reshape(out.size), x.reshape(x.size)
    if out.size >= PAR_MIN_ELEMS:
        _scale_par(o1, x1, s32)
    else:
        _scale_seq(o1, x1, s32)


# ---------------------------------------------------------------- add_bias, add_bias_id, sigmoid_mul
# Row ops of biased products and gated outputs (gpt-oss's biases, a shared expert's gate):
#   add_bias     out[t, :] = x[t, :] + b                      x, out [T, M], b [M]
#   add_bias_id  out[t, a, :] = x[t, a, :] + b[ids[t, a], :]  x, out [T, A, M], b [E, M]
#   sigmoid_mul  out[t, :] = x[t, :] * sigmoid(g[t, 0])       x, out [T, M], g [T, 1]
# out may alias x (a loop over two arrays then, as _glu_row's). Parallel over rows.

@njit(cache=True, error_model="numpy")
def _add_row(out, x, b):
    if out.ctypes.data == x.ctypes.data:
        for i in range(out.shape[0]):
            out[i] += b[i]
    else:
        for i in range(out.shape[0]):
            out[i] = x[i] + b[i]


@njit(cache=True, error_model="numpy")
def _add_bias_seq(out, x, b):
    for t in range(x.shape[0]):
        _add_row(out[t], x[t], b)


@njit(cache=True, error_model="numpy", parallel=True)
def _add_bias_par(out, x, b):
    for t in prange(x.shape[0]):
        _add_row(out[t], x[t], b)


@njit(cache=True, error_model="numpy")
def add_bias(out, x, b):
    """out [T, M] = x + b (b [M] added to every row); out may alias x."""
    if x.size >= PAR_MIN_ELEMS and x.shape[0] > 1:
        _add_bias_par(out, x, b)
    else:
        _add_bias_seq(out, x, b)


@njit(cache=True, error_model="numpy")
def _add_bias_id_seq(out, x, b, ids):
    for r in range(x.shape[0] * x.shape[1]):
        t, a = r // x.shape[1], r % x.shape[1]
        _add_row(out[t, a], x[t, a], b[ids[t, a]])


@njit(cache=True, error_model="numpy", parallel=True)
def _add_bias_id_par(out, x, b, ids):
    for r in prange(x.shape[0] * x.shape[1]):
        t, a = r // x.shape[1], r % x.shape[1]
        _add_row(out[t, a], x[t, a], b[ids[t, a]])


@njit(cache=True, error_model="numpy")
def add_bias_id(out, x, b, ids):
    """out [T, A, M] = x + the bias row of each pair's expert, b [E, M], ids [T, A] int32."""
    for t in range(ids.shape[0]):
        for a in range(ids.shape[1]):
            if ids[t, a] < 0 or ids[t, a] >= b.shape[0]:
                raise ValueError("add_bias_id: an expert id is outside the bias rows")
    if x.size >= PAR_MIN_ELEMS and x.shape[0] * x.shape[1] > 1:
        _add_bias_id_par(out, x, b, ids)
    else:
        _add_bias_id_seq(out, x, b, ids)


@njit(cache=True, error_model="numpy")
def _scale_row(out, x, s):
    if out.ctypes.data == x.ctypes.data:
        for i in range(out.shape[0]):
            out[i] *= s
    else:
        for i in range(out.shape[0]):
            out[i] = x[i] * s


@njit(cache=True, error_model="numpy")
def _sigmoid_mul_seq(out, x, g):
    for t in range(x.shape[0]):
        _scale_row(out[t], x[t], np.float32(1.0) / (np.float32(1.0) + exp_f32(-g[t, 0])))


@njit(cache=True, error_model="numpy", parallel=True)
def _sigmoid_mul_par(out, x, g):
    for t in prange(x.shape[0]):
        _scale_row(out[t], x[t], np.float32(1.0) / (np.float32(1.0) + exp_f32(-g[t, 0])))


@njit(cache=True, error_model="numpy")
def sigmoid_mul(out, x, g):
    """out [T, M] = x * sigmoid(g[:, 0]) row by row (g [T, 1]); out may alias x."""
    if x.size >= PAR_MIN_ELEMS and x.shape[0] > 1:
        _sigmoid_mul_par(out, x, g)
    else:
        _sigmoid_mul_seq(out, x, g)


# ---------------------------------------------------------------- rope
# x[T, H, Dh] in place; pos[T] int32. Rotary position embedding on the first n_rot dims
# of every head: pair (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos) with angle
#   theta_i = pos * freqs[i],  i = 0 .. n_rot/2 - 1,
# freqs[i] = freq_scale * freq_base^(-2i / n_rot) (rope_freqs), or YaRN's mix (model/arch.py),
# whose cos and sin are also scaled by mscale.
# Normal mode (llama GGUFs) pairs dims (2i, 2i+1); NeoX mode (qwen, gemma) pairs (i, i + n_rot/2).
# cos and sin are computed in float64 (positions reach 1e5, where a float32 angle is off by
# ~1e-2 rad), the rotation in float32. Parallel over tokens.
# Tables (rope_tables): each row is either computed (sincos_f64, every ROPE_ANCHOR tokens and
# after any jump in position) or rotated from the row before by one position's angle: a
# complex multiply instead of two libm calls per value (an order of magnitude faster); the float64
# error of 63 rotations (~1e-14) is far below the float32 result's rounding.

_2_PI = 0.63661977236758134308        # 2 / pi
_PIO2_1 = 1.57079632673412561417e+00  # pi/2 in three parts of 33 bits (fdlibm): k * part is
_PIO2_2 = 6.07710050630396597660e-11  # exact for |k| < 2^20 (|x| < 1.6e6), so x - k pi/2
_PIO2_3 = 2.02226624871116645580e-21  # loses nothing
_ROUND64 = 6755399441055744.0         # 1.5 * 2^52: adding it rounds a float64 to an integer
ROPE_ANCHOR = 64


@njit(cache=True, error_model="numpy", fastmath={"contract"})
def sincos_f64(x):
    """(sin x, cos x) in float64 to ~1 ulp for |x| < 1.6e6, without libm: x = k pi/2 + r,
    |r| <= pi/4, fdlibm's kernel polynomials for sin r and cos r, swapped and negated by the
    quadrant k mod 4. Compiled without reassociation (it would fold the reduction away)."""
    kf = (x * _2_PI + _ROUND64) - _ROUND64
    r = x - kf * _PIO2_1
    r = r - kf * _PIO2_2
    r = r - kf * _PIO2_3
    z = r * r
    s = z * (-2.50507602534068634195e-08 + z * 1.58969099521155010221e-10) + 2.75573137070700676789e-06
    s = z * s - 1.98412698298579493134e-04
    s = z * s + 8.33333333332248946124e-03
    s = z * s - 1.66666666666666324348e-01
    s = r + r * z * s
    c = z * (2.08757232129817482790e-09 + z * -1.13596475577881948265e-11) - 2.75573143513906633035e-07
    c = z * c + 2.48015872894767294178e-05
    c = z * c - 1.38888888888741095749e-03
    c = z * c + 4.16666666666666019037e-02
    c = 1.0 - 0.5 * z + z * z * c
    k = np.int64(kf)
    a = c if k & 1 else s  # odd quadrant: sin and cos swap
    b = s if k & 1 else c
    return (-a if k & 2 else a), (-b if (k + 1) & 2 else b)


def rope_freqs(n_rot, freq_base, freq_scale=1.0):
    """Angle per position of each rotated pair i < n_rot / 2: freq_scale * freq_base^(-2i / n_rot)
    (float64; model/arch.py makes the YaRN ones)."""
    return freq_scale * float(freq_base) ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)


@njit(cache=True, error_model="numpy")
def rope_tables(cs, sn, pos, freqs, mscale=1.0):
    """cs, sn [T, n_rot/2] float32 <- mscale * cos, sin of pos[t] * freqs[i] for positions pos [T]."""
    half = freqs.shape[0]
    T = pos.shape[0]
    c, s = np.empty(half, np.float64), np.empty(half, np.float64)    # row t
    c1, s1 = np.empty(half, np.float64), np.empty(half, np.float64)  # one position's angle
    if T > 1:
        for i in range(half):
            s1[i], c1[i] = sincos_f64(freqs[i])
    for t in range(T):
        if t % ROPE_ANCHOR == 0 or pos[t] != pos[t - 1] + 1:
            p = np.float64(pos[t])
            for i in range(half):
                s[i], c[i] = sincos_f64(p * freqs[i])
        else:
            for i in range(half):
                cn = c[i] * c1[i] - s[i] * s1[i]
                s[i] = s[i] * c1[i] + c[i] * s1[i]
                c[i] = cn
        ct, st = cs[t], sn[t]
        for i in range(half):
            ct[i] = mscale * c[i]
            st[i] = mscale * s[i]


@njit(cache=True, error_model="numpy")
def _rope_token(xt, c, s, neox):
    """Rotate each head of xt [H, Dh] by the angles whose cos, sin are c, s [n_rot/2]."""
    half = c.shape[0]
    for h in range(xt.shape[0]):
        v = xt[h]
        if neox:
            for i in range(half):
                x0 = v[i]
                x1 = v[i + half]
                v[i] = x0 * c[i] - x1 * s[i]
                v[i + half] = x0 * s[i] + x1 * c[i]
        else:
            for i in range(half):
                x0 = v[2 * i]
                x1 = v[2 * i + 1]
                v[2 * i] = x0 * c[i] - x1 * s[i]
                v[2 * i + 1] = x0 * s[i] + x1 * c[i]


@njit(cache=True, error_model="numpy")
def _rope_seq(x, cs, sn, neox):
    for t in range(x.shape[0]):
        _rope_token(x[t], cs[t], sn[t], neox)


@njit(cache=True, error_model="numpy", parallel=True)
def _rope_par(x, cs, sn, neox):
    for t in prange(x.shape[0]):
        _rope_token(x[t], cs[t], sn[t], neox)


@njit(cache=True, error_model="numpy")
def rope_apply(x, cs, sn, neox):
    """Rotate x [T, H, Dh] in place by tables cs, sn [T, n_rot/2] from rope_tables."""
    if x.size >= PAR_MIN_ELEMS and x.shape[0] > 1:
        _rope_par(x, cs, sn, neox)
    else:
        _rope_seq(x, cs, sn, neox)


@njit(cache=True, error_model="numpy")
def rope(x, pos, freqs, mscale, neox):
    """Rotate the first 2 * len(freqs) dims of each head of x [T, H, Dh] in place (pos [T] int32)
    by the angles pos * freqs[i], cos and sin scaled by mscale (1 but for YaRN)."""
    cs = np.empty((x.shape[0], freqs.shape[0]), np.float32)
    sn = np.empty((x.shape[0], freqs.shape[0]), np.float32)
    rope_tables(cs, sn, pos, freqs, mscale)
    rope_apply(x, cs, sn, neox)


# ---------------------------------------------------------------- swiglu, geglu, swiglu_oai
# out[N, F] = act(gate) * up, N = T (dense FFN) or T*A (routed experts); rows contiguous,
# gate/up may be row-strided views (e.g. halves of a fused [N, 2F] matmul output).
#   silu(g)      = g / (1 + exp(-g))
#   gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
#                = g / (1 + exp(-2 sqrt(2/pi) (g + 0.044715 g^3)))   (no cancellation near 0)
#   swiglu_oai (gpt-oss): x = min(g, L), y = clamp(u, -L, L), out = x / (1 + exp(-a x)) * (y + 1),
#                a = SWIGLU_OAI_ALPHA, L = SWIGLU_OAI_LIMIT (a NaN stays NaN, as in ggml)
# exp is exp_f32, so the inner loop vectorizes. Parallel over rows.

_GELU_K = np.float32(2.0 * math.sqrt(2.0 / math.pi))
_GELU_C = np.float32(0.044715)
_OAI_A = np.float32(SWIGLU_OAI_ALPHA)
_OAI_L = np.float32(SWIGLU_OAI_LIMIT)


# out aliasing gate or up (the graph's GLU writes in place) gets a loop over two arrays: with
# three, LLVM's run-time overlap check fails and the scalar loop runs (several times slower).

@njit(cache=True, error_model="numpy", inline="always")
def _silu_times(g, u):
    return g / (np.float32(1.0) + exp_f32(-g)) * u


@njit(cache=True, error_model="numpy", inline="always")
def _gelu_times(g, u):
    z = _GELU_K * (g + _GELU_C * g * g * g)
    return g / (np.float32(1.0) + exp_f32(-z)) * u


@njit(cache=True, error_model="numpy", inline="always")
def _swiglu_oai_times(g, u):
    x = _OAI_L if _OAI_L < g else g
    y = -_OAI_L if u < -_OAI_L else (_OAI_L if _OAI_L < u else u)
    return x / (np.float32(1.0) + exp_f32(-_OAI_A * x)) * (y + np.float32(1.0))


@njit(cache=True, error_model="numpy", inline="always")
def _glu_row(out, gate, up, act_times):
    """out[i] = act_times(gate[i], up[i]), over two arrays where out is gate or up."""
    if out.ctypes.data == gate.ctypes.data:
        for i in range(out.shape[0]):
            out[i] = act_times(out[i], up[i])
    elif out.ctypes.data == up.ctypes.data:
        for i in range(out.shape[0]):
            out[i] = act_times(gate[i], out[i])
    else:
        for i in range(out.shape[0]):
            out[i] = act_times(gate[i], up[i])


@njit(cache=True, error_model="numpy")
def _swiglu_row(out, gate, up):
    _glu_row(out, gate, up, _silu_times)


@njit(cache=True, error_model="numpy")
def _geglu_row(out, gate, up):
    _glu_row(out, gate, up, _gelu_times)


@njit(cache=True, error_model="numpy")
def _swiglu_oai_row(out, gate, up):
    _glu_row(out, gate, up, _swiglu_oai_times)


@njit(cache=True, error_model="numpy")
def _swiglu_seq(out, gate, up):
    for r in range(out.shape[0]):
        _swiglu_row(out[r], gate[r], up[r])


@njit(cache=True, error_model="numpy", parallel=True)
def _swiglu_par(out, gate, up):
    for r in prange(out.shape[0]):
        _swiglu_row(out[r], gate[r], up[r])


@njit(cache=True, error_model="numpy")
def _geglu_seq(out, gate, up):
    for r in range(out.shape[0]):
        _geglu_row(out[r], gate[r], up[r])


@njit(cache=True, error_model="numpy", parallel=True)
def _geglu_par(out, gate, up):
    for r in prange(out.shape[0]):
        _geglu_row(out[r], gate[r], up[r])


@njit(cache=True, error_model="numpy")
def _swiglu_oai_seq(out, gate, up):
    for r in range(out.shape[0]):
        _swiglu_oai_row(out[r], gate[r], up[r])


@njit(cache=True, error_model="numpy", parallel=True)
def _swiglu_oai_par(out, gate, up):
    for r in prange(out.shape[0]):
        _swiglu_oai_row(out[r], gate[r], up[r])


@njit(cache=True, error_model="numpy")
def swiglu(out, gate, up):
    """out[N, F] = silu(gate) * up; out may alias gate or up."""
    if out.size >= PAR_MIN_ELEMS and out.shape[0] > 1:
        _swiglu_par(out, gate, up)
    else:
        _swiglu_seq(out, gate, up)


@njit(cache=True, error_model="numpy")
def geglu(out, gate, up):
    """out[N, F] = gelu_tanh(gate) * up (gemma); out may alias gate or up."""
    if out.size >= PAR_MIN_ELEMS and out.shape[0] > 1:
        _geglu_par(out, gate, up)
    else:
        _geglu_seq(out, gate, up)


@njit(cache=True, error_model="numpy")
def swiglu_oai(out, gate, up):
    """out[N, F] = gpt-oss's clamped SwiGLU of gate and up; out may alias gate or up."""
    if out.size >= PAR_MIN_ELEMS and out.shape[0] > 1:
        _swiglu_oai_par(out, gate, up)
    else:
        _swiglu_oai_seq(out, gate, up)


# ---------------------------------------------------------------- softmax_rows
# x[N, V] in place: x = exp(x - max) / sum(exp(x - max)) per row (sampling over the vocab).
# Parallel over rows.

@intrinsic
def _maxnum(typingctx, a, b):
    """llvm.maxnum: the larger of two floats, the other one if either is NaN. Unlike a compare
    and select, LLVM vectorizes a reduction over it (vmaxps)."""
    if a != b or a not in (types.float32, types.float64):
        return None

    def codegen(context, builder, signature, args):
        ty = args[0].type
        name = "llvm.maxnum.f32" if ty == ir.FloatType() else "llvm.maxnum.f64"
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty, ty]), name)
        return builder.call(fn, args)

    return a(a, b), codegen


@njit(cache=True, error_model="numpy")
def row_max(x):
    """max of a float32 row, NaNs skipped; -inf for an empty row."""
    m = np.float32(-np.inf)
    for i in range(x.shape[0]):
        m = _maxnum(m, x[i])
    return m


@njit(cache=True, error_model="numpy", fastmath=FM)
def _softmax_row(x):
    m = row_max(x)
    s = np.float32(0.0)  # reassociated into 32 partial sums; a float64 sum halves the speed
    for i in range(x.shape[0]):
        e = exp_f32(x[i] - m)
        x[i] = e
        s += e
    inv = np.float32(1.0 / s)
    for i in range(x.shape[0]):
        x[i] *= inv


@njit(cache=True, error_model="numpy")
def _softmax_seq(x):
    for r in range(x.shape[0]):
        _softmax_row(x[r])


@njit(cache=True, error_model="numpy", parallel=True)
def _softmax_par(x):
    for r in prange(x.shape[0]):
        _softmax_row(x[r])


@njit(cache=True, error_model="numpy")
def softmax_rows(x):
    """Softmax of each row of x [N, V] in place."""
    if x.size >= PAR_MIN_ELEMS and x.shape[0] > 1:
        _softmax_par(x)
    else:
        _softmax_seq(x)


from nbmoe.cpu.windows import rms_norm_rows, rope_into  # noqa: E402,F401  (column windows)
