"""--ep-gpu: a rank's share of the experts computed on its GPU (nbmoe/parallel/gpu_share.py)
gives the CPU share's partial sums, under the CUDA simulator on tiny shapes (one process: the
share is what a rank computes; tests/test_expert_parallel.py runs the ranks)."""
import cuda_common  # noqa: F401  (selects the simulator before numba.cuda loads)
from cuda_common import RTOL_X8, _simulator_speed, small  # noqa: F401
import cuda_setup
import numpy as np


def test_gpu_share_equals_cpu_share(tiny_model, small):
    from nbmoe.parallel.worker import open_share
    # (rows of 32: the simulator's cost is per thread, a warp a row)
    path = tiny_model("qwen3moe", n_embd=32, n_head=2, n_head_kv=1, n_ff=64, n_ff_exp=32,
                      default_type="Q8_0")
    _, cpu = open_share(path, 1, 2)                 # rank 1 of 2: experts 4-7 of each layer
    _, gpu = open_share(path, 1, 2, device=0)
    rng = np.random.default_rng(3)
    T, D, A = 3, cpu.cfg.n_embd, cpu.cfg.n_expert_used
    h = rng.standard_normal((T, D)).astype(np.float32)
    ids = np.array([[5, 1], [7, 4], [0, 2]], np.int32)        # token 2: none of this share's
    wts = rng.random((T, A)).astype(np.float32)
    il = 1                                           # (one layer: the simulator is slow)
    want, got = np.empty((T, D), np.float32), np.empty((T, D), np.float32)
    cpu.compute(want, il, h, ids, wts)
    gpu.compute(got, il, h, ids, wts)
    assert np.abs(want[:2]).min() > 0 and not want[2].any()
    np.testing.assert_allclose(got, want, rtol=RTOL_X8, atol=RTOL_X8 * np.abs(want).max())
    # one token (generation): its pairs padded to [1, A] with weight 0, as a recorded graph
    # on a GPU (twice: the first call runs the launches, the second records them; the
    # simulator records none)
    for t in (0, 1, 2) if cuda_setup.SIM else (0, 1, 0, 2):
        want1, got1 = np.empty((1, D), np.float32), np.full((1, D), np.nan, np.float32)
        cpu.compute(want1, il, h[t:t + 1], ids[t:t + 1], wts[t:t + 1])
        gpu.compute(got1, il, h[t:t + 1], ids[t:t + 1], wts[t:t + 1])
        np.testing.assert_allclose(got1, want1, rtol=RTOL_X8, atol=RTOL_X8 * np.abs(want1).max())
