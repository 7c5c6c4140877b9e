"""The command-line tools end to end, in subprocesses: bench, REPL, and their errors."""
import json
import os
import subprocess
import sys

import pytest


def run(args, stdin="", env_extra=None):
    """env_extra: variables to set (None: removed)."""
    env = {k: v for k, v in {**os.environ, **(env_extra or {})}.items() if v is not None}
    return subprocess.run([sys.executable, "-m", *args], input=stdin, capture_output=True,
                          text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def moe_model(tiny_model):
    return tiny_model("llama", n_expert=4, n_expert_used=2, default_type="Q4_1")


def test_bench_json(moe_model):
    """-d 0,8: each test on an empty cache, then after 8 tokens."""
    r = run(["nbmoe.bench", "-m", moe_model, "-p", "16", "-n", "4", "-r", "2", "-t", "1",
             "-o", "json", "--no-bandwidth", "-d", "0,8"])
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["n_prompt"], x["n_gen"], x["n_depth"]) for x in rows] == [
        (16, 0, 0), (16, 0, 8), (0, 4, 0), (0, 4, 8)]
    for x in rows:
        assert x["avg_ts"] > 0 and x["n_threads"] == 1 and len(x["samples_ts"]) == 2
        assert x["model_filename"] == os.path.basename(moe_model)
        assert 0 < x["model_size"] <= os.path.getsize(moe_model)
        assert x["model_n_params"] > 0


def test_bench_table(moe_model):
    """-fa 1,0: a run each, an fa column."""
    r = run(["nbmoe.bench", "-m", moe_model, "-p", "8", "-n", "2", "-r", "1", "-t", "1", "-fa", "1,0"])
    assert r.returncode == 0, r.stderr
    assert "pp8" in r.stdout and "tg2" in r.stdout and "t/s" in r.stdout and "GB/s" in r.stdout
    fa = [ln.split("│")[7].strip() for ln in r.stdout.splitlines() if "pp8" in ln]
    assert fa == ["on", "off"], r.stdout


def test_sweep_json_plot_and_plot_from(moe_model, tmp_path):
    """Two runs (-fa on,off) as json rows and one plot; --plot-from draws the saved runs and
    shows their tables."""
    r = run(["nbmoe.sweep", "-m", moe_model, "-c", "48", "-ub", "16", "-n", "2", "-t", "1",
             "-fa", "on,off", "-o", "json", "--label", "tiny", "--plot", str(tmp_path / "a.png")])
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["label"], x["n_kv"]) for x in rows] == [
        ("tiny -fa on", 0), ("tiny -fa on", 16), ("tiny -fa off", 0), ("tiny -fa off", 16)]
    for x in rows:
        assert (x["pp"], x["tg"], x["n_ubatch"]) == (16, 2, 16)
        assert x["speed_pp"] == pytest.approx(16 / x["t_pp"]) and x["speed_tg"] > 0
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "a.json").write_text(r.stdout)
    r = run(["nbmoe.sweep", "--plot-from", str(tmp_path / "a.json"), "--plot", str(tmp_path / "b.png")])
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("S_PP t/s") == 2 and "tiny -fa off" in r.stdout
    assert (tmp_path / "b.png").stat().st_size > 10000
    (tmp_path / "bad.json").write_text("[1, 2]")
    msg = one_line_error(run(["nbmoe.sweep", "--plot-from", str(tmp_path / "bad.json"), "--plot",
                              str(tmp_path / "c.png")]))
    assert "is not the output of `python -m nbmoe.sweep -o json`" in msg


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
    assert "attention on CPU (-fa auto): 1 token: one-token kernel, 8 tokens: flash" in r.stderr
    assert "Python scheduling" in r.stderr


def test_bench_muge(moe_model):
    """-muge 0,1: a run each, the column, and --explain's line of the merged layers."""
    r = run(["nbmoe.bench", "-m", moe_model, "-p", "8", "-n", "0", "-r", "1", "-t", "1",
             "-muge", "0,1", "--explain", "--no-bandwidth", "-o", "json"])
    assert r.returncode == 0, r.stderr
    assert [x["merge_up_gate"] for x in json.loads(r.stdout)] == [0, 1]
    assert "-muge (ffn_gate_up_exps): layers 0-1 merged" in r.stderr
    assert "ffn_gate_up_exps.weight" in r.stderr


# ---- bad flag values: one line, exit 2, before any model loads ---------------------------

@pytest.mark.parametrize("args, message", [
    (["nbmoe.bench", "-t", "0"], "argument -t/--threads: must be at least 1, got 0"),
    (["nbmoe.bench", "-r", "0"], "argument -r/--repetitions: must be at least 1, got 0"),
    (["nbmoe.bench", "-p", "-5"], "argument -p/--n-prompt: must be 0 or more"),
    (["nbmoe.bench", "-n", "-5"], "argument -n/--n-gen: must be 0 or more"),
    (["nbmoe", "-n", "-5"], "argument -n/--n-predict: must be at least 1, or -1"),
    (["nbmoe", "-t", "0"], "argument -t/--threads: must be at least 1, got 0"),
])
def test_bad_value_one_line(args, message):
    r = run(args, stdin="hi\n")
    assert r.returncode == 2 and message in one_line_error(r)


@pytest.mark.parametrize("tool, args, message", [
    ("bench", ["-t", "1,0"], "-t/--threads: must be at least 1, got 0"),
    ("bench", ["-p", "0", "-n", "0"], "nothing to run: every -p and -n is 0"),
    ("bench", ["-p", "x"], "-p/--n-prompt: expected a comma list of integers, got 'x'"),
    ("bench", ["-ub", "0"], "-ub/--ubatch-size: must be at least 1, got 0"),
    ("bench", ["-ub", ","], "-ub/--ubatch-size: expected a comma list of integers, got ','"),
    ("bench", ["-ngl", "-1"], "-ngl/--n-gpu-layers: must be 0 or more"),
    ("bench", ["-ngl", "x"], "-ngl/--n-gpu-layers: expected a comma list of integers, got 'x'"),
    ("bench", ["-rtr", "2"], "-rtr/--run-time-repack: must be 0 or 1, got 2"),
    ("bench", ["-muge", "0,2"], "-muge/--merge-up-gate-experts: must be 0 or 1, got 2"),
    ("bench", ["-zce", "-1"], "-zce/--zero-copy-experts: must be 'auto' or 0 or more, got -1"),
    ("bench", ["-b", "0"], "-b/--batch-size: must be at least 1, got 0"),
    ("bench", ["-o", "xml"], "-o/--output: invalid choice: 'xml'"),
    ("bench", ["--n-cpu-moe", "-2"], "--n-cpu-moe: must be 0 or more, got -2"),
    ("chat", ["-c", "-1"], "-c/--ctx-size: must be 0 or more"),
    ("chat", ["-ub", "0"], "-ub/--ubatch-size: must be at least 1, got 0"),
    ("chat", ["--temp", "-1"], "--temp: must be 0 or more (0 = greedy), got -1.0"),
    ("chat", ["--temp", "nan"], "--temp: must be 0 or more"),
    ("chat", ["--top-k", "-1"], "--top-k: must be 0 or more"),
    ("chat", ["--top-p", "1.5"], "--top-p: must be between 0 and 1 (1 = off), got 1.5"),
    ("chat", ["--min-p", "-0.1"], "--min-p: must be between 0 and 1"),
    ("chat", ["--repeat-penalty", "0"], "--repeat-penalty: must be above 0"),
    ("chat", ["--seed", "-2"], "--seed: must be 0 or more, or -1 (random), got -2"),
    ("chat", ["-n", "0"], "-n/--n-predict: must be at least 1, or -1"),
    ("chat", ["-zce", "x"], "-zce/--zero-copy-experts: expected 'auto' or a number, got 'x'"),
    ("chat", ["--bogus"], "unrecognized arguments: --bogus"),
    ("bench", ["-fa", "1,maybe"], "-fa/--flash-attn: expected on, off or auto (or 1, 0), got 'maybe'"),
    ("chat", ["-fa", "2"], "-fa/--flash-attn: expected on, off or auto (or 1, 0), got '2'"),
    ("sweep", ["-c", "100", "-ub", "96", "-n", "8"], "-c/--ctx-size: 100 leaves no depth to measure"),
    ("sweep", ["-n", "0"], "-n/--n-gen: must be at least 1, got 0"),
    ("sweep", ["--plot-from", "a.json"], "--plot-from: needs --plot FILE.png"),
    ("sweep", ["-o", "xml"], "-o/--output: invalid choice: 'xml'"),
    ("chat", ["-ctk", "q4_0"], "-ctk/--cache-type-k: unknown KV cache type 'q4_0': choose one of f16, bf16, q8_0"),
    ("bench", ["-ctv", "f16,q5"], "-ctv/--cache-type-v: unknown KV cache type 'q5': choose one of f16, bf16, q8_0"),
])
def test_every_flag_checked(tool, args, message, capsys):
    """The sweep over the tools' flags, in this process (the same parser as above)."""
    from nbmoe.cli import bench, chat, sweep
    with pytest.raises(SystemExit) as e:
        {"bench": bench, "chat": chat, "sweep": sweep}[tool].parse_args(args)
    assert e.value.code == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], lines


def test_good_edge_values_accepted():
    from nbmoe.cli import bench, chat
    a = chat.parse_args(["-n", "-1", "-c", "0", "--seed", "-1", "--temp", "0", "--top-p", "1",
                         "--top-k", "0", "--min-p", "0", "-zce", "0"])
    assert (a.n_predict, a.ctx_size, a.seed) == (-1, 0, -1)
    b = bench.parse_args(["-p", "0", "-n", "4", "-ngl", "0,99", "-rtr", "0,1", "-zce", "auto,2",
                          "-fa", "1,0,auto,OFF", "-ctk", "f16,q8_0", "-ctv", "bf16"])
    assert b.ngl_list == [0, 99] and b.rtr_list == [False, True] and b.zce_list == ["auto", 2]
    assert b.fa_list == ["on", "off", "auto", "off"]
    assert (b.cache_type_k, b.cache_type_v) == (["f16", "q8_0"], ["bf16"])
    assert chat.parse_args(["-fa", "off"]).flash_attn == "off" and chat.parse_args([]).flash_attn is None


def warnings_of(r):
    return [ln for ln in r.stderr.splitlines() if ln.startswith("warning:")]


def test_more_threads_and_ngl_without_gpu_warn(moe_model):
    """As llama.cpp: more threads than cores and -ngl without a GPU go on, each with one
    warning line (Numba's pool caps the threads)."""
    import numba
    pool = numba.config.NUMBA_NUM_THREADS
    r = run(["nbmoe.bench", "-m", moe_model, "-t", "64", "-ngl", "99", "-p", "0", "-n", "2",
             "-r", "1", "-o", "json", "--no-bandwidth"], env_extra={"NUMBA_ENABLE_CUDASIM": None})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    rows = json.loads(r.stdout)
    assert [x["n_threads"] for x in rows] == [pool]
    no_gpu = ["warning: no usable CUDA GPU: -ngl 99 is ignored, every layer runs on the CPU"]
    assert warnings_of(r) == [
        f"warning: 64 threads asked, but Numba's pool has {pool} (NUMBA_NUM_THREADS, by default "
        f"the core count): using {pool}"] + (no_gpu if rows[0]["backends"] == "CPU" else []), r.stderr


def test_chat_more_threads_and_output_closed_early(moe_model):
    """The chat: -t 64 warns once and goes on; `| head` (the reader leaves mid-reply) ends it
    without a traceback."""
    p = subprocess.Popen([sys.executable, "-m", "nbmoe", "-m", moe_model, "-n", "-1", "-c", "4096",
                          "--temp", "0", "-t", "64"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    p.stdin.write("hello\n")
    p.stdin.close()
    assert len(p.stdout.read(10)) == 10
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=600) != 0 and "Traceback" not in err, err
    warned = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    assert len(warned) == 1 and "64 threads asked" in warned[0], err


def test_bench_times_without_the_cycle_collector(monkeypatch):
    """The timed repetitions run with Python's cycle collector off (a full pass over a loaded
    model's objects takes 0.1-0.4 s), the warm-ups with it on, and it is on again after."""
    import gc
    from types import SimpleNamespace
    from nbmoe.cli import bench
    seen = []
    monkeypatch.setattr(bench, "run_pp", lambda *a: seen.append(gc.isenabled()) or 1.0)
    args = SimpleNamespace(batch_size=512, repetitions=3)
    assert bench.run_test(SimpleNamespace(backends={"CPU": None}), "pp", 16, args, None) == [1.0, 1.0, 1.0]
    assert seen == [True, True, False, False, False] and gc.isenabled()


def test_bench_times_after_the_helper_compile_ends(monkeypatch):
    """A cold start's helper process (compiling generation's kernels during the prompt test)
    ends before the prompt's timed repetitions start: they would share its cores."""
    from types import SimpleNamespace
    from nbmoe import compiling
    from nbmoe.cli import bench
    seen = []
    monkeypatch.setattr(compiling, "_ahead", SimpleNamespace(wait=lambda: seen.append("helper done")))
    monkeypatch.setattr(bench, "run_pp", lambda *a: seen.append("run") or 1.0)
    args = SimpleNamespace(batch_size=512, repetitions=2)
    assert bench.run_test(SimpleNamespace(backends={"CPU": None}), "pp", 16, args, None) == [1.0, 1.0]
    assert seen == ["run", "run", "helper done", "run", "run"] and compiling._ahead is None


def test_bench_profiles_the_timed_runs_alone(monkeypatch):
    """NBMOE_PROFILE_TIMED with a GPU: the profiler's range opens after the warm-ups and closes
    after the last timed run (ncu --profile-from-start off then sees those alone)."""
    from types import SimpleNamespace
    from numba import cuda
    from nbmoe import config
    from nbmoe.cli import bench
    seen = []
    monkeypatch.setattr(config, "PROFILE_TIMED", True)
    monkeypatch.setattr(cuda, "synchronize", lambda: None)
    monkeypatch.setattr(cuda, "profile_start", lambda: seen.append("start"), raising=False)
    monkeypatch.setattr(cuda, "profile_stop", lambda: seen.append("stop"), raising=False)
    monkeypatch.setattr(bench, "run_pp", lambda *a: seen.append("run") or 1.0)
    args = SimpleNamespace(batch_size=512, repetitions=2)
    llm = SimpleNamespace(backends={"CUDA0": None, "CPU": None})
    assert bench.run_test(llm, "pp", 16, args, None) == [1.0, 1.0]
    assert seen == ["run", "run", "start", "run", "run", "stop"]
    seen.clear()
    bench.run_test(SimpleNamespace(backends={"CPU": None}), "pp", 16, args, None)
    assert seen == ["run"] * 4
