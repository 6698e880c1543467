"""One reply as streamed text: decoding, stop tokens and stop strings, and the
cache left holding exactly the conversation's ids.

A reply ended by a stop token keeps that token in the cache only when it is
the template's turn end, which closes the assistant turn the next prompt
renders; any other stop token (an end of sequence the next prompt does not
contain) is rewound. An interrupted reply leaves the session in step too.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

from .detokenize import StreamDecoder
from .generate import Timings, generate_tokens
from .stops import StopMatcher, StopTokens


@dataclass
class Reply:
    ids: list[int]  # the ids produced, the stop token left out
    text: str  # all the text streamed
    finish_reason: str  # "stop", "length" (max_tokens) or "capacity" (the cache is full)
    stop_string: bool  # a stop string cut it (then ``ids`` hold more than ``text``)
    timings: Timings


def stream_reply(
    session,
    prompt: list[int],
    cached: int,
    chunk: int,
    sample: Callable,
    max_tokens: int,
    stops: StopTokens,
    matcher: StopMatcher,
    decoder: StreamDecoder,
    constraint=None,
    speculation=None,
) -> Generator[str, None, Reply]:
    """Generate after ``prompt``, of which the session's cache holds ``cached``
    ids; yield the text, return the ``Reply``.

    Args:
        chunk: prefill chunk length.
        sample: a logits row and the ids so far to the next token (mx scalar).
        matcher: the stop strings, fresh for this reply.
        max_tokens: most tokens to generate; the room left in the cache caps it too.
        constraint: what the reply may be (``generate_tokens``), or None.
        speculation: how to draft and verify tokens (``generate_tokens``), or None.
    """
    cache = session.cache
    budget = min(max_tokens, cache.capacity - len(prompt))
    session.tokens.extend(prompt[cached:])  # prefill writes them all, or resync trims
    timings = Timings()
    produced: list[int] = []
    text_parts: list[str] = []
    finish_reason = "capacity" if budget < max_tokens else "length"
    stop_string = False
    yielded: list[int] = []  # every token generated, a stop token included
    try:
        steps = generate_tokens(session.forward, cache, prompt, cached, chunk, sample, budget, timings, constraint,
                                speculation)
        step = None
        for step in steps:
            yielded.append(step.token)
            if step.token in stops.ids:
                finish_reason = "stop"
                break
            produced.append(step.token)
            emit, stopped = matcher.feed(decoder.push(step.token))
            if emit:
                text_parts.append(emit)
                yield emit
            if stopped:
                finish_reason, stop_string = "stop", True
                break
        if not stop_string:  # release text held back for a possible stop
            emit, stop_string = matcher.feed(decoder.flush())
            tail_text = emit if stop_string else emit + matcher.flush()
            if tail_text:
                text_parts.append(tail_text)
                yield tail_text
        through_stop = len(prompt) + len(yielded)
        if finish_reason == "stop" and not stop_string and cache.length >= through_stop:
            # the stop token was fed (and, speculating, maybe proposals after
            # it); only the turn-end token is kept: it closes the assistant turn
            cache.rewind(through_stop - (step.token != stops.turn_end))
    finally:
        # the cache holds the prompt, then the first of the yielded tokens
        # (generate_tokens), which the session records
        del session.tokens[len(prompt):]
        session.tokens.extend(yielded[: max(0, cache.length - len(prompt))])
        session.resync()
    return Reply(produced, "".join(text_parts), finish_reason, stop_string, timings)
