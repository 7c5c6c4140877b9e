"""The KV cache: per layer, keys and values of every position as f16 bits [C, Hkv, Dh]."""
import numpy as np

from .errors import NbmoeError
from .memory import check_memory


class KVCache:
    def __init__(self, cfg, n_ctx):
        shape = (n_ctx, cfg.n_head_kv, cfg.head_dim)
        n_bytes = 2 * cfg.n_layer * int(np.prod(shape)) * 2
        check_memory(n_bytes, f"a KV cache of {n_ctx} tokens")
        if n_ctx < 1:
            raise NbmoeError(f"context size must be positive, got {n_ctx}")
        self.n_ctx = n_ctx
        self.k = [np.zeros(shape, np.uint16) for _ in range(cfg.n_layer)]
        self.v = [np.zeros(shape, np.uint16) for _ in range(cfg.n_layer)]
        self.n_bytes = n_bytes
