"""Control flow (If, Scan) and custom kernels (MetalKernel)."""

from __future__ import annotations

import mlx.core as mx

from ...errors import PteError, UnsupportedNodeError
from .table import op
from .shape import text


@op("IfNode")
def build_if(n, ctx):
    cond = ctx.int_(n.cond)
    then_run, else_run = ctx.chain(n.thenChainIdx), ctx.chain(n.elseChainIdx)

    def run(f):
        (then_run if f[cond] != 0 else else_run)(f)

    return run


@op("ScanNode")
def build_scan(n, ctx):
    """Run the body chain once per step along ``scan_axis``.

    Each step writes slice ``t`` of every ``originals[i]`` to ``sliced[i]``
    and runs the body; the body updates its carry slots in place and writes
    one step of each output, which are stacked along the axis at the end.
    """
    name = ctx.current_node
    originals = [ctx.t(t) for t in n.originals or []]
    sliced = [ctx.out(t) for t in n.sliced or []]
    outputs = [ctx.out(t) for t in n.outputs or []]
    for t in n.carry or []:
        ctx.out(t)  # the body writes them: only check they are writable
    if not originals or len(sliced) != len(originals):
        raise PteError(
            f"{name}: needs as many sliced slots ({len(sliced)}) as originals "
            f"({len(originals)}), at least one"
        )
    body, axis = ctx.chain(n.bodyChainIdx), n.scanAxis
    pairs = list(zip(originals, sliced))

    def run(f):
        steps = f[originals[0]].shape[axis]
        collected = [[] for _ in outputs]
        for t in range(steps):
            for src, dst in pairs:
                f[dst] = mx.take(f[src], t, axis)
            body(f)
            for acc, o in zip(collected, outputs):
                acc.append(f[o])
        for acc, o in zip(collected, outputs):
            f[o] = mx.stack(acc, axis)

    return run


@op("MetalKernelNode")
def build_metal_kernel(n, ctx):
    # ExecuTorch runs these only when built with
    # ET_MLX_ALLOW_CUSTOM_KERNEL_EXECUTION: a program's kernel is arbitrary GPU
    # code. This runtime never runs them, and off Apple GPUs it could not.
    kernel = text(n.name) or "?"
    if mx.metal.is_available():
        raise UnsupportedNodeError(
            f"MetalKernelNode '{kernel}' runs custom Metal code from the program, "
            "which this runtime does not execute (like ExecuTorch's default build)"
        )
    raise UnsupportedNodeError(
        f"MetalKernelNode '{kernel}' runs custom Metal code and needs an Apple GPU; "
        f"this machine runs MLX on {_device_name()}"
    )


def _device_name() -> str:
    device = mx.default_device()
    if device.type == mx.gpu and mx.cuda.is_available():
        return "an NVIDIA GPU (CUDA)"
    return "the GPU" if device.type == mx.gpu else "the CPU"
