"""A helped decode step alone and beside another thread's MLX work.

The extension's helped submission (``submit_helping``/``wait_helping``,
``runtime/cpu/gemv.cpp``) paces itself on its own graph; MLX's own
``async_eval`` counts queued tasks across every thread's streams, so a busy
neighbour thread (here: long chains of small ops on its own stream) stalled a
step by two orders of magnitude before that (4.5 s against 51 ms). This
times a step shaped like a decode step in small (per layer an up product, an
element-wise op, a down product and a residual add) both ways and reports
``busy / alone`` per repetition as ``median [min–max]``. Nothing here asserts
a speed; ``tests/test_cpu_gemv.py`` checks the results are right meanwhile.

    python benchmarks/bench_neighbour.py --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from harness import cli
from harness.report import fmt, ratio_spread, table


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=20, help="up/down pairs in the step (default: 20)")
    p.add_argument("--hidden", type=int, default=576, help="the step's row width (default: 576)")
    p.add_argument("--inner", type=int, default=1536, help="the up products' width (default: 1536)")
    p.add_argument("--steps", type=int, default=5, help="steps per timing, the median kept (default: 5)")
    cli.add_reps(p, 5, "alone/busy pairs")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    import mlx.core as mx
    import numpy as np

    from llm_executorch_mlx.runtime import cpu

    kernels = cpu.kernels(build=True)
    if not kernels.products.on:
        raise SystemExit(f"the extension's products are not in use here: {kernels.products.why}")
    kernel = kernels.extension
    rng = np.random.default_rng(0)
    ups = [mx.array(rng.standard_normal((args.inner, args.hidden)).astype(np.float32) * args.hidden**-0.5)
           for _ in range(args.layers)]
    downs = [mx.array(rng.standard_normal((args.hidden, args.inner)).astype(np.float32) * args.inner**-0.5)
             for _ in range(args.layers)]
    mx.eval(ups, downs)
    x = mx.array(rng.standard_normal((1, 1, args.hidden)).astype(np.float32))

    def step_seconds() -> float:
        times = []
        for _ in range(args.steps):
            h = x
            for up, down in zip(ups, downs):
                h = h + kernel.gemv(mx.tanh(kernel.gemv(h, up.T)), down.T)
            t = time.perf_counter()
            kernel.submit_helping([h])
            kernel.wait_helping(h)
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    def busy_seconds() -> float:
        stop, started = threading.Event(), threading.Event()

        def neighbour():
            while not stop.is_set():
                y = mx.zeros((64,))
                for _ in range(3000):
                    y = y + 1
                started.set()
                mx.eval(y)

        thread = threading.Thread(target=neighbour)
        thread.start()
        try:
            started.wait()
            return step_seconds()
        finally:
            stop.set()
            thread.join()

    step_seconds()  # warm-up
    alone, busy = [], []
    for _ in range(args.reps):
        alone.append(step_seconds())
        busy.append(busy_seconds())
    print("\n".join(table(
        ["step", "alone (ms)", "beside a busy thread (ms)", "busy / alone"],
        [[f"{args.layers} layers, {args.hidden}x{args.inner}", f"{1e3 * statistics.median(alone):.2f}",
          f"{1e3 * statistics.median(busy):.2f}", fmt(ratio_spread(busy, alone), "{:.2f}")]],
    )))


if __name__ == "__main__":
    main()
