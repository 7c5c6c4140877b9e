"""deepseek2 and glm4moe in their shipped types on CUDA, all on the GPU and with the experts in
RAM: as close to the float64 math as llama.cpp, the recorded cases of test_family_types, as a
prompt batch (the int8 tensor-core products) and token by token (the decode kernels).

A real GPU only: the simulator runs each family's placements in test_hybrid_families.py, at
shapes too small for these types' 256-blocks.
"""
import cuda_setup  # noqa: F401  (selects the simulator before numba.cuda loads; skips without it)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import nbmoe  # noqa: E402
from test_family_types import RECORD, as_close_as_llamacpp, recorded_case  # noqa: E402

pytestmark = pytest.mark.skipif(cuda_setup.SIM, reason="CI time: real GPU only")

PLACEMENTS = {"gpu": dict(n_gpu_layers=99), "hybrid": dict(n_gpu_layers=99, override_tensors=["exps=CPU"])}


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("name", sorted(RECORD["cases"]))
def test_as_close_to_float64_as_llamacpp_on_cuda(name, placement, tmp_path):
    path, tokens, want, theirs = recorded_case(name, tmp_path)
    llm = nbmoe.load(path, n_ctx=32, threads=2, **PLACEMENTS[placement])
    assert "CUDA0" in llm.backends
    assert as_close_as_llamacpp(f"{name} {placement} batch", llm.eval(tokens), want, theirs)
    llm.reset()
    steps = np.concatenate([llm.eval([t]) for t in tokens])
    assert as_close_as_llamacpp(f"{name} {placement} by token", steps, want, theirs)
