"""The extension's few-row product against MLX's matmul (BLAS), per row count.

A chat turn's short chunk multiplies a few rows of activations with every
weight. BLAS's sgemm repacks the whole weight for each call, so a 4-row
product costs it about what a 64-row one does; the extension's GEMV
(``runtime/cpu/gemv.cpp``) reads each weight once as stored, fp32 or bf16
(BLAS then needs the weight widened to fp32 first, as the runtime does for a
long chunk). This times both on the SmolLM2-135M MLP's shapes (a few hundred
MB of weights, more than the caches hold), the GEMV submitted with the host
helping as a step is, and reports ``blas / ours`` per repetition as
``median [min–max]``: above 1, ours is faster. For bf16 weights the row
count where it falls below 1 is where the extension's ``dense_rows``
(``kernels.h``'s ``Limits``) belongs; for fp32 it depends on the CPU and
the BLAS, and the runtime measures it once per machine
(``runtime/cpu/crossover.py``, shown by ``llm pte info``).

``--dtype bf16`` on a CPU with AVX512_BF16 also times the products with x
rounded to bf16 (``bf16_activations``), ``ours / bf16 x`` their gain.

``--dtype q4`` / ``q8`` times the quantized products (group 32) instead: BLAS
against the extension's dequantized weight (what a long chunk runs), the
quantized GEMV on MLX's layout, on the interleaved one
(``cpu/quantized_interleaved.h``), and the int8-activation products
(``cpu/quantized_int8.h``, the ``int8_activations`` route); the ratios are
``blas / interleaved``, ``stored / interleaved`` and ``interleaved / int8``.
Where the first falls below 1 is where the extension's
``interleaved_rows`` (``kernels.h``'s ``Limits``) belongs. ``--shape 8192x2048 --weights 6``
runs a 1B model's MLP shape (any ``--dtype``).

    python benchmarks/bench_rows.py --reps 5
    python benchmarks/bench_rows.py --dtype bf16
    python benchmarks/bench_rows.py --dtype q4
    LLM_PTE_CPU_VECTORS=avx2 python benchmarks/bench_rows.py --dtype q4 --shape 8192x2048 --weights 6
"""

from __future__ import annotations

import argparse
import statistics
import time

from harness import cli
from harness.report import fmt, ratio_spread, row, table


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,16,32,64,128", help="row counts, comma-separated (at most 128)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "q4", "q8"), default="fp32",
                   help="the weights' dtype (default: fp32)")
    p.add_argument("--weights", type=int, default=60, help="weights per pass (default: 60)")
    p.add_argument("--shape", default="1536x576", help="each weight's [N, K] (default: 1536x576, the 135M MLP's)")
    cli.add_reps(p, 5, "repetitions")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    import mlx.core as mx

    from llm_executorch_mlx.runtime import cpu

    found = cpu.kernels(build=True)
    if not found.products.on:
        raise SystemExit(f"the extension's products are not in use: {found.products.why}")
    kernel = found.extension
    if args.dtype in ("q4", "q8"):
        return quantized(args, kernel, found.blas.library)
    dtype = mx.bfloat16 if args.dtype == "bf16" else mx.float32
    n, k = map(int, args.shape.split("x"))
    weights = [mx.random.normal((n, k)).astype(dtype).T for _ in range(args.weights)]
    mx.eval(weights)

    def blas(x, w):
        return x @ (w if w.dtype == mx.float32 else w.astype(mx.float32))

    def timed(product, x) -> float:
        return helped_pass(kernel, product, x, weights)

    # bf16 weights where the build has bf16 dot products: also x rounded to bf16 (bf16_activations)
    rounded = args.dtype == "bf16" and kernel.limits()["bf16_dot"]
    routes = [blas, kernel.gemv] + ([lambda x, w: kernel.gemv(x, w, bf16_x=True)] if rounded else [])
    mb = sum(w.nbytes for w in weights) / 1e6
    print(f"{args.weights} weights [{n}, {k}] {args.dtype}, {mb:.0f} MB a pass; {found.blas.library}")
    extra = ["bf16 x ms", "ours / bf16 x"] if rounded else []
    print("\n".join(table(["rows", "BLAS ms", "ours ms", "BLAS / ours"] + extra)))
    for m in (int(r) for r in args.rows.split(",")):
        x = mx.random.normal((1, m, k))
        for route in routes:
            timed(route, x)  # warm
        runs = [[timed(route, x) for route in routes] for _ in range(args.reps)]
        b, o, *r = ([t[i] for t in runs] for i in range(len(routes)))
        cells = [m, f"{1000 * statistics.median(b):.1f}", f"{1000 * statistics.median(o):.1f}",
                 fmt(ratio_spread(b, o), "{:.2f}")]
        if rounded:
            cells += [f"{1000 * statistics.median(r[0]):.1f}", fmt(ratio_spread(o, r[0]), "{:.2f}")]
        print(row(cells), flush=True)


def helped_pass(kernel, product, x, weights) -> float:
    """Seconds for ``product(x, w)`` of every weight, submitted with the host
    helping as a decode step is."""
    import mlx.core as mx

    t0 = time.perf_counter()
    outs = [product(x, w) for w in weights]
    kernel.submit_helping(outs)
    kernel.wait_helping(outs[-1])
    mx.eval(outs)
    return time.perf_counter() - t0


def quantized(args, kernel, library: str) -> None:
    import mlx.core as mx

    bits, group = int(args.dtype[1]), 32
    if not kernel.limits()["interleave_lanes"]:
        raise SystemExit("this build of the extension has no interleaved layout (no integer dot products)")
    n, k = map(int, args.shape.split("x"))
    stored = [mx.quantize(mx.random.normal((n, k)), group_size=group, bits=bits) for _ in range(args.weights)]
    interleaved = [tuple(kernel.interleave_quantized(*q, group, bits)) for q in stored]
    int8 = [tuple(kernel.interleave_quantized(*q, group, bits, int8=True)) for q in stored]
    mx.eval(stored, interleaved, int8)
    routes = {
        "blas": (stored, lambda x, q: x @ kernel.dequantize(*q, group, bits).T),
        "stored": (stored, lambda x, q: kernel.quantized_gemv(x, *q, group, bits)),
        "interleaved": (interleaved, lambda x, q: kernel.quantized_gemv(x, *q, group, bits, interleaved=True)),
        "int8": (int8, lambda x, q: kernel.quantized_gemv(x, *q, group, bits, int8=True)),
    }

    def timed(route, x) -> float:
        weights, product = routes[route]
        return helped_pass(kernel, product, x, weights)

    mb = sum(a.nbytes for q in stored for a in q) / 1e6
    print(f"{args.weights} weights [{n}, {k}] {bits}-bit, group {group}, {mb:.0f} MB a pass; {library}")
    print("\n".join(table(["rows", "BLAS ms", "stored ms", "interleaved ms", "int8 ms", "BLAS / interleaved",
                           "stored / interleaved", "interleaved / int8"])))
    for m in (int(r) for r in args.rows.split(",")):
        x = mx.random.normal((1, m, k))
        wanted = [r for r in routes if r != "stored" or m <= 16]  # the stored layout's GEMV takes 16 rows
        for r in wanted:
            timed(r, x)  # warm
        times = [{r: timed(r, x) for r in wanted} for _ in range(args.reps)]
        ms = {r: 1000 * statistics.median(t[r] for t in times) for r in wanted}

        def ratio(a, b="interleaved"):
            if a not in ms:
                return "–"
            return fmt(ratio_spread([t[a] for t in times], [t[b] for t in times]), "{:.2f}")

        print(row([m, f"{ms['blas']:.1f}", f"{ms.get('stored', float('nan')):.1f}", f"{ms['interleaved']:.1f}",
                   f"{ms['int8']:.1f}", ratio("blas"), ratio("stored"), ratio("interleaved", "int8")]), flush=True)


if __name__ == "__main__":
    main()
