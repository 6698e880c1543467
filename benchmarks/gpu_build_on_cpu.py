"""A CUDA GPU's decode-step build, timed on the CPU.

The host's share of a GPU decode step starts with our interpreter building
the step's lazy graph (``step_profile.py``'s "build"). This runs that build
where no GPU is: the runtime takes its GPU route (every module sees a GPU,
as ``tests/test_gpu_branches.py`` makes it), with the decode-step kernels
and the cache's kernel (``runtime/gpu/``), each custom CUDA kernel standing
in as one MLX op of its output's shape (garbage values: only the build is
timed; MLX's own call of a custom kernel, which builds and hashes its
source, is not in it). It prints the mean build time of a step (one token,
or ``--rows``: a speculative try's verifying call) after the compiled runs
are traced (``interp/compiled_runs.py``), how many compiled calls a step
made, and what the first steps' builds cost (the recording and the trace
included). Run it with ``LLM_PTE_COMPILED_STEPS=0`` to compare with every
op built from Python.

    python benchmarks/gpu_build_on_cpu.py --pte model.pte [--rows 6]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import mlx.core as mx
import numpy as np

from llm_executorch_mlx.runtime import dtypes, load_program
from llm_executorch_mlx.runtime.gpu import attention, decode
from llm_executorch_mlx.runtime.interp import compiled_runs
from llm_executorch_mlx.text import generate


class StandInKernel:
    """``mx.fast.cuda_kernel``'s object: each output one op of its shape."""

    def __init__(self, **kernel):
        self.kernel = kernel

    def __call__(self, inputs, output_shapes, output_dtypes, **launch):
        first = inputs[0].reshape(-1)[:1]
        return [mx.broadcast_to(first.astype(dtype), shape) for shape, dtype in zip(output_shapes, output_dtypes)]


def see_a_cuda_gpu() -> None:
    """Every loaded module of the runtime sees a GPU with the CUDA kernels."""
    real = dtypes.on_cpu
    for name, module in list(sys.modules.items()):
        if name.startswith("llm_executorch_mlx") and getattr(module, "on_cpu", None) is real:
            module.on_cpu = lambda: False
    mx.fast.cuda_kernel = StandInKernel
    decode.for_device = lambda: decode.CudaKernels(False)  # the default route: a few rows on the FMA kernels


# prompt tokens a call: as many as the decode-step kernels take, so they
# stand in for the prompt's products too (MLX's CPU ops would compute them,
# slowly, in bf16)
PROMPT_CALL = attention.MOST_ROWS


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pte", type=pathlib.Path, required=True)
    p.add_argument("--prompt-tokens", type=int, default=16, help="prompt length (default: 16)")
    p.add_argument("--steps", type=int, default=50, help="steps timed (default: 50)")
    p.add_argument("--rows", type=int, default=1,
                   help="tokens a step (default: 1; more: a speculative try's verifying call)")
    args = p.parse_args(argv)
    see_a_cuda_gpu()
    program = load_program(args.pte, compute="auto")
    rows = args.rows
    cache = program.new_cache(capacity=args.prompt_tokens + (args.steps + 4) * rows + 8)
    forward = program.load_method("forward", cache=cache)
    n = args.prompt_tokens
    generate.prefill(forward, cache, list(range(5, n + 5)), 0, PROMPT_CALL)
    mx.eval(cache.state)  # the last call's logits are not needed
    token = mx.array([[7] * rows], dtype=mx.uint32)
    at = lambda i: np.arange(n + i * rows, n + (i + 1) * rows)  # noqa: E731
    first = []  # the first step, the recording, the trace, one replay: each one's build
    for i in range(4):
        start = time.perf_counter()
        out = forward.execute([token, at(i)])
        first.append(time.perf_counter() - start)
        mx.eval(out)
    calls = 0
    replay = compiled_runs._Run.call

    def counted(self, *args):
        nonlocal calls
        calls += 1
        return replay(self, *args)

    compiled_runs._Run.call = counted
    build = 0.0
    for i in range(args.steps):
        start = time.perf_counter()
        out = forward.execute([token, at(4 + i)])
        build += time.perf_counter() - start
        mx.eval(out)
    print(f"{args.pte.name}: {rows} rows, build {1e3 * build / args.steps:.3f} ms a step, "
          f"{calls / args.steps:.0f} compiled calls a step ({len(forward.op_names)} instructions); "
          f"the first four steps' builds (plain, recording, trace, replay): "
          f"{', '.join(f'{1e3 * t:.1f}' for t in first)} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
