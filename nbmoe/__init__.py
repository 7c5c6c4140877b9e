"""nbmoe: Mixture-of-Experts GGUF inference in plain Python compiled by Numba."""
import os

import numba

# Numba keeps LLVM's SLP vectorizer off by default; the block dot products need it to use
# SIMD (see KERNEL_NOTES.md). It must be set before the first kernel compiles.
if "NUMBA_SLP_VECTORIZE" not in os.environ:
    numba.config.SLP_VECTORIZE = 1

from .errors import NbmoeError  # noqa: E402

__all__ = ["LLM", "load", "NbmoeError"]
__version__ = "0.1.0"


def __getattr__(name):
    # The engine is imported on first use, so `import nbmoe.cpu.ops` stays light.
    if name in ("LLM", "load"):
        from . import engine
        return getattr(engine, name)
    raise AttributeError(name)
