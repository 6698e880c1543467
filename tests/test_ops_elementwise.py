"""Elementwise nodes against torch eager."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from opgraph import OpGraph

from llm_executorch_mlx.runtime.pte._schema import mlx_delegate as md
from llm_executorch_mlx.runtime.errors import PteError

RTOL, ATOL = 1e-5, 1e-6


def uniform(lo, hi, shape=(3, 5), seed=0):
    return np.random.default_rng(seed).uniform(lo, hi, shape).astype(np.float32)


def ints(lo, hi, shape=(3, 5), seed=0):
    return np.random.default_rng(seed).integers(lo, hi, shape).astype(np.int32)


def bools(shape=(3, 5), seed=0):
    return np.random.default_rng(seed).random(shape) < 0.5


def close(got, want):
    want = want.numpy()
    assert got.shape == want.shape
    if want.dtype.kind == "f":
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    else:
        np.testing.assert_array_equal(got, want)


def run_node(cls, arrays, names, **fields):
    """Run one node whose tensor inputs ``names`` are ``arrays``; its output."""
    g = OpGraph()
    slots = {name: g.input(a) for name, a in zip(names, arrays)}
    out = g.temp()
    g.node(cls, out=out, **slots, **fields)
    g.output(out)
    return g.run()[0]


UNARY = [
    (md.SiluNodeT, F.silu, uniform(-4, 4)),
    (md.SigmoidNodeT, torch.sigmoid, uniform(-4, 4)),
    (md.TanhNodeT, torch.tanh, uniform(-3, 3)),
    (md.RsqrtNodeT, torch.rsqrt, uniform(0.1, 4)),
    (md.LogNodeT, torch.log, uniform(0.1, 4)),
    (md.FloorNodeT, torch.floor, uniform(-4, 4)),
    (md.CeilNodeT, torch.ceil, uniform(-4, 4)),
    (md.SquareNodeT, torch.square, uniform(-4, 4)),
    (md.ExpNodeT, torch.exp, uniform(-4, 4)),
    (md.SinNodeT, torch.sin, uniform(-3, 3)),
    (md.CosNodeT, torch.cos, uniform(-3, 3)),
    (md.TanNodeT, torch.tan, uniform(-1.2, 1.2)),
    (md.ArcsinNodeT, torch.arcsin, uniform(-0.99, 0.99)),
    (md.ArccosNodeT, torch.arccos, uniform(-0.99, 0.99)),
    (md.ArctanNodeT, torch.arctan, uniform(-4, 4)),
    (md.SinhNodeT, torch.sinh, uniform(-3, 3)),
    (md.CoshNodeT, torch.cosh, uniform(-3, 3)),
    (md.ArcsinhNodeT, torch.arcsinh, uniform(-4, 4)),
    (md.ArccoshNodeT, torch.arccosh, uniform(1.01, 4)),
    (md.ArctanhNodeT, torch.arctanh, uniform(-0.99, 0.99)),
    (md.Log2NodeT, torch.log2, uniform(0.1, 4)),
    (md.Log10NodeT, torch.log10, uniform(0.1, 4)),
    (md.Log1pNodeT, torch.log1p, uniform(-0.9, 4)),
    (md.ErfNodeT, torch.erf, uniform(-3, 3)),
    (md.Expm1NodeT, torch.expm1, uniform(-3, 3)),
    (md.ReciprocalNodeT, torch.reciprocal, uniform(0.2, 4)),
    (md.SqrtNodeT, torch.sqrt, uniform(0, 4)),
    (md.AbsNodeT, torch.abs, uniform(-4, 4)),
    (md.NegNodeT, torch.neg, uniform(-4, 4)),
    (md.SignNodeT, torch.sign, np.array([[-2.5, 0.0, 3.0]], np.float32)),
    (md.TruncNodeT, torch.trunc, uniform(-4, 4)),
    (md.LogicalNotNodeT, torch.logical_not, bools()),
    (md.BitwiseInvertNodeT, torch.bitwise_not, ints(-100, 100)),
    (md.IdCopyNodeT, lambda t: t, uniform(-4, 4)),
]


@pytest.mark.parametrize("cls, fn, x", UNARY, ids=[c.__name__[:-5] for c, *_ in UNARY])
def test_unary(cls, fn, x):
    close(run_node(cls, [x], ["x"]), fn(torch.from_numpy(x)))


@pytest.mark.parametrize("decimals", [0, 2])
def test_round(decimals):
    x = uniform(-40, 40)
    got = run_node(md.RoundNodeT, [x], ["x"], decimals=decimals)
    close(got, torch.round(torch.from_numpy(x), decimals=decimals))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(approximate):
    x = uniform(-5, 5)
    got = run_node(md.GeluNodeT, [x], ["x"], approximate=approximate)
    close(got, F.gelu(torch.from_numpy(x), approximate=approximate))


@pytest.mark.parametrize("bounds", [("aMin", "aMax"), ("aMin",), ("aMax",)])
def test_clip(bounds):
    x, lo, hi = uniform(-4, 4), uniform(-2, -1, (5,)), uniform(1, 2, (5,))
    arrays = {"aMin": lo, "aMax": hi}
    got = run_node(md.ClipNodeT, [x] + [arrays[b] for b in bounds], ["x", *bounds])
    t = {b: torch.from_numpy(arrays[b]) for b in bounds}
    close(got, torch.clamp(torch.from_numpy(x), t.get("aMin"), t.get("aMax")))


@pytest.mark.parametrize(
    "x, scalar_type, torch_dtype",
    [
        (uniform(-40, 40), 3, torch.int32),  # float -> int truncates toward zero
        (ints(-100, 100), 6, torch.float32),
        (uniform(-1, 1), 11, torch.bool),
        (uniform(-4, 4), 5, torch.float16),
    ],
)
def test_astype(x, scalar_type, torch_dtype):
    got = run_node(md.AsTypeNodeT, [x], ["x"], scalarType=scalar_type)
    close(got, torch.from_numpy(x).to(torch_dtype))


a_f, b_f = uniform(-4, 4), uniform(-4, 4, (5,), seed=1)
a_pos, b_small = uniform(0.1, 3), uniform(-2, 2, (5,), seed=1)
a_i, b_i = ints(-20, 20), np.array([-7, -3, 2, 5, 9], np.int32)
a_b, b_b = bools(), bools((5,), seed=1)
a_u, b_u = ints(0, 256), ints(0, 256, (5,), seed=1)

BINARY = [
    (md.AddNodeT, torch.add, a_f, b_f),
    (md.SubtractNodeT, torch.subtract, a_f, b_f),
    (md.MultiplyNodeT, torch.multiply, a_f, b_f),
    (md.DivideNodeT, torch.divide, a_f, b_f),
    (md.MaximumNodeT, torch.maximum, a_f, b_f),
    (md.MinimumNodeT, torch.minimum, a_f, b_f),
    (md.Atan2NodeT, torch.atan2, a_f, b_f),
    (md.LogAddExpNodeT, torch.logaddexp, a_f, b_f),
    (md.FloorDivideNodeT, torch.floor_divide, a_f, b_f),
    (md.FloorDivideNodeT, torch.floor_divide, a_i, b_i),
    (md.RemainderNodeT, torch.remainder, a_f, b_f),
    (md.RemainderNodeT, torch.remainder, a_i, b_i),
    (md.PowerNodeT, torch.pow, a_pos, b_small),
    (md.LessNodeT, torch.lt, a_f, b_f),
    (md.LessEqualNodeT, torch.le, a_i, b_i),
    (md.GreaterNodeT, torch.gt, a_f, b_f),
    (md.GreaterEqualNodeT, torch.ge, a_i, b_i),
    (md.EqualNodeT, torch.eq, a_i, b_i),
    (md.NotEqualNodeT, torch.ne, a_i, b_i),
    (md.LogicalAndNodeT, torch.logical_and, a_b, b_b),
    (md.LogicalOrNodeT, torch.logical_or, a_b, b_b),
    (md.BitwiseAndNodeT, torch.bitwise_and, a_u, b_u),
    (md.BitwiseOrNodeT, torch.bitwise_or, a_u, b_u),
    (md.BitwiseXorNodeT, torch.bitwise_xor, a_i, b_i),
]


@pytest.mark.parametrize(
    "cls, fn, a, b", BINARY, ids=[f"{c.__name__[:-5]}-{a.dtype}" for c, _, a, _ in BINARY]
)
def test_binary(cls, fn, a, b):
    got = run_node(cls, [a, b], ["a", "b"])
    close(got, fn(torch.from_numpy(a), torch.from_numpy(b)))


def test_floor_divide_int_exact():
    a = np.array([7, -7, 7, -7, 6, -6, 0, -1], np.int32)
    b = np.array([2, 2, -2, -2, 3, 4, 5, 3], np.int32)
    got = run_node(md.FloorDivideNodeT, [a, b], ["a", "b"])
    assert got.dtype == np.int32
    close(got, torch.floor_divide(torch.from_numpy(a), torch.from_numpy(b)))


def test_where():
    c, x, y = bools(), uniform(-4, 4), uniform(-4, 4, (5,), seed=1)
    got = run_node(md.WhereNodeT, [c, x, y], ["condition", "x", "y"])
    close(got, torch.where(*(torch.from_numpy(v) for v in (c, x, y))))


def test_noop_chain():
    g = OpGraph()
    x = g.input(uniform(-1, 1))
    y = g.temp()
    g.node(md.NoopNodeT)
    g.node(md.NegNodeT, x=x, out=y)
    g.output(y)
    close(g.run()[0], -torch.from_numpy(uniform(-1, 1)))


# -- bad programs -------------------------------------------------------------


def bad_tid():
    t = md.TidT()
    t.idx = 99  # never registered with the graph, so it stays out of range
    return t


def build(cls, **fields):
    g = OpGraph()
    g.node(cls, **fields)
    return g.executor()


@pytest.mark.parametrize("cls", [c for c, *_ in UNARY], ids=lambda c: c.__name__)
def test_unary_bad_slot(cls):
    g = OpGraph()
    y = g.temp()
    g.node(cls, x=bad_tid(), out=y)
    name = cls.__name__[:-1]
    with pytest.raises(PteError, match=f"{name}: tensor slot 99 out of range"):
        g.executor()


@pytest.mark.parametrize("cls", sorted({c for c, *_ in BINARY}, key=lambda c: c.__name__),
                         ids=lambda c: c.__name__)
def test_binary_bad_slot(cls):
    g = OpGraph()
    a, y = g.input(a_f), g.temp()
    g.node(cls, a=a, b=bad_tid(), out=y)
    with pytest.raises(PteError, match=f"{cls.__name__[:-1]}: tensor slot 99"):
        g.executor()


def test_where_bad_slot():
    g = OpGraph()
    x = g.input(a_f)
    g.node(md.WhereNodeT, condition=bad_tid(), x=x, y=x, out=g.temp())
    with pytest.raises(PteError, match="WhereNode: tensor slot 99"):
        g.executor()


def test_clip_needs_a_bound():
    g = OpGraph()
    g.node(md.ClipNodeT, x=g.input(a_f), out=g.temp())
    with pytest.raises(PteError, match="ClipNode: neither a_min nor a_max"):
        g.executor()


def test_astype_unsupported_dtype():
    g = OpGraph()
    g.node(md.AsTypeNodeT, x=g.input(a_f), out=g.temp(), scalarType=7)  # fp64
    with pytest.raises(PteError, match="AsTypeNode: unsupported dtype fp64"):
        g.executor()


def test_write_to_constant():
    g = OpGraph()
    c = g.constant(a_f)
    g.node(md.NegNodeT, x=g.input(a_f), out=c)
    with pytest.raises(PteError, match="NegNode: writes constant tensor slot"):
        g.executor()
