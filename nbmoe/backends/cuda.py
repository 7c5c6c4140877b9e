"""The CUDA backend: the same binders as the CPU (backends/cpu.py) over numba.cuda kernels;
those that save launches (8-bit x handed on, fused groups) are in cuda_fusion.py.

Weights placed on a GPU are uploaded once at load. A matrix op whose weight lives in RAM but
which the scheduler offloaded here (cause `off`, large batches) uploads the weight before
each run into a scratch buffer; expert products upload the experts the router is expected
to choose ahead, on a copy stream, and the ones it chose beyond them after it
(expert_uploads.py); uploaded_bytes counts what went up. PCIe runs several times faster
from page-locked than from pageable memory, so on first use the span of the file mapping
that holds the RAM-resident matrices is page-locked in place (cuda/host_memory.py): uploads
then read the file's own pages at pinned speed, with no second copy in RAM. Where the driver
refuses that, each weight gets a pinned copy on first use instead. config.PIN off
(NBMOE_NO_PIN=1) uploads straight from the pageable mapping. Expert products of cause `zc`
(a one-token MoE layer's GPU share, scheduler.py) read their RAM weights in place through
the same locked mapping, which is also mapped into the GPU's address space: nothing is
copied at all.

Several GPUs: numba-cuda allocates, launches and copies in the calling thread's current CUDA
context, so a backend makes its GPU's context current (`activate`) before it allocates or
binds, and the scheduler does so before each step of a plan that uses several GPUs. Host
buffers are then pinned for every context (portable), since any GPU may copy through them.
"""
import atexit
import functools
import inspect

import numpy as np

from nbmoe import config, progress
from nbmoe.backends.cpu import Backend
from nbmoe.backends.cuda_fusion import FusionBinders
from nbmoe.backends.expert_uploads import ExpertUploads
from nbmoe.errors import NbmoeError


def _device_index(name):
    """CUDA3 -> 3 (the tests that fake a second GPU in the simulator replace this)."""
    return int(name[4:])


_current_device = [None]    # the device whose context an `activate` made current last
_contexts_at_exit = []


def select_gpu(device):
    """Make GPU `device`'s primary context current, for code beside the backends (--ep-gpu's
    share), noted so that a backend's activate() switches back."""
    from numba import cuda
    cuda.select_device(device)
    _current_device[0] = device


def _skip_frees_at_exit():
    """With several GPUs, numba-cuda's exit-time finalizers crashed the process (a segfault or
    glibc's "double free" in cuLibraryUnload): its deferred frees are switched off at exit
    instead; the driver releases every context's memory when the process ends."""
    for ctx in _contexts_at_exit:
        held = ctx.deallocations.disable()      # a generator context: kept, never exited
        held.__enter__()
        _held_at_exit.append(held)


_held_at_exit = []


def device_names():
    """Buffer types of the visible GPUs: CUDA0, CUDA1, ... (none without numba-cuda or a GPU)."""
    try:
        from nbmoe import cuda as _  # noqa: F401  (numpy shim before numba.cuda)
        from numba import cuda
        if not cuda.is_available():
            return []
        return [f"CUDA{i}" for i in range(len(cuda.gpus))]
    except Exception:   # numba-cuda missing or no driver: a CPU-only machine
        return []


class _OnStream:
    """A kernel module whose launchers all launch on one stream: the shared binders call
    mm.mul_mat(...) as on the CPU, and the stream comes along. Other attributes pass through."""

    def __init__(self, module, stream):
        self._module, self._stream = module, stream

    def __getattr__(self, name):
        attr = getattr(self._module, name)
        if callable(attr) and "stream" in inspect.signature(attr).parameters:
            attr = functools.partial(attr, stream=self._stream)
        setattr(self, name, attr)        # looked up once
        return attr


class CUDABackend(FusionBinders, Backend):
    positions_on_device = True   # attention reads positions from the pos buffer (graphs)

    def __init__(self, name, tensors, resident, in_ram=(), zero_copy=(), flash_attn="auto",
                 upload_all=False):
        super().__init__(tensors, flash_attn)
        self.upload_all = upload_all    # --upload-all-experts: offloaded experts go up whole
        from numba import cuda

        from nbmoe.cuda import SIM, attention, expert_fill, fused, graphs, matmul, mla, moe, norm_rope, ops, x8
        self.sim = SIM
        self.cuda, self.name, self.graphs = cuda, name, graphs
        self.device = _device_index(name)
        self.max_vec_t = matmul.MMV_MAX_T
        cuda.select_device(self.device)
        self.context = cuda.current_context()
        _current_device[0] = self.device
        self.portable = not self.sim and len(cuda.gpus) > 1
        if self.portable:
            if not _contexts_at_exit:
                atexit.register(_skip_frees_at_exit)   # runs before numba-cuda's finalizers
            _contexts_at_exit.append(self.context)
        # One stream per GPU, blocking: copies on the default stream stay ordered with it.
        self.stream = cuda.stream()
        self.mm, self.ops, self.attn, self.moe, self.fused, self.norm_rope, self.x8 = (
            _OnStream(m, self.stream) for m in (matmul, ops, attention, moe, fused, norm_rope, x8))
        self.mla, self.fill = _OnStream(mla, self.stream), _OnStream(expert_fill, self.stream)
        self.resident = {}
        # RAM-resident matrices (uploaded when offloaded), those of them the GPU reads in place
        self.in_ram, self.zero_copy, self.zero_copy_views = set(in_ram) | set(zero_copy), set(zero_copy), {}
        self.ram_locked = None           # whether their span of the file mapping is page-locked
        self.vectors = {}
        self.pinned = {}
        self.scratch = {}
        self.expert_uploads = []        # per plan with offloaded expert products: ExpertUploads
        self.last_expert_uploads = None     # the one that ran last
        self.mul_mat_uploaded = 0       # RAM weight bytes uploaded for offloaded MUL_MATs
        self.pin = config.PIN
        with progress.task(f"uploading weights to {name}", sum(tensors[n].n_bytes for n in resident)) as advance:
            for n in resident:
                t = tensors[n]
                if len(t.ne) == 1:
                    self.vectors[n] = cuda.to_device(self._f32(t))
                elif getattr(t, "parts", None) and len(t.ne) == 3:
                    self.resident[n] = self._upload_merged(t)
                else:
                    self.resident[n] = cuda.to_device(np.ascontiguousarray(t.data))
                advance(t.n_bytes)
        self.weight_bytes = sum(a.nbytes for a in self.resident.values())

    def _upload_merged(self, t):
        """A merged gate_up (-muge, loader/merge.py) [E, 2F, row_bytes], uploaded from the file
        straight into its device buffer: per expert, the F gate rows, then the F up rows (no
        merged copy in RAM)."""
        gate, up = (p.data for p in t.parts)
        E, F = gate.shape[0], gate.shape[1]
        d = self.alloc(t.data_shape, np.uint8)
        for e in range(E):
            d[e, :F].copy_to_device(gate[e])
            d[e, F:].copy_to_device(up[e])
        return d

    @staticmethod
    def _f32(t):
        from nbmoe.cpu.matmul import dequantize
        return np.ascontiguousarray(dequantize(t.data.reshape(1, -1), int(t.ggml_type)).reshape(-1))

    def activate(self):
        """Make this GPU's context the thread's current one (a no-op while it is)."""
        if _current_device[0] != self.device:
            if not self.sim:
                from numba.cuda.cudadrv.driver import driver
                driver.cuCtxSetCurrent(self.context.handle)
            _current_device[0] = self.device

    def prepare(self, graph):
        self.activate()
        self._grouping = None      # a new plan: no grouping of its own bound yet (_grouped)
        super().prepare(graph)

    # -- memory ---------------------------------------------------------------------------
    def empty(self):
        self.activate()
        from nbmoe.cuda import empty
        return empty()

    def alloc(self, shape, dtype):
        self.activate()
        try:
            return self.cuda.device_array(shape, dtype)
        except Exception as e:   # CUDA_ERROR_OUT_OF_MEMORY and friends
            raise NbmoeError(f"{self.name}: cannot allocate {np.prod(shape) * np.dtype(dtype).itemsize / 2**20:.1f} MiB ({e})") from None

    def constant(self, a):
        self.activate()
        return self.ops.constant(a)

    def copy_in(self, dst, src):
        """dst (here) <- src (a host array or a device array, possibly of another GPU)."""
        self.activate()
        dst.copy_to_device(src)

    def synchronize(self):
        self.activate()
        self.cuda.synchronize()

    def graph_run(self, steps, labels=(), wait=True):
        """One step that replays these steps (launches and copies on this GPU's stream) as a
        CUDA graph, then (wait) waits for it: for the host flag of its last step if that step
        can set one (`signal`, a norm_route whose outputs the CPU reads), else the stream."""
        signal = getattr(steps[-1], "signal", None) if steps else None
        flag = None
        if wait and signal is not None and self.graphs.ENABLED:
            if self._flag is None:
                self._flag = self.mapped_alloc((1,), np.int32)   # one run in flight at a time
            flag, signal["flag"] = self._flag
        return self.graphs.GraphRun(steps, self.stream, labels, wait, flag)

    _flag = None

    def pinned_alloc(self, shape, dtype):
        """A page-locked host array (decode plans' host buffers: async, recordable copies)."""
        a = self._pinned(shape, dtype)
        a[...] = 0
        return a

    def mapped_alloc(self, shape, dtype):
        """(host array, device array) over one page-locked host buffer mapped into this GPU's
        address space: kernels read and write it over PCIe, the host sees their writes once
        the stream is synchronised (scheduler.mapped_crossings)."""
        self.activate()
        dtype = np.dtype(dtype)
        if self.sim:
            from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
            host = np.zeros(shape, dtype)
            return host, FakeCUDAArray(host)
        from numba.cuda.cudadrv.devicearray import DeviceNDArray
        n = max(int(np.prod(shape)) * dtype.itemsize, 1)
        buf = self.cuda.current_context().memhostalloc(n, mapped=True, portable=self.portable)
        host = np.ndarray(shape, dtype, buffer=buf)
        host[...] = 0
        return host, DeviceNDArray(host.shape, host.strides, dtype, gpu_data=buf)

    def _pinned(self, shape, dtype):
        self.activate()
        if not self.portable:
            return self.cuda.pinned_array(shape, dtype)
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        buf = self.cuda.current_context().memhostalloc(max(n, 1), portable=True)
        return np.ndarray(shape, dtype, buffer=buf)

    def copy_async(self, dst, src):
        """A step copying between a pinned host array and this GPU, on this GPU's stream."""
        stream = self.stream
        if isinstance(dst, np.ndarray):
            return lambda: src.copy_to_host(dst, stream=stream)
        return lambda: dst.copy_to_device(src, stream=stream)

    def supports_type(self, ggml_type):
        from nbmoe.cuda.quants import is_supported
        return is_supported(int(ggml_type))

    # -- weights --------------------------------------------------------------------------
    def weight(self, name):
        t = self.tensors[name]
        if name in self.resident:
            return self.resident[name], int(t.ggml_type)
        if name not in self.zero_copy:
            raise KeyError(f"{name} is neither on {self.name} nor readable in place")
        self.lock_ram()
        return self.mapped_view(name), int(t.ggml_type)

    def lock_ram(self):
        """Page-lock the span of the file mapping that holds the RAM-resident matrices (once;
        host_memory.register_span). NbmoeError if the driver refuses."""
        if not self.ram_locked:
            from nbmoe.cuda import host_memory
            self.ram_locked = False
            host_memory.register_span([self.tensors[n].data for n in sorted(self.in_ram)])
            self.ram_locked = True

    def mapped_view(self, name):
        """The RAM-resident weight as this GPU reads it in place (the locked file mapping)."""
        if name not in self.zero_copy_views:
            from nbmoe.cuda import host_memory
            self.activate()
            self.zero_copy_views[name] = host_memory.device_view(self.tensors[name].data)
        return self.zero_copy_views[name]

    # Offloaded products' uploads, for tests and tools (the expert ones' counted once settled)
    @property
    def uploaded_bytes(self):
        """RAM weight bytes uploaded for offloaded products."""
        return self.mul_mat_uploaded + sum(u.settled().bytes for u in self.expert_uploads)

    @property
    def prefetched_uploads(self):
        """Expert tensors uploaded whole, ahead of their products."""
        return sum(u.whole for u in self.expert_uploads)

    @property
    def last_uploaded(self):
        """Experts on the GPU for the last offloaded expert product."""
        u = self.last_expert_uploads
        return u.settled().last if u is not None else 0

    def vector(self, name):
        self.activate()
        if name not in self.vectors:
            self.vectors[name] = self.cuda.to_device(self._f32(self.tensors[name]))
        return self.vectors[name]

    def host_copy(self, name):
        """The RAM-resident weight as the source of uploads: the file's pages, page-locked in
        place on first use (lock_ram); if the driver refuses, a pinned copy."""
        t = self.tensors[name]
        if not self.pin:
            return t.data
        if self.ram_locked is None and name in self.in_ram:
            try:
                self.lock_ram()
            except NbmoeError:
                pass                     # ram_locked stays False: pinned copies
        if self.ram_locked and name in self.in_ram:
            return t.data
        if name not in self.pinned:
            p = self._pinned(t.data.shape, np.uint8)
            np.copyto(p, t.data)
            self.pinned[name] = p
        return self.pinned[name]

    def scratch_buffer(self, key, shape):
        """A device buffer reused by every offloaded op of the same kind (one weight at a time)."""
        n = int(np.prod(shape))
        b = self.scratch.get(key)
        if b is None or b.size < n:
            b = self.scratch[key] = self.alloc((n,), np.uint8)
        return b[:n].reshape(shape)

    # -- offloaded matrix ops (weight in RAM) ------------------------------------------------
    def bind_mul_mat(self, node, buf, state):
        if node.weight in self.resident:
            return self._resident_mul_mat(node, buf)
        t = self.tensors[node.weight]
        host = self.host_copy(node.weight).reshape(-1, t.data.shape[-1])
        w, qtype, mm = self.scratch_buffer("mul_mat", host.shape), int(t.ggml_type), self.mm
        out, x = buf[node.out], buf[node.srcs[0]]
        out, x = out.reshape(out.shape[0], -1), x.reshape(x.shape[0], -1)

        def run():
            w.copy_to_device(host)
            self.mul_mat_uploaded += host.nbytes
            mm.mul_mat(out, w, x, qtype)
        return run

    def bind_mul_mat_id(self, node, buf, state):
        if node.weight in self.resident or node.cause == "zc":
            return self._resident_mul_mat_id(node, buf)
        self._grouping = None                  # its mul_mat_id groups the pairs itself
        t = self.tensors[node.weight]
        host = self.host_copy(node.weight)                         # [E, M, row_bytes]
        qtype, mm = int(t.ggml_type), self.mm
        out, x, ids = buf[node.out], buf[node.srcs[0]], buf[node.srcs[1]]
        if len(x.shape) == 2:
            x = x.reshape(x.shape[0], 1, x.shape[1])
        uploads = getattr(buf, "expert_uploads", None)      # one per plan
        if uploads is None:
            uploads = buf.expert_uploads = ExpertUploads(self, self.upload_all)
            self.expert_uploads.append(uploads)
        view = self.mapped_view(node.weight) if self.ram_locked and host is t.data else None
        i = uploads.add(host, ids, ids.size, node.weight.split(".")[1], view)
        cell = {}
        self.glu_cell(node, buf, qtype, x.shape[0], x.shape[2], host.shape[1], cell)

        def run():
            w = uploads.wait(i)
            mm.mul_mat_id(out, w, x, ids, qtype, glu=cell.get("glu"))
            uploads.done(i)
        return run
