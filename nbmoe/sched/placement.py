"""Where each weight lives: a buffer type (CPU, CUDA0, CUDA1, ...) per GGUF tensor.

Rules, first match wins, as in llama.cpp:
  1. `-ot REGEX=BUFTYPE` overrides, in the order given (re.search on the tensor name);
  2. the shorthands `--cpu-moe` (all experts) and `--n-cpu-moe N` (experts of layers < N),
     which are overrides to CPU placed after the user's own;
  3. `-ngl N`: the last N repeating layers and the output layer go to the GPUs (N >= 1
     already moves the output layer, like llama.cpp), spread evenly over the devices;
  4. everything else, the token embedding included, stays in RAM.
Each decision keeps its cause, so `--explain` can show why a tensor is where it is.
Under `--ep R` (expert parallelism over MPI ranks) an `-ot REGEX=RANKn` rule puts the experts
of the MoE layers it matches on rank n alone; the other layers' experts are split evenly over
the ranks (expert_ranks). Non-expert tensors always stay with rank 0.
"""
import re
from dataclasses import dataclass

from nbmoe.errors import NbmoeError

_LAYER = re.compile(r"^blk\.(\d+)\.")
_RANK = re.compile(r"^RANK(\d+)$")
EXPERT_TENSORS = r"\.ffn_(up|down|gate|gate_up)_exps\."


@dataclass(frozen=True)
class Override:
    pattern: str
    regex: re.Pattern
    buftype: str
    source: str            # "-ot", "--cpu-moe", "--n-cpu-moe"


def parse_overrides(specs, buftypes, source="-ot", n_ranks=1):
    """`REGEX=BUFTYPE` strings (each may hold several, comma-separated) -> [Override].
    BUFTYPE may be RANKn (n < n_ranks) under --ep n_ranks; buftypes None: any other name."""
    out = []
    for spec in specs or ():
        for item in str(spec).split(","):
            item = item.strip()
            if not item:
                continue
            pattern, sep, buftype = item.rpartition("=")
            if not sep or not pattern:
                raise NbmoeError(f"bad tensor override {item!r}: expected REGEX=BUFTYPE")
            rank = _RANK.match(buftype)
            if rank and n_ranks <= 1:
                raise NbmoeError(f"{item!r}: a RANKn buffer type places experts on an MPI rank "
                                 "and needs --ep R (mpiexec -n R)")
            if rank and int(rank.group(1)) >= n_ranks:
                raise NbmoeError(f"{item!r}: there is no rank {int(rank.group(1))}, --ep {n_ranks} "
                                 f"has ranks RANK0 to RANK{n_ranks - 1}")
            if not rank and buftypes is not None and buftype not in buftypes:
                raise NbmoeError(f"unknown buffer type {buftype!r} in {item!r}; "
                                 f"available: {', '.join(buftypes)}")
            try:
                regex = re.compile(pattern)
            except re.error as e:
                raise NbmoeError(f"bad regex {pattern!r} in tensor override: {e}") from None
            out.append(Override(pattern, regex, buftype, source))
    return out


def is_rank(override):
    return _RANK.match(override.buftype) is not None


def expert_ranks(moe_layers, n_expert, n_ranks, overrides):
    """{layer: [(lo, hi) of rank 0, of rank 1, ...]}: which experts of each MoE layer each rank
    holds. The first override matching a layer's expert weights decides: RANKn puts all of
    them on rank n; any other rule, or none, splits them evenly (contiguous runs)."""
    even = [(r * n_expert // n_ranks, (r + 1) * n_expert // n_ranks) for r in range(n_ranks)]
    layout = {}
    for il in moe_layers:
        chosen = {}
        for k in ("gate", "up", "down"):
            name = f"blk.{il}.ffn_{k}_exps.weight"
            hit = next((o for o in overrides if o.regex.search(name)), None)
            chosen[name] = (int(_RANK.match(hit.buftype).group(1)), hit.pattern) \
                if hit is not None and is_rank(hit) else (None, None)
        ranks = {r for r, _ in chosen.values()}
        if len(ranks) > 1:
            where = ", ".join(f"{n} on {'rank %d' % r if r is not None else 'the even split'}"
                              for n, (r, _) in chosen.items())
            raise NbmoeError(f"layer {il}'s expert tensors would be on different ranks ({where}): "
                             "a RANKn rule must match a layer's gate, up and down experts together")
        rank = ranks.pop()
        layout[il] = list(even) if rank is None else \
            [(0, n_expert) if r == rank else (0, 0) for r in range(n_ranks)]
    return layout


def moe_overrides(cpu_moe=False, n_cpu_moe=0):
    """The --cpu-moe / --n-cpu-moe shorthands as CPU overrides."""
    if cpu_moe:
        return [Override(EXPERT_TENSORS, re.compile(EXPERT_TENSORS), "CPU", "--cpu-moe")]
    return [Override(rf"^blk\.{i}{EXPERT_TENSORS}", re.compile(rf"^blk\.{i}{EXPERT_TENSORS}"),
                     "CPU", "--n-cpu-moe") for i in range(n_cpu_moe)]


def layer_of(name, n_layer):
    """Repeating layer index of a tensor; n_layer for the output layer; -1 for the input."""
    m = _LAYER.match(name)
    if m:
        return int(m.group(1))
    return n_layer if name.startswith("output") else -1


def gpu_layer_device(il, n_layer, n_gpu_layers, devices):
    """Device of layer il under -ngl (None = CPU). Layers n_layer+1-N .. n_layer (the last
    being the output layer) are offloaded and split into equal runs over the devices."""
    if not devices or n_gpu_layers <= 0 or il < 0:
        return None
    first = max(0, n_layer + 1 - n_gpu_layers)
    if il < first:
        return None
    n_off = n_layer + 1 - first
    return devices[min(len(devices) - 1, (il - first) * len(devices) // n_off)]


def place_tensors(names, n_layer, n_gpu_layers=0, overrides=(), devices=()):
    """{tensor name: (buftype, cause)} for every name."""
    placement = {}
    for name in names:
        hit = next((o for o in overrides if o.regex.search(name)), None)
        if hit is not None:
            placement[name] = (hit.buftype, f"{hit.source} {hit.pattern}={hit.buftype}")
            continue
        dev = gpu_layer_device(layer_of(name, n_layer), n_layer, n_gpu_layers, devices)
        if dev is not None:
            placement[name] = (dev, f"-ngl {n_gpu_layers}")
        else:
            placement[name] = ("CPU", "input layer" if layer_of(name, n_layer) < 0 else "default")
    return placement
