"""The float64 reference against llama.cpp's logits on tiny random-weight models.

tests/data/llamacpp_tiny.{json,npz} (and llamacpp_deepseek.*, the deepseek2 models) hold, per model, the make_model arguments and seed, a
fingerprint of the file they write, the token ids, and llama.cpp's logits after each token
(written by `python tools/llamacpp_logits.py --record tests/data/llamacpp_tiny`). The tests
rebuild each model, check it is the same file, and hold reference.py against those logits:
no llama.cpp is needed here.
"""
import json
import os

import numpy as np
import pytest

from llamacpp_logits import compare, fingerprint
from make_model import make_model
from nbmoe.model import reference

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
FILES = ("llamacpp_tiny", "llamacpp_deepseek")
RECORDS = {}
for _name in FILES:
    with open(os.path.join(DATA_DIR, _name + ".json")) as _f:
        RECORDS[_name] = json.load(_f)
CASES = {case: dict(spec, file=f) for f, r in RECORDS.items() for case, spec in r["cases"].items()}


@pytest.fixture(scope="module")
def logits_llamacpp():
    out = {}
    for f in FILES:
        with np.load(os.path.join(DATA_DIR, f + ".npz")) as z:
            out.update({name: z[name].astype(np.float64) for name in z.files})
    return out


def build(name, path):
    spec = dict(CASES[name]["make_model"])
    seed = RECORDS[CASES[name]["file"]]["model_seed"]
    return make_model(os.fspath(path), spec.pop("arch"), seed=seed, **spec)


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_matches_llamacpp(name, logits_llamacpp, tmp_path):
    case = CASES[name]
    path = build(name, tmp_path / f"{name}.gguf")
    assert fingerprint(path) == case["fingerprint"], "make_model no longer writes the recorded model"
    cfg, tensors = reference.load(path)
    want = reference.forward(cfg, tensors, case["tokens"])
    got = logits_llamacpp[name]
    cos, top1 = compare(got, want)
    if case["make_model"]["default_type"] == "F32":
        # the same math: llama.cpp differs only by float32 / f16-KV rounding (and the
        # float16 storage of its logits here, <= 0.002 at |logit| <= 4)
        assert cos >= 0.999 and top1 >= 0.97, (cos, top1)
        assert np.abs(got - want).max() < 0.006
    else:
        # quantized weights: the reference is their exact math; llama.cpp's distance to it
        # (it also rounds activations to 8 bits, which may flip a close expert choice at a
        # position: the median) is what nbmoe's must not exceed
        rec = case["llamacpp_vs_reference"]
        per_pos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        assert abs(cos - rec["worst_cosine"]) < 1e-4 and np.median(per_pos) > 0.999, (cos, rec)
        assert top1 == pytest.approx(rec["top1"], abs=1 / len(case["tokens"]))


def test_make_model_is_deterministic(tmp_path):
    """The same arguments and seed write the same bytes, so the recorded logits stay valid."""
    a, b = (build("gpt-oss-mxfp4", tmp_path / f"{i}.gguf") for i in range(2))
    assert open(a, "rb").read() == open(b, "rb").read()


def test_gpt_oss_parts_all_move_the_logits(tmp_path):
    """Each gpt-oss part the reference implements changes its logits well beyond llama.cpp's
    distance to it (0.002): sinks, the window, YaRN's scale, biases, the clamped SwiGLU."""
    import dataclasses
    cfg, tensors = reference.load(build("gpt-oss-f32", tmp_path / "oss.gguf"))
    tokens = CASES["gpt-oss-f32"]["tokens"]
    base = reference.forward(cfg, tensors, tokens)

    def moved(**changes):
        return np.abs(reference.forward(dataclasses.replace(cfg, **changes), tensors, tokens)
                      - base).max()
    assert moved(present=cfg.present - {"attn_sinks.weight"}) > 0.1
    assert moved(sliding_window=0) > 0.1
    assert moved(rope_mscale=1.0) > 0.1
    assert moved(yarn=()) > 0.1
    assert moved(present=cfg.present - {"attn_q.bias", "attn_k.bias", "attn_v.bias"}) > 0.1
    assert moved(present=cfg.present - {"ffn_gate_inp.bias"}) > 0.1
    assert moved(gating="softmax") > 0.1
    limit, reference.SWIGLU_OAI_LIMIT = reference.SWIGLU_OAI_LIMIT, 1e9
    try:
        assert np.abs(reference.forward(cfg, tensors, tokens) - base).max() > 0.05
    finally:
        reference.SWIGLU_OAI_LIMIT = limit


def test_glm4moe_parts_all_move_the_logits(tmp_path):
    """Each glm4moe part changes the reference's logits well beyond llama.cpp's distance to it:
    the selection bias, the routed scale, sigmoid gating, partial RoPE, q/k/v biases, the
    shared expert."""
    import dataclasses
    cfg, tensors = reference.load(build("glm4moe-f32", tmp_path / "glm.gguf"))
    tokens = CASES["glm4moe-f32"]["tokens"]
    base = reference.forward(cfg, tensors, tokens)

    def moved(**changes):
        return np.abs(reference.forward(dataclasses.replace(cfg, **changes), tensors, tokens)
                      - base).max()
    assert moved(present=cfg.present - {"exp_probs_b.bias"}) > 0.1
    assert moved(routed_scale=1.0) > 0.1
    assert moved(gating="softmax") > 0.1
    assert moved(n_rot=cfg.head_dim) > 0.1
    assert moved(present=cfg.present - {"attn_q.bias", "attn_k.bias", "attn_v.bias"}) > 0.1
    assert moved(n_shared_expert=0) > 0.1


def test_route_groups_and_selection_bias():
    """Expert groups and the selection bias choose; the weights come from the unbiased
    probabilities (DeepSeek-V3's routing, as llama.cpp's build_moe_ffn)."""
    from types import SimpleNamespace
    cfg = SimpleNamespace(gating="sigmoid", n_group=2, topk_group=1, n_expert_used=2,
                          moe_norm_topk=True, routed_scale=2.5)
    logits = np.array([[2.0, 1.0, 0.0, -1.0, 1.5, 1.4, 1.3, -3.0]])
    bias = np.array([0, 0, 0, 0, 0, 0, 0.5, 0.0])
    top, w = reference.route(logits, cfg, bias)
    # group scores (sum of the 2 best biased probs): group 1 (experts 4..7) wins through
    # expert 6's bias; within it, 6 then 4
    assert top.tolist() == [[6, 4]]
    p = 1 / (1 + np.exp(-logits[0, [6, 4]]))
    np.testing.assert_allclose(w[0], 2.5 * p / p.sum())


def test_partial_rope_leaves_the_other_dims():
    x = np.random.default_rng(0).standard_normal((5, 2, 8))
    y = reference.rope(x, np.arange(5.0), np.array([1.0, 0.1]), neox=True, mscale=1.3)
    np.testing.assert_array_equal(y[..., 4:], x[..., 4:])
    r = np.hypot(y[..., [0, 1]], y[..., [2, 3]])          # neox pairs (0, 2), (1, 3)
    np.testing.assert_allclose(r, 1.3 * np.hypot(x[..., [0, 1]], x[..., [2, 3]]))


def test_deepseek_parts_all_move_the_logits(tmp_path):
    """Each deepseek2 part the reference implements moves its logits well beyond llama.cpp's
    distance to it (0.005): YaRN (its ramp, its kq scale), the selection bias, the groups, the
    routed scale and the weights' normalisation."""
    import dataclasses
    cfg, tensors = reference.load(build("deepseek-v3-f32", tmp_path / "v3.gguf"))
    tokens = CASES["deepseek-v3-f32"]["tokens"]
    base = reference.forward(cfg, tensors, tokens)

    def moved(**changes):
        return np.abs(reference.forward(dataclasses.replace(cfg, **changes), tensors, tokens)
                      - base).max()
    assert moved(attn_mscale=1.0) > 0.1
    assert moved(yarn=()) > 0.1
    assert moved(present=cfg.present - {"exp_probs_b.bias"}) > 0.1
    assert moved(n_group=0) > 0.1
    assert moved(routed_scale=1.0) > 0.1
    assert moved(moe_norm_topk=False) > 0.1
