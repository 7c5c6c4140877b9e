"""The attention biases (q, k, v, o: gpt-oss; q, k, v: glm4moe) inside the fused decode paths:
the CPU's attn_block and products groups, the GPU's products_q8 and product_add. Their logits
equal the plain path's (each product, then its ADD_BIAS node) and follow the float64 reference.
"""
import numpy as np
import pytest

import nbmoe
from nbmoe.cpu import matmul
from nbmoe.model import reference
from nbmoe.sched import fusion

IDS = [1, 17, 200, 5, 9]          # a 3-token prompt, then two tokens one at a time
ROLES = {"gpt-oss": fusion.ATTN_BIASES, "glm4moe": ("attn_q", "attn_k", "attn_v")}


def decode(path, ids=IDS, n_prompt=3, **kw):
    llm = nbmoe.load(path, n_ctx=32, threads=2, **kw)
    out = [llm.eval(ids[:n_prompt])] + [llm.eval([t]) for t in ids[n_prompt:]]
    return np.concatenate(out), llm


def attn_biases(llm, backend):
    """The one-token plan's attention ADD_BIAS nodes and its groups on `backend`."""
    plan = llm.plan(1, 1)
    nodes = [n for n in plan.graph.nodes if n.op == "ADD_BIAS" and fusion._bias_of(n, fusion.ATTN_BIASES)]
    return nodes, llm.backends[backend]._groups, plan


def cosine_rows(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.mark.parametrize("family", ["gpt-oss", "glm4moe"])
def test_cpu_attention_biases_fused(tiny_model, monkeypatch, family):
    """One token: every attention bias inside an attn_block (and, blocks off, a products
    group: q, k, v); --explain names none of them; the logits of the blocks, of the per-node
    groups and of the plain nodes agree (blocks == groups bit for bit), and follow float64."""
    monkeypatch.setattr(matmul, "INT8_DOT", False)      # (test_variants' path: its kernels)
    path = tiny_model(family, default_type="Q8_0")
    blocks, llm = decode(path)
    nodes, groups, plan = attn_biases(llm, "CPU")
    n_layer = llm.cfg.n_layer
    assert {fusion._bias_of(n, ROLES[family]) for n in nodes} == {True}
    assert len(nodes) == n_layer * len(ROLES[family])
    assert all(groups[id(n)][0] == "attn_block" for n in nodes)
    assert not [n for n in fusion.unfused(plan.graph.nodes, "CPU") if n in nodes]
    labels = [op for _, op in plan.labels]
    assert labels.count("ATTN_BLOCK") == n_layer and "ATTN" not in labels
    # the router's bias, inside MOE_BLOCK too: no ADD_BIAS step is left
    assert labels.count("ADD_BIAS") == sum(n.op == "ADD_BIAS" and id(n) not in groups for n in plan.graph.nodes)

    monkeypatch.setattr(fusion, "BLOCKS", False)
    groups_out, llm = decode(path)
    nodes, groups, _ = attn_biases(llm, "CPU")
    qkv = [n for n in nodes if not fusion._bias_of(n, ("attn_output",))]
    assert all(groups[id(n)][0] == "products" for n in qkv)
    assert all(len(groups[id(n)][1]) == 6 for n in qkv)           # q, bq, k, bk, v, bv
    np.testing.assert_array_equal(blocks, groups_out)

    monkeypatch.setattr(fusion, "ENABLED", False)
    plain, llm = decode(path)
    assert llm.backends["CPU"]._groups == {}
    assert np.abs(blocks - plain).max() <= 1e-5 * np.abs(plain).max()
    cos = cosine_rows(blocks, reference.forward(llm.cfg, llm.file.tensors, IDS))
    assert cos.min() >= 0.999, cos


def test_products_and_mat_vec_add_the_bias_rows(monkeypatch):
    """matmul._products with biases (a weight without one: NO_BIAS) == the product, then
    ops.add_bias, bit for bit; q8 and float paths, two and three weights."""
    from nbmoe.cpu import fused, ops
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize
    rng = np.random.default_rng(0)
    K, Ms = 64, (48, 16, 16)
    ws = [quantize(rng.standard_normal((M, K)).astype(np.float32), Q.Q8_0) for M in Ms]
    bs = [rng.standard_normal(M).astype(np.float32) for M in Ms]
    x = rng.standard_normal((1, K)).astype(np.float32)
    for int8 in (False, True) if matmul.HAS_VNNI else (False,):
        monkeypatch.setattr(matmul, "INT8_DOT", int8)
        for n, biased in ((3, (True, True, True)), (3, (True, False, True)), (2, (False, True))):
            want = []
            for w, b, on in zip(ws[:n], bs, biased):
                y = np.empty((1, w.shape[0]), np.float32)
                matmul.mul_mat(y, w, x, int(Q.Q8_0))
                if on:
                    ops.add_bias(y, y, b)
                want.append(y)
            outs = [np.full((1, w.shape[0]), np.nan, np.float32) for w in ws[:n]]
            step = matmul.item_rows(sum(Ms[:n]), ws[0].shape[1], 1, int(Q.Q8_0))
            fused.products(outs, ws[:n], x, int(Q.Q8_0), matmul._int8(int(Q.Q8_0)), step,
                           [b if on else matmul.NO_BIAS for b, on in zip(bs, biased)])
            for got, w in zip(outs, want):
                np.testing.assert_array_equal(got, w)
