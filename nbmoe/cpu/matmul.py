"""Matrix products with GGUF-quantized weights on CPU: mul_mat, mul_mat_id, get_rows.

Letters: T tokens, M output features (weight rows), K input features (values per row),
E experts, A chosen experts per token, X input rows per token for mul_mat_id (1 or A),
B = K / 32 blocks per row.

Weights: C-contiguous uint8 [M, row_bytes] (or [E, M, row_bytes]), zero-copy views of the
read-only GGUF mmap, in any type of quants.TYPES (block layouts and per-type decoders in
quants.py and quants_int8.py). Activations and outputs float32, C-contiguous; ids int32.

Three paths, chosen per call by the number of tokens T sharing a weight matrix:
  matrix-vector (T < BLAS_MIN_T: generation)  a run of ITEM_ROWS rows is decoded block by
      block in registers and dotted with each token's x while in L1: weight bytes are read
      from memory once. Float dots (quants.dot_rows), or with INT8_DOT, for the block types,
      integer dots against x quantized to 8 bits (quants_int8). Parallel over runs of rows.
  batched integer product (T >= GEMM_MIN_T, the integer types with AVX-512 VNNI: prompts)
      gemm_i8: panels of 16 rows unpacked once to 8-bit codes, then vpdpbusd against 8
      tokens at a time, all in Numba's threads.
  dequantize + BLAS (T >= BLAS_MIN_T, the other types, or without VNNI)  a tile of rows is
      decoded to float32 (prange) and multiplied by numpy's matmul (OpenBLAS): the decode is
      paid once per tile, not once per token.
`mul_mat_plain` (decode a row to float32, dot it) is the plain reference all are tested
against. Kernels are built per weight type (specialize.py): the qtype and int8 arguments
must be the same for every call of a kernel from @njit code, and a cold start compiles only the
types a model has.

Repacked weights (quants_rtr, `-rtr`): Q4_0 / Q4_1 / Q8_0 / Q4_K / IQ4_NL / IQ4_XS / MXFP4
rewritten at load time into groups of 16 interleaved rows, with their own qtype ids
(R16_TYPES). Every entry point takes them: matrix-vector by quants_rtr's kernels (always
integer dots), gemm_i8 (a group is a panel) or decode for BLAS, get_rows and mul_mat_plain by
their decoders. Work items then hold whole groups
(multiples of 16 rows).

Threads: numba.set_num_threads for the kernels; OpenBLAS has its own pool, whose threads spin
after each product on the cores Numba's need (blas.py; one reason for gemm_i8).
"""
import numba
import numpy as np
from numba import njit, prange

from nbmoe import config

from . import gemm_i8
from .specialize import ConstantArgs, build, entry
from .quants import TYPES, dequant_rows, dot_rows
from .quants import Q4_1, Q5_1
from .quants_int8 import HAS_VNNI, INT8_TYPES, dot_rows_i8, prepare_blocks, quantize_x, x_extra_words
from .quants_rtr import (BASE, GROUP, R16_TYPES, block_biases, dequant_row_r16,
                         dequant_rows_r16, dot_rows_r16, level_bias)
from .quants_rtr_k import Q4_K_R16, prepare_xk
from .quants_rtr_xs import IQ4_XS_R16
from .quants_rtr_xs import prepare_xk as prepare_xk_xs
from .ops import EMPTY, _geglu_row, _swiglu_oai_row, _swiglu_row
from .work_queue import new_queue, next_item

# Tokens sharing a weight matrix from which dequantize + BLAS beats T matrix-vector passes
# (crossovers: docs/kernels.md).
BLAS_MIN_T = 10
# Float32 bytes of weights decoded per BLAS tile (decode output stays in L2/L3 for the GEMM).
TILE_BYTES = 4 << 20
# Weight rows per parallel work item: a few KB, so the rows stay in L1 while each token's x
# passes over them, and the per-item cost (an atomic refcount pair) stays small beside it.
ITEM_ROWS = 32
# With one token per weight (generation) nothing is reused from L1, so the rows are cut into
# whole rounds of the threads instead: prange hands each thread one equal run of items anyway,
# and each item costs refcounts on memory the threads share (tests raise it to run several).
VEC_ITEMS_PER_THREAD = 1
# One token times a weight smaller than this runs on the calling thread (one work item, no
# parallel region): a region's fork and join (a scheduler tick on a busy machine) costs what
# splitting ~32 KB of row dots saves. A MoE router is this small.
SERIAL_MAX_BYTES = 32 << 10
# Items per thread of a token's expert products, which share them out through work_queue (a
# thread that finishes early takes items from the slow ones' shares): finer items balance many
# threads; with few, an item's four streams need the length (docs/kernels.md).
EXPERT_ITEMS_PER_THREAD = 4
EXPERT_SPLIT_MIN_THREADS = 8


def expert_items_per_thread():
    """item_rows' per_thread for one token's expert products at the current thread count."""
    if numba.get_num_threads() >= EXPERT_SPLIT_MIN_THREADS:
        return EXPERT_ITEMS_PER_THREAD
    return VEC_ITEMS_PER_THREAD


def expert_item_rows(M, row_bytes, n_tokens, qtype=None):
    """item_rows for expert products (_mul_mat_id_vec, fused.down_combine): finer items from
    EXPERT_SPLIT_MIN_THREADS threads on, for work_queue to share out."""
    return item_rows(M, row_bytes, n_tokens, qtype, expert_items_per_thread())


# Integer dots against 8-bit x for the block types where the CPU has AVX-512 VNNI (without it
# they are no faster): ~0.5% error from x's rounding, as llama.cpp's. config.INT8_DOT off
# (NBMOE_INT8_DOT=0): exact float dots. Checked per call in Python, so tests can flip it.
INT8_DOT = HAS_VNNI and config.INT8_DOT
# Batched products of the integer-path types by gemm_i8 (Numba's threads) instead of
# dequantize + BLAS, whose pool spins against Numba's. config.GEMM_I8 off: BLAS, as without VNNI.
GEMM_I8 = HAS_VNNI and config.GEMM_I8
# Tokens sharing a weight matrix from which gemm_i8 beats T integer matrix-vector passes.
GEMM_MIN_T = 6
# ... but the matrix-vector pass prepares every row of x, serially: past this many rows
# gemm_i8 also takes the experts of fewer pairs, padded to its 8-slot groups.
VEC_FEW_MAX_ROWS = 128


def is_supported(qtype):
    return int(qtype) in TYPES or int(qtype) in BASE


def row_size(qtype, K):
    """Bytes of one row of K values of type qtype."""
    block, size = TYPES[BASE.get(int(qtype), int(qtype))]
    return K // block * size


def row_values(qtype, row_bytes):
    """Values K in one row of row_bytes bytes of type qtype."""
    block, size = TYPES[BASE.get(int(qtype), int(qtype))]
    return row_bytes // size * block


_INT8_SET = frozenset(INT8_TYPES)


def _int8(qtype):
    """Integer dots: the block types with INT8_DOT on; repacked weights always."""
    return qtype in BASE or (INT8_DOT and qtype in _INT8_SET)


def batched_int8(qtype):
    """Whether T >= GEMM_MIN_T tokens take gemm_i8 (else matrix-vector, from BLAS_MIN_T
    dequantize + BLAS)."""
    return GEMM_I8 and _int8(int(qtype))


def int8_path(qtype, n_tokens):
    """Whether a product of n_tokens sharing one weight matrix takes integer dots."""
    if n_tokens >= GEMM_MIN_T and batched_int8(qtype):
        return True
    return n_tokens < BLAS_MIN_T and _int8(int(qtype))


# ---------------------------------------------------------------- per-token x extras
# x [N, K] -> the float path's block sums xsum [N, B] (they carry the block offsets m, -8 d),
# or the int8 path's quantized x: xq [N, K], scales xd [N, B], xs [N, B] (quants_int8), and
# the type's extras xb [N, x_extra_words] int32 (Q5_0 / Q8_0: lane biases; Q4_0: quants_q4x's
# record; IQ4_*, MXFP4: x rearranged), for Q4_1 / Q5_1 the (xd, xs) pairs xds [N, 2B]
# (quants_int8.prepare_blocks), for repacked Q4_0 / Q8_0 xb followed by block biases [N, B]
# (IQ4_*, MXFP4: quants_rtr.block_biases), for repacked Q4_K / IQ4_XS xds the x scales of
# quants_rtr_k / quants_rtr_xs.prepare_xk.
# The unused ones are empty.

def _x_buffers_kernel(int8, qtype):
    """The arrays _prepare_x fills for N rows of K (the unused ones empty)."""
    repacked = qtype in R16_TYPES
    qt = BASE.get(qtype, qtype)
    scales = int8 and (qt == Q4_1 or qt == Q5_1 or qtype == Q4_K_R16 or qtype == IQ4_XS_R16)

    @njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
    def x_buffers(N, K):
        B = K // 32
        xsum = np.zeros((N, 0 if int8 else B), np.float32)
        xq = np.empty((N, K if int8 else 0), np.int8)
        xd = np.empty((N, B if int8 else 0), np.float32)
        xs = np.empty((N, B if int8 else 0), np.float32)
        nb = x_extra_words(qt, K) + (B if repacked else 0) if int8 else 0
        xb = np.empty((N, nb), np.int32)
        xds = np.empty((N, 2 * B if scales else 0), np.float32)
        return xsum, (xq, xd, xs, xb, xds)
    return x_buffers


_x_buffers = entry(_x_buffers_kernel, "N, K, int8, qtype")


def _prepare_x_row_kernel(int8, qtype):
    """Row n of x into the arrays of _x_buffers (xsum zeroed there)."""
    # the type's facts as closure constants, so that Numba prunes the other types' branches
    repacked = qtype in R16_TYPES
    qt = BASE.get(qtype, qtype)

    @njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
    def prepare_x_row(x, n, xsum, xi):
        xq, xd, xs, xb, xds = xi
        if int8:
            nb = xb.shape[1]
            quantize_x(xq[n], xd[n], xs[n], x[n])
            prepare_blocks(xb[n], xds[n], xq[n], xd[n], xs[n], qt)
            if qtype == Q4_K_R16:
                prepare_xk(xds[n], xd[n], xs[n])
            elif qtype == IQ4_XS_R16:
                prepare_xk_xs(xds[n], xd[n])
            if repacked and level_bias(qt):      # IQ4_*, MXFP4: after the plain kernel's record
                B = x.shape[1] // 32
                block_biases(xb[n, nb - B:], xq[n], level_bias(qt))
        else:
            for b in range(x.shape[1] // 32):
                for i in range(32):
                    xsum[n, b] += x[n, b * 32 + i]
    return prepare_x_row


_prepare_x_row = entry(_prepare_x_row_kernel, "x, n, xsum, xi, int8, qtype")


def _prepare_x_kernel(int8, qtype):
    @njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
    def prepare_x(x):
        xsum, xi = _x_buffers(x.shape[0], x.shape[1], int8, qtype)
        for n in range(x.shape[0]):
            _prepare_x_row(x, n, xsum, xi, int8, qtype)
        return xsum, xi
    return prepare_x


_prepare_x = entry(_prepare_x_kernel, "x, int8, qtype")


@njit(cache=True, error_model="numpy", inline="always")
def _dot_rows(qtype, out, w, x, n, xsum, xi, int8):
    """out [R] <- dequant(w [R, row_bytes]) @ x[n], by the path _prepare_x prepared for."""
    if qtype in R16_TYPES:
        xq, xd, xs, xb, xds = xi
        dot_rows_r16(qtype, out, w, xq[n], xd[n], xs[n], xb[n], xds[n])
    elif int8:
        xq, xd, xs, xb, xds = xi
        dot_rows_i8(qtype, out, w, xq[n], xd[n], xs[n], xb[n], xds[n])
    else:
        dot_rows(qtype, out, w, x[n], xsum[n])


@njit(cache=True, error_model="numpy", inline="always")
def _decode_rows(qtype, out, w):
    """out [R, K] f32 <- w [R, row_bytes] (repacked: w's first row starts a group)."""
    if qtype in R16_TYPES:
        dequant_rows_r16(qtype, out, w)
    else:
        dequant_rows(qtype, out, w)


@njit(cache=True, error_model="numpy", inline="always")
def _decode_row(qtype, out, w, r):
    """out [1, K] f32 <- row r of the whole matrix w [M, row_bytes]."""
    if qtype in R16_TYPES:
        dequant_row_r16(qtype, out[0], w, r)
    else:
        dequant_rows(qtype, out, w[r:r + 1])


# ---------------------------------------------------------------- mul_mat, plain loops
# out[T, M] = x[T, K] @ dequant(w[M, row_bytes])^T. Decode row r to float32, dot it with
# every token. The reference for the fast paths. Parallel over rows.

@njit(parallel=True, cache=True, error_model="numpy")
def mul_mat_plain(out, w, x, qtype):
    T, K = x.shape
    for r in prange(w.shape[0]):
        v = np.empty((1, K), np.float32)
        _decode_row(qtype, v, w, r)
        for t in range(T):
            s = np.float32(0)
            for k in range(K):
                s += v[0, k] * x[t, k]
            out[t, r] = s


# ---------------------------------------------------------------- mul_mat, matrix-vector
# out[T, M] = x[T, K] @ dequant(w[M, row_bytes])^T for T < BLAS_MIN_T. Work item = a run of
# ITEM_ROWS rows, dotted with x[0], x[1], ... in turn while in L1 (T = 1: whole rounds of
# the threads). Parallel over runs.

def item_rows(M, row_bytes, n_tokens, qtype=None, per_thread=None):
    """Rows per work item: ITEM_ROWS, or for one token an even count that makes the items
    whole rounds of the threads (`per_thread` items each, VEC_ITEMS_PER_THREAD if None;
    repacked: whole groups), or all M rows below SERIAL_MAX_BYTES (one item: mat_vec runs it
    on the calling thread)."""
    unit = GROUP if qtype in BASE else 2
    if n_tokens > 1:
        return ITEM_ROWS            # a multiple of GROUP
    if M * row_bytes < SERIAL_MAX_BYTES:
        return M                    # one item: mat_vec runs it without a parallel region
    n = numba.get_num_threads() * (per_thread or VEC_ITEMS_PER_THREAD)
    rows = (M + n - 1) // n
    return max(unit, (rows + unit - 1) // unit * unit)


# One parallel kernel for one weight and for fused.products' two or three (outs[j] = x @ W_j^T
# [+ biases[j]]; outs, ws, biases tuples of 3, n_rows [3] the rows of each, 0 for an unused
# slot; a bias of size 0 is none): each kernel that holds the type dispatch (_dot_rows) costs
# tens of seconds of LLVM at a cold start, so one weight goes through this kernel too (mat_vec)
# rather than a twin of its own. The bias is added to the finished row as ops.add_bias adds it.
# Biases are writeable float32 arrays (NO_BIAS, or a copy of the file's vector): the type that
# np.empty(0, np.float32) has inside a kernel, so mat_vec's calls link the same compile.
NO_BIAS = np.zeros(0, np.float32)


def _products_kernel(qtype, int8):
    @njit(parallel=True, cache=True, error_model="numpy", pipeline_class=ConstantArgs)
    def products(outs, ws, x, step, n_rows, biases):
        xsum, xi = _prepare_x(x, int8, qtype)
        n0 = (n_rows[0] + step - 1) // step
        n1 = (n_rows[1] + step - 1) // step
        n2 = (n_rows[2] + step - 1) // step
        for item in prange(n0 + n1 + n2):
            j = 0 if item < n0 else (1 if item < n0 + n1 else 2)
            i = item - (0 if j == 0 else (n0 if j == 1 else n0 + n1))
            w, out, b = ws[j], outs[j], biases[j]
            r0, r1 = i * step, min(n_rows[j], (i + 1) * step)
            for t in range(x.shape[0]):
                o = out[t, r0:r1]
                _dot_rows(qtype, o, w[r0:r1], x, t, xsum, xi, int8)
                if b.shape[0] > 0:
                    for r in range(r1 - r0):
                        o[r] += b[r0 + r]
    return products


_products = entry(_products_kernel, "outs, ws, x, qtype, int8, step, n_rows, biases")
_NO_BIASES = (NO_BIAS,) * 3


@njit(cache=True, error_model="numpy")
def _one_weight(M):
    """n_rows for _products with one weight (in slot 0)."""
    rows = np.zeros(3, np.int64)
    rows[0] = M
    return rows


def _mul_mat_vec_seq_kernel(qtype, int8):
    """mat_vec's product as one work item on the calling thread."""
    @njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
    def mul_mat_vec_seq(out, w, x):
        xsum, xi = _prepare_x(x, int8, qtype)
        for t in range(x.shape[0]):
            _dot_rows(qtype, out[t], w, x, t, xsum, xi, int8)
    return mul_mat_vec_seq


_mul_mat_vec_seq = entry(_mul_mat_vec_seq_kernel, "out, w, x, qtype, int8")


def _mat_vec_kernel(qtype, int8):
    """out [T, M] = x @ dequant(w)^T in work items of `step` rows, in parallel; a weight
    that is one work item (item_rows) without a parallel region."""
    @njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
    def mat_vec(out, w, x, step):
        if step >= w.shape[0]:
            _mul_mat_vec_seq(out, w, x, qtype, int8)
        else:
            nb = np.empty(0, np.float32)
            _products((out, out, out), (w, w, w), x, qtype, int8, step, _one_weight(w.shape[0]),
                      (nb, nb, nb))
    return mat_vec


mat_vec = entry(_mat_vec_kernel, "out, w, x, qtype, int8, step")


# ---------------------------------------------------------------- dequantize rows
# out[R, K] f32 = dequant(w[R, row_bytes]), parallel over runs of ITEM_ROWS rows: the BLAS
# path's tile decoder and dequantize(). get_rows: out[t] = dequant(w[ids[t]]), one t at a time.

def _dequant_rows_kernel(qtype):
    @njit(parallel=True, cache=True, error_model="numpy", pipeline_class=ConstantArgs)
    def dequant_rows(out, w):
        M = w.shape[0]
        for item in prange((M + ITEM_ROWS - 1) // ITEM_ROWS):
            r0, r1 = item * ITEM_ROWS, min(M, (item + 1) * ITEM_ROWS)
            _decode_rows(qtype, out[r0:r1], w[r0:r1])
    return dequant_rows


_dequant_rows = entry(_dequant_rows_kernel, "out, w, qtype")


def _get_rows_kernel(qtype):
    # serial: a prompt's rows decode in a sliver of its time, a generated token's row in less
    # than a parallel region's fork and join; and it compiles faster
    @njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
    def get_rows(out, w, ids):
        for t in range(ids.shape[0]):
            _decode_row(qtype, out[t:t + 1], w, ids[t])
    return get_rows


_get_rows = entry(_get_rows_kernel, "out, w, ids, qtype")


def _mul_mat_blas(out, w, x, qtype):
    """out [T, M] = x @ dequant(w)^T, a tile of rows at a time: decode (Numba), matmul (BLAS)."""
    M, K = w.shape[0], x.shape[1]
    rows = max(16, TILE_BYTES // (4 * K) // 16 * 16)     # whole groups of repacked rows
    if rows >= M:  # one tile: BLAS writes straight into out
        tile = np.empty((M, K), np.float32)
        _dequant_rows(tile, w, qtype)
        np.matmul(x, tile.T, out=out)
        return
    tile = np.empty((rows, K), np.float32)
    for r0 in range(0, M, rows):
        r1 = min(M, r0 + rows)
        _dequant_rows(tile[:r1 - r0], w[r0:r1], qtype)
        out[:, r0:r1] = x @ tile[:r1 - r0].T


def _mat_vec_step(out, w, x, qtype):
    """mat_vec(out, w, x, ...) as a call of the one of its two kernels that the work items
    need (a cold start compiles that one alone)."""
    qtype = int(qtype)
    int8, step = _int8(qtype), item_rows(w.shape[0], w.shape[1], x.shape[0], qtype)
    if step >= w.shape[0]:
        seq = build(_mul_mat_vec_seq_kernel, (qtype, int8))
        return lambda: seq(out, w, x)
    products, outs, ws, rows = build(_products_kernel, (qtype, int8)), (out,) * 3, (w,) * 3, _one_weight(w.shape[0])
    return lambda: products(outs, ws, x, step, rows, _NO_BIASES)


def mul_mat(out, w, x, qtype):
    """out [T, M] f32 = x [T, K] f32 @ dequant(w [M, row_bytes])^T."""
    if x.shape[0] >= GEMM_MIN_T and batched_int8(qtype):
        gemm_i8.mul_mat(out, w, x, qtype)
    elif x.shape[0] < BLAS_MIN_T:
        _mat_vec_step(out, w, x, qtype)()
    else:
        _mul_mat_blas(out, w, x, qtype)


def mul_mat_step(out, w, x, qtype):
    """mul_mat(out, w, x, qtype) as a plan's step: for one token the path and the work items
    are chosen once, at binding (as the fused groups' are): less Python per call."""
    if x.shape[0] == 1:
        step_fn = _mat_vec_step(out, w, x, qtype)
        step_fn.regions = int(item_rows(w.shape[0], w.shape[1], 1, qtype) < w.shape[0])    # (tools/tg_overhead.py)
        return step_fn
    return lambda: mul_mat(out, w, x, qtype)


# ---------------------------------------------------------------- mul_mat_id
# out[t, a] = dequant(w[ids[t, a]]) @ x[t, a if X == A else 0]   w [E, M, row_bytes],
# x [T, X, K], ids [T, A], out [T, A, M].
# Grouped by expert: the (t, a) pairs are counting-sorted by expert, so each chosen expert's
# rows are streamed once per call and dotted with all its tokens while in L1; experts nobody
# chose are never touched. Work item = (chosen expert, run of `step` rows), shared out over
# n_workers (numba.get_num_threads()) by work_queue.
# Experts chosen by >= blas_min pairs are left out here: the caller runs them through gemm_i8
# (>= GEMM_MIN_T pairs) or BLAS (>= BLAS_MIN_T).

@njit(cache=True, error_model="numpy")
def _group_by_expert(ids, E):
    """order [T*A] of flat pair indices t*A + a sorted by expert; start [E + 1] offsets."""
    flat = ids.ravel()
    start = np.zeros(E + 1, np.int64)
    for p in range(flat.shape[0]):
        start[flat[p] + 1] += 1
    for e in range(E):
        start[e + 1] += start[e]
    fill = start[:E].copy()
    order = np.empty(flat.shape[0], np.int64)
    for p in range(flat.shape[0]):
        e = flat[p]
        order[fill[e]] = p
        fill[e] += 1
    return order, start


# act: ACT_NONE the products alone; ACT_SILU / ACT_GELU / ACT_SWIGLU_OAI (fused.glu_id): w
# holds the gate rows, wu the up rows from row up0 of each expert's matrix (0; a merged
# ffn_gate_up_exps, -muge: wu is w, up0 = F), and an item computes both row runs of a pair,
# adds the chosen expert's gate / up bias rows (bg, bu flat [E * rows an expert], the up's
# from up0 too; size 0: none; gpt-oss), then the GLU into out [T, A, F].
ACT_NONE, ACT_SILU, ACT_GELU, ACT_SWIGLU_OAI = -1, 0, 1, 2


@njit(cache=True, error_model="numpy", inline="always")
def _add_bias_rows(y, b, i0):
    """y [R] += b[i0:i0 + R] (an expert's bias rows, as ops.add_bias_id adds them)."""
    for i in range(y.shape[0]):
        y[i] += b[i0 + i]


@njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
def _glu_rows(out, g, u, act):
    if act == ACT_SILU:
        _swiglu_row(out, g, u)
    elif act == ACT_GELU:
        _geglu_row(out, g, u)
    else:
        _swiglu_oai_row(out, g, u)


def _mul_mat_id_vec_kernel(qtype, int8):
    @njit(parallel=True, cache=True, error_model="numpy", pipeline_class=ConstantArgs)
    def mul_mat_id_vec(out, w, x, ids, blas_min, step, wu, up0, act, bg, bu, n_workers):
        E, M = w.shape[0], out.shape[2]
        T, X, K = x.shape
        A = ids.shape[1]
        order, start = _group_by_expert(ids, E)
        xf = x.reshape(T * X, K)                                  # row n = t * X + x-index
        xsum, xi = _prepare_x(xf, int8, qtype)
        n_used = 0
        used = np.empty(E, np.int64)
        for e in range(E):
            if 0 < start[e + 1] - start[e] < blas_min:
                used[n_used] = e
                n_used += 1
        n_runs = (M + step - 1) // step
        queue = new_queue(n_used * n_runs, n_workers)
        for worker in prange(n_workers):
            item = next_item(queue, worker)
            while item >= 0:
                e = used[item // n_runs]
                r0 = item % n_runs * step
                _expert_rows(qtype, out, w, xf, xsum, xi, int8, order, start, A, X, e, r0,
                             min(M, r0 + step), wu, up0, act, bg, bu)
                item = next_item(queue, worker)
    return mul_mat_id_vec


@njit(cache=True, error_model="numpy", inline="always")
def _expert_rows(qtype, out, w, xf, xsum, xi, int8, order, start, A, X, e, r0, r1, wu, up0, act,
                 bg, bu):
    """mul_mat_id_vec's item: rows r0:r1 of expert e for each of its pairs (start, order:
    _group_by_expert's), into out [T, A, M] (act ACT_NONE) or their GLU."""
    E = w.shape[0]
    sg, su = bg.shape[0] // E, bu.shape[0] // E       # bias values an expert (0: none)
    g = np.empty(r1 - r0 if act != ACT_NONE else 0, np.float32)
    u = np.empty(r1 - r0 if act != ACT_NONE else 0, np.float32)
    for p in range(start[e], start[e + 1]):
        t, a = order[p] // A, order[p] % A
        n = t * X + (a if X == A else 0)
        o = out[t, a, r0:r1]
        _dot_rows(qtype, o if act == ACT_NONE else g, w[e, r0:r1], xf, n, xsum, xi, int8)
        if act != ACT_NONE:
            _dot_rows(qtype, u, wu[e, up0 + r0:up0 + r1], xf, n, xsum, xi, int8)
            if sg > 0:
                _add_bias_rows(g, bg, e * sg + r0)
            if su > 0:
                _add_bias_rows(u, bu, e * su + up0 + r0)
            _glu_rows(o, g, u, act)


_mul_mat_id_vec = entry(_mul_mat_id_vec_kernel,
                        "out, w, x, ids, qtype, blas_min, int8, step, wu, up0, act, bg, bu, n_workers")


def mul_mat_id(out, w, x, ids, qtype):
    """out [T, A, M] = per-token expert products; see the comment above _mul_mat_id_vec."""
    gemm = batched_int8(qtype)
    many = GEMM_MIN_T if gemm else BLAS_MIN_T   # pairs an expert needs to leave matrix-vector
    if ids.shape[0] < many:  # generation: every chosen expert by matrix-vector
        step = expert_item_rows(w.shape[1], w.shape[2], ids.shape[0], qtype)
        _mul_mat_id_vec(out, w, x, ids, int(qtype), ids.size + 1, _int8(qtype), step, w, 0, ACT_NONE,
                        EMPTY, EMPTY, numba.get_num_threads())
        return
    T, X, K = x.shape
    A = ids.shape[1]
    order, start = _group_by_expert(ids, w.shape[0])
    counts = np.diff(start)
    if gemm and T * X > VEC_FEW_MAX_ROWS:
        many = 1                                   # gemm_i8 takes the experts of few tokens too
    if ((counts > 0) & (counts < many)).any():     # experts of few tokens (it prepares all of x)
        _mul_mat_id_vec(out, w, x, ids, qtype, many, _int8(qtype), ITEM_ROWS, w, 0, ACT_NONE,
                        EMPTY, EMPTY, numba.get_num_threads())
    if gemm:
        gemm_i8.mul_mat_id(out, w, x, ids, qtype, order, start, many)
        return
    for e in np.flatnonzero(counts >= BLAS_MIN_T):
        pairs = order[start[e]:start[e + 1]]
        t, a = pairs // A, pairs % A
        xe = x[t, a if X == A else 0]                                  # [n, K]
        ye = np.empty((pairs.shape[0], w.shape[1]), np.float32)        # [n, M]
        _mul_mat_blas(ye, w[e], xe, qtype)
        out[t, a] = ye


# ---------------------------------------------------------------- get_rows, dequantize

def get_rows(out, w, ids, qtype):
    """out [T, K] = dequant(w[ids[t]]) (embedding lookup); ids int32 [T]."""
    _get_rows(out, w, ids, qtype)


def dequantize(w, qtype):
    """w [..., row_bytes] -> float32 [..., K]."""
    K = row_values(qtype, w.shape[-1])
    if int(qtype) in BASE and w.ndim > 2:     # repacked: groups restart in every matrix
        mats = w.reshape((-1,) + w.shape[-2:])
        return np.stack([dequantize(m, qtype) for m in mats]).reshape(w.shape[:-1] + (K,))
    rows = w.reshape(-1, w.shape[-1])
    out = np.empty((rows.shape[0], K), np.float32)
    _dequant_rows(out, rows, int(qtype))
    return out.reshape(w.shape[:-1] + (K,))

from nbmoe.cpu.windows import mul_mat_heads  # noqa: E402,F401  (MLA's k_b, v_b: column windows)

# The benchmark of these kernels is tools/bench_kernels.py.
