"""Reductions and scans over axes (``x -> out``)."""

from __future__ import annotations

from functools import partial

import mlx.core as mx

from .table import op
from .elementwise import unary

# Nodes whose empty ``axes`` means "reduce every axis".
AXES_REDUCTIONS = {
    "SumNode": mx.sum,
    "MeanNode": mx.mean,
    "ProdNode": mx.prod,
    "MaxNode": mx.max,
    "MinNode": mx.min,
    "MedianNode": mx.median,
    "AnyNode": mx.any,
    "AllNode": mx.all,
}


def _axes(n) -> list[int]:
    return [int(a) for a in n.axes] if n.axes is not None else []


@op(*AXES_REDUCTIONS)
def build_reduction(n, ctx):
    fn = AXES_REDUCTIONS[ctx.current_node]
    return unary(n, ctx, partial(fn, axis=_axes(n) or None, keepdims=bool(n.keepdims)))


@op("VarNode", "StdNode")
def build_var_std(n, ctx):
    fn = mx.var if ctx.current_node == "VarNode" else mx.std
    return unary(
        n, ctx, partial(fn, axis=_axes(n) or None, keepdims=bool(n.keepdims), ddof=n.ddof)
    )


@op("LogSumExpNode")
def build_logsumexp(n, ctx):
    # The C++ runtime passes ``axes`` as is: empty reduces nothing.
    return unary(n, ctx, partial(mx.logsumexp, axis=_axes(n), keepdims=bool(n.keepdims)))


@op("ArgmaxNode", "ArgminNode")
def build_arg_reduction(n, ctx):
    fn = mx.argmax if ctx.current_node == "ArgmaxNode" else mx.argmin
    return unary(n, ctx, partial(fn, axis=n.axis, keepdims=bool(n.keepdims)))


@op("CumsumNode")
def build_cumsum(n, ctx):
    return unary(
        n, ctx,
        partial(mx.cumsum, axis=n.axis, reverse=bool(n.reverse), inclusive=bool(n.inclusive)),
    )


@op("SoftmaxNode")
def build_softmax(n, ctx):
    return unary(n, ctx, partial(mx.softmax, axis=n.axis, precise=bool(n.precise)))
