"""Choosing the next token from logits: greedy, or seeded sampling with filters."""

import math
import secrets
from collections.abc import Sequence

import mlx.core as mx

from ..options import DEFAULTS, OPTIONS, REPETITION_CONTEXT


class Sampler:
    """Picks token ids from logits; one seeded random stream for its lifetime.

    Order, as in transformers: repetition penalty, temperature, top-k, top-p, min-p.
    Temperature 0 is greedy argmax (the penalty still applies). The arguments
    are the prompt options of the same names (options.py): their defaults and
    their checks.
    """

    def __init__(
        self,
        temperature: float = DEFAULTS["temperature"],
        top_p: float = DEFAULTS["top_p"],
        top_k: int = DEFAULTS["top_k"],
        min_p: float = DEFAULTS["min_p"],
        repetition_penalty: float = DEFAULTS["repetition_penalty"],
        seed: int | None = DEFAULTS["seed"],
    ):
        given = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                     repetition_penalty=repetition_penalty, seed=seed)
        for name, value in given.items():
            OPTIONS[name].check(value)  # a ValueError saying what a valid value is
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

    def verify(self, logits: mx.array, history: list[int], proposed: int) -> mx.array:
        """The token after ``history`` given that a draft proposed ``proposed``
        there, as an unevaluated scalar: ``proposed`` itself when it is
        accepted. Greedy: the argmax, which accepts it only if it is that.
        Sampling: accepted with its probability, else a draw from the rest
        renormalized; a proposal made with certainty (prompt lookup's) then
        leaves the distribution exactly what ``sample_next`` draws from
        (speculative sampling, Leviathan et al. 2023)."""
        recent = mx.array(history[-REPETITION_CONTEXT:]) if self.repetition_penalty != 1.0 else None
        logits = self.process(logits, recent)
        if self.temperature == 0:
            return mx.argmax(logits)
        self._key, accept_key, draw_key = mx.random.split(self._key, 3)
        accepted = mx.random.uniform(key=accept_key) < mx.softmax(logits)[proposed]
        others = mx.where(mx.arange(logits.size) == proposed, -mx.inf, logits)
        return mx.where(accepted, proposed, mx.random.categorical(others, key=draw_key))

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
