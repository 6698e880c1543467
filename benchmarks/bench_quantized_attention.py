"""One decode step's attention over a quantized KV cache: the extension's
``quantized_attention`` (``runtime/cpu/attention.cpp``, dequantizing in
registers) against MLX's ``mx.quantized_matmul`` route (scores, softmax,
values: what mlx-lm runs over its quantized cache), with the extension's
fp16-cache attention beside them. Not a test; prints ms per call, median of
``--reps`` calls, for SmolLM2's attention shape (H 9, H_kv 3, D 64) and a 1B
model's (H 32, H_kv 8, D 64) at S 2048 and 8192, groups of 64.

Ours runs as in a decode step, the host thread helping (submit_helping,
wait_helping); the cache hands both routes slices of larger pools.
``--rotated``: ours reads the cache as stored rotated (as the cache stores
it: the queries' and output's groups go through a Walsh-Hadamard transform);
``--shape`` and ``--S`` pick one shape and lengths.

    python benchmarks/bench_quantized_attention.py --reps 30
    python benchmarks/bench_quantized_attention.py --shape smollm2 --S 2048 --rotated
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from llm_executorch_mlx.runtime.cpu import extension

SHAPES = {"smollm2 (9/3)": (9, 3, 64), "1b (32/8)": (32, 8, 64)}
BITS = ((8, 8), (8, 4), (4, 4))


def ms_per_call(run, reps: int) -> float:
    for _ in range(3):
        run()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def quantized(x, bits, group):
    data, scales, biases = mx.quantize(x, group_size=group, bits=bits)
    return data, scales.astype(mx.float16), biases.astype(mx.float16)


def mlx_route(q, K, V, k_bits, v_bits, group, scale):
    """mlx-lm's quantized_scaled_dot_product_attention for one query, each
    of K and V at its own width."""
    B, H, T, D = q.shape
    H_kv = K[0].shape[1]
    q = (q * scale).reshape(B, H_kv, H // H_kv, T, D)
    K, V = ([mx.expand_dims(a, -3) for a in kv] for kv in (K, V))
    scores = mx.quantized_matmul(q, *K, transpose=True, group_size=group, bits=k_bits)
    p = mx.softmax(scores, axis=-1, precise=True)
    return mx.quantized_matmul(p, *V, transpose=False, group_size=group, bits=v_bits).reshape(B, H, T, D)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--rotated", action="store_true", help="ours over a cache stored rotated")
    parser.add_argument("--shape", choices=[name.split()[0] for name in SHAPES], help="only this shape")
    parser.add_argument("--S", type=int, nargs="+", default=[2048, 8192], help="history lengths")
    args = parser.parse_args()
    ext = extension.build().module
    assert ext is not None, "the CPU extension did not build"

    def helped(make):
        def run():
            out = make()
            ext.submit_helping([out])
            ext.wait_helping(out)
        return run

    def alone(make):
        return lambda: mx.eval(make())

    rng = np.random.default_rng(0)
    columns = ["ours fp16"] + [f"ours {k}/{v}" for k, v in BITS] + [f"mlx qmm {k}/{v}" for k, v in BITS]
    print(f"ms per call, median of {args.reps}; group {args.group}; ours with the host helping"
          + ("; ours rotated" if args.rotated else ""))
    print(f"| shape | S | {' | '.join(columns)} |")
    print("|" + "---|" * (len(columns) + 2))
    with mx.stream(mx.cpu):
        for name, (H, H_kv, D) in SHAPES.items():
            if args.shape and name.split()[0] != args.shape:
                continue
            for S in args.S:
                pools = [mx.array(rng.standard_normal((1, H_kv, S + 64, D)).astype(np.float32)) for _ in range(2)]
                q = mx.array(rng.standard_normal((1, H, 1, D)).astype(np.float32))
                scale = D**-0.5
                k16, v16 = (p.astype(mx.float16) for p in pools)
                cells = [ms_per_call(helped(lambda: ext.attention(q, k16[:, :, :S], v16[:, :, :S], scale, False)),
                                     args.reps)]
                packed = {bits: [quantized(p, bits, args.group) for p in pools] for bits in (4, 8)}
                mx.eval(k16, v16, packed)

                def rows(bits, which):
                    return [a[:, :, :S] for a in packed[bits][which]]

                for k_bits, v_bits in BITS:
                    cells.append(ms_per_call(helped(lambda: ext.quantized_attention(
                        q, *rows(k_bits, 0), *rows(v_bits, 1), scale, False, k_bits, v_bits, args.group,
                        rotated=args.rotated)), args.reps))
                for k_bits, v_bits in BITS:
                    cells.append(ms_per_call(alone(lambda: mlx_route(
                        q, rows(k_bits, 0), rows(v_bits, 1), k_bits, v_bits, args.group, scale)), args.reps))
                print(f"| {name} | {S} | " + " | ".join(f"{c:.3f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
