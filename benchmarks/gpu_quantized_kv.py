"""A quantized KV cache on the device MLX computes on (a GPU where MLX has
one): the cache's attention against MLX's own, and its time per decode step.

- **check**: a flat and a sliding-window layer (8 kv heads of 64, 32 query
  heads) fed prefill chunks and single tokens in each storage (int8, int8/int4,
  int4), bf16 and fp32 queries: ``quantized_kv.attention`` over what the
  cache holds, as the plan attends on a GPU (``widened_attention``), against
  ``mx.fast.scaled_dot_product_attention`` over the same history dequantized
  and rotated back in fp32; the worst error as a fraction
  of the output's largest value.
- **time**: one decode step's attention at 2,048 and 8,192 keys, the bf16
  cache's SDPA against each quantized storage (rotations included), median of
  ``--reps`` synchronized calls.

    python benchmarks/gpu_quantized_kv.py [--reps 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from llm_executorch_mlx.runtime.cache import LayerGeometry, SequenceCache
from llm_executorch_mlx.runtime.quantized_kv import QuantizedKV, rotate, widened_attention

H, H_KV, D = 32, 8, 64
STORAGES = (("int8", "int8"), ("int8", "int4"), ("int4", "int4"))


def widened(history):
    """The history in fp32 as attention reads it: dequantized, rotated back."""
    if isinstance(history, QuantizedKV):
        x = history.dequantize(mx.float32)
        return rotate(x, history.group_size) if history.rotated else x
    return history.astype(mx.float32)


def check() -> None:
    steps = [70, 1, 1, 128, 3, 1] + [1] * 10 + [128, 1]
    for keys, values in STORAGES:
        for qdtype in (mx.bfloat16, mx.float32):
            cache = SequenceCache([LayerGeometry(H_KV, D), LayerGeometry(H_KV, D, 96)], 1024, keys, values,
                                  max_write=128)
            worst, position = 0.0, 0
            for i, T in enumerate(steps):
                for layer in range(2):
                    q, k, v = (mx.random.normal((1, n, T, D), key=mx.random.key(100 * i + 10 * layer + j))
                               for j, n in enumerate((H, H_KV, H_KV)))
                    K, V, mask = cache.update_and_fetch(layer, position, k, v)
                    ours = widened_attention(q.astype(qdtype), K, V, 0.125, mask).astype(mx.float32)
                    ref = mx.fast.scaled_dot_product_attention(q.astype(qdtype).astype(mx.float32), widened(K),
                                                               widened(V), scale=0.125, mask=mask)
                    worst = max(worst, (mx.abs(ours - ref).max() / mx.abs(ref).max()).item())
                position += T
            print(f"check {keys}/{values} queries {qdtype}: worst error {worst:.2e} of the output's scale "
                  f"over {position} tokens, flat and window 96")


def median_ms(fn, reps: int) -> float:
    for _ in range(10):
        mx.eval(fn())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def timing(reps: int) -> None:
    for S in (2048, 8192):
        q = mx.random.normal((1, H, 1, D)).astype(mx.bfloat16)
        k, v = (mx.random.normal((1, H_KV, S, D), key=mx.random.key(j)) for j in (1, 2))
        row = {"bf16": median_ms(lambda: mx.fast.scaled_dot_product_attention(
            q, k.astype(mx.bfloat16), v.astype(mx.bfloat16), scale=0.125), reps)}
        for keys, values in STORAGES:
            cache = SequenceCache([LayerGeometry(H_KV, D)], S, keys, values)
            K, V, _ = cache.update_and_fetch(0, 0, k, v)
            mx.eval(K.fields, V.fields)
            row[f"{keys}/{values}"] = median_ms(lambda K=K, V=V: widened_attention(q, K, V, 0.125, None), reps)
        print(f"time {S} keys: " + ", ".join(f"{name} {ms:.3f} ms" for name, ms in row.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args()
    print(f"mlx {mx.__version__} on {mx.default_device()}")
    check()
    timing(args.reps)


if __name__ == "__main__":
    main()
