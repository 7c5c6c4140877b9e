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
instructions a load, which made the first matrix-vector kernel instruction-bound.

Kernels, chosen per call by the number of tokens T sharing a weight matrix:
  matrix-vector (T <= MMV_MAX_T: generation)  one warp per weight row; lane l decodes units
      l, l + 32, ... of the row (a warp reads contiguous bytes), dots each with the NT tokens'
      x while in registers, and the warp sums its lanes by shuffles. Weights are read once.
      Block types (INT8_DOT): x is first quantized to 8 bits per 32-block (quantize_x_kernel,
      a second launch) and a unit costs two dp4a; a lane then takes V chunks of 1 to 4 units
      per step with all their loads in flight (mmv_q8.py); float types dot in float32.
  tiled (prompts)  a block computes a TILE_M x TILE_T tile of out: per 32-value step it decodes
      TILE_M rows' block into shared memory (one unit per thread) next to TILE_T tokens' x,
      then each thread accumulates an RM x RT piece from shared memory. Block types with
      integer codes (MMA, INT8_DOT) go to matmul_mma.py instead: x in 8 bits, the codes'
      dot products on int8 tensor cores (mma.sync), scaled per 32-block in float32.
mul_mat_id: for T <= MMV_MAX_T one matrix-vector block row per (token, slot) pair (its expert
read on the device); for prompts the pairs are grouped by expert on the device (one block:
counts, offsets, a table of (expert, first pair, pairs) tiles), then the tiled kernel runs
over (row tile, pair tile) with the pairs gathered. Experts nobody chose are never read.
Kernels are built per (type, sizes) by small factories, compiled on first use and cached.
"""
import numpy as np
from numba import cuda

from . import SIM, device_fn, device_id, ld_f32, rintf, shfl_idx, shfl_xor, warp_sum
from .mmv_q8 import chunk_units, chunks_in_flight, row_dot_fn, unit_words  # noqa: F401  (unit_words: matmul_mma)
from .quants import qtype_info, row_values, unit_cols  # noqa: F401  (row_values: for backends)

f32 = np.float32
i32 = np.int32
u32 = np.uint32

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
# hold TILE_T_ID tokens (experts get N / E tokens each on average). Measured on the H200
# (tools/cuda_tile_sweep.py, Q4_0 / Q8_0, T=512 4096x2048 and 2048 tokens x 8 of 128 experts
# 768x2048): 128x128 8x8 id 64: 13.4 / 12.3 TFLOP/s; 64x64 4x4 id 32: 10.2 / 9.7. The simulator
# keeps the small tiles (the same code; its cost grows with the work per thread).
TILE_M, TILE_T, TILE_RM, TILE_RT = (64, 64, 4, 4) if SIM else (128, 128, 8, 8)
TILE_T_ID = 32 if SIM else 64
# Float matrices of fewer rows than this take the matrix-vector kernel over chunks of
# MMV_MAX_T tokens for prompts too: a tiled grid of their few row tiles leaves the GPU idle
# (the F32 router of Qwen3-30B-A3B, 128 x 2048 at T = 512: 4 blocks, ~1 ms a layer, 37% of a
# pp512's device time under ncu; its weights stay in L2 across the chunks).
TILED_MIN_M = 1024
# Experts the grouping kernel handles (shared-memory counters).
MAX_E = 1024
# Threads of the get_rows / dequantize kernels (one unit each).
ROWS_THREADS = 128

_kernels = {}


def _cached(key, build):
    k = _kernels.get(key)
    if k is None:
        k = _kernels[key] = build()
    return k


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
        def mul_mat_vec_kernel(out, w, x, RB, K):
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
            write_rows(out, acc, res, r, t0, T, M, lane, wy, sl)
        return mul_mat_vec_kernel
    return _cached(("mmv", int(qtype), NT, S, ACC, MMV_WARPS), build)


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
    row) the S partial sums added in slice order by the row's first warp. ACC: out += the
    product (a residual add fused into the product: out is the residual stream, whose values
    the kernel loaded into res [NT] before its dot products)."""
    @device_fn
    def write_rows(out, acc, res, r, t0, T, M, lane, wy, sl):
        if S == 1:
            for j in range(NT):
                tot = warp_sum(acc[j])
                if lane == 0 and r < M and t0 + j < T:
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
                    out[t0 + j, r] = tot + res[j] if ACC else tot
    return write_rows


# ---------------------------------------------------------------- x to 8 bits
# x [N, K] (any shape of N rows of K, C-contiguous) -> flat buffers xq int32 [N * K / 4]
# (4 int8 codes a word, little-endian) and xds float32 [N * K / 16] ((d, s) per 32-block):
# d = max|x| / 127, code = rint(x / d), s = d * sum of the codes (as the CPU's quantize_x).
# One thread per word, 8 lanes per block reduce by shuffles; threads past the end work on the
# last word and do not write (every lane reaches the shuffles).

@cuda.jit
def quantize_x_kernel(xq, xds, x, n_words):
    idx = cuda.grid(1)
    i = min(idx, n_words - 1)
    quantize_word(xq, xds, idx, idx < n_words, ld_f32(x, 0, 16 * i), ld_f32(x, 0, 16 * i + 4),
                  ld_f32(x, 0, 16 * i + 8), ld_f32(x, 0, 16 * i + 12))


@device_fn
def quantize_word(xq, xds, idx, write, x0, x1, x2, x3):
    """Word idx of xq from its 4 values; lanes idx % 8 == 0..7 of one 32-block are 8
    consecutive lanes of a warp (all of them call this), and lane 0 of them writes xds."""
    a = max(max(abs(x0), abs(x1)), max(abs(x2), abs(x3)))
    if x0 != x0 or x1 != x1 or x2 != x2 or x3 != x3:
        a = x0 + x1 + x2 + x3                      # NaN sticks: d = NaN, so the output is NaN
    for m in (4, 2, 1):
        o = shfl_xor(a, m)
        if o > a or o != o:
            a = o
    d = a / f32(127.0)
    inv = f32(1.0) / d if d > f32(0.0) else f32(0.0)
    q0 = i32(rintf(x0 * inv))
    q1 = i32(rintf(x1 * inv))
    q2 = i32(rintf(x2 * inv))
    q3 = i32(rintf(x3 * inv))
    sq = q0 + q1 + q2 + q3
    for m in (4, 2, 1):
        sq += shfl_xor(sq, m)
    if write:
        xq[idx] = _word(q0, q1, q2, q3)
        if idx % 8 == 0:
            xds[idx // 4] = d
            xds[idx // 4 + 1] = d * f32(sq)


@device_fn
def _word(q0, q1, q2, q3):
    """Four 8-bit codes in one int32 word, little-endian."""
    return i32(u32(q0 & 0xFF) | (u32(q1 & 0xFF) << u32(8)) | (u32(q2 & 0xFF) << u32(16))
               | (u32(q3 & 0xFF) << u32(24)))


@device_fn
def quantize_lane(xq, xds, blk, write, v, lane):
    """32-block blk of x from one value a lane (lane l holds value 32 blk + l; all 32 lanes
    call this): the codes and (d, s) quantize_word gives the same block. Lanes 0..7 gather the
    codes of lanes 4l..4l+3 into word 8 blk + l."""
    a = abs(v)
    if v != v:
        a = v                                      # NaN sticks, as in quantize_word
    for m in (16, 8, 4, 2, 1):
        o = shfl_xor(a, m)
        if o > a or o != o:
            a = o
    d = a / f32(127.0)
    inv = f32(1.0) / d if d > f32(0.0) else f32(0.0)
    q = i32(rintf(v * inv))
    sq = q
    for m in (16, 8, 4, 2, 1):
        sq += shfl_xor(sq, m)
    src = 4 * (lane & 7)
    c0 = shfl_idx(q, src)
    c1 = shfl_idx(q, src + 1)
    c2 = shfl_idx(q, src + 2)
    c3 = shfl_idx(q, src + 3)
    if write and lane < 8:
        xq[8 * blk + lane] = _word(c0, c1, c2, c3)
        if lane == 0:
            xds[2 * blk] = d
            xds[2 * blk + 1] = d * f32(sq)


_x8_stand_ins = {}


def unused_x8():
    """Stand-ins for unused 8-bit output buffers (kernels are typed on them), per GPU."""
    key = device_id()
    if key not in _x8_stand_ins:
        _x8_stand_ins[key] = (cuda.device_array(1, np.int32), cuda.device_array(1, np.float32))
    return _x8_stand_ins[key]


def _quantize_x(x, n_rows, K, stream, ready=False):
    """x (n_rows rows of K) -> (xq, xds) in reused flat device buffers (one stream at a time).
    ready: the buffers already hold this x (the previous product quantized the same input)."""
    n = n_rows * K // 4
    xq, xds = x8_buffers(n_rows, K)
    if not ready:
        quantize_x_kernel[(n + 127) // 128, 128, stream](xq, xds, x, n)
    return xq, xds


def x8_buffers(n_rows, K):
    """The (xq, xds) buffers the next product reads when it gets x_ready=True (a fused
    producer, such as ops.rms_norm(..., xq=, xds=), writes x there in 8 bits)."""
    n = n_rows * K // 4
    return _buffer("xq", n, np.int32), _buffer("xds", n // 4, np.float32)


def quantizes_x(qtype, T, K):
    """Whether a product of T tokens with this weight type quantizes x (then a next product of
    the same x may pass x_ready=True and skip that launch)."""
    return _int8(qtype, K) and (T <= MMV_MAX_T or MMA)


# ---------------------------------------------------------------- matrix-vector, int8 x
# As mul_mat_vec_kernel, with x as 8-bit words: a unit is 2 dp4a + a multiply-add per token
# (the float kernel spends ~40 instructions a value on decode, loads and index math). The row
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
        def mul_mat_vec_q8_kernel(out, w, xq, xds, RB, K):
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
            write_rows(out, acc, res, r, t0, T, M, lane, wy, sl)
        return mul_mat_vec_q8_kernel
    return _cached(("mmv_q8", int(qtype), NT, S, V, ACC, chunk_units(qtype), MMV_WARPS), build)


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
    return _cached(("mmv_id_q8", int(qtype), V, chunk_units(qtype)), build)


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
    return _cached(("mmv_id", int(qtype)), build)


# ---------------------------------------------------------------- tiled
# out[orow[j], r0 + i] = sum_k dequant(w)[rbase + r0 + i, k] * x[xrow[j], k] over the tile's
# i < TM rows and j < TT token slots. Plain: tile (bx, by), slot j = token by * TT + j.
# Gathered (mul_mat_id): tile by = (expert, first pair, pairs) of `tiles` (flat: tiles[0] the
# count, then 3 ints a tile), slot j = pair order[first + j] = t * A + a,
# xrow = t * X + (a if X == A else 0), output out[t, a].
# Block: (TM / RM) * (TT / RT) threads; thread (tr, tc) owns rows tr + i * TM / RM (i < RM),
# so a warp reads 32 different shared-memory rows of stride 33 (no bank conflicts), and
# slots tc * RT + j (one value a warp: a broadcast). K must be a multiple of 32.

@device_fn
def tile_slots(xrow, orow, order, tiles, by, tid, nth, TT, T, M, A, X, gather):
    """The token slots of tile row `by` (the block's threads tid of nth fill them): xrow[j] the
    x row of slot j, orow[j] its output row (t, or the pair p = t * A + a), -1 past the tile's
    slots. Returns (rbase, slots): the first weight row of the tile's expert (0 when plain)
    and its slots. Gathered: the tile (expert, first pair, pairs) of `tiles`, the caller
    having checked by < tiles[0]."""
    if gather:
        k3 = 3 * by + 1
        first = tiles[k3 + 1]
        cnt = tiles[k3 + 2]
        for j in range(tid, TT, nth):
            if j < cnt:
                p = order[first + j]
                t = p // A
                xrow[j] = t * X + (p - t * A if X == A else 0)
                orow[j] = p
            else:
                xrow[j] = -1
                orow[j] = -1
        return tiles[k3] * M, cnt
    for j in range(tid, TT, nth):
        t = by * TT + j
        xrow[j] = t if t < T else -1
        orow[j] = xrow[j]
    return 0, min(TT, T - by * TT)


@device_fn
def _store_token(out, o, A, r, v):
    out[o, r] = v


@device_fn
def _store_pair(out, p, A, r, v):
    t = p // A
    out[t, p - t * A, r] = v


def _tiled_kernel(qtype, TM, TT, RM, RT, gather):
    t_ = qtype_info(qtype)
    dec, split = t_.dec, t_.split
    SR = TM // RM              # threads along rows
    NTH = SR * (TT // RT)      # threads in the block
    ACC = RM * RT              # (local and shared array shapes must be plain constants)
    WS, XS = (TM, 33), (TT, 33)
    store = _store_pair if gather else _store_token

    def build():
        @cuda.jit
        def mul_mat_tiled_kernel(out, w, x, RB, K, T, M, order, tiles, A, X):
            ws = cuda.shared.array(WS, f32)          # decoded weights, padded against bank conflicts
            xs = cuda.shared.array(XS, f32)
            xrow = cuda.shared.array(TT, i32)
            orow = cuda.shared.array(TT, i32)
            tid = cuda.threadIdx.x
            r0 = cuda.blockIdx.x * TM
            if gather and cuda.blockIdx.y >= tiles[0]:
                return                               # the whole block: beyond the tile table
            rbase, _ = tile_slots(xrow, orow, order, tiles, cuda.blockIdx.y, tid, NTH, TT, T, M,
                                  A, X, gather)
            tr = tid % SR
            tc = tid // SR
            acc = cuda.local.array(ACC, f32)
            a = cuda.local.array(RM, f32)
            for i in range(ACC):
                acc[i] = f32(0.0)
            cuda.syncthreads()
            for kb in range(K // 32):
                for n in range(tid, TM * 4, NTH):     # decode: one unit a thread
                    rr = n // 4
                    u = n - 4 * rr
                    base = (rbase + min(r0 + rr, M - 1)) * RB
                    v0, v1, v2, v3, v4, v5, v6, v7 = dec(w, base, kb, u, K)
                    i0, i1 = unit_cols(0, u, split)
                    ws[rr, i0] = v0
                    ws[rr, i0 + 1] = v1
                    ws[rr, i0 + 2] = v2
                    ws[rr, i0 + 3] = v3
                    ws[rr, i1] = v4
                    ws[rr, i1 + 1] = v5
                    ws[rr, i1 + 2] = v6
                    ws[rr, i1 + 3] = v7
                for n in range(tid, TT * 32, NTH):    # x: coalesced 32-float rows
                    j = n // 32
                    kk = n - 32 * j
                    xr = xrow[j]
                    xs[j, kk] = ld_f32(x, xr * K * 4, 4 * (kb * 32 + kk)) if xr >= 0 else f32(0.0)
                cuda.syncthreads()
                for kk in range(32):
                    for i in range(RM):
                        a[i] = ws[tr + i * SR, kk]
                    for j in range(RT):
                        bj = xs[tc * RT + j, kk]
                        for i in range(RM):
                            acc[i * RT + j] += a[i] * bj
                cuda.syncthreads()
            for j in range(RT):
                o = orow[tc * RT + j]
                if o >= 0:
                    for i in range(RM):
                        r = r0 + tr + i * SR
                        if r < M:
                            store(out, o, A, r, acc[i * RT + j])
        return mul_mat_tiled_kernel, NTH
    return _cached(("tiled", int(qtype), TM, TT, RM, RT, gather), build)


# ---------------------------------------------------------------- grouping pairs by expert
# ids [T, A] -> order [N] (pair indices t * A + a grouped by expert; order within an expert is
# whatever the atomics gave: each pair's result does not depend on it), tiles int32: tiles[0]
# the number n of tiles, then n triples (expert, first index into order, pairs <= TT). One block: shared-memory
# histogram by atomics, offsets and the tile table by thread 0 (E + N / TT steps), scatter.

def _group_kernel():
    def build():
        @cuda.jit
        def group_by_expert_kernel(ids, E, TT, order, tiles):
            cnt = cuda.shared.array(MAX_E, i32)
            fill = cuda.shared.array(MAX_E, i32)
            tid = cuda.threadIdx.x
            nth = cuda.blockDim.x
            A = ids.shape[1]
            N = ids.shape[0] * A
            for e in range(tid, E, nth):
                cnt[e] = 0
            cuda.syncthreads()
            for p in range(tid, N, nth):
                t = p // A
                cuda.atomic.add(cnt, ids[t, p - t * A], 1)
            cuda.syncthreads()
            if tid == 0:
                start = 0
                k = 0
                for e in range(E):
                    fill[e] = start
                    c = cnt[e]
                    for f in range(0, c, TT):
                        tiles[3 * k + 1] = e
                        tiles[3 * k + 2] = start + f
                        tiles[3 * k + 3] = min(TT, c - f)
                        k += 1
                    start += c
                tiles[0] = k
            cuda.syncthreads()
            for p in range(tid, N, nth):
                t = p // A
                slot = cuda.atomic.add(fill, ids[t, p - t * A], 1)
                order[slot] = p
        return group_by_expert_kernel
    return _cached(("group",), build)


_scratch = {}
_outgrown = []


def _buffer(name, n, dtype):
    """A flat device buffer of >= n elements reused across calls (one stream per GPU), one per
    GPU: grown, never freed (a recorded CUDA graph may still use an outgrown one), passed
    whole (kernels index it; slicing a device array costs host time)."""
    key = (device_id(), name)
    b = _scratch.get(key)
    if b is None or b.size < n:
        if b is not None:
            _outgrown.append(b)
        b = _scratch[key] = cuda.device_array(max(n, 1), dtype)
    return b


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
    return _cached(("rows", int(qtype), gather), build)


def _launch_rows(out, w, ids, RB, K, qtype, gather, stream):
    n = out.shape[0] * ((K + 7) // 8)
    if n == 0:
        return
    kern = _rows_kernel(qtype, gather)
    kern[(n + ROWS_THREADS - 1) // ROWS_THREADS, ROWS_THREADS, stream](out, w, ids, RB, K)


# ---------------------------------------------------------------- launchers

def _int8(qtype, K):
    return INT8_DOT and qtype_info(qtype).idec is not None and K % 32 == 0


def _group_by_expert(ids, E, TT, stream, grouped=False):
    """(order, tiles, max_tiles): the pairs of ids [T, A] grouped by expert in tiles of <= TT
    (group_by_expert_kernel); max_tiles bounds the table's length (the grid's y size).
    grouped: the last grouping on this GPU was of these ids, E and TT (the gate, up and down
    products of a MoE layer share their ids): its table is reused, no launch."""
    if E > MAX_E:
        raise ValueError(f"mul_mat_id: {E} experts, the CUDA grouping handles at most {MAX_E}")
    N = ids.shape[0] * ids.shape[1]
    max_tiles = N // TT + min(E, N)       # every used expert adds at most one partial tile
    order = _buffer("order", N, np.int32)
    tiles = _buffer("tiles", 1 + 3 * max_tiles, np.int32)
    if not grouped:
        _group_kernel()[1, 256, stream](ids, E, TT, order, tiles)
    return order, tiles, max_tiles


def id_tile(qtype, K, T):
    """The tile of token slots a T-token mul_mat_id groups its pairs in (0: no grouping, the
    matrix-vector path): a caller that knows two products share their ids passes grouped."""
    if T <= MMV_MAX_T or K % 32 != 0:
        return 0
    return _mma.TT_ID if MMA and _int8(qtype, K) else TILE_T_ID


def _rb_k(w, qtype):
    """(row_bytes, K) of weights w [..., row_bytes]."""
    shape = w.shape
    rb = shape[len(shape) - 1]           # (the simulator's shapes take no negative index)
    t = qtype_info(qtype)
    return rb, rb // t.size * t.block


def mul_mat(out, w, x, qtype, stream=0, x_ready=False, accumulate=False):
    """out [T, M] f32 = x [T, K] f32 @ dequant(w [M, row_bytes])^T, on the device.
    x_ready: x is the one the previous product quantized (see quantizes_x).
    accumulate: out += the product instead (matrix-vector products only, T <= MMV_MAX_T)."""
    RB, K = _rb_k(w, qtype)
    T, M = out.shape
    if T == 0:
        return
    if accumulate and T > MMV_MAX_T:
        raise ValueError("mul_mat: accumulate is for matrix-vector products (T <= MMV_MAX_T)")
    if T > MMV_MAX_T and MMA and _int8(qtype, K):
        _mma.mul_mat(out, w, x, qtype, RB, K, stream, x_ready)
        return
    if T > MMV_MAX_T and K % 32 == 0 and M >= TILED_MIN_M:
        kern, nth = _tiled_kernel(qtype, TILE_M, TILE_T, TILE_RM, TILE_RT, False)
        d = _buffer("dummy", 4, np.int32)
        kern[((M + TILE_M - 1) // TILE_M, (T + TILE_T - 1) // TILE_T), nth, stream](
            out, w, x, RB, K, T, M, d, d, 1, 1)
        return
    nt = min(T, MMV_MAX_T)      # small or odd float matrices at T > MMV_MAX_T: chunks of tokens
    S = _split_k(M, K)
    rpb = MMV_WARPS // S        # rows a block
    grid = ((M + rpb - 1) // rpb, (T + nt - 1) // nt)
    if _int8(qtype, K):
        xq, xds = _quantize_x(x, T, K, stream, x_ready)
        _mmv_q8_kernel(qtype, nt, S, chunks_in_flight(qtype, K, S), accumulate)[grid, (32, MMV_WARPS), stream](
            out, w, xq, xds, RB, K)
    else:
        _mmv_kernel(qtype, nt, S, accumulate)[grid, (32, MMV_WARPS), stream](out, w, x, RB, K)


def mul_mat_id(out, w, x, ids, qtype, stream=0, x_ready=False, grouped=False):
    """out [T, A, M] = dequant(w [E, M, row_bytes][ids[t, a]]) @ x[t, a if X == A else 0];
    x [T, X, K], ids int32 [T, A] on the device. grouped: see _group_by_expert."""
    RB, K = _rb_k(w, qtype)
    E, M = w.shape[0], w.shape[1]
    T, X = x.shape[0], x.shape[1]
    A = ids.shape[1]
    N = T * A
    if N == 0:
        return
    if T <= MMV_MAX_T or K % 32 != 0:
        grid = ((M + MMV_WARPS - 1) // MMV_WARPS, N)
        if _int8(qtype, K):
            xq, xds = _quantize_x(x, T * X, K, stream, x_ready)
            _mmv_id_q8_kernel(qtype, chunks_in_flight(qtype, K))[grid, (32, MMV_WARPS), stream](
                out, w, xq, xds, ids, X, RB, K)
        else:
            _mmv_id_kernel(qtype)[grid, (32, MMV_WARPS), stream](out, w, x, ids, X, RB, K)
        return
    if MMA and _int8(qtype, K):
        _mma.mul_mat_id(out, w, x, ids, qtype, RB, K, stream, x_ready, grouped)
        return
    TT = TILE_T_ID
    order, tiles, max_tiles = _group_by_expert(ids, E, TT, stream, grouped)
    kern, nth = _tiled_kernel(qtype, TILE_M, TT, TILE_RM, TILE_RT, True)
    kern[((M + TILE_M - 1) // TILE_M, max_tiles), nth, stream](out, w, x, RB, K, T, M, order, tiles, A, X)


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
    _launch_rows(out, w, _buffer("dummy", 4, np.int32), RB, K, qtype, False, stream)
    return out.reshape(shape[:-1] + (K,))


# ---------------------------------------------------------------- benchmark
# python -m nbmoe.cuda.matmul: T=1 GB/s (weight bytes read, active experts only) next to a
# device-to-device copy measured in the same run, and prompt GFLOP/s. Weights are cycled
# through copies larger than the L2, so every matrix-vector call reads from memory.

def _time_ms(fn, n):
    """Median time of fn(i) in ms over n calls, by CUDA events around each call (after a warm-up)."""
    fn(0)
    cuda.synchronize()
    times = []
    for i in range(n):
        e0, e1 = cuda.event(), cuda.event()
        e0.record()
        fn(i)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return float(np.median(times))


def main(argv=None):
    import argparse
    import time

    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    global MMV_WARPS
    p = argparse.ArgumentParser(description="CUDA mul_mat benchmark. Example: --types Q4_0,Q8_0")
    p.add_argument("--types", default="F16,Q8_0,Q4_0,Q4_1,Q5_0,Q5_1", help="comma-separated GGUF types")
    p.add_argument("--shapes", default="131072x4096,16384x16384", help="MxK list for T=1, 4 (large: device-bound)")
    p.add_argument("--gemm", default="4096x4096", help="MxK list for T=512")
    p.add_argument("--moe", default="64x8x8192x4096,128x8x768x2048", help="ExAxMxK list for mul_mat_id")
    p.add_argument("--mmv-warps", default=str(MMV_WARPS), help="MMV_WARPS values to try")
    p.add_argument("-n", type=int, default=10, help="calls per timing")
    p.add_argument("--copy-mb", type=int, default=1024, help="size of the bandwidth reference copy")
    a = p.parse_args(argv)
    big = cuda.device_array(a.copy_mb << 18, np.float32)
    big2 = cuda.device_array(a.copy_mb << 18, np.float32)
    ms = _time_ms(lambda i: big2.copy_to_device(big), 5)
    bw = 2 * big.nbytes / ms / 1e6
    big = big2 = None  # free the 2 GB
    print(f"device copy {bw:.0f} GB/s (read + write)")
    rng = np.random.default_rng(0)

    def weights(shape, qt):
        wf = rng.standard_normal((min(shape[-2], 4096),) + shape[-1:], dtype=np.float32)
        w = np.ascontiguousarray(quantize(wf, qt).view(np.uint8))       # tiled up: quantizing is slow
        reps = int(np.prod(shape[:-1])) // w.shape[0]
        return np.tile(w, (reps, 1)).reshape(shape[:-1] + (-1,))

    def per_call(fn, n):
        """ms per call of n back-to-back calls (device time once it exceeds the launch cost)."""
        return _time_ms(lambda i: [fn(j) for j in range(n)], 3) / n

    x1 = cuda.to_device(np.ones((1, 64), np.float32))
    o1 = cuda.device_array((1, 64), np.float32)
    w1 = cuda.to_device(weights((64, 64), 2))
    mul_mat(o1, w1, x1, 2)
    cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(100 * a.n):
        mul_mat(o1, w1, x1, 2)
    cuda.synchronize()
    print(f"host time of one mul_mat launch: {(time.perf_counter() - t0) * 1e4 / a.n:.1f} us")
    for name in a.types.split(","):
        qt = int(GGMLQuantizationType[name])
        for shape in a.shapes.split(","):
            M, K = (int(v) for v in shape.split("x"))
            dw = cuda.to_device(weights((M, K), qt))
            nbytes = dw.nbytes
            for T in (1, 4):
                x = cuda.to_device(rng.standard_normal((T, K), dtype=np.float32))
                out = cuda.device_array((T, M), np.float32)
                for warps in (int(v) for v in a.mmv_warps.split(",")):
                    MMV_WARPS = warps
                    t = per_call(lambda i: mul_mat(out, dw, x, qt), a.n)
                    gbs = nbytes / t / 1e6
                    print(f"  {name:5s} T={T} warps={warps} {M:6d}x{K:<5d} {t * 1e3:8.1f} us {gbs:6.0f} GB/s"
                          f"  ({gbs / bw:.2f} of copy)")
            dw = None
        for shape in a.gemm.split(","):
            M, K = (int(v) for v in shape.split("x"))
            dw = cuda.to_device(weights((M, K), qt))
            x = cuda.to_device(rng.standard_normal((512, K), dtype=np.float32))
            out = cuda.device_array((512, M), np.float32)
            t = per_call(lambda i: mul_mat(out, dw, x, qt), 3)
            print(f"  {name:5s} T=512 {M:6d}x{K:<5d} {t * 1e3:8.1f} us {2 * 512 * M * K / t / 1e9:6.1f} TFLOP/s")
        for case in a.moe.split(","):
            E, A, M, K = (int(v) for v in case.split("x"))
            dw = cuda.to_device(weights((E, M, K), qt))
            for T in (1, 512):
                ids = np.stack([rng.choice(E, A, replace=False) for _ in range(T)]).astype(np.int32)
                x = cuda.to_device(rng.standard_normal((T, 1, K), dtype=np.float32))
                out = cuda.device_array((T, A, M), np.float32)
                dids = cuda.to_device(ids)
                t = per_call(lambda i: mul_mat_id(out, dw, x, dids, qt), a.n if T == 1 else 3)
                gbs = len(np.unique(ids)) * dw.nbytes / E / t / 1e6
                print(f"  {name:5s} id T={T:<3d} E{E} A{A} {M}x{K} {t * 1e3:8.1f} us {gbs:6.0f} GB/s of used"
                      f" experts {2 * T * A * M * K / t / 1e9:6.1f} TFLOP/s")
            dw = None


from . import matmul_mma as _mma  # noqa: E402  (prompt products on tensor cores; imports this module)

if __name__ == "__main__":
    main()
