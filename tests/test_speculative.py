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

from llm_executorch_mlx.runtime import plan as plan_module
from llm_executorch_mlx.text import store
from llm_executorch_mlx.text.drafting import FEWEST, MOST, NgramDrafter
from llm_executorch_mlx.text.sampling import Sampler
from llm_executorch_mlx.text.session import common_prefix


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


def test_a_speculative_reply_is_the_same_with_steps_queued_when_built(tiny, monkeypatch):
    """A GPU's steps are queued as soon as they are built (``steps.ON_BUILD``):
    here on the CPU with that order, the look-ahead step queued before its
    token is read and its proposals' call after it, the reply is still
    transformers' greedy one."""
    real = plan_module.Plan.steps
    monkeypatch.setattr(plan_module.Plan, "steps", property(lambda plan: real.fget(plan)._replace(queue_on_build=True)))
    store.POOL.clear()
    store._programs.clear()
    register(tiny)
    prompt = "the cat sat on the mat, the cat sat on the mat"
    _, expected = hf_greedy(tiny, [{"role": "user", "content": prompt}], 30)
    r = llm.get_model("pte:tiny").conversation().prompt(prompt, max_tokens=30, draft="ngram", draft_tokens=4)
    assert r.text() == expected
    assert 0 < r.response_json["accepted_tokens"] <= r.response_json["drafted_tokens"]
    store.POOL.clear()
    store._programs.clear()


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


# -- a draft model (-o draft MODEL) ----------------------------------------


@pytest.fixture(scope="module")
def draft_pte(exported):
    """Another model of the test tokenizer (qwen3, random weights): its
    proposals are mostly rejected."""
    return exported("qwen3")


def test_a_draft_model_proposes_its_transformers_greedy_continuation(tiny, draft_pte):
    """Proposals are the draft's own greedy continuation (transformers' on
    the draft's weights), after ids that went on past what it proposed, so
    after rewinding its cache."""
    import torch
    import transformers

    from llm_executorch_mlx.text.drafting import ModelDrafter
    from llm_executorch_mlx.text.session import CachePolicy, Session

    model_dir, pte = draft_pte
    _, program = store.get_program(str(pte))
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()

    def greedy(ids, n):
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
        return out[0, len(ids):].tolist()

    ids = np.random.default_rng(1).integers(0, 256, 40).tolist()  # longer than a chunk of 32
    drafter = ModelDrafter(Session(program, CachePolicy(128, "fp32")), ids, 256, 256, 32)
    proposed = drafter.propose(5)
    assert proposed == greedy(ids, 5)
    drafter.extend(proposed[:2] + [(proposed[2] + 1) % 256])  # two kept, the third replaced
    assert drafter.propose(3) == greedy(drafter.ids, 3)
    assert drafter.session.cache.length == len(drafter.ids) + 2
    drafter.extend([7, 8, 9, 10])  # all kept and more, read ahead
    drafter.follow()
    assert drafter.session.cache.length == len(drafter.ids) - 1
    assert drafter.propose(4) == greedy(drafter.ids, 4)
    # an id past the draft's embedding (a target's padding id): it proposes
    # nothing from there on and feeds nothing it cannot read
    held = drafter.session.cache.length
    drafter.extend([5, 256, 6])
    drafter.follow()
    assert drafter.propose(4) == [] and drafter.session.cache.length <= held


def snapshot_of(session):
    """The cache's content, as numpy arrays per layer."""
    floor, layers = session.cache.snapshot()
    return session.cache.length, [(first, np.array(k), np.array(v)) for first, k, v in layers]


@pytest.mark.parametrize("draft_tokens", [1, 3, 7])
def test_replies_drafted_by_a_model_are_transformers_greedy_and_leave_the_cache_as_plain_decoding(
        tiny, draft_pte, draft_tokens, monkeypatch):
    """Whether the draft is the model itself (every proposal taken) or
    another (most rejected), each reply is transformers' greedy one, the
    cache holds what decoding without a draft leaves, and the next turn
    reuses both caches. Every step allowed tries the draft, which costs as
    much as the model here (what tries cost is the budget test's)."""
    from llm_executorch_mlx.text import generate

    monkeypatch.setattr(generate, "worth_trying", lambda *_: True)
    register(tiny)
    _, tok_dir, _ = tiny
    register((tiny[0], tok_dir, None), "itself")
    register((draft_pte[1], tok_dir, None), "other")
    model = llm.get_model("pte:tiny")
    prompts = ["Why is the sky blue?", "Tell me a story about a cat"]
    plain = []
    for prompt in prompts:
        # each turn from its session, none from disk; the cache stored exactly (fp32), so the comparison below
        # holds to fp32 sums in another order, not to fp16's rounding step, which such sums may straddle
        r = model.prompt(prompt, max_tokens=24, kv_disk_mb=0, kv_storage_dtype="fp32")
        r.text()
        (session,) = [s for _, s in store.POOL._sessions.values()]
        plain.append((r.text(), snapshot_of(session)))
        store.POOL.clear()
    for draft in ("itself", "other"):
        for prompt, (text, content) in zip(prompts, plain):
            conversation = model.conversation()
            r = conversation.prompt(prompt, max_tokens=24, draft=draft, draft_tokens=draft_tokens, kv_disk_mb=0,
                                    kv_storage_dtype="fp32")
            assert r.text() == text == hf_greedy(tiny, [{"role": "user", "content": prompt}], 24)[1]
            j = r.response_json
            assert j["draft"] == draft and j["drafted_tokens"] > 0
            if draft == "itself":
                assert j["accepted_tokens"] == j["drafted_tokens"]
            else:  # rejections, and the rewinds past them, happened
                assert j["accepted_tokens"] < j["drafted_tokens"]
            (session,) = [s for _, s in store.POOL._sessions.values()]
            length, layers = snapshot_of(session)
            assert length == content[0]
            for (_, k, v), (_, k0, v0) in zip(layers, content[1]):
                np.testing.assert_allclose(k, k0, atol=1e-5)
                np.testing.assert_allclose(v, v0, atol=1e-5)
            # the draft's cache is the conversation's, but for proposals of its last step
            (drafting,) = [s for _, s in store.DRAFTS._sessions.values()]
            assert drafting.cache.length == len(drafting.tokens)
            assert common_prefix(drafting.tokens, session.tokens) >= len(drafting.tokens) - draft_tokens
            again = conversation.prompt("And again?", max_tokens=6, draft=draft, draft_tokens=draft_tokens,
                                        kv_disk_mb=0, kv_storage_dtype="fp32")
            again.text()
            assert again.response_json["cache_path"] == "hit" and len(store.DRAFTS) == 1
            store.POOL.clear()
            store.DRAFTS.clear()


def test_a_draft_of_another_tokenizer_or_no_model_is_refused_in_one_line(tiny, draft_pte, tmp_path):
    from test_plugin import invoke

    from models import make_tokenizer

    register(tiny)
    foreign = make_tokenizer(tmp_path / "foreign", vocab_size=180)
    r = invoke("pte", "register", str(draft_pte[1]), "--tokenizer", str(foreign), "--name", "foreign")
    assert r.exit_code == 0, r.output
    r = invoke("-m", "pte:tiny", "-o", "draft", "foreign", "hello")
    assert r.exit_code == 1
    assert r.output.strip().splitlines() == [
        "Error: -o draft foreign: its tokenizer is not this model's, so its ids would mean other text: "
        "draft with a model of the same tokenizer, or -o draft ngram"]
    r = invoke("-m", "pte:tiny", "-o", "draft", "nobody", "hello")
    assert r.exit_code == 1
    assert r.output.strip().splitlines() == [
        "Error: -o draft nobody: no registered model has that name; `llm pte models` lists them "
        "(or use -o draft ngram)"]


class Clock:
    """Time that passes only where a test says: a forward call of r rows
    takes ``1 + ROW * (r - 1)`` (one plain step: 1), and whatever a
    drafter adds."""

    ROW = 0.25

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class TimedForward:
    """A forward whose calls take time on ``clock``."""

    def __init__(self, forward, clock: Clock):
        self.forward, self.clock = forward, clock

    def execute(self, inputs, **kwargs):
        self.clock.now += 1 + Clock.ROW * (len(inputs[0][0]) - 1)
        return self.forward.execute(inputs, **kwargs)

    def __getattr__(self, name):
        return getattr(self.forward, name)


class ReplayDrafter:
    """Proposes the plain reply's next ids (``hit``) or ids that differ from
    each (not ``hit``), for ``cost`` a proposed id, as a draft model's steps,
    plus ``read`` for each id seen since it last proposed, as a draft model
    reads them first."""

    free = False

    def __init__(self, ids: list[int], reply: list[int], hit: bool, cost: float, clock: Clock, vocab: int,
                 read: float = 0.0):
        self.ids, self.start, self.reply = list(ids), len(ids), reply
        self.hit, self.cost, self.clock, self.vocab, self.read = hit, cost, clock, vocab, read
        self.seen = len(ids)
        self.asked = 0

    def extend(self, ids):
        self.ids.extend(ids)

    def follow(self):
        pass

    def behind(self):
        return len(self.ids) - self.seen

    def propose(self, most):
        self.asked += 1
        at = len(self.ids) - self.start
        proposed = self.reply[at:at + most]
        self.clock.now += self.cost * len(proposed) + self.read * self.behind()
        self.seen = len(self.ids)
        return proposed if self.hit else [(t + 1) % self.vocab for t in proposed]


@pytest.mark.parametrize("rows_match_steps", [True, False])
def test_proposals_that_miss_cost_at_most_the_budget_and_proposals_that_pay_go_on(tiny, monkeypatch,
                                                                                   rows_match_steps):
    """On a clock where a plain step takes 1 and each proposal a third of a
    step more (a draft model's: SmolLM2-135M's for the 1B shape), a reply whose proposals all miss decodes in at
    most ``BUDGET`` more time than without them (its decoding counted as at
    least ``SHORTEST`` steps), beyond its first try of one proposal, made
    before a plain step is timed; proposals that are all kept go on to the
    end. Where a call's rows may not match one-token steps (a GPU), a token
    sampled on the device keeps its own step, and the first try costs it.
    Proposals that cost more than a step each are not tried again, and a
    draft that proposes nothing is asked again only after backing off. A
    drafter that reads every id it missed before proposing (a draft
    model's catching up, a tenth of a step an id) keeps to the budget too,
    though each try after a longer backoff costs more than the one before."""
    from llm_executorch_mlx.text import generate
    from llm_executorch_mlx.text.session import CachePolicy, Session

    _, program = store.get_program(str(tiny[0]))
    clock = Clock()
    monkeypatch.setattr(generate, "time", clock)
    prompt, tokens, cost, vocab = [5, 6, 7, 8], 5, 1 / 3, program.metadata.vocab_size
    chunk = program.metadata.prefill_chunk
    room = program.metadata.max_context - len(prompt)

    def decode(drafter=None):
        session = Session(program, CachePolicy(program.metadata.max_context, "fp32"))
        sampler, timings = Sampler(temperature=0), generate.Timings()
        speculation = None if drafter is None else generate.Speculation(drafter, tokens, sampler.verify,
                                                                        sampler.sample_next, rows_match_steps)
        steps = generate.generate_tokens(TimedForward(session.forward, clock), session.cache, prompt, 0, chunk,
                                         sampler.sample_next, room, timings, speculation=speculation)
        return [s.token for s in steps], timings

    reply, plain = decode()
    assert len(reply) == room and plain.decode_seconds == room - 1  # one step a token after the first
    for read in (0.0, 0.1):
        ids, missed = decode(ReplayDrafter(prompt, reply, False, cost, clock, vocab, read))
        # tries after the first, which proposes one id, as far as the budget allows
        assert ids == reply and missed.drafted_tokens > 1 and missed.accepted_tokens == 0
        first_try = cost + (Clock.ROW if rows_match_steps else 1)  # one proposal: a row more, or a call more
        allowed = generate.BUDGET * max(missed.decode_seconds, generate.SHORTEST)
        assert missed.decode_seconds - plain.decode_seconds <= allowed + first_try
    kept = ReplayDrafter(prompt, reply, True, cost, clock, vocab)
    ids, drafted = decode(kept)
    # each call keeps its proposals and adds one token: all but the reply's ends come from proposals
    assert ids == reply and drafted.accepted_tokens == drafted.drafted_tokens
    assert drafted.drafted_tokens > (room - 1) * tokens / (tokens + 1) - 2 * tokens
    assert drafted.decode_seconds < plain.decode_seconds
    # a draft with nothing to propose (its cache full, an id past its
    # embedding) is asked again only after backing off, as after a miss
    nothing = ReplayDrafter(prompt, [], True, cost, clock, vocab)
    ids, idle = decode(nothing)
    assert ids == reply and idle.drafted_tokens == 0 and nothing.asked <= generate.MAX_BACKOFF + 2
    # proposals that cost a step each to make cannot pay, kept or not: no try after the first
    for hit in (True, False):
        ids, costly = decode(ReplayDrafter(prompt, reply, hit, 1.5, clock, vocab))
        assert ids == reply and costly.drafted_tokens == 1
