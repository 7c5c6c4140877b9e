"""Text <-> token ids for a GGUF model, matching llama.cpp's ids exactly.

Built from the GGUF metadata dict (`tokenizer.ggml.*` keys). Two vocabulary kinds:
  "gpt2"  byte-level BPE with a pre-tokenizer regex chosen by `tokenizer.ggml.pre`
          (tokenizer_bpe.py: SmolLM, Llama 3, Qwen, ...);
  "llama" SentencePiece-style, score-ordered merges over "▁"-spelled text with
          `<0xNN>` byte fallback (tokenizer_spm.py: Llama 2, Gemma, ...).

Encoding first cuts special tokens out of the text, as llama.cpp does: every control,
user-defined and unknown token, longest text first, splits each remaining piece of raw
text at its occurrences. Control and unknown tokens are only matched when
`parse_special` is true; user-defined ones always are.

Token types (`tokenizer.ggml.token_type`): 1 normal, 2 unknown, 3 control,
4 user-defined, 5 unused, 6 byte.
"""
import codecs

import numpy as np

from nbmoe.errors import NbmoeError
from nbmoe.text.bpe import LLAMA3_NAMES, BytePairEncoder, decode_spelled
from nbmoe.text.spm import SentencePieceEncoder

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Tokens that end a turn, by text, beside the eos/eot/eom ids of the metadata (texts that
# llama.cpp also puts in its end-of-generation set; its FIM tokens are left out here).
END_OF_TURN_TEXTS = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<｜end▁of▁sentence｜>",
    "<|return|>", "<|call|>",
}

# gpt-oss's harmony format: these header tokens are always matched in text and always
# written out (user-defined), so a reply's channel structure survives decoding. With
# <|return|> and <|call|> ending a reply, <|end|> only closes a message (an analysis one,
# before the final answer), so it is no stop and becomes user-defined too: llama.cpp's rules.
HARMONY_HEADER_TEXTS = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")

# `tokenizer.ggml.pre` names whose vocab adds a BOS when the metadata does not say.
_ADD_BOS_PRE = LLAMA3_NAMES | {"tekken", "chameleon"}


def _as_list(values):
    """GGUF arrays come as numpy arrays (nbmoe.loader.gguf_file) or lists (gguf-py): plain lists."""
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


class Tokenizer:
    """encode / decode for one GGUF vocabulary; build with `Tokenizer.from_meta(meta)`."""

    def __init__(self, tokens, token_types=None, scores=None, merges=None, model="gpt2",
                 pre="", bos_id=None, eos_id=None, eot_id=None, eom_id=None, unk_id=None,
                 add_bos=False, add_eos=False, add_space_prefix=False, chat_template=None):
        # An empty token text would match everywhere; llama.cpp renames it the same way.
        self.tokens = list(tokens)
        if "" in self.tokens:
            self.tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(self.tokens)]
        n = len(self.tokens)
        self.token_types = list(token_types) if token_types is not None else [NORMAL] * n
        self.scores = scores if scores is not None else [0.0] * n
        self.model, self.pre = model, pre
        self.bos_id, self.eos_id, self.eot_id, self.eom_id = bos_id, eos_id, eot_id, eom_id
        self.unk_id = unk_id
        self.add_bos, self.add_eos, self.add_space_prefix = add_bos, add_eos, add_space_prefix
        self.chat_template = chat_template
        self.text_to_id = dict(zip(self.tokens, range(n)))   # a repeated text keeps its last id

        ends = {i for i in (eos_id, eot_id, eom_id) if i is not None and 0 <= i < n}
        ends |= {self.text_to_id[t] for t in END_OF_TURN_TEXTS if t in self.text_to_id}
        for i in ends:   # an end-of-turn token is a control token even if typed otherwise
            if self.token_types[i] not in (CONTROL, UNKNOWN):
                self.token_types[i] = CONTROL
        for text in HARMONY_HEADER_TEXTS:
            if text in self.text_to_id:
                self.token_types[self.text_to_id[text]] = USER_DEFINED
        end_texts = {self.tokens[i] for i in ends}
        if {"<|return|>", "<|call|>", "<|end|>"} <= end_texts:
            end = self.text_to_id["<|end|>"]
            ends.discard(end)
            self.token_types[end] = USER_DEFINED
        self.stop_ids = frozenset(ends)

        if model == "gpt2":
            self._bpe = BytePairEncoder(self.text_to_id, merges or [], pre)
        elif model == "llama":
            self._spm = SentencePieceEncoder(self.text_to_id, self.scores, unk_id)
        else:
            raise NbmoeError(f"tokenizer model {model!r} is not supported "
                             "(only 'gpt2' and 'llama' vocabularies)")
        self._index_specials()
        self._pieces = {}   # id -> bytes, filled on first use

    @classmethod
    def from_meta(cls, meta):
        """Build from a GGUF metadata dict (key -> value, arrays as lists or numpy arrays)."""
        def get(key, default=None):
            return meta.get("tokenizer.ggml." + key, default)

        model = get("model", "llama")
        is_spm = model == "llama"
        pre = get("pre", "") or ""
        types, scores = get("token_type"), get("scores")
        # Defaults where a key is absent are llama.cpp's: an SPM vocab adds BOS and a
        # prefix space, a BPE vocab neither (the Llama 3 family does add BOS).
        return cls(
            tokens=_as_list(get("tokens")),
            token_types=_as_list(types) if types is not None else None,
            scores=_as_list(scores) if scores is not None else None,
            merges=_as_list(get("merges", [])),
            model=model, pre=pre,
            bos_id=get("bos_token_id", 1 if is_spm else None),
            eos_id=get("eos_token_id", 2 if is_spm else None),
            eot_id=get("eot_token_id"), eom_id=get("eom_token_id"),
            unk_id=get("unknown_token_id", 0 if is_spm else None),
            add_bos=bool(get("add_bos_token", is_spm or pre in _ADD_BOS_PRE)),
            add_eos=bool(get("add_eos_token", False)),
            add_space_prefix=bool(get("add_space_prefix", is_spm)),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    # ---- properties -------------------------------------------------------------------

    @property
    def n_vocab(self):
        return len(self.tokens)

    def is_control(self, token_id):
        return self.token_types[token_id] == CONTROL

    def token_text(self, token_id):
        """The vocabulary's spelling of a token ("Ġthe", "▁the", "<|im_end|>")."""
        return self.tokens[token_id]

    # ---- encode -----------------------------------------------------------------------

    def encode(self, text, add_bos=None, parse_special=True):
        """Token ids of `text`.

        add_bos: None adds what the model's metadata asks for at the start of a sequence
        (BOS if `add_bos_token`, EOS if `add_eos_token`), which is what llama.cpp's
        `add_special` does; True always adds BOS, False never does.
        parse_special: match control tokens written in the text ("<|im_start|>").
        """
        if not text:
            return []   # the llama.cpp reference ids: no text gives no tokens, not even BOS
        with_bos = self.add_bos if add_bos is None else add_bos
        ids = [self.bos_id] if with_bos and self.bos_id is not None else []
        prev_special = True   # SPM: a prefix space goes before text that starts a run
        for frag in self._split_specials(text, parse_special):
            if isinstance(frag, int):
                ids.append(frag)
                prev_special = True
            elif self.model == "gpt2":
                ids.extend(self._bpe.encode(frag))
            else:
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                ids.extend(self._spm.encode(frag.replace(" ", "▁")))
                prev_special = False
        if add_bos is None and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def _index_specials(self):
        """Group the special tokens by their first two characters, to find candidates fast."""
        types = np.asarray(self.token_types)
        special = np.flatnonzero((types == CONTROL) | (types == USER_DEFINED) | (types == UNKNOWN))
        special = special.tolist()
        # llama.cpp tries longer texts first; equal lengths in id order here
        special.sort(key=lambda i: (-len(self.tokens[i]), i))
        self._rank = {tid: r for r, tid in enumerate(special)}
        self._special_groups = {}   # first two chars -> ids (in try order)
        for tid in special:
            self._special_groups.setdefault(self.tokens[tid][:2], []).append(tid)

    def _split_specials(self, text, parse_special):
        """Cut special tokens out of `text`: a list of raw-text strings and token ids.

        For each special token in turn (longest first) every raw piece is split at its
        leftmost non-overlapping occurrences, exactly llama.cpp's order. Only tokens that
        occur in the text are tried: most prefix groups are ruled out by one `in` test.
        """
        found = []
        for prefix, ids in self._special_groups.items():
            if prefix in text:
                found.extend(i for i in ids if self.tokens[i] in text and
                             (parse_special or self.token_types[i] == USER_DEFINED))
        found.sort(key=self._rank.__getitem__)
        frags = [text]
        for tid in found:
            special_text = self.tokens[tid]
            out = []
            for frag in frags:
                if isinstance(frag, int) or special_text not in frag:
                    out.append(frag)
                    continue
                for k, part in enumerate(frag.split(special_text)):
                    if k:
                        out.append(tid)
                    if part:
                        out.append(part)
            frags = out
        return frags

    # ---- decode -----------------------------------------------------------------------

    def token_bytes(self, token_id, special=False):
        """Raw bytes of one token. Control/unknown tokens give b"" unless `special`."""
        kind = self.token_types[token_id]
        if kind in (CONTROL, UNKNOWN):
            return self.tokens[token_id].encode("utf-8") if special else b""
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._piece(token_id, kind)
        return piece

    def _piece(self, token_id, kind):
        text = self.tokens[token_id]
        if kind == USER_DEFINED:
            return text.encode("utf-8")   # written as is, in both vocabulary kinds
        if kind == BYTE:
            return bytes([int(text[3:5], 16)])   # "<0x0A>"
        if kind != NORMAL:
            return b""                        # unused / undefined: nothing, like llama.cpp
        if self.model == "gpt2":
            return decode_spelled(text)
        return text.replace("▁", " ").encode("utf-8")

    def decode(self, ids, special=False):
        """Text of a sequence of ids; broken UTF-8 becomes U+FFFD.

        The prefix space an SPM vocab adds while encoding is taken off again, so
        decode(encode(s)) == s for text without special tokens.
        """
        text = b"".join(self.token_bytes(i, special) for i in ids).decode("utf-8", "replace")
        if self.add_space_prefix and text.startswith(" "):
            text = text[1:]
        return text

    def stream(self, special=False):
        """A StreamDecoder for this vocabulary."""
        return StreamDecoder(self, special)


class StreamDecoder:
    """Turns generated ids into text pieces as they come, never splitting a UTF-8 character.

    A character spread over several byte tokens (an emoji from `<0xF0><0x9F>...`) is
    held back until its last byte arrives; `flush()` returns what is left at the end.
    """

    def __init__(self, tokenizer, special=False):
        self.tokenizer, self.special = tokenizer, special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id):
        """Text completed by this token ("" while a character is still incomplete)."""
        return self._utf8.decode(self.tokenizer.token_bytes(token_id, self.special))

    def flush(self):
        return self._utf8.decode(b"", final=True)


def read_tokenizer_meta(path):
    """The `tokenizer.*` and `general.*` metadata of a GGUF file, as a dict for from_meta.

    Uses nbmoe.loader.gguf_file rather than gguf-py's GGUFReader: GGUFReader builds a numpy
    object per vocabulary entry and needs ~16 s for a 262k-token vocab on a loaded
    machine; GGUFFile reads only the header (~0.35 s for the same file).
    """
    from nbmoe.loader.gguf_file import GGUFFile

    meta = GGUFFile(path).meta
    return {k: v for k, v in meta.items() if k.startswith(("tokenizer.", "general."))}
