"""One timing of a generation for every engine.

An engine hands over its new tokens as an iterator; prefill tok/s = prompt
tokens / time from the call to the first token on the host, decode tok/s =
(new tokens - 1) / time from the first token to the last. Between two runs
``settle`` lets the machine go quiet.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass
from typing import Iterator

# Seconds between two engines' runs, so thread pools that spin after their work
# (OpenMP's 200 ms block time under MKL, XNNPACK's pthreadpool) have gone quiet
# before the next engine's clock starts.
SETTLE_S = 0.3


@dataclass
class Run:
    """One generation: its throughputs and the tokens it produced."""

    prefill_tps: float
    decode_tps: float
    tokens: list[int]
    plugin_timings: dict | None = None  # ours: the plugin's own Timings


def timed(token_stream: Iterator[int], prompt_len: int, stream=None) -> Run:
    """Drain a token generator, timing its first and last token.

    Waits for ``stream`` (an MLX stream the generator computes on, if any)
    afterwards, so work it queued past its last token cannot spill into the
    next measurement.
    """
    tokens = []
    t0 = time.perf_counter()
    for token in token_stream:
        now = time.perf_counter()
        if not tokens:
            t_first = now
        tokens.append(token)
    if stream is not None:
        import mlx.core as mx

        mx.synchronize(stream)
    return Run(prompt_len / (t_first - t0), (len(tokens) - 1) / (now - t_first), tokens)


def settle() -> None:
    """Free what the last run left and let its thread pools go quiet, so the
    next engine's clock starts on an idle machine."""
    import mlx.core as mx

    mx.clear_cache()
    gc.collect()
    time.sleep(SETTLE_S)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids two token lists share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def rep_entry(runs: dict[str, Run]) -> dict:
    """One repetition's raw numbers: every engine's run, and how many leading
    tokens each shares with ours."""
    entry = {name: {k: v for k, v in asdict(run).items() if v is not None} for name, run in runs.items()}
    entry["same_tokens"] = {
        name: common_prefix(runs["ours"].tokens, run.tokens) for name, run in runs.items() if name != "ours"
    }
    return entry
