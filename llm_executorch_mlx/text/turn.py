"""One chat turn: the history to a prompt that fits, the session that holds
most of it, the streamed reply, and what the turn reports.

Knows nothing of llm's objects: the plugin hands in role/content messages
and options, iterates the text, then reads ``Turn.result``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, make_dataclass

import mlx.core as mx

from ..options import OPTIONS
from . import store
from .conversation import encode_conversation, reply_start
from .detokenize import StreamDecoder
from .errors import TextError
from .sampling import Sampler
from .session import CachePolicy
from .stats import turn_stats
from .stops import StopMatcher, stop_tokens
from .streaming import stream_reply
from .templates import resolve_template

# The options of one turn: a field per declared option, with its declared default.
TurnOptions = make_dataclass(
    "TurnOptions", [(o.name, o.type, field(default=o.default)) for o in OPTIONS.values()]
)


@dataclass
class TurnResult:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str = "length"
    cache_path: str = "cold"
    stats: dict = field(default_factory=dict)


def cache_policy(opts: TurnOptions, program) -> CachePolicy:
    """The cache a turn with ``opts`` needs for ``program``."""
    meta = program.metadata
    capacity = opts.kv_max_capacity or meta.max_context
    if meta.max_context and capacity > meta.max_context:
        raise TextError(f"kv_max_capacity {capacity} exceeds the model's max context {meta.max_context}")
    return CachePolicy(
        capacity=capacity,
        dtype=opts.kv_storage_dtype or program.compute_dtype or "bf16",
        initial_capacity=opts.kv_initial_capacity,
        windows=opts.kv_windows,
    )


class Turn:
    """Iterate to stream text; ``result`` is complete once iteration ends."""

    def __init__(self, pte_path: str, tokenizer_path: str, messages: list[dict], opts: TurnOptions, notice=None):
        for what, path in (("model", pte_path), ("tokenizer", tokenizer_path)):
            if not os.path.isfile(path):
                raise TextError(f"the {what} file {path} is missing: re-register the model")
        self.key, self.program = store.get_program(pte_path, opts.compute_dtype)
        self.tokenizer = store.get_tokenizer(tokenizer_path)
        self.template = resolve_template(opts.chat, self.tokenizer)
        self.opts = opts
        self.notice = notice or (lambda msg: print(msg, file=sys.stderr))
        self.result = TurnResult()
        self.policy = cache_policy(opts, self.program)
        self.sampler = Sampler(
            temperature=opts.temperature, top_p=opts.top_p, top_k=opts.top_k,
            min_p=opts.min_p, repetition_penalty=opts.repetition_penalty, seed=opts.seed,
        )
        self.messages = messages
        self.stops = stop_tokens(self.program.metadata.eos_ids, self.tokenizer, self.template.turn_end)

    def __iter__(self):
        generated = store.REPLIES.of(self.key)

        def encode(messages):
            return encode_conversation(messages, self.template, self.tokenizer, generated)

        capacity = self.policy.capacity
        fitted = store.TRUNCATIONS.fit(self.key, self.messages, encode, capacity, self.opts.kv_overflow)
        if fitted.dropped:
            self.notice(
                f"[pte] the conversation is too long for the {capacity}-token cache: "
                f"left out its {fitted.dropped} oldest messages"
            )
        prompt = fitted.ids
        if not prompt:
            raise TextError("the prompt encodes to no tokens: give the model some text")
        decoder = StreamDecoder(self.tokenizer, prefix_ids=prompt[-4:])
        matcher = StopMatcher(self.opts.stop)
        start = reply_start(fitted.messages, self.template, self.tokenizer, generated)
        session = store.POOL.acquire(self.key, self.program, self.policy, prompt, start)
        path, cached = session.reuse(prompt)
        mx.reset_peak_memory()
        # a narrowed window lowers the cache's max write below the export's chunk
        chunk = session.cache.max_write or self.program.metadata.prefill_chunk
        reply = yield from stream_reply(
            session, prompt, cached, chunk, self.sampler.sample_next, self.opts.max_tokens,
            self.stops, matcher, decoder,
        )
        if not reply.stop_string:
            store.REPLIES.remember(self.key, reply.text, reply.ids)
        result = TurnResult(
            prompt_tokens=len(prompt), cached_tokens=cached, output_tokens=len(reply.ids),
            finish_reason=reply.finish_reason, cache_path=path,
        )
        result.stats = turn_stats(result, reply.timings, session.cache, self.program)
        self.result = result
