"""Byte-level BPE (GGUF `tokenizer.ggml.model = "gpt2"`), giving the ids llama.cpp gives.

Three steps per piece of text (special tokens are already cut out by tokenizer.py):
  1. pre-tokenize: split into words with the regexes named by `tokenizer.ggml.pre`;
     the regexes are applied one after another, each splitting every word the previous
     one made, and text that no match covers stays as a word of its own (llama.cpp keeps
     these gaps: "\\t\\tx" under the GPT-2 regex gives "\\t", "\\t", "x");
  2. byte-encode: UTF-8 bytes -> GPT-2's printable stand-in characters (space -> "Ġ");
  3. merge: repeatedly join the adjacent pair with the lowest merge rank (leftmost on a
     tie) until no pair has a rank; each final piece is a vocabulary token.
Words repeat a lot in real text, so step 3 is cached per word.
"""
import regex

from nbmoe.errors import NbmoeError

# The GPT-2 split: contractions, letters, digits, other symbols, whitespace runs.
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama3 / qwen2 use the tiktoken style, with case-insensitive contractions spelled out.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (gpt-4o, gpt-oss), exactly as llama.cpp writes it: an optional lead character, a
# run of letters other than a-z ("upper"), a run of letters other than A-Z ("lower"), an
# optional contraction. The lookaheads stand in for tokenizer.json's \p{Lu}/\p{Ll} classes
# and differ from them on non-ASCII letters and marks; llama.cpp's ids are the ones we match.
GPT4O = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
         r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Regex chains by family, as llama.cpp's llm_tokenizer_bpe picks them.
PRE_TOKENIZERS = {
    "gpt2": (GPT2,),
    "default": (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "llama3": (LLAMA3,),
    "qwen2": (QWEN2,),
    "smollm": (r"\p{N}", GPT2),   # every digit is a word of its own, then GPT-2
    "gpt-4o": (GPT4O,),
}

# `tokenizer.ggml.pre` value -> family. As in llama.cpp, a missing key means "default" and
# a name not listed here is refused (its split is unknown, so its ids would be wrong).
PRE_FAMILY = {
    "default": "default",
    "gpt2": "gpt2", "gpt-2": "gpt2", "phi-2": "gpt2", "mpt": "gpt2", "olmo": "gpt2",
    "jais": "gpt2", "trillion": "gpt2", "exaone4": "gpt2", "roberta-bpe": "gpt2",
    "llama3": "llama3", "llama-v3": "llama3", "llama-bpe": "llama3", "falcon3": "llama3",
    "falcon-h1": "llama3", "pixtral": "llama3", "midm-2.0": "llama3", "lfm2": "llama3",
    "dbrx": "llama3", "smaug-bpe": "llama3", "glm4": "llama3", "chatglm-bpe": "llama3",
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2", "stablelm2": "qwen2", "megrez": "qwen2",
    "hunyuan": "qwen2", "grok-2": "qwen2",
    "smollm": "smollm", "starcoder": "smollm", "refact": "smollm", "command-r": "smollm",
    "codeshell": "smollm", "exaone": "smollm", "minerva-7b": "smollm",
    "gpt-4o": "gpt-4o", "llama4": "gpt-4o", "kanana2": "gpt-4o", "talkie": "gpt-4o",
}

# Names for which llama.cpp takes a word that is already a whole token as is, without
# merging, and whose default is to add a BOS.
LLAMA3_NAMES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                "midm-2.0", "lfm2"}


def byte_chars():
    """GPT-2's table: byte value -> the printable character that stands for it in the vocab.

    Printable Latin-1 bytes stand for themselves; the other 68 are moved to U+0100 upward
    in byte order, so 0x20 (space) becomes U+0120 "Ġ" and 0x0A becomes U+010A "Ċ".
    """
    keep = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table, moved = [], 0
    for b in range(256):
        if b in keep:
            table.append(chr(b))
        else:
            table.append(chr(0x100 + moved))
            moved += 1
    return table


BYTE_CHARS = byte_chars()
CHAR_BYTES = {c: b for b, c in enumerate(BYTE_CHARS)}
# str.translate table taking a latin-1-decoded byte string to its byte-level spelling.
_LATIN1_TO_BYTE_CHARS = {b: c for b, c in enumerate(BYTE_CHARS)}


def split_words(text, patterns):
    """Pre-tokenize: each compiled pattern splits every current word; gaps are kept."""
    words = [text]
    for pat in patterns:
        out = []
        for word in words:
            pos = 0
            for m in pat.finditer(word):
                start, end = m.span()
                if start > pos:
                    out.append(word[pos:start])
                if end > start:
                    out.append(word[start:end])
                pos = end
            if pos < len(word):
                out.append(word[pos:])
        words = out
    return words


class BytePairEncoder:
    """Encodes text (no special tokens in it) to ids of a byte-level BPE vocabulary."""

    CACHE_LIMIT = 200_000   # words; cleared when full so a long chat cannot grow it forever

    def __init__(self, text_to_id, merges, pre=""):
        self.text_to_id = text_to_id
        # rank of the pair "left right"; a repeated merge keeps its first (lowest) rank
        n = len(merges)
        self.ranks = dict(zip(reversed(merges), range(n - 1, -1, -1)))
        self.family = PRE_FAMILY.get(pre or "default")
        if self.family is None:
            raise NbmoeError(f"tokenizer.ggml.pre {pre!r} is not a pre-tokenizer nbmoe knows "
                             f"(known: {', '.join(sorted(PRE_FAMILY))})")
        self.patterns = [regex.compile(p) for p in PRE_TOKENIZERS[self.family]]
        self.ignore_merges = pre in LLAMA3_NAMES
        self.cache = {}

    def encode(self, text):
        out = []
        cache = self.cache
        for word in split_words(text, self.patterns):
            ids = cache.get(word)
            if ids is None:
                if len(cache) >= self.CACHE_LIMIT:
                    cache.clear()
                ids = cache[word] = self._encode_word(word)
            out.extend(ids)
        return out

    def _encode_word(self, word):
        spelled = word.encode("utf-8").decode("latin-1").translate(_LATIN1_TO_BYTE_CHARS)
        if self.ignore_merges and spelled in self.text_to_id:
            return [self.text_to_id[spelled]]
        return [i for piece in self.merge(spelled) for i in self._piece_ids(piece)]

    def merge(self, spelled):
        """Join adjacent pieces, lowest rank first and leftmost on a tie, until none has a rank.

        This is the order of llama.cpp's priority queue (rank, then left position). The
        pair ranks live in a list beside the pieces; a merge only changes its neighbours.
        """
        ranks, none = self.ranks, len(self.ranks)   # `none`: larger than any real rank
        parts = list(spelled)
        pair = [ranks.get(a + " " + b, none) for a, b in zip(parts, parts[1:])]
        while pair:
            best = min(pair)
            if best == none:
                break
            i = pair.index(best)                    # leftmost pair with that rank
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
            del pair[i]
            if i > 0:
                pair[i - 1] = ranks.get(parts[i - 1] + " " + parts[i], none)
            if i < len(pair):
                pair[i] = ranks.get(parts[i] + " " + parts[i + 1], none)
        return parts

    def _piece_ids(self, piece):
        tid = self.text_to_id.get(piece)
        if tid is not None:
            return [tid]
        # Not a token (a vocabulary without all 256 byte characters): llama.cpp looks up
        # each UTF-8 byte as a one-byte string and drops those it does not find.
        return [self.text_to_id[chr(b)] for b in piece.encode("utf-8")
                if b < 0x80 and chr(b) in self.text_to_id]


def decode_spelled(text):
    """Byte-level spelling of one token -> its raw bytes (characters outside the table as UTF-8)."""
    out = bytearray()
    for ch in text:
        b = CHAR_BYTES.get(ch)
        if b is None:
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)
