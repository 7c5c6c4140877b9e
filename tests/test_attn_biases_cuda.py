"""gpt-oss's q, k, v and o biases in the GPU's fused decode launches (products_q8 adds each
row's bias, product_add the o bias before the residual add): the plain binders' logits (each
product, its ADD_BIAS, the ADD), bit for bit in the simulator, and close to float64.

Runs on the CUDA simulator in CI (a tiny model) and on a real GPU with NBMOE_REAL_GPU=1.
"""
import cuda_setup  # noqa: F401  (selects the simulator before numba.cuda loads)
import numpy as np

import nbmoe
from cuda_common import _simulator_speed  # noqa: F401  (fixture: a short GIL switch interval)
from nbmoe.model import reference
from nbmoe.sched import fusion
from test_attn_biases import attn_biases, cosine_rows

# test_hybrid_families' simulator shape: one layer, K a multiple of 32 (the 8-bit x)
SHAPE = dict(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=32, n_expert=4, n_expert_used=2,
             n_ff_exp=32, sliding_window=2)


def test_gpu_attention_biases_fused(tiny_model, monkeypatch):
    from nbmoe.cuda import matmul as cuda_matmul
    monkeypatch.setattr(cuda_matmul, "INT8_DOT", True)
    path = tiny_model("gpt-oss", types=[("exps", "MXFP4")], default_type="Q8_0",
                      **(SHAPE if cuda_setup.SIM else {}))
    ids = [1] if cuda_setup.SIM else [1, 5, 9, 11]

    def run():   # one-token plans; the simulator keeps the MoE half on the CPU (its time)
        llm = nbmoe.load(path, n_ctx=32, threads=2, n_gpu_layers=99, zero_copy_experts=0,
                         override_tensors=["exps=CPU", "ffn_gate_inp=CPU", "^output=CPU"] if cuda_setup.SIM else [])
        return np.concatenate([llm.eval([t]) for t in ids]), llm
    fused, llm = run()
    nodes, groups, plan = attn_biases(llm, "CUDA0")
    kinds = {groups[id(n)][0] for n in nodes}
    assert len(nodes) == 4 * llm.cfg.n_layer and kinds == {"products", "product_add"}
    assert not [n for n in fusion.unfused(plan.graph.nodes, "CUDA0") if n in nodes]
    monkeypatch.setattr(fusion, "ENABLED", False)       # (the bind-time fusions stay)
    plain, llm = run()
    assert llm.backends["CUDA0"]._groups == {}
    # the simulator computes in numpy: bit for bit (a GPU may contract a * b + c in one
    # kernel and not in its twin, and an 8-bit code of x then round the other way)
    assert np.array_equal(fused, plain) if cuda_setup.SIM else np.abs(fused - plain).max() <= 1e-2 * np.abs(plain).max()
    cos = cosine_rows(fused, reference.forward(llm.cfg, llm.file.tensors, ids))
    assert cos.min() >= 0.99, cos            # x in 8 bits, MXFP4 experts
