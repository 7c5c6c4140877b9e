"""Integer dots of the grid IQ types against the 8-bit x of quants_int8.quantize_x.

Layouts and grids: quants_iq.py. One super-block (256 values, 8 x-blocks) per intrinsic call,
written in LLVM IR with simd.Emit, as quants_k's integer dots. For each 64 values:
  codes <64 x u8>   the grid rows of their 8 (IQ3: 16) indices, loaded from the grid table (an
                    LLVM constant array in the module) and placed side by side
  x     <64 x s8>   xq, negated where the value's sign bit is set (grid values are >= 0, so
                    the sign moves to x: -127..127 negates without overflow)
  lanes <16 x i32>  dot(codes, x): one vpdpbusd; lane k covers values 4k..4k+3
  acc  += float(lanes) * s[lane]   s = d * (sub-block scale) * xd of the lane's 32 or 16 values
IQ1 (grid values -1, 0, 1, delta +-1/8): codes c = 8 (g + 1) + (2 where delta > 0), 0..18, so
8 (g + delta) = c - 9 and the dot is dot(c, x) - dot(9, x), scaled by d s xd / 8.
IQ2_XXS / IQ2_XS / IQ3_XXS store 7 sign bits per 8 values; the 8th is their parity.
"""
import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import cgutils

from .quants import FM, rows_in_streams
from .quants_iq import (IQ1_GRID, IQ1_M, IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ2S_GRID, IQ2XS_GRID,
                        IQ2XXS_GRID, IQ3_S, IQ3_XXS, IQ3S_GRID, IQ3XXS_GRID)
from .simd import I8, I32, acc_intrinsic, const, vec

I16, I64 = ir.IntType(16), ir.IntType(64)


# ---------------------------------------------------------------- IR pieces

def _table(e, name, grid):
    """The module's constant array of grid rows (uint8 [N, w] as N integers of 8w bits)."""
    module = e.b.module
    if name in module.globals:
        return module.globals[name]
    rows = np.ascontiguousarray(grid).view(np.uint64 if grid.shape[1] == 8 else np.uint32).ravel()
    ty = ir.ArrayType(ir.IntType(8 * grid.shape[1]), rows.shape[0])
    g = ir.GlobalVariable(module, ty, name)
    g.initializer = ir.Constant(ty, [int(v) for v in rows])
    g.global_constant, g.linkage = True, "internal"
    return g


def _bits(e, off, shift=0, mask=255, width=8):
    """i64: (the width-bit word at byte off of the block >> shift) & mask."""
    v = e.b.lshr(e.b.zext(e.word(off, width), I64), ir.Constant(I64, shift))
    return e.b.and_(v, ir.Constant(I64, mask))


def _rows(e, table, index, first, n):
    """<64 x i8>: rows index(e, first), ..., index(e, first + n - 1) of table, side by side.
    Indices come from scalar loads and shifts (index -> i64): extracting them from a vector
    was slower, and vector gathers (vpgatherdq, microcoded) slower still."""
    b, ty = e.b, table.type.pointee.element
    out = ir.Constant(vec(ty, n), None)
    for i in range(n):
        row = b.load(b.gep(table, [ir.Constant(I64, 0), index(e, first + i)]), align=1)
        out = b.insert_element(out, row, ir.Constant(I32, i))
    return b.bitcast(out, vec(I8, 64))


def _signed_x(e, signs, c):
    """xq of values 64c..64c+63, negated where their bit in signs (<32 x i8>, bit j of byte i =
    value 8i + j) is set."""
    mask = e.b.bitcast(e.pick(signs, range(8 * c, 8 * c + 8)), vec(ir.IntType(1), 64))
    x = e.xq(64 * c)
    return e.b.select(mask, e.b.sub(ir.Constant(x.type, None), x), x)


def _parity_signs(e, s7):
    """<32 x i8> sign bytes from 7-bit codes: bit 7 = the parity of bits 0..6."""
    fn = cgutils.get_or_insert_function(e.b.module, ir.FunctionType(s7.type, [s7.type]), "llvm.ctpop.v32i8")
    return e.b.or_(s7, e.shl(e.band(e.b.call(fn, [s7]), 1), 7))


def _fields(e, words, shifts, mask):
    """<len(words) * len(shifts) x i32>: (word >> shift) & mask, word by word."""
    n, m = words.type.count, len(shifts)
    rep = e.pick(words, [i // m for i in range(n * m)])
    return e.b.and_(e.b.lshr(rep, const(I32, list(shifts) * n)), const(I32, [mask] * (n * m)))


def _tofloat(e, v):
    return e.tofloat(v, signed=False)


def _half_scales(e, sc4, first, mult):
    """<16 x float>: d * (first + sc) * mult * xd per 16-value group, from 16 scale nibbles."""
    s = e.b.fadd(_tofloat(e, sc4), e.fconst(first, 16))
    return e.mul(e.splat(e.f16(0), 16), s, e.fconst(mult, 16), e.pick(e.xd(8), [g // 2 for g in range(16)]))


def _nibbles16(e, off, n_bytes):
    """<2 n_bytes x i32>: the nibbles of bytes off.., low nibble first."""
    return e.b.zext(e.b.and_(e.b.lshr(e.pick(e.bytes(off, n_bytes), [i // 2 for i in range(2 * n_bytes)]),
                                      const(I8, [0, 4] * n_bytes)), const(I8, [15] * 2 * n_bytes)),
                    vec(I32, 2 * n_bytes))


def _subs(c):   # lanes of 64 values 64c.. -> their sub-block (32 values)
    return [2 * c] * 8 + [2 * c + 1] * 8


def _groups(c):  # lanes of 64 values 64c.. -> their group of 16
    return [4 * c + k // 4 for k in range(16)]


# ---------------------------------------------------------------- bodies, one per type
# Grid index i of the super-block (byte offsets from its start; layouts in quants_iq.py).

def _idx_iq2_xxs(e, i):  # byte i % 4 of sub-block i // 4's 8 bytes
    return _bits(e, 2 + 8 * (i // 4) + i % 4)


def _idx_iq2_xs(e, i):   # low 9 bits of u16 i
    return _bits(e, 2 + 2 * i, 0, 511, 16)


def _idx_iq2_s(e, i):    # qs byte i | 2 bits of qh byte i // 4
    return _hi(e, _bits(e, 2 + i), _bits(e, 66 + i // 4, 2 * (i % 4), 3))


def _idx_iq3_xxs(e, i):  # qs byte i
    return _bits(e, 2 + i)


def _idx_iq3_s(e, i):    # qs byte i | bit i % 8 of qh byte i // 8
    return _hi(e, _bits(e, 2 + i), _bits(e, 66 + i // 8, i % 8, 1))


def _idx_iq1_s(e, i):    # qs byte i | 3 bits of sub-block i // 4's u16 qh
    return _hi(e, _bits(e, 2 + i), _bits(e, 34 + 2 * (i // 4), 3 * (i % 4), 7, 16))


def _idx_iq1_m(e, i):    # qs byte i | low 3 bits of qh nibble i
    return _hi(e, _bits(e, i), _bits(e, 32 + i // 2, 4 * (i % 2), 7))


def _hi(e, lo, hi):
    return e.b.or_(lo, e.b.shl(hi, ir.Constant(I64, 8)))


def _iq2_xxs(e):
    aux = e.pick(e.b.bitcast(e.bytes(2, 64), vec(I32, 16)), range(1, 16, 2))  # u32 2 of each 8 bytes
    signs = _parity_signs(e, e.b.trunc(_fields(e, aux, (0, 7, 14, 21), 127), vec(I8, 32)))
    sc = e.b.fadd(_tofloat(e, e.b.lshr(aux, const(I32, [28] * 8))), e.fconst(0.5, 8))
    s = e.mul(e.splat(e.f16(0), 8), sc, e.fconst(0.25, 8), e.xd(8))
    table = _table(e, "iq2xxs_grid", IQ2XXS_GRID)
    for c in range(4):
        e.acc_dot(_rows(e, table, _idx_iq2_xxs, 8 * c, 8), _signed_x(e, signs, c), s, _subs(c))


def _iq2_xs(e):
    qs = e.b.bitcast(e.bytes(2, 64), vec(I16, 32))
    signs = _parity_signs(e, e.b.trunc(e.b.lshr(qs, const(I16, [9] * 32)), vec(I8, 32)))
    s = _half_scales(e, _nibbles16(e, 66, 8), 0.5, 0.25)
    table = _table(e, "iq2xs_grid", IQ2XS_GRID)
    for c in range(4):
        e.acc_dot(_rows(e, table, _idx_iq2_xs, 8 * c, 8), _signed_x(e, signs, c), s, _groups(c))


def _iq2_s(e):
    signs = e.bytes(34, 32)
    s = _half_scales(e, _nibbles16(e, 74, 8), 0.5, 0.25)
    table = _table(e, "iq2s_grid", IQ2S_GRID)
    for c in range(4):
        e.acc_dot(_rows(e, table, _idx_iq2_s, 8 * c, 8), _signed_x(e, signs, c), s, _groups(c))


def _iq3_xxs(e):
    aux = e.b.bitcast(e.bytes(66, 32), vec(I32, 8))
    signs = _parity_signs(e, e.b.trunc(_fields(e, aux, (0, 7, 14, 21), 127), vec(I8, 32)))
    sc = e.b.fadd(_tofloat(e, e.b.lshr(aux, const(I32, [28] * 8))), e.fconst(0.5, 8))
    s = e.mul(e.splat(e.f16(0), 8), sc, e.fconst(0.5, 8), e.xd(8))
    table = _table(e, "iq3xxs_grid", IQ3XXS_GRID)
    for c in range(4):
        e.acc_dot(_rows(e, table, _idx_iq3_xxs, 16 * c, 16), _signed_x(e, signs, c), s, _subs(c))


def _iq3_s(e):
    signs = e.bytes(74, 32)
    sc = e.b.fadd(e.mul(_tofloat(e, _nibbles16(e, 106, 4)), e.fconst(2, 8)), e.fconst(1, 8))
    s = e.mul(e.splat(e.f16(0), 8), sc, e.xd(8))
    table = _table(e, "iq3s_grid", IQ3S_GRID)
    for c in range(4):
        e.acc_dot(_rows(e, table, _idx_iq3_s, 16 * c, 16), _signed_x(e, signs, c), s, _subs(c))


def _iq1_dots(e, index, plus, s, lanes):
    """Both IQ1 types: plus <256 x i1> (delta > 0 per value), s per-sub-block or per-group scales."""
    table = _table(e, "iq1_grid8", IQ1_GRID * 8)
    two, zero, nines = const(I8, [2] * 64), const(I8, [0] * 64), const(I8, [9] * 64)
    for c in range(4):
        delta = e.b.select(e.pick(plus, range(64 * c, 64 * c + 64)), two, zero)
        codes = e.b.add(_rows(e, table, index, 8 * c, 8), delta)
        x = e.xq(64 * c)
        e.add(e.mul(e.tofloat(e.b.sub(e.dot(codes, x), e.dot(nines, x))), e.pick(s, lanes(c))))


def _iq1_s(e):
    qh = e.b.zext(e.b.bitcast(e.bytes(34, 16), vec(I16, 8)), vec(I32, 8))
    sc = e.b.fadd(e.mul(_tofloat(e, _fields(e, qh, (12,), 7)), e.fconst(2, 8)), e.fconst(1, 8))
    s = e.mul(e.splat(e.f16(0), 8), sc, e.fconst(0.125, 8), e.xd(8))
    minus = e.b.icmp_unsigned("!=", _fields(e, qh, (15,), 1), ir.Constant(vec(I32, 8), None))
    _iq1_dots(e, _idx_iq1_s, e.b.not_(e.pick(minus, [i // 32 for i in range(256)])), s, _subs)


def _iq1_m(e):
    h = _nibbles16(e, 32, 16)                                  # per index: high bits | minus
    plus = e.b.icmp_unsigned("==", e.b.and_(h, const(I32, [8] * 32)), ir.Constant(vec(I32, 32), None))
    dbits = ir.Constant(I16, 0)                                # d: the 4 top nibbles of scales
    for i in range(4):
        dbits = e.b.or_(dbits, e.b.shl(e.b.lshr(e.word(48 + 2 * i, 16), ir.Constant(I16, 12)),
                                       ir.Constant(I16, 4 * i)))
    d = e.b.fpext(e.b.bitcast(dbits, ir.HalfType()), ir.FloatType())
    sc16 = e.b.zext(e.b.bitcast(e.bytes(48, 8), vec(I16, 4)), vec(I32, 4))
    sc = e.b.fadd(e.mul(_tofloat(e, _fields(e, sc16, (0, 3, 6, 9), 7)), e.fconst(2, 16)), e.fconst(1, 16))
    s = e.mul(e.splat(d, 16), sc, e.fconst(0.125, 16), e.pick(e.xd(8), [g // 2 for g in range(16)]))
    _iq1_dots(e, _idx_iq1_m, e.pick(plus, [i // 8 for i in range(256)]), s, _groups)


acc_iq2_xxs = acc_intrinsic(_iq2_xxs, 256, 8)
acc_iq2_xs = acc_intrinsic(_iq2_xs, 256, 8)
acc_iq2_s = acc_intrinsic(_iq2_s, 256, 8)
acc_iq3_xxs = acc_intrinsic(_iq3_xxs, 256, 8)
acc_iq3_s = acc_intrinsic(_iq3_s, 256, 8)
acc_iq1_s = acc_intrinsic(_iq1_s, 256, 8)
acc_iq1_m = acc_intrinsic(_iq1_m, 256, 8)


# ---------------------------------------------------------------- rows
# out [R] <- dequant(w [R, row_bytes]) @ (xq * xd) [K]: one intrinsic call per super-block.

@njit(inline="always")
def _rows_i8(acc_block, size, out, w, xq, xd, xs):
    rows_in_streams(acc_block, size, w.shape[1] // size, out, w, xq, xd, xs)


@njit(cache=True, error_model="numpy", fastmath=FM)
def dot_rows_iq_i8(qtype, out, w, xq, xd, xs):
    if qtype == IQ2_XXS:
        _rows_i8(acc_iq2_xxs, 66, out, w, xq, xd, xs)
    elif qtype == IQ2_XS:
        _rows_i8(acc_iq2_xs, 74, out, w, xq, xd, xs)
    elif qtype == IQ2_S:
        _rows_i8(acc_iq2_s, 82, out, w, xq, xd, xs)
    elif qtype == IQ3_XXS:
        _rows_i8(acc_iq3_xxs, 98, out, w, xq, xd, xs)
    elif qtype == IQ3_S:
        _rows_i8(acc_iq3_s, 110, out, w, xq, xd, xs)
    elif qtype == IQ1_S:
        _rows_i8(acc_iq1_s, 50, out, w, xq, xd, xs)
    elif qtype == IQ1_M:
        _rows_i8(acc_iq1_m, 56, out, w, xq, xd, xs)
