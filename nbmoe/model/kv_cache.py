"""The KV cache: per layer, keys and values of every position as f16 bits [C, Hkv, Dh],
each layer's on the backend that runs its attention. MLA: one array per layer, [C, 1, R + Dr]
(a token's latent and roped key part), that serves as keys and as values (forward.py)."""
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
