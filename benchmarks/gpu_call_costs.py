"""What MLX charges for a call on this device: a custom kernel's launch
against builtin ops, and a call of a few rows against one row.

Three probes, each printed as a table (µs or ms, best or median of a few
passes):

- ``blocks``: a 1B decode step's first block (RMSNorm, then the q, k and v
  products of Llama-3.2-1B's shape), 64 in a chain, each built lazily then
  the chain evaluated: MLX's own ops, the decode-step kernel
  (``runtime/gpu/decode.py``), the kernel traced once under ``mx.compile``,
  and a custom kernel that only copies (what any custom kernel's call
  costs). CUDA only.
- ``rows``: products of one [2048, 2048] weight (bf16, and 4-bit in groups
  of 32), 112 in a chain (a 1B step's), for 1 to 8 rows of ``x``: as one
  product, and as a batch of one-row products (``x`` as ``[M, 1, K]``).
- ``--pte PATH``: a whole forward call of R rows after a 300-token prompt,
  the host's build and submit and the wall time to the result read back,
  median of 20 calls per R (the cache rewound after each); and the first
  call of each R alone, which builds what that R needs (on a CUDA GPU the
  custom kernels MLX compiles once a process).

A verifying call of speculative decoding is a call of a few rows; a decode
step is a call of one.

    python benchmarks/gpu_call_costs.py --pte OUT/model.pte
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time


def chain_costs(f, x0, n: int, reps: int = 6) -> tuple[float, float]:
    """(build, evaluate) seconds per call of ``f`` in a chain of ``n`` (each
    call's first output feeds the next), best of ``reps`` after one warmup."""
    import mlx.core as mx

    build = evaluate = float("inf")
    for rep in range(reps + 1):
        mx.synchronize()
        t0 = time.perf_counter()
        x = x0
        for _ in range(n):
            x = f(x)
        t1 = time.perf_counter()
        mx.eval(x)
        t2 = time.perf_counter()
        if rep:
            build, evaluate = min(build, t1 - t0), min(evaluate, t2 - t1)
    return build / n, evaluate / n


def blocks() -> None:
    import mlx.core as mx

    from gpu_decode_kernels import weight
    from llm_executorch_mlx.runtime.gpu import decode
    from llm_executorch_mlx.runtime.gpu.decode import Block, MlxOps

    k, rows = 2048, (2048, 512, 512)
    source = "const int i = threadIdx.x + blockIdx.x * blockDim.x; out0[i] = x[i];"
    copy = mx.fast.cuda_kernel(name="copy_only", input_names=["x"], output_names=["out0"], source=source)
    # the same with the decode kernels' headers as written, comments and all:
    # what a kernel's source size costs a call
    long_header = decode._COMMON + decode._DENSE + decode._QUANTIZED
    copy_long = mx.fast.cuda_kernel(name="copy_long", input_names=["x"], output_names=["out0"], source=source,
                                    header=long_header)
    print("| weights | route | build µs | evaluate µs |\n|---|---|---|---|")
    for label, bits in (("bf16", 0), ("4-bit g32", 4)):
        keys = mx.random.split(mx.random.key(0), 4)
        block = Block(tuple(weight(n, k, mx.bfloat16, bits, 32, keys[i]) for i, n in enumerate(rows)),
                      (mx.ones((k,), mx.bfloat16), 1e-5))
        kernel = decode.for_device().launcher(block)  # the runtime's route
        routes = {
            "MLX ops": MlxOps().launcher(block),
            "kernel": kernel,
            "kernel under mx.compile": mx.compile(lambda x: kernel(x)),
            "a custom kernel that copies": lambda x: [copy(inputs=[x], output_shapes=[x.shape],
                                                           output_dtypes=[x.dtype], grid=(k, 1, 1),
                                                           threadgroup=(256, 1, 1))[0]],
            f"the same, its source {len(long_header) // 1024} KB longer": lambda x: [copy_long(
                inputs=[x], output_shapes=[x.shape], output_dtypes=[x.dtype], grid=(k, 1, 1),
                threadgroup=(256, 1, 1))[0]],
        }
        x0 = mx.random.normal((1, 1, k)).astype(mx.bfloat16)
        for name, f in routes.items():
            build, evaluate = chain_costs(lambda x: f(x)[0], x0, 64)
            print(f"| {label} | {name} | {build * 1e6:.1f} | {evaluate * 1e6:.1f} |", flush=True)


def rows() -> None:
    import mlx.core as mx

    n = k = 2048
    w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=32, bits=4)
    mx.eval(w, wq, s, b)
    routes = {
        "bf16": lambda x: x @ w.T,
        "bf16, one-row batch": lambda x: (x[:, None, :] @ w.T)[:, 0, :],
        "4-bit": lambda x: mx.quantized_matmul(x, wq, s, b, True, 32, 4),
        "4-bit, one-row batch": lambda x: mx.quantized_matmul(x[:, None, :], wq, s, b, True, 32, 4)[:, 0, :],
    }
    counts = (1, 2, 3, 4, 6, 8)
    print(f"\n| product | {' | '.join(f'{m} rows: build · evaluate µs' for m in counts)} |")
    print("|---|" + "---|" * len(counts))
    for name, f in routes.items():
        cells = []
        for m in counts:
            build, evaluate = chain_costs(f, mx.random.normal((m, k)).astype(mx.bfloat16), 112)
            cells.append(f"{build * 1e6:.1f} · {evaluate * 1e6:.1f}")
        print(f"| {name} | {' | '.join(cells)} |", flush=True)


def calls(pte: pathlib.Path) -> None:
    import numpy as np

    import mlx.core as mx
    from llm_executorch_mlx.runtime import load_program

    program = load_program(pte)
    program.prepare_cpu_kernels()
    cache = program.new_cache(capacity=1024)
    forward = program.load_method("forward", cache=cache)
    prompt = np.arange(300, dtype=np.int64) % 1000 + 100
    step = program.metadata.prefill_chunk or 100
    for lo in range(0, 300, step):
        ids = prompt[lo:lo + step]
        mx.eval(forward.execute([ids[None], np.arange(lo, lo + len(ids), dtype=np.int64)]))
    base = cache.length
    print(f"\n{pte.name}, after {base} tokens, median of 20 calls, ms:\n")
    print("| rows | build | submit | wall, to the result read | first call (builds its kernels) |\n|---|---|---|---|---|")
    for m in (1, 2, 3, 4, 6, 8, 16):
        build, submit, wall, first = [], [], [], None
        for it in range(22):
            cache.rewind(base)
            t0 = time.perf_counter()
            out = forward.execute([np.full((1, m), 200, np.int64), np.arange(base, base + m, dtype=np.int64)])
            t1 = time.perf_counter()
            y = mx.argmax(out[0][0], axis=-1)
            forward.submit(y)
            t2 = time.perf_counter()
            forward.wait(y)
            y.tolist()
            t3 = time.perf_counter()
            if it >= 2:  # the first calls of a row count compile what it needs
                build.append(t1 - t0), submit.append(t2 - t1), wall.append(t3 - t0)
            elif it == 0:
                first = t3 - t0
        print(f"| {m} | {statistics.median(build) * 1e3:.2f} | {statistics.median(submit) * 1e3:.2f} "
              f"| {statistics.median(wall) * 1e3:.2f} | {first * 1e3:.1f} |", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pte", type=pathlib.Path, help="also time whole calls of this program, per row count")
    args = p.parse_args(argv)
    from llm_executorch_mlx.runtime import load_program  # noqa: F401  binds MLX's BLAS first

    import mlx.core as mx

    print(f"# MLX call costs on {mx.default_device()}\n")
    if mx.cuda.is_available():
        blocks()
    else:
        print("(no CUDA GPU: the custom-kernel probe is skipped)")
    if mx.default_device() == mx.gpu:
        rows()
    else:
        print("(no GPU: the products probe is skipped; MLX's CPU products of bf16 are not what a step runs)")
    if args.pte:
        calls(args.pte)


if __name__ == "__main__":
    sys.exit(main())
