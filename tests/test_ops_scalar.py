"""Scalar (value slot) nodes: int arithmetic, SymSize, ItemInt."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from opgraph import OpGraph

from llm_executorch_mlx.runtime.pte._schema import mlx_delegate as md
from llm_executorch_mlx.runtime.errors import PteError

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def t_floordiv(a, b):
    return int(torch.div(torch.tensor(a), b, rounding_mode="floor"))


INT_OPS = [
    (md.AddIntNodeT, lambda a, b: int(torch.tensor(a) + b)),
    (md.SubtractIntNodeT, lambda a, b: int(torch.tensor(a) - b)),
    (md.MultiplyIntNodeT, lambda a, b: int(torch.tensor(a) * b)),
    (md.FloorDivideIntNodeT, t_floordiv),
    (md.ModIntNodeT, lambda a, b: int(torch.remainder(torch.tensor(a), b))),
]


def sized(g, n):
    """A Vid holding ``n``, computed at run time by SymSize of an input."""
    v = g.value()
    g.node(md.SymSizeNodeT, a=g.input(np.zeros((1, n), np.float32)), dim=1, out=v)
    return v


def run_int_op(cls, a, b, dynamic):
    """``cls`` on a, b; each of a, b in ``dynamic`` comes from a SymSize Vid
    (sizes are positive, so a negative operand is a literal)."""
    g = OpGraph()
    operands = [g.iov(sized(g, x) if name in dynamic else x) for name, x in (("a", a), ("b", b))]
    out = g.value()
    g.node(cls, a=operands[0], b=operands[1], out=out)
    g.output(out)
    return g.run()[0]


@pytest.mark.parametrize("cls, fn", INT_OPS, ids=[c.__name__[:-5] for c, _ in INT_OPS])
@pytest.mark.parametrize(
    "a, b, dynamic",
    [(7, 3, ""), (-7, 3, "b"), (7, -3, "a"), (-8, 5, "b"), (9, 4, "ab"), (0, 5, "b")],
)
def test_int_op(cls, fn, a, b, dynamic):
    got = run_int_op(cls, a, b, dynamic)
    assert type(got) is int and got == fn(a, b)


def test_literal_clamped_to_int32():
    # Like ExecuTorch, int64 literals saturate to int32 (INT64_MAX: "to the end").
    got = run_int_op(md.SubtractIntNodeT, 2**63 - 1, 3, "b")
    assert got == INT32_MAX - 3


@pytest.mark.parametrize(
    "cls, a, b, dynamic, message",
    [
        (md.AddIntNodeT, INT32_MAX, 1, "b", "AddIntNode: int32 overflow"),
        (md.SubtractIntNodeT, INT32_MIN, 1, "b", "SubtractIntNode: int32 overflow"),
        (md.MultiplyIntNodeT, 2**20, 2**12, "b", "MultiplyIntNode: int32 overflow"),
        (md.FloorDivideIntNodeT, INT32_MIN, -1, "", "FloorDivideIntNode: int32 overflow"),
        (md.FloorDivideIntNodeT, 5, 0, "a", "FloorDivideIntNode: division by zero"),
        (md.ModIntNodeT, 5, 0, "a", "ModIntNode: division by zero"),
    ],
)
def test_int_op_errors(cls, a, b, dynamic, message):
    with pytest.raises(PteError, match=message):
        run_int_op(cls, a, b, dynamic)


def test_literal_errors_surface_at_load():
    g = OpGraph()
    g.node(md.ModIntNodeT, a=g.iov(5), b=g.iov(0), out=g.value())
    with pytest.raises(PteError, match="ModIntNode: division by zero"):
        g.executor()


@pytest.mark.parametrize("dim", [0, 1, 2, -1, -3])
def test_sym_size(dim):
    x = np.zeros((2, 3, 4), np.float32)
    g = OpGraph()
    out = g.value()
    g.node(md.SymSizeNodeT, a=g.input(x, dynamic_dims=(1,)), dim=dim, out=out)
    g.output(out)
    ex = g.executor()
    for shape in [(2, 3, 4), (2, 7, 4)]:
        (got,) = ex.execute([np.zeros(shape, np.float32)])
        assert got == torch.zeros(shape).size(dim)


def test_sym_size_bad_dim():
    g = OpGraph()
    out = g.value()
    g.node(md.SymSizeNodeT, a=g.input(np.zeros((2, 3), np.float32)), dim=2, out=out)
    g.output(out)
    with pytest.raises(PteError, match="SymSizeNode"):
        g.run()


@pytest.mark.parametrize(
    "x", [np.array([[42]], np.int32), np.array([-5], np.int64), np.array(3.7, np.float32)],
    ids=["int32", "int64", "float32"],
)
def test_item_int(x):
    g = OpGraph()
    out = g.value()
    g.node(md.ItemIntNodeT, x=g.input(x), out=out)
    g.output(out)
    (got,) = g.run()
    assert type(got) is int and got == int(torch.from_numpy(x).item())


def test_item_int_feeds_int_arithmetic():
    g = OpGraph()
    item, out = g.value(), g.value()
    g.node(md.ItemIntNodeT, x=g.input(np.array([10], np.int32)), out=item)
    g.node(md.MultiplyIntNodeT, a=g.iov(item), b=g.iov(-3), out=out)
    g.output(out)
    assert g.run() == [-30]


def bad_tid():
    t = md.TidT()
    t.idx = 99  # never registered with the graph, so it stays out of range
    return t


@pytest.mark.parametrize("cls, field", [(md.SymSizeNodeT, "a"), (md.ItemIntNodeT, "x")])
def test_bad_tensor_slot(cls, field):
    g = OpGraph()
    g.node(cls, out=g.value(), **{field: bad_tid()})
    with pytest.raises(PteError, match=f"{cls.__name__[:-1]}: tensor slot 99 out of range"):
        g.executor()


def test_bad_value_slot():
    bad = md.VidT()
    bad.idx = 7
    g = OpGraph()
    g.node(md.AddIntNodeT, a=g.iov(bad), b=g.iov(1), out=g.value())
    with pytest.raises(PteError, match="AddIntNode: value slot 7 out of range"):
        g.executor()
