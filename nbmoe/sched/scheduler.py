"""The scheduler: gives every graph node a backend, cuts the graph into splits, binds calls
and inserts the activation copies between backends.

Assignment (recorded per node in `node.cause`, shown by --explain), like llama.cpp's:
  wgt  the node multiplies by a weight: it runs where that weight lives
  kv   attention runs where its layer's KV cache lives (the layer's device)
  off  the weight lives in RAM but the batch is large enough that copying the weight to a
       GPU and computing there wins (OffloadPolicy)
  inp  no weight, or a small one (FOLLOW_INPUTS): it runs where most of its input bytes
       already are (ties go to a GPU, where the next weighted op usually is, then to the
       backend that made an input last: the residual add after a layer split follows the
       new GPU), so the fewest bytes cross
  def  nothing to follow (graph inputs only): the CPU
  zc   a one-token MoE layer's GPU share of the chosen experts (zero_copy.split_expert_slots):
       the GPU that routed computes them reading the expert weights from RAM over PCIe (zero
       copy, no upload), at the same time as the CPU computes the other experts; and the
       layer's shared experts, whose weights that GPU holds
A split is a maximal run of consecutive nodes on one backend. Walking the nodes in order,
the scheduler tracks on which backends each buffer's current value is; when a split starts,
every buffer it reads that is not valid on its backend gets a copy step (all at once, so a
decoding GPU split ends with all the copies the next CPU split needs, in one CUDA graph).
The zc nodes' steps are moved after those copies and launched as a graph of their own that
the host does not wait for: the host waits for the routing and the copies only, then
computes the CPU's experts while the GPU computes its share.

On a GPU each run of consecutive GPU steps becomes one CUDA graph replay (cuda/graphs.py),
one host call instead of a launch per kernel: for decoding batches (up to GRAPH_MAX_T
tokens) and for prompt batches (graphed_batch; a 512-token batch of a 48-layer MoE makes
~1100 launches, more host time than GPU time). Copies from host memory and offloaded
products (their uploads run on a stream of their own) stay outside, between the graphs.
--timings replays each step of such a run as a graph of its own between CUDA events.
Small buffers that cross between the CPU and one GPU and that the GPU touches once per
crossing (the router's choices and weights out of a layer's GPU split, the CPU experts'
output back in: `mapped_crossings`) live in host memory mapped into the GPU's address space:
the GPU kernel writes (reads) them there over PCIe, the graph holds no copy for them.
The small buffers the CPU reads that the GPU reads too (the normed x, and with -zce the
router's choices) are mirrored instead: their CPU buffer is mapped host memory, and the
kernel that writes them (norm_route) writes both copies (`mirror_candidates`). So a hybrid
decode layer's graph holds no copy at all.
config.MAPPED off (NBMOE_NO_MAPPED=1) copies them as the others.
"""
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from nbmoe import config
from nbmoe.model.graph import OPS

# Batch rows from which an op whose weight is in RAM runs on a GPU (llama.cpp's choice):
# below it, copying the weight over PCIe costs more than the CPU computing the product.
OFFLOAD_MIN_BATCH = 32
# Ops whose small weight (a bias, the selection bias) goes where their input is, not the reverse.
FOLLOW_INPUTS = ("ADD_BIAS", "ADD_BIAS_ID", "TOPK_MOE")
# Batches up to which runs of GPU steps are always recorded and replayed as CUDA graphs
# (larger ones: graphed_batch).
GRAPH_MAX_T = 8
# Crossing buffers up to this size may be mapped host memory (see mapped_crossings).
MAPPED_MAX_BYTES = 64 << 10


EXPERT_OPS = ("MUL_MAT_ID", "MUL_MAT_ID_GLU")      # expert products, plain and fused


@dataclass
class OffloadPolicy:
    """Which op types may run on a GPU with a weight that lives in RAM (-op)."""
    enabled: dict = field(default_factory=lambda: {op: True for op in (
        "MUL_MAT", "MUL_MAT_ID", "MUL_MAT_ID_GLU")})

    @classmethod
    def parse(cls, spec):
        """`-op NAME_OR_ID,0|1,...` (`-1` = every op) -> policy."""
        from nbmoe.errors import NbmoeError
        pol = cls()
        items = [s.strip() for s in str(spec).split(",") if s.strip()] if spec else []
        if len(items) % 2:
            raise NbmoeError(f"bad -op {spec!r}: expected pairs OP,0|1 (OP a name, an id or -1)")
        for name, flag in zip(items[::2], items[1::2]):
            if flag not in ("0", "1"):
                raise NbmoeError(f"bad -op flag {flag!r} for {name}: use 0 or 1")
            if name == "-1":
                targets = list(pol.enabled)
            elif name.isdigit() and int(name) < len(OPS):
                targets = [OPS[int(name)]]
            elif name.upper() in OPS:
                targets = [name.upper()]
            else:
                raise NbmoeError(f"unknown op {name!r} in -op; ops: {', '.join(OPS)}")
            for op in targets:
                pol.enabled[op] = flag == "1"
        return pol

    def without_experts(self):
        """This policy with the expert products kept where their weights are (--ep: the
        ranks compute them)."""
        return OffloadPolicy({**self.enabled, **{op: False for op in EXPERT_OPS}})

    def min_batch(self, op, cfg):
        if op in EXPERT_OPS:   # each expert sees about T * A / E rows
            return OFFLOAD_MIN_BATCH * cfg.n_expert // max(1, cfg.n_expert_used)
        return OFFLOAD_MIN_BATCH

    def offload(self, node, n_tokens, cfg):
        op = node.policy_op        # the gate and up of a fused MUL_MAT_ID_GLU: that op's switch
        return self.enabled.get(op, False) and n_tokens >= self.min_batch(op, cfg)


@dataclass
class Split:
    backend: str
    nodes: list


@dataclass
class Copy:
    buffer: str
    src: str
    dst: str
    n_bytes: int
    mapped: bool = False      # no copy step: the GPU reads / writes the host buffer itself


class Plan:
    """A bound graph: `run()` executes it; `run_timed(acc)` adds seconds per op type to acc."""

    def __init__(self, graph, splits, steps, labels, buffers, copies, backends):
        self.graph, self.splits, self.steps, self.labels = graph, splits, steps, labels
        self.buffers, self.copies, self.backends = buffers, copies, backends

    def run(self):
        for step in self.steps:
            step()

    def run_timed(self, acc):
        """Like run, but each step is timed (GPU steps synchronised first, so their time is
        their own): acc[(backend, op)] += seconds; copies are ("COPY", dst). The steps of a
        recorded CUDA graph are timed one by one on the GPU (GraphRun.run_timed), or, when
        acc.whole_graphs is set, each graph as one step as it runs untimed (launch, device
        time and the wait at its end: the real cost of a GPU segment in a hybrid token)."""
        clock = time.perf_counter
        whole = getattr(acc, "whole_graphs", False)
        for (backend, what), step in zip(self.labels, self.steps):
            if hasattr(step, "run_timed") and not whole:
                step.run_timed(acc)
                continue
            t0 = clock()
            step()
            if not getattr(step, "waits_itself", False):
                self.backends[backend].synchronize()
            acc[(backend, what)] += clock() - t0

    @property
    def copy_bytes(self):
        return sum(c.n_bytes for c in self.copies)

    @property
    def launch_ahead(self):
        """The plan's _LaunchAhead steps (one a layer with a GPU share of its experts)."""
        return [getattr(s, "step", s) for s in self.steps
                if isinstance(getattr(s, "step", s), _LaunchAhead)]


def assign_backends(graph, weight_backend, policy=None, cfg=None, gpu=None, cache_backend=None):
    """Set node.backend and node.cause for every node (see the module docstring)."""
    producer, made_at = {}, {}
    for i, node in enumerate(graph.nodes):
        if node.params.get("zero_copy") and producer.get("expert_ids", "CPU") != "CPU":
            node.backend, node.cause = producer["expert_ids"], "zc"
        elif node.op == "ATTN" and cache_backend is not None:
            node.backend, node.cause = cache_backend(node.params["layer"]), "kv"
        elif node.weight is not None and node.op not in FOLLOW_INPUTS:
            node.backend, node.cause = weight_backend(node.weight), "wgt"
            if (node.backend == "CPU" and gpu and policy is not None and node.op != "GET_ROWS"
                    and policy.offload(node, graph.n_tokens, cfg)):
                node.backend, node.cause = gpu, "off"
        else:
            on, latest = defaultdict(int), {}
            for s in node.srcs:
                if s in producer:
                    b = graph.buffers[s]
                    on[producer[s]] += int(np.prod(b.shape)) * np.dtype(b.dtype).itemsize
                    latest[producer[s]] = max(latest.get(producer[s], -1), made_at[s])
            if on:
                node.backend = max(on, key=lambda be: (on[be], be != "CPU", latest[be]))
                node.cause = "inp"
            else:
                node.backend, node.cause = "CPU", "def"
        for out in node.outs:
            producer[out], made_at[out] = node.backend, i


def make_splits(graph):
    splits = []
    for node in graph.nodes:
        if not splits or splits[-1].backend != node.backend:
            splits.append(Split(node.backend, []))
        splits[-1].nodes.append(node)
    return splits


class _Buffers(dict):
    """One backend's activation buffers, allocated when first asked for. mirrors (a GPU's):
    name -> the GPU's view of the host buffer that a kernel writing `name` may also write
    (mirror_candidates)."""

    def __init__(self, backend, graph, alloc=None):
        super().__init__()
        self.graph, self.alloc = graph, alloc or backend.alloc
        self.mirrors = {}

    def __missing__(self, name):
        b = self.graph.buffers[name]
        arr = self[name] = self.alloc(b.shape, b.dtype)
        return arr


def make_plan(graph, backends, state, weight_backend=lambda name: "CPU", policy=None, cfg=None,
              prompt_graphs=True):
    gpus = [name for name in backends if name != "CPU"]
    assign_backends(graph, weight_backend, policy, cfg, gpus[0] if gpus else None,
                    lambda layer: state.kv.backends[layer])
    # Decoding with GPUs: host buffers pinned, so that copies run on the GPU's stream and a
    # CUDA graph can hold them with the kernels (graph mode, see the module docstring).
    graph_mode = gpus and all(hasattr(backends[g], "graph_run") for g in gpus) and graphed_batch(
        graph, prompt_graphs)
    bufs = {name: _Buffers(be, graph, backends[gpus[0]].pinned_alloc
                           if graph_mode and name == "CPU" else None)
            for name, be in backends.items()}
    mapped = set()
    if graph_mode and len(gpus) == 1 and config.MAPPED:
        mapped = mapped_crossings(graph, gpus[0])
        for name in mapped:
            b = graph.buffers[name]
            bufs["CPU"][name], bufs[gpus[0]][name] = backends[gpus[0]].mapped_alloc(b.shape, b.dtype)
        for name in mirror_candidates(graph, gpus[0]) - mapped:
            b = graph.buffers[name]
            bufs["CPU"][name], bufs[gpus[0]].mirrors[name] = backends[gpus[0]].mapped_alloc(b.shape, b.dtype)
    valid = {name: {"CPU"} for name in graph.inputs}
    steps, labels, copies = [], [], []
    runs_on = []             # per step: the backend that executes it
    record_on = {}           # step index -> the GPU whose graph may hold it (graph mode)
    ahead = set()            # step indices of zc steps: launched, not waited for
    deferred = []            # zc steps bound, not yet placed: (step, label, backend, outs)

    def ensure(name, where):
        """Make buffer `name` current on backend `where`, adding a copy step if needed."""
        if where in valid[name]:
            return
        if any(name in outs for *_, outs in deferred):
            raise AssertionError(f"{name} is copied before the zero-copy step that writes it")
        src = "CPU" if "CPU" in valid[name] else sorted(valid[name])[0]
        s_arr, d_arr = bufs[src][name], bufs[where][name]
        if name in mapped:                            # one buffer, seen by both: no step
            copies.append(Copy(name, src, where, int(s_arr.nbytes), mapped=True))
            valid[name].add(where)
            return
        if graph_mode and "CPU" in (src, where):      # host <-> GPU through pinned memory
            gpu = where if src == "CPU" else src
            record_on[len(steps)] = gpu
            steps.append(backends[gpu].copy_async(d_arr, s_arr))
        else:
            dst_be = backends[where]
            steps.append(lambda: dst_be.copy_in(d_arr, s_arr))
        runs_on.append(src if where == "CPU" else where)
        labels.append((where, "COPY"))
        copies.append(Copy(name, src, where, int(s_arr.nbytes)))
        valid[name].add(where)

    def place_deferred():
        """The zc steps bound so far, after the copies emitted since (see the docstring)."""
        for step, label, backend, _ in deferred:
            if graph_mode:
                record_on[len(steps)] = backend
                ahead.add(len(steps))
            steps.append(step)
            runs_on.append(backend)
            labels.append(label)
        deferred.clear()

    for be in backends.values():
        be.prepare(graph)
    nodes = graph.nodes
    for i, node in enumerate(nodes):
        if i == 0 or nodes[i - 1].backend != node.backend:
            for src in _split_inputs(nodes, i):   # all of a split's copies at its start
                ensure(src, node.backend)
        for src in node.srcs:
            ensure(src, node.backend)
        step = backends[node.backend].bind(node, bufs[node.backend], state)
        for out in node.outs:
            valid[out] = {node.backend}
        for name in getattr(step, "mirrors", ()):     # also written to the host: no copy step
            valid[name].add("CPU")
            copies.append(Copy(name, node.backend, "CPU", int(bufs["CPU"][name].nbytes), mapped=True))
        if node.cause != "zc":
            place_deferred()
        if getattr(step, "skip", False):      # a fused group's member: another step does it
            continue
        label = (node.backend, getattr(step, "label", node.op))
        before = getattr(step, "before", None)     # an unrecorded step ahead of this one
        if before is not None:
            steps.append(before)
            runs_on.append(node.backend)
            labels.append(label)
        if node.cause == "zc":
            deferred.append((step, label, node.backend, node.outs))
            continue
        if graph_mode and node.backend != "CPU" and node.cause != "off":
            record_on[len(steps)] = node.backend
        steps.append(step)
        runs_on.append(node.backend)
        labels.append(label)
    place_deferred()
    if "logits" in valid:
        ensure("logits", "CPU")
    if graph_mode:
        steps, labels, runs_on = _graph_runs(steps, labels, runs_on, record_on, backends, ahead)
    if len(gpus) > 1:
        steps = [step if be == "CPU" else _OnGPU(step, backends[be]) for step, be in zip(steps, runs_on)]
    host = {name: bufs["CPU"][name] for name in graph.inputs}
    if "logits" in valid:
        host["logits"] = bufs["CPU"]["logits"]
    return Plan(graph, make_splits(graph), steps, labels, host, copies, backends)


def graphed_batch(graph, prompt_graphs=True):
    """Whether a plan's GPU runs are CUDA graphs: decoding batches always; prompt batches
    (config.PROMPT_GRAPHS; prompt_graphs False: the engine serves several slots, whose caches
    a recording would need a plan each for). Offloaded products stay outside the graphs
    (config.OFFLOADED_PROMPT_GRAPHS off: their plans record nothing)."""
    if graph.n_tokens <= GRAPH_MAX_T:
        return True
    return (config.PROMPT_GRAPHS and prompt_graphs
            and (config.OFFLOADED_PROMPT_GRAPHS or not any(node.cause == "off" for node in graph.nodes)))


def mapped_crossings(graph, gpu):
    """Buffers (at most MAPPED_MAX_BYTES) that cross between the CPU and `gpu`, where the GPU
    reads a value the CPU wrote in one node only and never reads a value it wrote itself: a
    kernel touches them once per crossing, so mapped host memory costs it one PCIe trip and
    saves the graph a copy. Not the graph's inputs (the position is read by many kernels) and
    not the residual stream (read and written by every GPU node of a layer)."""
    writer, gpu_reads, crossing, bad = {}, {}, set(), set(graph.inputs)
    for node in graph.nodes:
        for src in node.srcs:
            w = writer.get(src, "CPU")
            if node.backend == gpu:
                if w == gpu:
                    bad.add(src)                      # the GPU reads its own value
                elif w == "CPU":
                    crossing.add(src)
                    gpu_reads[src] = gpu_reads.get(src, 0) + 1
                    if gpu_reads[src] > 1:
                        bad.add(src)                  # several GPU readers of one CPU value
                else:
                    bad.add(src)
            elif node.backend == "CPU" and w == gpu:
                crossing.add(src)
        for out in node.outs:
            writer[out], gpu_reads[out] = node.backend, 0
    return _small(graph, crossing - bad)


def mirror_candidates(graph, gpu):
    """Small buffers a `gpu` node writes and a CPU node reads next (mapped_crossings excluded
    the ones the GPU reads too, e.g. the router's choices when the GPU computes a share of the
    experts, or the normed x that the GPU's products read). Their CPU buffer is mapped host
    memory, and a kernel that can (norm_route) writes its output there as well as to the
    device: its step's `mirrors` names them, and no copy step follows (small copies in a
    graph cost more than a kernel's writes to mapped memory)."""
    writer, out = {}, set()
    for node in graph.nodes:
        if node.backend == "CPU":
            out.update(s for s in node.srcs if writer.get(s) == gpu)
        for o in node.outs:
            writer[o] = node.backend
    return _small(graph, out)


def _small(graph, names):
    """Those of `names` whose buffers take at most MAPPED_MAX_BYTES."""
    return {name for name in names
            if np.prod(graph.buffers[name].shape) * np.dtype(graph.buffers[name].dtype).itemsize
            <= MAPPED_MAX_BYTES}


def _split_inputs(nodes, start):
    """Buffers the split starting at nodes[start] reads before writing them, in order.
    Copying them all when the split starts (rather than before each reader) keeps the copies
    out of a GPU split together at its end: one CUDA graph and one wait instead of several."""
    backend, written, wanted = nodes[start].backend, set(), {}
    for node in nodes[start:]:
        if node.backend != backend:
            break
        for src in node.srcs:
            if src not in written:
                wanted.setdefault(src, None)
        written.update(node.outs)
    return list(wanted)


def _graph_runs(steps, labels, runs_on, record_on, backends, ahead=()):
    """Replace each run of consecutive steps recordable on one GPU by one graph replay (which
    waits for its GPU at the end: the host reads or rewrites the pinned buffers next, unless
    the next step is an unrecorded launch on the same GPU's stream, such as an offloaded
    product or MLA's keys of the tokens cached before a batch, which the stream orders after
    it). A run of zc steps (`ahead`) is a graph the host does not wait for, launched together
    with the run before it (_LaunchAhead)."""
    out_steps, out_labels, out_on, i = [], [], [], 0
    while i < len(steps):
        gpu = record_on.get(i)
        if gpu is None:
            out_steps.append(steps[i])
            out_labels.append(labels[i])
            out_on.append(runs_on[i])
            i += 1
            continue
        j, is_ahead = i, i in ahead
        while j < len(steps) and record_on.get(j) == gpu and (j in ahead) == is_ahead:
            j += 1
        launch_next = j < len(steps) and runs_on[j] == gpu and record_on.get(j) is None
        run = backends[gpu].graph_run(steps[i:j], labels[i:j], wait=not (is_ahead or launch_next))
        if is_ahead and out_on and out_on[-1] == gpu and isinstance(out_steps[-1], type(run)):
            prev = next((s for s in reversed(out_steps) if isinstance(s, _LaunchAhead)), None)
            out_steps[-1] = _LaunchAhead(out_steps[-1], run, backends[gpu], prev)
        else:
            out_steps.append(run)
            out_labels.append((gpu, "GRAPH"))
            out_on.append(gpu)
        i = j
    return out_steps, out_labels, out_on


class _LaunchAhead:
    """A graph the host waits for (the routing and the copies the CPU's experts read), and
    after it, on the same stream, a graph it does not wait for (the GPU's zero-copy experts):
    both are launched before the wait, which ends at an event between them (or, when the
    first ends with a flag for the host, graphs.GraphRun's, when the flag is set).
    With `measure` set, a call also records an event after the second graph, so that
    gpu_share_seconds() gives the GPU share's device time (it starts when the first graph
    ends), and the host's time from the end of the wait to the next _LaunchAhead's call (the
    CPU's share of the layer; `prev` links them) lands in cpu_share_seconds: what
    zero_copy.ShareBalancer weighs."""
    waits_itself = True     # Plan.run_timed: no stream synchronisation after it

    def __init__(self, first, second, backend, prev=None):
        first.wait = False
        self.first, self.second, self.stream = first, second, backend.stream
        backend.activate()      # an event belongs to the context current when it is made
        self.event, self.done = backend.cuda.event(), backend.cuda.event()
        self.prev, self.measure, self.released, self.cpu_share_seconds = prev, False, None, None

    def __call__(self):
        prev = self.prev
        if prev is not None and prev.measure:
            prev.cpu_share_seconds = time.perf_counter() - prev.released
        self.first()
        flagged = self.first.flag is not None and not self.measure
        if not flagged:
            self.event.record(self.stream)
        self.second()
        if self.measure:
            self.done.record(self.stream)
        if flagged:
            self.first.synchronize()               # the routing's host flag (graphs.GraphRun)
        else:
            self.event.synchronize()
        if self.measure:
            self.released = time.perf_counter()

    def gpu_share_seconds(self):
        """Device time of the last measured call's second graph (once the stream passed it)."""
        return self.event.elapsed_time(self.done) / 1e3

    def run_timed(self, acc):
        self.first.run_timed(acc)
        self.second.run_timed(acc)


class _OnGPU:
    """A step of a plan that uses several GPUs: its GPU's context is made current first
    (numba-cuda launches and copies in the current context)."""

    def __init__(self, step, backend):
        self.step, self.backend = step, backend
        self.waits_itself = getattr(step, "waits_itself", False)
        if hasattr(step, "run_timed"):
            self.run_timed = self._run_timed

    def __call__(self):
        self.backend.activate()
        self.step()

    def _run_timed(self, acc):
        self.backend.activate()
        self.step.run_timed(acc)


class TimingTable(defaultdict):
    """acc[(backend, op)] -> seconds; whole_graphs: time recorded CUDA graphs as one step."""

    def __init__(self, whole_graphs=False):
        super().__init__(float)
        self.whole_graphs = whole_graphs


def new_timing_table(whole_graphs=False):
    return TimingTable(whole_graphs)
