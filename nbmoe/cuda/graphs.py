"""CUDA graphs: record a run of kernel launches once, replay it with one driver call.

A numba launch costs tens of microseconds of host time (argument typing and packing in
Python), and a token of a 48-layer MoE makes ~1300 of them: the GPU would wait on Python. A
token's launches are the same every time (same buffers, same grids; positions are read from
the device pos buffer, see attention.py), so the scheduler hands each run of consecutive GPU
steps of a decode plan to a `GraphRun`: the first call runs the steps as they are (kernels
compile, scratch buffers are allocated), the second records them into a CUDA graph by stream
capture, and from then on one cuGraphLaunch replays the whole run. Copies between the GPU and
pinned host buffers are recorded too; a run ends by waiting for its stream, since the host
reads what it copied out, or writes the next inputs into the buffers it copied in.

A run whose last step sets a flag in mapped host memory once all that the host reads next is
there (`flag`: fused.norm_route's signal, a hybrid decode layer's routing) is waited for by
spinning on that flag instead of synchronising the stream: the host goes on a few
microseconds sooner a layer. Nothing runs after the flag's kernel.

What a recorded run must not do: launch on another stream, copy to or from the host, or
allocate (relaxed capture mode lets an allocation through, but the replay would reuse the
address of a buffer that may since have been freed: the scratch buffers therefore are never
freed, see scratch.buffer). Offloaded products (host uploads) are never recorded.
config.GRAPHS off (NBMOE_NO_GRAPHS=1) turns recording off. The simulator has no graphs: runs
stay plain.
"""
import time

from nbmoe import config

from . import SIM

ENABLED = config.GRAPHS and not SIM


def _check(result):
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver: {err!r}")
    return result[1] if len(result) > 1 else None


class GraphRun:
    """steps: the closures of consecutive GPU steps, all launching on `stream` (numba);
    labels: their (backend, op) for timings; wait: end each call by waiting for the stream
    (or for `flag`, a host int32 [1] array that the last step sets: see above)."""

    def __init__(self, steps, stream, labels=(), wait=True, flag=None):
        self.steps, self.stream, self.labels, self.wait, self.flag = steps, stream, labels, wait, flag
        self.calls, self.exec, self._singles = 0, None, None

    def __call__(self):
        if self.exec is None:
            self.calls += 1
            if self.calls == 1 or not ENABLED:    # first call: compile and allocate
                for step in self.steps:
                    step()
            else:
                self._record()
        if self.exec is not None:
            if self.flag is not None:
                self.flag[0] = 0
            _check(self._drv.cuGraphLaunch(self.exec, self._hstream))
        if self.wait:
            self.synchronize()

    def synchronize(self):
        """Wait until what the host reads next is there: the flag once the run is a recorded
        graph (its last kernel sets it), else the stream."""
        flag = self.flag
        if flag is None or self.exec is None:
            self.stream.synchronize()
            return
        spins = 0
        while flag[0] == 0:
            spins += 1
            if spins % 4096 == 0 and int(self._drv.cuStreamQuery(self._hstream)[0]) == 0 and flag[0] == 0:
                raise RuntimeError("CUDA graph finished without setting its host flag")

    def run_timed(self, acc):
        """Run the steps, each replayed as a graph of its own between two CUDA events:
        acc[label] += its device time in seconds (the first call of each still launches
        plainly, so its time includes the host's launch)."""
        from numba import cuda
        if SIM:                                   # no device clock: the whole run, by the host's
            t0 = time.perf_counter()
            self()
            acc[(self.labels[0][0], "GRAPH")] += time.perf_counter() - t0
            return
        if self._singles is None:
            self._singles = [GraphRun([s], self.stream, wait=False) for s in self.steps]
        for label, single in zip(self.labels, self._singles):
            e0, e1 = cuda.event(), cuda.event()
            e0.record(self.stream)
            single()
            e1.record(self.stream)
            e1.synchronize()
            acc[label] += e0.elapsed_time(e1) / 1e3

    def _record(self):
        from cuda.bindings import driver as drv
        self._drv = drv
        self._hstream = drv.CUstream(int(self.stream.handle))
        mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        _check(drv.cuStreamBeginCapture(self._hstream, mode))
        try:
            for step in self.steps:
                step()
        finally:
            graph = _check(drv.cuStreamEndCapture(self._hstream))
        self.graph = graph
        self.exec = _check(drv.cuGraphInstantiate(graph, 0))

    def __del__(self):
        if getattr(self, "exec", None) is not None:
            try:
                self._drv.cuGraphExecDestroy(self.exec)
                self._drv.cuGraphDestroy(self.graph)
            except Exception:   # interpreter shutdown: the driver may be gone already
                pass
