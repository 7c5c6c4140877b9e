"""Matrix products with GGUF-quantized weights on the GPU: mul_mat, mul_mat_id, get_rows.

Letters: T tokens, M output features (weight rows), K input features (values per row),
E experts, A chosen experts per token, X input rows per token for mul_mat_id (1 or A),
B = K / 32 blocks per row, N = T * A (token, slot) pairs. The unit: 8 values of a block
(quants.py).

Weights: device uint8 [M, row_bytes] or [E, M, row_bytes], the raw GGUF bytes, any type of
quants.TYPES, passed to the kernels as they are (decoders load fields at byte offsets).
Activations and outputs float32 C-contiguous device arrays; ids int32. Every launcher takes
an optional stream and never waits for the device. Hot loops load through the ld_* loaders
(32-bit offsets, no negative-index fix-ups): Numba's own x[t, i] costs ~10 64-bit integer
instructions a load.

Kernels, chosen per call by the number of tokens T sharing a weight matrix:
  matrix-vector (T <= MMV_MAX_T: generation)  one warp per weight row; lane l decodes units
      l, l + 32, ... of the row (a warp reads contiguous bytes), dots each with the NT tokens'
      x while in registers, and the warp sums its lanes by shuffles. Weights are read once.
      Block types (INT8_DOT): x is first quantized to 8 bits per 32-block (quantize_x_kernel,
      a second launch) and a unit costs two dp4a; a lane then takes V chunks of 1 to 4 units
      per step with all their loads in flight (mmv_q8.py); float types dot in float32.
  tiled (prompts)  a block computes a TILE_M x TILE_T tile of out in float32 (matmul_tiled.py).
      Block types with integer codes (MMA, INT8_DOT) go to matmul_mma.py instead: x in 8
      bits, the codes' dot products on int8 tensor cores (mma.sync), scaled per 32-block.
mul_mat_id: for T <= MMV_MAX_T one matrix-vector block row per (token, slot) pair (its expert
read on the device); for prompts the pairs are grouped by expert on the device
(matmul_tiled.group_by_expert), then the tiled kernel runs over (row tile, pair tile) with
the pairs gathered. Experts nobody chose are never read.
Kernels are built per (type, sizes) by small factories, compiled on first use and cached.
"""
import numpy as np
from numba import cuda

from . import SIM, device_fn, ld_f32, or_empty, warp_sum
from . import matmul_mma as _mma
from .matmul_tiled import group_by_expert, sum_splits, tiled_kernel
from .mmv_q8 import chunk_units, chunks_in_flight, row_dot_fn
from .ops import copy_cols
from .quants import qtype_info, row_values, unit_cols  # noqa: F401  (row_values: for backends)
from .scratch import buffer, cached
from .x8 import quantize_x, quantize_x_view

f32 = np.float32
i32 = np.int32

# Tokens sharing a weight matrix up to which the matrix-vector kernel runs.
MMV_MAX_T = 8
# Matrix-vector products of the block types with x quantized to 8 bits (integer dot products,
# ~0.5% error from x's rounding, as llama.cpp and the CPU's INT8_DOT). False: exact float dots.
INT8_DOT = True
# Prompts (T > MMV_MAX_T) of the block types with integer codes on int8 tensor cores
# (matmul_mma.py; needs INT8_DOT too, x in 8 bits as above). False: the float tiled kernel.
MMA = True
# Warps per matrix-vector block: a warp per weight row, or with split-K (below) S warps
# a row, each taking every S-th 32 units of it.
MMV_WARPS = 4
# Split-K: rows of at least SPLIT_K_MIN_K values get S = 2, 4 (SPLIT_K_MAX) warps while
# M * S < SPLIT_K_ROWS, so that small products still fill the GPU's ~8000 warp slots.
SPLIT_K_MIN_K, SPLIT_K_MAX, SPLIT_K_ROWS = 1024, 4, 8192
# Tiled kernel: out tile TILE_M rows x TILE_T tokens, RM x RT per thread; mul_mat_id tiles
# hold TILE_T_ID tokens (experts get N / E tokens each on average). Chosen with
# tools/cuda_tile_sweep.py (docs/kernels.md); the simulator keeps small tiles (cost per thread).
TILE_M, TILE_T, TILE_RM, TILE_RT = (64, 64, 4, 4) if SIM else (128, 128, 8, 8)
TILE_T_ID = 32 if SIM else 64
# Float matrices of fewer rows than this (an F32 router) take the tiled kernel split over K
# for prompts: SPLIT_TILE (TM, TT, RM, RT) tiles, about SPLIT_GRID blocks, each split at
# least SPLIT_MIN_BLOCKS 32-blocks of K (the matrix-vector kernel over chunks of 8 tokens took
# 162 us for a 128 x 2048 router at 512 tokens on an H200).
TILED_MIN_M = 1024
SPLIT_TILE = (16, 16, 2, 2) if SIM else (64, 64, 4, 4)
SPLIT_GRID, SPLIT_MIN_BLOCKS = (4, 2) if SIM else (256, 2)
# Threads of the get_rows / dequantize kernels (one unit each).
ROWS_THREADS = 128

@device_fn
def dot8(v0, v1, v2, v3, v4, v5, v6, v7, x, xb, i0, i1, K, tail):
    """A unit's 8 values dotted with the x row at byte offset xb, columns i0.. and i1..
    (unit_cols). tail (float types, whose K need not be a multiple of 8): columns past K read
    column K - 1 (times a 0)."""
    if tail:
        return (v0 * ld_f32(x, xb, 4 * min(i0, K - 1)) + v1 * ld_f32(x, xb, 4 * min(i0 + 1, K - 1))
                + v2 * ld_f32(x, xb, 4 * min(i0 + 2, K - 1)) + v3 * ld_f32(x, xb, 4 * min(i0 + 3, K - 1))
                + v4 * ld_f32(x, xb, 4 * min(i1, K - 1)) + v5 * ld_f32(x, xb, 4 * min(i1 + 1, K - 1))
                + v6 * ld_f32(x, xb, 4 * min(i1 + 2, K - 1)) + v7 * ld_f32(x, xb, 4 * min(i1 + 3, K - 1)))
    return (v0 * ld_f32(x, xb, 4 * i0) + v1 * ld_f32(x, xb, 4 * i0 + 4)
            + v2 * ld_f32(x, xb, 4 * i0 + 8) + v3 * ld_f32(x, xb, 4 * i0 + 12)
            + v4 * ld_f32(x, xb, 4 * i1) + v5 * ld_f32(x, xb, 4 * i1 + 4)
            + v6 * ld_f32(x, xb, 4 * i1 + 8) + v7 * ld_f32(x, xb, 4 * i1 + 12))


# ---------------------------------------------------------------- matrix-vector
# out[t, r] = sum_k dequant(w)[r, k] * x[t, k]  for T <= MMV_MAX_T.
# Grid (ceil(M / warps), ceil(T / NT)), block (32, warps): warp = row, block row y = NT tokens.
# Rows past M and tokens past T compute on clamped indices and are not written, so every lane
# reaches the shuffles.

def _mmv_kernel(qtype, NT, S=1, ACC=False):
    t_ = qtype_info(qtype)
    dec, split, tail = t_.dec, t_.split, t_.block == 1
    write_rows = _write_rows_fn(S, NT, ACC)

    def build():
        @cuda.jit
        def mul_mat_vec_kernel(out, w, x, bias, RB, K):
            M, T = out.shape[1], out.shape[0]
            lane = cuda.threadIdx.x
            wy = cuda.threadIdx.y
            r = cuda.blockIdx.x * (cuda.blockDim.y // S) + wy // S
            sl = wy % S
            base = min(r, M - 1) * RB
            t0 = cuda.blockIdx.y * NT
            acc = cuda.local.array(NT, f32)
            res = cuda.local.array(NT, f32)
            for j in range(NT):
                acc[j] = f32(0.0)
                if ACC:                                 # loaded early: off the critical path
                    res[j] = out[min(t0 + j, T - 1), min(r, M - 1)]
            for n in range(lane + 32 * sl, (K + 7) // 8, 32 * S):
                b = n >> 2
                u = n & 3
                v0, v1, v2, v3, v4, v5, v6, v7 = dec(w, base, b, u, K)
                i0, i1 = unit_cols(b, u, split)
                for j in range(NT):
                    xb = min(t0 + j, T - 1) * K * 4
                    acc[j] += dot8(v0, v1, v2, v3, v4, v5, v6, v7, x, xb, i0, i1, K, tail)
            write_rows(out, acc, res, bias, r, t0, T, M, lane, wy, sl)
        return mul_mat_vec_kernel
    return cached(("mmv", int(qtype), NT, S, ACC, MMV_WARPS), build)


def _split_k(M, K):
    """Warps per weight row (split-K, SPLIT_K_MAX at most): few long rows leave most of the
    GPU idle with a warp a row (the router's 128 rows, a 2048-row output projection)."""
    if K < SPLIT_K_MIN_K:
        return 1
    s = 1
    while s < min(SPLIT_K_MAX, MMV_WARPS) and M * s < SPLIT_K_ROWS:
        s *= 2
    return s


_PARTS = (8, MMV_MAX_T)     # split-K partial sums a block: MMV_WARPS <= 8 (a module constant:
                            # Numba takes shared array shapes from globals, not closures)


def _write_rows_fn(S, NT, ACC=False):
    """The end of a matrix-vector kernel: warp sums of acc [NT], and with split-K (S warps a
    row) the S partial sums added in slice order by the row's first warp, then the row's
    bias (bias [M], or size 0: none; as ops.add_bias after the product). ACC: out += that
    (a residual add fused into the product: out is the residual stream, whose values the
    kernel loaded into res [NT] before its dot products)."""
    @device_fn
    def write_rows(out, acc, res, bias, r, t0, T, M, lane, wy, sl):
        if S == 1:
            for j in range(NT):
                tot = warp_sum(acc[j])
                if lane == 0 and r < M and t0 + j < T:
                    if bias.shape[0] > 0:
                        tot = tot + bias[r]
                    out[t0 + j, r] = tot + res[j] if ACC else tot
            return
        part = cuda.shared.array(_PARTS, f32)   # [warp, token]
        for j in range(NT):
            tot = warp_sum(acc[j])
            if lane == 0:
                part[wy, j] = tot
        cuda.syncthreads()
        if sl == 0 and lane == 0 and r < M:
            for j in range(NT):
                if t0 + j < T:
                    tot = part[wy, j]
                    for q in range(1, S):
                        tot += part[wy + q, j]
                    if bias.shape[0] > 0:
                        tot = tot + bias[r]
                    out[t0 + j, r] = tot + res[j] if ACC else tot
    return write_rows


def quantizes_x(qtype, T, K):
    """Whether a product of T tokens with this weight type quantizes x (then a next product of
    the same x may pass x_ready=True and skip that launch)."""
    return _int8(qtype, K) and (T <= MMV_MAX_T or MMA)


# ---------------------------------------------------------------- matrix-vector, int8 x
# As mul_mat_vec_kernel, with x as 8-bit words: a unit is 2 dp4a + a multiply-add per token
# (the float kernel spends tens of instructions a value on decode, loads and index math). The row
# dot is mmv_q8.row_dot_fn: a lane takes V chunks (1 to 4 units of one block) per step, all
# their loads in flight together; the fused decode kernels (fused.py) use the same one.
# mul_mat_vec_q8_kernel: grid (ceil(M / (warps / S)), ceil(T / NT)), block (32, warps):
#     warp wy = S * row + slice:  | row r0 sl 0 | row r0 sl 1 | .. | row r0 + 1 sl 0 | ..
#   block row y = NT tokens sharing each weight load; rows past M and tokens past T compute on
#   clamped indices and are not written (every lane reaches the shuffles).
# mul_mat_vec_id_q8_kernel is the mul_mat_id version (block row y = pair, warp = row, as below).

def _mmv_q8_kernel(qtype, NT, S, V, ACC=False):
    row_dot = row_dot_fn(qtype, V, NT, S)
    write_rows = _write_rows_fn(S, NT, ACC)

    def build():
        @cuda.jit
        def mul_mat_vec_q8_kernel(out, w, xq, xds, bias, RB, K):
            M, T = out.shape[1], out.shape[0]
            lane = cuda.threadIdx.x
            wy = cuda.threadIdx.y
            r = cuda.blockIdx.x * (cuda.blockDim.y // S) + wy // S
            sl = wy % S
            base = min(r, M - 1) * RB
            t0 = cuda.blockIdx.y * NT
            acc = cuda.local.array(NT, f32)
            isum = cuda.local.array(NT, i32)
            res = cuda.local.array(NT, f32)
            for j in range(NT):
                acc[j] = f32(0.0)
                if ACC:                                 # loaded early: off the critical path
                    res[j] = out[min(t0 + j, T - 1), min(r, M - 1)]
            row_dot(acc, isum, w, w, base, xq, xds, t0, T - 1, K, lane, sl)
            write_rows(out, acc, res, bias, r, t0, T, M, lane, wy, sl)
        return mul_mat_vec_q8_kernel
    return cached(("mmv_q8", int(qtype), NT, S, V, ACC, chunk_units(qtype), MMV_WARPS), build)


@device_fn
def pair_row(ids, p, r, M, A, X, RB):
    """Pair p = t * A + a of a matrix-vector expert product, weight row r (clamped to M - 1):
    (t, a, byte offset of the row of expert ids[t, a], x row t * X + (a if X == A else 0))."""
    t = p // A
    a = p - t * A
    return t, a, (ids[t, a] * M + min(r, M - 1)) * RB, t * X + (a if X == A else 0)


def _mmv_id_q8_kernel(qtype, V):
    row_dot = row_dot_fn(qtype, V)

    def build():
        @cuda.jit
        def mul_mat_vec_id_q8_kernel(out, w, xq, xds, ids, X, RB, K):
            M = out.shape[2]
            A = ids.shape[1]
            lane = cuda.threadIdx.x
            r = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y
            t, a, base, xr = pair_row(ids, cuda.blockIdx.y, r, M, A, X, RB)
            acc = cuda.local.array(1, f32)
            isum = cuda.local.array(1, i32)
            acc[0] = f32(0.0)
            row_dot(acc, isum, w, w, base, xq, xds, xr, xr, K, lane, 0)
            tot = warp_sum(acc[0])
            if lane == 0 and r < M:
                out[t, a, r] = tot
        return mul_mat_vec_id_q8_kernel
    return cached(("mmv_id_q8", int(qtype), V, chunk_units(qtype)), build)


# ---------------------------------------------------------------- mul_mat_id, matrix-vector
# out[t, a, r] = dequant(w[ids[t, a]])[r] . x[t, a if X == A else 0]: expert e's row r is row
# e * M + r of the flat weights, x row t * X + (a or 0) of the flat x.
# Grid (ceil(M / warps), N), block (32, warps): block row y = one pair.

def _mmv_id_kernel(qtype):
    t_ = qtype_info(qtype)
    dec, split, tail = t_.dec, t_.split, t_.block == 1

    def build():
        @cuda.jit
        def mul_mat_vec_id_kernel(out, w, x, ids, X, RB, K):
            M = out.shape[2]
            A = ids.shape[1]
            lane = cuda.threadIdx.x
            r = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y
            t, a, base, xr = pair_row(ids, cuda.blockIdx.y, r, M, A, X, RB)
            xb = xr * K * 4
            acc = f32(0.0)
            for n in range(lane, (K + 7) // 8, 32):
                b = n >> 2
                u = n & 3
                v0, v1, v2, v3, v4, v5, v6, v7 = dec(w, base, b, u, K)
                i0, i1 = unit_cols(b, u, split)
                acc += dot8(v0, v1, v2, v3, v4, v5, v6, v7, x, xb, i0, i1, K, tail)
            tot = warp_sum(acc)
            if lane == 0 and r < M:
                out[t, a, r] = tot
        return mul_mat_vec_id_kernel
    return cached(("mmv_id", int(qtype)), build)


# ---------------------------------------------------------------- dequantize rows
# out[j, :] = dequant(w[row_j]) with row_j = ids[j] (get_rows) or j (dequantize).
# Flat grid over (row j, unit n) pairs; a thread decodes one unit and stores its 8 values.

def _rows_kernel(qtype, gather):
    t_ = qtype_info(qtype)
    dec, split = t_.dec, t_.split

    def build():
        @cuda.jit
        def dequant_rows_kernel(out, w, ids, RB, K):
            units = (K + 7) // 8
            idx = cuda.grid(1)
            j = idx // units
            if j >= out.shape[0]:
                return
            n = idx - j * units
            base = (ids[j] if gather else j) * RB
            b = n // 4
            u = n - 4 * b
            v0, v1, v2, v3, v4, v5, v6, v7 = dec(w, base, b, u, K)
            i0, i1 = unit_cols(b, u, split)
            out[j, i0] = v0
            if i0 + 1 < K:     # float types: K need not be a multiple of 8
                out[j, i0 + 1] = v1
            if i0 + 2 < K:
                out[j, i0 + 2] = v2
            if i0 + 3 < K:
                out[j, i0 + 3] = v3
            if i1 < K:
                out[j, i1] = v4
            if i1 + 1 < K:
                out[j, i1 + 1] = v5
            if i1 + 2 < K:
                out[j, i1 + 2] = v6
            if i1 + 3 < K:
                out[j, i1 + 3] = v7
        return dequant_rows_kernel
    return cached(("rows", int(qtype), gather), build)


def _launch_rows(out, w, ids, RB, K, qtype, gather, stream):
    n = out.shape[0] * ((K + 7) // 8)
    if n == 0:
        return
    kern = _rows_kernel(qtype, gather)
    kern[(n + ROWS_THREADS - 1) // ROWS_THREADS, ROWS_THREADS, stream](out, w, ids, RB, K)


# ---------------------------------------------------------------- launchers

def _int8(qtype, K):
    return INT8_DOT and qtype_info(qtype).idec is not None and K % 32 == 0


def id_tile(qtype, K, T, E, A):
    """The tile of token slots a T-token mul_mat_id of A of E experts groups its pairs in (0: no
    grouping, the matrix-vector path): a caller that knows two products share their ids passes
    grouped."""
    if T <= MMV_MAX_T or K % 32 != 0:
        return 0
    return _mma.id_tiles(T, E, A)[1] if MMA and _int8(qtype, K) else TILE_T_ID


def _rb_k(w, qtype):
    """(row_bytes, K) of weights w [..., row_bytes]."""
    shape = w.shape
    rb = shape[len(shape) - 1]           # (the simulator's shapes take no negative index)
    t = qtype_info(qtype)
    return rb, rb // t.size * t.block


def mul_mat(out, w, x, qtype, stream=0, x_ready=False, accumulate=False, bias=None):
    """out [T, M] f32 = x [T, K] f32 @ dequant(w [M, row_bytes])^T, on the device.
    x_ready: x is the one the previous product quantized (see quantizes_x).
    accumulate: out += the product instead (matrix-vector products only, T <= MMV_MAX_T);
    bias [M] (None or size 0: none): the product + bias, where fuses_bias says."""
    RB, K = _rb_k(w, qtype)
    T, M = out.shape
    if T == 0:
        return
    if T > MMV_MAX_T and accumulate:
        raise ValueError("mul_mat: accumulate is for matrix-vector products (T <= MMV_MAX_T)")
    if bias is not None and bias.shape[0] > 0 and not fuses_bias(qtype, T, K):
        raise ValueError(f"mul_mat: no kernel adds a bias to a {T}-row product of this type")
    if bias is not None and bias.shape[0] not in (0, M):
        raise ValueError(f"mul_mat: bias {bias.shape} for {M} rows")
    if T > MMV_MAX_T and MMA and _int8(qtype, K):
        _mma.mul_mat(out, w, x, qtype, RB, K, stream, x_ready, bias)
        return
    if T > MMV_MAX_T and K % 32 == 0 and M >= TILED_MIN_M:
        kern, nth = tiled_kernel(qtype, TILE_M, TILE_T, TILE_RM, TILE_RT, False)
        d = buffer("dummy", 4, np.int32)
        kern[((M + TILE_M - 1) // TILE_M, (T + TILE_T - 1) // TILE_T), nth, stream](
            out, w, x, RB, K, T, M, d, d, 1, 1, K // 32)
        return
    if T > MMV_MAX_T and K % 32 == 0:
        _mul_mat_split_k(out, w, x, qtype, RB, K, stream)
        return
    nt = min(T, MMV_MAX_T)      # odd float matrices at T > MMV_MAX_T: chunks of tokens
    S = _split_k(M, K)
    rpb = MMV_WARPS // S        # rows a block
    grid = ((M + rpb - 1) // rpb, (T + nt - 1) // nt)
    bias = or_empty(bias)
    if _int8(qtype, K):
        xq, xds = quantize_x(x, T, K, stream, x_ready)
        _mmv_q8_kernel(qtype, nt, S, chunks_in_flight(qtype, K, S), accumulate)[grid, (32, MMV_WARPS), stream](
            out, w, xq, xds, bias, RB, K)
    else:
        _mmv_kernel(qtype, nt, S, accumulate)[grid, (32, MMV_WARPS), stream](out, w, x, bias, RB, K)


def fuses_bias(qtype, T, K):
    """Whether mul_mat adds a bias in its own kernel for T rows: matrix-vector products and
    the int8 tensor-core tiles."""
    return T <= MMV_MAX_T or (MMA and _int8(qtype, K))


def fuses_bias_id(qtype, T, K):
    """Whether mul_mat_id adds the experts' bias in its own kernel: the tensor-core tiles."""
    return T > MMV_MAX_T and K % 32 == 0 and MMA and _int8(qtype, K)


def fuses_glu_id(qtype, T, K, M):
    """Whether mul_mat_id of a merged gate_up (M = 2F rows an expert) applies the GLU itself
    (its glu argument): the tensor-core tiles."""
    return fuses_bias_id(qtype, T, K) and M % 2 == 0


def _mul_mat_split_k(out, w, x, qtype, RB, K, stream):
    """out [T, M] = x @ dequant(w)^T for few rows (M < TILED_MIN_M): the tiled kernel with K
    split over grid z into enough blocks for the GPU, then the parts summed in order."""
    T, M = out.shape
    gm, gt = (M + SPLIT_TILE[0] - 1) // SPLIT_TILE[0], (T + SPLIT_TILE[1] - 1) // SPLIT_TILE[1]
    B = K // 32
    kc = max(SPLIT_MIN_BLOCKS, -(-B * gm * gt // SPLIT_GRID))     # 32-blocks a split
    Z = -(-B // kc)
    part = buffer("split_k", Z * T * M, np.float32)
    kern, nth = tiled_kernel(qtype, *SPLIT_TILE, False, True)
    d = buffer("dummy", 4, np.int32)
    kern[(gm, gt, Z), nth, stream](part, w, x, RB, K, T, M, d, d, 1, 1, kc)
    sum_splits(out, part, Z, stream)


def mul_mat_id(out, w, x, ids, qtype, stream=0, x_ready=False, grouped=False, bias=None, glu=None):
    """out [T, A, M] = dequant(w [E, M, row_bytes][ids[t, a]]) @ x[t, a if X == A else 0];
    x [T, X, K], ids int32 [T, A] on the device. grouped: see matmul_tiled.group_by_expert.
    bias (flat [E * M], None or size 0: none): + the chosen expert's row, where
    fuses_bias_id says. glu (glu_out [T * A, M / 2], act code), where fuses_glu_id says: w is
    a merged gate_up and glu_out gets act(gate, up) (out is not written)."""
    RB, K = _rb_k(w, qtype)
    E, M = w.shape[0], w.shape[1]
    T, X = x.shape[0], x.shape[1]
    A = ids.shape[1]
    N = T * A
    if bias is not None and bias.shape[0] > 0 and not fuses_bias_id(qtype, T, K):
        raise ValueError(f"mul_mat_id: no kernel adds a bias to a {T}-token product of this type")
    if glu is not None and not fuses_glu_id(qtype, T, K, M):
        raise ValueError(f"mul_mat_id: no kernel applies the GLU to a {T}-token product of this type")
    if N == 0:
        return
    if T <= MMV_MAX_T or K % 32 != 0:
        grid = ((M + MMV_WARPS - 1) // MMV_WARPS, N)
        if _int8(qtype, K):
            xq, xds = quantize_x(x, T * X, K, stream, x_ready)
            _mmv_id_q8_kernel(qtype, chunks_in_flight(qtype, K))[grid, (32, MMV_WARPS), stream](
                out, w, xq, xds, ids, X, RB, K)
        else:
            _mmv_id_kernel(qtype)[grid, (32, MMV_WARPS), stream](out, w, x, ids, X, RB, K)
        return
    if MMA and _int8(qtype, K):
        _mma.mul_mat_id(out, w, x, ids, qtype, RB, K, stream, x_ready, grouped, bias, glu)
        return
    TT = TILE_T_ID
    order, tiles, max_tiles = group_by_expert(ids, E, TT, stream, grouped)
    kern, nth = tiled_kernel(qtype, TILE_M, TT, TILE_RM, TILE_RT, True)
    kern[((M + TILE_M - 1) // TILE_M, max_tiles), nth, stream](out, w, x, RB, K, T, M, order, tiles, A, X,
                                                              K // 32)


def mul_mat_heads(out, w, x, ids, qtype, stream=0):
    """mul_mat_id where x [T, H, K] and out [T, H, M] may be column windows of wider heads
    (views, rows strided: MLA's k_b, v_b products). Decoding's 8-bit matrix-vector path
    quantizes x's window and writes out's in place; the float matrix-vector path reads a copy
    of x, the prompt paths read and write copies (they take contiguous rows)."""
    RB, K = _rb_k(w, qtype)
    T, X, M = x.shape[0], x.shape[1], out.shape[2]
    vec = T <= MMV_MAX_T or K % 32 != 0      # mul_mat_id's matrix-vector kernels: out[t, a, r]
    if vec and _int8(qtype, K):
        quantize_x_view(x, stream)
        mul_mat_id(out, w, x, ids, qtype, stream, x_ready=True)
        return
    xc, oc = x, out
    if not x.is_c_contiguous():
        xc = buffer("heads_x", T * X * K, np.float32)[:T * X * K].reshape(T, X, K)
        copy_cols(xc, x, 0, 0, K, stream)
    if not vec and not out.is_c_contiguous():
        oc = buffer("heads_out", T * X * M, np.float32)[:T * X * M].reshape(T, X, M)
    mul_mat_id(oc, w, xc, ids, qtype, stream)
    if oc is not out:
        copy_cols(out, oc, 0, 0, M, stream)


def get_rows(out, w, ids, qtype, stream=0):
    """out [T, K] = dequant(w[ids[t]]) (embedding lookup); ids int32 [T] on the device."""
    RB, K = _rb_k(w, qtype)
    _launch_rows(out, w, ids, RB, K, qtype, True, stream)


def dequantize(w, qtype, stream=0):
    """w [..., row_bytes] on the device -> a new float32 device array [..., K]."""
    RB, K = _rb_k(w, qtype)
    shape = tuple(w.shape)
    R = int(np.prod(shape[:-1]))
    out = cuda.device_array((R, K), np.float32)
    _launch_rows(out, w, buffer("dummy", 4, np.int32), RB, K, qtype, False, stream)
    return out.reshape(shape[:-1] + (K,))
