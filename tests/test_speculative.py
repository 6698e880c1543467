"""Speculative decoding with prompt lookup (``-o draft ngram``): the same
replies as decoding token by token, fewer steps where the reply copies.

Greedy replies are held to transformers' own greedy continuation; sampling
to the target distribution, counted over many draws; the drafter to a
brute-force search of the ids seen so far.
"""

from __future__ import annotations

import llm
import mlx.core as mx
import numpy as np
import pytest
from test_plugin import hf_greedy, register, tiny, user_dir  # noqa: F401 (fixtures: the registered tiny model)

from llm_executorch_mlx.text import store
from llm_executorch_mlx.text.drafting import FEWEST, MOST, NgramDrafter
from llm_executorch_mlx.text.sampling import Sampler


def brute_force_draft(ids: list[int], most: int) -> list[int]:
    """What followed the latest earlier occurrence of the longest suffix of
    ``MOST`` down to ``FEWEST`` ids, searched position by position."""
    for n in range(MOST, FEWEST - 1, -1):
        if len(ids) <= n:
            continue
        suffix = ids[-n:]
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start:start + n] == suffix:
                return ids[start + n:start + n + most]
    return []


def test_drafts_are_what_followed_the_longest_suffix_before():
    rng = np.random.default_rng(0)
    for trial in range(200):
        ids = rng.integers(0, 4 + trial % 7, int(rng.integers(1, 60))).tolist()
        drafter = NgramDrafter(ids[:5])
        drafter.extend(ids[5:])
        for most in (1, 3, 8):
            assert drafter.propose(most) == brute_force_draft(ids, most), (ids, most)
    assert NgramDrafter([1, 2, 3]).propose(4) == []  # nothing seen twice


def test_a_speculative_reply_is_transformers_greedy_and_its_cache_continues_the_chat(tiny):
    """A copy-heavy prompt on the tiny model: the reply equals transformers'
    greedy one, most proposals are taken, and the next turn reuses the cache
    exactly as a conversation decoded token by token would."""
    register(tiny)
    prompt = "the cat sat on the mat, the cat sat on the mat"
    _, expected = hf_greedy(tiny, [{"role": "user", "content": prompt}], 30)
    model = llm.get_model("pte:tiny")
    conversation = model.conversation()
    r = conversation.prompt(prompt, max_tokens=30, draft="ngram", draft_tokens=4)
    assert r.text() == expected
    j = r.response_json
    assert j["draft"] == "ngram" and 0 < j["accepted_tokens"] <= j["drafted_tokens"]
    assert j["cache_length"] == r.input_tokens + r.output_tokens - (j["finish_reason"] == "length")
    again = conversation.prompt("And again?", max_tokens=8, draft="ngram")
    text = again.text()
    assert again.response_json["cache_path"] == "hit"
    store.POOL.clear()
    cold = model.conversation()
    cold.prompt(prompt, max_tokens=30).text()
    store.POOL.clear()
    assert cold.prompt("And again?", max_tokens=8).text() == text


@pytest.mark.parametrize("top_k", [0, 2])
def test_verifying_a_proposal_keeps_the_sampled_distribution(top_k):
    """Whatever token is proposed, the token chosen is distributed as
    sampling without a proposal would be: the proposal taken with its
    probability, else a draw from the rest (proposed token 3 lies outside the
    top 2, so it is never taken there)."""
    logits = np.array([1.0, 0.2, -0.5, 0.9, 0.0], np.float32)
    sampler = Sampler(temperature=0.8, top_k=top_k, seed=7)
    draws = 4000
    chosen = [sampler.verify(mx.array(logits), [], 3) for _ in range(draws)]
    counts = np.bincount(np.array(mx.stack(chosen)), minlength=logits.size)
    scaled = logits / 0.8
    if top_k:
        scaled = np.where(scaled >= np.sort(scaled)[-top_k], scaled, -np.inf)
    p = np.exp(scaled - scaled.max())
    p /= p.sum()
    spread = np.sqrt(p * (1 - p) / draws)
    assert np.all(np.abs(counts / draws - p) <= 4 * spread + 1e-9), (counts / draws, p)


def test_greedy_verification_takes_the_argmax():
    sampler = Sampler(temperature=0)
    logits = mx.array([0.1, 2.0, 0.3])
    assert [sampler.verify(logits, [], d).item() for d in (0, 1, 2)] == [1, 1, 1]
