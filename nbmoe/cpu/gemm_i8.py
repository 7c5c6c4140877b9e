"""Batched integer products (prompts): out[T, M] = x[T, K] @ dequant(w[M, row_bytes])^T with
x quantized to 8 bits and the weights' integer codes, AVX-512 VNNI `vpdpbusd`, in Numba's
thread pool (no BLAS). matmul uses it for T >= GEMM_MIN_T tokens sharing a weight matrix.

Letters as in matmul.py: T tokens, M rows, K values per row, B = K / 32 x-blocks, E experts;
NT = 8 tokens of a group (accumulators in registers), G = 32 or 16 values per weight scale,
n = 32 / G weight groups per x-block.

x (prepare_x, once per call): each token (a "slot"; mul_mat_id: a (token, expert) pair) is
quantized as quantize_x does (xq int8, xd per 32 values; 16 x-blocks at a time in IR), and
laid out per group of NT slots as B records (XW words), one per x-block j:
    xq [NT][32] int8 | xd [NT] f32 | xb [n][NT] int32 = -128 * (sum of xq over G) |
    xs [n][NT] f32 = xd * (sum of xq over G)
Weights (gemm_unpack, once per work item): a panel of 16 rows of one matrix (zeros past M)
as 8-bit codes c + 128 (c the signed integer code, value = s * c + o), B records (PW words):
    codes [8][16][4] u8 | s [n][16] f32 | o [n][16] f32 (o: zeros unless the type has offsets)
    codes of record j, one 512-bit vector k per 4 values (as quants_rtr):
        byte  0  1  2  3 | 4  5  6  7 | ... | 60 61 62 63
        row   0  0  0  0 | 1  1  1  1 | ... | 15 15 15 15
        value 32j+4k .. +3 (the same 4 values of every row)
Records keep every load of the inner loop at a constant offset from two pointers (x record,
panel record): base + displacement addresses are one fused uop each, indexed ones two. What
bounds it: the two 512-bit ports, 64 vpdpbusd + 24-32 float ops an x-block.
Equation, for slot t, row r, weight group g (G values) in x-block j:
    out[t, r] = sum_j xd[t, j] * sum_(g in j) s[g, r] * dot_g  +  sum_g o[g, r] * xs[t, g]
    dot_g = xb[t, g] + sum_(k in g) (c[k, r] + 128) * xq[t, k]      (exact in int32)
dot_g is one vpdpbusd chain (u8 codes x the broadcast 4 x codes of the slot) of G / 4 steps
started at xb; then per slot float(dot) * s (* xd) into 16 float lanes (= the 16 rows).
Per call of acc_block: one x-block j for the NT slots of a group: 8 vpdpbusd a slot (k outer:
8 independent chains), the 8 weight vectors loaded once. Loop order: panel outer (unpacked
once, L1/L2), slot groups, x-blocks. Parallel over (job, panel) work items; a job = one
matrix and a run of slot groups. The items are shared out by work_queue: an expert's cost is
its token count, and prange's static split left threads idle behind the busiest share
(numba.parallel_chunksize does not change how the omp and workqueue layers assign iterations).
"""
import numba
import numpy as np
from llvmlite import ir
from numba import carray, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .gemm_unpack import HAS_M, PER16, panel_words, record_words, unpack
from .quants import f32, stack_f32
from .quants_int8 import _dot4_init
from .simd import F32, I8, I32, I64, vec
from .specialize import ConstantArgs, entry
from .work_queue import new_queue, next_item

NT = 8          # slots per group
ROWS = 16       # rows per panel
u64 = np.uint64

_stack_acc = stack_f32(NT * ROWS)


def x_record(G):
    """uint32 words of an x record (see the top)."""
    return 8 * NT + NT + 2 * NT * (32 // G)


x_words = njit(inline="always")(x_record)


# ---------------------------------------------------------------- the micro-kernel (IR)

def _emit_block(context, b, sig, args, G, has_m):
    """acc[t, 0:16] += slot t's dot of x-block j with the panel's 16 rows, t < NT."""
    _, _, acc, P, X, j = args
    n = 32 // G                                      # weight groups in the x-block

    def c(v):
        return ir.Constant(I64, v)

    def rec(i, words):                               # record j of array argument i, as i32*
        data = context.make_array(sig.args[i])(context, b, args[i]).data
        return b.bitcast(b.gep(b.bitcast(data, I32.as_pointer()), [b.mul(j, c(words))]), I32.as_pointer())

    def at(ptr, word, ty):
        return b.load(b.bitcast(b.gep(ptr, [c(word)]), ty.as_pointer()), align=4)

    def splat(v):
        one = b.insert_element(ir.Constant(vec(v.type, 16), None), v, ir.Constant(I32, 0))
        return b.shuffle_vector(one, one, ir.Constant(vec(I32, 16), None))

    v16i, v16f, v64b = vec(I32, 16), vec(F32, 16), vec(I8, 64)
    j = b.sext(j, I64) if j.type != I64 else j
    p, x = rec(3, record_words(G)), rec(4, x_record(G))
    W = [at(p, 16 * k, v16i) for k in range(8)]
    s = [at(p, 128 + 16 * g, v16f) for g in range(n)]
    o = [at(p, 128 + 16 * (n + g), v16f) for g in range(n)] if has_m else []
    XD, XB, XS = 8 * NT, 9 * NT, 9 * NT + n * NT    # word offsets in the x record
    # int32 chains: slot t, group g; k outer so that the NT independent chains interleave
    dots = [[splat(at(x, XB + g * NT + t, I32)) for g in range(n)] for t in range(NT)]
    for k in range(8):
        g = k * 4 // G
        for t in range(NT):
            x4 = b.bitcast(splat(at(x, 8 * t + k, I32)), v64b)
            dots[t][g] = _dot4_init(b, dots[t][g], b.bitcast(W[k], v64b), x4)
    ap = b.bitcast(context.make_array(sig.args[2])(context, b, acc).data, v16f.as_pointer())
    for t in range(NT):
        f = b.fmul(b.sitofp(dots[t][0], v16f), s[0], flags=("contract",))
        if n == 2:
            f = b.fadd(f, b.fmul(b.sitofp(dots[t][1], v16f), s[1], flags=("contract",)), flags=("contract",))
        pt = b.gep(ap, [c(t)])
        a = b.fadd(b.load(pt, align=4), b.fmul(f, splat(at(x, XD + t, F32)), flags=("contract",)),
                   flags=("contract",))
        for g in range(len(o)):
            a = b.fadd(a, b.fmul(o[g], splat(at(x, XS + g * NT + t, F32)), flags=("contract",)), flags=("contract",))
        b.store(a, pt, align=4)


@intrinsic
def acc_block(typingctx, G, has_m, acc, P, X, j):
    """acc [NT * 16] += x-block j of a slot group (X: its x records, uint32) dotted with the
    panel (P: its records, uint32); G (32 or 16) and has_m compile-time constants."""
    if not (isinstance(G, types.IntegerLiteral) and isinstance(has_m, types.BooleanLiteral)):
        return None

    def codegen(context, builder, sig, args):
        _emit_block(context, builder, sig, args, G.literal_value, has_m.literal_value)
        return context.get_dummy_value()
    return types.void(G, has_m, acc, P, X, j), codegen


@intrinsic
def store_lanes(typingctx, out, o, acc, t, n):
    """out[o:o + n] = acc[16 t:16 t + n], n <= 16, as one masked vector store (element reads of
    acc would make LLVM take its registers apart lane by lane)."""
    def codegen(context, b, sig, args):
        out, o, acc, t, n = args
        v16f = vec(F32, 16)
        src = b.gep(b.bitcast(context.make_array(sig.args[2])(context, b, acc).data, v16f.as_pointer()), [t])
        dst = b.bitcast(b.gep(context.make_array(sig.args[0])(context, b, out).data, [o]), v16f.as_pointer())
        n32 = b.trunc(n, I32)
        one = b.insert_element(ir.Constant(vec(I32, 16), None), n32, ir.Constant(I32, 0))
        mask = b.icmp_signed("<", ir.Constant(vec(I32, 16), list(range(16))),
                             b.shuffle_vector(one, one, ir.Constant(vec(I32, 16), None)))
        fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(ir.VoidType(), [
            v16f, v16f.as_pointer(), I32, vec(ir.IntType(1), 16)]), "llvm.masked.store.v16f32.p0")
        b.call(fn, [b.load(src, align=4), dst, ir.Constant(I32, 4), mask])
        return context.get_dummy_value()
    return types.void(out, o, acc, t, n), codegen


# ---------------------------------------------------------------- x, once per call

@intrinsic
def _round32(typingctx, xq, o, x, xo, inv):
    """xq[o:o + 32] = rint(x[xo:xo + 32] * inv) as int8 (as quantize_x, in vectors); returns
    the sums of the first and the last 16 codes."""
    def codegen(context, b, sig, args):
        q_, o, x_, xo, inv = args
        xv = b.load(b.bitcast(b.gep(context.make_array(sig.args[2])(context, b, x_).data, [xo]),
                              vec(F32, 32).as_pointer()), align=4)
        one = b.insert_element(ir.Constant(vec(F32, 32), None), inv, ir.Constant(I32, 0))
        scaled = b.fmul(xv, b.shuffle_vector(one, one, ir.Constant(vec(I32, 32), None)))
        rint = cgutils.get_or_insert_function(b.module, ir.FunctionType(vec(F32, 32), [vec(F32, 32)]),
                                              "llvm.rint.v32f32")
        q = b.fptosi(b.call(rint, [scaled]), vec(I32, 32))
        qp = b.gep(context.make_array(sig.args[0])(context, b, q_).data, [o])
        b.store(b.trunc(q, vec(ir.IntType(8), 32)), b.bitcast(qp, vec(ir.IntType(8), 32).as_pointer()), align=1)
        red = cgutils.get_or_insert_function(b.module, ir.FunctionType(I32, [vec(I32, 16)]),
                                             "llvm.vector.reduce.add.v16i32")
        halves = [b.call(red, [b.shuffle_vector(q, q, ir.Constant(vec(I32, 16), list(range(h, h + 16))))])
                  for h in (0, 16)]
        return context.make_tuple(b, sig.return_type, halves)
    return types.UniTuple(types.int32, 2)(xq, o, x, xo, inv), codegen


@njit(inline="always")
def _quantize_block(xi, xq, xf, x, bits, j, t, G):
    """x-block j of slot t (x: the slot's row, bits: the same as uint32) into record j of its
    group (as int32 xi, int8 xq, float32 xf), as quantize_x: amax as the largest |x| bit
    pattern (a NaN is larger than any number: it sticks, as in quantize_x)."""
    amax = u64(0)
    for i in range(32):
        a = u64(bits[u64(32 * j + i)] & np.uint32(0x7FFFFFFF))
        amax = a if a > amax else amax
    d = np.uint32(amax).view(np.float32) / f32(127)
    inv = f32(1) / d if d > 0 else f32(0)
    r = j * x_words(G)
    s0, s1 = _round32(xq, 4 * r + 32 * t, x, 32 * j, inv)
    xf[r + 8 * NT + t] = d
    xb, xs = r + 9 * NT + t, r + 9 * NT + (32 // G) * NT + t
    if G == 32:
        xi[xb], xf[xs] = -128 * (s0 + s1), d * f32(s0 + s1)
    else:
        xi[xb], xf[xs] = -128 * s0, d * f32(s0)
        xi[xb + NT], xf[xs + NT] = -128 * s1, d * f32(s1)


def _hreduce16(b, vs, op):
    """<16 x T>: lane j = op-reduction of the 16 lanes of vs[j] (16 vectors), by halving: each
    step pairs vectors, keeps half of each one's partial results side by side, and applies op
    (15 steps of 2 shuffles + op, instead of a 5-step tree per vector)."""
    width = 16
    while len(vs) > 1:
        h = width // 2                                  # lanes per block after this step
        lo, hi = [], []
        for blk in range(16 // width):                  # each input holds 16 / width blocks
            lo += [blk * width + i for i in range(h)]
            hi += [blk * width + h + i for i in range(h)]
        out = []
        for a, c in zip(vs[0::2], vs[1::2]):
            pick = lambda idx: b.shuffle_vector(a, c, ir.Constant(vec(I32, 16), idx + [16 + i for i in idx]))
            out.append(op(pick(lo), pick(hi)))
        vs, width = out, h
    return vs[0]


@intrinsic
def _quantize16(typingctx, X, x, j0, t, G):
    """x-blocks j0..j0 + 15 of slot t (x: its row) into records j0.. of a group (X, uint32),
    as _quantize_block does one: per-block maxima, scales and sums 16 at a time."""
    if not isinstance(G, types.IntegerLiteral):
        return None
    g = G.literal_value
    XW, n = x_record(g), 32 // g

    def codegen(context, b, sig, args):
        X_, x_, j0, t, _ = args
        v16i, v16f = vec(I32, 16), vec(F32, 16)

        def c(v):
            return ir.Constant(I64, v)
        xp = b.gep(context.make_array(sig.args[1])(context, b, x_).data, [b.mul(j0, c(32))])
        v = [b.load(b.bitcast(b.gep(xp, [c(16 * i)]), v16f.as_pointer()), align=4) for i in range(32)]
        mask = ir.Constant(v16i, [0x7FFFFFFF] * 16)
        absb = [b.and_(b.bitcast(u, v16i), mask) for u in v]
        umax = lambda p, q: b.select(b.icmp_unsigned(">", p, q), p, q)
        amax = _hreduce16(b, [umax(absb[2 * j], absb[2 * j + 1]) for j in range(16)], umax)
        d = b.fdiv(b.bitcast(amax, v16f), ir.Constant(v16f, [127.0] * 16))
        inv = b.select(b.fcmp_ordered(">", d, ir.Constant(v16f, None)),
                       b.fdiv(ir.Constant(v16f, [1.0] * 16), d), ir.Constant(v16f, None))
        rint = cgutils.get_or_insert_function(b.module, ir.FunctionType(v16f, [v16f]), "llvm.rint.v16f32")
        words = b.bitcast(context.make_array(sig.args[0])(context, b, X_).data, I32.as_pointer())
        rec = b.gep(words, [b.add(b.mul(j0, c(XW)), t)])            # word t of record j0
        codes = b.gep(b.bitcast(b.gep(words, [b.mul(j0, c(XW))]), I8.as_pointer()), [b.mul(t, c(32))])
        halves = ([], [])
        for j in range(16):
            s = b.shuffle_vector(inv, inv, ir.Constant(vec(I32, 16), [j] * 16))
            for h in range(2):
                q = b.fptosi(b.call(rint, [b.fmul(v[2 * j + h], s)]), v16i)
                halves[h].append(q)
                dst = b.gep(codes, [c(4 * XW * j + 16 * h)])
                b.store(b.trunc(q, vec(I8, 16)), b.bitcast(dst, vec(I8, 16).as_pointer()), align=1)
        s0, s1 = (_hreduce16(b, hs, b.add) for hs in halves)
        sums = [b.add(s0, s1)] if n == 1 else [s0, s1]
        fields = [(8 * NT, d)]
        for i, sm in enumerate(sums):
            fields.append((9 * NT + i * NT, b.mul(sm, ir.Constant(v16i, [-128] * 16))))
            fields.append((9 * NT + (n + i) * NT, b.fmul(d, b.sitofp(sm, v16f))))
        for j in range(16):
            for off, val in fields:
                e = b.extract_element(val, ir.Constant(I32, j))
                p = b.gep(rec, [c(j * XW + off)])
                b.store(e if e.type == I32 else b.bitcast(e, I32), p, align=4)
        return context.get_dummy_value()
    return types.void(X, x, j0, t, G), codegen


@njit(parallel=True, cache=True, error_model="numpy")
def prepare_x(x, slot_x, G):
    """Slot groups of x [N, K] (slot_x [S]: x row of each slot, -1: none; S = groups * NT):
    uint32 [groups, B * x_words(G)], B records per group (see the top)."""
    K = x.shape[1]
    B, n_groups, XW = K // 32, slot_x.shape[0] // NT, x_words(G)
    Xa = np.empty((n_groups, B * XW), np.uint32)
    for grp in prange(n_groups):
        X = Xa[grp]
        xi, xq, xf = X.view(np.int32), X.view(np.int8), X.view(np.float32)
        for t in range(NT):
            n = slot_x[grp * NT + t]
            if n >= 0:
                row = x[n]
                bits = row.view(np.uint32)
                for j in range(0, B - 15, 16):
                    if G == 32:
                        _quantize16(X, row, j, t, 32)
                    else:
                        _quantize16(X, row, j, t, 16)
                for j in range(B // 16 * 16, B):
                    _quantize_block(xi, xq, xf, row, bits, j, t, G)
            else:                                # no token: xd = xs = 0, the codes unused
                for j in range(B):
                    for i in range(8 * NT + t, XW, NT):
                        X[j * XW + i] = 0
    return Xa


# ---------------------------------------------------------------- the product

@njit(inline="always")
def _panel_groups(G, HM, out, P, Xa, slot_o, g0, g1, r0, nr):
    """out rows of slots in groups g0..g1 - 1, columns r0..r0 + nr - 1 <- panel . x."""
    B = Xa.shape[1] // x_words(G)
    flat = out.reshape(out.shape[0] * out.shape[1])
    for grp in range(g0, g1):
        acc = carray(_stack_acc(), NT * ROWS)
        for i in range(NT * ROWS):
            acc[i] = 0
        X = Xa[grp]
        for j in range(B):
            acc_block(G, HM, acc, P, X, j)
        for t in range(NT):
            orow = slot_o[grp * NT + t]
            if orow >= 0:
                store_lanes(flat, orow * out.shape[1] + r0, acc, t, nr)


def _group(qtype):
    """gemm_unpack.group_size from Python (that one is inline-only: no cache, a compile a process)."""
    return 16 if int(qtype) in PER16 else 32


def _item_kernel(qtype):
    """One work item: unpack rows r0..r0 + nr - 1 of w [M, row_bytes], then the slot groups
    g0..g1 - 1 (a function of its own: the parallel loop's body stays small to compile)."""
    G, HM = _group(qtype), qtype in HAS_M

    @njit(cache=True, error_model="numpy", pipeline_class=ConstantArgs)
    def item(out, w, Xa, slot_o, g0, g1, r0, nr):
        P = np.empty(Xa.shape[1] // x_words(G) * panel_words(G), np.uint32)
        unpack(qtype, P, w, r0, nr)
        _panel_groups(G, HM, out, P, Xa, slot_o, g0, g1, r0, nr)
    return item


_item = entry(_item_kernel, "out, w, qtype, Xa, slot_o, g0, g1, r0, nr")


def _gemm_kernel(qtype):
    """out [N, M]: out[slot_o[s]] = dequant(w[e]) @ x of slot s, for the slots of each job
    (jobs [J, 3]: matrix e, first slot group, end group); w [E, M, row_bytes]. Items (job,
    panel) differ in cost (experts' token counts): shared out over n_workers by work_queue."""
    @njit(parallel=True, cache=True, error_model="numpy", pipeline_class=ConstantArgs)
    def gemm(out, w, Xa, slot_o, jobs, n_workers):
        M = w.shape[1]
        n_panels = (M + ROWS - 1) // ROWS
        queue = new_queue(jobs.shape[0] * n_panels, n_workers)
        for worker in prange(n_workers):
            item = next_item(queue, worker)
            while item >= 0:
                job, p = item // n_panels, item % n_panels
                _item(out, w[jobs[job, 0]], qtype, Xa, slot_o, jobs[job, 1], jobs[job, 2], p * ROWS,
                      min(ROWS, M - p * ROWS))
                item = next_item(queue, worker)
    return gemm


gemm = entry(_gemm_kernel, "out, w, qtype, Xa, slot_o, jobs, n_workers")


def _jobs(n_groups, n_panels, n_threads):
    """Jobs of one matrix: its slot groups split in runs when there are few panels, so that
    every thread gets work (a run of >= 4 groups: the panel's unpacking is paid per run)."""
    runs = max(1, min(n_groups // 4, -(-4 * n_threads // n_panels)))
    edges = np.linspace(0, n_groups, runs + 1).astype(np.int64)
    return np.stack([np.zeros(runs, np.int64), edges[:-1], edges[1:]], 1)


def mul_mat(out, w, x, qtype):
    """out [T, M] = x [T, K] @ dequant(w [M, row_bytes])^T."""
    T = x.shape[0]
    s = np.full((T + NT - 1) // NT * NT, -1, np.int64)
    s[:T] = np.arange(T)
    Xa = prepare_x(x, s, _group(qtype))
    n_threads = numba.get_num_threads()
    jobs = _jobs(s.shape[0] // NT, (w.shape[0] + ROWS - 1) // ROWS, n_threads)
    gemm(out, w[None], qtype, Xa, s, jobs, n_threads)


@njit(cache=True, error_model="numpy")
def _expert_slots(ids, X, order, start, min_pairs):
    """Slots of the experts chosen by >= min_pairs (token, expert) pairs, each expert's run
    padded to whole groups: x rows (t * X + a or t * X), out rows t * A + a, and jobs."""
    A, E = ids.shape[1], start.shape[0] - 1
    n_slots, n_jobs = 0, 0
    for e in range(E):
        n = start[e + 1] - start[e]
        if n >= min_pairs:
            n_slots += (n + NT - 1) // NT * NT
            n_jobs += 1
    slot_x = np.full(n_slots, -1, np.int64)
    slot_o = np.full(n_slots, -1, np.int64)
    jobs = np.empty((n_jobs, 3), np.int64)
    s, j = 0, 0
    for e in range(E):
        n = start[e + 1] - start[e]
        if n >= min_pairs:
            for i in range(n):
                p = order[start[e] + i]
                slot_x[s + i] = p // A * X + (p % A if X == A else 0)
                slot_o[s + i] = p
            jobs[j, 0], jobs[j, 1], jobs[j, 2] = e, s // NT, (s + n + NT - 1) // NT
            s += (n + NT - 1) // NT * NT
            j += 1
    return slot_x, slot_o, jobs


def mul_mat_id(out, w, x, ids, qtype, order, start, min_pairs):
    """out [T, A, M]: the pairs of experts chosen by >= min_pairs pairs (order, start: the pairs
    sorted by expert, matmul._group_by_expert) = dequant(w [E, M, row_bytes][e]) @ x [T, X, K]."""
    T, X, K = x.shape
    slot_x, slot_o, jobs = _expert_slots(ids, X, order, start, min_pairs)
    if jobs.shape[0] == 0:
        return
    Xa = prepare_x(x.reshape(T * X, K), slot_x, _group(qtype))
    gemm(out.reshape(T * ids.shape[1], out.shape[2]), w, qtype, Xa, slot_o, jobs, numba.get_num_threads())
