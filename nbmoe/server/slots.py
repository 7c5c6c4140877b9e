"""The engine's one worker thread: requests in slots, batched decoding, and a FIFO queue.

The engine has N slots (llm.use_slot), each with its own part of the KV cache. A new request
goes to the idle slot whose cached tokens share the longest prefix with its prompt (that
prefix is not evaluated again) if that prefix is at least SIMILARITY of the prompt, else to
the idle slot used least recently (as llama-server's slot similarity: a short common
start, a system prompt, does not evict another conversation's cache); it waits in the queue
while every slot is busy. Each turn of the worker, every slot still reading its prompt
evaluates one micro-batch of it, in slot order; then every slot that is generating gives
its next token to one batch (llm.decode_slots: continuous batching, as llama-server's), so
the weights are read once a step for all of them. With the experts in RAM beside a GPU the
slots' tokens choose different experts, so a batch reads as many expert bytes as turns do and
loses the one-token paths (-zce, CUDA graphs): there they take turns (batch_decoding).

A Job's events go to its consumer through `emit` (a thread-safe callback): ("text", str),
then ("done", finish_reason, usage) or ("error", message). cancel() (a client that went away)
frees the slot at the worker's next step.
"""
import collections
import threading

from nbmoe.server.protocol import usage
from nbmoe.server.stops import StopScanner
from nbmoe.text.harmony import FINAL, PlainStream, reply_stream
from nbmoe.text.sampling import Sampler

SIMILARITY = 0.5


class Job:
    def __init__(self, req, emit):
        self.ids, self.max_tokens, self._emit = list(req.prompt_ids), req.max_tokens, emit
        self.sampler = Sampler(req.sampling)
        self.ignore_eos = req.ignore_eos
        self.chat = req.chat
        self.stops = StopScanner(req.stop)
        self.cancelled = False
        self.slot = None
        self.todo = None           # prompt ids still to evaluate (after the reused prefix)
        self.next_token = None     # the token sampled last, to evaluate before the next one
        self.n_gen = 0
        self.text = None           # the reply's channel splitter (reply_stream / PlainStream)

    def cancel(self):
        self.cancelled = True

    def emit(self, event):
        try:
            self._emit(event)
        except RuntimeError:        # its consumer's event loop is closed (the server stops)
            self.cancelled = True


def common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def batch_decoding(llm):
    """Whether continuous batching pays: not where MoE experts live in RAM beside a GPU
    (measured there: 46 t/s batched against 61 in turns, 4 clients)."""
    hybrid_experts = len(llm.backends) > 1 and any(
        "_exps." in name and where == "CPU" for name, (where, _) in llm.placement.items())
    return not hybrid_experts


class SlotWorker:
    def __init__(self, llm, batch=True):
        self.llm, self.batch = llm, batch
        self.jobs = [None] * len(llm.slots)     # the job in each slot
        self.used = [0] * len(llm.slots)        # when each slot was last given a job
        self.n_assigned = 0
        self.queue = collections.deque()
        self.cond = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._loop, name="nbmoe-slots", daemon=True)
        self.thread.start()

    # ---- from the server's threads ----------------------------------------------------------
    def submit(self, job):
        with self.cond:
            self.queue.append(job)
            self.cond.notify()

    def close(self):
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join(timeout=10)

    def status(self):
        with self.cond:
            return {"slots_idle": self.jobs.count(None),
                    "slots_processing": len(self.jobs) - self.jobs.count(None),
                    "queued": len(self.queue)}

    # ---- the worker -------------------------------------------------------------------------
    def _loop(self):
        while True:
            with self.cond:
                self._assign()
                while not self.closed and not any(self.jobs):
                    self.cond.wait()
                    self._assign()
                if self.closed:
                    return
                turn = [j for j in self.jobs if j is not None]
            for job in turn:
                if job.cancelled:
                    self._free(job)
            turn = [j for j in turn if not j.cancelled]
            for job in turn:        # prompts: one micro-batch each, in slot order
                if job.next_token is None:
                    self._guard([job], self._prompt_step, job)
            generating = [j for j in turn if j.next_token is not None and self.jobs[j.slot] is j]
            if generating and self.batch:   # then one token of every generating slot, one batch
                self._guard(generating, self._decode_step, generating)
            for job in generating if not self.batch else ():
                self._guard([job], self._decode_step, [job])

    def _guard(self, jobs, step, *args):
        """Run a step; if it raises, its jobs fail (one error each) and the server goes on."""
        try:
            step(*args)
        except Exception as e:
            for job in jobs:
                if self.jobs[job.slot] is job:
                    job.emit(("error", f"{type(e).__name__}: {e}"))
                    self._free(job)

    def _assign(self):
        """Queued jobs into idle slots, first come first served (cond held)."""
        while self.queue and None in self.jobs:
            job = self.queue.popleft()
            if job.cancelled:
                continue
            idle = [i for i, j in enumerate(self.jobs) if j is None]
            shared = {i: common_prefix(self.llm.slots[i].tokens, job.ids) for i in idle}
            best = max(idle, key=lambda i: (shared[i], -self.used[i]))
            if shared[best] < SIMILARITY * len(job.ids):
                best = min(idle, key=lambda i: self.used[i])
            self.n_assigned += 1
            job.slot, self.used[best], self.jobs[best] = best, self.n_assigned, job

    def _free(self, job):
        with self.cond:
            self.jobs[job.slot] = None

    def _prompt_step(self, job):
        llm = self.llm
        llm.use_slot(job.slot)
        if job.todo is None:      # the first step: keep the slot's cached prefix of the prompt
            job.todo = llm.reuse_prefix(job.ids)
            job.text = reply_stream(llm.tokenizer) if job.chat else PlainStream(llm.tokenizer)
        chunk, job.todo = job.todo[:llm.n_ubatch], job.todo[llm.n_ubatch:]
        logits = llm.eval_last(chunk)
        if not job.todo:
            self._take(job, logits)

    def _decode_step(self, jobs):
        logits = self.llm.decode_slots([(j.slot, j.next_token) for j in jobs])    # [B, V]
        for job, row in zip(jobs, logits):
            job.next_token = None
            self._guard([job], self._take, job, row)

    def _take(self, job, logits):
        """Sample the job's next token and send its text; finish the job, or keep the token
        for the next batched step."""
        llm, tokens = self.llm, self.llm.slots[job.slot].tokens
        tok = job.sampler.sample(logits, tokens)
        if tok in llm.tokenizer.stop_ids and not job.ignore_eos:
            return self._finish(job, "stop")
        job.n_gen += 1
        if self._send(job, job.text.push(tok)):
            return self._finish(job, "stop", stopped=True)
        if job.n_gen == job.max_tokens or len(tokens) >= llm.n_ctx:
            return self._finish(job, "length")
        job.next_token = tok

    def _send(self, job, pieces):
        """Send the final channel's text of `pieces`; True if a stop string ended it."""
        text = "".join(t for channel, t in pieces if channel == FINAL)
        if not text:
            return False
        out, stopped = job.stops.push(text)
        if out:
            job.emit(("text", out))
        return stopped

    def _finish(self, job, reason, stopped=False):
        if not stopped and self._send(job, job.text.flush()):
            stopped = True
        if stopped:
            reason = "stop"
        else:
            rest = job.stops.flush()
            if rest:
                job.emit(("text", rest))
        self._free(job)
        job.emit(("done", reason, usage(len(job.ids), job.n_gen)))
