"""Reductions, scans and softmax against torch eager."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from opgraph import OpGraph

from llm_executorch_mlx.runtime.pte._schema import mlx_delegate as md
from llm_executorch_mlx.runtime.errors import PteError

# Odd sizes everywhere, so every median is a middle element in MLX and torch.
X = np.random.default_rng(0).uniform(-2, 2, (3, 5, 7)).astype(np.float32)
BOOLS = np.random.default_rng(1).random((3, 5, 7)) < 0.3


def run_node(cls, x, **fields):
    g = OpGraph()
    out = g.temp()
    g.node(cls, x=g.input(x), out=out, **fields)
    g.output(out)
    return g.run()[0]


def close(got, want):
    want = want.numpy()
    assert got.shape == want.shape
    if want.dtype.kind == "f":
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_array_equal(got, want)


def torch_reduce(fn, x, axes, keepdims):
    """``fn`` reduces the last dim; apply it over ``axes`` (empty: all) of x."""
    nd = x.ndim
    axes = sorted(a % nd for a in axes) if axes else list(range(nd))
    kept = [d for d in range(nd) if d not in axes]
    y = fn(x.permute(kept + axes).reshape([x.shape[d] for d in kept] + [-1]))
    if keepdims:
        y = y.reshape([1 if d in axes else x.shape[d] for d in range(nd)])
    return y


REDUCTIONS = [
    (md.SumNodeT, lambda t: t.sum(-1), X, {}),
    (md.MeanNodeT, lambda t: t.mean(-1), X, {}),
    (md.ProdNodeT, lambda t: t.prod(-1), X / 2 + 1, {}),  # near 1: no overflow
    (md.MaxNodeT, lambda t: t.amax(-1), X, {}),
    (md.MinNodeT, lambda t: t.amin(-1), X, {}),
    (md.MedianNodeT, lambda t: t.median(-1).values, X, {}),
    (md.AnyNodeT, lambda t: t.any(-1), BOOLS, {}),
    (md.AllNodeT, lambda t: t.all(-1), ~BOOLS, {}),
    (md.VarNodeT, lambda t: t.var(-1, correction=0), X, {"ddof": 0}),
    (md.VarNodeT, lambda t: t.var(-1, correction=1), X, {"ddof": 1}),
    (md.StdNodeT, lambda t: t.std(-1, correction=0), X, {"ddof": 0}),
    (md.StdNodeT, lambda t: t.std(-1, correction=1), X, {"ddof": 1}),
]


@pytest.mark.parametrize("axes", [[], [1], [0, 2], [-1]], ids=str)
@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize(
    "cls, fn, x, fields", REDUCTIONS,
    ids=[f"{c.__name__[:-5]}{f.get('ddof', '')}" for c, _, _, f in REDUCTIONS],
)
def test_reduction(cls, fn, x, fields, axes, keepdims):
    got = run_node(cls, x, axes=axes, keepdims=keepdims, **fields)
    close(got, torch_reduce(fn, torch.from_numpy(x), axes, keepdims))


@pytest.mark.parametrize("axes", [[1], [0, 2]], ids=str)
@pytest.mark.parametrize("keepdims", [False, True])
def test_logsumexp(axes, keepdims):
    got = run_node(md.LogSumExpNodeT, X, axes=axes, keepdims=keepdims)
    close(got, torch.logsumexp(torch.from_numpy(X), axes, keepdim=keepdims))


def test_logsumexp_empty_axes_reduces_nothing():
    # The C++ runtime hands an empty axes list to MLX as is.
    close(run_node(md.LogSumExpNodeT, X, axes=[]), torch.from_numpy(X))


@pytest.mark.parametrize("axis", [0, 2, -2])
@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("cls, fn", [(md.ArgmaxNodeT, torch.argmax), (md.ArgminNodeT, torch.argmin)])
def test_arg_reduction(cls, fn, axis, keepdims):
    got = run_node(cls, X, axis=axis, keepdims=keepdims)
    np.testing.assert_array_equal(got, fn(torch.from_numpy(X), axis, keepdim=keepdims).numpy())


@pytest.mark.parametrize("axis", [1, -1])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("inclusive", [True, False])
def test_cumsum(axis, reverse, inclusive):
    got = run_node(md.CumsumNodeT, X, axis=axis, reverse=reverse, inclusive=inclusive)
    t = torch.from_numpy(X)
    if reverse:
        t = t.flip(axis)
    want = t.cumsum(axis)
    if not inclusive:
        want = want - t
    close(got, want.flip(axis) if reverse else want)


@pytest.mark.parametrize("axis", [0, -1])
@pytest.mark.parametrize("precise", [False, True])
def test_softmax(axis, precise):
    got = run_node(md.SoftmaxNodeT, X, axis=axis, precise=precise)
    close(got, torch.softmax(torch.from_numpy(X), axis))


def bad_tid():
    t = md.TidT()
    t.idx = 99  # never registered with the graph, so it stays out of range
    return t


@pytest.mark.parametrize(
    "cls",
    sorted({c for c, *_ in REDUCTIONS}, key=lambda c: c.__name__)
    + [md.LogSumExpNodeT, md.ArgmaxNodeT, md.ArgminNodeT, md.CumsumNodeT, md.SoftmaxNodeT],
    ids=lambda c: c.__name__,
)
def test_bad_slot(cls):
    g = OpGraph()
    g.node(cls, x=g.input(X), out=bad_tid())
    with pytest.raises(PteError, match=f"{cls.__name__[:-1]}: tensor slot 99 out of range"):
        g.executor()


def test_bad_axis_fails_naming_the_node():
    g = OpGraph()
    out = g.temp()
    g.node(md.SumNodeT, x=g.input(X), out=out, axes=[5])
    g.output(out)
    with pytest.raises(PteError, match="SumNode"):
        g.run()
