"""GPU kernels reading the GGUF file's mapping in place ("zero copy").

The file is mapped read-only (gguf_file.py); its pages are page-locked and mapped into every
GPU's address space with one cuMemHostRegister(READ_ONLY | DEVICEMAP | PORTABLE) over the span
of the tensors asked for, without copying a byte. A kernel's loads from such an array go over
PCIe, with the same results as from device copies. The pages stay locked until the mapping
is closed. Where the span has holes of at least GAP_BYTES between the tensors (the file's
up and gate experts, merged elsewhere by -muge), each part is registered on its own, so
that the hole's pages are neither read in nor locked.
"""
import mmap
import weakref

import numpy as np

from nbmoe import progress

from . import SIM

READ_IN_STEP = 256 << 20       # bytes read in per step of the progress bar
GAP_BYTES = 16 << 20           # a hole in a span from which its two sides register apart

_spans = {}      # id(mapping) -> [(lo, hi)] registered address ranges


def _mapping(a):
    """The mmap object a numpy view over it (np.frombuffer) comes from."""
    base = a.base
    while base is not None and not isinstance(base, (mmap.mmap, memoryview)):
        base = getattr(base, "base", None)
    if isinstance(base, memoryview):
        base = base.obj
    if not isinstance(base, mmap.mmap):
        raise ValueError("zero-copy weights must be views of the GGUF file's mapping")
    return base


def register_span(arrays):
    """Page-lock, per mapping (the file's; -muge's merged experts in RAM have one of their
    own), the address range covering its `arrays` for the GPUs, unless it lies inside a
    range registered before. Idempotent; no-op in the simulator."""
    if SIM or not arrays:
        return
    by_map = {}
    for a in arrays:
        m = _mapping(a)
        by_map.setdefault(id(m), (m, []))[1].append(a)
    for m, group in by_map.values():
        _register(m, group)


def spans_of(arrays, gap=None):
    """Page-aligned [lo, hi) address ranges covering `arrays`, one per run of them whose holes
    are all smaller than `gap` (GAP_BYTES)."""
    page, gap = mmap.PAGESIZE, GAP_BYTES if gap is None else gap
    out = []
    for lo, hi in sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays if a.nbytes):
        lo, hi = lo // page * page, -(-hi // page) * page
        if out and lo - out[-1][1] < gap:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [tuple(s) for s in out]


def _register(m, arrays):
    from cuda.bindings import driver as drv
    from numba import cuda
    cuda.current_context()              # the driver initialised, a context current
    spans = _spans.setdefault(id(m), [])
    todo = [(lo, hi) for lo, hi in spans_of(arrays)
            if not any(s_lo <= lo and hi <= s_hi for s_lo, s_hi in spans)]
    if not todo:
        return
    flags = (drv.CU_MEMHOSTREGISTER_READ_ONLY | drv.CU_MEMHOSTREGISTER_DEVICEMAP
             | drv.CU_MEMHOSTREGISTER_PORTABLE)
    with progress.task("reading the RAM weights in to page-lock them",
                       sum(hi - lo for lo, hi in todo)) as advance:
        for lo, hi in todo:
            _read_in(m, lo, hi, advance)
            err, = drv.cuMemHostRegister(lo, hi - lo, int(flags))
            if int(err) != 0:
                from nbmoe.errors import NbmoeError
                raise NbmoeError(f"could not page-lock {(hi - lo) >> 20} MiB of the model file for "
                                 f"the GPU to read in place ({err!r}); run without -zce")
            spans.append((lo, hi))
            weakref.finalize(m, _unregister, id(m), lo)


def _read_in(m, lo, hi, advance=None):
    """Fault the span's pages in from the file, a byte per page, in steps that move a
    progress bar (advance: a task's, else one of its own); page-locking them afterwards
    then waits on no disk."""
    if advance is None:
        with progress.task("reading the RAM weights in to page-lock them", hi - lo) as advance:
            return _read_in(m, lo, hi, advance)
    whole = np.frombuffer(m, np.uint8)
    base = whole.ctypes.data
    for a, b in progress.chunks(hi - lo, READ_IN_STEP):
        int(whole[lo - base + a:lo - base + b:mmap.PAGESIZE].sum())
        advance(b - a)


def _unregister(key, lo):
    from cuda.bindings import driver as drv
    drv.cuMemHostUnregister(lo)
    _spans.pop(key, None)


def device_view(a):
    """A device array over the host array `a` (inside a registered span), for the current
    GPU context: no copy; the simulator's stand-in wraps `a` itself."""
    from numba import cuda
    if SIM:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        return FakeCUDAArray(a)
    from cuda.bindings import driver as drv
    err, ptr = drv.cuMemHostGetDevicePointer(a.ctypes.data, 0)
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver: {err!r} (is the span registered?)")
    desc = {"shape": a.shape, "typestr": a.dtype.str, "data": (int(ptr), True), "version": 3,
            "strides": None if a.flags.c_contiguous else a.strides}
    return cuda.from_cuda_array_interface(desc, owner=a, sync=False)
