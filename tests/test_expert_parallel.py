"""Expert parallelism over MPI ranks on one machine (mpiexec -n 2 / 3 on the loopback): logits
equal to one process's, and the faults (a different file, a file a rank cannot open, a rank
lost mid-run) end every rank with one line naming the rank. Skipped without mpi4py / mpiexec
(pip install 'nbmoe[mpi]')."""
import importlib.util
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from ep_run import logits

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MPIEXEC = (shutil.which("mpiexec", path=os.path.dirname(sys.executable))
           or shutil.which("mpiexec"))
pytestmark = pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or MPIEXEC is None,
                                reason="needs mpi4py and mpiexec (pip install 'nbmoe[mpi]')")


def mpiexec(args, timeout=300, env=None):
    """Run mpiexec with args from the repository root: (returncode, stderr, seconds)."""
    t0 = time.perf_counter()
    r = subprocess.run([MPIEXEC] + args, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})
    return r.returncode, r.stderr, time.perf_counter() - t0


@pytest.mark.parametrize("arch,ranks", [("qwen3moe", 2), ("qwen3moe", 3), ("gpt-oss", 3),
                                        ("deepseek2", 2)])
def test_logits_equal_one_process(tiny_model, tmp_path, arch, ranks):
    import nbmoe
    path = tiny_model(arch, default_type="Q8_0")
    want = logits(nbmoe.load(path, n_ctx=32, threads=1))
    out = str(tmp_path / "logits.npy")
    rc, err, _ = mpiexec(["-n", str(ranks), sys.executable, os.path.join(HERE, "ep_run.py"),
                          path, out, str(ranks)])
    assert rc == 0, err
    got = np.load(out)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def bench(path, ranks):
    return [sys.executable, "-m", "nbmoe.bench", "-m", path, "-p", "4", "-n", "2", "-r", "1",
            "-t", "1", "--no-bandwidth", "--ep", str(ranks)]


def test_bad_files_refused_naming_the_ranks(tiny_model, tmp_path):
    path, other = tiny_model("qwen3moe", default_type="Q8_0"), tiny_model("qwen3moe", default_type="Q8_0", n_ff_exp=32)
    missing = str(tmp_path / "missing.gguf")
    rc, err, _ = mpiexec(["-n", "1"] + bench(path, 3) + [":", "-n", "1"] + bench(other, 3)
                         + [":", "-n", "1"] + bench(missing, 3))
    assert rc != 0
    lines = [ln for ln in err.splitlines() if "error" in ln]
    assert len(lines) == 1, err
    assert "rank 1" in lines[0] and "different model file" in lines[0], err
    assert "rank 2" in lines[0] and "missing.gguf" in lines[0], err


def test_lost_rank_ends_the_run(tiny_model):
    # rank 1 exits at its 3rd layer message; -disable-auto-cleanup keeps MPICH's launcher from
    # ending the others first, so rank 0's own bound (2 s here) and message are what is tested
    path = tiny_model("qwen3moe", default_type="Q8_0")
    rc, err, seconds = mpiexec(["-disable-auto-cleanup", "-n", "2"] + bench(path, 2),
                               env={"NBMOE_TEST_EP_EXIT": "1:3", "NBMOE_EP_TIMEOUT": "2"})
    assert rc != 0
    lines = [ln for ln in err.splitlines() if "error" in ln]
    assert len(lines) == 1 and "rank 1 sent no partial sums" in lines[0], err
    assert seconds < 120, seconds
