"""Chat templates: the two real models' formats rendered exactly, and tokenized with their
special tokens as single ids. SmolLM2 ships a ChatML template in its GGUF; gemma-3-270m
ships none, so it gets Gemma's own template from nbmoe.text.chat_template."""
import datetime

import pytest
from test_tokenizer import load_tokenizer

from nbmoe.errors import NbmoeError
from nbmoe.text.chat_template import (CHATML_TEMPLATE, GEMMA_TEMPLATE, ChatTemplateError, chat_prompt_ids,
                        default_template, fit_context, render_chat)

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


# ---- a conversation longer than the context ------------------------------------------------

LONG = [{"role": "system", "content": "Be brief."}] + [
    {"role": role, "content": f"{role} message number {i}, with a few more words in it"}
    for i in range(4) for role in ("user", "assistant")] + [{"role": "user", "content": "last"}]


def test_fit_context_keeps_everything_that_fits():
    tok = load_tokenizer("smollm2")
    ids, kept, dropped = fit_context(tok, LONG, 4096, 256)
    assert (ids, kept, dropped) == (chat_prompt_ids(tok, LONG), LONG, 0)


@pytest.mark.parametrize("turns_left", [0, 1, 3])
def test_fit_context_drops_oldest_turns(turns_left):
    """The context holds the system prompt, the newest turns_left exchanges, the new message
    and the reserve exactly: the older exchanges go, a user message with its reply at a time."""
    tok = load_tokenizer("smollm2")
    want = LONG[:1] + LONG[len(LONG) - 1 - 2 * turns_left:]
    reserve = 40
    n_ctx = len(chat_prompt_ids(tok, want)) + reserve
    ids, kept, dropped = fit_context(tok, LONG, n_ctx, reserve)
    assert kept == want and dropped == len(LONG) - len(want)
    assert ids == chat_prompt_ids(tok, want) and len(ids) + reserve == n_ctx
    _, kept, _ = fit_context(tok, LONG, n_ctx - 1, reserve)     # one token less: one more turn goes
    assert kept == LONG[:1] + LONG[len(LONG) - 1 - 2 * max(0, turns_left - 1):]


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])   # gemma's template raises unless
def test_fit_context_without_system_message(model):         # the roles alternate
    tok = load_tokenizer(model)
    turns = LONG[1:]
    n_ctx = len(chat_prompt_ids(tok, turns[-3:])) + 8
    ids, kept, dropped = fit_context(tok, turns, n_ctx, 8)
    assert kept == turns[-3:] and kept[0]["role"] == "user" and dropped == len(turns) - 3


def test_fit_context_message_too_long():
    tok = load_tokenizer("smollm2")
    alone = len(chat_prompt_ids(tok, LONG[:1] + LONG[-1:]))
    ids, kept, _ = fit_context(tok, LONG, alone + 1, 100)   # no room for the reserve: go on anyway
    assert kept == LONG[:1] + LONG[-1:] and len(ids) == alone
    with pytest.raises(NbmoeError, match=f"takes {alone} tokens .* holds {alone}: not sent"):
        fit_context(tok, LONG, alone, 0)
