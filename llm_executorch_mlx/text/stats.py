"""The figures a turn reports (llm's ``response_json``): tokens, speed, cache and memory."""

from __future__ import annotations

import mlx.core as mx

from .generate import Timings


def turn_stats(result, timings: Timings, cache, program) -> dict:
    """Args:
        result: the turn's ``TurnResult``.
        cache: the session's cache after the turn.
    """
    t = timings
    return {
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "prefilled_tokens": t.prefill_tokens,
        "generated_tokens": result.output_tokens,
        "time_to_first_token_s": round(t.first_token_seconds or 0.0, 4),
        "prefill_tokens_per_s": round(t.prefill_tokens / t.prefill_seconds, 2) if t.prefill_seconds else None,
        "decode_tokens_per_s": round(t.decode_tokens / t.decode_seconds, 2) if t.decode_seconds else None,
        "drafted_tokens": t.drafted_tokens,
        "accepted_tokens": t.accepted_tokens,
        "finish_reason": result.finish_reason,
        "cache_path": result.cache_path,
        "cache_length": cache.length,
        "cache_capacity": cache.capacity,
        "kv_storage_dtype": cache.dtype,
        "kv_value_dtype": cache.value_dtype,
        "kv_windows": [g.window for g in cache.layers],
        "kv_bytes_in_use": cache.bytes_in_use(),
        "kv_bytes_allocated": cache.nbytes,
        "device": mx.default_device().type.name,
        "compute_dtype": program.compute_dtype,
        "blas": program.cpu_kernels.blas.library,
        "mlx_active_bytes": mx.get_active_memory(),
        "mlx_peak_bytes": mx.get_peak_memory(),
    }
