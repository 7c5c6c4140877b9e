"""Chat messages -> prompt text, with the model's Jinja chat template (`tokenizer.chat_template`).

Rendered the way HF transformers renders it, so templates written for it work here:
a sandboxed Jinja environment with trim_blocks and lstrip_blocks, the loop-controls
extension, a `tojson` filter that keeps non-ASCII text, the `raise_exception` and
`strftime_now` helpers, and the `{% generation %}` block (rendered as plain text).

A GGUF without a template gets Gemma's turn format when its vocab has
`<start_of_turn>`, otherwise ChatML (`<|im_start|>role ... <|im_end|>`), llama.cpp's
default too.
"""
import datetime
import functools
import json

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nbmoe.errors import NbmoeError

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Gemma 3's template as google ships it (text parts only are used here).
GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


class ChatTemplateError(Exception):
    """A template called raise_exception (bad roles, unsupported content...)."""


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    HF; for inference it is only its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise ChatTemplateError(message)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile(template):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat(template, messages, bos_token, eos_token, add_generation_prompt=True, **extra):
    """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]).

    template: Jinja source; None or "" uses ChatML. `extra` goes to the template as
    variables (tools=..., enable_thinking=..., as some templates read them).
    """
    try:
        compiled = _compile(template or CHATML_TEMPLATE)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not parse: {e}") from None
    return compiled.render(messages=messages, bos_token=bos_token, eos_token=eos_token,
                           add_generation_prompt=add_generation_prompt, **extra)


def default_template(tokenizer):
    """The GGUF's own template, else Gemma's turns for a Gemma vocab, else ChatML."""
    if tokenizer.chat_template:
        return tokenizer.chat_template
    if "<start_of_turn>" in tokenizer.text_to_id:
        return GEMMA_TEMPLATE
    return CHATML_TEMPLATE


def chat_prompt_ids(tokenizer, messages, template=None, add_generation_prompt=True, **extra):
    """Render `messages` and tokenize the result, special tokens parsed, ready to prefill."""
    bos = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
    eos = tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
    text = render_chat(template or default_template(tokenizer), messages, bos, eos,
                       add_generation_prompt, **extra)
    # A template that writes the BOS itself (Gemma's) must not get a second one.
    add_bos = False if bos and text.startswith(bos) else None
    return tokenizer.encode(text, add_bos=add_bos, parse_special=True)


def fit_context(tokenizer, messages, n_ctx, reserve, template=None):
    """The prompt ids of `messages` with room for `reserve` more tokens in n_ctx: the oldest
    turns (a user message and its reply) are dropped first, a leading system message and
    the newest message never, as llama.cpp's context shift keeps the first tokens. Returns
    (ids, kept messages, number of messages dropped); NbmoeError if even the newest message
    leaves no room to answer."""
    head = 1 if messages and messages[0]["role"] == "system" else 0
    kept = list(messages)
    ids = chat_prompt_ids(tokenizer, kept, template)
    while len(ids) + reserve > n_ctx and len(kept) - head > 1:
        del kept[head]
        while len(kept) - head > 1 and kept[head]["role"] != "user":   # a turn starts with its user
            del kept[head]
        ids = chat_prompt_ids(tokenizer, kept, template)
    if len(ids) >= n_ctx:
        raise NbmoeError(f"the message takes {len(ids)} tokens with the chat template, the context "
                         f"holds {n_ctx}: not sent (use a larger -c)")
    return ids, kept, len(messages) - len(kept)
