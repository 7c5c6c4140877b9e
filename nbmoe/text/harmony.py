"""A gpt-oss reply, split into its channels as the tokens come (OpenAI's harmony format).

The chat prompt ends with `<|start|>assistant`; the model then writes messages like

    <|channel|>analysis<|message|>Let me think...<|end|>
    <|start|>assistant<|channel|>final<|message|>The answer.<|return|>

A header (role, `<|channel|>` name, an optional ` to=recipient` and `<|constrain|>` type)
runs up to `<|message|>`; the message body runs up to `<|end|>`, or to `<|return|>` /
`<|call|>`, which end the reply. The "final" channel is the answer for the user; "analysis"
(the reasoning) and "commentary" (preambles, tool calls) are not.
"""
import re

FINAL = "final"
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")


def is_harmony(tokenizer):
    """Whether this vocabulary writes harmony replies (it has the header tokens)."""
    return all(t in tokenizer.text_to_id for t in ("<|channel|>", "<|message|>", "<|start|>"))


class HarmonyStream:
    """push(token id) -> a list of (channel, text) pieces of message bodies; flush() at the end.

    Header text is held back until its `<|message|>` names the channel. A reply that never
    reaches a `<|message|>` (a model ignoring the format) comes out as "final" at flush().
    """

    def __init__(self, tokenizer):
        ids = tokenizer.text_to_id
        self.start, self.message = ids["<|start|>"], ids["<|message|>"]
        self.marks = {ids[t]: t for t in ("<|channel|>", "<|constrain|>") if t in ids}
        self.ends = {ids[t] for t in ("<|end|>", "<|return|>", "<|call|>") if t in ids}
        self.decoder = tokenizer.stream()
        self.channel = None      # the channel of the body being written; None in a header
        self.header = ""         # header text so far
        self.had_message = False

    def push(self, token_id):
        if token_id == self.message and self.channel is None:
            self.header += self.decoder.flush()
            m = _CHANNEL.search(self.header)
            recipient = " to=" in self.header
            self.channel = m.group(1) if m else FINAL
            if recipient and self.channel == FINAL:
                self.channel = "commentary"   # a tool call is never the answer
            self.header, self.had_message = "", True
            return []
        if token_id in self.ends or token_id == self.start:
            out = self._close()
            self.channel = None
            return out
        if self.channel is None:
            self.header += self.marks.get(token_id) or self.decoder.push(token_id)
            return []
        text = self.decoder.push(token_id)
        return [(self.channel, text)] if text else []

    def _close(self):
        rest = self.decoder.flush()
        if self.channel is None:
            self.header += rest
            return []
        return [(self.channel, rest)] if rest else []

    def flush(self):
        out = self._close()
        if not self.had_message and self.header.strip():
            out.append((FINAL, self.header))
        self.header = ""
        return out


class PlainStream:
    """The same interface for a model without channels: every piece is "final"."""

    def __init__(self, tokenizer):
        self.decoder = tokenizer.stream()

    def push(self, token_id):
        text = self.decoder.push(token_id)
        return [(FINAL, text)] if text else []

    def flush(self):
        text = self.decoder.flush()
        return [(FINAL, text)] if text else []


def reply_stream(tokenizer):
    """The channel splitter that fits this vocabulary."""
    return HarmonyStream(tokenizer) if is_harmony(tokenizer) else PlainStream(tokenizer)
