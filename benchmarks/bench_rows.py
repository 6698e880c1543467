"""The extension's few-row product against MLX's matmul (BLAS), per row count.

A chat turn's short chunk multiplies a few rows of activations with every
weight. BLAS's sgemm repacks the whole weight for each call, so a 4-row
product costs it about what a 64-row one does; the extension's GEMV
(``runtime/cpu/gemv.cpp``) reads each weight once as stored, fp32 or bf16
(BLAS then needs the weight widened to fp32 first, as the runtime does for a
long chunk). This times both on the SmolLM2-135M MLP's shapes (a few hundred
MB of weights, more than the caches hold), the GEMV submitted with the host
helping as a step is, and reports ``blas / ours`` per repetition as
``median [min–max]``: above 1, ours is faster. The row count where it falls
below 1 is where ``DENSE_GEMV_ROWS`` (``runtime/interp/ops/nn.py``) belongs.

    python benchmarks/bench_rows.py --reps 5
    python benchmarks/bench_rows.py --dtype bf16
"""

from __future__ import annotations

import argparse
import statistics
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,8,16,24,32", help="row counts, comma-separated (at most 32)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the weights' dtype (default: fp32)")
    p.add_argument("--weights", type=int, default=60, help="[1536, 576] weights per pass (default: 60)")
    p.add_argument("--reps", type=int, default=5, help="repetitions (default: 5)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    import mlx.core as mx

    from llm_executorch_mlx.runtime import cpu

    found = cpu.kernels(build=True)
    if not found.gemv.on:
        raise SystemExit(f"the extension's GEMV is not in use: {found.gemv.why}")
    kernel = found.extension
    dtype = mx.bfloat16 if args.dtype == "bf16" else mx.float32
    weights = [mx.random.normal((1536, 576)).astype(dtype).T for _ in range(args.weights)]
    mx.eval(weights)

    def blas(x, w):
        return x @ (w if w.dtype == mx.float32 else w.astype(mx.float32))

    def timed(product, x) -> float:
        t0 = time.perf_counter()
        outs = [product(x, w) for w in weights]
        kernel.submit_helping(outs)
        kernel.wait_helping(outs[-1])
        mx.eval(outs)
        return time.perf_counter() - t0

    mb = sum(w.nbytes for w in weights) / 1e6
    print(f"{args.weights} weights [1536, 576] {args.dtype}, {mb:.0f} MB a pass; {found.blas.library}")
    print("| rows | BLAS ms | ours ms | BLAS / ours |")
    print("|---|---|---|---|")
    for m in (int(r) for r in args.rows.split(",")):
        x = mx.random.normal((1, m, 576))
        timed(blas, x), timed(kernel.gemv, x)  # warm
        pairs = [(timed(blas, x), timed(kernel.gemv, x)) for _ in range(args.reps)]
        ratios = [b / o for b, o in pairs]
        b, o = (1000 * statistics.median(p[i] for p in pairs) for i in (0, 1))
        print(f"| {m} | {b:.1f} | {o:.1f} | {statistics.median(ratios):.2f} "
              f"[{min(ratios):.2f}–{max(ratios):.2f}] |", flush=True)


if __name__ == "__main__":
    main()
