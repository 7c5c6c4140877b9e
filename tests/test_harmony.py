"""gpt-oss's text side: its chat template rendered as llama.cpp renders it, and its replies
(harmony channels) shown as the chat shows them: the final channel as the answer, the
reasoning apart. The vocabulary and llama.cpp's rendering are in tests/data (README.md)."""
import argparse
import functools
import io
import json
import os

import pytest

from nbmoe.text.chat_template import ChatTemplateError, chat_prompt_ids, render_chat
from nbmoe.text.harmony import FINAL, HarmonyStream, PlainStream, is_harmony, reply_stream
from nbmoe.text.tokenizer import Tokenizer, read_tokenizer_meta

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


@functools.lru_cache(maxsize=None)
def harmony_tokenizer():
    return Tokenizer.from_meta(read_tokenizer_meta(os.path.join(DATA, "vocab-gpt4o.gguf")))


def llama_cpp_chat():
    with open(os.path.join(DATA, "gpt_oss_chat.json")) as f:
        return json.load(f)


def on_day(date):
    """Template variable that pins the template's strftime_now to the recorded day."""
    return {"strftime_now": lambda fmt: date}


# ---- the template ------------------------------------------------------------------------

def test_template_renders_as_llama_cpp():
    tok, ref = harmony_tokenizer(), llama_cpp_chat()
    text = render_chat(tok.chat_template, ref["messages"], "<|startoftext|>", "<|return|>",
                       add_generation_prompt=True, **on_day(ref["date"]))
    assert text == ref["prompt"]
    assert text.endswith("<|end|><|start|>assistant")
    # no BOS (gpt-oss's vocab adds none); the harmony markers are single tokens
    ids = chat_prompt_ids(tok, ref["messages"], **on_day(ref["date"]))
    assert ids == tok.encode(ref["prompt"])
    assert ids[0] == tok.text_to_id["<|start|>"]
    assert ids.count(tok.text_to_id["<|message|>"]) == 5


def test_template_hand_checked():
    """The harmony layout by hand: system block with the date and reasoning effort, the
    system message as developer instructions, past assistant turns as final messages."""
    tok = harmony_tokenizer()
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"}]
    text = render_chat(tok.chat_template, msgs, "", "", True, reasoning_effort="high",
                       **on_day("2025-08-05"))
    assert text == ("<|start|>system<|message|>You are ChatGPT, a large language model trained "
                    "by OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: 2025-08-05\n\n"
                    "Reasoning: high\n\n# Valid channels: analysis, commentary, final. Channel "
                    "must be included for every message.<|end|>"
                    "<|start|>user<|message|>Hi<|end|>"
                    "<|start|>assistant<|channel|>final<|message|>Hello!<|end|>"
                    "<|start|>user<|message|>Bye<|end|><|start|>assistant")


def test_template_with_tools_as_llama_cpp():
    """A function tool: its TypeScript-like namespace (tojson, .items(), macros) as llama.cpp
    renders it."""
    tok, ref = harmony_tokenizer(), llama_cpp_chat()
    text = render_chat(tok.chat_template, ref["tool_messages"], "", "", True, tools=ref["tools"],
                       **on_day(ref["date"]))
    assert text == ref["tool_prompt"]


def test_template_raise_exception():
    tok = harmony_tokenizer()
    bad = [{"role": "user", "content": "Hi"},
           {"role": "assistant", "content": "<|channel|>analysis<|message|>hm"},
           {"role": "user", "content": "?"}]
    with pytest.raises(ChatTemplateError, match="<|channel|> tags in the content"):
        render_chat(tok.chat_template, bad, "", "", True)


# ---- replies: channels -------------------------------------------------------------------

def _pieces(stream, tok, text):
    out = []
    for i in tok.encode(text):
        out += stream.push(i)
    return out + stream.flush()


def _by_channel(pieces):
    joined = {}
    for channel, text in pieces:
        joined[channel] = joined.get(channel, "") + text
    return joined


REPLY = ("<|channel|>analysis<|message|>User asks 3+3. Answer: 6.<|end|>"
         "<|start|>assistant<|channel|>final<|message|>Six — ünïcödé 😀.<|return|>")


def test_stream_splits_channels():
    tok = harmony_tokenizer()
    assert is_harmony(tok)
    got = _by_channel(_pieces(HarmonyStream(tok), tok, REPLY))
    assert got == {"analysis": "User asks 3+3. Answer: 6.", FINAL: "Six — ünïcödé 😀."}


def test_stream_tool_call_and_preamble_are_not_final():
    tok = harmony_tokenizer()
    reply = ("<|channel|>commentary<|message|>Checking.<|end|>"
             '<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json'
             '<|message|>{"city": "Oslo"}<|call|>')
    assert _by_channel(_pieces(HarmonyStream(tok), tok, reply)) == {
        "commentary": 'Checking.{"city": "Oslo"}'}
    reply = "<|channel|>final to=functions.f<|message|>{}<|call|>"    # a call is no answer
    assert _by_channel(_pieces(HarmonyStream(tok), tok, reply)) == {"commentary": "{}"}


def test_stream_without_headers_is_final():
    """A reply that ignores the format is still shown (at its end), as the answer."""
    tok = harmony_tokenizer()
    assert _pieces(HarmonyStream(tok), tok, "just text") == [(FINAL, "just text")]
    # a reply cut inside the final message keeps what it had
    got = _pieces(HarmonyStream(tok), tok, "<|channel|>final<|message|>Hal")
    assert _by_channel(got) == {FINAL: "Hal"}


def test_plain_vocab_streams_everything_as_final():
    from nbmoe.text.bpe import BYTE_CHARS
    tok = Tokenizer(list(BYTE_CHARS), model="gpt2", pre="gpt2")
    assert not is_harmony(tok) and isinstance(reply_stream(tok), PlainStream)
    assert _by_channel(_pieces(reply_stream(tok), tok, "a <b> ü")) == {FINAL: "a <b> ü"}


# ---- the chat REPL's reply ---------------------------------------------------------------

class ScriptedModel:
    """Stands in for the engine: replies with the ids of a fixed text, up to a stop id."""

    def __init__(self, tokenizer, reply):
        self.tokenizer, self.n_ctx, self.tokens, self.last_stats = tokenizer, 4096, [], {}
        self.reply_ids, self.prompts = tokenizer.encode(reply), []

    def reset(self):
        self.tokens = []

    def generate_ids(self, ids, n, sampler):
        self.prompts.append(ids)
        self.last_stats = {"stop": "eog"}
        for i in self.reply_ids:
            if i in self.tokenizer.stop_ids:
                return
            yield i


def test_chat_shows_final_channel_and_keeps_it(capsys):
    from nbmoe.cli.chat import Chat
    tok = harmony_tokenizer()
    args = argparse.Namespace(temp=0.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0,
                              seed=0, system_prompt="Be brief.", n_predict=64)
    model = ScriptedModel(tok, REPLY)
    chat, out = Chat(model, args), io.StringIO()
    stop = argparse.Namespace(requested=False)
    chat.reply("And 3+3?", out, stop)
    assert out.getvalue() == "Six — ünïcödé 😀.\n"
    assert "User asks 3+3. Answer: 6." in capsys.readouterr().err     # the reasoning, apart
    assert chat.messages[-1] == {"role": "assistant", "content": "Six — ünïcödé 😀."}
    # the next prompt carries the answer as a final message, without the reasoning
    chat.reply("Thanks", io.StringIO(), stop)
    prompt = tok.decode(model.prompts[-1], special=True)
    assert ("<|start|>assistant<|channel|>final<|message|>Six — ünïcödé 😀.<|end|>"
            "<|start|>user<|message|>Thanks<|end|><|start|>assistant") in prompt
    assert "User asks" not in prompt


def test_chat_plain_model_streams_everything(capsys):
    """A ChatML vocabulary has no channels: the whole reply is the answer, as before."""
    from nbmoe.cli.chat import Chat
    from nbmoe.text.bpe import BYTE_CHARS
    from nbmoe.text.tokenizer import CONTROL, NORMAL
    tokens = list(BYTE_CHARS) + ["<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(tokens, token_types=[NORMAL] * 256 + [CONTROL] * 2, model="gpt2", pre="gpt2")
    args = argparse.Namespace(temp=0.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0,
                              seed=0, system_prompt=None, n_predict=64)
    chat, out = Chat(ScriptedModel(tok, "Hi <b>there</b>!<|im_end|>ignored"), args), io.StringIO()
    chat.reply("Hello", out, argparse.Namespace(requested=False))
    assert out.getvalue() == "Hi <b>there</b>!\n"
    assert capsys.readouterr().err == ""
    assert chat.messages == [{"role": "user", "content": "Hello"},
                             {"role": "assistant", "content": "Hi <b>there</b>!"}]
