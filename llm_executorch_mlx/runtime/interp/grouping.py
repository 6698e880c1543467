"""Load-time grouping of products that read the same ``x``.

A transformer layer multiplies one normalised ``x`` by three weights (q, k
and v) and, later, another by two (gate and up). On the CPU with the
extension's GEMV (``cpu/gemv.cpp``), each product of a decode step or a
short chunk posts a job the host thread helps with and waits for its last
chunk (a quantized one also prepares ``x`` for the kernel). Grouped, the
first node of the group runs all of them as one op (``gemvs``,
``quantized_gemvs``): one job whose chunks cover every product, ``x``
prepared once, and fewer MLX nodes; each later node of the group then only
hands on its product, kept in a scratch slot. A chunk too long for the GEMV
(a prefill chunk, except for weights taking int8 activations, whose
products take any number of rows) runs each node's own route at its own
place, as without grouping.

A quantized matmul joins the group of an earlier one when it reads the same
``x`` slot (not written in between), with the same bits, group size and
mode, and its weight, scales and biases are constants (the weight one no
chain writes, its scales and biases at most filled by the init chain), so
that they exist when the first node runs. A dense ``AddmmNode`` (fp32 or
bf16 weights) joins likewise when its ``mat2`` is the transpose of such a
constant, of the first node's dtype.
"""

from __future__ import annotations

import mlx.core as mx

from ..plan import Layout
from ..pte.graph import node_name, tensor_fields
from .ops.nn import build_addmm, dense_rows, few_rows
from .ops.quant import GemvOperands, build_quantized_matmul
from .ops.shape import int_list, text

NODE = "QuantizedMatmulNode"
WINDOW = 12  # nodes after the first a member may be (q, k, v and their views; gate, silu, up)


def _signature(ctx, op):
    """``(x slot, bits, group, layout)`` of a node the products may run with
    its weights fixed constants, else None."""
    if not op.transpose or op.biases is None or text(op.mode) != "affine":
        return None
    if not ctx.plan.takes_quantized(op.bits, op.groupSize):
        return None
    # constant slots: only the init chain, which runs at load, may write them
    if ctx.fixed_constant(op.w.idx) is None or any(s.idx >= ctx.num_constants for s in (op.scales, op.biases)):
        return None
    return op.x.idx, op.bits, op.groupSize, ctx.layouts.get(op.w.idx, Layout.MLX)


def plan_group(ctx, instructions: list, i: int, taken) -> tuple | None:
    """``(kind, first_run, {j: later_run})`` for a product at ``i`` with
    partners later in the chain (``kind`` names the ops: "QuantizedMatmul"
    or "Matmul", then "Group" / "Grouped"); else None."""
    for kind, plan in (("QuantizedMatmul", plan_quantized_group), ("Matmul", plan_dense_group)):
        group = plan(ctx, instructions, i, taken)
        if group is not None:
            return (kind, *group)
    return None


def plan_quantized_group(ctx, instructions: list, i: int, taken) -> tuple | None:
    """For a quantized matmul at ``i`` with partners later in the chain:
    ``(first_run, {j: later_run})``; else None. ``taken``: instruction
    indices other plans already replace."""
    if node_name(instructions[i]) != NODE or ctx.plan.products is None:
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
    x, bits, group, layout = signature
    interleaved, int8 = layout is not Layout.MLX, layout is Layout.INT8
    gemvs = ctx.plan.products.quantized_gemvs
    weights = [(op.w.idx, op.scales.idx, op.biases.idx) for op in ops]
    own = [build_quantized_matmul(op, ctx) for op in ops]  # each node's route when the products do not take x
    operands = [GemvOperands(group, bits, layout) for _ in ops]
    most = ctx.plan.quantized_rows(layout)

    def products(f):
        xs = f[x]
        k = xs.shape[-1]
        fits = (xs.dtype == mx.float32
                and all(c.k(f[w], f[s], f[b]) == k for c, (w, s, b) in zip(operands, weights))
                and xs.size // k <= most and (xs.ndim <= 2 or xs.size // k == xs.shape[-2]))  # rows in the last two axes
        if not fits:
            return None
        return gemvs(xs, [f[w] for w, _, _ in weights], [f[s] for _, s, _ in weights],
                     [f[b] for _, _, b in weights], group, bits, interleaved=interleaved, int8=int8)

    return _group_runs(ctx, members, ops, own, products)


def _group_runs(ctx, members, ops, own, products, biases=None):
    """The runs replacing a group's nodes: the first computes every product
    (``products(f)``, or None where the GEMV does not take this x: each node
    then runs its own route ``own``), each later one hands on its own from a
    scratch slot, plus its bias (a frame slot, or None) if it has one."""
    outs = [ctx.out(op.out) for op in ops]
    biases = biases or [None] * len(ops)
    stashes = [ctx.scratch_slot() for _ in ops[1:]]

    def with_bias(f, n, y):
        return y if biases[n] is None else y + f[biases[n]]

    def first_run(f):
        ys = products(f)
        if ys is None:
            own[0](f)
            for slot in stashes:
                f[slot] = None
            return
        f[outs[0]] = with_bias(f, 0, ys[0])
        for slot, y in zip(stashes, ys[1:]):
            f[slot] = y

    def later_run(n):
        slot, out, run = stashes[n - 1], outs[n], own[n]

        def later(f):
            y = f[slot]
            if y is None:
                run(f)
            else:
                f[out], f[slot] = with_bias(f, n, y), None

        return later

    return first_run, {j: later_run(n) for n, j in enumerate(members) if n}

DENSE_NODE = "AddmmNode"


def plan_dense_group(ctx, instructions: list, i: int, taken) -> tuple | None:
    """As ``plan_quantized_group``, for an ``AddmmNode`` at ``i`` whose
    weight is a constant's transpose (a linear layer's fp32 or bf16 weight)."""
    if node_name(instructions[i]) != DENSE_NODE or ctx.plan.products is None:
        return None
    try:
        first = instructions[i].op
        weight = dense_weight(ctx, instructions, i, first)
        if weight is None:
            return None
        x, members, weights = first.mat1.idx, [i], [weight]
        for j in range(i + 1, min(len(instructions), i + 1 + WINDOW)):
            name = node_name(instructions[j])
            if name in ("IfNode", "ScanNode"):
                break
            op = instructions[j].op
            if name == DENSE_NODE and j not in taken and op.mat1.idx == x:
                w = dense_weight(ctx, instructions, j, op)
                if w is not None and w.dtype == weight.dtype and w.shape[0] == weight.shape[0]:
                    members.append(j)
                    weights.append(w)
            if x in tensor_fields(op)[1]:
                break  # x is written: later nodes read another x
    except (AttributeError, TypeError):
        return None  # malformed: each node's own builder reports it
    if len(members) < 2:
        return None
    return _dense_runs(ctx, members, [instructions[j].op for j in members], weights)


def dense_weight(ctx, instructions, j, op) -> mx.array | None:
    """``op``'s ``mat2`` as the ``[K, N]`` view of a fixed constant, when the
    last node before ``j`` to write it transposes that constant; its bias (if
    any) must be plain (alpha = beta = 1)."""
    if op.bias is not None and (float(op.alpha), float(op.beta)) != (1.0, 1.0):
        return None
    slot = op.mat2.idx
    for k in range(j - 1, -1, -1):
        if slot not in tensor_fields(instructions[k].op)[1]:
            continue
        t = instructions[k].op
        if node_name(instructions[k]) != "TransposeNode" or int_list(t.perm) != [1, 0]:
            return None
        w = ctx.fixed_constant(t.x.idx)
        if w is None or w.ndim != 2 or w.dtype not in (mx.float32, mx.bfloat16):
            return None
        view = w.T  # as build_transpose makes it: a view, made once
        mx.eval(view)
        return view
    return None


def _dense_runs(ctx, members, ops, weights):
    gemvs = ctx.plan.products.gemvs
    most = dense_rows(ctx.plan)
    bf16_x = ctx.plan.rounds_to_bf16 and weights[0].dtype == mx.bfloat16
    x = ops[0].mat1.idx
    own = [build_addmm(op, ctx) for op in ops]  # each node's route when the products do not take x

    def products(f):
        xs = f[x]
        return gemvs(xs, weights, bf16_x=bf16_x) if few_rows(xs, weights[0], most) else None

    return _group_runs(ctx, members, ops, own, products, [ctx.t_opt(op.bias) for op in ops])
