"""Pick the CUDA target for GPU tests: the simulator unless NBMOE_REAL_GPU=1 asks for the GPU.

Import this before anything imports numba.cuda. Numba reads its environment once, at import
(conftest imports numba first), and setting a NUMBA_ variable afterwards would make its next
compile re-read them all, undoing settings made in code (nbmoe sets SLP_VECTORIZE): so when
numba is already imported, set the flag numba.cuda reads instead.
"""
import os
import sys

import pytest

if os.environ.get("NBMOE_REAL_GPU") != "1" and "NUMBA_ENABLE_CUDASIM" not in os.environ:
    if "numba" in sys.modules:
        import numba.core.config
        numba.core.config.ENABLE_CUDASIM = 1
    else:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

try:
    import nbmoe.cuda as nbcuda  # applies the numpy shim before numba.cuda is imported
    from numba import cuda  # noqa: F401
except ImportError as e:  # numba-cuda or its CUDA bindings not installed
    pytest.skip(f"numba.cuda is not importable ({e}): pip install -e '.[cuda]'",
                allow_module_level=True)
if not nbcuda.is_available():
    pytest.skip("no CUDA GPU (and the simulator was not selected before numba.cuda was imported)",
                allow_module_level=True)
SIM = nbcuda.SIM
