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
