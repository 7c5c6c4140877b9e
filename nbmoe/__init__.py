"""nbmoe: Mixture-of-Experts GGUF inference in plain Python compiled by Numba."""
import os

import numba

# Numba keeps LLVM's SLP vectorizer off by default; the block dot products need it to use
# SIMD (see KERNEL_NOTES.md). It must be set before the first kernel compiles.
if "NUMBA_SLP_VECTORIZE" not in os.environ:
    numba.config.SLP_VECTORIZE = 1

from .engine import LLM, load  # noqa: E402
from .errors import NbmoeError  # noqa: E402

__all__ = ["LLM", "load", "NbmoeError"]
__version__ = "0.1.0"
