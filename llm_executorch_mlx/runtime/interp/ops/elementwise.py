"""Elementwise nodes: unary ``x -> out``, binary ``a, b -> out``, and kin."""

from __future__ import annotations

import mlx.core as mx

from ...errors import PteError
from .table import op


def unary(n, ctx, fn):
    """The closure for any ``x -> out`` node computing ``fn(x)``."""
    x, o = ctx.t(n.x), ctx.out(n.out)

    def run(f):
        f[o] = fn(f[x])

    return run


def binary(n, ctx, fn):
    a, b, o = ctx.t(n.a), ctx.t(n.b), ctx.out(n.out)

    def run(f):
        f[o] = fn(f[a], f[b])

    return run


UNARY = {
    "SiluNode": lambda x: x * mx.sigmoid(x),
    "SigmoidNode": mx.sigmoid,
    "TanhNode": mx.tanh,
    "RsqrtNode": mx.rsqrt,
    "LogNode": mx.log,
    "FloorNode": mx.floor,
    "CeilNode": mx.ceil,
    "SquareNode": mx.square,
    "ExpNode": mx.exp,
    "SinNode": mx.sin,
    "CosNode": mx.cos,
    "TanNode": mx.tan,
    "ArcsinNode": mx.arcsin,
    "ArccosNode": mx.arccos,
    "ArctanNode": mx.arctan,
    "SinhNode": mx.sinh,
    "CoshNode": mx.cosh,
    "ArcsinhNode": mx.arcsinh,
    "ArccoshNode": mx.arccosh,
    "ArctanhNode": mx.arctanh,
    "Log2Node": mx.log2,
    "Log10Node": mx.log10,
    "Log1pNode": mx.log1p,
    "ErfNode": mx.erf,
    "Expm1Node": mx.expm1,
    "ReciprocalNode": mx.reciprocal,
    "SqrtNode": mx.sqrt,
    "AbsNode": mx.abs,
    "NegNode": mx.negative,
    "SignNode": mx.sign,
    "TruncNode": mx.trunc,
    "LogicalNotNode": mx.logical_not,
    "BitwiseInvertNode": mx.bitwise_invert,
}

BINARY = {
    "AddNode": mx.add,
    "SubtractNode": mx.subtract,
    "MultiplyNode": mx.multiply,
    "DivideNode": mx.divide,
    "MaximumNode": mx.maximum,
    "MinimumNode": mx.minimum,
    "Atan2Node": mx.arctan2,
    "LogAddExpNode": mx.logaddexp,
    "RemainderNode": mx.remainder,
    "PowerNode": mx.power,
    "LessNode": mx.less,
    "LessEqualNode": mx.less_equal,
    "GreaterNode": mx.greater,
    "GreaterEqualNode": mx.greater_equal,
    "EqualNode": mx.equal,
    "NotEqualNode": mx.not_equal,
    "LogicalAndNode": mx.logical_and,
    "LogicalOrNode": mx.logical_or,
    "BitwiseAndNode": mx.bitwise_and,
    "BitwiseOrNode": mx.bitwise_or,
    "BitwiseXorNode": mx.bitwise_xor,
}


@op(*UNARY)
def build_unary(n, ctx):
    return unary(n, ctx, UNARY[ctx.current_node])


@op(*BINARY)
def build_binary(n, ctx):
    return binary(n, ctx, BINARY[ctx.current_node])


@op("NoopNode")
def build_noop(n, ctx):
    return lambda f: None


@op("IdCopyNode")
def build_id_copy(n, ctx):
    x, o = ctx.t(n.x), ctx.out(n.out)

    def run(f):
        f[o] = f[x]

    return run


@op("RoundNode")
def build_round(n, ctx):
    decimals = n.decimals
    return unary(n, ctx, lambda x: mx.round(x, decimals))


@op("AsTypeNode")
def build_astype(n, ctx):
    dtype = ctx.dtype(n.scalarType)
    return unary(n, ctx, lambda x: x.astype(dtype))


def _gelu_tanh(x):
    # The C++ runtime's formula and operation order, not mlx.nn's.
    inner = 0.7978845608 * (x + 0.044715 * (x * (x * x)))
    return 0.5 * (x * (1.0 + mx.tanh(inner)))


def _gelu_erf(x):
    return 0.5 * (x * (1.0 + mx.erf(0.7071067812 * x)))


@op("GeluNode")
def build_gelu(n, ctx):
    approximate = n.approximate
    if approximate is None:
        raise PteError("GeluNode: approximate is missing")
    if isinstance(approximate, bytes):
        approximate = approximate.decode()
    # Like the C++ runtime, anything but "tanh" is the exact (erf) form.
    return unary(n, ctx, _gelu_tanh if approximate == "tanh" else _gelu_erf)


@op("ClipNode")
def build_clip(n, ctx):
    x, o = ctx.t(n.x), ctx.out(n.out)
    lo, hi = ctx.t_opt(n.aMin), ctx.t_opt(n.aMax)
    if lo is None and hi is None:
        raise PteError("ClipNode: neither a_min nor a_max is set")

    def run(f):
        f[o] = mx.clip(f[x], None if lo is None else f[lo], None if hi is None else f[hi])

    return run


def _floor_divide(a, b):
    if mx.issubdtype(a.dtype, mx.inexact) or mx.issubdtype(b.dtype, mx.inexact):
        return mx.floor_divide(a, b)  # floor(a / b)
    # Integer floor_divide truncates on some MLX backends (Metal). a - a % b
    # (Python-style remainder) is an exact multiple of b, so any integer
    # division of it is the floored quotient.
    return mx.floor_divide(a - mx.remainder(a, b), b)


@op("FloorDivideNode")
def build_floor_divide(n, ctx):
    return binary(n, ctx, _floor_divide)


@op("WhereNode")
def build_where(n, ctx):
    c, x, y, o = ctx.t(n.condition), ctx.t(n.x), ctx.t(n.y), ctx.out(n.out)

    def run(f):
        f[o] = mx.where(f[c], f[x], f[y])

    return run
