"""The decode loop: chunked prefill, then one token per step with look-ahead.

``generate_tokens`` yields token ids only; text, stops and stats live a level
up. Each decode step is queued (``forward.submit``: ``mx.async_eval``, on
the CPU with the host thread helping to run the step) before the previous
token is read on the host, so the host waits on the device at most once per
token and builds step N+1's graph while step N runs (as mlx-lm does). Token
ids go to ``forward`` as device arrays and positions as host arrays, so no
step reads a device value it does not need.

Because of the look-ahead, every token yielded after the first has already
been fed to the model (its K/V is in the cache) unless the cache had no
room for it; the first is yielded before its step is queued, so a chat
turn's first token waits for its own prefill only. ``Step.fed`` says which.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import mlx.core as mx
import numpy as np

# a sampled token's dtype (mx.argmax's, mx.random.categorical's): tokens
# known on the host go into a step in it, so a one-token step fed from the
# host shares the compiled runs of one fed a sampled token
# (interp/compiled_runs.py)
TOKEN_IDS = np.uint32


@dataclass
class Step:
    token: int
    fed: bool  # its K/V is in the cache (the next step was queued)


@dataclass
class Timings:
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    first_token_seconds: float | None = None
    drafted_tokens: int = 0  # proposed by the draft (speculative decoding)
    accepted_tokens: int = 0  # of those, kept


def prefill(forward, cache, tokens: list[int], start: int, chunk: int) -> mx.array:
    """Feed ``tokens`` at positions ``start...`` in chunks; return the last
    row of logits (lazy).

    Only the cache is evaluated after a chunk that is not the last: its logits
    are never needed, so the final norm, the last MLP and the LM head of those
    chunks are never computed, and memory stays at one chunk's activations.
    """
    logits = None
    for off in range(0, len(tokens), chunk):
        ids = np.asarray([tokens[off : off + chunk]], dtype=np.int64)
        pos = np.arange(start + off, start + off + ids.shape[1], dtype=np.int64)
        logits = step(forward, ids, pos)
        if off + chunk < len(tokens):
            # queued as a step is, so the host helps with the products it can
            # share (a quantized chunk's, runtime/steps.py)
            state = cache.state
            forward.submit(*state)
            forward.wait(state[-1])
            mx.eval(state)
    return logits


def step(forward, ids, positions) -> mx.array:
    """One forward call; the logits row of its last token (lazy).

    A forward exported in "selected" logits mode takes a third input, the row
    to keep; that is always the last one here.
    """
    inputs = [ids, positions]
    if forward.n_inputs == 3:
        inputs.append(np.array([ids.shape[1] - 1], dtype=np.int64))
    return forward.execute(inputs, last_position_only=True)[0][0, -1]


def generate_tokens(
    forward,
    cache,
    prompt: list[int],
    start: int,
    chunk: int,
    sample: Callable[[mx.array, list[int]], mx.array],
    max_tokens: int,
    timings: Timings,
    constraint=None,
    speculation=None,
) -> Iterator[Step]:
    """Prefill ``prompt[start:]`` (the part the cache does not hold yet), then
    decode up to ``max_tokens`` tokens.

    Args:
        forward: the loaded forward method (bound to ``cache``).
        cache: the off-graph cache, holding ``prompt[:start]``; a token is fed
            only while it has room.
        sample: maps a logits row and all ids so far (the whole prompt, then
            the generated ones) to a token (mx scalar).
        constraint: a ``Constraint`` (constrained.py) or None. It takes
            each token once it is read on the host and masks the logits of
            the next sample: a host array, so no extra device sync.
        speculation: a ``Speculation`` (draft and verify several tokens a
            step, ``speculate``) or None; not with a constraint.

    The first token is read and yielded before the step that feeds it is
    queued (its ``Step.fed`` is False; asking for the next token feeds it):
    queuing a step runs part of it with the host's help, which would delay
    the first token by most of a step. Each later token is yielded after the
    step that feeds it is queued. So the cache holds the prompt, then the
    yielded tokens in order, all but the last one or all of them; if this
    is interrupted it may hold one more (fed, not yet read). The caller
    counts what the cache holds from ``cache.length``.
    """
    t0 = time.perf_counter()
    tail = prompt[start:]
    logits = prefill(forward, cache, tail, start, chunk)
    if speculation is not None:  # a draft model reads the prompt with the model
        speculation.drafter.follow()
    history = list(prompt)
    allowed = (lambda row: row) if constraint is None else constraint.apply
    y = sample(allowed(logits), history)
    forward.submit(y)
    forward.wait(y)
    token = y.item()
    if constraint is not None:
        constraint.advance(token)
    t_first = time.perf_counter()
    timings.prefill_tokens = len(tail)
    timings.prefill_seconds = timings.first_token_seconds = t_first - t0
    yield Step(token, False)
    if max_tokens < 2 or not cache.can_extend(1):
        return
    position = len(prompt)
    logits = step(forward, y.reshape(1, 1), np.array([position], np.int64))
    position += 1
    history.append(token)
    y = sample(allowed(logits), history)
    forward.submit(y)
    if speculation is not None:
        yield from speculate(forward, cache, history, y, position, max_tokens - 1, timings, t_first, speculation)
        return
    for produced in range(2, max_tokens + 1):
        fed = produced < max_tokens and cache.can_extend(1)
        if fed:  # build the step that feeds y before reading y on the host
            logits = step(forward, y.reshape(1, 1), np.array([position], np.int64))
            position += 1
            if forward.queue_on_build:  # a GPU's: it computes the step while y is read and sampled from
                forward.submit(logits)
        forward.wait(y)
        token = y.item()
        if constraint is not None:
            constraint.advance(token)
        timings.decode_tokens = produced - 1
        timings.decode_seconds = time.perf_counter() - t_first
        if fed:
            history.append(token)
            y = sample(allowed(logits), history)
            forward.submit(y)
        yield Step(token, fed)
        if not fed:
            return


MAX_BACKOFF = 6  # after proposals that all missed, up to 2**MAX_BACKOFF steps propose none
BUDGET = 0.03  # the share of decoding's time proposals may cost beyond what they gave,
SHORTEST = 128  # decoding counted as at least this many plain steps, so misses at a reply's start leave it some


def worth_trying(per_step: float | None, free: bool, tried: bool, making: float, spent: float, gave: int,
                 risk: float, elapsed: float) -> bool:
    """Whether a step tries the drafter (``speculate`` names the seconds and
    counts). Before a plain step is timed: a ``free`` one always, another
    once (proposals all kept would never let a plain step be timed). After:
    where what proposals cost beyond the plain steps they saved, and
    ``risk``, what this try costs beyond a plain step if it all misses,
    stay within ``BUDGET`` of the decoding time (at least ``SHORTEST``
    plain steps), and proposals took less than a plain step each to make
    (``making``, the least they took; one that takes more saves less than
    it costs, kept or not)."""
    if per_step is None:
        return free or not tried
    return making < per_step and spent - gave * per_step + risk <= BUDGET * max(elapsed, SHORTEST * per_step)


def miss_risk(missed: float, missed_behind: int, behind: int, per_step: float | None) -> float:
    """What a try costs beyond a plain step if it all misses: what the
    latest try that did cost beyond one (``missed`` seconds, reading
    ``missed_behind`` seen ids first), grown as the ids this one reads
    first (``behind``) outnumber those. A draft model reads every id it
    missed before it proposes, so after a backoff a try costs more than
    the try before it."""
    if per_step is None:
        return 0.0
    return max(0.0, missed - per_step) * max(1.0, (behind + 1) / (missed_behind + 1))


@dataclass
class Speculation:
    """Speculative decoding: ``drafter`` proposes up to ``tokens`` ids a step
    (drafting.py); ``verify(logits, history, proposed)`` and ``sample``
    choose each position's token as ``Sampler.verify`` and ``sample_next``."""

    drafter: object
    tokens: int
    verify: Callable[[mx.array, list[int], int], mx.array]
    sample: Callable[[mx.array, list[int]], mx.array]
    rows_match_steps: bool  # as the program's plan says (plan.py)


def speculate(forward, cache, history: list[int], y: mx.array, position: int, max_tokens: int, timings: Timings,
              t_first: float, speculation: Speculation) -> Iterator[Step]:
    """Up to ``max_tokens`` tokens from ``y`` on (sampled after ``history``,
    queued, not read; its slot ``position``), several a step where the draft
    guesses what follows.

    Once a token is read, the draft proposes what follows it, and the
    logits of the token's step and of the proposals choose the token at
    every position: the proposals up to the first one not chosen are kept,
    the cache rewound past the rest, and the token chosen in its place (or
    after the last, when all were kept) is the next one. Known on the host,
    it goes into the next step with that step's proposals, one call. A token
    sampled on the device (after a step without proposals) has its step
    queued before it is read, as ``generate_tokens``' loop does, so those
    steps cost what they cost without speculation; proposals for it then
    take a call of their own. But where the drafter is not ``free`` (a
    draft model, which always has proposals) and this step will try it, the
    token is read first and fed with them, one call: a whole step saved
    for the look-ahead of one. Not where a call's rows may get other logits
    than one-token steps (``rows_match_steps``, a GPU): there the tokens a
    reply keeps when all proposals miss come from one-token steps, as
    without speculation. The tokens a step may propose grow by one
    after proposals that were all kept (up to ``speculation.tokens``, from
    one for a drafter whose proposals are not ``free``) and
    fall by one after proposals that missed before their last; after
    proposals that all missed, the next 2, 4, ... ``2**MAX_BACKOFF`` steps
    propose none, as after a try of a drafter that is not free which
    proposed nothing. And a step tries the drafter only where ``worth_trying``
    (what proposals cost against the plain steps that would have made the
    tokens they gave, a plain step timed from token to token): so drafts
    that miss cost at most ``BUDGET`` of the decoding time after the first
    try, a draft model's included, which costs a step of its own per token
    proposed, and one that costs a whole step per token is not tried again.
    """
    clock = time.perf_counter
    drafter = speculation.drafter
    drafter.extend(history[len(drafter.ids):])
    produced, misses, idle = 0, 0, 0  # tokens yielded; proposals that all missed, in a row; steps left without
    # tokens the next step may propose: a reply's first proposals are made
    # before the budget can weigh them, so they are one where each costs a step
    most = speculation.tokens if drafter.free else 1
    queued = None  # the logits of the step feeding y, when y is sampled on the device and its step queued
    plain, plain_steps = 0.0, 0  # seconds of the plain steps timed, and how many
    read = None  # when the last token was read, if the step after it is plain
    spent, gave = 0.0, 0  # seconds the steps that verified proposals took, and the tokens they gave
    missed = 0.0  # seconds the latest step whose proposals all missed took (it gave one token)
    missed_behind = 0  # the drafter's behind() at the top of that step
    # the least seconds proposals took to make, per proposal (0 until some
    # were): the least, since a draft model's may include reading what it missed
    making = 0.0
    unpiped = None  # when a step began that feeds a token verified on the host, with no look-ahead
    while True:
        fed = produced + 1 < max_tokens and cache.can_extend(1)  # the next token is fed only if another follows
        per_step = plain / plain_steps if plain_steps else None  # unknown until a plain step follows one
        behind = drafter.behind()  # as counted where the latest miss was (missed_behind)
        trying = fed and not idle and worth_trying(per_step, drafter.free, timings.drafted_tokens > 0, making,
                                                   spent, gave, miss_risk(missed, missed_behind, behind, per_step),
                                                   clock() - t_first)
        # y's step is queued before y is read (the look-ahead) where y was
        # sampled on the device, unless a drafter that is not free tries now:
        # it always proposes, and y is fed with its proposals in one call,
        # where that call's rows get what one-token steps get
        joins = trying and not drafter.free and speculation.rows_match_steps
        ahead = isinstance(y, mx.array) and fed and not joins
        if isinstance(y, mx.array):
            if ahead:
                queued = step(forward, y.reshape(1, 1), np.array([position], np.int64))
                position += 1
                if forward.queue_on_build:
                    forward.submit(queued)
            forward.wait(y)
            y = y.item()
            if read is not None and ahead:  # token to token: all a plain step's host and device work
                plain, plain_steps = plain + clock() - read, plain_steps + 1
            if unpiped is not None:  # a verified token's step without proposals: the look-ahead lost
                spent, gave, unpiped = spent + clock() - unpiped, gave + 1, None
        read = clock()
        token = y
        produced += 1
        timings.decode_tokens += 1
        timings.decode_seconds = time.perf_counter() - t_first
        history.append(token)
        drafter.extend([token])
        if not fed:
            yield Step(token, False)
            return
        room = min(most, max_tokens - produced - 1,
                   cache.capacity - cache.length - (1 if ahead else 2))
        started = clock()
        draft = drafter.propose(room) if trying else []
        if draft:
            each_took = (clock() - started) / len(draft)
            making = min(making, each_took) if making else each_took
        idle = max(0, idle - 1)
        if trying and not draft and not drafter.free:
            # a draft model with nothing to propose (its cache full, an id
            # past its embedding) backs off as after proposals that missed:
            # each try cost the look-ahead of the token it would have joined
            misses += 1
            idle = 2 ** min(misses, MAX_BACKOFF)
        if ahead and not draft:
            y = speculation.sample(queued, history)
            forward.submit(y)
            yield Step(token, True)
            continue
        read = None  # the step after this token verifies proposals
        if ahead and not forward.queue_on_build:  # queued when built otherwise
            # y's step runs first, submitted on its own: in one submission
            # with the proposals' call the two took far longer than apart
            forward.submit(queued)
        # one call: the proposals, after the token itself where it is not fed yet
        ids = draft if ahead else [token, *draft]
        rows = forward.execute([np.asarray([ids], dtype=TOKEN_IDS),
                                np.arange(position, position + len(ids), dtype=np.int64)])[0][0]
        each = ([queued] if ahead else []) + [rows[i] for i in range(len(ids))]
        position += 0 if ahead else 1
        if not draft:
            y = speculation.sample(each[0], history)
            forward.submit(y)
            unpiped = started
            yield Step(token, True)
            continue
        chosen = [speculation.verify(each[i], history + draft[:i], d) for i, d in enumerate(draft)]
        chosen.append(speculation.sample(each[-1], history + draft))
        forward.submit(*chosen)
        forward.wait(chosen[-1])
        chosen = mx.stack(chosen).tolist()
        kept = next((i for i, (d, c) in enumerate(zip(draft, chosen)) if d != c), len(draft))
        took = clock() - started
        spent, gave = spent + took, gave + kept + 1
        missed, missed_behind = (missed, missed_behind) if kept else (took, behind)
        position += kept
        # the kept proposals; a ring layer allows it, since one call writes
        # at most its max write (speculation.tokens + 1)
        if not cache.rewind(position):
            raise RuntimeError(f"the cache cannot rewind to {position} after a speculative step")
        timings.drafted_tokens += len(draft)
        timings.accepted_tokens += kept
        misses = 0 if kept else misses + 1
        idle = 2 ** min(misses, MAX_BACKOFF) if misses else 0
        most = min(speculation.tokens, max(kept + 1, most - 1))
        yield Step(token, True)
        for d in draft[:kept]:
            produced += 1
            timings.decode_tokens += 1
            timings.decode_seconds = time.perf_counter() - t_first
            history.append(d)
            drafter.extend([d])
            yield Step(d, True)
        y = chosen[kept]  # on the host: the next step feeds it with that step's proposals
