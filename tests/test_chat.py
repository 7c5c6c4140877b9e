"""Chat templates: the two real models' formats rendered exactly, and tokenized with their
special tokens as single ids. SmolLM2 ships a ChatML template in its GGUF; gemma-3-270m
ships none, so it gets Gemma's own template from nbmoe.text.chat_template."""
import datetime

import pytest
from test_tokenizer import load_tokenizer

from nbmoe.text.chat_template import (CHATML_TEMPLATE, GEMMA_TEMPLATE, ChatTemplateError, chat_prompt_ids,
                        default_template, render_chat)

HI = [{"role": "user", "content": "Hi"}]
TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": " Hi "},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
]


def _render(tok, messages, **kw):
    return render_chat(default_template(tok), messages, tok.token_text(tok.bos_id),
                       tok.token_text(tok.eos_id), **kw)


# ---- SmolLM2: ChatML, with a default system prompt ----------------------------------------

def test_smollm2_template_from_gguf():
    tok = load_tokenizer("smollm2")
    assert default_template(tok) == tok.chat_template
    assert _render(tok, HI) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert _render(tok, TURNS) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n Hi <|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert not _render(tok, HI, add_generation_prompt=False).endswith("assistant\n")


def test_smollm2_prompt_ids():
    tok = load_tokenizer("smollm2")
    ids = chat_prompt_ids(tok, TURNS)
    im_start, im_end, nl = 1, 2, 198
    assert ids[:3] == [im_start, 9690, nl]             # <|im_start|> system \n
    assert ids.count(im_start) == 5 and ids.count(im_end) == 4
    assistant = tok.encode("assistant")
    assert ids[-len(assistant) - 2:] == [im_start, *assistant, nl]
    assert tok.decode(ids, special=True) == _render(tok, TURNS)


# ---- gemma-3: turns with <start_of_turn>, system text folded into the first user turn -----

def test_gemma3_fallback_template():
    tok = load_tokenizer("gemma3")
    assert tok.chat_template is None and default_template(tok) == GEMMA_TEMPLATE
    assert _render(tok, HI) == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert _render(tok, TURNS) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n")


def test_gemma3_prompt_ids_single_bos():
    tok = load_tokenizer("gemma3")
    ids = chat_prompt_ids(tok, HI)
    bos, sot, eot, nl = 2, 105, 106, 107
    # the template writes <bos> itself: exactly one, and every marker a single id
    assert ids == [bos, sot, *tok.encode("user", add_bos=False), nl,
                   *tok.encode("Hi", add_bos=False), eot, nl,
                   sot, *tok.encode("model", add_bos=False), nl]
    assert ids.count(bos) == 1


def test_gemma3_roles_must_alternate():
    tok = load_tokenizer("gemma3")
    with pytest.raises(ChatTemplateError, match="alternate"):
        _render(tok, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_gemma3_content_parts():
    tok = load_tokenizer("gemma3")
    parts = [{"role": "user", "content": [{"type": "text", "text": " Hi "}]}]
    assert _render(tok, parts) == _render(tok, HI)


# ---- the environment ---------------------------------------------------------------------

def test_no_template_falls_back_to_chatml():
    assert render_chat(None, HI, "", "") == render_chat(CHATML_TEMPLATE, HI, "", "")
    bare = render_chat("", HI, "", "", add_generation_prompt=False)
    assert bare == "<|im_start|>user\nHi<|im_end|>\n"


def test_helpers_and_filters():
    year = str(datetime.datetime.now().year)
    assert render_chat("{{ strftime_now('%Y') }}", [], "", "") == year
    as_json = render_chat("{{ messages | tojson }}", [{"content": "é"}], "", "")
    assert as_json == '[{"content": "é"}]'
    assert render_chat("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                       "{{ m.content }}{% endfor %}", [{"content": "a"}, {"content": "b"}],
                       "", "") == "a"
    assert render_chat("{% generation %}x{% endgeneration %}", [], "", "") == "x"
    with pytest.raises(ChatTemplateError, match="boom"):
        render_chat("{{ raise_exception('boom') }}", [], "", "")


def test_trim_and_lstrip_blocks():
    # as HF renders: the newline after a block tag and the indentation before one are dropped
    template = ("{% for m in messages %}\n    {% if m.content %}\n[{{ m.content }}]\n"
                "    {% endif %}\n{% endfor %}")
    assert render_chat(template, [{"content": "a"}, {"content": "b"}], "", "") == "[a]\n[b]\n"


def test_sandboxed():
    with pytest.raises(Exception):
        render_chat("{{ ''.__class__.__mro__[1].__subclasses__() }}", [], "", "")
