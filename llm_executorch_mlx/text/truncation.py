"""Fitting a conversation into the cache: the oldest turns left out, and the cut remembered.

Once a conversation overflows, turns are dropped until it fills at most half
the cache, and the cut is remembered: later turns of the same conversation
reuse it while it fits, so their prompt keeps the start the cache holds.
Dropping one turn at a time would change the prompt's start, and cost a full
prefill, on every later turn. A cut is the number of messages left out and a
digest of them; a saved cache state records the cut its prompt was made
with, so a later process (``llm -c``) makes the same one (``remember``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass

from .errors import TextError

MAX_REMEMBERED_CUTS = 256  # per program and capacity; the oldest are forgotten


@dataclass(frozen=True)
class Fitted:
    messages: list[dict]  # the messages the prompt holds, oldest first
    ids: list[int]  # their token ids
    dropped: int  # how many of the oldest messages were left out
    cut: tuple[int, str] | None = None  # (dropped, their digest) when some were


def cut_digest(messages: list[dict]) -> str:
    """sha256 of the messages' roles and contents: what identifies a cut."""
    text = json.dumps([(m["role"], m["content"]) for m in messages])
    return hashlib.sha256(text.encode()).hexdigest()


class Truncation:
    """The cuts made so far, per (loaded program, capacity): runs of the oldest
    messages, as (how many, ``cut_digest`` of them)."""

    def __init__(self):
        self._cuts: dict[tuple, list[tuple[int, str]]] = {}

    def remember(self, key, capacity: int, cut: tuple[int, str]) -> None:
        """Add a cut made elsewhere (a saved state's), to be reused while it fits."""
        cuts = self._cuts.setdefault((key, capacity), [])
        if cut not in cuts:
            cuts.append(cut)
            del cuts[:-MAX_REMEMBERED_CUTS]

    def fit(
        self, key, messages: list[dict], encode: Callable[[list[dict]], list[int]], capacity: int, overflow: str
    ) -> Fitted:
        """The messages and ids of the prompt, leaving room to generate one token.

        Args:
            key: the loaded program's key (cuts of one program do not apply to another).
            encode: a conversation to its token ids.
            overflow: "truncate" drops the oldest turns (a system message stays);
                "error" refuses a conversation that does not fit.
        """
        messages = list(messages)
        ids = encode(messages)
        if len(ids) + 1 <= capacity:
            return Fitted(messages, ids, 0)
        if overflow == "error":
            raise TextError(
                f"the prompt needs {len(ids)} tokens plus one to generate, but the cache holds "
                f"{capacity}: start a new conversation, raise -o kv_max_capacity, or use "
                "-o kv_overflow truncate"
            )
        first = 1 if messages[0]["role"] == "system" else 0
        cuts = self._cuts.setdefault((key, capacity), [])
        kept, dropped = messages, 0
        for n, digest in sorted(cuts, reverse=True):
            if len(messages) - first > n and cut_digest(messages[first : first + n]) == digest:
                shorter = messages[:first] + messages[first + n :]
                shorter_ids = encode(shorter)
                if len(shorter_ids) + 1 <= capacity:
                    kept, ids, dropped = shorter, shorter_ids, n
                    break
        if not dropped:
            kept = list(messages)
            while len(ids) + 1 > capacity // 2 and len(kept) - first > 1:
                # drop the oldest whole turn: a user message and the replies after it
                del kept[first]
                dropped += 1
                while len(kept) - first > 1 and kept[first]["role"] != "user":
                    del kept[first]
                    dropped += 1
                ids = encode(kept)
            cuts.append((dropped, cut_digest(messages[first : first + dropped])))
            del cuts[:-MAX_REMEMBERED_CUTS]
        if len(ids) + 1 > capacity:
            raise TextError(
                f"the prompt needs {len(ids)} tokens plus one to generate, but the cache holds "
                f"{capacity}: shorten it or raise -o kv_max_capacity"
            )
        return Fitted(kept, ids, dropped, (dropped, cut_digest(messages[first : first + dropped])) if dropped else None)

    def drop(self, key) -> None:
        """Forget the cuts of one program."""
        for cut_key in [c for c in self._cuts if c[0] == key]:
            del self._cuts[cut_key]

    def clear(self) -> None:
        self._cuts.clear()
