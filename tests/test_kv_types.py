"""KV cache types (-ctk / -ctv: f16, bf16, q8_0) on the CPU: the rows store_kv writes, and
attention over them, against float64 references that quantize the same way (naive.kv_round),
so the only difference is arithmetic. Small shapes: these compile each kernel per cache type."""
import numpy as np
import pytest

import naive
from naive import max_rel, rnd
from nbmoe.cpu import attention as att
from nbmoe.cpu import attention_flash as flash
from nbmoe.cpu import ops
from nbmoe.errors import NbmoeError
from nbmoe.model import reference
from nbmoe.model.kv_cache import KVCache, row_layout

RTOL = 1e-5


def empty_cache(kv_type, C, Hkv, Dh):
    row, dt = row_layout(kv_type, Hkv, Dh)
    return np.zeros((C,) + row, dt)


def test_store_rows_match_the_reference_bytes():
    """bf16: round to nearest even; q8_0: llama.cpp's block_q8_0 bytes (d f16, 32 int8)."""
    k = rnd(3, 2, 64, seed=1, scale=3.0)
    k[0, 0, :32] = 0.0                                    # an all-zero block: d = 0, q = 0
    k[1, 1, 5] = np.float32(1 + 2 ** -8)                  # a bf16 tie -> even
    for kv_type in ("bf16", "q8_0"):
        kc = empty_cache(kv_type, 6, 2, 64)
        att.store_kv(kc, kc, k, k, 2)
        assert not kc[:2].any() and not kc[5:].any()
        if kv_type == "bf16":
            assert np.array_equal(kc[2:5].view(np.uint16).astype(np.uint64) << 16,
                                  naive.bf16_round(k).astype(np.float32).view(np.uint32))
        else:
            d, q = naive.q8_0_quantize(k)
            blocks = kc[2:5].reshape(3, 2, 2, 34)
            assert np.array_equal(blocks[..., :2].copy().view(np.float16)[..., 0], d)
            assert np.array_equal(blocks[..., 2:].view(np.int8), q.reshape(3, 2, 2, 32))


@pytest.mark.parametrize("types", [("q8_0", "q8_0"), ("bf16", "bf16")])
@pytest.mark.parametrize("T", [1, 20])
def test_attention_over_quantized_cache(T, types):
    """Decode (sequential and split) and prompt tiles (flash) read the cache's blocks directly."""
    H, Hkv, Dh, pos0, C = 4, 2, 64, 70, 96
    tk, tv = types
    kc, vc = empty_cache(tk, C, Hkv, Dh), empty_cache(tv, C, Hkv, Dh)
    k_all, v_all = rnd(pos0 + T, Hkv, Dh, seed=T), rnd(pos0 + T, Hkv, Dh, seed=T + 1)
    att.store_kv(kc, vc, k_all[:pos0], v_all[:pos0], 0)
    att.store_kv(kc, vc, k_all[pos0:], v_all[pos0:], pos0)
    q = rnd(T, H, Dh, seed=T + 2, scale=2.0)
    ref = naive.attention(q, naive.kv_round(k_all, tk), naive.kv_round(v_all, tv), pos0, 0.125)
    fns = [att.attention]
    fns += [att._decode_seq, att._decode_split] if T == 1 else [flash.flash_seq, flash.flash_par]
    for fn in fns:
        out = np.full_like(q, np.nan)
        fn(out, q, kc, vc, pos0, 0.125, 0, ops.EMPTY)
        assert max_rel(out, ref) < RTOL, (fn, types)


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_attention_rows_reads_each_rows_sequence(kv_type):
    """A batch of three sequences' next tokens (decode_slots): each row's key and value go to
    its own cache row, and it attends over its sequence's rows only (a window, sinks)."""
    H, Hkv, Dh, C = 4, 2, 64, 72
    q, k, v, k_all, v_all, k_new, v_new, pos, rows = naive.rows_case(C, H, Hkv, Dh)
    kc, vc = empty_cache(kv_type, C, Hkv, Dh), empty_cache(kv_type, C, Hkv, Dh)
    att.store_kv(kc, vc, k_all, v_all, 0)
    att.store_kv_rows(kc, vc, k, v, rows)
    kr, vr = naive.kv_round(k_new, kv_type), naive.kv_round(v_new, kv_type)
    for window, sinks in ((0, ops.EMPTY), (4, rnd(H, seed=8))):
        out = np.full_like(q, np.nan)
        att.attention_rows(out, q, kc, vc, pos, rows, 0.125, window, sinks)
        ref = naive.attention_rows(q, kr, vr, pos, rows, 0.125, window, sinks if sinks.size else None)
        assert max_rel(out, ref) < RTOL, (window, kv_type)


class _Cfg:
    n_layer, n_head_kv, is_mla = 2, 2, False

    def __init__(self, head_dim):
        self.head_dim = head_dim


def test_cache_sizes_and_bad_types():
    with pytest.raises(NbmoeError, match="q8_0 needs a head dim that is a multiple of 32; this model's is 48"):
        KVCache(_Cfg(48), 64, type_k="q8_0")
    with pytest.raises(NbmoeError, match="'q4_0' for -ctv: choose one of f16, bf16, q8_0"):
        KVCache(_Cfg(64), 64, type_v="q4_0")
    c = KVCache(_Cfg(64), 64, type_k="q8_0", type_v="bf16")
    assert c.k[0].shape == (64, 2, 68) and c.k[0].dtype == np.uint8 and c.v[1].dtype == np.int16
    assert c.n_bytes == 2 * 64 * 2 * (68 + 128) and c.f16_bytes == 2 * 64 * 2 * 256
    assert c.summary() == "KV cache 64 tokens: 0.0 MiB q8_0/bf16 (f16: 0.1 MiB)"


def test_engine_logits_with_quantized_caches(smollm2_path):
    """SmolLM2-135M over q8_0 and bf16 caches, a prompt then tokens one at a time (the batch
    and the decoding kernels): the same top-1 token at every position, logits within cosine
    0.99 of the f16 cache's (this small model moves by about 0.997 with either type; that
    the kernels are exact is test_engine_matches_the_reference_holding_the_same_cache's)."""
    import nbmoe
    llm = nbmoe.load(smollm2_path, n_ctx=32, threads=2)
    ids = llm.tokenize("The capital of France is Paris. The capital of Italy is")
    ref = llm.eval(ids)
    for ctk, ctv in (("q8_0", "q8_0"), ("bf16", "q8_0")):
        llm = nbmoe.load(smollm2_path, n_ctx=32, threads=2, cache_type_k=ctk, cache_type_v=ctv)
        got = np.concatenate([llm.eval(ids[:8])] + [llm.eval([t]) for t in ids[8:]])
        cos = np.sum(got * ref, 1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
        print(ctk, ctv, max_rel(got, ref), cos.min(), (got.argmax(1) == ref.argmax(1)).mean())
        assert cos.min() > 0.99, (ctk, ctv)
        assert np.array_equal(got.argmax(axis=1), ref.argmax(axis=1)), (ctk, ctv)
    with pytest.raises(NbmoeError, match="unknown KV cache type 'q4_0' for -ctk"):
        nbmoe.load(smollm2_path, n_ctx=32, cache_type_k="q4_0")


@pytest.mark.parametrize("types", [("q8_0", "q8_0"), ("bf16", "q8_0")])
def test_engine_matches_the_reference_holding_the_same_cache(tiny_model, types, monkeypatch):
    """The float path over a quantized cache against reference.py rounding keys and values the
    same way: only arithmetic apart, far closer than to the f16 cache's reference."""
    import nbmoe
    from nbmoe.cpu import matmul
    monkeypatch.setattr(matmul, "INT8_DOT", False)
    prompt = [1, 17, 200, 33, 5, 250, 99, 12, 7]
    llm = nbmoe.load(tiny_model("qwen3", default_type="Q8_0"), n_ctx=16, threads=2,
                     cache_type_k=types[0], cache_type_v=types[1])
    got = np.concatenate([llm.eval(prompt[:5])] + [llm.eval([t]) for t in prompt[5:]])
    f16 = reference.forward(llm.cfg, llm.file.tensors, prompt)
    monkeypatch.setattr(reference, "KV_TYPES", types)
    want = reference.forward(llm.cfg, llm.file.tensors, prompt)
    print(types, max_rel(got, want), max_rel(got, f16))
    assert max_rel(got, want) < 1e-4 and max_rel(got, f16) > 1e-3
