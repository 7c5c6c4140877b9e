"""The KV cache: per layer, keys and values of every position [C, Hkv, ...], each layer's on
the backend that runs its attention. MLA: one array per layer (a token's latent and roped key
part, R + Dr values, one kv head) that serves as keys and as values (forward.py).

Cache types (llama.cpp's -ctk / -ctv names), a row of Dh values of one (position, kv head):
  f16   uint16 [C, Hkv, Dh]          f16 bit patterns
  bf16  int16  [C, Hkv, Dh]          bf16 bit patterns (the top half of an f32); int16, not
                                     uint16, so that the dtype alone tells the kernels the type
  q8_0  uint8  [C, Hkv, Dh/32 * 34]  llama.cpp's block_q8_0 per 32 values: d f16 (2 bytes,
                                     little-endian) then 32 int8 q; value = d * q
The kernels are compiled per dtype (Numba specializes on it), so f16's code is as before.

Slots (a server's parallel sequences): the C positions split into N contiguous ranges, each
slot a view of every layer's one array, [C // N, Hkv, ...], as llama-server divides -c.
"""
import numpy as np

from nbmoe.errors import NbmoeError
from nbmoe.memory import check_memory

KV_TYPES = ("f16", "bf16", "q8_0")
QK8_0 = 32
Q8_0_BYTES = 34       # one block: d f16 + 32 int8
_DTYPES = {"f16": np.uint16, "bf16": np.int16, "q8_0": np.uint8}


def check_kv_type(name, flag="-ctk"):
    """name if it is a cache type, else a one-line error naming the value and the choices."""
    if name not in KV_TYPES:
        raise NbmoeError(f"unknown KV cache type {name!r} for {flag}: choose one of {', '.join(KV_TYPES)}")
    return name


def kv_type_of(cache):
    """The type name of a cache array (by its dtype)."""
    return {np.dtype(d): n for n, d in _DTYPES.items()}[np.dtype(cache.dtype)]


def row_layout(kv_type, n_head_kv, head_dim, flag="-ctk"):
    """(shape of one position [Hkv, cols], dtype) of a cache of this type."""
    check_kv_type(kv_type, flag)
    if kv_type == "q8_0":
        if head_dim % QK8_0:
            raise NbmoeError(f"{flag} q8_0 needs a head dim that is a multiple of {QK8_0}; "
                             f"this model's is {head_dim}")
        return (n_head_kv, head_dim // QK8_0 * Q8_0_BYTES), np.uint8
    return (n_head_kv, head_dim), _DTYPES[kv_type]


class KVCache:
    def __init__(self, cfg, n_ctx, allocators=None, layer_backends=None, type_k="f16", type_v="f16"):
        if n_ctx < 1:
            raise NbmoeError(f"context size must be positive, got {n_ctx}")
        check_kv_type(type_k, "-ctk")
        check_kv_type(type_v, "-ctv")
        if cfg.is_mla and type_k != type_v:
            raise NbmoeError(f"this model (MLA) keeps keys and values in one latent cache: -ctk "
                             f"and -ctv must be the same, got {type_k} and {type_v}")
        Hkv, Dh = cfg.n_head_kv, cfg.head_dim
        (rk, dk), (rv, dv) = row_layout(type_k, Hkv, Dh, "-ctk"), row_layout(type_v, Hkv, Dh, "-ctv")
        shape_k, shape_v = (n_ctx,) + rk, (n_ctx,) + rv
        layer_backends = layer_backends or ["CPU"] * cfg.n_layer
        allocators = allocators or {"CPU": lambda s, d: np.zeros(s, d)}
        nbytes = lambda shape, dt: int(np.prod(shape)) * np.dtype(dt).itemsize
        per_layer = nbytes(shape_k, dk) + (0 if cfg.is_mla else nbytes(shape_v, dv))
        check_memory(per_layer * layer_backends.count("CPU"), f"a KV cache of {n_ctx} tokens")
        self.n_ctx, self.n_bytes, self.backends = n_ctx, per_layer * cfg.n_layer, layer_backends
        self.start = 0                # (as a view's: where its positions begin in the arrays)
        self.f16_bytes = (1 if cfg.is_mla else 2) * n_ctx * Hkv * Dh * 2 * cfg.n_layer
        self.type_k, self.type_v = type_k, type_v
        self.k = [allocators[b](shape_k, dk) for b in layer_backends]
        self.v = self.k if cfg.is_mla else [allocators[b](shape_v, dv) for b in layer_backends]

    def summary(self):
        """One line for the load messages, e.g. 'KV cache 2048 tokens: 36.0 MiB q8_0/q8_0
        (f16: 68.0 MiB)'."""
        line = f"KV cache {self.n_ctx} tokens: {self.n_bytes / 2**20:.1f} MiB {self.type_k}/{self.type_v}"
        if (self.type_k, self.type_v) != ("f16", "f16"):
            line += f" (f16: {self.f16_bytes / 2**20:.1f} MiB)"
        return line

    def slot_views(self, n_slots):
        """The cache as n_slots views of n_ctx // n_slots positions each (one: the cache)."""
        if n_slots == 1:
            return [self]
        n = self.n_ctx // n_slots
        if n < 1:
            raise NbmoeError(f"a context of {self.n_ctx} tokens cannot be shared by {n_slots} slots")
        return [KVView(self, i * n, n) for i in range(n_slots)]


class KVView:
    """Positions start .. start + n - 1 of every layer's cache: the cache of one slot."""

    def __init__(self, cache, start, n):
        self.n_ctx, self.backends, self.start = n, cache.backends, start
        self.k = [a[start:start + n] for a in cache.k]
        self.v = self.k if cache.v is cache.k else [a[start:start + n] for a in cache.v]
