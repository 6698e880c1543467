"""Fitting a conversation into the cache: the oldest turns left out, and the cut remembered.

Once a conversation overflows, turns are dropped until it fills at most half
the cache, and the cut is remembered: later turns of the same conversation
reuse it while it fits, so their prompt keeps the start the cache holds.
Dropping one turn at a time would change the prompt's start, and cost a full
prefill, on every later turn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .errors import TextError

MAX_REMEMBERED_CUTS = 256  # per program and capacity; the oldest are forgotten


@dataclass(frozen=True)
class Fitted:
    messages: list[dict]  # the messages the prompt holds, oldest first
    ids: list[int]  # their token ids
    dropped: int  # how many of the oldest messages were left out


def _signature(messages: list[dict]) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in messages]


class Truncation:
    """The cuts made so far, per (loaded program, capacity): runs of the oldest messages."""

    def __init__(self):
        self._cuts: dict[tuple, list[list[tuple[str, str]]]] = {}

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
        for cut in sorted(cuts, key=len, reverse=True):
            n = len(cut)
            if len(messages) - first > n and _signature(messages[first : first + n]) == cut:
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
            cuts.append(_signature(messages[first : first + dropped]))
            del cuts[:-MAX_REMEMBERED_CUTS]
        if len(ids) + 1 > capacity:
            raise TextError(
                f"the prompt needs {len(ids)} tokens plus one to generate, but the cache holds "
                f"{capacity}: shorten it or raise -o kv_max_capacity"
            )
        return Fitted(kept, ids, dropped)

    def drop(self, key) -> None:
        """Forget the cuts of one program."""
        for cut_key in [c for c in self._cuts if c[0] == key]:
            del self._cuts[cut_key]

    def clear(self) -> None:
        self._cuts.clear()
