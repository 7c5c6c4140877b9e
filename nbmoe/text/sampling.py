"""Choosing the next token from logits.

The chain follows llama.cpp's default order: repeat penalty -> top-k -> top-p -> min-p ->
temperature -> draw. Temperature <= 0 means greedy (argmax after the penalty).
"""
from dataclasses import dataclass

import numpy as np


@dataclass
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40           # 0 = off
    top_p: float = 0.95       # 1 = off
    min_p: float = 0.05       # 0 = off
    repeat_penalty: float = 1.0   # 1 = off
    repeat_last_n: int = 64
    seed: int | None = None


class Sampler:
    def __init__(self, params=None):
        self.p = params or SamplingParams()
        self.rng = np.random.default_rng(self.p.seed)

    def penalize(self, logits, history):
        """Divide positive (multiply negative) logits of recently seen tokens by the penalty."""
        p = self.p
        if p.repeat_penalty == 1.0 or not history or p.repeat_last_n == 0:
            return logits
        recent = np.unique(np.asarray(history[-p.repeat_last_n:], np.int64))
        logits = logits.copy()
        v = logits[recent]
        logits[recent] = np.where(v > 0, v / p.repeat_penalty, v * p.repeat_penalty)
        return logits

    def sample(self, logits, history=()):
        p = self.p
        logits = self.penalize(np.asarray(logits, np.float32), history)
        if p.temperature <= 0:
            return int(np.argmax(logits))
        # candidates sorted by logit, cut by top-k
        k = p.top_k if 0 < p.top_k < logits.size else logits.size
        idx = np.argpartition(-logits, k - 1)[:k] if k < logits.size else np.arange(logits.size)
        idx = idx[np.argsort(-logits[idx], kind="stable")]
        x = logits[idx].astype(np.float64)
        probs = np.exp(x - x[0])
        probs /= probs.sum()
        keep = idx.size
        if p.top_p < 1.0:  # smallest prefix whose mass reaches top_p
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
        if p.min_p > 0.0:  # drop tokens below min_p times the best one's probability
            keep = min(keep, max(1, int(np.sum(probs >= p.min_p * probs[0]))))
        idx, x = idx[:keep], x[:keep]
        q = np.exp((x - x[0]) / p.temperature)
        return int(idx[self.rng.choice(keep, p=q / q.sum())])
