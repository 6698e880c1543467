"""Conversation sessions: one off-graph cache each, and the ids it holds.

A turn renders the whole history to ids and reuses the longest prefix the
session's cache already holds: ``hit`` (the cache is a prefix of the prompt),
``trim`` (rewound to the divergence point), ``reset`` (a ring layer had
already dropped that point, so the cache is cleared) or ``cold`` (a new
session). Only the remaining tail is prefilled.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_MAX_SESSIONS = 4


@dataclass(frozen=True)
class CachePolicy:
    """The runtime cache choices; changing any of them needs a new cache."""

    capacity: int
    dtype: str
    initial_capacity: int | None = None
    windows: str | None = None
    value_dtype: str | None = None  # None: dtype


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Session:
    """One cache and the exact ids it holds."""

    def __init__(self, program, policy: CachePolicy):
        self.policy = policy
        self.cache = program.new_cache(
            capacity=policy.capacity,
            dtype=policy.dtype,
            initial_capacity=policy.initial_capacity,
            windows=policy.windows,
            value_dtype=policy.value_dtype,
        )
        self.forward = program.load_method("forward", cache=self.cache)
        self.tokens: list[int] = []
        self.last_used = time.monotonic()

    def reuse(self, prompt: list[int]) -> tuple[str, int]:
        """Position the cache for ``prompt``; return (path, tokens reused).

        At least one prompt token is always left to feed, since the next
        token's logits come from feeding it.
        """
        self.last_used = time.monotonic()
        if not self.tokens:
            return "cold", 0
        n = min(common_prefix(self.tokens, prompt), len(prompt) - 1)
        if n == len(self.tokens):
            return "hit", n
        if n > 0 and self.cache.rewind(n):
            del self.tokens[n:]
            return "trim", n
        self.cache.clear()
        self.tokens.clear()
        return "reset", 0

    def resync(self) -> None:
        """Make the cache hold exactly ``tokens`` again (after an interruption)."""
        if self.cache.length > len(self.tokens):
            if not self.cache.rewind(len(self.tokens)):
                self.cache.clear()
                self.tokens.clear()
        else:
            del self.tokens[self.cache.length :]


class SessionPool:
    """The live sessions of one process, least recently used dropped first."""

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS):
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[int, tuple[object, Session]] = OrderedDict()

    def acquire(self, key, program, policy: CachePolicy, prompt: list[int], reply_start: int | None) -> Session:
        """The session that holds the most of ``prompt``, or a new one.

        A session belongs to this prompt's conversation when its whole history
        is a prefix of the prompt (the next turn), when the prompt is a prefix
        of it (a regenerated turn), or when they part at or after
        ``reply_start``, where the prompt's last assistant reply begins (that
        reply re-tokenized differently, or the last user turn edited). A
        prompt sharing less (say, only a system prompt) gets a session of its
        own, so interleaved conversations keep their caches; when the pool is
        full, the least recently used session is dropped for it.
        """
        best, best_n = None, 0
        for sid, (k, s) in self._sessions.items():
            if k != key or s.policy != policy:
                continue
            n = common_prefix(s.tokens, prompt)
            if n and n >= best_n:  # ties go to the most recently used
                best, best_n = sid, n
        if best is not None:
            s = self._sessions[best][1]
            same = (
                best_n == len(s.tokens)
                or best_n >= len(prompt) - 1
                or (reply_start is not None and best_n >= reply_start)
            )
            if same:
                self._sessions.move_to_end(best)
                return s
        while len(self._sessions) >= self.max_sessions:
            self._sessions.popitem(last=False)
        session = Session(program, policy)
        self._sessions[id(session)] = (key, session)
        return session

    def held(self, key, policy: CachePolicy, prompt: list[int]) -> int:
        """The most of ``prompt`` one live session holds (its common prefix)."""
        return max((common_prefix(s.tokens, prompt) for k, s in self._sessions.values()
                    if k == key and s.policy == policy), default=0)

    def adopt(self, key, session: Session) -> None:
        """Add a session made elsewhere (loaded from disk), as the most recently used."""
        while len(self._sessions) >= self.max_sessions:
            self._sessions.popitem(last=False)
        self._sessions[id(session)] = (key, session)

    def drop(self, key) -> None:
        """Free every session of one program."""
        for sid in [sid for sid, (k, _) in self._sessions.items() if k == key]:
            del self._sessions[sid]

    def clear(self) -> None:
        self._sessions.clear()

    def __len__(self) -> int:
        return len(self._sessions)
