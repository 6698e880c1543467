"""Draft tokens for speculative decoding: prompt lookup, or a smaller model.

Where the reply copies from what came before (editing code, answering from a
pasted document, reformatting), the tokens after its last few also followed
the same few tokens earlier on. ``NgramDrafter`` proposes them: the
continuation of the latest earlier occurrence of the longest suffix of
``MOST``..``FEWEST`` ids, as llama.cpp's and vLLM's prompt lookup do. It
needs no second model, and costs a dictionary update per token.
``ModelDrafter`` proposes what a smaller model of the same tokenizer would
say next, which pays on any text the small model guesses well.

Both take the ids seen so far (``extend``), read ahead what they will need
while the model reads the prompt (``follow``), say how many seen ids a
proposal would read first (``behind``) and propose up to a number of ids
(``propose``); ``generate.speculate`` verifies them.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .generate import prefill, step

MOST, FEWEST = 4, 2  # suffix lengths looked up, longest first; one id matches too often to be worth a draft


class NgramDrafter:
    """Proposals from the ids seen so far (prompt and reply)."""

    free = True  # proposals cost no step to make (generate.speculate)

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

    def follow(self) -> None:
        """Nothing to read ahead: ``extend`` indexes each id as it comes."""

    def behind(self) -> int:
        return 0

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


class ModelDrafter:
    """Proposals from a smaller model that shares the target's tokenizer: its
    greedy continuation of the ids seen so far.

    ``session`` is the draft's own (session.py): its cache follows the
    conversation a step behind, since what is seen is fed only when the next
    proposals are asked for, after rewinding past any proposals the target
    did not keep. Greedy proposals are made with certainty, so the target's
    verification keeps its own distribution when sampling (sampling.py).
    """

    free = False  # each proposal costs a step of the draft (generate.speculate)

    def __init__(self, session, ids: list[int], vocab_size: int, readable: int, chunk: int):
        """``vocab_size``: the target's (the ids it can take); ``readable``:
        the draft's own (the ids its embedding has rows for); ``chunk``: the
        draft's prefill chunk."""
        self.session = session
        self.ids = list(ids)
        self.vocab_size = vocab_size
        self.readable = readable
        self.chunk = chunk
        self._read = 0  # ids seen when the draft last read what was seen (at most: the target may drop some)

    def extend(self, ids: list[int]) -> None:
        self.ids.extend(ids)

    def follow(self) -> None:
        """Feed the draft what was seen (the prompt, as the target reads it),
        but for the last id, which the next proposal feeds for its logits."""
        session, cache, forward = self.session, self.session.cache, self.session.forward
        new, held = self._unfed()
        if new is None or len(new) < 2 or not cache.can_extend(len(new)):
            return
        prefill(forward, cache, new[:-1], held, self.chunk)
        state = cache.state
        forward.submit(*state)
        forward.wait(state[-1])
        mx.eval(state)
        session.tokens = self.ids[:-1]
        self._read = len(self.ids) - 1

    def behind(self) -> int:
        """About how many seen ids the next proposal reads first: those
        since it last read (the target's kept proposals aside)."""
        return len(self.ids) - self._read

    def _unfed(self) -> tuple[list[int] | None, int]:
        """(the ids the draft's cache lacks, how many it holds), after
        rewinding past what it fed and the target did not keep; at least
        one id is left to feed. None for the ids where one is past the
        draft's embedding (a padding id of a target with more logits than
        the tokenizer has ids): the draft cannot read on."""
        self.session.resync()  # a proposal interrupted may have fed more than it recorded
        _, held = self.session.reuse(self.ids)
        new = self.ids[held:]
        return (None if max(new) >= self.readable else new), held

    def propose(self, most: int) -> list[int]:
        """Up to ``most`` ids, the draft's greedy choices after ``ids``; []
        where its cache has no room for them."""
        if most <= 0:
            return []
        session, cache, forward = self.session, self.session.cache, self.session.forward
        new, held = self._unfed()
        if new is None or not cache.can_extend(len(new) + most - 1):
            return []
        logits = prefill(forward, cache, new, held, self.chunk)
        drafted = []
        for position in range(len(self.ids), len(self.ids) + most):
            drafted.append(mx.argmax(logits[: self.vocab_size]))  # the target cannot take ids past its own
            forward.submit(drafted[-1])  # runs while the next step is built, which feeds it unread
            if len(drafted) < most:
                logits = step(forward, drafted[-1].reshape(1, 1), np.array([position], np.int64))
        forward.wait(drafted[-1])
        drafted = mx.stack(drafted).tolist()
        session.tokens = self.ids + drafted[:-1]
        self._read = len(self.ids)
        return drafted
