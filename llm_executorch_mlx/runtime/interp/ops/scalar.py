"""Nodes computing scalar values (``Vid`` slots): int arithmetic, sizes, item."""

from __future__ import annotations

from ...errors import PteError
from ..int32 import INT32_MAX, INT32_MIN
from .table import op


def _checked(name: str, result: int) -> int:
    if not INT32_MIN <= result <= INT32_MAX:
        raise PteError(f"{name}: int32 overflow ({result})")
    return result


def _floor_divide(a: int, b: int) -> int:
    if b == 0:
        raise PteError("FloorDivideIntNode: division by zero")
    return _checked("FloorDivideIntNode", a // b)  # INT32_MIN // -1 overflows


def _mod(a: int, b: int) -> int:
    if b == 0:
        raise PteError("ModIntNode: division by zero")
    return a % b  # Python's % takes the divisor's sign, as the C++ runtime does


INT_OPS = {
    "AddIntNode": lambda a, b: _checked("AddIntNode", a + b),
    "SubtractIntNode": lambda a, b: _checked("SubtractIntNode", a - b),
    "MultiplyIntNode": lambda a, b: _checked("MultiplyIntNode", a * b),
    "FloorDivideIntNode": _floor_divide,
    "ModIntNode": _mod,
}


@op(*INT_OPS)
def build_int_op(n, ctx):
    fn = INT_OPS[ctx.current_node]
    a, b, o = ctx.int_(n.a), ctx.int_(n.b), ctx.v(n.out)
    if not (n.a.isVid or n.b.isVid):
        const = fn(ctx.static_int(n.a), ctx.static_int(n.b))  # errors surface at load

        def run_const(f):
            f[o] = const

        return run_const

    def run(f):
        f[o] = fn(f[a], f[b])

    return run


@op("SymSizeNode")
def build_sym_size(n, ctx):
    a, o, dim = ctx.t(n.a), ctx.v(n.out), n.dim

    def run(f):
        f[o] = f[a].shape[dim]  # negative dims count from the end; IndexError names the node

    return run


@op("ItemIntNode")
def build_item_int(n, ctx):
    x, o = ctx.t(n.x), ctx.v(n.out)

    def run(f):
        f[o] = int(f[x].item())  # a sync: the value feeds later shapes

    return run
