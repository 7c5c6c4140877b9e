"""-muge on the GPU (the CUDA simulator in CI, a real GPU with NBMOE_REAL_GPU=1): the merged
gate_up tensor uploaded straight into its device buffer, or merged in RAM for the experts
there (read in place by -zce, uploaded, only the chosen experts, when offloaded); the logits
equal the CPU engine's without -muge. The merged fused kernel equals the float64 reference."""
from cuda_common import _simulator_speed, small  # noqa: F401  (fixtures; first: selects the simulator)
from cuda_common import Q, check, dev, poisoned, quantize, rnd, x_rounded  # noqa: E402
import cuda_setup  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import nbmoe  # noqa: E402
from nbmoe.cpu import matmul  # noqa: E402
from nbmoe.sched import scheduler  # noqa: E402

MOE = dict(arch="qwen3moe", n_layer=1 if cuda_setup.SIM else 2, n_embd=32, n_head=2, n_head_kv=1,
           head_dim=32, n_ff=64, n_expert=4, n_expert_used=2, n_ff_exp=32)
PROMPT = [17] if cuda_setup.SIM else list(range(1, 65))
KEEP_OUTPUT = ["^output=CPU"] if cuda_setup.SIM else []
N_CTX = len(PROMPT) + 8      # the prompt, then tokens after it


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(**MOE, types=[("exps", "Q4_0")], default_type="Q8_0")


@pytest.fixture(autouse=True)
def exact(monkeypatch):
    from nbmoe.cuda import matmul as cuda_matmul
    monkeypatch.setattr(matmul, "INT8_DOT", False)
    monkeypatch.setattr(cuda_matmul, "INT8_DOT", False)


def load(path, override_tensors=(), **kw):
    return nbmoe.load(path, n_ctx=N_CTX, threads=2, override_tensors=list(override_tensors) + KEEP_OUTPUT,
                      merge_up_gate=True, **kw)


def close(a, b, rel=2e-4 if cuda_setup.SIM else 1e-3):
    """(a real GPU's 64-token prompt on the tiled float products: ~6e-4 from the CPU's, -muge
    or not)"""
    return np.abs(a - b).max() <= rel * np.abs(b).max()


@pytest.mark.parametrize("placement", [
    dict(n_gpu_layers=99),                                              # merged on the GPU
    dict(n_gpu_layers=99, override_tensors=["exps=CPU"], zero_copy_experts=1),   # in RAM, -zce
])
def test_merged_equals_cpu(model, placement, small):
    llm = load(model, **placement)
    where = "CPU" if "override_tensors" in placement else "CUDA0"
    assert llm.placement["blk.0.ffn_gate_up_exps.weight"][0] == where
    be = llm.backends["CUDA0"]
    if where == "CUDA0":      # uploaded expert by expert into one device buffer
        t = llm.weights["blk.0.ffn_gate_up_exps.weight"]
        assert np.array_equal(be.resident[t.name].copy_to_host(), t.data)
    else:                     # the GPU's share of a token's experts reads the merge in place
        assert "blk.0.ffn_gate_up_exps.weight" in be.zero_copy
    ref = nbmoe.load(model, n_ctx=N_CTX, threads=2)
    # (the simulator: one token on the fused kernels, or on -zce's split; a real
    # GPU: a prompt on the tiled / MMA products, then tokens)
    if not cuda_setup.SIM or where == "CUDA0":
        out = llm.eval(PROMPT)
        assert close(out, ref.eval(PROMPT))
        if not cuda_setup.SIM:        # the same products as without -muge, within rounding
            split = nbmoe.load(model, n_ctx=N_CTX, threads=2, **placement).eval(PROMPT)
            assert close(out, split, rel=1e-5)
    if not cuda_setup.SIM or where == "CPU":
        assert close(llm.eval([5]), ref.eval([5]))


@pytest.mark.parametrize("arch,offloaded", [("qwen3moe", False), ("gpt-oss", False), ("qwen3moe", True)])
def test_prompt_glu_in_the_product(model, arch, offloaded, tiny_model, monkeypatch, small):
    """A prompt on the int8 tensor-core tiles: the merged product applies the GLU itself (no
    GLU launch; gpt-oss: its experts' biases too, no bias launch) and the logits are those of
    the same products with the GLU run after; offloaded: the experts in RAM, the chosen ones
    uploaded for the prompt (the batch threshold patched to 1 row)."""
    from nbmoe.backends import expert_uploads
    from nbmoe.cuda import matmul as cuda_matmul
    from nbmoe.cuda import matmul_mma, ops
    if arch == "gpt-oss":
        model = tiny_model("gpt-oss", types=[("exps", "MXFP4")], default_type="Q8_0", n_layer=1)
    place = dict(n_gpu_layers=99)
    if offloaded:
        monkeypatch.setattr(scheduler, "OFFLOAD_MIN_BATCH", 1)
        monkeypatch.setattr(expert_uploads, "START_WHOLE_PAIRS", 10**6)
        place["override_tensors"] = ["exps=CPU"]
    for mod, k, v in ((cuda_matmul, "INT8_DOT", True), (matmul, "INT8_DOT", True), (cuda_matmul, "MMA", True),
                      (cuda_matmul, "MMV_MAX_T", 2), (matmul_mma, "ID_TILES", ((0, (32, 8, 2, 1, 2)),))):
        monkeypatch.setattr(mod, k, v)
    launches = []
    for name in ("swiglu", "swiglu_oai", "add_bias_id"):
        kernel = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _k=kernel, _n=name, **kw: launches.append(_n) or _k(*a, **kw))
    prompt = [17, 3, 9, 30]
    llm = load(model, **place)
    if offloaded:
        assert {n.cause for n in llm.plan(len(prompt), len(prompt)).graph.nodes if n.op == "MUL_MAT_ID"} == {"off"}
    fused = llm.eval(prompt)
    assert launches == []
    monkeypatch.setattr(cuda_matmul, "fuses_glu_id", lambda *a: False)
    apart = load(model, **place).eval(prompt)
    assert launches == ["swiglu" if arch == "qwen3moe" else "swiglu_oai"] * (MOE["n_layer"] if arch == "qwen3moe" else 1)
    assert close(fused, apart, rel=1e-5)


def test_offloaded_merged_experts(model, monkeypatch, small):
    """A batch over the expert threshold (patched to 1 row: 2 tokens): the merged experts the
    router chose are uploaded (their gate and up rows together) and run on the GPU, and so is
    the output layer (in RAM in the simulator: its offload is checked here)."""
    from nbmoe.backends import expert_uploads
    monkeypatch.setattr(scheduler, "OFFLOAD_MIN_BATCH", 1)
    monkeypatch.setattr(expert_uploads, "START_WHOLE_PAIRS", 10**6)
    llm = load(model, n_gpu_layers=99, override_tensors=["exps=CPU"])
    ids = [3, 44]
    nodes = llm.plan(2, 2).graph.nodes
    assert {(n.weight.split(".")[2], n.cause) for n in nodes if n.op == "MUL_MAT_ID"} == {
        ("ffn_gate_up_exps", "off"), ("ffn_down_exps", "off")}
    if cuda_setup.SIM:
        assert [n.cause for n in nodes if n.weight == "output.weight"] == ["off"]
    assert close(llm.eval(ids), nbmoe.load(model, n_ctx=N_CTX, threads=2).eval(ids))
    assert 0 < llm.backends["CUDA0"].last_uploaded <= MOE["n_expert"]


def test_different_buffers_not_merged(model):
    llm = load(model, n_gpu_layers=99, override_tensors=["ffn_up_exps=CPU"], zero_copy_experts=0)
    assert llm.merged_layers == frozenset()
    assert llm.explain_lines() == [f"-muge (ffn_gate_up_exps): no layer merged; not merged: layers "
                                   f"0{'-1' if MOE['n_layer'] == 2 else ''} (ffn_gate_exps on CUDA0, "
                                   "ffn_up_exps on CPU)"]


def test_merged_glu_id_q8(small):
    """glu_id_q8 with a merged weight (wu None: each expert's gate rows, then its up rows)
    against the float64 GLU of the two halves (x rounded to 8 bits as the kernel's)."""
    from nbmoe.cuda import fused
    from nbmoe.cuda.x8 import quantize_x
    from nbmoe.model.reference import glu
    E, F, K, A = 3, 5, 64, 2
    w, wref = quantize(rnd(E, 2 * F, K, seed=21), "Q4_0")
    x = rnd(1, 1, K, seed=22)
    ids = np.array([[2, 0]], np.int32)
    out = poisoned((1, A, F))
    dx = dev(x)
    xq, xds = quantize_x(dx, 1, K, 0)
    fused.glu_id_q8(out, dev(w), None, xq, xds, dev(ids), 1, int(Q.Q4_0), K, fused.ACT_SILU)
    xr = x_rounded(x)[0, 0]
    want = np.stack([glu(wref[e, :F] @ xr, wref[e, F:] @ xr, "silu") for e in ids[0]])[None]
    check("glu_id_q8 merged", out.copy_to_host(), want)


def test_page_lock_spans_skip_holes():
    """The RAM tensors' pages are locked in runs: a hole of GAP_BYTES or more between them
    (the file's up and gate experts once -muge merged them elsewhere) is left out; smaller
    holes and shared pages join their neighbours."""
    import mmap

    from nbmoe.cuda import host_memory
    page, gap = mmap.PAGESIZE, 8 * mmap.PAGESIZE
    m = mmap.mmap(-1, 64 * page)
    whole = np.frombuffer(m, np.uint8)
    base = whole.ctypes.data
    parts = [whole[100:2 * page], whole[2 * page + 8:3 * page], whole[6 * page:7 * page],
             whole[20 * page:21 * page + 5]]
    assert host_memory.spans_of(parts, gap) == [(base, base + 7 * page), (base + 20 * page, base + 22 * page)]
