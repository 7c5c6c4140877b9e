"""CUDA kernels (numba.cuda), twins of nbmoe/cpu: same launchers, same signatures, device arrays.

Modules: quants (GGUF block decoders), matmul (mul_mat, mul_mat_id, get_rows, dequantize;
x8: x in 8 bits, mmv_q8: the int8 row dot, matmul_tiled / matmul_mma: prompt products, scratch:
kernels and buffers kept between calls), ops (norms, rope, activations, adds), attention (f16
KV cache; flash: its prompt kernel on f16 tensor cores), moe (routing, combine), fused (decode
kernels that do several nodes' work), graphs (CUDA graph replay), host_memory (zero copy).
Reading order: docs/kernels.md.
Every launcher takes numba device arrays and python scalars, plus an optional `stream`; it
never synchronises or copies to the host. Kernels are `<op>_kernel` (or built per type / per
size by a small factory and cached), launchers `<op>()`.

This file holds the few device primitives that differ between real CUDA and Numba's CUDA
simulator (NUMBA_ENABLE_CUDASIM=1, which the CPU-only CI uses):
  as_f32(bits)       int bit pattern -> float32 (libdevice int_as_float; numpy view in the sim)
  shfl_xor(v, m)     value of lane (lane ^ m) of the warp (the sim has no warp shuffles:
  shfl_idx(v, src)   value of lane src           emulated with a barrier per simulated warp)
  warp_sum, warp_max butterfly reductions over the 32 lanes; every lane gets the result
  expf(x)            float32 exp (libdevice expf; numpy's in the sim, where math.exp would
                     return float64 and raise on overflow)
  rintf(x)           float32 round half to even (libdevice rintf)
  dp4a(a, b, c)      c + the dot product of the 4 signed bytes of int32 a and b: one PTX
                     dp4a.s32.s32 (inline assembly: Numba has no intrinsic for it)
  ld_u8 / ld_u16 / ld_u32 / ld_i32 / ld_u64 / ld_f16 / ld_f32 (a, base, off)
                     the value at byte offset base + off of array a's data, whatever a's dtype
                     and shape (C-contiguous): unsigned ones as uint32, f16 converted to
                     float32 in hardware. base is a 64-bit row offset, off a 32-bit offset in
                     the row: no negative-index fix-ups and 32-bit index math, where Numba's
                     a[i, j] costs ~10 64-bit instructions a load. The loads must be aligned
                     to their size (the simulator checks).
  ld_u32_a2(a, base, off)  a 32-bit word at a 2-byte aligned offset (two 16-bit loads)
  ld_u32x2(a, base, off)   two 32-bit words at an 8-byte aligned offset (one 64-bit load)
  st_f32 / st_i32(a, base, off, v)  store float32 / int32 v there (the same addressing as the loaders)
And one host-side helper: empty(), EMPTY, the size-0 float32 device array that stands for
"none" in an optional array argument (attention sinks, routing and product biases).
Warp primitives need all 32 lanes of the warp to call them (as on hardware, full mask).
In the simulator, device_fn functions stay plain Python, and the simulator's shared-array
allocation is patched to take a lock (unlocked, simulated threads can each get their own copy).
"""
import threading

import numpy as np

# numba-cuda 0.30 calls np.row_stack at import; numpy 2.5 removed it.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

from numba import cuda  # noqa: E402
from numba.cuda.core import config as _config  # noqa: E402

SIM = bool(_config.ENABLE_CUDASIM)

# Small grids are normal here (T=1 decoding); numba's low-occupancy warning would print per launch.
if hasattr(_config, "CUDA_LOW_OCCUPANCY_WARNINGS"):
    _config.CUDA_LOW_OCCUPANCY_WARNINGS = 0

FULL = 0xFFFFFFFF
WARP = 32


def device_fn(fn):
    """A device function inlined into its callers (at the NVVM level on real CUDA). In the
    simulator it stays a plain Python function (a simulated device function swaps module
    globals on every call: slow), so it must not use `cuda.*` itself."""
    if SIM:
        return fn
    return cuda.jit(device=True, forceinline=True)(fn)


if SIM:
    import sys
    import traceback

    from numba.cuda.simulator import kernelapi as _kernelapi

    _SHARED_LOCK = threading.Lock()

    def _shared_array(self, shape, dtype, alignment=None):
        """The simulator's cuda.shared.array (numba-cuda 0.30.4) with its allocation under a
        lock: unlocked, two simulated threads can each create their own copy of a block's
        shared array (seen as garbage indices read from shared memory)."""
        if alignment is not None:
            raise RuntimeError("Array alignment is not supported in cudasim")
        if shape == 0:
            return _shared_array_orig(self, shape, dtype)
        caller = tuple(traceback.extract_stack(sys._getframe(1), limit=1)[0])[0:2]
        if isinstance(dtype, _kernelapi.types.Type):
            dtype = _kernelapi.numpy_support.as_dtype(dtype)
        with _SHARED_LOCK:
            res = self._allocations.get(caller)
            if res is None:
                res = self._allocations[caller] = np.empty(shape, dtype)
        return res

    _shared_array_orig = _kernelapi.FakeCUDAShared.array
    _kernelapi.FakeCUDAShared.array = _shared_array

    # One state per simulated warp (on the simulator's BlockManager of the block): a barrier,
    # and two exchange buffers used alternately, so that a lane that runs ahead into the next
    # exchange cannot overwrite what a slower lane is still reading (each op waits once).
    _SIM_LOCK = threading.Lock()

    class _SimWarp:
        def __init__(self, n):
            self.bufs = ([None] * WARP, [None] * WARP)
            self.ops = [None, None]
            self.res = [None, None]
            self.gen = 0
            self.bar = threading.Barrier(n, action=self._reduce)

        def _reduce(self):
            """Runs once, when all lanes have arrived: a reduction's butterfly, in the order the
            hardware adds (every lane ends with the same value: a + b == b + a)."""
            g = self.gen
            op = self.ops[g]
            if op is not None:
                v = list(self.bufs[g])
                for m in (16, 8, 4, 2, 1):
                    v = [op(v[i], v[i ^ m]) for i in range(WARP)]
                self.res[g] = v[0]

    def _sim_exchange(v, op):
        """Put v in the warp's buffer, wait for all lanes; (buffer, lane, reduction result)."""
        th = threading.current_thread()
        mgr = th._manager  # the simulator's BlockManager of this block
        w, lane = divmod(th.thread_id, WARP)
        with _SIM_LOCK:
            warps = mgr.__dict__.setdefault("_nbmoe_warps", {})
            if w not in warps:
                warps[w] = _SimWarp(min(WARP, int(np.prod(mgr._block_dim)) - w * WARP))
        st = warps[w]
        g = th.__dict__.get("_nbmoe_gen", 0)
        th._nbmoe_gen = g ^ 1
        st.bufs[g][lane] = v
        st.ops[g] = op
        st.gen = g
        st.bar.wait()
        return st.bufs[g], lane, st.res[g]

    def shfl_xor(v, m):
        buf, lane, _ = _sim_exchange(v, None)
        return type(v)(buf[lane ^ m])

    def shfl_idx(v, src):
        buf, lane, _ = _sim_exchange(v, None)
        return type(v)(buf[src])

    def warp_sum(v):
        return type(v)(_sim_exchange(v, lambda a, b: a + b)[2])

    def warp_max(v):
        return type(v)(_sim_exchange(v, max)[2])

    def as_f32(bits):
        return np.uint32(int(bits) & 0xFFFFFFFF).view(np.float32)

    def _bytes_at(a, base, off, size):
        item = object.__getattribute__(a, "_item") if hasattr(a, "_item") else None
        b = item.__dict__.get("_nbmoe_bytes") if item is not None else None
        if b is None:
            b = (item._ary if item is not None else a).reshape(-1).view(np.uint8)
            if item is not None:
                item.__dict__["_nbmoe_bytes"] = b
        i = int(base) + (int(off) & 0xFFFFFFFF)
        if i % size:
            raise ValueError(f"misaligned {size}-byte load at byte {i}")
        return b[i:i + size]

    def ld_u8(a, base, off):
        return np.uint32(_bytes_at(a, base, off, 1)[0])

    def ld_u16(a, base, off):
        return np.uint32(_bytes_at(a, base, off, 2).view(np.uint16)[0])

    def ld_u32(a, base, off):
        return _bytes_at(a, base, off, 4).view(np.uint32)[0]

    def ld_i32(a, base, off):
        return _bytes_at(a, base, off, 4).view(np.int32)[0]

    def ld_u64(a, base, off):
        return _bytes_at(a, base, off, 8).view(np.uint64)[0]

    def ld_f16(a, base, off):
        return np.float32(_bytes_at(a, base, off, 2).view(np.float16)[0])

    def ld_f32(a, base, off):
        return _bytes_at(a, base, off, 4).view(np.float32)[0]

    def st_f32(a, base, off, v):
        _bytes_at(a, base, off, 4).view(np.float32)[0] = v

    def st_i32(a, base, off, v):
        _bytes_at(a, base, off, 4).view(np.int32)[0] = v

    def expf(x):
        with np.errstate(over="ignore", invalid="ignore"):
            return np.exp(np.float32(x))

    def rintf(x):
        return np.rint(np.float32(x))

    def dp4a(a, b, c):
        a = int(a) & 0xFFFFFFFF
        b = int(b) & 0xFFFFFFFF
        tot = int(c)
        for k in range(4):
            x, y = (a >> (8 * k)) & 0xFF, (b >> (8 * k)) & 0xFF
            tot += (x - 256 if x > 127 else x) * (y - 256 if y > 127 else y)
        return np.int32(tot)
else:
    import math

    from numba.cuda import libdevice

    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @cuda.jit(device=True, forceinline=True)
    def expf(x):
        return math.exp(np.float32(x))

    @cuda.jit(device=True, forceinline=True)
    def rintf(x):
        return libdevice.rintf(np.float32(x))

    @intrinsic
    def _dp4a(typingctx, a, b, c):
        if not (a == b == c == types.int32):
            return None

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            fn = ir.InlineAsm(ir.FunctionType(i32, [i32, i32, i32]), "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r")
            return builder.call(fn, args)
        return types.int32(types.int32, types.int32, types.int32), codegen

    @cuda.jit(device=True, forceinline=True)
    def dp4a(a, b, c):
        return _dp4a(np.int32(a), np.int32(b), np.int32(c))

    _LD = {  # kind: (LLVM type loaded, numba type returned)
        "u8": (ir.IntType(8), types.uint32), "u16": (ir.IntType(16), types.uint32),
        "u32": (ir.IntType(32), types.uint32), "i32": (ir.IntType(32), types.int32),
        "u64": (ir.IntType(64), types.uint64),
        "f16": (ir.HalfType(), types.float32), "f32": (ir.FloatType(), types.float32),
    }

    def _loader(kind):
        llty, ret = _LD[kind]

        @intrinsic
        def ld(typingctx, a, base, off):
            if not (isinstance(a, types.Array) and isinstance(base, types.Integer)
                    and isinstance(off, types.Integer)):
                return None

            def codegen(context, builder, sig, args):
                i32, i64 = ir.IntType(32), ir.IntType(64)
                arr = context.make_array(sig.args[0])(context, builder, args[0])
                data = builder.bitcast(arr.data, ir.IntType(8).as_pointer())
                b = context.cast(builder, args[1], sig.args[1], types.int64)
                o = args[2]
                if o.type.width > 32:
                    o = builder.trunc(o, i32)
                elif o.type.width < 32:
                    o = builder.zext(o, i32)
                p = builder.gep(data, [builder.add(b, builder.zext(o, i64))])
                v = builder.load(builder.bitcast(p, llty.as_pointer()), align=max(1, llty.width // 8)
                                 if isinstance(llty, ir.IntType) else (2 if kind == "f16" else 4))
                if kind in ("u8", "u16"):
                    return builder.zext(v, i32)
                if kind == "f16":
                    return builder.fpext(v, ir.FloatType())
                return v
            return ret(a, base, off), codegen
        return ld

    ld_u8, ld_u16, ld_u32, ld_i32, ld_u64, ld_f16, ld_f32 = (
        _loader(k) for k in ("u8", "u16", "u32", "i32", "u64", "f16", "f32"))

    def _storer(nb_type, ll_type):
        @intrinsic
        def st(typingctx, a, base, off, v):
            if not (isinstance(a, types.Array) and base == types.int64 and off == types.uint32
                    and v == nb_type):
                return None

            def codegen(context, builder, sig, args):
                arr = context.make_array(sig.args[0])(context, builder, args[0])
                data = builder.bitcast(arr.data, ir.IntType(8).as_pointer())
                p = builder.gep(data, [builder.add(args[1], builder.zext(args[2], ir.IntType(64)))])
                builder.store(args[3], builder.bitcast(p, ll_type.as_pointer()), align=4)
                return context.get_dummy_value()
            return types.none(a, base, off, v), codegen
        return st

    _st_f32, _st_i32 = _storer(types.float32, ir.FloatType()), _storer(types.int32, ir.IntType(32))

    @cuda.jit(device=True, forceinline=True)
    def st_f32(a, base, off, v):
        _st_f32(a, np.int64(base), np.uint32(off), np.float32(v))

    @cuda.jit(device=True, forceinline=True)
    def st_i32(a, base, off, v):
        _st_i32(a, np.int64(base), np.uint32(off), np.int32(v))

    @cuda.jit(device=True, forceinline=True)
    def shfl_xor(v, m):
        return cuda.shfl_xor_sync(FULL, v, m)

    @cuda.jit(device=True, forceinline=True)
    def shfl_idx(v, src):
        return cuda.shfl_sync(FULL, v, src)

    @cuda.jit(device=True, forceinline=True)
    def as_f32(bits):
        return libdevice.int_as_float(np.int32(np.uint32(bits)))

    @cuda.jit(device=True, forceinline=True)
    def warp_sum(v):
        """Sum of v over the warp's 32 lanes, in every lane (butterfly)."""
        v += shfl_xor(v, 16)
        v += shfl_xor(v, 8)
        v += shfl_xor(v, 4)
        v += shfl_xor(v, 2)
        v += shfl_xor(v, 1)
        return v

    @cuda.jit(device=True, forceinline=True)
    def warp_max(v):
        """Max of v over the warp's 32 lanes, in every lane (NaN-free inputs)."""
        v = max(v, shfl_xor(v, 16))
        v = max(v, shfl_xor(v, 8))
        v = max(v, shfl_xor(v, 4))
        v = max(v, shfl_xor(v, 2))
        v = max(v, shfl_xor(v, 1))
        return v


@device_fn
def ld_u32x2(a, base, off):
    """Two 32-bit little-endian words at an 8-aligned offset, in one load (bytes 0..3, 4..7)."""
    v = ld_u64(a, base, off)
    return np.uint32(v & np.uint64(0xFFFFFFFF)), np.uint32(v >> np.uint64(32))


@device_fn
def ld_u32_a2(a, base, off):
    """A 32-bit little-endian word at a 2-byte aligned offset (blocks of 18, 22, 34 bytes)."""
    return ld_u16(a, base, off) | (ld_u16(a, base, off + 2) << np.uint32(16))


def device_id():
    """The current GPU's number (0 in the simulator): scratch buffers are kept per GPU."""
    return 0 if SIM else cuda.get_current_device().id


def is_available():
    """True when kernels can run: a CUDA GPU, or the simulator."""
    return SIM or cuda.is_available()



_empty = {}


def empty():
    """EMPTY: a float32 device array of size 0, standing for "none" in an optional array
    argument (attention sinks, biases); one per GPU, kept (CUDA graphs hold it)."""
    key = device_id()
    a = _empty.get(key)
    if a is None:
        a = _empty[key] = cuda.device_array(0, np.float32)
    return a


def or_empty(a):
    """a, or EMPTY for None: optional arrays reach the kernels as arrays, size 0 meaning none."""
    return empty() if a is None else a
