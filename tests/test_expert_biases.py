"""gpt-oss's expert biases on the CPU's fused paths: the experts' gate / up / GLU (glu_id), down
and weighted sum (down_combine) and, for one token, the whole MoE half of a layer (moe_block,
the router's bias too) take the ADD_BIAS_ID nodes in; the logits equal the plain path's
(every node on its own, fusion.ENABLED off) and follow the float64 reference. The kernels
themselves: tests/test_cpu_variants.py (CPU), tests/test_cuda_variants.py (CUDA).
"""
import numpy as np
import pytest

import nbmoe
from nbmoe.cpu import matmul
from nbmoe.model import reference
from nbmoe.sched import fusion
from nbmoe.sched.explain import unfused_lines

PROMPT, NEXT = [1, 17, 200, 33, 5, 250, 99, 12, 7, 64, 3], [91, 150, 8]


def run(path, merged):
    """Logits of PROMPT (a batch: the plain path), two single tokens and a batch of 3 (the
    matrix-vector groups), and the steps' labels at 1 and 3 tokens."""
    llm = nbmoe.load(path, n_ctx=32, threads=2, merge_up_gate=merged)
    out = [llm.eval(PROMPT), llm.eval(NEXT[:1]), llm.eval(NEXT[1:2]), llm.eval(NEXT)]
    labels = {T: {op for _, op in llm.plan(T, T).labels} for T in (1, 3)}
    return np.concatenate(out), labels, llm


@pytest.mark.parametrize("merged", [False, True])
def test_cpu_fused_expert_biases(tiny_model, monkeypatch, merged):
    monkeypatch.setattr(matmul, "INT8_DOT", False)        # the exact float path
    path = tiny_model("gpt-oss", types=[("exps", "MXFP4")], default_type="Q8_0")
    fused, labels, llm = run(path, merged)
    assert "MOE_BLOCK" in labels[1] and "EXPERT_FFN" in labels[3]
    assert not {"ADD_BIAS_ID", "MUL_MAT_ID", "GLU", "MOE_COMBINE"} & (labels[1] | labels[3])
    assert "TOPK_MOE" not in labels[1]
    assert llm.merged_layers == (frozenset(range(llm.cfg.n_layer)) if merged else frozenset())
    assert not any("ADD_BIAS_ID" in line for line in unfused_lines(llm, (1, 3)))
    monkeypatch.setattr(fusion, "ENABLED", False)
    plain, labels, _ = run(path, merged)
    assert "ADD_BIAS_ID" in labels[1]
    assert np.abs(fused - plain).max() <= 1e-5 * np.abs(plain).max()
    want = reference.forward(llm.cfg, llm.file.tensors, PROMPT + NEXT[:2] + NEXT)
    assert np.abs(fused - want).max() <= 1e-4 * np.abs(want).max()
