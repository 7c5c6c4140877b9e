"""Uploads of offloaded expert tensors (weights in RAM, product on a GPU) for a prompt batch.

A plan's offloaded expert products, in run order, go through device slots of a whole tensor
each: tensor i fills slot i % n_slots on a copy stream while the compute stream works on the
tensors before it, so the link keeps uploading while the GPU computes. Events order the two
streams: a product waits for its upload; an upload waits until the product that last used
its slot is done.

Which experts an upload holds, before the router has chosen:
  all of them, on the plan's first run when the batch gives each expert at least
  START_WHOLE_PAIRS (token, expert) pairs (a spread router then chooses nearly all), and
  after any run whose router chose at least WHOLE_SHARE of them;
  else the experts the router chose for that layer in the plan's last run, or last few at
  large batches (none on a first run): a layer's choice changes little from batch to batch
  (trained routers and random ones alike favour some experts).
Unless an upload held every expert, the chosen experts it lacks are copied in before the
product: by a kernel reading them from the mapped file (cuda/expert_fill.py), queued with
the products, so the host never waits for the router; where the file is not mapped for the
GPU, the host reads the layer's choice (once for its gate, up and down) and uploads them on
the compute stream. Experts keep their place in the slot, so the products read the router's
ids as they are. --upload-all-experts: every upload whole.
"""
import numpy as np

# A first run uploads whole tensors from this many (token, expert) pairs per expert (at 4, an
# expert of a spread router goes unchosen with probability ~e^-4).
START_WHOLE_PAIRS = 4
# A layer whose router chose at least this share of the experts uploads whole tensors next run.
WHOLE_SHARE = 0.9
# An upload holds the experts its layer chose in this many runs before: 1 while the link
# sets the pace (ahead bytes cost what missed ones do), more from RECENT_MORE_PAIRS (token,
# expert) pairs per expert, where missed experts wait on the products' stream and ahead ones
# hide under the products.
RECENT_RUNS, RECENT_RUNS_LARGE, RECENT_MORE_PAIRS = 1, 4, 64
# Device slots (uploads run up to n_slots - 1 tensors ahead of the products): as many as fit
# in SLOT_BYTES, between MIN_SLOTS and MAX_SLOTS.
MIN_SLOTS, MAX_SLOTS, SLOT_BYTES = 2, 8, 2 << 30


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
        self.run, self.chosen, self.before = -1, None, []

    def fetch(self, stream, run):
        """Queue the copy of this run's choice (after the router, on the compute stream)."""
        if self.run != run:
            if self.run >= 0:
                self.before = ([self.experts()] + self.before)[:RECENT_RUNS_LARGE - 1]
            self.ids.copy_to_host(self.host, stream=stream)
            self.copied.record(stream)
            self.run, self.chosen = run, None

    def experts(self):
        """The experts chosen in the run fetched last, sorted (waits for its copy)."""
        if self.chosen is None:
            self.copied.synchronize()
            self.chosen = np.flatnonzero(np.bincount(self.host.ravel()))   # sorted, unique
        return self.chosen

    def recent(self, runs):
        """The experts chosen in the last `runs` runs fetched."""
        out = self.experts()
        for chosen in self.before[:runs - 1]:
            out = np.union1d(out, chosen)
        return out


class _Tensor:
    """An offloaded expert tensor: host [E, M, row_bytes], its layer's choice, the experts its
    upload holds (None: all), and for the kernel that completes it the file's mapping as the
    GPU sees it and a held mask per run parity (mapped host memory)."""

    def __init__(self, host, choice, held, view, runs):
        self.host, self.choice, self.held, self.view = host, choice, held, view
        self.runs = runs           # the runs whose choices an upload holds
        self.masks = None          # [(host, device)] for runs of even, odd number
        self.pending = None        # (held, run) of a completed upload whose choice is unread
        self.device = None         # its slot's bytes as [E, M, row_bytes] (made once)
        self.fill = None           # the completing kernel's operands (made once)


class ExpertUploads:
    """The offloaded expert tensors of one plan (see the module docstring)."""

    def __init__(self, backend, upload_all=False):
        cuda = backend.cuda
        self.backend, self.upload_all = backend, upload_all
        backend.activate()      # streams and events belong to the context current when made
        self.copy_stream = cuda.stream()
        self.tensors, self.uploaded = [], []    # per tensor: _Tensor, its upload's event
        self.choices = {}       # layer -> _Choice (the layers share one ids buffer)
        self.slots, self.freed, self.slot_bytes, self.run = None, None, 0, 0
        self.bytes = 0          # bytes uploaded (the completing kernels' once settled)
        self.missed_bytes = 0   # of them, chosen experts an upload ahead lacked
        self.whole = 0          # uploads that held every expert
        self.last = 0           # experts on the GPU for the last product (once settled)

    def add(self, host, ids, n_pairs, layer, view=None):
        """Register an expert tensor of `layer` and the ids its product reads (view: host as a
        device array, for the kernel that completes uploads); its index."""
        if layer not in self.choices:
            self.choices[layer] = _Choice(self.backend, ids)
        whole = self.upload_all or n_pairs >= START_WHOLE_PAIRS * host.shape[0]
        held = None if whole else np.zeros(0, np.int64)
        runs = RECENT_RUNS_LARGE if n_pairs >= RECENT_MORE_PAIRS * host.shape[0] else RECENT_RUNS
        self.tensors.append(_Tensor(host, self.choices[layer], held, view, runs))
        self.uploaded.append(self.backend.cuda.event())
        self.slot_bytes = max(self.slot_bytes, host.nbytes)
        return len(self.tensors) - 1

    @property
    def n_slots(self):
        fit = SLOT_BYTES // max(self.slot_bytes, 1)
        return int(min(MAX_SLOTS, len(self.tensors), max(MIN_SLOTS, fit)))

    def _device(self, i):
        t = self.tensors[i]
        if t.device is None:        # a device array's slicing costs the host tens of microseconds
            t.device = self.slots[i % len(self.slots)][:t.host.nbytes].reshape(t.host.shape)
        return t.device

    def _upload(self, i):
        """Queue tensor i's upload: every expert, or those its layer chose recently."""
        be, t = self.backend, self.tensors[i]
        if self.slots is None:
            self.slots = [be.alloc((self.slot_bytes,), np.uint8) for _ in range(self.n_slots)]
            self.freed = [be.cuda.event() for _ in self.slots]
            for ev in self.freed:
                ev.record(be.stream)
        if not self.upload_all and t.choice.run >= 0:     # a run has shown this layer's choice
            recent = t.choice.recent(t.runs)
            t.held = None if len(t.choice.experts()) >= WHOLE_SHARE * t.host.shape[0] else recent
        slot = i % len(self.slots)
        self.freed[slot].wait(self.copy_stream)
        runs = [(0, t.host.shape[0])] if t.held is None else id_runs(t.held)
        self._copy(self._device(i), t.host, runs, self.copy_stream)
        self.uploaded[i].record(self.copy_stream)
        if t.held is None:
            self.whole += 1

    def _copy(self, dst, host, runs, stream):
        """dst[a:b] <- host[a:b] for each run (a, b), queued on `stream`, one driver call each."""
        be = self.backend
        self.bytes += sum(b - a for a, b in runs) * host.strides[0]
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

    def _complete(self, i, dev):
        """Queue the copy of the chosen experts that tensor i's upload lacks."""
        be, t = self.backend, self.tensors[i]
        if t.view is None:                           # the host reads the choice first
            self._copy(dev, t.host, id_runs(self._missed(t, t.held)), be.stream)
            return
        if t.masks is None:
            self._make_masks()
        host_mask, mask = t.masks[self.run % 2]      # run r - 2, its last reader, is done
        host_mask[:] = 0
        host_mask[t.held] = 1
        if t.fill is None:
            t.fill = be.fill.fill_operands(dev, t.view, t.choice.ids)
        be.fill.fill_chosen(dev, t.view, t.choice.ids, mask, operands=t.fill)
        t.pending = (t.held, self.run)

    def _make_masks(self):
        """Every tensor's two held masks, in one mapped host buffer."""
        E = max(t.host.shape[0] for t in self.tensors)
        host, dev = self.backend.mapped_alloc((len(self.tensors), 2, E), np.int32)
        for i, t in enumerate(self.tensors):
            n = t.host.shape[0]
            t.masks = [(host[i, p, :n], dev[i, p, :n]) for p in range(2)]

    def _missed(self, t, held):
        """The experts t's layer chose beyond `held`, counted in missed_bytes and last."""
        missing = np.setdiff1d(t.choice.experts(), held, assume_unique=True)
        self.missed_bytes += len(missing) * t.host.strides[0]
        self.last = len(held) + len(missing)
        return missing

    def settled(self):
        """Self, with the bytes the completing kernels copied counted (their choices read)."""
        for t in self.tensors:
            if t.pending is not None and t.pending[1] == t.choice.run:
                held, t.pending = t.pending[0], None
                self.bytes += len(self._missed(t, held)) * t.host.strides[0]
        return self

    def wait(self, i):
        """The device copy of tensor i ([E, M, row_bytes], the chosen experts in place), once
        the compute stream has waited for its upload."""
        be = self.backend
        if i == 0:                                   # a new run of the plan: fill the slots
            self.settled()
            self.run += 1
            for j in range(self.n_slots):
                self._upload(j)
        t = self.tensors[i]
        if not self.upload_all:
            t.choice.fetch(be.stream, self.run)
        dev = self._device(i)
        self.uploaded[i].wait(be.stream)
        be.last_expert_uploads = self
        if t.held is None:
            self.last = t.host.shape[0]
        else:
            self._complete(i, dev)
        return dev

    def done(self, i):
        """Tensor i's product is queued: its slot takes tensor i + n_slots once that product ran."""
        self.freed[i % len(self.slots)].record(self.backend.stream)
        if i + len(self.slots) < len(self.tensors):
            self._upload(i + len(self.slots))
