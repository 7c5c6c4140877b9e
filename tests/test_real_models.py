"""Real models against llama.cpp's own logits (tests/data/logits_llamacpp.json).

For each prompt the reference holds llama.cpp's prompt tokens plus its 24 greedy tokens,
and after every token the ids and values of its 20 largest logits. We evaluate the same
token sequence in one pass and compare: same top-1 token wherever llama.cpp's choice is
clear, and logits close to llama.cpp's on its top 20.
"""
import json
import os

import numpy as np
import pytest

import nbmoe
from nbmoe.cpu import matmul
from test_tokenizer import gemma3_gguf

REF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "logits_llamacpp.json")


def cases(model):
    with open(REF) as f:
        return [c for c in json.load(f)["cases"] if c["model"] == model]


def compare(llm, case):
    toks = case["tokens"]
    assert llm.tokenize(case["prompt"]) == toks[: case["n_prompt_tokens"]]
    llm.reset()
    logits = llm.eval(toks)                                    # [T, V]
    worst, mismatches = 0.0, []
    for t, (ids, vals) in enumerate(zip(case["top20_ids"], case["top20_logits"])):
        ours = logits[t, ids]
        worst = max(worst, float(np.abs(ours - np.asarray(vals)).max()))
        # llama.cpp rounds activations to 8 bits (and q to f16 in attention); we keep float32.
        # Measured: our float64 reference agrees with the engine to 0.005, and with llama.cpp
        # to 0.05 at position 0 once it rounds activations the same way, but later positions
        # are sensitive: that rounding alone moves them by up to ~0.7. So logits may differ
        # by about 1, and only clear choices must agree.
        clear = vals[0] - vals[1] > 0.5
        if clear and int(np.argmax(logits[t])) != ids[0]:
            mismatches.append(t)
    return worst, mismatches


@pytest.mark.parametrize("i", range(3))
def test_smollm2_matches_llamacpp(smollm2_path, i):
    case = cases("SmolLM2-135M-Instruct.Q4_1.gguf")[i]
    llm = nbmoe.load(smollm2_path, n_ctx=128, threads=2)
    worst, mismatches = compare(llm, case)
    print(f"max |logit - llama.cpp| on top-20: {worst:.3f}")
    assert not mismatches
    assert worst < 1.5


def test_upcycled_default_model_writes_what_dense_writes(smollm2_path, smollm2_moe, monkeypatch):
    """All experts are copies of the dense FFN: the MoE model must generate the same text.
    Compared on the exact float path: the dense and expert products may round x differently
    on the int8 path."""
    monkeypatch.setattr(matmul, "INT8_DOT", False)
    case = cases("SmolLM2-135M-Instruct.Q4_1.gguf")[0]
    prompt = case["tokens"][: case["n_prompt_tokens"]]
    dense = nbmoe.load(smollm2_path, n_ctx=64, threads=2)
    moe = nbmoe.load(smollm2_moe, n_ctx=64, threads=2)
    assert moe.cfg.n_expert == 8 and moe.cfg.n_expert_used == 2
    a = dense.eval(case["tokens"])
    b = moe.eval(case["tokens"])
    # identical up to float rounding (w1*y + w2*y with w1 + w2 = 1 is not bit-exact)
    assert np.abs(a - b).max() < 1e-3 * np.abs(a).max()
    dense.reset(), moe.reset()
    a = list(dense.generate_ids(prompt, 16, stop_ids=()))
    assert a == list(moe.generate_ids(prompt, 16, stop_ids=()))
    assert dense.detokenize(a).startswith(" Paris.")


@pytest.fixture(scope="module")
def gemma3_path():
    return gemma3_gguf()                                       # skips without the gemma extra


@pytest.mark.parametrize("i", range(3))
def test_gemma3_matches_llamacpp(gemma3_path, i):
    """gemma3: sliding-window layers, QK-norm, post norms, GELU, Q4_K/Q6_K/Q5_0/Q8_0 weights."""
    case = cases("gemma-3-270m-q4_k_m.gguf")[i]
    llm = nbmoe.load(gemma3_path, n_ctx=128, threads=2)
    worst, mismatches = compare(llm, case)
    print(f"max |logit - llama.cpp| on top-20: {worst:.3f}")   # measured 0.61, 0.93, 1.14
    assert not mismatches
    assert worst < 1.5
