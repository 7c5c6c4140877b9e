"""SentencePiece-style BPE (GGUF `tokenizer.ggml.model = "llama"`), giving the ids llama.cpp gives.

The text arrives with spaces already spelled "▁" (and the optional prefix space added by
tokenizer.py). Start from single characters; repeatedly join the adjacent pair whose
joined text is a vocabulary token with the highest score (leftmost on a tie), until no
adjacent pair forms a token. A character that is no token on its own is written as its
UTF-8 bytes with the `<0xNN>` byte tokens.

Merges could run over a whole piece of text at once (a heap of candidate pairs keeps
that near-linear), but real text repeats words, so we cut it into words and cache each
word's ids. The cut is exact, not a heuristic: we cut before a "▁" only where the
character before it never precedes a "▁" inside any token. No token can then span the
cut, so no pair across it is ever joined and each side merges as it would in the whole
(gemma-3: only ">" is excluded, for its token ">▁</").
"""
import heapq
import re

SPACE = "\u2581"   # "▁", the vocabulary's spelling of a space


class SentencePieceEncoder:
    """Encodes "▁"-spelled text to ids of an SPM vocabulary, caching per word."""

    CACHE_LIMIT = 200_000   # words; cleared when full

    def __init__(self, text_to_id, scores, unk_id=None):
        self.text_to_id, self.scores, self.unk_id = text_to_id, scores, unk_id
        # characters that some token has right before a "▁" (not counting "▁" itself)
        # (one scan over all texts joined by NUL, when no text holds a NUL itself)
        tokens = list(text_to_id)
        joined = "\x00".join(tokens)
        if joined.count("\x00") == len(tokens) - 1:
            before = set(re.findall("([^" + SPACE + "\x00])" + SPACE, joined))
        else:
            before = {c for t in tokens for c in re.findall("([^" + SPACE + "])" + SPACE, t)}
        if len(before) > 200:   # a vocab of multi-word tokens: keep pieces whole
            self.cut = None
        else:
            keep = "".join(re.escape(c) for c in sorted(before))
            self.cut = re.compile("(?<=[^" + SPACE + keep + "])(?=" + SPACE + ")")
        self.cache = {}

    def encode(self, text):
        if self.cut is None:
            return spm_encode(text, self.text_to_id, self.scores, self.unk_id)
        out = []
        cache = self.cache
        for word in self.cut.split(text):
            ids = cache.get(word)
            if ids is None:
                if len(cache) >= self.CACHE_LIMIT:
                    cache.clear()
                ids = cache[word] = spm_encode(word, self.text_to_id, self.scores, self.unk_id)
            out.extend(ids)
        return out


def spm_encode(text, text_to_id, scores, unk_id=None):
    """ids of `text` (spaces already "▁"): score-ordered merges, then byte fallback."""
    n = len(text)
    if n == 0:
        return []
    piece = list(text)                 # piece[i]: text of symbol i ("" once merged away)
    nxt = list(range(1, n + 1))        # linked list of live symbols
    nxt[-1] = -1
    prv = list(range(-1, n - 1))
    heap = []                          # (-score, left, right, joined length)

    def push(left, right):
        if left < 0 or right < 0:
            return
        joined = piece[left] + piece[right]
        tid = text_to_id.get(joined)
        if tid is not None:
            heapq.heappush(heap, (-scores[tid], left, right, len(joined)))

    for i in range(n - 1):
        push(i, i + 1)

    while heap:
        _, left, right, size = heapq.heappop(heap)
        a, b = piece[left], piece[right]
        # stale entry: one side was merged away or has grown since it was pushed
        if not a or not b or len(a) + len(b) != size:
            continue
        piece[left], piece[right] = a + b, ""
        after = nxt[right]
        nxt[left] = after
        if after >= 0:
            prv[after] = left
        push(prv[left], left)
        push(left, after)

    out = []
    i = 0
    while i >= 0:
        tid = text_to_id.get(piece[i])
        if tid is not None:
            out.append(tid)
        else:
            # Only single characters can miss: a joined piece is a token by construction
            # (so llama.cpp's re-split of merged pieces never runs).
            out.extend(byte_ids(piece[i], text_to_id, unk_id))
        i = nxt[i]
    return out


def byte_ids(piece, text_to_id, unk_id=None):
    """The `<0xNN>` tokens of the UTF-8 bytes of `piece` (an ASCII byte may be its own token)."""
    out = []
    for b in piece.encode("utf-8"):
        tid = text_to_id.get(f"<0x{b:02X}>")
        if tid is None and b < 0x80:
            tid = text_to_id.get(chr(b))
        if tid is None:
            tid = unk_id
        if tid is not None:
            out.append(tid)
    return out
