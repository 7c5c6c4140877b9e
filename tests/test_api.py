"""The Python API of the README: load, tokenize/detokenize, eval, reset, generate."""
import numpy as np
import pytest

import nbmoe


@pytest.fixture(scope="module")
def llm(tiny_model):
    return nbmoe.load(tiny_model("qwen3", default_type="Q8_0"), n_ctx=64, threads=2)


def test_tokenize_roundtrip(llm):
    ids = llm.tokenize("hello world")
    assert ids and llm.detokenize(ids) == "hello world"


def test_eval_appends_to_cache_and_reset_empties_it(llm):
    llm.reset()
    a = llm.eval([5, 6, 7])
    assert a.shape == (3, llm.cfg.n_vocab) and a.dtype == np.float32
    b = llm.eval([8])                       # continues after the three cached tokens
    llm.reset()
    c = llm.eval([5, 6, 7, 8])
    assert np.allclose(b[0], c[3], atol=1e-3 * np.abs(c).max())
    llm.reset()
    assert llm.tokens == []


def test_generate_streams_the_greedy_text(llm):
    llm.reset()
    pieces = list(llm.generate("hello", max_tokens=8, temperature=0.0))
    llm.reset()
    ids = list(llm.generate_ids(llm.tokenize("hello"), 8))
    assert "".join(pieces) == llm.detokenize([i for i in ids if i not in llm.tokenizer.stop_ids])


def test_prompt_longer_than_context(llm):
    llm.reset()
    with pytest.raises(nbmoe.NbmoeError, match="exceed the context"):
        llm.eval(list(range(100)))


def test_load_keeps_numpys_blas_to_one_thread(llm):
    """numpy's OpenBLAS threads spin after each product on the cores Numba's threads need
    (cpu/blas.py): a loaded model leaves BLAS at one thread, and the float products that
    still call it (here an F32 matrix at a prompt's batch) agree with float64."""
    from nbmoe.cpu.blas import blas_threads
    from nbmoe.cpu.matmul import mul_mat
    from gguf import GGMLQuantizationType
    if blas_threads() is None:
        pytest.skip("no OpenBLAS loaded")
    assert blas_threads() == 1
    rng = np.random.default_rng(1)
    w = rng.standard_normal((24, 64), dtype=np.float32)
    x = rng.standard_normal((40, 64), dtype=np.float32)
    out = np.empty((40, 24), np.float32)
    mul_mat(out, w.view(np.uint8), x, int(GGMLQuantizationType.F32))
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    assert np.abs(out - ref).max() / np.abs(ref).max() < 1e-5


# ---- slots: sequences that share one cache -----------------------------------------------

def interleaved(llm, a, b, chunk):
    """The logits of sequences a and b fed `chunk` tokens at a time, in turns on slots 0 and 1."""
    for slot in (0, 1):
        llm.use_slot(slot)
        llm.reset()
    got = [[], []]
    for i in range(0, max(len(a), len(b)), chunk):
        for slot, seq in enumerate((a, b)):
            if i < len(seq):
                llm.use_slot(slot)
                got[slot].append(llm.eval(seq[i:i + chunk]))
    assert llm.slots[0].tokens == list(a) and llm.slots[1].tokens == list(b)
    return [np.concatenate(g) for g in got]


def alone(llm, seq, chunk):
    """The logits of seq fed alone on slot 0, in the same chunks."""
    llm.use_slot(0)
    llm.reset()
    return np.concatenate([llm.eval(seq[i:i + chunk]) for i in range(0, len(seq), chunk)])


def test_slots_share_the_cache(tiny_model):
    llm = nbmoe.load(tiny_model("qwen3", default_type="Q8_0"), n_ctx=64, threads=2, n_slots=2)
    assert llm.n_ctx == 32 and len(llm.slots) == 2
    a, b = [5, 6, 7, 8, 9], [9, 10, 11, 12]
    got = interleaved(llm, a, b, chunk=2)
    assert np.array_equal(got[1], alone(llm, b, 2)) and np.array_equal(got[0], alone(llm, a, 2))
    # slot 1 is the second half of each layer's one array
    assert np.shares_memory(llm.slots[1].kv.k[0], llm.kv.k[0])
    assert llm.kv.k[0][32:36].any() and not llm.kv.k[0][36:].any()
    with pytest.raises(nbmoe.NbmoeError, match="exceed the context of 32"):
        llm.eval(list(range(40)))
    with pytest.raises(nbmoe.NbmoeError, match="slot 2 does not exist"):
        llm.use_slot(2)


def batched_vs_alone(llm, prompts, steps):
    """Feed each prompt to its slot, then decode `steps` rounds of (slot, token) rows as one
    batch each (llm.decode_slots); returns (batched, alone) logits per round, alone from
    each slot's sequence fed on its own to slot 0 of an engine of one slot."""
    for s, p in enumerate(prompts):
        llm.use_slot(s)
        llm.reset()
        if p:
            llm.eval(p)
    ref = nbmoe.load(llm.path, n_ctx=llm.n_ctx, threads=2, cache_type_k=llm.kv.type_k,
                     cache_type_v=llm.kv.type_v)
    got, want = [], []
    for rows in steps:
        got.append(llm.decode_slots(rows))
        alone = []
        for s, tok in rows:
            ref.reset()
            alone.append(ref.eval(llm.slots[s].tokens)[-1])
            assert llm.slots[s].tokens[-1] == tok
        want.append(np.stack(alone))
    return got, want


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_decode_slots_is_each_slot_alone(tiny_model, kv_type):
    """Three slots at different positions (past gpt-oss's 8-token window on layer 0, with
    sinks) decoded as one batch, in any row order, then two of them: each row's logits are
    its slot's decoded alone."""
    llm = nbmoe.load(tiny_model("gpt-oss", default_type="Q8_0"), n_ctx=96, threads=2, n_slots=3,
                     cache_type_k=kv_type, cache_type_v=kv_type)
    prompts = [[5, 6, 7, 8, 9], list(range(20, 32)), [3, 4]]
    got, want = batched_vs_alone(llm, prompts, [[(2, 13), (0, 11), (1, 12)], [(1, 40), (2, 41)]])
    for g, w in zip(got, want):
        assert g.shape == w.shape and np.abs(g - w).max() <= 1e-4 * np.abs(w).max()
    assert llm.decode_slots([(0, 7)]).shape == (1, llm.cfg.n_vocab)       # one row: the one-token path
    with pytest.raises(nbmoe.NbmoeError, match="a slot appears twice"):
        llm.decode_slots([(0, 1), (0, 2)])


# ---- generation's end, the context, threads ----------------------------------------------

def test_generate_reports_why_it_stopped(tiny_model):
    llm = nbmoe.load(tiny_model("qwen3", default_type="Q8_0"), n_ctx=32, threads=1)
    prompt = [5, 6, 7, 8]
    out = list(llm.generate_ids(prompt, max_tokens=-1, stop_ids=()))    # until the context's end
    assert llm.last_stats["stop"] == "context" and len(llm.tokens) == 32
    assert len(out) == 32 - len(prompt) + 1     # the last token is returned, not yet cached
    llm.reset()
    assert list(llm.generate_ids(prompt, max_tokens=3, stop_ids=())) == out[:3]
    assert llm.last_stats["stop"] == "length"
    llm.reset()
    k = next(i for i in range(1, len(out)) if out[i] not in out[:i])    # a token not seen before
    assert list(llm.generate_ids(prompt, max_tokens=-1, stop_ids={out[k]})) == out[:k]
    assert llm.last_stats["stop"] == "stop"


def test_context_and_threads_arguments(tiny_model):
    import numba
    path = tiny_model("qwen3", default_type="Q8_0")
    assert nbmoe.load(path, n_ctx=0, threads=1).n_ctx == 2048        # the model's context_length
    with pytest.raises(nbmoe.NbmoeError, match="context size must be 0 or more"):
        nbmoe.load(path, n_ctx=-1)
    with pytest.raises(nbmoe.NbmoeError, match="threads must be at least 1, got 0"):
        nbmoe.load(path, threads=0)
    pool = numba.config.NUMBA_NUM_THREADS
    with pytest.warns(UserWarning, match=f"1000 threads asked, but Numba's pool has {pool}"):
        llm = nbmoe.load(path, n_ctx=16, threads=1000)
    assert llm.threads == pool and llm.eval([1, 2]).shape == (2, llm.cfg.n_vocab)


# ---- the README's example, as written, on the default model ------------------------------

def readme_api_example():
    """The README's first Python block that calls nbmoe.load."""
    import os
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    return next(b for b in blocks if "nbmoe.load(" in b)


def test_readme_api_example_runs(smollm2_path, capsys):
    """Runs the README's example exactly as written: it must load the default model
    (nbmoe.load() without a path) and print what it generates."""
    from nbmoe.loader.default_model import default_model_path
    code = readme_api_example()
    ns = {}
    exec(compile(code, "README.md", "exec"), ns)
    llm = ns["llm"]
    assert llm.path == default_model_path()
    printed = capsys.readouterr().out
    assert printed.strip(), "the example printed nothing"
    if "logits" in ns and "ids" in ns:
        assert ns["logits"].shape == (len(ns["ids"]), llm.cfg.n_vocab)
