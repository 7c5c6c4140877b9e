"""Architecture variants through the engine against the float64 reference: gpt-oss (biases on
q/k/v/o, the router and the experts, attention sinks, a sliding window on alternate layers,
YaRN, clamped SwiGLU, softmax over the chosen experts), batched and token by token, on the
plain and the fused paths, in the float and the 8-bit activation paths; and glm4moe the same way.
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


def matches_reference(llm, label, greedy=12):
    """Logits of PROMPT in one batch and token by token through the KV cache: cosine >= 0.999
    per position against the float64 reference; `greedy` tokens as the reference's."""
    want = reference.forward(llm.cfg, llm.file.tensors, PROMPT)
    batch = llm.eval(PROMPT)
    llm.reset()
    steps = np.concatenate([llm.eval([t]) for t in PROMPT])
    for got in (batch, steps):
        cos = cosine_rows(got, want)
        print(f"{label}: min cosine {cos.min():.6f}")
        assert cos.min() >= 0.999
    if greedy:
        llm.reset()
        ours = list(llm.generate_ids(PROMPT, max_tokens=greedy, stop_ids=()))
        assert ours == reference.greedy(llm.cfg, llm.file.tensors, PROMPT, greedy)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gpt_oss_float_path_matches_reference(tiny_model, qtype, fused, monkeypatch):
    """Logits of a prompt (one batch) and of the same tokens one at a time through the KV
    cache: cosine >= 0.999 per position; 12 greedy tokens as the reference's."""
    monkeypatch.setattr(matmul, "INT8_DOT", False)
    monkeypatch.setattr(fusion, "ENABLED", fused)
    llm = nbmoe.load(tiny_model("gpt-oss", default_type=qtype), n_ctx=64, threads=2)
    matches_reference(llm, f"gpt-oss {qtype} fused={fused}")


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


# ---------------------------------------------------------------- glm4moe (GLM-4.5 / 4.5-Air)
# A dense layer 0, then sigmoid routing with a selection bias and a routed scale, a shared
# expert, q/k/v biases, partial RoPE (16 of 32 dims), and a NextN block that is not run.

@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_glm4moe_float_path_matches_reference(tiny_model, qtype, fused, monkeypatch):
    """As gpt-oss's: one batch and token by token, cosine >= 0.999, greedy tokens equal."""
    monkeypatch.setattr(matmul, "INT8_DOT", False)
    monkeypatch.setattr(fusion, "ENABLED", fused)
    llm = nbmoe.load(tiny_model("glm4moe", default_type=qtype), n_ctx=64, threads=2)
    matches_reference(llm, f"glm4moe {qtype} fused={fused}")


def test_glm4moe_qk_norm_matches_reference(tiny_model, monkeypatch):
    """GLM-4.5 (355B)'s q/k norms before the partial RoPE, after the q/k biases."""
    monkeypatch.setattr(matmul, "INT8_DOT", False)
    llm = nbmoe.load(tiny_model("glm4moe", default_type="F32", qk_norm=True), n_ctx=64, threads=2)
    assert {"attn_q_norm.weight", "attn_k_norm.weight"} <= llm.cfg.present
    matches_reference(llm, "glm4moe q/k norms", greedy=0)


def test_glm4moe_q4k_experts_int8_path(tiny_model):
    """The default path (8-bit activations) on Q4_K experts (their 64-wide down projections
    Q5_0, as llama.cpp's quantizer gives them), 256 wide: median cosine to the float64 math."""
    llm = nbmoe.load(tiny_model("glm4moe", types=[("_exps", "Q4_K")], default_type="Q8_0",
                                n_embd=256), n_ctx=64, threads=2)
    assert llm.weights["blk.1.ffn_down_exps.weight"].type_name == "Q5_0"
    cos = cosine_rows(llm.eval(PROMPT), reference.forward(llm.cfg, llm.file.tensors, PROMPT))
    print(f"glm4moe Q4_K int8: min {cos.min():.6f} median {np.median(cos):.6f}")
    assert np.median(cos) >= 0.999 and cos.min() >= 0.99


def test_glm4moe_config_and_nextn_block(tiny_model, capsys):
    """The file's 4 blocks are 3 layers and a NextN block whose tensors are accepted, never
    placed or read; --explain says so."""
    from nbmoe.cli.bench import explain
    llm = nbmoe.load(tiny_model("glm4moe", default_type="F32"), n_ctx=32, threads=1)
    cfg = llm.cfg
    assert (cfg.n_layer, cfg.n_nextn, cfg.n_leading_dense, cfg.n_shared_expert) == (3, 1, 1, 1)
    assert cfg.gating == "sigmoid" and cfg.moe_norm_topk and cfg.routed_scale == 2.5
    assert cfg.n_rot == 16 and cfg.head_dim == 32 and cfg.n_ff_shexp == 64
    assert cfg.present == {"attn_q.bias", "attn_k.bias", "attn_v.bias", "exp_probs_b.bias"}
    assert "blk.3.nextn.eh_proj.weight" in llm.file.tensors
    assert not [n for n in llm.placement if n.startswith("blk.3.")]
    g = llm.plan(4, 1).graph
    assert not [n for n in g.nodes if (n.weight or "").startswith("blk.3.")]
    assert {"ADD_BIAS", "TOPK_MOE"} <= {n.op for n in g.nodes}
    explain(llm, 4)
    assert "1 NextN layer not run (blk.3" in capsys.readouterr().err


def test_glm4moe_q4k_as_close_as_llamacpp(tmp_path):
    """On the recorded Q4_K glm4moe (tests/data/llamacpp_tiny), the default path is at least
    as close to the float64 math as llama.cpp's recorded logits: worst cosine and top-1."""
    import json
    import os
    from make_model import make_model
    from llamacpp_logits import compare
    with open(os.path.join(os.path.dirname(__file__), "data", "llamacpp_tiny.json")) as f:
        record = json.load(f)
    case = record["cases"]["glm4moe-q4k"]
    spec = dict(case["make_model"])
    path = make_model(str(tmp_path / "glm.gguf"), spec.pop("arch"), seed=record["model_seed"], **spec)
    llm = nbmoe.load(path, n_ctx=64, threads=2)
    want = reference.forward(llm.cfg, llm.file.tensors, case["tokens"])
    cos, top1 = compare(llm.eval(case["tokens"]).astype(np.float64), want)
    theirs = case["llamacpp_vs_reference"]
    print(f"glm4moe Q4_K: nbmoe worst cosine {cos:.6f} top-1 {top1:.1%}; llama.cpp {theirs}")
    assert cos >= theirs["worst_cosine"] - 1e-5 and top1 >= theirs["top1"] - 1e-3


# ---------------------------------------------------------------- deepseek2 (MLA)

def _deepseek(tiny_model, variant, qtype):
    from conftest import DEEPSEEK_V3
    return tiny_model("deepseek2", default_type=qtype, **(DEEPSEEK_V3 if variant == "v3" else {}))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("variant", ["v2-lite", "v3"])
def test_deepseek2_matches_reference(tiny_model, variant, qtype, fused, monkeypatch):
    """MLA (the cache holds a token's latent and roped key part; k_b absorbed into the query),
    YaRN with the log multiplier, a leading dense layer, shared experts, and V2-Lite's softmax
    or V3's q lora, sigmoid + selection bias + groups + scale: logits of a prompt and of the
    same tokens one at a time, cosine >= 0.999 per position; 12 greedy tokens as the reference's."""
    monkeypatch.setattr(matmul, "INT8_DOT", False)
    monkeypatch.setattr(fusion, "ENABLED", fused)
    llm = nbmoe.load(_deepseek(tiny_model, variant, qtype), n_ctx=64, threads=2)
    matches_reference(llm, f"deepseek2 {variant} {qtype} fused={fused}")


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("variant", ["v2-lite", "v3"])
def test_deepseek2_expanded_prompts_match_reference(tiny_model, variant, qtype, monkeypatch):
    """Prompt batches in MLA's expanded form (config.MLA_EXPAND_MIN_TOKENS lowered to 2): each
    head's keys and values made from the cached latents through attn_kv_b, made at load from
    k_b and v_b; two batches (the second over the first's cache), then tokens one at a time
    (absorbed): cosine >= 0.999 per position against the float64 reference (Q8_0: attn_kv_b's
    k_b part is quantized a second time, transposed: median 0.999, each >= 0.995)."""
    from nbmoe import config
    monkeypatch.setattr(matmul, "INT8_DOT", False)
    monkeypatch.setattr(config, "MLA_EXPAND_MIN_TOKENS", 2)
    llm = nbmoe.load(_deepseek(tiny_model, variant, qtype), n_ctx=64, threads=2)
    assert llm.mla_expands(5) and not llm.mla_expands(1)
    want = reference.forward(llm.cfg, llm.file.tensors, PROMPT + PROMPT[:4])
    got = np.concatenate([llm.eval(PROMPT[:9]), llm.eval(PROMPT[9:]), llm.eval(PROMPT[:1]),
                          llm.eval(PROMPT[1:4])])
    cos = cosine_rows(got, want)
    print(f"deepseek2 {variant} {qtype} expanded: min cosine {cos.min():.6f} median {np.median(cos):.6f}")
    assert np.median(cos) >= 0.999 and cos.min() >= (0.999 if qtype == "F32" else 0.995)
    paths = llm.backends["CPU"].attn_paths
    assert paths[(9, 48)].startswith("flash, MLA expanded") and paths[(1, 80)].startswith("one-token")


def test_deepseek2_int8_path(tiny_model):
    """The default path (8-bit activations) on Q8_0: close to the float64 math (median; a
    rounding may flip a near-tied expert at a position)."""
    from conftest import DEEPSEEK_V3
    llm = nbmoe.load(tiny_model("deepseek2", default_type="Q8_0", **DEEPSEEK_V3), n_ctx=64, threads=2)
    cos = cosine_rows(llm.eval(PROMPT), reference.forward(llm.cfg, llm.file.tensors, PROMPT))
    print(f"deepseek2 v3 Q8_0 int8: min {cos.min():.6f} median {np.median(cos):.6f}")
    assert np.median(cos) >= 0.999 and cos.min() >= 0.99


def test_deepseek2_config_and_cache(tiny_model):
    """Every MLA field read from the file; one cache array a layer, R + Dr wide, one kv head."""
    from conftest import DEEPSEEK_V3
    cfg = nbmoe.load(_deepseek(tiny_model, "v2-lite", "F32"), n_ctx=32, threads=1).cfg
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_nope_dim, cfg.n_rot, cfg.v_head_dim) == (64, 0, 32, 16, 32)
    assert (cfg.n_head_kv, cfg.head_dim, cfg.n_leading_dense, cfg.n_shared_expert) == (1, 80, 1, 2)
    assert cfg.gating == "softmax" and not cfg.moe_norm_topk and cfg.yarn and cfg.rope_mscale == 1.0
    assert cfg.yarn_log_mul == pytest.approx(0.707)
    # llama.cpp's kq scale: (1 + 0.1 * 0.707 * ln 40)^2 / sqrt(Dn + Dr)
    assert cfg.attn_scale == pytest.approx((1 + 0.0707 * np.log(40)) ** 2 / np.sqrt(48), rel=1e-6)
    llm = nbmoe.load(tiny_model("deepseek2", default_type="F32", **DEEPSEEK_V3), n_ctx=32, threads=1)
    c = llm.cfg
    assert (c.q_lora_rank, c.gating, c.n_group, c.topk_group, c.routed_scale, c.moe_norm_topk) == (
        32, "sigmoid", 4, 2, 2.5, True)
    assert "exp_probs_b.bias" in c.present
    assert llm.kv.k is llm.kv.v and llm.kv.k[0].shape == (32, 1, 80)
    assert llm.kv.n_bytes == 2 * 32 * 80 * 2


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_deepseek2_older_kv_b_layout(tiny_model, qtype, monkeypatch):
    """An older file (one attn_kv_b a layer, key_length = Dn + Dr, H kv heads) loads: its k_b and
    v_b made from attn_kv_b (loader/mla.py), its prompts expanded through attn_kv_b itself;
    the float64 reference reads the made k_b / v_b: cosine >= 0.999 (Q8_0: k_b quantized again)."""
    from nbmoe import config
    monkeypatch.setattr(matmul, "INT8_DOT", False)
    monkeypatch.setattr(config, "MLA_EXPAND_MIN_TOKENS", 4)
    from conftest import TINY
    path = tiny_model("deepseek2", default_type=qtype, mla=dict(TINY["deepseek2"]["mla"], kv_b=True))
    llm = nbmoe.load(path, n_ctx=64, threads=2)
    assert "blk.0.attn_kv_b.weight" in llm.file.tensors and llm.cfg.n_head_kv == 1
    assert llm.kv.k[0].shape == (64, 1, 80)
    want = reference.forward(llm.cfg, llm.file.tensors, PROMPT)
    got = np.concatenate([llm.eval(PROMPT[:9])] + [llm.eval([t]) for t in PROMPT[9:]])
    cos = cosine_rows(got, want)
    print(f"deepseek2 kv_b {qtype}: min cosine {cos.min():.6f}")
    assert cos.min() >= (0.999 if qtype == "F32" else 0.995)
    if qtype == "F32":      # the made k_b is the file's attn_kv_b rows, transposed, exactly
        kv_b = llm.file.tensors["blk.0.attn_kv_b.weight"].data.view(np.float32).reshape(4, 64, 64)
        k_b = llm.file.tensors["blk.0.attn_k_b.weight"].data.view(np.float32).reshape(4, 64, 32)
        assert np.array_equal(k_b, kv_b[:, :32].transpose(0, 2, 1))


def test_deepseek2_refuses_the_old_mla_layout(tiny_model):
    """attn_kv_b beside the split layout's metadata is one line naming it."""
    from nbmoe.errors import NbmoeError
    from nbmoe.model.arch import config_from_meta
    from nbmoe.loader.gguf_file import GGUFFile
    f = GGUFFile(_deepseek(tiny_model, "v2-lite", "F32"))
    names = [n.replace("attn_k_b", "attn_kv_b") for n in f.tensors]
    with pytest.raises(NbmoeError, match=r"blk\.0\.attn_kv_b\.weight"):
        config_from_meta(f.meta, None, names)
    meta = {k: v for k, v in f.meta.items() if not k.endswith("key_length_mla")}
    with pytest.raises(NbmoeError, match="key_length_mla"):
        config_from_meta(meta, None, list(f.tensors))


def test_deepseek2_refuses_an_unknown_gating_function(tiny_model):
    """A gating function nbmoe has no kernel for is one line naming the key and its value."""
    from nbmoe.errors import NbmoeError
    from nbmoe.model.arch import config_from_meta
    from nbmoe.loader.gguf_file import GGUFFile
    f = GGUFFile(_deepseek(tiny_model, "v2-lite", "F32"))
    assert config_from_meta(f.meta, None, list(f.tensors)).gating in ("softmax", "sigmoid")
    meta = dict(f.meta, **{"deepseek2.expert_gating_func": 7})
    with pytest.raises(NbmoeError, match=r"deepseek2\.expert_gating_func = 7; nbmoe runs softmax"):
        config_from_meta(meta, None, list(f.tensors))
