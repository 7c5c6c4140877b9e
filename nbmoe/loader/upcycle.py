"""Sparse upcycling: turn a dense GGUF into a Mixtral-style MoE GGUF of E identical experts.

Letters: L layers, D n_embd, F FFN width, E experts, A active experts.

Each layer's dense FFN (ffn_gate/up/down, already quantized) is copied byte for byte E times
into the stacked expert tensors ffn_{gate,up,down}_exps, and a random F32 router
ffn_gate_inp [E, D] is added. Both target architectures renormalise the top-A router weights
to sum to 1, so with identical experts the MoE computes exactly the dense model's function
(up to float rounding of the weighted sum): a real, coherent MoE model for tests and demos.

Everything else (tensors and metadata, with their exact value types) is copied unchanged;
general.name gets a suffix and {arch}.expert_count / expert_used_count are added.
The source is read through one mmap and the output is written one tensor at a time, so
memory holds at most E copies of one FFN tensor.
"""
import math
import os
import re
import struct

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from nbmoe.errors import NbmoeError
from nbmoe.loader.gguf_file import GGUFFile

# dense architecture -> the MoE architecture llama.cpp loads the upcycled file as
MOE_ARCH = {"llama": "llama", "qwen3": "qwen3moe"}

_FFN = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.weight")

_SCALAR = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


def read_metadata(path):
    """Every key of a GGUF file, in file order: key -> (value, vtype, sub_type).

    Value types are kept exactly (llama.cpp rejects a key stored as the wrong integer type),
    strings stay raw bytes, arrays are lists. gguf.GGUFReader does the same but builds one
    numpy object per array item, which takes seconds for a 50k-token vocabulary.
    """
    try:
        f = open(path, "rb")
    except OSError as e:
        raise NbmoeError(f"{path}: cannot open ({e.strerror})") from None
    with f:
        buf = f.read(1 << 20)
        pos = 24
        if buf[:4] != b"GGUF":
            raise NbmoeError(f"{path}: not a GGUF file (bad magic)")
        n_kv = struct.unpack_from("<Q", buf, 16)[0]

        def need(n):  # grow the buffer until it holds n more bytes past pos
            nonlocal buf
            while pos + n > len(buf):
                more = f.read(max(1 << 20, n))
                if not more:
                    raise NbmoeError(f"{path}: truncated GGUF header")
                buf += more

        def scalar(vtype):
            nonlocal pos
            fmt = _SCALAR[vtype]
            need(struct.calcsize(fmt))
            v = struct.unpack_from(fmt, buf, pos)[0]
            pos += struct.calcsize(fmt)
            return v

        def string():
            nonlocal pos
            n = scalar(GGUFValueType.UINT64)
            need(n)
            pos += n
            return bytes(buf[pos - n:pos])

        meta = {}
        for _ in range(n_kv):
            key = string().decode("utf-8")
            vtype = GGUFValueType(scalar(GGUFValueType.UINT32))
            sub_type = None
            if vtype == GGUFValueType.STRING:
                value = string()
            elif vtype == GGUFValueType.ARRAY:
                sub_type = GGUFValueType(scalar(GGUFValueType.UINT32))
                count = scalar(GGUFValueType.UINT64)
                if sub_type == GGUFValueType.STRING:
                    value = [string() for _ in range(count)]
                elif sub_type in _SCALAR:
                    size = struct.calcsize(_SCALAR[sub_type])
                    need(count * size)
                    value = np.frombuffer(buf, _SCALAR[sub_type], count, pos).tolist()
                    pos += count * size
                else:
                    raise NbmoeError(f"{path}: key {key} is an array of arrays (not supported)")
            else:
                value = scalar(vtype)
            meta[key] = (value, vtype, sub_type)
    return meta


def meta_value(meta, key, default=None):
    """The plain value of a read_metadata() entry, strings decoded."""
    if key not in meta:
        return default
    value = meta[key][0]
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value


def upcycle(src, dst, *, n_expert=8, n_expert_used=2, seed=0, progress=None):
    """Write dst: the dense GGUF src with each FFN turned into n_expert identical experts.

    progress(bytes_done, bytes_total) is called after each tensor. Returns dst.
    """
    meta = read_metadata(src)
    arch = meta_value(meta, "general.architecture", "")
    if arch not in MOE_ARCH:
        raise NbmoeError(f"{src}: cannot upcycle architecture '{arch}' "
                         f"(supported: {', '.join(MOE_ARCH)})")
    if meta_value(meta, f"{arch}.expert_count", 0):
        raise NbmoeError(f"{src}: already a mixture of experts")
    if not 1 <= n_expert_used <= n_expert:
        raise NbmoeError(f"need 1 <= active experts <= experts, got {n_expert_used} of {n_expert}")
    moe_arch = MOE_ARCH[arch]
    src_file = GGUFFile(src)
    tensors = src_file.tensors

    # The plan: (name, numpy shape, ggml type, n_bytes, how to make its bytes), in source order.
    n_embd = meta_value(meta, f"{arch}.embedding_length")
    rng = np.random.default_rng(seed)
    plan, routed = [], set()
    for name, t in tensors.items():
        m = _FFN.fullmatch(name)
        if m is None:
            plan.append((name, t.shape, t.ggml_type, t.n_bytes, t.data))
            continue
        layer, which = m.groups()
        if layer not in routed:  # the router goes just before the layer's first expert tensor
            routed.add(layer)
            for w in ("gate", "up", "down"):
                if f"blk.{layer}.ffn_{w}.weight" not in tensors:
                    raise NbmoeError(f"{src}: layer {layer} has no ffn_{w}.weight to upcycle")
            # [E, D] F32, std 1/sqrt(D): router logits O(1) for an RMS-normed input
            router = rng.standard_normal((n_expert, n_embd)) / math.sqrt(n_embd)
            router = router.astype(np.float32)
            plan.append((f"blk.{layer}.ffn_gate_inp.weight", router.shape,
                         GGMLQuantizationType.F32, router.nbytes, router))
        # [E, F, D] for gate/up, [E, D, F] for down: E stacked raw copies of the dense bytes
        plan.append((f"blk.{layer}.ffn_{which}_exps.weight", (n_expert, *t.shape), t.ggml_type,
                     n_expert * t.n_bytes, (t.data, n_expert)))
    if not routed:
        raise NbmoeError(f"{src}: no dense ffn_gate/up/down tensors to upcycle")

    writer = GGUFWriter(dst, moe_arch)
    for key, (value, vtype, sub_type) in meta.items():
        if key == "general.architecture":
            continue  # the writer wrote it first
        if key == "general.alignment":
            writer.data_alignment = value
        if key.startswith(arch + "."):
            key = moe_arch + key[len(arch):]
        if key == "general.name":
            value = value + f" (upcycled {n_expert}x, {n_expert_used} active)".encode()
        writer.add_key_value(key, value, vtype, sub_type)
    if "general.name" not in meta:
        writer.add_string("general.name", f"upcycled {n_expert}x, {n_expert_used} active")
    writer.add_uint32(f"{moe_arch}.expert_count", n_expert)
    writer.add_uint32(f"{moe_arch}.expert_used_count", n_expert_used)
    if moe_arch != "llama":  # llama's experts are feed_forward_length wide; qwen3moe reads this key
        writer.add_uint32(f"{moe_arch}.expert_feed_forward_length",
                          meta_value(meta, f"{arch}.feed_forward_length"))

    for name, shape, gtype, n_bytes, _ in plan:
        # dtype float32 (not uint8) tells the writer that shape is in elements, not bytes
        writer.add_tensor_info(name, shape, np.dtype(np.float32), n_bytes, raw_dtype=gtype)
    ok = False
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        total, done = sum(p[3] for p in plan), 0
        for name, shape, gtype, n_bytes, data in plan:
            if isinstance(data, tuple):  # (dense bytes, E): E contiguous copies
                dense, copies = data
                data = np.tile(dense.reshape(-1), copies)
            writer.write_tensor_data(data)
            done += n_bytes
            if progress is not None:
                progress(done, total)
        ok = True
    finally:
        writer.close()
        if not ok and os.path.exists(dst):
            os.remove(dst)  # never leave a half-written file behind
    return os.fspath(dst)
