"""What a user sees while Numba compiles kernels: a live line on stderr with a bar, the kernel
being compiled, how many are done of how many expected, and the time so far.

A first run compiles each kernel the model's weight types need (about a minute on two cores);
later runs load them from the on-disk cache, and then nothing is shown but the caller's own
message. The expected count is the one recorded the last time the same kind of model compiled
(kernel_estimates.json in the cache folder), else a guess from its weight types.

Numba compiles one kernel at a time in a process, so when a first kernel compiles, a second
process (`python -m nbmoe.compile`, config.COMPILE_AHEAD) compiles the path the caller needs
later (a chat's prompt batches while it compiles generation's kernels, a bench's generation
while it runs the prompt test) into the same cache; wait_ahead() waits for it.
"""
import atexit
import json
import os
import subprocess
import sys
import time

from numba.core import event

from nbmoe import config

_RECORD = "kernel_estimates.json"


def kernel_name(dispatcher):
    """A short name for a compiling kernel: module.function, with the weight types a
    specialized one was built for (specialize.build), e.g. matmul.products[Q4_1]."""
    origin = getattr(dispatcher, "nbmoe_origin", None)
    if origin is not None:
        module, factory, key = origin
        name = factory.removeprefix("_").removesuffix("_kernel")
        types = [_type_name(v) for v in _flat(key) if not isinstance(v, bool)]
        return f"{module.rsplit('.', 1)[-1]}.{name}[{','.join(dict.fromkeys(types))}]"
    fn = getattr(dispatcher, "py_func", None)
    if fn is None:
        return str(dispatcher)
    return f"{str(fn.__module__).rsplit('.', 1)[-1]}.{fn.__qualname__.split('.<locals>.')[-1]}"


def _flat(v):
    return [x for item in v for x in _flat(item)] if isinstance(v, tuple) else [v]


def _type_name(qtype):
    from gguf import GGMLQuantizationType
    from nbmoe.cpu.quants_rtr import BASE
    try:
        base = GGMLQuantizationType(BASE.get(qtype, qtype)).name
    except ValueError:
        return str(qtype)
    return base + ("_R16" if qtype in BASE else "")


class _Watch(event.Listener):
    """Counts Numba's compiles: top-level ones (a kernel a Python call needed) done, and the
    name of the one in progress."""

    def __init__(self, on_first=None):
        self.depth, self.done, self.current, self.started = 0, 0, None, None
        self.on_first = on_first

    def on_start(self, ev):
        if self.depth == 0:
            self.current = kernel_name(ev.data["dispatcher"])
            if self.started is None:
                self.started = time.perf_counter()
                if self.on_first:
                    self.on_first()
        self.depth += 1

    def on_end(self, ev):
        self.depth -= 1
        if self.depth == 0:
            self.done += 1
            self.current = None


def model_key(llm, purpose):
    """What decides which kernels compile: the command's purpose, the architecture and the
    (buffer type, weight type) pairs of its matrices, repacked or not (unplaced tensors, a
    NextN block's, are never read), -fmoe and the KV cache's types."""
    pairs = sorted({(llm.placement[n][0], int(t.ggml_type)) for n, t in llm.file.tensors.items()
                    if len(t.ne) >= 2 and n in llm.placement})
    muge = " muge" if getattr(llm, "merged_layers", None) else ""    # the merged GLU's kernels
    key = f"{purpose} {llm.cfg.arch} rtr={int(bool(llm.repacked))}{muge} {pairs}"
    kv = getattr(llm, "kv", None)
    if not getattr(llm, "fused_moe", True):
        key += " fmoe=0"
    if kv is not None and (kv.type_k, kv.type_v) != ("f16", "f16"):
        key += f" kv={kv.type_k}/{kv.type_v}"
    return key


def _record_path():
    return os.path.join(config.cache_dir(), "kernels", _RECORD)


def _read_record():
    try:
        with open(_record_path()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def expected_kernels(llm, purpose):
    """(count, exact): the top-level kernels the same kind of model compiled last time, else
    a guess from the number of weight types on the CPU (exact False)."""
    n = _read_record().get(model_key(llm, purpose))
    if n:
        return int(n), True
    types = {int(t.ggml_type) for name, t in llm.file.tensors.items()
             if len(t.ne) >= 2 and name in llm.placement and llm.placement[name][0] == "CPU"}
    return 14 + 2 * len(types), False


def _save_count(llm, purpose, n):
    record = _read_record()
    record[model_key(llm, purpose)] = n
    path = _record_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(record, f, indent=0)
        os.replace(tmp, path)
    except OSError:          # a read-only cache: the next run guesses again
        pass


# ---------------------------------------------------------------- compiling ahead

_ahead = None       # the helper process (subprocess.Popen), while one runs


def start_ahead(llm, batches):
    """Start `python -m nbmoe.compile` on llm's model for these batch sizes, unless one runs,
    COMPILE_AHEAD is off, the model has GPU layers (a second process would set up the GPU) or
    its experts are shared over MPI ranks."""
    global _ahead
    if (_ahead is not None or not config.COMPILE_AHEAD or set(llm.backends) != {"CPU"}
            or getattr(llm, "ep", None)):      # --ep: a second process would map every expert
        return
    cmd = [sys.executable, "-m", "nbmoe.compile", "-m", llm.path, "-ub", str(llm.n_ubatch),
           "-t", "1", "--batches", ",".join(map(str, batches)), "--quiet"]
    if llm.repacked:
        cmd.append("-rtr")
    cmd += ["-fa", llm.flash_attn]     # the prompts' attention kernel (-fa off: the plain one)
    cmd += ["-fmoe", str(int(llm.fused_moe)), "-ctk", llm.kv.type_k, "-ctv", llm.kv.type_v]
    try:
        _ahead = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
    except OSError:     # no process to spare: this one compiles everything
        _ahead = None


def wait_ahead(progress=None):
    """Wait for the helper process, if one runs (its kernels then load from the cache)."""
    global _ahead
    if _ahead is None:
        return
    if progress is not None:
        progress.waiting = True
    try:
        _ahead.wait()
    finally:
        _ahead = None
        if progress is not None:
            progress.waiting = False


@atexit.register
def _stop_ahead():
    if _ahead is not None and _ahead.poll() is None:
        _ahead.kill()


class CompileProgress:
    """A context manager: `with CompileProgress(console, "loading", llm, "chat") as p:` shows a
    spinner and the message (p.update(message) changes it); while Numba compiles, also a bar
    of the kernels done of those expected, the one compiling and the time so far. Quiet when
    every kernel comes from the cache. Not a terminal: a line when compiling starts and one
    when it ends. ahead: batch sizes for a helper process to compile once compiling starts
    (start_ahead), which the caller waits for with wait_ahead(p) before it runs them."""

    def __init__(self, console, message, llm=None, purpose="run", ahead=()):
        self.console, self.message, self.llm, self.purpose = console, message, llm, purpose
        self.expected, self.exact = expected_kernels(llm, purpose) if llm is not None else (0, False)
        self.live, self.ahead, self.waiting = None, tuple(ahead), False
        self.watch = _Watch(on_first=self._first)

    def update(self, message):
        self.message = message

    def __enter__(self):
        event.register("numba:compile", self.watch)
        if self.console.is_terminal:
            from rich.live import Live
            self.live = Live(console=self.console, transient=True, refresh_per_second=8,
                             get_renderable=self._render)
            self.live.start()
        return self

    def __exit__(self, *exc):
        event.unregister("numba:compile", self.watch)
        if self.live is not None:
            self.live.stop()
        w = self.watch
        if w.done:
            secs = time.perf_counter() - w.started
            self.console.print(f"compiled {w.done} kernels in {secs:.0f} s "
                               "(once: later runs load them from the cache)", highlight=False)
            if self.llm is not None and exc[0] is None:
                _save_count(self.llm, self.purpose, w.done)
        return False

    def _render(self):
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.spinner import Spinner
        from rich.table import Table
        w = self.watch
        head = Spinner("dots", text=self.message)
        if w.started is None:
            return head
        total = max(self.expected, w.done + (w.current is not None))
        line = Table.grid(padding=(0, 1))
        now = w.current or ("(the rest in a second process)" if self.waiting else "")
        line.add_row("  compiling kernels", ProgressBar(total=total, completed=w.done, width=24),
                     f"{w.done}/{'' if self.exact else '~'}{total}", now,
                     f"{time.perf_counter() - w.started:.0f} s")
        return Group(head, line)

    def _first(self):
        if self.ahead and self.llm is not None:
            start_ahead(self.llm, self.ahead)
        if self.live is None:
            self.console.print(f"compiling kernels for this model's weight types (about {self.expected}; "
                               "once: later runs load them from the cache)", highlight=False)
