"""Two adjacent view nodes run as one (runtime/pairs.py): splitting heads
(reshape, transpose) and merging them (transpose, reshape).

Each program is checked against numpy, fused or not; fusion must not change
a value, and must not happen when a later node (or the caller) still reads
the first node's output.
"""

import numpy as np
import pytest

from llm_executorch_mlx.runtime.pte._schema import mlx_delegate as md
from opgraph import OpGraph

H, D = 3, 4


def head_split(x, shape, perm, also_return_reshape=False, read_reshape_later=False):
    g = OpGraph()
    xs, r, y = g.input(x), g.temp(), g.temp()
    g.node(md.ReshapeNodeT, x=xs, out=r, shape=[g.iov(s) for s in shape])
    g.node(md.TransposeNodeT, x=r, out=y, perm=perm)
    g.output(y)
    if also_return_reshape:
        g.output(r)
    if read_reshape_later:
        neg = g.temp()
        g.node(md.NegNodeT, x=r, out=neg)
        g.output(neg)
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


def test_head_split_whose_reshape_a_later_node_reads_stays_two_nodes():
    x = np.arange(H * D, dtype=np.float32).reshape(1, 1, H * D)
    ex = head_split(x, [1, 1, H, D], [0, 2, 1, 3], read_reshape_later=True)
    assert ex.node_names[:2] == ["ReshapeNode", "TransposeNode"]
    y, neg = (np.array(o) for o in ex.execute([x]))
    np.testing.assert_array_equal(y, x.reshape(1, 1, H, D).transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(neg, -x.reshape(1, 1, H, D))


@pytest.mark.parametrize("T", [1, 3])
def test_head_split_with_the_length_a_runtime_value(T):
    """Exports carry the sequence length as a value (``sym_size``), not a literal."""
    x = np.random.default_rng(5).standard_normal((1, T, H * D)).astype(np.float32)
    g = OpGraph()
    xs, r, y = g.input(x, dynamic_dims=(1,)), g.temp(), g.temp()
    length = g.value()
    g.node(md.SymSizeNodeT, a=xs, dim=1, out=length)
    g.node(md.ReshapeNodeT, x=xs, out=r, shape=[g.iov(1), g.iov(length), g.iov(H), g.iov(D)])
    g.node(md.TransposeNodeT, x=r, out=y, perm=[0, 2, 1, 3])
    g.output(y)
    ex = g.executor()
    assert "ReshapeTransposeFused" in ex.node_names
    (out,) = ex.execute([x])
    np.testing.assert_array_equal(np.array(out), x.reshape(1, T, H, D).transpose(0, 2, 1, 3))


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
