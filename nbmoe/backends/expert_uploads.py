"""Uploads of offloaded expert tensors (weights in RAM, product on a GPU) for a prompt batch.

A plan's offloaded expert products, in run order, go through SLOTS device buffers of a
whole tensor each: tensor i fills slot i % SLOTS on a copy stream while the compute stream
works on the tensors before it, so the link keeps uploading while the GPU computes. Events
order the two streams: a product waits for its upload; an upload waits until the product
that last used its slot is done.

Which experts an upload holds, before the router has chosen:
  all of them, on the plan's first run when the batch gives each expert at least
  START_WHOLE_PAIRS (token, expert) pairs (a spread router then chooses nearly all), and
  after any run whose router chose at least WHOLE_SHARE of them;
  else the experts the router chose for that layer in the plan's previous run (none on a
  first run), whose choice of a layer changes little from batch to batch (trained routers
  and random ones alike favour some experts).
Unless an upload held every expert, the host reads the layer's choice (once for its gate,
up and down) and uploads the chosen experts the upload missed on the compute stream, before
the product. Experts keep their place in the slot, so the products read the router's ids as
they are. --upload-all-experts: every upload whole, the router never read.
"""
import numpy as np

# A first run uploads whole tensors from this many (token, expert) pairs per expert (at 4, an
# expert of a spread router goes unchosen with probability ~e^-4).
START_WHOLE_PAIRS = 4
# A layer whose router chose at least this share of the experts uploads whole tensors next run
# (no wait for the router).
WHOLE_SHARE = 0.9
# Device slots, each the size of the largest offloaded expert tensor: uploads run up to
# SLOTS - 1 tensors ahead of the products.
SLOTS = 4


def id_runs(sorted_ids):
    """[(a, b)]: maximal runs of consecutive ids, range(a, b), of a sorted id array."""
    if len(sorted_ids) == 0:
        return []
    breaks = np.flatnonzero(np.diff(sorted_ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(sorted_ids)]))
    return [(int(sorted_ids[j]), int(sorted_ids[k - 1]) + 1) for j, k in zip(starts, ends)]


class _Choice:
    """One layer's router choice, copied from the ids buffer to the host once a run (before
    the next layer's router overwrites it: the copy is queued on the compute stream)."""

    def __init__(self, backend, ids):
        self.ids, self.host = ids, backend.cuda.pinned_array(ids.shape, ids.dtype)
        self.copied = backend.cuda.event()
        self.run, self.chosen = -1, None

    def fetch(self, stream, run):
        """Queue the copy of this run's choice (after the router, on the compute stream)."""
        if self.run != run:
            self.ids.copy_to_host(self.host, stream=stream)
            self.copied.record(stream)
            self.run, self.chosen = run, None

    def experts(self):
        """The experts chosen in the run fetched last, sorted (waits for its copy)."""
        if self.chosen is None:
            self.copied.synchronize()
            self.chosen = np.unique(self.host)
        return self.chosen


class ExpertUploads:
    """The offloaded expert tensors of one plan (see the module docstring)."""

    def __init__(self, backend, upload_all=False):
        cuda = backend.cuda
        self.backend, self.upload_all = backend, upload_all
        backend.activate()      # streams and events belong to the context current when made
        self.copy_stream = cuda.stream()
        self.tensors = []       # per tensor: [host array [E, M, row_bytes], _Choice, held]
        self.uploaded = []      # per tensor: its upload's event
        self.freed = [cuda.event() for _ in range(SLOTS)]   # per slot: its last product's
        self.choices = {}       # layer -> _Choice (the layers share one ids buffer)
        self.slots, self.slot_bytes, self.run = None, 0, 0

    def add(self, host, ids, n_pairs, layer):
        """Register an expert tensor of `layer` and the ids its product reads; its index."""
        key = layer
        if key not in self.choices:
            self.choices[key] = _Choice(self.backend, ids)
        whole = self.upload_all or n_pairs >= START_WHOLE_PAIRS * host.shape[0]
        self.tensors.append([host, self.choices[key], None if whole else np.zeros(0, np.int64)])
        self.uploaded.append(self.backend.cuda.event())
        self.slot_bytes = max(self.slot_bytes, host.nbytes)
        return len(self.tensors) - 1

    def _device(self, i):
        host = self.tensors[i][0]
        return self.slots[i % SLOTS][:host.nbytes].reshape(host.shape)

    def _upload(self, i):
        """Queue tensor i's upload: every expert, or those its layer chose last run."""
        if self.slots is None:
            self.slots = [self.backend.alloc((self.slot_bytes,), np.uint8) for _ in range(SLOTS)]
            for ev in self.freed:
                ev.record(self.backend.stream)
        entry = self.tensors[i]
        host, choice = entry[0], entry[1]
        if not self.upload_all and choice.run >= 0:     # a run has shown this layer's choice
            chosen = choice.experts()
            entry[2] = None if len(chosen) >= WHOLE_SHARE * host.shape[0] else chosen
        self.freed[i % SLOTS].wait(self.copy_stream)
        held = entry[2]
        runs = [(0, host.shape[0])] if held is None else id_runs(held)
        self._copy(self._device(i), host, runs, self.copy_stream)
        self.uploaded[i].record(self.copy_stream)
        if held is None:
            self.backend.prefetched_uploads += 1

    def _copy(self, dst, host, runs, stream):
        """dst[a:b] <- host[a:b] for each run (a, b), queued on `stream`, one driver call each."""
        be = self.backend
        for a, b in runs:
            be.uploaded_bytes += host[a:b].nbytes
        if be.sim:
            for a, b in runs:
                dst[a:b].copy_to_device(host[a:b], stream=stream)
            return
        from cuda.bindings import driver as drv
        from numba.cuda.cudadrv.driver import device_pointer
        row, d, h = host.strides[0], device_pointer(dst), host.ctypes.data
        handle = drv.CUstream(int(stream.handle))
        for a, b in runs:
            err, = drv.cuMemcpyHtoDAsync(drv.CUdeviceptr(d + a * row), h + a * row, (b - a) * row, handle)
            if int(err) != 0:
                raise RuntimeError(f"CUDA driver: {err!r} uploading experts {a}-{b - 1}")

    def wait(self, i):
        """The device copy of tensor i ([E, M, row_bytes], the chosen experts in place), once
        the compute stream has waited for its upload."""
        stream = self.backend.stream
        if i == 0:                                   # a new run of the plan: fill the slots
            self.run += 1
            for j in range(min(SLOTS, len(self.tensors))):
                self._upload(j)
        host, choice, held = self.tensors[i]
        if not self.upload_all:
            choice.fetch(stream, self.run)
        dev = self._device(i)
        if held is not None:                         # add the chosen experts it missed
            missing = np.setdiff1d(choice.experts(), held, assume_unique=True)
            self._copy(dev, host, id_runs(missing), stream)
            self.backend.last_uploaded = len(held) + len(missing)
        else:
            self.backend.last_uploaded = host.shape[0]
        self.uploaded[i].wait(stream)
        return dev

    def done(self, i):
        """Tensor i's product is queued: its slot takes tensor i + SLOTS once that product ran."""
        self.freed[i % SLOTS].record(self.backend.stream)
        if i + SLOTS < len(self.tensors):
            self._upload(i + SLOTS)
