"""deepseek2 and glm4moe in the weight types their files ship (Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS,
BF16): the engine's logits against the float64 reference on the CPU, one batch and token by
token, and a few greedy tokens.

The tiny shapes keep every row a multiple of 256 where the real models' are, so the K-quants
and IQ4_XS land on the tensors the real files hold them in; rows that cannot take a 256-block
(MLA's attn_k_b, 32 wide as DeepSeek's 128) take make_model's fallback, as llama.cpp's
quantizer does.
"""
import json
import os

import numpy as np
import pytest

import nbmoe
from nbmoe.cpu import matmul
from nbmoe.model import reference

from conftest import DEEPSEEK_V3
from test_variants import PROMPT, cosine_rows, matches_reference

TYPES = ["Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "BF16"]
# V3's MLA with q lora (attn_q_a / attn_q_b), the latent 256 wide (attn_v_b's rows), H * Dv =
# 256 (attn_output's rows); experts 256 wide, so every expert matrix takes the type
SHAPES = {
    "deepseek2": dict(DEEPSEEK_V3, n_embd=256, n_ff=256, n_ff_exp=256,
                      mla=dict(DEEPSEEK_V3["mla"], kv_lora_rank=256, q_lora_rank=256, v_dim=64)),
    # one dense layer, one MoE layer with a shared expert, H * Dh = 256, the NextN block
    "glm4moe": dict(n_layer=2, n_embd=256, head_dim=64, n_ff=256, n_ff_exp=256),
}
# the tensors whose rows are too short for a 256-block, by family
SHORT_ROWS = {"deepseek2": {"attn_k_b"}, "glm4moe": set()}


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("family", list(SHAPES))
def test_family_in_shipped_type_matches_reference(tiny_model, family, qtype, monkeypatch):
    """Exact float dots: cosine >= 0.999 per position, 4 greedy tokens as the reference's;
    then the default 8-bit activation path: median cosine >= 0.999 (its rounding may flip a
    near-tied expert choice at a position, as the same rounding in the reference does)."""
    llm = nbmoe.load(tiny_model(family, default_type=qtype, **SHAPES[family]), n_ctx=64, threads=2)
    for name, w in llm.weights.items():
        role = name.split(".")[-2]
        made = w.offset is None         # made at load (MLA's attn_kv_b: Q8_0, loader/mla.py)
        if name.startswith("blk.") and w.type_name != "F32" and role not in SHORT_ROWS[family] and not made:
            assert w.type_name == qtype, name
    monkeypatch.setattr(matmul, "INT8_DOT", False)
    matches_reference(llm, f"{family} {qtype}", greedy=4)
    monkeypatch.undo()
    llm.reset()
    cos = cosine_rows(llm.eval(PROMPT), reference.forward(llm.cfg, llm.file.tensors, PROMPT))
    print(f"{family} {qtype} int8: min {cos.min():.6f} median {np.median(cos):.6f}")
    assert np.median(cos) >= 0.999


# ---------------------------------------------------------------- against llama.cpp
# tests/data/llamacpp_types.*: llama.cpp's logits of both families in each type (these shapes,
# written by `python tools/llamacpp_logits.py --record tests/data/llamacpp_types`)
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "llamacpp_types")
with open(DATA + ".json") as _f:
    RECORD = json.load(_f)


def recorded_case(name, tmp_path):
    """(path of the recorded model remade, its tokens, the float64 logits, llama.cpp's 1 - cosine
    per position against them)."""
    from llamacpp_logits import fingerprint
    from make_model import make_model
    case = RECORD["cases"][name]
    spec = dict(case["make_model"])
    path = make_model(str(tmp_path / "m.gguf"), spec.pop("arch"), seed=RECORD["model_seed"], **spec)
    assert fingerprint(path) == case["fingerprint"], "make_model no longer writes the recorded model"
    llm = nbmoe.load(path, n_ctx=32, threads=2)
    want = reference.forward(llm.cfg, llm.file.tensors, case["tokens"])
    with np.load(DATA + ".npz") as z:
        theirs = 1 - cosine_rows(z[name].astype(np.float64), want)
    return path, case["tokens"], want, theirs


def as_close_as_llamacpp(label, got, want, theirs):
    ours = 1 - cosine_rows(got, want)
    print(f"{label}: 1 - cosine, median / worst: nbmoe {np.median(ours):.2e} / {ours.max():.2e}, "
          f"llama.cpp {np.median(theirs):.2e} / {theirs.max():.2e}")
    return np.median(ours) <= 1.05 * np.median(theirs)


@pytest.mark.parametrize("name", sorted(RECORD["cases"]))
def test_as_close_to_float64_as_llamacpp(name, tmp_path):
    """The default path (8-bit activations) at least as close to the float64 math as llama.cpp,
    at the median position: a rounding that flips a near-tied expert moves single positions a
    lot in either engine, at positions of its own (the worst ones are printed, not compared)."""
    path, tokens, want, theirs = recorded_case(name, tmp_path)
    llm = nbmoe.load(path, n_ctx=32, threads=2)
    assert as_close_as_llamacpp(name, llm.eval(tokens), want, theirs)
