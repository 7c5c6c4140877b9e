"""Architecture variants through the engine against the float64 reference: gpt-oss (biases on
q/k/v/o, the router and the experts, attention sinks, a sliding window on alternate layers,
YaRN, clamped SwiGLU, softmax over the chosen experts), batched and token by token, on the
plain and the fused paths, in the float and the 8-bit activation paths.
"""
import numpy as np
import pytest

import nbmoe
from nbmoe.cpu import matmul
from nbmoe.model import reference
from nbmoe.sched import fusion

# longer than the tiny gpt-oss window (8), so layer 0's window cuts keys off
PROMPT = [1, 17, 200, 33, 5, 250, 99, 12, 7, 64, 3, 91, 150, 8]


def cosine_rows(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gpt_oss_float_path_matches_reference(tiny_model, qtype, fused, monkeypatch):
    """Logits of a prompt (one batch) and of the same tokens one at a time through the KV
    cache: cosine >= 0.999 per position; 12 greedy tokens as the reference's."""
    monkeypatch.setattr(matmul, "INT8_DOT", False)
    monkeypatch.setattr(fusion, "ENABLED", fused)
    llm = nbmoe.load(tiny_model("gpt-oss", default_type=qtype), n_ctx=64, threads=2)
    want = reference.forward(llm.cfg, llm.file.tensors, PROMPT)
    batch = llm.eval(PROMPT)
    llm.reset()
    steps = np.concatenate([llm.eval([t]) for t in PROMPT])
    for got in (batch, steps):
        cos = cosine_rows(got, want)
        print(f"gpt-oss {qtype} fused={fused}: min cosine {cos.min():.6f}")
        assert cos.min() >= 0.999
    llm.reset()
    ours = list(llm.generate_ids(PROMPT, max_tokens=12, stop_ids=()))
    assert ours == reference.greedy(llm.cfg, llm.file.tensors, PROMPT, 12)


def test_gpt_oss_mxfp4_experts_int8_path(tiny_model):
    """The default path (8-bit activations) on MXFP4 experts, as the real files ship: close
    to the float64 math except where rounding flips a near-tied expert choice (median)."""
    llm = nbmoe.load(tiny_model("gpt-oss", types=[("exps", "MXFP4")], default_type="Q8_0"),
                     n_ctx=64, threads=2)
    cos = cosine_rows(llm.eval(PROMPT), reference.forward(llm.cfg, llm.file.tensors, PROMPT))
    print(f"gpt-oss MXFP4 int8: min {cos.min():.6f} median {np.median(cos):.6f}")
    assert np.median(cos) >= 0.999 and cos.min() >= 0.99


def test_gpt_oss_config_reads_every_variant(tiny_model):
    llm = nbmoe.load(tiny_model("gpt-oss", default_type="F32"), n_ctx=32, threads=1)
    cfg = llm.cfg
    assert cfg.gating == "softmax_topk" and cfg.flags.glu == "swiglu_oai"
    assert [cfg.layer_window(il) for il in range(cfg.n_layer)] == [8, 0]
    assert {"attn_sinks.weight", "attn_q.bias", "ffn_down_exps.bias", "ffn_gate_inp.bias"} <= cfg.present
    assert cfg.yarn and cfg.rope_mscale > 1.0
    ops = {n.op for n in llm.plan(4, 1).graph.nodes}
    assert {"ADD_BIAS", "ADD_BIAS_ID"} <= ops
