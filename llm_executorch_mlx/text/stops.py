"""Stop strings: end generation where one appears, even across token boundaries."""

from collections.abc import Iterable


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
