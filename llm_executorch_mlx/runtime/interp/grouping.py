"""Load-time grouping of quantized products that read the same ``x``.

A transformer layer multiplies one normalised ``x`` by three quantized
weights (q, k and v) and, later, another by two (gate and up). On the CPU
with the extension's quantized GEMV (``cpu/gemv.cpp``), each product of a
decode step or a short chunk prepares ``x`` for the kernel, posts a job the
host thread helps with, and waits for its last chunk. Grouped, the first
node of the group runs all of them as one op (``quantized_gemvs``): ``x``
prepared once, one job whose chunks cover every product, and fewer MLX
nodes; each later node of the group then only hands on its product, kept in
a scratch slot. A chunk too long for the GEMV (a prefill chunk) runs each
node's own route at its own place, as without grouping.

A node joins the group of an earlier one when it reads the same ``x`` slot
(not written in between), with the same bits, group size and mode, and its
weight, scales and biases are constants (the weight one no chain writes, its
scales and biases at most filled by the init chain), so that they exist when
the first node runs.
"""

from __future__ import annotations

import mlx.core as mx

from ..dtypes import on_cpu
from ..pte.graph import node_name, tensor_fields
from .ops.quant import (
    INTERLEAVED_GEMV_ROWS, QUANTIZED_GEMV_BITS, QUANTIZED_GEMV_GROUPS, QUANTIZED_GEMV_ROWS, build_quantized_matmul,
)
from .ops.shape import text

NODE = "QuantizedMatmulNode"
WINDOW = 12  # nodes after the first a member may be (q, k, v and their views; gate, silu, up)


def _signature(ctx, op):
    """``(x slot, bits, group, interleaved)`` of a node the GEMV may run with
    its weights fixed constants, else None."""
    if not op.transpose or op.biases is None or text(op.mode) != "affine":
        return None
    if op.bits not in QUANTIZED_GEMV_BITS or op.groupSize not in QUANTIZED_GEMV_GROUPS:
        return None
    # constant slots: only the init chain, which runs at load, may write them
    if ctx.fixed_constant(op.w.idx) is None or any(s.idx >= ctx.num_constants for s in (op.scales, op.biases)):
        return None
    return op.x.idx, op.bits, op.groupSize, op.w.idx in ctx.interleaved


def plan_quantized_group(ctx, instructions: list, i: int, taken) -> tuple | None:
    """For a quantized matmul at ``i`` with partners later in the chain:
    ``(first_run, {j: later_run})``; else None. ``taken``: instruction
    indices other plans already replace."""
    kernels = ctx.kernels
    if node_name(instructions[i]) != NODE or kernels is None or not kernels.gemv.on or not on_cpu():
        return None
    try:
        first = instructions[i].op
        signature = _signature(ctx, first)
        if signature is None:
            return None
        members = [i]
        for j in range(i + 1, min(len(instructions), i + 1 + WINDOW)):
            name = node_name(instructions[j])
            if name in ("IfNode", "ScanNode"):
                break
            op = instructions[j].op
            if name == NODE and j not in taken and _signature(ctx, op) == signature:
                members.append(j)
            if signature[0] in tensor_fields(op)[1]:
                break  # x is written: later nodes read another x
    except (AttributeError, TypeError):
        return None  # malformed: each node's own builder reports it
    if len(members) < 2:
        return None
    ops = [instructions[j].op for j in members]
    if len({ctx.fixed_constant(op.w.idx).shape[1] for op in ops}) != 1:
        return None
    return _runs(ctx, members, ops, signature)


def _runs(ctx, members, ops, signature):
    x, bits, group, interleaved = signature
    gemvs = ctx.kernels.extension.quantized_gemvs
    weights = [(op.w.idx, op.scales.idx, op.biases.idx) for op in ops]
    outs = [ctx.out(op.out) for op in ops]
    own = [build_quantized_matmul(op, ctx) for op in ops]  # each node's route when the GEMV does not take x
    stashes = [ctx.scratch_slot() for _ in ops[1:]]

    def first_run(f):
        xs = f[x]
        k = xs.shape[-1]
        most = INTERLEAVED_GEMV_ROWS if interleaved else QUANTIZED_GEMV_ROWS
        fits = (xs.dtype == mx.float32 and xs.size // k <= most and k % (256 // bits) == 0
                and (xs.ndim <= 2 or xs.size // k == xs.shape[-2]))  # rows in the last two axes only
        if fits and all(f[s].dtype == mx.float32 for _, s, _ in weights):
            ys = gemvs(xs, [f[w] for w, _, _ in weights], [f[s] for _, s, _ in weights],
                       [f[b] for _, _, b in weights], group, bits, interleaved=interleaved)
            f[outs[0]] = ys[0]
            for slot, y in zip(stashes, ys[1:]):
                f[slot] = y
            return
        own[0](f)
        for slot in stashes:
            f[slot] = None

    def later_run(n):
        slot, out, run = stashes[n - 1], outs[n], own[n]

        def later(f):
            y = f[slot]
            if y is None:
                run(f)
            else:
                f[out], f[slot] = y, None

        return later

    return first_run, {j: later_run(n) for n, j in enumerate(members) if n}
