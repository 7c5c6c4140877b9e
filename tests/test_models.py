"""Every architecture and every weight type: engine logits against the float64 reference.

Tiny random models (built by tools/make_model.py through the `tiny_model` fixture) run
through the engine's op graph and kernels, and through nbmoe/model/reference.py, which shares no
kernel code with the engine (weights dequantized by gguf-py, float64 NumPy math).
"""
import numpy as np
import pytest

import nbmoe
from nbmoe.model import reference
from nbmoe.cpu import matmul

ARCHS = {
    "llama": dict(arch="llama"),
    "llama-moe": dict(arch="llama", n_expert=4, n_expert_used=2),
    "qwen3": dict(arch="qwen3"),
    "qwen3moe": dict(arch="qwen3moe", n_expert=6, n_expert_used=2, n_ff_exp=64),
}
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
PROMPT = [1, 17, 200, 33, 5, 250, 99, 12, 7]


def cosine_rows(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("name", list(ARCHS))
def test_logits_and_greedy_match_reference(tiny_model, name, qtype, monkeypatch):
    """The exact float path: cosine >= 0.999 per position and 16 identical greedy tokens."""
    monkeypatch.setattr(matmul, "INT8_DOT", False)
    path = tiny_model(**ARCHS[name], default_type=qtype)
    llm = nbmoe.load(path, n_ctx=64, threads=2)
    got = llm.eval(PROMPT)                                   # [T, V] float32
    want = reference.forward(llm.cfg, llm.file.tensors, PROMPT)
    cos = cosine_rows(got, want)
    rel = np.abs(got - want).max() / np.abs(want).max()
    print(f"{name} {qtype}: min cosine {cos.min():.6f}, max rel err {rel:.2e}")
    assert cos.min() >= 0.999
    # 16 greedy steps, one token at a time through the KV cache
    llm.reset()
    ours = list(llm.generate_ids(PROMPT, max_tokens=16, stop_ids=()))
    assert ours == reference.greedy(llm.cfg, llm.file.tensors, PROMPT, 16)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
@pytest.mark.parametrize("name", list(ARCHS))
def test_int8_path_matches_reference(tiny_model, name, qtype, monkeypatch):
    """The default fast path rounds activations to 8 bits (as llama.cpp does): logits stay
    within cosine 0.999 of float64, except where that rounding flips a near-tied router
    choice of an MoE token, which then takes other experts (so MoE checks the median)."""
    monkeypatch.setattr(matmul, "INT8_DOT", True)
    llm = nbmoe.load(tiny_model(**ARCHS[name], default_type=qtype), n_ctx=64, threads=2)
    cos = cosine_rows(llm.eval(PROMPT), reference.forward(llm.cfg, llm.file.tensors, PROMPT))
    print(f"{name} {qtype} int8: cosine min {cos.min():.6f} median {np.median(cos):.6f}")
    assert (np.median(cos) if llm.cfg.is_moe else cos.min()) >= 0.999


def test_eval_in_pieces_equals_eval_at_once(tiny_model):
    """Micro-batches and the KV cache give the same logits as one pass."""
    path = tiny_model(**ARCHS["qwen3moe"], default_type="Q8_0")
    llm = nbmoe.load(path, n_ctx=64, threads=2, n_ubatch=4)
    whole = llm.eval(PROMPT)
    llm.reset()
    parts = np.concatenate([llm.eval(PROMPT[:5]), llm.eval(PROMPT[5:6]), llm.eval(PROMPT[6:])])
    assert np.abs(whole - parts).max() <= 1e-4 * np.abs(whole).max()


def test_flash_attn_on_and_off_match_reference(tiny_model, monkeypatch):
    """-fa on (tiled prompt kernel) and off (plain_attention): the float64 reference's logits,
    and each other's, for a prompt and a second batch after it in the cache."""
    monkeypatch.setattr(matmul, "INT8_DOT", False)
    path = tiny_model(**ARCHS["qwen3moe"], default_type="F16")
    ids, more = PROMPT, [3, 44, 180, 9, 61]
    got = {}
    for fa in ("on", "off"):
        llm = nbmoe.load(path, n_ctx=64, threads=2, flash_attn=fa)
        got[fa] = np.concatenate([llm.eval(ids), llm.eval(more)])
        want = reference.forward(llm.cfg, llm.file.tensors, ids + more)
        assert cosine_rows(got[fa], want).min() >= 0.999
        assert llm.backends["CPU"].attn_paths[(len(ids), llm.cfg.head_dim)] == (
            "flash" if fa == "on" else "plain")
    assert np.abs(got["on"] - got["off"]).max() <= 1e-4 * np.abs(got["off"]).max()
    with pytest.raises(nbmoe.NbmoeError, match="one of auto, on, off"):
        nbmoe.load(path, n_ctx=16, flash_attn="maybe")


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "IQ4_XS", "IQ2_XXS"])
def test_kquant_and_iq_models_match_reference(tiny_model, qtype, monkeypatch):
    """Models made of 256-value block types (tools/make_model.py quantizes them with the
    reference quantizers): every row length a multiple of 256. The exact float path as above,
    and the int8 path at the MoE median."""
    path = tiny_model("qwen3moe", n_embd=256, head_dim=64, n_ff=256, n_ff_exp=256,
                      default_type=qtype)
    monkeypatch.setattr(matmul, "INT8_DOT", False)
    llm = nbmoe.load(path, n_ctx=64, threads=2)
    want = reference.forward(llm.cfg, llm.file.tensors, PROMPT)
    cos = cosine_rows(llm.eval(PROMPT), want)
    print(f"qwen3moe {qtype}: min cosine {cos.min():.6f}")
    assert cos.min() >= 0.999
    llm.reset()
    ours = list(llm.generate_ids(PROMPT, max_tokens=16, stop_ids=()))
    assert ours == reference.greedy(llm.cfg, llm.file.tensors, PROMPT, 16)
    monkeypatch.setattr(matmul, "INT8_DOT", True)
    llm = nbmoe.load(path, n_ctx=64, threads=2)
    cos = cosine_rows(llm.eval(PROMPT), want)
    print(f"qwen3moe {qtype} int8: cosine min {cos.min():.6f} median {np.median(cos):.6f}")
    assert np.median(cos) >= 0.999


# the super-block types need rows of 256 values
WIDE = dict(n_embd=256, head_dim=64, n_ff=256, n_ff_exp=256)


# One type per repacked layout (most of each case is compiling its type's kernels): quants_rtr's
# 16-row groups with plain nibbles (Q4_0) and with a table of levels (MXFP4), quants_rtr_k
# (Q4_K), quants_rtr_xs (IQ4_XS). Every -rtr type's kernels against the GGUF layout's:
# test_cpu_matmul.py; Q4_1 and Q8_0 -rtr engines also run in test_fusion.py and test_cli.py.
@pytest.mark.parametrize("qtype", ["Q4_0", "MXFP4", "Q4_K", "IQ4_XS"])
def test_repack_matches_plain(tiny_model, qtype):
    """-rtr (repack=True) gives the int8 path's logits and greedy tokens: the attention and
    expert matrices and the tied output layer repacked, the embedding left for GET_ROWS."""
    path = tiny_model(**{**ARCHS["qwen3moe"], **(WIDE if qtype in ("Q4_K", "IQ4_XS") else {})}, default_type=qtype)
    plain = nbmoe.load(path, n_ctx=64, threads=2)
    rtr = nbmoe.load(path, n_ctx=64, threads=2, repack=True)
    assert "blk.0.ffn_down_exps.weight" in rtr.repacked and "output.weight" in rtr.repacked
    assert "token_embd.weight" not in rtr.repacked
    cos = cosine_rows(rtr.eval(PROMPT), plain.eval(PROMPT))
    assert cos.min() >= 0.999
    plain.reset()
    rtr.reset()
    assert (list(rtr.generate_ids(PROMPT, max_tokens=16, stop_ids=()))
            == list(plain.generate_ids(PROMPT, max_tokens=16, stop_ids=())))


def test_repack_skips_gpu_and_get_rows_tensors(tiny_model):
    from nbmoe.loader.repack import repackable
    t = nbmoe.load(tiny_model(**ARCHS["qwen3moe"], default_type="Q4_0"), n_ctx=16).weights
    assert repackable("blk.0.attn_q.weight", t["blk.0.attn_q.weight"], "CPU")
    assert not repackable("blk.0.attn_q.weight", t["blk.0.attn_q.weight"], "CUDA0")
    assert not repackable("token_embd.weight", t["token_embd.weight"], "CPU")
    assert not repackable("blk.0.attn_norm.weight", t["blk.0.attn_norm.weight"], "CPU")
