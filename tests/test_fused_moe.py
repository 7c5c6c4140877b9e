"""-fmoe 0|1 on the CPU: the experts' gate, up and GLU as one op (MUL_MAT_ID_GLU, bound to the
fused kernels for small batches) or as three; the same logits either way, the float64
reference's. (The GPU's and the op's -op switch: tests/test_hybrid.py.)"""
import numpy as np

import nbmoe
from nbmoe.cpu import matmul
from nbmoe.model import reference

MOE = dict(arch="qwen3moe", n_layer=2, n_embd=64, n_head=2, n_head_kv=1, head_dim=32, n_ff=64,
           n_expert=8, n_expert_used=3, n_ff_exp=64)
PROMPT, NEXT = [1, 17, 40], 5


def run(path, fused):
    llm = nbmoe.load(path, n_ctx=32, threads=2, fused_moe=fused)
    logits = np.concatenate([llm.eval(PROMPT), llm.eval([NEXT])])
    labels = {op for n in (len(PROMPT), 1) for _, op in llm.plan(n, n).labels}
    return logits, labels, llm


def test_cpu_fused_moe_switch(tiny_model, monkeypatch):
    monkeypatch.setattr(matmul, "INT8_DOT", False)       # the exact float path
    path = tiny_model(**MOE, types=[("exps", "Q4_0")], default_type="Q8_0")
    on, labels_on, llm = run(path, True)
    assert "MOE_BLOCK" in labels_on and labels_on & {"MUL_MAT_ID_GLU", "EXPERT_FFN"}
    assert "GLU" not in labels_on
    big = llm.plan(64, 0).graph.nodes                     # a prompt batch: still the one op
    assert sum(n.policy_op == "MUL_MAT_ID_GLU" for n in big) == 3 * MOE["n_layer"]
    off, labels_off, llm = run(path, False)
    assert {"MUL_MAT_ID", "GLU"} <= labels_off
    assert not {"MUL_MAT_ID_GLU", "EXPERT_FFN", "MOE_BLOCK"} & labels_off
    assert not any(n.policy_op == "MUL_MAT_ID_GLU" for n in llm.plan(64, 0).graph.nodes)
    want = reference.forward(llm.cfg, llm.file.tensors, PROMPT + [NEXT])
    for got in (on, off):
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert np.abs(on - off).max() <= 1e-5 * np.abs(off).max()


def test_ep_policy_keeps_every_expert_product_home(tiny_model):
    """--ep: no expert product moves to a GPU, fused (MUL_MAT_ID_GLU, its own -op switch) or
    not, however large the batch; other products still may."""
    from nbmoe.sched.scheduler import OffloadPolicy
    path = tiny_model(**MOE, types=[("exps", "Q4_0")], default_type="Q8_0")
    policy = OffloadPolicy.parse("-1,1").without_experts()
    for fused in (True, False):
        llm = nbmoe.load(path, n_ctx=32, threads=2, fused_moe=fused)
        nodes = llm.plan(64, 0).graph.nodes
        experts = [n for n in nodes if n.op == "MUL_MAT_ID"]
        assert experts and not any(policy.offload(n, 10**6, llm.cfg) for n in experts)
        assert any(policy.offload(n, 10**6, llm.cfg) for n in nodes if n.op == "MUL_MAT")
