"""The command-line tools end to end, in subprocesses: bench, REPL, and their errors."""
import json
import os
import subprocess
import sys

import pytest


def run(args, stdin="", env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", *args], input=stdin, capture_output=True,
                          text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def moe_model(tiny_model):
    return tiny_model("llama", n_expert=4, n_expert_used=2, default_type="Q4_1")


def test_bench_json(moe_model):
    r = run(["nbmoe.bench", "-m", moe_model, "-p", "16", "-n", "4", "-r", "2", "-t", "1",
             "-o", "json", "--no-bandwidth"])
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["n_prompt"], x["n_gen"]) for x in rows] == [(16, 0), (0, 4)]
    for x in rows:
        assert x["avg_ts"] > 0 and x["n_threads"] == 1 and len(x["samples_ts"]) == 2
        assert x["model_filename"] == os.path.basename(moe_model)
        assert 0 < x["model_size"] <= os.path.getsize(moe_model)
        assert x["model_n_params"] > 0


def test_bench_table(moe_model):
    r = run(["nbmoe.bench", "-m", moe_model, "-p", "8", "-n", "2", "-r", "1", "-t", "1"])
    assert r.returncode == 0, r.stderr
    assert "pp8" in r.stdout and "tg2" in r.stdout and "t/s" in r.stdout and "GB/s" in r.stdout


def test_bench_rtr(moe_model):
    """-rtr 0,1: a model loaded each way, the rows tagged; the REPL takes -rtr too."""
    r = run(["nbmoe.bench", "-m", moe_model, "-p", "0", "-n", "2", "-r", "1", "-t", "1",
             "-rtr", "0,1", "-o", "json", "--no-bandwidth"])
    assert r.returncode == 0, r.stderr
    assert [x["repack"] for x in json.loads(r.stdout)] == [False, True]
    r = run(["nbmoe", "-m", moe_model, "-n", "4", "--temp", "0", "-rtr"], stdin="hello\n")
    assert r.returncode == 0, r.stderr


def test_repl_piped(moe_model):
    r = run(["nbmoe", "-m", moe_model, "-n", "8", "--temp", "0"], stdin="hello\n/stats\n/reset\nhi\n/quit\n")
    assert r.returncode == 0, r.stderr
    assert "t/s" in r.stderr and "conversation cleared" in r.stderr


def one_line_error(r):
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    return lines[0]


def test_missing_file_error(tmp_path):
    assert "no such file" in one_line_error(run(["nbmoe.bench", "-m", str(tmp_path / "x.gguf")]))


def test_not_gguf_error(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_text("hello")
    assert "not a GGUF" in one_line_error(run(["nbmoe", "-m", str(p)], stdin="hi\n"))


def test_truncated_error(tmp_path, moe_model):
    p = tmp_path / "cut.gguf"
    p.write_bytes(open(moe_model, "rb").read()[: os.path.getsize(moe_model) // 2])
    assert "truncated" in one_line_error(run(["nbmoe.bench", "-m", str(p), "-r", "1"]))


def test_unknown_architecture_error(tmp_path, moe_model):
    data = open(moe_model, "rb").read()
    p = tmp_path / "arch.gguf"
    p.write_bytes(data.replace(b"llama", b"xxxxx", 1))     # general.architecture's value
    msg = one_line_error(run(["nbmoe.bench", "-m", str(p), "-r", "1"]))
    assert "unsupported architecture" in msg and "qwen3moe" in msg


def test_prompt_longer_than_context(moe_model):
    msg = one_line_error(run(["nbmoe", "-m", moe_model, "-c", "16", "-n", "4"], stdin="word " * 40 + "\n"))
    assert "context" in msg


def test_bad_override_errors(moe_model):
    msg = one_line_error(run(["nbmoe.bench", "-m", moe_model, "-ot", "exps=CUDA9", "-r", "1"]))
    assert "unknown buffer type 'CUDA9'" in msg and "available: CPU" in msg
    msg = one_line_error(run(["nbmoe.bench", "-m", moe_model, "-ot", "(exps=CPU", "-r", "1"]))
    assert "bad regex '(exps'" in msg
    msg = one_line_error(run(["nbmoe.bench", "-m", moe_model, "-op", "NOPE,1", "-r", "1"]))
    assert "unknown op 'NOPE'" in msg
    msg = one_line_error(run(["nbmoe.bench", "-m", moe_model, "-zce", "2", "-r", "1"]))
    assert "-zce needs a MoE layer whose router is on a GPU" in msg     # CPU only: no GPU share
    r = run(["nbmoe.bench", "-m", moe_model, "-zce", "x", "-r", "1"])
    assert r.returncode == 2 and "expected 'auto' or a number, got 'x'" in r.stderr


def test_explain_and_timings(moe_model):
    r = run(["nbmoe.bench", "-m", moe_model, "-p", "8", "-n", "2", "-r", "1", "-t", "1",
             "--explain", "--timings", "--no-bandwidth"])
    assert r.returncode == 0, r.stderr
    assert "tensor placement" in r.stderr and "ffn_up_exps.weight" in r.stderr
    assert "schedule per micro-batch" in r.stderr and "MUL_MAT_ID" in r.stderr
    assert "Python scheduling" in r.stderr
