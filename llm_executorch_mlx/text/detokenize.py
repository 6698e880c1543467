"""Streaming detokenization: text as tokens arrive, never half a character."""

from collections.abc import Iterable

from .tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Prefix tokens kept as context; one is enough for spacing, a few cover a split character.
_PREFIX_CONTEXT = 4


class StreamDecoder:
    """Turns token ids, pushed one at a time, into the text they complete.

    Each step decodes only a short window: the tokens of the last emitted piece
    (as context, so a tokenizer that drops a sequence's leading space, like
    sentencepiece, drops it from both decodes alike) plus those pushed since.
    Text ending in U+FFFD is held back: the character may still be incomplete.
    """

    def __init__(self, tokenizer: Tokenizer, prefix_ids: Iterable[int] = ()):
        """``prefix_ids``: tokens already shown (e.g. the prompt's last one), decoded
        only as context so the first piece gets its leading space right."""
        self._tokenizer = tokenizer
        self._ids = [int(i) for i in prefix_ids][-_PREFIX_CONTEXT:]
        self._read = len(self._ids)  # ids before this index are context, already shown

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes, possibly empty."""
        self._ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        """Return whatever text is still held back, complete or not."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        context = self._tokenizer.decode(self._ids[: self._read])
        text = self._tokenizer.decode(self._ids)
        if len(text) <= len(context) or (not final and text.endswith(_REPLACEMENT)):
            return ""
        del self._ids[: self._read]
        self._read = len(self._ids)
        return text[len(context) :]
