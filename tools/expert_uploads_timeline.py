"""Where a hybrid prompt micro-batch's time goes: the uploads' stream against the products'.

    python tools/expert_uploads_timeline.py -m MODEL -ub 512 [-p 2048] [--runs 3]

Experts in RAM (`-ngl 99 -ot exps=CPU`). The prompt runs twice to warm up, then --runs more
times with CUDA events around each offloaded expert tensor's upload (on the copy stream,
from the moment its slot is free), the copy of the chosen experts it lacked (on the
products' stream) and its product's end. Per micro-batch, from the first upload's start:

  span      the last product's end
  link      time the copy stream spent uploading, and its rate (the bytes uploaded ahead
            of the routers / link)
  fill      time the products' stream spent copying missed experts
  wait      time the products' stream stood waiting for an upload (it had reached the
            tensor's product before the tensor was there)
  host      the host's time in the uploads' bookkeeping, less its waits for a router's choice
and, as means, the GB uploaded ahead and filled a micro-batch and their rate over the span.

A span near `link` is the link's pace; near `wait` + the products, the uploads arrive late;
`host` near the span, the host cannot queue work fast enough.
"""
import argparse
import time

import numpy as np

import nbmoe
from nbmoe.backends import expert_uploads
from nbmoe.cli.bench import run_pp


class Timeline:
    """Events recorded by the wrapped ExpertUploads methods, per micro-batch (a run of the
    plan: wait(0) starts one)."""

    def __init__(self):
        self.on, self.runs, self.host, self.current, self.inside = False, [], 0.0, None, False

    def install(self):
        """Wrap the ExpertUploads methods; returns a function that puts them back."""
        cls, tl = expert_uploads.ExpertUploads, self
        wait, done, upload, complete, copy = cls.wait, cls.done, cls._upload, cls._complete, cls._copy
        experts = expert_uploads._Choice.experts

        def uninstall():
            cls.wait, cls.done, cls._upload, cls._complete, cls._copy = wait, done, upload, complete, copy
            expert_uploads._Choice.experts = experts

        def ev(stream):
            e = self.backend.cuda.event()
            e.record(stream)
            return e

        def timed(fn):
            def call(self, *a):
                t0, tl.inside = time.perf_counter(), True
                try:
                    return fn(self, *a)
                finally:
                    tl.host += time.perf_counter() - t0
                    tl.inside = False
            return call

        def untimed(fn):                  # a wait inside the bookkeeping, taken off its time
            def call(self, *a):
                t0 = time.perf_counter()
                try:
                    return fn(self, *a)
                finally:
                    tl.host -= time.perf_counter() - t0 if tl.inside else 0.0
            return call

        def _wait(self, i):
            if tl.on and i == 0:
                tl.backend = self.backend
                tl.runs.append({"ready": {}, "up": {}, "fill": {}, "end": {}})
            if tl.on and tl.runs:       # the products' stream has reached tensor i's product
                tl.runs[-1]["ready"][i] = ev(self.backend.stream)
            return wait(self, i)

        def _upload(self, i):
            tl.current = i if tl.on and tl.runs else None
            return upload(self, i)

        def _copy_timed(self, dst, host, runs, stream):
            i = tl.current
            start = ev(stream) if i is not None and stream is self.copy_stream else None
            copy(self, dst, host, runs, stream)
            if start is not None:
                tl.runs[-1]["up"][i] = (start, ev(stream))

        def _complete(self, i, dev):
            if not (tl.on and tl.runs):
                return complete(self, i, dev)
            start = ev(self.backend.stream)
            complete(self, i, dev)
            tl.runs[-1]["fill"][i] = (start, ev(self.backend.stream))

        def _done(self, i):
            if tl.on and tl.runs:
                tl.runs[-1]["end"][i] = ev(self.backend.stream)
            tl.current = None
            return done(self, i)

        cls.wait, cls.done = timed(_wait), timed(_done)
        expert_uploads._Choice.experts = untimed(experts)
        cls._upload, cls._complete, cls._copy = _upload, _complete, _copy_timed
        return uninstall

    def report(self, ahead_bytes, filled_bytes=0.0):
        """One line a micro-batch (milliseconds from the products' stream reaching the first
        expert product, or the first upload's start if earlier), then their means; the bytes
        are the runs' totals (ahead: the copy stream's; filled: the missed experts')."""
        rows = []
        for r in self.runs:
            if 0 not in r["ready"] or not r["end"]:
                continue
            t0 = r["ready"][0]
            ms = t0.elapsed_time                          # milliseconds after t0 (may be < 0)
            up = {i: (ms(s), ms(e)) for i, (s, e) in r["up"].items()}
            first = min([0.0] + [s for s, _ in up.values()])
            link = sum(e - s for s, e in up.values())
            fill = sum(s.elapsed_time(e) for s, e in r["fill"].values())
            wait = sum(max(0.0, up[i][1] - ms(e)) for i, e in r["ready"].items() if i in up)
            rows.append((max(ms(e) for e in r["end"].values()) - first, link, fill, wait))
        if not rows:
            print("  no micro-batch with offloaded expert products recorded")
            return
        gb = ahead_bytes / len(rows) / 1e9
        for span, link, fill, wait in rows:
            print(f"  span {span:7.1f}  link {link:7.1f} ({gb / link * 1e3 if link > 0 else 0:5.1f} GB/s)"
                  f"  fill {fill:6.1f}  wait {wait:6.1f}")
        m = np.mean(rows, axis=0)
        filled = filled_bytes / len(rows) / 1e9
        print(f"  mean: span {m[0]:.1f} ms, link {m[1]:.1f}, fill {m[2]:.1f}, wait {m[3]:.1f}; "
              f"{gb:.2f} GB uploaded ahead and {filled:.2f} GB filled a micro-batch "
              f"({(gb + filled) / m[0] * 1e3 if m[0] > 0 else 0:.1f} GB/s over PCIe in the span); "
              f"host {self.host / len(rows) * 1e3:.1f} ms a micro-batch in the uploads' bookkeeping")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-ub", type=int, default=512)
    ap.add_argument("-p", type=int, default=2048, help="prompt tokens")
    ap.add_argument("-t", "--threads", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    tl = Timeline()
    tl.install()
    llm = nbmoe.load(a.model, n_ctx=max(4096, a.p), threads=a.threads, n_ubatch=a.ub,
                     n_gpu_layers=99, override_tensors=["exps=CPU"])
    gpu = llm.backends["CUDA0"]
    rng = np.random.default_rng(0)
    for _ in range(2):
        run_pp(llm, a.p, 2048, rng)
    before, missed = gpu.uploaded_bytes, gpu.last_expert_uploads.missed_bytes
    tl.on, tl.host = True, 0.0
    ts = [a.p / run_pp(llm, a.p, 2048, rng) for _ in range(a.runs)]
    gpu.cuda.synchronize()
    tl.on = False
    uploaded = gpu.uploaded_bytes - before     # (reading it counts the last run's fills first)
    missed = gpu.last_expert_uploads.missed_bytes - missed
    print(f"pp{a.p} at ub {a.ub}: {np.mean(ts):.1f} +- {np.std(ts):.1f} t/s")
    tl.report(uploaded - missed, missed)


if __name__ == "__main__":
    main()
