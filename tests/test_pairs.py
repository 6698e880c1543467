"""Two adjacent nodes run as one (runtime/pairs.py): head split and merge
views, and a product added to the residual stream.

Each program is checked against numpy, fused or not; fusion must not change
a value, and must not happen when a later node (or the caller) still reads
the first node's output.
"""

import numpy as np
import pytest

from llm_executorch_mlx.runtime._schema import mlx_delegate as md
from opgraph import OpGraph

H, D = 3, 4


def head_split(x, shape, perm, also_return_reshape=False):
    g = OpGraph()
    xs, r, y = g.input(x), g.temp(), g.temp()
    g.node(md.ReshapeNodeT, x=xs, out=r, shape=[g.iov(s) for s in shape])
    g.node(md.TransposeNodeT, x=r, out=y, perm=perm)
    g.output(y)
    if also_return_reshape:
        g.output(r)
    return g.executor()


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("shape", [(1, "T", H, D), (1, -1, H, D)])
def test_head_split_is_one_node_with_the_exported_values(T, shape):
    x = np.random.default_rng(0).standard_normal((1, T, H * D)).astype(np.float32)
    shape = [T if s == "T" else s for s in shape]
    ex = head_split(x, shape, [0, 2, 1, 3])
    assert ex.node_names == ["ReshapeTransposeFused"]
    (y,) = ex.execute([x])
    np.testing.assert_array_equal(np.array(y), x.reshape(1, T, H, D).transpose(0, 2, 1, 3))


def test_head_split_whose_reshape_is_returned_stays_two_nodes():
    x = np.arange(2 * H * D, dtype=np.float32).reshape(1, 2, H * D)
    ex = head_split(x, [1, 2, H, D], [0, 2, 1, 3], also_return_reshape=True)
    assert ex.node_names == ["ReshapeNode", "TransposeNode"]
    y, r = (np.array(o) for o in ex.execute([x]))
    np.testing.assert_array_equal(r, x.reshape(1, 2, H, D))
    np.testing.assert_array_equal(y, x.reshape(1, 2, H, D).transpose(0, 2, 1, 3))


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("perm", [[0, 2, 1, 3], [0, -2, 1, -1]])
def test_head_merge_is_one_node_with_the_exported_values(T, perm):
    x = np.random.default_rng(1).standard_normal((1, H, T, D)).astype(np.float32)
    g = OpGraph()
    xs, t, y = g.input(x), g.temp(), g.temp()
    g.node(md.TransposeNodeT, x=xs, out=t, perm=perm)
    g.node(md.ReshapeNodeT, x=t, out=y, shape=[g.iov(1), g.iov(T), g.iov(-1)])
    g.output(y)
    ex = g.executor()
    assert ex.node_names == ["TransposeReshapeFused"]
    (out,) = ex.execute([x])
    np.testing.assert_array_equal(np.array(out), x.transpose(0, 2, 1, 3).reshape(1, T, H * D))


def residual_program(x, w, residual, product_first=False, bias=None):
    g = OpGraph()
    xs, ws, rs = g.input(x), g.input(w), g.input(residual)
    mm, y = g.temp(), g.temp()
    fields = dict(mat1=xs, mat2=ws, out=mm, alpha=1.0, beta=1.0)
    if bias is not None:
        fields["bias"] = g.input(bias)
    g.node(md.AddmmNodeT, **fields)
    a, b = (mm, rs) if product_first else (rs, mm)
    g.node(md.AddNodeT, a=a, b=b, out=y)
    g.output(y)
    return g.executor()


@pytest.mark.parametrize("rows", [(1, 1), (1, 5), (3,)])
@pytest.mark.parametrize("product_first", [False, True])
def test_product_added_to_the_residual_is_one_addmm(rows, product_first):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((*rows, 16)).astype(np.float32)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    residual = rng.standard_normal((*rows, 8)).astype(np.float32)
    ex = residual_program(x, w, residual, product_first)
    assert ex.node_names == ["AddmmResidualFused"]
    (y,) = ex.execute([x, w, residual])
    want = x.astype(np.float64) @ w + residual
    np.testing.assert_allclose(np.array(y), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("residual_shape", [(8,), (2, 1, 8)])
def test_residual_that_broadcasts_gets_the_broadcast_sum(residual_shape):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 4, 16)).astype(np.float32)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    residual = rng.standard_normal(residual_shape).astype(np.float32)
    (y,) = residual_program(x, w, residual).execute([x, w, residual])
    want = x.astype(np.float64) @ w + residual
    assert y.shape == want.shape
    np.testing.assert_allclose(np.array(y), want, rtol=1e-5, atol=1e-5)


def test_product_with_a_bias_keeps_its_own_add():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 2, 16)).astype(np.float32)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    residual, bias = (rng.standard_normal(s).astype(np.float32) for s in ((1, 2, 8), (8,)))
    ex = residual_program(x, w, residual, bias=bias)
    assert ex.node_names == ["AddmmNode", "AddNode"]
    (y,) = ex.execute([x, w, residual, bias])
    np.testing.assert_allclose(np.array(y), x @ w + bias + residual, rtol=1e-5, atol=1e-5)
