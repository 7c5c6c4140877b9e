"""Each model family on the GPU and split between the CPU and the GPU: the CPU engine's
logits (apart from tests/test_hybrid.py so that a second test worker runs them beside it).

Runs on the CUDA simulator in CI (tiny models) and on a real GPU with NBMOE_REAL_GPU=1.
"""
import cuda_setup  # noqa: F401  (selects the simulator before numba.cuda loads)
import pytest

import nbmoe
from cuda_common import _simulator_speed  # noqa: F401  (fixture: a short GIL switch interval)
from test_hybrid import PROMPT, close, cpu_logits, exact, load  # noqa: F401  (exact: autouse fixture)


def _family_model(tiny_model, family):
    """A tiny model of each family with every variant it has (tests/conftest.py TINY), smaller
    in the simulator: gpt-oss (biases, sinks, a window, YaRN, clamped SwiGLU, softmax over the
    chosen), glm4moe (a dense layer 0, sigmoid routing with a selection bias and a scale, a
    shared expert, q/k/v biases, partial RoPE, a NextN block left unread), deepseek2 (MLA with
    its latent cache, q lora, sigmoid + bias + groups, shared expert)."""
    if family == "gpt-oss":
        shape = dict(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=32, n_expert=4,
                     n_expert_used=2, n_ff_exp=32, sliding_window=2) if cuda_setup.SIM else {}
        return tiny_model("gpt-oss", types=[("exps", "MXFP4")], default_type="Q8_0", **shape)
    if family == "glm4moe":
        shape = dict(n_embd=32, n_head=2, n_head_kv=1, n_ff=32, n_expert=4, n_expert_used=2,
                     n_ff_exp=32, n_layer=2) if cuda_setup.SIM else {}
        return tiny_model("glm4moe", types=[("exps", "Q4_0")], default_type="Q8_0", **shape)
    from conftest import DEEPSEEK_V3
    if not cuda_setup.SIM:
        return tiny_model("deepseek2", **DEEPSEEK_V3, default_type="Q8_0")
    # 8 experts in 4 groups of 2: the top 2 groups leave 4 candidates for the 2 chosen
    mla = dict(DEEPSEEK_V3["mla"], n_dense=0, kv_lora_rank=32)
    return tiny_model("deepseek2", **{**DEEPSEEK_V3, "mla": mla, "n_expert": 8, "n_expert_used": 2},
                      n_layer=1, n_embd=32, n_head=2, default_type="Q8_0")


@pytest.mark.parametrize("placement", [
    dict(n_gpu_layers=99),
    dict(n_gpu_layers=99, override_tensors=["exps=CPU"]),                     # -zce auto
    pytest.param(dict(n_gpu_layers=99, override_tensors=["exps=CPU"], zero_copy_experts=0),
                 marks=pytest.mark.skipif(cuda_setup.SIM, reason="CI time: real GPU only")),
])
@pytest.mark.parametrize("family", ["gpt-oss", "glm4moe", "deepseek2"])
def test_family_hybrid_equals_cpu(tiny_model, family, placement):
    """Each family's variants on the GPU and split: the CPU engine's logits, batched and token
    by token. On a GPU the prompt has more tokens than the matrix-vector kernels take: grouped
    expert products, whose grouping by expert each layer makes anew."""
    if cuda_setup.SIM and placement == dict(n_gpu_layers=99):
        pytest.skip("CI time: the simulator runs the split placement (real GPU: all)")
    path = _family_model(tiny_model, family)
    long = not cuda_setup.SIM and family != "deepseek2"
    # (the simulator: 3 tokens, gpt-oss's window of 2 leaves the first key out of the last)
    ids = PROMPT + ([5, 9, 250, 33, 12, 7, 64, 3, 91] if long
                    else [5] if cuda_setup.SIM else [5, 9])
    llm = load(path, **placement)
    assert "CUDA0" in llm.backends
    assert not [n for n in llm.placement if n.startswith(f"blk.{llm.cfg.n_layer}.")]   # NextN
    assert close(llm.eval(ids), cpu_logits(path, ids), rel=5e-4)
    if "override_tensors" in placement and llm.cfg.n_shared_expert:
        # a token's shared experts: on the GPU beside the CPU's routed experts
        shared = [n for n in llm.plan(1, 1).graph.nodes if n.weight and "_shexp." in n.weight]
        assert shared and {(n.backend, n.cause) for n in shared} == {("CUDA0", "zc")}
    ref = nbmoe.load(path, n_ctx=64, threads=2)
    ref.eval(ids)
    for tok in (17, 200, 5, 9) if long else (17,) if cuda_setup.SIM else (17, 200):
        assert close(llm.eval([tok]), ref.eval([tok]), rel=5e-4)


@pytest.mark.skipif(cuda_setup.SIM, reason="CI time (48 s): real GPU only; the simulator runs "
                    "the kernels alone (test_cuda_flash.py)")
def test_mla_expanded_prompts_on_the_gpu(tiny_model, monkeypatch):
    """MLA's expanded prompt form on the GPU (cuda/mla.py, the flash kernel's narrower values),
    two batches, the second over the first's cache: the CPU engine's logits, also expanded,
    within the flash kernel's f16 rounding of q and P (test_cuda_flash.py's RTOL_F16)."""
    from nbmoe import config
    monkeypatch.setattr(config, "MLA_EXPAND_MIN_TOKENS", 3)
    path = _family_model(tiny_model, "deepseek2")
    ids = PROMPT + [5, 9, 250, 33, 12, 7, 64, 3, 91]
    cut = len(ids) // 2                                  # (more than the decode kernel's 2)
    llm = load(path, n_gpu_layers=99)
    ref = nbmoe.load(path, n_ctx=64, threads=2)
    assert llm.mla_expands(cut) and ref.mla_expands(cut)
    for part in (ids[:cut], ids[cut:]):
        assert close(llm.eval(part), ref.eval(part), rel=3e-3)
    assert llm.backends["CUDA0"].attn_paths[(cut, llm.cfg.qk_nope_dim + llm.cfg.n_rot)].startswith(
        "flash, MLA expanded")


def test_mla_expanded_attention_is_recorded(tiny_model, monkeypatch):
    """All on the GPU, a prompt batch's expanded MLA attention (its own rows' keys and values,
    the attention) is recorded with the rest of its layer's CUDA graph; only the keys of the
    tokens cached before the batch, whose count the host knows at each call, are a step
    outside the graphs (one a layer, launching nothing for a batch at position 0)."""
    from nbmoe import config
    from nbmoe.cuda.graphs import GraphRun
    monkeypatch.setattr(config, "MLA_EXPAND_MIN_TOKENS", 3)
    llm = load(_family_model(tiny_model, "deepseek2"), n_gpu_layers=99)
    assert llm.mla_expands(6)
    plan = llm.plan(6, 1)
    recorded = [label for s in plan.steps if isinstance(s, GraphRun) for label in s.labels]
    plain = [label for s, label in zip(plan.steps, plan.labels) if not isinstance(s, GraphRun)]
    assert recorded.count(("CUDA0", "ATTN")) == llm.cfg.n_layer
    assert plain.count(("CUDA0", "ATTN")) == llm.cfg.n_layer
