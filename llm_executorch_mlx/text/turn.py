"""One chat turn: history to ids, cache reuse, generation, stops, stats.

Knows nothing of llm's objects: the plugin hands in role/content messages
and options, iterates the text, then reads ``Turn.result``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import mlx.core as mx

from ..runtime import load_program
from .conversation import encode_conversation
from .detokenize import StreamDecoder
from .errors import TextError
from .generate import Timings, generate_tokens
from .sampling import Sampler
from .session import CachePolicy, SessionPool
from .stops import StopMatcher
from .templates import resolve_template
from .tokenizer import load_tokenizer

POOL = SessionPool()
_programs: dict = {}
_tokenizers: dict = {}
# Per loaded program: assistant text -> the ids generated for it, so a later
# turn can splice them in instead of re-tokenizing (bounded, oldest dropped).
_generated: dict = {}
MAX_REMEMBERED_REPLIES = 256
REPETITION_CONTEXT = 64  # ids the repetition penalty looks back over
# Per (loaded program, capacity): the oldest messages truncation cut from conversations.
_truncations: dict = {}


def _signature(messages: list[dict]) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in messages]


def _file_key(path: str):
    st = os.stat(path)
    return (os.path.abspath(path), st.st_mtime_ns, st.st_size)


def get_program(path: str, compute: str = "auto"):
    """The loaded program for ``path``, reused while the file is unchanged."""
    key = _file_key(path) + (compute,)
    if key not in _programs:
        for old in [k for k in _programs if k[0] == key[0]]:
            # the file changed: free the old program and all that refers to it
            del _programs[old]
            POOL.drop(old)
            _generated.pop(old, None)
            for cut_key in [c for c in _truncations if c[0] == old]:
                del _truncations[cut_key]
        program = load_program(path, compute=compute)
        program.prepare_cpu_kernels()  # builds them at the first generation, before a method loads
        _programs[key] = program
    return key, _programs[key]


def get_tokenizer(path: str):
    key = _file_key(path)
    if key not in _tokenizers:
        _tokenizers[key] = load_tokenizer(path)
    return _tokenizers[key]


@dataclass
class TurnOptions:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    chat: str = "auto"
    kv_max_capacity: int | None = None
    kv_storage_dtype: str | None = None
    kv_initial_capacity: int | None = None
    kv_windows: str | None = None
    kv_overflow: str = "truncate"
    compute_dtype: str = "auto"


@dataclass
class TurnResult:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str = "length"
    cache_path: str = "cold"
    stats: dict = field(default_factory=dict)


class Turn:
    """Iterate to stream text; ``result`` is complete once iteration ends."""

    def __init__(self, pte_path: str, tokenizer_path: str, messages: list[dict], opts: TurnOptions, notice=None):
        for what, path in (("model", pte_path), ("tokenizer", tokenizer_path)):
            if not os.path.isfile(path):
                raise TextError(f"the {what} file {path} is missing: re-register the model")
        self.key, self.program = get_program(pte_path, opts.compute_dtype)
        self.tokenizer = get_tokenizer(tokenizer_path)
        self.template = resolve_template(opts.chat, self.tokenizer)
        self.opts = opts
        self.notice = notice or (lambda msg: print(msg, file=sys.stderr))
        self.result = TurnResult()
        meta = self.program.metadata
        capacity = opts.kv_max_capacity or meta.max_context
        if meta.max_context and capacity > meta.max_context:
            raise TextError(
                f"kv_max_capacity {capacity} exceeds the model's max context {meta.max_context}"
            )
        self.policy = CachePolicy(
            capacity=capacity,
            dtype=opts.kv_storage_dtype or self.program.compute_dtype or "bf16",
            initial_capacity=opts.kv_initial_capacity,
            windows=opts.kv_windows,
        )
        self.sampler = Sampler(
            temperature=opts.temperature, top_p=opts.top_p, top_k=opts.top_k,
            min_p=opts.min_p, repetition_penalty=opts.repetition_penalty, seed=opts.seed,
        )
        self.messages = messages
        self.stop_ids = self._stop_ids()

    def _stop_ids(self) -> set[int]:
        ids = set(self.program.metadata.eos_ids) | set(self.tokenizer.eos_ids or [])
        self.turn_end_id = None
        if self.template.turn_end:
            self.turn_end_id = self.tokenizer.token_to_id(self.template.turn_end)
            if self.turn_end_id is not None:
                ids.add(self.turn_end_id)
        return ids

    def _fit(self, generated) -> list[int]:
        """Ids of the history, dropping the oldest turns if the cache is too small.

        Once a conversation overflows, turns are dropped until it fills at most
        half the cache, and the cut is remembered: later turns of the same
        conversation reuse it while it fits, so their prompt keeps the start
        the cache holds. Dropping one turn at a time would change the prompt's
        start, and cost a full prefill, on every later turn.
        """
        capacity = self.policy.capacity
        messages = list(self.messages)
        self.fitted = messages
        ids = encode_conversation(messages, self.template, self.tokenizer, generated)
        if len(ids) + 1 <= capacity:
            return ids
        if self.opts.kv_overflow == "error":
            raise TextError(
                f"the prompt needs {len(ids)} tokens plus one to generate, but the cache holds "
                f"{capacity}: start a new conversation, raise -o kv_max_capacity, or use "
                "-o kv_overflow truncate"
            )
        first = 1 if messages[0]["role"] == "system" else 0
        cuts = _truncations.setdefault((self.key, capacity), [])
        dropped = 0
        for cut in sorted(cuts, key=len, reverse=True):
            n = len(cut)
            if len(messages) - first > n and _signature(messages[first : first + n]) == cut:
                kept = messages[:first] + messages[first + n :]
                kept_ids = encode_conversation(kept, self.template, self.tokenizer, generated)
                if len(kept_ids) + 1 <= capacity:
                    messages, ids, dropped = kept, kept_ids, n
                    break
        if not dropped:
            while len(ids) + 1 > capacity // 2 and len(messages) - first > 1:
                # drop the oldest whole turn: a user message and the replies after it
                del messages[first]
                dropped += 1
                while len(messages) - first > 1 and messages[first]["role"] != "user":
                    del messages[first]
                    dropped += 1
                ids = encode_conversation(messages, self.template, self.tokenizer, generated)
            cuts.append(_signature(self.messages[first : first + dropped]))
            del cuts[:-MAX_REMEMBERED_REPLIES]
        if len(ids) + 1 > capacity:
            raise TextError(
                f"the prompt needs {len(ids)} tokens plus one to generate, but the cache holds "
                f"{capacity}: shorten it or raise -o kv_max_capacity"
            )
        self.fitted = messages
        self.notice(
            f"[pte] the conversation is too long for the {capacity}-token cache: "
            f"left out its {dropped} oldest messages"
        )
        return ids

    def __iter__(self):
        r = self.result
        generated = _generated.setdefault(self.key, {})
        prompt = self._fit(generated)
        if not prompt:
            raise TextError("the prompt encodes to no tokens: give the model some text")
        decoder = StreamDecoder(self.tokenizer, prefix_ids=prompt[-4:])
        stops = StopMatcher(self.opts.stop)
        session = POOL.acquire(self.key, self.program, self.policy, prompt, self._reply_start(generated))
        path, cached = session.reuse(prompt)
        r.prompt_tokens, r.cached_tokens, r.cache_path = len(prompt), cached, path
        cache = session.cache
        budget = min(self.opts.max_tokens, cache.capacity - len(prompt))
        session.tokens.extend(prompt[cached:])  # prefill writes them all, or resync trims
        timings = Timings()
        produced: list[int] = []
        text_parts: list[str] = []
        stop_string = False
        last_fed = False
        mx.reset_peak_memory()
        try:
            # a narrowed window lowers the cache's max write below the export's chunk
            chunk = cache.max_write or self.program.metadata.prefill_chunk
            steps = generate_tokens(
                session.forward, cache, prompt, cached, chunk,
                self._sample, budget, timings,
            )
            step = None
            r.finish_reason = "capacity" if budget < self.opts.max_tokens else "length"
            for step in steps:
                if step.fed:
                    session.tokens.append(step.token)
                last_fed = step.fed
                if step.token in self.stop_ids:
                    r.finish_reason = "stop"
                    break
                produced.append(step.token)
                emit, stopped = stops.feed(decoder.push(step.token))
                if emit:
                    text_parts.append(emit)
                    yield emit
                if stopped:
                    r.finish_reason, stop_string = "stop", True
                    break
            if not stop_string:  # release text held back for a possible stop
                emit, stop_string = stops.feed(decoder.flush())
                tail_text = emit if stop_string else emit + stops.flush()
                if tail_text:
                    text_parts.append(tail_text)
                    yield tail_text
            if r.finish_reason == "stop" and not stop_string and last_fed and step.token != self.turn_end_id:
                # Only the turn-end token is kept: it closes the assistant turn.
                cache.rewind(cache.length - 1)
                session.tokens.pop()
        finally:
            session.resync()
        if not stop_string:
            generated["".join(text_parts)] = produced
            while len(generated) > MAX_REMEMBERED_REPLIES:
                del generated[next(iter(generated))]
        r.output_tokens = len(produced)
        r.stats = self._stats(timings, session, r)

    def _reply_start(self, generated) -> int | None:
        """Token offset where the prompt's last assistant reply begins."""
        replies = [i for i, m in enumerate(self.fitted) if m["role"] == "assistant"]
        if not replies:
            return None
        before = self.fitted[: replies[-1]]
        return len(encode_conversation(before, self.template, self.tokenizer, generated, False))

    def _sample(self, logits, history: list[int]):
        recent = None
        if self.opts.repetition_penalty != 1.0:
            recent = mx.array(history[-REPETITION_CONTEXT:])
        return self.sampler.sample(logits, recent)

    def _stats(self, t: Timings, session, r: TurnResult) -> dict:
        cache = session.cache
        return {
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "prefilled_tokens": t.prefill_tokens,
            "generated_tokens": r.output_tokens,
            "time_to_first_token_s": round(t.first_token_seconds or 0.0, 4),
            "prefill_tokens_per_s": round(t.prefill_tokens / t.prefill_seconds, 2) if t.prefill_seconds else None,
            "decode_tokens_per_s": round(t.decode_tokens / t.decode_seconds, 2) if t.decode_seconds else None,
            "finish_reason": r.finish_reason,
            "cache_path": r.cache_path,
            "cache_length": cache.length,
            "cache_capacity": cache.capacity,
            "kv_storage_dtype": cache.dtype,
            "kv_windows": [g.window for g in cache.layers],
            "kv_bytes_in_use": cache.bytes_in_use(),
            "kv_bytes_allocated": cache.nbytes,
            "device": mx.default_device().type.name,
            "compute_dtype": self.program.compute_dtype,
            "blas": self.program.cpu_kernels.blas.library,
            "mlx_active_bytes": mx.get_active_memory(),
            "mlx_peak_bytes": mx.get_peak_memory(),
        }
