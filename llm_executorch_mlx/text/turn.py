"""One chat turn: the history to a prompt that fits, the session that holds
most of it, the streamed reply, and what the turn reports.

Knows nothing of llm's objects: the plugin hands in role/content messages
and options, iterates the text, then reads ``Turn.result``.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field, make_dataclass

import mlx.core as mx

from ..options import OPTIONS
from . import store
from .conversation import assistant_message, calls_as_text, encode_conversation, message_key, reply_start
from .detokenize import StreamDecoder
from .drafting import ModelDrafter, NgramDrafter
from .generate import Speculation
from .errors import TextError
from .reasoning import opens_reasoning, think_tags, thinking_context
from .reply_parts import ReplySplitter, split_reply
from .sampling import Sampler
from .saved_states import StateDirError, StateStore, model_identity, worth_loading
from .session import CachePolicy, Session
from .stats import turn_stats
from .stops import StopMatcher, stop_tokens
from .streaming import stream_reply
from .templates import resolve_template
from .tool_calls import forced_tools, tool_format

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
    cache_path: str = "cold"  # cold, hit, trim, reset, or disk (loaded from a saved state)
    stats: dict = field(default_factory=dict)


def draft_policy(policy: CachePolicy, program) -> CachePolicy:
    """The cache a draft model (``-o draft MODEL``) keeps beside a target's
    cache of ``policy``: as long, as far as the draft's context allows, in
    its own default storage."""
    meta = program.metadata
    return CachePolicy(capacity=min(policy.capacity, meta.max_context or policy.capacity),
                       dtype=program.kv_dtype)


def cache_policy(opts: TurnOptions, program) -> CachePolicy:
    """The cache a turn with ``opts`` needs for ``program``."""
    meta = program.metadata
    capacity = opts.kv_max_capacity or meta.max_context
    if meta.max_context and capacity > meta.max_context:
        raise TextError(f"kv_max_capacity {capacity} exceeds the model's max context {meta.max_context}")
    return CachePolicy(
        capacity=capacity,
        dtype=opts.kv_storage_dtype or program.kv_dtype,
        initial_capacity=opts.kv_initial_capacity,
        windows=opts.kv_windows,
        value_dtype=opts.kv_value_dtype,
    )


class Turn:
    """Iterate to stream text (``events`` to have it split into reasoning, answer
    and tool calls); ``result`` is complete once iteration ends."""

    def __init__(self, pte_path: str, tokenizer_path: str, messages: list[dict], opts: TurnOptions, notice=None,
                 state_dir=None, schema: dict | None = None, tools: list[dict] | None = None,
                 draft_model: tuple[str, str] | None = None):
        """``state_dir``: where cache states are saved between processes (None: nowhere);
        ``schema``: a JSON schema the reply must be a document of (constrained.py);
        ``tools``: the tools offered, as chat templates take them (tool_calls.tool_definitions);
        ``draft_model``: the (.pte, tokenizer) files of the model ``opts.draft`` names."""
        for what, path in (("model", pte_path), ("tokenizer", tokenizer_path)):
            if not os.path.isfile(path):
                raise TextError(f"the {what} file {path} is missing: re-register the model")
        if (draft_model is None) != (opts.draft in ("none", "ngram")):
            raise ValueError(f"-o draft {opts.draft} needs the files of that model, and only it does")
        self.key, self.program = store.get_program(pte_path, opts.compute_dtype, opts.int8_activations,
                                                   opts.bf16_activations)
        self.tokenizer = store.get_tokenizer(tokenizer_path)
        template = resolve_template(opts.chat, self.tokenizer)
        self.tool_format = tool_format(template.source) if tools else None
        context = thinking_context(template.source, opts.reasoning)
        if tools:
            context.update(self.tool_format.template_context(tools))
        self.template = template.bound(**context)
        self.think = think_tags(template.source)
        # the reply starts inside the reasoning when the generation prompt opened it
        self.in_reasoning = bool(self.think) and bool(messages) and opens_reasoning(
            self.template.render(messages), self.think)
        self.parts = None  # a ReplyParts once ``events`` runs
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
        self.constraint = self._constraint(schema, forced_tools(opts.tool_choice, tools, messages))
        self.disk = (StateStore(state_dir, int(opts.kv_disk_mb * 2**20), self.notice)
                     if state_dir is not None and opts.kv_disk_mb else None)
        self.draft = None if draft_model is None else self._draft(*draft_model)

    def _draft(self, pte_path: str, tokenizer_path: str) -> tuple:
        """(key, program) of the draft model, refused where its tokenizer is
        not this model's."""
        name = self.opts.draft
        for what, path in (("model", pte_path), ("tokenizer", tokenizer_path)):
            if not os.path.isfile(path):
                raise TextError(f"the draft's {what} file {path} is missing: re-register {name}")
        key, program = store.get_program(pte_path, self.opts.compute_dtype, self.opts.int8_activations,
                                         self.opts.bf16_activations)
        if store.get_tokenizer(tokenizer_path).vocabulary != self.tokenizer.vocabulary:
            raise TextError(f"-o draft {name}: its tokenizer is not this model's, so its ids would mean "
                            "other text: draft with a model of the same tokenizer, or -o draft ngram")
        return key, program

    def _constraint(self, schema: dict | None, forced: list[dict] | None):
        """The reply's schema, or the call it is forced to make, as a token mask;
        None without either."""
        if schema is not None and self.opts.tool_choice != "auto":
            raise TextError("-o tool_choice cannot be used with a schema: the reply is either a document or a call")
        if schema is None and forced is None:
            return None
        what = "a schema" if forced is None else f"-o tool_choice {self.opts.tool_choice}"
        if self.opts.stop:
            raise TextError(f"-o stop cannot be used with {what}: a stop string would cut the JSON")
        if forced is not None and self.in_reasoning:
            raise TextError(f"-o tool_choice {self.opts.tool_choice} cannot force a call inside the reasoning "
                            "the template opens: add -o reasoning false")
        from .constrained import Constraint  # llguidance: loaded for a schema or a forced call only

        n_vocab = self.program.metadata.vocab_size or self.tokenizer.vocab_size
        call = None if forced is None else (self.tool_format, forced)
        return Constraint(schema, self.tokenizer, n_vocab, self.stops.ids, call=call)

    def _speculation(self, session, prompt: list[int], start: int | None, chunk: int) -> Speculation | None:
        """How ``-o draft`` speculates in this turn, or None: not under a
        constraint (its mask follows each token in turn), nor with a forward
        that returns one position's logits only, nor with one-token calls.
        ``start``: where the prompt's last reply begins (``SessionPool.acquire``)."""
        if self.opts.draft == "none" or self.constraint is not None or session.forward.n_inputs != 2 or chunk < 2:
            return None
        if self.draft is None:
            drafter = NgramDrafter(prompt)
        else:  # the draft's session that holds the most of this conversation (store.DRAFTS)
            key, program = self.draft
            own = store.DRAFTS.acquire(key, program, draft_policy(self.policy, program), prompt, start)
            drafter = ModelDrafter(own, prompt, self.program.metadata.vocab_size or self.tokenizer.vocab_size,
                                   program.metadata.vocab_size or self.tokenizer.vocab_size,
                                   own.cache.max_write or program.metadata.prefill_chunk)
        return Speculation(drafter, min(self.opts.draft_tokens, chunk - 1), self.sampler.verify,
                           self.sampler.sample_next, self.program.plan.rows_match_steps)

    def _disk_key(self) -> tuple[dict, dict]:
        """The model identity and cache policy a saved state must match."""
        policy = {
            "capacity": self.policy.capacity, "dtype": self.policy.dtype,
            "value_dtype": self.policy.value_dtype or self.policy.dtype,
            "windows": [g.window for g in self.program.cache_geometry(self.policy.windows)],
            "compute": self.program.compute_dtype, "device": mx.default_device().type.name,
            # the rounding routes change the cached keys and values
            "int8_activations": self.opts.int8_activations, "bf16_activations": self.opts.bf16_activations,
        }
        return model_identity(self.program.path), policy

    def _load_saved(self, states, prompt: list[int], relist) -> tuple[int, float]:
        """Load the saved state that gives the most of ``prompt``, when that is
        worth more than what a live session holds (``worth_loading``), as a
        new session of the pool; return (tokens loaded, seconds reading and
        restoring it). When a state vanishes meanwhile (another process saved
        the conversation further and dropped it), the states are listed
        again, once."""
        held = store.POOL.held(self.key, self.policy, prompt)
        session, seconds = None, 0.0
        for _ in range(2):
            vanished = False
            for state, n in sorted(((s, s.usable(prompt)) for s in states), key=lambda sn: -sn[1]):
                if not worth_loading(n, held):
                    break
                session = session or Session(self.program, self.policy)  # the first one loads the weights
                t0 = time.perf_counter()
                done = self.disk.load(state, n, session.cache)
                seconds += time.perf_counter() - t0
                if done:
                    session.tokens = list(prompt[:n])
                    store.POOL.adopt(self.key, session)
                    return n, seconds
                vanished = vanished or done is None
            if not vanished:
                break
            states = relist()
        return 0, seconds

    def events(self):
        """The reply as ("reasoning" | "text", text) events; then
        ``parts.calls`` holds the tool calls it made."""
        splitter = ReplySplitter(self.think, self.in_reasoning, self.tool_format)
        self.parts = splitter.parts
        for text in self:
            yield from splitter.feed(text)
        yield from splitter.finish()

    def _history(self, generated: dict[str, list[int]]) -> list[dict]:
        """The messages as the template takes them: where it renders no tool
        calls (SmolLM3's), a turn that called goes back as the text it wrote."""
        fmt = self.tool_format
        if fmt is None and any(m.get("tool_calls") for m in self.messages):  # called before, no tools now
            try:
                fmt = tool_format(self.template.source)
            except TextError:
                fmt = None
        if fmt is None or not fmt.calls_in_content:
            return self.messages
        return calls_as_text(self.messages, fmt, self.think, self.tokenizer, generated)

    def _reply_key(self, text: str) -> str:
        """What llm will hand this reply back as, as ``message_key`` reads it."""
        if not self.think and self.tool_format is None:
            return text
        parts = split_reply(text, self.think, self.in_reasoning, self.tool_format)
        return message_key(assistant_message(parts.content, parts.reasoning, parts.calls))

    def __iter__(self):
        generated = store.REPLIES.of(self.key)
        states = []
        if self.disk:
            identity, disk_policy = self._disk_key()
            states = self.disk.states(identity, disk_policy)
            for state in states:  # replies generated in other processes, spliced as their ids
                for text, ids in state.replies:
                    generated.setdefault(text, ids)
                if state.cut:  # and their cuts, so an overflowing history is cut the same way
                    store.TRUNCATIONS.remember(self.key, self.policy.capacity, state.cut)

        def encode(messages):
            return encode_conversation(messages, self.template, self.tokenizer, generated)

        capacity = self.policy.capacity
        fitted = store.TRUNCATIONS.fit(self.key, self._history(generated), encode, capacity, self.opts.kv_overflow)
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
        loaded, load_s = (self._load_saved(states, prompt, lambda: self.disk.states(identity, disk_policy))
                          if states else (0, 0.0))
        session = store.POOL.acquire(self.key, self.program, self.policy, prompt, start)
        path, cached = session.reuse(prompt)
        if loaded and path == "hit" and cached == loaded:
            path = "disk"
        mx.reset_peak_memory()
        # a narrowed window lowers the cache's max write below the export's chunk
        chunk = session.cache.max_write or self.program.metadata.prefill_chunk
        speculation = self._speculation(session, prompt, start, chunk)
        reply = yield from stream_reply(
            session, prompt, cached, chunk, self.sampler.sample_next, self.opts.max_tokens,
            self.stops, matcher, decoder, self.constraint, speculation,
        )
        if self.constraint is not None and not self.constraint.complete:
            raise TextError(_cut_document(reply.finish_reason, self.opts.max_tokens, self.constraint.what))
        reply_key = None
        if not reply.stop_string:
            reply_key = self._reply_key(reply.text)
            store.REPLIES.remember(self.key, reply_key, reply.ids)
        result = TurnResult(
            prompt_tokens=len(prompt), cached_tokens=cached, output_tokens=len(reply.ids),
            finish_reason=reply.finish_reason, cache_path=path,
        )
        result.stats = turn_stats(result, reply.timings, session.cache, self.program)
        result.stats["draft"] = self.opts.draft if speculation is not None else "none"
        if self.disk:
            result.stats["disk_loaded_tokens"] = loaded if path == "disk" else 0
            result.stats["disk_load_s"] = round(load_s, 4)
            t0 = time.perf_counter()
            keys = [message_key(m) for m in fitted.messages if m["role"] == "assistant"]
            replies = [[key, generated[key]] for key in keys if key in generated]
            if reply_key is not None:
                replies.append([reply_key, reply.ids])
            try:
                saved = self.disk.save(identity, disk_policy, session.cache, session.tokens, replies, fitted.cut)
            except StateDirError as e:  # the states path is a file or cannot be read: the reply stands
                saved = None
                self.notice(f"[pte] could not save the cache state: {e}")
            except OSError as e:  # a full disk or an unwritable user dir: the reply stands
                saved = None
                self.notice(f"[pte] could not save the cache state in {self.disk.directory}: {e.strerror or e}")
            result.stats["disk_save_s"] = round(time.perf_counter() - t0, 4) if saved else None
        self.result = result


def _cut_document(finish_reason: str, max_tokens: int, what: str) -> str:
    """Why a constrained reply ended before its document (or call) closed, and the fix."""
    written = "JSON document" if what == "the schema" else "tool call"
    if finish_reason == "capacity":
        return (f"the cache filled before the reply's {written} was complete: "
                "raise -o kv_max_capacity or start a new conversation")
    return f"max_tokens {max_tokens} ended the reply before its {written} was complete: raise -o max_tokens"
