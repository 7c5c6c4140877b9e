"""Warp-level tensor-core products (PTX mma.sync, sm_80+): int8 for the quantized prompt products,
f16 for attention; and their simulator twins.

  mma_s8_16x8x32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3)
      D [16 x 8] = A [16 x 32] @ B [32 x 8] + C, int8 inputs, int32 accumulators:
      mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32
  mma_s8_16x8x16(a0, a1, b0, c0, c1, c2, c3) -> (d0, d1, d2, d3)
      the same with k = 16 (for scales that change every 16 values: Q3_K, Q6_K):
      mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32
  mma_f16_16x8x16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3)
      D [16 x 8] = A [16 x 16] @ B [16 x 8] + C, f16 inputs (2 a register), float32 C and D:
      mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32
  pack_f16x2(lo, hi) -> uint32: two float32 rounded to f16 (nearest even) in one register,
      lo in the low half (cvt.rn.f16x2.f32), the element order of the f16 fragments
Every lane of the warp calls them together (no lane may be masked off), each with its own
fragment registers; an int32 register holds 4 int8 values, the lowest k in the low byte.

Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k32" and "... mma.m16n8k16 with integer
type"): lane l = 4 g + t, g = l >> 2 (groupID 0..7), t = l & 3 (threadID_in_group 0..3).

  A 16 x 32 (row: m, k contiguous)          B 32 x 8 (col: n, k contiguous)
          k: 0..15        16..31                    n:  g
    m g    a0 = k 4t..4t+3 a2 = k 16+4t..         k 4t..4t+3      b0
    m g+8  a1 = k 4t..     a3 = k 16+4t..         k 16+4t..16+4t+3 b1

  C, D 16 x 8 int32
          n: 2t   2t+1
    m g    c0    c1
    m g+8  c2    c3

  k16: A = (a0, a1) and B = b0 exactly as the first k half above, C and D the same.
So one k32 product's registers are the two k16 products' registers: (a0, a1, b0) for
k 0..15 and (a2, a3, b1) for k 16..31.

f16 (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"): a register
holds 2 f16, the lower k in the low half; the same g, t as above.

  A 16 x 16 (row: m, k contiguous)          B 16 x 8 (col: n, k contiguous)
          k: 0..7          8..15                    n:  g
    m g    a0 = k 2t, 2t+1 a2 = k 8+2t, 8+2t+1    k 2t, 2t+1      b0
    m g+8  a1 = k 2t, 2t+1 a3 = k 8+2t, ..        k 8+2t, 8+2t+1  b1

  C, D 16 x 8 float32: as the int32 table above.
Note that the C/D fragment of one product is, register for register, the A fragment of the
next one's k = its n (two n-tiles of 8 side by side make the k 0..7 | 8..15 halves): that
is how attention's P = softmax(S) feeds P @ V without leaving the registers.

In the simulator (NUMBA_ENABLE_CUDASIM=1) each lane hands its registers to the warp
(_sim_exchange), rebuilds A and B from all 32 lanes by the table above and takes its own
four results: what CI tests, so the table is checked wherever the kernels are.
"""
import numpy as np

from . import SIM

if SIM:
    from . import _sim_exchange

    _LANES = np.arange(32)
    _G, _T = _LANES >> 2, _LANES & 3

    def _words(regs):
        """[32 lanes, n] int32-ish values -> int8 bytes [32, n, 4], byte i = element i."""
        r = np.array([[int(v) & 0xFFFFFFFF for v in lane] for lane in regs], np.uint32)
        return r.view(np.int8).reshape(32, r.shape[1], 4).astype(np.int64)

    def _result(a, b, c):
        """This lane's (d0..d3) of D = A @ B + C, wrapped to int32 as the hardware's adder."""
        buf, lane, _ = _sim_exchange(a + b, None)
        w = _words(buf)
        na, nb = len(a), len(b)
        K = 16 * nb
        A = np.zeros((16, K), np.int64)
        B = np.zeros((K, 8), np.int64)
        kk = 4 * _T[:, None] + np.arange(4)                    # [32, 4]: k of a register's bytes
        for r in range(na):                                     # a0: (g, lo), a1: (g+8, lo), a2: (g, hi), ..
            A[(_G + 8 * (r & 1))[:, None], kk + 16 * (r >> 1)] = w[:, r]
        for r in range(nb):                                     # b0: lo, b1: hi
            B[kk + 16 * r, _G[:, None]] = w[:, na + r]
        D = A @ B
        g, t = lane >> 2, lane & 3
        out = (D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1])
        return tuple(np.int32(np.int64(((int(v) + int(cv) + 2 ** 31) % 2 ** 32) - 2 ** 31))
                     for v, cv in zip(out, c))

    def mma_s8_16x8x32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return _result((a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3))

    def mma_s8_16x8x16(a0, a1, b0, c0, c1, c2, c3):
        return _result((a0, a1), (b0,), (c0, c1, c2, c3))

    def _halves(regs):
        """[32 lanes, n] registers of 2 f16 -> float64 [32, n, 2], element 0 = the low half."""
        r = np.array([[int(v) & 0xFFFFFFFF for v in lane] for lane in regs], np.uint32)
        return r.view(np.float16).reshape(32, r.shape[1], 2).astype(np.float64)

    def mma_f16_16x8x16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        buf, lane, _ = _sim_exchange((a0, a1, a2, a3, b0, b1), None)
        h = _halves(buf)
        A = np.zeros((16, 16))
        B = np.zeros((16, 8))
        kk = 2 * _T[:, None] + np.arange(2)                    # [32, 2]: k of a register's halves
        for r in range(4):                                      # a0: (g, lo), a1: (g+8, lo), a2: (g, hi), ..
            A[(_G + 8 * (r & 1))[:, None], kk + 8 * (r >> 1)] = h[:, r]
        for r in range(2):                                      # b0: k lo, b1: k hi
            B[kk + 8 * r, _G[:, None]] = h[:, 4 + r]
        D = A @ B                                               # exact: f16 products, float64 sums
        g, t = lane >> 2, lane & 3
        out = (D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1])
        return tuple(np.float32(v + np.float64(cv)) for v, cv in zip(out, (c0, c1, c2, c3)))

    def pack_f16x2(lo, hi):
        with np.errstate(over="ignore"):
            return np.array([lo, hi], np.float32).astype(np.float16).view(np.uint32)[0]
else:
    from llvmlite import ir
    from numba import cuda, types
    from numba.cuda.extending import intrinsic

    def _mma_codegen(shape, n_a, n_b):
        """Code generation of one mma.sync instruction: (n_a + n_b + 4 int32) -> UniTuple(int32, 4).
        The call is marked convergent: the compiler must not move it into a branch (all lanes
        execute it together)."""
        n_in = n_a + n_b + 4
        regs = lambda lo, n: "{" + ", ".join(f"${i}" for i in range(lo, lo + n)) + "}"   # noqa: E731
        asm = (f"mma.sync.aligned.{shape}.row.col.s32.s8.s8.s32 {regs(0, 4)}, {regs(4, n_a)}, "
               f"{regs(4 + n_a, n_b)}, {regs(4 + n_a + n_b, 4)};")
        cons = ",".join(["=r"] * 4 + ["r"] * n_in)

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32] * n_in)
            res = builder.call(ir.InlineAsm(fnty, asm, cons), args, attrs=("convergent",))
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(4)])
        return codegen

    _RET = types.UniTuple(types.int32, 4)

    @intrinsic
    def _mma_k32(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        args = (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        if any(a != types.int32 for a in args):
            return None
        return _RET(*args), _mma_codegen("m16n8k32", 4, 2)

    @intrinsic
    def _mma_k16(typingctx, a0, a1, b0, c0, c1, c2, c3):
        args = (a0, a1, b0, c0, c1, c2, c3)
        if any(a != types.int32 for a in args):
            return None
        return _RET(*args), _mma_codegen("m16n8k16", 2, 1)

    _RET_F = types.UniTuple(types.float32, 4)

    @intrinsic
    def _mma_f16(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        if any(a != types.int32 for a in (a0, a1, a2, a3, b0, b1)) or \
                any(c != types.float32 for c in (c0, c1, c2, c3)):
            return None
        asm = ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, "
               "{$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")
        cons = ",".join(["=f"] * 4 + ["r"] * 6 + ["f"] * 4)

        def codegen(context, builder, sig, args):
            i32_, f32_ = ir.IntType(32), ir.FloatType()
            fnty = ir.FunctionType(ir.LiteralStructType([f32_] * 4), [i32_] * 6 + [f32_] * 4)
            res = builder.call(ir.InlineAsm(fnty, asm, cons), args, attrs=("convergent",))
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(4)])
        return _RET_F(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), codegen

    @intrinsic
    def _pack_f16x2(typingctx, lo, hi):
        if not (lo == hi == types.float32):
            return None

        def codegen(context, builder, sig, args):
            i32_, f32_ = ir.IntType(32), ir.FloatType()
            # cvt.rn.f16x2.f32 d, a, b puts a in the upper half, b in the lower
            fn = ir.InlineAsm(ir.FunctionType(i32_, [f32_, f32_]), "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f")
            return builder.call(fn, [args[1], args[0]])
        return types.uint32(lo, hi), codegen

    i32 = np.int32
    f32 = np.float32

    @cuda.jit(device=True, forceinline=True)
    def mma_f16_16x8x16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return _mma_f16(i32(a0), i32(a1), i32(a2), i32(a3), i32(b0), i32(b1),
                        f32(c0), f32(c1), f32(c2), f32(c3))

    @cuda.jit(device=True, forceinline=True)
    def pack_f16x2(lo, hi):
        return _pack_f16x2(f32(lo), f32(hi))

    @cuda.jit(device=True, forceinline=True)
    def mma_s8_16x8x32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return _mma_k32(i32(a0), i32(a1), i32(a2), i32(a3), i32(b0), i32(b1),
                        i32(c0), i32(c1), i32(c2), i32(c3))

    @cuda.jit(device=True, forceinline=True)
    def mma_s8_16x8x16(a0, a1, b0, c0, c1, c2, c3):
        return _mma_k16(i32(a0), i32(a1), i32(b0), i32(c0), i32(c1), i32(c2), i32(c3))
