"""The engine's one worker thread: requests in slots, taking turns, and a FIFO queue.

The engine has N slots (llm.use_slot), each with its own part of the KV cache. A new request
goes to the idle slot whose cached tokens share the longest prefix with its prompt (that
prefix is not evaluated again) if that prefix is at least SIMILARITY of the prompt, else to
the idle slot used least recently (as llama-server's slot similarity: a short common
start, a system prompt, does not evict another conversation's cache); it waits in the queue
while every slot is busy. The worker
serves the busy slots round-robin, one step each per turn: a prompt micro-batch, or one
generated token, so that every client makes progress. (Slots take turns: their tokens are
not batched together.)

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
        self.logits = None
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


class SlotWorker:
    def __init__(self, llm):
        self.llm = llm
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
            for job in turn:        # one step each, in slot order
                if job.cancelled:
                    self._free(job)
                    continue
                try:
                    self._step(job)
                except Exception as e:      # the request fails; the server goes on
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

    def _step(self, job):
        llm = self.llm
        llm.use_slot(job.slot)
        if job.todo is None:      # the first step: keep the slot's cached prefix of the prompt
            job.todo = llm.reuse_prefix(job.ids)
            job.text = reply_stream(llm.tokenizer) if job.chat else PlainStream(llm.tokenizer)
        if job.next_token is not None:
            job.logits, job.next_token = llm.eval_last([job.next_token]), None
        elif job.todo:
            chunk, job.todo = job.todo[:llm.n_ubatch], job.todo[llm.n_ubatch:]
            job.logits = llm.eval_last(chunk)
            if job.todo:
                return
        tok = job.sampler.sample(job.logits, llm.tokens)
        if tok in llm.tokenizer.stop_ids and not job.ignore_eos:
            return self._finish(job, "stop")
        job.n_gen += 1
        if self._send(job, job.text.push(tok)):
            return self._finish(job, "stop", stopped=True)
        if job.n_gen == job.max_tokens or len(llm.tokens) >= llm.n_ctx:
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
