"""Linear layers sharing an input, run as one product (grouped_linear.py).

Hand-built programs check which matmuls may be grouped and that a grouped
program computes what the separate products do (numpy reference); the
exported models' parity tests (test_parity.py) assert q/k/v and gate/up are
grouped in every layer and still match transformers.
"""

import numpy as np

from llm_executorch_mlx.runtime._schema import mlx_delegate as md
from llm_executorch_mlx.runtime.graph import decode_graph, encode_graph
from llm_executorch_mlx.runtime.grouped_linear import concatenate, find_groups
from llm_executorch_mlx.runtime.interpreter import GraphExecutor
from opgraph import OpGraph

RNG = np.random.default_rng(0)
X = RNG.standard_normal((1, 3, 8)).astype(np.float32)


def weight(rows, cols=8):
    return RNG.standard_normal((rows, cols)).astype(np.float32)


def linear(g, x, w, bias=None):
    wt, y = g.temp(), g.temp()
    g.node(md.TransposeNodeT, x=g.constant(w), out=wt, perm=[1, 0])
    g.node(md.AddmmNodeT, mat1=x, mat2=wt, out=y, bias=bias, alpha=1.0, beta=1.0)
    return y


def grouped_run(g, inputs):
    """Run ``g`` the way Program does: groups found, their weights joined."""
    graph, constants = g.build()
    graph = decode_graph(encode_graph(graph))
    groups = find_groups(graph)
    constants = list(constants)
    for group in groups:
        joined = concatenate([constants[w] for w in group.weights])
        for w in group.weights:
            constants[w] = None
        constants[group.weights[0]] = joined
    ex = GraphExecutor(graph, constants, linear_groups=groups)
    return groups, ex, [np.array(o) for o in ex.execute(inputs)]


def test_projections_of_one_input_run_as_one_product_with_the_same_results():
    g = OpGraph()
    x = g.input(X)
    ws = [weight(8), weight(4), weight(4)]
    ys = [linear(g, x, w) for w in ws]
    h = g.temp()
    g.node(md.AddNodeT, a=ys[0], b=ys[0], out=h)  # other work between the members
    other = linear(g, h, weight(5))  # a different input: not in the group
    for y in ys + [other]:
        g.output(y)
    groups, ex, outs = grouped_run(g, [X])
    assert [len(gr.members) for gr in groups] == [3]
    assert ex.node_names.count("LinearGroup") == 1 and ex.node_names.count("LinearColumns") == 2
    for w, y in zip(ws, outs):
        np.testing.assert_allclose(y, X @ w.T, rtol=1e-5, atol=1e-5)


def test_input_rewritten_between_matmuls_splits_the_group():
    g = OpGraph()
    x = g.input(X)
    a, b = weight(8), weight(8)
    ya = linear(g, x, a)
    g.node(md.AddNodeT, a=x, b=x, out=x)  # x changes before the second product
    yb = linear(g, x, b)
    g.output(ya)
    g.output(yb)
    groups, _, (got_a, got_b) = grouped_run(g, [X])
    assert groups == []
    np.testing.assert_allclose(got_a, X @ a.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_b, (2 * X) @ b.T, rtol=1e-5, atol=1e-5)


def test_weights_read_elsewhere_or_with_bias_are_not_grouped():
    g = OpGraph()
    x = g.input(X)
    w = g.constant(weight(8))
    wt, y1 = g.temp(), g.temp()
    g.node(md.TransposeNodeT, x=w, out=wt, perm=[1, 0])
    g.node(md.AddmmNodeT, mat1=x, mat2=wt, out=y1, alpha=1.0, beta=1.0)
    y2 = linear(g, x, weight(8), bias=g.constant(np.ones(8, np.float32)))
    y3 = linear(g, x, weight(8))
    z = g.temp()
    g.node(md.AddNodeT, a=w, b=w, out=z)  # the first weight is also read as itself
    for y in (y1, y2, y3, z):
        g.output(y)
    graph, _ = g.build()
    # only y3 qualifies, and a group needs two
    assert find_groups(decode_graph(encode_graph(graph))) == []
