"""-muge on the CPU: each MoE layer's ffn_gate_exps and ffn_up_exps merged at load into one
ffn_gate_up_exps [E, 2F, row_bytes] (gate rows, then up rows); one expert product computes
both halves. The logits equal the split tensors', a file that ships the merged tensor gives
the same ones, a layer whose two tensors differ stays apart and --explain says why, and the
merged fused kernel equals the float64 reference. (The GPU's: test_merge_up_gate_cuda.py.)"""
import numpy as np
import pytest
from gguf.quants import dequantize, quantize

import nbmoe
from nbmoe.cpu import fused, matmul
from nbmoe.model import reference

MOE = dict(arch="qwen3moe", n_layer=2, n_embd=64, n_head=2, n_head_kv=1, head_dim=32, n_ff=64,
           n_expert=8, n_expert_used=3, n_ff_exp=64)
# a prompt (fused matrix-vector kernels), a generated token (the one-token block) and a
# batch past matmul.BLAS_MIN_T (the merged product, then the GLU of its halves)
PROMPT, NEXT, BATCH = [1, 17, 40], [5], list(range(2, 14))


@pytest.fixture(autouse=True)
def exact(monkeypatch):
    monkeypatch.setattr(matmul, "INT8_DOT", False)       # the exact float path


def run(path, **kw):
    llm = nbmoe.load(path, n_ctx=32, threads=2, **kw)
    logits = np.concatenate([llm.eval(ids) for ids in (PROMPT, NEXT, BATCH)])
    return logits, llm


def labels(llm):
    return {op for n in (len(PROMPT), 1, len(BATCH)) for _, op in llm.plan(n, n).labels}


def test_merged_equals_split(tiny_model):
    path = tiny_model(**MOE, types=[("exps", "Q4_0")], default_type="Q8_0")
    split, _ = run(path)
    for fmoe in (True, False):
        got, llm = run(path, merge_up_gate=True, fused_moe=fmoe)
        assert not any(".ffn_gate_exps." in n or ".ffn_up_exps." in n for n in llm.weights)
        assert llm.merged_layers == {0, 1} and llm.placement["blk.0.ffn_gate_up_exps.weight"][0] == "CPU"
        assert llm.explain_lines() == ["-muge (ffn_gate_up_exps): layers 0-1 merged"]
        nodes = llm.plan(len(BATCH), 0).graph.nodes
        prods = [n.weight for n in nodes if n.op == "MUL_MAT_ID"]
        assert prods == [f"blk.{i}.ffn_{k}_exps.weight" for i in (0, 1) for k in ("gate_up", "down")]
        glu = [n for n in nodes if n.op == "GLU"]
        assert all(n.srcs == ("exp_gate_up",) for n in glu)
        assert all((n.policy_op == "MUL_MAT_ID_GLU") == fmoe for n in glu)
        if fmoe:      # the fused kernels take the merged weight
            assert {"EXPERT_FFN", "MOE_BLOCK"} <= labels(llm)
        # matrix-vector: the same row dots, bit for bit; the batch: BLAS over 2F rows at once
        n = len(PROMPT) + 1
        assert np.array_equal(got[:n], split[:n])
        assert np.abs(got - split).max() <= 1e-5 * np.abs(split).max()


def test_shipped_merged_file(tiny_model):
    """make_model --merged-up-gate writes the split file's values as ffn_gate_up_exps: read as
    such, no flag needed, with the same logits as the split file merged at load (and the
    reference's)."""
    path = tiny_model(**MOE, types=[("exps", "Q4_0")], default_type="Q8_0")
    shipped = tiny_model(**MOE, types=[("exps", "Q4_0")], default_type="Q8_0", merged_up_gate=True)
    got, llm = run(shipped)
    assert llm.merged_layers == {0, 1} and llm.merge_notes is None
    assert llm.explain_lines() == ["-muge (ffn_gate_up_exps): layers 0-1 shipped merged by the file"]
    assert "blk.0.ffn_gate_up_exps.weight" in llm.file.tensors
    assert "blk.0.ffn_gate_exps.weight" not in llm.file.tensors
    merged, _ = run(path, merge_up_gate=True)
    assert np.array_equal(got, merged)
    want = reference.forward(llm.cfg, llm.file.tensors, PROMPT + NEXT + BATCH)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_not_merged_explained(tiny_model):
    """Up and gate of different types stay apart; --explain's line says which and why."""
    path = tiny_model(**MOE, types=[("up_exps", "Q8_0"), ("exps", "Q4_0")], default_type="Q8_0")
    split, _ = run(path)
    got, llm = run(path, merge_up_gate=True)
    assert llm.merged_layers == frozenset()
    assert llm.explain_lines() == ["-muge (ffn_gate_up_exps): no layer merged; not merged: "
                                   "layers 0-1 (ffn_gate_exps is Q4_0, ffn_up_exps Q8_0)"]
    assert np.array_equal(got, split)


def test_merged_biases(tiny_model):
    """gpt-oss: the gate and up biases merge too (ffn_gate_up_exps.bias [E, 2F]); -rtr
    repacks the merged weight (MXFP4, F a multiple of 16)."""
    path = tiny_model("gpt-oss", types=[("exps", "MXFP4")])
    for rtr in (False, True):
        split, _ = run(path, repack=rtr)
        got, llm = run(path, merge_up_gate=True, repack=rtr)
        assert "blk.1.ffn_gate_up_exps.bias" in llm.weights and "blk.1.ffn_up_exps.bias" not in llm.weights
        assert ("blk.1.ffn_gate_up_exps.weight" in llm.repacked) == rtr
        assert np.abs(got - split).max() <= 1e-5 * np.abs(split).max()


@pytest.mark.parametrize("act", [fused.ACT_SILU, fused.ACT_SWIGLU_OAI])
def test_merged_glu_kernels(act):
    """fused.glu_id with a merged weight (wu None) against the float64 GLU of the gate rows
    0..F-1 and the up rows F..2F-1 of each chosen expert; fused.glu_halves (the unfused GLU
    of a merged product's output) against the float64 GLU of its halves."""
    from gguf import GGMLQuantizationType as Q
    from nbmoe.model.reference import glu
    rng = np.random.default_rng(3)
    E, F, K, T, A = 5, 48, 64, 2, 3
    w = np.ascontiguousarray(quantize(rng.standard_normal((E, 2 * F, K), dtype=np.float32), Q.Q4_0))
    w.flags.writeable = False
    wf = dequantize(w, Q.Q4_0).reshape(E, 2 * F, K).astype(np.float64)
    x = rng.standard_normal((T, 1, K), dtype=np.float32)
    ids = np.array([[4, 0, 2], [2, 3, 4]], np.int32)
    out = np.full((T, A, F), np.nan, np.float32)
    fused.glu_id(out, w, None, x, ids, int(Q.Q4_0), False, 16, act)
    kind = "silu" if act == fused.ACT_SILU else "swiglu_oai"
    want = np.stack([[glu(wf[e, :F] @ x[t, 0], wf[e, F:] @ x[t, 0], kind) for e in ids[t]]
                     for t in range(T)])
    assert np.abs(out - want).max() <= 1e-5 * np.abs(want).max()
    gu = rng.standard_normal((7, 2 * F), dtype=np.float32) * 4
    got = np.full((7, F), np.nan, np.float32)
    fused.glu_halves(got, gu, act)
    want = glu(gu[:, :F].astype(np.float64), gu[:, F:].astype(np.float64), kind)
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
