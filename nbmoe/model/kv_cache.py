"""The KV cache: per layer, keys and values of every position as f16 bits [C, Hkv, Dh],
each layer's on the backend that runs its attention. MLA: one array per layer, [C, 1, R + Dr]
(a token's latent and roped key part), that serves as keys and as values (forward.py).

Slots (a server's parallel sequences): the C positions split into N contiguous ranges, each
slot a view of every layer's one array, [C // N, Hkv, Dh], as llama-server divides -c."""
import numpy as np

from nbmoe.errors import NbmoeError
from nbmoe.memory import check_memory


class KVCache:
    def __init__(self, cfg, n_ctx, allocators=None, layer_backends=None):
        if n_ctx < 1:
            raise NbmoeError(f"context size must be positive, got {n_ctx}")
        shape = (n_ctx, cfg.n_head_kv, cfg.head_dim)
        layer_backends = layer_backends or ["CPU"] * cfg.n_layer
        allocators = allocators or {"CPU": lambda s, d: np.zeros(s, d)}
        per_layer = (1 if cfg.is_mla else 2) * int(np.prod(shape)) * 2
        check_memory(per_layer * layer_backends.count("CPU"), f"a KV cache of {n_ctx} tokens")
        self.n_ctx, self.n_bytes, self.backends = n_ctx, per_layer * cfg.n_layer, layer_backends
        self.k = [allocators[b](shape, np.uint16) for b in layer_backends]
        self.v = self.k if cfg.is_mla else [allocators[b](shape, np.uint16) for b in layer_backends]

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
        self.n_ctx, self.backends = n, cache.backends
        self.k = [a[start:start + n] for a in cache.k]
        self.v = self.k if cache.v is cache.k else [a[start:start + n] for a in cache.v]
