"""Sampler against transformers' logits processors and by its empirical behaviour."""

import math

import mlx.core as mx
import numpy as np
import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from llm_executorch_mlx.text import Sampler

VOCAB = 64


def random_logits(seed, n=VOCAB):
    return np.random.default_rng(seed).normal(0, 3, n).astype(np.float32)


def draws(sampler, logits, count, recent=None):
    """``count`` samples, evaluated together."""
    tokens = [sampler.sample(mx.array(logits), recent) for _ in range(count)]
    mx.eval(tokens)
    return np.array([t.item() for t in tokens])


def hf_process(logits, input_ids=(), temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, penalty=1.0):
    """transformers' processors, in generate()'s order."""
    scores = torch.tensor(logits)[None]
    ids = torch.tensor([list(input_ids)], dtype=torch.long)
    if penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(penalty)(ids, scores)
    scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    if min_p:
        scores = MinPLogitsWarper(min_p)(ids, scores)
    return scores[0].numpy()


def test_greedy_is_argmax():
    sampler = Sampler()
    for seed in range(5):
        logits = random_logits(seed)
        token = sampler.sample(mx.array(logits))
        assert isinstance(token, mx.array) and token.shape == ()
        assert token.item() == logits.argmax()


def test_top_k_one_is_argmax():
    logits = random_logits(1)
    assert set(draws(Sampler(temperature=1.5, top_k=1, seed=0), logits, 50)) == {logits.argmax()}


def test_same_seed_same_tokens():
    logits = random_logits(2) / 4  # flat enough that draws vary
    first = draws(Sampler(temperature=1.0, seed=7), logits, 40)
    assert (first == draws(Sampler(temperature=1.0, seed=7), logits, 40)).all()
    assert len(set(first)) > 5
    assert not (first == draws(Sampler(temperature=1.0, seed=8), logits, 40)).all()


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0.7, top_k=5),
        dict(temperature=1.3, top_p=0.8),
        dict(temperature=1.0, min_p=0.1),
        dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05),
        dict(temperature=1.0, repetition_penalty=1.8),
    ],
)
def test_process_matches_transformers(settings):
    logits, recent = random_logits(3), [3, 3, 10, 40, 63]
    ours = Sampler(**settings).process(mx.array(logits), mx.array(recent))
    ref = hf_process(
        logits,
        recent,
        temperature=settings["temperature"],
        top_k=settings.get("top_k", 0),
        top_p=settings.get("top_p", 1.0),
        min_p=settings.get("min_p", 0.0),
        penalty=settings.get("repetition_penalty", 1.0),
    )
    ours = np.array(ours)
    assert (np.isinf(ours) == np.isinf(ref)).all()
    np.testing.assert_allclose(ours[~np.isinf(ours)], ref[~np.isinf(ref)], rtol=1e-5)


def test_top_p_samples_only_the_nucleus():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    tokens = draws(Sampler(temperature=1.0, top_p=0.7, seed=1), np.log(probs), 2000)
    counts = np.bincount(tokens, minlength=4)
    assert counts[2:].sum() == 0  # 0.5 + 0.3 reaches 0.7 first
    assert abs(counts[0] / 2000 - 0.5 / 0.8) < 0.05


def test_unfiltered_sampling_follows_the_distribution():
    probs = np.array([0.6, 0.25, 0.1, 0.05])
    freq = np.bincount(draws(Sampler(temperature=1.0, seed=3), np.log(probs), 4000), minlength=4) / 4000
    np.testing.assert_allclose(freq, probs, atol=0.03)


def test_repetition_penalty_changes_the_choice_as_transformers_does():
    logits = np.array([2.0, 1.5, -0.5, -1.0], dtype=np.float32)
    recent = [0, 0, 2]
    greedy = Sampler(repetition_penalty=1.5)
    assert greedy.sample(mx.array(logits), mx.array(recent)).item() == 1
    assert hf_process(logits, recent, penalty=1.5).argmax() == 1
    penalized = np.array(greedy.process(mx.array(logits), recent))
    np.testing.assert_allclose(penalized, [2 / 1.5, 1.5, -0.75, -1.0])
    assert greedy.sample(mx.array(logits), None).item() == 0
    assert greedy.sample(mx.array(logits), mx.array([], dtype=mx.int32)).item() == 0


def test_input_logits_are_not_modified():
    logits = mx.array(random_logits(4))
    before = np.array(logits)
    Sampler(temperature=1.0, top_p=0.5, repetition_penalty=2.0, seed=0).sample(logits, mx.array([1, 2]))
    np.testing.assert_array_equal(np.array(logits), before)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.1), "temperature must be >= 0"),
        (dict(temperature=math.inf), "temperature must be >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-1), "top_k must be an integer >= 0"),
        (dict(top_k=2.5), "top_k must be an integer >= 0"),
        (dict(min_p=1.1), r"min_p must be in \[0, 1\]"),
        (dict(repetition_penalty=0), "repetition_penalty must be > 0"),
        (dict(seed=-1), r"seed must be an integer in \[0, 2\*\*64\) or None"),
        (dict(seed="x"), "seed must be"),
    ],
)
def test_arguments_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Sampler(**kwargs)


def test_logits_must_be_one_row():
    with pytest.raises(ValueError, match=r"shape \[vocab\]"):
        Sampler().sample(mx.zeros((1, VOCAB)))
