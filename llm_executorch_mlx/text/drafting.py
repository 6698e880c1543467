"""Prompt lookup: draft tokens for speculative decoding from the conversation itself.

Where the reply copies from what came before (editing code, answering from a
pasted document, reformatting), the tokens after its last few also followed
the same few tokens earlier on. ``NgramDrafter`` proposes them: the
continuation of the latest earlier occurrence of the longest suffix of
``MOST``..``FEWEST`` ids, as llama.cpp's and vLLM's prompt lookup do. It
needs no second model, and costs a dictionary update per token.
"""

from __future__ import annotations

MOST, FEWEST = 4, 2  # suffix lengths looked up, longest first; one id matches too often to be worth a draft


class NgramDrafter:
    """Proposals from the ids seen so far (prompt and reply)."""

    def __init__(self, ids: list[int]):
        self.ids: list[int] = []
        self._ends: dict[tuple[int, ...], int] = {}  # an n-gram -> where its latest occurrence ends
        self.extend(ids)

    def extend(self, ids: list[int]) -> None:
        """Append ``ids``; each n-gram that now ends before the last id is
        indexed at its latest end."""
        seen = self.ids
        for token in ids:
            seen.append(token)
            end = len(seen) - 1  # the n-grams ending just before the new id
            for n in range(FEWEST, MOST + 1):
                if end >= n:
                    self._ends[tuple(seen[end - n:end])] = end

    def propose(self, most: int) -> list[int]:
        """Up to ``most`` ids that followed the longest suffix's latest
        earlier occurrence; [] when no suffix occurred before."""
        seen = self.ids
        if most <= 0:
            return []
        for n in range(MOST, FEWEST - 1, -1):
            if len(seen) <= n:
                continue
            end = self._ends.get(tuple(seen[-n:]))  # indexed only once an id followed it: an earlier one
            if end is not None:
                return seen[end:end + most]
        return []
