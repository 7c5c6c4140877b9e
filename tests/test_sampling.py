"""Sampling chain: greedy, penalties, top-k / top-p / min-p cut-offs, seeded draws."""
import numpy as np

from nbmoe.text.sampling import Sampler, SamplingParams


def test_greedy_is_argmax():
    logits = np.random.default_rng(1).normal(size=1000).astype(np.float32)
    assert Sampler(SamplingParams(temperature=0)).sample(logits) == int(np.argmax(logits))


def test_repeat_penalty_changes_greedy_choice():
    logits = np.array([2.0, 1.9, -1.0], np.float32)
    s = Sampler(SamplingParams(temperature=0, repeat_penalty=1.5))
    assert s.sample(logits, history=[0]) == 1          # 2.0 / 1.5 < 1.9


def draws(params, logits, n=2000):
    s = Sampler(params)
    return np.bincount([s.sample(logits) for _ in range(n)], minlength=logits.size)


def test_top_k_keeps_only_k():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))
    c = draws(SamplingParams(temperature=1, top_k=2, top_p=1, min_p=0, seed=0), logits)
    assert c[2] == c[3] == 0 and c[0] > c[1] > 0


def test_top_p_and_min_p():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    c = draws(SamplingParams(temperature=1, top_k=0, top_p=0.75, min_p=0, seed=0), logits)
    assert c[2] == c[3] == 0                           # 0.5 + 0.3 reaches 0.75
    c = draws(SamplingParams(temperature=1, top_k=0, top_p=1, min_p=0.2, seed=0), logits)
    assert c[3] == 0 and c[2] > 0                      # 0.05 < 0.2 * 0.5 <= 0.15


def test_sampled_frequencies_follow_probabilities():
    p = np.array([0.6, 0.3, 0.1])
    c = draws(SamplingParams(temperature=1, top_k=0, top_p=1, min_p=0, seed=3), np.log(p), 6000)
    assert np.allclose(c / c.sum(), p, atol=0.03)


def test_seed_reproducible():
    logits = np.random.default_rng(0).normal(size=50).astype(np.float32)
    a = draws(SamplingParams(temperature=1.5, seed=7), logits, 50)
    b = draws(SamplingParams(temperature=1.5, seed=7), logits, 50)
    assert np.array_equal(a, b)
