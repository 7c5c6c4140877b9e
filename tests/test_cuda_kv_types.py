"""KV cache types (bf16, q8_0) on the GPU, under the simulator as test_cuda_kernels.py: the
rows store_kv writes (the same bytes as the CPU's, which test_kv_types.py holds against the
reference), attention over them against the float64 reference of the same quantized values,
and the decoding fusion that writes the new rows itself."""
from cuda_common import _simulator_speed, small  # noqa: F401  (fixtures; first: selects the simulator)
from cuda_common import att, check, dev, poisoned, rnd  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from numba import cuda  # noqa: E402

import naive  # noqa: E402
from nbmoe.cpu import attention as cpu_att  # noqa: E402
from nbmoe.cpu.ops import rope_freqs  # noqa: E402
from nbmoe.model.kv_cache import row_layout  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def caches(types, C, Hkv, Dh):
    return [np.zeros((C,) + row, dt) for row, dt in (row_layout(t, Hkv, Dh) for t in types)]


@pytest.mark.parametrize("types", [("q8_0", "bf16"), ("bf16", "q8_0")])
def test_store_kv_and_attention(types, small, monkeypatch):
    """T = 1 over three key splits, and a batch of T = 3 (the warp-per-query kernel: flash
    stages f16 tiles only)."""
    monkeypatch.setattr(att, "SPLIT_KEYS", 4)
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
        out = poisoned(q.shape)
        att.attention(out, dev(q), dkc, dvc, p, 0.125)
        check(f"attention {types} T={T}", out.copy_to_host(), naive.attention(q, kr, vr, p, 0.125))


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
    from nbmoe.cuda import fused
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
            fused.norm_rope_store(q, k, v, kc, vc, *args)
            att.attention(out, q, kc, vc, pos, 0.125)
        outs.append([a.copy_to_host() for a in (out, kc, vc)])
    for name, a, b in zip(("out", "k cache", "v cache"), *outs):
        assert np.array_equal(a, b), name
    assert outs[0][1][pos0].any()
