"""-zce auto: the GPU's share of each generated token's chosen experts, balanced as it runs.

A MoE layer's GPU share (S experts whose weights the GPU reads from RAM over PCIe) and its
CPU share (the other A - S) run at the same time, and the next layer waits for the slower.
Which S balances them depends on the machine and moves with the RAM bandwidth the CPU gets
(measured: 3 of 8 best on one H200 lend, 2 on another). So every EVERY-th generated token
is measured: per layer, the GPU share's device time (CUDA events around its graph) and the
CPU share's host time (scheduler._LaunchAhead), and ShareBalancer moves S by one when two
measured tokens in a row ask for the same move:
  down  when the GPU share is the slower (by more than SLACK: noise), as the layer waits for
        it (measured on an H200: the CPU share's time hardly moved between 5 and 6 experts,
        ~190 us, while the GPU's grew ~68 us an expert);
  up    when the GPU would still finish first with one expert more (its time there as
        last measured, or scaled by experts; the CPU's taken as it is now, see update).
The CPU share's speed swings with the RAM bandwidth the machine gets, so the share follows
it (replayed on the measurements of three H200 lends in tests/test_zero_copy.py).
S = 0 (the CPU computes all) has no GPU share to measure: it is final.
"""
import numpy as np

EVERY = 8          # generated tokens between two measured ones
SAMPLE = 4         # of a measured token, every SAMPLE-th layer is timed
SLACK = 1.02       # the GPU share may take this much longer than the CPU's before S drops


class ShareBalancer:
    def __init__(self, share, n_used):
        self.share, self.n_used, self.tokens, self.pending = share, n_used, 0, 0
        self.history = []            # (share, GPU seconds, CPU seconds) per measured token
        self.gpu_at = {}             # share -> its GPU share's last measured seconds

    def due(self):
        """Whether to measure this generated token."""
        self.tokens += 1
        return self.share > 0 and self.tokens % EVERY == 0

    def update(self, gpu_s, cpu_s):
        """A measured token's per-layer GPU and CPU share times (medians) -> the share to use.
        A move needs two measured tokens in a row that ask for it (one can be an outlier:
        seen on an H200, a CPU share of 195 us among 215-251)."""
        S, A = self.share, self.n_used
        self.history.append((S, gpu_s, cpu_s))
        self.gpu_at[S] = gpu_s
        # the GPU share with one expert more: as last measured there, else S + 1 experts at
        # this one's rate; the CPU share's time is taken as it is now (on H200s it hardly
        # moved between 5 and 6 experts: its fixed costs and the RAM's swings dominate)
        gpu_up = self.gpu_at.get(S + 1, gpu_s * (S + 1) / S)
        want = 0
        if gpu_s > SLACK * cpu_s:
            want = -1
        elif S < A - 1 and SLACK * gpu_up < cpu_s:
            want = 1
        if want and want == self.pending:
            self.share, want = S + want, 0
        self.pending = want
        return self.share


def sampled_layers(plan):
    """The _LaunchAhead steps (one a shared layer) timed on a measured token: every
    SAMPLE-th, so that the events cost little (the last one needs a next layer)."""
    steps = plan.launch_ahead
    return steps[:-1][::SAMPLE] or steps[:1]


def measured_times(steps):
    """(GPU, CPU) share seconds of a layer, medians over `steps`, after a run with their
    `measure` set (and their cpu_share_seconds cleared before)."""
    gpu = [s.gpu_share_seconds() for s in steps]
    cpu = [s.cpu_share_seconds for s in steps if s.cpu_share_seconds is not None]
    return float(np.median(gpu)), float(np.median(cpu)) if cpu else float("inf")
