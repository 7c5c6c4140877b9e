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


@pytest.mark.parametrize("types", [("q8_0", "q8_0"), ("bf16", "bf16"), ("q8_0", "f16")])
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


class _Cfg:
    n_layer, n_head_kv, head_dim, is_mla = 2, 2, 48, False


def test_cache_sizes_and_bad_types():
    with pytest.raises(NbmoeError, match="multiple of 32"):
        KVCache(_Cfg, 64, type_k="q8_0")
    with pytest.raises(NbmoeError, match="'q4_0' for -ctv: choose one of f16, bf16, q8_0"):
        KVCache(_Cfg, 64, type_v="q4_0")
    _Cfg.head_dim = 64
    c = KVCache(_Cfg, 64, type_k="q8_0", type_v="bf16")
    assert c.k[0].shape == (64, 2, 68) and c.k[0].dtype == np.uint8 and c.v[1].dtype == np.int16
    assert c.n_bytes == 2 * 64 * 2 * (68 + 128) and c.f16_bytes == 2 * 64 * 2 * 256
    assert c.summary() == "KV cache 64 tokens: 0.0 MiB q8_0/bf16 (f16: 0.1 MiB)"
