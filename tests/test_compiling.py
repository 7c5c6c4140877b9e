"""compiling.py: the progress display while kernels compile, its estimate and its record."""
import io
import types

import numpy as np
from numba import njit
from rich.console import Console

from nbmoe import compiling
from nbmoe.cpu import matmul
from nbmoe.cpu.quants import Q4_1
from nbmoe.cpu.specialize import build


def fake_llm(qtypes=(Q4_1,)):
    tensors = {f"w{i}": types.SimpleNamespace(ggml_type=q, ne=(64, 64)) for i, q in enumerate(qtypes)}
    return types.SimpleNamespace(placement={n: ("CPU", "default") for n in tensors}, repacked={},
                                 file=types.SimpleNamespace(tensors=tensors), backends={"CPU": None},
                                 cfg=types.SimpleNamespace(arch="llama"))


def test_kernel_names():
    assert compiling.kernel_name(build(matmul._products_kernel, (Q4_1, True))) == "matmul.products[Q4_1]"
    assert compiling.kernel_name(matmul._group_by_expert) == "matmul._group_by_expert"


def test_quiet_when_nothing_compiles(monkeypatch, tmp_path):
    monkeypatch.setenv("NBMOE_CACHE", str(tmp_path))
    out = io.StringIO()
    with compiling.CompileProgress(Console(file=out), "warming up", fake_llm(), "test"):
        pass
    assert out.getvalue() == ""


def test_compiling_is_shown_counted_and_recorded(monkeypatch, tmp_path):
    """Not a terminal: a line when compiling starts and one when it ends; the count is
    recorded and is the next estimate for the same kind of model."""
    monkeypatch.setenv("NBMOE_CACHE", str(tmp_path))
    llm = fake_llm()
    assert compiling.expected_kernels(llm, "test") == (16, False)          # a guess: 1 type

    @njit
    def fresh(x):
        return x + 1

    out = io.StringIO()
    with compiling.CompileProgress(Console(file=out, width=200), "warming up", llm, "test"):
        fresh(np.float32(1))
        fresh(np.int64(1))
    text = out.getvalue()
    assert "compiling kernels for this model's weight types (about 16" in text
    assert "compiled 2 kernels in" in text
    assert compiling.expected_kernels(llm, "test") == (2, True)
    assert compiling.expected_kernels(llm, "bench") == (16, False)          # another purpose


def test_the_terminal_display_names_the_kernel():
    progress = compiling.CompileProgress(Console(file=io.StringIO(), force_terminal=True, width=200),
                                         "warming up", fake_llm(), "test")
    progress.watch.started, progress.watch.done, progress.watch.current = 0.0, 3, "matmul.products[Q4_1]"
    out = io.StringIO()
    Console(file=out, width=200).print(progress._render())
    assert "compiling kernels" in out.getvalue() and "3/~16" in out.getvalue()
    assert "matmul.products[Q4_1]" in out.getvalue()


def test_no_helper_process_for_a_model_with_gpu_layers(monkeypatch):
    monkeypatch.setattr(compiling, "_ahead", None)
    llm = fake_llm()
    llm.backends = {"CPU": None, "CUDA0": None}
    compiling.start_ahead(llm, [16])
    assert compiling._ahead is None
    compiling.wait_ahead()              # nothing to wait for


def test_compile_command_passes_cache_types_and_fmoe(monkeypatch):
    """python -m nbmoe.compile -ctk/-ctv (comma lists: every combination) and -fmoe load the
    engine each way, so that the attention kernels of those cache types compile; the helper
    process of a cold start gets the running engine's -fmoe, -ctk and -ctv."""
    import nbmoe.engine
    from nbmoe.cli import compile as cli_compile
    loads = []
    monkeypatch.setattr(nbmoe.engine, "load", lambda path, **kw: loads.append(kw) or kw)
    monkeypatch.setattr(cli_compile, "compile_batches", lambda llm, batches: None)
    cli_compile.main(["-m", "x.gguf", "-ctk", "f16,q8_0", "-ctv", "bf16", "-fmoe", "0", "--quiet"])
    assert [(kw["cache_type_k"], kw["cache_type_v"], kw["fused_moe"]) for kw in loads] == [
        ("f16", "bf16", False), ("q8_0", "bf16", False)]

    started = []
    monkeypatch.setattr(compiling, "_ahead", None)
    monkeypatch.setattr(compiling.subprocess, "Popen", lambda cmd, **kw: started.append(cmd))
    llm = fake_llm()
    llm.path, llm.n_ubatch, llm.flash_attn, llm.fused_moe = "x.gguf", 16, "auto", False
    llm.kv = types.SimpleNamespace(type_k="q8_0", type_v="q8_0")
    compiling.start_ahead(llm, [16])
    cmd = " ".join(started[0])
    assert "-fmoe 0" in cmd and "-ctk q8_0 -ctv q8_0" in cmd
    assert compiling.model_key(llm, "chat").endswith("fmoe=0 kv=q8_0/q8_0")
    monkeypatch.setattr(compiling, "_ahead", None)
