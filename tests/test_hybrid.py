"""Hybrid CPU + GPU execution: placements, the offload policy, copies between splits.

Runs on the CUDA simulator in CI (tiny models) and on a real GPU with NBMOE_REAL_GPU=1.
Every placement must give the CPU engine's logits (both on the exact float path).
"""
import cuda_setup  # noqa: F401  (selects the simulator before numba.cuda loads)
import numpy as np
import pytest

import nbmoe
from nbmoe.sched import scheduler
from nbmoe.model.graph import OPS
from nbmoe.cpu import matmul
from cuda_common import _simulator_speed  # noqa: F401  (fixture: a short GIL switch interval)

# The simulator runs every CUDA thread as a Python thread: the model is tiny, the output
# layer (295 vocabulary rows) stays on the CPU, and offload thresholds are patched low.
MOE = dict(arch="qwen3moe", n_layer=2, n_embd=32, n_head=2, n_head_kv=1, head_dim=32, n_ff=64,
           n_expert=4, n_expert_used=2, n_ff_exp=32)
PROMPT = [1, 17] if cuda_setup.SIM else [1, 17, 200]
KEEP_OUTPUT = ["^output=CPU"] if cuda_setup.SIM else []


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(**MOE, types=[("exps", "Q4_0")], default_type="Q8_0")


@pytest.fixture(scope="module")
def whole(model, tiny_model):
    """The model for whole runs whose placement needs no second layer: in the simulator one
    layer (every layer costs seconds there), on a real GPU the two-layer model."""
    if not cuda_setup.SIM:
        return model
    return tiny_model(**{**MOE, "n_layer": 1}, types=[("exps", "Q4_0")], default_type="Q8_0")


@pytest.fixture(autouse=True)
def exact(monkeypatch):
    """Both backends on their exact float paths (their int8 paths round x differently)."""
    from nbmoe.cuda import matmul as cuda_matmul
    monkeypatch.setattr(matmul, "INT8_DOT", False)
    monkeypatch.setattr(cuda_matmul, "INT8_DOT", False)


def load(path, override_tensors=(), **kw):
    return nbmoe.load(path, n_ctx=64, threads=2, override_tensors=list(override_tensors) + KEEP_OUTPUT, **kw)


def cpu_logits(path, ids):
    return nbmoe.load(path, n_ctx=64, threads=2).eval(ids)


def close(a, b, rel=2e-4):
    return np.abs(a - b).max() <= rel * np.abs(b).max()


# The simulator's cost is per simulated thread (a warp a weight row): tests of the attention
# side keep the FFN (norm, router, experts) on the CPU there, tests of the experts' side the
# attention. Every layer's products all on the GPU: test_flash_attn_on_off_equal_cpu[off].
FFN_ON_CPU = ["ffn_=CPU"] if cuda_setup.SIM else []
ATTN_ON_CPU = ["attn_=CPU"] if cuda_setup.SIM else []


def test_slots_on_the_gpu(whole):
    """Slots are views of each layer's one device array; the GPU's bound steps read the
    active slot's at run time (the simulator: the attention side on the GPU)."""
    from test_api import interleaved
    llm = load(whole, n_gpu_layers=99, n_slots=2, override_tensors=FFN_ON_CPU)
    assert all(b == "CUDA0" for b in llm.kv.backends)
    a, b = ([1, 17], [3]) if cuda_setup.SIM else ([1, 17, 200], [3, 5])
    got = interleaved(llm, a, b, chunk=1)     # slot 1 written between slot 0's two tokens
    ref = nbmoe.load(whole, n_ctx=32, threads=2)
    for g, seq in zip(got, (a, b)):
        ref.reset()
        assert close(g, np.concatenate([ref.eval([t]) for t in seq]))


def test_decode_slots_on_the_gpu(whole):
    """Two slots' next tokens as one batch on the GPU (the decoding kernel per row, over the
    whole cache): slot 2 (its first token) and slot 0 (at position 2) give the CPU's logits
    for each alone (the simulator: the attention side on the GPU). (The cache types:
    test_cuda_kv_types.py's test_attention_rows.)"""
    from test_api import batched_vs_alone
    llm = load(whole, n_gpu_layers=99, n_slots=3, override_tensors=FFN_ON_CPU)
    assert all(b == "CUDA0" for b in llm.kv.backends)
    steps = [[(2, 13), (0, 11)]] + ([] if cuda_setup.SIM else [[(1, 40), (2, 41), (0, 42)]])
    got, want = batched_vs_alone(llm, [[5, 6], [], []], steps)      # (the simulator: 2 GPU runs)
    for g, w in zip(got, want):
        assert close(g, w)


# (the simulator runs everything on the GPU in test_flash_attn_on_off_equal_cpu, -zce auto's
# 1 of 2 in test_zero_copy_experts_equal_cpu)
SIM_ELSEWHERE = pytest.mark.skipif(cuda_setup.SIM, reason="CI time: the simulator runs it elsewhere")


@pytest.mark.parametrize("placement", [
    pytest.param(dict(n_gpu_layers=99), marks=SIM_ELSEWHERE),                  # everything on the GPU
    pytest.param(dict(n_gpu_layers=99, override_tensors=["exps=CPU"]),         # experts in RAM (-zce
                 marks=SIM_ELSEWHERE),                                         # auto: 1 of 2 on the GPU)
    dict(n_gpu_layers=99, override_tensors=["exps=CPU"], zero_copy_experts=0),   # all on the CPU
    dict(n_gpu_layers=2),                                    # output + the last layer
    pytest.param(dict(n_gpu_layers=99, n_cpu_moe=1),         # experts of layer 0 in RAM
                 marks=pytest.mark.skipif(cuda_setup.SIM, reason="CI time: real GPU only")),
])
def test_hybrid_equals_cpu(model, whole, placement):
    if placement["n_gpu_layers"] != 2:     # -ngl 2 needs both layers: one on the CPU
        model = whole
    llm = load(model, **placement)
    assert "CUDA0" in llm.backends
    got = llm.eval(PROMPT)
    assert close(got, cpu_logits(model, PROMPT))
    # one-token steps through the GPU-resident KV cache; on a real GPU the second and later
    # replay the step recorded as CUDA graphs (positions read from the device)
    ref = nbmoe.load(model, n_ctx=64, threads=2)
    ref.eval(PROMPT)
    tok = int(got[-1].argmax())
    for _ in range(1 if cuda_setup.SIM else 4):
        nxt = llm.eval([tok])
        assert close(nxt, ref.eval([tok]))
        tok = int(nxt[-1].argmax())


@pytest.mark.skipif(cuda_setup.SIM, reason="the simulator records no CUDA graphs")
@pytest.mark.parametrize("experts_in_ram", [False, True])
def test_prompt_batches_replay_as_graphs(whole, monkeypatch, experts_in_ram):
    """Prompt batches are CUDA graphs: the third batch (and the ones after it) replays the
    recording of the second at new positions and tokens, equal to the same batches launched
    one kernel at a time, and to the CPU's logits. All on the GPU, batches of 12 tokens; with
    the experts in RAM, of 64 (their products offloaded, run between the graphs)."""
    from nbmoe import config
    from nbmoe.cuda.graphs import GraphRun
    T = 64 if experts_in_ram else 12
    place = dict(n_gpu_layers=99, flash_attn="off", override_tensors=["exps=CPU"] if experts_in_ram else [])
    rng = np.random.default_rng(3)
    batches = [rng.integers(1, 200, T).tolist() for _ in range(4)]
    monkeypatch.setattr(config, "PROMPT_GRAPHS", False)
    plain = nbmoe.load(whole, n_ctx=4 * T, threads=2, **place)
    want = [plain.eval(ids) for ids in batches]
    monkeypatch.setattr(config, "PROMPT_GRAPHS", True)
    llm = nbmoe.load(whole, n_ctx=4 * T, threads=2, **place)
    ref = nbmoe.load(whole, n_ctx=4 * T, threads=2)
    for ids, w in zip(batches, want):
        got = llm.eval(ids)
        assert np.array_equal(got, w)
        assert close(got, ref.eval(ids))
    plan = llm._plans[next(k for k in llm._plans if llm._plans[k].graph.n_tokens == T)]
    assert any(n.cause == "off" for n in plan.graph.nodes) == experts_in_ram
    assert any(s.exec is not None for s in plan.steps if isinstance(s, GraphRun))
    assert not any(isinstance(s, GraphRun) for p in plain._plans.values() for s in p.steps
                   if p.graph.n_tokens > 8)


@pytest.mark.parametrize("zce", [0, 1])
def test_decode_crossings_in_mapped_memory(model, zce):
    """Experts in RAM, one token: the router's choices and weights, the normed x and the
    experts' sum cross through mapped host memory, no copy step a layer (prompts too, while
    their experts stay on the CPU). The GPU kernels
    read / write the ones only they use there (mapped_crossings); norm_route writes the ones
    the GPU reads too (the normed x for its products; with -zce the choices for its share of
    the experts) to both memories (mirror_candidates). Copied: the token's embedding and
    position in, and the residual stream (the simulator's output layer is on the CPU) or the
    logits out."""
    llm = load(model, n_gpu_layers=99, override_tensors=["exps=CPU"], zero_copy_experts=zce)
    plan = llm.plan(1, 1)
    assert {c.buffer for c in plan.copies if c.mapped} == {"expert_ids", "expert_weights", "ffn_out", "h"}
    out = "x" if KEEP_OUTPUT else "logits"          # (the output layer's input or output)
    assert sorted(c.buffer for c in plan.copies if not c.mapped) == sorted(["pos", "x", out])
    # a prompt below the experts' offload batch is recorded too: its small crossings mapped
    assert {c.buffer for c in llm.plan(9, 1).copies if c.mapped} == {"expert_ids", "expert_weights", "ffn_out"}
    # experts offloaded: recorded too (the offloaded products between the graphs); in the
    # simulator the output norm stays on the CPU and its output reaches the GPU mapped
    assert {c.buffer for c in llm.plan(64, 1).copies if c.mapped} == ({"out_h"} if KEEP_OUTPUT else set())


@pytest.mark.parametrize("zce", [0, 1])
def test_routing_graphs_wait_on_a_host_flag(model, zce, monkeypatch):
    """Experts in RAM, one token: each layer's recorded graph ends with norm_route, whose last
    block sets a flag in mapped host memory once the choices, weights and normed x are there;
    the host waits for that flag instead of the stream (graphs.GraphRun.flag; with -zce the
    wait sits between the routing's graph and the GPU's expert share). Checked on the plan
    with recording switched on (the simulator records no graphs; the real GPU runs them in
    the tests above)."""
    from nbmoe.cuda import graphs
    monkeypatch.setattr(graphs, "ENABLED", True)
    llm = load(model, n_gpu_layers=99, override_tensors=["exps=CPU"], zero_copy_experts=zce)
    runs = [getattr(s, "first", s) for s in llm.plan(1, 1).steps]
    flagged = [r for r in runs if isinstance(r, graphs.GraphRun) and r.flag is not None]
    assert len(flagged) == MOE["n_layer"]
    for r in flagged:
        assert r.steps[-1].label == "RMS_NORM+MUL_MAT+TOPK_MOE"
        assert r.steps[-1].signal["flag"] is not None and r.flag.shape == (1,)


def test_decode_split_copies_together(model):
    """Experts in RAM: each layer's GPU split ends with every value its CPU split reads (the
    router's ids and weights, the normed x), so a decode token makes one CUDA graph a layer."""
    llm = load(model, n_gpu_layers=99, override_tensors=["exps=CPU"], zero_copy_experts=0)
    plan = llm.plan(1, 1)
    ops = [what for _, what in plan.labels]
    assert ops.count("GRAPH") == MOE["n_layer"] + 1
    assert ops[1:4] == ["GRAPH", "EXPERT_FFN", "GRAPH"]        # the CPU's experts: one region


@pytest.mark.parametrize("slots", [1] if cuda_setup.SIM else [1, 3])
def test_zero_copy_experts_equal_cpu(tiny_model, slots):
    """-zce: for one-token steps the GPU computes the first `slots` chosen experts of each
    layer, reading their weights from RAM in place, while the CPU computes the others; the
    logits are the CPU engine's. The GPU's share is launched without a wait of its own, in
    the layer's graph step, so a token still makes one host step of GPU work a layer."""
    A = 2 if cuda_setup.SIM else 4
    path = tiny_model(**{**MOE, "n_layer": 1 if cuda_setup.SIM else 2, "n_expert_used": A},
                      types=[("exps", "Q4_0")], default_type="Q8_0")
    llm = load(path, n_gpu_layers=99, override_tensors=["exps=CPU"], zero_copy_experts=slots)
    plan = llm.plan(1, 1)
    zc = [n for n in plan.graph.nodes if n.cause == "zc"]
    assert {n.backend for n in zc} == {"CUDA0"}
    assert [n.params["slots"] for n in zc if n.op == "MUL_MAT_ID"] == [(0, slots)] * 3 * llm.cfg.n_layer
    cpu_share = [n for n in plan.graph.nodes if n.backend == "CPU" and n.op == "MUL_MAT_ID"]
    assert {n.params["slots"] for n in cpu_share} == {(slots, A)}
    ops = [what for _, what in plan.labels]
    assert ops.count("GRAPH") == llm.cfg.n_layer + 1
    assert sum(isinstance(s, scheduler._LaunchAhead) for s in plan.steps) == llm.cfg.n_layer
    assert not any(n.cause == "zc" for n in llm.plan(2, 1).graph.nodes)   # prompts: as before
    ref = nbmoe.load(path, n_ctx=64, threads=2)
    assert close(llm.eval(PROMPT), ref.eval(PROMPT))
    for tok in (5,) if cuda_setup.SIM else (5, 9, 11):   # real GPU: graphs from the 2nd step
        assert close(llm.eval([tok]), ref.eval([tok]))


@pytest.mark.skipif(cuda_setup.SIM, reason="the balancer needs the device clock (real GPU only)")
def test_zero_copy_share_balances_while_generating(tiny_model):
    """-zce auto: every few generated tokens the GPU and CPU shares are timed and the share
    may move; the logits stay the CPU engine's whatever share a token ran with."""
    from nbmoe.sched.zero_copy import EVERY
    path = tiny_model(**{**MOE, "n_expert_used": 4}, types=[("exps", "Q4_0")], default_type="Q8_0")
    llm = load(path, n_gpu_layers=99, override_tensors=["exps=CPU"])
    assert llm.balancer is not None and llm.zce_share == 2     # round(3/8 * 4)
    ref = nbmoe.load(path, n_ctx=64, threads=2)
    assert close(llm.eval(PROMPT), ref.eval(PROMPT))
    for tok in range(3 * EVERY):
        assert close(llm.eval([tok + 5]), ref.eval([tok + 5]))
    hist = llm.balancer.history          # (a share of 0 is final: nothing more to measure)
    assert len(hist) == 3 or (llm.zce_share == 0 and hist)
    assert all(g > 0 and c > 0 for _, g, c in hist)


def test_zero_copy_experts_need_a_gpu_router(model):
    with pytest.raises(nbmoe.NbmoeError, match="-zce needs"):
        nbmoe.load(model, n_ctx=64, zero_copy_experts=1)                      # no GPU
    with pytest.raises(nbmoe.NbmoeError, match="-zce needs"):
        load(model, n_gpu_layers=99, zero_copy_experts=1)                    # experts on the GPU
    # the default, auto: 3/8 of the chosen experts (here 1 of 2) where a GPU routes a layer
    # whose experts are in RAM, and no complaint where none does
    assert nbmoe.load(model, n_ctx=64).gpu_slots == {}
    assert load(model, n_gpu_layers=99).gpu_slots == {}
    llm = load(model, n_gpu_layers=99, override_tensors=[r"blk\.1\.ffn_.*_exps=CPU"])
    assert llm.gpu_slots == {1: ("CUDA0", 1)}
    nodes = llm.plan(1, 1).graph.nodes          # layer 0 all on the GPU, layer 1 shared
    assert [n.params.get("slots") for n in nodes if n.op == "MUL_MAT_ID"] == [None] * 3 + [(0, 1)] * 3 + [(1, 2)] * 3


@pytest.fixture
def two_gpus(monkeypatch):
    """CUDA0 and CUDA1: the real ones where the machine has two GPUs, else two backends that
    share the one GPU (or the simulator's), which still runs every cross-GPU step: the
    context switches, the copies between the backends' buffers, per-GPU graphs."""
    from numba import cuda

    from nbmoe.backends import cuda as backend_cuda
    if cuda_setup.SIM or len(cuda.gpus) < 2:
        monkeypatch.setattr(backend_cuda, "device_names", lambda: ["CUDA0", "CUDA1"])
        monkeypatch.setattr(backend_cuda, "_device_index", lambda name: 0)


@pytest.mark.parametrize("placement", [
    dict(n_gpu_layers=99, override_tensors=["exps=CUDA1"]),         # experts on the second GPU
    pytest.param(dict(n_gpu_layers=99, override_tensors=[r"blk\.1\.=CUDA1"]),  # a layer each
                 marks=pytest.mark.skipif(cuda_setup.SIM, reason="CI time: one case in the simulator")),
    pytest.param(dict(n_gpu_layers=99, override_tensors=["exps=CPU", r"blk\.1\.=CUDA1"]),
                 marks=pytest.mark.skipif(cuda_setup.SIM, reason="CI time: one case in the simulator")),
])
def test_two_gpus_equal_cpu(model, whole, two_gpus, placement):
    if "exps=CUDA1" in placement["override_tensors"]:
        model = whole       # (the simulator: router on CUDA0, experts on CUDA1, attention on CPU)
        placement = dict(placement, override_tensors=placement["override_tensors"] + ATTN_ON_CPU)
    llm = load(model, **placement)
    assert {"CUDA0", "CUDA1"} <= set(llm.backends)
    assert close(llm.eval(PROMPT), cpu_logits(model, PROMPT))
    plan = llm.plan(1, 1)
    assert any("CUDA1" in (c.src, c.dst) for c in plan.copies)
    ref = nbmoe.load(model, n_ctx=64, threads=2)
    ref.eval(PROMPT)
    for tok in (5,) if cuda_setup.SIM else (5, 9, 11):   # real GPUs: graphs from the 2nd step
        assert close(llm.eval([tok]), ref.eval([tok]))


def test_two_gpus_split_once(model, two_gpus):
    """Layer 0 on CUDA0, layer 1 on CUDA1: the residual stream crosses once, not per op."""
    llm = load(model, n_gpu_layers=99, override_tensors=[r"blk\.1\.=CUDA1"])
    for T in (1, 4):
        plan = llm.plan(T, 1)
        assert [s.backend for s in plan.splits] == ["CPU", "CUDA0", "CUDA1"] + (["CPU"] if KEEP_OUTPUT else [])
        assert [(c.src, c.dst) for c in plan.copies if c.buffer == "x"] == (
            [("CPU", "CUDA0"), ("CUDA0", "CUDA1")] + ([("CUDA1", "CPU")] if KEEP_OUTPUT else []))


def test_experts_stay_on_cpu_for_small_batches(model):
    one_gpu = [r"^blk\.=CUDA0"] + ([] if KEEP_OUTPUT else ["^output=CUDA0"])   # of several too
    llm = load(model, n_gpu_layers=99, override_tensors=["exps=CPU"] + one_gpu)
    plan = llm.plan(4, 1)
    ids_nodes = [n for n in plan.graph.nodes if n.op == "MUL_MAT_ID"]
    assert ids_nodes and all(n.backend == "CPU" and n.cause == "wgt" for n in ids_nodes)
    attn = [n for n in plan.graph.nodes if n.weight and "attn" in n.weight]
    assert all(n.backend == "CUDA0" for n in attn)
    # embedding on CPU, per layer GPU attention + router and CPU experts, then the last
    # residual add and the output layer on the GPU (the output on the CPU in the simulator)
    assert len(plan.splits) == 1 + 2 * 2 + (2 if KEEP_OUTPUT else 1)
    # per layer: h, expert ids and weights down to the CPU, the experts' sum back up
    per_layer = [c.buffer for c in plan.copies if c.buffer in ("h", "expert_ids", "expert_weights", "ffn_out")]
    assert per_layer == ["h", "expert_ids", "expert_weights", "ffn_out"] * 2
    assert plan.copy_bytes > 0


def test_offload_thresholds(model):
    """MUL_MAT with a RAM weight goes to the GPU from 32 rows; MUL_MAT_ID from 32*E/A = 64."""
    llm = load(model, n_gpu_layers=99, override_tensors=["exps=CPU", "attn_q=CPU"])

    def causes(T):
        g = llm.plan(T, 0).graph
        return ({n.cause for n in g.nodes if n.weight and n.weight.endswith("attn_q.weight")},
                {n.cause for n in g.nodes if n.op == "MUL_MAT_ID"})
    assert causes(31) == ({"wgt"}, {"wgt"})
    assert causes(32) == ({"off"}, {"wgt"})
    assert causes(63) == ({"off"}, {"wgt"})
    assert causes(64) == ({"off"}, {"off"})


def test_offload_policy_switches(model):
    llm = load(model, n_gpu_layers=99, override_tensors=["exps=CPU"],
               offload_policy="MUL_MAT_ID,0,MUL_MAT_ID_GLU,0")
    g = llm.plan(64, 0).graph
    assert {n.backend for n in g.nodes if n.op == "MUL_MAT_ID"} == {"CPU"}
    glu_id = OPS.index("MUL_MAT_ID_GLU")          # an op named by its id, as --help lists them
    llm = load(model, n_gpu_layers=99, override_tensors=["exps=CPU"], offload_policy=f"-1,0,MUL_MAT_ID,1,{glu_id},1")
    g = llm.plan(64, 0).graph
    assert {n.cause for n in g.nodes if n.op == "MUL_MAT_ID"} == {"off"}


@pytest.mark.parametrize("prefetch", [True] if cuda_setup.SIM else [False, True])
def test_offloaded_experts_match_cpu(whole, monkeypatch, prefetch):
    """A batch over the expert threshold: chosen experts are uploaded and run on the GPU
    (threshold patched from 32 rows to 1, so 2 tokens are enough in the simulator; the output
    layer's offload switched off: test_merge_up_gate_cuda.py runs it; the simulator runs the
    chosen-only uploads in test_upload_all_experts). With prefetch (pairs per expert patched
    down to 1) every expert tensor is uploaded whole ahead on the copy stream (3 tensors a
    layer through expert_uploads.SLOTS slots, reused)."""
    from nbmoe.backends import expert_uploads
    monkeypatch.setattr(scheduler, "OFFLOAD_MIN_BATCH", 1)
    monkeypatch.setattr(expert_uploads, "START_WHOLE_PAIRS", 1 if prefetch else 10**6)
    model = whole
    llm = load(model, n_gpu_layers=99, override_tensors=["exps=CPU"] + ATTN_ON_CPU,
               offload_policy="MUL_MAT,0")
    ids = [3, 44]
    assert close(llm.eval(ids), cpu_logits(model, ids))
    nodes = llm.plan(2, 2).graph.nodes
    assert {n.cause for n in nodes if n.op == "MUL_MAT_ID"} == {"off"}
    assert not [n for n in nodes if n.op == "MUL_MAT" and n.cause == "off"]
    if prefetch:     # per layer gate, up, down, each uploaded whole once
        assert llm.backends["CUDA0"].prefetched_uploads == llm.cfg.n_layer * 3
    else:
        assert 0 < llm.backends["CUDA0"].last_uploaded <= MOE["n_expert"]


def test_fused_moe_op_switch(model):
    """-fmoe 1: the experts' gate and up (MUL_MAT_ID_GLU, op id 15) have an -op switch of
    their own, at the expert threshold: off, they stay on the CPU for a batch of 64 while the
    down product is offloaded, and --explain names the op. -fmoe 0: MUL_MAT_ID's switch."""
    import io

    from rich.console import Console

    from nbmoe.model.graph import OPS
    from nbmoe.sched.explain import schedule_table
    fid = OPS.index("MUL_MAT_ID_GLU")
    llm = load(model, n_gpu_layers=99, override_tensors=["exps=CPU"], offload_policy=f"{fid},0")
    nodes = llm.plan(64, 0).graph.nodes
    fused = [n for n in nodes if n.policy_op == "MUL_MAT_ID_GLU"]
    assert len(fused) == 3 * MOE["n_layer"] and {n.backend for n in fused} == {"CPU"}
    assert {n.cause for n in nodes if n.op == "MUL_MAT_ID" and n.policy_op == "MUL_MAT_ID"} == {"off"}
    out = io.StringIO()
    Console(file=out, width=300, color_system=None).print(schedule_table(llm, [64]))
    assert "MUL_MAT_ID x2" in out.getvalue() and "MUL_MAT_ID_GLU: CPU/wgt x2" in out.getvalue()
    llm = load(model, n_gpu_layers=99, override_tensors=["exps=CPU"], offload_policy=f"{fid},0",
               fused_moe=False)
    assert {n.cause for n in llm.plan(64, 0).graph.nodes if n.op == "MUL_MAT_ID"} == {"off"}


def test_fused_moe_switch_on_gpu(whole, monkeypatch):
    """On the GPU's int8 path, -fmoe 1 binds the experts' gate, up and GLU to one fused kernel
    (glu_id) and -fmoe 0 to three: the logits of a one-token step equal each other and the
    float64 reference's (cosine, as tests/test_models.py's int8 path). (The simulator: the
    attention on the CPU.)"""
    from nbmoe.cuda import matmul as cuda_matmul
    from nbmoe.model import reference
    monkeypatch.setattr(cuda_matmul, "INT8_DOT", True)
    out = {}
    for fused in (True, False):
        llm = load(whole, n_gpu_layers=99, fused_moe=fused, override_tensors=ATTN_ON_CPU)
        out[fused] = llm.eval([1])[0]
        assert ("glu_id" in {k for k, _ in llm.backends["CUDA0"]._groups.values()}) == fused
    assert close(out[True], out[False], 1e-5)
    want = reference.forward(llm.cfg, llm.file.tensors, [1])[0]      # (x rounded to 8 bits)
    assert out[True] @ want / (np.linalg.norm(out[True]) * np.linalg.norm(want)) >= 0.999


def test_upload_all_experts(tiny_model, monkeypatch):
    """--upload-all-experts: an offloaded expert product uploads whole tensors, not only the
    chosen experts; on a skewed router (half the experts never chosen) that is more bytes
    for the same logits, the CPU engine's."""
    from nbmoe.backends import expert_uploads
    monkeypatch.setattr(scheduler, "OFFLOAD_MIN_BATCH", 1)      # experts offloaded from 2 rows
    monkeypatch.setattr(expert_uploads, "START_WHOLE_PAIRS", 10**6)
    skewed = tiny_model(**{**MOE, "n_layer": 1}, types=[("exps", "Q4_0")], default_type="Q8_0",
                        router_skew=0.5)
    ids, out = [3, 44], {}
    for every in (False, True):
        llm = load(skewed, n_gpu_layers=99, override_tensors=["exps=CPU"] + ATTN_ON_CPU,
                   upload_all_experts=every, offload_policy="MUL_MAT,0")   # (output: CPU)
        out[every] = llm.eval(ids), llm.backends["CUDA0"].uploaded_bytes
        nodes = llm.plan(2, 2).graph.nodes
        assert {n.cause for n in nodes if n.op == "MUL_MAT_ID"} == {"off"}
        if not every:
            assert 0 < llm.backends["CUDA0"].last_uploaded <= MOE["n_expert"]
    assert close(out[False][0], cpu_logits(skewed, ids))
    assert close(out[True][0], out[False][0], 1e-6)
    # the two rare experts of 4 never went up
    exps = sum(t.n_bytes for n, t in llm.weights.items() if "_exps." in n)
    assert out[True][1] - out[False][1] == exps // 2


DENSE = dict(arch="llama", n_layer=1, n_embd=32, n_head=2, n_head_kv=1, head_dim=16, n_ff=32)


@pytest.mark.parametrize("shape", ["moe", "dense"])
def test_fused_decode_launches_are_exact(tiny_model, monkeypatch, shape):
    """On the int8 path the CUDA backend fuses decode launches: residual add + norm in one
    launch, the norm (attention) writing the 8-bit x of the next product, products of one
    input quantizing it once (backend_cuda), and the runs of nodes of fusion.find_groups (q/k/v
    in one launch, gate/up/GLU, expert down + combine + residual add, a product + residual
    add, QK-norm + RoPE + KV store, norm + router + top-k). The logits of a prompt and of
    one-token steps equal those of the plain binders, bit for bit."""
    from nbmoe.backends import cuda as backend_cuda
    from nbmoe.sched import fusion
    from nbmoe.backends.cpu import Backend
    from nbmoe.cuda import matmul as cuda_matmul
    monkeypatch.setattr(cuda_matmul, "INT8_DOT", True)
    flags = []
    ready = backend_cuda.CUDABackend._x_ready
    monkeypatch.setattr(backend_cuda.CUDABackend, "_x_ready",
                        lambda *a: flags.append(ready(*a)) or flags[-1])
    if shape == "moe":
        model = tiny_model(**{**MOE, "n_layer": 1}, types=[("exps", "Q4_0")], default_type="Q8_0")
    else:
        model = tiny_model(**DENSE, default_type="Q8_0")

    def run():
        llm = load(model, n_gpu_layers=99)
        out = [llm.eval([1] if cuda_setup.SIM else PROMPT)]     # the simulator: one-token plans only
        for tok in (5,) if cuda_setup.SIM else (5, 9, 11):
            out.append(llm.eval([tok]))
        groups = {kind for kind, _ in llm.backends["CUDA0"]._groups.values()}
        return out, groups, llm
    fused, groups, llm = run()
    assert sum(flags) >= 1                           # q, k, v from the norm's 8-bit x
    want = ({"products", "rope_attn", "product_add"}
            | ({"norm_route", "glu_id", "down_combine_add"} if shape == "moe" else {"glu"}))
    assert groups == want                            # the one-token plan's groups
    labels = {lab for _, lab in llm.plan(1, 1).labels}
    assert "GRAPH" in labels or "QK_NORM+ROPE+ATTN" in labels
    monkeypatch.setattr(fusion, "ENABLED", False)
    for name in ("bind_add", "bind_rms_norm"):
        monkeypatch.setattr(backend_cuda.CUDABackend, name, getattr(Backend, name))
    monkeypatch.setattr(backend_cuda.CUDABackend, "_x_ready", lambda *a: False)
    plain, groups, _ = run()
    assert groups == set()
    for a, b in zip(fused, plain):
        # the simulator computes in numpy: bit for bit; the GPU compiler may contract a * b + c
        # into one FMA in one kernel and not in its fused twin (one rounding less), and an
        # 8-bit code of x can then round the other way
        assert np.array_equal(a, b) if cuda_setup.SIM else close(a, b, 1e-2)


def test_zce_sweep_tool(whole, capsys):
    """tools/zce_sweep.py decodes with each share in alternated rounds and prints a row each."""
    import zce_sweep
    ot = [a for r in ["exps=CPU"] + KEEP_OUTPUT + ATTN_ON_CPU for a in ("-ot", r)]
    zce_sweep.main(["-m", whole, "-t", "2", "-ngl", "99", *ot, "--zce", "0,1", "--tokens", "1",
                    "--rounds", "1", "--read-mb", "32"])
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln.split() and ln.split()[0] in ("0", "1")]
    assert [r[0] for r in rows] == ["0", "1"] and all(float(r[1]) > 0 for r in rows)
    assert "streaming read" in out


def test_zero_copy_check_tool(capsys):
    """tools/cuda_zero_copy_check.py: expert kernels on weights read in place from a locked
    file mapping give the bits of device copies (tiny shapes here; rates on a real GPU)."""
    import cuda_zero_copy_check
    assert cuda_zero_copy_check.main(["--experts", "4", "--rows", "32", "--cols", "32", "--chosen", "1",
                                      "--reps", "1", "--spin", "1"]) == 0
    assert "bit-identical to device copies" in capsys.readouterr().out


@pytest.mark.parametrize("fa", ["on", "off"])
def test_flash_attn_on_off_equal_cpu(whole, fa, monkeypatch):
    """-fa on / off on the GPU: a 3-token prompt (past the decoding kernel's 2) on the flash
    kernel or the warp-per-query one, both the CPU engine's and the float64 reference's logits;
    then a one-token step: off, everything on the GPU (the simulator's test of that placement);
    on, the experts stay in RAM (6 token-expert pairs cost the simulator ~15 s), and the cache
    counts as long: flash.decode's key splits, 2 keys each."""
    from nbmoe.model import reference
    ids = [1, 17, 200]
    llm = load(whole, n_gpu_layers=99, flash_attn=fa,
               **(dict(override_tensors=["exps=CPU"], zero_copy_experts=0) if fa == "on" else {}))
    got = llm.eval(ids)
    assert llm.backends["CUDA0"].attn_paths[(3, llm.cfg.head_dim)] == ("flash" if fa == "on" else "plain")
    assert close(got, cpu_logits(whole, ids), rel=2e-3 if fa == "on" else 2e-4)   # on: P in f16
    want = reference.forward(llm.cfg, llm.file.tensors, ids)
    cos = np.sum(got * want, -1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
    assert cos.min() >= 0.999
    from nbmoe.cuda import flash
    monkeypatch.setattr(flash, "DECODE_MIN_CACHE", 16)
    monkeypatch.setattr(flash, "DECODE_SPLIT_KEYS", 2)
    ref = nbmoe.load(whole, n_ctx=64, threads=2)
    ref.eval(ids)
    assert close(llm.eval([5]), ref.eval([5]), rel=2e-3 if fa == "on" else 2e-4)
    assert llm.backends["CUDA0"].attn_paths[(1, llm.cfg.head_dim)].endswith(
        "(flash over long caches)" if fa == "on" else "kernel")


def test_flash_attn_on_without_a_kernel_is_recorded():
    """-fa on where CUDA has no flash kernel (Dh 40): the plain kernel, noted for the warning;
    auto takes it silently."""
    from types import SimpleNamespace
    from nbmoe.backends.cpu import Backend
    from nbmoe.cuda import attention
    for mode, noted in (("on", {40}), ("auto", set())):
        be = SimpleNamespace(flash_attn=mode, attn=attention, attn_paths={}, no_flash=set())
        assert not Backend.use_flash(be, 8, 40) and Backend.use_flash(be, 8, 32)
        assert not Backend.use_flash(be, 2, 32)          # decoding: its own kernel in every mode
        assert be.no_flash == noted and be.attn_paths[(2, 32)] == "one-token kernel"
