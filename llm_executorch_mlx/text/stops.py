"""Where a reply ends: at a stop token, or where a stop string appears (even across tokens)."""

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class StopTokens:
    ids: frozenset[int]  # ids that end a reply
    turn_end: int | None  # the one that closes an assistant turn, if the template has one


def stop_tokens(model_eos_ids: Iterable[int], tokenizer, turn_end: str | None) -> StopTokens:
    """The model's and the tokenizer's end-of-sequence ids, plus the template's turn end (``turn_end``: its text)."""
    turn_end_id = tokenizer.token_to_id(turn_end) if turn_end else None
    ids = set(model_eos_ids) | set(tokenizer.eos_ids or [])
    if turn_end_id is not None:
        ids.add(turn_end_id)
    return StopTokens(frozenset(ids), turn_end_id)


class StopMatcher:
    """Filters streamed text, holding back what could be the start of a stop string.

    Generation stops at the first point in the stream where a stop string is
    complete; the text before that occurrence is emitted, nothing after it.
    """

    def __init__(self, stop_strings: Iterable[str] = ()):
        self._stops = tuple(dict.fromkeys(stop_strings))
        if any(not isinstance(s, str) or not s for s in self._stops):
            raise ValueError("stop strings must be non-empty strings")
        self._held = ""
        self._stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        """Add streamed text; return (text safe to show, whether a stop string was hit)."""
        if self._stopped:
            return "", True
        buffer = self._held + text
        # The stop completed earliest wins, so any chunking of the stream gives one answer.
        hits = [(i + len(s), i) for s in self._stops if (i := buffer.find(s)) >= 0]
        if hits:
            self._held, self._stopped = "", True
            return buffer[: min(hits)[1]], True
        cut = self._hold_from(buffer)
        self._held = buffer[cut:]
        return buffer[:cut], False

    def flush(self) -> str:
        """Release held text at the end of generation."""
        held, self._held = self._held, ""
        return held

    def _hold_from(self, buffer: str) -> int:
        # Where the longest tail of buffer that begins some stop string starts.
        longest = max((len(s) for s in self._stops), default=1)
        for start in range(max(0, len(buffer) - longest + 1), len(buffer)):
            tail = buffer[start:]
            if any(s.startswith(tail) for s in self._stops):
                return start
        return len(buffer)
