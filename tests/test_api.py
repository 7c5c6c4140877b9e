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
