"""Linear layers reading one input run as one product (runtime/siblings.py).

GPUs join them at load; these tests join on the CPU directly. Each product
must equal numpy's, groups must not span a rewrite of their input, and the
joined weights must replace the originals rather than add to them.
"""

import gc

import mlx.core as mx
import numpy as np

from llm_executorch_mlx.runtime._schema import mlx_delegate as md
from llm_executorch_mlx.runtime.graph import decode_graph, encode_graph
from llm_executorch_mlx.runtime.interpreter import GraphExecutor
from llm_executorch_mlx.runtime.siblings import find_groups, join_weights
from opgraph import OpGraph

K = 8


def linear(g, x, weight):
    wt, y = g.temp(), g.temp()
    g.node(md.TransposeNodeT, x=g.constant(weight), out=wt, perm=[1, 0])
    g.node(md.AddmmNodeT, mat1=x, mat2=wt, out=y, alpha=1.0, beta=1.0)
    return y


def decoded(g):
    graph, constants = g.build()
    return decode_graph(encode_graph(graph)), constants


def test_projections_of_one_input_run_as_one_product_with_the_same_values():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 3, K)).astype(np.float32)
    weights = [rng.standard_normal((n, K)).astype(np.float32) for n in (4, 2, 2)]
    g = OpGraph()
    xs = g.input(x)
    for w in weights:
        g.output(linear(g, xs, w))
    graph, constants = decoded(g)
    joined = join_weights(graph, constants)
    ex = GraphExecutor(graph, constants, joined=joined)
    assert ex.node_names.count("AddmmJoined") == 3
    for out, w in zip(ex.execute([x]), weights):
        np.testing.assert_allclose(np.array(out), x @ w.T, rtol=1e-5, atol=1e-6)


def test_groups_stop_at_a_rewrite_of_their_input_and_at_another_input():
    rng = np.random.default_rng(1)
    x, z = (rng.standard_normal((1, 2, K)).astype(np.float32) for _ in range(2))
    w1, w2, w3 = (rng.standard_normal((3, K)).astype(np.float32) for _ in range(3))
    g = OpGraph()
    xs, zs, t = g.input(x), g.input(z), g.temp()
    g.node(md.NegNodeT, x=xs, out=t)
    a = linear(g, t, w1)
    g.node(md.NegNodeT, x=t, out=t)  # t rewritten: the next product reads new values
    b = linear(g, t, w2)
    c = linear(g, zs, w3)
    for y in (a, b, c):
        g.output(y)
    graph, constants = decoded(g)
    assert find_groups(graph) == []
    outs = GraphExecutor(graph, constants, joined=join_weights(graph, constants)).execute([x, z])
    for out, want in zip(outs, (-x @ w1.T, x @ w2.T, z @ w3.T)):
        np.testing.assert_allclose(np.array(out), want, rtol=1e-5, atol=1e-6)


def test_joined_weights_replace_the_originals_in_memory():
    rng = np.random.default_rng(2)
    g = OpGraph()
    xs = g.input(rng.standard_normal((1, 1, 256)).astype(np.float32))
    for n in (512, 256, 256):
        g.output(linear(g, xs, mx.array(rng.standard_normal((n, 256)).astype(np.float32))))
    graph, constants = decoded(g)
    g = None
    gc.collect()
    mx.eval(constants)
    before = mx.get_active_memory()
    join_weights(graph, constants)
    gc.collect()
    grown = mx.get_active_memory() - before
    weight_bytes = sum(c.nbytes for c in constants)
    assert grown < 0.05 * weight_bytes, f"joining kept {grown} extra bytes of {weight_bytes}"
