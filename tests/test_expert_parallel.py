"""Expert parallelism over MPI ranks on one machine (mpiexec -n 2 / 3 on the loopback): logits
equal to one process's, and the faults (a different file, a file a rank cannot open, a rank
lost mid-run) end every rank with one line naming the rank. Skipped without mpi4py / mpiexec
(pip install 'nbmoe[mpi]')."""
import importlib.util
import os
import shutil
import signal
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


def test_rank_override_logits_equal_one_process(tiny_model, tmp_path):
    # layer 0's experts split evenly, layer 1's all on rank 1, layer 2's all on rank 0 (no
    # message for it)
    import nbmoe
    path = tiny_model("qwen3moe", default_type="Q8_0", n_layer=3)
    want = logits(nbmoe.load(path, n_ctx=32, threads=1))
    out = str(tmp_path / "logits.npy")
    rc, err, _ = mpiexec(["-n", "2", sys.executable, os.path.join(HERE, "ep_run.py"), path, out,
                          "2", r"blk\.1\.ffn_.*_exps=RANK1,blk\.2\.ffn_.*_exps=RANK0"])
    assert rc == 0, err
    np.testing.assert_allclose(np.load(out), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    explain = open(out + ".txt").read()
    assert "experts 0-3 of layer 0; experts 0-7 of layer 2," in explain, explain
    assert "experts 4-7 of layer 0; experts 0-7 of layer 1," in explain, explain


def test_rank_overrides_placement():
    from nbmoe.errors import NbmoeError
    from nbmoe.sched.placement import expert_ranks, parse_overrides
    rules = parse_overrides([r"blk\.[23]\.ffn_.*_exps=RANK2,blk\.3\.=CPU,exps=RANK0"], ["CPU"], n_ranks=3)
    layout = expert_ranks(range(5), 6, 3, rules)
    assert layout[2] == layout[3] == [(0, 0), (0, 0), (0, 6)]        # first match wins
    assert layout[0] == [(0, 6), (0, 0), (0, 0)]
    layout = expert_ranks(range(2), 6, 3, parse_overrides(["blk.1.ffn=CPU"], ["CPU"], n_ranks=3))
    assert layout[0] == layout[1] == [(0, 2), (2, 4), (4, 6)]          # the even split
    for specs, n_ranks, words in ((["exps=RANK2"], 2, "no rank 2, --ep 2 has ranks RANK0 to RANK1"),
                                  (["exps=RANK1"], 1, "needs --ep R")):
        with pytest.raises(NbmoeError, match=words):
            parse_overrides(specs, ["CPU"], n_ranks=n_ranks)
    with pytest.raises(NbmoeError, match="layer 0's expert tensors would be on different ranks"):
        expert_ranks([0], 6, 2, parse_overrides(["up_exps=RANK1"], ["CPU"], n_ranks=2))


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


def test_server_answers_as_one_process(tiny_model):
    # the same chat completion (sampled, with a seed) from a one-process server and from
    # `mpiexec -n 2 python -m nbmoe.server --ep 2`; Ctrl-C to mpiexec ends every rank
    from test_server import HI, free_port
    import httpx
    path = tiny_model("qwen3moe", default_type="Q8_0")
    body = {"messages": HI, "max_tokens": 12, "temperature": 1.0, "seed": 5}
    texts = []
    for ranks in (1, 2):
        port = free_port()
        cmd = [sys.executable, "-m", "nbmoe.server", "-m", path, "--port", str(port), "-t", "1",
               "-c", "256"]
        cmd = [MPIEXEC, "-n", "2"] + cmd + ["--ep", "2"] if ranks > 1 else cmd
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 120
            while True:
                assert proc.poll() is None, proc.stderr.read()
                try:
                    if httpx.get(url + "/health", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.time() < deadline, "the server did not start"
                time.sleep(0.2)
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["message"]["content"])
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
        assert rc == 0, proc.stderr.read()
    assert texts[0] and texts[1] == texts[0], texts
