"""Fused decode groups on the CPU (fusion.find_groups + nbmoe/cpu/fused.py): the same logits
as binding every node on its own, on the 8-bit and the float path, MoE and dense."""
import numpy as np
import pytest

import nbmoe
from nbmoe.sched import fusion
from nbmoe.cpu import matmul

MOE = dict(arch="qwen3moe", n_layer=2, n_embd=64, n_head=2, n_head_kv=1, head_dim=32, n_ff=64,
           n_expert=8, n_expert_used=3, n_ff_exp=64)
DENSE = dict(arch="qwen3")


def decode(path, **kw):
    llm = nbmoe.load(path, n_ctx=32, threads=2, **kw)
    out = [llm.eval([1, 17, 40])]
    for tok in (5, 9):
        out.append(llm.eval([tok]))
    return out, llm


@pytest.mark.parametrize("int8", [True, False])
@pytest.mark.parametrize("shape", ["moe", "dense"])
def test_cpu_groups_match_unfused(tiny_model, monkeypatch, shape, int8):
    if int8 and not matmul.HAS_VNNI:
        pytest.skip("the 8-bit path is off without VNNI")
    monkeypatch.setattr(matmul, "INT8_DOT", int8)
    monkeypatch.setattr(fusion, "BLOCKS", False)      # the per-node groups (blocks: below)
    path = (tiny_model(**MOE, types=[("exps", "Q4_0")], default_type="Q8_0") if shape == "moe"
            else tiny_model(**DENSE, default_type="Q4_1"))
    fused, llm = decode(path)
    kinds = {k for k, _ in llm.backends["CPU"]._groups.values()}
    assert kinds == ({"products", "expert_ffn"} if shape == "moe" else {"products", "glu"})
    labels = {op for _, op in llm.plan(1, 1).labels}
    assert "MUL_MAT_ID" not in labels and "GLU" not in labels and "MOE_COMBINE" not in labels
    monkeypatch.setattr(fusion, "ENABLED", False)
    plain, llm = decode(path)
    assert llm.backends["CPU"]._groups == {}
    for a, b in zip(fused, plain):
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()


def test_cpu_groups_on_repacked_weights(tiny_model, monkeypatch):
    """-rtr: the fused groups run the repacked kernels (16-row groups: items of whole groups)."""
    monkeypatch.setattr(fusion, "BLOCKS", False)
    path = tiny_model(**{**MOE, "n_ff_exp": 96}, types=[("exps", "Q4_0")], default_type="Q8_0")
    fused, llm = decode(path, repack=True)
    assert {k for k, _ in llm.backends["CPU"]._groups.values()} == {"products", "expert_ffn"}
    monkeypatch.setattr(fusion, "ENABLED", False)
    plain, _ = decode(path, repack=True)
    for a, b in zip(fused, plain):
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()


BLOCK_CASES = {   # name: (tiny_model kwargs, block kinds of a decoding token)
    "llama": (dict(arch="llama", default_type="Q4_1"), {"attn_block", "ffn_block"}),
    # QK-norm, v of another type than q and k (its own product inside the block)
    "qwen3": (dict(arch="qwen3", types=[("attn_v", "Q8_0")], default_type="Q4_1"),
              {"attn_block", "ffn_block"}),
    "moe": (dict(**MOE, types=[("exps", "Q4_0")], default_type="Q8_0"), {"attn_block", "moe_block"}),
}


@pytest.mark.parametrize("repack", [False, True])
@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_cpu_blocks_equal_nodes(tiny_model, monkeypatch, case, repack):
    """cpu/blocks.py: a decoding token's layers as one compiled call per block give the very
    logits of the nodes bound one by one (the same kernels, in the same order)."""
    kw, kinds = BLOCK_CASES[case]
    path = tiny_model(**kw)
    blocks, llm = decode(path, repack=repack)
    assert {k for k, _ in llm.backends["CPU"]._groups.values()} == kinds
    labels = [op for _, op in llm.plan(1, 1).labels]
    assert labels.count("ATTN_BLOCK") == llm.cfg.n_layer and "ATTN" not in labels
    monkeypatch.setattr(fusion, "BLOCKS", False)
    nodes, llm = decode(path, repack=repack)
    assert not {k for k, _ in llm.backends["CPU"]._groups.values()} & set(fusion.BLOCK_KINDS)
    for a, b in zip(blocks, nodes):
        np.testing.assert_array_equal(a, b)
