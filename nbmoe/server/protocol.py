"""OpenAI requests in, OpenAI replies out: checking a request's JSON, the replies' shapes.

A bad request is an ApiError: its HTTP status and one message, sent as OpenAI sends errors,
{"error": {"message", "type", "code"}}. Fields nbmoe does not use are ignored, as OpenAI's
clients send some (user, frequency_penalty...) by default.
"""
import json
import time
import uuid
from dataclasses import dataclass, field

from nbmoe.text.sampling import SamplingParams


class ApiError(Exception):
    def __init__(self, status, message, type="invalid_request_error", code=None, param=None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def body(self):
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


@dataclass
class Request:
    """What a completion request asks for, checked; prompt_ids are filled in by the app."""
    chat: bool
    model: str | None
    messages: list | None = None       # chat
    prompt: object = None              # completions: text or token ids
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None      # None: until the context is full
    stop: list = field(default_factory=list)
    ignore_eos: bool = False           # llama-server's: go on past end-of-generation tokens
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompt_ids: list = field(default_factory=list)


def parse_json(raw):
    """The body as a JSON object, or a 400."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _get(body, name, types, default=None, check=None, want=None):
    """body[name] if it has one of `types` (bool is not a number here) and passes `check`."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in types or not isinstance(v, types):
        names = " or ".join("a number" if t in (int, float) else {str: "a string", bool: "a boolean",
                            list: "a list", dict: "an object"}[t] for t in dict.fromkeys(types))
        raise ApiError(400, f"'{name}' must be {names}, got {json.dumps(v)}", param=name)
    if check is not None and not check(v):
        raise ApiError(400, f"'{name}' must be {want}, got {json.dumps(v)}", param=name)
    return v


NUM = (int, float)


def parse_request(body, chat):
    """A Request from a /v1/chat/completions (chat) or /v1/completions body, or a 400."""
    req = Request(chat=chat, model=_get(body, "model", (str,)))
    if chat:
        req.messages = _messages(body.get("messages"))
    else:
        req.prompt = _prompt(body.get("prompt"))
    req.stream = _get(body, "stream", (bool,), False)
    options = _get(body, "stream_options", (dict,), {})
    req.include_usage = bool(_get(options, "include_usage", (bool,), False))
    n = _get(body, "n", (int,), 1)
    if n != 1:
        raise ApiError(400, f"'n' must be 1 (one choice per request), got {n}", param="n")
    # max_completion_tokens is the newer name of max_tokens (chat)
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            req.max_tokens = _get(body, name, (int,), check=lambda v: v >= 1, want="at least 1")
            break
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")
    req.stop = [s for s in stop or [] if s]
    req.ignore_eos = _get(body, "ignore_eos", (bool,), False)
    d = SamplingParams()
    seed = _get(body, "seed", (int,))
    req.sampling = SamplingParams(
        temperature=_get(body, "temperature", NUM, d.temperature, lambda v: v >= 0, "0 or more"),
        top_k=_get(body, "top_k", (int,), d.top_k, lambda v: v >= 0, "0 or more (0 = off)"),
        top_p=_get(body, "top_p", NUM, d.top_p, lambda v: 0 < v <= 1, "above 0 and at most 1"),
        min_p=_get(body, "min_p", NUM, d.min_p, lambda v: 0 <= v <= 1, "between 0 and 1"),
        repeat_penalty=_get(body, "repeat_penalty", NUM, d.repeat_penalty, lambda v: v > 0, "above 0"),
        seed=None if seed is None or seed < 0 else seed)
    return req


def _messages(messages):
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects",
                       param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):       # content parts: the text ones, joined
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                               param="messages")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                           param="messages")
        out.append({**m, "content": content})
    return out


def _prompt(prompt):
    """Text, or a list of token ids; a list of one text is that text."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in prompt):
        return prompt
    raise ApiError(400, "'prompt' must be a string, a list of one string, or a list of token ids",
                   param="prompt")


def check_fits(req, n_ctx):
    """The prompt and max_tokens fit a slot's context, or a 400."""
    n = len(req.prompt_ids)
    if req.max_tokens is not None and req.max_tokens > n_ctx:
        raise ApiError(400, f"max_tokens is {req.max_tokens}, more than a slot's context of "
                            f"{n_ctx} tokens", param="max_tokens")
    if n == 0:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if n + (req.max_tokens or 1) > n_ctx:
        want = f" plus max_tokens {req.max_tokens}" if req.max_tokens else " plus one token"
        raise ApiError(400, f"the prompt's {n} tokens{want} exceed a slot's context of {n_ctx} "
                            "tokens (shorten the prompt, lower max_tokens, or start the server "
                            "with a larger -c or a smaller -np)",
                       code="context_length_exceeded", param="messages" if req.chat else "prompt")


# ---- replies ---------------------------------------------------------------------------

class Reply:
    """The JSON objects of one request's answer, whole or as stream chunks."""

    def __init__(self, req, model):
        self.chat, self.model, self.created = req.chat, model, int(time.time())
        self.id = ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.object = "chat.completion" if req.chat else "text_completion"

    def _wrap(self, choice, chunk):
        obj = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [{"index": 0, **choice, "logprobs": None}]}

    def whole(self, text, finish_reason, usage):
        part = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        return {**self._wrap({**part, "finish_reason": finish_reason}, False), "usage": usage}

    def chunk(self, text, finish_reason=None, first=False):
        if self.chat:
            delta = ({"role": "assistant", "content": text} if first else
                     {"content": text} if text or finish_reason is None else {})
            part = {"delta": delta}
        else:
            part = {"text": text}
        return self._wrap({**part, "finish_reason": finish_reason}, True)

    def usage_chunk(self, usage):
        obj = self.object + (".chunk" if self.chat else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [], "usage": usage}


def usage(n_prompt, n_gen):
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}
