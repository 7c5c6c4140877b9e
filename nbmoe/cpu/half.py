"""Half-precision (f16) and bfloat16 conversions for Numba CPU kernels.

Numba's CPU target has no float16 type, so f16 data travels as uint16 bit patterns.
LLVM does know `half`: bitcasting the bits to half and extending to float lets LLVM
emit the hardware conversion (vcvtph2ps with F16C), which also vectorizes.
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic


@intrinsic
def f16_to_f32(typingctx, bits):
    """uint16 f16 bit pattern -> float32 (exact)."""
    if bits != types.uint16:
        return None
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


@intrinsic
def f32_to_f16(typingctx, value):
    """float32 -> uint16 f16 bit pattern, rounded to nearest even."""
    if value != types.float32:
        return None
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


@njit(inline="always")
def bf16_to_f32(bits):
    """uint16 bfloat16 bit pattern -> float32: the top half of an f32."""
    return np.uint32(np.uint32(bits) << np.uint32(16)).view(np.float32)
