"""-muge: a MoE layer's ffn_gate_exps and ffn_up_exps as one tensor, ffn_gate_up_exps.

Layout (llama.cpp's, for files that ship the tensor): ggml ne (D, 2F, E), bytes [E, 2F,
row_bytes]: expert e's F gate rows, then its F up rows. One expert product then computes
both halves, reading x once; the GLU takes the gate half and the up half (model/forward.py).
The biases (gpt-oss) merge the same way: ffn_gate_up_exps.bias ne (2F, E).

The merge happens on the device that holds the two tensors:
  RAM    copied once at load, expert by expert (quantized blocks are bytes: nothing is
         decoded), into one anonymous mapping (cuda/host_memory.py can page-lock it for the
         GPUs, as the file's); the file's pages of the two tensors are dropped
  a GPU  uploaded from the file straight into the merged device buffer (backends/cuda.py),
         no merged copy in RAM
A layer whose two tensors differ in buffer or type, or of which one has a bias and the other
not, keeps them apart (`notes` say why, --explain prints them). -rtr repacks a merged RAM
tensor like any other where F is a multiple of its 16-row groups (loader/repack.py).
"""
import mmap
from collections import defaultdict
from contextlib import nullcontext

import numpy as np

from nbmoe import progress
from nbmoe.loader.gguf_file import TensorShape
from nbmoe.memory import check_memory

GATE, UP, MERGED = "ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps"
STEP_BYTES = 64 << 20       # bytes merged per step of the progress bar


class MergedTensor(TensorShape):
    """A ffn_gate_up_exps made from its gate and up parts (TensorInfo's fields). data: the
    merged bytes in RAM, made on first use (a GPU's copy never asks: backends/cuda.py)."""

    def __init__(self, name, gate, up):
        self.name, self.parts = name, (gate, up)
        self.ggml_type = gate.ggml_type
        self.ne = (gate.ne[0], 2 * gate.ne[1]) + tuple(gate.ne[2:])
        self.offset = None              # not in the file
        self.n_bytes = gate.n_bytes + up.n_bytes
        self._data = None

    @property
    def data_shape(self):
        """[E, 2F, row_bytes] (a bias: [E, 2F * 4])."""
        s = self.parts[0].data.shape
        return (s[0], 2 * s[1]) + tuple(s[2:])

    @property
    def data(self):
        if self._data is None:
            self._data = np.empty(self.data_shape, np.uint8)
            merge_into(self._data, self.parts)
            self._data.flags.writeable = False
        return self._data


def merge_into(out, parts, advance=None):
    """out [E, 2F, ...] bytes <- expert e's gate rows, then its up rows (a strided copy per part:
    one memcpy of F rows per expert)."""
    E = out.shape[0]
    flat = out.reshape(E, -1)
    half = flat.shape[1] // 2
    step = max(1, STEP_BYTES // max(1, 2 * half))
    for lo in range(0, E, step):
        hi = min(E, lo + step)
        for j, part in enumerate(parts):
            flat[lo:hi, j * half:(j + 1) * half] = part.data.reshape(E, -1)[lo:hi]
        if advance:
            advance((hi - lo) * 2 * half)


def _why_not(il, weights, placement):
    """Why layer il's gate and up stay apart, or None (they merge)."""
    g, u = (weights[f"blk.{il}.{k}.weight"] for k in (GATE, UP))
    pg, pu = (placement[f"blk.{il}.{k}.weight"][0] for k in (GATE, UP))
    if pg != pu:
        return f"ffn_gate_exps on {pg}, ffn_up_exps on {pu}"
    if g.ggml_type != u.ggml_type:
        return f"ffn_gate_exps is {g.type_name}, ffn_up_exps {u.type_name}"
    if tuple(g.ne) != tuple(u.ne):
        return f"ffn_gate_exps has shape {list(g.ne)}, ffn_up_exps {list(u.ne)}"
    biases = [f"blk.{il}.{k}.bias" in weights for k in (GATE, UP)]
    if biases[0] != biases[1]:
        return "only one of ffn_gate_exps and ffn_up_exps has a bias"
    return None


def merge_up_gate(gguf, cfg, weights, placement, skip=None):
    """Replace each MoE layer's gate and up expert tensors in `weights` and `placement` (both
    changed in place) by their merge. skip: a reason that keeps every layer apart (--ep).
    Returns (merged layers, notes {reason: [layers]})."""
    notes, pairs = defaultdict(list), []
    for il in range(cfg.n_layer):
        if not cfg.is_moe_layer(il) or f"blk.{il}.{MERGED}.weight" in weights:
            continue                    # dense, or the file ships the merged tensor
        why = skip or _why_not(il, weights, placement)
        if why:
            notes[why].append(il)
        else:
            pairs.append(il)
    ram = [il for il in pairs if placement[f"blk.{il}.{GATE}.weight"][0] == "CPU"]
    arena = _Arena([_merged(il, "weight", weights).data_shape for il in ram])
    bar = progress.task("merging up and gate experts (-muge)", arena.n_bytes) if ram else nullcontext(None)
    with bar as advance:
        for il in pairs:
            for kind in ("weight", "bias"):
                name = f"blk.{il}.{MERGED}.{kind}"
                if f"blk.{il}.{GATE}.{kind}" not in weights:
                    continue
                t = _merged(il, kind, weights)
                place = placement[f"blk.{il}.{GATE}.{kind}"]
                if kind == "weight" and il in ram:
                    t._data = arena.take(t.data_shape)
                    merge_into(t._data, t.parts, advance)
                    t._data.flags.writeable = False   # typed as the file's read-only weights
                    for part in t.parts:
                        gguf.drop_pages(part.offset, part.n_bytes)
                for k in (GATE, UP):
                    del weights[f"blk.{il}.{k}.{kind}"], placement[f"blk.{il}.{k}.{kind}"]
                weights[name], placement[name] = t, place
    return pairs, dict(notes)


def merged_name(name):
    """The ffn_gate_up_exps tensor that ffn_gate_exps / ffn_up_exps `name` is part of."""
    return name.replace(f".{GATE}.", f".{MERGED}.").replace(f".{UP}.", f".{MERGED}.")


def _merged(il, kind, weights):
    return MergedTensor(f"blk.{il}.{MERGED}.{kind}", *(weights[f"blk.{il}.{k}.{kind}"] for k in (GATE, UP)))


class _Arena:
    """One anonymous mapping for the RAM merges, handed out in page-aligned pieces."""

    def __init__(self, shapes):
        page = mmap.PAGESIZE
        sizes = [-(-int(np.prod(s)) // page) * page for s in shapes]
        self.n_bytes = sum(int(np.prod(s)) for s in shapes)
        check_memory(self.n_bytes, "the merged up and gate experts (-muge)")
        self.map = mmap.mmap(-1, max(sum(sizes), page)) if shapes else None
        self.at = 0

    def take(self, shape):
        n = int(np.prod(shape))
        a = np.frombuffer(self.map, np.uint8, n, self.at).reshape(shape)
        self.at += -(-n // mmap.PAGESIZE) * mmap.PAGESIZE
        return a


def explain_line(merged, notes, shipped=()):
    """--explain's one line: the layers merged at load, those the file ships merged and, per
    reason, those kept apart."""
    from nbmoe.sched.explain import _ranges
    parts = [f"layers {_ranges(merged)} merged"] if merged else []
    parts += [f"layers {_ranges(shipped)} shipped merged by the file"] if shipped else []
    parts = (parts or ["no layer merged"]) + [f"not merged: layers {_ranges(ils)} ({why})"
                                              for why, ils in notes.items()]
    return "-muge (ffn_gate_up_exps): " + "; ".join(parts)
