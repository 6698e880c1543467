"""Choosing the next token from logits: greedy, or seeded sampling with filters."""

import math
import secrets
from collections.abc import Sequence

import mlx.core as mx

REPETITION_CONTEXT = 64  # ids the repetition penalty looks back over


class Sampler:
    """Picks token ids from logits; one seeded random stream for its lifetime.

    Order, as in transformers: repetition penalty, temperature, top-k, top-p, min-p.
    Temperature 0 is greedy argmax (the penalty still applies).
    """

    def __init__(
        self,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
    ):
        if not (isinstance(temperature, (int, float)) and 0 <= temperature < math.inf):
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature!r}")
        if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 disables), got {top_p!r}")
        if not (isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 disables), got {top_k!r}")
        if not (isinstance(min_p, (int, float)) and 0 <= min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1] (0 disables), got {min_p!r}")
        if not (isinstance(repetition_penalty, (int, float)) and 0 < repetition_penalty < math.inf):
            raise ValueError(
                f"repetition_penalty must be > 0 (1 disables), got {repetition_penalty!r}"
            )
        if seed is not None and not (isinstance(seed, int) and 0 <= seed < 2**64):
            raise ValueError(f"seed must be an integer in [0, 2**64) or None, got {seed!r}")
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.top_k = top_k
        self.min_p = float(min_p)
        self.repetition_penalty = float(repetition_penalty)
        self._key = mx.random.key(secrets.randbits(63) if seed is None else seed)

    def sample(self, logits: mx.array, recent: mx.array | Sequence[int] | None = None) -> mx.array:
        """The next token id, as an unevaluated scalar array.

        ``logits``: shape [vocab]. ``recent``: the ids (array or list) the
        repetition penalty applies to.
        """
        logits = self.process(logits, recent)
        if self.temperature == 0:
            return mx.argmax(logits)
        self._key, key = mx.random.split(self._key)
        return mx.random.categorical(logits, key=key)

    def sample_next(self, logits: mx.array, history: list[int]) -> mx.array:
        """The token after ``history`` (all ids so far), which the penalty sees the
        last ``REPETITION_CONTEXT`` of."""
        recent = None
        if self.repetition_penalty != 1.0:
            recent = mx.array(history[-REPETITION_CONTEXT:])
        return self.sample(logits, recent)

    def process(self, logits: mx.array, recent: mx.array | Sequence[int] | None = None) -> mx.array:
        """The logits ``sample`` draws from: penalized, divided by the temperature
        and filtered, excluded tokens at -inf. Greedy: only penalized."""
        if logits.ndim != 1:
            raise ValueError(f"logits must have shape [vocab], got {tuple(logits.shape)}")
        logits = logits.astype(mx.float32)
        if self.repetition_penalty != 1.0 and recent is not None:
            recent = mx.array(recent).reshape(-1).astype(mx.int32)
            if recent.size > 0:
                logits = self._penalize(logits, recent)
        if self.temperature == 0:
            return logits
        logits = logits / self.temperature
        if 0 < self.top_k < logits.size:
            kth = mx.topk(logits, self.top_k).min()
            logits = mx.where(logits < kth, -mx.inf, logits)
        if self.top_p < 1.0:
            logits = _top_p(logits, self.top_p)
        if self.min_p > 0.0:
            # Drop tokens less likely than min_p times the likeliest one.
            logits = mx.where(logits < logits.max() + math.log(self.min_p), -mx.inf, logits)
        return logits

    def _penalize(self, logits: mx.array, recent: mx.array) -> mx.array:
        # As transformers' RepetitionPenaltyLogitsProcessor: each seen token gets
        # less likely, its logit divided by the penalty if positive, multiplied if negative.
        seen = mx.zeros(logits.shape, dtype=mx.bool_)
        seen[recent] = True
        p = self.repetition_penalty
        return mx.where(seen, mx.where(logits < 0, logits * p, logits / p), logits)


def _top_p(logits: mx.array, top_p: float) -> mx.array:
    # Keep the smallest set of likeliest tokens whose probability reaches top_p:
    # in ascending order, those whose cumulative probability exceeds 1 - top_p.
    order = mx.argsort(logits)
    cumulative = mx.cumsum(mx.softmax(logits[order]))
    keep_sorted = cumulative > 1 - top_p
    keep_sorted[-1] = True  # the likeliest token always survives rounding
    keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
    return mx.where(keep, logits, -mx.inf)
