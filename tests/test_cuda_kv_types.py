"""KV cache types (bf16, q8_0) on the GPU, under the simulator as test_cuda_kernels.py: the
rows store_kv writes (the same bytes as the CPU's, which test_kv_types.py holds against the
reference), attention over them against the float64 reference of the same quantized values
(the warp kernels and the flash kernel, whose tiles are converted to f16 as they are staged),
the decoding fusion that writes the new rows itself, and a prompt through the whole engine."""
from cuda_common import _simulator_speed, small  # noqa: F401  (fixtures; first: selects the simulator)
from cuda_common import att, check, dev, poisoned, rnd  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from numba import cuda  # noqa: E402

import naive  # noqa: E402
from nbmoe.cpu import attention as cpu_att  # noqa: E402
from nbmoe.cpu.ops import rope_freqs  # noqa: E402
from nbmoe.cuda import flash  # noqa: E402
from nbmoe.model.kv_cache import row_layout  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def caches(types, C, Hkv, Dh):
    return [np.zeros((C,) + row, dt) for row, dt in (row_layout(t, Hkv, Dh) for t in types)]


@pytest.mark.parametrize("types", [("q8_0", "bf16"), ("bf16", "q8_0")])
def test_store_kv_and_attention(types, small, monkeypatch):
    """T = 1 over three key splits, and a batch of T = 3, on the warp-per-query kernels (-fa off)
    and the flash kernel (q8_0 rows staged raw, then converted; T = 1: flash.decode's splits)."""
    monkeypatch.setattr(att, "SPLIT_KEYS", 4)
    monkeypatch.setattr(flash, "DECODE_MIN_CACHE", 8)
    monkeypatch.setattr(flash, "DECODE_SPLIT_KEYS", 4)
    H, Hkv, Dh, pos0, C = 2, 1, 64, 9, 12
    k_all, v_all = rnd(pos0 + 3, Hkv, Dh, seed=1), rnd(pos0 + 3, Hkv, Dh, seed=2, scale=0.01)
    kc, vc = caches(types, C, Hkv, Dh)
    cpu_att.store_kv(kc, vc, k_all, v_all, 0)
    dkc, dvc = (cuda.to_device(np.zeros_like(c)) for c in (kc, vc))
    att.store_kv(dkc, dvc, dev(k_all[:pos0]), dev(v_all[:pos0]), 0)
    att.store_kv(dkc, dvc, dev(k_all[pos0:]), dev(v_all[pos0:]), pos0)
    assert np.array_equal(dkc.copy_to_host(), kc) and np.array_equal(dvc.copy_to_host(), vc)
    kr, vr = naive.kv_round(k_all, types[0]), naive.kv_round(v_all, types[1])
    for T, p in ((1, pos0 + 2), (3, pos0)):
        q = rnd(T, H, Dh, seed=T, scale=2.0)
        for fa in (False, True):
            out = poisoned(q.shape)
            att.attention(out, dev(q), dkc, dvc, p, 0.125, fa=fa)
            check(f"attention {types} T={T} fa={fa}", out.copy_to_host(), naive.attention(q, kr, vr, p, 0.125),
                  **({"rtol": 4e-3} if fa else {}))


@pytest.mark.parametrize("types", [("f16", "f16"), ("q8_0", "bf16")])
def test_attention_rows(types, small, monkeypatch):
    """decode_slots' rows on the GPU: keys written at each row's cache row, each row over its
    own sequence (key splits and their merge, a window, sinks)."""
    monkeypatch.setattr(att, "SPLIT_KEYS", 4)
    H, Hkv, Dh, C = 2, 1, 32, 36
    q, k, v, k_all, v_all, k_new, v_new, pos, rows = naive.rows_case(C, H, Hkv, Dh)
    kc, vc = caches(types, C, Hkv, Dh)
    cpu_att.store_kv(kc, vc, k_all, v_all, 0)
    dkc, dvc = cuda.to_device(kc), cuda.to_device(vc)
    att.store_kv_rows(dkc, dvc, dev(k), dev(v), dev(rows))
    cpu_att.store_kv_rows(kc, vc, k, v, rows)
    assert np.array_equal(dkc.copy_to_host(), kc) and np.array_equal(dvc.copy_to_host(), vc)
    kr, vr = naive.kv_round(k_new, types[0]), naive.kv_round(v_new, types[1])
    for window, sinks in ((0, None), (4, rnd(H, seed=8))):
        out = poisoned(q.shape)
        att.attention_rows(out, dev(q), dkc, dvc, dev(pos), dev(rows), 0.125, window,
                           None if sinks is None else dev(sinks))
        check(f"attention_rows {types} window {window}", out.copy_to_host(),
              naive.attention_rows(q, kr, vr, pos, rows, 0.125, window, sinks))


def test_rope_attention_writes_q8_0_rows(small, monkeypatch):
    """Decoding attention that norms, rotates and stores the new key itself: the same output
    and cache bytes as norm_rope_store + attention, on a q8_0 cache."""
    from nbmoe.cuda import norm_rope
    monkeypatch.setattr(att, "SPLIT_KEYS", 4)
    T, H, Hkv, Dh, C, pos0 = 1, 2, 1, 32, 8, 5
    q0, k0, v0 = (rnd(T, n, Dh, seed=s, scale=2.0) for s, n in ((1, H), (2, Hkv), (3, Hkv)))
    pos = dev(np.arange(pos0, pos0 + T, dtype=np.int32))
    outs = []
    for fused_launch in (False, True):
        q, k, v = dev(q0), dev(k0), dev(v0)
        kc, vc = (cuda.to_device(c) for c in caches(("q8_0", "q8_0"), C, Hkv, Dh))
        att.store_kv(kc, vc, dev(rnd(pos0, Hkv, Dh, seed=6)), dev(rnd(pos0, Hkv, Dh, seed=7)), 0)
        out = poisoned((T, H, Dh))
        args = (pos, None, None, 1e-6, rope_freqs(16, 10000.0), 1.0, True)
        if fused_launch:
            att.rope_attention(out, q, k, v, kc, vc, *args, 0.125)
        else:
            norm_rope.norm_rope_store(q, k, v, kc, vc, *args)
            att.attention(out, q, kc, vc, pos, 0.125)
        outs.append([a.copy_to_host() for a in (out, kc, vc)])
    for name, a, b in zip(("out", "k cache", "v cache"), *outs):
        assert np.array_equal(a, b), name
    assert outs[0][1][pos0].any()


@pytest.mark.parametrize("types", [("q8_0", "bf16"), ("bf16", "q8_0")])
def test_flash_attention_over_quantized_caches(types):
    """Prompts on the flash kernel over bf16 / q8_0 keys and values: fresh random rows after
    pos0 earlier positions, causal, GQA, a partial query tile and two key tiles of the
    simulator's sizes (test_cuda_flash.py crosses query tiles), two q8_0 blocks a row; unused
    rows hold NaN (never read). The reference attends over the values the cache holds; the
    kernel rounds q, P and those values to f16."""
    T, H, Hkv, Dh, pos0 = 12, 4, 2, 64, 5
    C = pos0 + T + 3
    rng = np.random.default_rng()
    k_all, v_all = (rng.standard_normal((pos0 + T, Hkv, Dh)).astype(np.float32) for _ in range(2))
    q = (rng.standard_normal((T, H, Dh)) * 2).astype(np.float32)
    kc, vc = (cuda.to_device(c) for c in caches(types, C, Hkv, Dh))
    att.store_kv(kc, vc, dev(k_all[:pos0]), dev(v_all[:pos0]), 0)
    att.store_kv(kc, vc, dev(k_all[pos0:]), dev(v_all[pos0:]), pos0)
    for c in (kc, vc):
        h = c.copy_to_host()
        h[pos0 + T:] = 0x7FC0 if h.dtype == np.int16 else 0x7E     # bf16 NaN; q8_0: d = NaN
        c.copy_to_device(h)
    assert att.flash_used(T, Dh, types) and flash.supported(Dh, types)
    ref = naive.attention(q, naive.kv_round(k_all, types[0]), naive.kv_round(v_all, types[1]),
                          pos0, 0.125)
    out = poisoned(q.shape)
    att.attention(out, dev(q), kc, vc, dev(np.arange(pos0, pos0 + T, dtype=np.int32)), 0.125)
    check(f"flash {types[0]}/{types[1]}", out.copy_to_host(), ref, 4e-3)


def test_engine_prompt_over_q8_0_cache_equals_cpu(tiny_model, monkeypatch):
    """-ctk q8_0 -ctv q8_0 with every layer on the GPU (the experts in RAM: the simulator's
    cost is in their products): a 3-token prompt (the flash kernel, as --explain records)
    gives the CPU engine's logits over the same cache types (both on their float paths; the
    GPU rounds q, P and the cache values to f16)."""
    import nbmoe
    from nbmoe.cpu import matmul
    from nbmoe.cuda import matmul as cuda_matmul
    monkeypatch.setattr(matmul, "INT8_DOT", False)
    monkeypatch.setattr(cuda_matmul, "INT8_DOT", False)
    path = tiny_model("qwen3moe", n_layer=1, n_embd=32, n_head=2, n_head_kv=1, head_dim=32, n_ff=64,
                      n_expert=4, n_expert_used=2, n_ff_exp=32, types=[("exps", "Q4_0")],
                      default_type="Q8_0")
    ids = [1, 17, 200]
    kw = dict(n_ctx=16, threads=2, cache_type_k="q8_0", cache_type_v="q8_0")
    want = nbmoe.load(path, **kw).eval(ids)
    llm = nbmoe.load(path, n_gpu_layers=99, override_tensors=["^output=CPU", "exps=CPU"],
                     flash_attn="on", **kw)
    got = llm.eval(ids)
    from nbmoe.cli.measure import attention_lines
    assert llm.backends["CUDA0"].attn_paths[(3, 32)] == "flash"
    assert "attention on CUDA0 (-fa on, -ctk q8_0 -ctv q8_0): 3 tokens: flash" in attention_lines(llm)
    assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max()
    assert np.array_equal(got.argmax(-1), want.argmax(-1))
