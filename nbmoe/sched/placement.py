"""Where each weight lives: a buffer type (CPU, CUDA0, CUDA1, ...) per GGUF tensor.

Rules, first match wins, as in llama.cpp:
  1. `-ot REGEX=BUFTYPE` overrides, in the order given (re.search on the tensor name);
  2. the shorthands `--cpu-moe` (all experts) and `--n-cpu-moe N` (experts of layers < N),
     which are overrides to CPU placed after the user's own;
  3. `-ngl N`: the last N repeating layers and the output layer go to the GPUs (N >= 1
     already moves the output layer, like llama.cpp), spread evenly over the devices;
  4. everything else, the token embedding included, stays in RAM.
Each decision keeps its cause, so `--explain` can show why a tensor is where it is.
"""
import re
from dataclasses import dataclass

from nbmoe.errors import NbmoeError

_LAYER = re.compile(r"^blk\.(\d+)\.")
EXPERT_TENSORS = r"\.ffn_(up|down|gate|gate_up)_exps\."


@dataclass(frozen=True)
class Override:
    pattern: str
    regex: re.Pattern
    buftype: str
    source: str            # "-ot", "--cpu-moe", "--n-cpu-moe"


def parse_overrides(specs, buftypes, source="-ot"):
    """`REGEX=BUFTYPE` strings (each may hold several, comma-separated) -> [Override]."""
    out = []
    for spec in specs or ():
        for item in str(spec).split(","):
            item = item.strip()
            if not item:
                continue
            pattern, sep, buftype = item.rpartition("=")
            if not sep or not pattern:
                raise NbmoeError(f"bad tensor override {item!r}: expected REGEX=BUFTYPE")
            if buftype not in buftypes:
                raise NbmoeError(f"unknown buffer type {buftype!r} in {item!r}; "
                                 f"available: {', '.join(buftypes)}")
            try:
                regex = re.compile(pattern)
            except re.error as e:
                raise NbmoeError(f"bad regex {pattern!r} in tensor override: {e}") from None
            out.append(Override(pattern, regex, buftype, source))
    return out


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
