"""LLVM IR building blocks for integer block dots (quants_k_i8, quants_iq4, quants_iq_i8) and
for the batched product's weight panels (Rows, at the bottom: gemm_unpack).

Numba has no vector types, so a block's integer dot is one intrinsic that emits LLVM IR:
`acc_intrinsic(body, values, xs_per, size)` makes an intrinsic
    acc_block(acc, row, o, xq, xd, xs, b)
that runs body(e) for block b of a row: e (an Emit) holds pointers to the block's bytes
row[o:], its x codes xq[values * b:], x scales xd[values // 32 * b:] and x sums
xs[xs_per * b:], and acc, 16 float32 lane accumulators (a stack array, see quants.lanes16).
Bodies unpack codes with vector ops, call e.dot (u8 codes x s8 xq, 4 products per int32
lane) and add float lanes times per-lane scales as terms; finish() sums a block's terms as
a tree and adds that to acc once (one add per block on the loop-carried chain, instead of
one 4-cycle FMA per term: 5 per Q4_K super-block, 20 cycles).

dot: `vpdpbusd` (AVX-512 VNNI) through its LLVM intrinsic where the CPU has it, else plain
widen-multiply-add IR (same results, slower). lut (a 16-entry byte table lookup): `vpshufb`.
With a block's byte count, acc_intrinsic also prefetches the bytes PREFETCH further on (the
hardware prefetchers alone leave the decode waiting on memory: docs/kernels.md).
What bounds these kernels in cache: the 512-bit ports (p0, p5: ~2 vector ops per cycle), so
each op saved per 64 values counts.
"""
import llvmlite.binding as llb
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from nbmoe import config

_FEATURES = llb.get_host_cpu_features()
# config.NO_VNNI (NBMOE_NO_VNNI=1) forces the generic dot (it names another kernel cache).
HAS_VNNI = bool(_FEATURES.get("avx512vnni") and _FEATURES.get("avx512vl")) and not config.NO_VNNI
HAS_AVX512BW = bool(_FEATURES.get("avx512bw"))
# Byte permutes across a whole 512-bit register (vpermb / vpermt2b): the 4-bit table types'
# quads gather their blocks with them (quants_iq4).
HAS_VBMI = bool(_FEATURES.get("avx512vbmi")) and HAS_AVX512BW
HAS_AVX2 = bool(_FEATURES.get("avx2"))
# Bytes ahead of the block being decoded whose cache lines each block prefetches (0: none);
# a compile-time constant, chosen by the sweep in docs/kernels.md.
PREFETCH = 3072

I1, I8, I16, I32, I64, F32 = (ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32),
                              ir.IntType(64), ir.FloatType())


def vec(elt, n):
    return ir.VectorType(elt, n)


def const(elt, values):
    """A constant vector of the given element type (integers >= 2**(bits-1) written as negative)."""
    if isinstance(elt, ir.IntType):
        values = [v - (1 << elt.width) if v >= 1 << (elt.width - 1) else v for v in values]
    return ir.Constant(vec(elt, len(values)), list(values))


def load_at(b, ptr, off, ty):
    """A load of type ty, alignment 1, at byte pointer ptr + off (off: an int)."""
    p = b.gep(ptr, [ir.Constant(I64, off)]) if off else ptr
    return b.load(b.bitcast(p, ty.as_pointer()), align=1)


def splat(b, v, n):
    """<n x v.type> with v in every lane."""
    one = b.insert_element(ir.Constant(vec(v.type, n), None), v, ir.Constant(I32, 0))
    return b.shuffle_vector(one, one, ir.Constant(vec(I32, n), None))


def prefetch_lines(b, ptrs):
    """Ask for the cache line at each byte pointer (llvm.prefetch: read, keep in all levels, data)."""
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(
        ir.VoidType(), [I8.as_pointer(), I32, I32, I32]), "llvm.prefetch.p0")
    for p in ptrs:
        b.call(fn, [p, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


def arg_data(context, b, sig, args, i):
    """The data pointer of an intrinsic's array argument i."""
    return context.make_array(sig.args[i])(context, b, args[i]).data


def group_record(b, w, o, sb, size, prefetch=False):
    """Byte pointer of super-block sb's record (`size` bytes) in the repacked group at byte o
    of w (quants_rtr_k / quants_rtr_xs layouts); prefetch: also ask for the record's lines
    PREFETCH bytes further on."""
    rec = b.gep(w, [b.add(o, b.mul(sb, ir.Constant(I64, size)))])
    if prefetch and PREFETCH:
        prefetch_lines(b, [b.gep(rec, [ir.Constant(I64, off)])
                           for off in range(PREFETCH, PREFETCH + size, 64)])
    return rec


@intrinsic
def copy16(typingctx, dst, i, src, j):
    """dst[i:i + 16] = src[j:j + 16] (1-byte items) as one 16-byte move: the loop version
    stays a byte at a time (LLVM cannot rule out that dst and src overlap). For the per-call
    x rearrangements (quants_q4x, quants_iq4, quants_k_i8)."""
    def codegen(context, b, sig, args):
        ptr = [b.gep(arg_data(context, b, sig, args, k), [args[k + 1]]) for k in (0, 2)]
        v16 = vec(I8, 16)
        b.store(b.load(b.bitcast(ptr[1], v16.as_pointer()), align=1), b.bitcast(ptr[0], v16.as_pointer()), align=1)
        return context.get_dummy_value()
    return types.void(dst, i, src, j), codegen


def x_word16(b, x, off):
    """<64 x i8>: the 4 x codes at byte pointer x + off, repeated in all 16 lanes."""
    return b.bitcast(splat(b, load_at(b, x, off, I32), 16), vec(I8, 64))


def lut(b, table, idx):
    """table[idx] per byte (vpshufb, as wide as the CPU has it); table: 16 byte values, idx:
    <n x i8> in 0..15, n a multiple of 16."""
    n = idx.type.count
    width = 64 if n % 64 == 0 and HAS_AVX512BW else 32 if n % 32 == 0 and HAS_AVX2 else 16
    name = {64: "llvm.x86.avx512.pshuf.b.512", 32: "llvm.x86.avx2.pshuf.b",
            16: "llvm.x86.ssse3.pshuf.b.128"}[width]
    ty = vec(I8, width)
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(ty, [ty, ty]), name)
    tab = const(I8, [t & 255 for t in table] * (width // 16))
    out = [b.call(fn, [tab, b.shuffle_vector(idx, idx, const(I32, range(i, i + width)))])
           for i in range(0, n, width)]
    while len(out) > 1:
        m = out[0].type.count
        out = [b.shuffle_vector(out[i], out[i + 1], const(I32, range(2 * m))) for i in range(0, len(out), 2)]
    return out[0]


class Emit:
    """IR helpers for one block of one row; see the module docstring for the arguments."""

    def __init__(self, context, builder, sig, args, values, xs_per):
        b = self.b = builder

        def data(i):
            return context.make_array(sig.args[i])(context, builder, args[i]).data

        blk = args[6]
        self._acc = b.bitcast(data(0), vec(F32, 16).as_pointer())
        self._row = b.gep(data(1), [args[2]])
        self._xq = b.gep(data(3), [b.mul(blk, ir.Constant(blk.type, values))])
        self._xd = b.gep(data(4), [b.mul(blk, ir.Constant(blk.type, values // 32))])
        self._xs = b.gep(data(5), [b.mul(blk, ir.Constant(blk.type, xs_per))])
        self.terms = []

    # -- loads
    def _load(self, base, off, ty):
        p = self.b.gep(base, [ir.Constant(I64, off)]) if off else base
        return self.b.load(self.b.bitcast(p, ty.as_pointer()), align=1)

    def bytes(self, off, n):
        """<n x i8>: the block's bytes off..off + n."""
        return self._load(self._row, off, vec(I8, n))

    def word(self, off, bits=32):
        """The little-endian integer of `bits` bits at byte off of the block."""
        return self._load(self._row, off, ir.IntType(bits))

    def f16(self, off):
        """The f16 at byte off of the block, as float."""
        return self.b.fpext(self.b.bitcast(self.word(off, 16), ir.HalfType()), F32)

    def xq(self, off, n=64):
        """<n x i8>: x codes off..off + n of this block."""
        return self._load(self._xq, off, vec(I8, n))

    def xd(self, n):
        """<n x float>: the scales of this block's n x-blocks."""
        return self._load(self._xd, 0, vec(F32, n))

    def xs(self, n):
        """<n x float>: this block's n x sums (xs: per 32 values, or sums16's per 16)."""
        return self._load(self._xs, 0, vec(F32, n))

    def xsi(self, n, off=0):
        """<n x i32>: this block's words off..off + n of xs when it holds int32 (lane biases)."""
        return self._load(self._xs, off, vec(I32, n))

    # -- vector ops
    def splat(self, v, n):
        return splat(self.b, v, n)

    def pack(self, *scalars):
        """<n x type>: the scalars as a vector."""
        v = ir.Constant(vec(scalars[0].type, len(scalars)), None)
        for i, x in enumerate(scalars):
            v = self.b.insert_element(v, x, ir.Constant(I32, i))
        return v

    def pick(self, v, idx):
        """<len(idx)>: v[idx[0]], v[idx[1]], ..."""
        return self.b.shuffle_vector(v, v, const(I32, idx))

    def cat(self, *parts):
        """The vectors side by side (2 or 4 of equal length)."""
        while len(parts) > 1:
            n = parts[0].type.count
            parts = [self.b.shuffle_vector(parts[i], parts[i + 1], const(I32, range(2 * n)))
                     for i in range(0, len(parts), 2)]
        return parts[0]

    def band(self, v, m):
        return self.b.and_(v, const(v.type.element, [m] * v.type.count))

    def shr(self, v, s):
        return self.b.lshr(v, const(v.type.element, [s] * v.type.count)) if s else v

    def shl(self, v, s):
        return self.b.shl(v, const(v.type.element, [s] * v.type.count))

    def fconst(self, value, n):
        return const(F32, [float(value)] * n)

    def nibbles(self, q):
        """(low nibbles, high nibbles) of a byte vector."""
        return self.band(q, 15), self.shr(q, 4)

    def shr16(self, v, shifts):
        """Bytes v shifted right per 16-bit lane (shifts: one count per lane, vpsrlvw), unmasked:
        mask the result to the bits wanted."""
        w = self.b.bitcast(v, vec(I16, v.type.count // 2))
        return self.b.bitcast(self.b.lshr(w, const(I16, shifts)), v.type)

    def shl16(self, v, shifts):
        """As shr16, to the left (vpsllvw)."""
        w = self.b.bitcast(v, vec(I16, v.type.count // 2))
        return self.b.bitcast(self.b.shl(w, const(I16, shifts)), v.type)

    def keep(self, v, mask):
        """v where mask (a list of 0/1 per lane), else 0."""
        return self.b.select(const(I1, mask), v, ir.Constant(v.type, None))

    def crumbs(self, q, s):
        """Bits s, s + 1 of each byte of q (2-bit codes)."""
        return self.band(self.shr(q, s), 3)

    def flag(self, v, m, value):
        """value where v & m != 0, else 0 (per byte)."""
        n = v.type.count
        on = self.b.icmp_unsigned("!=", self.band(v, m), ir.Constant(v.type, None))
        return self.b.select(on, const(I8, [value] * n), ir.Constant(vec(I8, n), None))

    def tofloat(self, v, signed=True):
        ty = vec(F32, v.type.count)
        return self.b.sitofp(v, ty) if signed else self.b.uitofp(v, ty)

    def lut(self, table, idx):
        """table[idx] per byte; table: 16 byte values, idx: <n x i8> in 0..15."""
        return lut(self.b, table, idx)

    def dot(self, codes, x, init=None):
        """<n/4 x i32>: lane k = init[k] + sum over i < 4 of codes[4k + i] (unsigned) * x[4k + i]
        (signed); init 0 if None."""
        n = codes.type.count
        v32 = vec(I32, n // 4)
        init = ir.Constant(v32, None) if init is None else init
        if HAS_VNNI and n in (32, 64):
            name = "llvm.x86.avx512.vpdpbusd.512" if n == 64 else "llvm.x86.avx512.vpdpbusd.256"
            fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(v32, [v32] * 3), name)
            return self.b.call(fn, [init, self.b.bitcast(codes, v32), self.b.bitcast(x, v32)])
        p = self.b.mul(self.b.zext(codes, vec(I32, n)), self.b.sext(x, vec(I32, n)))
        for m in (n // 2, n // 4):  # pairwise sums, the shape of pmaddwd
            p = self.b.add(self.pick(p, range(0, 2 * m, 2)), self.pick(p, range(1, 2 * m, 2)))
        return self.b.add(p, init)

    def prefetch(self, dist, size):
        """Ask for the cache lines of bytes dist..dist + size ahead of the block (none if dist = 0)."""
        prefetch_lines(self.b, [self.b.gep(self._row, [ir.Constant(I64, off)])
                                for off in range(dist, dist + size if dist else 0, 64)])

    # -- accumulation: a block's terms are summed as a tree, then added to acc once, so that
    # the only chain from block to block is one add (4 cycles), not one FMA per term.
    def add(self, v):
        """acc[0:n] += v (<n x float>, n <= 16), at finish."""
        if v.type.count < 16:
            zero = ir.Constant(v.type, None)
            v = self.b.shuffle_vector(v, zero, const(I32, list(range(v.type.count))
                                                     + [v.type.count] * (16 - v.type.count)))
        self.terms.append(v)

    def mul(self, *vs):
        out = vs[0]
        for v in vs[1:]:
            out = self.b.fmul(out, v, flags=("contract",))
        return out

    def acc_dot(self, codes, x, scales, idx):
        """acc[0:len(idx)] += float(dot(codes, x)) * scales[idx] (a per-lane scale)."""
        self.add(self.mul(self.tofloat(self.dot(codes, x)), self.pick(scales, idx)))

    def finish(self, chain=False):
        """acc += the block's terms: as a tree (one add on the loop-carried chain), or with
        chain, added one by one (each product an FMA into acc: fewer ops, a longer chain; pays
        where several rows run side by side, quants.rows_in_streams)."""
        if chain:
            acc = self.b.load(self._acc, align=4)
            for v in self.terms:
                acc = self.b.fadd(acc, v, flags=("contract",))
            self.b.store(acc, self._acc, align=4)
            return
        t = self.terms
        while len(t) > 1:  # products pair up into FMAs (contract)
            pairs = [self.b.fadd(t[i], t[i + 1], flags=("contract",)) for i in range(0, len(t) - 1, 2)]
            t = pairs + t[len(t) // 2 * 2:]
        acc = self.b.load(self._acc, align=4)
        self.b.store(self.b.fadd(acc, t[0], flags=("contract",)), self._acc, align=4)


def acc_intrinsic(body, values, xs_per, size=0, chain=False):
    """The intrinsic acc_block(acc, row, o, xq, xd, xs, b) running body(Emit) (see the top) on
    `size` bytes of the row, after prefetching the bytes PREFETCH further on (size 0: none);
    chain: Emit.finish's one-by-one sum."""
    @intrinsic
    def acc_block(typingctx, acc, row, o, xq, xd, xs, b):
        def codegen(context, builder, sig, args):
            e = Emit(context, builder, sig, args, values, xs_per)
            e.prefetch(PREFETCH, size)
            body(e)
            e.finish(chain)
            return context.get_dummy_value()
        return types.void(acc, row, o, xq, xd, xs, b), codegen
    return acc_block


# ---------------------------------------------------------------- 16 rows at a time (gemm_unpack)


class Rows:
    """IR for one block (`size` bytes, `values` values, G per scale) of 16 weight rows at once,
    for gemm_unpack's intrinsics (args P, w, roff, blk): words(off, n) loads words of each
    row's block and transposes them, so that lane r of a <16 x i32> is row r; put and scale
    store a panel's <16 x i32> codes and <16 x float> scales into its records of PW words
    (layout: gemm_unpack)."""

    def __init__(self, context, b, sig, args, size, values, G, PW):
        _, P, w, roff, blk = args
        self.b, self.n, self.PW = b, 32 // G, PW

        def data(i):
            return context.make_array(sig.args[i])(context, b, args[i]).data

        ro, base = data(3), b.mul(blk, self.c(size))
        self.rows = [b.gep(data(2), [b.add(b.load(b.gep(ro, [self.c(r)])), base)]) for r in range(16)]
        self.P = b.gep(data(1), [b.mul(blk, self.c(values // 32 * PW))])

    @staticmethod
    def c(v, t=I64):
        return ir.Constant(t, v)

    def k(self, v):
        """A <16 x i32> constant."""
        return const(I32, [v] * 16)

    def _each(self, off, ty):
        return [self.b.load(self.b.bitcast(self.b.gep(p, [self.c(off)]), ty.as_pointer()), align=1)
                for p in self.rows]

    def _lanes(self, scalars):
        v = ir.Constant(vec(scalars[0].type, 16), None)
        for r, s in enumerate(scalars):
            v = self.b.insert_element(v, s, ir.Constant(I32, r))
        return v

    def _shuffle(self, a, b, idx):
        return self.b.shuffle_vector(a, b, const(I32, idx))

    def words(self, off, n):
        """[n x <16 x i32>]: words off + 4i (i < n <= 4) of the block, lane r = row r."""
        if n == 1:
            return [self._lanes(self._each(off, I32))]
        rows = [self._shuffle(v, v, list(range(n)) + [0] * (4 - n)) for v in self._each(off, vec(I32, n))]
        lanes = []                                       # per 4 rows: [w0 of the 4 | w1 | w2 | w3]
        for g in range(4):
            r = rows[4 * g:4 * g + 4]
            q = self._shuffle(self._shuffle(r[0], r[1], range(8)), self._shuffle(r[2], r[3], range(8)), range(16))
            lanes.append(self._shuffle(q, q, [4 * j + i for i in range(4) for j in range(4)]))

        def pick(x, y, lx, ly):                          # 128-bit lanes lx of x, then ly of y
            return self._shuffle(x, y, [4 * lane + i for lane in lx for i in range(4)]
                                 + [16 + 4 * lane + i for lane in ly for i in range(4)])
        lo01, hi01 = pick(lanes[0], lanes[1], (0, 1), (0, 1)), pick(lanes[0], lanes[1], (2, 3), (2, 3))
        lo23, hi23 = pick(lanes[2], lanes[3], (0, 1), (0, 1)), pick(lanes[2], lanes[3], (2, 3), (2, 3))
        return [pick(lo01, lo23, (0, 2), (0, 2)), pick(lo01, lo23, (1, 3), (1, 3)),
                pick(hi01, hi23, (0, 2), (0, 2)), pick(hi01, hi23, (1, 3), (1, 3))][:n]

    def half(self, off):
        """<16 x float>: the f16 at byte off of each row's block."""
        h = self.b.bitcast(self._lanes(self._each(off, I16)), vec(ir.HalfType(), 16))
        return self.b.fpext(h, vec(F32, 16))

    def byte(self, off):
        return self.b.zext(self._lanes(self._each(off, I8)), vec(I32, 16))

    # -- word ops (<16 x i32>, constants as ints)
    def and_(self, v, m):
        return self.b.and_(v, self.k(m))

    def or_(self, *vs):
        out = vs[0]
        for v in vs[1:]:
            out = self.b.or_(out, v if isinstance(v, ir.Value) else self.k(v))
        return out

    def add(self, v, m):
        return self.b.add(v, self.k(m))

    def shr(self, v, s):
        return self.b.lshr(v, self.k(s)) if s else v

    def shl(self, v, s):
        return self.b.shl(v, self.k(s)) if s else v

    def bits(self, v, s, m):
        """(v >> s) & m."""
        return self.and_(self.shr(v, s), m)

    def float(self, v):
        return self.b.sitofp(v, vec(F32, 16))

    def lut(self, v, table):
        """Each byte of v (0..15) -> table[byte] + 128 (vpshufb)."""
        fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(vec(I8, 64), [vec(I8, 64)] * 2),
                                            "llvm.x86.avx512.pshuf.b.512")
        tab = const(I8, [(int(t) + 128) & 255 for t in table] * 4)
        return self.b.bitcast(self.b.call(fn, [tab, self.b.bitcast(v, vec(I8, 64))]), vec(I32, 16))

    # -- stores
    def _store(self, word, v):
        self.b.store(v, self.b.bitcast(self.b.gep(self.P, [self.c(word)]), v.type.as_pointer()), align=4)

    def put(self, k, v):
        """Panel vector k of the block (values 4k..4k + 3 of the 16 rows)."""
        self._store(k // 8 * self.PW + 16 * (k % 8), v)

    def scale(self, g, v, offset=None):
        """S (and O) of group g of the block."""
        at = g // self.n * self.PW + 128 + 16 * (g % self.n)
        self._store(at, v)
        if offset is not None:
            self._store(at + 16 * self.n, offset)
