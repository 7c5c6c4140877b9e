"""Kernels compiled for the weight types a model has, not for every type.

A kernel that takes qtype as a run-time int holds every type's code, and LLVM optimizes all
of it again in each kernel that calls it (5-20 s apiece at a cold start). Here such a kernel is
written as a factory of its constants (qtype, int8, ...) that returns an @njit closure: in the
closure they are compile-time constants, and Numba's cache keeps one entry per set of them (it
hashes a closure's cell contents). A dispatch function (`if qtype == Q4_0: ...`) called with a
constant compiles, with ConstantArgs, to a copy that holds that type's branch alone.

entry() makes the function callers use, with the kernel's usual signature. From Python it
builds (once) and calls the kernel of the arguments' constants; from @njit code, where those
arguments must be compile-time constants (a caller's own closure constants), an overload
links the same kernel. The kernel itself takes the other arguments only.
"""
import inspect

from numba.core import ir, types
from numba.core.analysis import dead_branch_prune
from numba.core.compiler import CompilerBase, DefaultPassBuilder
from numba.core.compiler_machinery import FunctionPass, register_pass
from numba.core.ir_utils import build_definitions
from numba.core.untyped_passes import IRProcessing
from numba.extending import overload

_built = {}


def build(factory, key):
    """factory(*key), built once per key (a tuple of ints and bools; numpy scalars find the
    same kernel, and are made Python ints first: Numba's cache key pickles them)."""
    kernel = _built.get((factory, key))
    if kernel is None:
        key = _plain(key)
        kernel = _built.get((factory, key))
        if kernel is None:
            kernel = _built[(factory, key)] = factory(*key)
            kernel.nbmoe_origin = (factory.__module__, factory.__qualname__, key)   # load_order
            # The machine code's symbol names come from the qualname (and a number each
            # process counts): the kernels of one factory must not share it, or code cached
            # by one process links another kernel's code in the next.
            kernel.py_func.__qualname__ += "_" + _suffix(key)
    return kernel


def _suffix(key):
    """The constants as a name: (3, True) -> '3_1'."""
    return "_".join(str(int(v)) for v in _flat(key))


def _flat(v):
    return [x for item in v for x in _flat(item)] if isinstance(v, tuple) else [v]


def _constant(ty):
    """The value of a compile-time constant argument's Numba type (None if it is not one)."""
    if isinstance(ty, types.Literal):
        return ty.literal_value
    if isinstance(ty, types.BaseTuple) and all(isinstance(t, types.Literal) for t in ty):
        return tuple(t.literal_value for t in ty)
    return None


def _plain(v):
    """A key value as Python ints and bools (numpy scalars and nested tuples converted)."""
    if isinstance(v, tuple):
        return tuple(_plain(x) for x in v)
    return bool(v) if isinstance(v, bool) or type(v).__name__ == "bool_" else int(v)


def entry(factory, signature):
    """The callable for factory's kernels: signature names every argument in order, among
    them the factory's own parameters (the constants), which the kernel does not take."""
    names = [n.strip() for n in signature.split(",")]
    consts = list(inspect.signature(factory).parameters)
    key = ", ".join(consts) + ("," if len(consts) == 1 else "")
    rest = ", ".join(n for n in names if n not in consts)
    scope = {"build": build, "factory": factory, "__name__": factory.__module__}
    exec(f"def call({', '.join(names)}):\n    return build(factory, ({key}))({rest})", scope)
    call = scope["call"]
    call.__name__ = call.__qualname__ = factory.__name__.removesuffix("_kernel")
    call.__doc__ = factory.__doc__
    at = [names.index(n) for n in consts]

    @overload(call, prefer_literal=True, strict=False, jit_options={"error_model": "numpy"})
    def _typed(*args):
        values = [_constant(args[i]) for i in at]
        if any(v is None for v in values):
            return None
        key = tuple(values)
        kernel, name = build(factory, key), f"{call.__name__}_{_suffix(key)}"     # (see build)
        impl = {"kernel": kernel, "__name__": factory.__module__}
        exec(f"def {name}({', '.join(names)}):\n    return kernel({rest})", impl)
        return impl[name]
    return call


@register_pass(mutates_CFG=True, analysis_only=False)
class _PruneByLiteralArgs(FunctionPass):
    """Arguments of an int or bool literal type become constants, and the branches they decide
    are pruned until none is left (Numba's own pruning sees a constant argument only in
    `x is None`, and keeps a variable's definitions from pruned blocks until a later pass)."""
    _name = "nbmoe_prune_by_literal_args"

    def __init__(self):
        FunctionPass.__init__(self)

    def run_pass(self, state):
        func_ir, changed = state.func_ir, False
        for block in func_ir.blocks.values():
            for stmt in block.body:
                if isinstance(stmt, ir.Assign) and isinstance(stmt.value, ir.Arg):
                    ty = state.args[stmt.value.index]
                    if isinstance(ty, (types.IntegerLiteral, types.BooleanLiteral)):
                        stmt.value = ir.Const(ty.literal_value, stmt.value.loc)
                        changed = True
        func_ir._definitions = build_definitions(func_ir.blocks)
        while True:
            n = len(func_ir.blocks)
            dead_branch_prune(func_ir, state.args)
            func_ir._definitions = build_definitions(func_ir.blocks)
            if len(func_ir.blocks) == n:
                return changed
            changed = True


class ConstantArgs(CompilerBase):
    """The nopython pipeline for dispatch functions (@njit(pipeline_class=ConstantArgs)): a call
    with a constant qtype compiles a copy holding that type's branch alone (its callees'
    code is linked, and LLVM re-optimizes it, in every kernel that calls it); a run-time
    qtype compiles every branch, as before."""

    def define_pipelines(self):
        pm = DefaultPassBuilder.define_nopython_pipeline(self.state)
        pm.add_pass_after(_PruneByLiteralArgs, IRProcessing)
        pm.finalize()
        return [pm]
